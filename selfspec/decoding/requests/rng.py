"""Counter-based random numbers: a (seed, offset) pair always gives the same uniform.

The verify rules draw their randomness from here so that a Triton kernel and the torch
reference, given the same per-row seeds, make bit-identical choices (tests compare them
exactly), and so that a seeded request is reproducible whatever the batch around it.
The hash is the murmur3 32-bit finaliser over seed * golden-ratio + offset modulo 2^32 (Triton
computes it in uint32): on the CPU in numpy uint32 arrays, elsewhere in int32 tensors with
masked shifts, and for a handful of values in Python ints (`hash_int`); tests hold all three to
the same bits.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from selfspec.decoding.argmax import first_argmax

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35


def _i32(c: int) -> torch.Tensor:
    return torch.tensor(c - (1 << 32) if c >= 1 << 31 else c, dtype=torch.int32)


_GOLDEN_I32, _M1_I32, _M2_I32 = _i32(_GOLDEN), _i32(_M1), _i32(_M2)
_GOLDEN_U32, _M1_U32, _M2_U32 = np.uint32(_GOLDEN), np.uint32(_M1), np.uint32(_M2)


#: Draws of at most this many values are hashed in Python: a served step at batch 1 draws a
#: handful of seeds and uniforms, where each of the tensor path's ~12 ops costs more than the
#: whole Python hash of one value.
SMALL_DRAW = 32


def hash_int(seed: int, offset: int) -> int:
    """The hash of one (seed, offset) pair, in [0, 2^32): the same bits as the tensor path."""
    x = (((seed & _MASK32) * _GOLDEN) + offset) & _MASK32
    x ^= x >> 16
    x = (x * _M1) & _MASK32
    x ^= x >> 13
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def _small_pairs(seed: torch.Tensor, offset: torch.Tensor) -> tuple[list, list, torch.Size] | None:
    """(seeds, offsets, shape) as host lists when the draw is small and on the CPU, else None."""
    if seed.device.type != "cpu" or offset.device.type != "cpu":
        return None
    if seed.shape != offset.shape:
        if seed.numel() > SMALL_DRAW or offset.numel() > SMALL_DRAW:
            return None
        seed, offset = torch.broadcast_tensors(seed, offset)
    if seed.numel() > SMALL_DRAW:
        return None
    return seed.flatten().tolist(), offset.flatten().tolist(), seed.shape


def _hash_small(pairs: tuple[list, list, torch.Size]) -> torch.Tensor:
    seeds, offsets, shape = pairs
    bits = [hash_int(s, o) for s, o in zip(seeds, offsets)]
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(shape)


def _low32(seed: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seed and offset as int32 holding their low 32 bits (what `& 0xFFFFFFFF` keeps: torch's
    int64 -> int32 cast truncates; tests check it against `hash_int` at values >= 2^31 and < 0)."""
    return seed.to(torch.int32), offset.to(torch.int32)


