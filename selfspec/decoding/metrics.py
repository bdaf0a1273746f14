"""Decoding metrics, per sequence and aggregated.

Counting conventions (the same in every mode and engine):
- `forwards`: model forwards this sequence took part in, the prefill included (the prefill
  produces the first token, so AR decoding has TPF exactly 1.0).
- `committed_tokens`: tokens emitted (the stop token included, nothing after it).
- `query_tokens`: query tokens this sequence put through the model after its prompt: 1 for the
  prefill (only its last position yields a token) plus every token of each step layout,
  layout padding included (fixed-width ISD pads to 2N-1), batch padding excluded.
- TPF = committed_tokens / forwards; compute overhead = query_tokens / committed_tokens
  (AR: 1.0; the FLOP ratio to AR of the decode phase, ignoring attention-length effects).
- `accept_hist[k]`: number of decode forwards (prefill excluded) that committed k tokens
  (accepted drafts plus the one corrected / bonus token); the mean is the mean accepted length.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class SequenceMetrics:
    forwards: int = 0
    committed_tokens: int = 0
    query_tokens: int = 0
    accept_hist: Counter = field(default_factory=Counter)

    def record_prefill(self, committed: int) -> None:
        self.forwards += 1
        self.query_tokens += 1
        self.committed_tokens += committed

    def record_step(self, query_tokens: int, committed: int) -> None:
        self.forwards += 1
        self.query_tokens += query_tokens
        self.committed_tokens += committed
        self.accept_hist[committed] += 1

    @property
    def decode_forwards(self) -> int:
        return sum(self.accept_hist.values())

    @property
    def tokens_per_forward(self) -> float:
        return self.committed_tokens / self.forwards if self.forwards else 0.0

    @property
    def mean_accepted_length(self) -> float:
        n = self.decode_forwards
        return sum(k * c for k, c in self.accept_hist.items()) / n if n else 0.0

    @property
    def compute_overhead(self) -> float:
        return self.query_tokens / self.committed_tokens if self.committed_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "forwards": self.forwards,
            "committed_tokens": self.committed_tokens,
            "query_tokens": self.query_tokens,
            "tokens_per_forward": self.tokens_per_forward,
            "mean_accepted_length": self.mean_accepted_length,
            "compute_overhead": self.compute_overhead,
            "accept_hist": {str(k): v for k, v in sorted(self.accept_hist.items())},
        }


def aggregate(metrics: Iterable[SequenceMetrics]) -> dict:
    """Totals over sequences; ratios are ratios of totals (token-weighted), not means of ratios."""
    total = SequenceMetrics()
    count = 0
    for m in metrics:
        count += 1
        total.forwards += m.forwards
        total.committed_tokens += m.committed_tokens
        total.query_tokens += m.query_tokens
        total.accept_hist.update(m.accept_hist)
    out = total.to_dict()
    out["sequences"] = count
    return out
