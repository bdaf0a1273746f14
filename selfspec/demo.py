"""The README's main job: what selfspec buys, shown on this machine.

`python -m selfspec.demo [--model tiny-idlm] [--config serving_configs/tuned-<host>-isd.yaml]`

Serves the embedded I-DLM model twice with stock SGLang, one server at a time: first plain AR,
then ISD through the selfspec plugin with a tuned width plan (`selfspec tune`; the config
written for this host if there is one, else the committed one measured on a 2-core CPU). Both
answer the same prompts, greedy, first one at a time and then as one concurrent burst of other
prompts (held-out ones: ISD's context candidates draw on every answer its server has given,
`decoding/corpus.py`, so a burst of prompts it had just answered would replay those answers);
the demo prints ISD's answers, its tokens per forward, both servers' tok/s and their ratio, and
whether ISD's output equals AR's token for token (it must: ISD is lossless).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from selfspec.serving import ServerProcess, ServerSpec, ServeError

REPO = Path(__file__).resolve().parents[1]
CHAT_PROMPT = "Write a Python function that reverses a string."
# Ends mid-line: the BPE merges a newline with the indentation after it, so a prompt ending in
# a bare newline would start the model from a token boundary it never saw in training.
COMPLETION_PROMPTS = [
    'def list_python_files(root):\n    """Return the paths of all Python files under root."""\n'
    "    result = []\n    for",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description=",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self",
    "def read_config(path):\n    with open(path) as f:\n        data = json.load(f)\n    if",
]
BURST = 8  # concurrent requests in the burst (the plan picks the width for this batch size)
WARMUP_PROMPT = "def add(a, b):\n    return"  # asked first, answered nowhere else
HELDOUT = REPO / "bench" / "prompts" / "heldout.jsonl"


def burst_prompts() -> list[str]:
    """BURST held-out prompts, asked in the burst only."""
    lines = [line for line in HELDOUT.read_text().splitlines() if line.strip()]
    return [json.loads(line)["prompt"] for line in lines[:BURST]]


@dataclass
class Run:
    texts: list[str]
    token_ids: list[list[int]]
    seconds: float
    burst_seconds: float
    burst_ids: list[list[int]]
    forwards: int

    @property
    def burst_tokens(self) -> int:
        return sum(len(t) for t in self.burst_ids)

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def default_config() -> Path:
    host = socket.gethostname().split(".")[0]
    own = REPO / "serving_configs" / f"tuned-{host}-isd.yaml"
    return own if own.is_file() else REPO / "serving_configs" / "tuned-vm-isd.yaml"


def _ask(server: ServerProcess, prompts: list[str], max_tokens: int) -> Run:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="none")

    def one(prompt: str):
        return client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0)

    def ids(prompt: str) -> tuple[list[int], int]:
        body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens}}
        req = urllib.request.Request(server.base_url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        meta = out["meta_info"]
        return out["output_ids"], int(meta.get("selfspec_forwards") or meta.get("completion_tokens", 0))

    one(WARMUP_PROMPT)
    t0 = time.perf_counter()
    got = [ids(p) for p in prompts]
    seconds = time.perf_counter() - t0
    burst = burst_prompts()
    with ThreadPoolExecutor(len(burst)) as ex:
        t0 = time.perf_counter()
        burst_out = list(ex.map(ids, burst))
        burst_seconds = time.perf_counter() - t0
    texts = [one(p).choices[0].text for p in prompts]  # through the OpenAI client, after the timing
    return Run(texts, [g[0] for g in got], seconds, burst_seconds, [b[0] for b in burst_out],
               sum(g[1] for g in got))


def _serve(model: str, args: list[str], name: str, prompts: list[str], max_tokens: int) -> Run:
    log = Path(tempfile.mkdtemp(prefix=f"selfspec-demo-{name}-")) / "sglang.log"
    print(f"starting SGLang ({name}) with {model} (log: {log}) ...", flush=True)
    started = time.perf_counter()
    with ServerProcess(ServerSpec(model, port=None, extra_args=args), log_path=log, startup_timeout=900) as server:
        print(f"  ready on {server.base_url} in {time.perf_counter() - started:.0f} s; {len(prompts)} prompts one at a time, "
              f"then {BURST} held-out prompts at once", flush=True)
        return _ask(server, prompts, max_tokens)


def run_demo(model: str, config: Path, max_tokens: int, extra: list[str]) -> bool:
    from transformers import AutoTokenizer

    from selfspec.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], tokenize=False,
                                   add_generation_prompt=True)
    prompts = [chat, *COMPLETION_PROMPTS]
    ar = _serve(model, list(extra), "AR", prompts, max_tokens)
    isd = _serve(model, ["--speculative-algorithm", "ISD", "--selfspec-config", str(config), *extra],
                 f"ISD, plan {config.name}", prompts, max_tokens)
    print()
    for prompt, text in zip(prompts, isd.texts):
        if prompt is chat:
            print(f"== chat: {CHAT_PROMPT}\n{text.strip()}\n")
        else:
            print(f"== completion:\n{prompt}{text.rstrip()}\n")
    same = sum(a == b for a, b in zip(ar.token_ids, isd.token_ids))
    same_burst = sum(a == b for a, b in zip(ar.burst_ids, isd.burst_ids))
    one_ratio = (isd.tokens / isd.seconds) / (ar.tokens / ar.seconds)
    burst_ratio = (isd.burst_tokens / isd.burst_seconds) / (ar.burst_tokens / ar.burst_seconds)
    print(f"{'':22s}{'AR':>10s}{'ISD':>10s}")
    print(f"{'one at a time, tok/s':22s}{ar.tokens / ar.seconds:10.1f}{isd.tokens / isd.seconds:10.1f}   "
          f"ISD = {one_ratio:.2f}x AR")
    print(f"{f'{BURST} at once, tok/s':22s}{ar.burst_tokens / ar.burst_seconds:10.1f}"
          f"{isd.burst_tokens / isd.burst_seconds:10.1f}   ISD = {burst_ratio:.2f}x AR")
    print(f"{'tokens per forward':22s}{1.0:10.2f}{isd.tokens / max(isd.forwards, 1):10.2f}")
    print(f"greedy output identical to AR's, token for token: {same}/{len(prompts)} prompts, "
          f"{same_burst}/{len(isd.burst_ids)} in the burst")
    for batch in (1, BURST):
        print(f"plan at batch {batch}: {plan_step(config, batch)}")
    return same == len(prompts) and same_burst == len(isd.burst_ids)


def plan_step(config: Path, batch: int) -> str:
    """What the ISD plan of `config` runs for a greedy batch of `batch` requests, in words: the
    tuner may give a batch size lookup steps (the context candidate alone) or AR steps where
    ISD's own proposals do not pay on this machine."""
    from selfspec.decoding.width_plan import WidthPlan
    from selfspec.sglang_ext.config import load_yaml_config

    data = load_yaml_config(config).get("plan")
    if data is None:
        return "ISD steps (no width plan)"
    plan = WidthPlan.from_dict(data, "isd")
    b = plan.greedy[plan.bucket(batch, False)]
    opts = ", ".join(f"{k}={v}" for k, v in b.options.items() if k != "match_sizes")
    kind = {"ngram": "lookup steps", "ar": "plain AR steps"}.get(b.mode, f"{b.mode.upper()} steps")
    return f"{kind}{' (' + opts + ')' if opts else ''}"


def main(argv: list[str] | None = None) -> int:
    from selfspec.serving import split_passthrough

    argv, extra = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog="python -m selfspec.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-idlm", help="an I-DLM checkpoint (default: the embedded tiny-idlm)")
    parser.add_argument("--config", default=None, help="ISD serving config with a width plan "
                        "(default: serving_configs/tuned-<host>-isd.yaml, else the committed 2-core CPU one)")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    config = Path(args.config) if args.config else default_config()
    if not config.is_file():
        print(f"demo: --config {config}: no such file (write one with `selfspec tune --model {args.model}`)",
              file=sys.stderr)
        return 2
    try:
        return 0 if run_demo(args.model, config, args.max_tokens, extra) else 1
    except (ServeError, ValueError) as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
