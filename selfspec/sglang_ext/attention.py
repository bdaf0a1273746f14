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

import math
from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention


@dataclass
class RaggedVerify:
    """A verify forward that carries only each request's real step tokens: request r's first
    `widths[r]` of the W columns, concatenated. The model's projections and LM head cost per token
    on CPU, so a step whose requests draft less than W pays for what they draft; the verify
    attention runs per group of requests of similar width (`width_groups`), each group's queries
    padded to its own widest request rather than to W."""

    rows: torch.Tensor  # [sum(widths)] row of each real token in the padded [bs * W] block
    padding: torch.Tensor  # the other rows
    padded_rows: int  # bs * W
    widths: list[int]

    @classmethod
    def of(cls, widths: list[int], width: int, device) -> "RaggedVerify | None":
        """None when every request fills the width (nothing to leave out)."""
        if min(widths) >= width:
            return None
        real = (torch.arange(width) < torch.tensor(widths).unsqueeze(1)).flatten()  # [bs * W]
        return cls(real.nonzero().squeeze(1).to(device), (~real).nonzero().squeeze(1).to(device),
                   len(widths) * width, list(widths))

    def take(self, padded: torch.Tensor) -> torch.Tensor:
        """The real rows of a per-token tensor of the padded block."""
        return padded[self.rows]

    def pad(self, real: torch.Tensor, buffer: "PadBuffer | None" = None) -> torch.Tensor:
        """A per-token tensor of the real rows back in the padded block; padding rows are 0.
        `buffer`: reuse its memory (a batch-32 step's padded logits are 14 MB, and freshly
        mapped pages cost a fault each: ~2 ms a step here)."""
        shape = (self.padded_rows, *real.shape[1:])
        if buffer is None:
            out = real.new_zeros(shape)
        else:  # only the padding rows need zeros: the real ones are overwritten
            out = buffer.view(shape, real.dtype, real.device).index_fill_(0, self.padding, 0)
        return out.index_copy_(0, self.rows, real)


