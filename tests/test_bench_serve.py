"""`selfspec bench serve`: each mode behind a real SGLang server, AR as the reference."""

from __future__ import annotations

import copy
import argparse
import json

import pytest

from selfspec.benchmarks import serve


def test_level_prompts_rotate_through_the_file():
    texts = [str(i) for i in range(10)]
    sizes = [4, 4, 4]
    assert serve.level_prompts(texts, sizes, 0) == ["0", "1", "2", "3"]
    assert serve.level_prompts(texts, sizes, 1) == ["4", "5", "6", "7"]
    assert serve.level_prompts(texts, sizes, 2) == ["8", "9", "0", "1"]
    # a level holds at least C requests: "C=8" with 4 prompts a level would batch only 4
    assert serve.level_sizes([1, 4, 8], 4) == [4, 4, 8]
    assert serve.level_prompts(texts, [4, 4, 8], 2) == ["8", "9", "0", "1", "2", "3", "4", "5"]


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
    split = serve.loop_split(results, has_verify=True)
    assert split["repetition_loops"] == 1 and split["per_request_tok_s"] == pytest.approx(73 / 3.5)
    assert split["non_loop"] == {"outputs": 2, "tokens": 50, "forwards": 21, "tpf": 50 / 21, "wall_s": 2.5,
                                 "tokens_per_s": 20.0, "ratio_vs_ar": None}
    assert serve.loop_split(results, has_verify=False)["non_loop"]["tpf"] is None  # forwards unknown
    no_ids = serve.loop_split([dict(results[0], token_ids=None)], has_verify=True)
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
    assert serve.ngram_verifies_greedily("cpu")
    report = _report(0.7)
    serve.finish_report(report)
    ar, ngram = report["results"][0]["levels"][0], report["results"][1]["levels"][0]
    assert ar["ratio_vs_ar"] == 1.0 and ar["non_loop"]["ratio_vs_ar"] == 1.0
    assert ngram["ratio_vs_ar"] == 3.0 and ngram["non_loop"]["ratio_vs_ar"] == pytest.approx(1.5)
    assert report["results"][1]["notes"] == [serve.NGRAM_GREEDY_NOTE] and report["results"][0]["notes"] == []
    table = serve.format_table(report)
    ngram_row = next(line for line in table.splitlines() if line.startswith("ngram"))
    assert ngram_row.endswith("[NGRAM verifies greedily on this build]") and "1/2" in ngram_row
    assert "note (ngram): NGRAM verifies greedily" in table and "risd" in table and "NL xAR" in table
    greedy = _report(0.0)
    serve.finish_report(greedy)
    assert all(r["notes"] == [] for r in greedy["results"])
    wrapped = dict(_report(0.0), concurrency=[1, 4], num_prompts=32, prompts_available=48)  # level 2 wraps
    serve.finish_report(wrapped)
    assert wrapped["results"][1]["notes"] == [serve.NGRAM_REPEAT_NOTE] and wrapped["results"][0]["notes"] == []
    fits = dict(_report(0.0), concurrency=[1, 4], num_prompts=32, prompts_available=64)
    serve.finish_report(fits)
    assert fits["results"][1]["notes"] == []
    filled = dict(_report(0.0), concurrency=[1, 64], num_prompts=32, prompts_available=64)  # 32 + 64 requests
    serve.finish_report(filled)
    assert filled["results"][1]["notes"] == [serve.NGRAM_REPEAT_NOTE]


