"""Run stock SGLang 0.5.23 on a CPU without a CPU build of `sgl_kernel`.

`install_cpu_compat()` is called by the selfspec SGLang plugin (`sglang.srt.plugins` entry
point) in every SGLang process. When the CPU engine is selected (`SGLANG_USE_CPU_ENGINE=1`,
SGLang's own `is_cpu()` switch) and no working `sgl_kernel` can be imported, it makes the
pure-PyTorch stand-ins in `ops.py` importable as `sgl_kernel` / `sgl_kernel.speculative`.
A working `sgl_kernel` is never shadowed.

Why a directory on `sys.path` rather than only a `sys.modules` entry or a meta-path finder:
SGLang's scheduler and detokenizer are `multiprocessing` *spawn* children. A spawn child
unpickles its target (`run_scheduler_process`), and so imports `sglang.srt.managers.scheduler`
-> ... -> `sglang.kernels.ops.kvcache.cache_move`, which does `from sgl_kernel import ...`,
*before* the target's first line calls `load_plugins()`. Nothing installed in the parent's
memory survives into a spawn child, but the child does take the parent's `sys.path` before it
unpickles anything (`multiprocessing.spawn.prepare`). So the parent puts `_shim/` (which holds
only an `sgl_kernel` package re-exporting `ops.py`) on `sys.path`, and each child then imports
the shim through the ordinary path finder. In the launching process itself the plugin runs
(`launch_server.py`, `sglang serve`) before the first `sgl_kernel` import.

One case the plugin cannot reach: importing `sglang.srt.entrypoints.engine` (the offline
`sglang.Engine`) itself imports `sgl_kernel`, before `Engine.__init__` loads plugins. Call
`install_cpu_compat()` before that import in such programs.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

SHIM_ROOT = Path(__file__).resolve().parent / "_shim"
#: Set to "0" to never install the stand-ins (for debugging a real sgl_kernel).
DISABLE_ENV = "SELFSPEC_CPU_COMPAT"
SHIM_MARKER = "__selfspec_cpu_shim__"


def _cpu_engine_selected() -> bool:
    # Same switch as sglang.srt.utils.common.is_cpu(); read directly to stay import-light.
    return os.getenv("SGLANG_USE_CPU_ENGINE", "0") == "1"


def is_shim_active() -> bool:
    """True when `sgl_kernel` in this process is the selfspec stand-in."""
    mod = sys.modules.get("sgl_kernel")
    return mod is not None and getattr(mod, SHIM_MARKER, False)


def real_sgl_kernel_importable() -> bool:
    """Try the real `sgl_kernel`; True if it imports. A failed attempt leaves no trace in sys.modules."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return False
    try:
        mod = importlib.import_module("sgl_kernel")
        return not getattr(mod, SHIM_MARKER, False)  # our own stand-in found via sys.path
    except Exception as exc:  # CUDA-only wheel on a CPU box: OSError (libcuda.so.1), ImportError, ...
        logger.info("sgl_kernel is installed but cannot be imported (%s: %s)", type(exc).__name__, exc)
        for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
            del sys.modules[name]
        return False


def install_cpu_compat(force: bool = False) -> bool:
    """Make the pure-torch `sgl_kernel` stand-ins importable if SGLang's CPU path needs them.

    Returns True when the stand-in is (now) the `sgl_kernel` of this process. `force` skips
    the CPU-engine check (still never replaces an importable real `sgl_kernel`).
    Idempotent and cheap on repeat calls.
    """
    if os.getenv(DISABLE_ENV, "1") == "0":
        return False
    if is_shim_active():
        _ensure_on_path(front=False)
        return True
    if "sgl_kernel" in sys.modules:  # a real one is already loaded
        return False
    if not (force or _cpu_engine_selected()):
        return False
    installed_but_broken = importlib.util.find_spec("sgl_kernel") is not None
    if real_sgl_kernel_importable():
        return False
    # Broken install on disk: the shim must come first on sys.path to win in child processes.
    _ensure_on_path(front=installed_but_broken)
    importlib.invalidate_caches()
    mod = importlib.import_module("sgl_kernel")
    if not getattr(mod, SHIM_MARKER, False):  # pragma: no cover - defensive
        raise RuntimeError(f"expected the selfspec sgl_kernel stand-in, got {mod!r}")
    logger.info("selfspec: using pure-PyTorch sgl_kernel stand-ins from %s", SHIM_ROOT)
    return True


def _ensure_on_path(front: bool) -> None:
    root = str(SHIM_ROOT)
    if root in sys.path:
        if front and sys.path[0] != root:
            sys.path.remove(root)
            sys.path.insert(0, root)
        return
    if front:
        sys.path.insert(0, root)
    else:
        sys.path.append(root)


__all__ = ["install_cpu_compat", "is_shim_active", "real_sgl_kernel_importable", "SHIM_ROOT"]
