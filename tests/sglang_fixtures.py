"""Helpers and fixtures for the end-to-end tests of the selfspec SGLang plugin.

Import what a test module needs (`from sglang_fixtures import ...`). Servers are started one at a
time: the AR reference is computed by a session fixture that starts the AR server, collects its
greedy outputs on the held-out prompts and stops it before any mode server starts; each test
module then starts its own mode server (module scope) and compares against that reference.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from selfspec.serving import ServerProcess, ServerSpec, free_port

#: Tokens per held-out prompt in the lossless comparisons (16 prompts).
MAX_NEW = 32
NUM_PROMPTS = 16
#: Test servers run in float32: the AR server (decode path) and a mode server (verify path)
#: compute the same logits through different attention code, and a bf16 rounding difference can
#: flip a near-tie argmax. float32 keeps both paths within ~1e-6 of each other.
TEST_DTYPE = os.environ.get("SELFSPEC_TEST_DTYPE", "float32")
#: One OpenMP thread per server process: on a small shared machine two OpenMP threads that
#: wait for each other at every op make a multi-token forward ~20x slower under contention.
TEST_ENV = {"OMP_NUM_THREADS": os.environ.get("SELFSPEC_TEST_OMP_THREADS", "1")}


def server_args(*extra: str) -> list[str]:
    return ["--dtype", TEST_DTYPE, "--mem-fraction-static", "0.5", "--max-running-requests", "32",
            "--enable-custom-logit-processor", *extra]


def start_server(tmp_path_factory, name: str, extra_args: list[str], model: str | Path = "tiny-base",
                 env: dict | None = None) -> ServerProcess:
    log = tmp_path_factory.mktemp(f"server-{name}") / "sglang.log"
    spec = ServerSpec(str(model), port=None, extra_args=list(extra_args))  # free port, retried if taken
    proc = ServerProcess(spec, log_path=log, startup_timeout=600)
    env = {**TEST_ENV, **(env or {})}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc.start()
    except Exception:
        print(log.read_text()[-6000:] if log.exists() else "(no log)")
        proc.stop()
        raise
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    proc.log_file = log
    return proc


def post_json(base_url: str, path: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def native_generate(base_url: str, input_ids: list[int], max_new_tokens: int = MAX_NEW, **sampling) -> dict:
    sp = {"temperature": 0, "max_new_tokens": max_new_tokens}
    sp.update(sampling)
    return post_json(base_url, "/generate", {"input_ids": input_ids, "sampling_params": sp})


def burst(fn, items, concurrency: int = 16) -> list:
    with ThreadPoolExecutor(concurrency) as ex:
        return list(ex.map(fn, items))


def internal_state(base_url: str) -> dict:
    with urllib.request.urlopen(base_url + "/server_info", timeout=60) as r:
        info = json.loads(r.read())
    states = info.get("internal_states") or [{}]
    return states[0]


def check_default_speculates(base_url: str) -> dict:
    """After a server of a mode at its default policy has answered greedy requests one at a time
    and in a burst: its greedy steps speculated (the policy's own steps or lookup steps, not
    silently plain AR steps), lookup steps served the burst (draft trees among them), and more than
    one token came per forward. Read from /server_info (the worker's own counts), not from the log."""
    state = internal_state(base_url)["selfspec"]
    assert state["policy"] == "auto" and state["plan"] is not None, state
    kinds = {k: v["tokens"] for k, v in state["steps_by_kind"].items()}
    speculated = kinds.get("own", 0) + kinds.get("lookup", 0)
    assert speculated > 0.5 * sum(kinds.values()) and kinds.get("lookup", 0) > 0, kinds
    assert state["tree_request_steps"] > 0, state  # the burst's lookup steps drafted trees
    assert state["tokens_per_forward"] > 1.2, state
    return kinds


def check_own_steps(base_url: str, mode: str, before: dict | None = None) -> dict[str, int]:
    """The server runs `mode` and the mode's own steps (not only lookup or plain AR steps)
    committed tokens since `before` (an earlier `internal_state(...)["selfspec"]`; None: since
    start-up). Read from /server_info (the worker's own counts), not from the log. Returns the
    tokens each kind of step committed over that span."""
    state = internal_state(base_url).get("selfspec")
    assert state is not None, "no selfspec worker in /server_info: the mode never engaged"
    assert state["mode"] == mode, state["mode"]

    def tokens(s):
        return {k: v["tokens"] for k, v in ((s or {}).get("steps_by_kind") or {}).items()}
    now, then = tokens(state), tokens(before)
    kinds = {k: now[k] - then.get(k, 0) for k in now}
    assert kinds.get("own", 0) > 0, f"no tokens from {mode}'s own steps: {kinds}"
    return kinds


def tokens_in_use(base_url: str) -> int:
    """KV tokens held by requests (running + cached prefixes locked by them). The tests run with
    --disable-radix-cache, so finished requests hold nothing: 0 when idle."""
    st = internal_state(base_url)
    for key in ("kv_tokens_in_use",):
        if key in st:
            return st[key]
    raise KeyError(f"no token usage in /server_info internal state: {sorted(st)}")


def wait_tokens_zero(base_url: str, timeout: float = 30.0) -> int:
    deadline = time.time() + timeout
    used = tokens_in_use(base_url)
    while used and time.time() < deadline:
        time.sleep(0.5)
        used = tokens_in_use(base_url)
    return used


def first_mismatch(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else -1


@pytest.fixture(scope="session")
def heldout_ids(heldout_prompts, tiny_base_path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_base_path))
    return [tok(p, add_special_tokens=False)["input_ids"] for p in heldout_prompts[:NUM_PROMPTS]]


@pytest.fixture(scope="session")
def tokenizer(tiny_base_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_base_path))


