"""Watermarked sampling served: `--enable-watermark` with ISD and SJD emits the AR server's
watermarked tokens wherever a position is forced (every position before the first repeated
context), greedy requests are untouched, and SGLang's detector finds the mark (the start-up
rules: tests/test_sglang_config.py). SGLang's own AR server watermarks on this CPU through the
plugin (`selfspec/sglang_ext/watermark.py`), so it is the reference.

One server at a time: the AR server's outputs are collected and it is stopped before the mode
servers start; every server runs SGLang's default path (radix cache, 16-token prefill chunks).
"""

from __future__ import annotations

import json

import pytest
from sglang_fixtures import TEST_DTYPE, burst, check_own_steps, native_generate, start_server
from test_watermark import first_repeat

pytestmark = pytest.mark.server

KEY = "0123456789abcdef"
WINDOW = 3
PROMPTS = 8
NEW = 32
SAMPLING = dict(temperature=0.9, top_p=0.95)


def wm_args(*extra: str) -> list[str]:
    return ["--dtype", TEST_DTYPE, "--mem-fraction-static", "0.5", "--max-running-requests", "32",
            "--chunked-prefill-size", "16", "--enable-watermark",
            "--watermark-config", json.dumps({"key": KEY, "context_window": WINDOW}), *extra]


def collect(base_url: str, prompts: list[list[int]]) -> dict:
    """Watermarked sampled outputs (two seeds each, the second as a concurrent burst), plain
    sampled outputs and watermark-enabled greedy outputs."""
    def marked(seed_base):
        return lambda item: native_generate(base_url, item[1], NEW, ignore_eos=True, sampling_seed=seed_base + item[0],
                                            watermark={"enabled": True}, **SAMPLING)["output_ids"]

    items = list(enumerate(prompts))
    return {
        "marked": [marked(0)(it) for it in items],
        "marked_other_seeds": burst(marked(1000), items, 8),
        "plain": [native_generate(base_url, ids, NEW, ignore_eos=True, sampling_seed=i, **SAMPLING)["output_ids"]
                  for i, ids in items],
        "greedy": [native_generate(base_url, ids, NEW, ignore_eos=True, temperature=0,
                                   watermark={"enabled": True})["output_ids"] for ids in prompts],
    }


@pytest.fixture(scope="module")
def prompts(heldout_ids) -> list[list[int]]:
    return heldout_ids[:PROMPTS]


@pytest.fixture(scope="module")
def ar_marked(tmp_path_factory, ar_reference, prompts) -> dict:
    proc = start_server(tmp_path_factory, "ar-watermark", wm_args())
    try:
        return collect(proc.base_url, prompts)
    finally:
        proc.stop()


#: the modes alone on every step (`--selfspec-policy own`): the default policy serves sampled
#: batches with plain AR steps, which would leave the modes' own sampled steps untested here
MODES = {
    "isd": ["--speculative-algorithm", "ISD", "--selfspec-policy", "own", "--selfspec-stride", "3",
            "--selfspec-options", "context_tokens=4"],
    "sjd": ["--speculative-algorithm", "SJD", "--selfspec-policy", "own", "--selfspec-options", "context_tokens=4"],
}


@pytest.fixture(scope="module", params=sorted(MODES))
def mode_marked(request, tmp_path_factory, ar_marked, prompts) -> tuple[str, dict]:
    proc = start_server(tmp_path_factory, f"{request.param}-watermark", wm_args(*MODES[request.param]))
    try:
        got = collect(proc.base_url, prompts)
        got["own_steps"] = check_own_steps(proc.base_url, request.param.upper())  # the mode's steps wrote them
        return request.param, got
    finally:
        proc.stop()


def check_forced_spans(prompts, reference, got) -> int:
    covered = 0
    for p, want, have in zip(prompts, reference, got):
        k = first_repeat(p, want, WINDOW)
        assert have[:k] == want[:k], f"differs within the forced span of {k} tokens"
        covered += k
    return covered


def test_the_ar_servers_watermark_is_seed_independent(ar_marked, prompts):
    assert check_forced_spans(prompts, ar_marked["marked"], ar_marked["marked_other_seeds"]) >= 4 * PROMPTS
    assert ar_marked["marked"] != ar_marked["plain"]


def test_modes_emit_the_ar_servers_watermarked_tokens(mode_marked, ar_marked, ar_reference, prompts):
    mode, got = mode_marked
    for key in ("marked", "marked_other_seeds"):  # different seeds, sequential and concurrent
        assert check_forced_spans(prompts, ar_marked["marked"], got[key]) >= 4 * PROMPTS, (mode, key)
    assert got["plain"] != got["marked"]  # without the watermark the seeds decide
    # greedy requests are never watermarked: greedy AR's output
    assert [g[:len(r)] for g, r in zip(got["greedy"], ar_reference["output_ids"])] == \
        [r[:NEW] for r in ar_reference["output_ids"][:PROMPTS]]
    from sglang.srt.sampling.watermarking.detector import WatermarkDetector

    det = WatermarkDetector(KEY, context_window=WINDOW)
    marked = [det.detect_tokens(o, prompt_token_ids=p).combined.z_score for p, o in zip(prompts, got["marked"])]
    plain = [det.detect_tokens(o, prompt_token_ids=p).combined.z_score for p, o in zip(prompts, got["plain"])]
    assert sum(marked) / PROMPTS > 2.0 > sum(plain) / PROMPTS, (mode, marked, plain)

