"""Served step costs: what one decode step costs at batch C, per kind of step, beside stock AR.

Serves stock AR and, on the selfspec worker, its plain AR steps, ISD's own steps at stride 2 and
4 (`--selfspec-policy own`: no context candidate), the 12-token lookup step, the 11-token tree
lookup step and SJD's own step, one server at a time (`selfspec bench serve`), with the worker's per-step timing switched on
(`SELFSPEC_DEBUG_TIMING=1`: plan / forward / finish / scheduler time between steps, and the
tokens each step emitted). Per level C it keeps the steps that ran at batch C and reports their
medians. Every server, stock AR included (it has no worker), is also timed by its effective
period, C x TPF / output tok/s: the time per step its clients saw, prefills and HTTP included.
The step period over stock AR's, beside the tokens per request-step, says which factor a
speed-up is short of: a step kind pays when its tokens per step exceed its period / AR's.

    python bench/step_costs.py [--temperature 0.7] [--prompts humaneval] [--json out.json]

About 10 minutes on 2 CPU cores; run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FW = "--selfspec-config bench/fixed_widths"
#: label -> (mode, flags): each kind of step alone on the selfspec worker
KINDS = {
    "worker-ar": ("isd", "--selfspec-policy ar"),
    "isd-s2": ("isd", "--selfspec-policy own --selfspec-stride 2"),
    "isd-s4": ("isd", "--selfspec-policy own --selfspec-stride 4"),
    "lookup12": ("isd", f"{FW}/lookup12x1a-sampled.yaml"),
    "lookup-tree11": ("isd", f"{FW}/lookup-tree11-sampled.yaml"),
    "sjd-own": ("sjd", "--selfspec-policy own"),
}
STEP_LINE = re.compile(r"\[selfspec\] step bs=(\d+) width (\d+) tokens (\d+) emitted (\d+) plan ([\d.]+) ms "
                       r"forward ([\d.]+) ms finish ([\d.]+) ms between ([\d.nan]+) ms")
PARTS = ("plan", "forward", "finish", "between")


def parse_steps(log: str) -> dict[int, list[dict]]:
    """Batch size -> the worker's logged decode steps at that batch size."""
    out: dict[int, list[dict]] = {}
    for m in STEP_LINE.finditer(log):
        bs, width, tokens, emitted = (int(x) for x in m.groups()[:4])
        times = dict(zip(PARTS, (float(x) for x in m.groups()[4:])))
        out.setdefault(bs, []).append({"width": width, "tokens": tokens, "emitted": emitted, **times})
    return out


def summarize(steps: list[dict], bs: int) -> dict:
    """Medians of one level's steps; period = plan + forward + finish + between."""
    timed = [s for s in steps if s["between"] == s["between"]]  # the first step has no `between`
    row = {p: round(statistics.median(s[p] for s in timed), 3) for p in PARTS}
    row["period"] = round(sum(row[p] for p in PARTS), 3)
    row["steps"] = len(steps)
    row["query_tokens_per_request"] = round(sum(s["tokens"] for s in steps) / (bs * len(steps)), 2)
    row["tokens_per_request_step"] = round(sum(s["emitted"] for s in steps) / (bs * len(steps)), 2)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-idlm")
    p.add_argument("--prompts", default="humaneval", help="prompt set (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per level (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kinds", default=",".join(KINDS), help="step kinds to serve (default: all)")
    p.add_argument("--json", help="write the table here")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        p.error(f"--kinds {','.join(unknown)}: choose from {','.join(KINDS)}")
    levels = [int(c) for c in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="step-costs-"))
    modes = ",".join(["ar"] + [f"{k}={KINDS[k][0]}" for k in kinds])
    cmd = [sys.executable, "-m", "selfspec.cli", "bench", "serve", "--model", args.model, "--modes", modes,
           "--prompts", args.prompts, "--temperature", str(args.temperature), "--concurrency", args.concurrency,
           "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens), "--genai-bench", "off",
           "--log-dir", str(work), "--json", str(work / "serve.json")]
    for k in kinds:
        cmd += ["--mode-args", f"{k}={KINDS[k][1]}"]
    subprocess.run(cmd, check=True, env={**os.environ, "SELFSPEC_DEBUG_TIMING": "1"})

    serve = json.loads((work / "serve.json").read_text())
    report = {"model": args.model, "prompts": args.prompts, "temperature": args.temperature, "levels": levels,
              "kinds": {}}
    ar_ms: dict[int, float] = {}
    for r in serve["results"]:
        label = r.get("label", r["mode"])
        eff = {lv["concurrency"]: 1e3 * lv["concurrency"] * lv["tpf"] / lv["output_tok_s"] for lv in r["levels"]}
        if label == "ar":
            ar_ms = eff
            report["stock_ar"] = {c: {"effective_period": round(ms, 3)} for c, ms in eff.items()}
            continue
        steps = parse_steps("".join(f.read_text(errors="replace") for f in sorted(work.glob(f"server-{label}*.log"))))
        report["kinds"][label] = {c: summarize(steps[c], c) | {
            "effective_period": round(eff[c], 3), "effective_vs_stock_ar": round(eff[c] / ar_ms[c], 3),
            "speedup_vs_stock_ar": round(ar_ms[c] * lv_tpf / eff[c], 3)}
            for c, lv_tpf in ((lv["concurrency"], lv["tpf"]) for lv in r["levels"]) if steps.get(c)}

    print(f"\neffective step period ms (x stock AR's) [tokens per request-step], {args.prompts}, "
          f"T={args.temperature}")
    print(f"{'':>10} " + " ".join(f"{'C=' + str(c):>24}" for c in levels))
    print(f"{'stock AR':>10} " + " ".join(f"{ar_ms[c]:>8.2f} (1.00) [1.00]".rjust(24) for c in levels))
    for k, rows in report["kinds"].items():
        cells = [f"{rows[c]['effective_period']:>8.2f} ({rows[c]['effective_vs_stock_ar']:.2f}) "
                 f"[{rows[c]['tokens_per_request_step']:.2f}]" if c in rows else "-" for c in levels]
        print(f"{k:>10} " + " ".join(x.rjust(24) for x in cells))
    print("worker's step at batch C, medians (plan / forward / finish / between ms):")
    for k, rows in report["kinds"].items():
        print(f"{k:>10} " + " ".join(" / ".join(f"{rows[c][p]:.2f}" for p in PARTS).rjust(24) if c in rows else "-"
                                     for c in levels))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
