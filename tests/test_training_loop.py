"""The training loop's seams: config fields written once (command-line options generated from
the dataclasses), one schedule / time-budget rule for every objective, the objective protocol,
export and I-DLM kept apart. CPU only, fast."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
from pathlib import Path

import pytest
import torch

from selfspec.training.objective import OBJECTIVES

TRAINING = Path(__file__).resolve().parents[1] / "selfspec" / "training"

# The `selfspec train idlm` flags of docs/training.md and of the recipes before the loop was shared.
IDLM_FLAGS_BEFORE = {
    "--base", "--out", "--stride", "--curriculum", "--stage-fractions", "--lora-rank", "--lora-alpha",
    "--lora-targets", "--data", "--data-weights", "--seq-len", "--batch-size", "--grad-accum", "--steps",
    "--time-budget-minutes", "--lr", "--min-lr-ratio", "--warmup-ratio", "--weight-decay", "--grad-clip",
    "--ce-scale", "--auto-balance-from", "--mask-distill-weight", "--ar-anchor-weight", "--eval-every",
    "--eval-tokens", "--save-every", "--checkpoint-dir", "--resume", "--seed", "--threads", "--mixed-precision",
    "--attn-implementation", "--name", "--base-ref", "--no-export",
}


def _idlm_parser() -> argparse.ArgumentParser:
    from selfspec.training.idlm import objective as idlm

    parser = argparse.ArgumentParser()
    idlm.add_arguments(parser)
    return parser


def test_idlm_options_are_the_config_fields_with_their_defaults():
    from selfspec.training.config import from_args
    from selfspec.training.idlm.objective import IDLMConfig

    parser = _idlm_parser()
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    fields = {f.name: f for f in dataclasses.fields(IDLMConfig)}
    assert set(actions) == set(fields)
    assert IDLM_FLAGS_BEFORE <= {s for a in actions.values() for s in a.option_strings}
    for name, f in fields.items():
        a = actions[name]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            assert a.required, name
        elif f.default_factory is not dataclasses.MISSING:
            assert a.default is None, name  # filled by the factory in from_args
        else:
            assert a.default == f.default, name
        assert a.help, f"--{name} has no help text"
    args = parser.parse_args(["--base", "b", "--out", "o"])
    assert from_args(IDLMConfig, args) == IDLMConfig(base="b", out="o")


def test_idlm_options_parse_lists_and_flags_as_before():
    from selfspec.training.config import from_args
    from selfspec.training.idlm.objective import IDLMConfig

    parser = _idlm_parser()
    args = parser.parse_args(["--base", "b", "--out", "o", "--stride", "3", "--curriculum", "2,3", "--lora-rank", "4",
                              "--lora-targets", "q_proj,v_proj", "--data", "x", "y", "--data-weights", "1,3",
                              "--resume", "--no-export", "--no-progress-bar", "--time-budget-minutes", "2.5",
                              "--mixed-precision", "bf16", "--threads", "2", "--stop-after-steps", "7"])
    cfg = from_args(IDLMConfig, args)
    assert cfg == IDLMConfig(base="b", out="o", stride=3, curriculum=[2, 3], lora_rank=4, lora_targets=["q_proj", "v_proj"],
                             data=["x", "y"], data_weights=[1.0, 3.0], resume="auto", export=False, progress_bar=False,
                             time_budget_minutes=2.5, mixed_precision="bf16", threads=2, stop_after_steps=7)
    assert cfg.lora_alpha == 8.0 and cfg.stage_fractions == [0.5, 0.5]
    assert parser.parse_args(["--base", "b", "--out", "o", "--resume", "ckpt/step-0000004"]).resume == "ckpt/step-0000004"
    for bad in (["--curriculum", "2,x"], ["--data-weights", ","], ["--mixed-precision", "fp8"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--base", "b", "--out", "o", *bad])


def test_recipe_and_tiny_base_options_come_from_their_configs():
    from selfspec.training import recipes, tiny_base
    from selfspec.training.config import from_args, given_options
    from selfspec.training.idlm.objective import IDLMConfig

    p = argparse.ArgumentParser()
    recipes.add_arguments(p)
    args = p.parse_args(["--steps", "5", "--resume"])
    assert given_options(IDLMConfig, args) == {"steps": 5, "resume": "auto"}
    args = p.parse_args(["--mask-distill-weight", "1", "--mask-distill-temperatures", "1.0,0.7"])
    assert given_options(IDLMConfig, args) == {"mask_distill_weight": 1.0, "mask_distill_temperatures": [1.0, 0.7]}
    p = argparse.ArgumentParser()
    tiny_base.add_arguments(p)
    cfg = from_args(tiny_base.TinyBaseConfig, p.parse_args(["--steps", "7"]))
    assert cfg == tiny_base.TinyBaseConfig(steps=7)
    assert (cfg.time_budget_minutes, cfg.seed, cfg.lr) == (45.0, 0, 3e-3)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_objectives_implement_the_protocol(name):
    from selfspec.training.config import LoopConfig
    from selfspec.training.objective import Objective, objective_class

    cls = objective_class(name)
    assert cls.name == name and issubclass(cls.config_class, LoopConfig)
    assert issubclass(cls, Objective) and not inspect.isabstract(cls)
    for method in ("build_model", "setup_training", "batch", "forward", "loss", "evaluate", "provenance"):
        assert getattr(cls, method) is not getattr(Objective, method), f"{cls.__name__} lacks {method}"


# ------------------------------------------------------------------------------ imports
# (no import cycle among the training modules: tests/test_layers.py)
def _training_imports() -> dict[str, set[str]]:
    """module (dotted, below selfspec.training: `loop`, `idlm.objective`) -> the training modules
    it imports (anywhere in the file, lazily too)."""
    files = {".".join(p.relative_to(TRAINING).with_suffix("").parts): p for p in TRAINING.rglob("*.py")
             if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {m.removeprefix("selfspec.training.") for m in mods} & set(files)
        graph[name] = deps - {name}
    return graph


def test_export_and_idlm_do_not_import_each_other():
    graph = _training_imports()
    idlm = "idlm.objective"
    assert {"loop", "objective", "config", "checkpoint", "export", idlm, "tiny_base"} <= set(graph)
    assert idlm not in graph["export"] and "export" not in graph[idlm]
    assert idlm not in graph["loop"] and "tiny_base" not in graph["loop"]  # the loop knows no objective
    assert not any(m.startswith(("idlm.", "jacobi_forcing.")) for m in graph["loop"] | graph["export"])


# ------------------------------------------------------------------------------ tiny-base on the loop
def test_tiny_base_has_no_schedule_of_its_own():
    from selfspec.training import tiny_base

    assert not hasattr(tiny_base, "_lr_at") and not hasattr(tiny_base, "_progress")
    assert tiny_base.train is __import__("selfspec.training.loop", fromlist=["train"]).train


def test_tiny_base_pretraining_runs_on_the_loop(tmp_path, monkeypatch):
    from selfspec.training import tiny_base
    from selfspec.corpus import CorpusSplit, load_stdlib_split
    from selfspec.training.loop import lr_at

    full = load_stdlib_split()
    small = CorpusSplit(root=full.root, train=full.train[:8], heldout=full.heldout[:2])
    monkeypatch.setattr(tiny_base, "load_stdlib_split", lambda: small)
    cfg = tiny_base.TinyBaseConfig(out=str(tmp_path / "tb"), checkpoint_dir=str(tmp_path / "ckpt"), steps=4,
                                   time_budget_minutes=None, vocab_size=300, hidden_size=32, num_layers=1,
                                   num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64, seq_len=32,
                                   batch_size=2, eval_every=2, eval_tokens=256, progress_bar=False, warmup_ratio=0.25)
    res = tiny_base.train_tiny_base(cfg)
    hist = res["state"]["history"]
    assert [h["step"] for h in hist] == [2, 4]
    assert [h["lr"] for h in hist] == [lr_at(cfg, 1, 4), lr_at(cfg, 3, 4)]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in hist) and hist[-1]["heldout"]["heldout_loss"] > 0
    out = Path(cfg.out)
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert not (out / "selfspec.json").exists()  # a plain AR model
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["steps"] == 4 and prov["corpus"]["train_files"] == 8 and prov["history"] == hist
    assert json.loads((Path(res["checkpoint"]) / "train_state.json").read_text())["objective"] == "tiny-base"


def test_config_to_args_round_trips_through_the_generated_options():
    import argparse

    from selfspec.training import config as C
    from selfspec.training.idlm.objective import IDLMConfig

    cfg = IDLMConfig(base="b", out="o", stride=3, curriculum=[2, 3], data=["x.jsonl", "y"], batch_size=2,
                     progress_bar=False, export=False, eval_every=10, resume="auto")
    parser = argparse.ArgumentParser()
    C.add_arguments(parser, IDLMConfig)
    assert C.from_args(IDLMConfig, parser.parse_args(C.to_args(cfg))) == cfg
    assert "--no-progress-bar" in C.to_args(cfg) and "--steps" not in C.to_args(cfg)


def test_take_rows_keeps_shared_fields_and_slices_rows():
    import dataclasses

    from selfspec.training.distributed import global_mean, shard_rows, take_rows

    @dataclasses.dataclass
    class Batch:
        ids: torch.Tensor
        lens: torch.Tensor
        layout: tuple
        flag: bool

    b = Batch(torch.arange(12).view(4, 3), torch.arange(4), (7, 8), True)
    part = take_rows({"b": b, "pair": (torch.arange(4), torch.zeros(4, 2)), "seed": 5}, shard_rows(2, 1))
    assert part["b"].ids.tolist() == [[6, 7, 8], [9, 10, 11]] and part["b"].lens.tolist() == [2, 3]
    assert part["b"].layout == (7, 8) and part["b"].flag is True and part["seed"] == 5
    assert part["pair"][0].tolist() == [2, 3] and part["pair"][1].shape == (2, 2)
    # one process: the plain mean
    assert float(global_mean(torch.tensor(6.0), 4)) == 1.5


def test_a_recipe_measurement_on_another_prompt_set_keeps_the_held_out_one(tmp_path):
    """`python -m selfspec.training.jacobi_forcing.recipe measure M --prompts humaneval` records its numbers
    beside the held-out measurement, never over it; the prompts are named as given."""
    import json

    from selfspec.training import recipes
    from selfspec.training.recipes import measure_prompts, record_measurement

    meta = {"mode": "jacobi", "metrics": {"measured": {"prompts": "selfspec/data/prompts/heldout.jsonl", "tpf": 2.0}}}
    (tmp_path / "selfspec.json").write_text(json.dumps(meta))
    (tmp_path / "provenance.json").write_text(json.dumps({"measured": {"tpf": 2.0}}))
    record_measurement(tmp_path, {"prompts": "humaneval", "tpf": 3.0}, "humaneval")
    written = json.loads((tmp_path / "selfspec.json").read_text())["metrics"]
    assert written["measured"]["tpf"] == 2.0 and written["measured_by_prompts"]["humaneval"]["tpf"] == 3.0
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["measured"]["tpf"] == 2.0 and prov["measured_by_prompts"]["humaneval"]["tpf"] == 3.0

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(text) % 7 + 1, 2]}

    label, ids = measure_prompts("humaneval", Tokenizer(), 5)
    assert label == "humaneval" and len(ids) == 5
    label, ids = measure_prompts(recipes.HELDOUT_PROMPTS, Tokenizer(), 3)
    assert label == "selfspec/data/prompts/heldout.jsonl" and len(ids) == 3
