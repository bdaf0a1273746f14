"""TARGET_VERIFY for SGLang's torch_native attention backend (the CPU backend).

SGLang 0.5.23's `TorchNativeAttnBackend.forward_extend` has no target-verify path: it neither
offsets the queries by the committed prefix nor applies `spec_info.custom_mask`. The plugin
wraps it (HookRegistry AROUND, no patched file): TARGET_VERIFY forwards go to `verify_attention`
below, everything else to the original.

Per request r with committed length L and verify width W, the W query tokens attend over the
KV slots `req_to_token[r, :L+W]` (the committed prefix, then the W slots this forward writes)
with the mask `[ones(W, L) | M_r]`, M_r the W x W visibility among the step tokens. Both mask
layouts SGLang uses are accepted: the draft-only one (bs*W*W, what NGRAM passes on CPU) and
the full one (per request W x (L+W), concatenated, what the GPU backends take).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention


@dataclass
class RaggedVerify:
    """A verify forward that carries only each request's real step tokens: request r's first
    `widths[r]` of the W columns, concatenated. The model's projections and LM head cost per token
    on CPU, so a step whose requests draft less than W pays for what they draft; the verify
    attention alone works on the padded [bs, W] block (`padded_rows`), its padding rows unused."""

    rows: torch.Tensor  # [sum(widths)] row of each real token in the padded [bs * W] block
    padded_rows: int  # bs * W

    @classmethod
    def of(cls, widths: list[int], width: int, device) -> "RaggedVerify | None":
        """None when every request fills the width (nothing to leave out)."""
        if min(widths) >= width:
            return None
        real = torch.arange(width) < torch.tensor(widths).unsqueeze(1)  # [bs, W]
        return cls(real.flatten().nonzero().squeeze(1).to(device), len(widths) * width)

    def take(self, padded: torch.Tensor) -> torch.Tensor:
        """The real rows of a per-token tensor of the padded block."""
        return padded[self.rows]

    def pad(self, real: torch.Tensor) -> torch.Tensor:
        """A per-token tensor of the real rows back in the padded block; padding rows are 0."""
        out = real.new_zeros((self.padded_rows, *real.shape[1:]))
        out[self.rows] = real
        return out


@dataclass
class VerifyPlan:
    """What every layer of one verify forward shares: which KV slots each request reads and the
    mask over them. Built once per forward (it was a dozen small ops per layer, a third of a
    small model's attention time at batch 1)."""

    slots: torch.Tensor  # [bs, kv_max] KV slot per column (padding reads a real slot, masked)
    mask: torch.Tensor  # [bs, 1, W, kv_max] bool
    width: int


def plan_verify(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: list[int], width: int,
                custom_mask: torch.Tensor | None) -> VerifyPlan:
    """Each request's KV (its committed prefix of length L, then its W step tokens) as one
    padded [bs, max(L) + W] block, and the mask `[ones(W, L) | M_r]` over it, columns past a
    request's own L + W masked out."""
    bs = len(seq_lens)
    dev = req_to_token.device
    lens = torch.tensor(seq_lens, dtype=torch.long, device=dev)
    kv_max = int(max(seq_lens)) + width
    cols = torch.arange(kv_max, device=dev)
    valid = cols.unsqueeze(0) < (lens + width).unsqueeze(1)  # [bs, kv_max]
    rows = req_to_token[req_pool_indices.long()][:, :kv_max].long()  # [bs, kv_max]
    slots = torch.where(valid, rows, rows[:, :1])
    prefix = cols.unsqueeze(0) < lens.unsqueeze(1)  # [bs, kv_max]
    mask = prefix.unsqueeze(1).expand(bs, width, kv_max).clone()
    if custom_mask is None:
        local = torch.ones(width, width, dtype=torch.bool, device=dev).tril().expand(bs, width, width)
    elif custom_mask.numel() == bs * width * width:
        local = custom_mask.view(bs, width, width).bool()
    else:  # the full [W, L + W] layout of the GPU backends, per request
        local = torch.empty(bs, width, width, dtype=torch.bool, device=dev)
        off = 0
        for r, L in enumerate(seq_lens):
            n = width * (int(L) + width)
            local[r] = custom_mask[off:off + n].view(width, int(L) + width)[:, int(L):].bool()
            off += n
    step_cols = lens.unsqueeze(1) + torch.arange(width, device=dev)  # [bs, W] absolute columns
    mask.scatter_(2, step_cols.unsqueeze(1).expand(bs, width, width), local)
    return VerifyPlan(slots, mask.unsqueeze(1), width)


def verify_attention(
    q: torch.Tensor,  # [bs*W, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, Dv]
    plan: VerifyPlan,
    scaling: float | None,
    out: torch.Tensor,  # [bs*W, Hq, Dv]
) -> torch.Tensor:
    """One SDPA call for the whole batch over the plan's KV block. On CPU a per-request loop
    costs a gather, a mask and an SDPA call per request and layer, which dominated steps of
    small models at batch 16."""
    bs, width = plan.slots.shape[0], plan.width
    # index_select, not k_cache[slots]: the same rows, gathered about 6x faster on a CPU (advanced
    # indexing was a tenth of a batch-16 step)
    slots = plan.slots.reshape(-1)
    key = k_cache.index_select(0, slots).view(bs, -1, *k_cache.shape[1:]).movedim(2, 1)  # [bs, Hkv, kv_max, D]
    value = v_cache.index_select(0, slots).view(bs, -1, *v_cache.shape[1:]).movedim(2, 1)
    query = q.view(bs, width, q.shape[1], q.shape[2]).movedim(2, 1)  # [bs, Hq, W, D]
    if key.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    o = scaled_dot_product_attention(query, key, value, attn_mask=plan.mask, scale=scaling,
                                     enable_gqa=q.shape[1] != k_cache.shape[1])  # [bs, Hq, W, Dv]
    out.copy_(o.movedim(1, 2).reshape(bs * width, o.shape[1], o.shape[3]))
    return out


def _forward_plan(forward_batch, req_to_token: torch.Tensor, width: int) -> VerifyPlan:
    """The forward's plan, built by its first layer and kept on the ForwardBatch (one per forward)."""
    spec = forward_batch.spec_info
    custom_mask = getattr(spec, "custom_mask", None)
    key = (width, id(spec), id(custom_mask), id(forward_batch.req_pool_indices))
    cached = getattr(forward_batch, "_selfspec_verify_plan", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    seq_lens_cpu = forward_batch.seq_lens_cpu
    seq_lens = (seq_lens_cpu if seq_lens_cpu is not None else forward_batch.seq_lens.cpu()).tolist()
    plan = plan_verify(req_to_token, forward_batch.req_pool_indices, seq_lens,
                       width, custom_mask)
    forward_batch._selfspec_verify_plan = (key, plan)
    return plan


def _forward_extend_around(original, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    if not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if layer.is_cross_attention or (layer.sliding_window_size is not None and layer.sliding_window_size > -1):
        raise NotImplementedError("selfspec target verify on torch_native: cross attention / sliding window layers")
    if save_kv_cache and k is not None and v is not None:
        self.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
    q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    spec = forward_batch.spec_info
    ragged: RaggedVerify | None = getattr(spec, "selfspec_ragged", None)
    real_tokens = q_.shape[0]
    if ragged is not None:  # the real rows into the padded query block; padding rows stay unused
        q_ = ragged.pad(q_)
    o = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
    width = int(getattr(spec, "draft_token_num", 0) or getattr(spec, "num_tokens_per_req", 0))
    verify_attention(
        q_, self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.token_to_kv_pool.get_value_buffer(layer.layer_id),
        _forward_plan(forward_batch, self.req_to_token_pool.req_to_token, width), layer.scaling, o,
    )
    if ragged is not None:
        o = ragged.take(o)
    return o.reshape(real_tokens, layer.tp_q_head_num * layer.v_head_dim)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        _forward_extend_around, HookType.AROUND)
