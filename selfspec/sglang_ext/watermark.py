"""SGLang's text watermarking (`--enable-watermark`) in a selfspec server.

SGLang 0.5.23 checks `--enable-watermark` at start-up
(`arg_groups/validation_hook.check_watermark_server_args`) and allows it only with
`--device cuda` and with NGRAM / EAGLE / EAGLE3 as speculative algorithm. Both limits are
about its own code paths, not ours:
- the selfspec worker watermarks every verify row itself (`selfspec.decoding.requests.watermark`, with
  SGLang's hash and selector), so a selfspec algorithm is checked as NGRAM is;
- on the CPU engine SGLang's watermark state and selector have PyTorch paths
  (`sampling/watermarking/core.py`, the reference its Triton kernels are tested against), so
  the check reads the device as CUDA there and the AR server watermarks on a CPU too.
Every other rule of SGLang's check applies unchanged. Per request, the key, context window
and on/off are SGLang's own resolution of the request's `watermark` field against the
server's configuration (`resolve_watermark_request`).
"""

from __future__ import annotations

import os

from selfspec.decoding import registry
from selfspec.decoding.requests.watermark import SequenceWatermark, WatermarkConfig


class _CheckedAs:
    """server_args read through, with some fields answering other values (also where SGLang's
    resolution declared them: `resolving_view` reads `_resolved_overrides` first)."""

    def __init__(self, server_args, **fields):
        object.__setattr__(self, "_args", server_args)
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name: str):
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        value = getattr(object.__getattribute__(self, "_args"), name)
        if name == "_resolved_overrides" and value:
            return [(source, {k: v for k, v in d.items() if k not in fields}) for source, d in value]
        return value


def _check(original, server_args, *args, **kwargs):
    fields = {}
    if os.getenv("SGLANG_USE_CPU_ENGINE", "0") == "1" and getattr(server_args, "device", None) == "cpu":
        fields["device"] = "cuda"
    algo = (getattr(server_args, "speculative_algorithm", None) or "").upper()
    if registry.for_sglang_algorithm(algo) is not None:
        fields["speculative_algorithm"] = "NGRAM"
    return original(_CheckedAs(server_args, **fields) if fields else server_args, *args, **kwargs)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.arg_groups.validation_hook.check_watermark_server_args", _check,
                          HookType.AROUND)


def request_watermark(req, model_runner, mask_token_id: int | None) -> SequenceWatermark | None:
    """The request's watermark state, or None when the server has watermarking off or the
    request resolves to no watermark."""
    if getattr(model_runner, "watermark_state", None) is None:
        return None
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.sampling.watermarking.config import MAX_WATERMARKED_CONTEXTS_PER_REQUEST
    from sglang.srt.sampling.watermarking.core import resolve_watermark_request

    f = get_exec().features
    key, window, enabled = resolve_watermark_request(
        req.sampling_params.watermark, server_enabled=True, default_key=f.watermark_key,
        default_context_window=f.watermark_context_window, default_enabled=f.watermark_default_enabled,
        enforce_all=f.watermark_enforce_all)
    if not enabled:
        return None
    capacity = min(model_runner.req_to_token_pool.req_to_token.shape[1], MAX_WATERMARKED_CONTEXTS_PER_REQUEST)
    config = WatermarkConfig(key, window, f.watermark_key_b, f.watermark_mixing_probability,
                             f.watermark_max_probability, capacity)
    return SequenceWatermark(config, skip_token=mask_token_id)
