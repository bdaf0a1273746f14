"""The generate loop of the reference engine: prefill, then mode steps until every sequence stops.

Per batch of prompts:
1. prefill every prompt in one right-padded forward (positions 0 … len−1, causal); the last
   prompt row gives the first token by the AR sampling rule (`decoding.modes.ar.next_tokens`), which
   becomes the pending token;
2. loop: the mode plans each active sequence's step layout, the `StepRunner` runs one forward
   over the padded batch against the per-sequence slot KV cache and processes the logits, the
   mode decides what to emit, `SequenceProgress` applies stop ids and max_new_tokens, the cache
   keeps the KV the mode says to keep; finished sequences leave the batch.
Sequences advance independently (no lockstep); randomness comes from per-sequence seed streams
(`decoding.requests.seeds`), so a seeded sequence gives the same output in any batch.

Callbacks see every step (`StepEvent`, the prefill included): trajectory recording and rollout
statistics hook in here without touching the loop. With `logprobs=True` each emitted token gets
its log-probability under the processed logits row that predicted it (the row of step index
`keep[k]` for `emit[k]`: the query token right before it), before temperature / top-k / top-p.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from selfspec.decoding.requests import watermark
from selfspec.decoding.requests.logits_rules import GrammarWalk
from selfspec.decoding.metrics import SequenceMetrics
from selfspec.decoding.progress import SequenceProgress
from selfspec.decoding.requests.sampling import SamplingParams
from selfspec.decoding.requests.seeds import step_seeds
from selfspec.decoding.step import DecodeSequence, Mode, StepContext, StepLayout, StepOutcome, collate
from selfspec.decoding.modes.verify import VerifyOps
from selfspec.engines.kv_cache import SlotKVCache
from selfspec.engines.runner import StepRunner


@dataclass
class GenerationOutput:
    token_ids: list[int]  # generated tokens only; ends with the stop token if one was hit
    finish_reason: str  # "stop" | "length"
    metrics: SequenceMetrics = field(default_factory=SequenceMetrics)
    logprobs: list[float] | None = None  # per generated token, when asked for


@dataclass
class StepEvent:
    """One forward of the loop, as callbacks see it (read-only by convention)."""

    step: int  # 0 = prefill
    rows: list[int]  # index of each batch row's sequence among the batch's prompts
    seqs: list[DecodeSequence]  # their state after the step (history extended, mode state updated)
    layouts: list[StepLayout]
    outcomes: list[StepOutcome]  # what each row emitted and kept
    logits: torch.Tensor  # [B, W, V] processed logits of the step


StepCallback = Callable[[StepEvent], None]


def _emitted_logprobs(logits: torch.Tensor, outcomes: Sequence[StepOutcome]) -> list[list[float]]:
    """Per row, the log-probability of each emitted token under the row that predicted it: one
    gather over the rows that matter and one host read for the whole step."""
    dev = logits.device
    batch_rows = torch.tensor([b for b, o in enumerate(outcomes) for _ in o.keep], dtype=torch.long, device=dev)
    step_rows = torch.tensor([r for o in outcomes for r in o.keep], dtype=torch.long, device=dev)
    tokens = torch.tensor([t for o in outcomes for t in o.emit], dtype=torch.long, device=dev)
    rows = logits[batch_rows, step_rows]  # [emitted, V]
    flat = (rows.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - rows.logsumexp(-1)).tolist()
    out, start = [], 0
    for o in outcomes:
        out.append(flat[start : start + len(o.emit)])
        start += len(o.emit)
    return out


def generate_batch(
    runner: StepRunner,
    mode: Mode,
    prompts: list[list[int]],
    params: list[SamplingParams],
    seeds: list[int],
    stops: list[int],
    max_new_tokens: int,
    cache: SlotKVCache,
    ops: VerifyOps,
    callbacks: Sequence[StepCallback] = (),
    logprobs: bool = False,
    grammars: Sequence | None = None,
    mask_token: int | None = None,
    watermarks: Sequence[watermark.WatermarkConfig | None] | None = None,
) -> list[GenerationOutput]:
    n = len(prompts)
    progress = [SequenceProgress(max_new_tokens, stops) for _ in range(n)]
    metrics = [SequenceMetrics() for _ in range(n)]
    token_logprobs: list[list[float]] | None = [[] for _ in range(n)] if logprobs else None
    if max_new_tokens <= 0:
        return [GenerationOutput([], "length", m, [] if logprobs else None) for m in metrics]
    dev = cache.device
    base = torch.tensor(seeds, dtype=torch.long, device=dev)
    counter = torch.zeros(n, dtype=torch.long, device=dev)
    grammars = list(grammars) if grammars is not None else [None] * n
    seqs = [DecodeSequence(list(p), sp, stop_ids=frozenset(stops),
                           constraint=GrammarWalk(lambda g=g: g, mask_token) if g is not None else None)
            for p, sp, g in zip(prompts, params, grammars)]
    for seq, wm in zip(seqs, watermarks or ()):
        if wm is not None:
            seq.watermark = watermark.SequenceWatermark(wm, skip_token=mask_token)

    def commit(i: int, tokens: list[int]) -> int:
        """Emit tokens through the stop conditions; a grammar that terminates ends the sequence
        there, as SGLang's scheduler does (nothing after the terminating token is emitted)."""
        g = grammars[i]
        if g is not None:
            tokens = tokens[: g.commit(tokens)]
        appended = progress[i].commit(tokens)
        if g is not None and g.is_terminated() and not progress[i].finished:
            progress[i].finish_reason = "stop"
        return appended

    def record(step: int, rows: list[int], layouts, outcomes, logits) -> None:
        if token_logprobs is not None:
            for i, lp in zip(rows, _emitted_logprobs(logits, outcomes)):
                token_logprobs[i].extend(lp[: len(progress[i].tokens) - len(token_logprobs[i])])
        if callbacks:
            event = StepEvent(step, rows, [seqs[i] for i in rows], layouts, outcomes, logits)
            for cb in callbacks:
                cb(event)

    # prefill: the whole prompt, causal; the last prompt row gives the first token
    layouts = [StepLayout(p) for p in prompts]
    batch = collate(layouts, device=dev)
    last = torch.tensor([len(p) - 1 for p in prompts], device=dev)
    prompt_logits = runner.forward(cache, batch)
    logits = runner.process(prompt_logits[torch.arange(n, device=dev), last].unsqueeze(1), seqs, None)
    ctx = StepContext.from_params(params, step_seeds(base, counter, 1), ops)
    counter += 1
    first = watermark.first_tokens(logits[:, 0], seqs, ctx)
    cache.commit([list(range(len(p))) for p in prompts])
    outcomes = [StepOutcome([tok], [0], 0) for tok in first.tolist()]
    for i, tok in enumerate(first.tolist()):
        metrics[i].record_prefill(commit(i, [tok]))
        seqs[i].history.append(tok)
    record(0, list(range(n)), layouts, outcomes, logits)

    active = list(range(n))
    active = _drop_finished(active, progress, cache)
    for i in active:
        mode.start(seqs[i])
    base, counter = base[active], counter[active]
    act_params = [params[i] for i in active]
    step = 0
    while active:
        step += 1
        rows = [seqs[i] for i in active]
        layouts = mode.layouts(rows)
        batch = collate(layouts, device=dev)
        logits = runner.process(runner.forward(cache, batch), rows, batch)
        ctx = StepContext.from_params(act_params, step_seeds(base, counter, mode.step_seed_columns), ops)
        counter = counter + mode.seeds_per_step
        outcomes = watermark.finish_step(mode, rows, batch, logits, ctx)  # logprobs: the logits before forcing
        keeps = []
        for i, lay, out in zip(active, layouts, outcomes):
            if len(out.keep) != len(out.emit):
                raise AssertionError(f"{mode.name}: keep {out.keep} does not match emit {out.emit}")
            metrics[i].record_step(len(lay), commit(i, out.emit))
            seqs[i].history.extend(out.emit)
            keeps.append(out.keep)
        cache.commit(keeps)
        record(step, list(active), layouts, outcomes, logits)
        still = [j for j, i in enumerate(active) if not progress[i].finished]
        if len(still) != len(active):
            idx = torch.tensor(still, dtype=torch.long, device=dev)
            cache.select(idx)
            base, counter = base[idx], counter[idx]
            active = [active[j] for j in still]
            act_params = [act_params[j] for j in still]
    return [GenerationOutput(p.tokens, p.finish_reason, m, token_logprobs[i] if token_logprobs is not None else None)
            for i, (p, m) in enumerate(zip(progress, metrics))]


def _drop_finished(active: list[int], progress: list[SequenceProgress], cache: SlotKVCache) -> list[int]:
    still = [j for j, i in enumerate(active) if not progress[i].finished]
    if len(still) != len(active):
        cache.select(torch.tensor(still, dtype=torch.long, device=cache.device))
    return [active[j] for j in still]
