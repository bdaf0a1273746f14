"""`selfspec bench serve`: each mode behind a real SGLang server, AR as the reference."""

from __future__ import annotations

import argparse
import json

import pytest

from selfspec.benchmarks import load, serve, serve_report


def test_level_prompts_rotate_through_the_file():
    texts = [str(i) for i in range(10)]
    sizes = [4, 4, 4]
    assert load.level_prompts(texts, sizes, 0) == ["0", "1", "2", "3"]
    assert load.level_prompts(texts, sizes, 1) == ["4", "5", "6", "7"]
    assert load.level_prompts(texts, sizes, 2) == ["8", "9", "0", "1"]
    # a level holds at least C requests: "C=8" with 4 prompts a level would batch only 4
    assert load.level_sizes([1, 4, 8], 4) == [4, 4, 8]
    assert load.level_prompts(texts, [4, 4, 8], 2) == ["8", "9", "0", "1", "2", "3", "4", "5"]


def test_unknown_mode_is_refused():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(SystemExit):
        serve.run(parser.parse_args(["--modes", "ar,medusa"]))


def _request(token_ids, e2e, verify_ct=None):
    r = {"e2e": e2e, "ttft": 0.01, "tokens": len(token_ids), "token_ids": token_ids, "tpot": 0.01}
    if verify_ct is not None:
        r["verify_ct"] = verify_ct
    return r


LOOP, NO_LOOP = [1, 2, 3] + [7] * 20, list(range(40))


def test_levels_split_looping_and_non_looping_requests():
    results = [_request(LOOP, 1.0, 3), _request(NO_LOOP, 2.0, 19), _request(NO_LOOP[:10], 0.5)]  # last: prefill only
    split = load.loop_split(results, has_verify=True)
    assert split["repetition_loops"] == 1 and split["per_request_tok_s"] == pytest.approx(73 / 3.5)
    assert split["non_loop"] == {"outputs": 2, "tokens": 50, "forwards": 21, "tpf": 50 / 21, "wall_s": 2.5,
                                 "tokens_per_s": 20.0, "ratio_vs_ar": None}
    assert load.loop_split(results, has_verify=False)["non_loop"]["tpf"] is None  # forwards unknown
    no_ids = load.loop_split([dict(results[0], token_ids=None)], has_verify=True)
    assert no_ids["repetition_loops"] is None and no_ids["non_loop"] is None


def _report(temperature, device="cpu"):
    def level(tok_s, nl_tok_s):
        return {"concurrency": 1, "requests": 2, "tokens": 40, "output_tok_s": tok_s, "tpot_ms_p50": 1.0,
                "tpot_ms_p99": 2.0, "tpf": 1.5, "genai_bench": None, "per_request_tok_s": tok_s,
                "repetition_loops": 1, "non_loop": {"outputs": 1, "tokens": 20, "forwards": 10, "tpf": 2.0,
                                                    "wall_s": 20 / nl_tok_s, "tokens_per_s": nl_tok_s,
                                                    "ratio_vs_ar": None}}

    return {"temperature": temperature, "device": device, "results": [
        {"mode": "ar", "status": "ok", "reason": None, "levels": [level(10.0, 8.0)], "notes": []},
        {"mode": "ngram", "status": "ok", "reason": None, "levels": [level(30.0, 12.0)], "notes": []},
        {"mode": "risd", "status": "skipped", "reason": "no RISD adapter", "levels": [], "notes": []}]}


