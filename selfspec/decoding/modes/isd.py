"""Introspective Strided Decoding (ISD) and its lossless LoRA variant RISD (I-DLM, §3.2, App. B).

Stride N >= 2. (N = 1 with a context candidate is a lookup step: [pending, candidate], no MASK
proposals, the candidate verified as a chain with the rest of the batch: `ngram.NgramMode`'s step,
which any mode's width plan may also run as `{mode: ngram}`.) One step is one forward over

    [pending, q_1 … q_m, MASK × (N−1)]          m = N−1 (P step) or 0 (propose-only step)

with plain causal attention: every query sees the cached prefix and the step tokens before it,
so MASK positions see pending and all proposals, and pending / proposals never see a MASK.
With the logit shift (row i predicts token i+1):
- rows 0 … m are the causal anchors p: row i−1 verifies q_i (i = 1 … m), row m is the bonus
  anchor; in a propose-only step row 0 alone gives one exact new token;
- the N−1 MASK rows stand in for the positions after q_m; their argmax are the next proposals
  (for the N−1 positions after the bonus token).
Outcomes (`consume`):
- all pass (always, for m = 0): q_1 … q_m and a token drawn from row m are emitted (m+1
  tokens); that token is the next pending, the MASK argmax are its proposals;
- rejection at q_k: q_1 … q_{k−1} and the token resampled from max(0, p − q) are emitted (k
  tokens); it is the next pending and the next step is propose-only.
KV kept: pending and the accepted proposals (a prefix of the step). MASK, rejected and padding
positions never survive the step. `fixed_width` pads every layout to 2N−1 with MASK tokens
(what CUDA graphs need); otherwise a propose-only step is N tokens.

RISD is the same plan with the gate on at MASK positions: the engine applies the LoRA adapter
there only, so anchors are the base model's exact AR distribution.

Relaxed acceptance (tau > 0) is not lossless. With an argmax proposal x at a verified position
whose anchor gives p(x), the emitted token's law moves exactly min(tau·p(x), 1 − p(x)) of
probability mass onto x: that is its total-variation distance from AR sampling at that
position (positions after a rejection, and the propose-only step's token, stay exact);
tests/test_decoding_sampling.py checks samples against that law.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.decoding.requests.logits_rules import grammar_valid, mask_disallowed
from selfspec.decoding.modes.corpus import SharedCorpus
from selfspec.decoding.modes.ngram import CONTEXT_MATCH_SIZES, NgramConfig, NgramMode, SuffixIndex, context_index, match_sizes
from selfspec.decoding.argmax import first_argmax
from selfspec.decoding.requests.sampling import sample_from_probs
from selfspec.decoding.step import (
    DecodeSequence, Mode, StepBatch, StepContext, StepLayout, StepOutcome, verify_drafts,
)
from selfspec.decoding.modes.tree_verify import TreePlan, build_branches, finish_split, path_outcome, verify_paths


def stride_allowed(stride: int, context_tokens: int) -> bool:
    """N >= 2, or N = 1 with a context candidate (a lookup step: no MASK rows)."""
    return stride >= 2 or (stride == 1 and context_tokens > 0)


#: the strides a served ISD / RISD step may take (2N-1 query tokens per request)
SERVED_STRIDES = (2, 16)


def serving_check(options: dict, sources: dict) -> str | None:
    """What is wrong with these resolved options for a served ISD / RISD step (the problem and
    its fix), or None."""
    stride = options.get("stride")
    lo, hi = SERVED_STRIDES
    if not isinstance(stride, int) or stride > hi or not stride_allowed(stride, options.get("context_tokens") or 0):
        return (f"stride N={stride!r} ({sources.get('stride', 'default')}) is out of range: it needs an integer "
                f"{lo} <= N <= {hi} (2N-1 query tokens per step), or N = 1 with context_tokens > 0 (lookup "
                f"steps); pass e.g. --selfspec-stride 4")
    if options.get("fixed_width") is False:
        return ("under SGLang it chooses the layout width itself (padded to 2N-1; unpadded only on CPU with "
                "SELFSPEC_RAGGED_VERIFY=1); remove fixed_width=false")
    return None


@dataclass
class ISDConfig:
    stride: int = 4  # N: at most N tokens per step; 2N-1 query tokens (1: lookup steps, see module doc)
    tau: float = 0.0  # relaxed acceptance min(1, (1+tau) p/q); 0 keeps AR's distribution
    fixed_width: bool = True  # pad every step to 2N-1 (CUDA-graph shape) or use N / 2N-1
    mask_token_id: int | None = None  # default: selfspec.json, then the tokenizer's mask_token
    adapter: str | None = None  # RISD: PEFT adapter dir (default: selfspec.json's adapter)
    # context n-gram candidate: up to this many tokens that followed the latest earlier match of
    # the sequence's suffix, verified as a second branch beside the proposals (0 = off)
    context_tokens: int = 0
    context_match_sizes: tuple[int, ...] = CONTEXT_MATCH_SIZES  # suffix lengths tried, longest first
    context_tail: bool = True  # MASK proposals after the candidate too (used when it wins whole)
    # context candidates also from the other sequences served (`corpus.py`), for greedy rows
    context_corpus: bool = True
    # weak matches draft short candidates (`ngram.WEAK_MATCH_CAPS`; off: it did not pay served)
    context_caps: bool = False
    # > 0: a candidate is at most this many times as long as its match (`ngram.SuffixIndex`)
    context_length_factor: float = 0.0
    # sampled decoding: proposals "sample"d from the MASK rows' distribution q and verified
    # against that q (accepted with probability sum min(p, q)), or "argmax" proposals (the I-DLM
    # paper's). Greedy rows propose by argmax either way; sampling measured higher acceptance
    # on tiny-idlm at T=0.7 (`selfspec bench offline --modes isd --temperature 0.7` with
    # `--mode-config isd:proposal=argmax` against the default).
    proposal: str = "sample"
    # under a grammar, each proposal is drawn from its MASK row masked by what the grammar allows
    # after the tokens before it (bench/grammar_proposals.py measures what it buys)
    grammar_proposals: bool = True

    def __post_init__(self) -> None:
        if not stride_allowed(self.stride, self.context_tokens):
            raise ValueError(f"ISD stride must be >= 2, or 1 with context_tokens > 0 (a lookup step: the "
                             f"context candidate alone), got stride={self.stride}, "
                             f"context_tokens={self.context_tokens}")
        if self.tau < 0:
            raise ValueError(f"tau must be >= 0, got {self.tau}")
        if self.context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0 (0 = off), got {self.context_tokens}")
        self.context_match_sizes = match_sizes(self.context_match_sizes, "ISD context_match_sizes")
        if self.context_length_factor < 0:
            raise ValueError(f"ISD context_length_factor must be >= 0 (0 = off), got {self.context_length_factor}")
        if self.proposal not in ("argmax", "sample"):
            raise ValueError(f"ISD proposal must be 'argmax' or 'sample', got {self.proposal!r}")


@dataclass
class ISDState:
    proposals: list[int] = field(default_factory=list)  # for the positions after pending
    proposal_probs: torch.Tensor | None = None  # [N-1, V] q the proposals were sampled from; None: one-hot
    index: SuffixIndex | None = None  # the context lookup (context_tokens > 0)
    plan: TreePlan | None = None  # this step's branches, when it has a candidate branch


def build_layout(pending: int, proposals: list[int], stride: int, mask_token_id: int, fixed_width: bool) -> StepLayout:
    """[pending, q_1 … q_m, MASK × (N−1)] (+ MASK padding to 2N−1); gate on at MASK tokens."""
    if proposals and len(proposals) != stride - 1:
        raise ValueError(f"an ISD step verifies 0 or {stride - 1} proposals, got {len(proposals)}")
    real = 1 + len(proposals)
    width = 2 * stride - 1 if fixed_width else real + stride - 1
    tokens = [pending, *proposals] + [mask_token_id] * (width - real)
    gate = [False] * real + [True] * (width - real)
    return StepLayout(tokens, gate=gate)


def build_tree_layout(pending: int, proposals: list[int], candidate: list[int], stride: int, mask_token_id: int,
                      tail: bool, width: int | None = None) -> tuple[StepLayout, TreePlan]:
    """Two branches over the pending token: [proposals, MASK × (N−1)] and [candidate (+ MASK ×
    (N−1) if tail)], their common prefix shared as trunk; padded with MASK to `width` if given."""
    n1 = stride - 1
    return build_branches(pending, [(proposals, n1), (candidate, n1 if tail else 0)], mask_token_id, width)


@dataclass
class ISDStepResult:
    emit: list[int]  # tokens emitted by this step
    pending: int  # the next pending token (emit[-1])
    keep: list[int]  # step indices whose KV is cached: the old pending + accepted proposals
    proposals: list[int]  # the next step's proposals; [] -> a propose-only step follows


def consume(proposals: list[int], accept_len: int, next_token: int, mask_argmax: list[int]) -> ISDStepResult:
    """Apply one step's verify result (accept_len of the proposals, the corrected / bonus token)."""
    all_pass = accept_len == len(proposals)
    emit = list(proposals[:accept_len]) + [int(next_token)]
    return ISDStepResult(emit, int(next_token), list(range(accept_len + 1)), list(mask_argmax) if all_pass else [])