#: The sampled-distribution check: SAMPLES seeded requests of SAMPLE_LEN tokens on a prompt
#: with a repeated span (context candidates are found and win or lose), at the sampling
#: settings of SAMPLING (temperature and nucleus truncation both matter).
SAMPLE_TEXT = "import os\nimport sys\nimport re\nimport os\nimport sys\nimport re\nimport os\n"
SAMPLES = 1000
SAMPLE_LEN = 5
SAMPLING = {"temperature": 0.7, "top_k": 40, "top_p": 0.9}
ALPHA = 1e-3  # the family-wise level of the sampled-distribution check


def sampled_outputs(base_url: str, prompt_ids: list[int], seeds: range, metas: list | None = None
                    ) -> list[tuple[int, ...]]:
    """One batch of seeded requests (native API), SAMPLE_LEN tokens each, EOS ignored; their
    meta infos are appended to `metas` when given."""
    params = [{**SAMPLING, "max_new_tokens": SAMPLE_LEN, "ignore_eos": True, "sampling_seed": s} for s in seeds]
    outs = post_json(base_url, "/generate", {"input_ids": [prompt_ids] * len(params), "sampling_params": params})
    if metas is not None:
        metas.extend(o["meta_info"] for o in outs)
    return [tuple(o["output_ids"]) for o in outs]


def distribution_pvalues(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> dict[str, float]:
    """Two-sample homogeneity p-values: the joint of the first 3 tokens and each position's token."""
    from collections import Counter

    from model_helpers import two_sample_pvalue

    out = {"joint[:3]": two_sample_pvalue(Counter(x[:3] for x in a), Counter(x[:3] for x in b))[1]}
    for pos in range(SAMPLE_LEN):
        out[f"token {pos}"] = two_sample_pvalue(Counter(x[pos] for x in a), Counter(x[pos] for x in b))[1]
    return out


def rule_requests(plain_outputs: list[list[int]]) -> list[tuple[int, dict]]:
    """(prompt index, sampling params) of greedy requests with logits rules, each built so that
    it changes the AR server's output (checked when the reference is taken): penalties,
    logit_bias on tokens the plain output uses, min_new_tokens holding back a stop token that
    the plain output reaches early, min_p (a no-op for greedy, served all the same), a mix, and
    a regex, a JSON schema and an EBNF grammar."""
    out3, out4, out5 = plain_outputs[3], plain_outputs[4], plain_outputs[5]
    return [
        (0, {"frequency_penalty": 0.6}),
        (1, {"presence_penalty": 0.8}),
        (2, {"repetition_penalty": 1.3}),
        (3, {"logit_bias": {str(out3[0]): -100.0, str(out3[4]): 4.0}}),
        (4, {"stop_token_ids": [out4[2]], "min_new_tokens": 12}),
        (5, {"frequency_penalty": 0.3, "presence_penalty": 0.2, "repetition_penalty": 1.1, "min_p": 0.2,
             "logit_bias": {str(out5[1]): -3.0}}),
        # grammars (SGLang's xgrammar backend), each kind
        (6, {"regex": r"(def|class) [a-z_]{2,16}\((self|[a-z]+)?\):\n    [a-z]+"}),
        (7, {"json_schema": json.dumps({"type": "object", "required": ["name", "size"],
                                        "properties": {"name": {"type": "string"}, "size": {"type": "integer"}}})}),
        (8, {"ebnf": 'root ::= "x = " [0-9]+ ("," [0-9]+)* "\\n"'}),
        (9, {"regex": r"[a-z_]+ = [0-9]+", "frequency_penalty": 0.5}),
        # a custom logit processor (SGLang's own DisallowedTokensLogitsProcessor)
        (10, {"custom_params": {"token_ids": [plain_outputs[10][1], plain_outputs[10][3]]},
              CUSTOM_PROCESSOR: "disallow"}),
    ]


CUSTOM_PROCESSOR = "_custom_logit_processor"  # request key: a processor of the request (top level)


def _processor(name: str) -> str:
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    return {"disallow": DisallowedTokensLogitsProcessor}[name].to_str()


def rule_outputs(base_url: str, heldout_ids: list[list[int]], requests: list[tuple[int, dict]],
                 concurrent: bool) -> list[list[int]]:
    def fn(r):
        params = dict(r[1])
        processor = params.pop(CUSTOM_PROCESSOR, None)
        body = {"input_ids": heldout_ids[r[0]], "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW,
                                                                     **params}}
        if processor is not None:
            body["custom_logit_processor"] = _processor(processor)
        return post_json(base_url, "/generate", body)["output_ids"]
    return burst(fn, requests, len(requests)) if concurrent else [one_alone(base_url, fn, r) for r in requests]


