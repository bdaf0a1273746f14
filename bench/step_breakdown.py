"""What one decode step costs, phase by phase, on servers that run the same requests: by default
stock SGLang's plain AR step beside the selfspec worker's AR steps (`--selfspec-policy ar`) and
the default policy's (sampled batches run AR steps), one request at a time; with `--servers
ngram,lookup-tree --concurrency 32 --temperature 0` SGLang NGRAM's step beside the lookup step's
11-token draft tree at 32 requests.

Every server is up at once (`--sleep-on-idle`) with `SELFSPEC_DEBUG_TIMING=1`, and the prompts
run through them in interleaved chunks (forward then backward), so each meets the same drift
of a shared machine. Every decode step logs the scheduler's phases (`sglang_ext/step_timing.py`:
prepare = `get_next_batch_to_run`, run = `run_batch`, result = `process_batch_result`, loop =
the rest of the event loop) and, on the selfspec worker, its own plan / forward / finish inside
`run_batch`; the table holds their medians over the steps of a full batch (at least 3/4 of
`--concurrency` requests). With `--py-spy` a second
pass samples each scheduler process and splits its non-idle samples by the function they are in
(ms per decode step: samples / rate / every decode step of the pass, the smaller ones included).

    python bench/step_breakdown.py --py-spy --json bench/results/ar-step-breakdown.json
    python bench/step_breakdown.py --servers ngram,lookup-tree --concurrency 32 --temperature 0 \
        --prompts external --num-prompts 96 --py-spy --json bench/results/lookup-step-breakdown.json

About 4 minutes on 2 CPU cores; run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: label -> SGLang flags (the model's own; the CPU settings are added by `ServerSpec`)
SERVERS = {
    "stock-ar": [],
    "worker-ar": ["--speculative-algorithm", "ISD", "--selfspec-policy", "ar"],
    "default": ["--speculative-algorithm", "ISD"],
    "ngram": ["--speculative-algorithm", "NGRAM"],
    # the default policy with its long lookup (the 11-token tree) at every greedy batch size
    "lookup-tree": ["--speculative-algorithm", "ISD", "--selfspec-config",
                    str(Path(__file__).resolve().parent / "fixed_widths" / "policy-tree-wide-isd.yaml")],
}
SCHED = re.compile(r"\[selfspec\] sched step bs=(\d+) prepare ([\d.]+) ms run ([\d.]+) ms result ([\d.]+) ms "
                   r"loop ([\d.na]+) ms")
WORKER = re.compile(r"\[selfspec\] step bs=(\d+) width (\d+) tokens \d+ emitted \d+ plan ([\d.]+) ms "
                    r"forward ([\d.]+) ms finish ([\d.]+) ms")
SCHED_PARTS = ("prepare", "run", "result", "loop")
SPY_RATE = 200  # py-spy samples per second
#: py-spy: a sample's phase is the scheduler method it is under, its part the first of these
#: functions (outermost first) on its stack; what matches none is the phase's "other"
PHASES = (("prepare", ("Scheduler.get_next_batch_to_run",)), ("run", ("Scheduler.run_batch",)),
          ("result", ("Scheduler.process_batch_result",)), ("loop", ("Scheduler.ingest_requests",)))
PARTS = (
    ("prepare_for_decode", ("ScheduleBatch.prepare_for_decode",)),
    ("model forward", ("ModelRunner.forward",)),
    ("sampling", ("ModelRunner.sample", "finish_step", "PlannedMode.finish", "ARMode.finish")),
    ("worker plan", ("SelfSpecWorker._plan_step", "SelfSpecWorker._state_for")),
    ("worker logits rules", ("apply_logits_rules",)),
    ("worker commit", ("SelfSpecWorker._commit_step", "SelfSpecWorker._record_step")),
    ("stream output", ("SchedulerOutputStreamer.stream_output",)),
    ("ngram draft", ("NGRAMWorker._prepare_for_speculative_decoding",)),
    ("ngram corpus", ("NGRAMWorker._update_ngram_corpus",)),
    ("ngram verify", ("eagle_sample",)),
    ("verify attention", ("verify_attention",)),
)
def sched_pid(root: int) -> int | None:
    import psutil

    for child in psutil.Process(root).children(recursive=True):
        try:
            if "scheduler" in " ".join(child.cmdline()).lower() or "scheduler" in child.name().lower():
                return child.pid
        except psutil.Error:
            continue
    return None


def bucket_profile(raw: str, steps: int, rate: int) -> dict[str, float]:
    """py-spy's collapsed stacks (one line per distinct stack: frames outermost first, then the
    count; idle samples left out) -> ms per decode step of each "phase/part"."""
    counts: dict[str, int] = {}
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = [re.sub(r" \(.*", "", f) for f in stack.split(";")]
        if not any(".event_loop" in f for f in frames):
            continue  # another thread
        phase = next((name for name, keys in PHASES if any(f in keys for f in frames)), "loop")
        part = next((f"{phase}/{name}" for f in frames for name, keys in PARTS if f in keys), f"{phase}/other")
        counts[part] = counts.get(part, 0) + int(n)
    return {k: round(1e3 * v / rate / steps, 3) for k, v in sorted(counts.items())} if steps else {}


def medians(text: str, min_batch: int = 1) -> dict:
    """The scheduler phases (and the worker's parts) of a log's decode steps of at least
    `min_batch` requests, medians."""
    rows = [dict(zip(SCHED_PARTS, (float(x) for x in m.groups()[1:]))) for m in SCHED.finditer(text)
            if int(m.group(1)) >= min_batch]
    timed = [r for r in rows if r["loop"] == r["loop"]]  # a step after idle time has no loop part
    out = {"decode_steps": len(rows)}
    if timed:
        out["scheduler_ms"] = {p: round(statistics.median(r[p] for r in timed), 3) for p in SCHED_PARTS}
        out["scheduler_ms"]["period"] = round(sum(out["scheduler_ms"][p] for p in SCHED_PARTS), 3)
    worker = [m for m in WORKER.finditer(text) if int(m.group(1)) >= min_batch]
    if worker:
        out["worker_ms"] = {p: round(statistics.median(float(m.group(i)) for m in worker), 3)
                            for i, p in ((3, "plan"), (4, "forward"), (5, "finish"))}
    return out


def main(argv: list[str] | None = None) -> int:
    from selfspec.benchmarks.load import run_requests
    from selfspec.prompts import load_prompt_set
    from selfspec.serving import ServerProcess, ServerSpec

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-idlm")
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight; the table reads the steps "
                   "of at least 3/4 as many (default %(default)s)")
    p.add_argument("--interleave", type=int, default=3, help="rounds: each server runs a chunk of the prompts in "
                   "turn, forward then backward (default %(default)s)")
    p.add_argument("--servers", default="stock-ar,worker-ar,default", help=f"of {', '.join(SERVERS)} "
                   "(default %(default)s)")
    p.add_argument("--py-spy", action="store_true", help="also sample each scheduler with py-spy (a separate "
                   "pass: sampling slows what it samples)")
    p.add_argument("--json", help="write the table here")
    args = p.parse_args(argv)
    spy_bin = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    work = Path(tempfile.mkdtemp(prefix="ar-steps-"))
    labels = args.servers.split(",")
    if unknown := [lab for lab in labels if lab not in SERVERS]:
        p.error(f"unknown server {', '.join(unknown)}: choose from {', '.join(SERVERS)}")
    min_batch = max(1, (3 * args.concurrency + 3) // 4)
    prompts = load_prompt_set(args.prompts)[:args.num_prompts]
    chunks = [prompts[i::args.interleave] for i in range(args.interleave)]
    os.environ["SELFSPEC_DEBUG_TIMING"] = "1"
    servers = {lab: ServerProcess(ServerSpec(args.model, port=None, extra_args=SERVERS[lab] + ["--sleep-on-idle"]),
                                  log_path=work / f"server-{lab}.log") for lab in labels}
    text = {lab: "" for lab in labels}
    spy_text = {lab: "" for lab in labels}
    tokens = {lab: 0 for lab in labels}
    wall = {lab: 0.0 for lab in labels}
    try:
        for lab, srv in servers.items():
            srv.start()
            run_requests(srv.base_url, prompts[:2], 2, args.max_tokens, args.temperature, False)  # warm-up
        passes = ("timing", "py-spy") if args.py_spy else ("timing",)
        for kind in passes:
            for r, chunk in enumerate(chunks):
                for lab in (labels if r % 2 == 0 else labels[::-1]):
                    srv, log = servers[lab], work / f"server-{lab}.log"
                    mark, spy, out = log.stat().st_size, None, work / f"{lab}-{kind}-{r}.pyspy.txt"
                    if kind == "py-spy" and (pid := sched_pid(srv.proc.pid)) is not None:
                        spy = subprocess.Popen([spy_bin, "record", "-p", str(pid), "-f", "raw", "-r", str(SPY_RATE),
                                                "-o", str(out), "--nonblocking"],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                        time.sleep(1.0)
                    res = run_requests(srv.base_url, chunk, args.concurrency, args.max_tokens, args.temperature, False)
                    if spy is not None:
                        spy.send_signal(signal.SIGINT)
                        spy.wait(timeout=60)
                    time.sleep(0.3)
                    with open(log, errors="replace") as f:
                        f.seek(mark)
                        piece = f.read()
                    if kind == "timing":
                        text[lab] += piece
                        tokens[lab] += sum(x["tokens"] for x in res.results)
                        wall[lab] += res.wall_s
                    elif out.exists():
                        spy_text[lab] += out.read_text(errors="replace")
                        text[lab + "/py-spy"] = text.get(lab + "/py-spy", "") + piece
    finally:
        for srv in servers.values():
            srv.stop()
    report = {"model": args.model, "prompts": args.prompts, "num_prompts": args.num_prompts,
              "max_tokens": args.max_tokens, "temperature": args.temperature, "concurrency": args.concurrency,
              "min_batch": min_batch,
              "interleave": args.interleave, "servers": {}}
    for lab in labels:
        row = {"server_args": SERVERS[lab], "tokens": tokens[lab], "output_tok_s": round(tokens[lab] / wall[lab], 2),
               **medians(text[lab], min_batch)}
        if spy_text[lab]:
            row["py_spy_ms"] = bucket_profile(spy_text[lab], medians(text[lab + "/py-spy"])["decode_steps"], SPY_RATE)
        report["servers"][lab] = row
    print(f"\nms per decode step of >= {min_batch} requests (medians), {args.prompts}, T={args.temperature}, "
          f"C={args.concurrency}")
    print(f"{'':>10} " + " ".join(f"{p:>8}" for p in SCHED_PARTS + ("period",)) + "    tok/s   worker plan/forward/finish")
    for lab, r in report["servers"].items():
        s, w = r.get("scheduler_ms", {}), r.get("worker_ms")
        print(f"{lab:>10} " + " ".join(f"{s.get(p, float('nan')):>8.3f}" for p in SCHED_PARTS + ("period",))
              + f" {r['output_tok_s']:>8.1f}" + ("   " + " / ".join(f"{w[k]:.3f}" for k in ("plan", "forward", "finish"))
                                                  if w else ""))
    if args.py_spy:
        parts = sorted({k for r in report["servers"].values() for k in r.get("py_spy_ms", {})})
        print("\npy-spy, ms per decode step (non-idle samples)")
        print(f"{'':>28} " + " ".join(f"{lab:>10}" for lab in labels))
        for k in parts:
            print(f"{k:>28} " + " ".join(f"{report['servers'][lab].get('py_spy_ms', {}).get(k, 0.0):>10.3f}"
                                          for lab in labels))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json} (logs: {work})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
