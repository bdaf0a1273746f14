"""Per-request checks: what a selfspec mode cannot honour is refused with HTTP 400, not ignored.

An AFTER hook on SGLang's `SamplingParams.verify` (run by the tokenizer manager on every
request, whose ValueError becomes a 400 response) rejects, when the server runs a selfspec
mode: sampling with JACOBI (greedy only: its guarantee is exactly greedy AR) and beam search.
Everything else a plain server takes is served: penalties, min_p, logit_bias, min_new_tokens
and grammars (`selfspec.decoding.requests.logits_rules`, `selfspec.sglang_ext.grammar`), logprobs
(`selfspec.sglang_ext.logprobs`), custom logit processors (the worker) and watermarking
(`selfspec.decoding.requests.watermark`, `selfspec.sglang_ext.watermark`).
"""

from __future__ import annotations

from selfspec.decoding import registry


def _algorithm() -> str | None:
    try:
        from sglang.srt.runtime_context import get_spec

        algo = (get_spec().speculative_algorithm or "").upper()
    except Exception:
        return None
    return algo if registry.for_sglang_algorithm(algo) is not None else None


def check_sampling_params(sp, algorithm: str) -> None:
    greedy = sp.top_k == 1
    spec = registry.for_sglang_algorithm(algorithm)
    if spec is not None and spec.greedy_only and not greedy:
        sampled = ", ".join(s.sglang_algorithm for s in registry.SGLANG_ALGORITHMS.values() if not s.greedy_only)
        raise ValueError(f"{algorithm} decoding is greedy only (it reproduces greedy AR exactly): send temperature 0, "
                         f"or serve --speculative-algorithm {sampled} for sampling")
    if (getattr(sp, "beam_width", None) or 1) > 1:
        raise ValueError(f"{algorithm} (selfspec) does not support beam search (beam_width); remove it or use a "
                         "server without --speculative-algorithm")


def _after_verify(result, self, *args, **kwargs):
    algo = _algorithm()
    if algo is not None:
        check_sampling_params(self, algo)
    return result


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.sampling.sampling_params.SamplingParams.verify", _after_verify, HookType.AFTER)
