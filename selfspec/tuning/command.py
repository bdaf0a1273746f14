"""`selfspec tune`: measure this machine's forward cost and each configuration's acceptance, pick
the width per batch size, print the table, write a serving config with the plan.

    selfspec tune --model tiny-idlm --modes isd,sjd [--prompts bench/prompts/heldout.jsonl]
        [--batch-sizes 1,2,4,8,16,32] [--temperature 0.7] [--out serving_configs/tuned-{host}-{mode}.yaml]

Serve the result with `--speculative-algorithm ISD --selfspec-config <file>`: the worker then runs
each decode step with the configuration of the bucket its batch falls in (greedy batches and
batches with sampled rows apart), plain AR steps included. The forward cost is measured on the
HF engine with `--threads` torch threads (default 1, what `selfspec bench serve` gives each CPU
server process) and `--dtype` (default float32, what `selfspec serve` uses on a CPU). What a
served step costs besides the forward (scheduling, bookkeeping, the extend path and verify rules
of a wide step) is measured on real servers of the mode running AR and verify steps at a few
batch sizes (`calibrate.py`: three servers, about three minutes per mode, and one stock AR server
per tune, what the printed bench levels compare with), or given with
`--step-overhead-ms BASE[,PER_REQUEST]` (0 for the offline engine). A candidate is priced by the
query tokens its steps carry: the real ones where the CPU worker's forwards are ragged (so a
lookup whose weak matches draft short, `lookup=12c`, or whose requests' drafts follow their recent
acceptance, `lookup=12ca`, costs what it sends), its padded width on a CUDA machine. Beside the
plan it prints what `selfspec bench serve` should read at each level of its batch sizes (32
requests: the level replayed from each prompt's own acceptance, the batch thinning as requests
finish, each request's prefill and handling paid once, `tuning/level.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import time
from pathlib import Path
from typing import Any

from selfspec.errors import UsageError

DEFAULT_PROMPTS = "bench/prompts/heldout.jsonl"
DEFAULT_OUT = "serving_configs/tuned-{host}-{mode}.yaml"
#: requests per replayed bench level (`selfspec bench serve`'s default --num-prompts)
LEVEL_REQUESTS = 32


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", help="embedded model name or checkpoint / adapter directory (required unless --replan)")
    p.add_argument("--modes", default="isd", help="comma-separated served modes to tune (isd, risd, jacobi, sjd); "
                   "one serving config each")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help='JSON lines {"prompt": "..."} (default %(default)s)')
    p.add_argument("--limit", type=int, default=16, help="prompts used for the acceptance runs (default 16)")
    p.add_argument("--corpus-prompts", type=int, default=32,
                   help="the next N prompts' greedy outputs fill the context corpus before the greedy acceptance "
                   "runs, as a server's holds what it served before (default %(default)s; 0: an empty corpus)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens per prompt in the acceptance runs (default 128; acceptance grows with the output "
                   "length on text that repeats itself, so use the length you serve)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32",
                   help="batch sizes of the cost grid; the plan covers 1 … the largest (default %(default)s)")
    p.add_argument("--widths", default="1,2,4,8,12,16,24",
                   help="query tokens per request of the cost grid (default %(default)s)")
    p.add_argument("--context", type=int, default=192, help="tokens already cached per request when timing")
    p.add_argument("--reps", type=int, default=5, help="timed forwards per grid point (median)")
    p.add_argument("--temperature", type=float, default=0.7, help="the sampled batches' temperature (default 0.7)")
    p.add_argument("--step-overhead-ms", default=None, metavar="BASE[,PER_REQUEST]",
                   help="a step's cost beyond the forward, in ms (BASE + PER_REQUEST x batch); default: measured "
                   "on a server of the mode (use 0 for a plan for the offline engine)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads while timing (default 1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT, help="serving config path; {host} and {mode} are filled "
                   "(default %(default)s)")
    p.add_argument("--json", dest="json_out", default=None, help="also write every measurement and prediction here")
    p.add_argument("--margin", type=float, default=None,
                   help="how much faster than plain AR steps a speculative candidate must be predicted, as a "
                   "fraction (default 0.15: the served error of the predictions)")
    p.add_argument("--replan", metavar="TUNE.json", default=None,
                   help="plan again from an earlier run's --json (its costs, acceptance and step costs) instead of "
                   "measuring: seconds, not minutes; every mode in it is planned, --margin applies, --out and --json "
                   "are written anew")
    return p


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or values[0] < 1:
        raise UsageError(f"{flag} {text!r}: expected integers >= 1")
    return values


def _modes(text: str) -> list[str]:
    from selfspec.decoding import registry
    from selfspec.tuning.acceptance import GRIDS

    out = []
    for name in (m.strip() for m in text.split(",") if m.strip()):
        try:
            spec = registry.get(name)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if spec.sglang_algorithm is None or spec.name not in GRIDS:
            raise UsageError(f"--modes {name}: tune a served selfspec mode ({', '.join(sorted(GRIDS))})")
        out.append(spec.name)
    if not out:
        raise UsageError("--modes: name at least one mode")
    return out


def run(args: argparse.Namespace) -> int:
    from selfspec.tuning.choose import MARGIN

    args.margin = MARGIN if args.margin is None else args.margin
    if not 0 <= args.margin < 1:
        raise UsageError(f"--margin {args.margin}: expected a fraction in [0, 1), e.g. 0.15")
    if args.replan:
        return _replan(args)
    if not args.model:
        raise UsageError("--model: name the model to tune (an embedded name or a checkpoint directory)")
    import torch
    from tqdm import tqdm

    from selfspec.benchmarks.offline import load_prompts
    from selfspec.decoding.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine
    from selfspec.engines.kernel_choice import ragged_verify_enabled
    from selfspec.serving import cuda_available
    from selfspec.tuning import acceptance, cost

    modes = _modes(args.modes)
    batch_sizes = _int_list(args.batch_sizes, "--batch-sizes")
    widths = _int_list(args.widths, "--widths")
    if args.temperature <= 0:
        raise UsageError("--temperature: the sampled batches' temperature must be > 0 (greedy is always tuned)")
    if not Path(args.prompts).is_file():
        raise UsageError(f"--prompts {args.prompts}: no such file")
    if args.corpus_prompts < 0:  # checked before the model loads
        raise UsageError(f"--corpus-prompts {args.corpus_prompts}: expected >= 0")
    overhead = _overhead_flag(args.step_overhead_ms)
    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    engine = HFEngine.from_pretrained(args.model, dtype=dtype)
    try:
        _, loaded = load_prompts(args.prompts, engine.tokenizer, args.limit + args.corpus_prompts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    prompts, corpus_prompts = loaded[: args.limit], loaded[args.limit :]
    samplings = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=args.temperature)}
    cands = {m: acceptance.candidates_for(m) for m in modes}
    # widths beyond the grid are extrapolated; extend the grid to the widest candidate instead
    widest = max(engine.build_mode(m, opts).max_width
                 for m in modes for opts in acceptance.GRIDS[m])
    if widest > widths[-1]:
        widths.append(widest)
    from selfspec.tuning.calibrate import calibration_batches, server_overhead, stock_ar_overhead

    # AR steps timed at the calibration's batches, and at batch 1 on its AR-only server
    calibrate = [1, *calibration_batches(batch_sizes)[0]] if overhead is None else []
    total = (cost.GRID_PASSES * len(batch_sizes) * len(widths) + sum(len(c) * len(samplings) for c in cands.values())
             + len(calibrate) * len(samplings) * (len(modes) + 1))
    t0 = time.perf_counter()
    overheads: dict[str, dict[str, cost.StepOverhead]] = {}  # mode -> sampling kind -> overhead
    stock_ar: dict[str, cost.StepOverhead] = {}  # sampling kind -> stock AR server's steps
    with tqdm(total=total, desc="tune", unit="run") as bar:
        raw = cost.measure(cost.hf_forward(engine, args.context), batch_sizes, widths, args.reps, bar)
        table = raw.monotone()
        bar.set_description("tune: corpus")
        corpus = acceptance.warm_corpus(engine, corpus_prompts, args.max_new_tokens)
        bar.set_description("tune")
        for m in modes:
            # layouts as the served worker builds them (unpadded where its forwards are ragged)
            acceptance.measure(engine, cands[m], prompts, args.max_new_tokens, samplings, seed=args.seed, progress=bar,
                               corpus=corpus, ragged=ragged_verify_enabled() and not cuda_available())
        for m in modes:
            if overhead is not None:
                overheads[m] = {kind: overhead for kind in samplings}
            else:
                bar.set_description(f"tune: {m} server steps")
                overheads[m] = server_overhead(args.model, m, table, cands[m], prompts[0], batch_sizes,
                                               args.temperature, args.threads, progress=bar)
        if overhead is None:
            bar.set_description("tune: stock AR server steps")
            stock_ar = stock_ar_overhead(args.model, table, prompts[0], batch_sizes, args.temperature,
                                         args.threads, progress=bar)
    host = socket.gethostname().split(".")[0] or "host"
    report: dict[str, Any] = {"schema": "selfspec.tune/v1", "model": args.model, "host": host,
                              "threads": args.threads, "dtype": args.dtype, "temperature": args.temperature,
                              "seconds": time.perf_counter() - t0, "costs": table.to_dict(),
                              "costs_measured": raw.to_dict(), "modes": {},
                              "settings": {k: getattr(args, k) for k in _SETTINGS}}
    if stock_ar:
        report["stock_ar"] = {"step_overhead": {kind: ov.to_dict() for kind, ov in stock_ar.items()}}
    _plan_and_write(modes, table, cands, overheads, batch_sizes, args, report, host)
    return 0


#: the measuring run's settings a --replan takes from its report (the YAML header states them)
_SETTINGS = ("prompts", "limit", "corpus_prompts", "max_new_tokens", "batch_sizes", "context")


def _replan(args: argparse.Namespace) -> int:
    """The plans again from an earlier run's report: its measurements, this run's choice settings."""
    from selfspec.tuning.acceptance import Candidate
    from selfspec.tuning.cost import CostTable, StepOverhead

    try:
        report = json.loads(Path(args.replan).read_text())
        if report.get("schema") != "selfspec.tune/v1" or "costs" not in report:
            raise ValueError("not a `selfspec tune --json` report")
        table = CostTable(**report["costs"])
        modes = list(report["modes"])
        cands = {m: [Candidate.from_dict(c) for c in report["modes"][m]["candidates"]] for m in modes}
        overheads = {m: {k: StepOverhead.from_dict(v) for k, v in _measured_alone(report["modes"][m]).items()}
                     for m in modes}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--replan {args.replan}: {e}") from None
    for key in ("model", "temperature", "threads", "dtype"):
        setattr(args, key, report[key])
    for key, value in report.get("settings", {}).items():  # absent in reports before they were kept
        setattr(args, key, value)
    args.modes = ",".join(modes)
    report = dict(report, modes={}, replanned_from=args.replan)
    _plan_and_write(modes, table, cands, overheads, table.batch_sizes, args, report, report["host"])
    return 0


def _measured_alone(mode_report: dict) -> dict:
    """A mode's step costs as its own servers measured them (before `pool_shared_steps`)."""
    return mode_report.get("step_overhead_unpooled") or mode_report["step_overhead"]


