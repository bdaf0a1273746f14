"""`selfspec bench offline`: table, JSON schema, skipped modes, exact match against AR."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from selfspec.benchmarks import offline
from selfspec.engines.testing import save_random_adapter, tiny_qwen3
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
                 "--max-new-tokens", "6", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["modes"]
    assert [r["status"] for r in rows] == ["ok", "skipped"] and "MASK" in rows[1]["reason"]


def test_repetition_loop_detector():
    assert offline.is_repetition_loop([1, 2, 3] + [7] * 20)
    assert offline.is_repetition_loop(list(range(10)) + [4, 5, 6] * 8)
    assert not offline.is_repetition_loop(list(range(40)))
    assert not offline.is_repetition_loop([7] * 10)  # too short to call
    assert not offline.is_repetition_loop([1, 2] * 10 + [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18])


def test_prompt_file_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        offline.load_prompts(bad)
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="tokenizer"):
        offline.load_prompts(bad)
