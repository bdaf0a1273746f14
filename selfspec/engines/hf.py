"""The Hugging Face reference engine: runs any `selfspec.decoding` mode on a transformers model.

    engine = HFEngine.from_pretrained("tiny-base", dtype=torch.float32, device="cpu")
    outs = engine.generate(prompt_ids, max_new_tokens=64, sampling=SamplingParams(), mode="isd",
                           mode_config={"stride": 4})

What it does, per batch of prompts:
1. prefill every prompt in one right-padded forward (positions 0 … len−1, causal); the last
   prompt logits give the first token (AR sampling rule), which becomes the pending token;
2. loop: ask the mode for each active sequence's step layout, run one forward over the padded
   batch against the per-sequence slot KV cache (`kv_cache.SlotKVCache`: each row its own
   committed length, position ids and 4D mask), hand the logits to the mode, commit the
   emitted tokens through `SequenceProgress` (stop ids, max_new_tokens), keep the KV the mode
   says to keep; finished sequences leave the batch.
Sequences advance independently (no lockstep); randomness comes from per-sequence seed streams
(`decoding.seeds`), so a seeded sequence gives the same output in any batch.

The model runs in the dtype it was loaded in; logits are compared in fp32. Models with sliding
window attention layers are refused (the mask here is full attention).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from selfspec.decoding.metadata import SelfspecMetadata, load_metadata, resolve_mask_token_id
from selfspec.decoding.metrics import SequenceMetrics
from selfspec.decoding.modes import normalize_mode, parse_mode_config
from selfspec.decoding.progress import SequenceProgress, normalize_stop_ids
from selfspec.decoding.sampling import SamplingParams, sample
from selfspec.decoding.seeds import base_seeds, step_seeds
from selfspec.decoding.step import DecodeSequence, Mode, ModeUnavailable, StepContext, StepLayout, collate
from selfspec.engines.kv_cache import SlotKVCache, step_attention_mask


@dataclass
class GenerationOutput:
    token_ids: list[int]  # generated tokens only; ends with the stop token if one was hit
    finish_reason: str  # "stop" | "length"
    metrics: SequenceMetrics = field(default_factory=SequenceMetrics)


class HFEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        metadata: SelfspecMetadata | None = None,
        mask_token_id: int | None = None,
        adapter: str | Path | None = None,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.metadata = metadata
        self.mask_token_id = mask_token_id
        self.adapter = str(adapter) if adapter is not None else None
        self._gate = getattr(model, "_selfspec_gate", None)  # LoRAGate once an adapter is attached
        config = model.config
        layer_types = getattr(config, "layer_types", None) or []
        if "sliding_attention" in layer_types or getattr(config, "use_sliding_window", False):
            raise NotImplementedError("HFEngine does not support sliding-window attention layers")
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.num_layers = config.num_hidden_layers
        self.vocab_size = model.get_output_embeddings().weight.shape[0]

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        path_or_name: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        *,
        adapter: str | Path | None = None,
        attn_implementation: str = "sdpa",
    ) -> HFEngine:
        """A checkpoint dir or embedded model name; an adapter dir loads its base (selfspec.json
        `base_model`, else adapter_config.json `base_model_name_or_path`) with the adapter."""
        from transformers import AutoModelForCausalLM

        from selfspec.models import resolve_model, resolve_with_adapter

        path = resolve_model(path_or_name)
        metadata = load_metadata(path)
        model_dir, own_adapter = resolve_with_adapter(path)
        if own_adapter is not None:
            adapter = adapter or own_adapter
            base_meta = load_metadata(model_dir)
            if metadata is None:
                metadata = base_meta
            elif metadata.mask_token_id is None and base_meta is not None:
                metadata.mask_token_id = base_meta.mask_token_id
        elif adapter is None and metadata is not None and metadata.adapter:
            adapter = metadata.adapter_path
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn_implementation)
        model.to(device)
        tokenizer = None
        for tok_dir in (path, model_dir):
            try:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tok_dir)
                break
            except Exception:  # noqa: BLE001 - a checkpoint without a tokenizer is still usable
                continue
        return cls(model, tokenizer, metadata=metadata, adapter=adapter)

    # ------------------------------------------------------------------ modes
    def default_stop_ids(self) -> list[int]:
        for cfg in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
        return []

    def resolve_mask_token(self, explicit: int | None = None) -> int | None:
        tid = self.mask_token_id if explicit is None else explicit
        return resolve_mask_token_id(tid, self.metadata, self.tokenizer)

    def build_mode(self, mode: str | Mode, mode_config: Any = None) -> Mode:
        """The mode object for this model, or ModeUnavailable saying why it cannot run.
        A `Mode` instance is used as given (custom or instrumented modes)."""
        if isinstance(mode, Mode):
            return mode
        mode = normalize_mode(mode)
        meta = self.metadata
        defaults: dict[str, Any] = {}
        if meta is not None and mode in ("isd", "risd") and meta.stride:
            defaults["stride"] = meta.stride
        cfg = parse_mode_config(mode, mode_config, defaults)
        if mode == "ar":
            from selfspec.decoding.ar import ARMode

            return ARMode()
        if mode in ("isd", "risd"):
            from selfspec.decoding.isd import ISDMode

            mask_id = self.resolve_mask_token(cfg.mask_token_id)
            if mask_id is None:
                raise ModeUnavailable(
                    f"{mode.upper()} needs a [MASK] token and this model has none: its tokenizer has no "
                    "mask_token, it has no selfspec.json with mask_token_id, and mode_config gives no "
                    "mask_token_id"
                )
            if not 0 <= mask_id < self.model.get_input_embeddings().weight.shape[0]:
                raise ModeUnavailable(f"mask token id {mask_id} is outside the model's embedding table")
            if mode == "risd":
                self._ensure_adapter(cfg.adapter or self.adapter)
            return ISDMode(cfg, mask_id, gated=mode == "risd")
        if mode == "jacobi":
            from selfspec.decoding.jacobi import JacobiMode

            return JacobiMode(cfg, self.vocab_size)
        if mode == "sjd":
            from selfspec.decoding.sjd import SJDMode

            return SJDMode(cfg)
        if mode == "ngram":
            from selfspec.decoding.ngram import NgramMode

            return NgramMode(cfg)
        raise AssertionError(mode)

    def _ensure_adapter(self, adapter: str | None) -> None:
        if adapter is None:
            raise ModeUnavailable(
                "RISD needs a LoRA adapter (PEFT format): pass mode_config={'adapter': DIR}, load an "
                "adapter directory, or name one in the model's selfspec.json ('adapter')"
            )
        adapter = str(Path(adapter).expanduser().resolve())
        # the wrapper lives in the model (in place): engines sharing a model share its adapter
        attached = getattr(self.model, "_selfspec_adapter", None)
        if attached == adapter:
            self._gate = self.model._selfspec_gate
            return
        if attached is not None:
            raise ValueError(f"this model already carries adapter {attached}; load a fresh model for {adapter}")
        from selfspec.engines.lora import attach_gated_adapter

        if not Path(adapter, "adapter_config.json").is_file():
            raise ModeUnavailable(f"RISD adapter {adapter} has no adapter_config.json")
        self._gate = attach_gated_adapter(self.model, adapter)
        self.model._selfspec_adapter = adapter
        self.model._selfspec_gate = self._gate

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt_ids: list[list[int]],
        max_new_tokens: int = 128,
        sampling: SamplingParams | list[SamplingParams] = SamplingParams(),
        seed: int | list[int] | None = None,
        stop_token_ids: list[int] | None = None,
        mode: str | Mode = "ar",
        mode_config: Any = None,
        batch_size: int | None = None,
    ) -> list[GenerationOutput]:
        prompts = [list(map(int, p)) for p in prompt_ids]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        n = len(prompts)
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        seeds = base_seeds(seed, n)
        stops = normalize_stop_ids(self.default_stop_ids() if stop_token_ids is None else stop_token_ids)
        mode_obj = self.build_mode(mode, mode_config)
        if mode_obj.greedy_only and any(not p.greedy for p in params):
            raise ValueError(f"{mode_obj.name.upper()} decoding is greedy only (temperature 0)")
        size = batch_size or n
        outs: list[GenerationOutput] = []
        with torch.inference_mode():  # (mode building above may attach an adapter: not in here)
            for start in range(0, n, size):
                sl = slice(start, start + size)
                outs.extend(self._generate_batch(prompts[sl], params[sl], seeds[sl], stops, max_new_tokens, mode_obj))
        return outs

    def _forward(self, cache: SlotKVCache, batch) -> torch.Tensor:
        cache.begin_step(batch.width)
        positions = cache.lengths.unsqueeze(1) + batch.offsets
        mask = step_attention_mask(cache.lengths, batch.local, cache._visible, self.dtype)
        gate_ctx = self._gate.active(batch.gate) if self._gate is not None else _null()
        with gate_ctx:
            out = self.model(
                input_ids=batch.tokens, position_ids=positions, attention_mask=mask,
                past_key_values=cache, use_cache=True,
            )
        return out.logits.float()

    def _generate_batch(self, prompts, params, seeds, stops, max_new_tokens, mode: Mode) -> list[GenerationOutput]:
        n = len(prompts)
        progress = [SequenceProgress(max_new_tokens, stops) for _ in range(n)]
        metrics = [SequenceMetrics() for _ in range(n)]
        if max_new_tokens <= 0:
            return [GenerationOutput([], "length", m) for m in metrics]
        dev = self.device
        capacity = max(map(len, prompts)) + max_new_tokens + mode.max_width + 8
        cache = SlotKVCache(self.num_layers, n, capacity, dev, self.dtype)
        base = torch.tensor(seeds, dtype=torch.long, device=dev)
        counter = torch.zeros(n, dtype=torch.long, device=dev)

        # prefill: the whole prompt, causal; the last prompt logits give the first token
        batch = collate([StepLayout(p) for p in prompts], device=dev)
        logits = self._forward(cache, batch)
        last = torch.tensor([len(p) - 1 for p in prompts], device=dev)
        ctx = StepContext.from_params(params, step_seeds(base, counter, 1))
        counter += 1
        first_logits = logits[torch.arange(n, device=dev), last]
        first = first_logits.argmax(-1) if ctx.all_greedy else sample(
            first_logits, ctx.seeds[:, 0], ctx.temperature, ctx.top_k, ctx.top_p)
        cache.commit([list(range(len(p))) for p in prompts])
        seqs = [DecodeSequence(list(p), sp) for p, sp in zip(prompts, params)]
        for i, tok in enumerate(first.tolist()):
            metrics[i].record_prefill(progress[i].commit([tok]))
            seqs[i].history.append(tok)

        active = list(range(n))
        active = self._drop_finished(active, progress, cache)
        for i in active:
            mode.start(seqs[i])
        base, counter = base[active], counter[active]
        act_params = [params[i] for i in active]
        while active:
            rows = [seqs[i] for i in active]
            layouts = mode.layouts(rows)
            batch = collate(layouts, device=dev)
            logits = self._forward(cache, batch)
            ctx = StepContext.from_params(act_params, step_seeds(base, counter, mode.seeds_per_step))
            counter = counter + mode.seeds_per_step
            outcomes = mode.finish(rows, batch, logits, ctx)
            keeps = []
            for i, lay, out in zip(active, layouts, outcomes):
                if len(out.keep) != len(out.emit):
                    raise AssertionError(f"{mode.name}: keep {out.keep} does not match emit {out.emit}")
                metrics[i].record_step(len(lay), progress[i].commit(out.emit))
                seqs[i].history.extend(out.emit)
                keeps.append(out.keep)
            cache.commit(keeps)
            still = [j for j, i in enumerate(active) if not progress[i].finished]
            if len(still) != len(active):
                idx = torch.tensor(still, dtype=torch.long, device=dev)
                cache.select(idx)
                base, counter = base[idx], counter[idx]
                active = [active[j] for j in still]
                act_params = [act_params[j] for j in still]
        return [GenerationOutput(p.tokens, p.finish_reason, m) for p, m in zip(progress, metrics)]

    @staticmethod
    def _drop_finished(active, progress, cache: SlotKVCache):
        still = [j for j, i in enumerate(active) if not progress[i].finished]
        if len(still) != len(active):
            cache.select(torch.tensor(still, dtype=torch.long, device=cache.device))
        return [active[j] for j in still]

    # ------------------------------------------------------------------ conveniences
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer")
        return self.tokenizer.decode(ids)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def timed_generate(engine: HFEngine, *args, **kwargs) -> tuple[list[GenerationOutput], float]:
    start = time.perf_counter()
    outs = engine.generate(*args, **kwargs)
    return outs, time.perf_counter() - start