def _plan_and_write(modes, table, cands, overheads, batch_sizes, args, report, host) -> None:
    """Per mode: the plan from the measurements, printed and written as a serving config (and
    into `report`, written to --json)."""
    from selfspec.decoding import registry
    from selfspec.tuning.calibrate import pool_shared_steps
    from selfspec.tuning.choose import buckets, choose, servable, throughput
    from selfspec.tuning.level import plan_levels, settle_widest

    report["margin"] = args.margin
    stock = stock_ar_of(report)
    measured_alone = overheads
    overheads = pool_shared_steps(table, overheads, lambda m: registry.get(m).needs_adapter)
    print(_cost_text(table))
    for m in modes:
        plan, lines, levels = {}, [], {}
        for kind in ("greedy", "sampled"):
            usable = servable(cands[m], kind, registry.get(m).greedy_only)
            choices = choose(table, usable, kind, batch_sizes[-1], overheads[m][kind], margin=args.margin)
            choices = settle_widest(table, choices, usable, kind, LEVEL_REQUESTS, args.max_new_tokens,
                                    overheads[m][kind], margin=args.margin)
            plan[kind] = [b.to_dict() for b in buckets(choices)]
            lines += _overhead_text(kind, overheads[m][kind])
            lines += _choice_text(m, kind, cands[m], choices, batch_sizes)
            ar = next(c for c in cands[m] if c.mode == "ar")
            levels[kind] = plan_levels(table, [ch.best for ch in choices], ar, kind, batch_sizes,
                                       LEVEL_REQUESTS, args.max_new_tokens, overheads[m][kind], stock.get(kind))
            lines += _level_text(kind, levels[kind], args.max_new_tokens, "stock AR" if stock else "AR steps")
        lines += _own_steps_note(m, plan)
        out = Path(args.out.format(host=host, mode=m))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(_yaml_text(m, plan, table, cands[m], lines, args))
        print("\n".join(lines))
        print(f"wrote {out}: serve it with --speculative-algorithm {m.upper()} --selfspec-config {out}")
        ov = overheads[m]
        report["modes"][m] = {"config": str(out), "plan": plan, "candidates": [c.to_dict() for c in cands[m]],
                              "levels": {kind: {str(c): {"plan_tok_s": p, "ar_tok_s": a} for c, (p, a) in lv.items()}
                                         for kind, lv in levels.items()},
                              "levels_ar": "stock" if stock else "mode",
                              "step_overhead": {kind: ov[kind].to_dict() for kind in ov},
                              # each mode's own servers' AR and lookup steps, before pooling
                              "step_overhead_unpooled": {kind: o.to_dict() for kind, o in measured_alone[m].items()},
                              "predicted": {kind: {str(b): {c.label: _finite(throughput(table, c, kind, b, ov[kind]))
                                                            for c in cands[m]} for b in batch_sizes}
                                            for kind in ov}}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))


