"""The rejection-recycling n-gram pool of Jacobi decoding (Jacobi Forcing, §3.4.6).

Rejected draft segments often hold runs of correct tokens at the wrong offset. The pool stores
every n-gram (length `ngram_size`) of each rejected segment, keyed by its first token; for the
token a sequence just committed (its pending token), `candidates` returns the stored n-grams
starting with that token, most recently added first, as drafts for the positions after it
(the n-gram minus its first token). At most `per_key` n-grams are kept per first token (least
recently added evicted first); re-adding an n-gram refreshes it.
"""

from __future__ import annotations

from collections import OrderedDict


class NgramPool:
    def __init__(self, ngram_size: int = 4, per_key: int = 4):
        if ngram_size < 2:
            raise ValueError("pool n-grams need at least 2 tokens (a key and a continuation)")
        self.ngram_size = ngram_size
        self.per_key = per_key
        self._pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, segment: list[int]) -> int:
        """Store every full-length n-gram of a rejected segment; returns how many were stored."""
        n = self.ngram_size
        added = 0
        for start in range(len(segment) - n + 1):
            gram = tuple(int(t) for t in segment[start : start + n])
            bucket = self._pool.setdefault(gram[0], OrderedDict())
            bucket.pop(gram, None)
            bucket[gram] = None
            while len(bucket) > self.per_key:
                bucket.popitem(last=False)
            added += 1
        return added

    def candidates(self, token: int, limit: int) -> list[list[int]]:
        """Up to `limit` continuations (n-gram[1:]) of n-grams starting with `token`, newest first."""
        bucket = self._pool.get(int(token))
        if not bucket or limit <= 0:
            return []
        return [list(g[1:]) for g in reversed(bucket)][:limit]

    def __len__(self) -> int:
        return sum(len(b) for b in self._pool.values())
