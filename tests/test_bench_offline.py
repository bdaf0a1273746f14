"""`selfspec bench offline`: table, JSON schema, skipped modes, exact match against AR."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from selfspec.benchmarks import offline
from selfspec.benchmarks.repetition import OutputStat, non_loop_summary, set_ratio_vs_ar
from selfspec.decoding.metrics import SequenceMetrics
from selfspec.engines.generate import GenerationOutput
from model_helpers import save_random_adapter, tiny_qwen3
from selfspec.models import ASSETS_DIR

PROMPTS = [
    "def add(a, b):\n    return",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "for i in range(10):\n    print(i)\n",
    "x = [1, 2, 3]\ny = [",
    "# Copyright\n",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small forwards: 1 thread is faster


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random Qwen3 over the embedded tokenizer (which has a [MASK] token)."""
    root = tmp_path_factory.mktemp("bench")
    model = tiny_qwen3(8192, hidden_size=64, seed=0, eos_token_id=0)
    model.save_pretrained(root / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS_DIR / "tiny-base" / name, root / "model" / name)
    save_random_adapter(model, root / "adapter", rank=4)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def _run(args: list[str]) -> int:
    parser = offline.add_arguments(argparse.ArgumentParser())
    return offline.run(parser.parse_args(args))


def test_greedy_benchmark_reports_every_mode(model_dir, capsys):
    out = model_dir / "greedy.json"
    rc = _run(["--model", str(model_dir / "model"), "--prompts", str(model_dir / "prompts.jsonl"),
               "--modes", "ngram,jacobi,sjd,isd,risd", "--max-new-tokens", "24", "--batch-size", "3",
               "--mode-config", "jacobi:block_size=6", "--mode-config", "isd:stride=3", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "TPF" in table and "risd: skipped" in table
    result = json.loads(out.read_text())
    assert result["schema"] == offline.SCHEMA and result["num_prompts"] == len(PROMPTS)
    modes = {r["mode"]: r for r in result["modes"]}
    assert list(modes) == ["ar", "ngram", "jacobi", "sjd", "isd", "risd"]  # AR first, added
    assert modes["risd"]["status"] == "skipped" and "adapter" in modes["risd"]["reason"]
    assert modes["jacobi"]["config"]["block_size"] == 6 and modes["isd"]["config"]["stride"] == 3
    for name in ("ar", "ngram", "jacobi", "sjd", "isd"):
        r = modes[name]
        assert r["status"] == "ok", r
        assert r["exact_match_vs_ar"] == 1.0  # greedy modes are lossless
        assert r["tokens"] == modes["ar"]["tokens"]
        assert r["tpf"] == pytest.approx(r["tokens"] / r["forwards"])
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0
        assert r["speedup_vs_ar"] == pytest.approx(1 / r["wall_ratio_vs_ar"])
        assert sum(r["finish_reasons"].values()) == len(PROMPTS)
        assert 0 <= r["repetition_loops"] <= len(PROMPTS)
        assert r["mean_accepted_length"] >= 1.0 and r["compute_overhead"] >= 1.0
    assert modes["ar"]["tpf"] == 1.0 and modes["ar"]["wall_ratio_vs_ar"] == 1.0
    for name in ("ar", "ngram", "jacobi", "sjd", "isd"):  # batches of 3: no per-output time, NL TPF only
        nl = modes[name]["non_loop"]
        assert nl["outputs"] == len(PROMPTS) - modes[name]["repetition_loops"] and nl["timing"] == "per-batch"
        assert nl["wall_s"] is None and nl["tokens_per_s"] is None and nl["ratio_vs_ar"] is None
        if nl["outputs"]:
            assert nl["tpf"] == pytest.approx(nl["tokens"] / nl["forwards"])
    assert "NL TPF" in table and "--batch-size 1" in table


def test_sampling_benchmark_with_adapter(model_dir):
    out = model_dir / "sampled.json"
    rc = _run(["--model", str(model_dir / "model"), "--prompts", str(model_dir / "prompts.jsonl"),
               "--modes", "ar,jacobi,sjd,isd,risd", "--max-new-tokens", "12", "--temperature", "0.8",
               "--top-k", "50", "--adapter", str(model_dir / "adapter"), "--limit", "4", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    modes = {r["mode"]: r for r in result["modes"]}
    assert result["num_prompts"] == 4 and result["sampling"]["temperature"] == 0.8
    assert modes["jacobi"]["status"] == "skipped" and "greedy" in modes["jacobi"]["reason"]
    for name in ("ar", "sjd", "isd", "risd"):
        assert modes[name]["status"] == "ok" and modes[name]["exact_match_vs_ar"] is None


def test_model_without_mask_token_skips_isd(tmp_path):
    model = tiny_qwen3(64, seed=1)
    model.save_pretrained(tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n" + json.dumps({"prompt_ids": [4, 5]}) + "\n")
    out = tmp_path / "r.json"
    assert _run(["--model", str(tmp_path / "m"), "--prompts", str(prompts), "--modes", "isd",
                 "--max-new-tokens", "6", "--batch-size", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["modes"]
    assert [r["status"] for r in rows] == ["ok", "skipped"] and "MASK" in rows[1]["reason"]
    nl = rows[0]["non_loop"]  # 6 tokens cannot loop; one prompt per batch: per-output time
    assert nl["outputs"] == 2 and nl["tokens"] == rows[0]["tokens"] and nl["timing"] == "per-output"
    assert nl["wall_s"] == pytest.approx(rows[0]["wall_s"]) and nl["ratio_vs_ar"] == 1.0


def test_repetition_loop_detector():
    assert offline.is_repetition_loop([1, 2, 3] + [7] * 20)
    assert offline.is_repetition_loop(list(range(10)) + [4, 5, 6] * 8)
    assert not offline.is_repetition_loop(list(range(40)))
    assert not offline.is_repetition_loop([7] * 10)  # too short to call
    assert not offline.is_repetition_loop([1, 2] * 10 + [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18])


LOOPING = [[1, 2, 3] + [7] * 20, list(range(10)) + [4, 5, 6] * 8]
NOT_LOOPING = [list(range(40)), [7] * 10]


def test_non_loop_summary_counts_only_outputs_that_do_not_loop():
    stats = [OutputStat(LOOPING[0], 5, 1.0), OutputStat(NOT_LOOPING[0], 20, 2.0), OutputStat(LOOPING[1], 4, 1.0),
             OutputStat(NOT_LOOPING[1], 5, 0.5)]
    nl = non_loop_summary(stats)
    assert nl == {"outputs": 2, "tokens": 50, "forwards": 25, "tpf": 2.0, "wall_s": 2.5, "tokens_per_s": 20.0,
                  "ratio_vs_ar": None}
    ar = non_loop_summary([OutputStat(NOT_LOOPING[0], 40, 4.0)])
    set_ratio_vs_ar(nl, ar)
    assert ar["tpf"] == 1.0 and nl["ratio_vs_ar"] == pytest.approx(2.0)
    untimed = non_loop_summary([OutputStat(NOT_LOOPING[0], 20, None), OutputStat(LOOPING[0], 5, 1.0)])
    assert untimed["tpf"] == 2.0 and untimed["wall_s"] is None and untimed["tokens_per_s"] is None
    set_ratio_vs_ar(untimed, ar)
    assert untimed["ratio_vs_ar"] is None
    none_left = non_loop_summary([OutputStat(t, 3, 1.0) for t in LOOPING])
    assert none_left["outputs"] == 0 and none_left["tpf"] is None and none_left["tokens_per_s"] is None
    assert non_loop_summary([OutputStat(NOT_LOOPING[0], 10, 1.0, tokens=30)])["tokens"] == 30  # a server's count


class _StubMode:
    config = None
    greedy_only = False


class _StubEngine:
    """Prompt [i] decodes to OUTPUTS[i] in `forwards` forwards; records the seeds it was given."""

    def __init__(self, outputs, forwards):
        self.outputs, self.forwards, self.seeds = outputs, forwards, []

    def build_mode(self, mode, config=None):
        return _StubMode()

    def generate(self, prompts, max_new_tokens, sampling, seed=None, mode=None, stop_token_ids=None, batch_size=None):
        if mode is None:  # warm-up
            return []
        self.seeds.append(list(seed))
        return [GenerationOutput(self.outputs[p[0]], "length",
                                 SequenceMetrics(forwards=self.forwards[p[0]], committed_tokens=len(self.outputs[p[0]])))
                for p in prompts]


@pytest.mark.parametrize("batch_size", [1, 2])
def test_rows_split_looping_and_non_looping_outputs(batch_size):
    outputs = [LOOPING[0], NOT_LOOPING[0], LOOPING[1], NOT_LOOPING[1]]
    engine = _StubEngine(outputs, forwards=[5, 20, 4, 5])
    rows = offline.run_benchmark(engine, [[0], [1], [2], [3]], ["ar"], batch_size=batch_size, seed=7, log=lambda *a: None)
    assert engine.seeds == ([[7], [8], [9], [10]] if batch_size == 1 else [[7, 8], [9, 10]])  # seed + index, as one call
    (row,) = rows
    assert row["repetition_loops"] == 2 and row["tokens"] == sum(map(len, outputs)) and row["forwards"] == 34
    nl = row["non_loop"]
    assert (nl["outputs"], nl["tokens"], nl["forwards"], nl["tpf"]) == (2, 50, 25, 2.0)
    if batch_size == 1:
        assert nl["timing"] == "per-output" and 0 < nl["wall_s"] < row["wall_s"]
        assert nl["tokens_per_s"] == pytest.approx(50 / nl["wall_s"]) and nl["ratio_vs_ar"] == 1.0
    else:
        assert nl["timing"] == "per-batch" and nl["wall_s"] is None and nl["ratio_vs_ar"] is None
    table = offline.format_table(rows)
    head, ar_line = table.splitlines()[:2]
    assert head.endswith("NL  NL TPF  NL xAR") and ar_line.split()[-3:] == (
        ["2", "2.00", "1.00x"] if batch_size == 1 else ["2", "2.00", "-"])


def test_prompt_file_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        offline.load_prompts(bad)
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="tokenizer"):
        offline.load_prompts(bad)


def test_mode_lists_take_labelled_variants():
    from selfspec.benchmarks.modes import ModeRun, parse_modes

    assert parse_modes("ngram,isd,isd-ctx=isd,ar") == [ModeRun("ar", "ar"), ModeRun("ngram", "ngram"),
                                                        ModeRun("isd", "isd"), ModeRun("isd-ctx", "isd")]
    with pytest.raises(ValueError, match="twice"):
        parse_modes("isd,isd")
    with pytest.raises(ValueError, match="unknown decoding mode"):
        parse_modes("fast=eagle")


def test_serving_config_rows_carry_their_options_and_plan(tmp_path):
    from selfspec.benchmarks.offline import _serving_configs

    f = tmp_path / "tuned.yaml"
    f.write_text("mode: ISD\nstride: 3\nplan:\n  - {max_batch: 2, context_tokens: 4}\n  - {max_batch: null, mode: ar}\n")
    options, plans = _serving_configs([f"isd-tuned:{f}"])
    assert options == {"isd-tuned": {"stride": 3}}
    assert plans["isd-tuned"][1] == {"max_batch": None, "mode": "ar"}
    with pytest.raises(ValueError, match="LABEL:FILE"):
        _serving_configs([str(f)])
