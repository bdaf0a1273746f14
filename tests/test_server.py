"""A real SGLang server on CPU with the selfspec plugin, driven through the openai client."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
import torch

from selfspec.decoding.requests.sampling import SamplingParams
from selfspec.serving import ServerProcess, ServerSpec

pytestmark = pytest.mark.server

MAX_NEW = 32


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "sglang.log"
    proc = ServerProcess(ServerSpec("tiny-base", port=None), log_path=log)
    try:
        proc.start()
    except Exception:
        print(log.read_text()[-5000:] if log.exists() else "(no log)")
        raise
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_engine(tiny_base_path):
    from selfspec.engines.hf import HFEngine

    return HFEngine.from_pretrained(tiny_base_path, dtype=torch.float32)


def _native_generate(server, input_ids: list[int], max_new_tokens: int) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    req = urllib.request.Request(server.base_url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_completion(client):
    out = client.completions.create(model="default", prompt="def main():\n", max_tokens=16, temperature=0)
    assert out.choices[0].text
    assert out.usage.completion_tokens == 16 or out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens > 0


def test_chat_completion(client):
    out = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Sort a list."}],
                                         max_tokens=16, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content
    assert 0 < out.usage.completion_tokens <= 16


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model="default", prompt="class Stack:\n", max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert len(pieces) > 1
    assert "".join(pieces) == whole


def test_server_greedy_equals_hf_engine(server, client, hf_engine, heldout_prompts):
    """The cross-engine check every later mode relies on: same tokens, 16 held-out prompts."""
    tok = hf_engine.tokenizer
    prompts = heldout_prompts[:16]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    hf_out = hf_engine.generate(prompt_ids, max_new_tokens=MAX_NEW, sampling=SamplingParams(), batch_size=8)
    mismatches = []
    for i, (ids, ref) in enumerate(zip(prompt_ids, hf_out)):
        got = _native_generate(server, ids, MAX_NEW)["output_ids"]
        if got != ref.token_ids:
            mismatches.append((i, got, ref.token_ids))
    assert not mismatches, f"{len(mismatches)}/16 prompts differ, first: {mismatches[0]}"
    # The same through the OpenAI client: the text of the HF tokens.
    for ids, ref in list(zip(prompt_ids, hf_out))[:4]:
        text = client.completions.create(model="default", prompt=ids, max_tokens=MAX_NEW, temperature=0).choices[0].text
        assert text == tok.decode(ref.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("bad", [{"temperature": -1.0}, {"top_p": 0.0}, {"max_tokens": -3}])
def test_invalid_parameters_get_4xx_and_server_keeps_serving(client, bad):
    kwargs = dict(model="default", prompt="x = ", max_tokens=4, temperature=0)
    kwargs.update(bad)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(**kwargs)
    assert 400 <= info.value.status_code < 500
    ok = client.completions.create(model="default", prompt="x = ", max_tokens=4, temperature=0)
    assert ok.choices[0].text is not None
