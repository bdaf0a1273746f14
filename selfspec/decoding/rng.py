"""Counter-based random numbers: a (seed, offset) pair always gives the same uniform.

The verify rules draw their randomness from here so that a Triton kernel and the torch
reference, given the same per-row seeds, make bit-identical choices (tests compare them
exactly), and so that a seeded request is reproducible whatever the batch around it.
The hash is the murmur3 32-bit finaliser over seed * golden-ratio + offset, computed in
int64 with explicit 32-bit wrap-around (Triton computes the same in uint32).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35


def hash_u32(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    x = ((seed.long() & _MASK32) * _GOLDEN + offset.long()) & _MASK32
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 13)
    x = (x * _M2) & _MASK32
    x = x ^ (x >> 16)
    return x


def uniform(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Uniform in the open interval (0, 1), 23-bit resolution, fp32; broadcasts seed against offset.

    23 bits, not 24: (2^24 - 0.5) / 2^24 rounds to exactly 1.0 in fp32, whose Gumbel noise is
    +inf and would let a zero-probability token win a Gumbel-max draw.
    """
    return ((hash_u32(seed, offset) >> 9).float() + 0.5) * (1.0 / (1 << 23))


def gumbel(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform(seed, offset)))


def draw_seeds(shape: tuple[int, ...], generator: torch.Generator | None = None) -> torch.Tensor:
    """Fresh per-row seeds (int64 in [0, 2^31)) from a torch generator."""
    return torch.randint(0, 2**31 - 1, shape, generator=generator, dtype=torch.long)