def check_rules_match_ar(base_url: str, heldout_ids: list[list[int]], reference: dict) -> None:
    """Greedy requests with penalties / logit_bias / min_tokens / min_p return exactly the AR
    server's output, sent one at a time and as one burst mixed with plain requests."""
    requests, want = reference["rule_requests"], reference["rule_outputs"]
    got = rule_outputs(base_url, heldout_ids, requests, concurrent=False)
    bad = [f"{p}: got {g} want {w}" for (_, p), g, w in zip(requests, got, want) if g != w]
    assert not bad, "outputs with logits rules differ from the AR server's:\n" + "\n".join(bad)
    mixed = requests + [(i, {}) for i in range(6, 12)]
    outs = rule_outputs(base_url, heldout_ids, mixed, concurrent=True)
    assert outs[: len(requests)] == want
    assert outs[len(requests):] == reference["output_ids"][6:12]


#: (prompt index, sampling params) of the logprob comparison against the AR server
LOGPROB_REQUESTS = [(0, {}), (1, {})]
#: a request whose logprobs come from the penalised distribution; its reference is the HF
#: engine's AR run: the stock AR server now and then reports a doubly penalised token in its
#: top logprobs for this request (its greedy tokens and the selfspec servers never differ),
#: so it is no stable reference for the penalised distribution's tail
RULED_LOGPROB_REQUEST = (2, {"frequency_penalty": 0.5, "repetition_penalty": 1.2})


@functools.lru_cache(maxsize=2)
def reference_engine(model_path: str):
    """The HF reference engine on `model_path` (float32), its tokenizer and the model's stop tokens
    (what a server stops on: the generation config's EOS ids), loaded once per process."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    from selfspec.engines.hf import HFEngine

    eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    return (HFEngine.from_pretrained(model_path, dtype=torch.float32), AutoTokenizer.from_pretrained(model_path),
            list(eos) if isinstance(eos, (list, tuple)) else [eos])


def ruled_logprob_reference(heldout_ids: list[list[int]], model_path) -> list[float]:
    from selfspec.decoding.requests.sampling import SamplingParams

    i, extra = RULED_LOGPROB_REQUEST
    engine = reference_engine(str(model_path))[0]
    return engine.generate([heldout_ids[i]], 16, SamplingParams(**extra), stop_token_ids=[], logprobs=True)[0].logprobs


def logprob_outputs(base_url: str, heldout_ids: list[list[int]], concurrent: bool = False) -> list[dict]:
    """Greedy requests with logprobs, top-3 logprobs and two token-id logprobs per position."""
    def one(req):
        i, extra = req
        body = {"input_ids": heldout_ids[i], "return_logprob": True, "top_logprobs_num": 3,
                "token_ids_logprob": [5, 17],
                "sampling_params": {"temperature": 0, "max_new_tokens": 16, **extra}}
        meta = post_json(base_url, "/generate", body)["meta_info"]
        return {"ids": [t[1] for t in meta["output_token_logprobs"]],
                "logprobs": [t[0] for t in meta["output_token_logprobs"]],
                "top_ids": [[x[1] for x in pos] for pos in meta["output_top_logprobs"]],
                "top_logprobs": [[x[0] for x in pos] for pos in meta["output_top_logprobs"]],
                "token_ids_logprobs": [[x[0] for x in pos] for pos in meta["output_token_ids_logprobs"]]}
    if concurrent:
        return burst(one, LOGPROB_REQUESTS, len(LOGPROB_REQUESTS))
    return [one_alone(base_url, one, r) for r in LOGPROB_REQUESTS]


def one_alone(base_url: str, fn, item):
    """fn(item) on an idle server (no KV held): each sequential request runs alone in its batch."""
    try:
        wait_tokens_zero(base_url)
    except KeyError:  # a server without the usage field: give its scheduler a few iterations
        time.sleep(0.5)
    return fn(item)


def check_logprobs_match_ar(base_url: str, heldout_ids: list[list[int]], reference: dict, tol: float = 1e-4) -> None:
    """Greedy outputs' logprobs (the emitted token's, top-3 and token-id ones) equal the AR
    server's to `tol`, sequentially and as a burst."""
    for concurrent in (False, True):
        got = logprob_outputs(base_url, heldout_ids, concurrent)
        for (i, extra), g, w in zip(LOGPROB_REQUESTS, got, reference["logprobs"]):
            assert g["ids"] == w["ids"] and len(g["ids"]) == 16, (i, extra)
            diff = [(k, a, b) for k, (a, b) in enumerate(zip(g["top_ids"], w["top_ids"])) if a != b]
            assert not diff, (i, extra, "burst" if concurrent else "sequential", diff)
            for key in ("logprobs", "top_logprobs", "token_ids_logprobs"):
                a = torch_tensor(g[key])
                b = torch_tensor(w[key])
                assert a.shape == b.shape and float((a - b).abs().max()) < tol, (i, extra, key, g[key], w[key])
    i, extra = RULED_LOGPROB_REQUEST
    body = {"input_ids": heldout_ids[i], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True, **extra}}
    got = [t[0] for t in post_json(base_url, "/generate", body)["meta_info"]["output_token_logprobs"]]
    want = reference["ruled_logprobs"]
    assert len(got) == 16 and float((torch_tensor(got) - torch_tensor(want)).abs().max()) < tol, (got, want)


