"""Context n-gram candidates verified beside a mode's own proposals (ISD, RISD, SJD, JACOBI):
greedy output equals greedy AR with the candidate branch both winning and losing, sampled ISD
keeps AR's distribution with candidates in the tree, the multi-path rule reduces to the
single-draft rule, and a repeated span is decoded in fewer forwards."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import selfspec.decoding.modes.isd as isd
import selfspec.decoding.modes.ngram as ngram
import selfspec.decoding.modes.sjd as sjd
from selfspec.decoding.requests import rng
from selfspec.decoding.modes.isd import build_tree_layout
from selfspec.decoding.modes.corpus import SharedCorpus
from selfspec.decoding.modes.ngram import SuffixIndex
from selfspec.decoding.requests.sampling import SamplingParams
from selfspec.decoding.step import DecodeSequence, branch_visibility
from selfspec.decoding.modes.tree_verify import DraftPath, PathResult, verify_paths
from selfspec.decoding.modes.verify import speculative_verify_reference
from selfspec.engines.hf import HFEngine
from model_helpers import (
    add_mask_token, chi_square_pvalue, compare_greedy, exact_distribution, random_prompts, save_random_adapter,
    tiny_qwen3,
)

VOCAB = 128
MAX_NEW = 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_qwen3(VOCAB, seed=11).eval()
    mask_id = add_mask_token(model)
    prompts = random_prompts(48, VOCAB, 1, 16, seed=5)
    reference = HFEngine(model).generate(prompts, MAX_NEW, stop_token_ids=[], batch_size=16)
    adapter = save_random_adapter(model, tmp_path_factory.mktemp("adapter"), rank=4)
    return model, mask_id, prompts, reference, str(adapter)


@pytest.fixture
def tree_outcomes(monkeypatch):
    """Which path won each tree step (0: the proposals, 1: the context candidate; lookup steps
    with two candidates: 0 the first, 1 the second)."""
    seen: Counter = Counter()
    original = isd.verify_paths

    def spy(*args, **kwargs):
        res = original(*args, **kwargs)
        seen[res.path] += 1
        return res

    monkeypatch.setattr(isd, "verify_paths", spy)
    monkeypatch.setattr(sjd, "verify_paths", spy)
    monkeypatch.setattr(ngram, "verify_paths", spy)
    return seen


@pytest.mark.parametrize("mode, config", [
    ("isd", {"stride": 3, "context_tokens": 4}),
    ("isd", {"stride": 4, "context_tokens": 6, "context_tail": False, "fixed_width": False}),
    ("risd", {"stride": 3, "context_tokens": 5, "context_match_sizes": (2,)}),
    ("isd", {"stride": 1, "context_tokens": 4}),  # lookup steps: the candidate alone
    ("risd", {"stride": 1, "context_tokens": 6, "fixed_width": False}),
    ("sjd", {"window": 2, "context_tokens": 4}),
    ("sjd", {"window": 5, "history_offset": 2, "context_tokens": 3, "context_match_sizes": (2, 1)}),
    # lookup steps with a second candidate from another place the suffix occurred
    ("ngram", {"num_draft": 4, "match_sizes": (3, 2, 1), "branches": 2}),
    # lookup steps whose draft length follows each request's recent acceptance
    ("ngram", {"num_draft": 6, "match_sizes": (3, 2, 1), "caps": True, "adaptive": True}),
    # lookup steps drafting a token tree over every place the suffix occurred
    ("ngram", {"num_draft": 6, "match_sizes": (2, 1), "tree": 8}),
    ("ngram", {"num_draft": 4, "match_sizes": (3, 2, 1), "tree": 11, "adaptive": True, "tree_min_score": 0.05}),
])
def test_candidates_are_greedy_ar(setup, tree_outcomes, mode, config):
    model, mask_id, prompts, reference, adapter = setup
    engine = HFEngine(model, mask_token_id=mask_id, adapter=adapter if mode == "risd" else None)
    committed: Counter = Counter()  # tokens committed per decode forward
    for bs in (1, 8):
        outs = engine.generate(prompts, MAX_NEW, stop_token_ids=[], mode=mode, mode_config=config, batch_size=bs)
        cmp = compare_greedy(model, prompts, [o.token_ids for o in outs], [o.token_ids for o in reference])
        assert not cmp.failures and cmp.excused == 0, "\n".join(cmp.failures)
        for o in outs:
            committed.update(o.metrics.accept_hist)
    # the candidate branch both won and lost steps: the comparison above covered both outcomes
    if _chains_only(mode, config):  # lookup steps verify the candidate as a chain, no tree
        assert not tree_outcomes and committed[1] > 0 and max(committed) > 1, (tree_outcomes, committed)
    else:
        assert tree_outcomes[0] > 0 and tree_outcomes[1] > 0, tree_outcomes


def _chains_only(mode: str, config: dict) -> bool:
    """Lookup steps of one candidate: verified as chains, never as a tree."""
    return config.get("stride") == 1 or (mode == "ngram" and config.get("branches", 1) == 1 and not config.get("tree"))


def test_jacobi_with_context_candidate_is_greedy_ar(setup):
    model, _, prompts, reference, _ = setup
    engine = HFEngine(model)
    plain = engine.generate(prompts, MAX_NEW, stop_token_ids=[], mode="jacobi", batch_size=8)
    outs = engine.generate(prompts, MAX_NEW, stop_token_ids=[], mode="jacobi", mode_config={"context_tokens": 7},
                           batch_size=8)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    forwards = lambda xs: sum(o.metrics.forwards for o in xs)  # noqa: E731
    assert forwards(outs) < forwards(plain)  # the candidate won steps the pool could not


@pytest.mark.parametrize("max_blocks", [1, 2])
def test_jacobi_candidate_runs_past_the_block(max_blocks):
    """A context candidate longer than the real-active block: a win commits more tokens than the
    block holds (the blocks then restart), still exactly greedy AR."""
    engine = HFEngine.from_pretrained("tiny-idlm")
    text = "def area(w, h):\n    return w * h\n\n\ndef area(w, h):\n    return w * h\n\n\ndef area("
    ids = [engine.encode(text), engine.encode("for i in range(10):\n    print(i)\nfor i in range(10):\n")]
    ar = engine.generate(ids, 48, stop_token_ids=[], batch_size=2)
    config = {"block_size": 3, "max_blocks": max_blocks, "context_tokens": 12}
    outs = engine.generate(ids, 48, stop_token_ids=[], mode="jacobi", mode_config=config, batch_size=2)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar]
    longest = max(k for o in outs for k in o.metrics.accept_hist)
    assert longest > config["block_size"] + 1, [dict(o.metrics.accept_hist) for o in outs]


def test_tree_layout_shares_the_common_prefix():
    lay, plan = build_tree_layout(9, [1, 2, 3], [1, 2, 7, 8], stride=4, mask_token_id=0, tail=True)
    # trunk: pending, 1, 2; branch 1: 3 + 3 MASK; branch 2: 7, 8 + 3 MASK
    assert lay.tokens == [9, 1, 2, 3, 0, 0, 0, 7, 8, 0, 0, 0]
    assert lay.offsets == [0, 1, 2, 3, 4, 5, 6, 3, 4, 5, 6, 7]
    a, b = plan.paths
    assert (a.tokens, a.rows, a.end_row) == ([1, 2, 3], [0, 1, 2], 3)
    assert (b.tokens, b.rows, b.end_row) == ([1, 2, 7, 8], [0, 1, 2, 7], 8)
    assert plan.tail_rows == [[4, 5, 6], [9, 10, 11]]
    seen = branch_visibility(torch.tensor(lay.branch))
    assert not seen[7, 3] and seen[7, 2] and seen[11, 8] and not seen[11, 6]  # branches see the trunk, not each other
    assert lay.gate == [t == 0 and i > 0 for i, t in enumerate(lay.tokens)]


def test_single_path_rule_is_the_verify_rule():
    """One path through `verify_paths` decides exactly as speculative_verify_reference (one-hot q)."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        logits = torch.randn(4, 11, generator=gen) * 2
        drafts = torch.randint(0, 11, (3,), generator=gen)
        drafts[0] = logits[0].argmax() if trial % 2 else drafts[0]
        seeds = rng.draw_seeds((4,), gen)
        ref = speculative_verify_reference(logits[None], drafts[None], torch.tensor([3]), seeds[None], 0.9, 0, 1.0)
        got = verify_paths(logits, [DraftPath(drafts.tolist(), [0, 1, 2], 3)], seeds, 0.9)
        assert (got.accepted, got.next_token) == (int(ref.accept_len), int(ref.next_tokens))


