"""The Hugging Face reference engine: runs any registered decoding mode on a transformers model.

    engine = HFEngine.from_pretrained("tiny-base", dtype=torch.float32, device="cpu")
    outs = engine.generate(prompt_ids, max_new_tokens=64, sampling=SamplingParams(), mode="isd",
                           mode_config={"stride": 4})

This file loads models (with their selfspec.json and RISD adapter) and builds modes from the
registry (`selfspec.decoding.registry`); a step is run by `runner.StepRunner` (model adapter,
forward, logits processors) and the loop by `generate.generate_batch` (prefill, steps, stop
conditions, callbacks, logprobs). The verify implementation (kernel or reference) is chosen
once, when the engine is built.

The model runs in the dtype it was loaded in and in the train/eval state its owner gave it
(`from_pretrained` puts its own model in eval mode; a caller's model is left as it is: on-policy
rollouts run on a model that is being trained). Logits are compared in fp32. Models with sliding
window attention layers are refused (the mask here is full attention).
"""

from __future__ import annotations

import dataclasses

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from selfspec.decoding import registry
from selfspec.decoding.modes.corpus import SharedCorpus
from selfspec.checkpoints.metadata import SelfspecMetadata, load_metadata, resolve_mask_token_id
from selfspec.decoding.progress import normalize_stop_ids
from selfspec.decoding.requests.sampling import SamplingParams
from selfspec.decoding.requests.seeds import base_seeds
from selfspec.decoding.step import Mode, ModeUnavailable
from selfspec.engines.generate import GenerationOutput, StepCallback, generate_batch
from selfspec.engines.kernel_choice import verify_ops
from selfspec.engines.kv_cache import SlotKVCache
from selfspec.engines.runner import LogitsProcessor, ModelAdapter, StepRunner, causal_lm
from selfspec.kernels.lora_gate import model_gate

__all__ = ["GenerationOutput", "HFEngine"]


class HFEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        *,
        metadata: SelfspecMetadata | None = None,
        mask_token_id: int | None = None,
        adapter: str | Path | None = None,
        model_adapter: ModelAdapter = causal_lm,
        processors: Sequence[LogitsProcessor] = (),
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.metadata = metadata
        self.mask_token_id = mask_token_id
        self.adapter = str(adapter) if adapter is not None else None
        config = model.config
        layer_types = getattr(config, "layer_types", None) or []
        if "sliding_attention" in layer_types or getattr(config, "use_sliding_window", False):
            raise NotImplementedError("HFEngine does not support sliding-window attention layers")
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.num_layers = config.num_hidden_layers
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.runner = StepRunner(model, model_adapter, processors)
        self.verify_ops = verify_ops(self.device)

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
        model.to(device).eval()
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

    def build_mode(self, mode: str | Mode, mode_config: Any = None, plan: Any = None,
                   corpus: SharedCorpus | None = None) -> Mode:
        """The mode object for this model, or ModeUnavailable saying why it cannot run.
        A `Mode` instance is used as given (custom or instrumented modes). `plan` (a
        `width_plan.WidthPlan` or its dict form) picks each step's configuration from the batch,
        over mode_config as the base options. `corpus`: the text its context candidates may draw
        on besides each sequence's own (default: a fresh one, filled by this mode's sequences)."""
        if isinstance(mode, Mode):
            return mode
        spec = registry.get(mode)
        meta = self.metadata
        defaults = {k: meta.option(k) for k in spec.metadata_fields} if meta is not None else {}
        cfg = registry.parse_mode_config(spec.name, mode_config, defaults)
        mask_id = None
        if spec.needs_mask_token:
            mask_id = self.resolve_mask_token(cfg.mask_token_id)
            if mask_id is None:
                raise ModeUnavailable(
                    f"{spec.name.upper()} needs a [MASK] token and this model has none: its tokenizer has no "
                    "mask_token, it has no selfspec.json with mask_token_id, and mode_config gives no "
                    "mask_token_id"
                )
            if not 0 <= mask_id < self.model.get_input_embeddings().weight.shape[0]:
                raise ModeUnavailable(f"mask token id {mask_id} is outside the model's embedding table")
        if spec.needs_adapter:
            self._ensure_adapter(cfg.adapter or self.adapter)
        resources = registry.ModeResources(mask_id, self.vocab_size, corpus)
        if plan is not None:
            base = dataclasses.asdict(cfg) if cfg is not None else {}
            return registry.build_planned(spec.name, base, plan, resources)
        return registry.build(spec.name, cfg, resources)

    def _ensure_adapter(self, adapter: str | None) -> None:
        if adapter is None:
            raise ModeUnavailable(
                "RISD needs a LoRA adapter (PEFT format): pass mode_config={'adapter': DIR}, load an "
                "adapter directory, or name one in the model's selfspec.json ('adapter')"
            )
        adapter = str(Path(adapter).expanduser().resolve())
        # the wrapper lives in the model (in place): engines sharing a model share its adapter
        attached = getattr(self.model, "_selfspec_adapter", None)
        if attached == adapter and model_gate(self.model) is not None:
            return
        if attached is not None:
            raise ValueError(f"this model already carries adapter {attached}; load a fresh model for {adapter}")
        from selfspec.engines.lora import attach_gated_adapter

        if not Path(adapter, "adapter_config.json").is_file():
            raise ModeUnavailable(f"RISD adapter {adapter} has no adapter_config.json")
        attach_gated_adapter(self.model, adapter)
        self.model._selfspec_adapter = adapter

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
        callbacks: Sequence[StepCallback] = (),
        logprobs: bool = False,
        plan: Any = None,
        grammars: Sequence | None = None,
        watermarks: Sequence | None = None,
    ) -> list[GenerationOutput]:
        """`callbacks` see every step (`generate.StepEvent`); `logprobs=True` fills each output's
        per-token log-probabilities (see `engines/generate.py`); `plan`: see `build_mode`;
        `grammars`: per prompt an `engines.grammar.XGrammar` (or None), fresh for this call;
        `watermarks`: per prompt a `decoding.requests.watermark.WatermarkConfig` (or None): SGLang's text
        watermark on sampled requests (`decoding/requests/watermark.py`)."""
        prompts = [list(map(int, p)) for p in prompt_ids]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        n = len(prompts)
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        vocab = self.model.get_output_embeddings().weight.shape[0]
        bad = sorted({t for p in params for t, _ in p.logit_bias if not 0 <= t < vocab})
        if bad:
            raise ValueError(f"logit_bias names token ids outside the vocabulary [0, {vocab}): {bad}")
        if grammars is not None and len(grammars) != n:
            raise ValueError(f"got {len(grammars)} grammars for {n} prompts")
        if watermarks is not None and len(watermarks) != n:
            raise ValueError(f"got {len(watermarks)} watermarks for {n} prompts")
        seeds = base_seeds(seed, n)
        stops = normalize_stop_ids(self.default_stop_ids() if stop_token_ids is None else stop_token_ids)
        mode_obj = self.build_mode(mode, mode_config, plan)
        if mode_obj.greedy_only and any(not p.greedy for p in params):
            raise ValueError(f"{mode_obj.name.upper()} decoding is greedy only (temperature 0)")
        size = batch_size or n
        outs: list[GenerationOutput] = []
        with torch.inference_mode():  # (mode building above may attach an adapter: not in here)
            for start in range(0, n, size):
                sl = slice(start, start + size)
                batch_prompts = prompts[sl]
                capacity = max(map(len, batch_prompts)) + max_new_tokens + mode_obj.max_width + 8
                cache = SlotKVCache(self.num_layers, len(batch_prompts), capacity, self.device, self.dtype)
                outs.extend(generate_batch(self.runner, mode_obj, batch_prompts, params[sl], seeds[sl], stops,
                                           max_new_tokens, cache, self.verify_ops, callbacks, logprobs,
                                           grammars[sl] if grammars is not None else None, self.mask_token_id,
                                           watermarks[sl] if watermarks is not None else None))
        return outs

    # ------------------------------------------------------------------ conveniences
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer")
        return self.tokenizer.decode(ids)
