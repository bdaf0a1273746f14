"""The Jacobi Forcing training row, its position ids and its attention mask: one predicate, two renderings.

A row packs a prompt and T blocks of n tokens, each block twice — a noisy Jacobi state k_j
and its fixed point (the clean block) c_j:

    index:     0 .. P-1    P .. P+n-1   P+n .. P+2n-1   ...  P+2(T-1)n ..     .. P+2Tn-1
    tokens:    [prompt]    [k_0]        [c_0]           ...  [k_{T-1}]        [c_{T-1}]
    position:  0 .. P-1    P .. P+n-1   P .. P+n-1      ...  P+(T-1)n ..      (same)

A noisy block shares the position ids of its clean block, so RoPE sees what Jacobi decoding
sees: the state of block j sits right after the prompt and the blocks before it. With the logit
shift the output at offset t of a block predicts the token at offset t+1 (offset n-1 predicts the
next block's first token).

Visibility (query -> key), from `jf_mask_mod`; nothing sees a later block, "causal" = keys at
or before the query in its own block:

| query \\ key | prompt | k_i, i<j | own k_j | c_i, i<j | own c_j |
|---|---|---|---|---|---|
| prompt | causal | - | - | - | - |
| k_j, `nc` (noise-conditioned, Jacobi Forcing's default) | all | yes | causal | no | no |
| k_j, `cllm` (clean context, CLLM) | all | no | causal | yes | no |
| k_j, `nc_ic` (as the seed defines it; window(j) = j // w) | all | window(i) != window(j) | causal | window(i) == window(j) | no |
| c_j (every variant) | all | no | no | yes | causal |

Under `cllm` a noisy block sees exactly what one Jacobi step of that block sees at inference
(prompt + committed blocks + itself), which is also how trajectories are collected; the clean
blocks see a plain causal forward of prompt + fixed points, whatever the variant.

Rows of one batch share P (shorter prompts are left-padded: padding keys are invisible to
everyone, a padding query sees only itself so no row of the mask is empty) and T.
`dense_mask` renders the predicate as an explicit boolean mask for SDPA (CPU);
`flex_block_mask` as a FlexAttention `BlockMask` (CUDA). Tests compare both cell by cell.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CONTEXTS = ("nc", "cllm", "nc_ic")


@dataclass(frozen=True)
class JFLayout:
    prompt_len: int  # P (after left padding)
    block_size: int  # n
    num_blocks: int  # T
    context: str = "nc"  # what a noisy block sees of the earlier blocks (CONTEXTS)
    window: int = 1  # w: nc_ic's window of blocks

    def __post_init__(self) -> None:
        if self.context not in CONTEXTS:
            raise ValueError(f"unknown Jacobi Forcing mask {self.context!r}; choose one of {', '.join(CONTEXTS)}")
        if self.block_size < 2 or self.num_blocks < 1 or self.prompt_len < 1 or self.window < 1:
            raise ValueError(f"bad Jacobi Forcing layout {self}")

    @property
    def length(self) -> int:
        return self.prompt_len + 2 * self.num_blocks * self.block_size

    def noisy_index(self, block: int) -> int:
        return self.prompt_len + 2 * block * self.block_size

    def clean_index(self, block: int) -> int:
        return self.prompt_len + (2 * block + 1) * self.block_size

    def noisy_indices(self, device=None) -> torch.Tensor:
        """[T, n]: the row index of every noisy token."""
        return self._indices(0, device)

    def clean_indices(self, device=None) -> torch.Tensor:
        """[T, n]: the row index of every clean token."""
        return self._indices(1, device)

    def _indices(self, which: int, device) -> torch.Tensor:
        n = self.block_size
        j = torch.arange(self.num_blocks, device=device).unsqueeze(1)
        return self.prompt_len + (2 * j + which) * n + torch.arange(n, device=device)


def jf_mask_mod(q_idx: torch.Tensor, kv_idx: torch.Tensor, layout: JFLayout) -> torch.Tensor:
    """May row index `q_idx` attend to row index `kv_idx`? (broadcasting int tensors; pure index
    arithmetic, so FlexAttention can trace it). Left padding is applied separately (`dense_mask`)."""
    P, n, w = layout.prompt_len, layout.block_size, layout.window
    q_prompt, k_prompt = q_idx < P, kv_idx < P
    q_r, k_r = (q_idx - P).clamp_min(0), (kv_idx - P).clamp_min(0)
    q_blk, k_blk = q_r // (2 * n), k_r // (2 * n)
    q_noisy, k_noisy = (q_r % (2 * n)) < n, (k_r % (2 * n)) < n
    q_off, k_off = q_r % n, k_r % n
    same = q_blk == k_blk
    earlier = k_blk < q_blk
    own_causal = same & (q_noisy == k_noisy) & (k_off <= q_off)

    prompt_query = q_prompt & k_prompt & (kv_idx <= q_idx)
    clean_query = ~q_prompt & ~q_noisy & (k_prompt | (~k_prompt & ~k_noisy & (earlier | own_causal)))
    if layout.context == "nc":
        sees_earlier = k_noisy
    elif layout.context == "cllm":
        sees_earlier = ~k_noisy
    else:  # nc_ic: earlier windows' noisy blocks, the own window's clean blocks
        same_window = (q_blk // w) == (k_blk // w)
        sees_earlier = torch.where(same_window, ~k_noisy, k_noisy)
    noisy_query = ~q_prompt & q_noisy & (k_prompt | (~k_prompt & ((earlier & sees_earlier) | own_causal)))
    return prompt_query | clean_query | noisy_query


def position_ids(layout: JFLayout, prompt_lens: torch.Tensor) -> torch.Tensor:
    """[B, L]: RoPE positions (left padding: the real prompt starts at 0; padding gets 0)."""
    P, n = layout.prompt_len, layout.block_size
    idx = torch.arange(layout.length, device=prompt_lens.device)
    pad = (P - prompt_lens).unsqueeze(1)  # [B, 1]
    r = (idx - P).clamp_min(0)
    block_pos = P + (r // (2 * n)) * n + r % n
    pos = torch.where(idx < P, idx, block_pos).unsqueeze(0) - pad
    return pos.clamp_min(0)


def key_valid(layout: JFLayout, prompt_lens: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: False at left padding."""
    idx = torch.arange(layout.length, device=prompt_lens.device)
    return idx.unsqueeze(0) >= (layout.prompt_len - prompt_lens).unsqueeze(1)