def test_tuner_predictions_sit_beside_the_rows_served_with_its_plan(tmp_path):
    from selfspec.benchmarks import predictions

    config = tmp_path / "tuned-isd.yaml"
    config.write_text("mode: ISD\n")
    stride3 = {"stride": 3, "context_tokens": 16}
    tune = {"schema": "selfspec.tune/v1", "modes": {"isd": {
        "config": str(config),
        "plan": {"greedy": [{"max_batch": 2, "mode": "isd", **stride3}, {"max_batch": None, "mode": "ar"}]},
        "candidates": [{"mode": "ar", "options": {}, "tokens_per_step": {"greedy": 1.0}},
                       {"mode": "isd", "options": stride3, "tokens_per_step": {"greedy": 4.0}}],
        "predicted": {"greedy": {"1": {"ar": 9.0, "stride=3,context_tokens=16": 25.0},
                                 "4": {"ar": 30.0, "stride=3,context_tokens=16": 20.0}}}}}}
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(tune))

    def level(c, tok_s, tpf=1.0, tpot=100.0):
        return {"concurrency": c, "output_tok_s": tok_s, "requests": 4, "tpot_ms_p50": tpot, "tpot_ms_p99": 2 * tpot,
                "tokens": 404, "tpf": tpf}

    report = {"temperature": 0.0, "results": [
        {"mode": "ar", "status": "ok", "levels": [level(1, 10.0), level(4, 25.0), level(3, 20.0), level(16, 28.0)]},
        {"mode": "isd", "status": "ok", "server_args": ["--selfspec-config", str(tmp_path / "." / config.name)],
         "levels": [level(1, 20.0, tpf=404 / 204, tpot=80.0), level(4, 30.0)]},  # C=1: 2 tokens per decode step
        {"mode": "isd", "status": "ok", "server_args": [], "levels": [level(1, 15.0)]}]}  # not the tuned plan
    for row in report["results"]:  # as finish_report sets it before the predictions attach
        for lv in row["levels"]:
            lv["ratio_vs_ar"] = lv["output_tok_s"] / {1: 10.0, 4: 25.0}[lv["concurrency"]] if row["mode"] != "ar" else 1.0
    predictions.attach(report, predictions.load(path))
    ar, tuned, fixed = (r["levels"] for r in report["results"])
    # batch 3 is not on the tuner's grid; C=16 with 4 requests is a batch of 4
    assert [lv["predicted_tok_s"] for lv in ar] == [9.0, 30.0, None, 30.0]
    assert ar[0]["prediction_error"] == pytest.approx(-0.1) and ar[2]["prediction_error"] is None
    assert ar[0]["step_error"] == pytest.approx(100.0 / (1e3 / 9.0) - 1)  # AR: one token per step
    assert [lv["predicted_tok_s"] for lv in tuned] == [25.0, 30.0]  # the plan's bucket at each batch
    assert tuned[1]["prediction_error"] == pytest.approx(0.0)
    # 2 tokens per step served at TPOT 80 ms: a 160 ms step where the tuner priced 4 tokens at 25 tok/s
    assert tuned[0]["prediction_error"] == pytest.approx(0.25)
    assert tuned[0]["step_error"] == pytest.approx(160.0 / 160.0 - 1)
    assert "predicted_tok_s" not in fixed[0]
    # the speed-up over AR: predicted 25 / 9 at batch 1, measured 20 / 10 in the same run
    assert "speedup_error" not in ar[0]
    assert tuned[0]["predicted_speedup"] == pytest.approx(25.0 / 9.0)
    assert tuned[0]["speedup_error"] == pytest.approx((25.0 / 9.0) / 2.0 - 1)
    assert tuned[1]["speedup_error"] == pytest.approx((30.0 / 30.0) / (30.0 / 25.0) - 1)
    # rows record the plan they served; a plan the tune did not write (the file since re-tuned,
    # or a copy of it elsewhere) is matched by content, not by the path
    report["results"][1]["selfspec_plan"] = predictions.served_plan(report["results"][1]["server_args"])
    assert report["results"][1]["selfspec_plan"] is None  # the config file holds no plan
    planned = tmp_path / "planned.yaml"
    planned.write_text("mode: ISD\nplan:\n  greedy:\n  - {max_batch: null, mode: ar}\n")
    assert predictions.served_plan(["--selfspec-config", str(planned)]) == {"greedy": [{"max_batch": None, "mode": "ar"}]}
    predictions.attach(report, predictions.load(path))
    assert "predicted_tok_s" not in tuned[0] and "speedup_error" not in tuned[0]  # stale values cleared
    report["results"][1]["selfspec_plan"] = copy.deepcopy(tune["modes"]["isd"]["plan"])
    report["results"][2]["selfspec_plan"] = copy.deepcopy(tune["modes"]["isd"]["plan"])  # a copy elsewhere
    predictions.attach(report, predictions.load(path))
    assert report["results"][1]["levels"][0]["predicted_tok_s"] == 25.0
    assert report["results"][2]["levels"][0]["predicted_tok_s"] == 25.0
    # a bucket the tuner never measured (a hand-edited plan) gets no prediction, not an error
    tune["modes"]["isd"]["plan"]["greedy"][0]["stride"] = 4
    path.write_text(json.dumps(tune))
    predictions.attach(report, predictions.load(path))
    assert "predicted_tok_s" not in report["results"][1]["levels"][0]  # served stride 3: not this plan
    report["results"][1]["selfspec_plan"] = copy.deepcopy(tune["modes"]["isd"]["plan"])
    predictions.attach(report, predictions.load(path))
    assert report["results"][1]["levels"][0]["predicted_tok_s"] is None
    assert report["results"][1]["levels"][0]["step_error"] is None
    assert "xAR err" in serve.format_table({"temperature": 0.0, "results": [dict(r, reason=None, notes=[])
                                                                             for r in report["results"][:1]]})
    path.write_text(json.dumps({"schema": "selfspec.bench.serve/v1"}))
    with pytest.raises(SystemExit, match="not a `selfspec tune --json` report"):
        predictions.load(path)


