"""`selfspec bench serve`: each mode behind a real SGLang server, AR as the reference."""

from __future__ import annotations

import argparse
import json

import pytest

from selfspec.benchmarks import serve


def test_level_prompts_rotate_through_the_file():
    texts = [str(i) for i in range(10)]
    assert serve.level_prompts(texts, 0, 4) == ["0", "1", "2", "3"]
    assert serve.level_prompts(texts, 1, 4) == ["4", "5", "6", "7"]
    assert serve.level_prompts(texts, 2, 4) == ["8", "9", "0", "1"]


def test_unknown_mode_is_refused():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(SystemExit):
        serve.run(parser.parse_args(["--modes", "ar,medusa"]))


@pytest.mark.server
def test_bench_serve_ar_and_sjd(tmp_path, tiny_base_path):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    args = parser.parse_args([
        "--modes", "sjd,risd", "--model", str(tiny_base_path), "--concurrency", "1,2", "--num-prompts", "4",
        "--max-tokens", "12", "--json", str(out), "--plot", str(png), "--genai-bench", "off",
        "--server-args", "--dtype float32 --disable-radix-cache", "--log-dir", str(tmp_path / "logs"),
    ])
    assert serve.run(args) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == serve.SCHEMA
    by_mode = {r["mode"]: r for r in report["results"]}
    assert list(by_mode) == ["ar", "sjd", "risd"]  # AR first, always
    assert by_mode["risd"]["status"] == "skipped" and "adapter" in by_mode["risd"]["reason"]
    for mode in ("ar", "sjd"):
        levels = by_mode[mode]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        for lv in levels:
            assert lv["errors"] == 0 and lv["tokens"] > 0 and lv["output_tok_s"] > 0
            assert lv["tpot_ms_p50"] > 0 and lv["tpf"] >= 1.0
            assert lv["ratio_vs_ar"] is not None
    assert all(lv["ratio_vs_ar"] == pytest.approx(1.0) for lv in by_mode["ar"]["levels"])
    assert png.stat().st_size > 0
