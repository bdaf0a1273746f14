"""Jacobi trajectories of a model's own greedy responses: the training data of Jacobi Forcing.

    selfspec train jf-trajectories --model M [--prompts FILE | --data SRC ...] --block-size n --out DIR

For every prompt: the model's greedy AR response (HF engine, `new_tokens` tokens, not cut at
EOS; the first EOS is recorded and nothing after it is trained on), cut into T blocks of n.
Block j starts from an initial draft — its first token is the correct one (the prefill's argmax
or the previous block's bonus token), the other n-1 are drawn with replacement from the context's
own tokens (prompt + earlier blocks; `decoding.modes.jacobi.context_draft`), as the reference code
does — and is iterated by greedy Jacobi until it reaches its fixed point. Every state is kept,
the first being the initial draft (a copy: the public reference stores a tensor that later
iterations overwrite, so its "initial" state is really the fixed point).

Batched: earlier blocks of a response are already at their fixed points (they are the greedy
response), so all T blocks of a batch of prompts iterate together in one forward of the
clean-context row (`masks` context "cllm": a noisy block sees the prompt, the clean earlier
blocks and itself causally), which is exactly one Jacobi step of each block. The same forward's
clean rows are a plain causal forward of prompt + response: their argmax must reproduce the
response (the fixed point equals greedy AR; asserted per sample; a sample where the HF engine's
KV-cached AR and the packed forward disagree on a near-tie is dropped and counted, and more than
2% dropped is an error).

Prompts: by default cuts of `prompt_tokens` tokens from the training split of the stdlib corpus
(held-out trajectories from the held-out split); `--data` text / JSONL / chat sources (chat and
prompt/response records: the prompt as the chat template renders it, the response the model's
own); `--prompts FILE` (JSONL with a "prompt" field, the last `--heldout-prompts` held out).

Storage: `DIR/manifest.json` (settings, model fingerprint, counts) and JSONL shards
`DIR/train/shard-00000.jsonl`, `DIR/heldout/shard-00000.jsonl`, one trajectory per line
(`data.Trajectory.to_record`). JSONL because a shard is streamed, appended and read with no
library (and diffable by eye); shards because collection is resumable at shard granularity: a
shard is written to a temporary file and renamed when complete, and a rerun skips the shards
that exist (the manifest must match, or the run refuses to mix settings).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfspec.decoding.modes.jacobi import context_draft
from selfspec.errors import UsageError
from selfspec.training import config as C
from selfspec.training.config import option
from selfspec.training.jacobi_forcing.data import Trajectory, pack
from selfspec.training.jacobi_forcing.forward import jacobi_update
from selfspec.training.jacobi_forcing.masks import dense_mask, plain_row

MAX_DROPPED = 0.02


@dataclass(kw_only=True)
class TrajectoryConfig:
    """Jacobi trajectories"""

    model: str = option(help="the model whose greedy Jacobi trajectories are recorded (embedded name or directory)")
    out: str = option(help="output directory (manifest.json + train/ and heldout/ JSONL shards)")
    block_size: int = option(8, help="n: tokens per Jacobi block")
    new_tokens: int = option(128, help="greedy response tokens per prompt (a multiple of --block-size)")
    prompt_tokens: int = option(64, help="prompt length of corpus cuts")
    num_prompts: int = option(1024, help="training prompts")
    heldout_prompts: int = option(64, help="held-out prompts (for the training's evaluation)")
    prompts: str | None = option(None, help="JSONL file with a 'prompt' field per line instead of corpus cuts")
    data: list[str] | None = option(
        None, nargs="+", help="'stdlib' (default) or text / JSONL / chat files or directories to take prompts from")
    batch_size: int = option(16, help="prompts per batched Jacobi forward")
    shard_size: int = option(256, help="trajectories per shard (the unit of resumption)")
    seed: int = option(0, help="seed of the prompt cuts and of the initial drafts")
    threads: int | None = option(None, help="torch CPU threads")
    progress_bar: bool = option(True, help="no tqdm progress bar")

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise UsageError(f"--block-size {self.block_size}: a Jacobi block needs at least 2 tokens")
        if self.new_tokens < self.block_size or self.new_tokens % self.block_size:
            raise UsageError(f"--new-tokens {self.new_tokens} must be a positive multiple of --block-size "
                             f"{self.block_size}")
        if self.prompts is not None and not Path(self.prompts).expanduser().is_file():
            raise UsageError(f"--prompts {self.prompts}: no such file (give a JSONL file with a 'prompt' field)")
        for source in self.data or []:
            if source != "stdlib" and not Path(source).expanduser().exists():
                raise UsageError(f"--data {source}: no such file or directory")
        if self.prompts is not None and self.data:
            raise UsageError("give --prompts or --data, not both")


# ------------------------------------------------------------------------------ prompts
def _cuts(stream: torch.Tensor, num: int, length: int, generator: torch.Generator) -> list[list[int]]:
    if len(stream) <= length:
        raise UsageError(f"the data has {len(stream)} tokens, fewer than one {length}-token prompt")
    starts = torch.randint(0, len(stream) - length, (num,), generator=generator).tolist()
    return [stream[s : s + length].tolist() for s in starts]


def _chat_prompts(dataset, num: int) -> list[list[int]]:
    """The prompt part (up to the first trained token) of chat / prompt-response documents."""
    out = []
    for doc in dataset.docs:
        first = next((i for i, code in enumerate(doc.loss) if code), None)
        if first:
            out.append(doc.ids[:first])
        if len(out) == num:
            break
    return out


def load_prompt_ids(cfg: TrajectoryConfig, tokenizer) -> tuple[list[list[int]], list[list[int]], dict]:
    """(train prompts, held-out prompts, description)."""
    if cfg.prompts is not None:
        from selfspec.prompts import load_prompt_set

        texts = load_prompt_set(str(cfg.prompts))
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        ids = [p for p in ids if p]
        held = ids[-cfg.heldout_prompts:] if cfg.heldout_prompts else []
        train = ids[: len(ids) - len(held)][: cfg.num_prompts]
        return train, held, {"prompts": str(cfg.prompts), "lines": len(texts)}
    from selfspec.training.data import load_data

    splits = load_data(tokenizer, cfg.data)
    parts = []
    for k, (dataset, num) in enumerate(((splits.train, cfg.num_prompts), (splits.heldout, cfg.heldout_prompts))):
        gen = torch.Generator().manual_seed(cfg.seed * 2 + k)  # held-out cuts do not depend on --num-prompts
        datasets = getattr(dataset, "parts", [dataset])
        if any(d.chat for d in datasets):
            parts.append([p for d in datasets for p in _chat_prompts(d, num)][:num])
        else:
            stream = torch.cat([d.stream for d in datasets])
            parts.append(_cuts(stream, num, cfg.prompt_tokens, gen))
    return parts[0], parts[1], {"data": splits.description, "prompt_tokens": cfg.prompt_tokens}


# ------------------------------------------------------------------------------ collection
def greedy_responses(engine, prompts: list[list[int]], new_tokens: int, batch_size: int) -> list[list[int]]:
    """The model's greedy AR responses on the HF engine, `new_tokens` each (EOS does not stop)."""
    outs = engine.generate(prompts, max_new_tokens=new_tokens, mode="ar", stop_token_ids=[], batch_size=batch_size)
    return [o.token_ids for o in outs]


