"""Training under `accelerate launch` with two processes on this CPU (DDP over gloo, the committed
`accelerate_configs/cpu-ddp.yaml`): each process holds half of one global micro-batch, so two
processes at batch size B train what one process at batch size 2B trains.

- I-DLM (through the README's command, `accelerate launch ... -m selfspec.cli train idlm`), Jacobi
  Forcing and OPD: the two-process loss curve equals the one-process curve of the same global
  batch to floating-point tolerance, and differs from a one-process run of half the batch by far
  more (the tolerance has teeth).
- A checkpoint resumes across a change of process count (one process stops, two finish, and the
  other way round) to the uninterrupted run's curve and weights; rank 0 alone exports.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selfspec.serving import free_port

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "accelerate_configs" / "cpu-ddp.yaml"
WORKER = Path(__file__).resolve().parent / "ddp_train.py"
STEPS = 20
#: relative agreement of two runs of the same global batch (summation order differs)
TOL = 1e-4


def launch(args: list[str], processes: int, log: Path) -> None:
    """`accelerate launch --config_file cpu-ddp.yaml --num_processes N ARGS`; raises with the log."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
           "--num_processes", str(processes), "--main_process_port", str(free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent)}
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=900, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"accelerate launch failed ({proc.returncode}):\n{log.read_text()[-5000:]}")


def launch_objective(objective: str, cfg, processes: int, tmp: Path) -> None:
    spec = tmp / f"spec-{processes}.json"
    spec.write_text(json.dumps({"objective": objective, "config": dataclasses.asdict(cfg)}))
    launch([str(WORKER), str(spec)], processes, tmp / f"launch-{processes}.log")


def final_state(checkpoint_dir: Path) -> dict:
    from selfspec.training.checkpoint import find_checkpoint, read_state

    return read_state(find_checkpoint(checkpoint_dir))


def curve(state: dict, key: str) -> list[float]:
    return [row[key] for row in state["curve"]]


def assert_same_curve(a: list[float], b: list[float], tol: float = TOL) -> float:
    assert len(a) == len(b) and len(a) > 0
    worst = max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(a, b))
    assert worst < tol, f"curves differ by {worst:.2e} (relative):\n{a}\n{b}"
    return worst


def assert_different_curve(a: list[float], b: list[float], by: float = 100 * TOL) -> None:
    worst = max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(a, b))
    assert worst > by, f"a run of half the batch gives the same curve ({worst:.2e}): the comparison has no teeth"


def run_in_process(objective: str, cfg) -> dict:
    from selfspec.training.loop import train
    from selfspec.training.objective import objective_class

    return train(objective_class(objective)(cfg))


# ------------------------------------------------------------------------------ I-DLM
@pytest.fixture(scope="module")
def idlm_single(micro_config, tmp_path_factory):
    """One process, batch 4, the whole run: the reference curve and weights."""
    out = tmp_path_factory.mktemp("idlm-one")
    cfg = micro_config(out, batch_size=4, threads=1, eval_every=10)
    result = run_in_process("idlm", cfg)
    return cfg, result


def test_idlm_two_processes_train_what_one_process_with_the_whole_batch_trains(micro_config, idlm_single, tmp_path):
    single_cfg, single = idlm_single
    cfg = micro_config(tmp_path / "two", batch_size=2, threads=1, eval_every=10)
    from selfspec.training.config import to_args

    launch(["-m", "selfspec.cli", "train", "idlm", *to_args(cfg)], 2, tmp_path / "launch.log")
    two = final_state(Path(cfg.checkpoint_dir))
    for key in ("mask_ce", "clean_ce"):
        assert_same_curve(curve(single["state"], key), curve(two, key))
    assert len(two["curve"]) == STEPS
    # the evaluations (rank 0's) see the same model
    assert [h["heldout"]["ar_loss"] for h in two["history"]] == pytest.approx(
        [h["heldout"]["ar_loss"] for h in single["state"]["history"]], rel=TOL)
    # rank 0 alone exported: one export, and its weights are the one-process run's
    from safetensors.torch import load_file

    a = load_file(str(Path(single_cfg.out) / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "model.safetensors"))
    assert a.keys() == b.keys()
    worst = max(float((b[k].float() - a[k].float()).abs().max()) for k in a)
    assert worst < 1e-3, worst
    assert (tmp_path / "launch.log").read_text().count("exported ") == 1


