"""Verifying several draft paths of one sequence in one forward: the rule for step layouts that
carry more than one branch (a mode's own proposals beside a context n-gram candidate).

A `DraftPath` is a chain of draft tokens and, for each, the logits row that judges it (the
row of the query token right before it); paths that agree on a prefix share its rows. The walk
starts at the pending token's row and goes down the tree of paths:

- greedy: the child equal to the row's argmax is accepted; the first row whose argmax is no
  child (or a path's end) gives the next token. Exactly greedy AR.
- sampled: recursive rejection sampling over the node's children, tried in order. r starts as
  the row's AR distribution p; child c, drawn from q (a dense proposal distribution, or one-hot
  for a deterministic draft such as a context candidate or an argmax proposal), is accepted with
  probability min(1, r(c) / q(c)) (r normalised); on rejection r becomes max(0, r - q); when
  every child is rejected (or there is none: the bonus token) the next token is drawn from r.
  Each emitted token is then distributed exactly as p (for one-hot drafts: P(c_1) = p(c_1),
  P(c_2) = (1 - p(c_1)) · p(c_2) / (1 - p(c_1)), the rest proportional to p). Children with a
  dense q are tried one path at a time (their draws are independent); one-hot children are
  grouped by token. With tau > 0 the accept test is relaxed to (1 + tau) · r(c) / q(c), as in
  `verify.speculative_verify_reference`, and is not lossless.

Randomness: child j of depth d uses uniform(seed[d], -j), the draw at depth d uses
gumbel(seed[d], v + 1): offsets disjoint from the Gumbel ones (a shared offset would tie a
child's rejection to one vocabulary entry's noise and bias the draw), and a single path
decides exactly as `verify.speculative_verify_reference` with one-hot q does (offset 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.decoding.requests import rng
from selfspec.decoding.argmax import first_argmax
from selfspec.decoding.requests.sampling import SamplingFilters, logits_to_probs
from selfspec.decoding.step import StepContext, StepLayout, StepOutcome


@dataclass
class DraftPath:
    tokens: list[int]  # the drafts, in order
    rows: list[int]  # rows[i]: the logits row that judges tokens[i]
    end_row: int  # the row that gives the token after the last draft (the bonus)
    probs: torch.Tensor | None = None  # [len(tokens), V] the distributions the drafts were drawn from; None: one-hot


@dataclass
class TreePlan:
    """A step's draft paths and, per path, the rows of its fill tail (None: no tail)."""

    paths: list[DraftPath]
    tail_rows: list[list[int] | None]


def build_branches(pending: int, branches: list[tuple[list[int], int]], fill_token: int,
                   width: int | None = None) -> tuple[StepLayout, TreePlan]:
    """One layout holding several draft chains over the pending token: branch b is its drafts
    then `tail` fill tokens (ISD's MASK proposals; 0 for none). The prefix all drafts share is
    laid once as the trunk; each branch sees the trunk and itself. Gate on at the fill tails
    (RISD applies its LoRA there); padded with fill tokens, gate off, to `width` if given."""
    shared = 0
    while all(shared < len(d) for d, _ in branches) and len({d[shared] for d, _ in branches}) == 1:
        shared += 1
    head = branches[0][0][:shared]
    tokens, offsets = [pending, *head], list(range(shared + 1))
    branch, gate = [0] * (shared + 1), [False] * (shared + 1)
    paths, tails = [], []
    for bid, (drafts, tail) in enumerate(branches, start=1):
        rows = list(range(shared + 1))  # rows[i] judges draft i; the last one gives the bonus
        for depth in range(shared, len(drafts)):
            rows.append(len(tokens))
            tokens.append(drafts[depth]), offsets.append(depth + 1), branch.append(bid), gate.append(False)
        tail_rows = list(range(len(tokens), len(tokens) + tail)) if tail else None
        tokens += [fill_token] * tail
        offsets += range(len(drafts) + 1, len(drafts) + 1 + tail)
        branch += [bid] * tail
        gate += [True] * tail
        paths.append(DraftPath(list(drafts), rows[: len(drafts)], rows[len(drafts)]))
        tails.append(tail_rows)
    if width is not None and len(tokens) < width:
        extra = width - len(tokens)
        tokens += [fill_token] * extra
        offsets += range(max(offsets) + 1, max(offsets) + 1 + extra)
        branch += [len(branches) + 1] * extra
        gate += [False] * extra
    return StepLayout(tokens, offsets, branch, gate), TreePlan(paths, tails)


def build_tree(pending: int, nodes: list[tuple[int, int]]) -> tuple[StepLayout, TreePlan]:
    """One layout holding a token tree over the pending token, each node laid once: `nodes[i]`
    = (token, parent), parent the index of an earlier node or -1 for the pending token; node i
    is step index i + 1 and sees its ancestors only (`StepLayout.parent`). The plan's paths run
    from the pending token to each leaf; paths sharing a prefix share its rows."""
    parent = [-1] + [p + 1 for _, p in nodes]
    depth = [0] * len(parent)
    children = [0] * len(parent)
    for i in range(1, len(parent)):
        if not -1 <= parent[i] - 1 < i - 1:
            raise ValueError(f"tree node {i - 1}'s parent {parent[i] - 1} does not come before it")
        depth[i] = depth[parent[i]] + 1
        children[parent[i]] += 1
    paths = []
    for leaf in (i for i in range(1, len(parent)) if not children[i]):
        chain = []
        while leaf:
            chain.append(leaf)
            leaf = parent[leaf]
        chain.reverse()
        paths.append(DraftPath([nodes[i - 1][0] for i in chain], [parent[i] for i in chain], chain[-1]))
    tokens = [pending] + [t for t, _ in nodes]
    return StepLayout(tokens, depth, parent=parent), TreePlan(paths or [DraftPath([], [], 0)], [None] * max(1, len(paths)))