def initial_drafts(prompts: list[list[int]], responses: list[list[int]], n: int, salt: int) -> torch.Tensor:
    """[B, T, n]: block j = [its correct first token, n-1 tokens drawn from prompt + earlier blocks]."""
    out = []
    for p, r in zip(prompts, responses):
        blocks = []
        for j in range(len(r) // n):
            context = p + r[: j * n]
            blocks.append([r[j * n]] + context_draft(context, n - 1, salt))
        out.append(blocks)
    return torch.tensor(out, dtype=torch.long)


def _cached_step_mask(batch, device) -> torch.Tensor:
    """[B, 1, Tn, P + 2Tn]: what the noisy blocks see when the prompt + response (the plain row,
    P + Tn keys) is in the KV cache and the T noisy blocks follow it. The same CLLM predicate of
    `masks`, read through the map from this order to the packed row's."""
    layout = batch.layout
    P = layout.prompt_len
    full = dense_mask(layout, batch.prompt_lens, device)  # [B, 1, L, L] in the packed order
    keys = torch.cat([torch.arange(P, device=device), layout.clean_indices(device).flatten(),
                      layout.noisy_indices(device).flatten()])
    queries = layout.noisy_indices(device).flatten()
    return full[:, :, queries][:, :, :, keys]


@torch.no_grad()
def jacobi_trajectories(model, prompts: list[list[int]], responses: list[list[int]], n: int, pad_id: int,
                        salt: int = 0, eos_id: int | None = None) -> tuple[list[Trajectory | None], int]:
    """Trajectories of one batch (None where a sample is dropped) and the Jacobi forwards run.

    The prompt + response is forwarded once (its clean rows checked against the response) and
    kept in the KV cache; each Jacobi step then forwards only the T noisy blocks."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    bsz = len(prompts)
    clean = torch.tensor(responses, dtype=torch.long).view(bsz, -1, n)
    T = clean.shape[1]
    cur = initial_drafts(prompts, responses, n, salt)
    batch = pack(prompts, cur, clean, pad_id, context="cllm")
    layout = batch.layout
    P = layout.prompt_len
    plain_pos, plain_mask = plain_row(layout, batch.prompt_lens, device)
    cache = DynamicCache()
    out = model(input_ids=batch.plain_ids.to(device), position_ids=plain_pos.to(device), attention_mask=plain_mask,
                past_key_values=cache, use_cache=True)
    greedy = out.logits[:, P - 1 : -1].argmax(-1).cpu()
    ok = [torch.equal(greedy[b], clean[b].flatten()) for b in range(bsz)]  # the fixed point is greedy AR
    step_mask = _cached_step_mask(batch, device)
    noisy_pos = batch.position_ids[:, layout.noisy_indices().flatten()].to(device)

    states = [[[cur[b, j].tolist()] for j in range(T)] for b in range(bsz)]
    done = (cur == clean).all(-1)
    forwards = 1
    for _ in range(n + 1):
        if bool(done.all()):
            break
        logits = model(input_ids=cur.view(bsz, -1).to(device), position_ids=noisy_pos, attention_mask=step_mask,
                       past_key_values=cache, use_cache=True).logits
        cache.crop(P + T * n)
        forwards += 1
        new = jacobi_update(logits.view(bsz, T, n, -1).cpu(), cur)
        new[done] = cur[done]
        stuck = (new == cur).all(-1) & ~done  # converged somewhere other than the response
        rows = new.tolist()
        for b, j in (~done).nonzero().tolist():
            ok[b] = ok[b] and not bool(stuck[b, j])
            states[b][j].append(rows[b][j])
        cur = new
        done = (cur == clean).all(-1)
    trajs = []
    for b in range(bsz):
        if not (ok[b] and bool(done[b].all())):
            trajs.append(None)
            continue
        eos_at = responses[b].index(eos_id) if eos_id is not None and eos_id in responses[b] else None
        trajs.append(Trajectory(list(prompts[b]), list(responses[b]), states[b], eos_at))
    return trajs, forwards


def _fingerprint(path: Path) -> str:
    from selfspec.checkpoints.metadata import weights_sha256

    try:
        return weights_sha256(path)
    except FileNotFoundError:
        return "unknown"


def collect(cfg: TrajectoryConfig) -> dict:
    """Collect (or finish collecting) the trajectories of `cfg`; returns the manifest."""
    from selfspec.engines.hf import HFEngine
    from selfspec.models import resolve_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    started = time.time()
    out = Path(cfg.out)
    engine = HFEngine.from_pretrained(cfg.model, dtype=torch.float32)
    tokenizer = engine.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = engine.default_stop_ids()
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("out", "threads", "progress_bar", "batch_size")}
    settings["model_sha256"] = _fingerprint(resolve_model(cfg.model))
    manifest_file = out / "manifest.json"
    if manifest_file.exists():
        old = json.loads(manifest_file.read_text())
        if old.get("settings") != settings:
            raise UsageError(f"{out} holds trajectories collected with other settings ({manifest_file}); "
                             "give another --out or delete it")
    train, held, description = load_prompt_ids(cfg, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"settings": settings, "prompts": description, "format": "jsonl shards of data.Trajectory records",
                "splits": {}}
    manifest_file.write_text(json.dumps(manifest, indent=2) + "\n")
    totals = {"forwards": 0, "dropped": 0, "kept": 0}
    for split, prompts in (("train", train), ("heldout", held)):
        shards = [prompts[i : i + cfg.shard_size] for i in range(0, len(prompts), cfg.shard_size)]
        bar = tqdm(total=len(prompts), desc=f"jacobi trajectories ({split}, n={cfg.block_size})", unit="prompt",
                   disable=not cfg.progress_bar, dynamic_ncols=True)
        counts = {"kept": 0, "dropped": 0, "states": 0, "blocks": 0}
        for k, shard_prompts in enumerate(shards):
            file = out / split / f"shard-{k:05d}.jsonl"
            if file.exists():
                for tr in read_shard(file):
                    counts["kept"] += 1
                    counts["blocks"] += tr.num_blocks
                    counts["states"] += sum(len(s) for s in tr.states)
                counts["dropped"] += len(shard_prompts) - sum(1 for _ in file.open())
                bar.update(len(shard_prompts))
                continue
            lines = []
            for i in range(0, len(shard_prompts), cfg.batch_size):
                batch = shard_prompts[i : i + cfg.batch_size]
                responses = greedy_responses(engine, batch, cfg.new_tokens, cfg.batch_size)
                salt = cfg.seed * 1_000_003 + k * cfg.shard_size + i
                trajs, fwd = jacobi_trajectories(engine.model, batch, responses, cfg.block_size, pad_id,
                                                 salt=salt, eos_id=eos[0] if eos else None)
                totals["forwards"] += fwd
                for tr in trajs:
                    if tr is None:
                        counts["dropped"] += 1
                        continue
                    counts["kept"] += 1
                    counts["blocks"] += tr.num_blocks
                    counts["states"] += sum(len(s) for s in tr.states)
                    lines.append(json.dumps(tr.to_record()))
                bar.update(len(batch))
                bar.set_postfix(states_per_block=f"{counts['states'] / max(1, counts['blocks']):.2f}",
                                dropped=counts["dropped"])
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in lines))
            tmp.rename(file)
        bar.close()
        if counts["dropped"] > MAX_DROPPED * max(1, len(prompts)):
            raise RuntimeError(f"{counts['dropped']} of {len(prompts)} {split} samples dropped: the Jacobi fixed "
                               "point did not reproduce the model's greedy AR response; check the model's "
                               "attention implementation (it must honour a 4-D attention mask)")
        # Jacobi steps per block = recorded states - 1 (the initial draft is not a step)
        counts["jacobi_tpf"] = cfg.block_size * counts["blocks"] / max(1, counts["states"] - counts["blocks"])
        manifest["splits"][split] = counts
    manifest["seconds"] = round(time.time() - started, 1)
    manifest_file.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_shard(file: Path) -> list[Trajectory]:
    return [Trajectory.from_record(json.loads(line)) for line in file.read_text().splitlines() if line.strip()]


def load_trajectories(directory: str | Path, split: str = "train") -> list[Trajectory]:
    root = Path(directory) / split
    files = sorted(root.glob("shard-*.jsonl"))
    if not files:
        raise UsageError(f"no {split} trajectories in {directory} (collect them with `selfspec train jf-trajectories`)")
    return [tr for f in files for tr in read_shard(f)]


def is_complete(directory: str | Path) -> bool:
    file = Path(directory) / "manifest.json"
    return file.exists() and "seconds" in json.loads(file.read_text())


# ------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_arguments(parser, TrajectoryConfig)


def run(args: argparse.Namespace) -> int:
    manifest = collect(C.from_args(TrajectoryConfig, args))
    for split, c in manifest["splits"].items():
        print(f"{split}: {c['kept']} trajectories ({c['dropped']} dropped), {c['states'] / max(1, c['blocks']):.2f} "
              f"states per block, plain-Jacobi tokens per step {c['jacobi_tpf']:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.training.jacobi_forcing.trajectories", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
