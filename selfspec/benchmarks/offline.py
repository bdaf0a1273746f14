"""Offline benchmark of the decoding modes on the HF reference engine.

    selfspec bench offline --modes ar,ngram,jacobi,sjd,isd,risd --model tiny-base \\
        --prompts prompts.jsonl [--max-new-tokens 128] [--batch-size B] [--temperature T] [--json OUT]

`--prompts` is JSON lines, one {"prompt": "text"} (or {"prompt_ids": [ints]}) per line. AR always
runs first (added if not listed): it is the reference for the wall-clock ratio and, under greedy
decoding, for the exact-match rate. Each mode decodes every prompt once, `--batch-size` prompts
per `HFEngine.generate` call (after one short warm-up generate); time is wall clock around each
call, summed. Besides all outputs, each mode is reported on its outputs that do not end in a
repetition loop (`non_loop`; which outputs loop is decided per mode from that mode's own outputs,
see `repetition.py`): their TPF always, their tokens/s and its ratio to AR's non-looping tokens/s
only when each output's own wall time is known, i.e. with `--batch-size 1` (a batch's time cannot
be split between its outputs: with larger batches those fields are null). A mode the model cannot run
(ISD without a [MASK] token, RISD without an adapter, JACOBI when sampling) is reported as
"skipped" with the reason; an unexpected failure as "error" (exit status 1).

JSON schema (`schema` = "selfspec.bench.offline/v1"; keys are only ever added):

    {
      "schema": "selfspec.bench.offline/v1",
      "model": str, "prompts_file": str, "num_prompts": int,
      "max_new_tokens": int, "batch_size": int | null,          # null: all prompts in one batch
      "sampling": {"temperature": float, "top_k": int, "top_p": float}, "seed": int,
      "device": str, "dtype": str, "torch_threads": int,
      "modes": [
        {
          "mode": str,                          # ar | ngram | jacobi | sjd | isd | risd
          "label": str,                         # the row's name: the mode, or LABEL of a LABEL=MODE entry
          "status": "ok" | "skipped" | "error",
          "reason": str | null,                 # why skipped / the error
          "config": {...} | null,               # the mode's resolved configuration
          "plan": {...} | null,                 # its width plan (--config FILE with a plan), else null
          "wall_s": float,                      # wall-clock seconds for all prompts
          "tokens": int,                        # generated tokens (stop tokens included)
          "tokens_per_s": float,
          "forwards": int,                      # model forwards summed over sequences (prefill incl.)
          "tpf": float,                         # tokens per forward = tokens / forwards
          "wall_ratio_vs_ar": float,            # wall_s / AR's wall_s (same run); < 1 is faster
          "speedup_vs_ar": float,               # AR's wall_s / wall_s
          "exact_match_vs_ar": float | null,    # share of prompts whose output equals AR's (greedy only)
          "mean_accepted_length": float,        # tokens committed per decode forward (prefill excl.)
          "compute_overhead": float,            # query tokens per committed token (AR = 1)
          "repetition_loops": int,              # outputs ending in a repetition loop (`is_repetition_loop`)
          "non_loop": {                         # this mode's outputs that do not end in a loop
            "outputs": int, "tokens": int, "forwards": int,
            "tpf": float | null,                # their tokens / their forwards (null: no such output)
            "wall_s": float | null,             # their summed wall time (null unless batch_size is 1)
            "tokens_per_s": float | null,       # their tokens / wall_s
            "ratio_vs_ar": float | null,        # tokens_per_s / AR's non_loop tokens_per_s; > 1 is faster
            "timing": "per-output" | "per-batch"   # per-batch: no per-output time, the null fields above
          },
          "accept_hist": {"k": count},          # decode forwards that committed k tokens
          "finish_reasons": {"stop": int, "length": int}
        }, ...
      ]
    }
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from selfspec.benchmarks.modes import parse_modes
from selfspec.prompts import load_prompts
from selfspec.benchmarks.repetition import OutputStat, is_repetition_loop, non_loop_summary, set_ratio_vs_ar

SCHEMA = "selfspec.bench.offline/v1"
DEFAULT_MODES = "ar,ngram,jacobi,sjd,isd,risd"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"comma-separated modes (default {DEFAULT_MODES}); LABEL=MODE adds a variant of a mode "
                        "under its own name, e.g. isd,isd-ctx=isd with --mode-config isd-ctx:context_tokens=8")
    parser.add_argument("--model", default="tiny-base", help="embedded model name or checkpoint / adapter dir")
    parser.add_argument("--prompts", default="eval", help="a prompt set: eval (default), tune, humaneval, external, or a "
                        'JSON-lines file of {"prompt": "..."} rows')
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=None, help="prompts per batch (default: all)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    parser.add_argument("--mode-config", action="append", default=[], metavar="MODE|LABEL:K=V,...",
                        help="per-mode options, e.g. isd:stride=4,tau=0.5 (repeatable)")
    parser.add_argument("--config", action="append", default=[], metavar="MODE|LABEL:FILE.yaml",
                        help="a serving config for one row (its options and width plan, e.g. what `selfspec tune` "
                        "wrote): isd-tuned:plan.yaml with --modes ...,isd-tuned=isd (repeatable)")
    parser.add_argument("--adapter", default=None, help="RISD adapter dir (PEFT format)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results here")
    return parser


def _mode_configs(entries: list[str]) -> dict[str, dict[str, Any]]:
    from selfspec.decoding import registry

    out: dict[str, dict[str, Any]] = {}
    for entry in entries:
        mode, sep, opts = entry.partition(":")
        if not sep:
            raise ValueError(f"--mode-config {entry!r}: expected MODE:key=value,...")
        out.setdefault(mode.strip().lower(), {}).update(registry.parse_option_string(opts))
    return out


def _serving_configs(entries: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """`--config LABEL:FILE` entries -> (options per label, width plan per label)."""
    import yaml

    options: dict[str, dict[str, Any]] = {}
    plans: dict[str, Any] = {}
    for entry in entries:
        label, sep, path = entry.partition(":")
        if not sep or not Path(path).is_file():
            raise ValueError(f"--config {entry!r}: expected MODE|LABEL:FILE.yaml with an existing file")
        data = dict(yaml.safe_load(Path(path).read_text()) or {})
        data.pop("mode", None)
        plan = data.pop("plan", None)
        key = label.strip().lower()
        options.setdefault(key, {}).update(data)
        if plan is not None:
            plans[key] = plan
    return options, plans


def run_benchmark(
    engine,
    prompt_ids: list[list[int]],
    modes: list[str],
    max_new_tokens: int = 128,
    batch_size: int | None = None,
    sampling=None,
    seed: int = 0,
    mode_configs: dict[str, dict[str, Any]] | None = None,
    adapter: str | None = None,
    log=print,
    plans: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run AR and the given modes on one engine; returns the per-mode result rows (schema above).
    `plans`: a width plan per label (`decoding/widths/width_plan.py`)."""
    from selfspec.decoding import registry
    from selfspec.decoding.metrics import aggregate
    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.decoding.step import ModeUnavailable

    sampling = sampling or SamplingParams()
    mode_configs = mode_configs or {}
    runs = parse_modes(modes)
    engine.generate([prompt_ids[0]], 4, sampling, seed=seed, stop_token_ids=None)  # warm-up
    rows: list[dict[str, Any]] = []
    ar_tokens: list[list[int]] | None = None
    ar_wall: float | None = None
    ar_non_loop: dict[str, Any] | None = None
    for run in runs:
        mode = run.mode
        row: dict[str, Any] = {"mode": mode, "label": run.label, "status": "ok", "reason": None, "config": None}
        config = dict(mode_configs.get(run.label, mode_configs.get(mode, {})))
        if registry.get(mode).needs_adapter and adapter and "adapter" not in config:
            config["adapter"] = adapter
        try:
            plan = (plans or {}).get(run.label)
            mode_obj = (engine.build_mode(mode, config or None, plan) if plan is not None
                        else engine.build_mode(mode, config or None))
            cfg_obj = getattr(mode_obj, "config", None)
            row["config"] = dataclasses.asdict(cfg_obj) if dataclasses.is_dataclass(cfg_obj) else None
            row["plan"] = mode_obj.plan.to_dict() if hasattr(mode_obj, "plan") else None
            if mode_obj.greedy_only and not sampling.greedy:
                raise ModeUnavailable(f"{mode.upper()} is greedy only; run it with --temperature 0")
            outs, batch_walls = _generate_timed(engine, prompt_ids, max_new_tokens, sampling, seed, mode_obj,
                                                batch_size)
            wall = sum(batch_walls)
        except ModeUnavailable as exc:
            row.update(status="skipped", reason=str(exc))
            rows.append(row)
            log(f"{run.label:>7}: skipped ({exc})")
            continue
        except Exception as exc:  # noqa: BLE001 - report and go on with the other modes
            row.update(status="error", reason=f"{type(exc).__name__}: {exc}")
            rows.append(row)
            log(f"{run.label:>7}: error ({type(exc).__name__}: {exc})")
            continue
        tokens = [o.token_ids for o in outs]
        agg = aggregate(o.metrics for o in outs)
        size = batch_size or len(prompt_ids)
        per_output = size == 1
        non_loop = non_loop_summary(
            OutputStat(o.token_ids, o.metrics.forwards, batch_walls[i // size] if per_output else None)
            for i, o in enumerate(outs))
        non_loop["timing"] = "per-output" if per_output else "per-batch"
        if mode == "ar":
            ar_tokens, ar_wall, ar_non_loop = tokens, wall, non_loop
        set_ratio_vs_ar(non_loop, ar_non_loop)
        total = sum(len(t) for t in tokens)
        finish: dict[str, int] = {}
        for o in outs:
            finish[o.finish_reason] = finish.get(o.finish_reason, 0) + 1
        row.update(
            wall_s=wall,
            tokens=total,
            tokens_per_s=total / wall if wall > 0 else 0.0,
            forwards=agg["forwards"],
            tpf=agg["tokens_per_forward"],
            wall_ratio_vs_ar=wall / ar_wall if ar_wall else None,
            speedup_vs_ar=ar_wall / wall if ar_wall and wall > 0 else None,
            exact_match_vs_ar=(sum(a == b for a, b in zip(tokens, ar_tokens)) / len(tokens)
                               if sampling.greedy and ar_tokens is not None else None),
            mean_accepted_length=agg["mean_accepted_length"],
            compute_overhead=agg["compute_overhead"],
            repetition_loops=sum(is_repetition_loop(t) for t in tokens),
            non_loop=non_loop,
            accept_hist=agg["accept_hist"],
            finish_reasons=finish,
        )
        rows.append(row)
        log(f"{run.label:>7}: {total} tokens in {wall:.2f}s, TPF {row['tpf']:.2f}")
    return rows


def _generate_timed(engine, prompt_ids, max_new_tokens, sampling, seed, mode_obj, batch_size):
    """`engine.generate` one batch at a time, timing each; the outputs equal one call's (each prompt
    keeps its seed, seed + its index in the whole request). Returns (outputs, [seconds per batch])."""
    from selfspec.decoding.requests.seeds import base_seeds

    seeds = base_seeds(seed, len(prompt_ids))
    size = batch_size or len(prompt_ids)
    outs, walls = [], []
    for start in range(0, len(prompt_ids), size):
        t0 = time.perf_counter()
        outs.extend(engine.generate(prompt_ids[start : start + size], max_new_tokens, sampling,
                                    seed=seeds[start : start + size], mode=mode_obj))
        walls.append(time.perf_counter() - t0)
    return outs, walls


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ["mode", "status", "TPF", "tok/s", "wall/AR", "speedup", "exact", "acc.len", "overhead", "loops",
            "NL", "NL TPF", "NL xAR"]
    lines = [head]
    for r in rows:
        if r["status"] != "ok":
            lines.append([r.get("label", r["mode"]), r["status"]] + ["-"] * (len(head) - 2))
            continue
        exact = "-" if r["exact_match_vs_ar"] is None else f"{100 * r['exact_match_vs_ar']:.0f}%"
        nl = r["non_loop"]
        lines.append([
            r.get("label", r["mode"]), "ok", f"{r['tpf']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['wall_ratio_vs_ar']:.2f}",
            f"{r['speedup_vs_ar']:.2f}x", exact, f"{r['mean_accepted_length']:.2f}", f"{r['compute_overhead']:.2f}",
            str(r["repetition_loops"]), str(nl["outputs"]),
            "-" if nl["tpf"] is None else f"{nl['tpf']:.2f}",
            "-" if nl["ratio_vs_ar"] is None else f"{nl['ratio_vs_ar']:.2f}x",
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines]
    out.append("NL: outputs that do not end in a repetition loop (per mode); NL xAR: their tokens/s over AR's")
    if any(r["status"] == "ok" and r["non_loop"]["timing"] == "per-batch" for r in rows):
        out.append("NL xAR needs per-output time: run with --batch-size 1 (a batch's time is not split "
                   "between its outputs)")
    for r in rows:
        if r["status"] != "ok":
            out.append(f"{r['mode']}: {r['status']}: {r['reason']}")
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    import torch

    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    engine = HFEngine.from_pretrained(args.model, dtype=dtype, device=args.device)
    _, prompt_ids = load_prompts(args.prompts, engine.tokenizer, args.limit)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k))
    configs = _mode_configs(args.mode_config)
    file_options, plans = _serving_configs(args.config)
    for label, opts in file_options.items():
        configs[label] = {**opts, **configs.get(label, {})}
    rows = run_benchmark(engine, prompt_ids, modes, args.max_new_tokens, args.batch_size, sampling, args.seed,
                         configs, args.adapter, log=log, plans=plans)
    result = {
        "schema": SCHEMA,
        "model": str(args.model),
        "prompts_file": str(args.prompts),
        "num_prompts": len(prompt_ids),
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "sampling": dataclasses.asdict(sampling),
        "seed": args.seed,
        "device": str(engine.device),
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "modes": rows,
    }
    print(format_table(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if any(r["status"] == "error" for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="selfspec bench offline", description=__doc__.split("\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
