"""A per-sequence slot KV cache for Hugging Face decoder models.

Each layer holds one preallocated buffer [B, H_kv, capacity, D]. Sequence b owns the slots
0 .. lengths[b]-1 (its committed prefix, in position order). A multi-token step writes its W
query tokens to the slots lengths[b] .. lengths[b]+W-1 of every row, so sequences with
different committed lengths share one batched forward; the attention mask (see
`step_attention_mask`) lets each query see its own row's committed slots plus the step slots
its layout allows. After the step, `commit` keeps a chain of step slots (in order) by moving
them to lengths[b].. and advancing lengths[b]; everything else written by the step (MASK
positions, rejected drafts, losing branches, padding) is simply beyond the committed length
and is never visible again: it is overwritten by the next step.

The object is handed to the model as `past_key_values`: transformers' attention layers call
`update(key, value, layer_idx)` and attend over what it returns.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    is_compileable = False
    is_sliding: list[bool] = []

    def __init__(self, num_layers: int, batch_size: int, capacity: int, device, dtype):
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.capacity = capacity
        self.device = torch.device(device)
        self.dtype = dtype
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self._write_slots: torch.Tensor | None = None  # [B, W] absolute slots of this step's tokens
        self._visible = 0

    # ------------------------------------------------------------------ step protocol
    def begin_step(self, width: int) -> torch.Tensor:
        """Reserve slots for a step of `width` tokens; returns their slot ids [B, W]."""
        need = int(self.lengths.max()) + width if self.batch_size else width
        if need > self.capacity:
            self._grow(max(need, 2 * self.capacity))
        self._write_slots = self.lengths.unsqueeze(1) + torch.arange(width, device=self.device)
        self._visible = need
        return self._write_slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.keys[layer_idx] is None:
            b, h, _, d = key_states.shape
            self.keys[layer_idx] = torch.zeros(b, h, self.capacity, d, dtype=key_states.dtype, device=key_states.device)
            self.values[layer_idx] = torch.zeros_like(self.keys[layer_idx])
        rows = torch.arange(key_states.shape[0], device=key_states.device).unsqueeze(1)
        # advanced indices (rows, slots) around a slice put the indexed dims first: [B, W, H, D]
        self.keys[layer_idx][rows, :, self._write_slots] = key_states.transpose(1, 2)
        self.values[layer_idx][rows, :, self._write_slots] = value_states.transpose(1, 2)
        return self.keys[layer_idx][:, :, : self._visible], self.values[layer_idx][:, :, : self._visible]

    def commit(self, keep: list[list[int]]) -> None:
        """keep[b]: step-local indices (into this step's W tokens) to keep, in sequence order."""
        src_rows, src_slots, dst_slots = [], [], []
        for b, idx in enumerate(keep):
            base = int(self.lengths[b])
            for j, s in enumerate(idx):
                if s != j:  # a prefix of the step is already in place
                    src_rows.append(b)
                    src_slots.append(base + s)
                    dst_slots.append(base + j)
        if src_rows:
            r = torch.tensor(src_rows, device=self.device)
            s = torch.tensor(src_slots, device=self.device)
            d = torch.tensor(dst_slots, device=self.device)
            for layer in range(self.num_layers):
                if self.keys[layer] is None:
                    continue
                # gather first, then scatter: a source slot may be another row's destination
                k = self.keys[layer][r, :, s].clone()
                v = self.values[layer][r, :, s].clone()
                self.keys[layer][r, :, d] = k
                self.values[layer][r, :, d] = v
        self.lengths += torch.tensor([len(k) for k in keep], dtype=torch.long, device=self.device)
        self._write_slots = None

    def commit_prefix(self, counts: torch.Tensor) -> None:
        """Keep the first counts[b] step tokens of each row: they are already in place, so no KV
        moves (the tensor-only commit of batched rollouts, where every kept chain is a prefix)."""
        self.lengths += counts.to(self.lengths.dtype)
        self._write_slots = None

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (finished sequences leave the batch)."""
        for layer in range(self.num_layers):
            if self.keys[layer] is not None:
                self.keys[layer] = self.keys[layer].index_select(0, rows)
                self.values[layer] = self.values[layer].index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)
        self.batch_size = int(rows.numel())

    # ------------------------------------------------------------------ helpers
    def _grow(self, capacity: int) -> None:
        for layer in range(self.num_layers):
            if self.keys[layer] is None:
                continue
            b, h, old, d = self.keys[layer].shape
            for store in (self.keys, self.values):
                t = torch.zeros(b, h, capacity, d, dtype=store[layer].dtype, device=store[layer].device)
                t[:, :, :old] = store[layer]
                store[layer] = t
        self.capacity = capacity

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max()) if self.batch_size else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._visible, 0

    def __len__(self) -> int:
        return self.num_layers


def step_attention_mask(
    lengths: torch.Tensor, local: torch.Tensor, visible: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive 4D mask [B, 1, W, visible] for one step.

    Query i of row b sees the committed slots < lengths[b] and the step slot lengths[b]+j
    when local[b, i, j] (the step layout's own visibility: causal, or a tree). Every layout
    lets a query see itself, so no row is fully masked (padding included).
    """
    bsz, width, _ = local.shape
    kv = torch.arange(visible, device=lengths.device)
    rel = kv.unsqueeze(0) - lengths.unsqueeze(1)  # [B, S]
    in_step = (rel >= 0) & (rel < width)
    step_vis = local.gather(2, rel.clamp(0, width - 1).unsqueeze(1).expand(bsz, width, visible))
    allowed = (rel < 0).unsqueeze(1) | (step_vis & in_step.unsqueeze(1))
    mask = torch.zeros(bsz, 1, width, visible, dtype=dtype, device=lengths.device)
    return mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)
