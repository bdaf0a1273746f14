"""Step-cost growth: how one decode step's cost grows with the context, per kind of step, beside
stock AR and SGLang's NGRAM.

Serves stock AR, NGRAM and each kind of step of `bench/step_costs.py` (`KINDS`: the selfspec
worker's plain AR steps, ISD's own steps at stride 2 and 4, the 12-token lookup step, SJD's own
step), one server per kind, each reused for every cell of the grid: prompt length P x output
length O x concurrency C. The prompts are windows of exactly P tokens of the model's tokenizer
from the files the `eval` set is cut from (`selfspec.prompts.long_prompts`, made at run time,
deterministic: every request its own window, no window twice on one server); every request
generates exactly O tokens (`ignore_eos`); a cell is a closed loop of C clients sending
max(--num-prompts, C) requests, as `selfspec bench serve` levels are. The servers run with the
radix cache off (overlapping windows would otherwise share prefills), room for C x (P + O)
tokens in the KV pool and C running requests.

Per cell: tokens/s, the effective step period C x TPF / output tok/s (what the clients saw,
prefills and HTTP included: the only clock stock AR and NGRAM have, as in step_costs) and, for
the selfspec kinds, the median of the worker's own steps at batch C (`SELFSPEC_DEBUG_TIMING=1`:
plan + forward + finish + the scheduler's time between steps, step_costs' `parse_steps` /
`summarize`, on the part of the server log the cell wrote). Each kind's step is compared with
AR's at the same cell: the selfspec kinds' worker step with the worker's AR step, stock AR's and
NGRAM's effective period with stock AR's (the worker's AR step with stock AR's, both effective).
Growth: per kind, O and C, its cost at the longest prompt over its cost at the shortest, over
AR's same ratio; a kind whose cost grows more than --threshold (10%) faster than AR's is flagged.

The tiny models' trained window: tiny-base was pre-trained on 512-token rows, tiny-idlm and its
RISD adapter converted on 256-token rows, tiny-jf on 320-token rows (64 prompt + trajectory);
all have `max_position_embeddings` 4096 and plain RoPE (theta 10,000, no scaling), so SGLang
serves 4,096 tokens of context and positions past the window are extrapolated. Quality drops
there (tiny-base's loss on 2,048-token eval windows: 3.55 at positions 0-256, 3.65 at 256-512,
3.80 at 512-1,536, 4.04 at 1,536-2,048; tiny-idlm's 3.55 / 3.68 / 3.84-3.87 / 4.14), so tokens
per step and tok/s at long prompts say less about a real model; the cost of a step does not
depend on what the weights predict, and that is what this table is for. The eval files hold
about 53,000 tokens, so long windows overlap each other: the lookup step and NGRAM find more of
the prompt in their corpora than on distinct documents.

    python bench/growth.py [--quick] [--json growth.json] [--plot growth.png]
    python bench/growth.py --dry-run     # the grid, the server flags and the time it would take

Run from the repository root (the lookup step's plan is `bench/fixed_widths/...`), alone on the
machine. Time on 2 CPU cores (`--dry-run` prints it for any grid), every server at stock AR's
pace from `bench/results/step-costs.json` (short prompts: 11.3 / 18.7 / 31.2 / 51.6 ms per step
at C = 1 / 4 / 16 / 32, extrapolated to 64) plus an assumed 0.8 us per context token per request
per step (the KV read) and 0.15 ms per prefilled token, 25 s per server start: the default grid
(P 256,1024,2048; O 128,512; C 1,4,16,64; 4 requests per cell at C < 4; 7 servers) about 75
minutes (45 without any growth, 110 at twice the assumed growth); `--quick` (P 256,2048; O 128;
C 1,16) about 7 minutes. `--fresh-per-length` adds a server start per prompt length.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_costs import KINDS, parse_steps, summarize  # noqa: E402

SCHEMA = "selfspec.bench.growth/v1"
STOCK = {"ar": "ar", "ngram": "ngram"}  # label -> registry mode: SGLang's own decoding, no selfspec worker
DEFAULT_MODES = ",".join([*STOCK, *KINDS])
DEFAULT_GRID = {"prompt_tokens": "256,1024,2048", "output_tokens": "128,512", "concurrency": "1,4,16,64"}
QUICK_GRID = {"prompt_tokens": "256,2048", "output_tokens": "128", "concurrency": "1,16"}
#: the headroom past P + O a request's row and the KV pool keep (the widest verify step and its reserve)
ROW_HEADROOM = 64
STEP_COSTS_JSON = Path(__file__).resolve().parent / "results" / "step-costs.json"


# ------------------------------------------------------------------ the grid
def parse_grid(text: str, name: str) -> list[int]:
    """'256,1024,2048' -> [256, 1024, 2048]: positive integers, sorted, each once."""
    try:
        values = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--{name} {text}: give comma-separated integers, e.g. 1,4,16") from None
    if not values or values[0] < 1:
        raise ValueError(f"--{name} {text}: give at least one integer, each >= 1")
    return values


def grid_of(args: argparse.Namespace) -> dict[str, list[int]]:
    """The grid the flags ask for: each axis as given, else --quick's or the default's."""
    base = QUICK_GRID if args.quick else DEFAULT_GRID
    return {axis: parse_grid(getattr(args, axis) or base[axis], axis.replace("_", "-")) for axis in DEFAULT_GRID}


def level_sizes(levels: list[int], num_prompts: int) -> list[int]:
    """Requests per concurrency level, as `selfspec bench serve` sends them."""
    from selfspec.benchmarks.load import level_sizes as serve_sizes

    return serve_sizes(levels, num_prompts)


def prompts_needed(grid: dict[str, list[int]], num_prompts: int) -> int:
    """Distinct prompts of one length that one server's cells send (every output length's levels)."""
    return len(grid["output_tokens"]) * sum(level_sizes(grid["concurrency"], num_prompts))


def kv_tokens(grid: dict[str, list[int]]) -> int:
    """KV pool that holds C requests of the longest prompt and output at once (at least the CPU default)."""
    from selfspec.sglang_ext.cpu_defaults import CPU_MAX_TOTAL_TOKENS

    need = max(grid["concurrency"]) * (max(grid["prompt_tokens"]) + max(grid["output_tokens"]) + ROW_HEADROOM)
    return max(CPU_MAX_TOTAL_TOKENS, need)


def server_flags(grid: dict[str, list[int]]) -> list[str]:
    return ["--max-running-requests", str(max(grid["concurrency"])), "--max-total-tokens", str(kv_tokens(grid)),
            "--disable-radix-cache"]


def check_context(grid: dict[str, list[int]], max_positions: int) -> None:
    longest = max(grid["prompt_tokens"]) + max(grid["output_tokens"]) + ROW_HEADROOM
    if longest > max_positions:
        raise ValueError(f"the longest request needs {longest} positions (prompt + output + {ROW_HEADROOM}); the "
                         f"model serves {max_positions} (max_position_embeddings): shorten --prompt-tokens or "
                         "--output-tokens")


# ------------------------------------------------------------------ the numbers
def step_ms(cell: dict, worker: bool) -> float | None:
    """A cell's step cost: the worker's median step (worker=True) or the effective period."""
    return cell.get("step_ms") if worker else cell.get("effective_ms")


def reference_of(label: str, labels: list[str], has_steps: bool) -> tuple[str, bool]:
    """(the row a kind is compared with, whether by the worker's own step): a selfspec kind with
    logged steps against the worker's AR step where that was served; everything else against
    stock AR, by the effective period."""
    if has_steps and label != "worker-ar" and "worker-ar" in labels:
        return "worker-ar", True
    return "ar", False


def _cells(row: dict) -> dict[tuple[int, int, int], dict]:
    return {(c["prompt_tokens"], c["output_tokens"], c["concurrency"]): c for c in row.get("cells", [])}


def add_ratios(report: dict) -> None:
    """Each cell's step over its reference's at the same cell (`x_ar`, `ar_reference`)."""
    rows = report["rows"]
    for label, row in rows.items():
        has_steps = any(c.get("step_ms") is not None for c in row.get("cells", []))
        ref, worker = reference_of(label, list(rows), has_steps)
        ref_cells = _cells(rows.get(ref, {}))
        row["ar_reference"] = ref if label != ref else None
        for key, cell in _cells(row).items():
            mine, theirs = step_ms(cell, worker), step_ms(ref_cells.get(key, {}), worker)
            cell["x_ar"] = round(mine / theirs, 3) if mine and theirs and label != ref else (1.0 if label == ref else None)


def growth(report: dict, threshold: float = 0.10) -> dict:
    """Per kind and (O, C): its step at the longest prompt over its step at the shortest
    (`cost_growth`), AR's same ratio (`ar_growth`, AR as `reference_of` picks it), their ratio
    (`relative`) and `flagged` when the kind's cost grows more than `threshold` faster."""
    rows, out = report["rows"], {}
    lo, hi = min(report["prompt_tokens"]), max(report["prompt_tokens"])
    for label, row in rows.items():
        has_steps = any(c.get("step_ms") is not None for c in row.get("cells", []))
        ref, worker = reference_of(label, list(rows), has_steps)
        if label == ref or ref not in rows or lo == hi:
            continue
        mine, theirs = _cells(row), _cells(rows[ref])
        for o in report["output_tokens"]:
            for c in report["concurrency"]:
                a = [step_ms(mine.get((p, o, c), {}), worker) for p in (lo, hi)]
                b = [step_ms(theirs.get((p, o, c), {}), worker) for p in (lo, hi)]
                if not all(a + b):
                    continue
                g, g_ar = a[1] / a[0], b[1] / b[0]
                out.setdefault(label, {})[f"O={o},C={c}"] = {
                    "output_tokens": o, "concurrency": c, "reference": ref, "by": "worker step" if worker else "effective",
                    "cost_growth": round(g, 3), "ar_growth": round(g_ar, 3), "relative": round(g / g_ar, 3),
                    "flagged": g / g_ar > 1 + threshold}
    return out


def format_table(report: dict) -> str:
    """ms per step (x AR's step) and tok/s per kind, a block per (O, C), a column per prompt
    length; then each kind's growth relative to AR's, flagged ones marked."""
    rows, ps = report["rows"], report["prompt_tokens"]
    lines = ["ms per step (x AR's step) tok/s; selfspec kinds: the worker's median step at batch C against the "
             "worker's AR step; stock AR, NGRAM: C x TPF / tok/s against stock AR's; worker-ar: its worker step, "
             "(x) by both effective periods"]
    for o in report["output_tokens"]:
        for c in report["concurrency"]:
            lines.append(f"O={o} C={c}".ljust(12) + "".join(f"P={p}".rjust(26) for p in ps))
            for label, row in rows.items():
                if row.get("status") != "ok":
                    lines.append(f"{label:<12}{row.get('status')}: {str(row.get('reason') or '').splitlines()[0][:80]}")
                    continue
                cells = _cells(row)
                out = []
                for p in ps:
                    cell = cells.get((p, o, c))
                    ms = cell and (cell.get("step_ms") if cell.get("step_ms") is not None else cell.get("effective_ms"))
                    if not ms:
                        out.append("-")
                        continue
                    x = f"({cell['x_ar']:.2f})" if cell.get("x_ar") is not None else ""
                    out.append(f"{ms:.1f} {x} {cell['output_tok_s']:.0f}")
                lines.append(f"{label:<12}" + "".join(s.rjust(26) for s in out))
    g = report.get("growth") or {}
    if g:
        keys = [f"O={o},C={c}" for o in report["output_tokens"] for c in report["concurrency"]]
        lines.append(f"cost growth P={min(ps)} -> {max(ps)} over AR's (! = more than "
                     f"{report.get('threshold', 0.10):.0%} faster)")
        lines.append(f"{'':<12}" + "".join(k.rjust(14) for k in keys))
        for label, cells in g.items():
            lines.append(f"{label:<12}" + "".join(
                (f"{cells[k]['relative']:.3f}{'!' if cells[k]['flagged'] else ' '}" if k in cells else "-").rjust(14)
                for k in keys))
    return "\n".join(lines)


def plot(report: dict, out: str) -> None:
    """ms per step against prompt length, one panel per C (top), and the ratio to AR's step (bottom);
    a colour per kind, solid for the shortest output, dashed for the longest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    levels, outputs, ps = report["concurrency"], report["output_tokens"], report["prompt_tokens"]
    fig, axes = plt.subplots(2, len(levels), figsize=(4 * len(levels), 7), squeeze=False, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    handles = []
    for k, (label, row) in enumerate(report["rows"].items()):
        color = colors[k % len(colors)]
        handles.append(Line2D([], [], color=color, marker="o", markersize=3, label=label))
        cells = _cells(row)
        for j, c in enumerate(levels):
            for i, o in enumerate(outputs):
                pts = [(p, cells[(p, o, c)]) for p in ps if (p, o, c) in cells]
                style = dict(color=color, linestyle=styles[i % len(styles)], marker="o", markersize=3)
                ms = [(p, x.get("step_ms") or x.get("effective_ms")) for p, x in pts]
                ms = [(p, v) for p, v in ms if v]
                if ms:
                    axes[0][j].plot(*zip(*ms), **style)
                ratio = [(p, x["x_ar"]) for p, x in pts if x.get("x_ar")]
                if ratio and row.get("ar_reference"):
                    axes[1][j].plot(*zip(*ratio), **style)
    handles += [Line2D([], [], color="grey", linestyle=styles[i % len(styles)], label=f"O={o}")
                for i, o in enumerate(outputs)]
    for j, c in enumerate(levels):
        axes[0][j].set_title(f"C={c}")
        axes[1][j].set_xlabel("prompt tokens")
        axes[1][j].axhline(1.0, color="grey", linewidth=0.8)
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ps, [str(p) for p in ps])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("ms per step")
    axes[1][0].set_ylabel("x AR's step")
    fig.legend(handles=handles, loc="lower center", ncol=min(10, len(handles)), fontsize=8)
    fig.suptitle(f"decode step cost against context: {Path(report['model']).name} ({report['device']}), "
                 f"T={report['temperature']}; selfspec kinds: the worker's step against its AR step", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ the run-time estimate
def _ar_periods() -> dict[int, float]:
    """Stock AR's effective step period (ms) by batch size, bench/results/step-costs.json (short prompts)."""
    try:
        data = json.loads(STEP_COSTS_JSON.read_text())["stock_ar"]
        return {int(c): float(v["effective_period"]) for c, v in data.items()}
    except (OSError, KeyError, ValueError):
        return {1: 11.3, 4: 18.7, 16: 31.2, 32: 51.6}


def _period_at(periods: dict[int, float], c: int) -> float:
    """Linear in C between the measured batch sizes, and past the last two beyond them."""
    cs = sorted(periods)
    if c in periods:
        return periods[c]
    lo = max([x for x in cs if x < c], default=cs[0])
    hi = min([x for x in cs if x > c], default=None)
    if hi is None:
        lo, hi = cs[-2], cs[-1]
    return periods[lo] + (periods[hi] - periods[lo]) * (c - lo) / (hi - lo)


def estimate_seconds(grid: dict[str, list[int]], num_prompts: int, servers: int, kv_us: float = 0.8,
                     prefill_ms: float = 0.15, startup_s: float = 25.0, starts: int = 1) -> float:
    """The run's time, every server at stock AR's pace: per cell ceil(n / C) x O steps, each stock
    AR's step at batch C plus kv_us per context token per request, and n x P prefilled tokens."""
    periods, total = _ar_periods(), 0.0
    sizes = level_sizes(grid["concurrency"], num_prompts)
    for p in grid["prompt_tokens"]:
        for o in grid["output_tokens"]:
            for c, n in zip(grid["concurrency"], sizes):
                step = _period_at(periods, c) + c * (p + o / 2) * kv_us / 1e3
                total += math.ceil(n / c) * o * step / 1e3 + n * p * prefill_ms / 1e3
    return servers * (total + starts * startup_s)


# ------------------------------------------------------------------ the run
def _cell(label: str, mode: str, proc, log: Path, texts: list[str], p: int, o: int, c: int, args) -> dict:
    from selfspec.benchmarks.serve import _level_row, _timed_chunk

    start = log.stat().st_size if log.exists() else 0
    cell_args = argparse.Namespace(**{**vars(args), "max_tokens": o, "ignore_eos": True})
    lv = _level_row(mode, label, c, [_timed_chunk(proc, texts, c, cell_args)])
    with open(log, "rb") as f:
        f.seek(start)
        steps = parse_steps(f.read().decode(errors="replace")).get(c, [])
    timed = [s for s in steps if s["between"] == s["between"]]
    step = summarize(steps, c) if timed else None
    tpf = lv.get("tpf") or 1.0
    eff = 1e3 * c * tpf / lv["output_tok_s"] if lv["output_tok_s"] > 0 else None
    return {"prompt_tokens": p, "output_tokens": o, "concurrency": c, "requests": lv["requests"],
            "errors": lv["errors"], "tokens": lv["tokens"], "wall_s": round(lv["wall_s"], 3),
            "output_tok_s": round(lv["output_tok_s"], 2), "tpf": lv.get("tpf"), "ttft_ms_p50": lv["ttft_ms_p50"],
            "effective_ms": round(eff, 3) if eff else None, "step_ms": step["period"] if step else None,
            "step": step, "tokens_by_step_kind": lv.get("tokens_by_step_kind")}


def run(args: argparse.Namespace, grid: dict[str, list[int]], modes: list[str]) -> dict:
    from transformers import AutoTokenizer

    from selfspec.benchmarks.load import level_prompts
    from selfspec.benchmarks.modes import ModeRun
    from selfspec.benchmarks.serve import _start_row
    from selfspec.models import resolve_with_adapter
    from selfspec.prompts import long_prompts
    from selfspec.serving import ServerProcess, ServerSpec, cuda_available, server_threads

    model_dir, _ = resolve_with_adapter(args.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    need = prompts_needed(grid, args.num_prompts)
    prompts = {p: long_prompts(tok, p, need) for p in grid["prompt_tokens"]}
    for p, texts in prompts.items():
        if not texts:
            raise SystemExit(f"no {p}-token window in the eval files: lower --prompt-tokens")
        if len(texts) < need:
            print(f"[growth] {len(texts)} distinct {p}-token prompts for {need} requests: some repeat on a server",
                  file=sys.stderr)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="selfspec-growth-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    gpu = cuda_available()
    flags = server_flags(grid) + ([args.server_args] if args.server_args else [])
    report = {"schema": SCHEMA, "model": str(model_dir), "temperature": args.temperature, **grid,
              "num_prompts": args.num_prompts, "threshold": args.threshold, "device": "cuda" if gpu else "cpu",
              "server_args": flags, "log_dir": str(log_dir), "rows": {}}
    serve_args = argparse.Namespace(
        mode_args=[], lora=None, temperature=args.temperature,
        server_args=" ".join(flags), startup_timeout=args.startup_timeout, max_tokens=min(grid["output_tokens"]),
        ignore_eos=True)
    sizes = level_sizes(grid["concurrency"], args.num_prompts) * len(grid["output_tokens"])
    os.environ["SELFSPEC_DEBUG_TIMING"] = "1"  # the servers inherit it: the worker logs each step
    t0 = time.perf_counter()
    with server_threads(None if gpu else args.cpu_threads):
        for label in modes:
            mode = STOCK.get(label) or KINDS[label][0]
            groups = [[p] for p in grid["prompt_tokens"]] if args.fresh_per_length else [grid["prompt_tokens"]]
            for g, lengths in enumerate(groups):
                name = f"{label}-p{lengths[0]}" if args.fresh_per_length else label
                serve_args.mode_args = [f"{name}={KINDS[label][1]}"] if label in KINDS else []
                started, proc = _start_row(ModeRun(name, mode), serve_args, model_dir, log_dir, ServerProcess,
                                           ServerSpec)
                row = report["rows"].setdefault(label, {**started, "label": label, "cells": [], "startup_s": 0.0})
                row["startup_s"] = round(row["startup_s"] + started.get("startup_s", 0.0), 1)
                if proc is None:
                    row.update(status=started["status"], reason=started["reason"])
                    break
                try:
                    for p in lengths:
                        for i, o in enumerate(grid["output_tokens"]):
                            for j, c in enumerate(grid["concurrency"]):
                                texts = level_prompts(prompts[p], sizes, i * len(grid["concurrency"]) + j)
                                row["cells"].append(_cell(label, mode, proc, log_dir / f"server-{name}.log", texts,
                                                          p, o, c, serve_args))
                except Exception as e:  # the row says what broke; the other kinds still run
                    row.update(status="error", reason=repr(e))
                finally:
                    proc.stop()
                if row["status"] != "ok":
                    break
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-idlm", help="embedded model name or checkpoint dir (default %(default)s)")
    p.add_argument("--modes", default=DEFAULT_MODES, help="rows to serve, comma-separated: ar, ngram and step_costs' "
                   "kinds (default: all: %(default)s); ar always runs")
    p.add_argument("--prompt-tokens", default=None, help=f"prompt lengths in tokens (default {DEFAULT_GRID['prompt_tokens']}"
                   f"; --quick {QUICK_GRID['prompt_tokens']})")
    p.add_argument("--output-tokens", default=None, help=f"output lengths in tokens (default "
                   f"{DEFAULT_GRID['output_tokens']}; --quick {QUICK_GRID['output_tokens']})")
    p.add_argument("--concurrency", default=None, help=f"concurrency levels (default {DEFAULT_GRID['concurrency']}; "
                   f"--quick {QUICK_GRID['concurrency']})")
    p.add_argument("--quick", action="store_true", help="the small grid for the axes not given")
    p.add_argument("--num-prompts", type=int, default=4, help="requests per cell, at least C (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7, help="as step_costs (default %(default)s)")
    p.add_argument("--threshold", type=float, default=0.10, help="flag a kind whose cost grows this much faster than "
                   "AR's (default %(default)s)")
    p.add_argument("--fresh-per-length", action="store_true", help="a fresh server for each prompt length (3 starts "
                   "per kind instead of 1): the lookup step's and NGRAM's corpora then hold only that length's text")
    p.add_argument("--server-args", default="", help="extra SGLang flags for every server")
    p.add_argument("--cpu-threads", type=int, default=1, help="without CUDA: OpenMP threads per server (default 1)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default=None, help="keep the server logs here")
    p.add_argument("--dry-run", action="store_true", help="print the grid, the server flags and the estimated time; "
                   "start nothing")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plot", help="write the plot here (PNG)")
    args = p.parse_args(argv)
    try:
        grid = grid_of(args)
    except ValueError as e:
        p.error(str(e))
    modes = ["ar"] + [m for m in dict.fromkeys(x.strip() for x in args.modes.split(",")) if m and m != "ar"]
    unknown = [m for m in modes if m not in STOCK and m not in KINDS]
    if unknown or args.num_prompts < 1:
        p.error(f"--modes {','.join(unknown)}: choose from {DEFAULT_MODES}" if unknown else "--num-prompts must be >= 1")
    from selfspec.models import resolve_with_adapter

    model_dir, _ = resolve_with_adapter(args.model)
    max_positions = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", 0)
    try:
        check_context(grid, max_positions)
    except ValueError as e:
        p.error(str(e))
    if any(m in KINDS for m in modes) and not Path("bench/fixed_widths").is_dir():
        p.error("run from the repository root: the lookup step's plan is bench/fixed_widths/...")
    est = estimate_seconds(grid, args.num_prompts, len(modes),
                           starts=len(grid["prompt_tokens"]) if args.fresh_per_length else 1)
    print(f"[growth] {len(modes)} servers ({','.join(modes)}), P {grid['prompt_tokens']} x O {grid['output_tokens']} x "
          f"C {grid['concurrency']}, {prompts_needed(grid, args.num_prompts)} prompts per length; flags "
          f"{' '.join(server_flags(grid))}; about {est / 60:.0f} minutes on 2 CPU cores", file=sys.stderr)
    if args.dry_run:
        return 0
    report = run(args, grid, modes)
    add_ratios(report)
    report["growth"] = growth(report, args.threshold)
    report["flagged"] = [[label, g["output_tokens"], g["concurrency"]] for label, cells in report["growth"].items()
                         for g in cells.values() if g["flagged"]]
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 1 if any(r.get("status") == "error" for r in report["rows"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
