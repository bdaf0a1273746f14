"""Prompt-lookup n-gram speculation: the draft-free baseline of the benchmarks, and the lookup
step every mode's width plan may run.

Draft: find the latest earlier occurrence of the last m committed tokens (m = 3, then 2 by
default) in the sequence's own history (prompt + output) and propose the k tokens that followed it
(a copy of the history at that lag, which runs on past its end when the match is fewer than k
tokens back); with `corpus`, greedy rows also look in the other sequences served (`corpus.py`).
One step is a causal forward over [pending, d_1 … d_j] (j <= k; j = 0 is a plain AR step); the
drafts are verified with the shared rules (greedy prefix, or p/q with one-hot q when sampling,
which keeps AR's distribution) and the corrected / bonus token is emitted. With `tree: N` the
draft is instead a token tree of N tokens over every kept place the suffix occurred
(`SuffixIndex.tree`, `draft_tree.py`), verified by the tree rule of `tree_verify.py`.

The same step is the narrowest speculative width of every mode: a width plan bucket
`{mode: ngram, ...}` runs it in an ISD, RISD, SJD or JACOBI plan where a batch is too wide for
the mode's own proposals to pay (ISD's `stride: 1` is this step too). Its `NgramConfig` answers
to the `context_*` names the other modes' configs use, so whatever reads a mode's context
candidate (`candidate_watch.CandidateWatch`) reads this one alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from selfspec.decoding.modes.corpus import OCCURRENCES, SharedCorpus
from selfspec.decoding.modes.draft_tree import draft_tree, match_confidence
from selfspec.decoding.widths.draft_length import RecentAcceptance
from selfspec.decoding.requests.logits_rules import grammar_valid
from selfspec.decoding.modes.tree_verify import (
    TreePlan, build_branches, build_tree, finish_split, path_outcome, verify_paths,
)
from selfspec.decoding.step import (
    DecodeSequence, Mode, StepBatch, StepContext, StepLayout, StepOutcome, verify_drafts,
)


#: Suffix lengths a context candidate looks up, longest first. Once a server's corpus holds other
#: requests' text a 3-gram recurs in many places and its latest occurrence is often the wrong
#: one; a longer match picks the continuation: ISD tokens per step +5-6% served-like (held-out
#: prompts after 64 others, `python bench/context_lookup.py`), -1.5% on 16 prompts with no corpus.
#: Length 1 (the last token alone, as SGLang's NGRAM also matches) drafts where nothing longer
#: recurs: NGRAM, which does, had a candidate accepted in a fifth of the steps where ours had none
#: (the same replay).
CONTEXT_MATCH_SIZES = (8, 6, 4, 3, 2, 1)

#: The longest candidate a weak first match drafts, by (the match is in the sequence's own text,
#: its suffix length); matches not listed draft the full length. Measured on the held-out
#: prompts (`bench/context_lookup.py`, tokens accepted per step of a 16-token candidate at
#: C=16): own text 1.7 / 3.1 at suffix 1 / 2, other requests' text 0.6 / 1.3 / 1.6 / 2.6 / 3.5
#: at 1 / 2 / 3 / 4 / 6, against 8-13 for an 8-token match. Where each query token costs (a CPU
#: step over a batch: the served forward carries each request's real tokens only), the tail
#: of a weak candidate costs more than the tokens it adds.
WEAK_MATCH_CAPS: dict[tuple[bool, int], int] = {
    (True, 1): 6, (True, 2): 8,
    (False, 1): 2, (False, 2): 4, (False, 3): 6, (False, 4): 8, (False, 6): 12,
}

#: The most tokens of history a match is followed back (`match_length`): a loop this long is
#: certain enough for any draft length served
MAX_MATCH_LENGTH = 256

#: The weight of the next shorter suffix's places in a draft tree (`SuffixIndex.tree`), beside the
#: longest's 1: where the longest match occurred once, the shorter one's other places give the
#: tree its second branches. Tokens per step of an 11-token tree, tune prompts, C = 4 / 16 / 32
#: (`python bench/context_lookup.py --prompts tune`): 5.92 / 5.36 / 6.05 against 5.71 / 5.28 / 5.93
#: with the longest suffix alone (0.1: 5.83 / 5.33 / 5.99; three suffix lengths: within 1%)
TREE_BACKOFF_WEIGHT = 0.3

#: Lookups a candidate chains when a continuation ends early (the match sat at the end of a
#: document another request is still writing): the next one starts from history + candidate.
CHAIN_LOOKUPS = 4


def match_sizes(sizes, option: str = "match_sizes") -> tuple[int, ...]:
    """Suffix lengths to look up, longest first, each once; ValueError naming `option` otherwise."""
    out = tuple(sorted({int(m) for m in sizes}, reverse=True))
    if not out or out[-1] < 1:
        raise ValueError(f"{option} must be suffix lengths >= 1, got {tuple(sizes)!r}")
    return out


@dataclass
class NgramConfig:
    num_draft: int = 4  # k
    match_sizes: tuple[int, ...] = (3, 2)  # suffix lengths tried, longest first
    # greedy rows also draft from the other sequences served (`corpus.py`); off for the
    # prompt-lookup baseline, on in the lookup buckets `selfspec tune` writes
    corpus: bool = False
    caps: bool = False  # weak matches draft short candidates (`WEAK_MATCH_CAPS`)
    # each request's draft length follows its recent acceptance (`draft_length.py`)
    adaptive: bool = False
    # 2: a second candidate from another place the suffix occurred (`SuffixIndex.alternative`),
    # verified as a second branch of the step's tree where it differs from the first
    branches: int = 1
    # > 0: a draft is at most this many times as long as its match (SuffixDecoding's
    # max_spec_factor): a match followed back through a loop drafts long, a short one short
    length_factor: float = 0.0
    # > 0: the draft is a token tree of at most this many tokens, at most num_draft deep, over
    # every kept place the suffix occurred (`SuffixIndex.tree`, `draft_tree.py`); 0: one chain
    tree: int = 0
    tree_min_score: float = 0.0  # ... without the nodes scored below this (`draft_tree.draft_tree`)

    def __post_init__(self) -> None:
        self.match_sizes = match_sizes(self.match_sizes, "ngram match_sizes")
        if self.num_draft < 1:
            raise ValueError(f"ngram needs num_draft >= 1, got {self.num_draft}")
        if self.branches not in (1, 2):
            raise ValueError(f"ngram branches must be 1 or 2, got {self.branches}")
        if self.length_factor < 0:
            raise ValueError(f"ngram length_factor must be >= 0 (0 = off), got {self.length_factor}")
        if self.tree < 0 or not 0 <= self.tree_min_score < 1:
            raise ValueError(f"ngram tree must be >= 0 draft tokens (0 = a chain) and tree_min_score in [0, 1), got "
                             f"{self.tree} / {self.tree_min_score}")
        if self.tree and self.branches > 1:
            raise ValueError("ngram: choose tree (a draft tree) or branches: 2 (a second chain), not both")

    # the names of the other modes' context-candidate options (see module doc)
    @property
    def context_tokens(self) -> int:
        return self.num_draft

    @property
    def context_match_sizes(self) -> tuple[int, ...]:
        return self.match_sizes

    @property
    def context_corpus(self) -> bool:
        return self.corpus

    @property
    def context_caps(self) -> bool:
        return self.caps

    @property
    def context_length_factor(self) -> float:
        return self.length_factor


def lagged_copy(history: list[int], lag: int, k: int) -> list[int]:
    """The k tokens after `history` if it repeated itself with period `lag`: token t is token
    t − lag. Up to the end of history this is the text that followed the earlier match; past
    it (a match fewer than k tokens back, as in a loop of period < k) the copy runs on into the
    tokens it has just drafted, so a short loop still drafts k tokens."""
    out: list[int] = []
    n = len(history)
    for i in range(k):
        src = n + i - lag
        out.append(history[src] if src < n else out[src - n])
    return out


def match_length(context: list[int], end: int, hit: int, m: int, most: int) -> int:
    """How far the match of the m tokens ending at `end` with those ending at `hit` (< end)
    runs back (at most `most`): m, plus each earlier token that equals its counterpart."""
    n = m
    while n < most and hit - n >= 0 and context[end - n] == context[hit - n]:
        n += 1
    return n


class SuffixIndex:
    """Latest end position of every m-gram of a growing token list, for each m in sizes; with a
    `SharedCorpus`, also the sequence's document there (`corpus.py`), searched after its own
    history at each suffix length."""

    def __init__(self, sizes: tuple[int, ...], corpus: SharedCorpus | None = None, seq: DecodeSequence | None = None,
                 weak_caps: dict[tuple[bool, int], int] | None = None, occurrences: int = 1,
                 length_factor: float = 0.0):
        """`occurrences` > 1: also index that many of each m-gram's latest occurrences (for
        `alternative` and `tree`; at 1, the indexing of every new token stays one dict write per
        length). `length_factor` > 0: a draft is at most that many times as long as its match
        (the match in the own history followed back token by token, `match_length`; one in the
        corpus is its suffix)."""
        self.sizes = sizes
        self.weak_caps = weak_caps or {}
        self.length_factor = length_factor
        self.last_end: dict[int, dict[tuple[int, ...], int]] = {m: {} for m in sizes}
        # each m-gram's earlier occurrences (before its latest), oldest first
        self.occurrences = occurrences
        self.earlier: dict[int, dict[tuple[int, ...], list[int]]] | None = (
            {m: {} for m in sizes} if occurrences > 1 else None)
        self.indexed = 0  # m-grams ending before this position are indexed
        self.corpus = corpus
        self.doc: int | None = None
        if corpus is not None:  # one document per sequence, kept when a width plan restarts it
            if seq is None:
                raise ValueError("a SuffixIndex with a shared corpus needs the sequence it indexes")
            if seq.corpus_doc is None:
                seq.corpus_doc = corpus.open()
            self.doc = seq.corpus_doc

    def update(self, history: list[int]) -> None:
        """Index the m-grams of `history` ending before its last token; the corpus gets them too."""
        end = len(history) - 1  # the suffix ends at `end`; index m-grams ending before it
        for pos in range(self.indexed, end):
            for m in self.sizes:
                if pos - m + 1 >= 0:
                    key = tuple(history[pos - m + 1 : pos + 1])
                    if self.earlier is not None and key in self.last_end[m]:
                        kept = self.earlier[m].setdefault(key, [])
                        kept.append(self.last_end[m][key])
                        if len(kept) >= self.occurrences:
                            del kept[0]
                    self.last_end[m][key] = pos
        self.indexed = max(self.indexed, end)
        if self.corpus is not None:  # the corpus holds what the own index holds: history[:end]
            have = self.corpus.length(self.doc)
            if have < end:
                self.corpus.append(self.doc, history[have:end])

    def propose(self, history: list[int], k: int, shared: bool = True) -> list[int]:
        """k tokens continuing the latest earlier occurrence of history's suffix (`lagged_copy`),
        else (when `shared`) what most of its occurrences in the corpus's other documents go on
        with (`SharedCorpus.continuation`), longest suffix first; a continuation that ends early is chained on from the
        suffix of history + candidate (`CHAIN_LOOKUPS`); [] when it never occurred. The
        sequence's text joins the corpus either way."""
        self.update(history)
        corpus = self.corpus if shared else None
        most = math.ceil(k / self.length_factor) if self.length_factor > 0 else 0
        out, match, length = self._lookup(history, k, corpus, most)
        if match is not None:  # a weak match drafts a short candidate (`WEAK_MATCH_CAPS`)
            k = min(k, self.weak_caps.get(match, k))
            if self.length_factor > 0:
                k = min(k, max(1, int(self.length_factor * length)))
            out = out[:k]
        for _ in range(CHAIN_LOOKUPS - 1):
            if not out or len(out) >= k:
                break
            more, _, _ = self._lookup(history + out, k - len(out), corpus)
            if not more:
                break
            out += more
        return out

    def alternative(self, history: list[int], k: int, first: list[int], shared: bool = True) -> list[int]:
        """A second candidate of up to k tokens that differs from `first` (the `propose` of this
        step) within their common length: the continuation of the longest suffix at another
        place — an earlier occurrence in the own history, else one of the corpus's kept
        occurrences, latest first; [] when every place continues like `first`. Call after
        `propose`, on an index made with `occurrences` > 1."""
        if self.earlier is None:
            raise ValueError("SuffixIndex.alternative needs occurrences > 1")
        end = len(history) - 1
        corpus = self.corpus if shared else None
        for m in self.sizes:
            if end - m + 1 < 0:
                continue
            suffix = tuple(history[end - m + 1 : end + 1])
            places = [lagged_copy(history, end - hit, k) for hit in self._own_hits(m, suffix)[:2]]
            if corpus is not None:
                places += corpus.continuations(suffix, k, exclude=self.doc)
            for cand in places:
                n = min(len(cand), len(first))
                if cand and cand[:n] != first[:n]:
                    return cand
        return []

    def tree(self, history: list[int], k: int, budget: int, shared: bool = True, min_score: float = 0.0
             ) -> list[tuple[int, int]]:
        """A draft tree of up to `budget` nodes, at most k deep (`draft_tree.draft_tree`): the
        continuations of every kept occurrence of the longest suffix that occurred, in the own
        history (the latest one as a `lagged_copy`, which runs on through a loop) and, when
        `shared`, in the corpus's other documents, each weighted 1, and those of the next shorter
        suffix that occurred weighted `TREE_BACKOFF_WEIGHT`; confidence from the longest match's
        length (the latest own occurrence followed back, else the suffix's). [] when no suffix
        occurred. Needs an index made with `occurrences` > 1."""
        self.update(history)
        end = len(history) - 1
        corpus = self.corpus if shared else None
        conts: list[tuple[list[int], float]] = []
        length, weight = 0, 1.0
        for m in self.sizes:
            if end - m + 1 < 0:
                continue
            suffix = tuple(history[end - m + 1 : end + 1])
            hits = self._own_hits(m, suffix)
            found = [lagged_copy(history, end - hit, k) for hit in hits]
            if corpus is not None:
                found += corpus.continuations(suffix, k, exclude=self.doc)
            if not found:
                continue
            conts += [(c, weight) for c in found]
            if length:
                break
            length = match_length(history, end, hits[0], m, MAX_MATCH_LENGTH) if hits else m
            weight = TREE_BACKOFF_WEIGHT
        return draft_tree(conts, budget, match_confidence(length), min_score) if conts else []

    def _own_hits(self, m: int, suffix: tuple[int, ...]) -> list[int]:
        """The indexed own occurrences of `suffix` (its last token's position), latest first."""
        hit = self.last_end[m].get(suffix)
        if hit is None:
            return []
        return [hit] + (self.earlier[m].get(suffix, [])[::-1] if self.earlier is not None else [])

    def _lookup(self, context: list[int], k: int, corpus: SharedCorpus | None, most: int = 0
                ) -> tuple[list[int], tuple[bool, int] | None, int]:
        """Up to k tokens after the longest suffix of `context` that occurred earlier: in the
        indexed own history (ending before its last token), else in the corpus; the match (in
        the own history, suffix length), None when there was none; and the match's length,
        followed back up to `most` tokens in the own history (`match_length`)."""
        end = len(context) - 1
        for m in self.sizes:
            if end - m + 1 < 0:
                continue
            suffix = tuple(context[end - m + 1 : end + 1])
            hit = self.last_end[m].get(suffix)
            if hit is not None:
                length = match_length(context, end, hit, m, most) if most > m else m
                return lagged_copy(context, end - hit, k), (True, m), length
            if corpus is not None:
                found = corpus.continuation(suffix, k, exclude=self.doc)
                if found:
                    return found, (False, m), m
        return [], None, 0


