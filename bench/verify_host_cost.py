"""Host cost of a sampled verify's pieces on the CPU: the full-vocabulary hash, uniform and
race_argmax of `selfspec.decoding.requests.rng`, `speculative_verify_reference` at one draft, and AR
sampling's draw beside them, at V = 8192 (tiny-idlm's vocabulary) and one thread:

    python bench/verify_host_cost.py [--vocab 8192] [--batches 1,4,16,32] [--repeat 200]

Prints the median microseconds of one call per function and batch size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from selfspec.decoding.requests import rng
from selfspec.decoding.requests.sampling import logits_to_probs, sample_from_probs
from selfspec.decoding.modes.verify import speculative_verify_reference


def _median_us(fn, repeat: int) -> float:
    for _ in range(max(3, repeat // 10)):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def cases(bsz: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(bsz)
    seed = rng.draw_seeds((bsz, 1), g)
    offsets = torch.arange(1, vocab + 1)
    weights = torch.softmax(torch.randn(bsz, vocab, generator=g), -1)
    logits = torch.randn(bsz, 2, vocab, generator=g) * 3
    drafts = torch.randint(0, vocab, (bsz, 1), generator=g)
    num = torch.ones(bsz, dtype=torch.long)
    seeds = rng.draw_seeds((bsz, 2), g)
    probs = logits_to_probs(logits[:, 0], 0.7)
    return {
        "hash_i32": lambda: rng._hash_i32(seed, offsets),
        "uniform": lambda: rng.uniform(seed, offsets),
        "race_argmax": lambda: rng.race_argmax(weights, seed),
        "verify_ref": lambda: speculative_verify_reference(logits, drafts, num, seeds, 0.7),
        "sample_probs": lambda: sample_from_probs(probs, seed.squeeze(1)),
        "logits_to_probs": lambda: logits_to_probs(logits, 0.7),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    table = {b: {name: _median_us(fn, args.repeat) for name, fn in cases(b, args.vocab).items()} for b in batches}
    names = list(next(iter(table.values())))
    print(f"V = {args.vocab}, 1 thread, median us per call")
    print(f"{'B':>4} " + " ".join(f"{n:>15}" for n in names))
    for b in batches:
        print(f"{b:>4} " + " ".join(f"{table[b][n]:>15.1f}" for n in names))


if __name__ == "__main__":
    main()
