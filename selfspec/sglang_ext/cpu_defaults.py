"""The CPU settings for a machine without an accelerator, in one place: `selfspec serve` adds
them to the command line it builds, and the plugin fills them into a bare
`python -m sglang.launch_server ...` launched on such a machine, so the README's command works
verbatim instead of ending in SGLang's "No accelerator ... is available" traceback.

What they are and why: `SGLANG_USE_CPU_ENGINE=1` (SGLang's own CPU switch, read from the
environment by every SGLang process), `--device cpu`, `--attention-backend torch_native` (the
backend the selfspec verify path extends on CPU), a bounded `--max-total-tokens` (the KV pool
would otherwise be sized from free RAM: a minute to allocate), `--skip-server-warmup`, and
`--dtype float32` (AVX2 CPUs have no bf16 arithmetic; fp32 is faster there and matches the HF
reference engine exactly). The user's own value of any of them always wins.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
#: set by the plugin in the launching process when it chose the CPU for the user
FILLED_ENV = "SELFSPEC_CPU_DEFAULTS"
CPU_MAX_TOTAL_TOKENS = 65536
#: flag -> (ServerArgs attribute, its value when the user did not give the flag, the CPU value)
CPU_FLAGS: dict[str, tuple[str, object, object]] = {
    "--device": ("device", None, "cpu"),
    "--attention-backend": ("attention_backend", None, "torch_native"),
    "--max-total-tokens": ("max_total_tokens", None, CPU_MAX_TOTAL_TOKENS),
    "--skip-server-warmup": ("skip_server_warmup", False, True),
    "--dtype": ("dtype", "auto", "float32"),
}


def cli_defaults() -> dict[str, list[str]]:
    """The flags as command-line words (`selfspec serve`)."""
    out = {}
    for flag, (_, _, value) in CPU_FLAGS.items():
        out[flag] = [] if value is True else [str(value)]
    return out


def accelerator_present() -> bool:
    """Any device SGLang would pick before the CPU (CUDA / ROCm, XPU, MPS, NPU)."""
    try:
        import torch
    except Exception:  # a broken torch is reported by SGLang itself
        return True
    checks = [lambda: torch.cuda.is_available(), lambda: torch.xpu.is_available(),
              lambda: torch.backends.mps.is_available()]
    for check in checks:
        try:
            if check():
                return True
        except Exception:  # noqa: BLE001 - a backend this torch build lacks
            continue
    import importlib.util

    return importlib.util.find_spec("torch_npu") is not None or importlib.util.find_spec("habana_frameworks") is not None


def choose_cpu_engine() -> bool:
    """In an SGLang process with no accelerator and no CPU switch set: set it (inherited by the
    processes SGLang spawns) and remember that the flags are still to fill. True if it did."""
    if CPU_ENGINE_ENV in os.environ or accelerator_present():
        return False
    os.environ[CPU_ENGINE_ENV] = "1"
    os.environ[FILLED_ENV] = "1"
    return True


def fill_server_args(ns) -> list[str]:
    """Set each CPU flag the user left at its default on the parsed namespace (only when the
    plugin chose the CPU engine); returns the flags it filled, and logs them in one line."""
    if os.environ.get(FILLED_ENV) != "1":
        return []
    filled = []
    for flag, (attr, unset, value) in CPU_FLAGS.items():
        if hasattr(ns, attr) and getattr(ns, attr) == unset:
            setattr(ns, attr, value)
            filled.append(flag if value is True else f"{flag} {value}")
    if filled:
        logger.warning("[selfspec] no accelerator found: serving on the CPU with %s=1 %s (what `selfspec serve` "
                       "uses); give --device or %s to choose otherwise", CPU_ENGINE_ENV, " ".join(filled),
                       CPU_ENGINE_ENV)
    return filled
