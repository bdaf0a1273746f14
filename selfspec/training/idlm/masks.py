"""The I-DLM training layout and its attention mask: one predicate, two renderings.

A training row packs two copies of a clean sequence x_0 = (x_0 .. x_{L-1}) into one forward:

    index:      0 .. L-1              L .. 2L-1
    tokens:     [MASK] * L            x_0 .. x_{L-1}          = [x_t | x_0]
    position:   0 .. L-1              0 .. L-1

The MASK half is cut into stride blocks of N-1 consecutive positions (block k covers positions
k(N-1) .. k(N-1)+N-2). With the logit shift, the output at position p predicts token p+1 in
both halves. Attention (query -> key) follows sequence positions, strictly causally:

- a clean query at position p sees the clean keys at positions <= p (the ordinary AR forward,
  so the clean half keeps the AR mapping: the verify distribution);
- a MASK query at position p in the block starting at s sees the clean keys at positions < s
  and the MASK keys of its own block at positions <= p; never a later clean token, never a
  MASK of another block.

This is exactly what ISD's MASK positions see at inference: a step's N-1 MASKs sit at the
positions s .. s+N-2 right after the last clean (pending / proposed) token s-1, attend
causally to the committed KV cache plus the step's clean tokens (all at positions < s) and to
the earlier MASKs of the step, and the MASK at position s+j predicts token s+j+1. Each MASK
shares the position id of the clean token it stands in for, so RoPE sees what inference sees.

`idlm_mask_mod` is the single definition. `sdpa_mask` renders it as an explicit boolean
[1, 1, 2L, 2L] mask (CPU, SDPA: True = may attend); `flex_block_mask` renders it as a
FlexAttention `BlockMask` (CUDA). Tests compare the two cell by cell.
"""

from __future__ import annotations

import torch


def idlm_mask_mod(q_idx: torch.Tensor, kv_idx: torch.Tensor, seq_len: int, block: int) -> torch.Tensor:
    """May packed index `q_idx` attend to packed index `kv_idx`? (broadcasting int tensors)

    `seq_len` is L (the packed row has 2L tokens: MASKs first, then clean), `block` is the
    number of MASKs per stride block, N-1.
    """
    q_clean = q_idx >= seq_len
    k_clean = kv_idx >= seq_len
    q_pos = torch.where(q_clean, q_idx - seq_len, q_idx)
    k_pos = torch.where(k_clean, kv_idx - seq_len, kv_idx)
    q_block_start = (q_pos // block) * block
    clean_to_clean = q_clean & k_clean & (k_pos <= q_pos)
    mask_to_clean = ~q_clean & k_clean & (k_pos < q_block_start)
    mask_to_mask = ~q_clean & ~k_clean & (k_pos >= q_block_start) & (k_pos <= q_pos)
    return clean_to_clean | mask_to_clean | mask_to_mask


def packed_position_ids(seq_len: int, device=None) -> torch.Tensor:
    """[1, 2L]: positions 0..L-1 for the MASK half, again 0..L-1 for the clean half."""
    pos = torch.arange(seq_len, device=device)
    return torch.cat([pos, pos]).unsqueeze(0)


def packed_input_ids(clean: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """[B, L] clean ids -> [B, 2L] = [MASK * L | clean]."""
    return torch.cat([torch.full_like(clean, mask_token_id), clean], dim=1)


def mask_positions(batch: int, seq_len: int, device=None) -> torch.Tensor:
    """[B, 2L] bool: True at the MASK half (where RISD's gated LoRA is active)."""
    gate = torch.zeros(batch, 2 * seq_len, dtype=torch.bool, device=device)
    gate[:, :seq_len] = True
    return gate


def dense_mask(seq_len: int, stride: int, device=None) -> torch.Tensor:
    """[2L, 2L] bool (True = may attend): the predicate evaluated on every cell."""
    if stride < 2:
        raise ValueError(f"stride N must be >= 2 (N-1 MASKs per block), got {stride}")
    idx = torch.arange(2 * seq_len, device=device)
    return idlm_mask_mod(idx.unsqueeze(1), idx.unsqueeze(0), seq_len, stride - 1)


def sdpa_mask(seq_len: int, stride: int, device=None) -> torch.Tensor:
    """[1, 1, 2L, 2L] boolean mask for `attn_implementation="sdpa"` (transformers uses a 4D
    mask as given; True = attend). Every row has at least its own key, so no row is empty."""
    return dense_mask(seq_len, stride, device)[None, None]


def flex_block_mask(seq_len: int, stride: int, device=None, block_size: int = 128):
    """The same predicate as a FlexAttention `BlockMask` for `attn_implementation="flex_attention"`."""
    from torch.nn.attention.flex_attention import create_block_mask

    if stride < 2:
        raise ValueError(f"stride N must be >= 2 (N-1 MASKs per block), got {stride}")
    block = stride - 1

    def mask_mod(b, h, q_idx, kv_idx):
        return idlm_mask_mod(q_idx, kv_idx, seq_len, block)

    n = 2 * seq_len
    return create_block_mask(mask_mod, None, None, n, n, device=device, BLOCK_SIZE=block_size)


def block_mask_to_dense(block_mask) -> torch.Tensor:
    """Materialise a `BlockMask` cell by cell from its own block tables: full blocks are all True,
    partial blocks apply the mask_mod, absent blocks are False. Returns [Q, KV] bool (batch 0,
    head 0). Used to test that the block-sparse rendering equals the dense one."""
    q_len, kv_len = block_mask.seq_lengths
    bq, bkv = block_mask.BLOCK_SIZE
    out = torch.zeros(q_len, kv_len, dtype=torch.bool)
    q_all = torch.arange(q_len)
    kv_all = torch.arange(kv_len)

    def fill(num_blocks, indices, full: bool) -> None:
        if num_blocks is None:
            return
        num_blocks = num_blocks[0, 0].cpu()
        indices = indices[0, 0].cpu()
        for qb in range(num_blocks.shape[0]):
            q = q_all[qb * bq : (qb + 1) * bq]
            for j in range(int(num_blocks[qb])):
                kb = int(indices[qb, j])
                k = kv_all[kb * bkv : (kb + 1) * bkv]
                if full:
                    out[q.unsqueeze(1), k.unsqueeze(0)] = True
                else:
                    zero = torch.zeros((), dtype=torch.long)
                    out[q.unsqueeze(1), k.unsqueeze(0)] = block_mask.mask_mod(zero, zero, q.unsqueeze(1), k.unsqueeze(0))

    fill(block_mask.kv_num_blocks, block_mask.kv_indices, full=False)
    fill(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, full=True)
    return out


def attention_mask_for(seq_len: int, stride: int, device, attn_implementation: str):
    """The mask object the model's attention implementation takes, from the one predicate."""
    if attn_implementation == "flex_attention":
        return flex_block_mask(seq_len, stride, device)
    return sdpa_mask(seq_len, stride, device)
