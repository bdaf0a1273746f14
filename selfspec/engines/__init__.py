"""Engines that run the decoding core on a model.

- `hf`: the Hugging Face reference engine (loading, modes from the registry, `generate`)
- `runner`: one step (model adapter -> forward -> logits processors), gated LoRA switched per step
- `generate`: the loop (prefill, steps, stop conditions, callbacks, logprobs)
- `kv_cache`: per-sequence slot KV cache and step attention masks
- `kernel_choice`: which verify implementation (kernel or reference) an engine runs, chosen once
- `lora`: gated LoRA adapters attached to transformers models (RISD)
"""
