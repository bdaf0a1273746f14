"""`torch.ops.sgl_kernel.*` stand-ins for the few such ops SGLang's AVX2 CPU path calls.

Nearly every `torch.ops.sgl_kernel.*_cpu` call in SGLang 0.5.23 sits behind
`cpu_has_amx_support()` / `use_intel_amx_backend(...)` (false without the real kernels) or a
`hasattr(torch.ops.sgl_kernel, ...)` probe, so the native torch paths run. The exception is
`murmur_hash32_cpu` (`sglang/kernels/ops/sampling/murmur_hash.py`), which seeded sampling calls
for every CPU tensor unconditionally. SGLang 0.5.23 builds per-request seeds only with
`--enable-deterministic-inference` (`sampling_seed`, default 42), so that is when it is reached.
"""

from __future__ import annotations

import torch

from selfspec.sglang_ext.cpu_compat.ops import murmur_hash32_cpu as _murmur_hash32_cpu

_registered = False


def register_torch_ops() -> None:
    """Define `sgl_kernel::murmur_hash32_cpu` unless something already did (idempotent)."""
    global _registered
    if _registered or hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        _registered = True
        return

    @torch.library.custom_op("sgl_kernel::murmur_hash32_cpu", mutates_args=(), device_types="cpu")
    def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
        return _murmur_hash32_cpu(seed, positions, col_indices)

    @murmur_hash32_cpu.register_fake
    def _(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
        return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)

    _registered = True
