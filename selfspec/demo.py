"""The README's main job: what selfspec buys at its defaults, and where it comes from.

`python -m selfspec.demo [--model tiny-idlm] [--max-tokens 96] [-- EXTRA SGLANG FLAGS]`

Serves the embedded I-DLM model with stock SGLang, one server at a time: plain AR (no
speculative algorithm), then ISD through the selfspec plugin with no plan file — first with one
part of its default policy at a time (`--selfspec-policy`: plain AR steps on the selfspec
worker, lookup steps only, ISD's own steps only), then the default itself. Every server answers
the same requests: a few prompts one at a time, then a burst of held-out prompts at once (the
`eval` set: ISD's context candidates draw on every answer its server has given, so a burst of
prompts it had just answered would replay those answers), greedy and at temperature 0.7 (seeded).
It prints the default's answers (which of them end in a repetition loop, and at least one that
does not), each server's tok/s over stock AR's with its tokens per forward, and whether the
greedy outputs equal stock AR's token for token (they must: every mode here is lossless).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from selfspec.serving import ServerProcess, ServerSpec, ServeError

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
BURST = 8  # concurrent requests in a burst
WARMUP_PROMPT = "def add(a, b):\n    return"  # asked first, answered nowhere else
TEMPERATURE = 0.7
#: (label, extra server flags): stock AR first (the reference), then the default's parts, then it
ROWS = (
    ("stock AR", []),
    ("ISD: AR steps only", ["--speculative-algorithm", "ISD", "--selfspec-policy", "ar"]),
    ("ISD: lookup steps only", ["--speculative-algorithm", "ISD", "--selfspec-policy", "lookup"]),
    ("ISD: own steps only", ["--speculative-algorithm", "ISD", "--selfspec-policy", "own"]),
    ("ISD default", ["--speculative-algorithm", "ISD"]),
)


def burst_prompts(offset: int) -> list[str]:
    """BURST prompts of the `eval` set from `offset`, each asked in one burst only."""
    from selfspec.prompts import load_prompt_set

    return load_prompt_set("eval")[offset : offset + BURST]


@dataclass
class Pass:
    """One way of asking (one at a time or a burst, greedy or sampled): outputs and wall time."""

    token_ids: list[list[int]] = field(default_factory=list)
    forwards: int = 0
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tpf(self) -> float:
        return self.tokens / max(self.forwards, 1)


def _generate(base_url: str, prompt: str, max_tokens: int, temperature: float, seed: int) -> tuple[list[int], int]:
    params = {"temperature": temperature, "max_new_tokens": max_tokens, "sampling_seed": seed}
    body = {"text": prompt, "sampling_params": params}
    req = urllib.request.Request(base_url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    meta = out["meta_info"]
    return out["output_ids"], int(meta.get("selfspec_forwards") or meta.get("completion_tokens", 0))


def _ask(base_url: str, prompts: list[str], max_tokens: int, temperature: float, concurrent: bool) -> Pass:
    def one(i: int) -> tuple[list[int], int]:
        return _generate(base_url, prompts[i], max_tokens, temperature, seed=1000 + i)

    t0 = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(prompts)) as ex:
            got = list(ex.map(one, range(len(prompts))))
    else:
        got = [one(i) for i in range(len(prompts))]
    return Pass([g[0] for g in got], sum(g[1] for g in got), time.perf_counter() - t0)


#: the four passes every server runs: (name, one at a time?, temperature, burst prompts' offset)
PASSES = (("one greedy", False, 0.0, 0), ("burst greedy", True, 0.0, 0),
          ("one T=0.7", False, TEMPERATURE, 0), ("burst T=0.7", True, TEMPERATURE, BURST))


def _serve(model: str, label: str, args: list[str], prompts: list[str], max_tokens: int) -> dict[str, Pass]:
    log = Path(tempfile.mkdtemp(prefix="selfspec-demo-")) / "sglang.log"
    print(f"starting SGLang ({label}) with {model} (log: {log}) ...", flush=True)
    started = time.perf_counter()
    with ServerProcess(ServerSpec(model, port=None, extra_args=args), log_path=log, startup_timeout=900) as server:
        print(f"  ready in {time.perf_counter() - started:.0f} s", flush=True)
        _generate(server.base_url, WARMUP_PROMPT, 8, 0.0, 0)
        return {name: _ask(server.base_url, burst_prompts(offset) if concurrent else prompts, max_tokens,
                           temperature, concurrent)
                for name, concurrent, temperature, offset in PASSES}


def _show_answers(tok, prompts: list[str], answers: list[list[int]]) -> None:
    from selfspec.benchmarks.repetition import is_repetition_loop

    loops = [is_repetition_loop(a) for a in answers]
    shown = [i for i in range(len(prompts)) if not loops[i]][:2] or [0]
    for i in shown:
        print(f"== {'does not loop' if not loops[i] else 'loops'}: prompt {i + 1} and the default's greedy answer\n"
              f"{prompts[i]}{tok.decode(answers[i], skip_special_tokens=True).rstrip()}\n")
    print(f"{sum(loops)} of the {len(prompts)} greedy answers end in a repetition loop (the tiny model's habit; "
          "lookup steps copy loops, which flatters them)\n")


def run_demo(model: str, max_tokens: int, extra: list[str]) -> bool:
    from transformers import AutoTokenizer

    from selfspec.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    chat = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], tokenize=False,
                                   add_generation_prompt=True)
    prompts = [chat, *COMPLETION_PROMPTS]
    results = {label: _serve(model, label, [*args, *extra], prompts, max_tokens) for label, args in ROWS}
    ar, default = results["stock AR"], results["ISD default"]
    print()
    _show_answers(tok, prompts, default["one greedy"].token_ids)
    names = [name for name, *_ in PASSES]
    print(f"{'output tok/s x stock AR (TPF)':26s}" + "".join(f"{n:>17s}" for n in names))
    for label, passes in results.items():
        cells = [f"{passes[n].tok_s / ar[n].tok_s:.2f}x ({passes[n].tpf:.2f})" for n in names]
        print(f"{label:26s}" + "".join(f"{c:>17s}" for c in cells))
    print(f"{'stock AR tok/s':26s}" + "".join(f"{ar[n].tok_s:17.1f}" for n in names))
    exact = True
    for label, passes in results.items():
        same = sum(a == b for n in ("one greedy", "burst greedy")
                   for a, b in zip(passes[n].token_ids, ar[n].token_ids))
        total = len(prompts) + BURST
        exact &= same == total
        if label != "stock AR":
            print(f"{label}: greedy outputs identical to stock AR's: {same}/{total}")
    print("Where the default's speed comes from: 'AR steps only' is the selfspec worker's own one-token step "
          "against stock AR's; 'lookup' and 'own' each run one kind of speculative step at every batch size; "
          "the default runs ISD's own step (with the context candidate) one request at a time, lookup steps in "
          "greedy bursts and AR steps in sampled ones, and switches to AR steps wherever they measure faster.")
    return exact


def main(argv: list[str] | None = None) -> int:
    from selfspec.serving import split_passthrough

    argv, extra = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog="python -m selfspec.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-idlm", help="an I-DLM checkpoint (default: the embedded tiny-idlm)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per answer (default 96)")
    args = parser.parse_args(argv)
    try:
        return 0 if run_demo(args.model, args.max_tokens, extra) else 1
    except (ServeError, ValueError) as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