def torch_tensor(values):
    import torch

    return torch.tensor(values, dtype=torch.float64)


#: tiny-base's context length, and the new tokens of the request that fills it exactly
CONTEXT_LEN = 4096
CONTEXT_TAIL = 24


def context_filling_prompt(heldout_ids: list[list[int]]) -> list[int]:
    """A prompt of CONTEXT_LEN - CONTEXT_TAIL tokens: prompt + max_tokens reach the position limit."""
    flat = [t for ids in heldout_ids for t in ids]
    return (flat * (CONTEXT_LEN // len(flat) + 1))[: CONTEXT_LEN - CONTEXT_TAIL]


def check_context_limit(base_url: str, reference: dict) -> None:
    """A request whose prompt + max_tokens is the context length: the last steps' verify windows
    must not run past the position limit, and the output is AR's."""
    out = native_generate(base_url, reference["long_ids"], CONTEXT_TAIL, ignore_eos=True)["output_ids"]
    want = reference["long_output"]
    assert out == want, f"first difference at {first_mismatch(out, want)}: got {out} want {want}"
    # SGLang stops a request a token or two short of the context length; both servers alike
    assert len(reference["long_ids"]) + len(out) >= CONTEXT_LEN - 2, len(out)


#: a burst of greedy and sampled requests, each with its own settings (seeded)
MIXED_SAMPLED = [
    (6, {"temperature": 0.7, "top_k": 20, "sampling_seed": 11}),
    (7, {"temperature": 1.0, "top_p": 0.8, "sampling_seed": 12}),
    (8, {"temperature": 0.5, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "sampling_seed": 13}),
    (9, {"temperature": 0.9, "frequency_penalty": 0.4, "logit_bias": {"202": -2.0}, "sampling_seed": 14}),
]


def _sampled_with_top_logprobs(base_url: str, heldout_ids: list[list[int]], item) -> dict:
    i, params = item
    body = {"input_ids": heldout_ids[i], "return_logprob": True, "top_logprobs_num": 5,
            "sampling_params": {"max_new_tokens": MAX_NEW, **params}}
    out = post_json(base_url, "/generate", body)
    top = out["meta_info"]["output_top_logprobs"]
    return {"ids": out["output_ids"], "top": [{x[1]: x[0] for x in pos} for pos in top]}


def check_mixed_burst(base_url: str, heldout_ids: list[list[int]], reference: dict) -> None:
    """Greedy rows of a mixed burst equal the AR server's output; each sampled row (its own
    temperature / top-k / top-p / min_p / penalties, seeded) follows its own solo run: token for
    token, or up to a token where the two runs' distributions still agree (the top-5 logprobs at
    every position up to and including it, to 1e-4) and the seeded draw fell the other way — a
    batch's float rounding (~1e-6 in the logits) can tip a draw that sits on a boundary, but not
    move a distribution (a penalty counted differently in a batch would)."""
    def sampled(item):
        return _sampled_with_top_logprobs(base_url, heldout_ids, item)

    solo = [one_alone(base_url, sampled, r) for r in MIXED_SAMPLED]
    items = [(i, {}) for i in range(6)] + MIXED_SAMPLED
    outs = burst(lambda r: sampled(r) if r[1] else native_generate(base_url, heldout_ids[r[0]])["output_ids"],
                 items, len(items))
    assert all(s["ids"] != reference["output_ids"][i] for (i, _), s in zip(MIXED_SAMPLED, solo))  # sampling happened
    assert outs[:6] == reference["output_ids"][:6]
    for (i, params), got, alone in zip(MIXED_SAMPLED, outs[6:], solo):
        split = first_mismatch(got["ids"], alone["ids"])
        if split < 0:
            continue
        for pos in range(min(split + 1, len(got["top"]), len(alone["top"]))):
            a, b = got["top"][pos], alone["top"][pos]
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a), \
                f"{params}: the burst's distribution at token {pos} differs from the solo run's: {a} vs {b}"


#: the chat request of the AR reference (`endpoint_answers`); a mode server answers it alike
CHAT_REQUEST = {"messages": [{"role": "user", "content": "Sort a list."}], "max_tokens": 12}
#: OpenAI completion parameters that the server must refuse with a 4xx, and keep serving
INVALID_PARAMETERS = [{"temperature": -1.0}, {"top_p": 0.0}, {"max_tokens": -3}]


def endpoint_answers(base_url: str) -> dict:
    """The AR server's answers on its OpenAI endpoints and /server_info, recorded by
    `ar_reference` while its server is up (`test_sglang_ar.py` checks them): a text-prompt
    completion whole and streamed, a chat completion, the status of each INVALID_PARAMETERS
    request and a completion after them, and /server_info's internal state when idle."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    kw = dict(model="default", prompt="class Stack:\n", max_tokens=24, temperature=0)
    whole = client.completions.create(**kw)
    streamed = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    chat = client.chat.completions.create(model="default", temperature=0, **CHAT_REQUEST)
    invalid = []
    for bad in INVALID_PARAMETERS:
        try:
            client.completions.create(**{**kw, "max_tokens": 4, **bad})
            invalid.append(200)
        except openai.APIStatusError as e:
            invalid.append(e.status_code)
    after = client.completions.create(**{**kw, "max_tokens": 4})
    wait_tokens_zero(base_url)
    return {"completion": {"text": whole.choices[0].text, "finish_reason": whole.choices[0].finish_reason,
                           "usage": whole.usage.model_dump()},
            "streamed": streamed,
            "chat": {"role": chat.choices[0].message.role, "content": chat.choices[0].message.content,
                     "usage": chat.usage.model_dump()},
            "invalid_statuses": invalid, "after_invalid": after.usage.completion_tokens,
            "state": internal_state(base_url)}


@pytest.fixture(scope="session")
def ar_reference(tmp_path_factory, heldout_ids, tiny_base_path) -> dict:
    """Greedy outputs of the plain (AR) server on the held-out prompts, sequential requests, and
    its sampled outputs on SAMPLE_TEXT (`check_sampling_matches_ar`), and its answers on the
    OpenAI endpoints (`endpoint_answers`). The AR server is stopped before the fixture returns
    (one server at a time)."""
    # Overlap scheduling off: with it, SGLang's own AR path counts penalties one token late (the
    # penalizer reads req.output_ids[-1] before the previous step's token is appended, and the
    # last prompt token at the first decode); its non-overlap path counts what the penalty
    # definitions say, which is what the selfspec modes do (they run without overlap anyway).
    ar_args = server_args("--disable-radix-cache", "--disable-overlap-schedule")
    proc = start_server(tmp_path_factory, "ar", ar_args)
    try:
        outs = [native_generate(proc.base_url, ids)["output_ids"] for ids in heldout_ids]
        texts = [openai_complete(proc.base_url, ids) for ids in heldout_ids]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tiny_base_path))
        sample_ids = tok(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
        samples = sampled_outputs(proc.base_url, sample_ids, range(SAMPLES))
        greedy = native_generate(proc.base_url, sample_ids, SAMPLE_LEN, ignore_eos=True)["output_ids"]
        requests = rule_requests(outs)
        ruled = rule_outputs(proc.base_url, heldout_ids, requests, concurrent=False)
        for (i, params), got in zip(requests, ruled):  # every rule changes what AR emits
            assert got != outs[i], f"{params} changed nothing"
        logprobs = logprob_outputs(proc.base_url, heldout_ids)
        ruled_logprobs = ruled_logprob_reference(heldout_ids, tiny_base_path)
        long_ids = context_filling_prompt(heldout_ids)
        long_out = native_generate(proc.base_url, long_ids, CONTEXT_TAIL, ignore_eos=True)["output_ids"]
        fuzz, proc = fuzz_reference(proc, heldout_ids, restart=lambda: start_server(tmp_path_factory, "ar", ar_args))
        endpoints = endpoint_answers(proc.base_url)
        return {"fuzz": fuzz, "long_ids": long_ids, "long_output": long_out, "output_ids": outs, "texts": texts,
                "sample_ids": sample_ids, "samples": samples, "sample_greedy": tuple(greedy),
                "rule_requests": requests, "rule_outputs": ruled, "logprobs": logprobs,
                "ruled_logprobs": ruled_logprobs, "endpoints": endpoints}
    finally:
        proc.stop()


def check_sampling_matches_ar(base_url: str, reference: dict, metas: list | None = None) -> dict[str, float]:
    """The mode server's sampled outputs on SAMPLE_TEXT against the AR server's own (other
    seeds): every homogeneity p-value above ALPHA / tests. The check has teeth: the AR sample
    is far from what a server ignoring the temperature (always the greedy output) would give."""
    ar = reference["samples"]
    greedy_like = distribution_pvalues(ar, [reference["sample_greedy"]] * len(ar))
    assert min(greedy_like.values()) < 1e-6, f"the AR sample cannot tell sampling from greedy: {greedy_like}"
    got = sampled_outputs(base_url, reference["sample_ids"], range(10**6, 10**6 + len(ar)), metas)
    pvalues = distribution_pvalues(ar, got)
    level = ALPHA / len(pvalues)
    assert min(pvalues.values()) > level, f"sampled outputs differ from the AR server's (level {level:.1e}): {pvalues}"
    return pvalues


def openai_complete(base_url: str, prompt_ids: list[int], max_tokens: int = MAX_NEW, **kw) -> str:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    out = client.completions.create(model="default", prompt=prompt_ids, max_tokens=max_tokens, temperature=0, **kw)
    return out.choices[0].text


#: SGLang's default server path (radix cache on), with prefill chunks small enough that the
#: held-out prompts are prefilled in several chunks
DEFAULT_PATH = ("--chunked-prefill-size", "16")


def mode_server_fixture(name: str, extra: list[str], env: dict | None = None, default_path: bool = False):
    """A module-scoped fixture factory for a mode server; `default_path`: radix cache and chunked
    prefill on (DEFAULT_PATH), otherwise the radix cache is off."""
    path_args = DEFAULT_PATH if default_path else ("--disable-radix-cache",)

    @pytest.fixture(scope="module")
    def _server(tmp_path_factory, ar_reference):  # ar_reference first: its server is gone by now
        proc = start_server(tmp_path_factory, name, server_args(*path_args, *extra), env=env)
        yield proc
        proc.stop()

    return _server


def check_lossless(base_url: str, heldout_ids: list[list[int]], reference, concurrent: bool) -> dict:
    """Greedy outputs of a mode server vs the AR server's, sequentially or as one 16-concurrent
    burst: through the OpenAI client (completion text, the AR server's text through the same
    client) and through the native API (token ids, token for token). `reference` is the
    `ar_reference` fixture (or a bare list of token-id lists). Returns the native meta infos."""
    ref_ids = reference["output_ids"] if isinstance(reference, dict) else reference
    ref_texts = reference.get("texts") if isinstance(reference, dict) else None
    run = (lambda fn: burst(fn, heldout_ids, 16)) if concurrent else (lambda fn: [fn(ids) for ids in heldout_ids])
    bad = []
    if ref_texts is not None:
        texts = run(lambda ids: openai_complete(base_url, ids))
        for i, (got, want) in enumerate(zip(texts, ref_texts)):
            if got != want:
                bad.append(f"prompt {i} (openai client): got {got!r} want {want!r}")
    outs = run(lambda ids: native_generate(base_url, ids))
    for i, (o, ref) in enumerate(zip(outs, ref_ids)):
        got = o["output_ids"]
        if got != ref:
            k = first_mismatch(got, ref)
            bad.append(f"prompt {i}: first difference at token {k}: got {got[k:k + 4]} want {ref[k:k + 4]}")
    assert not bad, f"{len(bad)} outputs differ from AR greedy:\n" + "\n".join(bad)
    return {"metas": [o["meta_info"] for o in outs]}


# ------------------------------------------------------------------ fuzzed request mixes
#: the fuzz: a mix of FUZZ_SIZE requests per seed, each mix sent at once (concurrency FUZZ_SIZE)
FUZZ_SEEDS = (0, 1, 2)
FUZZ_SIZE = 24
#: a JSON object with a string and an integer member, both required
FUZZ_SCHEMA = json.dumps({"type": "object", "required": ["name", "n"],
                          "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}})
FUZZ_GRAMMARS = {
    "def": {"regex": r"(def|class) [a-z_]{2,12}\((self)?\):\n    [a-z]+"},
    # digits only: with min_new_tokens beyond a short match, no token is allowed once the digits
    # end but the stop token, which min_new_tokens holds back
    "digits": {"regex": r"[0-9]{1,6}"},
    "json": {"json_schema": FUZZ_SCHEMA},
}


#: requests whose constraints leave no allowed token, appended to every fuzzed mix, greedy and
#: sampled: a grammar that must end before min_new_tokens; logit_bias -100 on every token a
#: grammar allows (tiny-base's digit tokens are 19-28); stop strings that match at once
FUZZ_EDGES = [
    {"max_new_tokens": 16, "regex": r"[0-9]{1,6}", "min_new_tokens": 12},
    {"max_new_tokens": 8, "regex": r"[0-9]", "logit_bias": {str(t): -100.0 for t in range(19, 29)}},
    {"max_new_tokens": 8, "stop": [" ", "\n", "(", ")", ":", "=", "."]},
]


def _edge_requests() -> list[dict]:
    out = []
    for i, sp in enumerate(FUZZ_EDGES):
        for sampling in ({"temperature": 0}, {"temperature": 1.3, "sampling_seed": 7 + i}):
            out.append({"prompt": i, "return_logprob": True, "sampling_params": {**sp, **sampling}})
    return out


def fuzz_request():
    """A hypothesis strategy of one native /generate request over the held-out prompts: greedy or
    sampled (temperature 0.3-1.3, top_p, top_k, min_p, a seed), frequency / presence /
    repetition penalties, logit_bias (-100 included), stop strings, min_new_tokens, logprobs, and
    a regex or a JSON schema (one of them leaving no allowed token once its digits end)."""
    from hypothesis import strategies as st

    @st.composite
    def request(draw):
        def maybe(strategy):
            return draw(st.one_of(st.none(), strategy))

        max_new = draw(st.integers(4, 24))
        sp: dict = {"max_new_tokens": max_new, "temperature": 0}
        if draw(st.booleans()):
            sp["temperature"] = draw(st.sampled_from([0.3, 0.7, 1.0, 1.3]))
            sp["sampling_seed"] = draw(st.integers(0, 2**20))
            extra = {"top_p": maybe(st.sampled_from([0.5, 0.8, 0.95])), "top_k": maybe(st.integers(1, 50)),
                     "min_p": maybe(st.sampled_from([0.05, 0.2]))}
            sp.update({k: v for k, v in extra.items() if v is not None})
        rules = {"frequency_penalty": maybe(st.sampled_from([0.2, 0.6, 1.0])),
                 "presence_penalty": maybe(st.sampled_from([0.2, 0.8])),
                 "repetition_penalty": maybe(st.sampled_from([1.1, 1.3])),
                 "logit_bias": maybe(st.dictionaries(st.integers(0, 400).map(str), st.sampled_from([-100.0, -3.0, 3.0]),
                                                     min_size=1, max_size=3)),
                 "stop": maybe(st.lists(st.sampled_from(["\n\n", ")", " = ", "return", ":"]), min_size=1, max_size=2,
                                        unique=True)),
                 "min_new_tokens": maybe(st.integers(1, max_new))}
        sp.update({k: v for k, v in rules.items() if v is not None})
        grammar = maybe(st.sampled_from(sorted(FUZZ_GRAMMARS)))
        if grammar:
            sp.update(FUZZ_GRAMMARS[grammar])
        return {"prompt": draw(st.integers(0, NUM_PROMPTS - 1)), "return_logprob": draw(st.booleans()),
                "sampling_params": sp}

    return request()


def fuzz_mixes(seeds: tuple[int, ...] = FUZZ_SEEDS, size: int = FUZZ_SIZE) -> list[list[dict]]:
    """One mix per seed: `size` requests drawn from `fuzz_request`, then the FUZZ_EDGES requests;
    the same on every run: the AR server answers them once for the whole session, every mode
    server the same ones."""
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from hypothesis import strategies as st

    mixes: list[list[dict]] = []
    for s in seeds:
        drawn: list[list[dict]] = []

        @seed(s)
        @settings(max_examples=8, database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(fuzz_request(), min_size=size, max_size=size))
        def collect(mix):
            drawn.append(mix)

        collect()
        mixes.append(drawn[-1] + _edge_requests())  # the last draw: hypothesis starts simple
    return mixes


def fuzz_send(base_url: str, heldout_ids: list[list[int]], request: dict) -> tuple[int, dict | str]:
    """(HTTP status, the JSON answer or the error text) of one fuzzed request."""
    body = {"input_ids": heldout_ids[request["prompt"]], "sampling_params": request["sampling_params"]}
    if request["return_logprob"]:
        body["return_logprob"] = True
    try:
        return 200, post_json(base_url, "/generate", body)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:300]


#: the status recorded for a request that brought the stock AR server down
STOCK_AR_CRASHED = 0


def fuzz_answers(proc, mixes: list[list[dict]], heldout_ids: list[list[int]], restart) -> tuple[list, object]:
    """The AR server's answers to the fuzzed mixes, one request at a time. Stock SGLang's CPU
    sampler dies on some of them ("probability tensor contains either inf, nan or element < 0"
    in torch.multinomial); such a request is recorded as STOCK_AR_CRASHED and the server
    restarted (`restart()` returns a new one). Returns the answers and the server up at the end."""
    answers: list[list[tuple]] = [[] for _ in mixes]
    try:
        for mix, row in zip(mixes, answers):
            for r in mix:
                try:
                    row.append(one_alone(proc.base_url, lambda r: fuzz_send(proc.base_url, heldout_ids, r), r))
                except (urllib.error.URLError, ConnectionError, OSError):
                    row.append((STOCK_AR_CRASHED, "the stock AR server went down on this request"))
                    proc.stop()
                    proc = restart()
    except BaseException:
        proc.stop()
        raise
    return answers, proc


def fuzz_reference(proc, heldout_ids: list[list[int]], restart) -> tuple[dict, object]:
    mixes = fuzz_mixes()
    answers, proc = fuzz_answers(proc, mixes, heldout_ids, restart)
    return {"mixes": mixes, "answers": answers}, proc


def reference_engine_greedy(request: dict, heldout_ids: list[list[int]], model_path) -> list[int]:
    """The HF reference engine's greedy answer to a fuzzed request (its logits rules token by
    token, its grammar through xgrammar; stop strings not applied, so a server's answer that a
    stop string ended is a prefix of it)."""
    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.grammar import XGrammar

    engine, tok, stops = reference_engine(str(model_path))
    sp = request["sampling_params"]
    params = SamplingParams(frequency_penalty=sp.get("frequency_penalty", 0.0),
                            presence_penalty=sp.get("presence_penalty", 0.0),
                            repetition_penalty=sp.get("repetition_penalty", 1.0),
                            logit_bias=tuple((int(t), float(v)) for t, v in (sp.get("logit_bias") or {}).items()),
                            min_new_tokens=sp.get("min_new_tokens", 0))
    grammar = None
    if "regex" in sp or "json_schema" in sp:
        grammar = XGrammar.compile(tok, engine.model.config.vocab_size, regex=sp.get("regex"),
                                   json_schema=sp.get("json_schema"), stop_token_ids=stops)
    out = engine.generate([heldout_ids[request["prompt"]]], sp["max_new_tokens"], params,
                          stop_token_ids=stops, grammars=[grammar] if grammar else None)
    return out[0].token_ids


#: the count check_fuzz keeps of greedy answers where stock AR differs and the reference agrees
STOCK_AR_WRONG = "greedy: stock AR differs, the reference engine agrees"


def check_fuzz(base_url: str, heldout_ids: list[list[int]], reference: dict, model_path,
               mask_token_id: int | None = None, greedy_only: bool = False) -> dict:
    """Each fuzzed mix sent at once to a mode server against the AR server's answers: no 5xx; the
    same status as AR (a greedy-only mode answers sampled requests 400; where stock AR went down,
    any answer but a 5xx); greedy outputs token for token AR's with the same finish reason — or,
    where they differ, the reference engine's (stock SGLang's AR server carries penalty state
    from one request to the next now and then, and where a grammar must end before
    min_new_tokens its row is -inf everywhere and argmax emits token 0, where selfspec emits the
    likeliest stop token the grammar allows); no [MASK] token in any output or logprob;
    sampled outputs within max_new_tokens; then no KV held and the server still answering.
    Returns the count of answers per status (and of STOCK_AR_WRONG)."""
    problems: list[str] = []
    counts: dict = {}
    for m, (mix, want) in enumerate(zip(reference["fuzz"]["mixes"], reference["fuzz"]["answers"])):
        got = burst(lambda r: fuzz_send(base_url, heldout_ids, r), mix, len(mix))
        for k, (req, (status, body), (ar_status, ar_body)) in enumerate(zip(mix, got, want)):
            counts[status] = counts.get(status, 0) + 1
            sp = req["sampling_params"]
            sampled = sp["temperature"] > 0 and sp.get("top_k") != 1  # top_k 1 draws the argmax
            where = f"mix {m} request {k} {req}"
            expected = 400 if greedy_only and sampled and ar_status in (200, STOCK_AR_CRASHED) else ar_status
            if expected == STOCK_AR_CRASHED:
                expected = status if status < 500 else 200  # any answer but a server error
            if status >= 500 or status != expected:
                problems.append(f"{where}: HTTP {status} ({body}), AR {ar_status} ({str(ar_body)[:200]})")
                continue
            if status != 200:
                continue
            ids = body["output_ids"]
            logprob_ids = [t[1] for t in body["meta_info"].get("output_token_logprobs") or []]
            greedy_ar = ar_body["output_ids"] if not sampled and ar_status == 200 else None
            if mask_token_id is not None and mask_token_id in ids + logprob_ids and mask_token_id not in (greedy_ar or []):
                problems.append(f"{where}: the [MASK] token {mask_token_id} in the answer {ids}")
            if req["return_logprob"] and logprob_ids != ids:
                problems.append(f"{where}: logprob tokens {logprob_ids} are not the output {ids}")
            if len(ids) > sp["max_new_tokens"]:
                problems.append(f"{where}: {len(ids)} tokens beyond max_new_tokens")
            if greedy_ar is None:
                continue
            reason = (body["meta_info"]["finish_reason"] or {}).get("type")
            ar_reason = (ar_body["meta_info"]["finish_reason"] or {}).get("type")
            if ids == greedy_ar and reason == ar_reason:
                continue
            ref = reference_engine_greedy(req, heldout_ids, model_path)
            if ids == ref[: len(ids)] and (reason != "length" or len(ids) == len(ref)):
                counts[STOCK_AR_WRONG] = counts.get(STOCK_AR_WRONG, 0) + 1
                continue
            k0 = first_mismatch(ids, greedy_ar)
            problems.append(f"{where}: greedy output differs from AR's at token {k0}: got {ids} ({reason}) want "
                            f"{greedy_ar} ({ar_reason}); the reference engine gives {ref}")
    assert not problems, f"{len(problems)} fuzzed requests differ from the AR server:\n" + "\n".join(problems)
    assert wait_tokens_zero(base_url) == 0
    assert len(native_generate(base_url, heldout_ids[0], max_new_tokens=4)["output_ids"]) == 4
    return counts

# ------------------------------------------------------------------ checkpoints for the failure tests
def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def make_random_lora(base: Path, out: Path, rank: int = 8, seed: int = 0, base_sha256: str | None = None) -> Path:
    """A randomly initialised PEFT LoRA adapter over `base` (every projection; B != 0, so the
    adapter changes the MASK positions' outputs), with selfspec.json naming its base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, cfg)
    peft_model.save_pretrained(str(out))
    from selfspec.checkpoints.metadata import write_metadata
    from selfspec.checkpoints.metadata import weights_sha256 as checkpoint_sha256

    write_metadata(out, {"mode": "RISD", "base_model": str(base),
                         "lora": {"rank": rank, "targets": list(cfg.target_modules),
                                  "base_sha256": base_sha256 or checkpoint_sha256(base)}})
    return out


def launch_expect_failure(model: str | Path, extra_args: list[str], timeout: float = 300) -> tuple[int, str, float]:
    """Start a real server that must refuse to start; returns (exit code, output, seconds)."""
    spec = ServerSpec(str(model), port=free_port(), extra_args=list(extra_args))
    argv, env = spec.command()
    t0 = time.time()
    try:
        p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the server did not fail within {timeout} s: {str(e.output)[-2000:]}") from None
    return p.returncode, p.stdout, time.time() - t0


def resolve_in_process(argv: list[str]):
    """Parse and resolve SGLang server arguments in this process with the plugin loaded: runs the
    same validation the launcher runs before it starts any worker process."""
    from selfspec.sglang_ext import config as cfgmod

    for k in (cfgmod.FLAGS_ENV, cfgmod.RESOLVED_ENV):
        os.environ.pop(k, None)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.server_args import prepare_server_args

    try:
        sa = prepare_server_args(argv)
        sa.resolve_once()
        return sa
    finally:
        for k in (cfgmod.FLAGS_ENV, cfgmod.RESOLVED_ENV):
            os.environ.pop(k, None)


def python() -> str:
    return sys.executable