def stock_ar_of(report: dict) -> dict:
    """Sampling kind -> the stock AR server's step costs a tune report holds (none in reports from
    before it measured them)."""
    from selfspec.tuning.cost import StepOverhead

    return {kind: StepOverhead.from_dict(ov) for kind, ov in (report.get("stock_ar") or {}).get("step_overhead", {}).items()}


def _level_text(kind: str, levels: dict[int, tuple[float, float]], tokens: int, ar: str) -> list[str]:
    """What `selfspec bench serve` should read: each level replayed (`tuning/level.py`)."""
    cells = ", ".join(f"C={c} {p:.0f} tok/s ({p / a:.2f}x {ar})" for c, (p, a) in levels.items())
    return [f"  {kind} bench levels replayed ({LEVEL_REQUESTS} requests x {tokens} tokens, requests finishing "
            f"unevenly, each request's prefill and handling once): {cells}"]


def _own_steps_note(mode: str, plan: dict[str, list[dict]]) -> list[str]:
    """A line saying so when the plan never runs the mode's own steps (a user who asked for
    JACOBI would otherwise find lookup and AR steps in its plan with no word why)."""
    if any(b["mode"] == mode for buckets in plan.values() for b in buckets):
        return []
    return [f"note: no batch size runs {mode.upper()}'s own steps: on this machine and model its plan serves "
            "lookup steps (mode ngram) and plain AR steps, predicted faster at every batch size (table above)"]


