"""Pure-PyTorch stand-ins for the `sgl_kernel` CPU ops that SGLang 0.5.23 imports on its CPU path
(numpy only for the raw-address KV row copies).

SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`) imports these names from `sgl_kernel` at module
level (`mem_cache/allocation.py`, `kernels/ops/kvcache/cache_move.py`,
`kernels/ops/speculative/{cache_locs,eagle,spec_tree,multi_layer_eagle,reconstruct_tree}.py`).
The only `sgl_kernel` on PyPI is a CUDA build, and SGLang's own CPU kernels need AVX-512/AMX,
so on a plain AVX2 machine none of them exist. Each function here reproduces the contract of
SGLang's Triton/CUDA reference for the same op (same argument order and keyword names, same
in-place outputs); `tests/test_cpu_compat.py` checks them against those references.

All functions run once or a few times per scheduler step on tiny index tensors, so they avoid
Python loops over tokens; the two tree walks (`verify_tree_greedy_cpu`,
`build_tree_kernel_efficient_cpu`) are inherently sequential pointer chasing over a handful of
nodes and walk Python lists instead, which is faster than many tiny torch launches.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

__all__ = [
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
    "verify_tree_greedy_cpu",
    "build_tree_kernel_efficient_cpu",
    "rotate_input_ids_cpu",
    "reconstruct_indices_from_tree_mask",
    "murmur_hash32_cpu",
]


# --------------------------------------------------------------------------------------------
# helpers


def _as_table(req_to_token: torch.Tensor, pool_len: int) -> torch.Tensor:
    # The kernels address `req_to_token + row * pool_len`; accept a flat table as well as 2-D.
    return req_to_token if req_to_token.dim() == 2 else req_to_token.view(-1, pool_len)


def _ragged_coords(
    start_offset: torch.Tensor, end_offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For segments [start_i, end_i): (segment id, column) of every element, packed in order.

    Element k of the packed output belongs to segment `row[k]` at column `col[k]`; segment i
    starts in the packed output at sum_{j<i}(end_j - start_j), as in SGLang's kernels.
    """
    start = start_offset.to(torch.int64).reshape(-1)
    lens = (end_offset.to(torch.int64).reshape(-1) - start).clamp_min(0)
    total = int(lens.sum())
    row = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=total)
    seg_begin = torch.cumsum(lens, 0) - lens  # packed offset of each segment
    col = torch.arange(total, device=lens.device) - seg_begin[row] + start[row]
    return row, col, total


# --------------------------------------------------------------------------------------------
# KV-slot bookkeeping (mem_cache/allocation.py, kernels/ops/speculative/cache_locs.py)


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start_i:end_i] = next (end_i - start_i) entries of out_cache_loc.

    Reference: Triton `assign_req_to_token_pool` in `sglang/srt/mem_cache/allocation.py`.
    """
    table = _as_table(req_to_token, pool_len)
    row, col, total = _ragged_coords(start_offset, end_offset)
    if total == 0:
        return
    rows = req_pool_indices.to(torch.int64).reshape(-1)[row]
    table[rows, col] = out_cache_loc.reshape(-1)[:total].to(table.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Pack req_to_token[req_pool_indices[i], start_i:end_i] for all i, in order, into out_cache_loc.

    Reference: Triton `assign_extend_cache_locs` in `sglang/kernels/ops/speculative/cache_locs.py`.
    Also used with a per-request window as the table (`fill_front_out_cache_loc_func`).
    """
    table = _as_table(req_to_token, pool_len)
    row, col, total = _ragged_coords(start_offset, end_offset)
    if total == 0:
        return
    rows = req_pool_indices.to(torch.int64).reshape(-1)[row]
    out_cache_loc.view(-1)[:total] = table[rows, col].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    speculative_num_steps: int,
) -> None:
    """out_cache_loc[i*W:(i+1)*W] = req_to_token[req_pool_indices[i], seq_lens[i]:seq_lens[i]+W], W = topk*steps.

    Reference: Triton `assign_draft_cache_locs_contiguous` (cache_locs.py); the CPU caller
    never asks for the optional positions / mrope outputs.
    """
    width = int(topk) * int(speculative_num_steps)
    bs = seq_lens.numel()
    if bs == 0 or width == 0:
        return
    table = _as_table(req_to_token, pool_len)
    cols = seq_lens.to(torch.int64).reshape(-1, 1) + torch.arange(width, device=seq_lens.device)
    rows = req_pool_indices.to(torch.int64).reshape(-1, 1)
    out_cache_loc.view(-1)[: bs * width] = table[rows, cols].reshape(-1).to(out_cache_loc.dtype)


