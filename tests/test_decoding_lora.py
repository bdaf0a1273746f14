"""The per-token gated LoRA wrapper (RISD): base-exact where the gate is off, PEFT's output where
it is on, on Qwen3, Qwen2 and Llama; and RISD loading from an adapter directory."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from selfspec.engines.hf import HFEngine
from selfspec.engines.lora import attach_gated_adapter
from model_helpers import add_mask_token, random_prompts, save_random_adapter, tiny_qwen3


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # small forwards: 1 thread is faster


def tiny(arch: str, vocab: int = 64):
    if arch == "qwen3":
        return tiny_qwen3(vocab, seed=3)
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(Qwen2Config(**common)) if arch == "qwen2" else LlamaForCausalLM(LlamaConfig(**common))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_gate_off_is_base_exact_and_gate_on_is_peft(arch, tmp_path):
    from peft import PeftModel

    base = tiny(arch)
    adapter = save_random_adapter(base, tmp_path / "a", rank=4, modules_to_save=["lm_head"])
    wrapped = copy.deepcopy(base)
    gate = attach_gated_adapter(wrapped, adapter)
    peft = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter)).eval()
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = base(input_ids=ids).logits
        with gate.active(None):
            off = wrapped(input_ids=ids).logits
        assert torch.equal(off, ref)
        suffix = torch.zeros(3, 9, dtype=torch.bool)
        suffix[:, 6:] = True  # like [MASK] positions: after every ungated token
        with gate.active(suffix):
            part = wrapped(input_ids=ids).logits
        assert torch.equal(part[:, :6], ref[:, :6])  # bit-identical: gated-off rows are the base
        assert not torch.allclose(part[:, 6:], ref[:, 6:], atol=1e-3)
        with gate.active(torch.ones(3, 9, dtype=torch.bool)):
            full = wrapped(input_ids=ids).logits
        assert torch.allclose(full, peft(input_ids=ids).logits, atol=1e-5)
    assert gate.mask is None  # the context resets the gate


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_risd_greedy_equals_base_ar_on_other_architectures(arch, tmp_path):
    model = tiny(arch, vocab=64)
    mask_id = add_mask_token(model)
    adapter = save_random_adapter(model, tmp_path / "a", rank=4)
    prompts = random_prompts(12, 64, 1, 10, seed=9)
    engine = HFEngine(model, mask_token_id=mask_id, adapter=adapter)
    ref = engine.generate(prompts, 20, stop_token_ids=[])
    for bs in (1, 6):
        outs = engine.generate(prompts, 20, stop_token_ids=[], mode="risd", mode_config={"stride": 3}, batch_size=bs)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_trainable_token_rows_are_gated(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    base = tiny("qwen3")
    mask_id = add_mask_token(base)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj"],
                                                                 trainable_token_indices=[mask_id]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "trainable_tokens_delta" in name or "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(str(tmp_path / "t"))
    wrapped = copy.deepcopy(base)
    gate = attach_gated_adapter(wrapped, tmp_path / "t")
    peft = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "t")).eval()
    ids = torch.tensor([[1, 2, mask_id, mask_id]])
    with torch.no_grad():
        with gate.active(torch.tensor([[False, False, True, True]])):
            part = wrapped(input_ids=ids).logits
        assert torch.equal(part[:, :2], base(input_ids=ids).logits[:, :2])
        with gate.active(torch.ones(1, 4, dtype=torch.bool)):
            assert torch.allclose(wrapped(input_ids=ids).logits, peft(input_ids=ids).logits, atol=1e-5)


def test_risd_from_an_adapter_directory(tmp_path):
    model = tiny_qwen3(64, seed=5, eos_token_id=[])
    mask_id = add_mask_token(model)
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    model.save_pretrained(base_dir)
    (base_dir / "selfspec.json").write_text(json.dumps({"mask_token_id": mask_id}))
    save_random_adapter(model, adapter_dir, rank=4)
    (adapter_dir / "selfspec.json").write_text(json.dumps({"mode": "RISD", "stride": 3, "base_model": "../base"}))
    engine = HFEngine.from_pretrained(adapter_dir)  # loads the base named by selfspec.json + the adapter
    assert engine.resolve_mask_token() == mask_id and engine.adapter == str(adapter_dir)
    prompts = random_prompts(6, 64, 2, 8, seed=1)
    ref = HFEngine(model).generate(prompts, 16, stop_token_ids=[])
    outs = engine.generate(prompts, 16, stop_token_ids=[], mode="risd")
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    # a base dir naming its adapter in selfspec.json
    (base_dir / "selfspec.json").write_text(json.dumps({"mask_token_id": mask_id, "adapter": "../adapter"}))
    engine2 = HFEngine.from_pretrained(base_dir)
    outs2 = engine2.generate(prompts, 16, stop_token_ids=[], mode="risd", mode_config={"stride": 4})
    assert [o.token_ids for o in outs2] == [o.token_ids for o in ref]
    # no adapter anywhere: RISD is unavailable, with the reason
    from selfspec.decoding.step import ModeUnavailable

    with pytest.raises(ModeUnavailable, match="adapter"):
        HFEngine(model, mask_token_id=mask_id).generate(prompts, 4, mode="risd")


@pytest.mark.parametrize("gated", ["mixed", "none", "all"])
def test_add_gated_lora_on_a_precomputed_base(gated):
    """The op SGLang's hooked linear layers use (their base projection is already computed):
    gated-off rows are the base bit for bit, gated rows base + the LoRA delta."""
    from selfspec.kernels.gated_lora import add_gated_lora, gated_lora_linear_reference

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(11, 48, generator=gen)
    w, b = torch.randn(40, 48, generator=gen) / 7, torch.randn(40, generator=gen)
    a, bb = torch.randn(8, 48, generator=gen) / 7, torch.randn(40, 8, generator=gen) / 3
    mask = {"mixed": torch.rand(11, generator=gen) < 0.5, "none": torch.zeros(11, dtype=torch.bool),
            "all": torch.ones(11, dtype=torch.bool)}[gated]
    base = torch.nn.functional.linear(x, w, b)
    out = add_gated_lora(base, x, a, bb, 1.5, mask)
    assert torch.equal(out[~mask], base[~mask])
    torch.testing.assert_close(out, gated_lora_linear_reference(x, w, b, a, bb, 1.5, mask))
    if mask.any():
        assert not torch.allclose(out[mask], base[mask])  # the adapter did act on the gated rows
