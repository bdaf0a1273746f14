"""Which implementation of the verify rules an engine runs: chosen once, when the engine is
built, from `SELFSPEC_KERNELS` (see `selfspec.kernels.dispatch`) and the engine's device.

The decoding core never imports `selfspec.kernels`; it verifies with the `VerifyOps` it is
handed in each step's context, so this module is where the two layers meet.
"""

from __future__ import annotations

import os

import torch

from selfspec.decoding.modes.verify import (
    VerifyOps,
    greedy_verify_candidates_reference,
    greedy_verify_reference,
    speculative_verify_reference,
)
from selfspec.kernels.dispatch import resolve


def verify_ops(device: str | torch.device) -> VerifyOps:
    sample = torch.empty(0, device=device)
    return VerifyOps(
        greedy=resolve("greedy_verify", greedy_verify_reference, sample),
        speculative=resolve("speculative_verify", speculative_verify_reference, sample),
        greedy_candidates=resolve("greedy_verify_candidates", greedy_verify_candidates_reference, sample),
    )


def ragged_verify_enabled() -> bool:
    """Whether the served CPU verify forwards run ragged (`sglang_ext.attention.RaggedVerify`:
    each request's real step tokens only), so the tuner measures the layouts they run. On unless
    `SELFSPEC_RAGGED_VERIFY=0`: a C=16 lookup step of 136 real tokens in a 208-token padded
    block forwarded in 31 ms against 36.5 (the same `selfspec bench serve` level with
    `SELFSPEC_RAGGED_VERIFY=0`); it gains only while a step's finish does not copy the padded
    logits."""
    return os.environ.get("SELFSPEC_RAGGED_VERIFY", "1") != "0"
