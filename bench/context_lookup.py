"""Context candidates without the model's cost: what a lookup drafter would commit, replayed on
greedy AR outputs, beside SGLang's own NGRAM drafter.

Greedy decoding is deterministic, so whether a context candidate is accepted depends on the text
alone: a step commits the candidate's longest prefix that matches the AR output, plus one token.
This replays the levels of `selfspec bench serve` (the same prompt windows per level, C requests
in flight, each advancing by what its step commits, every request's text joining the corpus as
it is written, the corpus kept from level to level as a server keeps it) for

- `ngram`: SGLang's NGRAM drafter itself (its C++ corpus with the server's defaults: 12 draft
  tokens counting the root, BFS breadth 1-10, trie depth 18; after each step it is given the
  last 18 tokens, as `ngram_worker` does), a tree of candidates;
- `selfspec+K`: selfspec's context candidate (`ngram.SuffixIndex` over the request's own text,
  then the `corpus.SharedCorpus` of every request served), one chain of K tokens: what a mode's
  `context_tokens=K` branch verifies beside the mode's own proposals; `selfspec+Kc` the same
  with weak matches cut short (`ngram.WEAK_MATCH_CAPS`, the modes' default `context_caps`),
  `selfspec+Kca` also each request's draft length following its recent acceptance
  (`draft_length.RecentAcceptance`, a lookup bucket's `adaptive`).

It reports tokens per step from the candidates alone (a mode's own proposals add to it), on all
outputs and on those that do not end in a loop, and the query tokens a step verifies (candidate
+ root; NGRAM always 12): where each query token costs, tokens per query token is what pays.
With `--costs TUNE.json` (what `selfspec tune --json` wrote) it also prices each level's steps
by that forward-cost table: C x tokens per step / forward ms at C requests of that many query
tokens (the forward alone, no server overhead: a comparison of drafters, not a prediction of a
server). It needs no accelerator and takes about a minute on 2 CPU cores (most of it generating
the AR outputs):

    python bench/context_lookup.py --model tiny-idlm --tokens 8,12,16 [--costs TUNE.json] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from selfspec.benchmarks.repetition import is_repetition_loop
from selfspec.benchmarks.serve import level_sizes
from selfspec.decoding.modes.corpus import OCCURRENCES, SharedCorpus
from selfspec.decoding.modes.tree_verify import build_tree
from selfspec.decoding.widths.draft_length import RecentAcceptance
from selfspec.decoding.modes.ngram import CONTEXT_MATCH_SIZES, WEAK_MATCH_CAPS, SuffixIndex
from selfspec.decoding.step import DecodeSequence

#: SGLang's NGRAM defaults (server_args / ngram_worker): draft tokens incl. the root, trie depth
NGRAM_DRAFT_TOKENS, NGRAM_DEPTH = 12, 18


@dataclass
class Request:
    index: int
    prompt: list[int]
    output: list[int]  # the AR greedy output
    committed: int = 1  # output tokens committed (the prefill gives the first)
    steps: int = 0
    query_tokens: int = 0  # what its steps verified: the candidate tokens and the root
    state: object = None

    def history(self) -> list[int]:
        return self.prompt + self.output[: self.committed]


class SelfspecDrafter:
    def __init__(self, tokens: int, capped: bool = False, adaptive: bool = False, length_factor: float = 0.0):
        self.tokens, self.corpus, self.capped, self.adaptive = tokens, SharedCorpus(), capped, adaptive
        self.length_factor = length_factor
        self.name = (f"selfspec+{tokens}" + ("c" if capped else "") + ("a" if adaptive else "")
                     + (f"x{length_factor:g}" if length_factor else ""))

    def start(self, req: Request) -> None:
        index = SuffixIndex(CONTEXT_MATCH_SIZES, self.corpus, DecodeSequence(list(req.prompt)),
                            WEAK_MATCH_CAPS if self.capped else None, length_factor=self.length_factor)
        req.state = (index, RecentAcceptance(self.tokens) if self.adaptive else None)

    def paths(self, req: Request) -> list[list[int]]:
        index, recent = req.state
        path = index.propose(req.history(), recent.limit() if recent is not None else self.tokens)
        req.query_tokens += len(path) + 1
        return [path]

    def record(self, req: Request, committed: int) -> None:
        if req.state[1] is not None:
            req.state[1].record(committed - 1)

    def stepped(self, reqs: list[Request]) -> None:
        pass  # SuffixIndex adds the text to the corpus when it next proposes


class TreeDrafter:
    """selfspec's draft tree (`SuffixIndex.tree`): every kept place the suffix occurred, in the
    request's own text and the corpus, merged and scored (`draft_tree.py`), `budget` draft
    tokens at most (NGRAM's 11 besides the root), nodes scored below `min_score` left out."""

    def __init__(self, budget: int, min_score: float = 0.0, depth: int = NGRAM_DRAFT_TOKENS, adaptive: bool = False):
        self.budget, self.min_score, self.depth, self.adaptive = budget, min_score, depth, adaptive
        self.corpus = SharedCorpus()
        self.name = f"tree{budget}" + (f"s{min_score:g}" if min_score else "") + ("a" if adaptive else "")

    def start(self, req: Request) -> None:
        index = SuffixIndex(CONTEXT_MATCH_SIZES, self.corpus, DecodeSequence(list(req.prompt)), occurrences=OCCURRENCES)
        req.state = (index, RecentAcceptance(self.depth) if self.adaptive else None)

    def paths(self, req: Request) -> list[list[int]]:
        index, recent = req.state
        nodes = index.tree(req.history(), recent.limit() if recent is not None else self.depth, self.budget,
                           min_score=self.min_score)
        req.query_tokens += len(nodes) + 1
        return [p.tokens for p in build_tree(0, nodes)[1].paths]

    def record(self, req: Request, committed: int) -> None:
        if req.state[1] is not None:
            req.state[1].record(committed - 1)

    def stepped(self, reqs: list[Request]) -> None:
        pass


class NgramDrafter:
    """SGLang's NGRAM corpus, driven as its worker drives it."""

    name = "ngram"

    def __init__(self):
        from sglang.kernels.ops.speculative.ngram_corpus import get_ngram_corpus_cls

        self.n = NGRAM_DRAFT_TOKENS
        self.corpus = get_ngram_corpus_cls()(
            capacity=10_000_000, max_trie_depth=NGRAM_DEPTH, min_bfs_breadth=1, max_bfs_breadth=10,
            draft_token_num=self.n, match_type="BFS", external_sam_budget=0, external_corpus_max_tokens=10_000_000)
        self.next_id = 0

    def start(self, req: Request) -> None:
        req.state, self.next_id = self.next_id, self.next_id + 1

    def paths(self, req: Request) -> list[list[int]]:
        req.query_tokens += self.n
        self.corpus.synchronize()
        hist = req.history()
        ids, mask = self.corpus.match_stateful([req.state], [hist[-NGRAM_DEPTH:]], [len(hist)])
        ids = np.asarray(ids).reshape(self.n)
        mask = np.asarray(mask).reshape(self.n, self.n)  # row i: node i's ancestors and itself
        leaves = [i for i in range(1, self.n) if not mask[i + 1 :, i].any() and not mask[1:i, i].any()]
        return [[int(ids[c]) for c in range(1, self.n) if mask[leaf][c]] for leaf in leaves]

    def record(self, req: Request, committed: int) -> None:
        pass

    def stepped(self, reqs: list[Request]) -> None:
        self.corpus.insert([r.history()[-NGRAM_DEPTH:] for r in reqs])


def committed_by(paths: list[list[int]], truth: list[int]) -> int:
    best = 0
    for path in paths:
        a = 0
        while a < len(path) and a < len(truth) and path[a] == truth[a]:
            a += 1
        best = max(best, a)
    return min(best + 1, len(truth))


@dataclass
class LevelResult:
    concurrency: int
    tokens_per_step: float
    non_loop_tokens_per_step: float
    query_tokens_per_step: float
    non_loop: int
    requests: int


def replay(drafter, data: list[tuple[list[int], list[int]]], levels: list[int], sizes: list[int]) -> list[LevelResult]:
    results, start = [], 0
    for c, size in zip(levels, sizes):
        queue = [(start + i) % len(data) for i in range(size)]
        start += size
        active: list[Request] = []
        done: list[Request] = []
        while queue or active:
            while queue and len(active) < c:
                i = queue.pop(0)
                req = Request(i, *data[i])
                drafter.start(req)
                active.append(req)
            for req in active:
                n = committed_by(drafter.paths(req), req.output[req.committed :])
                drafter.record(req, n)
                req.committed += n
                req.steps += 1
            drafter.stepped(active)
            done += [r for r in active if r.committed >= len(r.output)]
            active = [r for r in active if r.committed < len(r.output)]
        nl = [r for r in done if not is_repetition_loop(r.output)]
        rate = lambda rs: sum(len(r.output) - 1 for r in rs) / max(1, sum(r.steps for r in rs))
        query = sum(r.query_tokens for r in done) / max(1, sum(r.steps for r in done))
        results.append(LevelResult(c, round(rate(done), 3), round(rate(nl), 3), round(query, 2), len(nl), len(done)))
    return results


def replay_set(name: str, data: list, levels: list[int], sizes: list[int], lengths: list[int], costs,
               costs_path: str | None, tree_scores: list[float] = (0.0,),
               tree_budgets: list[int] = (NGRAM_DRAFT_TOKENS - 1,), length_factors: list[float] = ()) -> dict:
    """Every drafter replayed on one prompt set's AR outputs; prints its table, returns {drafter: rows}."""
    out: dict = {}
    print(f"\n{name}\n{'drafter':>14} " + " ".join(f"{'C=' + str(c):>20}" for c in levels)
          + "   (tokens/step: all / non-looping [query tokens/step])")
    drafters = [NgramDrafter()] + [SelfspecDrafter(k, capped, adaptive) for k in lengths
                                   for capped, adaptive in ((False, False), (True, False), (True, True))]
    drafters += [SelfspecDrafter(k, length_factor=f) for k in lengths for f in length_factors]
    drafters += [TreeDrafter(budget, score, adaptive=adaptive)
                 for budget in tree_budgets for score in tree_scores for adaptive in (False, True)]
    priced: list[str] = []
    for drafter in drafters:
        res = replay(drafter, data, levels, sizes)
        out[drafter.name] = [r.__dict__ for r in res]
        print(f"{drafter.name:>14} " + " ".join(f"{r.tokens_per_step:>6.2f} /{r.non_loop_tokens_per_step:>5.2f} "
                                               f"[{r.query_tokens_per_step:>4.1f}]" for r in res))
        if costs is not None:  # NGRAM's tree is priced as its 12 query tokens, like a chain
            rates = [1e3 * r.concurrency * r.tokens_per_step / costs.time_ms(r.concurrency, r.query_tokens_per_step)
                     for r in res]
            out[drafter.name + " forward tok/s"] = [round(x) for x in rates]
            priced.append(f"{drafter.name:>14} " + " ".join(f"{x:>20.0f}" for x in rates))
    if priced:
        print(f"\nforward-only tok/s by {costs_path}'s cost table (C x tokens/step / forward ms):")
        print("\n".join(priced))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-idlm", help="an embedded model name or a model dir (default %(default)s)")
    p.add_argument("--prompts", default="tune", help="prompt sets, comma-separated (tune, eval, humaneval) or JSON "
                                                      "lines files {\"prompt\": ...} (default %(default)s)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per level, as bench serve (default 32)")
    p.add_argument("--concurrency", default="1,4,16,32", help="levels, as bench serve (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="AR output tokens per request (default 128)")
    p.add_argument("--tokens", default="8,12,16", help="selfspec candidate lengths K to replay (default %(default)s)")
    p.add_argument("--length-factors", default="", help="also replay each length's chain cut to this many "
                   "times its match's length (`SuffixIndex` length_factor), comma-separated (default none)")
    p.add_argument("--tree-budgets", default=str(NGRAM_DRAFT_TOKENS - 1),
                   help="draft trees to replay, by their draft tokens (default %(default)s: NGRAM's budget)")
    p.add_argument("--tree-scores", default="0", help="draft trees to replay, by their nodes' least score "
                                                          "(`draft_tree.draft_tree` min_score; default %(default)s)")
    p.add_argument("--costs", help="a `selfspec tune --json` report: price each level's steps by its forward-cost table")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
        lengths = [int(x) for x in args.tokens.split(",")]
        tree_scores = [float(x) for x in args.tree_scores.split(",")] if args.tree_scores else []
    except ValueError:
        p.error("--concurrency and --tokens take comma-separated integers, e.g. 1,4,16")
    from selfspec.prompts import SET_NAMES

    sets = args.prompts.split(",")
    for name in sets:
        if name not in SET_NAMES and not Path(name).is_file():
            p.error(f"--prompts {name}: no such file (or a set: {', '.join(SET_NAMES)})")
    costs = None
    if args.costs:
        from selfspec.tuning.cost import CostTable

        try:
            costs = CostTable(**json.loads(Path(args.costs).read_text())["costs"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--costs {args.costs}: not a `selfspec tune --json` report ({e})")
    if min(levels + lengths + [args.num_prompts, args.max_tokens]) < 1:
        p.error("--concurrency, --tokens, --num-prompts and --max-tokens must be >= 1")

    import torch

    from selfspec.prompts import load_prompts
    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine

    sizes = level_sizes(levels, args.num_prompts)
    engine = HFEngine.from_pretrained(args.model, dtype=torch.float32)
    report = {"model": args.model, "max_tokens": args.max_tokens, "levels": levels, "level_sizes": sizes, "sets": {}}
    for name in sets:
        _, prompts = load_prompts(name, engine.tokenizer, sum(sizes))
        print(f"[context_lookup] {name}: greedy AR outputs of {len(prompts)} prompts x {args.max_tokens} tokens",
              file=sys.stderr)
        outs = engine.generate(prompts, args.max_tokens, SamplingParams(), stop_token_ids=[], batch_size=32)
        data = [(list(p), list(o.token_ids)) for p, o in zip(prompts, outs)]
        report["sets"][name] = replay_set(name, data, levels, sizes, lengths, costs, args.costs, tree_scores,
                                          [int(x) for x in args.tree_budgets.split(",")],
                                          [float(x) for x in args.length_factors.split(",") if x])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
