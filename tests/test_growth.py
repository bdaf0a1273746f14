"""bench/growth.py's pure parts: the grid, the server flags it needs, the per-cell step lines,
the ratios to AR's step and their growth with the context, the table and the plot. No server
starts: the one function that drives a server is given a fake."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def growth():
    path = REPO / "bench" / "growth.py"
    spec = importlib.util.spec_from_file_location("growth", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _ns(**kw):
    import argparse

    base = dict(quick=False, prompt_tokens=None, output_tokens=None, concurrency=None)
    return argparse.Namespace(**{**base, **kw})


def test_the_grid_parses_sorts_and_refuses_bad_values(growth):
    assert growth.parse_grid("2048,256,1024,256", "prompt-tokens") == [256, 1024, 2048]
    for bad in ("a,b", "0,4", "", ","):
        with pytest.raises(ValueError, match="--concurrency"):
            growth.parse_grid(bad, "concurrency")
    assert growth.grid_of(_ns()) == {"prompt_tokens": [256, 1024, 2048], "output_tokens": [128, 512],
                                     "concurrency": [1, 4, 16, 64]}
    assert growth.grid_of(_ns(quick=True)) == {"prompt_tokens": [256, 2048], "output_tokens": [128],
                                               "concurrency": [1, 16]}
    assert growth.grid_of(_ns(quick=True, concurrency="2"))["concurrency"] == [2]  # a given axis wins


def test_the_servers_hold_the_largest_cell(growth):
    grid = growth.grid_of(_ns())
    flags = growth.server_flags(grid)
    assert flags[flags.index("--max-running-requests") + 1] == "64"
    assert int(flags[flags.index("--max-total-tokens") + 1]) >= 64 * (2048 + 512)
    assert "--disable-radix-cache" in flags  # overlapping windows share no prefill
    # every request of the largest level of every output length gets its own window
    assert growth.prompts_needed(grid, 4) == 2 * (4 + 4 + 16 + 64)
    growth.check_context(grid, 4096)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        growth.check_context(grid, 2048)
    quick = growth.grid_of(_ns(quick=True))
    assert growth.estimate_seconds(quick, 4, 7) < growth.estimate_seconds(grid, 4, 7)
    assert growth.estimate_seconds(grid, 4, 7, starts=3) > growth.estimate_seconds(grid, 4, 7)


def _cell(p, o, c, eff, step=None, tok_s=100.0):
    return {"prompt_tokens": p, "output_tokens": o, "concurrency": c, "effective_ms": eff, "step_ms": step,
            "output_tok_s": tok_s}


def _report():
    """AR doubles its cost from P=256 to 2048; isd-s2's worker step triples (50% faster growth than the
    worker's AR step, which doubles); ngram grows as AR does."""
    rows = {
        "ar": {"status": "ok", "cells": [_cell(256, 128, 1, 10.0), _cell(2048, 128, 1, 20.0)]},
        "ngram": {"status": "ok", "cells": [_cell(256, 128, 1, 12.0), _cell(2048, 128, 1, 24.0)]},
        "worker-ar": {"status": "ok", "cells": [_cell(256, 128, 1, 9.0, 8.0), _cell(2048, 128, 1, 18.0, 16.0)]},
        "isd-s2": {"status": "ok", "cells": [_cell(256, 128, 1, 14.0, 12.0), _cell(2048, 128, 1, 40.0, 36.0)]},
        "sjd-own": {"status": "skipped", "reason": "no server\nmore", "cells": []},
    }
    return {"model": "/x/tiny-idlm", "device": "cpu", "temperature": 0.7, "prompt_tokens": [256, 2048],
            "output_tokens": [128], "concurrency": [1], "threshold": 0.1, "rows": rows}


def test_ratios_compare_like_with_like(growth):
    report = _report()
    growth.add_ratios(report)
    rows = report["rows"]
    assert rows["isd-s2"]["ar_reference"] == "worker-ar"  # the worker's step against the worker's AR step
    assert rows["isd-s2"]["cells"][0]["x_ar"] == pytest.approx(12.0 / 8.0)
    assert rows["ngram"]["ar_reference"] == "ar" and rows["ngram"]["cells"][1]["x_ar"] == pytest.approx(1.2)
    assert rows["worker-ar"]["ar_reference"] == "ar"  # both by the effective period
    assert rows["worker-ar"]["cells"][0]["x_ar"] == pytest.approx(0.9)
    assert rows["ar"]["ar_reference"] is None and rows["ar"]["cells"][0]["x_ar"] == 1.0
    # without the worker's AR row a selfspec kind falls back to stock AR, by the effective period
    del report["rows"]["worker-ar"]
    growth.add_ratios(report)
    assert rows["isd-s2"]["ar_reference"] == "ar" and rows["isd-s2"]["cells"][0]["x_ar"] == pytest.approx(1.4)