class ISDMode(Mode):
    name = "isd"

    def __init__(self, config: ISDConfig, mask_token_id: int, gated: bool = False, corpus: SharedCorpus | None = None):
        self.config = config
        self.corpus = corpus
        self.mask_token_id = mask_token_id
        self.gated = gated
        self.name = "risd" if gated else "isd"
        n1, k = config.stride - 1, config.context_tokens
        self.verify_seeds = max(n1, k) + 1  # one per depth of the deepest path, plus the bonus
        # then one per sampled proposal
        self.seeds_per_step = self.verify_seeds + (n1 if config.proposal == "sample" else 0)
        self.max_width = 1 + 2 * n1 + (k + (n1 if config.context_tail else 0) if k else 0)
        # stride 1: the lookup step, run by the one implementation of it
        self.lookup = (NgramMode(NgramConfig(k, config.context_match_sizes, config.context_corpus, config.context_caps,
                                             length_factor=config.context_length_factor), corpus, tau=config.tau)
                       if config.stride == 1 else None)

    def start(self, seq: DecodeSequence) -> None:
        if self.lookup is not None:
            self.lookup.start(seq)
            return
        seq.state = ISDState(index=context_index(seq, self.config, self.corpus))

    def layouts(self, seqs: list[DecodeSequence]) -> list[StepLayout]:
        if self.lookup is not None:
            return [self._gated(self._padded(lay)) for lay in self.lookup.layouts(seqs)]
        cfg = self.config
        out = []
        for s in seqs:
            st = s.state
            st.plan = None
            candidate = (st.index.propose(s.history, cfg.context_tokens, shared=s.sampling.greedy)
                         if st.index is not None else [])
            candidate = grammar_valid(s, candidate)
            if candidate and candidate != st.proposals[: len(candidate)]:
                width = self.max_width if cfg.fixed_width else None
                lay, st.plan = build_tree_layout(s.pending, st.proposals, candidate, cfg.stride, self.mask_token_id,
                                                 cfg.context_tail, width)
                st.plan.paths[0].probs = st.proposal_probs  # the proposals' q (None: one-hot)
            else:
                lay = build_layout(s.pending, st.proposals, cfg.stride, self.mask_token_id, cfg.fixed_width)
            out.append(self._gated(lay))
        return out

    def _padded(self, lay: StepLayout) -> StepLayout:
        """A lookup step's chain, MASK-padded to the fixed width if the mode pads."""
        pad = self.max_width - len(lay.tokens) if self.config.fixed_width else 0
        return StepLayout(list(lay.tokens) + [self.mask_token_id] * pad, gate=[False] * len(lay.tokens) + [True] * pad)

    def _gated(self, lay: StepLayout) -> StepLayout:
        if not self.gated:  # the gate is RISD's adapter switch
            lay.gate = None
        return lay

    def finish(self, seqs, batch: StepBatch, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        if self.lookup is not None:
            return self.lookup.finish(seqs, batch, logits, ctx)
        return finish_split(seqs, logits, ctx, self._finish_chains, self._finish_tree)

    def _finish_chains(self, seqs, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        """Steps without a candidate branch, verified as one batch."""
        n = self.config.stride
        device = logits.device
        num = torch.tensor([len(s.state.proposals) for s in seqs], dtype=torch.long, device=device)
        drafts = torch.tensor(
            [s.state.proposals or [0] * (n - 1) for s in seqs], dtype=torch.long, device=device
        )
        dense = [s.state.proposal_probs for s in seqs]
        draft_probs = None
        if any(q is not None for q in dense):  # one-hot rows for argmax / greedy proposals
            draft_probs = torch.nn.functional.one_hot(drafts, logits.shape[-1]).float()
            for b, q in enumerate(dense):
                if q is not None:
                    draft_probs[b] = q
        result = verify_drafts(logits[:, :n], drafts, num, ctx, tau=self.config.tau, draft_probs=draft_probs)
        # MASK rows start right after the real proposals
        mask_rows = (1 + num).unsqueeze(1) + torch.arange(n - 1, device=device)
        mask_logits = logits.gather(1, mask_rows.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        proposals, probs = self._propose(mask_logits, ctx)
        outcomes = []
        for b, (s, a, t) in enumerate(zip(seqs, result.accept_len.tolist(), result.next_tokens.tolist())):
            step = consume(s.state.proposals, a, t, proposals[b])
            s.state.proposals = step.proposals
            s.state.proposal_probs = probs[b] if step.proposals and probs is not None else None
            if step.proposals and self._grammar_guided(s):  # redrawn from the grammar-masked rows
                s.state.proposals, s.state.proposal_probs = self._grammar_proposals(
                    s, step.emit, mask_logits[b], ctx.select(b))
            outcomes.append(StepOutcome(step.emit, step.keep, a))
        return outcomes

    def _propose(self, mask_logits: torch.Tensor, ctx: StepContext, first: int = 0
                 ) -> tuple[list[list[int]], list | None]:
        """The next proposals from MASK rows [B, N-1, V] (rows first, first + 1, ... of them):
        argmax, or drawn from q (the request's sampling distribution of the MASK rows) for
        sampled rows under proposal="sample"; then also each sampled row's q (None for rows
        whose proposals are one-hot)."""
        if self.config.proposal != "sample" or ctx.all_greedy:
            return first_argmax(mask_logits).tolist(), None
        q = ctx.probs(mask_logits)
        start = self.verify_seeds + first
        seeds = ctx.seeds[:, start : start + mask_logits.shape[1]]
        drawn = sample_from_probs(q, seeds).tolist()
        return drawn, [None if g else q[b] for b, g in enumerate(ctx.greedy.tolist())]

    def _grammar_guided(self, seq: DecodeSequence) -> bool:
        return seq.constraint is not None and self.config.grammar_proposals

    def _grammar_proposals(self, seq: DecodeSequence, emitted: list[int], mask_rows: torch.Tensor,
                           ctx: StepContext) -> tuple[list[int], torch.Tensor | None]:
        """Proposals the sequence's grammar allows: one position at a time, each MASK row [N-1, V]
        masked along the emitted tokens and the proposals before it (a proposal the grammar
        rejects could never be accepted); their q is the masked rows' distribution."""
        proposals, qs = [], []
        for i in range(mask_rows.shape[0]):
            row = mask_disallowed(mask_rows[i], seq, emitted + proposals)
            drawn, q = self._propose(row.view(1, 1, -1), ctx, first=i)
            proposals.append(drawn[0][0])
            qs.append(q[0] if q is not None else None)
        return proposals, (torch.cat(qs) if qs[0] is not None else None)

    def _finish_tree(self, seq: DecodeSequence, logits: torch.Tensor, ctx: StepContext) -> StepOutcome:
        """A step with a candidate branch (`tree_verify`): the winning path's drafts, then the
        MASK proposals of that path if it was accepted whole and has them."""
        plan = seq.state.plan
        res = verify_paths(logits, plan.paths, ctx.seeds[0], tau=self.config.tau, **ctx.row(0))
        outcome = path_outcome(plan, res)
        emit = outcome.emit
        tail = plan.tail_rows[res.path]
        whole = res.accepted == len(plan.paths[res.path].tokens)
        seq.state.proposals, seq.state.proposal_probs = [], None
        if whole and tail is not None:
            if self._grammar_guided(seq):
                seq.state.proposals, seq.state.proposal_probs = self._grammar_proposals(seq, emit, logits[tail], ctx)
            else:
                proposals, probs = self._propose(logits[tail].unsqueeze(0), ctx)
                seq.state.proposals = proposals[0]
                seq.state.proposal_probs = probs[0] if probs is not None else None
        seq.state.plan = None
        return outcome
