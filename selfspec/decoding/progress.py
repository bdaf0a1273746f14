"""Stop conditions shared by every mode: the one place that decides what a sequence emits.

A step may produce several tokens at once; `SequenceProgress.commit` appends them one by one
and stops at the first stop token (kept, reason "stop") or when `max_new_tokens` tokens have
been emitted (reason "length"). Nothing after a stop token is ever emitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class SequenceProgress:
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = frozenset(self.stop_token_ids)
        if self.max_new_tokens <= 0 and self.finish_reason is None:
            self.finish_reason = "length"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return max(0, self.max_new_tokens - len(self.tokens))

    def commit(self, new_tokens: Sequence[int] | Iterable[int]) -> int:
        """Append tokens until a stop condition; returns how many were appended."""
        appended = 0
        for tok in new_tokens:
            if self.finished:
                break
            tok = int(tok)
            self.tokens.append(tok)
            appended += 1
            if tok in self.stop_token_ids:
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = "length"
        return appended


def normalize_stop_ids(stop_token_ids: int | Iterable[int] | None) -> frozenset[int]:
    if stop_token_ids is None:
        return frozenset()
    if isinstance(stop_token_ids, int):
        return frozenset([stop_token_ids])
    return frozenset(int(t) for t in stop_token_ids)
