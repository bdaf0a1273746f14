"""`selfspec tune`: a width plan measured on this machine, for when the built-in policy is not enough.

    selfspec tune --model tiny-idlm --mode isd [--prompts tune] [--out plan-isd.yaml]

Every served mode runs a built-in policy with no measurement (`decoding/widths/policy.py`). This
command measures instead: the forward time of this machine by batch size and query tokens per
request (the HF engine, `--threads` torch threads, `--dtype`), and the tokens each candidate
step commits on the `tune` prompts (AR, the mode's own step with a few context-candidate
lengths, lookup steps), then writes, per batch size, the candidate with the most predicted
output tokens per second as a plan. Serve it with `--selfspec-config <file>`: the plan replaces
the policy, its run-time check still measures each bucket against plain AR steps. The plan
records the model it was measured on; a server of another model refuses it at start-up.
About 1-3 minutes on 2 CPU cores for a tiny model.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from selfspec.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", required=True, help="embedded model name or checkpoint / adapter directory")
    p.add_argument("--mode", default="isd", help="the served mode to plan (isd, risd, jacobi, sjd; default isd)")
    p.add_argument("--prompts", default="tune", help="prompt set or JSON-lines file for the acceptance runs "
                   "(default tune: never the eval set reported numbers come from)")
    p.add_argument("--limit", type=int, default=8, help="prompts per acceptance run (default 8)")
    p.add_argument("--corpus-prompts", type=int, default=16,
                   help="the next N prompts' greedy outputs fill the context corpus before the greedy runs, as a "
                   "server's holds what it served before (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt in the acceptance runs")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="batch sizes of the cost grid; the plan covers "
                   "1 … the largest (default %(default)s)")
    p.add_argument("--widths", default="1,4,8,12,16,24", help="query tokens per request of the cost grid")
    p.add_argument("--context", type=int, default=192, help="tokens already cached per request when timing")
    p.add_argument("--reps", type=int, default=3, help="timed forwards per grid point (median)")
    p.add_argument("--temperature", type=float, default=0.7, help="the sampled batches' temperature (default 0.7)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads while timing (default 1, what each "
                   "server process of `selfspec bench serve` gets)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="plan-{mode}.yaml", help="the plan file ({mode} is filled; default %(default)s)")
    p.add_argument("--json", dest="json_out", default=None, help="also write every measurement here")
    return p


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not values or values[0] < 1:
        raise UsageError(f"{flag} {text!r}: expected integers >= 1")
    return values


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from selfspec.prompts import load_prompts
    from selfspec.decoding import registry
    from selfspec.checkpoints.metadata import model_fingerprint
    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine
    from selfspec.engines.kernel_choice import ragged_verify_enabled
    from selfspec.models import resolve_with_adapter
    from selfspec.serving import cuda_available
    from selfspec.tuning import acceptance, cost
    from selfspec.tuning.choose import buckets, choose, servable

    try:
        spec = registry.get(args.mode)
    except ValueError as e:
        raise UsageError(f"--mode: {e}") from None
    if spec.sglang_algorithm is None:
        raise UsageError(f"--mode {args.mode}: plan a served selfspec mode ({', '.join(registry.SGLANG_ALGORITHMS)})")
    batch_sizes = _int_list(args.batch_sizes, "--batch-sizes")
    widths = _int_list(args.widths, "--widths")
    if not 0 < args.temperature:
        raise UsageError(f"--temperature {args.temperature}: the sampled batches' temperature must be > 0")
    if min(args.limit, args.max_new_tokens, args.reps) < 1 or args.corpus_prompts < 0:
        raise UsageError("--limit, --max-new-tokens and --reps must be >= 1, --corpus-prompts >= 0")
    torch.set_num_threads(args.threads)
    engine = HFEngine.from_pretrained(args.model, dtype=torch.float32 if args.dtype == "float32" else torch.bfloat16)
    try:
        _, loaded = load_prompts(args.prompts, engine.tokenizer, args.limit + args.corpus_prompts)
    except ValueError as e:
        raise UsageError(str(e)) from None
    prompts, corpus_prompts = loaded[: args.limit], loaded[args.limit :]
    samplings = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=args.temperature)}
    cands = acceptance.candidates_for(spec.name)
    widest = max(engine.build_mode(c.mode, c.options or None).max_width for c in cands)
    if widest > widths[-1]:  # price the widest candidate inside the grid, not by extrapolation
        widths.append(widest)
    t0 = time.perf_counter()
    total = cost.GRID_PASSES * len(batch_sizes) * len(widths) + len(cands) * len(samplings)
    with tqdm(total=total, desc="tune: forward grid", unit="run") as bar:
        table = cost.measure(cost.hf_forward(engine, args.context), batch_sizes, widths, args.reps, bar).monotone()
        bar.set_description("tune: acceptance")
        corpus = acceptance.warm_corpus(engine, corpus_prompts, args.max_new_tokens)
        acceptance.measure(engine, cands, prompts, args.max_new_tokens, samplings, seed=args.seed, progress=bar,
                           corpus=corpus, ragged=ragged_verify_enabled() and not cuda_available())
    plan: dict[str, list[dict[str, Any]]] = {}
    lines = [_cost_text(table)]
    for kind in samplings:
        choices = choose(table, servable(cands, kind, spec.greedy_only), kind, batch_sizes[-1])
        plan[kind] = [b.to_dict() for b in buckets(choices)]
        lines += _choice_text(kind, cands, choices, batch_sizes)
    try:
        fingerprint = model_fingerprint(resolve_with_adapter(args.model)[0])  # RISD: the base it serves on
    except FileNotFoundError:
        fingerprint = None
    out = Path(args.out.format(mode=spec.name))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_yaml_text(spec.name, plan, fingerprint, lines, args))
    print("\n".join(lines))
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s: serve it with --speculative-algorithm "
          f"{spec.sglang_algorithm} --selfspec-config {out}")
    if args.json_out:
        report = {"schema": "selfspec.tune/v2", "model": args.model, "mode": spec.name, "plan": plan,
                  "costs": table.to_dict(), "candidates": [c.to_dict() for c in cands],
                  "settings": {k: getattr(args, k) for k in ("prompts", "limit", "corpus_prompts", "max_new_tokens",
                                                             "threads", "dtype", "temperature", "context")}}
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _cost_text(table) -> str:
    head = "forward ms  " + "".join(f"{'w=' + str(w):>8}" for w in table.widths)
    rows = [f"batch {b:<5} " + "".join(f"{t:8.2f}" for t in row) for b, row in zip(table.batch_sizes, table.ms)]
    return "\n".join([head, *rows])


def _choice_text(kind, cands, choices, batch_sizes) -> list[str]:
    lines = [f"{kind}: tokens per step, query tokens per request and predicted tok/s by batch size (* = chosen)",
             f"  {'candidate':44s} {'tok/step':>8} {'width':>5} " + "".join(f"{'b=' + str(b):>9}" for b in batch_sizes)]
    by_batch = {c.batch: c for c in choices}
    for cand in cands:
        cells = ""
        for b in batch_sizes:
            v = by_batch[b].tokens_per_s.get(cand.label, float("nan"))
            mark = "*" if by_batch[b].best is cand else " "
            cells += f"{v:8.0f}{mark}" if v == v else f"{'-':>8} "
        tps = cand.tokens_per_step.get(kind, float("nan"))
        lines.append(f"  {cand.label:44s} {tps:8.2f} {cand.priced_width(kind):5.1f} {cells}")
    return lines


def _yaml_text(mode: str, plan: dict, fingerprint: str | None, lines: list[str], args) -> str:
    import yaml

    head = [f"# Width plan for {mode.upper()} on {args.model}, written by `selfspec tune` (forward grid on the HF "
            f"engine, {args.threads} thread(s), {args.dtype};",
            f"# acceptance on {args.limit} prompts of {args.prompts} x {args.max_new_tokens} tokens, sampled at "
            f"temperature {args.temperature}).",
            f"# Serve: python -m sglang.launch_server --model-path <model> --speculative-algorithm {mode.upper()} "
            "--selfspec-config <this file>",
            "# Each decode step runs the bucket its batch falls in (greedy batches and batches with a sampled",
            "# row apart); mode ar is a plain one-token step, mode ngram a lookup step (the context candidate alone)."]
    head += ["# " + line for text in lines for line in text.splitlines()]

    class Dumper(yaml.SafeDumper):  # buckets sharing an option list are written out, not as &id / *id
        def ignore_aliases(self, data) -> bool:
            return True

    body: dict[str, Any] = {"mode": mode.upper(), "plan": plan}
    if fingerprint is not None:
        body["model_fingerprint"] = fingerprint
    return "\n".join(head) + "\n" + yaml.dump(body, Dumper=Dumper, sort_keys=False, default_flow_style=None)
