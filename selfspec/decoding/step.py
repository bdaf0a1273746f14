"""What one decoding step is, independent of the engine that runs it.

Every mode works on sequences whose committed tokens (`history`) end with the *pending*
token: emitted, but its KV not yet cached; it sits at position len(history) - 1, right after
the cached prefix. A step is:

1. `Mode.layouts(seqs)` -> one `StepLayout` per sequence: the query tokens of this forward
   (token 0 is always the pending token), their position offsets from the pending token, the
   visibility among them (`branch`: 0 = shared trunk seen by everyone after it; equal ids see
   each other causally; so all-zero is plain causal attention, distinct ids make a tree of
   branches over the trunk; or `parent`, a token tree: each query token sees its ancestors and
   itself, as a lookup step's draft tree shares nodes), and the per-token LoRA gate (RISD).
2. The engine runs one forward over `collate(layouts)` with the cached prefix visible to every
   query and returns logits [B, W, V] (row i predicts the token after query token i).
3. `Mode.finish(seqs, batch, logits, ctx)` verifies with the rules of `selfspec.decoding.modes.verify`
   and returns one `StepOutcome` per sequence: the tokens to emit (accepted drafts plus the
   corrected / bonus token, whose last one is the next pending token) and `keep`, the step
   indices whose KV joins the cached prefix, in order (the old pending token plus the accepted
   drafts: len(keep) == len(emit)). Everything else the step computed is dropped.
The mode updates `seq.state` inside `finish`; the engine then extends `seq.history`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

from selfspec.decoding.requests.sampling import SamplingFilters, SamplingParams, logits_to_probs
from selfspec.errors import UserError
from selfspec.decoding.modes.verify import REFERENCE_OPS, VerifyOps, VerifyResult


@dataclass(eq=False)  # compared and hashed by identity: modes key per-sequence state by it
class DecodeSequence:
    history: list[int]  # prompt + emitted tokens; the last one is the pending token
    sampling: SamplingParams = field(default_factory=SamplingParams)
    state: Any = None  # the running mode's per-sequence state (`Mode.start` makes it)
    prompt_len: int = -1  # history[:prompt_len] is the prompt (-1: all of the initial history)
    stop_ids: frozenset[int] = frozenset()  # what min_new_tokens holds back
    constraint: Any = None  # a `logits_rules.TokenConstraint` (grammar), or None
    watermark: Any = None  # a `watermark.SequenceWatermark`, or None
    corpus_doc: int | None = None  # its document in the mode's `corpus.SharedCorpus`, once it has one

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.history)

    @property
    def output(self) -> list[int]:
        """The tokens generated so far (the pending token included)."""
        return self.history[self.prompt_len :]

    @property
    def pending(self) -> int:
        return self.history[-1]


@dataclass
class StepLayout:
    tokens: list[int]
    offsets: list[int] | None = None  # position offset from the pending token; None: 0..W-1
    branch: list[int] | None = None  # visibility groups (see module doc); None: causal
    gate: list[bool] | None = None  # LoRA on at these tokens (RISD [MASK] positions)
    parent: list[int] | None = None  # a tree: parent[i] < i is token i's parent (-1 for token 0); overrides branch

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class StepBatch:
    tokens: torch.Tensor  # [B, W] long
    offsets: torch.Tensor  # [B, W] long
    local: torch.Tensor  # [B, W, W] bool: query i sees step token j
    gate: torch.Tensor | None  # [B, W] bool, or None when no layout gates
    widths: list[int]  # real tokens per row (batch padding excluded)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def seen(self, b: int, rows: int) -> list[list[int]]:
        """For each query row i < rows of sequence b, the step indices after the pending token
        that it sees, in order (itself included for i >= 1): its path from the pending token."""
        sees = self.local[b, :rows, 1:].cpu()
        return [(sees[i].nonzero().flatten() + 1).tolist() for i in range(rows)]


def branch_visibility(branch: torch.Tensor) -> torch.Tensor:
    """[..., W] branch ids -> [..., W, W] bool: j <= i and (branch[j] == 0 or same branch)."""
    width = branch.shape[-1]
    causal = torch.ones(width, width, dtype=torch.bool, device=branch.device).tril()
    bi, bj = branch.unsqueeze(-1), branch.unsqueeze(-2)
    return causal & ((bj == 0) | (bj == bi))


def tree_visibility(parent: list[int], out: numpy.ndarray) -> None:
    """Rows i < len(parent) of `out` [>= n, >= n] bool: token i sees its ancestors and itself.
    numpy rows: a torch row copy per node was most of a 16-tree step's collate on a CPU."""
    for i, p in enumerate(parent):
        if p >= i:
            raise ValueError(f"tree layout: token {i}'s parent {p} does not come before it")
        out[i] = out[p] if p >= 0 else False
        out[i, i] = True