def test_growth_is_a_ratio_of_ratios_and_flags_faster_growth(growth):
    report = _report()
    g = growth.growth(report, 0.10)
    isd = g["isd-s2"]["O=128,C=1"]
    assert isd["cost_growth"] == pytest.approx(3.0) and isd["ar_growth"] == pytest.approx(2.0)
    assert isd["relative"] == pytest.approx(1.5) and isd["flagged"] and isd["reference"] == "worker-ar"
    assert g["ngram"]["O=128,C=1"]["relative"] == pytest.approx(1.0) and not g["ngram"]["O=128,C=1"]["flagged"]
    assert g["worker-ar"]["O=128,C=1"]["relative"] == pytest.approx(1.0)
    assert "ar" not in g and "sjd-own" not in g
    # 9% faster is under a 10% threshold
    report["rows"]["ngram"]["cells"][1]["effective_ms"] = 12.0 * 2 * 1.09
    assert not growth.growth(report, 0.10)["ngram"]["O=128,C=1"]["flagged"]
    assert growth.growth(report, 0.05)["ngram"]["O=128,C=1"]["flagged"]
    # a missing cell leaves that (O, C) out
    report["rows"]["ngram"]["cells"].pop()
    assert "ngram" not in growth.growth(report)


def test_the_table_shows_every_row_and_marks_flagged_growth(growth):
    report = _report()
    growth.add_ratios(report)
    report["growth"] = growth.growth(report)
    text = growth.format_table(report)
    lines = text.splitlines()
    isd = next(line for line in lines if line.startswith("isd-s2") and "(" in line)
    assert "12.0 (1.50) 100" in isd and "36.0 (2.25) 100" in isd  # the worker's step, x the worker's AR step
    assert any(line.startswith("ar ") and "10.0 (1.00)" in line for line in lines)
    assert any(line.startswith("sjd-own") and "skipped: no server" in line for line in lines)
    growth_line = next(line for line in reversed(lines) if line.startswith("isd-s2"))
    assert "1.500!" in growth_line
    assert "P=256 -> 2048" in text


def test_the_plot_is_written(growth, tmp_path):
    report = _report()
    growth.add_ratios(report)
    out = tmp_path / "growth.png"
    growth.plot(report, str(out))
    assert out.stat().st_size > 0


def test_a_cell_reads_only_the_log_lines_it_wrote(growth, tmp_path, monkeypatch):
    """Every cell of a server shares its log: a cell's steps are the lines written while it ran."""
    from selfspec.benchmarks import load, serve
    from selfspec.sglang_ext.worker import STEP_TIMING_LOG

    log = tmp_path / "server-isd-s2.log"
    earlier = (2, 3, 6, 3, 0.1, 50.0, 1.0, 1.0)  # an earlier cell's step at the same batch size
    log.write_text("".join("INFO " + STEP_TIMING_LOG % earlier + "\n" for _ in range(5)))

    def fake_chunk(proc, prompts, concurrency, args):
        assert args.max_tokens == 64 and args.ignore_eos
        with open(log, "a") as f:
            for args_ in [(2, 3, 6, 3, 0.1, 8.0, 1.0, float("nan")), (2, 3, 6, 5, 0.2, 9.0, 1.2, 1.1)]:
                f.write("INFO " + STEP_TIMING_LOG % args_ + "\n")
        results = [{"e2e": 1.0, "ttft": 0.1, "tokens": 64, "token_ids": None, "tpot": 0.01, "verify_ct": 31}
                   for _ in prompts]
        return load.Chunk(results, [], 1.0)

    monkeypatch.setattr(serve, "_timed_chunk", fake_chunk)
    import argparse

    cell = growth._cell("isd-s2", "isd", None, log, ["a", "b"], 256, 64, 2,
                        argparse.Namespace(max_tokens=8, ignore_eos=False, temperature=0.7))
    assert cell["step"]["steps"] == 2 and cell["step"]["forward"] == 9.0  # not the earlier cell's 50 ms
    assert cell["step_ms"] == pytest.approx(0.2 + 9.0 + 1.2 + 1.1)
    assert cell["output_tok_s"] == 128.0 and cell["tpf"] == pytest.approx(2.0)
    assert cell["effective_ms"] == pytest.approx(1e3 * 2 * 2.0 / 128.0)


def test_quick_grid_flags_and_a_grid_past_the_context_are_refused(growth):
    """The servers' flags fit the grid (room for its widest level, radix cache off); a grid past the
    model's positions stops before any server starts, as a usage error (exit 2) of the script."""
    grid = growth.grid_of(_ns(quick=True))
    flags = growth.server_flags(grid)
    assert flags[flags.index("--max-running-requests") + 1] == str(max(grid["concurrency"]))
    assert "--disable-radix-cache" in flags
    growth.check_context(grid, 4096)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        growth.check_context({**grid, "prompt_tokens": [4000]}, 4096)
    script = str(REPO / "bench" / "growth.py")
    assert subprocess.run([sys.executable, script, "--dry-run", "--quick"], capture_output=True, cwd=REPO,
                          timeout=120).returncode == 0
    bad = subprocess.run([sys.executable, script, "--dry-run", "--prompt-tokens", "4000"], capture_output=True,
                         cwd=REPO, timeout=120)
    assert bad.returncode == 2
