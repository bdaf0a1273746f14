"""Served benchmark: each mode behind a real SGLang server, driven like users drive it. This
module runs the servers and the levels; `load.py` sends the requests, `serve_report.py` makes
the report, `genai.py` drives genai-bench.

    selfspec bench serve --modes ar,ngram,isd,risd,jacobi,sjd --model M --concurrency 1,4,16 \\
        --prompts FILE.jsonl [--max-tokens 64] [--json OUT] [--plot OUT.png]

For every mode in turn (AR first: it is the reference) one server is started
(`selfspec.serving.ServerProcess`; on a machine without CUDA the CPU flags are added), then the
prompts are sent through the OpenAI client at each concurrency level (a closed loop of C
workers, streaming, so time to first token and time per output token are measured per request).
SGLang's builtin draft-free NGRAM is the mode users would otherwise pick, so it runs beside AR.
With genai-bench installed (`--genai-bench auto`, the default) the same server is also measured
by genai-bench at the same concurrencies (synthetic D(input, output) traffic), the load
generator users run; its headline numbers are stored beside ours.

With `--interleave ROUNDS` every mode's server is up at once instead (the idle ones asleep), and
each level's prompts are cut into ROUNDS chunks that run through every server in turn, forward
then backward: the modes meet the same drift of a shared machine (10-30% over minutes on the
2-core VM, more than the gaps between modes) instead of each meeting its own.

Reported per mode and concurrency: output tokens/s (all requests' completion tokens over the
wall time of the level), TPOT p50 / p99 (per request: (end - first token) / (tokens - 1)),
TTFT p50, TPF (tokens per forward, prefill included: completion tokens / (decode forwards + 1),
from the response's speculative details, or the server's aggregate), and the ratio of output
tokens/s to AR's at the same concurrency measured in the same run. The same numbers are reported
for the requests whose output does not end in a repetition loop (`non_loop`; the output token ids
come back with the response, and which requests loop is decided per mode from that mode's own
outputs, see `repetition.py`): their TPF (their tokens / (their verify forwards + 1)) and their
tokens/s, a per-request rate (their tokens over the sum of their own latencies), compared with
AR's non-looping requests at the same concurrency; `per_request_tok_s` is that rate over all
requests. Where a baseline cannot honour a setting the mode's row says so (`notes`): SGLang's
builtin NGRAM verifies by argmax on CPU even when a temperature is set (`ngram_verifies_greedily`).

JSON (`schema` "selfspec.bench.serve/v1"; keys are only ever added):

    {"schema": ..., "model": str, "prompts_file": str, "num_prompts": int, "prompts_available": int,
     "max_tokens": int, "interleave": int,                    # ROUNDS, 0: one server at a time
     "temperature": float, "concurrency": [int], "device": "cpu" | "cuda", "genai_bench": bool,
     "results": [{"mode": str, "status": "ok" | "skipped" | "error", "reason": str | null,
                  "server_args": [str], "startup_s": float,
                  "selfspec_plan": dict | null,                # the plan the server runs (its policy's or file's)
                  "selfspec_policy": str | null,               # the built-in policy, or null: a plan file
                  "levels": [{"concurrency": int, "requests": int, "tokens": int, "wall_s": float,
                              "output_tok_s": float, "tpot_ms_p50": float, "tpot_ms_p99": float,
                              "ttft_ms_p50": float, "tpf": float | null, "ratio_vs_ar": float | null,
                              "tokens_by_step_kind": {"own" | "lookup" | "ar": share} | null,  # selfspec rows
                              "errors": int, "round_tok_s": [float],  # per chunk (one per round)
                              "genai_bench": {"output_tok_s": float, "tpot_ms_p50": float, ...} | null,
                              "per_request_tok_s": float,     # tokens / sum of request latencies
                              "repetition_loops": int | null, # requests whose output ends in a loop
                              "non_loop": {"outputs": int,    # requests that do not loop
                                           "tokens": int, "forwards": int | null, "tpf": float | null,
                                           "wall_s": float | null,  # sum of their latencies
                                           "tokens_per_s": float | null,  # tokens / wall_s
                                           "ratio_vs_ar": float | null}  # over AR's, same concurrency
                                          | null,             # null: the server returned no token ids
                             }],
                  "notes": [str]}]}                           # e.g. NGRAM's greedy verify under sampling
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from selfspec.benchmarks.genai import genai_bench_available, run_genai_bench
from selfspec.benchmarks.load import (Chunk, interleave_chunks, kinds_delta, level_prompts, level_sizes, round_order,
                                      run_requests, server_stats, stats_delta, summarize_level)
from selfspec.benchmarks.modes import ModeRun, breakdown, parse_modes
from selfspec.benchmarks.serve_report import finish_report, format_table, plot, step_kind_shares
from selfspec.prompts import describe as describe_prompts, load_prompt_set


SCHEMA = "selfspec.bench.serve/v1"
DEFAULT_MODES = "ar,ngram,isd,risd,jacobi,sjd"
def mode_server_args(mode: str) -> list[str]:
    """The SGLang flags that serve `mode`: the plugin's algorithm, SGLang's builtin (NGRAM), or none (AR)."""
    from selfspec.decoding import registry

    spec = registry.get(mode)
    algorithm = spec.sglang_algorithm or spec.builtin_sglang_algorithm
    return ["--speculative-algorithm", algorithm] if algorithm else []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"comma-separated modes (default {DEFAULT_MODES}); ar always runs first; LABEL=MODE adds "
                        "a variant of a mode under its own name (its flags: --mode-args 'LABEL=...')")
    parser.add_argument("--model", default="tiny-base", help="embedded model name or checkpoint directory")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrency levels")
    parser.add_argument("--prompts", default="eval",
                        help="a prompt set: eval (default; what reported numbers use), tune (what plans and constants are "
                        "fitted on), humaneval (HumanEval's 164 prompts), external (160 prompts of networkx, code the models never "
                        "saw), or a JSON-lines file of {\"prompt\": text}")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts sent per concurrency level (at least C at level C: a "
                        "level always fills its concurrency)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (JACOBI is greedy only)")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max_tokens tokens")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="throughput-versus-latency plot")
    parser.add_argument("--lora", default=None, metavar="DIR",
                        help="RISD adapter (default: the checkpoint's selfspec.json; without one RISD is skipped)")
    parser.add_argument("--mode-args", action="append", default=[], metavar="MODE=ARGS",
                        help="extra SGLang/selfspec flags for one mode, e.g. --mode-args 'isd=--selfspec-stride 3' "
                        "(repeatable)")
    parser.add_argument("--server-args", default="", metavar="ARGS", help="extra SGLang flags for every server")
    parser.add_argument("--genai-bench", choices=("auto", "on", "off"), default="auto",
                        help="also measure with genai-bench (auto: when installed)")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="without CUDA: OpenMP threads per server process (default 1; more threads that "
                        "wait on each other slow a small shared machine down)")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", default=None, help="keep server and genai-bench logs here")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="keep every mode's server up at once (idle ones asleep) and run each level's prompts in "
                        "ROUNDS chunks, every chunk through every server in turn (order reversed on odd rounds): the "
                        "modes meet the same drift of a shared machine. 0 (default): one server at a time")
    parser.add_argument("--breakdown", action="store_true",
                        help="before each selfspec mode (served at its default policy) add the rows that say where its "
                        "speed comes from, each the same server with one --selfspec-policy: MODE:ar-steps (plain AR "
                        "steps on the selfspec worker, against stock AR), MODE:lookup (lookup steps only), MODE:own "
                        "(the mode's own steps only, no context candidate)")


def _mode_extra(run: ModeRun, args, model_dir: Path) -> tuple[list[str] | None, str | None]:
    from selfspec.decoding import registry

    spec = registry.get(run.mode)
    extra = mode_server_args(run.mode)
    for entry in args.mode_args:
        name, _, rest = entry.partition("=")
        if name.strip().lower() == run.label:
            extra += shlex.split(rest)
    if spec.needs_adapter and "--selfspec-lora" not in extra:
        lora = args.lora
        if lora is None:
            from selfspec.checkpoints.metadata import load_metadata

            meta = load_metadata(model_dir)
            lora = meta.adapter_path if meta is not None else None
        if lora is None:
            return None, "no RISD adapter: pass --lora DIR or name one in the checkpoint's selfspec.json"
        extra += ["--selfspec-lora", str(lora)]
    if spec.greedy_only and args.temperature > 0:
        return None, f"{spec.name.upper()} is greedy only (temperature > 0 requested)"
    return extra + shlex.split(args.server_args), None


def run(args: argparse.Namespace) -> int:
    from selfspec.models import resolve_with_adapter
    from selfspec.serving import ServerProcess, ServerSpec, cuda_available, server_threads

    try:
        modes = parse_modes(args.modes)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.breakdown:
        modes, extra_args = breakdown(modes)
        args.mode_args = extra_args + list(args.mode_args)
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    if args.interleave < 0:
        raise SystemExit(f"--interleave {args.interleave}: give the number of rounds (>= 1), or 0 for one server at a time")
    model_dir, adapter = resolve_with_adapter(args.model)  # an adapter-only model: its base, and RISD's adapter
    if adapter is not None and args.lora is None:
        args.lora = str(adapter)
    all_prompts = load_prompt_set(args.prompts)
    prompts = level_prompts(all_prompts, [args.num_prompts], 0)
    sent = sum(level_sizes(levels, args.num_prompts))
    if sent > len(all_prompts):
        print(f"[bench serve] warning: the levels send {sent} requests but --prompts {args.prompts} holds "
              f"{len(all_prompts)}: later levels reuse prompts, and every row that keeps a corpus of what it "
              "served (NGRAM, the selfspec modes) drafts their earlier answers there", file=sys.stderr)
    use_genai = args.genai_bench == "on" or (args.genai_bench == "auto" and genai_bench_available())
    if args.genai_bench == "on" and not genai_bench_available():
        raise SystemExit("--genai-bench on, but genai-bench is not installed (pip install genai-bench)")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="selfspec-bench-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    gpu = cuda_available()
    input_tokens = _mean_prompt_tokens(model_dir, prompts) if use_genai else 0

    report: dict[str, Any] = {
        "schema": SCHEMA, "model": str(model_dir), "prompts_file": describe_prompts(args.prompts), "num_prompts": len(prompts),
        "prompts_available": len(all_prompts),
        "max_tokens": args.max_tokens, "temperature": args.temperature, "concurrency": levels,
        "device": "cuda" if gpu else "cpu", "genai_bench": use_genai, "log_dir": str(log_dir), "results": [],
    }
    report["interleave"] = args.interleave
    with server_threads(None if gpu else args.cpu_threads):
        if args.interleave:
            report["results"] = _bench_interleaved(modes, args, model_dir, all_prompts, levels, log_dir, use_genai,
                                                   input_tokens, ServerProcess, ServerSpec)
        else:
            for mode in modes:
                report["results"].append(_bench_mode(mode, args, model_dir, all_prompts, levels, log_dir,
                                                     use_genai, input_tokens, ServerProcess, ServerSpec))

    finish_report(report)
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 1 if any(r["status"] == "error" for r in report["results"]) else 0


def _mean_prompt_tokens(model_dir: Path, prompts: list[str]) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return int(round(statistics.mean(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)))


def _start_row(run: ModeRun, args, model_dir, log_dir, ServerProcess, ServerSpec,
               flags: tuple[str, ...] = ()) -> tuple[dict, Any]:
    """A mode's report row and its started, warmed-up server (None where the row is skipped or its
    server did not start: the row says why)."""
    mode, label = run.mode, run.label
    extra, skip = _mode_extra(run, args, model_dir)
    row: dict[str, Any] = {"mode": mode, "label": label, "status": "ok", "reason": None, "server_args": extra or [], "levels": [],
                           "notes": [], "selfspec_plan": None, "selfspec_policy": None}
    if skip:
        row.update(status="skipped", reason=skip)
        print(f"[bench serve] {label}: skipped ({skip})", file=sys.stderr)
        return row, None
    log = log_dir / f"server-{label}.log"
    proc = ServerProcess(ServerSpec(str(model_dir), port=None, extra_args=extra + list(flags)), log_path=log,
                         startup_timeout=args.startup_timeout)
    t0 = time.perf_counter()
    try:
        proc.start()
        row["startup_s"] = time.perf_counter() - t0
        run_requests(proc.base_url, ["def warmup():\n"] * 2, 1, min(8, args.max_tokens), args.temperature,
                     False)  # warm-up
        served = server_stats(proc.base_url).get("selfspec") or {}
        row.update(selfspec_plan=served.get("plan"), selfspec_policy=served.get("policy"))
    except Exception as e:
        tail = log.read_text()[-3000:] if log.exists() else ""
        row.update(status="error", reason=f"server did not start: {e}\n{tail}")
        print(f"[bench serve] {label}: server did not start; see {log}", file=sys.stderr)
        proc.stop()
        return row, None
    return row, proc


def _timed_chunk(proc, prompts: list[str], concurrency: int, args) -> Chunk:
    before = server_stats(proc.base_url)
    chunk = run_requests(proc.base_url, prompts, concurrency, args.max_tokens, args.temperature, args.ignore_eos)
    after = server_stats(proc.base_url)
    chunk.stats, chunk.kinds = stats_delta(before, after), kinds_delta(before, after)
    return chunk


def _level_row(mode: str, label: str, concurrency: int, chunks: list[Chunk]) -> dict:
    lv = summarize_level(concurrency, chunks)
    if "tpf" not in lv:  # no per-request details: the server's own counts, or AR's one forward a token
        counted = [ch.stats for ch in chunks if ch.stats is not None]
        forwards = sum(f for _, f in counted)
        lv["tpf"] = 1.0 if mode == "ar" else (sum(c for c, _ in counted) / forwards if forwards > 0 else None)
        if mode == "ar" and lv["non_loop"] and lv["non_loop"]["outputs"]:
            lv["non_loop"].update(forwards=lv["non_loop"]["tokens"], tpf=1.0)
    lv["genai_bench"] = None
    lv["tokens_by_step_kind"] = step_kind_shares([ch.kinds for ch in chunks])
    kinds = " ".join(f"{k} {v:.0%}" for k, v in (lv["tokens_by_step_kind"] or {}).items())
    print(f"[bench serve] {label:6s} C={concurrency:<3d} {lv['output_tok_s']:8.1f} tok/s  TPOT p50 "
          f"{lv['tpot_ms_p50']:7.1f} ms  TPF {lv['tpf'] if lv['tpf'] is not None else float('nan'):.2f}"
          f"{'  tokens from ' + kinds if kinds else ''}", file=sys.stderr)
    return lv


def _add_genai_bench(row: dict, proc, args, model_dir, levels, log_dir, input_tokens) -> None:
    try:
        gb = run_genai_bench(proc.base_url, str(model_dir), levels, input_tokens, args.max_tokens,
                             args.num_prompts, log_dir / f"genai-bench-{row['label']}")
        for lv in row["levels"]:
            lv["genai_bench"] = gb.get(lv["concurrency"])
    except Exception as e:  # genai-bench is a second opinion; never fail the run on it
        row["genai_bench_error"] = repr(e)


def _bench_mode(run: ModeRun, args, model_dir, all_prompts, levels, log_dir, use_genai, input_tokens,
                ServerProcess, ServerSpec) -> dict:
    row, proc = _start_row(run, args, model_dir, log_dir, ServerProcess, ServerSpec)
    if proc is None:
        return row
    try:
        for i, c in enumerate(levels):
            prompts = level_prompts(all_prompts, level_sizes(levels, args.num_prompts), i)
            row["levels"].append(_level_row(run.mode, run.label, c, [_timed_chunk(proc, prompts, c, args)]))
        if use_genai:
            _add_genai_bench(row, proc, args, model_dir, levels, log_dir, input_tokens)
    except Exception as e:
        row.update(status="error", reason=repr(e))
    finally:
        proc.stop()
    return row


#: what one idle tiny-model server holds (its three processes' resident memory, fewer pages shared)
SERVER_MEMORY_GIB = 2.5


def _check_interleave_memory(modes: list[ModeRun]) -> None:
    import psutil

    need = len(modes) * SERVER_MEMORY_GIB
    free = psutil.virtual_memory().available / 2**30
    if need > free:
        raise SystemExit(f"--interleave keeps every mode's server up at once: {len(modes)} servers need about "
                         f"{need:.0f} GiB, {free:.0f} GiB is available. Run fewer --modes (ABBA labels are not needed "
                         f"with --interleave), or drop --interleave to serve one mode at a time.")


def _bench_interleaved(modes: list[ModeRun], args, model_dir, all_prompts, levels, log_dir, use_genai,
                       input_tokens, ServerProcess, ServerSpec) -> list[dict]:
    """Every mode's server up at once (idle ones asleep, `--sleep-on-idle`); each level's prompts
    run in `args.interleave` rounds, each round's chunk through every server in turn. A shared
    machine drifts by 10-30% over minutes; run this way every mode meets the same drift."""
    _check_interleave_memory(modes)
    started = []
    try:
        for run in modes:
            started.append(_start_row(run, args, model_dir, log_dir, ServerProcess, ServerSpec, ("--sleep-on-idle",)))
        live = [(row, proc) for row, proc in started if proc is not None]
        for i, c in enumerate(levels):
            prompts = level_prompts(all_prompts, level_sizes(levels, args.num_prompts), i)
            chunks: dict[str, list[Chunk]] = {row["label"]: [] for row, _ in live}
            for r, part in enumerate(interleave_chunks(prompts, args.interleave, c)):
                for row, proc in round_order(live, r):
                    chunks[row["label"]].append(_timed_chunk(proc, part, c, args))
            for row, _ in live:
                row["levels"].append(_level_row(row["mode"], row["label"], c, chunks[row["label"]]))
        if use_genai:
            for row, proc in live:
                _add_genai_bench(row, proc, args, model_dir, levels, log_dir, input_tokens)
    finally:
        for _, proc in started:
            if proc is not None:
                proc.stop()
    return [row for row, _ in started]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="selfspec bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