def collate(layouts: list[StepLayout], pad_token: int = 0, device=None) -> StepBatch:
    """Pad layouts to one width. Batch padding goes after every real token (branch -1), so no
    real query sees it, and it sees only the trunk and itself (no fully masked rows)."""
    width = max(len(lay) for lay in layouts)
    bsz = len(layouts)
    if width == 1 and all(lay.gate is None for lay in layouts):  # AR steps: skip the general build
        tokens = torch.tensor([lay.tokens for lay in layouts], dtype=torch.long, device=device)
        zeros = torch.zeros((bsz, 1), dtype=torch.long, device=device)
        return StepBatch(tokens, zeros, torch.ones((bsz, 1, 1), dtype=torch.bool, device=device), None, [1] * bsz)
    # rows built as host lists and made tensors once: a tensor write per row and field was a
    # measurable share of a wide batch's step on a CPU
    tok_rows, off_rows, branch_rows, gate_rows = [], [], [], []
    any_gate = any(lay.gate is not None for lay in layouts)
    for lay in layouts:
        n = len(lay)
        pad = width - n
        tok_rows.append(list(lay.tokens) + [pad_token] * pad)
        off_rows.append((list(lay.offsets) if lay.offsets is not None else list(range(n))) + list(range(n, width)))
        branch_rows.append((list(lay.branch) if lay.branch is not None else [0] * n) + [-1] * pad)
        if any_gate:
            gate_rows.append((list(lay.gate) if lay.gate is not None else [False] * n) + [False] * pad)
    tokens = torch.tensor(tok_rows, dtype=torch.long)
    offsets = torch.tensor(off_rows, dtype=torch.long)
    gate = torch.tensor(gate_rows, dtype=torch.bool) if any_gate else None
    local = branch_visibility(torch.tensor(branch_rows, dtype=torch.long))
    if any(lay.parent is not None for lay in layouts):
        view = local.numpy()  # shares local's memory
        for b, lay in enumerate(layouts):
            if lay.parent is not None:  # the batch padding after it keeps seeing its branch-0 tokens
                tree_visibility(lay.parent, view[b])
    batch = StepBatch(tokens, offsets, local, gate, [len(lay) for lay in layouts])
    if device is not None:
        batch.tokens, batch.offsets, batch.local = (t.to(device) for t in (batch.tokens, batch.offsets, batch.local))
        if batch.gate is not None:
            batch.gate = batch.gate.to(device)
    return batch


