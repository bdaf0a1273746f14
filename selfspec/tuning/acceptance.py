"""Tokens committed per decode step of each candidate configuration, measured offline.

A candidate is one configuration a plan bucket could run: plain AR (width 1), the lookup step
(`mode: ngram`: the context candidate alone, any mode's plan may run it) or the mode's own step
with some options. Its acceptance does not depend on the batch it runs in (every mode decides
each sequence on its own), so each candidate decodes the tune prompts once per sampling setting
on the HF engine, all prompts in one batch, and reports committed tokens and query tokens per
decode step.

A server's context candidates also draw on what it served before (`decoding/modes/corpus.py`), which
an acceptance run from an empty corpus does not see; so greedy runs start from a corpus that
already holds other prompts' outputs (`warm_corpus`), as a server's does after its first
requests. Sampled rows never use the corpus.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from selfspec.decoding import registry
from selfspec.decoding.modes.corpus import SharedCorpus
from selfspec.decoding.modes.ngram import CONTEXT_MATCH_SIZES
from selfspec.decoding.registry import unpadded
from selfspec.decoding.requests.sampling import SamplingParams
from selfspec.decoding.widths.width_plan import PLAN_STEP_MODES

#: the mode's own step: its policy options (`ModeSpec.policy_options`) with these candidate lengths
OWN_CONTEXT_TOKENS = (0, 4, 16)
#: lookup steps: (draft tokens, weak matches cut short, draft length following recent acceptance)
LOOKUPS = ((4, False, False), (8, True, True), (12, True, True), (16, False, False))


@dataclass
class Candidate:
    mode: str  # "ar", "ngram" (a lookup step) or the tuned mode
    options: dict[str, Any] = field(default_factory=dict)
    width: int = 1  # query tokens per request of its widest step (padded)
    tokens_per_step: dict[str, float] = field(default_factory=dict)  # "greedy" / "sampled" -> committed
    query_tokens_per_step: dict[str, float] = field(default_factory=dict)  # real query tokens per step
    ragged: bool = False  # its served forwards carry the real query tokens only: priced by them

    def priced_width(self, kind: str) -> float:
        """The query tokens per request a step of it is priced by: the real ones where the
        served forward is ragged, else the padded width."""
        if self.ragged and kind in self.query_tokens_per_step:
            return max(1.0, self.query_tokens_per_step[kind])
        return float(self.width)

    @property
    def label(self) -> str:
        if self.mode == "ar":
            return "ar"
        if self.mode == "ngram":
            return (f"lookup={self.options['num_draft']}" + ("c" if self.options.get("caps") else "")
                    + ("a" if self.options.get("adaptive") else ""))
        return ",".join(f"{k}={v}" for k, v in self.options.items()) or "defaults"

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "options": self.options, "width": self.width, "ragged": self.ragged,
                "tokens_per_step": self.tokens_per_step, "query_tokens_per_step": self.query_tokens_per_step}


def candidates_for(mode: str) -> list[Candidate]:
    """AR, the mode's own step at its policy options with a few candidate lengths, the lookups."""
    own = [Candidate(mode, {**registry.get(mode).policy_options, "context_tokens": k}) for k in OWN_CONTEXT_TOKENS]
    lookups = [Candidate("ngram", {"num_draft": k, "match_sizes": list(CONTEXT_MATCH_SIZES), "corpus": True,
                                   **({"caps": True, "adaptive": True} if adaptive else {})})
               for k, _, adaptive in LOOKUPS]
    return [Candidate("ar"), *own, *lookups]


def warm_corpus(engine, prompts: list[list[int]], max_new_tokens: int) -> SharedCorpus:
    """A corpus holding `prompts` and their greedy AR continuations, one document each."""
    corpus = SharedCorpus()
    if prompts:
        outs = engine.generate(prompts, max_new_tokens, SamplingParams(), stop_token_ids=[], batch_size=len(prompts))
        for p, out in zip(prompts, outs):
            corpus.append(corpus.open(), list(p) + list(out.token_ids))
    return corpus


def measure(engine, candidates: list[Candidate], prompts: list[list[int]], max_new_tokens: int,
            samplings: dict[str, SamplingParams], seed: int = 0, progress=None, corpus: SharedCorpus | None = None,
            ragged: bool = False) -> None:
    """Fill each candidate's width and tokens / query tokens per step (per sampling kind) in
    place. `corpus`: what greedy runs' context candidates find besides the prompts' own text (a
    copy each). `ragged`: the served forwards carry real tokens only (CPU): layouts are built
    unpadded, as the served worker then builds them."""
    for cand in candidates:
        options = cand.options or None
        cand.width = int(engine.build_mode(cand.mode, options).max_width)
        cand.ragged = ragged
        if ragged and options is not None and cand.mode not in PLAN_STEP_MODES:
            options = unpadded(cand.mode, options)
        for kind, sampling in samplings.items():
            # a fresh mode per run: its context corpus must not hold the other run's outputs
            warm = copy.deepcopy(corpus) if corpus is not None and sampling.greedy else None
            mode_obj = engine.build_mode(cand.mode, options, corpus=warm)
            if mode_obj.greedy_only and not sampling.greedy:
                cand.tokens_per_step[kind] = float("nan")  # cannot serve sampled batches
            else:
                outs = engine.generate(prompts, max_new_tokens, sampling, seed=seed, stop_token_ids=[],
                                       mode=mode_obj, batch_size=len(prompts))
                # the prefill's token, forward and query tokens excluded
                steps = sum(o.metrics.forwards - 1 for o in outs)
                cand.tokens_per_step[kind] = sum(o.metrics.committed_tokens - 1 for o in outs) / max(steps, 1)
                cand.query_tokens_per_step[kind] = sum(o.metrics.query_tokens - 1 for o in outs) / max(steps, 1)
            if progress is not None:
                progress.update(1)