def test_report_ratios_and_the_ngram_note():
    assert serve_report.ngram_verifies_greedily("cpu")
    report = _report(0.7)
    serve_report.finish_report(report)
    ar, ngram = report["results"][0]["levels"][0], report["results"][1]["levels"][0]
    assert ar["ratio_vs_ar"] == 1.0 and ar["non_loop"]["ratio_vs_ar"] == 1.0
    assert ngram["ratio_vs_ar"] == 3.0 and ngram["non_loop"]["ratio_vs_ar"] == pytest.approx(1.5)
    assert report["results"][1]["notes"] == [serve_report.NGRAM_GREEDY_NOTE] and report["results"][0]["notes"] == []
    table = serve_report.format_table(report)
    ngram_row = next(line for line in table.splitlines() if line.startswith("ngram"))
    assert ngram_row.endswith("[NGRAM verifies greedily on this build]") and "1/2" in ngram_row
    assert "note (ngram): NGRAM verifies greedily" in table and "risd" in table and "NL xAR" in table
    greedy = _report(0.0)
    serve_report.finish_report(greedy)
    assert all(r["notes"] == [] for r in greedy["results"])
    wrapped = dict(_report(0.0), concurrency=[1, 4], num_prompts=32, prompts_available=48)  # level 2 wraps
    serve_report.finish_report(wrapped)
    assert wrapped["results"][1]["notes"] == [serve_report.REPEAT_NOTE] and wrapped["results"][0]["notes"] == []
    assert wrapped["prompts_reused"]
    fits = dict(_report(0.0), concurrency=[1, 4], num_prompts=32, prompts_available=64)
    serve_report.finish_report(fits)
    assert fits["results"][1]["notes"] == []
    filled = dict(_report(0.0), concurrency=[1, 64], num_prompts=32, prompts_available=64)  # 32 + 64 requests
    serve_report.finish_report(filled)
    assert filled["results"][1]["notes"] == [serve_report.REPEAT_NOTE]


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
            nl = lv["non_loop"]  # the server returned every request's token ids; 12 tokens cannot loop
            assert lv["repetition_loops"] == 0 and nl["outputs"] == lv["requests"] and nl["tokens"] == lv["tokens"]
            assert nl["tpf"] == pytest.approx(lv["tpf"]) and nl["tokens_per_s"] == pytest.approx(lv["per_request_tok_s"])
            assert nl["ratio_vs_ar"] is not None
        assert by_mode[mode]["notes"] == []
    assert all(lv["ratio_vs_ar"] == pytest.approx(1.0) for lv in by_mode["ar"]["levels"])
    # SJD's own steps served the requests one at a time (the server's counts, /server_info); the
    # AR server has no selfspec worker to count
    shares = by_mode["sjd"]["levels"][0]["tokens_by_step_kind"]
    assert shares and shares.get("own", 0) > 0, shares
    assert all(lv["tokens_by_step_kind"] is None for lv in by_mode["ar"]["levels"])
    assert png.stat().st_size > 0


def test_the_prompt_sets_are_disjoint_and_fill_the_readme_levels():
    """A prompt asked twice lets every lookup method (NGRAM, context candidates) replay the first
    answer; the README's runs (levels 1, 4, 16, 32 with 32 prompts each) must fit every set, and
    nothing fitted on `tune` may be measured on `eval`."""
    from selfspec.prompts import SET_NAMES, load_prompt_set
    from selfspec.prompts import SPLIT_COUNT, split_prompts

    sets = {name: load_prompt_set(name) for name in SET_NAMES}
    for name, texts in sets.items():
        assert len(set(texts)) == len(texts), name
        assert sum(load.level_sizes([1, 4, 16, 32], 32)) <= len(texts), name
    assert not set(sets["tune"]) & set(sets["eval"])
    assert sets["tune"] == split_prompts("tune", SPLIT_COUNT)  # the committed files are the rule's output
    assert len(sets["humaneval"]) == 164 and sets["humaneval"][0].startswith("from typing import List")