def test_a_tune_with_per_prompt_acceptance_predicts_the_level_replayed(tmp_path):
    """With the tune's per-prompt records (and the report's max_tokens), a level's prediction is
    the level replayed (`tuning/level.py`): a looping prompt finishes first and the other runs on
    alone; the steady batch's prediction stays beside it."""
    from selfspec.benchmarks import predictions

    lookup = {"mode": "ngram", "options": {"num_draft": 12}, "width": 13, "tokens_per_step": {"greedy": 200 / 110},
              "per_request": {"greedy": [[100, 10, 130], [100, 100, 1300]]}}
    ar = {"mode": "ar", "options": {}, "width": 1, "tokens_per_step": {"greedy": 1.0},
          "per_request": {"greedy": [[100, 100, 100], [100, 100, 100]]}}
    plan = {"greedy": [{"max_batch": None, "mode": "ngram", "num_draft": 12}]}
    tune = {"schema": "selfspec.tune/v1", "costs": {"batch_sizes": [1, 2], "widths": [1, 16], "ms": [[10, 10], [10, 10]]},
            "modes": {"isd": {"config": "x.yaml", "plan": plan, "candidates": [ar, lookup],
                              "step_overhead": {"greedy": {"ar_ms": {"1": 0.0}}},
                              "predicted": {"greedy": {"2": {"ar": 200.0, "lookup=12": 364.0}}}}}}
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(tune))
    level = {"concurrency": 2, "output_tok_s": 180.0, "requests": 2, "ratio_vs_ar": 1.0}
    report = {"temperature": 0.0, "max_tokens": 100, "results": [
        {"mode": "ar", "status": "ok", "levels": [dict(level)]},
        {"mode": "isd", "status": "ok", "selfspec_plan": plan, "levels": [dict(level, ratio_vs_ar=1.0)]}]}
    predictions.attach(report, predictions.load(path))
    ar_lv, isd_lv = (r["levels"][0] for r in report["results"])
    assert ar_lv["predicted_tok_s"] == pytest.approx(200.0)  # 2 x 1 token per 10 ms step
    assert isd_lv["predicted_tok_s"] == pytest.approx(200.0) and isd_lv["predicted_steady_tok_s"] == 364.0
    assert isd_lv["prediction_error"] == pytest.approx(200.0 / 180.0 - 1)
    assert isd_lv["predicted_speedup"] == pytest.approx(1.0)
    # a mode whose calibration priced every step 10 ms dearer: its speed-up is over AR steps
    # priced alike (its own AR replay, 100 tok/s), not over the first mode's AR (200 tok/s)
    tune["modes"]["sjd"] = dict(tune["modes"]["isd"], step_overhead={"greedy": {"ar_ms": {"1": 10.0}}})
    path.write_text(json.dumps(tune))
    report["results"].append({"mode": "sjd", "status": "ok", "selfspec_plan": plan, "levels": [dict(level)]})
    predictions.attach(report, predictions.load(path))
    sjd_lv = report["results"][2]["levels"][0]
    assert sjd_lv["predicted_tok_s"] == pytest.approx(100.0) and sjd_lv["predicted_ar_tok_s"] == pytest.approx(100.0)
    assert sjd_lv["predicted_speedup"] == pytest.approx(1.0)
    # a tune that timed the stock AR server (its steps 15 ms at batch 2): the AR row and every
    # mode's speed-up are priced by it, the plans by their own calibration
    tune["stock_ar"] = {"step_overhead": {"greedy": {"ar_ms": {"1": 5.0}}}}
    path.write_text(json.dumps(tune))
    predictions.attach(report, predictions.load(path))
    ar_lv, isd_lv, sjd_lv = (r["levels"][0] for r in report["results"])
    assert ar_lv["predicted_tok_s"] == pytest.approx(2e3 / 15)
    assert isd_lv["predicted_tok_s"] == pytest.approx(200.0) and sjd_lv["predicted_tok_s"] == pytest.approx(100.0)
    assert isd_lv["predicted_speedup"] == pytest.approx(1.5) and sjd_lv["predicted_speedup"] == pytest.approx(0.75)
    del report["max_tokens"]  # an older report: the steady prediction
    predictions.attach(report, predictions.load(path))
    assert report["results"][1]["levels"][0]["predicted_tok_s"] == 364.0


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
    assert png.stat().st_size > 0


