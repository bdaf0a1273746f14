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


def _wrap32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding a value in [0, 2^32) -> int32 with the same 32 bits."""
    x = x & _MASK32
    return (x - ((x >> 31) << 32)).to(torch.int32)


def _i32(c: int) -> torch.Tensor:
    return torch.tensor(c - (1 << 32) if c >= 1 << 31 else c, dtype=torch.int32)


_M1_I32, _M2_I32 = _i32(_M1), _i32(_M2)


def _hash_i32(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The hash's 32 bits in an int32 tensor. int32 adds and multiplies wrap modulo 2^32 like
    the uint32 Triton code (right shifts are masked to be logical); the full-vocabulary draws
    hash [B, V] elements, and int32 halves the memory traffic of int64."""
    x = _wrap32((seed.long() & _MASK32) * _GOLDEN) + _wrap32(offset.long())
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _M1_I32
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * _M2_I32
    return x ^ ((x >> 16) & 0xFFFF)


def hash_u32(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash as int64 in [0, 2^32)."""
    return _hash_i32(seed, offset).long() & _MASK32


def uniform(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Uniform in the open interval (0, 1), 23-bit resolution, fp32; broadcasts seed against offset.

    23 bits, not 24: (2^24 - 0.5) / 2^24 rounds to exactly 1.0 in fp32, whose Gumbel noise is
    +inf and would let a zero-probability token win a Gumbel-max draw.
    """
    return (((_hash_i32(seed, offset) >> 9) & 0x7FFFFF).float() + 0.5) * (1.0 / (1 << 23))


def gumbel(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform(seed, offset)))


def draw_seeds(shape: tuple[int, ...], generator: torch.Generator | None = None) -> torch.Tensor:
    """Fresh per-row seeds (int64 in [0, 2^31)) from a torch generator."""
    return torch.randint(0, 2**31 - 1, shape, generator=generator, dtype=torch.long)
