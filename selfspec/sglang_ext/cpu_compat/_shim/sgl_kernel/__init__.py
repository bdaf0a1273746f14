"""selfspec's pure-PyTorch stand-in for `sgl_kernel`, used by SGLang's CPU engine on machines
without a CPU build of sgl-kernel. Only the names SGLang's AVX2 CPU path imports are provided;
anything else raises ImportError / AttributeError exactly as if sgl_kernel were absent, so
SGLang's optional-feature probes (`try: from sgl_kernel.x import y`) keep their fallbacks.
"""

from selfspec.sglang_ext.cpu_compat.ops import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    rotate_input_ids_cpu,
    verify_tree_greedy_cpu,
)
from selfspec.sglang_ext.cpu_compat.torch_ops import register_torch_ops

from . import speculative

__selfspec_cpu_shim__ = True
__version__ = "0.0.0+selfspec.cpu"

# torch.ops.sgl_kernel.* that the AVX2 CPU path calls without checking for AMX first.
register_torch_ops()

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
    "speculative",
]
