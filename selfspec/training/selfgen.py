"""On-policy data for the MASK positions: a model's own greedy continuations.

ISD / RISD accept a proposal when it equals what the verify positions predict, and under greedy
decoding those predictions are the model's own greedy continuation, not the corpus. This writes
JSONL records `{"prefix_ids": [...], "ids": [...], "clean_loss": false}`: a prompt cut at a
random place of the training split (no loss) and the model's greedy continuation of it, in
token ids as generated. Training mixes them with the corpus
(`--data stdlib FILE --data-weights ...`); `clean_loss: false` keeps them out of the clean
(AR) half's loss, so the verify distribution is still learned from the corpus only.

    python -m selfspec.training.selfgen --model tiny-base --out runs/selfgen/tiny-base.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def generate_selfgen(model: str, out: Path, num: int = 1024, prompt_tokens: int = 128, new_tokens: int = 128,
                     batch_size: int = 64, seed: int = 0) -> dict:
    """Greedy continuations with transformers' `generate` (every prompt has the same length, so
    no padding is involved; float32, the same greedy argmax as the HF engine's AR mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.models import resolve_model
    from selfspec.training.data import load_data

    started = time.time()
    path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    stops = lm.generation_config.eos_token_id
    stops = set([stops] if isinstance(stops, int) else (stops or []))
    stream = load_data(tokenizer, ["stdlib"]).train.stream
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - prompt_tokens, (num,), generator=gen).tolist()
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = 0
    from tqdm.auto import tqdm

    bar = tqdm(total=num, desc="selfgen (greedy continuations)", unit="seq")
    with open(out, "w") as f, torch.no_grad():
        for i in range(0, num, batch_size):
            x = torch.stack([stream[s : s + prompt_tokens] for s in starts[i : i + batch_size]])
            seqs = lm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=tokenizer.pad_token_id)
            for p, row in zip(x.tolist(), seqs[:, prompt_tokens:].tolist()):
                cont = []
                for t in row:
                    cont.append(t)
                    if t in stops:
                        break
                f.write(json.dumps({"prefix_ids": p, "ids": cont, "clean_loss": False}) + "\n")
                tokens += len(cont)
            bar.update(len(x))
            bar.set_postfix(tokens=f"{tokens:,}")
    bar.close()
    return {"model": model, "file": str(out), "num": num, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "seed": seed, "tokens": tokens, "seconds": round(time.time() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.training.selfgen", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-base")
    parser.add_argument("--out", required=True)
    parser.add_argument("--num", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    info = generate_selfgen(args.model, Path(args.out), args.num, args.prompt_tokens, args.new_tokens,
                            args.batch_size, args.seed)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