def finish_split(seqs, logits: torch.Tensor, ctx: StepContext, finish_chains, finish_tree) -> list[StepOutcome]:
    """A mode's step outcomes when some rows carry a tree (`seq.state.plan` set): the chain rows
    verified as one batch, `finish_chains(seqs, logits, ctx)`, the tree rows one at a time,
    `finish_tree(seq, logits [W, V], ctx of that row)`; outcomes in the batch's order."""
    chain = [b for b, s in enumerate(seqs) if s.state.plan is None]
    if len(chain) == len(seqs):  # no copy: logits[idx] of a [16, 13, 8192] step was 2.5 ms on a CPU
        return finish_chains(seqs, logits, ctx)
    outcomes: list[StepOutcome | None] = [None] * len(seqs)
    if chain:
        idx = torch.tensor(chain, dtype=torch.long, device=logits.device)
        for b, out in zip(chain, finish_chains([seqs[b] for b in chain], logits[idx], ctx.select(idx))):
            outcomes[b] = out
    for b, s in enumerate(seqs):
        if s.state.plan is not None:
            outcomes[b] = finish_tree(s, logits[b], ctx.select(b))
    return outcomes


@dataclass
class PathResult:
    path: int  # index of the path holding the accepted drafts (a fully accepted one if any)
    accepted: int  # drafts accepted along it
    next_token: int  # the corrected token, or the bonus


def verify_paths(
    logits: torch.Tensor,
    paths: list[DraftPath],
    seeds: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    tau: float = 0.0,
    min_p: float = 0.0,
) -> PathResult:
    """logits [W, V] of one sequence's step; seeds [>= deepest path + 1] long."""
    filters = SamplingFilters(temperature, top_k, top_p, min_p)
    alive = list(range(len(paths)))
    depth = 0
    greedy = temperature <= 0
    # greedy: the argmax of the rows the walk visits only (a wide tree's other rows are most of
    # the step's [W, V] logits: an argmax over all of them was most of a served step's finish)
    argmax: dict[int, int] = {}
    while True:
        children: dict[tuple[int, int], torch.Tensor | None] = {}  # (token, dense path or -1) -> q row
        rows = set()
        for p in alive:
            path = paths[p]
            if depth < len(path.tokens):
                dense = path.probs is not None
                children.setdefault((path.tokens[depth], p if dense else -1), path.probs[depth] if dense else None)
                rows.add(path.rows[depth])
            else:
                rows.add(path.end_row)
        if len(rows) != 1:
            raise ValueError(f"paths that agree up to depth {depth} are judged by different rows {sorted(rows)}")
        row_index = rows.pop()
        if greedy:
            if row_index not in argmax:
                argmax[row_index] = int(first_argmax(logits[row_index]))
            token = argmax[row_index]
            if any(t == token for t, _ in children):
                alive, depth = _holding(paths, alive, depth, token), depth + 1
                continue
            return PathResult(_finished(paths, alive, depth), depth, token)
        row = logits[row_index]
        residual = logits_to_probs(row, *filters)
        seed = seeds[depth]
        accepted = None
        for j, ((token, _), q) in enumerate(children.items()):
            mass = residual.sum() if j else 1.0  # the first child is judged by p itself, as in verify.py
            q_token = 1.0 if q is None else q[token].float()
            u = rng.uniform(seed, torch.tensor(-j, device=seed.device))
            if mass > 0 and u * q_token * mass < (1.0 + tau) * residual[token]:
                accepted = token
                break
            if q is None:
                residual = residual.clone()
                residual[token] = 0.0
            else:
                residual = (residual / mass - q.float()).clamp_min(0.0)
        if accepted is not None:
            alive, depth = _holding(paths, alive, depth, accepted), depth + 1
            continue
        if not residual.sum() > 0:  # only through rounding: p's mass sat on rejected children
            residual = logits_to_probs(row, *filters)
        token = int(rng.race_argmax(residual, seed.view(1)))
        return PathResult(_finished(paths, alive, depth), depth, token)


def _holding(paths: list[DraftPath], alive: list[int], depth: int, token: int) -> list[int]:
    """The alive paths whose draft at `depth` is `token` (they share the row below it)."""
    return [p for p in alive if depth < len(paths[p].tokens) and paths[p].tokens[depth] == token]


def _finished(paths: list[DraftPath], alive: list[int], depth: int) -> int:
    """The path the walk stopped on: one that was accepted to its end if any (its tail is valid)."""
    return next((p for p in alive if len(paths[p].tokens) == depth), alive[0])


def path_outcome(plan: TreePlan, res: PathResult) -> StepOutcome:
    """What a verified tree step commits: the winning path's accepted drafts and the next token,
    and the step indices whose KV is kept (the pending token's, then each accepted draft's)."""
    path = plan.paths[res.path]
    positions = path.rows[1:] + [path.end_row]  # step index of draft i is positions[i]
    return StepOutcome(path.tokens[: res.accepted] + [res.next_token], [0] + positions[: res.accepted], res.accepted)