def _overhead_flag(text: str | None):
    from selfspec.tuning.cost import StepOverhead

    if text is None:
        return None
    try:
        parts = [float(v) for v in text.split(",")]
    except ValueError:
        raise UsageError(f"--step-overhead-ms {text!r}: expected BASE or BASE,PER_REQUEST in ms") from None
    if len(parts) > 2 or any(v < 0 for v in parts):
        raise UsageError(f"--step-overhead-ms {text!r}: expected BASE or BASE,PER_REQUEST, both >= 0")
    return StepOverhead.linear(parts[0], parts[1] if len(parts) == 2 else 0.0)


def _overhead_text(kind: str, ov) -> list[str]:
    def pts(d: dict, unit: str) -> str:
        return ", ".join(f"{v:.1f} ms at {unit} {k}" for k, v in sorted(d.items())) or "none"

    lines = [f"{kind} step cost beyond the forward: every step {pts(ov.ar_ms, 'batch')}"]
    if len(ov.verify_by_width) >= 2:
        lines += [f"  a step of the mode's own of {w} query tokens also {pts(ov.verify_by_width[w], 'batch')}"
                  for w in sorted(ov.verify_by_width)]
    else:
        lines.append(f"  a verify step also {pts(ov.verify_ms, 'query tokens')}")
    if len(ov.lookup_by_width) >= 2:
        lines += [f"  a lookup step of {w} query tokens also {pts(ov.lookup_by_width[w], 'batch')}"
                  for w in sorted(ov.lookup_by_width)]
        lines.append("  (other widths: linear in the width between and beyond these two, at the step's batch)")
    elif ov.lookup_ms:
        lines.append(f"  a lookup step also {pts(ov.lookup_ms, 'query tokens')}")
    lines += [f"  served {what} step: {pts(steps, 'batch')}" for what, steps in ov.measured.items()]
    if ov.request_ms:
        lines.append(f"  a request besides its steps (prefill, HTTP): {ov.request_ms:.1f} ms")
    return lines


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _cost_text(table) -> str:
    head = "forward ms  " + "".join(f"{'w=' + str(w):>8}" for w in table.widths)
    rows = [f"batch {b:<5} " + "".join(f"{t:8.2f}" for t in row) for b, row in zip(table.batch_sizes, table.ms)]
    return "\n".join([head, *rows])


