"""The token text of every sequence a mode has served, for context candidates across requests.

A sequence's own prompt + output often repeats itself (`ngram.SuffixIndex`), but what a server
answers also repeats across requests: the same code idioms, the same boilerplate, a prompt that
continues where another one stopped. SGLang's builtin NGRAM draws its drafts from all of it;
this is the same source for selfspec's context candidates. One `SharedCorpus` per served model
(the engine's, shared by every bucket of a width plan) holds documents, one per sequence, each
its committed tokens, appended as the sequence grows and kept after it finishes, the oldest
documents dropped beyond `capacity` tokens. `continuation(suffix, k, exclude)` gives up to k
tokens that followed `suffix` in the documents but `exclude` (the sequence's own, which its
SuffixIndex already searched, with the lagged-copy rule for loops): of its latest `OCCURRENCES`
occurrences, the continuation most of them agree on, token by token (`majority_path`). Where a
suffix recurs across requests, the text that followed it most often is a better guess than the
text that followed it last: tokens committed per step of a 12-token candidate +6% at C=4, +4%
at C=16 (`python bench/context_lookup.py`).

Used for greedy rows only: the candidate is verified, so any source is lossless, but a seeded
sampled request must not draw differently because of what other requests said before it.
"""

from __future__ import annotations

from collections import OrderedDict

_END_MASK = (1 << 32) - 1

#: occurrences of an m-gram the corpus keeps, the latest ones (`bench/context_lookup.py`: 8 took
#: nearly all of what every occurrence gives; 2 little more than the latest alone)
OCCURRENCES = 8


def majority_path(continuations: list[list[int]], k: int) -> list[int]:
    """Up to k tokens, each the next token most of the continuations that agree with the path so
    far go on with; ties go to the latest (the list is oldest first)."""
    path: list[int] = []
    pool = [c for c in continuations if c]
    while pool and len(path) < k:
        if len(pool) == 1:
            return path + pool[0][len(path) : k]
        d = len(path)
        votes: dict[int, tuple[int, int]] = {}
        for i, c in enumerate(pool):
            if len(c) > d:
                votes[c[d]] = (votes.get(c[d], (0, 0))[0] + 1, i)
        if not votes:
            break
        token = max(votes, key=votes.__getitem__)
        path.append(token)
        pool = [c for c in pool if len(c) > d and c[d] == token]
    return path


class SharedCorpus:
    def __init__(self, capacity: int = 1 << 18):
        if capacity < 1:
            raise ValueError(f"the shared corpus needs a capacity >= 1 token, got {capacity}")
        self.capacity = capacity  # tokens kept over all documents
        self.docs: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self.tokens = 0
        # per suffix length m: hash of the m-gram -> its occurrence, doc << 32 | index of its last
        # token, or the latest OCCURRENCES of them (oldest first) where it recurs. Ints, not
        # tuples: six lengths over 262,144 tokens would hold ~1.6M entries, most of them m-grams
        # that occur once; a hash collision only yields a candidate the verify rejects
        self.places: dict[int, dict[int, int | list[int]]] = {}
        self._next_doc = 0

    def open(self) -> int:
        """A new empty document; returns its id."""
        doc = self._next_doc
        self._next_doc += 1
        self.docs[doc] = []
        return doc

    def length(self, doc: int) -> int:
        """Tokens in `doc` (0 once dropped: a sequence that outlives its document starts a new one)."""
        return len(self.docs.get(doc, ()))

    def append(self, doc: int, tokens: list[int]) -> None:
        """Extend `doc` (re-opened at the end if it was dropped) and index its new m-grams."""
        text = self.docs.get(doc)
        if text is None:
            text = self.docs[doc] = []
        start = len(text)
        text.extend(int(t) for t in tokens)
        self.tokens += len(tokens)
        for m in self.places:
            self._index(m, doc, text, start)
        while self.tokens > self.capacity and len(self.docs) > 1:
            self._drop_oldest()

    def continuation(self, suffix: tuple[int, ...], k: int, exclude: int | None = None) -> list[int]:
        """Up to k tokens after `suffix` outside `exclude`: what most of its kept occurrences go
        on with (`majority_path`); [] if none."""
        return majority_path(self._continuations(suffix, k, exclude), k)

    def continuations(self, suffix: tuple[int, ...], k: int, exclude: int | None = None) -> list[list[int]]:
        """Up to k tokens after each kept occurrence of `suffix` outside `exclude`, latest first:
        the places a second candidate may come from."""
        return self._continuations(suffix, k, exclude)[::-1]

    def _continuations(self, suffix: tuple[int, ...], k: int, exclude: int | None) -> list[list[int]]:
        hits = self.places[self._indexed(len(suffix))].get(hash(suffix))
        hits = [] if hits is None else [hits] if isinstance(hits, int) else hits
        found = (self._after(hit, suffix, k, exclude) for hit in hits)
        return [f for f in found if f]

    def _indexed(self, m: int) -> int:
        """`m`, with the stored text's m-grams indexed (on the first lookup of that length)."""
        if m not in self.places:
            self.places[m] = {}
            for doc, text in self.docs.items():
                self._index(m, doc, text, 0)
        return m

    def _after(self, hit: int | None, suffix: tuple[int, ...], k: int, exclude: int | None) -> list[int]:
        if hit is None or hit >> 32 == exclude:
            return []
        doc, end, m = hit >> 32, hit & _END_MASK, len(suffix)
        text = self.docs.get(doc)
        if text is None or end >= len(text) or tuple(text[end - m + 1 : end + 1]) != suffix:
            return []  # a hash collision
        return text[end + 1 : end + 1 + k]

    def _index(self, m: int, doc: int, text: list[int], start: int) -> None:
        places = self.places[m]
        base = doc << 32
        for end in range(max(start, m - 1), len(text)):
            key = hash(tuple(text[end - m + 1 : end + 1]))
            hits = places.get(key)
            if hits is None:
                places[key] = base | end
            elif isinstance(hits, int):
                places[key] = [hits, base | end]
            else:
                hits.append(base | end)
                if len(hits) > OCCURRENCES:
                    del hits[0]

    def _drop_oldest(self) -> None:
        doc, text = self.docs.popitem(last=False)
        self.tokens -= len(text)
        for m, places in self.places.items():
            for end in range(m - 1, len(text)):
                key = hash(tuple(text[end - m + 1 : end + 1]))
                hits = places.get(key)
                if hits is None:
                    continue
                kept = [h for h in ([hits] if isinstance(hits, int) else hits) if h >> 32 != doc]
                if not kept:
                    del places[key]
                else:
                    places[key] = kept[0] if len(kept) == 1 else kept
