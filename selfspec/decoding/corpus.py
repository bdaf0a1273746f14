"""The token text of every sequence a mode has served, for context candidates across requests.

A sequence's own prompt + output often repeats itself (`ngram.SuffixIndex`), but what a server
answers also repeats across requests: the same code idioms, the same boilerplate, a prompt that
continues where another one stopped. SGLang's builtin NGRAM draws its drafts from all of it;
this is the same source for selfspec's context candidates. One `SharedCorpus` per served model
(the engine's, shared by every bucket of a width plan) holds documents, one per sequence, each
its committed tokens, appended as the sequence grows and kept after it finishes, the oldest
documents dropped beyond `capacity` tokens. `continuation(suffix, k, exclude)` gives the k
tokens that followed the latest occurrence of `suffix` in any document but `exclude` (the
sequence's own, which its SuffixIndex already searched, with the lagged-copy rule for loops);
when that occurrence sits at the end of a document still being written (a request served
alongside) and offers fewer than k tokens, the occurrence before it in another document is used
if it offers more.

Used for greedy rows only: the candidate is verified, so any source is lossless, but a seeded
sampled request must not draw differently because of what other requests said before it.
"""

from __future__ import annotations

from collections import OrderedDict

_END_MASK = (1 << 32) - 1


class SharedCorpus:
    def __init__(self, capacity: int = 1 << 18):
        if capacity < 1:
            raise ValueError(f"the shared corpus needs a capacity >= 1 token, got {capacity}")
        self.capacity = capacity  # tokens kept over all documents
        self.docs: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self.tokens = 0
        # per suffix length m: hash of the m-gram -> its latest occurrence, doc << 32 | index of
        # its last token. Ints, not tuples: six lengths over 262,144 tokens would hold ~1.6M
        # entries; a hash collision only yields a candidate the verify rejects
        self.latest: dict[int, dict[int, int]] = {}
        # the same for the occurrence before the latest one, in another document
        self.previous: dict[int, dict[int, int]] = {}
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
        for m in self.latest:
            self._index(m, doc, text, start)
        while self.tokens > self.capacity and len(self.docs) > 1:
            self._drop_oldest()

    def continuation(self, suffix: tuple[int, ...], k: int, exclude: int | None = None) -> list[int]:
        """Up to k tokens after the latest occurrence of `suffix` outside `exclude` (or the one
        before it, when that offers more of the k); [] if none."""
        m = self._indexed(len(suffix))
        key = hash(suffix)
        found = self._after(self.latest[m].get(key), suffix, k, exclude)
        if len(found) < k:
            earlier = self._after(self.previous[m].get(key), suffix, k, exclude)
            if len(earlier) > len(found):
                return earlier
        return found

    def continuations(self, suffix: tuple[int, ...], k: int, exclude: int | None = None) -> list[list[int]]:
        """Up to k tokens after the latest and after the previous occurrence of `suffix`
        outside `exclude`: the places a second candidate may come from."""
        m, key = self._indexed(len(suffix)), hash(suffix)
        found = (self._after(table.get(key), suffix, k, exclude) for table in (self.latest[m], self.previous[m]))
        return [f for f in found if f]

    def _indexed(self, m: int) -> int:
        """`m`, with the stored text's m-grams indexed (on the first lookup of that length)."""
        if m not in self.latest:
            self.latest[m], self.previous[m] = {}, {}
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
        latest, previous = self.latest[m], self.previous[m]
        base = doc << 32
        for end in range(max(start, m - 1), len(text)):
            key = hash(tuple(text[end - m + 1 : end + 1]))
            hit = latest.get(key)
            if hit is not None and hit >> 32 != doc:
                previous[key] = hit
            latest[key] = base | end

    def _drop_oldest(self) -> None:
        doc, text = self.docs.popitem(last=False)
        self.tokens -= len(text)
        for m in self.latest:
            tables = (self.latest[m], self.previous[m])
            for end in range(m - 1, len(text)):
                key = hash(tuple(text[end - m + 1 : end + 1]))
                for table in tables:
                    hit = table.get(key)
                    if hit is not None and hit >> 32 == doc:
                        del table[key]