def dense_mask(layout: JFLayout, prompt_lens: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """[B, 1, L, L] bool (True = may attend; B = 1 without `prompt_lens`): the predicate on every
    cell, padding keys removed, every padding query left its own key."""
    idx = torch.arange(layout.length, device=device)
    mask = jf_mask_mod(idx.unsqueeze(1), idx.unsqueeze(0), layout)[None, None]
    if prompt_lens is None:
        return mask
    valid = key_valid(layout, prompt_lens.to(device))
    eye = torch.eye(layout.length, dtype=torch.bool, device=device)[None, None]
    return (mask & valid[:, None, None, :] & valid[:, None, :, None]) | (eye & ~valid[:, None, :, None])


def flex_block_mask(layout: JFLayout, prompt_lens: torch.Tensor | None = None, device=None, block_size: int = 128):
    """The same predicate (and padding rule) as a FlexAttention `BlockMask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    valid = None if prompt_lens is None else key_valid(layout, prompt_lens.to(device))

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = jf_mask_mod(q_idx, kv_idx, layout)
        if valid is None:
            return allowed
        qv, kv = valid[b, q_idx], valid[b, kv_idx]
        return (allowed & qv & kv) | ((q_idx == kv_idx) & ~qv)

    batch = None if prompt_lens is None else int(prompt_lens.shape[0])
    n = layout.length
    return create_block_mask(mask_mod, batch, None, n, n, device=device, BLOCK_SIZE=block_size)


def plain_row(layout: JFLayout, prompt_lens: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(position ids [B, P + Tn], mask [B, 1, P + Tn, P + Tn]) of the plain causal row
    [pad][prompt][response]: what AR decoding sees (the clean rows' view, and the anchor
    teacher's input). Padding as in `dense_mask`."""
    P, total = layout.prompt_len, layout.prompt_len + layout.num_blocks * layout.block_size
    full_pos = position_ids(layout, prompt_lens)
    pos = torch.cat([full_pos[:, :P], full_pos[:, layout.clean_indices().flatten()]], 1)
    valid = torch.arange(total).unsqueeze(0) >= (P - prompt_lens).unsqueeze(1)
    causal = torch.ones(total, total, dtype=torch.bool).tril()[None, None]
    eye = torch.eye(total, dtype=torch.bool)[None, None]
    mask = (causal & valid[:, None, None, :]) | (eye & ~valid[:, None, :, None])
    return pos.to(device), mask.to(device)


def attention_mask_for(layout: JFLayout, prompt_lens: torch.Tensor, device, attn_implementation: str):
    """The mask object the model's attention implementation takes, from the one predicate."""
    if attn_implementation == "flex_attention":
        return flex_block_mask(layout, prompt_lens, device)
    return dense_mask(layout, prompt_lens, device)
