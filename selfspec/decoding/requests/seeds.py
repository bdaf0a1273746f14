"""Per-sequence seed streams: where every random draw of a decoding step gets its seed.

A sequence owns a base seed and a counter. A step that needs `width` seeds takes
hash(base, counter + i) for i < width (`selfspec.decoding.requests.rng.hash_u32`, 31 bits kept) and
advances the counter by `width`. Each mode consumes a fixed number of seeds per step, so a
seeded sequence makes the same draws whatever else is in its batch, whatever the batch size,
and whichever engine runs it. The seeds then feed the verify rules' own (seed, offset) contract.
"""

from __future__ import annotations

import torch

from selfspec.decoding.requests import rng


def base_seeds(seed: int | list[int] | None, count: int, generator: torch.Generator | None = None) -> list[int]:
    """One base seed per sequence: a list is used as given; an int s gives s + i to sequence i
    (its index in the request, not in a batch); None draws fresh seeds from torch's RNG."""
    if seed is None:
        return rng.draw_seeds((count,), generator).tolist()
    if isinstance(seed, int):
        return [seed + i for i in range(count)]
    seeds = [int(s) for s in seed]
    if len(seeds) != count:
        raise ValueError(f"got {len(seeds)} seeds for {count} prompts")
    return seeds


def step_seeds(base: torch.Tensor | list[int], counter: torch.Tensor | list[int], width: int) -> torch.Tensor:
    """[B] base seeds, [B] counters (tensors or host lists) -> [B, width] seeds in [0, 2^31)."""
    if isinstance(base, list) or isinstance(counter, list):
        bases, counters = _host(base), _host(counter)
        if len(bases) * width <= rng.SMALL_DRAW:  # a served step at small batch: hashed in Python
            rows = [[rng.hash_int(b, c + i) & 0x7FFFFFFF for i in range(width)] for b, c in zip(bases, counters)]
            return torch.tensor(rows, dtype=torch.long).view(len(bases), width)
        base, counter = torch.tensor(bases, dtype=torch.long), torch.tensor(counters, dtype=torch.long)
    elif base.device.type == "cpu" and base.numel() * width <= rng.SMALL_DRAW:
        return step_seeds(base.tolist(), counter.tolist(), width)
    offsets = counter.unsqueeze(1) + torch.arange(width, device=base.device)
    return rng.hash_u32(base.unsqueeze(1), offsets) & 0x7FFFFFFF


def _host(values: torch.Tensor | list[int]) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else [int(v) for v in values]
