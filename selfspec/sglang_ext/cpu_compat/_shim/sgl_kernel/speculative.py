"""Stand-in for `sgl_kernel.speculative` (imported by sglang/kernels/ops/speculative/reconstruct_tree.py)."""

from selfspec.sglang_ext.cpu_compat.ops import reconstruct_indices_from_tree_mask

__all__ = ["reconstruct_indices_from_tree_mask"]
