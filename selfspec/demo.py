"""The README's main job: serve the embedded model with SGLang + selfspec, talk to it, stop.

`python -m selfspec.demo [--model tiny-base] [-- extra SGLang args]`
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from selfspec.serving import ServerProcess, ServerSpec, ServeError, free_port, split_passthrough

CHAT_PROMPT = "Write a Python function that reverses a string."
# Ends mid-line: the BPE merges a newline with the indentation after it, so a prompt ending in
# a bare newline would start the model from a token boundary it never saw in training.
COMPLETION_PROMPT = (
    'def list_python_files(root):\n    """Return the paths of all Python files under root."""\n'
    "    result = []\n    for"
)


def run_demo(model: str, extra_args: list[str], max_tokens: int) -> None:
    from openai import OpenAI

    port = free_port()
    log = Path(tempfile.gettempdir()) / f"selfspec-demo-{port}.log"
    print(f"starting SGLang on 127.0.0.1:{port} with model {model} (log: {log}) ...", flush=True)
    started = time.perf_counter()
    with ServerProcess(ServerSpec(model, port=port, extra_args=extra_args), log_path=log) as server:
        print(f"server ready in {time.perf_counter() - started:.0f} s\n", flush=True)
        client = OpenAI(base_url=server.base_url + "/v1", api_key="none")

        t0 = time.perf_counter()
        chat = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": CHAT_PROMPT}], max_tokens=max_tokens, temperature=0
        )
        chat_s = time.perf_counter() - t0
        print(f"== chat: {CHAT_PROMPT}\n{chat.choices[0].message.content}")
        print(f"-- {chat.usage.completion_tokens} tokens, {chat.usage.completion_tokens / chat_s:.1f} tok/s\n")

        t0 = time.perf_counter()
        comp = client.completions.create(model="default", prompt=COMPLETION_PROMPT, max_tokens=max_tokens, temperature=0)
        comp_s = time.perf_counter() - t0
        print(f"== completion:\n{COMPLETION_PROMPT}{comp.choices[0].text}")
        print(f"-- {comp.usage.completion_tokens} tokens, {comp.usage.completion_tokens / comp_s:.1f} tok/s\n")
    print("server stopped.")


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog="python -m selfspec.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-base")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    try:
        run_demo(args.model, extra, args.max_tokens)
    except (ServeError, ValueError) as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
