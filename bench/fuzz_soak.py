#!/usr/bin/env python
"""The fuzz at length: many mixes of every request feature, sent at once to each served mode,
against stock SGLang's AR server (answering one request at a time) and the reference engine.

    python bench/fuzz_soak.py [--seeds 0-9] [--size 64] [--modes isd,isd-default,risd,jacobi,sjd,sjd-retract]
                              [--aborts 8] [--ar-answers AR.json] [--json out.json]

Per seed, one mix of `--size` requests (tests/sglang_fixtures.py: `fuzz_request`: greedy and
sampled, penalties, logit_bias, stop strings, min_new_tokens, logprobs, regex, JSON schema) is
drawn; stock AR answers each alone (restarted where it goes down: such requests are counted);
then every mode server gets each mix at once (concurrency = size) plus `--aborts` streamed
requests closed after their first chunk, and `sglang_fixtures.check_fuzz` asserts what the test
suite asserts (no 5xx, AR's statuses, greedy == AR or the reference engine, no [MASK], no KV
held afterwards). The bounded version runs in `make test` (3 seeds × 24 requests per server).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

#: the soak's servers: label -> (model, extra SGLang arguments, environment)
SERVERS = {
    "isd": ("tiny-base", ["--speculative-algorithm", "ISD", "--selfspec-policy", "own"], {}),
    "isd-default": ("tiny-base", ["--speculative-algorithm", "ISD"], {}),
    "risd": ("tiny-idlm-lora", [], {}),
    "jacobi": ("tiny-base", ["--speculative-algorithm", "JACOBI"], {}),
    "sjd": ("tiny-base", ["--speculative-algorithm", "SJD"], {}),
    # SGLang's retraction test mode: running requests are retracted and prefilled again
    "sjd-retract": ("tiny-base", ["--speculative-algorithm", "SJD"], {"SGLANG_TEST_RETRACT": "1"}),
}


def _seeds(text: str) -> tuple[int, ...]:
    if "-" in text:
        lo, hi = text.split("-")
        return tuple(range(int(lo), int(hi) + 1))
    return tuple(int(x) for x in text.split(","))


def _abort_streams(base_url: str, prompt_ids: list[int], count: int) -> None:
    """`count` streamed requests, each closed after its first chunk."""
    def one(_):
        body = json.dumps({"input_ids": prompt_ids, "stream": True,
                           "sampling_params": {"temperature": 0, "max_new_tokens": 64}}).encode()
        req = urllib.request.Request(base_url + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            r.readline()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class _Factory:
    """What `start_server` takes from pytest's tmp_path_factory: a fresh log folder."""

    def __init__(self, root: Path):
        self.root = root
        self.n = 0

    def mktemp(self, name: str) -> Path:
        self.n += 1
        path = self.root / f"{name}{self.n}"
        path.mkdir(parents=True, exist_ok=True)
        return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0-9", help="mix seeds: a range 0-9 or a list 0,3,5 (default %(default)s)")
    p.add_argument("--size", type=int, default=64, help="requests per mix, sent at once (default %(default)s)")
    p.add_argument("--modes", default=",".join(SERVERS), help=f"servers among {', '.join(SERVERS)} (default: all)")
    p.add_argument("--ar-answers", default=None, help="stock AR's answers: read from this JSON file when it holds "
                   "the same mixes, else computed and written there")
    p.add_argument("--aborts", type=int, default=8, help="streams closed early per mix (default %(default)s)")
    p.add_argument("--logs", default="/tmp/selfspec-fuzz-soak", help="server logs (default %(default)s)")
    p.add_argument("--json", default=None, help="write the counts here")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in SERVERS]
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose among {', '.join(SERVERS)}")

    import sglang_fixtures as fx
    from transformers import AutoTokenizer

    from selfspec.models import resolve_model
    from selfspec.prompts import HELDOUT_PROMPTS

    base = resolve_model("tiny-base")
    tok = AutoTokenizer.from_pretrained(str(base))
    prompts = [json.loads(line)["prompt"] for line in HELDOUT_PROMPTS.read_text().splitlines() if line.strip()]
    heldout_ids = [tok(x, add_special_tokens=False)["input_ids"] for x in prompts[: fx.NUM_PROMPTS]]
    factory = _Factory(Path(args.logs))
    seeds = _seeds(args.seeds)

    t0 = time.time()
    ar_args = fx.server_args("--disable-radix-cache", "--disable-overlap-schedule")
    mixes = fx.fuzz_mixes(seeds, args.size)
    cache = Path(args.ar_answers) if args.ar_answers else None
    cached = json.loads(cache.read_text()) if cache and cache.is_file() else None
    if cached and cached.get("mixes") == mixes:
        answers = [[tuple(a) for a in row] for row in cached["answers"]]
    else:
        ar = fx.start_server(factory, "ar", ar_args)
        answers, ar = fx.fuzz_answers(ar, mixes, heldout_ids, lambda: fx.start_server(factory, "ar", ar_args))
        ar.stop()
        if cache:
            cache.write_text(json.dumps({"mixes": mixes, "answers": answers}))
    crashed = sum(a[0] == fx.STOCK_AR_CRASHED for row in answers for a in row)
    report = {"seeds": list(seeds), "size": args.size, "requests": sum(len(m) for m in mixes),
              "stock_ar_crashes": crashed, "stock_ar_seconds": round(time.time() - t0, 1),
              "stock_ar_crashed_on": [r for mix, row in zip(mixes, answers) for r, a in zip(mix, row)
                                      if a[0] == fx.STOCK_AR_CRASHED], "modes": {}}
    print(f"stock AR: {report['requests']} requests one at a time, went down on {crashed}", flush=True)
    for mode in modes:
        model, extra, env = SERVERS[mode]
        t1 = time.time()
        proc = fx.start_server(factory, mode, fx.server_args("--disable-radix-cache", *extra), model=model, env=env)
        try:
            greedy_only = mode == "jacobi"
            counts: dict = {}
            failure = None
            for i, seed in enumerate(seeds):
                one = {"fuzz": {"mixes": [mixes[i]], "answers": [answers[i]]}}
                _abort_streams(proc.base_url, heldout_ids[seed % len(heldout_ids)], args.aborts)
                try:
                    got = fx.check_fuzz(proc.base_url, heldout_ids, one, base, mask_token_id=tok.mask_token_id,
                                        greedy_only=greedy_only)
                except AssertionError as e:
                    failure = f"seed {seed}: {str(e)[:2000]}"
                    break
                for k, v in got.items():
                    counts[str(k)] = counts.get(str(k), 0) + v
        finally:
            proc.stop()
        report["modes"][mode] = {"counts": counts, "failure": failure, "seconds": round(time.time() - t1, 1)}
        print(f"{mode}: {'FAILED ' + failure if failure else 'passed'} {counts} ({time.time() - t1:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if any(m["failure"] for m in report["modes"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
