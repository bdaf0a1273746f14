"""The built-in policy: the width plan every mode serves when no plan file gives one.

A step of several query tokens per request pays while the forward is flat in query tokens, and
the wider the batch the sooner it turns linear. So, per step, from the batch it runs in:

- small greedy batches run the mode's own step with the context candidate (`context_tokens`),
  drafted as long as twice its match (a match followed back through a loop drafts long, a
  fresh one short: SuffixDecoding's rule): there a query token costs little, and the candidate
  rides along as a second branch;
- middle greedy batches run the lookup step (`ngram.NgramMode`: the candidate alone), a draft
  tree of 11 tokens over every place the text's suffix occurred (`ngram.SuffixIndex.tree`);
- wide greedy batches run the narrow lookup step: a drafted token must be likely to pay its cost,
  so a draft is no longer than its match (a loop followed back drafts all 12 tokens);
- sampled batches run plain AR steps, at every batch size: on the tune prompts at temperature
  0.7 no speculative step beat them (ISD's own stride-2 step with a 4-token candidate read
  0.98 / 0.98 / 0.86x stock AR at C = 1 / 4 / 16, the worker's AR steps 1.04 / 1.16 / 1.30x;
  sampled lookup steps accept little at T=0.7, 1.25-1.34 tokens per step, and read 0.85-1.10x
  the AR steps at C = 1 / 4 / 16 / 32: bench/results/policy/tune-t07-lookup.json), and one step
  kind at every batch size keeps a seeded sampled request's output the same alone and in any
  batch.

The run-time check (`online_check.OnlineCheck`) then measures, per batch-size class of greedy
batches, the plan's arm against plain AR steps and, at small batches, against the lookup step of
the same candidate (whether the mode's own proposals pay for their query tokens depends on the
model), and serves the fastest: a policy that does not pay on some machine or model falls back
by measurement. Nothing here is measured at start-up; the constants below were chosen on the
`tune` prompts on a 2-core CPU (docs/serving.md: the default policy; `bench/results/policy/`).

On CUDA the verify width is captured once: the policy's widest bucket sets it, and narrower
steps pad to it (the worker's fixed forward width).

Named policies (`--selfspec-policy`) besides `auto` isolate what each part buys (the
breakdown of `selfspec bench serve --breakdown`): `own` is the mode alone at its options on every
step (no lookup, no check), `lookup` the policy with every own step replaced by the lookup step
of the same candidate, `ar` plain AR steps on the selfspec worker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from selfspec.decoding.modes.ngram import CONTEXT_MATCH_SIZES

POLICY_NAMES = ("auto", "own", "lookup", "ar")


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "auto"
    # greedy batches of up to this many requests run the mode's own step with the candidate. On
    # the tune prompts (one interleaved run each) ISD's own step and the lookup step read within
    # 3% of each other at C = 2 and 4 (1065 / 1082 and 1247 / 1277 tok/s): the own step's query
    # tokens are left to batch 1, where the run-time check also weighs it against the lookup
    own_max_batch: int = 1
    # greedy batches of up to this many requests run the long lookup step; wider, the narrow one.
    # Tune prompts: the long lookup led at C = 4 / 8 / 16 (1047 / 1419 / 1880 tok/s against 850 /
    # 1460 / 1700 for 4 tokens), the 4-token one at C = 32 (2146 against 1990). With the long
    # lookup's draft tree (median of 3 interleaved runs, bench/results/policy/tune-greedy-tree-wide.json):
    # tied at C = 24 (2.16 / 2.09x AR), the narrow lookup (a fixed 4 then) ahead at C = 32 (2.07 / 1.77x AR), where
    # the tree commits NGRAM's tokens per step (4.97 against 5.17; the narrow lookup 3.50) at
    # NGRAM's cost per step (bench/results/lookup-step-breakdown.json)
    lookup_max_batch: int = 18
    # the candidate of the own step at small greedy batches: at most this long, and at most
    # `context_length_factor` times its match. On the tune prompts at C=1 (ISD, one run):
    # 32 x 2 read 702 tok/s against 665 for 16 uncapped (NGRAM 630)
    context_tokens: int = 32
    context_length_factor: float = 2.0
    # the long lookup's longest draft, one chain: a second branch (the match's next-best
    # continuation) committed more per step on the tune prompts (TPF 3.92 / 4.77 against 3.78 /
    # 4.30 at C = 4 / 16) but read 0.89 / 0.86x the chain's tok/s for its wider forward
    # (bench/results/policy/tune-greedy-branches.json)
    lookup_tokens: int = 12
    lookup_length_factor: float = 1.0  # ... at most this many times as long as its match
    # > 0: the long lookup drafts a token tree of this many tokens, at most `lookup_tokens` deep,
    # over every place the suffix occurred (`ngram.SuffixIndex.tree`), instead of the chain cut
    # by its match and its recent acceptance: SGLang NGRAM's draft budget (12 query tokens with
    # the root). Served at C = 4 / 16 (one interleaved run per set), ISD's default against NGRAM:
    # eval 1.06 / 1.04x, HumanEval 0.95 / 1.01x, external 1.10 / 1.05x with the tree; 0.95 / 1.05,
    # 0.93 / 0.84, 0.98 / 0.83x with the chain, which committed 13-23% fewer tokens per step
    # (bench/results/policy/tree-vs-chain.json; tuned on the replay of the tune prompts,
    # `bench/context_lookup.py`)
    lookup_tree: int = 11
    # the narrow lookup's draft: at most `wide_tokens`, and (> 0) at most `wide_length_factor`
    # times as long as its match, so a loop followed back drafts long and a fresh match short.
    # Tune prompts, 3 interleaved runs at C = 24 / 32 (bench/results/policy/tune-greedy-tree-wide.json):
    # 12 tokens x 1 read the tok/s of a fixed 4 (2.17 / 2.00 against 2.21 / 1.99x AR) and
    # committed 17 / 27% more per step (TPF 4.05 / 4.45 against 3.45 / 3.50; NGRAM 4.36 / 5.17):
    # as fast here, and fewer forwards where a forward costs the same for more query tokens
    wide_tokens: int = 12
    wide_length_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in POLICY_NAMES:
            raise ValueError(f"policy name {self.name!r}: choose one of {', '.join(POLICY_NAMES)}")
        for f in fields(self):
            value = getattr(self, f.name)
            kind = float if f.type in (float, "float") else int
            if f.name != "name" and (not isinstance(value, (kind, int)) or isinstance(value, bool) or value < 0):
                raise ValueError(f"policy option {f.name}={value!r}: {'a number' if kind is float else 'an integer'} >= 0")
        if self.lookup_max_batch < self.own_max_batch:
            raise ValueError(f"policy option lookup_max_batch={self.lookup_max_batch} is below own_max_batch="
                             f"{self.own_max_batch}: the long lookup serves the batches after the own step's")
        for key in ("context_tokens", "lookup_tokens", "wide_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"policy option {key}={getattr(self, key)}: at least 1 draft token")

    @staticmethod
    def parse(value: Any) -> PolicyConfig:
        """A policy from its name or a mapping of its fields; ValueError naming the problem."""
        if isinstance(value, PolicyConfig):
            return value
        if value is None:
            return PolicyConfig()
        if isinstance(value, str):
            return PolicyConfig(name=value.strip().lower())
        if not isinstance(value, dict):
            raise ValueError(f"policy: a name ({', '.join(POLICY_NAMES)}) or a mapping of its options, got {value!r}")
        known = {f.name for f in fields(PolicyConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown policy option(s) {unknown}; known: {', '.join(sorted(known))}")
        return PolicyConfig(**value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _lookup(tokens: int, max_batch: int | None, length_factor: float = 0.0, adaptive: bool = False,
            tree: int = 0) -> dict[str, Any]:
    # drafts cut to their match (`ngram.SuffixIndex`) and to the request's recent acceptance
    # (`draft_length.RecentAcceptance`) leave out what a query token is unlikely to pay for; the
    # narrow lookup's 4 tokens need neither; a tree spends its budget on the likeliest branches
    opts: dict[str, Any] = {"max_batch": max_batch, "mode": "ngram", "num_draft": tokens,
                            "match_sizes": list(CONTEXT_MATCH_SIZES), "corpus": True}
    if tree:
        opts["tree"] = tree
        return opts
    if length_factor:
        opts["length_factor"] = length_factor
    if adaptive:
        opts["adaptive"] = True
    return opts


def policy_plan(mode: str, own_options: dict[str, Any], policy: PolicyConfig) -> dict[str, Any] | None:
    """The width plan (its dict form, `width_plan.WidthPlan.from_dict`) of `policy` for `mode`,
    whose own step at small batches runs `own_options` (the mode spec's `policy_options`) with
    the candidate; None for the `own` policy (the mode alone, no plan)."""
    if policy.name == "own":
        return None
    if policy.name == "ar":
        ar = [{"max_batch": None, "mode": "ar"}]
        return {"greedy": ar, "sampled": ar, "online": False}

    greedy = []
    if policy.own_max_batch:
        if policy.name == "lookup":
            greedy.append(_lookup(policy.context_tokens, policy.own_max_batch, policy.context_length_factor))
        else:
            greedy.append({"max_batch": policy.own_max_batch, "mode": mode, **own_options,
                           "context_tokens": policy.context_tokens,
                           "context_length_factor": policy.context_length_factor})
    if policy.lookup_max_batch > policy.own_max_batch:
        greedy.append(_lookup(policy.lookup_tokens, policy.lookup_max_batch, policy.lookup_length_factor, adaptive=True,
                              tree=policy.lookup_tree))
    greedy.append(_lookup(policy.wide_tokens, None, policy.wide_length_factor))
    return {"greedy": greedy, "sampled": [{"max_batch": None, "mode": "ar"}]}
