"""One decoding step on a Hugging Face model: model adapter -> forward -> logits processors.

    runner = StepRunner(model, processors=[...])
    logits = runner.process(runner.forward(cache, batch), seqs, batch)   # [B, W, V] fp32

The runner knows nothing of modes; the generate loop (`engines/generate.py`) asks the mode for
layouts, calls the runner, and hands the logits to `mode.finish`.

- A `ModelAdapter` turns a step batch into logits. The default runs a causal LM over the step
  tokens at their positions against the slot KV cache; a model that needs something else (a
  class-token prefix, paired conditional / unconditional rows for guidance) supplies its own.
- `LogitsProcessor`s run in order between the forward and the mode's verify, on every row of
  the step (guidance fusion, vocabulary restriction): whatever they return is what acceptance,
  sampling and logprobs see. Then each request's own rules (penalties, logit_bias,
  min_new_tokens: `selfspec.decoding.requests.logits_rules`, the one hook the SGLang worker calls too). At prefill they see the last prompt row of each
  sequence as a [B, 1, V] step whose `batch` is None.
- The gated LoRA (RISD) is switched on at the rows the layout gates, through the model's one
  `LoRAGate` (`selfspec.kernels.lora_gate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from selfspec.decoding.requests.logits_rules import apply_logits_rules
from selfspec.decoding.step import DecodeSequence, StepBatch
from selfspec.engines.kv_cache import SlotKVCache, step_attention_mask
from selfspec.kernels.lora_gate import gated, model_gate


class ModelAdapter(Protocol):
    def __call__(self, model: torch.nn.Module, batch: StepBatch, positions: torch.Tensor,
                 attention_mask: torch.Tensor, cache: SlotKVCache) -> torch.Tensor:
        """Logits [B, W, V] (any float dtype) of the step's query tokens."""
        ...


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor, seqs: Sequence[DecodeSequence], batch: StepBatch | None) -> torch.Tensor:
        """Transformed logits [B, W, V]; row b belongs to seqs[b]."""
        ...


def causal_lm(model: torch.nn.Module, batch: StepBatch, positions: torch.Tensor, attention_mask: torch.Tensor,
              cache: SlotKVCache) -> torch.Tensor:
    """The default adapter: a transformers causal LM over the step tokens."""
    out = model(input_ids=batch.tokens, position_ids=positions, attention_mask=attention_mask,
                past_key_values=cache, use_cache=True)
    return out.logits


class StepRunner:
    def __init__(self, model: torch.nn.Module, adapter: ModelAdapter = causal_lm,
                 processors: Sequence[LogitsProcessor] = ()):
        self.model = model
        self.adapter = adapter
        self.processors = list(processors)
        self.dtype = next(model.parameters()).dtype

    def forward(self, cache: SlotKVCache, batch: StepBatch) -> torch.Tensor:
        """One forward of the step's query tokens against the cached prefix: fp32 logits [B, W, V]."""
        cache.begin_step(batch.width)
        positions = cache.lengths.unsqueeze(1) + batch.offsets
        mask = step_attention_mask(cache.lengths, batch.local, cache._visible, self.dtype)
        with gated(model_gate(self.model), batch.gate):
            return self.adapter(self.model, batch, positions, mask, cache).float()

    def process(self, logits: torch.Tensor, seqs: Sequence[DecodeSequence], batch: StepBatch | None) -> torch.Tensor:
        for processor in self.processors:
            logits = processor(logits, seqs, batch)
        return apply_logits_rules(logits, seqs, batch)