def context_index(seq: DecodeSequence, config, corpus: SharedCorpus | None,
                  occurrences: int = 1) -> SuffixIndex | None:
    """The context lookup for `seq` of a mode whose `config` has the `context_*` options (None
    when its candidates are off: `context_tokens` == 0); `occurrences`: see `SuffixIndex`."""
    if not config.context_tokens:
        return None
    return SuffixIndex(config.context_match_sizes, corpus if config.context_corpus else None, seq,
                       WEAK_MATCH_CAPS if config.context_caps else None, occurrences,
                       config.context_length_factor)


def propose_ngram(history: list[int], k: int, sizes: tuple[int, ...] = (3, 2)) -> list[int]:
    """Stateless form of `SuffixIndex.propose` (for tests and one-off use)."""
    return SuffixIndex(tuple(sorted(sizes, reverse=True))).propose(history, k)


@dataclass
class NgramState:
    index: SuffixIndex
    drafts: list[int] = field(default_factory=list)
    plan: TreePlan | None = None  # this step's two branches, when it has a second candidate
    recent: RecentAcceptance | None = None  # with `adaptive`: what limits the next draft


def finish_chains(drafts: list[list[int]], logits: torch.Tensor, ctx: StepContext, tau: float = 0.0
                  ) -> list[StepOutcome]:
    """Steps [pending, d_1 … d_j] verified as one batch (logits [B, W, V] of layouts padded
    past each chain, W > the longest chain): each chain is a deterministic draft (one-hot q), so
    the p/q rule keeps AR's distribution at tau = 0; the accepted drafts and the corrected /
    bonus token."""
    depth = max((len(d) for d in drafts), default=0)
    logits = logits[:, : depth + 1]  # the rows past every chain are another branch's or padding
    device = logits.device
    num = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=device)
    padded = torch.tensor([d + [0] * (depth - len(d)) for d in drafts], dtype=torch.long,
                          device=device).view(len(drafts), depth)
    result = verify_drafts(logits, padded, num, ctx, tau=tau)
    return [StepOutcome(d[:a] + [t], list(range(a + 1)), a)
            for d, a, t in zip(drafts, result.accept_len.tolist(), result.next_tokens.tolist())]


