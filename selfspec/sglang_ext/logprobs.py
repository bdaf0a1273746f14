"""Logprobs of a selfspec step, in the fields SGLang's scheduler reads for speculative output.

Each emitted token gets its log-probability under the processed row that predicted it (the
step row `keep[j]` for `emit[j]`, after the request's logits rules), computed the way the plain
server's sampler computes it: `log_softmax(logits)` when every request of the batch is greedy,
`log_softmax(logits / temperature)` otherwise (SGLang 0.5.23 `layers/sampler.py`; top-k / top-p
are not applied to reported logprobs). Decode steps go through SGLang's own
`compute_spec_logprobs` (what NGRAM uses), so top_logprobs and token_ids_logprob come in the
layout the batch result processor expects: [bs, max_accept] rows, padding ignored past each
request's accept length.
"""

from __future__ import annotations

import torch

from selfspec.decoding.step import StepOutcome


def _batch_logprobs(batch, logits: torch.Tensor) -> torch.Tensor:
    info = batch.sampling_info
    if info.is_all_greedy:
        out = torch.log_softmax(logits.float(), dim=-1)
    else:
        out = torch.log_softmax(logits.float() / info.temperatures.view(-1, 1).float(), dim=-1)
    return out.clamp_(min=torch.finfo(out.dtype).min)


def write_prefill_logprobs(batch, logits_output, logits: torch.Tensor, next_token_ids: torch.Tensor) -> None:
    """The first generated token's logprob (and top / token-id logprobs) after prefill:
    logits [bs, V] processed rows of the last prompt positions."""
    from sglang.srt.layers.logprob_processor import OutputLogprobProcessor

    logprobs = _batch_logprobs(batch, logits)
    result = OutputLogprobProcessor().compute_logprobs(
        logprobs, list(batch.top_logprobs_nums or [0] * len(batch.reqs)),
        list(batch.token_ids_logprobs or [None] * len(batch.reqs)), next_token_ids)
    result.write_output_to(logits_output)


def write_decode_logprobs(batch, logits_output, logits: torch.Tensor, outcomes: list[StepOutcome],
                          max_accept: int) -> None:
    """logits [bs, W, V]: the step's processed rows; outcomes: what each request emitted."""
    from sglang.srt.layers.logprob_processor import compute_spec_logprobs

    bs, width, vocab = logits.shape
    accept_index = torch.zeros(bs, max_accept, dtype=torch.long)
    predict = torch.zeros(bs * width, dtype=torch.long)
    for r, out in enumerate(outcomes):
        rows = [r * width + k for k in out.keep]
        accept_index[r] = r * width
        accept_index[r, : len(rows)] = torch.tensor(rows, dtype=torch.long)
        predict[rows] = torch.tensor(out.emit, dtype=torch.long)
    logits_output.next_token_logits = logits.reshape(bs * width, vocab)
    compute_spec_logprobs(batch, logits_output, predict.to(logits.device), accept_index=accept_index.to(logits.device))
