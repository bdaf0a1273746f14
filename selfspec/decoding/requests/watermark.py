"""Text watermarking on every verify row of a step, as SGLang watermarks a sampled token.

SGLang 0.5.23 (`sglang/srt/sampling/watermarking/`, whose README is the specification) forces
one token at a sampled position: with p the request's distribution there (after penalties,
bias, grammar, temperature, top-k / top-p / min-p), the token argmax_t log(u_t) / p_t, u_t a
keyed hash of the context (the last h prompt + output tokens) and t. A context is forced at
most once per request (a repeated context samples normally, so a short loop cannot keep
excluding EOS), greedy requests are never watermarked, and a position whose largest
probability exceeds the server's max_probability samples normally. We call SGLang's own hash
and selector; only the choice of rows and contexts is ours.

In a step each verify row gets the context AR would have at its position: the committed
history followed by the row's path in the step (`StepBatch.seen`). It is forced iff that
context is new to the request: not forced in an earlier step and not forced at one of the
row's ancestor rows (the rows that decide the positions before it, which AR would have forced
first were the row's path accepted). A forced row's distribution is one-hot, so acceptance
(greedy or p/q, chains or trees) emits exactly the forced token whatever was drafted, and an
unforced row keeps p: a watermarked request decodes with AR's law, token for token AR's output
wherever every position is forced. (SGLang's own speculative path calls a context repeated
when any earlier row of the tree has it, on or off the row's path.) Rows whose path holds a
[MASK] make proposals, not decisions, and are left alone. Logprobs stay those of the logits
before forcing, as SGLang reports them.

After the mode decided, `commit` records the contexts of the rows that decided emitted tokens
(step index keep[j] decides emit[j]). Engines call `first_tokens` at prefill and `finish_step`
for a decode step, which do both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from selfspec.decoding.modes.ar import next_tokens
from selfspec.decoding.step import DecodeSequence, Mode, StepBatch, StepContext, StepOutcome

# SGLang's watermarking modules are imported where a watermark is used: importing any of them
# imports `sglang.srt` (and triton), which the reference engine must not pay for (or import
# before a test sets TRITON_INTERPRET) on every generate call.


@dataclass(frozen=True)
class WatermarkConfig:
    """One request's watermark (SGLang's server fields, resolved for the request)."""

    key: str  # 1-16 hex digits, optional 0x
    context_window: int = 4  # h: tokens hashed before each position
    key_b: str | None = None  # dual-key mode: key A with probability mixing_probability per context
    mixing_probability: float = 0.5
    max_probability: float = 1.0  # positions more certain than this sample normally
    capacity: int | None = None  # contexts forced per request at most (None: SGLang's maximum)

    def __post_init__(self) -> None:
        from sglang.srt.sampling.watermarking.config import parse_watermark_key

        parse_watermark_key(self.key)
        if self.key_b is not None:
            parse_watermark_key(self.key_b)
        if not 1 <= self.context_window <= 64:
            raise ValueError(f"watermark context_window must be 1..64, got {self.context_window}")
        if not 0 < self.mixing_probability < 1:
            raise ValueError(f"watermark mixing_probability must be in (0, 1), got {self.mixing_probability}")
        if not 0 < self.max_probability <= 1:
            raise ValueError(f"watermark max_probability must be in (0, 1], got {self.max_probability}")


@dataclass
class SequenceWatermark:
    """A sequence's watermark state: the contexts forced so far and this step's forced rows."""

    config: WatermarkConfig
    skip_token: int | None = None  # rows whose path holds it make proposals (ISD's [MASK])
    forced: set[int] = field(default_factory=set)  # context hashes forced so far
    marks: dict[int, int] = field(default_factory=dict)  # this step: forced row -> its context hash


def force(logits: torch.Tensor, seqs: Sequence[DecodeSequence], batch: StepBatch | None) -> torch.Tensor:
    """logits [B, W, V] after the logits rules (or [B, 1, V] at prefill, batch None) -> the same
    with every row to be forced one-hot at its watermark token (a copy when any is)."""
    rows_of, hashes, plans = [], [], []
    for b, seq in enumerate(seqs):
        wm = seq.watermark
        if wm is None:
            continue
        wm.marks = {}
        if seq.sampling.greedy:
            continue
        plan = _row_contexts(seq, batch, b)
        plans.append((b, wm, plan))
        for row, (context_hash, _) in plan.items():
            if context_hash not in wm.forced:
                rows_of.append((b, row))
                hashes.append(context_hash)
    if not rows_of:
        return logits
    from sglang.srt.sampling.watermarking.config import MAX_WATERMARKED_CONTEXTS_PER_REQUEST

    forced_rows, forceable = _select(logits, seqs, rows_of, hashes)
    out = logits.clone()
    decided = dict(zip(rows_of, zip(forceable, forced_rows)))
    for b, wm, plan in plans:
        capacity = wm.config.capacity or MAX_WATERMARKED_CONTEXTS_PER_REQUEST
        for row in sorted(plan):
            context_hash, ancestors = plan[row]
            ok, forced_row = decided.get((b, row), (False, None))
            earlier = [wm.marks[a] for a in ancestors if a in wm.marks]
            if ok and context_hash not in earlier and len(wm.forced) + len(earlier) < capacity:
                wm.marks[row] = context_hash
                out[b, row] = forced_row
    return out


def first_tokens(logits: torch.Tensor, seqs: Sequence[DecodeSequence], ctx: StepContext) -> torch.Tensor:
    """The AR rule on the last prompt rows [B, V] (`ar.next_tokens`), watermarked sequences
    deciding by their forced token; their contexts recorded."""
    tokens = next_tokens(force(logits.unsqueeze(1), seqs, None)[:, 0], ctx)
    commit(seqs, [StepOutcome([t], [0]) for t in tokens.tolist()])
    return tokens


def finish_step(mode: Mode, seqs: Sequence[DecodeSequence], batch: StepBatch, logits: torch.Tensor,
                ctx: StepContext) -> list[StepOutcome]:
    """`mode.finish` on the step's logits with the watermarked rows forced, then their contexts
    recorded. The logits themselves are left as they were (logprobs report them)."""
    outcomes = mode.finish(seqs, batch, force(logits, seqs, batch), ctx)
    commit(seqs, outcomes)
    return outcomes


def commit(seqs: Sequence[DecodeSequence], outcomes: Sequence[StepOutcome]) -> None:
    """Record the forced contexts of the rows that decided what each sequence emitted."""
    for seq, out in zip(seqs, outcomes):
        wm = seq.watermark
        if wm is None:
            continue
        for row in out.keep:
            if row in wm.marks:
                wm.forced.add(wm.marks[row])
        wm.marks = {}


def _row_contexts(seq: DecodeSequence, batch: StepBatch | None, b: int) -> dict[int, tuple[int, list[int]]]:
    """Verify row -> (hash of its context, its ancestor rows)."""
    from sglang.srt.sampling.watermarking.detector import hash_context

    h = seq.watermark.config.context_window
    skip = seq.watermark.skip_token
    if batch is None:
        return {0: (hash_context(seq.history[-h:]), [])}
    tokens = batch.tokens[b].tolist()
    out = {}
    for row, seen in enumerate(batch.seen(b, batch.widths[b])):
        path = [tokens[j] for j in seen]
        if skip is not None and skip in path:
            continue
        # the row's parent rows: the pending row, then each step token on its path but itself
        out[row] = (hash_context((seq.history + path)[-h:]), [0] + [j for j in seen if j != row] if row else [])
    return out


def _select(logits: torch.Tensor, seqs: Sequence[DecodeSequence], rows_of: list[tuple[int, int]],
            hashes: list[int]) -> tuple[torch.Tensor, list[bool]]:
    """SGLang's selector on the candidate rows: their forced (one-hot) logits and whether each
    passed the entropy gate."""
    from sglang.srt.sampling.watermarking.config import parse_watermark_key
    from sglang.srt.sampling.watermarking.core import force_watermark_tokens

    vocab = logits.shape[-1]
    dev = logits.device
    b_idx = torch.tensor([b for b, _ in rows_of], device=dev)
    r_idx = torch.tensor([r for _, r in rows_of], device=dev)
    rows = logits[b_idx, r_idx].float().clone()
    sp = [seqs[b].sampling for b, _ in rows_of]
    cfg = [seqs[b].watermark.config for b, _ in rows_of]
    dual = any(c.key_b is not None for c in cfg)
    if len({c.max_probability for c in cfg}) > 1:  # SGLang's gate is one number per server
        raise ValueError("one step's watermarked rows must share max_probability")
    eligible = force_watermark_tokens(
        logits=rows,
        context_hashes=torch.tensor(hashes, dtype=torch.int64, device=dev),
        eligible=torch.ones(len(rows_of), dtype=torch.bool, device=dev),
        temperatures=torch.tensor([[p.temperature] for p in sp], dtype=torch.float32, device=dev),
        top_ks=torch.tensor([p.top_k if p.top_k > 0 else vocab for p in sp], dtype=torch.int64, device=dev),
        top_ps=torch.tensor([p.top_p for p in sp], dtype=torch.float32, device=dev),
        min_ps=torch.tensor([p.min_p for p in sp], dtype=torch.float32, device=dev),
        keys=torch.tensor([parse_watermark_key(c.key) for c in cfg], dtype=torch.int64, device=dev),
        keys_b=torch.tensor([parse_watermark_key(c.key_b or c.key) for c in cfg], dtype=torch.int64, device=dev)
        if dual else None,
        # a single-key row in a dual-key batch: its threshold 2^32 always picks key A
        mixing_thresholds=torch.tensor([int(c.mixing_probability * (1 << 32)) if c.key_b is not None else 1 << 32
                                        for c in cfg], dtype=torch.int64, device=dev) if dual else None,
        max_probability=cfg[0].max_probability,
    )
    return rows.to(logits.dtype), eligible.tolist()