def test_two_paths_keep_the_distribution_of_each_position():
    """Two one-hot candidates at the same node: the emitted token is distributed as p."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=gen)
    p = torch.softmax(logits[0], -1)
    paths = [DraftPath([int(p.argmax())], [0], 1), DraftPath([int(p.argsort()[-2])], [0], 2)]
    counts = Counter()
    for i in range(20_000):
        res = verify_paths(logits, paths, torch.tensor([i, i + 7]), 1.0)
        counts[paths[res.path].tokens[0] if res.accepted else res.next_token] += 1
    stat, pvalue, dof = chi_square_pvalue(Counter({(t,): c for t, c in counts.items()}),
                                          {(t,): float(p[t]) for t in range(6)})
    assert pvalue > 0.01, (stat, dof, counts)


@pytest.mark.parametrize("mode, config", [
    ("isd", {"stride": 3, "context_tokens": 3, "context_match_sizes": (1,)}),
    ("isd", {"stride": 1, "context_tokens": 3, "context_match_sizes": (1,)}),
    ("sjd", {"window": 2, "context_tokens": 3, "context_match_sizes": (1,)}),
    ("ngram", {"num_draft": 3, "match_sizes": (1,), "branches": 2}),
    ("ngram", {"num_draft": 3, "match_sizes": (1,), "adaptive": True}),
    ("ngram", {"num_draft": 3, "match_sizes": (1,), "tree": 5}),
])
def test_sampled_candidates_keep_ar_sampling(tree_outcomes, mode, config):
    model = tiny_qwen3(8, hidden_size=32, seed=4, initializer_range=0.3).eval()
    mask_id = add_mask_token(model)
    engine = HFEngine(model, mask_token_id=mask_id)
    prompt, steps, sampling = [1, 2, 3, 1], 3, SamplingParams(1.0)
    exact = exact_distribution(model, prompt, steps, sampling)
    outs = engine.generate([prompt] * 20_000, steps + 1, sampling, seed=list(range(20_000)), stop_token_ids=[],
                           mode=mode, mode_config=config, batch_size=5000)
    counts = Counter(tuple(o.token_ids[:steps]) for o in outs)
    stat, pvalue, dof = chi_square_pvalue(counts, exact)
    assert pvalue > 0.01, (stat, dof)
    if _chains_only(mode, config):  # lookup steps: candidates rejected at once and accepted in part
        committed = sum((o.metrics.accept_hist for o in outs), Counter())
        assert committed[1] > 100 and sum(c for k, c in committed.items() if k > 1) > 100, committed
    else:
        assert tree_outcomes[0] > 100 and tree_outcomes[1] > 100, tree_outcomes


def test_sampling_test_would_see_a_biased_rule(monkeypatch):
    """The statistical check above has teeth: always accepting a candidate is caught."""
    model = tiny_qwen3(8, hidden_size=32, seed=4, initializer_range=0.3).eval()
    mask_id = add_mask_token(model)
    engine = HFEngine(model, mask_token_id=mask_id)
    prompt, steps, sampling = [1, 2, 3, 1], 3, SamplingParams(1.0)
    original = isd.verify_paths

    def greedy_on_candidates(logits, paths, seeds, *args, **kwargs):
        res = original(logits, paths, seeds, *args, **kwargs)
        return PathResult(1, 1, res.next_token) if len(paths[1].tokens) > 1 else res

    monkeypatch.setattr(isd, "verify_paths", greedy_on_candidates)
    exact = exact_distribution(model, prompt, steps, sampling)
    outs = engine.generate([prompt] * 5000, steps + 1, sampling, seed=list(range(5000)), stop_token_ids=[],
                           mode="isd", mode_config={"stride": 3, "context_tokens": 3, "context_match_sizes": (1,)},
                           batch_size=5000)
    _, pvalue, _ = chi_square_pvalue(Counter(tuple(o.token_ids[:steps]) for o in outs), exact)
    assert pvalue < 0.01


@pytest.mark.parametrize("mode", ["isd", "sjd"])
def test_repeated_span_takes_fewer_forwards(mode):
    engine = HFEngine.from_pretrained("tiny-idlm")
    ids = engine.encode("import os\nimport sys\nimport re\nimport os\nimport sys\nimport re\nimport os\n")
    (plain,) = engine.generate([ids], 64, stop_token_ids=[], mode=mode, mode_config={"context_tokens": 0})
    (ctx,) = engine.generate([ids], 64, stop_token_ids=[], mode=mode, mode_config={"context_tokens": 8})
    assert ctx.token_ids == plain.token_ids
    assert ctx.metrics.tokens_per_forward >= plain.metrics.tokens_per_forward + 0.5, (
        ctx.metrics.tokens_per_forward, plain.metrics.tokens_per_forward)


# ------------------------------------------------------------------ the corpus across requests
def test_corpus_continues_what_most_occurrences_agree_on_and_forgets_the_oldest():
    from selfspec.decoding.modes.corpus import OCCURRENCES

    corpus = SharedCorpus(capacity=24)
    a, b, c = corpus.open(), corpus.open(), corpus.open()
    corpus.append(a, [1, 2, 3, 4, 5, 6])
    corpus.append(b, [9, 2, 3, 7])
    assert corpus.continuation((2, 3), 3) == [7]  # one occurrence each: the latest (b's, still being written)
    corpus.append(c, [2, 3, 4, 5, 8])
    d = corpus.open()
    corpus.append(d, [2, 3, 9, 9, 9])
    assert corpus.continuation((2, 3), 3) == [4, 5, 8]  # two of four go on with 4, 5 (d's is the latest)
    assert corpus.continuation((2, 3), 3, exclude=c) == [9, 9, 9]  # a, b, d: a tie, the latest
    assert corpus.continuations((2, 3), 2) == [[9, 9], [4, 5], [7], [4, 5]]  # every kept place, latest first
    assert corpus.continuation((1, 2, 3), 2) == [4, 5]  # a length first asked for: indexed on demand
    corpus.append(b, [8] * 6)  # 26 tokens > 24: a is dropped, with its entries
    assert corpus.tokens == 20 and corpus.length(a) == 0
    assert corpus.continuation((1, 2, 3), 2) == [] and corpus.continuation((5, 6), 1) == []
    assert corpus.continuation((2, 3), 3) == [9, 9, 9] and corpus.continuation((2, 3), 3, exclude=d) == [4, 5, 8]
    loop = SharedCorpus()
    loop.append(loop.open(), [2, 3, 0] * 10 + [2, 3, 1])
    assert loop.continuation((2, 3), 1) == [0]  # seven 0s against the latest, a 1
    assert len(loop.places[2][hash((2, 3))]) == OCCURRENCES  # the latest ones only


def test_the_longest_match_picks_the_continuation_and_a_hash_collision_drafts_nothing(monkeypatch):
    """With the default match sizes a longer suffix match wins over the latest short one: in a
    corpus of many requests a 2-gram recurs everywhere and its latest occurrence is often the
    wrong text. The corpus indexes hashes of m-grams; an entry whose text differs (a collision)
    gives no candidate: two m-grams under one hash each find their own continuation."""
    import selfspec.decoding.modes.corpus as corpus_mod
    from selfspec.decoding.modes.ngram import CONTEXT_MATCH_SIZES

    corpus = SharedCorpus()
    a, b = corpus.open(), corpus.open()
    corpus.append(a, [10, 11, 12, 13, 20, 21])  # the right continuation of (11, 12, 13)
    corpus.append(b, [40, 12, 13, 30, 31])  # the latest (12, 13): wrong here
    seq = DecodeSequence([1, 11, 12, 13])
    assert SuffixIndex(CONTEXT_MATCH_SIZES, corpus, seq).propose(seq.history, 2) == [20, 21]
    assert SuffixIndex((2,), corpus, DecodeSequence([1, 11, 12, 13])).propose(seq.history, 2) == [30, 31]
    collide = SharedCorpus()
    real_hash = hash
    monkeypatch.setattr(corpus_mod, "hash", lambda key: 7 if key in {(2, 3), (8, 9)} else real_hash(key),
                        raising=False)  # (2, 3) and (8, 9) collide
    collide.append(collide.open(), [2, 3, 5, 8, 9, 6])  # both occurrences under one key
    assert collide.continuation((8, 9), 1) == [6]
    assert collide.continuation((2, 3), 1) == [5]  # not (8, 9)'s continuation
    only = SharedCorpus()
    only.append(only.open(), [8, 9, 6])
    assert only.continuation((2, 3), 1) == []  # (8, 9)'s entry is not (2, 3)'s


def test_a_continuation_that_ends_early_is_chained_on_and_a_lone_token_still_drafts():
    """A match at the end of a document another request is still writing offers fewer tokens
    than asked: the candidate goes on from the suffix of history + candidate. Where no 2-gram
    recurs, the last token alone (length 1, as SGLang's NGRAM matches) still finds a candidate."""
    from selfspec.decoding.modes.ngram import CONTEXT_MATCH_SIZES

    corpus = SharedCorpus()
    a, b = corpus.open(), corpus.open()
    corpus.append(a, [50, 5, 6, 7])  # (5, 6) continues with 7, then a's text ends
    corpus.append(b, [6, 7, 8, 9, 10])  # (6, 7) goes on here
    seq = DecodeSequence([1, 2, 5, 6])
    assert SuffixIndex((2,), corpus, seq).propose(seq.history, 4) == [7, 8, 9, 10]
    assert SuffixIndex((2,), corpus, seq).propose(seq.history, 1) == [7]
    lone = DecodeSequence([1, 2, 3, 9])
    assert SuffixIndex((2,), corpus, lone).propose(lone.history, 2) == []
    assert SuffixIndex(CONTEXT_MATCH_SIZES, corpus, lone).propose(lone.history, 2) == [10]


def test_a_weak_match_drafts_a_short_candidate():
    """`WEAK_MATCH_CAPS`: a candidate found only by another request's last token (or two) is cut
    short, one found by a long suffix of the request's own text is not; the caps are a mode
    option (`context_caps`, off by default), and without them the same lookups draft the full
    length."""
    from selfspec.decoding.modes.ngram import CONTEXT_MATCH_SIZES, WEAK_MATCH_CAPS, NgramConfig, context_index

    def lookup(caps: bool) -> NgramConfig:
        return NgramConfig(16, CONTEXT_MATCH_SIZES, corpus=True, caps=caps)

    corpus = SharedCorpus()
    corpus.append(corpus.open(), [90, 9] + list(range(100, 130)))  # token 9 then a long run
    lone = DecodeSequence([1, 2, 3, 9])  # only its last token (9) recurs, in the other document
    weak = context_index(lone, lookup(True), corpus)
    assert weak.propose(lone.history, 16) == list(range(100, 100 + WEAK_MATCH_CAPS[(False, 1)]))
    uncapped = context_index(DecodeSequence([1, 2, 3, 9]), lookup(False), corpus)
    assert uncapped.propose(lone.history, 16) == list(range(100, 116))
    loop = list(range(40, 50))
    own = DecodeSequence(loop * 2)  # a 10-token own suffix recurs: a strong match
    strong = context_index(own, lookup(True), corpus)
    assert strong.propose(own.history, 16) == (loop * 2)[:16]
    from selfspec.decoding.modes.isd import ISDConfig, ISDMode

    for caps in (False, True):
        seq = DecodeSequence([1, 2, 3])
        ISDMode(ISDConfig(stride=2, context_tokens=16, context_caps=caps), mask_token_id=99).start(seq)
        assert seq.state.index.weak_caps == (WEAK_MATCH_CAPS if caps else {})


def test_a_requests_draft_length_follows_its_recent_acceptance():
    """`draft_length.RecentAcceptance`: the first draft is full length, a miss shortens the next
    ones, drafts accepted whole grow the limit back to full; never past full, never below 1."""
    from selfspec.decoding.widths.draft_length import RecentAcceptance

    recent = RecentAcceptance(16)
    assert recent.limit() == 16
    limits = []
    for _ in range(4):
        recent.record(0)
        limits.append(recent.limit())
    assert limits[0] < 16 and limits == sorted(limits, reverse=True) and limits[-1] == 2, limits
    grown = []
    while recent.limit() < 16:  # each step's draft accepted whole
        recent.record(recent.limit())
        grown.append(recent.limit())
        assert len(grown) < 6, grown
    assert grown == sorted(grown) and grown[-1] == 16, grown
    recent.record(100)
    assert recent.limit() == 16
    assert RecentAcceptance(1).limit() == 1


def test_adaptive_lookups_send_fewer_query_tokens_for_the_same_text():
    """An `adaptive` lookup step shortens the drafts of requests whose drafts keep missing: on
    code with long repeats and new lines between, the same greedy text for fewer query tokens
    per committed token (the test fails if the limit is never applied)."""
    engine = HFEngine.from_pretrained("tiny-idlm")
    ids = [engine.encode(t) for t in ("import os\nimport sys\nimport re\nimport os\nimport sys\n",
                                      "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
                                      "class Point:\n    def __init__(self, x, y):\n")]
    base = {"num_draft": 16, "match_sizes": (4, 3, 2, 1)}
    full = engine.generate(ids, 64, stop_token_ids=[], mode="ngram", mode_config=base, batch_size=3)
    adapt = engine.generate(ids, 64, stop_token_ids=[], mode="ngram", mode_config={**base, "adaptive": True},
                            batch_size=3)
    assert [o.token_ids for o in adapt] == [o.token_ids for o in full]
    per_token = lambda outs: sum(o.metrics.query_tokens for o in outs) / sum(len(o.token_ids) for o in outs)  # noqa: E731
    assert per_token(adapt) < 0.8 * per_token(full), (per_token(adapt), per_token(full))


def test_own_history_first_then_the_corpus_for_greedy_rows():
    corpus = SharedCorpus()
    other = DecodeSequence([5, 6, 7, 8, 9])
    SuffixIndex((2,), corpus, other).propose(other.history + [1], 3)  # its text joins the corpus
    seq = DecodeSequence([1, 2, 3, 4, 6, 7])
    index = SuffixIndex((2,), corpus, seq)
    assert index.propose(seq.history, 3) == [8, 9]  # (6, 7) only occurred in the other sequence (the
    # corpus holds what each sequence had indexed: its text before its pending token)
    assert index.propose(seq.history, 3, shared=False) == []  # a sampled row: own history only
    seq.history += [1, 2]
    assert index.propose(seq.history, 2) == [3, 4]  # (1, 2) occurred in its own history: that wins


@pytest.mark.parametrize("mode, config", [
    ("isd", {"stride": 3, "context_tokens": 16}),
    ("sjd", {"window": 2, "context_tokens": 16}),
    ("jacobi", {"context_tokens": 16}),
])
def test_a_repeated_request_is_drafted_from_the_first(mode, config):
    """A server answering the same prompt twice: the second answer's context candidates come from
    the first (its own history holds no match), so it takes far fewer forwards, and is still AR's."""
    engine = HFEngine.from_pretrained("tiny-idlm")
    ids = engine.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser(description=")
    (ar,) = engine.generate([ids], 64, stop_token_ids=[])
    tpf = {}
    for shared in (True, False):
        mode_obj = engine.build_mode(mode, {**config, "context_corpus": shared})  # one mode = one server
        first, second = (engine.generate([ids], 64, stop_token_ids=[], mode=mode_obj)[0] for _ in range(2))
        assert first.token_ids == second.token_ids == ar.token_ids
        tpf[shared] = (first.metrics.tokens_per_forward, second.metrics.tokens_per_forward)
    assert tpf[False][1] == pytest.approx(tpf[False][0])  # without the corpus nothing carries over
    assert tpf[True][1] >= tpf[True][0] + 1.0, tpf


def test_sampled_requests_do_not_draw_on_other_requests():
    """A seeded sampled request decodes the same on a mode that served others before it."""
    engine = HFEngine.from_pretrained("tiny-idlm")
    ids = engine.encode("class Parser(object):\n    def __init__(self, name):\n        self.")
    sampling = SamplingParams(temperature=0.8)
    config = {"stride": 3, "context_tokens": 16}
    (fresh,) = engine.generate([ids], 48, sampling, seed=3, stop_token_ids=[], mode="isd", mode_config=config)
    used = engine.build_mode("isd", config)
    engine.generate([ids], 48, stop_token_ids=[], mode=used)  # greedy: its text joins the corpus
    (again,) = engine.generate([ids], 48, sampling, seed=3, stop_token_ids=[], mode=used)
    assert again.token_ids == fresh.token_ids


def test_a_step_of_chains_only_hands_its_logits_on_uncopied():
    """`finish_split` gives the chain verifier the step's own logits when no row carries a tree:
    `logits[idx]` over every row copied a [16, 13, 8192] step (2.5 ms a step on a CPU, a tenth
    of a served lookup step at C=16); a mixed step still splits, in the batch's order."""
    from types import SimpleNamespace

    from selfspec.decoding.step import StepContext
    from selfspec.decoding.modes.tree_verify import finish_split

    logits = torch.randn(3, 4, 8)
    ctx = StepContext.from_params([SamplingParams()] * 3, torch.zeros(3, 5, dtype=torch.long))
    seen = []

    def chains(seqs, lg, c):
        seen.append(lg)
        return [f"chain{s.i}" for s in seqs]

    def tree(s, lg, c):
        return f"tree{s.i}"

    seqs = [SimpleNamespace(i=i, state=SimpleNamespace(plan=None)) for i in range(3)]
    assert finish_split(seqs, logits, ctx, chains, tree) == ["chain0", "chain1", "chain2"]
    assert seen[-1] is logits
    seqs[1].state.plan = object()
    assert finish_split(seqs, logits, ctx, chains, tree) == ["chain0", "tree1", "chain2"]
    assert torch.equal(seen[-1], logits[[0, 2]])


def test_a_draft_tree_takes_the_most_travelled_branches_first():
    """Continuations merged into a trie, nodes taken best first by the share of places that went
    that way (times the match's confidence per token), each after its parent, cut by the budget
    and by the least score."""
    from selfspec.decoding.modes.draft_tree import draft_tree, match_confidence

    conts = [([1, 2, 3], 1.0), ([1, 2, 4], 1.0), ([1, 5], 1.0)]
    assert draft_tree(conts, 10, 1.0) == [(1, -1), (2, 0), (3, 1), (4, 1), (5, 0)]
    assert draft_tree(conts, 3, 1.0) == [(1, -1), (2, 0), (3, 1)]
    assert draft_tree(conts, 10, 1.0, min_score=0.5) == [(1, -1), (2, 0)]
    # a 1-token match: the other first token (0.5 x 1/4) beats the majority's third (0.5^3 x 3/4);
    # a 32-token match: the majority's chain first
    conts = [([7, 8, 9], 3.0), ([6], 1.0)]
    assert [t for t, _ in draft_tree(conts, 3, match_confidence(1))] == [7, 8, 6]
    assert [t for t, _ in draft_tree(conts, 3, match_confidence(32))] == [7, 8, 9]


def test_a_tree_layout_lays_each_node_once_and_each_sees_its_ancestors():
    from selfspec.decoding.modes.tree_verify import build_tree
    from selfspec.decoding.step import StepLayout, collate
    from selfspec.sglang_ext.worker import pad_layout

    lay, plan = build_tree(9, [(1, -1), (2, 0), (3, 1), (4, 1), (5, 0)])
    assert lay.tokens == [9, 1, 2, 3, 4, 5] and lay.offsets == [0, 1, 2, 3, 3, 2]
    assert [(p.tokens, p.rows, p.end_row) for p in plan.paths] == [
        ([1, 2, 3], [0, 1, 2], 3), ([1, 2, 4], [0, 1, 2], 4), ([1, 5], [0, 1], 5)]
    padded = pad_layout(lay, 8, pad_token=0)
    batch = collate([padded, StepLayout([3, 4])])
    seen = batch.local[0]
    assert seen[4].nonzero().flatten().tolist() == [0, 1, 2, 4]  # node 4 sees 2, 1, the root: not its sibling 3
    assert seen[5].nonzero().flatten().tolist() == [0, 1, 5]
    assert not seen[:6, 6:].any() and seen[6:, 0].all()  # padding: seen by nobody, sees the root
    assert batch.local[1, 1].tolist()[:2] == [True, True]  # a chain row beside it stays causal
    assert batch.seen(0, 6)[4] == [1, 2, 4]


def test_the_tree_index_drafts_every_place_a_suffix_occurred():
    """Own history with the suffix (5, 6) followed by 7 twice and by 8 once: the tree branches
    there, the majority first; with no second place it is the lagged copy, one chain."""
    index = SuffixIndex((2,), occurrences=8)
    history = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 7, 3, 5, 6]
    nodes = index.tree(history, 3, 6)
    assert nodes[0] == (7, -1) and (8, -1) in nodes
    assert {t for t, p in nodes if p == 0} == {1, 3}  # after 7: both places' next tokens
    single = SuffixIndex((2,), occurrences=8).tree([1, 2, 3, 1, 2], 4, 6)
    assert single == [(3, -1), (1, 0), (2, 1), (3, 2)]
    with pytest.raises(ValueError):
        ngram.NgramConfig(tree=4, branches=2)


def test_a_constrained_row_of_a_tree_lookup_drafts_a_chain_within_the_trees_width(monkeypatch):
    """A grammar checks chains, so its rows draft one; the forward width reserved for the tree
    (`max_width`) still holds it however long the chain's own limit (num_draft)."""
    mode = ngram.NgramMode(ngram.NgramConfig(num_draft=12, match_sizes=(1,), tree=4))
    seq = DecodeSequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 1])
    seq.constraint = object()  # any constraint: the grammar's check lets every draft through
    monkeypatch.setattr(ngram, "grammar_valid", lambda s, drafts: drafts)
    mode.start(seq)
    (lay,) = mode.layouts([seq])
    assert lay.parent is None and len(lay) == mode.max_width == 5
