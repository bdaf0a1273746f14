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

import torch
from torch.nn.functional import scaled_dot_product_attention


def verify_attention(
    q: torch.Tensor,  # [bs*W, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, Dv]
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: list[int],  # committed lengths L per request (host ints)
    width: int,
    custom_mask: torch.Tensor | None,
    scaling: float | None,
    out: torch.Tensor,  # [bs*W, Hq, Dv]
) -> torch.Tensor:
    bs = len(seq_lens)
    enable_gqa = q.shape[1] != k_cache.shape[1]
    draft_only = custom_mask is not None and custom_mask.numel() == bs * width * width
    full_off = 0
    causal = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
    for r in range(bs):
        L = int(seq_lens[r])
        kv_len = L + width
        slots = req_to_token[req_pool_indices[r], :kv_len].long()
        key = k_cache[slots].movedim(0, 1)  # [Hkv, kv_len, D]
        value = v_cache[slots].movedim(0, 1)
        query = q[r * width:(r + 1) * width].movedim(0, 1)  # [Hq, W, D]
        if key.dtype != query.dtype:
            key, value = key.to(query.dtype), value.to(query.dtype)
        if custom_mask is None:
            local = causal
            mask = torch.cat([torch.ones(width, L, dtype=torch.bool, device=q.device), local], dim=1)
        elif draft_only:
            local = custom_mask[r * width * width:(r + 1) * width * width].view(width, width).bool()
            mask = torch.cat([torch.ones(width, L, dtype=torch.bool, device=q.device), local], dim=1)
        else:
            n = width * kv_len
            mask = custom_mask[full_off:full_off + n].view(width, kv_len).bool()
            full_off += n
        o = scaled_dot_product_attention(
            query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
            attn_mask=mask, scale=scaling, enable_gqa=enable_gqa,
        ).squeeze(0)
        out[r * width:(r + 1) * width] = o.movedim(0, 1)
    return out


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
    o = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
    spec = forward_batch.spec_info
    width = int(getattr(spec, "draft_token_num", 0) or getattr(spec, "num_tokens_per_req", 0))
    seq_lens_cpu = forward_batch.seq_lens_cpu
    seq_lens = (seq_lens_cpu if seq_lens_cpu is not None else forward_batch.seq_lens.cpu()).tolist()
    verify_attention(
        q_, self.token_to_kv_pool.get_key_buffer(layer.layer_id), self.token_to_kv_pool.get_value_buffer(layer.layer_id),
        self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, seq_lens, width,
        getattr(spec, "custom_mask", None), layer.scaling, o,
    )
    return o.view(q_.shape[0], layer.tp_q_head_num * layer.v_head_dim)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        _forward_extend_around, HookType.AROUND)