@dataclass
class StepContext:
    """Per-row sampling settings and this step's seeds (see `selfspec.decoding.requests.seeds`)."""

    filters: SamplingFilters  # per-row tensors: temperature [B] float, top_k [B] long, top_p / min_p [B] float
    seeds: torch.Tensor  # [B, Mode.seeds_per_step] long
    ops: VerifyOps = REFERENCE_OPS  # the verify implementations (chosen once by the engine)
    filtered: bool = True  # some row uses top-k / top-p / min-p (False: known from the params)
    # known from the params: every row's temperature when they share one (else None), and
    # whether every row is greedy (None: read from `temperature`)
    shared_temperature: float | None = None
    known_all_greedy: bool | None = None

    @property
    def greedy(self) -> torch.Tensor:
        return self.filters.temperature <= 0

    @property
    def all_greedy(self) -> bool:
        if self.known_all_greedy is not None:
            return self.known_all_greedy
        return bool(self.greedy.all())

    def select(self, rows: torch.Tensor | int) -> StepContext:
        """The context of a subset of the batch's rows (an int: that one row, as views)."""
        if isinstance(rows, int):
            rows = slice(rows, rows + 1)
        return StepContext(SamplingFilters._make(t[rows] for t in self.filters), self.seeds[rows], self.ops,
                           self.filtered, self.shared_temperature,
                           True if self.known_all_greedy else None)  # a subset of greedy rows is greedy

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The rows' sampling distributions: logits [B, ..., V] -> probs (`sampling.logits_to_probs`)."""
        return logits_to_probs(logits, *self.sampling_args())

    def sampling_args(self) -> SamplingFilters:
        """The settings for the sampling and verify functions: the filters as their neutral
        scalars when no row uses them (the functions then skip them outright), the temperature
        as a number when every row has the same one."""
        temperature = self.filters.temperature if self.shared_temperature is None else self.shared_temperature
        if self.filtered:
            return SamplingFilters(temperature, *self.filters[1:])
        return SamplingFilters(temperature)

    def row(self, b: int) -> dict:
        """Row b's settings as the scalar keywords of `tree_verify.verify_paths`."""
        if self.shared_temperature is not None and not self.filtered:  # known without reading tensors
            return SamplingFilters(self.shared_temperature)._asdict()
        temperature, top_k, top_p, min_p = self.filters
        return SamplingFilters(float(temperature[b]), int(top_k[b]), float(top_p[b]), float(min_p[b]))._asdict()

    @staticmethod
    def from_params(params: list[SamplingParams], seeds: torch.Tensor, ops: VerifyOps = REFERENCE_OPS) -> StepContext:
        return StepContext(
            _param_tensors(tuple(params), seeds.device), seeds, ops,
            filtered=any(p.filtered for p in params),
            shared_temperature=params[0].temperature if len({p.temperature for p in params}) == 1 else None,
            known_all_greedy=all(p.greedy for p in params),
        )


_FILTER_DTYPES = SamplingFilters(torch.float32, torch.long, torch.float32, torch.float32)


@functools.lru_cache(maxsize=256)
def _param_tensors(params: tuple[SamplingParams, ...], device: torch.device) -> SamplingFilters:
    """The batch's per-row settings as tensors, cached by the batch's settings: a served batch
    keeps its requests for many steps, and four small tensors a step were a measurable share of
    a batch-1 step on a CPU. Callers treat them as read-only."""
    return SamplingFilters._make(torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)
                                 for name, dtype in _FILTER_DTYPES._asdict().items())


@dataclass
class StepOutcome:
    emit: list[int]  # new tokens; emit[-1] becomes the pending token
    keep: list[int]  # step indices whose KV is cached, in order; len(keep) == len(emit)
    accepted: int = 0  # drafts accepted this step (len(emit) - 1 for draft-verify modes)


def verify_drafts(
    target_logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    ctx: StepContext,
    tau: float = 0.0,
    draft_probs: torch.Tensor | None = None,
) -> VerifyResult:
    """The verify rule for a batch: greedy prefix acceptance when every row is greedy,
    otherwise p/q speculative acceptance (greedy rows then reduce to the greedy rule, since p
    is one-hot). Uses seeds ctx.seeds[:, :D+1] (the verify contract's per-position seeds)."""
    if ctx.all_greedy:
        return ctx.ops.greedy(target_logits, drafts, num_drafts)
    depth = drafts.shape[1]
    return ctx.ops.speculative(target_logits, drafts, num_drafts, ctx.seeds[:, : depth + 1], tau=tau,
                               draft_probs=draft_probs, **ctx.sampling_args()._asdict())


class Mode:
    """Base class of the decoding modes (see module doc for the step protocol)."""

    name = "base"
    seeds_per_step = 1
    greedy_only = False
    max_width = 1  # most query tokens a layout can have (sizes the engine's buffers)

    @property
    def step_width(self) -> int:
        """The widest layout of the step `layouts` last planned (a planned mode narrows it)."""
        return self.max_width

    @property
    def step_seed_columns(self) -> int:
        """How many of the step's `seeds_per_step` seeds the step `layouts` last planned reads
        (a prefix: the engine hashes only those and still advances the counter by all)."""
        return self.seeds_per_step

    def start(self, seq: DecodeSequence) -> None:
        """Called once after prefill, when the first generated token is the pending token."""

    def layouts(self, seqs: list[DecodeSequence]) -> list[StepLayout]:
        raise NotImplementedError

    def finish(
        self, seqs: list[DecodeSequence], batch: StepBatch, logits: torch.Tensor, ctx: StepContext
    ) -> list[StepOutcome]:
        raise NotImplementedError


class ModeUnavailable(UserError):
    """The model cannot run this mode (no mask token, no adapter, ...); the message says why."""
