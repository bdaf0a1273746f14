"""Batched image rollouts: cached AR and HB-SJD (the HB-SJD paper) with classifier-free guidance, on a
transformers image-token GPT (`images.gpt`), with Full / Compact / Hybrid execution.

    engine = ImageRolloutEngine(model, layout)
    costs = calibrated_costs(model, batch=32, window=8)       # images.gamma
    out = engine.rollout(labels, prefix, RolloutConfig(window=8, execution="hybrid", costs=costs))
    out.codes        # [B, 196], the prefix then the generated codes

Each image is a pair of rows in one `SlotKVCache` (conditional rows 0..B-1, unconditional rows
B..2B-1, sharing every length and commit); one forward per round runs every row's
`[pending, drafts]` at its own positions (`engines.runner.StepRunner`), the guided logits are
fused and restricted to codes (`images.cfg`), verified (`decoding.modes.verify` through the
engine's `VerifyOps`) and committed (`images.hbsjd`). The round loop is tensor ops only.

Physical execution: `full` keeps every image in the batch to the end (finished ones ride along,
committing nothing); `compact` removes finished images from the batch and the KV cache as soon
as any finishes; `hybrid` compacts when the rounds still to run repay it
(`hbsjd.should_compact` on the costs `selfspec calibrate-gamma` measures). The three give
identical tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from selfspec.images import hbsjd
from selfspec.images.cfg import guided_logits, restrict_to_codes, split_guided
from selfspec.decoding.requests.sampling import logits_to_probs, sample_from_probs
from selfspec.decoding.requests.seeds import step_seeds
from selfspec.decoding.step import StepBatch
from selfspec.engines.kernel_choice import verify_ops
from selfspec.engines.kv_cache import SlotKVCache
from selfspec.engines.runner import StepRunner

EXECUTIONS = ("full", "compact", "hybrid")


@dataclass
class RolloutConfig(hbsjd.HBSJDConfig):
    execution: str = "compact"
    costs: hbsjd.CompactionCosts | None = None  # hybrid: the measured costs it decides by
    cfg_scale: float = 2.0
    temperature: float = 1.0  # verify="prob" (and AR sampling): the sampling distribution
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.execution not in EXECUTIONS:
            raise ValueError(f"execution must be one of {', '.join(EXECUTIONS)}, got {self.execution!r}")
        if self.execution == "hybrid" and self.costs is None:
            raise ValueError("hybrid execution needs measured costs (see `selfspec calibrate-gamma`)")
        if self.verify == "prob" and self.temperature <= 0:
            raise ValueError("probabilistic verification samples: temperature must be > 0")

    @property
    def greedy(self) -> bool:
        return self.verify == "greedy"


@dataclass
class RolloutResult:
    codes: torch.Tensor  # [B, tokens]
    rounds: int  # forwards after the prefill
    seconds: float
    rounds_per_image: torch.Tensor  # [B] rounds until the image finished
    committed_foreground: int  # committed generated tokens that are not the background code
    committed_background: int
    image_rounds: int  # sum over rounds of the images that committed something
    finish_seconds: torch.Tensor  # [B] when each image had all its codes, from the start of the rollout
    compactions: int = 0  # times finished images left the batch
    trace: list[dict] = field(default_factory=list)  # per round: active images, width, committed

    @property
    def tokens_per_round(self) -> float:
        return (self.committed_foreground + self.committed_background) / max(1, self.image_rounds)

    def summary(self) -> dict:
        n = max(1, self.image_rounds)
        return {"rounds": self.rounds, "seconds": round(self.seconds, 4),
                "mean_latency_s": round(float(self.finish_seconds.mean()), 4),
                "p95_latency_s": round(float(self.finish_seconds.quantile(0.95)), 4),
                "mean_rounds_per_image": round(float(self.rounds_per_image.float().mean()), 2),
                "compactions": self.compactions,
                "tokens_per_round": round(self.tokens_per_round, 3),
                "foreground_per_round": round(self.committed_foreground / n, 3),
                "background_per_round": round(self.committed_background / n, 3)}


def causal_batch(tokens: torch.Tensor) -> StepBatch:
    """A plain causal step over tokens [rows, width] (every row the same layout)."""
    rows, width = tokens.shape
    device = tokens.device
    offsets = torch.arange(width, device=device).repeat(rows, 1)
    local = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(rows, width, width)
    return StepBatch(tokens, offsets, local, None, [width] * rows)


class ImageRolloutEngine:
    def __init__(self, model: torch.nn.Module, layout, background_code: int | None = None):
        self.model = model
        self.layout = layout
        self.runner = StepRunner(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.verify = verify_ops(self.device)
        self.background_code = background_code

    # ------------------------------------------------------------------ one forward
    def _forward(self, cache: SlotKVCache, tokens: torch.Tensor, length: torch.Tensor, guided: bool,
                 scale: float) -> torch.Tensor:
        """tokens [B, W] starting at each image's pending token -> fused, code-only logits
        [B, W, V]. The two rows of a pair run the same tokens, except that a pending class token
        (no prefix yet) is the null class in the unconditional row."""
        if guided:
            uncond = tokens.clone()
            uncond[:, 0] = torch.where(length == 1, torch.full_like(length, self.layout.null_id), tokens[:, 0])
            rows = torch.cat([tokens, uncond])
        else:
            rows = tokens
        batch = causal_batch(rows)
        cond, uncond = split_guided(self.runner.forward(cache, batch), guided)
        return restrict_to_codes(guided_logits(cond, uncond, scale), self.layout.codebook_size)

    # ------------------------------------------------------------------ rollout
    @torch.inference_mode()
    def rollout(self, labels: torch.Tensor, prefix: torch.Tensor, cfg: RolloutConfig, seed: int = 0) -> RolloutResult:
        """Complete each image's `prefix` [B, P] (codes; P may be 0) under class `labels` [B]."""
        lay, dev = self.layout, self.device
        started = time.perf_counter()
        bsz, plen = prefix.shape
        total = 1 + lay.tokens  # class token + codes
        guided = cfg.cfg_scale != 1.0
        w = cfg.window
        seq = torch.zeros(bsz, total + w + 1, dtype=torch.long, device=dev)
        seq[:, 0] = lay.class_ids(labels.to(dev))
        seq[:, 1 : 1 + plen] = prefix.to(dev).long()
        length = torch.full((bsz,), 1 + plen, dtype=torch.long, device=dev)
        rows = 2 * bsz if guided else bsz
        cache = SlotKVCache(self.model.config.num_hidden_layers, rows, total + w + 2, dev, self.dtype)
        if plen:  # prefill everything but the pending token (the last prefix code)
            known = seq[:, :plen]
            if guided:
                unconditional = known.clone()
                unconditional[:, 0] = lay.null_id
                known = torch.cat([known, unconditional])
            self._prefill(cache, known)
        out = seq[:, :total].clone()
        index = torch.arange(bsz, device=dev)  # batch row -> image
        rounds_per_image = torch.zeros(bsz, dtype=torch.long, device=dev)
        finish = torch.zeros(bsz, dtype=torch.float64)
        drafts = torch.zeros(bsz, w, dtype=torch.long, device=dev)
        reused = torch.zeros(bsz, dtype=torch.long, device=dev)
        q = torch.zeros(bsz, w, lay.vocab_size, device=dev) if not cfg.greedy else None
        base = torch.arange(bsz, device=dev) + seed * 1_000_003
        counter = torch.zeros(bsz, dtype=torch.long, device=dev)
        window_end = length + w if cfg.schedule == "window" else None
        fg = bg = image_rounds = rounds = compactions = 0
        trace: list[dict] = []
        while True:
            active = length < total
            n_active = int(active.sum())
            if n_active == 0:
                break
            if n_active < len(length) and self._compacts(cfg, length, total, active, n_active, fg + bg, image_rounds):
                compactions += 1  # finished images leave the batch and the KV cache
                keep_rows = active.nonzero().squeeze(1)
                out[index[~active]] = seq[~active, :total]
                cache.select(torch.cat([keep_rows, keep_rows + len(length)]) if guided else keep_rows)
                seq, length, drafts, reused, index = (t[keep_rows] for t in (seq, length, drafts, reused, index))
                base, counter, active = base[keep_rows], counter[keep_rows], active[keep_rows]
                q = q[keep_rows] if q is not None else None
                window_end = window_end[keep_rows] if window_end is not None else None
            drafts = hbsjd.history_fill(seq, length, drafts, reused, cfg.history_offset)
            num = hbsjd.draft_counts(length, total, w, cfg.schedule, window_end)
            width = 1 + int(num.max())
            pending = seq.gather(1, (length - 1).unsqueeze(1))
            logits = self._forward(cache, torch.cat([pending, drafts[:, : width - 1]], 1), length, guided,
                                   cfg.cfg_scale)
            d = drafts[:, : width - 1]
            if cfg.greedy:
                res = self.verify.greedy(logits, d, num)
                preds, probs = logits.argmax(-1), None
            else:
                seeds = step_seeds(base, counter, 2 * width)
                counter = counter + 2 * width
                onehot = torch.nn.functional.one_hot(d, lay.vocab_size).float()
                known = (torch.arange(width - 1, device=dev).unsqueeze(0) < reused.unsqueeze(1)).unsqueeze(-1)
                draft_probs = torch.where(known, q[:, : width - 1], onehot)
                res = self.verify.speculative(logits, d, num, seeds[:, :width], cfg.temperature, cfg.top_k,
                                              cfg.top_p, 0.0, draft_probs)
                probs = logits_to_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
                preds = sample_from_probs(probs, seeds[:, width:])
            keep = hbsjd.keep_counts(res.accept_len, length, total, active, cfg.schedule, window_end)
            chain = hbsjd.chain_tokens(d, res.accept_len, res.next_tokens)
            cache.commit_prefix(torch.cat([keep, keep]) if guided else keep)
            seq = hbsjd.append_chain(seq, length, chain, keep)
            if self.background_code is not None:
                kept = torch.arange(width, device=dev).unsqueeze(0) < keep.unsqueeze(1)
                n_bg = int(((chain == self.background_code) & kept).sum())
                bg += n_bg
                fg += int(keep.sum()) - n_bg
            else:
                fg += int(keep.sum())
            moved = keep > 0
            image_rounds += int(moved.sum())
            rounds_per_image[index] += active.long()
            length = length + keep
            finished = active & (length >= total)
            finish[index[finished].cpu()] = time.perf_counter() - started
            new_drafts, reused = hbsjd.reuse_predictions(preds, keep, w)
            drafts = new_drafts  # an image that kept nothing reuses rows 0.. (its window did not move)
            if probs is not None:
                idx = (keep.unsqueeze(1) + torch.arange(w, device=dev)).clamp(max=width - 1)
                q = probs.gather(1, idx.unsqueeze(-1).expand(-1, -1, probs.shape[-1]))
            if window_end is not None:
                window_end = hbsjd.advance_window_end(window_end, length, length < total, w)
            rounds += 1
            trace.append({"active": n_active, "rows": int(cache.batch_size), "width": width,
                          "committed": int(keep.sum())})
        out[index] = seq[:, :total]
        return RolloutResult(out[:, 1:], rounds, time.perf_counter() - started, rounds_per_image, fg, bg,
                             image_rounds, finish, compactions, trace)

    @staticmethod
    def _compacts(cfg: RolloutConfig, length: torch.Tensor, total: int, active: torch.Tensor, n_active: int,
                  committed: int, image_rounds: int) -> bool:
        """Whether the finished images leave the batch before this round."""
        if cfg.execution != "hybrid":
            return cfg.execution == "compact"
        rounds = hbsjd.rounds_left(length, total, active, committed / max(1, image_rounds))
        return hbsjd.should_compact(cfg.costs, len(length), n_active, rounds)

    def _prefill(self, cache: SlotKVCache, tokens: torch.Tensor) -> None:
        batch = causal_batch(tokens)
        self.runner.forward(cache, batch)
        cache.commit_prefix(torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long, device=self.device))