class NgramMode(Mode):
    name = "ngram"

    def __init__(self, config: NgramConfig, corpus: SharedCorpus | None = None, tau: float = 0.0):
        """`corpus`: the texts served (used when `config.corpus`); `tau`: relaxed acceptance of
        the drafts (ISD's lookup steps carry their own; 0 keeps AR's distribution)."""
        self.config = config
        self.corpus = corpus
        self.tau = tau
        self.seeds_per_step = config.num_draft + 1
        self.max_width = (config.tree or config.branches * config.num_draft) + 1

    def start(self, seq: DecodeSequence) -> None:
        several = self.config.branches > 1 or self.config.tree > 0
        seq.state = NgramState(context_index(seq, self.config, self.corpus, OCCURRENCES if several else 1),
                               recent=RecentAcceptance(self.config.num_draft) if self.config.adaptive else None)

    def layouts(self, seqs: list[DecodeSequence]) -> list[StepLayout]:
        out = []
        for s in seqs:
            st = s.state
            k = st.recent.limit() if st.recent is not None else self.config.num_draft
            if self.config.tree:
                if s.constraint is None:
                    out.append(self._tree_layout(s, k))
                    continue
                k = min(k, self.config.tree)  # a grammar checks chains: its rows draft one, in the tree's width
            st.drafts = grammar_valid(s, st.index.propose(s.history, k, shared=s.sampling.greedy))
            second = (grammar_valid(s, st.index.alternative(s.history, k, st.drafts, shared=s.sampling.greedy))
                      if self.config.branches > 1 and st.drafts else [])
            if second:
                lay, st.plan = build_branches(s.pending, [(st.drafts, 0), (second, 0)], fill_token=s.pending)
            else:
                lay, st.plan = StepLayout([s.pending, *st.drafts]), None
            out.append(lay)
        return out

    def _tree_layout(self, s: DecodeSequence, k: int) -> StepLayout:
        """The step's draft tree; a tree that is one chain is laid and verified as a chain."""
        st = s.state
        nodes = st.index.tree(s.history, k, self.config.tree, s.sampling.greedy, self.config.tree_min_score)
        if all(p == i - 1 for i, (_, p) in enumerate(nodes)):
            st.drafts, st.plan = [t for t, _ in nodes], None
            return StepLayout([s.pending, *st.drafts])
        st.drafts = []
        lay, st.plan = build_tree(s.pending, nodes)
        return lay

    def finish(self, seqs, batch: StepBatch, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        outcomes = finish_split(seqs, logits, ctx, self._finish_chains, self._finish_tree)
        if self.config.adaptive:
            for s, o in zip(seqs, outcomes):
                s.state.recent.record(o.accepted)
        return outcomes

    def _finish_chains(self, seqs, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        return finish_chains([s.state.drafts for s in seqs], logits, ctx, self.tau)

    def _finish_tree(self, seq: DecodeSequence, logits: torch.Tensor, ctx: StepContext) -> StepOutcome:
        """The candidates (two chains, or a draft tree's paths) as one-hot draft paths
        (`tree_verify`): lossless like a single chain."""
        plan, seq.state.plan = seq.state.plan, None
        return path_outcome(plan, verify_paths(logits, plan.paths, ctx.seeds[0], tau=self.tau, **ctx.row(0)))