def _choice_text(mode, kind, cands, choices, batch_sizes) -> list[str]:
    lines = [f"{mode} {kind}: tokens per step, query tokens priced per request (width: the real ones where "
             f"the forward is ragged) and predicted tok/s by batch size"]
    lines.append(f"  {'candidate':36s} {'tok/step':>8} {'width':>5} " + "".join(f"{'b=' + str(b):>9}" for b in batch_sizes))
    by_batch = {c.batch: c for c in choices}
    for cand in cands:
        tps = cand.tokens_per_step.get(kind, float("nan"))
        cells = ""
        for b in batch_sizes:
            v = by_batch[b].tokens_per_s.get(cand.label, float("nan"))  # "-": not a choice for this kind
            mark = "*" if by_batch[b].best is cand else " "
            cells += f"{v:8.0f}{mark}" if math.isfinite(v) else f"{'-':>8} "
        lines.append(f"  {cand.label:36s} {tps:8.2f} {cand.priced_width(kind):5.1f} {cells}")
    return lines


def _yaml_text(mode, plan, table, cands, lines, args) -> str:
    import yaml

    when = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    head = [f"# Width plan for {mode.upper()}, written by `selfspec tune` on {socket.gethostname()} at {when}",
            f"#   selfspec tune --model {args.model} --modes {args.modes} --batch-sizes {args.batch_sizes} "
            f"--temperature {args.temperature} --threads {args.threads}"
            + (f" (re-planned from {args.replan} with --margin {args.margin})" if getattr(args, "replan", None) else ""),
            f"# Serve: python -m sglang.launch_server --model-path <model> --speculative-algorithm {mode.upper()} "
            "--selfspec-config <this file>",
            "# Each decode step runs the bucket its batch falls in (max_batch: up to that many requests;",
            "# greedy batches and batches with a sampled row apart); mode ar is a plain one-token step,",
            "# mode ngram a lookup step (the context candidate alone, no proposals of the mode's own).",
            "#",
            f"# Measured forward time (ms), HF engine, {args.threads} thread(s), {args.dtype}, "
            f"{args.context} cached tokens per request:"]
    head += ["#   " + line for line in _cost_text(table).splitlines()]
    head += ["#", f"# Acceptance: {args.limit} prompts of {args.prompts} x {args.max_new_tokens} tokens; "
             f"sampled = temperature {args.temperature}; * = chosen;",
             f"# greedy context candidates also draw on the next {args.corpus_prompts} prompts' outputs (a served corpus)"]
    head += ["# " + line for line in lines]
    class Dumper(yaml.SafeDumper):  # buckets sharing an option list are written out, not as &id / *id
        def ignore_aliases(self, data) -> bool:
            return True

    body = yaml.dump({"mode": mode.upper(), "plan": plan}, Dumper=Dumper, sort_keys=False, default_flow_style=None)
    return "\n".join(head) + "\n" + body