def test_half_the_batch_is_a_different_curve(micro_config, idlm_single, tmp_path):
    """Teeth: one process at batch 2 (what each of the two processes holds) is not the same run."""
    _, single = idlm_single
    half = run_in_process("idlm", micro_config(tmp_path / "half", batch_size=2, threads=1, steps=6, eval_every=0,
                                               export=False))
    assert_different_curve(curve(single["state"], "mask_ce")[:6], curve(half["state"], "mask_ce"))


@pytest.mark.parametrize("first,then", [(1, 2), (2, 1)])
def test_idlm_resumes_across_a_change_of_process_count(micro_config, idlm_single, tmp_path, first, then):
    _, single = idlm_single
    batch = {1: 4, 2: 2}
    out = tmp_path / "run"
    start = micro_config(out, batch_size=batch[first], threads=1, eval_every=10, stop_after_steps=10, export=False)
    if first == 1:
        run_in_process("idlm", start)
    else:
        launch_objective("idlm", start, 2, tmp_path)
    assert final_state(Path(start.checkpoint_dir))["step"] == 10
    finish = dataclasses.replace(start, batch_size=batch[then], stop_after_steps=None, resume="auto", export=True)
    if then == 1:
        run_in_process("idlm", finish)
    else:
        launch_objective("idlm", finish, 2, tmp_path)
    state = final_state(Path(start.checkpoint_dir))
    assert state["step"] == STEPS
    assert_same_curve(curve(single["state"], "mask_ce"), curve(state, "mask_ce"))
    assert (out / "model.safetensors").exists() and (out / "provenance.json").exists()


# ------------------------------------------------------------------------------ Jacobi Forcing and OPD
from test_jacobi_forcing import _jf_config, trajectories  # noqa: E402,F401  (the module's fixture)
from test_opd import _cfg as _opd_cfg, micro_pair  # noqa: E402,F401  (the module's fixture)


def test_jacobi_forcing_two_processes_equal_one(micro_dir, trajectories, tmp_path):  # noqa: F811
    kw = dict(steps=6, eval_every=0, export=False, schedule="random")
    one = run_in_process("jacobi-forcing", _jf_config(micro_dir, trajectories, tmp_path / "one", batch_size=4, **kw))
    two_cfg = _jf_config(micro_dir, trajectories, tmp_path / "two", batch_size=2, **kw)
    launch_objective("jacobi-forcing", two_cfg, 2, tmp_path)
    two = final_state(Path(two_cfg.checkpoint_dir))
    for key in ("consistency", "ar_ce"):
        assert_same_curve(curve(one["state"], key), curve(two, key))
    half = run_in_process("jacobi-forcing", _jf_config(micro_dir, trajectories, tmp_path / "half", batch_size=2, **kw))
    assert_different_curve(curve(one["state"], "ar_ce"), curve(half["state"], "ar_ce"))


def test_opd_two_processes_equal_one(micro_pair, tmp_path):  # noqa: F811
    kw = dict(steps=4, on_policy=1.0, export=False)
    one = run_in_process("opd", _opd_cfg(micro_pair, tmp_path / "one", batch_size=4, **kw))
    two_cfg = _opd_cfg(micro_pair, tmp_path / "two", batch_size=2, **kw)
    launch_objective("opd", two_cfg, 2, tmp_path)
    two = final_state(Path(two_cfg.checkpoint_dir))
    assert_same_curve(curve(one["state"], "loss"), curve(two, "loss"))
    half = run_in_process("opd", _opd_cfg(micro_pair, tmp_path / "half", batch_size=2, **kw))
    assert_different_curve(curve(one["state"], "loss"), curve(half["state"], "loss"))


def test_jacobi_forcing_rounds_collect_on_rank_0_only(monkeypatch, tmp_path):
    """With several processes, a round's trajectories are collected once (rank 0); the others
    wait for the complete manifest instead of writing the same shards."""
    from selfspec.training.jacobi_forcing import objective as jacobi_forcing
    from selfspec.training.jacobi_forcing import trajectories

    checks = iter([False, False, False, True])
    monkeypatch.setattr(trajectories, "is_complete", lambda path: next(checks))
    monkeypatch.setattr(trajectories, "collect", lambda cfg: pytest.fail("rank 1 collected"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    jacobi_forcing.collect_round(object(), tmp_path / "traj", poll_s=0.01)
    assert next(checks, "drained") == "drained"  # it polled until rank 0's manifest was complete
