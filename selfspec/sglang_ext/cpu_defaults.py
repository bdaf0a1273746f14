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
from pathlib import Path

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


THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def numa_node_count() -> int:
    """NUMA nodes as SGLang counts them (`numa_utils.get_cpu_ids_by_node`); 1 where unknown."""
    nodes = [p for p in Path("/sys/devices/system/node").glob("node[0-9]*")] if Path("/sys/devices/system/node").is_dir() else []
    return max(1, len(nodes))


def thread_binding(ranks: int, cpus: list[int]) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` scheduler processes: the CPUs split into contiguous
    groups, one per rank (ranks share CPUs round-robin where there are fewer CPUs than ranks)."""
    cpus = sorted(cpus)
    if len(cpus) < ranks:
        return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))
    groups = [cpus[r * len(cpus) // ranks:(r + 1) * len(cpus) // ranks] for r in range(ranks)]
    return "|".join(",".join(map(str, g)) for g in groups)


def fill_thread_binding(ns) -> str | None:
    """On the CPU engine SGLang binds each rank to one NUMA node and refuses more ranks than nodes
    unless SGLANG_CPU_OMP_THREADS_BIND names each rank's CPUs; a 1-node machine with --tp-size 2
    or --dp-size 2 would fail at start-up. When the user set no binding, split this process's
    CPUs between the ranks (inherited by the scheduler processes SGLang spawns). Returns the
    value it set, or None."""
    if os.environ.get(CPU_ENGINE_ENV) != "1" or THREADS_BIND_ENV in os.environ:
        return None
    ranks = int(getattr(ns, "tp_size", 1) or 1) * int(getattr(ns, "dp_size", 1) or 1) * int(getattr(ns, "pp_size", 1) or 1)
    if ranks <= numa_node_count():
        return None
    value = thread_binding(ranks, list(os.sched_getaffinity(0)))
    os.environ[THREADS_BIND_ENV] = value
    logger.warning("[selfspec] %d ranks on %d NUMA node(s): %s=%s (one CPU group per rank; set it yourself to "
                   "choose)", ranks, numa_node_count(), THREADS_BIND_ENV, value)
    return value


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