def test_a_bad_prompt_set_is_named(tmp_path):
    from selfspec.prompts import load_prompt_set
    from selfspec.errors import UsageError

    with pytest.raises(UsageError, match="no such file.*tune, eval, humaneval"):
        load_prompt_set(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(UsageError, match="bad.jsonl:1"):
        load_prompt_set(str(bad))


# ------------------------------------------------------------------ bench/*.py scripts
def _bench_module(name: str):
    """bench/NAME.py, imported (the scripts are not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _context_lookup():
    return _bench_module("context_lookup")


def _runs_report(levels: dict[int, dict[str, float]]) -> dict:
    """A `bench serve` report with rows ar / ngram / isd: {C: {label: output tok/s}}."""
    labels = ("ar", "ngram", "isd")
    return {"concurrency": sorted(levels), "prompts_file": "eval", "temperature": 0.0,
            "results": [{"label": lab, "status": "ok", "levels": [
                {"concurrency": c, "output_tok_s": rates[lab], "tpf": 1.0} for c, rates in sorted(levels.items())]}
                for lab in labels]}


def test_median_table_takes_each_levels_median_over_the_runs_that_measured_it():
    """A level measured again on its own joins the full runs: its median is over the runs that
    have it, the other levels keep theirs, and the legend says how many runs each level has."""
    mt = _bench_module("median_table")
    full = [_runs_report({1: {"ar": 10, "ngram": 20, "isd": 30}, 32: {"ar": 10, "ngram": 20, "isd": x}})
            for x in (5, 6, 7)]
    alone = [_runs_report({32: {"ar": 10, "ngram": 20, "isd": x}}) for x in (40, 50, 60)]
    med = mt.cells(full[:1] + alone)
    assert med["isd"][1]["runs"] == 1 and med["isd"][1]["x_ngram"] == pytest.approx(1.5)
    assert med["isd"][32]["runs"] == 4 and med["isd"][32]["x_ngram"] == pytest.approx((2.0 + 2.5) / 2)
    assert mt.cells(full)["isd"][32]["x_ngram"] == pytest.approx(0.3)
    assert mt.cells(alone + full[:1])["isd"][1]["runs"] == 1  # whichever run comes first
    text = mt.table(full[:1] + alone, markdown=True)
    assert "C=1: 1, C=32: 4" in text and "| isd | " in text


def test_context_lookup_replays_what_each_drafter_commits():
    """A loop is copied by both drafters (up to their draft length + 1 a step); text that never
    repeats gets one token a step from either; the second request of a level also finds the
    first one's text (the corpus is shared, as a server's is)."""
    cl = _context_lookup()
    loop = ([10, 11, 12, 13], [5, 6, 7] * 40)
    fresh = ([20, 21, 22, 23], list(range(100, 220)))
    for drafter in (cl.NgramDrafter(), cl.SelfspecDrafter(8)):
        (res,) = cl.replay(drafter, [loop], [1], [1])
        assert res.tokens_per_step > 6, (drafter.name, res)
        assert res.non_loop == 0 and res.requests == 1
        # NGRAM always verifies its 12 tokens; ours the candidate it found + the root (none at first)
        assert res.query_tokens_per_step == 12 if drafter.name == "ngram" else 1 < res.query_tokens_per_step <= 9
    (res,) = cl.replay(cl.SelfspecDrafter(8), [fresh], [1], [1])
    assert res.tokens_per_step == 1.0 and res.non_loop == 1 and res.query_tokens_per_step == 1.0
    (first, second) = cl.replay(cl.SelfspecDrafter(8), [fresh, fresh], [1, 1], [1, 1])
    assert first.tokens_per_step == 1.0 and second.tokens_per_step > 6
    assert cl.committed_by([[1, 2, 9], [1, 5]], [1, 2, 3, 4]) == 3  # the best path's 2 + 1
    assert cl.committed_by([[1, 2, 3]], [1, 2]) == 2  # never past the output's end


def test_interleaved_levels_run_the_same_chunks_through_every_server_in_turn(monkeypatch, tmp_path):
    """--interleave: every server is up at once; a level's prompts run in rounds of at least C
    requests, each round through every server, forward then backward, and a level's numbers sum
    its rounds. A failed start leaves its row in error and the others running; all are stopped."""
    assert load.interleave_chunks(list("abcdefgh"), 4, 2) == [["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"]]
    assert load.interleave_chunks(list("abcdefgh"), 4, 3) == [["a", "b", "c", "d"], ["e", "f", "g", "h"]]
    assert load.interleave_chunks(list("abcd"), 3, 8) == [["a", "b", "c", "d"]]  # never under C a chunk
    assert load.round_order([1, 2, 3], 0) == [1, 2, 3] and load.round_order([1, 2, 3], 1) == [3, 2, 1]

    calls, stopped = [], []

    class FakeServer:
        def __init__(self, spec, log_path=None, startup_timeout=0):
            self.label = log_path.stem.removeprefix("server-")
            self.base_url, self.flags = f"http://{self.label}", spec.extra_args

        def start(self):
            if self.label == "broken":
                raise RuntimeError("no port")

        def stop(self):
            stopped.append(self.label)

    def fake_requests(base_url, prompts, concurrency, max_tokens, temperature, ignore_eos):
        if prompts != ["def warmup():\n"] * 2:
            calls.append((base_url.removeprefix("http://"), concurrency, tuple(prompts)))
        results = [_request(list(range(10)), 0.5, 4) for _ in prompts]
        return load.Chunk(results, [], 0.25 * len(prompts))

    monkeypatch.setattr(serve, "run_requests", fake_requests)
    monkeypatch.setattr(serve, "server_stats", lambda base_url: {})
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--modes", "ngram,broken=sjd", "--concurrency", "1,2", "--num-prompts", "4",
                              "--interleave", "2", "--genai-bench", "off"])
    modes = serve.parse_modes(args.modes)
    prompts = [f"p{i}" for i in range(8)]
    servers = []
    rows = serve._bench_interleaved(modes, args, tmp_path, prompts, [1, 2], tmp_path, False, 0,
                                    lambda *a, **k: servers.append(FakeServer(*a, **k)) or servers[-1], _Spec)
    assert all(s.flags[-1] == "--sleep-on-idle" for s in servers)  # an idle server leaves the cores alone
    assert [r["label"] for r in rows] == ["ar", "ngram", "broken"]
    assert rows[2]["status"] == "error" and "no port" in rows[2]["reason"]
    assert calls == [("ar", 1, ("p0", "p1")), ("ngram", 1, ("p0", "p1")),
                     ("ngram", 1, ("p2", "p3")), ("ar", 1, ("p2", "p3")),
                     ("ar", 2, ("p4", "p5")), ("ngram", 2, ("p4", "p5")),
                     ("ngram", 2, ("p6", "p7")), ("ar", 2, ("p6", "p7"))]
    for row in rows[:2]:
        assert [(lv["concurrency"], lv["requests"], lv["wall_s"]) for lv in row["levels"]] == [(1, 4, 1.0), (2, 4, 1.0)]
        assert row["levels"][0]["output_tok_s"] == 40.0 and row["levels"][0]["tpf"] == 40 / 20
    assert sorted(stopped) == ["ar", "broken", "ngram"]
    with pytest.raises(SystemExit, match="--interleave"):
        serve.run(parser.parse_args(["--modes", "ar", "--interleave", "-1"]))


def test_breakdown_rows_isolate_each_part_of_a_modes_default():
    """--breakdown: before each served selfspec mode, the same mode under each isolating policy
    (AR steps, lookup only, own steps only); AR and NGRAM get none. Each level reports which
    kind of step committed its tokens, from the server's counts."""
    from selfspec.benchmarks.modes import breakdown, parse_modes

    runs, extra = breakdown(parse_modes("ngram,isd,fast=sjd"))
    assert [r.label for r in runs] == ["ar", "ngram", "isd:ar-steps", "isd:lookup", "isd:own", "isd",
                                       "fast:ar-steps", "fast:lookup", "fast:own", "fast"]
    assert "isd:own=--selfspec-policy own" in extra and "fast:ar-steps=--selfspec-policy ar" in extra
    args = argparse.Namespace(mode_args=extra, lora=None, temperature=0.0, server_args="")
    flags, skip = serve._mode_extra(runs[4], args, None)
    assert skip is None and flags == ["--speculative-algorithm", "ISD", "--selfspec-policy", "own"]
    before = {"selfspec": {"steps_by_kind": {"own": {"tokens": 10}}}}
    after = {"selfspec": {"steps_by_kind": {"own": {"tokens": 40}, "lookup": {"tokens": 60}}}}
    assert load.kinds_delta(before, after) == {"own": 30, "lookup": 60}
    assert serve_report.step_kind_shares([{"own": 30, "lookup": 60}, None, {"ar": 10}]) == {"ar": 0.1, "lookup": 0.6,
                                                                                    "own": 0.3}
    assert serve_report.step_kind_shares([None]) is None and load.kinds_delta({}, {"selfspec": None}) is None


