"""Verifying several draft paths of one sequence in one forward: the rule for step layouts that
carry more than one branch (a mode's own proposals beside a context n-gram candidate).

A `DraftPath` is a chain of draft tokens and, for each, the logits row that judges it (the
row of the query token right before it); paths that agree on a prefix share its rows. The walk
starts at the pending token's row and goes down the tree of paths:

- greedy: the child equal to the row's argmax is accepted; the first row whose argmax is no
  child (or a path's end) gives the next token. Exactly greedy AR.
- sampled, all drafts deterministic (one-hot q): at each node the children are tried in order,
  child c accepted with probability r(c) / sum(r), where r starts as the row's AR distribution p
  and loses each rejected child; when every child is rejected (or there is none: the bonus
  token) the next token is drawn from r. Each token is then distributed exactly as p (the
  multi-draft form of the p/q rule with one-hot q: P(c_1) = p(c_1), P(c_2) = (1 - p(c_1)) ·
  p(c_2) / (1 - p(c_1)), the rest proportional to p). With tau > 0 the accept test is relaxed
  to (1 + tau) · r(c) / sum(r), as in `verify.speculative_verify_reference`, and is not lossless.

Randomness: child j of depth d uses uniform(seed[d], -j), the draw at depth d uses
gumbel(seed[d], v + 1): offsets disjoint from the Gumbel ones (a shared offset would tie a
child's rejection to one vocabulary entry's noise and bias the draw), and a single path
decides exactly as `verify.speculative_verify_reference` with one-hot q does (offset 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.decoding import rng
from selfspec.decoding.sampling import logits_to_probs


@dataclass
class DraftPath:
    tokens: list[int]  # the drafts, in order
    rows: list[int]  # rows[i]: the logits row that judges tokens[i]
    end_row: int  # the row that gives the token after the last draft (the bonus)


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
) -> PathResult:
    """logits [W, V] of one sequence's step; seeds [>= deepest path + 1] long."""
    alive = list(range(len(paths)))
    depth = 0
    greedy = temperature <= 0
    while True:
        children: dict[int, list[int]] = {}
        rows = set()
        for p in alive:
            path = paths[p]
            if depth < len(path.tokens):
                children.setdefault(path.tokens[depth], []).append(p)
                rows.add(path.rows[depth])
            else:
                rows.add(path.end_row)
        if len(rows) != 1:
            raise ValueError(f"paths that agree up to depth {depth} are judged by different rows {sorted(rows)}")
        row = logits[rows.pop()]
        if greedy:
            token = int(row.argmax())
            if token in children:
                alive, depth = children[token], depth + 1
                continue
            return PathResult(_finished(paths, alive, depth), depth, token)
        residual = logits_to_probs(row, temperature, top_k, top_p)
        seed = seeds[depth]
        accepted = None
        for j, (token, holders) in enumerate(children.items()):
            mass = residual.sum() if j else 1.0  # the first child is judged by p itself, as in verify.py
            u = rng.uniform(seed, torch.tensor(-j, device=seed.device))
            if mass > 0 and u * mass < (1.0 + tau) * residual[token]:
                accepted = holders
                break
            residual = residual.clone()
            residual[token] = 0.0
        if accepted is not None:
            alive, depth = accepted, depth + 1
            continue
        if not residual.sum() > 0:  # only through rounding: p's mass sat on rejected children
            residual = logits_to_probs(row, temperature, top_k, top_p)
        noise = rng.gumbel(seed, torch.arange(1, residual.shape[-1] + 1, device=residual.device))
        token = int((residual.log() + noise).argmax())
        return PathResult(_finished(paths, alive, depth), depth, token)


def _finished(paths: list[DraftPath], alive: list[int], depth: int) -> int:
    """The path the walk stopped on: one that was accepted to its end if any (its tail is valid)."""
    return next((p for p in alive if len(paths[p].tokens) == depth), alive[0])
