"""Tensor parallelism on the CPU engine: gloo collectives instead of GPU communicators.

SGLang 0.5.23 builds every model-parallel group with a PyNccl communicator unless the platform
is NPU / XPU / out-of-tree (`parallel_state.init_model_parallel_group`), so `--tp-size 2` with
`--device cpu` dies in `PyNcclCommunicator` ("Expected a cuda device, but got: cpu") whenever the
NCCL wheel that comes with PyPI torch is present. On the CPU engine we turn the GPU-only
communicators off for every group; `GroupCoordinator.all_reduce` / `all_gather` then take their
own CPU branch (its shared-memory kernel where `sgl_kernel` has one, else
`torch.distributed` on the group's gloo backend).
"""

from __future__ import annotations

import os

#: the GPU-only communicators of `init_model_parallel_group`, all off on the CPU engine
GPU_COMMUNICATORS = ("use_pynccl", "use_custom_allreduce", "use_mscclpp", "use_torch_symm_mem_allreduce")


def _cpu_engine() -> bool:
    return os.getenv("SGLANG_USE_CPU_ENGINE", "0") == "1"


def _group_without_gpu_communicators(original, *args, **kwargs):
    if _cpu_engine():
        for name in GPU_COMMUNICATORS:
            kwargs[name] = False
    return original(*args, **kwargs)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.distributed.parallel_state.init_model_parallel_group",
                          _group_without_gpu_communicators, HookType.AROUND)