class _Spec:
    def __init__(self, model, port=None, extra_args=()):
        self.extra_args = list(extra_args)


def _bench_script(name: str):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module



def test_step_costs_reads_the_workers_step_timing_lines():
    """bench/step_costs.py parses what the worker logs under SELFSPEC_DEBUG_TIMING=1."""
    from selfspec.sglang_ext.worker import STEP_TIMING_LOG

    sc = _bench_module("step_costs")
    log = "\n".join("INFO " + STEP_TIMING_LOG % args for args in [
        (2, 3, 6, 3, 0.1, 8.0, 1.0, float("nan")), (2, 3, 6, 5, 0.2, 9.0, 1.2, 1.1), (1, 1, 1, 1, 0.1, 6.0, 0.3, 1.0)])
    steps = sc.parse_steps(log)
    assert sorted(steps) == [1, 2] and len(steps[2]) == 2
    row = sc.summarize(steps[2], 2)
    assert row["forward"] == 9.0 and row["period"] == pytest.approx(0.2 + 9.0 + 1.2 + 1.1)  # the first has no gap
    assert row["tokens_per_request_step"] == 2.0 and row["query_tokens_per_request"] == 3.0



def test_step_breakdown_reads_the_steps_of_a_full_batch():
    """bench/step_breakdown.py's table reads the scheduler's and the worker's per-step lines of
    at least `min_batch` requests (a burst's full batch, not its tail)."""
    from selfspec.sglang_ext.step_timing import SCHED_TIMING_LOG
    from selfspec.sglang_ext.worker import STEP_TIMING_LOG

    sb = _bench_module("step_breakdown")
    log = "\n".join(["INFO " + SCHED_TIMING_LOG % (bs, 1.0, run, 0.5, 0.2) for bs, run in ((32, 60.0), (30, 62.0), (3, 9.0))]
                    + ["INFO " + STEP_TIMING_LOG % (bs, 12, 300, 200, 5.0, fwd, 4.0, 1.0) for bs, fwd in ((32, 55.0), (2, 7.0))])
    full = sb.medians(log, min_batch=24)
    assert full["decode_steps"] == 2 and full["scheduler_ms"]["run"] == 61.0 and full["worker_ms"]["forward"] == 55.0
    assert sb.medians(log)["decode_steps"] == 3