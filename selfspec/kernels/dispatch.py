"""Chooses between an accelerated kernel and its torch reference.

Every accelerated function has a plain-torch reference with the same signature (the rule's one
definition, in `selfspec.decoding` or next to the kernel); this module only decides which of the
two runs. Callers resolve once and keep the function (the engines when they are built:
`selfspec.engines.kernel_choice`; the gated LoRA layers when they are attached). The choice
follows the environment variable ``SELFSPEC_KERNELS`` at that moment:

* ``auto`` (default): the accelerated implementation when the sample tensor is on CUDA and
  Triton imports; the reference everywhere else.
* ``triton``: always the accelerated (Triton) implementation, whatever the device. CPU tensors
  then need the Triton interpreter: ``TRITON_INTERPRET=1`` must be set *before* the kernel
  modules are imported (Triton fixes interpreted-vs-compiled when a kernel is decorated). This is
  how the CPU test suite runs the kernels.
* ``reference``: always the reference (debugging, bisecting a suspected kernel bug).

Names without a registered kernel always resolve to their reference.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

import torch

ENV_VAR = "SELFSPEC_KERNELS"
MODES = ("auto", "triton", "reference")

# name -> (module, function used when forced to Triton, function used by `auto` on CUDA)
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "greedy_verify": ("selfspec.kernels.verify_triton", "greedy_verify_triton", "greedy_verify_triton"),
    "greedy_verify_candidates": (
        "selfspec.kernels.verify_triton",
        "greedy_verify_candidates_triton",
        "greedy_verify_candidates_triton",
    ),
    "speculative_verify": ("selfspec.kernels.verify_triton", "speculative_verify_triton", "speculative_verify_triton"),
    # gated LoRA: forcing Triton runs the Triton kernel; `auto` picks the measured-faster path
    # (cuBLAS or Triton, see gated_lora_triton.gated_lora_linear_auto).
    "gated_lora_linear": ("selfspec.kernels.gated_lora_triton", "gated_lora_linear_triton", "gated_lora_linear_auto"),
}

_triton_ok: bool | None = None


def mode() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(MODES)}")
    return value


def triton_available() -> bool:
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _triton_ok = True
        except Exception:  # pragma: no cover - depends on the installation
            _triton_ok = False
    return _triton_ok


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def registered() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _load(name: str, forced: bool) -> Callable:
    module_name, forced_fn, auto_fn = _REGISTRY[name]
    module = importlib.import_module(module_name)
    return getattr(module, forced_fn if forced else auto_fn)


def resolve(name: str, reference: Callable, sample: torch.Tensor) -> Callable:
    """The implementation of `name` to call for inputs like `sample` (its device decides)."""
    chosen = mode()
    if chosen == "reference" or name not in _REGISTRY:
        return reference
    if chosen == "triton":
        if not triton_available():
            raise RuntimeError(f"{ENV_VAR}=triton but triton does not import")
        if not sample.is_cuda:
            module_name = _REGISTRY[name][0]
            if module_name not in sys.modules and not interpreter_enabled():
                raise RuntimeError(
                    f"{ENV_VAR}=triton with a {sample.device} tensor needs the Triton interpreter: "
                    "set TRITON_INTERPRET=1 before selfspec.kernels' Triton modules are imported"
                )
            if not getattr(importlib.import_module(module_name), "INTERPRETED", False):
                raise RuntimeError(
                    f"{module_name} was imported without TRITON_INTERPRET=1, so its kernels are compiled "
                    f"for a GPU and cannot take {sample.device} tensors; set the variable before the import"
                )
        return _load(name, forced=True)
    if sample.is_cuda and triton_available():
        return _load(name, forced=False)
    return reference


def resolve_once(name: str, reference: Callable) -> Callable:
    """`reference`'s drop-in that resolves `name` at its first call on each device type and keeps
    that choice (for layers built before the model is moved to its device)."""
    chosen: dict[str, Callable] = {}

    def call(sample: torch.Tensor, *args, **kwargs):
        impl = chosen.get(sample.device.type)
        if impl is None:
            impl = chosen[sample.device.type] = resolve(name, reference, sample)
        return impl(sample, *args, **kwargs)

    return call
