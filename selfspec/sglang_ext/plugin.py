"""SGLang plugin entry point (`sglang.srt.plugins` group): runs in every SGLang process.

Order matters: the CPU stand-ins for `sgl_kernel` first (SGLang's CPU path imports them), then
the selfspec algorithms and the hooks they need. Hooks are registered here and applied by
SGLang's `load_plugins()` right after every plugin ran (`HookRegistry.apply_hooks`).
"""

from __future__ import annotations

import sys


def _user_errors_in_one_line() -> None:
    """A start-up check that fails ends the launcher with its message alone (it names the fix),
    not with a traceback through SGLang's argument parsing; any other exception keeps its own."""
    from selfspec.errors import UserError

    previous = sys.excepthook
    if getattr(previous, "selfspec", False):
        return

    def hook(kind, value, tb):
        if isinstance(value, UserError):
            print(f"error: {value}", file=sys.stderr)
        else:
            previous(kind, value, tb)

    hook.selfspec = True
    sys.excepthook = hook


def register() -> None:
    from selfspec.sglang_ext.cpu_compat import install_cpu_compat
    from selfspec.sglang_ext.cpu_defaults import choose_cpu_engine

    choose_cpu_engine()  # no accelerator and no CPU switch: the CPU engine (flags: cli_args)
    _user_errors_in_one_line()

    install_cpu_compat()
    from selfspec.sglang_ext.cpu_compat import distributed

    distributed.install()  # --tp-size > 1 on the CPU engine: gloo instead of PyNccl

    from selfspec.sglang_ext import (attention, cli_args, lora, metrics, registration, request_checks, step_timing,
                                     watermark)

    registration.register_algorithms()  # --speculative-algorithm ISD | RISD | JACOBI | SJD
    registration.install()  # room in each request's KV row for the decode reservation
    cli_args.install()  # --selfspec-* flags on SGLang's command line
    attention.install()  # TARGET_VERIFY for the torch_native (CPU) attention backend
    lora.install()  # RISD: per-token gated LoRA inside SGLang's linear layers
    metrics.install()  # per-request TPF / accepted length in meta_info
    watermark.install()  # --enable-watermark with the selfspec algorithms, and on the CPU engine
    request_checks.install()  # 400 for what a mode cannot honour (sampling with JACOBI, penalties, ...)
    step_timing.install()  # SELFSPEC_DEBUG_TIMING=1: the scheduler's phases per decode step, any server
