"""Tokens committed per decode step of each candidate configuration, measured offline.

A candidate is one configuration a plan bucket could run: plain AR (width 1), the lookup step
(`mode: ngram`: the context candidate alone, any mode's plan may run it) or the mode with some
options. Its acceptance does not depend on the batch it runs in (every mode decides each
sequence on its own), so each candidate decodes the held-out prompts once per sampling setting
on the HF engine, all prompts in one batch, and reports committed tokens per decode step. Its
width is the widest layout of its mode object: what a planned server step pads every request
to (`Mode.step_width`).

A server's context candidates also draw on what it served before (`decoding/corpus.py`), which
an acceptance run from an empty corpus does not see: it priced the corpus at nothing, and a
served ISD plan ran 4-token candidates where 8 served faster. So greedy runs start from a corpus
that already holds other prompts' outputs (`warm_corpus`), as a server's does after its first
requests; sampled rows never use the corpus.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from selfspec.decoding.corpus import SharedCorpus
from selfspec.decoding.ngram import CONTEXT_MATCH_SIZES
from selfspec.decoding.width_plan import PLAN_STEP_MODES
from selfspec.decoding.registry import unpadded
from selfspec.decoding.sampling import SamplingParams

#: The widths searched per mode: stride N for ISD / RISD, window W for SJD, block size n for
#: JACOBI, each with and without a context candidate of a few lengths (the embedded I-DLM
#: models are trained for strides 2-4). The lookup step, where the mode's own proposals cost
#: more query tokens than they commit, is `LOOKUP_GRID`, a candidate of every mode.
GRIDS: dict[str, list[dict[str, Any]]] = {
    "isd": [{"stride": n, "context_tokens": k, "context_tail": False} for n in (2, 3, 4) for k in (0, 4, 8, 12, 16)],
    "sjd": [{"window": w, "context_tokens": k} for w in (1, 2, 4) for k in (0, 4, 8, 12, 16)],
    # JACOBI's pool candidates (verify_size) widen every step; its context candidate may run
    # past the block, so small blocks with a long candidate are in the grid
    "jacobi": [{"block_size": n, "verify_size": v, "context_tokens": k}
               for n in (2, 4, 8) for v in (0, 4) for k in (0, 8, 16)],
}
GRIDS["risd"] = GRIDS["isd"]
#: lookup steps (`ngram.NgramMode` as a plan bucket) with the context options the modes' own
#: candidates use: the longer suffixes first, other requests' text for greedy rows. A second
#: candidate (branches 2) commits ~10% more per step for ~50% more query tokens on tiny-idlm
#: (README "Lookup steps in every mode's plan"): a longer single candidate does better where
#: query tokens cost (a CPU), the second branch where they are nearly free.
#: With `caps`, weak matches draft short candidates (`ngram.WEAK_MATCH_CAPS`): fewer query tokens
#: for nearly the same tokens a step, which pays where the forward is ragged (CPU); with
#: `adaptive` too, each request's draft length follows its recent acceptance
#: (`draft_length.py`): fewer still, which pays at the wider batches.
LOOKUP_GRID: list[dict[str, Any]] = [
    {"num_draft": k, "match_sizes": list(CONTEXT_MATCH_SIZES), "corpus": True, **({"branches": b} if b > 1 else {}),
     **({"caps": True} if caps else {}), **({"adaptive": True} if adaptive else {})}
    for k, b, caps, adaptive in ((4, 1, False, False), (8, 1, False, False), (12, 1, False, False),
                                 (16, 1, False, False), (8, 2, False, False), (12, 2, False, False),
                                 (12, 1, True, False), (16, 1, True, False), (8, 1, True, True), (12, 1, True, True),
                                 (16, 1, True, True))]


@dataclass
class Candidate:
    mode: str  # "ar", "ngram" (a lookup step) or the tuned mode
    options: dict[str, Any] = field(default_factory=dict)
    width: int = 1  # query tokens per request of its steps (padded)
    tokens_per_step: dict[str, float] = field(default_factory=dict)  # "greedy" / "sampled" -> committed per step
    # "greedy" / "sampled" -> query tokens per request and step of its layouts (with
    # `measure(ragged=True)` unpadded: what a ragged CPU forward carries)
    query_tokens_per_step: dict[str, float] = field(default_factory=dict)
    ragged: bool = False  # its served forwards carry the real query tokens only: priced by them
    # "greedy" / "sampled" -> per prompt [committed tokens, decode steps, query tokens] (the
    # prefill's left out): what `level.py` replays a served level's requests from
    per_request: dict[str, list[list[int]]] = field(default_factory=dict)

    def priced_width(self, kind: str) -> float:
        """The query tokens per request a step of it is priced by: the real ones where the
        served forward is ragged, else the padded width."""
        if self.ragged and kind in self.query_tokens_per_step:
            return max(1.0, self.query_tokens_per_step[kind])
        return float(self.width)

    @property
    def is_lookup(self) -> bool:
        """A lookup step: the context candidate alone (`LOOKUP_GRID`)."""
        return self.mode == "ngram"

    @property
    def label(self) -> str:
        if self.mode == "ar":
            return "ar"
        if self.is_lookup:  # the grid varies the draft length and the branches only
            branches = self.options.get("branches", 1)
            return (f"lookup={self.options['num_draft']}" + (f"x{branches}" if branches > 1 else "")
                    + ("c" if self.options.get("caps") else "") + ("a" if self.options.get("adaptive") else ""))
        return ",".join(f"{k}={v}" for k, v in self.options.items()) or "defaults"

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "options": self.options, "width": self.width, "ragged": self.ragged,
                "tokens_per_step": self.tokens_per_step, "query_tokens_per_step": self.query_tokens_per_step,
                "per_request": self.per_request}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Candidate:
        return Candidate(d["mode"], dict(d.get("options") or {}), int(d.get("width", 1)),
                         dict(d.get("tokens_per_step") or {}), dict(d.get("query_tokens_per_step") or {}),
                         bool(d.get("ragged", False)), dict(d.get("per_request") or {}))


def candidates_for(mode: str, grid: list[dict[str, Any]] | None = None) -> list[Candidate]:
    """AR, every grid point of `mode`, then the lookup steps."""
    own = [Candidate(mode, dict(opts)) for opts in (grid if grid is not None else GRIDS[mode])]
    return [Candidate("ar"), *own, *(Candidate("ngram", dict(opts)) for opts in LOOKUP_GRID)]


def warm_corpus(engine, prompts: list[list[int]], max_new_tokens: int) -> SharedCorpus:
    """A corpus holding `prompts` and their greedy AR continuations, one document each."""
    corpus = SharedCorpus()
    if prompts:
        outs = engine.generate(prompts, max_new_tokens, SamplingParams(), stop_token_ids=[], batch_size=len(prompts))
        for p, out in zip(prompts, outs):
            corpus.append(corpus.open(), list(p) + list(out.token_ids))
    return corpus


def measure(engine, candidates: list[Candidate], prompts: list[list[int]], max_new_tokens: int,
            samplings: dict[str, SamplingParams], base_options: dict[str, Any] | None = None, seed: int = 0,
            progress=None, corpus: SharedCorpus | None = None, ragged: bool = False) -> None:
    """Fill each candidate's width and tokens_per_step (per sampling kind) in place. `corpus`:
    what the greedy runs' context candidates find besides the prompts' own text (a copy each).
    `ragged`: the served forwards carry real tokens only (CPU): layouts are built unpadded, as
    the served worker then builds them. Each candidate's query tokens per step are kept."""
    for cand in candidates:
        # the base options are the tuned mode's; a plan step (AR, lookup) has its own
        options = ((cand.options or None) if cand.mode in PLAN_STEP_MODES
                   else {**(base_options or {}), **cand.options})
        cand.width = int(engine.build_mode(cand.mode, options).max_width)
        cand.ragged = ragged
        if ragged and options is not None:
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
                rows = [[o.metrics.committed_tokens - 1, o.metrics.forwards - 1, o.metrics.query_tokens - 1]
                        for o in outs]
                cand.per_request[kind] = rows
                steps = sum(r[1] for r in rows)
                cand.tokens_per_step[kind] = sum(r[0] for r in rows) / max(steps, 1)
                cand.query_tokens_per_step[kind] = sum(r[2] for r in rows) / max(steps, 1)
            if progress is not None:
                progress.update(1)
