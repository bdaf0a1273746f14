"""I-DLM training: the attention mask, the layout against ISD inference, the loss, gated LoRA,
short training runs on a micro model, resume, export round trip. CPU only, fast."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from selfspec.training.idlm import masks as M
from selfspec.training.losses import IGNORE_INDEX, clean_loss_scale, idlm_loss, shifted_labels



# ------------------------------------------------------------------------------ helpers
def _committed_metadata(name: str) -> dict:
    from selfspec.models import ASSETS_DIR

    return json.loads((ASSETS_DIR / name / "selfspec.json").read_text())


def _load(micro_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(micro_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


# ------------------------------------------------------------------------------ the mask
def _reference_mask(seq_len: int, stride: int) -> torch.Tensor:
    """The layout rule written out with loops over (query, key), independent of masks.py."""
    b = stride - 1
    n = 2 * seq_len
    out = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            q_clean, k_clean = q >= seq_len, k >= seq_len
            qp, kp = q % seq_len, k % seq_len
            if q_clean:
                out[q, k] = k_clean and kp <= qp
            else:
                start = (qp // b) * b
                out[q, k] = (k_clean and kp < start) or (not k_clean and start <= kp <= qp)
    return out


def test_mask_small_case_by_hand():
    # L = 4, N = 3: MASK blocks {0,1} and {2,3}. Rows: MASK 0..3, clean 0..3; columns the same.
    expected = torch.tensor([
        # M0 M1 M2 M3 C0 C1 C2 C3
        [1, 0, 0, 0, 0, 0, 0, 0],  # M0: own block, nothing clean before position 0
        [1, 1, 0, 0, 0, 0, 0, 0],  # M1: M0, itself
        [0, 0, 1, 0, 1, 1, 0, 0],  # M2: clean 0,1 (before its block), itself
        [0, 0, 1, 1, 1, 1, 0, 0],  # M3: clean 0,1, M2, itself
        [0, 0, 0, 0, 1, 0, 0, 0],  # C0..C3: plain causal over clean
        [0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(M.dense_mask(4, 3), expected)
    assert torch.equal(M.sdpa_mask(4, 3)[0, 0], expected)


@pytest.mark.parametrize("seq_len,stride", [(1, 2), (5, 2), (7, 3), (9, 4), (10, 4), (13, 5), (16, 8)])
def test_mask_matches_reference_cell_by_cell(seq_len, stride):
    dense = M.dense_mask(seq_len, stride)
    assert torch.equal(dense, _reference_mask(seq_len, stride))
    assert bool(dense.any(dim=1).all())  # every query sees at least itself


@pytest.mark.parametrize("seq_len,stride,block", [(10, 4, 8), (20, 3, 16), (40, 4, 16), (150, 4, 128), (64, 2, 128)])
def test_flex_block_mask_equals_sdpa_mask_cell_by_cell(seq_len, stride, block):
    bm = M.flex_block_mask(seq_len, stride, device="cpu", block_size=block)
    assert torch.equal(M.block_mask_to_dense(bm), M.dense_mask(seq_len, stride))


def test_flex_attention_output_equals_sdpa_with_explicit_mask():
    from torch.nn.attention.flex_attention import flex_attention

    torch.manual_seed(0)
    seq_len, stride = 24, 4
    q, k, v = (torch.randn(2, 2, 2 * seq_len, 16) for _ in range(3))
    flex = flex_attention(q, k, v, block_mask=M.flex_block_mask(seq_len, stride, "cpu", block_size=16))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=M.sdpa_mask(seq_len, stride))
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ layout vs inference
def test_clean_half_is_the_plain_ar_forward(micro_dir):
    from selfspec.training.idlm.objective import packed_forward

    model = _load(micro_dir)
    torch.manual_seed(1)
    x = torch.randint(5, 500, (2, 20))
    with torch.no_grad():
        packed = packed_forward(model, x, 4, 1, "sdpa", gated=False)
        plain = model(input_ids=x).logits
    torch.testing.assert_close(packed[:, 20:], plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stride", [2, 3, 4])
def test_mask_logits_equal_the_isd_inference_layout(micro_dir, stride):
    """An ISD step puts N-1 MASKs at positions s..s+N-2 after the clean context x_0..x_{s-1}
    (KV cache + the step's pending / proposed tokens), causally; the MASK at s+j predicts
    x_{s+j+1}. The training forward's MASK block starting at s must give the same logits."""
    from selfspec.training.idlm.objective import packed_forward

    model = _load(micro_dir)
    mask_id = 1
    torch.manual_seed(2)
    seq_len = 18
    x = torch.randint(5, 500, (2, seq_len))
    b = stride - 1
    with torch.no_grad():
        packed = packed_forward(model, x, stride, mask_id, "sdpa", gated=False)
        for s in range(b, seq_len - b + 1, b):
            step = torch.cat([x[:, :s], torch.full((2, b), mask_id)], dim=1)  # what ISD's forward sees
            isd = model(input_ids=step).logits[:, s : s + b]
            torch.testing.assert_close(packed[:, s : s + b], isd, atol=1e-5, rtol=1e-5)
            # and with the context split into a KV-cached prefix and the step's own tokens
            cut = max(1, s - b)
            out = model(input_ids=x[:, :cut], use_cache=True)
            tail = torch.cat([x[:, cut:s], torch.full((2, b), mask_id)], dim=1)
            cached = model(input_ids=tail, past_key_values=out.past_key_values, use_cache=True).logits
            torch.testing.assert_close(packed[:, s : s + b], cached[:, s - cut :], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ loss
def test_loss_fixed_and_auto_balanced():
    torch.manual_seed(3)
    logits = torch.randn(2, 12, 50, requires_grad=True)
    clean = torch.randint(0, 50, (2, 7))
    labels = shifted_labels(clean)
    assert labels.shape == (2, 6) and torch.equal(labels, clean[:, 1:])
    fixed = idlm_loss(logits, labels, "fixed", 0.2)
    ce = lambda lg: torch.nn.functional.cross_entropy(lg.reshape(-1, 50), labels.reshape(-1))  # noqa: E731
    torch.testing.assert_close(fixed.total, ce(logits[:, :6]) + 0.2 * ce(logits[:, 6:]))
    auto = idlm_loss(logits, labels, "auto")
    scale = float(ce(logits[:, :6]) / (ce(logits[:, 6:]) + 1e-8))
    assert auto.scale == pytest.approx(scale)
    torch.testing.assert_close(auto.total, 2 * ce(logits[:, :6]))  # value: 2 * CE_mask
    # the ratio carries no gradient: d total / d clean logits = scale * d CE_clean
    auto.total.backward()
    g = logits.grad[:, 6:].clone()
    logits.grad = None
    (scale * ce(logits[:, 6:])).backward()
    torch.testing.assert_close(g, logits.grad[:, 6:])
    assert clean_loss_scale(torch.tensor(3.0), torch.tensor(1.5), "auto", 0.2) == pytest.approx(2.0)


def test_loss_mask_ignores_prompt_and_padding():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    loss_mask = torch.tensor([[False, False, True, True, False]])
    assert shifted_labels(ids, loss_mask).tolist() == [[IGNORE_INDEX, 7, 8, IGNORE_INDEX]]


def test_chat_data_trains_on_responses_only(micro_dir, tmp_path):
    from transformers import AutoTokenizer

    from selfspec.training.data import load_data

    tok = AutoTokenizer.from_pretrained(micro_dir)
    f = tmp_path / "chat.jsonl"
    recs = [{"prompt": f"sort list {i}", "response": f"sorted(x) # {i}"} for i in range(40)]
    recs.append({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                              {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]})
    f.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    data = load_data(tok, [str(f)])
    assert data.train.chat
    docs = data.train.docs + data.heldout.docs
    for d in docs:
        text_all = tok.decode(d.ids)
        text_loss = tok.decode([t for t, m in zip(d.ids, d.loss) if m])
        assert text_all.startswith("<|im_start|>user\n")
        assert "user" not in text_loss and text_loss.endswith("<|im_end|>\n")
    multi = next(d for d in docs if tok.decode(d.ids).count("<|im_start|>assistant") == 2)
    assert tok.decode([t for t, m in zip(multi.ids, multi.loss) if m]) == "b<|im_end|>\nd<|im_end|>\n"
    ids, lm = data.train.sample(torch.Generator().manual_seed(0), 3, 32)
    assert ids.shape == lm.shape == (3, 33)


def test_mask_token_added_when_missing(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    from selfspec.training.idlm.objective import ensure_mask_token

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["def f(x):\n    return x\n"] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")
    n = len(tok)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    info = ensure_mask_token(model, tok)
    assert info["added_to_tokenizer"] and info["embedding_resized"] and info["mask_token_id"] == n
    emb = model.get_input_embeddings().weight
    torch.testing.assert_close(emb[n], emb[:n].mean(0))
    assert tok.mask_token == "[MASK]" and tok.convert_tokens_to_ids("[MASK]") == n


# ------------------------------------------------------------------------------ gated LoRA
def test_gated_lora_changes_only_mask_positions(micro_dir):
    from peft import LoraConfig, get_peft_model

    from selfspec.training.idlm.gating import gate_lora_layers
    from selfspec.training.idlm.objective import DEFAULT_LORA_TARGETS, packed_forward

    base = _load(micro_dir)
    torch.manual_seed(4)
    x = torch.randint(5, 500, (2, 16))
    with torch.no_grad():
        ref = packed_forward(base, x, 4, 1, "sdpa", gated=False)
    peft_model = get_peft_model(_load(micro_dir), LoraConfig(r=4, lora_alpha=8, target_modules=DEFAULT_LORA_TARGETS,
                                                              lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained-looking adapter (B = 0 at init would change nothing)
    gate = gate_lora_layers(peft_model)
    from peft.tuners.lora import Linear as LoraLinear

    assert sum(isinstance(m, LoraLinear) for m in peft_model.modules()) == 2 * len(DEFAULT_LORA_TARGETS)
    with torch.no_grad():
        gated = packed_forward(peft_model, x, 4, 1, "sdpa", gated=True)
        off = packed_forward(peft_model, x, 4, 1, "sdpa", gated=False)  # adapter off everywhere
        with gate.active(torch.ones(2, 32, dtype=torch.bool)):  # adapter everywhere
            everywhere = peft_model(input_ids=M.packed_input_ids(x, 1), position_ids=M.packed_position_ids(16),
                                    attention_mask=M.sdpa_mask(16, 4)).logits
    assert torch.equal(gated[:, 16:], ref[:, 16:]), "clean (verify) positions must be bit-identical to the base"
    assert (gated[:, :16] - ref[:, :16]).abs().amax(-1).min() > 1e-3, "every MASK position must change"
    assert torch.equal(off, ref)
    assert (everywhere[:, 16:] - ref[:, 16:]).abs().max() > 1e-3


# ------------------------------------------------------------------------------ training runs
def test_twenty_step_run_lowers_mask_loss(micro_dir, data_file, micro_config, tmp_path):
    from selfspec.training.idlm.objective import train_idlm

    cfg = micro_config(tmp_path / "full", export=False)
    res = train_idlm(cfg)
    state = res["state"]
    assert cfg.steps == 20 and state["step"] == cfg.steps
    before = state["base_eval"]["mask_loss"]
    after = state["history"][-1]["heldout"]["mask_loss"]
    assert after < before - 0.5, (before, after)
    strides = [h["stride"] for h in state["history"]]
    assert strides[-1] == 3


def test_lora_run_trains_only_the_adapter_and_keeps_the_ar_path(micro_dir, data_file, micro_config, tmp_path):
    from safetensors.torch import load_file

    from selfspec.training.idlm.objective import train_idlm

    cfg = micro_config(tmp_path / "lora", lora_rank=4, lr=1e-2, curriculum=[3], steps=12)
    res = train_idlm(cfg)
    state = res["state"]
    before, after = state["base_eval"], state["history"][-1]["heldout"]
    assert after["mask_loss"] < before["mask_loss"] - 0.05
    assert after["ar_loss"] == pytest.approx(before["ar_loss"], abs=1e-6)  # verify path = frozen base
    base_sd = load_file(micro_dir / "model.safetensors")
    model = res["model"]
    for name, p in model.named_parameters():
        if "lora_" not in name:
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert not p.requires_grad and torch.equal(p.detach(), base_sd[key]), name
    # export: adapter-only PEFT checkpoint + metadata naming the base
    out = Path(cfg.out)
    names = {f.name for f in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "selfspec.json", "provenance.json"} <= names
    assert "model.safetensors" not in names and "config.json" not in names
    meta = json.loads((out / "selfspec.json").read_text())
    assert meta["mode"] == "risd" and meta["stride"] == 3 and meta["mask_token_id"] == 1
    assert meta["base_model"] == str(micro_dir)
    assert meta["lora"]["rank"] == 4 and set(meta["lora"]["targets"]) == set(cfg.lora_targets)
    from selfspec.checkpoints.metadata import weights_sha256

    assert meta["lora"]["base_sha256"] == weights_sha256(micro_dir)
    assert sorted(meta) == sorted(_committed_metadata("tiny-idlm-lora"))  # key for key what the embedded adapter has
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all(t.dtype == torch.bfloat16 for t in adapter.values())
    # round trip: the engine's loader (base + adapter, gated) gives the trained model's logits
    from selfspec.checkpoints.metadata import load_metadata
    from selfspec.engines.lora import attach_gated_adapter
    from selfspec.training.idlm.objective import packed_forward

    md = load_metadata(out)
    assert md.mode == "risd" and md.stride == 3 and md.lora.rank == 4 and md.base_model_path == str(micro_dir)
    loaded = _load(micro_dir)
    gate = attach_gated_adapter(loaded, out)
    x = torch.randint(5, 500, (1, 12))
    packed = dict(input_ids=M.packed_input_ids(x, 1), position_ids=M.packed_position_ids(12),
                  attention_mask=M.sdpa_mask(12, 3))
    with torch.no_grad(), gate.active(M.mask_positions(1, 12)):
        a = loaded(**packed).logits
    with torch.no_grad():
        b = packed_forward(model.eval(), x, 3, 1, "sdpa", gated=True)
    assert torch.equal(a[:, 12:], b[:, 12:])
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=0.05, rtol=0.05)  # bf16 adapter
    # the HF engine resolves the adapter dir to base + adapter; RISD greedy = base greedy AR
    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines.hf import HFEngine

    engine = HFEngine.from_pretrained(out, dtype=torch.float32)
    prompt = engine.tokenizer("def f(x):\n", add_special_tokens=False)["input_ids"]
    (risd,) = engine.generate([prompt], max_new_tokens=12, sampling=SamplingParams(), seed=0, mode="risd")
    (ar,) = engine.generate([prompt], max_new_tokens=12, sampling=SamplingParams(), seed=0, mode="ar")
    assert risd.token_ids == ar.token_ids


def test_resume_equals_uninterrupted_run(micro_dir, data_file, micro_config, tmp_path):
    from selfspec.training.idlm.objective import train_idlm

    kw = dict(steps=6, curriculum=[2, 3], eval_every=3, export=False, grad_accum=2)
    whole = train_idlm(micro_config(tmp_path / "a", **kw))
    first = train_idlm(micro_config(tmp_path / "b", stop_after_steps=3, **kw))
    assert first.get("interrupted") and first["state"]["step"] == 3
    saved = json.loads((Path(first["checkpoint"]) / "train_state.json").read_text())
    assert saved["objective"] == "idlm" and "stage" in saved and saved["config"]["grad_accum"] == 2
    resumed = train_idlm(micro_config(tmp_path / "b", resume="auto", **kw))
    assert resumed["state"]["step"] == 6
    a = whole["model"].state_dict()
    b = resumed["model"].state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ha = [h["heldout"]["mask_loss"] for h in whole["state"]["history"]]
    hb = [h["heldout"]["mask_loss"] for h in resumed["state"]["history"]]
    assert ha == hb
    # and so are the training losses logged beside them
    assert [h["mask_ce"] for h in whole["state"]["history"]] == [h["mask_ce"] for h in resumed["state"]["history"]]


def test_resume_refuses_a_checkpoint_of_another_objective(micro_dir, data_file, micro_config, tmp_path):
    from selfspec.errors import UsageError
    from selfspec.training.idlm.objective import train_idlm

    ckpt = tmp_path / "ckpt" / "step-0000003"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text(json.dumps({"step": 3, "objective": "tiny-base", "config": {}}))
    with pytest.raises(UsageError, match="a checkpoint of a tiny-base run, not of idlm"):
        train_idlm(micro_config(tmp_path, resume=str(ckpt), export=False))


def test_idlm_objective_drives_the_one_loop(micro_dir, data_file, micro_config, tmp_path):
    """`train_idlm` is the shared loop over the I-DLM objective: the same run through
    `loop.train(IDLMObjective(cfg))` gives the same weights and per-step losses."""
    from selfspec.training.idlm.objective import IDLMObjective, train_idlm
    from selfspec.training.loop import lr_at, train
    from selfspec.training.objective import objective_class

    kw = dict(steps=3, curriculum=[3], eval_every=1, export=False)
    a = train_idlm(micro_config(tmp_path / "a", **kw))
    cfg = micro_config(tmp_path / "b", **kw)
    b = train(IDLMObjective(cfg))
    assert [h["mask_ce"] for h in a["state"]["history"]] == [h["mask_ce"] for h in b["state"]["history"]]
    sa, sb = a["model"].state_dict(), b["model"].state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [h["lr"] for h in b["state"]["history"]] == [lr_at(cfg, s, 3) for s in range(3)]
    assert objective_class("idlm") is IDLMObjective  # what `selfspec export` rebuilds a checkpoint with


def test_full_export_round_trip_and_export_command(micro_dir, data_file, micro_config, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.training.export import run as export_run
    from selfspec.training.idlm.objective import packed_forward, train_idlm

    cfg = micro_config(tmp_path / "full", steps=4, curriculum=[3])
    res = train_idlm(cfg)
    out = Path(cfg.out)
    meta = json.loads((out / "selfspec.json").read_text())
    assert meta["mode"] == "isd" and meta["stride"] == 3 and "lora" not in meta and "base_model" not in meta
    assert meta["mask_token"] == "[MASK]" and meta["mask_token_id"] == 1
    assert math.isfinite(meta["metrics"]["heldout_ar_perplexity"])
    assert meta["recipe"]["config"]["curriculum"] == [3]
    assert sorted(meta) == sorted(_committed_metadata("tiny-idlm"))  # key for key what the embedded model has
    loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    assert loaded.dtype == torch.bfloat16
    assert AutoTokenizer.from_pretrained(out).mask_token == "[MASK]"
    trained = {k: v.to(torch.bfloat16) for k, v in res["model"].state_dict().items()}
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, trained[k]), k
    x = torch.randint(5, 500, (1, 12))
    with torch.no_grad():
        ref = packed_forward(res["model"].eval(), x, 3, 1, "sdpa", False)
        torch.testing.assert_close(packed_forward(loaded.float(), x, 3, 1, "sdpa", False), ref, atol=0.05, rtol=0.05)
    # `selfspec export` from the run's checkpoint reproduces the same weights
    import argparse

    from safetensors.torch import load_file

    again = tmp_path / "again"
    export_run(argparse.Namespace(checkpoint=str(cfg.checkpoint_dir), out=str(again)))
    a, b = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_loads_in_the_hf_engine(micro_dir, data_file, micro_config, tmp_path):
    from selfspec.decoding.requests.sampling import SamplingParams
    from selfspec.engines import hf
    from selfspec.training.idlm.objective import train_idlm

    cfg = micro_config(tmp_path / "full", steps=2, curriculum=[3])
    train_idlm(cfg)
    engine = hf.HFEngine.from_pretrained(cfg.out, dtype=torch.float32)
    prompt = engine.tokenizer("def f(x):\n", add_special_tokens=False)["input_ids"]
    (ar,) = engine.generate([prompt], max_new_tokens=12, sampling=SamplingParams(), seed=0, mode="ar")
    (isd,) = engine.generate([prompt], max_new_tokens=12, sampling=SamplingParams(), seed=0, mode="isd")
    assert isd.token_ids == ar.token_ids  # greedy ISD at tau = 0 is the model's own greedy AR output


def test_curriculum_schedule_and_time_plan():
    from selfspec.training.idlm.objective import IDLMConfig, balance_for, stage_index
    from selfspec.training.loop import lr_at
    from selfspec.training.loop import replan as _replan

    cfg = IDLMConfig(base="b", out="o", stride=4, curriculum=[2, 3, 4], stage_fractions=[1, 1, 2], steps=100,
                     lr=1.0, min_lr_ratio=0.1, warmup_ratio=0.1, time_budget_minutes=10)
    assert cfg.stage_fractions == [0.25, 0.25, 0.5]
    assert [cfg.curriculum[stage_index(cfg, s, 100)] for s in (0, 24, 25, 49, 50, 99)] == [2, 2, 3, 3, 4, 4]
    assert [balance_for(cfg, n) for n in (2, 3, 4)] == ["fixed", "fixed", "auto"]
    assert lr_at(cfg, 0, 100) == pytest.approx(0.1) and lr_at(cfg, 9, 100) == pytest.approx(1.0)
    assert lr_at(cfg, 100, 100) == pytest.approx(0.1)
    state = {"step": 10, "planned_steps": 100, "elapsed_s": 60.0}
    _replan(cfg, state, loop_seconds=60.0, loop_steps=10, reserve_s=0.0)  # 6 s/step, 540 s left
    assert state["planned_steps"] == 100  # capped by --steps
    state = {"step": 10, "planned_steps": 100, "elapsed_s": 300.0}
    _replan(cfg, state, loop_seconds=300.0, loop_steps=10, reserve_s=0.0)  # 30 s/step, 300 s left
    assert state["planned_steps"] == 20
    with pytest.raises(ValueError):
        IDLMConfig(base="b", out="o", stride=4, curriculum=[2, 3])


def test_on_policy_records_train_the_mask_half_only_and_mix_by_weight(micro_dir, data_file, micro_config, tmp_path):
    from transformers import AutoTokenizer

    from selfspec.training.data import LOSS_BOTH, LOSS_CLEAN, LOSS_MASK, batch_generator, load_data

    tok = AutoTokenizer.from_pretrained(micro_dir)
    f = tmp_path / "selfgen.jsonl"
    f.write_text("".join(json.dumps({"prefix_ids": [5, 6, 7], "ids": [8, 9, 10, 11], "clean_loss": False}) + "\n"
                         for _ in range(30)))
    data = load_data(tok, [str(data_file), str(f)], [0.75, 0.25])
    assert data.train.rows_per_part(8) == [6, 2]
    ids, lm = data.train.sample(batch_generator(0, 0, 0), 8, 16)
    assert ids.shape == lm.shape == (8, 17)
    assert bool((lm[:6] == LOSS_BOTH).all())  # text rows: both halves
    assert ids[6, :7].tolist() == [5, 6, 7, 8, 9, 10, 11] and lm[6, :7].tolist() == [0, 0, 0] + [LOSS_MASK] * 4
    mask_labels = shifted_labels(ids, (lm & LOSS_MASK) > 0)
    clean_labels = shifted_labels(ids, (lm & LOSS_CLEAN) > 0)
    assert mask_labels[6, :6].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 8, 9, 10, 11]
    assert bool((clean_labels[6:] == IGNORE_INDEX).all())
    assert data.heldout.num_tokens > 0 and not data.heldout.chat  # held-out = the first source


def test_auto_balance_ratio_uses_the_targets_both_halves_learn():
    torch.manual_seed(5)
    logits = torch.randn(2, 8, 30)
    labels = torch.randint(0, 30, (2, 4))
    clean_labels = labels.clone()
    clean_labels[1] = IGNORE_INDEX  # row 1: MASK half only (on-policy data)
    out = idlm_loss(logits, labels, "auto", clean_labels=clean_labels)
    ce = lambda lg, y: torch.nn.functional.cross_entropy(lg.reshape(-1, 30), y.reshape(-1))  # noqa: E731
    assert out.mask_ce == pytest.approx(float(ce(logits[:, :4], labels)), rel=1e-5)
    assert out.scale == pytest.approx(float(ce(logits[0, :4], labels[0]) / ce(logits[0, 4:], labels[0])), rel=1e-5)


def test_selfgen_records_are_the_models_own_greedy_continuations(tmp_path, tiny_base_path):
    from selfspec.engines.hf import HFEngine
    from selfspec.training.selfgen import generate_selfgen

    out = tmp_path / "selfgen.jsonl"
    info = generate_selfgen("tiny-base", out, num=4, prompt_tokens=32, new_tokens=12, batch_size=2, seed=3)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 4 and info["tokens"] == sum(len(r["ids"]) for r in records)
    assert all(r["clean_loss"] is False and len(r["prefix_ids"]) == 32 for r in records)
    engine = HFEngine.from_pretrained(tiny_base_path, dtype=torch.float32)
    greedy = engine.generate([r["prefix_ids"] for r in records], 12, mode="ar")
    assert [r["ids"] for r in records] == [o.token_ids for o in greedy]


def test_ar_anchor_kl_is_the_kl_from_the_teacher_and_trains_only_the_student():
    from selfspec.training.losses import ar_anchor_kl

    torch.manual_seed(2)
    student = torch.randn(2, 5, 11, requires_grad=True)
    teacher = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    labels[1, 3:] = IGNORE_INDEX
    assert float(ar_anchor_kl(teacher, teacher, labels)) == pytest.approx(0.0, abs=1e-6)
    kl = ar_anchor_kl(student, teacher, labels)
    valid = labels != IGNORE_INDEX
    p = torch.softmax(teacher[valid], -1)
    want = (p * (p.log() - torch.log_softmax(student[valid], -1))).sum(-1).mean()
    assert float(kl) == pytest.approx(float(want), rel=1e-5)
    kl.backward()
    assert student.grad is not None and teacher.grad is None


def test_ar_anchor_keeps_the_clean_half_closer_to_the_base(micro_dir, data_file, micro_config, tmp_path):
    from selfspec.training.idlm.objective import train_idlm
    from selfspec.training.losses import ar_anchor_kl

    base = _load(micro_dir)
    ids = torch.tensor([list(json.loads(line)["text"].encode()[:40]) for line in data_file.read_text().splitlines()[:4]])
    ids = ids.remainder(base.config.vocab_size)  # any token ids will do for a distance between models
    labels = torch.zeros(ids.shape, dtype=torch.long)
    kls = {}
    for weight in (0.0, 5.0):
        res = train_idlm(micro_config(tmp_path / f"anchor-{weight}", export=False,
                                 ar_anchor_weight=weight))
        model = res["model"].eval()
        with torch.no_grad():
            kls[weight] = float(ar_anchor_kl(model(input_ids=ids).logits, base(input_ids=ids).logits, labels))
    assert kls[5.0] < 0.5 * kls[0.0], kls


def test_anchor_teacher_runs_only_on_rows_with_clean_labels(micro_dir):
    from selfspec.training.idlm.objective import anchor_teacher_logits

    teacher = _load(micro_dir)
    seen = []
    teacher.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs["input_ids"].shape[0]),
                                      with_kwargs=True)
    ids = torch.randint(0, teacher.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    clean_labels = shifted_labels(ids)
    clean_labels[1] = IGNORE_INDEX  # an on-policy row: MASK half only, nothing for the anchor
    with torch.no_grad():
        full = teacher(input_ids=ids[:, :-1]).logits
    seen.clear()
    got = anchor_teacher_logits(teacher, ids, clean_labels)
    assert seen == [2] and got.shape == full.shape  # the teacher saw rows 0 and 2 only
    torch.testing.assert_close(got[[0, 2]], full[[0, 2]], rtol=1e-5, atol=1e-5)
    assert not got[1].any()
    seen.clear()
    clean_labels = shifted_labels(ids)
    torch.testing.assert_close(anchor_teacher_logits(teacher, ids, clean_labels), full)
    assert seen == [3]


def test_mask_self_distillation_is_tempered_on_both_sides_and_trains_only_the_mask_half():
    from selfspec.training.losses import self_distill_ce

    torch.manual_seed(3)
    mask = torch.randn(2, 5, 11, requires_grad=True)
    clean = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 4] = IGNORE_INDEX
    valid = labels != IGNORE_INDEX
    for temp in (1.0, 0.7):
        got = self_distill_ce(mask, clean, labels, temp)
        want = -(torch.softmax(clean[valid] / temp, -1) * torch.log_softmax(mask[valid] / temp, -1)).sum(-1).mean()
        assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert float(self_distill_ce(mask, clean, labels, 0.7)) != pytest.approx(float(self_distill_ce(mask, clean, labels)))
    # the gradient vanishes where the MASK distribution already equals the tempered clean one
    same = clean.detach().clone().requires_grad_(True)
    self_distill_ce(same, clean, labels, 0.7).backward()
    assert float(same.grad.abs().max()) < 1e-6 and clean.grad is None


def test_distillation_temperatures_cycle_over_batches():
    from selfspec.errors import UsageError
    from selfspec.training.idlm.objective import IDLMConfig, IDLMObjective

    cfg = IDLMConfig(base="b", out="o", stride=2, mask_distill_weight=0.5, mask_distill_temperatures=[1.0, 0.7])
    objective = IDLMObjective.__new__(IDLMObjective)  # stage() reads the config alone
    objective.cfg = cfg
    temps = [objective.stage(step, 10, {})["distill_temperature"] for step in range(4)]
    assert temps == [1.0, 0.7, 1.0, 0.7]
    objective.cfg = IDLMConfig(base="b", out="o", stride=2)  # no distillation: the stage says nothing of it
    assert "distill_temperature" not in objective.stage(0, 10, {})
    with pytest.raises(UsageError, match="mask-distill-temperatures"):
        IDLMConfig(base="b", out="o", stride=2, mask_distill_temperatures=[0.0])