def test_the_committed_prompts_never_repeat_and_fill_the_readme_levels():
    """A prompt asked twice lets every lookup method (NGRAM, context candidates) replay the first
    answer; the README's runs (levels 1, 4, 16, 32 with 16 prompts each, C=32 filled) must fit."""
    texts = serve.load_prompt_texts(serve.Path(serve.__file__).resolve().parents[2] / "bench" / "prompts" / "heldout.jsonl")
    assert len(set(texts)) == len(texts)
    assert sum(serve.level_sizes([1, 4, 16, 32], 16)) <= len(texts)


# ------------------------------------------------------------------ bench/context_lookup.py
def _context_lookup():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "context_lookup.py"
    spec = importlib.util.spec_from_file_location("context_lookup", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


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
    assert serve.interleave_chunks(list("abcdefgh"), 4, 2) == [["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"]]
    assert serve.interleave_chunks(list("abcdefgh"), 4, 3) == [["a", "b", "c", "d"], ["e", "f", "g", "h"]]
    assert serve.interleave_chunks(list("abcd"), 3, 8) == [["a", "b", "c", "d"]]  # never under C a chunk
    assert serve.round_order([1, 2, 3], 0) == [1, 2, 3] and serve.round_order([1, 2, 3], 1) == [3, 2, 1]

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
        return serve.Chunk(results, [], 0.25 * len(prompts))

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


def test_abba_table_pools_interleaved_runs_and_spreads_their_ratios():
    """Two interleaved runs: a label's rows are its runs (means), and the spread is of each run's
    ratio to its own AR: the machine drifted 2x between the runs, the mode's lead did not move."""
    abba = _bench_script("abba_table")

    def run(ar: float, isd: float) -> dict:
        def row(label, tok_s):
            return {"mode": label, "label": label, "status": "ok",
                    "levels": [{"concurrency": 1, "output_tok_s": tok_s, "tpf": 2.0, "non_loop": None}]}
        return {"interleave": 2, "results": [row("ar", ar), row("isd", isd)]}

    first, second = run(100.0, 150.0), run(200.0, 300.0)
    pooled = abba.abba_means(dict(first, results=first["results"] + second["results"]))
    assert pooled["isd"][1]["tok_s"] == 225.0 and pooled["isd"][1]["runs"] == 2
    assert pooled["isd"][1]["spread"] == 0.0 and pooled["ar"][1]["spread"] == pytest.approx(2 / 3)
    assert abba.abba_means(first)["isd"][1]["spread"] is None  # one run: no spread to show
    assert "| 100 |" in abba.markdown(first)


def test_abba_table_plots_each_row_over_ar(tmp_path):
    abba = _bench_script("abba_table")

    def row(label, tok_s):
        return {"mode": label, "label": label, "status": "ok",
                "levels": [{"concurrency": c, "output_tok_s": tok_s * c, "tpf": 1.0, "non_loop": None} for c in (1, 4)]}

    report = {"model": "m", "temperature": 0.0, "results": [row("ar", 100.0), row("isd-tuned", 150.0), row("lookup4", 90.0)]}
    out = tmp_path / "levels.png"
    assert abba.plot(report, str(out)) == ["ar", "isd-tuned", "lookup4"]
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