def _mix_np(seed: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The hash over uint32 arrays, as `hash_int` writes it: numpy's uint32 multiply wraps modulo
    2^32 and its right shift is logical, so no masks; every step after the first is in place.
    On a CPU each numpy op over a [B, V] draw costs about a third of the torch op's time."""
    x = np.empty(np.broadcast_shapes(seed.shape, offset.shape), np.uint32)
    np.add(np.multiply(seed, _GOLDEN_U32, out=np.empty(seed.shape, np.uint32)), offset, out=x)
    t = np.empty_like(x)
    x ^= np.right_shift(x, 16, out=t)
    x *= _M1_U32
    x ^= np.right_shift(x, 13, out=t)
    x *= _M2_U32
    x ^= np.right_shift(x, 16, out=t)
    return x


def _mix_torch(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The hash in int32 tensors (any device): adds and multiplies wrap modulo 2^32 like the uint32
    Triton code; right shifts are masked to be logical. One temporary, the rest in place."""
    x = seed * _GOLDEN_I32 + offset
    t = torch.empty_like(x)
    x ^= torch.bitwise_right_shift(x, 16, out=t).bitwise_and_(0xFFFF)
    x *= _M1_I32
    x ^= torch.bitwise_right_shift(x, 13, out=t).bitwise_and_(0x7FFFF)
    x *= _M2_I32
    x ^= torch.bitwise_right_shift(x, 16, out=t).bitwise_and_(0xFFFF)
    return x


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def _u32(t: torch.Tensor) -> np.ndarray:
    """An int32 CPU tensor's bits as a uint32 array (shares memory)."""
    return t.numpy().view(np.uint32)


def _hash_i32(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The hash's 32 bits in an int32 tensor (the full-vocabulary draws hash [B, V] elements, and
    int32 halves the memory traffic of int64); seed broadcasts against offset."""
    pairs = _small_pairs(seed, offset)
    if pairs is not None:
        return _hash_small(pairs)
    seed, offset = _low32(seed, offset)
    if _on_cpu(seed, offset):
        return torch.from_numpy(_mix_np(_u32(seed), _u32(offset)).view(np.int32))
    return _mix_torch(seed, offset)


def hash_u32(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash as int64 in [0, 2^32)."""
    return _hash_i32(seed, offset).long() & _MASK32


def _uniform_np(bits: np.ndarray) -> np.ndarray:
    """`uniform` of uint32 hash bits, reusing their array for the shift."""
    u = np.right_shift(bits, 9, out=bits).astype(np.float32)
    u += 0.5
    u *= 1.0 / (1 << 23)
    return u


def uniform(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Uniform in the open interval (0, 1), 23-bit resolution, fp32; broadcasts seed against offset.

    23 bits, not 24: (2^24 - 0.5) / 2^24 rounds to exactly 1.0 in fp32, whose Gumbel noise is
    +inf and would let a zero-probability token win a Gumbel-max draw.
    """
    pairs = _small_pairs(seed, offset)
    if pairs is not None:  # (k + 0.5) / 2^23 with k < 2^23 is exact in float32 as in double
        seeds, offsets, shape = pairs
        values = [((hash_int(s, o) >> 9) + 0.5) * (1.0 / (1 << 23)) for s, o in zip(seeds, offsets)]
        return torch.tensor(values, dtype=torch.float32).view(shape)
    seed, offset = _low32(seed, offset)
    if _on_cpu(seed, offset):
        return torch.from_numpy(_uniform_np(_mix_np(_u32(seed), _u32(offset))))
    x = _mix_torch(seed, offset)
    x >>= 9
    u = x.bitwise_and_(0x7FFFFF).float()
    u += 0.5
    u *= 1.0 / (1 << 23)
    return u


def uniform_at(seed: torch.Tensor, offset: int) -> torch.Tensor:
    """`uniform(seed, offset)` at one offset for every seed."""
    if seed.device.type == "cpu" and seed.numel() <= SMALL_DRAW:
        values = [((hash_int(s, offset) >> 9) + 0.5) * (1.0 / (1 << 23)) for s in seed.flatten().tolist()]
        return torch.tensor(values, dtype=torch.float32).view(seed.shape)
    return uniform(seed, torch.full_like(seed, offset))


def gumbel(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return -torch.log(-torch.log(uniform(seed, offset)))


@functools.lru_cache(maxsize=16)
def _vocab_offsets(vocab: int, device: torch.device) -> torch.Tensor:
    """int32 arange(1, vocab + 1): the Gumbel offsets of a vocabulary, made once per (V, device)."""
    return torch.arange(1, vocab + 1, dtype=torch.int32, device=device)


def race_argmax(weights: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max draw from unnormalised weights [..., V] with seed [..., 1]: the first
    argmax over v of log w(v) + gumbel(seed, v + 1), computed as its exponential-race form
    w(v) / -log(uniform(seed, v + 1)) (log is monotone, so the winner is the same up to float
    rounding at exact ties): one log over the vocabulary instead of three, a large part of a
    sampled verify at batch 1 on a CPU. Zero weights never win (unless every weight is zero).
    The Triton kernels evaluate the log form.

    The float ops are the formula's, in its order, on a fresh uniform tensor (so in place): the
    same bits (tests compare the draw with the formula written out)."""
    u = uniform(seed, _vocab_offsets(weights.shape[-1], weights.device))
    return first_argmax(weights / u.log_().neg_())


def draw_seeds(shape: tuple[int, ...], generator: torch.Generator | None = None) -> torch.Tensor:
    """Fresh per-row seeds (int64 in [0, 2^31)) from a torch generator."""
    return torch.randint(0, 2**31 - 1, shape, generator=generator, dtype=torch.long)