class PadBuffer:
    """Memory kept between uses, valid until the next `view`: a step's padded logits (the
    scheduler consumes them before it runs the next step: overlap scheduling is off for the
    selfspec algorithms) or a layer's gathered KV."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        numel = math.prod(shape)
        flat = self._flat
        if flat is None or flat.numel() < numel or flat.dtype != dtype or flat.device != torch.device(device):
            flat = self._flat = torch.empty(numel, dtype=dtype, device=device)
        return flat[:numel].view(shape)


#: One more SDPA call per layer costs about what this many padded query rows do (CPU, tiny
#: models, 300-600 KV columns: ~0.1 ms a call, 7-14 us a row)
GROUP_COST_ROWS = 16
#: CPU SDPA in bf16 takes a slow path for a single query row (3x the time of two rows here)
MIN_GROUP_WIDTH = 2


def width_groups(widths: list[int], max_groups: int = 3) -> list[tuple[list[int], int]]:
    """The requests in at most `max_groups` groups of neighbouring widths, each padded to its
    widest (at least `MIN_GROUP_WIDTH`), with the fewest padded query rows plus `GROUP_COST_ROWS`
    per group: (request indices, width) per group. A batch where a few requests draft long and
    most short runs the short ones narrow."""
    order = sorted(range(len(widths)), key=lambda r: widths[r])
    w = [max(widths[r], MIN_GROUP_WIDTH) for r in order]
    n = len(w)
    ends = [i for i in range(1, n + 1) if i == n or w[i] != w[i - 1]]  # a group ends between widths
    # best[g][i]: the first i sorted requests in g groups; cut[g][i]: where the last group starts
    best = [dict.fromkeys([0] + ends, math.inf) for _ in range(max_groups + 1)]
    cut = [dict.fromkeys([0] + ends, 0) for _ in range(max_groups + 1)]
    best[0][0] = 0.0
    for g in range(1, max_groups + 1):
        for i in ends:
            for j in [0] + ends:
                if j < i and best[g - 1][j] < math.inf:
                    cost = best[g - 1][j] + (i - j) * w[i - 1] + GROUP_COST_ROWS
                    if cost < best[g][i]:
                        best[g][i], cut[g][i] = cost, j
    g = min(range(1, max_groups + 1), key=lambda k: best[k][n])
    groups, i = [], n
    while i > 0:
        j = cut[g][i]
        groups.append((sorted(order[j:i]), w[i - 1]))
        i, g = j, g - 1
    return groups[::-1]


@dataclass
class VerifyPart:
    """Requests of a verify forward that share one SDPA call (the whole batch unless the forward
    is ragged), their queries padded to `width`."""

    requests: torch.Tensor | None  # batch indices; None: the whole batch, in order
    width: int
    slots: torch.Tensor  # [n * kv_max] KV slot per column (padding reads a real slot, masked)
    mask: torch.Tensor  # [n, 1, width, kv_max] bool


@dataclass
class VerifyPlan:
    """What every layer of one verify forward shares: which KV slots each request reads and the
    mask over them. Built once per forward (it was a dozen small ops per layer, a third of a
    small model's attention time at batch 1)."""

    parts: list[VerifyPart]
    batch: int
    width: int  # W: the query block is [batch, W]
    kv_max: int


def plan_verify(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: list[int], width: int,
                custom_mask: torch.Tensor | None, real_widths: list[int] | None = None) -> VerifyPlan:
    """Each request's KV (its committed prefix of length L, then its W step tokens) as one
    padded [bs, max(L) + W] block, and the mask `[ones(W, L) | M_r]` over it, columns past a
    request's own L + W masked out. `real_widths` (a ragged forward): each request's real step
    tokens, which split the batch into `width_groups`."""
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
    mask = mask.unsqueeze(1)
    groups = width_groups(real_widths) if real_widths is not None else [(list(range(bs)), width)]
    if len(groups) == 1 and groups[0][1] == width:
        return VerifyPlan([VerifyPart(None, width, slots.reshape(-1), mask)], bs, width, kv_max)
    parts = []
    for reqs, w in groups:
        idx = torch.tensor(reqs, dtype=torch.long, device=dev)
        parts.append(VerifyPart(idx, w, slots.index_select(0, idx).reshape(-1),
                                mask.index_select(0, idx)[:, :, :w].contiguous()))
    return VerifyPlan(parts, bs, width, kv_max)


#: the gathered keys / values of a part, reused by every part, layer and forward (a batch-32
#: gather is ~10 MB: fresh memory each time took 3x as long, page faults)
_KEYS, _VALUES = PadBuffer(), PadBuffer()


def _gather(cache: torch.Tensor, slots: torch.Tensor, buffer: PadBuffer) -> torch.Tensor:
    # index_select, not cache[slots]: the same rows, gathered about 6x faster on a CPU (advanced
    # indexing was a tenth of a batch-16 step)
    out = buffer.view((slots.numel(), *cache.shape[1:]), cache.dtype, cache.device)
    return torch.index_select(cache, 0, slots, out=out)


def verify_attention(
    q: torch.Tensor,  # [bs*W, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, Dv]
    plan: VerifyPlan,
    scaling: float | None,
    out: torch.Tensor,  # [bs*W, Hq, Dv]
) -> torch.Tensor:
    """One SDPA call per part of the plan (the whole batch unless the forward is ragged) over its
    KV block. On CPU a per-request loop costs a gather, a mask and an SDPA call per request and
    layer, which dominated steps of small models at batch 16. A ragged plan leaves the rows past
    each part's width unwritten: padding, which the forward does not take back."""
    bs, width, kv_max = plan.batch, plan.width, plan.kv_max
    q4 = q.view(bs, width, q.shape[1], q.shape[2])
    out4 = out.view(bs, width, out.shape[1], out.shape[2])
    for part in plan.parts:
        n = part.mask.shape[0]
        key = _gather(k_cache, part.slots, _KEYS).view(n, kv_max, *k_cache.shape[1:]).movedim(2, 1)  # [n, Hkv, kv, D]
        value = _gather(v_cache, part.slots, _VALUES).view(n, kv_max, *v_cache.shape[1:]).movedim(2, 1)
        query = q4 if part.requests is None else q4.index_select(0, part.requests)
        query = query[:, :part.width].movedim(2, 1)  # [n, Hq, w, D]
        if key.dtype != query.dtype:
            key, value = key.to(query.dtype), value.to(query.dtype)
        o = scaled_dot_product_attention(query, key, value, attn_mask=part.mask, scale=scaling,
                                         enable_gqa=q.shape[1] != k_cache.shape[1]).movedim(1, 2)  # [n, w, Hq, Dv]
        if part.requests is None:
            out4[:, :part.width].copy_(o)
        else:
            out4[part.requests, :part.width] = o
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
    ragged: RaggedVerify | None = getattr(spec, "selfspec_ragged", None)
    plan = plan_verify(req_to_token, forward_batch.req_pool_indices, seq_lens, width, custom_mask,
                       ragged.widths if ragged is not None else None)
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