# --------------------------------------------------------------------------------------------
# KV-cache row moves (kernels/ops/kvcache/cache_move.py)


def _byte_rows(ptr: int, num_rows: int, row_bytes: int) -> np.ndarray:
    # The op only receives raw buffer addresses (the pool's `data_ptrs`, uint64) and row strides
    # in bytes; a ctypes array over the first `num_rows` rows gives a writable uint8 view of that
    # memory without copying. Only rows < num_rows (= 1 + largest index used) are ever touched.
    raw = (ctypes.c_uint8 * (num_rows * row_bytes)).from_address(ptr)
    return np.frombuffer(raw, dtype=np.uint8).reshape(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every buffer b (base address data_ptrs[b], row size strides[b] bytes): row tgt_loc[k] <- row src_loc[k].

    Reference: Triton `copy_all_layer_kv_cache_tiled` (cache_move.py). Like the Triton kernel,
    all source rows are read before any target row is written, so overlapping src/tgt is safe.
    The row copies go through numpy: its fancy-index assignment is a plain single-threaded
    memcpy per row, while torch's index_put opens an OpenMP region once a copy exceeds its grain
    size, which costs milliseconds per layer on a busy 2-core machine.
    """
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.reshape(-1).to(torch.int64).numpy()
    src = src_loc.reshape(-1).to(torch.int64).numpy()
    num_rows = int(max(tgt.max(), src.max())) + 1
    for ptr, row_bytes in zip(data_ptrs.reshape(-1).tolist(), strides.reshape(-1).tolist()):
        buf = _byte_rows(int(ptr), num_rows, int(row_bytes))
        buf[tgt] = buf[src]  # fancy-index read copies first: in-place safe


# --------------------------------------------------------------------------------------------
# Speculative-decoding commit helpers (kernels/ops/speculative/eagle.py)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """bonus_tokens[i] = accept_tokens.flat[i * accept_stride + accept_lens[i] - 1] (the last accepted token).

    Reference: Triton `fill_bonus_tokens` (eagle.py).
    """
    bs = accept_lens.numel()
    if bs == 0:
        return
    idx = torch.arange(bs, device=accept_lens.device) * int(accept_stride) + accept_lens.reshape(-1).to(torch.int64) - 1
    bonus_tokens.view(-1)[:bs] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """Compact out_cache_loc[accept_index] over the non-(-1) entries of accept_index (flattened, in order).

    Reference: Triton `fill_accept_out_cache_loc` (eagle.py): entry p goes to position
    #{q < p : accept_index[q] != -1}; entries of accept_out_cache_loc past the count are untouched.
    """
    flat = accept_index.reshape(-1).to(torch.int64)
    counted = flat != -1
    dst = torch.cumsum(counted, 0) - counted.to(torch.int64)
    keep = flat > -1
    accept_out_cache_loc.view(-1)[dst[keep]] = out_cache_loc.reshape(-1)[flat[keep]].to(accept_out_cache_loc.dtype)


# --------------------------------------------------------------------------------------------
# Draft trees (kernels/ops/speculative/spec_tree.py, reconstruct_tree.py)


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy walk of each request's draft tree; writes predicts, accept_index, accept_token_num in place.

    Reference: Triton `verify_tree_greedy_kernel_triton` (spec_tree.py) / CUDA `VerifyTreeGreedy`.
    From the root, repeatedly take the first child (in next_token / next_sibling order) whose
    draft token equals the target's argmax at the last accepted node. predicts[node] gets the
    target token at every accepted node, and the bonus target token at the last one.
    The walk is sequential pointer chasing over <= draft_token_num nodes per request, so it
    runs on Python lists and writes all results with one indexed store per output.
    (Keyword names `retrive_*` match the sgl_kernel op schema that SGLang calls with.)
    """
    bs, num_draft = candidates.shape[0], candidates.shape[1]
    num_spec = accept_index.shape[1]
    cand = candidates.reshape(bs, num_draft).tolist()
    r_index = retrive_index.reshape(bs, num_draft).tolist()
    r_next = retrive_next_token.reshape(bs, num_draft).tolist()
    r_sib = retrive_next_sibling.reshape(bs, num_draft).tolist()
    target = target_predict.reshape(-1).tolist()

    pred_pos: list[int] = []
    pred_val: list[int] = []
    acc_rows: list[int] = []
    acc_cols: list[int] = []
    acc_vals: list[int] = []
    num_accepted = [0] * bs
    for b in range(bs):
        last = r_index[b][0]
        acc_rows.append(b)
        acc_cols.append(0)
        acc_vals.append(last)
        n_acc = 0
        cur = 0
        for _ in range(1, num_spec):
            cur = r_next[b][cur]
            want = target[last]
            for _hop in range(num_draft):  # bounded like the reference, even for a malformed list
                if cur == -1 or cand[b][cur] == want:
                    break
                cur = r_sib[b][cur]
            if cur == -1 or cand[b][cur] != want:
                break
            pred_pos.append(last)
            pred_val.append(want)
            n_acc += 1
            last = r_index[b][cur]
            acc_rows.append(b)
            acc_cols.append(n_acc)
            acc_vals.append(last)
        num_accepted[b] = n_acc
        pred_pos.append(last)
        pred_val.append(target[last])

    dev = predicts.device
    flat_pred = predicts.view(-1)
    flat_pred[torch.tensor(pred_pos, dtype=torch.int64, device=dev)] = torch.tensor(
        pred_val, dtype=flat_pred.dtype, device=dev
    )
    accept_index[
        torch.tensor(acc_rows, dtype=torch.int64, device=dev),
        torch.tensor(acc_cols, dtype=torch.int64, device=dev),
    ] = torch.tensor(acc_vals, dtype=accept_index.dtype, device=dev)
    accept_token_num.view(-1)[:bs] = torch.tensor(num_accepted, dtype=accept_token_num.dtype, device=dev)


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Build EAGLE's verify tree (mask, positions, retrieve links) from the draft's top-k selection.

    Reference: Triton `sgl_build_tree_kernel_efficient_triton` (spec_tree.py), modes FULL_MASK (0)
    and QLEN_ONLY (1); retrive_next_token / retrive_next_sibling must arrive filled with -1.
    Node 0 is the verified token; node t>0 is selected_index[t-1]. Its parent is found through
    parent_list[selected // topk]; the mask row of t marks node 0, t and t's ancestors.
    """
    mode = int(tree_mask_mode)
    if mode not in (0, 1):
        # QLEN_ONLY_BITPACKING is only used by GPU attention backends (flashinfer).
        raise NotImplementedError("build_tree_kernel_efficient_cpu: QLEN_ONLY_BITPACKING is not supported")
    n, topk, depth = int(draft_token_num), int(topk), int(depth)
    bs = verified_seq_len.numel()
    if bs == 0:
        return
    sel = selected_index.reshape(bs, -1).tolist()
    par = parent_list.reshape(bs, -1).tolist()

    next_tok = retrive_next_token.reshape(bs, n).tolist()
    next_sib = retrive_next_sibling.reshape(bs, n).tolist()
    block = torch.zeros(bs, n, n, dtype=torch.bool)  # block[b, t, c]: node c visible to node t
    block[:, :, 0] = True
    depth_of = [[0] * n for _ in range(bs)]

    def position_of(b: int, token_idx: int) -> int:
        # Node holding selected entry `token_idx` is 1 + its index in selected_index; -1 if absent.
        for pos in range(n - 1):
            if sel[b][pos] == token_idx:
                return pos
        return -1

    for b in range(bs):
        # Retrieve links: walk nodes from last to first so each parent's child list ends up in
        # ascending order (a later-inserted child becomes the head, pushing the older one to sibling).
        for i in range(n - 1, 0, -1):
            parent_tb = sel[b][i - 1] // topk
            if parent_tb == 0:
                parent_node = 0
            else:
                p = position_of(b, par[b][parent_tb])
                if p < 0:
                    continue  # invalid tree entry (e.g. NaN logprobs); skipped like the reference
                parent_node = p + 1
            head = next_tok[b][parent_node]
            next_tok[b][parent_node] = i
            if head != -1:
                next_sib[b][i] = head
        # Mask rows and depths: follow each node's parent chain (at most `depth` hops).
        for t in range(1, n):
            cur = t - 1
            steps = 0
            for _ in range(depth):
                steps += 1
                block[b, t, cur + 1] = True
                parent_tb = sel[b][cur] // topk
                if parent_tb == 0:
                    break
                cur = position_of(b, par[b][parent_tb])
                if cur < 0:
                    break
            depth_of[b][t] = steps

    dev = positions.device
    retrive_next_token.copy_(torch.tensor(next_tok, dtype=retrive_next_token.dtype).view_as(retrive_next_token))
    retrive_next_sibling.copy_(torch.tensor(next_sib, dtype=retrive_next_sibling.dtype).view_as(retrive_next_sibling))
    retrive_index.view(bs, n).copy_(torch.arange(bs * n, dtype=retrive_index.dtype, device=dev).view(bs, n))
    seq_t = verified_seq_len.reshape(-1, 1).to(torch.int64)
    positions.view(bs, n).copy_((torch.tensor(depth_of, dtype=torch.int64) + seq_t).to(positions.dtype))

    # Scatter the n x n blocks into the flat mask buffer.
    ar = torch.arange(n, dtype=torch.int64)
    if mode == 0:
        # FULL_MASK: request b owns rows of length seq_len_b + n, after all earlier requests' rows;
        # the draft block sits after the seq_len_b prefix columns (left untouched).
        seq_flat = seq_t.view(-1)
        base = n * n * torch.arange(bs, dtype=torch.int64) + n * (torch.cumsum(seq_flat, 0) - seq_flat)
        row_start = base[:, None] + (seq_flat[:, None] + n) * ar[None, :] + seq_flat[:, None]
    else:
        # QLEN_ONLY: dense bs x n x n.
        row_start = n * n * torch.arange(bs, dtype=torch.int64)[:, None] + n * ar[None, :]
    idx = (row_start[:, :, None] + ar[None, None, :]).reshape(-1)
    tree_mask.view(-1)[idx.to(tree_mask.device)] = block.reshape(-1).to(device=tree_mask.device, dtype=tree_mask.dtype)


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """NGRAM verify metadata from a dense bs x n x n tree mask (mask[b, i, j]: j is an ancestor of i, or i itself).

    Reference: `_reconstruct_tree_mask_kernel` (reconstruct_tree.py) / CUDA
    `reconstructIndicesFromTreeMask`: positions = seq_len + #strict ancestors; parent = nearest
    ancestor; next_token = first child; next_sibling = next node with the same parent (-1 for roots).
    """
    bs, n = int(batch_size), int(draft_token_num)
    if bs == 0:
        return
    dev = positions.device
    m = tree_mask.reshape(-1)[: bs * n * n].view(bs, n, n) != 0
    idx = torch.arange(n, device=dev)
    anc = m & (idx[None, :] < idx[:, None])  # anc[b, i, j]: j < i is an ancestor of i
    depth = anc.sum(-1)
    pos = depth + verified_seq_len.reshape(-1, 1).to(torch.int64)
    parent = torch.where(anc, idx, -1).amax(-1)  # [bs, n]
    child = torch.where(anc, idx[None, :, None], n).amin(1)  # smallest i with anc[i, tid]
    next_token = torch.where(child < n, child, -1)
    later = idx[:, None] > idx[None, :]  # [k, tid]: k after tid
    same_parent = (parent[:, :, None] == parent[:, None, :]) & later
    sibling = torch.where(same_parent, idx[None, :, None], n).amin(1)
    next_sibling = torch.where((parent >= 0) & (sibling < n), sibling, -1)

    positions.view(-1)[: bs * n] = pos.reshape(-1).to(positions.dtype)
    retrive_index.view(bs, n).copy_(torch.arange(bs * n, device=dev).view(bs, n))
    retrive_next_token.view(bs, n).copy_(next_token)
    retrive_next_sibling.view(bs, n).copy_(next_sibling)


# --------------------------------------------------------------------------------------------
# Multi-layer EAGLE input rotation (kernels/ops/speculative/multi_layer_eagle.py)


def rotate_input_ids_cpu(
    input_ids: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: torch.Tensor | None = None,
) -> None:
    """Shift each request's extend segment left by one and put topk_index[i] in the freed last slot.

    Reference: Triton `rotate_input_ids_kernel`. With select_index, the new token goes to
    input_ids[select_index[i]] instead of the segment's last slot. Empty segments are skipped.
    """
    start = extend_start_loc.reshape(-1).to(torch.int64)
    lens = extend_seq_lens.reshape(-1).to(torch.int64)
    _, col, _ = _ragged_coords(start, start + (lens - 1).clamp_min(0))
    flat = input_ids.view(-1)
    if col.numel():
        flat[col] = flat[col + 1]  # gather before scatter: a pure left shift
    nonempty = lens > 0
    last = select_index.reshape(-1).to(torch.int64) if select_index is not None else start + lens - 1
    flat[last[nonempty]] = topk_index.reshape(-1)[: lens.numel()][nonempty].to(flat.dtype)


# --------------------------------------------------------------------------------------------
# Seeded sampling hash (kernels/ops/sampling/murmur_hash.py -> torch.ops.sgl_kernel.murmur_hash32_cpu)

_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    # (a * c) mod 2**32 for a < 2**32 held in int64, split in 16-bit halves so no product
    # overflows int64 (signed overflow would be undefined behaviour in the C++ kernels).
    lo = a * (c & 0xFFFF)
    hi = ((a * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(k, 0xCC9E2D51)
    k = _rotl32(k, 15)
    k = _mul32(k, 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """uint32 [n, m] hash of (seed[i] (64-bit), positions[i] (low 32 bits), col_indices[j] (low 32 bits)).

    Reference: Triton `murmur_hash32_kernel` (murmur_hash.py): MurmurHash3 over four 4-byte
    blocks (seed low, seed high, position, column) with length 16.
    """
    s = seed.reshape(-1)
    s = s.view(torch.int64) if s.dtype == torch.uint64 else s.to(torch.int64)  # same bits
    seed_lo = (s & _M32)[:, None]
    seed_hi = ((s >> 32) & _M32)[:, None]
    pos = (positions.reshape(-1).to(torch.int64) & _M32)[:, None]
    col = (col_indices.reshape(-1).to(torch.int64) & _M32)[None, :]
    h = torch.zeros_like(seed_lo)
    h = _murmur3_mix(h, seed_lo)
    h = _murmur3_mix(h, seed_hi)
    h = _murmur3_mix(h, pos)  # [n, 1]
    h = _murmur3_mix(h.expand(-1, col.shape[1]), col.expand(h.shape[0], -1))
    h = _fmix32(h ^ 16)
    return h.to(torch.uint32)
