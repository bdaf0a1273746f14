"""Jacobi Forcing: train a causal LM on its own Jacobi trajectories so that greedy Jacobi decoding
(`--speculative-algorithm JACOBI`) fixes several tokens per forward (the method of *Fast and
Accurate Causal Parallel Decoding using Jacobi Forcing*).

    selfspec train jf --base M [--rounds 8:8,16:8] [--schedule progressive] [--context nc] --out DIR

A round (block size n, window w):
1. trajectories of the round's starting model (`selfspec.training.jacobi_forcing.trajectories`, collected
   first unless `--trajectories` names a finished collection);
2. training on the shared loop (`selfspec.training.loop`): each row packs the prompt and, for
   every block, a recorded noisy state beside its fixed point (`data`; the state picked at
   the schedule's target noise, re-picked each epoch with a phase), attention from `masks`
   (`--context nc`: noisy blocks see earlier noisy blocks, `nc_ic`, `cllm`), loss from
   `losses` (progressive consistency + `--ar-weight` AR CE + `--anchor-weight` KL to the
   frozen starting model).
`--rounds "8:8,16:8"` runs rounds in order, each starting from the previous round's model and
collecting new trajectories with it at the new block size (work files under the checkpoint
directory: `round-K/{trajectories,model,checkpoints}`); the time budget and steps are shared by
`--round-fractions`. The last round exports to --out with a `selfspec.json` of mode "jacobi"
and the recommended JACOBI settings, so SGLang and the HF engine need no flags.

Held-out evaluation (before training and every --eval-every steps), on the held-out
trajectories of the round's starting model, in the clean-context layout (one Jacobi step of a
block after committed blocks, as at inference):
- `gain_by_noise`: one-step Jacobi gain, new correct prefix minus old, per noise quartile (a
  model that was never trained for it gains about 1.0: only the token after the correct prefix);
- `accuracy_by_offset`: the share of correct tokens at offset m after the first error (m = 0 is
  the AR token itself; m >= 1 is what Jacobi Forcing teaches);
- the consistency loss under the training layout, and AR perplexity on the held-out corpus.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from selfspec.checkpoints.metadata import JacobiMetadata, SelfspecMetadata, weights_sha256
from selfspec.errors import UsageError
from selfspec.training import config as C
from selfspec.training.config import LoopConfig, option
from selfspec.training.data import batch_generator
from selfspec.training.distributed import global_rows, rank_and_world, shard_rows, take_rows
from selfspec.training.jacobi_forcing.data import SCHEDULES, JFBatch, Trajectory, first_error, pack, pack_trajectories, state_noise
from selfspec.training.jacobi_forcing.forward import forward, jacobi_update
from selfspec.training.jacobi_forcing.losses import jf_loss
from selfspec.training.jacobi_forcing.masks import CONTEXTS, plain_row
from selfspec.training.loop import train
from selfspec.training.objective import Objective

NOISE_BUCKETS = 4
OFFSETS = 4  # accuracy at offsets m = 0 .. OFFSETS-1 after the first error


@dataclass(frozen=True)
class Round:
    block_size: int  # n
    window: int  # w
    prompts: int | None = None  # trajectory prompts of this round (None: --num-prompts)


def parse_rounds(text: str | list[str] | None) -> list[Round]:
    """'8:8,16:8:1024' -> rounds of BLOCK:WINDOW[:PROMPTS]."""
    if text is None:
        return []
    items = text if isinstance(text, list) else text.split(",")
    out = []
    for item in items:
        parts = str(item).strip().split(":")
        try:
            if not 1 <= len(parts) <= 3:
                raise ValueError
            values = [int(p) for p in parts]
        except ValueError:
            raise UsageError(f"--rounds {item!r}: expected BLOCK:WINDOW[:PROMPTS], e.g. 8:8,16:8:1024") from None
        rnd = Round(values[0], values[1] if len(values) > 1 else values[0], values[2] if len(values) > 2 else None)
        if rnd.block_size < 2 or rnd.window < 1 or (rnd.prompts is not None and rnd.prompts < 1):
            raise UsageError(f"--rounds {item!r}: block size >= 2, window >= 1, prompts >= 1")
        out.append(rnd)
    return out


@dataclass(kw_only=True)
class JFConfig(LoopConfig):
    """Jacobi Forcing"""

    base: str = option(help="causal LM to train: embedded name or HF checkpoint directory")
    block_size: int = option(16, help="n: Jacobi block size (one round; --rounds overrides)")
    window: int = option(16, help="w: noise levels of the schedule, {0, 1/w, ..., (w-1)/w} (one round)")
    rounds: list[str] | None = option(None, help="rounds as BLOCK:WINDOW[:PROMPTS], e.g. 8:8,16:8:1024 (each from "
                                                 "the previous round's model, with trajectories collected by it; "
                                                 "the learning rate halves each round)")
    round_fractions: list[float] | None = option(None, help="share of --steps / --time-budget-minutes per round "
                                                            "(default equal)")
    trajectories: str | None = option(None, help="a finished `selfspec train jf-trajectories` directory for a "
                                                 "single round (default: collected into the work directory)")
    schedule: str = option("progressive", choices=list(SCHEDULES), help="how each block's target noise is chosen")
    context: str = option("nc", choices=list(CONTEXTS), help="what a noisy block sees of earlier blocks")
    ar_weight: float = option(1.0, help="weight of the AR cross-entropy on the clean chain")
    anchor_weight: float = option(1.0, help="weight of KL(frozen anchor model || clean rows); 0 = off")
    anchor_model: str | None = option(None, help="the anchor's frozen model (default: the round's starting model; "
                                                 "give the original base to hold every round to it)")
    num_prompts: int = option(1024, help="trajectory collection: training prompts")
    heldout_prompts: int = option(64, help="trajectory collection: held-out prompts")
    prompt_tokens: int = option(64, help="trajectory collection: prompt length of corpus cuts")
    new_tokens: int = option(128, help="trajectory collection: greedy response tokens per prompt")
    prompts: str | None = option(None, help="trajectory collection: JSONL prompts file instead of corpus cuts")
    data: list[str] | None = option(None, nargs="+", help="trajectory collection: prompt sources (see jf-trajectories)")
    eval_batch_size: int = option(16, help="rows per held-out evaluation batch")
    attn_implementation: str = option("auto", choices=["auto", "sdpa", "flex_attention", "eager"],
                                      help="auto: flex_attention on CUDA, sdpa on CPU")
    serve_max_blocks: int = option(2, help="recommended JACOBI max_blocks written to selfspec.json")
    serve_verify_size: int = option(4, help="recommended JACOBI verify_size written to selfspec.json")
    serve_spawn_ratio: float = option(0.85, help="recommended JACOBI spawn_ratio written to selfspec.json")
    base_ref: str | None = option(None, help="how the metadata names the starting model (default: --base as given)")
    lr: float = 1e-5

    def __post_init__(self) -> None:
        self.round_list = parse_rounds(self.rounds) or [Round(self.block_size, self.window)]
        if self.round_fractions is None:
            self.round_fractions = [1.0 / len(self.round_list)] * len(self.round_list)
        if len(self.round_fractions) != len(self.round_list):
            raise UsageError("--round-fractions needs one value per round")
        for rnd in self.round_list:
            if self.new_tokens % rnd.block_size:
                raise UsageError(f"--new-tokens {self.new_tokens} must be a multiple of every block size "
                                 f"(got {rnd.block_size})")
        if self.trajectories is not None and len(self.round_list) > 1:
            raise UsageError("--trajectories names one round's data; with --rounds each round collects its own")
        if self.trajectories is not None and not (Path(self.trajectories) / "manifest.json").exists():
            raise UsageError(f"--trajectories {self.trajectories}: no manifest.json there (collect with "
                             "`selfspec train jf-trajectories`)")


# ------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def jacobi_step_quality(model, trajs: list[Trajectory], pad_id: int, attn_implementation: str = "sdpa",
                        batch_size: int = 16) -> dict:
    """One greedy Jacobi step of every recorded non-final state, in the clean-context layout:
    the mean gain (new correct prefix - old) per noise quartile, and the accuracy at offsets
    d + m after the first error d."""
    gain_sum = [0.0] * NOISE_BUCKETS
    gain_n = [0] * NOISE_BUCKETS
    acc_sum = [0] * OFFSETS
    acc_n = [0] * OFFSETS
    for i in range(0, len(trajs), batch_size):
        chunk = trajs[i : i + batch_size]
        depth = max(len(s) for tr in chunk for s in tr.states)
        for k in range(depth - 1):
            noisy = [[tr.states[j][min(k, len(tr.states[j]) - 1)] for j in range(tr.num_blocks)] for tr in chunk]
            clean = [[tr.fixed(j) for j in range(tr.num_blocks)] for tr in chunk]
            batch = pack([tr.prompt_ids for tr in chunk], torch.tensor(noisy), torch.tensor(clean), pad_id, "cllm")
            new = jacobi_update(forward(model, batch, attn_implementation, chain=False).noisy.cpu(), batch.noisy)
            for b, tr in enumerate(chunk):
                for j in range(tr.num_blocks):
                    if k >= len(tr.states[j]) - 1:
                        continue
                    state, fixed, nxt = noisy[b][j], clean[b][j], new[b, j].tolist()
                    d = first_error(state, fixed)
                    bucket = min(NOISE_BUCKETS - 1, int(state_noise(state, fixed) * NOISE_BUCKETS))
                    gain_sum[bucket] += first_error(nxt, fixed) - d
                    gain_n[bucket] += 1
                    for m in range(OFFSETS):
                        if d + m < len(fixed):
                            acc_sum[m] += int(nxt[d + m] == fixed[d + m])
                            acc_n[m] += 1
    gains = [s / n if n else None for s, n in zip(gain_sum, gain_n)]
    total = sum(gain_n)
    return {"gain": sum(gain_sum) / max(1, total), "gain_by_noise": gains, "states": total,
            "accuracy_by_offset": [s / n if n else None for s, n in zip(acc_sum, acc_n)]}


def heldout_corpus_tokens(tokenizer, max_tokens: int) -> torch.Tensor:
    """The first `max_tokens` + 1 tokens of the stdlib held-out split (the AR perplexity text)."""
    from selfspec.corpus import load_stdlib_split
    from selfspec.training.tiny_base import tokenize_files

    return tokenize_files(tokenizer, [f.text for f in load_stdlib_split().heldout])[: max_tokens + 1]


def corpus_perplexity(model, tokens: torch.Tensor, seq_len: int = 256, batch_size: int = 8) -> float:
    from selfspec.training.tiny_base import heldout_loss

    was_training = model.training
    loss = heldout_loss(model, tokens, min(seq_len, len(tokens) - 1), batch_size)
    model.train(was_training)
    return math.exp(loss)


# ------------------------------------------------------------------------------ objective
class JFObjective(Objective):
    """One round of Jacobi Forcing as an objective of the training loop."""

    name = "jacobi-forcing"
    config_class = JFConfig
    cfg: JFConfig

    def __init__(self, cfg: JFConfig, trajectories: str | None = None):
        super().__init__(cfg)
        self.trajectory_dir = trajectories or cfg.trajectories
        self.teacher = None

    def build_model(self, device: torch.device) -> torch.nn.Module:
        from selfspec.training.idlm.objective import load_base, resolve_attn_implementation

        self.device = device
        self.attn_impl = resolve_attn_implementation(self.cfg.attn_implementation, device)
        self.base_path, model, self.tokenizer = load_base(self.cfg.base, self.attn_impl)
        model.config.use_cache = False
        tok = self.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return model

    def setup_training(self, model: torch.nn.Module, log) -> None:
        from selfspec.training.jacobi_forcing.trajectories import load_trajectories

        if self.trajectory_dir is None:
            raise UsageError("Jacobi Forcing needs trajectories: give --trajectories or run through train_jf")
        self.train_trajs = load_trajectories(self.trajectory_dir, "train")
        self.heldout_trajs = load_trajectories(self.trajectory_dir, "heldout")
        n = self.train_trajs[0].block_size
        if n != self.cfg.block_size:
            raise UsageError(f"{self.trajectory_dir}: trajectories of block size {n}, but --block-size is "
                             f"{self.cfg.block_size}")
        manifest = json.loads((Path(self.trajectory_dir) / "manifest.json").read_text())
        first = self.train_trajs[0]
        self.data_description = {"trajectories": str(self.trajectory_dir), "manifest": manifest,
                                 "row_tokens": len(first.prompt_ids) + 2 * len(first.response_ids)}
        log(f"trajectories: {len(self.train_trajs)} train, {len(self.heldout_trajs)} held-out, n={n}, "
            f"T={self.train_trajs[0].num_blocks}; schedule {self.cfg.schedule}, window {self.cfg.window}, "
            f"mask {self.cfg.context}; attention {self.attn_impl}")
        self.ppl_tokens = heldout_corpus_tokens(self.tokenizer, self.cfg.eval_tokens)
        if self.cfg.anchor_weight > 0 and self.cfg.anchor_model:
            from selfspec.training.idlm.objective import load_base

            _, teacher, _ = load_base(self.cfg.anchor_model, self.attn_impl)
            if teacher.get_input_embeddings().weight.shape != model.get_input_embeddings().weight.shape:
                raise UsageError(f"--anchor-model {self.cfg.anchor_model}: its vocabulary differs from --base's")
            self.teacher = teacher.eval().requires_grad_(False).to(self.device)
        elif self.cfg.anchor_weight > 0:
            self.teacher = copy.deepcopy(model).eval().requires_grad_(False).to(self.device)

    def _rows(self, step: int, micro: int) -> tuple[list[Trajectory], int]:
        """The trajectories of a global micro-batch (every process's rows) and their epoch: a
        seeded permutation per epoch, walked in order by a global row counter."""
        cfg = self.cfg
        num = len(self.train_trajs)
        size = global_rows(cfg.batch_size)
        first = (step * cfg.grad_accum + micro) * size
        rows, epochs = [], []
        for g in range(first, first + size):
            epoch = g // num
            perm = torch.randperm(num, generator=torch.Generator().manual_seed(cfg.seed * 7919 + epoch))
            rows.append(self.train_trajs[int(perm[g % num])])
            epochs.append(epoch)
        return rows, epochs[0]

    def batch(self, step: int, micro: int, rank: int) -> JFBatch:
        cfg = self.cfg
        trajs, epoch = self._rows(step, micro)
        packed = pack_trajectories(trajs, self.pad_id, cfg.schedule, cfg.window, cfg.context, phase=epoch,
                                   generator=batch_generator(cfg.seed, step, micro))
        return take_rows(packed, shard_rows(cfg.batch_size, rank))

    def forward(self, model: torch.nn.Module, batch: JFBatch, stage: dict):
        logits = forward(model, batch, self.attn_impl)
        teacher = None
        if self.teacher is not None:
            with torch.no_grad():
                pos, mask = plain_row(batch.layout, batch.prompt_lens, self.device)
                out = self.teacher(input_ids=batch.plain_ids.to(self.device), position_ids=pos, attention_mask=mask,
                                   use_cache=False).logits
                teacher = out[:, batch.layout.prompt_len - 1 :].float()
        return logits, teacher

    def loss(self, outputs, batch: JFBatch, stage: dict):
        logits, teacher = outputs
        out = jf_loss(logits, batch, self.cfg.ar_weight, self.cfg.anchor_weight, teacher)
        stats = {"consistency": out.consistency, "consistency_kl": out.consistency_kl, "ar_ce": out.ar_ce}
        if out.anchor_kl is not None:
            stats["anchor_kl"] = out.anchor_kl
        return out.total, stats

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> dict:
        cfg = self.cfg
        was_training = model.training
        model.eval()
        quality = jacobi_step_quality(model, self.heldout_trajs, self.pad_id, self.attn_impl, cfg.eval_batch_size)
        pc, kl, count = 0.0, 0.0, 0
        for i in range(0, len(self.heldout_trajs), cfg.eval_batch_size):
            batch = pack_trajectories(self.heldout_trajs[i : i + cfg.eval_batch_size], self.pad_id, cfg.schedule,
                                      cfg.window, cfg.context, phase=0, generator=torch.Generator().manual_seed(0))
            out = jf_loss(forward(model, batch, self.attn_impl), batch, 0.0)
            pc += out.consistency * out.counted
            kl += out.consistency_kl * out.counted
            count += out.counted
        ppl = corpus_perplexity(model, self.ppl_tokens)
        model.train(was_training)
        return {**quality, "consistency": pc / max(1, count), "consistency_kl": kl / max(1, count),
                "ar_perplexity": ppl}

    def describe_eval(self, ev: dict) -> str:
        gains = " ".join("-" if g is None else f"{g:.2f}" for g in ev["gain_by_noise"])
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in ev["accuracy_by_offset"])
        return (f"ppl {ev['ar_perplexity']:.2f} KL {ev['consistency_kl']:.3f} gain {ev['gain']:.3f} "
                f"(by noise {gains}) acc after error {acc}")

    def postfix(self, stage: dict, stats: dict[str, float]) -> dict:
        out = {"kl": f"{stats['consistency_kl']:.3f}", "ar": f"{stats['ar_ce']:.3f}"}
        if "anchor_kl" in stats:
            out["anchor"] = f"{stats['anchor_kl']:.4f}"
        return out

    # -------------------------------------------------------------------------- export
    @property
    def base_ref(self) -> str:
        return self.cfg.base_ref or _as_ref(self.cfg.base)

    def _metrics(self, state: dict) -> dict:
        final = state["history"][-1]["heldout"] if state["history"] else {}
        return {"heldout": final, "base_heldout": state.get("base_eval") or {}, "steps": state["step"]}

    def metadata(self, state: dict) -> SelfspecMetadata:
        cfg = self.cfg
        jac = JacobiMetadata(block_size=cfg.block_size, max_blocks=cfg.serve_max_blocks,
                             spawn_ratio=cfg.serve_spawn_ratio, verify_size=cfg.serve_verify_size)
        return SelfspecMetadata(mode="jacobi", converted_from=self.base_ref, jacobi=jac,
                                recipe={"command": C.command_line(), "config": asdict(cfg)},
                                metrics=self._metrics(state))

    def provenance(self, model, state: dict, out: Path, train_seconds: float | None) -> dict:
        cfg = self.cfg
        try:
            base_sha = weights_sha256(self.base_path)
        except FileNotFoundError:
            base_sha = None
        row_tokens = (state.get("data") or {}).get("row_tokens") or 0
        return {
            "model": cfg.name or out.name, "command": C.command_line(), "config": asdict(cfg),
            "seed": cfg.seed, "base": {"ref": self.base_ref, "path": str(self.base_path), "sha256": base_sha},
            "data": state.get("data"), "steps": state["step"],
            "rows_seen": state["step"] * cfg.batch_size * cfg.grad_accum,
            "tokens_seen": state["step"] * cfg.batch_size * cfg.grad_accum * row_tokens,
            "train_seconds": round(state["elapsed_s"], 1),
            "total_seconds": round(train_seconds, 1) if train_seconds else None,
            "history": state["history"], "base_eval": state.get("base_eval") or {},
            "torch": torch.__version__, "python": platform.python_version(), "saved_dtype": "bfloat16",
        }


# ------------------------------------------------------------------------------ rounds
def _as_ref(base: str) -> str:
    return str(Path(base).resolve()) if Path(base).exists() else base


def work_dir(cfg: JFConfig) -> Path:
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else Path(cfg.out) / "checkpoints"


def round_configs(cfg: JFConfig) -> list[tuple[JFConfig, Path]]:
    """(the loop config, the trajectory directory) of every round."""
    root = work_dir(cfg)
    out = []
    model = cfg.base
    last = len(cfg.round_list) - 1
    for r, (rnd, frac) in enumerate(zip(cfg.round_list, cfg.round_fractions)):
        rdir = root / f"round-{r + 1}"
        traj = Path(cfg.trajectories) if cfg.trajectories else rdir / "trajectories"
        rcfg = replace(cfg, rounds=None, round_fractions=None, trajectories=None,  # collected later: see train_jf
                       block_size=rnd.block_size, window=rnd.window, num_prompts=rnd.prompts or cfg.num_prompts,
                       base=model, out=cfg.out if r == last else str(rdir / "model"),
                       checkpoint_dir=str(rdir / "checkpoints"),
                       steps=max(1, round(cfg.steps * frac)),
                       time_budget_minutes=None if cfg.time_budget_minutes is None else cfg.time_budget_minutes * frac,
                       base_ref=cfg.base_ref or _as_ref(cfg.base), lr=cfg.lr * (0.5 ** r))
        out.append((rcfg, traj))
        model = rcfg.out
    return out


def _round_done(rcfg: JFConfig) -> bool:
    return (Path(rcfg.out) / "selfspec.json").exists() and (Path(rcfg.out) / "provenance.json").exists() \
        and json.loads((Path(rcfg.out) / "provenance.json").read_text()).get("steps", 0) > 0


def collect_round(rcfg: JFConfig, traj: Path, poll_s: float = 2.0) -> None:
    """The round's trajectories. Under `accelerate launch` rank 0 collects them and the other
    processes wait for its complete manifest (the process group is not up before training)."""
    from selfspec.training.jacobi_forcing.trajectories import TrajectoryConfig, collect, is_complete

    if is_complete(traj):
        return
    rank, _ = rank_and_world()
    if rank != 0:
        print(f"rank {rank}: waiting for rank 0 to collect {traj}", flush=True)
        while not is_complete(traj):
            time.sleep(poll_s)
        return
    collect(TrajectoryConfig(model=rcfg.base, out=str(traj), block_size=rcfg.block_size, new_tokens=rcfg.new_tokens,
                             prompt_tokens=rcfg.prompt_tokens, num_prompts=rcfg.num_prompts,
                             heldout_prompts=rcfg.heldout_prompts, prompts=rcfg.prompts, data=rcfg.data,
                             seed=rcfg.seed, threads=rcfg.threads, progress_bar=rcfg.progress_bar))


def train_jf(cfg: JFConfig) -> dict:
    """Every round in order (finished rounds are skipped, an interrupted one resumes with --resume)."""
    result: dict = {"rounds": []}
    rounds = round_configs(cfg)
    for r, (rcfg, traj) in enumerate(rounds):
        if _round_done(rcfg) and r < len(rounds) - 1:
            print(f"round {r + 1} ({rcfg.out}) is done; skipping it")
            continue
        print(f"round {r + 1}/{len(rounds)}: n={rcfg.block_size}, w={rcfg.window}, from {rcfg.base}")
        collect_round(rcfg, traj)
        res = train(JFObjective(rcfg, str(traj)))
        result["rounds"].append({"round": r + 1, "block_size": rcfg.block_size, "window": rcfg.window,
                                 "checkpoint": res["checkpoint"], "export": res.get("export")})
        result.update({k: v for k, v in res.items() if k != "rounds"})
        if res.get("interrupted"):
            break
    return result


# ------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    C.add_arguments(parser, JFConfig)


def run(args: argparse.Namespace) -> int:
    result = train_jf(C.from_args(JFConfig, args))
    if result.get("export"):
        print(f"exported {result['export']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selfspec.training.jacobi_forcing.objective", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
