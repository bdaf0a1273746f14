"""Introspective Strided Decoding (ISD) and its lossless LoRA variant RISD (I-DLM, §3.2, App. B).

Stride N >= 2. One step is one forward over

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

from selfspec.decoding.step import (
    DecodeSequence, Mode, StepBatch, StepContext, StepLayout, StepOutcome, verify_drafts,
)


@dataclass
class ISDConfig:
    stride: int = 4  # N: at most N tokens per step; 2N-1 query tokens
    tau: float = 0.0  # relaxed acceptance min(1, (1+tau) p/q); 0 keeps AR's distribution
    fixed_width: bool = True  # pad every step to 2N-1 (CUDA-graph shape) or use N / 2N-1
    mask_token_id: int | None = None  # default: selfspec.json, then the tokenizer's mask_token
    adapter: str | None = None  # RISD: PEFT adapter dir (default: selfspec.json's adapter)

    def __post_init__(self) -> None:
        if self.stride < 2:
            raise ValueError(f"ISD stride must be >= 2, got {self.stride}")
        if self.tau < 0:
            raise ValueError(f"tau must be >= 0, got {self.tau}")


@dataclass
class ISDState:
    proposals: list[int] = field(default_factory=list)  # for the positions after pending


def build_layout(pending: int, proposals: list[int], stride: int, mask_token_id: int, fixed_width: bool) -> StepLayout:
    """[pending, q_1 … q_m, MASK × (N−1)] (+ MASK padding to 2N−1); gate on at MASK tokens."""
    if proposals and len(proposals) != stride - 1:
        raise ValueError(f"an ISD step verifies 0 or {stride - 1} proposals, got {len(proposals)}")
    real = 1 + len(proposals)
    width = 2 * stride - 1 if fixed_width else real + stride - 1
    tokens = [pending, *proposals] + [mask_token_id] * (width - real)
    gate = [False] * real + [True] * (width - real)
    return StepLayout(tokens, gate=gate)


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

    def __init__(self, config: ISDConfig, mask_token_id: int, gated: bool = False):
        self.config = config
        self.mask_token_id = mask_token_id
        self.gated = gated
        self.name = "risd" if gated else "isd"
        self.seeds_per_step = config.stride  # D + 1 verify seeds
        self.max_width = 2 * config.stride - 1

    def start(self, seq: DecodeSequence) -> None:
        seq.state = ISDState()

    def layouts(self, seqs: list[DecodeSequence]) -> list[StepLayout]:
        cfg = self.config
        out = []
        for s in seqs:
            lay = build_layout(s.pending, s.state.proposals, cfg.stride, self.mask_token_id, cfg.fixed_width)
            if not self.gated:
                lay.gate = None
            out.append(lay)
        return out

    def finish(self, seqs, batch: StepBatch, logits: torch.Tensor, ctx: StepContext) -> list[StepOutcome]:
        n = self.config.stride
        device = logits.device
        num = torch.tensor([len(s.state.proposals) for s in seqs], dtype=torch.long, device=device)
        drafts = torch.tensor(
            [s.state.proposals or [0] * (n - 1) for s in seqs], dtype=torch.long, device=device
        )
        result = verify_drafts(logits[:, :n], drafts, num, ctx, tau=self.config.tau)
        # MASK rows start right after the real proposals
        mask_rows = (1 + num).unsqueeze(1) + torch.arange(n - 1, device=device)
        mask_argmax = logits.gather(1, mask_rows.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).argmax(-1)
        outcomes = []
        for s, a, t, props in zip(seqs, result.accept_len.tolist(), result.next_tokens.tolist(), mask_argmax.tolist()):
            step = consume(s.state.proposals, a, t, props)
            s.state.proposals = step.proposals
            outcomes.append(StepOutcome(step.emit, step.keep, a))
        return outcomes
