"""Served benchmark: each mode behind a real SGLang server, driven like users drive it.

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
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfspec.benchmarks.modes import ModeRun, breakdown, parse_modes
from selfspec.prompt_sets import describe as describe_prompts, load_prompt_set

from selfspec.decoding.repetition import OutputStat, non_loop_summary, set_ratio_vs_ar

SCHEMA = "selfspec.bench.serve/v1"
DEFAULT_MODES = "ar,ngram,isd,risd,jacobi,sjd"
NGRAM_GREEDY_NOTE = ("NGRAM verifies greedily on this build: its sampled rows are argmax outputs (every token "
                     "after the first is the target's argmax, whatever the temperature)")


REPEAT_NOTE = ("this server saw these prompts at an earlier level: the levels' windows wrap around the prompt "
               "set, and its n-gram corpus keeps every earlier output, so it drafts what it already wrote (keep "
               "the levels' requests, each max(--num-prompts, C), within the set's prompts)")


def ngram_verifies_greedily(device: str) -> bool:
    """Whether SGLang's builtin NGRAM commits argmax tokens even at temperature > 0 on `device`.

    SGLang 0.5.23: the NGRAM worker verifies with `eagle_sample` (speculative/ngram_worker.py:27,
    :479), which takes the greedy tree walk on argmax targets when `_verify_uses_greedy(...)` holds
    (speculative/eagle_utils.py:641-660), and that is `is_all_greedy or is_cpu or is_xpu or (is_hip and
    not use_rejection_sampling)` (eagle_utils.py:500): on the CPU engine (SGLANG_USE_CPU_ENGINE=1,
    what `ServerProcess` starts without CUDA) every request is verified by argmax. On ROCm too
    (NGRAM has no draft distribution for rejection sampling)."""
    if device == "cpu":
        return True
    try:
        import torch

        return getattr(torch.version, "hip", None) is not None
    except ImportError:
        return False


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
                        "fitted on), humaneval (HumanEval's 164 prompts), or a JSON-lines file of {\"prompt\": text}")
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


# ---------------------------------------------------------------------------------- one level
def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _one_request(client, prompt: str, max_tokens: int, temperature: float, ignore_eos: bool) -> dict:
    t0 = time.perf_counter()
    first = None
    tokens = None
    details = None
    token_ids: list[int] = []
    extra = {"return_spec_tokens_details": True, "return_token_ids": True}
    if ignore_eos:
        extra["ignore_eos"] = True
    stream = client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                       stream=True, stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.choices:
            choice = chunk.choices[0]
            ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
            if ids:
                token_ids.extend(int(t) for t in ids)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        d = getattr(chunk, "sglext", None) or (chunk.model_extra or {}).get("sglext")
        if d:
            details = d
    end = time.perf_counter()
    first = first or end
    n = int(tokens or 0)
    out = {"e2e": end - t0, "ttft": first - t0, "tokens": n, "token_ids": token_ids if token_ids or not n else None,
           "tpot": (end - first) / (n - 1) if n > 1 else float("nan")}
    spec = None
    if isinstance(details, dict):
        spec = details.get("spec_tokens_details") or details
    if isinstance(spec, dict) and spec.get("spec_verify_ct"):
        out["verify_ct"] = int(spec["spec_verify_ct"])
    return out


def server_stats(base_url: str) -> dict:
    try:
        with urllib.request.urlopen(base_url + "/server_info", timeout=30) as r:
            st = (json.loads(r.read()).get("internal_states") or [{}])[0]
    except Exception:
        return {}
    return {"selfspec": st.get("selfspec"), "avg_spec_accept_length": st.get("avg_spec_accept_length")}


@dataclass
class Chunk:
    """One closed-loop pass of some prompts through a server: what each request returned."""
    results: list[dict]
    errors: list[str]
    wall_s: float
    stats: tuple[int, int] | None = None  # (committed tokens, forwards) the server counted meanwhile
    kinds: dict[str, int] | None = None  # tokens committed meanwhile by each kind of step (own, lookup, ar)


def run_requests(base_url: str, prompts: list[str], concurrency: int, max_tokens: int, temperature: float,
                 ignore_eos: bool) -> Chunk:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=3600)
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    queue = list(prompts)

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                p = queue.pop(0)
            try:
                r = _one_request(client, p, max_tokens, temperature, ignore_eos)
                with lock:
                    results.append(r)
            except Exception as e:  # recorded, the level continues
                with lock:
                    errors.append(repr(e))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        for _ in range(concurrency):
            ex.submit(worker)
    return Chunk(results, errors, time.perf_counter() - t0)


def summarize_level(concurrency: int, chunks: list[Chunk]) -> dict:
    """One level's numbers from the chunks it ran in (one, or one per round of `--interleave`):
    tokens over the summed wall time, latency percentiles over every request."""
    results = [r for ch in chunks for r in ch.results]
    errors = [e for ch in chunks for e in ch.errors]
    wall = sum(ch.wall_s for ch in chunks)
    tokens = sum(r["tokens"] for r in results)
    tpots = [r["tpot"] * 1e3 for r in results if r["tpot"] == r["tpot"]]
    level = {
        "concurrency": concurrency, "requests": len(results), "tokens": tokens, "wall_s": wall,
        "output_tok_s": tokens / wall if wall > 0 else 0.0,
        "tpot_ms_p50": _percentile(tpots, 0.5), "tpot_ms_p99": _percentile(tpots, 0.99),
        "ttft_ms_p50": _percentile([r["ttft"] * 1e3 for r in results], 0.5),
        "errors": len(errors), "first_error": errors[0] if errors else None,
        # each chunk's own rate: how far the rounds of an interleaved level disagree
        "round_tok_s": [sum(r["tokens"] for r in ch.results) / ch.wall_s if ch.wall_s > 0 else 0.0 for ch in chunks],
    }
    has_verify = any("verify_ct" in r for r in results)  # a request that ended at its prefill reports no details
    if has_verify:
        level["tpf"] = tokens / sum(r.get("verify_ct", 0) + 1 for r in results)
    level.update(loop_split(results, has_verify))
    return level


def run_level(base_url: str, prompts: list[str], concurrency: int, max_tokens: int, temperature: float,
              ignore_eos: bool) -> dict:
    return summarize_level(concurrency, [run_requests(base_url, prompts, concurrency, max_tokens, temperature,
                                                      ignore_eos)])


def loop_split(results: list[dict], has_verify: bool) -> dict:
    """The all / non-looping split of one level's requests (`_one_request` results): the level's
    `per_request_tok_s`, `repetition_loops` and `non_loop` (None without every request's token ids)."""
    latency = sum(r["e2e"] for r in results)
    out: dict[str, Any] = {"per_request_tok_s": sum(r["tokens"] for r in results) / latency if latency > 0 else 0.0,
                           "repetition_loops": None, "non_loop": None}
    if any(r.get("token_ids") is None for r in results):
        return out
    stats = [OutputStat(r["token_ids"], r.get("verify_ct", 0) + 1 if has_verify else None, r["e2e"], r["tokens"])
             for r in results]
    out["repetition_loops"] = sum(o.loops for o in stats)
    out["non_loop"] = non_loop_summary(stats)
    return out


def kinds_delta(before: dict, after: dict) -> dict[str, int] | None:
    """Tokens a selfspec server committed between two `server_stats` by each kind of step: the
    mode's own steps, lookup steps, plain AR steps (`metrics.AggregateStats.by_kind`)."""
    a, b = (after.get("selfspec") or {}).get("steps_by_kind"), (before.get("selfspec") or {}).get("steps_by_kind")
    if a is None:
        return None
    return {k: v["tokens"] - ((b or {}).get(k) or {}).get("tokens", 0) for k, v in a.items()}


def stats_delta(before: dict, after: dict) -> tuple[int, int] | None:
    """(committed tokens, forwards) a selfspec server counted between two `server_stats`."""
    a, b = after.get("selfspec"), before.get("selfspec")
    if a and b is not None:
        return (a["committed_tokens"] - (b or {}).get("committed_tokens", 0),
                a["forwards"] - (b or {}).get("forwards", 0))
    return None


# ---------------------------------------------------------------------------------- genai-bench
def genai_bench_available() -> bool:
    return shutil.which("genai-bench") is not None or (Path(sys.executable).parent / "genai-bench").exists()


def run_genai_bench(base_url: str, tokenizer_dir: str, concurrency: list[int], input_tokens: int, max_tokens: int,
                    num_requests: int, workdir: Path, timeout: float = 3600) -> dict[int, dict]:
    """Run genai-bench once over all levels; returns {concurrency: headline metrics}."""
    exe = shutil.which("genai-bench") or str(Path(sys.executable).parent / "genai-bench")
    cmd = [exe, "benchmark", "--api-backend", "openai", "--api-base", base_url, "--api-key", "none",
           "--api-model-name", "default", "--model-tokenizer", tokenizer_dir, "--task", "text-to-text",
           "--traffic-scenario", f"D({max(1, input_tokens)},{max_tokens})", "--server-engine", "SGLang",
           "--max-time-per-run", "5", "--max-requests-per-run", str(num_requests),
           "--experiment-base-dir", str(workdir)]
    for c in concurrency:
        cmd += ["--num-concurrency", str(c)]
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "genai-bench.log", "w") as log:
        subprocess.run(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    out: dict[int, dict] = {}
    for f in workdir.rglob("*.json"):
        try:
            data = json.loads(f.read_text())
        except Exception:
            continue
        agg = data.get("aggregated_metrics") if isinstance(data, dict) else None
        if not isinstance(agg, dict):
            continue
        c = agg.get("num_concurrency") or (data.get("num_concurrency") if isinstance(data, dict) else None)
        if c is None:
            continue
        stats = agg.get("stats") or {}
        tpot = (stats.get("tpot") or {}) if isinstance(stats, dict) else {}
        out[int(c)] = {
            "output_tok_s": agg.get("mean_output_throughput_tokens_per_s"),
            "tpot_ms_p50": (tpot.get("p50") * 1e3) if isinstance(tpot.get("p50"), (int, float)) else None,
            "tpot_ms_p99": (tpot.get("p99") * 1e3) if isinstance(tpot.get("p99"), (int, float)) else None,
            "error_rate": agg.get("error_rate"),
            "file": str(f),
        }
    return out


# ---------------------------------------------------------------------------------- driver
def level_sizes(levels: list[int], num_prompts: int) -> list[int]:
    """Requests per concurrency level: `num_prompts`, or C where C is larger, so a level of
    concurrency C really holds C requests in flight (16 requests at "C=32" would measure C=16)."""
    return [max(num_prompts, c) for c in levels]


def level_prompts(texts: list[str], sizes: list[int], level_index: int) -> list[str]:
    """The prompts of one concurrency level: consecutive windows of the file (cycling), so a mode
    that learns from its own outputs (NGRAM's corpus) does not see the same prompt twice when the
    file is long enough; every mode gets the same window at the same level."""
    start = sum(sizes[:level_index]) % len(texts)
    return [texts[(start + i) % len(texts)] for i in range(sizes[level_index])]


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
            from selfspec.decoding.metadata import load_metadata

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


def finish_report(report: dict) -> None:
    """Fill what needs every mode: the ratios to AR at each concurrency (all requests and the
    non-looping ones), and the notes on rows whose baseline cannot honour the run's settings."""
    from selfspec.decoding import registry

    ar = next((r for r in report["results"] if r["mode"] == "ar" and r["status"] == "ok"), None)
    ar_by_c = {lv["concurrency"]: lv for lv in (ar["levels"] if ar else [])}
    greedy_ngram = report["temperature"] > 0 and ngram_verifies_greedily(report["device"])
    sent = sum(level_sizes(report.get("concurrency", []), report.get("num_prompts", 0)))
    repeats = sent > report.get("prompts_available", math.inf)  # the levels' windows wrap around the set
    report["prompts_reused"] = repeats
    for r in report["results"]:
        notes = r.setdefault("notes", [])
        if r["status"] == "ok" and registry.get(r["mode"]).builtin_sglang_algorithm == "NGRAM":
            notes += [NGRAM_GREEDY_NOTE] if greedy_ngram else []
        if r["status"] == "ok" and r["mode"] != "ar" and repeats:
            notes.append(REPEAT_NOTE)
        for lv in r.get("levels", []):
            base = ar_by_c.get(lv["concurrency"])
            lv["ratio_vs_ar"] = lv["output_tok_s"] / base["output_tok_s"] if base and base["output_tok_s"] else None
            set_ratio_vs_ar(lv.get("non_loop"), (base or {}).get("non_loop"))


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
        run_level(proc.base_url, ["def warmup():\n"] * 2, 1, min(8, args.max_tokens), args.temperature,
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


def step_kind_shares(kinds: list[dict[str, int] | None]) -> dict[str, float] | None:
    """The share of a level's decode tokens each kind of step committed (None without the counts)."""
    counted = [k for k in kinds if k is not None]
    if not counted:
        return None
    total: dict[str, int] = {}
    for k in counted:
        for name, n in k.items():
            total[name] = total.get(name, 0) + n
    s = sum(total.values())
    return {name: round(n / s, 3) for name, n in sorted(total.items())} if s > 0 else None


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


def interleave_chunks(prompts: list[str], rounds: int, concurrency: int) -> list[list[str]]:
    """A level's prompts as `rounds` consecutive chunks of at least C requests each (fewer chunks
    where the level holds fewer than rounds x C: a chunk always fills its concurrency)."""
    n = max(1, min(rounds, len(prompts) // max(1, concurrency)))
    bounds = [round(i * len(prompts) / n) for i in range(n + 1)]
    return [prompts[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def round_order(items: list, round_index: int) -> list:
    """Forward on even rounds, backward on odd ones (A B C, C B A, ...): no mode always runs first."""
    return list(items) if round_index % 2 == 0 else list(items)[::-1]


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


def format_table(report: dict) -> str:
    def num(value, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    head = ["mode", "C", "tok/s", "xAR", "TPOT p50", "TPOT p99", "TPF", "genai tok/s", "loops", "req tok/s",
            "NL req tok/s", "NL xAR", "NL TPF"]
    with_pred = any("predicted_tok_s" in lv for r in report["results"] for lv in r.get("levels", []))
    if with_pred:
        head += ["pred tok/s", "pred err", "step err", "pred xAR", "xAR err"]
    rows, tails = [head], [""]
    for r in report["results"]:
        if r["status"] != "ok":
            rows.append([r.get("label", r["mode"]), "", r["status"]] + [""] * (len(head) - 3))
            tails.append(f": {str(r['reason']).splitlines()[0] if r['reason'] else ''}")
            continue
        for lv in r["levels"]:
            nl = lv.get("non_loop") or {}
            loops = lv.get("repetition_loops")
            rows.append([
                r.get("label", r["mode"]), str(lv["concurrency"]), num(lv["output_tok_s"], ".1f"), num(lv.get("ratio_vs_ar"), ".2f"),
                num(lv["tpot_ms_p50"], ".1f"), num(lv["tpot_ms_p99"], ".1f"), num(lv.get("tpf"), ".2f"),
                num((lv.get("genai_bench") or {}).get("output_tok_s"), ".1f"),
                "-" if loops is None else f"{loops}/{lv['requests']}", num(lv.get("per_request_tok_s"), ".1f"),
                num(nl.get("tokens_per_s"), ".1f"), num(nl.get("ratio_vs_ar"), ".2f"), num(nl.get("tpf"), ".2f"),
            ] + ([num(lv.get("predicted_tok_s"), ".1f"), num(lv.get("prediction_error"), "+.0%"),
                  num(lv.get("step_error"), "+.0%"), num(lv.get("predicted_speedup"), ".2f"),
                  num(lv.get("speedup_error"), "+.0%")] if with_pred else []))
            tails.append("".join(f"  [{n.split(':')[0]}]" for n in r.get("notes") or []))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [" ".join(row[0].ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))
             .rstrip() + tail for row, tail in zip(rows, tails)]
    lines.append("NL: requests whose output does not end in a repetition loop (per mode); req tok/s: tokens over "
                 "the sum of the requests' latencies; NL xAR: NL req tok/s over AR's at the same C")
    if with_pred:
        lines.append("pred: the tuner's predicted tok/s of the level (replayed from per-prompt acceptance where the "
                     "tune kept it, else a steady batch of min(C, requests)); pred err: predicted / measured - 1; "
                     "step err: measured step (TPOT p50 x tokens per step served) / predicted step - 1, the cost model alone; pred xAR: predicted "
                     "over AR's predicted, xAR err: that over the measured xAR - 1 (the machine's drift since the "
                     "tune cancels)")
    for r in report["results"]:
        for note in r.get("notes") or []:
            lines.append(f"note ({r['mode']}): {note}")
    return "\n".join(lines)


def plot(report: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in report["results"]:
        if r["status"] != "ok" or not r["levels"]:
            continue
        xs = [lv["tpot_ms_p50"] for lv in r["levels"]]
        ys = [lv["output_tok_s"] for lv in r["levels"]]
        ax.plot(xs, ys, marker="o", label=r.get("label", r["mode"]))
        for lv, x, y in zip(r["levels"], xs, ys):
            ax.annotate(f"C={lv['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("TPOT p50 (ms per output token, lower is better)")
    ax.set_ylabel("output tokens/s (higher is better)")
    ax.set_title(f"selfspec modes served by SGLang: {Path(report['model']).name} ({report['device']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="selfspec bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
