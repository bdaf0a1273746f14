"""The AR reference server: stock SGLang with the selfspec plugin loaded and no selfspec mode,
the server every mode's output is held to (`sglang_fixtures.ar_reference`, which records what
it answered while it was up; no server of its own here). Its greedy output is the reference
engine's, its OpenAI endpoints answer, and /server_info carries the plugin's fields."""

from __future__ import annotations

import pytest
from sglang_fixtures import INVALID_PARAMETERS, MAX_NEW, reference_engine

pytestmark = pytest.mark.server


def test_ar_server_greedy_equals_the_reference_engine(ar_reference, heldout_ids, tiny_base_path):
    """The cross-engine check every mode's comparison relies on: the AR server's greedy tokens
    on the held-out prompts are the HF engine's, and its OpenAI completion text is their text."""
    from selfspec.decoding.requests.sampling import SamplingParams

    engine, tok, _ = reference_engine(str(tiny_base_path))
    ref = [o.token_ids for o in engine.generate(heldout_ids, max_new_tokens=MAX_NEW, sampling=SamplingParams(),
                                                batch_size=8)]
    bad = [i for i, (got, want) in enumerate(zip(ar_reference["output_ids"], ref)) if got != want]
    assert not bad, f"{len(bad)}/{len(ref)} prompts differ, first {bad[0]}: {ar_reference['output_ids'][bad[0]]} " \
                    f"vs {ref[bad[0]]}"
    assert ar_reference["texts"] == [tok.decode(ids, skip_special_tokens=True) for ids in ref]


def test_ar_server_endpoints(ar_reference):
    """Completion (a text prompt, whole and streamed: the same text), chat completion, invalid
    parameters answered 4xx with the server still serving, and /server_info's plugin fields:
    `kv_tokens_in_use` (0 when idle; the plugin's hook adds it) and no selfspec worker."""
    ep = ar_reference["endpoints"]
    done = ep["completion"]
    assert done["text"] and done["usage"]["prompt_tokens"] > 0
    assert done["usage"]["completion_tokens"] == 24 or done["finish_reason"] == "stop"
    assert len(ep["streamed"]) > 1 and "".join(ep["streamed"]) == done["text"]
    chat = ep["chat"]
    assert chat["role"] == "assistant" and chat["content"]
    assert 0 < chat["usage"]["completion_tokens"] <= 12
    assert len(ep["invalid_statuses"]) == len(INVALID_PARAMETERS)
    assert all(400 <= s < 500 for s in ep["invalid_statuses"]), dict(zip(map(str, INVALID_PARAMETERS),
                                                                          ep["invalid_statuses"]))
    assert ep["after_invalid"] == 4
    assert ep["state"]["kv_tokens_in_use"] == 0 and "selfspec" not in ep["state"], sorted(ep["state"])
