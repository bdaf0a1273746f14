"""Registration, configuration and fail-fast validation of the selfspec SGLang plugin.

Most checks run SGLang's own argument parsing and resolution in this process with the plugin
loaded (exactly what the launcher runs before it spawns any worker); two start a real server
that must exit at startup with the message.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from sglang_fixtures import launch_expect_failure, make_random_lora, resolve_in_process

REPO = Path(__file__).resolve().parents[1]
PRESETS = REPO / "serving_configs"


def _argv(model, *extra):
    return ["--model-path", str(model), "--device", "cpu", "--attention-backend", "torch_native",
            "--max-total-tokens", "4096", *extra]


def _resolve(model, *extra):
    """The resolved server arguments (SGLang's resolving view: declarations applied)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    return resolving_view(resolve_in_process(_argv(model, *extra)))


def _fails(model, *extra) -> str:
    from selfspec.sglang_ext.config import SelfSpecConfigError

    with pytest.raises(SelfSpecConfigError) as info:
        _resolve(model, *extra)
    return str(info.value)


@pytest.fixture(scope="module")
def no_mask_model(tmp_path_factory, tiny_base_path) -> Path:
    d = tmp_path_factory.mktemp("nomask") / "model"
    shutil.copytree(tiny_base_path, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("mask_token", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def other_base_adapter(tmp_path_factory, tiny_base_path) -> Path:
    return make_random_lora(tiny_base_path, tmp_path_factory.mktemp("other") / "adapter", rank=4,
                            base_sha256="0" * 64)


@pytest.fixture(scope="module")
def good_adapter(tmp_path_factory, tiny_base_path) -> Path:
    return make_random_lora(tiny_base_path, tmp_path_factory.mktemp("good") / "adapter", rank=4)


def test_algorithms_registered_with_complete_spec_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    resolve_in_process  # noqa: B018  (plugin loading happens in resolve_in_process)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    for name in ("ISD", "RISD", "JACOBI", "SJD"):
        algo = SpeculativeAlgorithm.from_string(name)
        assert algo.is_speculative() and algo.is_ngram() and not algo.has_draft_kv()
        # what 0.5.23's scheduler calls on every algorithm but CustomSpecAlgo lacks
        assert algo.carries_draft_hidden_states() is False
        assert algo.need_topk() is False
        assert algo.get_platform_worker_cls() is None
        assert callable(algo.create_future_map)


def _published(monkeypatch, model, *extra):
    """(the resolved server arguments, the selfspec configuration the launcher publishes)."""
    from selfspec.sglang_ext import config as cfgmod

    seen = []
    monkeypatch.setattr(cfgmod, "publish", seen.append)
    sa = _resolve(model, *extra)
    return sa, seen[-1]


def test_the_default_is_the_built_in_policy_and_its_width_the_widest_bucket(tiny_base_path, monkeypatch):
    """No plan file: the built-in policy, whose widest step (the own step with its 32-token
    candidate) sets the verify width; options the user gives go to the own step; `own` runs
    the mode alone at its options."""
    sa, cfg = _published(monkeypatch, tiny_base_path, "--speculative-algorithm", "ISD")
    assert sa.speculative_num_draft_tokens == 35  # stride 2: 1 + 2 (proposal, MASK) + 32-token candidate
    assert cfg.policy == "auto" and cfg.sources["plan"] == "built-in policy auto"
    assert [b["mode"] for b in cfg.plan["greedy"]] == ["isd", "ngram", "ngram"]
    sa = _resolve(tiny_base_path, "--speculative-algorithm", "SJD", "--selfspec-options", "window=6")
    assert sa.speculative_num_draft_tokens == 1 + 6 + 32  # the user's window in the own step
    assert sa.disable_overlap_schedule is True
    assert sa.enable_mixed_chunk is False
    sa, cfg = _published(monkeypatch, tiny_base_path, "--speculative-algorithm", "ISD", "--selfspec-policy", "own")
    assert sa.speculative_num_draft_tokens == 7  # the mode alone: 2N-1 with the default N = 4
    assert cfg.plan is None and cfg.policy == "own"
    sa = _resolve(tiny_base_path, "--speculative-algorithm", "JACOBI", "--selfspec-policy", "ar")
    assert sa.speculative_num_draft_tokens == 1


@pytest.mark.parametrize("yaml_text, problem", [
    ("mode: ISD\npolicy: {name: auto, own_max_batch: -2}\n", "policy option own_max_batch=-2"),
    ("mode: ISD\npolicy: {fast: true}\n", "unknown policy option"),
    ("mode: ISD\npolicy: own\nplan:\n  greedy: [{max_batch: null, mode: ar}]\n", "replaces the built-in policy"),
    ("mode: ISD\nplan:\n  greedy: [{max_batch: null, mode: sjd, window: 2}]\n", "a isd plan runs isd, ar, ngram"),
    ("mode: SJD\nplan:\n  greedy: [{max_batch: null, mode: ar}]\n", "is a SJD preset but --speculative-algorithm is ISD"),
])
def test_a_bad_policy_or_a_plan_for_another_mode_fails_at_start_up(tmp_path, tiny_base_path, yaml_text, problem):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml_text)
    assert problem in _fails(tiny_base_path, "--speculative-algorithm", "ISD", "--selfspec-config", str(cfg))


def test_presets_parse_and_apply(tiny_base_path):
    from selfspec.sglang_ext.config import load_yaml_config

    widths = {"isd-n4.yaml": 7, "risd-n4-lossless.yaml": None, "jacobi-mr.yaml": 45, "sjd.yaml": 5,
              "isd-context.yaml": 1 + 2 * 2 + 8}
    assert set(widths) == {f.name for f in PRESETS.glob("*.yaml") if not f.name.startswith("tuned-")}
    for name, width in widths.items():
        data = load_yaml_config(PRESETS / name)
        assert data["mode"] in ("ISD", "RISD", "JACOBI", "SJD")
        assert (PRESETS / name).read_text().lstrip().startswith("#")  # each preset is commented
        if width is None:
            continue
        sa = _resolve(tiny_base_path, "--selfspec-config", str(PRESETS / name))  # the preset names the mode
        assert sa.speculative_algorithm == data["mode"]
        assert sa.speculative_num_draft_tokens == width


def test_fixed_width_plans_serve(tiny_base_path):
    """The one-bucket plans the fixed-vs-tuned benches serve (bench/fixed_widths): a plan of a
    mode's own steps resolves under the algorithm it names, a lookup or AR plan under any, and
    the verify width is that of its step (a 4-token lookup: 5 rows)."""
    from selfspec.sglang_ext.config import load_yaml_config

    fixed = sorted((REPO / "bench" / "fixed_widths").glob("*.yaml"))
    assert len(fixed) >= 7
    widths = {}
    for path in fixed:
        mode = load_yaml_config(path).get("mode")
        for algorithm in [mode] if mode else ["ISD", "JACOBI", "SJD"]:
            sa = _resolve(tiny_base_path, "--speculative-algorithm", algorithm, "--selfspec-config", str(path))
            assert sa.speculative_algorithm == algorithm
            assert widths.setdefault(path.stem, sa.speculative_num_draft_tokens) == sa.speculative_num_draft_tokens
    assert widths["lookup4"] == 5 and widths["lookup12c"] == 13 and widths["isd-stride3"] == 5
    assert widths["ar-steps"] == 1


def test_flags_override_yaml(tiny_base_path):
    sa = _resolve(tiny_base_path, "--selfspec-config", str(PRESETS / "isd-n4.yaml"), "--selfspec-stride", "3")
    assert sa.speculative_num_draft_tokens == 5


def test_checkpoint_metadata_supplies_defaults(tmp_path, tiny_base_path):
    d = tmp_path / "idlm"
    shutil.copytree(tiny_base_path, d)
    (d / "selfspec.json").write_text(json.dumps({"mode": "isd", "stride": 5, "mask_token_id": 1}))
    sa = _resolve(d, "--speculative-algorithm", "ISD", "--selfspec-policy", "own")
    assert sa.speculative_num_draft_tokens == 9


def test_stride_out_of_range(tiny_base_path):
    msg = _fails(tiny_base_path, "--speculative-algorithm", "ISD", "--selfspec-stride", "1")
    assert "out of range" in msg and "--selfspec-stride" in msg and "context_tokens > 0" in msg
    assert "out of range" in _fails(tiny_base_path, "--speculative-algorithm", "ISD", "--selfspec-stride", "64")


def test_stride_one_with_a_candidate_is_a_lookup_step(tiny_base_path):
    sa = _resolve(tiny_base_path, "--speculative-algorithm", "ISD", "--selfspec-stride", "1", "--selfspec-policy",
                  "own", "--selfspec-mask-token-id", "1", "--selfspec-options", "context_tokens=8")
    assert sa.speculative_num_draft_tokens == 9  # [pending, 8-token candidate]


@pytest.mark.parametrize("algorithm, options, problem", [
    ("JACOBI", "ngram_size=1", "ngram_size must be >= 2"),
    ("SJD", "window=4.5", "window=4.5: expected an integer"),
    ("JACOBI", "num_blocks=2", "unknown JACOBI option 'num_blocks'"),
])
def test_bad_mode_options_stop_the_server_at_start_up(tiny_base_path, algorithm, options, problem):
    """Caught while the launcher resolves the arguments, before any scheduler process starts
    (these used to pass start-up and crash inside the scheduler at the first request)."""
    assert problem in _fails(tiny_base_path, "--speculative-algorithm", algorithm, "--selfspec-options", options)


def test_options_help_names_real_options():
    import argparse

    from selfspec.decoding import registry
    from selfspec.sglang_ext.cli_args import add_selfspec_args

    parser = argparse.ArgumentParser()
    add_selfspec_args(parser)
    text = next(a.help for a in parser._actions if a.dest == "selfspec_options")
    import re

    examples = [kv.split("=")[0] for kv in re.search(r"e\.g\. '([^']*)'", text).group(1).split(",")]
    assert examples and all(k in registry.get("jacobi").defaults for k in examples)


def test_malformed_selfspec_json_is_named(tmp_path, tiny_base_path):
    d = tmp_path / "broken"
    shutil.copytree(tiny_base_path, d)
    (d / "selfspec.json").write_text('{"mode": "isd", "stride": ')
    msg = _fails(d, "--speculative-algorithm", "ISD")
    assert str(d / "selfspec.json") in msg and "not valid JSON" in msg


def test_isd_without_mask_token(no_mask_model):
    msg = _fails(no_mask_model, "--speculative-algorithm", "ISD")
    assert "no mask token" in msg and "--selfspec-mask-token-id" in msg


def test_risd_without_adapter(tiny_base_path):
    msg = _fails(tiny_base_path, "--speculative-algorithm", "RISD")
    assert "needs a gated LoRA adapter" in msg and "--selfspec-lora" in msg


def test_risd_adapter_of_another_base(tiny_base_path, other_base_adapter):
    msg = _fails(tiny_base_path, "--speculative-algorithm", "RISD", "--selfspec-lora", str(other_base_adapter))
    assert "trained on another base" in msg


def test_risd_adapter_of_this_base_resolves(tiny_base_path, good_adapter):
    sa = _resolve(tiny_base_path, "--speculative-algorithm", "RISD", "--selfspec-lora", str(good_adapter))
    assert sa.speculative_num_draft_tokens == 35  # the built-in policy's own step, as ISD's


def test_width_larger_than_kv_reservation(tiny_base_path):
    msg = _fails(tiny_base_path, "--speculative-algorithm", "SJD", "--selfspec-options", "window=8",
                 "--speculative-num-draft-tokens", "4")
    assert "reserves only" in msg and "--speculative-num-draft-tokens" in msg


@pytest.mark.parametrize("extra, needle", [
    (["--page-size", "16"], "--page-size 1"),
    (["--enable-mixed-chunk"], "--enable-mixed-chunk"),
    (["--speculative-draft-model-path", "SELF"], "draft-free"),
    (["--attention-backend", "triton"], "torch_native"),
    (["--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"], "DP attention"),
    (["--pp-size", "2"], "pipeline parallelism"),
    (["--speculative-adaptive"], "fixed verify width"),
])
def test_unsupported_combinations(tiny_base_path, extra, needle):
    argv = _argv(tiny_base_path, "--speculative-algorithm", "JACOBI")
    extra = [str(tiny_base_path) if a == "SELF" else a for a in extra]
    if "--attention-backend" in extra:
        i = argv.index("--attention-backend")
        del argv[i:i + 2]
    from selfspec.sglang_ext.config import SelfSpecConfigError

    with pytest.raises(SelfSpecConfigError) as info:
        resolve_in_process(argv + extra)
    assert needle in str(info.value)


def test_unknown_option_and_mismatched_preset(tiny_base_path):
    assert "unknown JACOBI option" in _fails(tiny_base_path, "--speculative-algorithm", "JACOBI",
                                             "--selfspec-options", "blocksize=8")
    assert "is a ISD preset" in _fails(tiny_base_path, "--speculative-algorithm", "SJD",
                                       "--selfspec-config", str(PRESETS / "isd-n4.yaml"))


@pytest.mark.server
def test_real_server_fails_fast_with_message(tiny_base_path):
    code, out, seconds = launch_expect_failure(tiny_base_path, ["--speculative-algorithm", "RISD"])
    assert code != 0
    assert "needs a gated LoRA adapter" in out
    code, out, seconds = launch_expect_failure(tiny_base_path, ["--speculative-algorithm", "ISD",
                                                                "--selfspec-stride", "0"])
    assert code != 0 and "out of range" in out
    assert "Uvicorn running" not in out


def test_watermarking_passes_sglangs_start_up_check_with_its_other_rules(tiny_base_path):
    """SGLang allows --enable-watermark only with --device cuda and NGRAM / EAGLE; the plugin
    lets the selfspec modes (and the CPU engine) through and keeps every other rule."""
    for extra in (["--speculative-algorithm", "ISD"], ["--speculative-algorithm", "SJD"], []):
        resolve_in_process(_argv(tiny_base_path, *extra, "--enable-watermark")).check_server_args()
    with pytest.raises(ValueError, match="incompatible with --enable-custom-logit-processor"):
        resolve_in_process(_argv(tiny_base_path, "--speculative-algorithm", "ISD", "--enable-watermark",
                                 "--enable-custom-logit-processor")).check_server_args()
    with pytest.raises(ValueError, match="key_b requires a server key"):
        resolve_in_process(_argv(tiny_base_path, "--speculative-algorithm", "SJD", "--enable-watermark",
                                 "--watermark-config", '{"key_b": "ab"}')).check_server_args()


def test_parallel_settings_are_accepted_for_every_mode(tiny_base_path, good_adapter, monkeypatch):
    """Tensor and data parallelism pass the start-up checks in every mode, RISD included (served
    and compared in tests/test_sglang_parallel.py); only DP attention and PP are refused."""
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|1")  # the binding is tested on its own
    for algo in ("ISD", "RISD", "JACOBI", "SJD"):
        extra = ["--selfspec-lora", str(good_adapter)] if algo == "RISD" else []
        for par in (["--tp-size", "2"], ["--dp-size", "2"]):
            resolve_in_process(_argv(tiny_base_path, "--speculative-algorithm", algo, *extra, *par))


@pytest.mark.server
def test_readme_command_serves_verbatim_without_an_accelerator(tmp_path, tiny_base_path):
    """`python -m sglang.launch_server --model-path M --speculative-algorithm ISD`, nothing else,
    with no SGLANG_USE_CPU_ENGINE in the environment: the plugin picks the CPU settings, says so
    in one line, and the server answers."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from sglang_fixtures import check_own_steps, native_generate

    from selfspec.serving import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "SELFSPEC_CPU_DEFAULTS")}
    env["OMP_NUM_THREADS"] = "1"
    log = tmp_path / "server.log"
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_base_path), "--port", str(port),
            "--speculative-algorithm", "ISD"]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        assert proc.poll() is None, log.read_text()[-4000:]
        res = native_generate(f"http://127.0.0.1:{port}", [1, 2, 3, 4], 8)
        assert len(res["output_ids"]) == 8 and res["meta_info"]["selfspec_mode"] == "ISD"
        check_own_steps(f"http://127.0.0.1:{port}", "ISD")
        text = log.read_text()
        assert "No accelerator" not in text
        line = next(x for x in text.splitlines() if "no accelerator found" in x)
        assert "--device cpu" in line and "--attention-backend torch_native" in line
    finally:
        import signal

        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
