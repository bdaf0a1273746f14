"""Unit tests of the selfspec SGLang plugin's pieces that need no server: the torch_native
verify attention, the verify mask layouts, step padding, the gated LoRA mapping onto SGLang's
fused layers, request checks and per-request metrics."""

from __future__ import annotations

import math

import pytest
import torch

from selfspec.decoding.step import StepLayout, branch_visibility, collate


def _naive(q, k_cache, v_cache, rows, L, local, scale):
    """Per request: softmax over [prefix | step] with an explicit -inf mask, GQA by repeat."""
    out = []
    hq, hk = q.shape[1], k_cache.shape[1]
    for r, (slots, n) in enumerate(zip(rows, L)):
        W = local.shape[-1]
        k = k_cache[slots[: n + W]].repeat_interleave(hq // hk, dim=1)  # [T, Hq, D]
        v = v_cache[slots[: n + W]].repeat_interleave(hq // hk, dim=1)
        qr = q[r * W:(r + 1) * W]  # [W, Hq, D]
        scores = torch.einsum("whd,thd->hwt", qr, k) * scale
        mask = torch.cat([torch.ones(W, n, dtype=torch.bool), local[r]], dim=1)
        scores = scores.masked_fill(~mask, float("-inf"))
        out.append(torch.einsum("hwt,thd->whd", scores.softmax(-1), v))
    return torch.cat(out)


@pytest.mark.parametrize("full", [False, True])
def test_verify_attention_matches_naive_reference(full):
    from selfspec.sglang_ext.attention import plan_verify, verify_attention
    from selfspec.sglang_ext.worker import build_custom_mask

    torch.manual_seed(0)
    hq, hk, d, W = 4, 2, 16, 5
    L = [3, 9, 6]
    slots = 64
    k_cache, v_cache = torch.randn(slots, hk, d), torch.randn(slots, hk, d)
    perm = torch.randperm(slots)
    req_to_token = torch.zeros(4, 32, dtype=torch.int32)
    rows = []
    for r, n in enumerate(L):
        s = perm[r * 20:r * 20 + n + W]
        req_to_token[r + 1, : n + W] = s.to(torch.int32)
        rows.append(s)
    branch = torch.tensor([[0, 1, 1, 2, 2], [0, 0, 0, 0, 0], [0, 1, 2, 1, -1]])
    local = branch_visibility(branch)
    q = torch.randn(len(L) * W, hq, d)
    out = torch.empty_like(q)
    mask = build_custom_mask(local, L, full)
    plan = plan_verify(req_to_token, torch.tensor([1, 2, 3]), L, W, mask)
    verify_attention(q, k_cache, v_cache, plan, 1 / math.sqrt(d), out)
    want = _naive(q, k_cache, v_cache, rows, L, local, 1 / math.sqrt(d))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_ragged_verify_attention_equals_the_padded_one_on_real_rows():
    """A ragged verify forward carries each request's real tokens only; the attention runs each
    group of requests of similar width padded to its own widest, and the real rows' outputs are
    the padded forward's; the logits come back padded with zero rows (into reused memory too)."""
    from selfspec.sglang_ext.attention import PadBuffer, RaggedVerify, plan_verify, verify_attention
    from selfspec.sglang_ext.worker import build_custom_mask

    torch.manual_seed(1)
    hq, hk, d, W = 4, 2, 8, 9
    L = [5, 2, 7, 3, 4, 6, 1, 8]
    widths = [9, 1, 3, 2, 9, 3, 1, 2]
    bs = len(L)
    k_cache, v_cache = torch.randn(bs * 20, hk, d), torch.randn(bs * 20, hk, d)
    req_to_token = torch.arange(bs * 20, dtype=torch.int32).view(bs, 20)
    local = torch.ones(bs, W, W, dtype=torch.bool).tril()
    mask = build_custom_mask(local, L, False)
    q = torch.randn(bs * W, hq, d)
    padded = verify_attention(q, k_cache, v_cache, plan_verify(req_to_token, torch.arange(bs), L, W, mask), 0.5,
                              torch.empty_like(q))
    ragged = RaggedVerify.of(widths, W, "cpu")
    assert ragged.rows.tolist()[:11] == list(range(9)) + [9, 18]
    plan = plan_verify(req_to_token, torch.arange(bs), L, W, mask, ragged.widths)
    assert [p.width for p in plan.parts] == [3, 9]  # the narrow requests in one call, not padded to 9
    assert sorted(r for p in plan.parts for r in p.requests.tolist()) == list(range(bs))
    out = verify_attention(ragged.pad(ragged.take(q)), k_cache, v_cache, plan, 0.5, torch.zeros_like(q))
    torch.testing.assert_close(ragged.take(out), ragged.take(padded), rtol=1e-6, atol=1e-6)
    buffer = PadBuffer()
    for rows in (11, 5):  # reused memory: the second step's padding rows are zero again
        real = torch.randn(len(ragged.rows), rows)
        logits = ragged.pad(real, buffer)
        assert logits.shape == (bs * W, rows) and not logits[9 + 1:18].any()  # request 1's padding
        assert torch.equal(ragged.take(logits), real)
    assert RaggedVerify.of([W] * bs, W, "cpu") is None  # full rows: the padded forward as it was


def test_width_groups_pad_each_group_to_its_widest_and_stop_where_a_call_costs_more():
    from selfspec.sglang_ext.attention import GROUP_COST_ROWS, width_groups

    assert width_groups([5, 5, 5]) == [([0, 1, 2], 5)]
    # 28 requests drafting 4, 4 drafting 12: two calls (28*4 + 4*12) instead of 32*12 rows
    widths = [12 if r % 8 == 0 else 4 for r in range(32)]
    assert width_groups(widths) == [([r for r in range(32) if r % 8], 4), ([0, 8, 16, 24], 12)]
    # a narrower group that saves fewer rows than a call costs is not split off
    assert width_groups([3, 2]) == [([0, 1], 3)]
    assert GROUP_COST_ROWS > 1
    groups = width_groups([1, 2, 3, 5, 8, 13, 13, 13] * 4, max_groups=3)
    assert len(groups) <= 3 and sorted(r for g, _ in groups for r in g) == list(range(32))
    assert all(max([1, 2, 3, 5, 8, 13, 13, 13][r % 8] for r in g) == w for g, w in groups)


def test_full_mask_layout_matches_sglang_ngram_layout():
    from selfspec.sglang_ext.worker import build_custom_mask

    local = branch_visibility(torch.tensor([[0, 1, 1], [0, 0, 0]]))
    full = build_custom_mask(local, [2, 1], full=True)
    assert full.numel() == 3 * (2 + 3) + 3 * (1 + 3)  # sum over requests of W * (L + W)
    first = full[: 3 * 5].view(3, 5)
    assert first[:, :2].all() and torch.equal(first[:, 2:], local[0])
    assert torch.equal(build_custom_mask(local, [2, 1], full=False), local.flatten())


def test_pad_layout_keeps_real_tokens_blind_to_padding():
    from selfspec.sglang_ext.worker import pad_layout

    lay = StepLayout([7, 8, 9], offsets=[0, 1, 2], branch=[0, 1, 1], gate=[False, True, True])
    padded = pad_layout(lay, 6, pad_token=1)
    assert padded.tokens == [7, 8, 9, 1, 1, 1] and padded.offsets == [0, 1, 2, 3, 4, 5]
    assert padded.gate == [False, True, True, False, False, False]
    batch = collate([padded, pad_layout(StepLayout([5]), 6, 1)])
    assert not batch.local[0, :3, 3:].any()  # real queries never see padding
    assert batch.local[0, 3:, 0].all()  # padding sees the trunk (no fully masked rows)
    assert torch.equal(batch.local[0, :3, :3], branch_visibility(torch.tensor([[0, 1, 1]]))[0])
    with pytest.raises(RuntimeError):
        pad_layout(StepLayout([1] * 7), 6, 1)


class _FakeLayer(torch.nn.Module):
    def __init__(self, weight, output_sizes=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        if output_sizes is not None:
            self.output_sizes = output_sizes


def _base_apply(self, layer, x, bias=None):
    return torch.nn.functional.linear(x, layer.weight, bias)


def test_gated_lora_on_fused_qkv_matches_peft_and_keeps_gated_off_rows_exact(tmp_path, tiny_base_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from selfspec.sglang_ext import lora as loramod

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_base_path), dtype=torch.float32)
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                target_modules=["q_proj", "v_proj", "down_proj"]))
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    attn = peft_model.base_model.model.model.layers[0].self_attn
    mlp = peft_model.base_model.model.model.layers[0].mlp
    q, k, v = attn.q_proj.base_layer.weight, attn.k_proj.weight, attn.v_proj.base_layer.weight
    sizes = [q.shape[0], k.shape[0], v.shape[0]]

    # an SGLang-shaped model: fused qkv_proj with output_sizes, plain down_proj
    sg = torch.nn.Module()
    sg.model = torch.nn.Module()
    layer0 = torch.nn.Module()
    layer0.self_attn = torch.nn.Module()
    layer0.mlp = torch.nn.Module()
    layer0.self_attn.qkv_proj = _FakeLayer(torch.cat([q, k, v]).detach().clone(), sizes)
    layer0.mlp.down_proj = _FakeLayer(mlp.down_proj.base_layer.weight.detach().clone())
    sg.model.layers = torch.nn.ModuleList([layer0])
    # the adapter covers every layer; keep only layer 0's tensors for this fake model
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    save_file({k_: t for k_, t in state.items() if ".layers.0." in k_},
              str(tmp_path / "adapter" / "adapter_model.safetensors"))
    handle = loramod.attach_to_sglang_model(sg, str(tmp_path / "adapter"))
    assert len(handle.layers) == 2

    x = torch.randn(6, q.shape[1])
    gate = torch.tensor([False, True, False, True, True, False])
    base = _base_apply(None, layer0.self_attn.qkv_proj, x)
    with handle.gate.active(gate):
        got = loramod._apply_around(_base_apply, None, layer0.self_attn.qkv_proj, x)
    with torch.no_grad():
        want = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)  # PEFT: LoRA on every row
    assert torch.equal(got[~gate], base[~gate])  # bit for bit the base layer where the gate is off
    torch.testing.assert_close(got[gate], want[gate], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got[gate], base[gate])  # the adapter does act at gated rows
    # no gate (prefill, other modes): the original method untouched
    assert torch.equal(loramod._apply_around(_base_apply, None, layer0.self_attn.qkv_proj, x), base)

    xd = torch.randn(6, mlp.down_proj.base_layer.weight.shape[1])
    with handle.gate.active(gate):
        got = loramod._apply_around(_base_apply, None, layer0.mlp.down_proj, xd)
    with torch.no_grad():
        want = mlp.down_proj(xd)
    torch.testing.assert_close(got[gate], want[gate], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[~gate], _base_apply(None, layer0.mlp.down_proj, xd)[~gate])


def test_adapter_for_another_shape_is_refused(tmp_path, tiny_base_path):
    from selfspec.sglang_ext import lora as loramod

    sg = torch.nn.Module()
    sg.model = torch.nn.Module()
    layer0 = torch.nn.Module()
    layer0.mlp = torch.nn.Module()
    layer0.mlp.down_proj = _FakeLayer(torch.zeros(7, 5))
    sg.model.layers = torch.nn.ModuleList([layer0])
    from safetensors.torch import save_file

    d = tmp_path / "a"
    d.mkdir()
    (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 2}')
    save_file({"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.zeros(2, 9),
               "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": torch.zeros(7, 2)},
              str(d / "adapter_model.safetensors"))
    with pytest.raises(loramod.LoRAAttachError, match="another base"):
        loramod.attach_to_sglang_model(sg, str(d))


def test_request_checks():
    from types import SimpleNamespace

    from selfspec.sglang_ext.request_checks import check_sampling_params

    def sp(**kw):
        base = dict(top_k=1, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_p=0.0,
                    logit_bias=None, min_new_tokens=0, json_schema=None, regex=None, ebnf=None, structural_tag=None)
        base.update(kw)
        return SimpleNamespace(**base)

    check_sampling_params(sp(), "JACOBI")
    check_sampling_params(sp(top_k=50), "SJD")
    with pytest.raises(ValueError, match="greedy only"):
        check_sampling_params(sp(top_k=50), "JACOBI")
    # served exactly now (logits_rules): no refusal
    check_sampling_params(sp(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5, min_p=0.1,
                             logit_bias={"3": -5.0}, min_new_tokens=4), "ISD")
    check_sampling_params(sp(regex="a+"), "RISD")  # grammars are served (sglang_ext/grammar.py)
    with pytest.raises(ValueError, match="beam search"):
        check_sampling_params(sp(beam_width=4), "SJD")
    check_sampling_params(sp(top_k=50, watermark={"enabled": True}), "SJD")  # served (decoding/requests/watermark.py)


def test_request_metrics_conventions():
    from selfspec.sglang_ext.metrics import request_metrics

    m = request_metrics(completion_tokens=10, verify_ct=3)
    assert m["selfspec_tpf"] == pytest.approx(10 / 4)  # prefill counts as a forward
    assert m["selfspec_accept_length"] == pytest.approx(9 / 3)


def test_sampling_from_sglang_params():
    from types import SimpleNamespace

    from selfspec.sglang_ext.worker import base_seed_for, sampling_from_req

    rules = dict(frequency_penalty=0.5, presence_penalty=0.0, repetition_penalty=1.2, min_p=0.1,
                 logit_bias={"7": -2.0, "07": -3.0}, min_new_tokens=3)
    greedy = SimpleNamespace(sampling_params=SimpleNamespace(top_k=1, temperature=1.0, top_p=1.0, sampling_seed=None,
                                                             **rules), rid="a")
    g = sampling_from_req(greedy)
    assert g.greedy and g.min_p == 0.0  # min_p cannot change a greedy token
    # a greedy request keeps its rules; "7" and "07" are one token, the last value wins as in SGLang
    assert (g.frequency_penalty, g.repetition_penalty, g.logit_bias, g.min_new_tokens) == (0.5, 1.2, ((7, -3.0),), 3)
    sampled = SimpleNamespace(sampling_params=SimpleNamespace(top_k=1 << 30, temperature=0.7, top_p=0.9,
                                                              sampling_seed=5, **rules), rid="b")
    p = sampling_from_req(sampled)
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.7, 0, 0.9, 0.1)
    assert base_seed_for(sampled) == 5
    assert base_seed_for(greedy) == base_seed_for(greedy)  # derived from the id: same on every TP rank


def test_retracted_request_keeps_its_seed_counter():
    """Re-prefill after retraction: the counter (and metrics) carry on; a chunked first prefill
    (no output yet) starts at 0, so its first token's draw does not depend on the chunking."""
    from types import SimpleNamespace

    from selfspec.sglang_ext.worker import RequestState, SelfSpecWorker

    sp = SimpleNamespace(top_k=1, temperature=1.0, top_p=1.0, sampling_seed=3, frequency_penalty=0.0,
                         presence_penalty=0.0, repetition_penalty=1.0, min_p=0.0, logit_bias=None,
                         min_new_tokens=0, stop_token_ids=None, json_schema=None, regex=None, ebnf=None,
                         structural_tag=None)
    worker = object.__new__(SelfSpecWorker)
    worker.cfg = SimpleNamespace(mask_token_id=None)
    req = SimpleNamespace(rid="r", sampling_params=sp, origin_input_ids=[1, 2, 3], output_ids=[], eos_token_ids=None,
                          tokenizer=None)
    worker.states = {"r": RequestState(None, 3, counter=17)}
    assert worker._fresh_state(req).counter == 0  # a prefill chunk: nothing generated yet
    req.output_ids = [4, 5]
    st = worker._fresh_state(req)
    assert st.counter == 17 and st.seq.history == [1, 2, 3, 4, 5] and st.seq.output == [4, 5]


# ------------------------------------------------------------------------------ tensor parallelism
def _tp_delta(x, a, b):
    return x @ a.T @ b.T


def test_column_parallel_lora_shards_give_each_rank_its_output_slice():
    """Fused q/k/v (tp 4, 2 KV heads: each KV head on two ranks) and gate/up: per rank, the
    sharded LoRA's delta is the full delta's rows of that rank's output shard."""
    from selfspec.sglang_ext.lora import LayerShard, shard_lora

    torch.manual_seed(0)
    head, q_heads, kv_heads, tp, r, width = 4, 8, 2, 4, 6, 16
    parts = [q_heads * head, kv_heads * head, kv_heads * head]
    a, b = torch.randn(r, width), torch.randn(sum(parts), r)
    x = torch.randn(5, width)
    full = _tp_delta(x, a, b).split(parts, dim=1)
    q_local, kv_local = q_heads * head // tp, head  # one KV head per rank, replicated twice
    for rank in range(tp):
        kv_shard = rank // (tp // kv_heads)
        shard = LayerShard(rows=((rank * q_local, q_local), (kv_shard * kv_local, kv_local),
                                 (kv_shard * kv_local, kv_local)))
        la, lb = shard_lora(a, b, parts, shard)
        got = _tp_delta(x, la, lb).split([q_local, kv_local, kv_local], dim=1)
        assert torch.allclose(got[0], full[0][:, rank * q_local:(rank + 1) * q_local], atol=1e-5)
        for i in (1, 2):
            assert torch.allclose(got[i], full[i][:, kv_shard * kv_local:(kv_shard + 1) * kv_local], atol=1e-5)
    # gate/up on 2 ranks
    parts = [12, 12]
    b = torch.randn(24, r)
    full = _tp_delta(x, a, b).split(parts, dim=1)
    for rank in range(2):
        la, lb = shard_lora(a, b, parts, LayerShard(rows=((rank * 6, 6), (rank * 6, 6))))
        gate, up = _tp_delta(x, la, lb).split([6, 6], dim=1)
        assert torch.allclose(gate, full[0][:, rank * 6:(rank + 1) * 6], atol=1e-5)
        assert torch.allclose(up, full[1][:, rank * 6:(rank + 1) * 6], atol=1e-5)


def test_row_parallel_lora_partials_sum_to_the_full_delta():
    """o / down: each rank adds B (A_r x_r) to its partial output; the all-reduce's sum is B A x."""
    from selfspec.sglang_ext.lora import LayerShard, shard_lora

    torch.manual_seed(1)
    a, b, x = torch.randn(6, 16), torch.randn(10, 6), torch.randn(5, 16)
    total = sum(_tp_delta(x[:, rank * 8:(rank + 1) * 8], *shard_lora(a, b, [10], LayerShard(cols=(rank * 8, 8))))
                for rank in range(2))
    assert torch.allclose(total, _tp_delta(x, a, b), atol=1e-5)
    assert not torch.allclose(_tp_delta(x[:, :8], *shard_lora(a, b, [10], LayerShard(cols=(0, 8)))), total)


def test_thread_binding_splits_the_cpus_between_ranks(monkeypatch):
    import argparse

    from selfspec.sglang_ext import cpu_defaults

    assert cpu_defaults.thread_binding(2, [0, 1]) == "0|1"
    assert cpu_defaults.thread_binding(2, [0, 1, 2, 3]) == "0,1|2,3"
    assert cpu_defaults.thread_binding(4, [0, 1]) == "0|1|0|1"  # more ranks than CPUs: shared
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(cpu_defaults, "numa_node_count", lambda: 1)
    assert cpu_defaults.fill_thread_binding(argparse.Namespace(tp_size=1, dp_size=1, pp_size=1)) is None
    value = cpu_defaults.fill_thread_binding(argparse.Namespace(tp_size=2, dp_size=1, pp_size=1))
    assert value and value.count("|") == 1 and __import__("os").environ["SGLANG_CPU_OMP_THREADS_BIND"] == value
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0-7|8-15")  # the user's own binding wins
    assert cpu_defaults.fill_thread_binding(argparse.Namespace(tp_size=2, dp_size=1, pp_size=1)) is None


def test_cpu_engine_groups_get_no_gpu_communicators(monkeypatch):
    from selfspec.sglang_ext.cpu_compat import distributed

    seen = {}

    def group(*args, **kwargs):
        seen.update(kwargs)
        return "group"
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert distributed._group_without_gpu_communicators(group, [[0, 1]], 0, "gloo", use_pynccl=None) == "group"
    assert all(seen[name] is False for name in distributed.GPU_COMMUNICATORS)
    seen.clear()
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "0")  # a GPU engine keeps SGLang's own choice
    distributed._group_without_gpu_communicators(group, [[0, 1]], 0, "nccl", use_pynccl=None)
    assert seen == {"use_pynccl": None}


def test_verify_plan_is_built_once_per_forward_and_never_reused_across_forwards():
    from types import SimpleNamespace

    from selfspec.sglang_ext import attention

    req_to_token = torch.arange(64, dtype=torch.int32).view(2, 32)

    def forward_batch(lens):
        spec = SimpleNamespace(custom_mask=torch.ones(len(lens) * 3 * 3, dtype=torch.bool), draft_token_num=3)
        return SimpleNamespace(spec_info=spec, seq_lens_cpu=torch.tensor(lens), seq_lens=torch.tensor(lens),
                               req_pool_indices=torch.arange(len(lens)))

    fb = forward_batch([4, 6])
    first = attention._forward_plan(fb, req_to_token, 3)
    assert attention._forward_plan(fb, req_to_token, 3) is first  # every later layer of the forward
    nxt = forward_batch([5, 7])  # the next step: new lengths, new spec
    plan = attention._forward_plan(nxt, req_to_token, 3)
    (part,) = plan.parts
    assert plan is not first and plan.kv_max == 7 + 3 and part.slots.shape == (2 * (7 + 3),)
    assert torch.equal(part.slots.view(2, 10)[1], req_to_token[1, :10].long())


def test_tensor_parallel_ranks_follow_the_plan_as_written():
    """The run-time check chooses steps by each process's own clock; tensor-parallel ranks must
    run the same step, so with --tp-size > 1 it is off (data-parallel ranks are independent)."""
    from types import SimpleNamespace

    from selfspec.sglang_ext.worker import timing_check_allowed

    assert timing_check_allowed(SimpleNamespace(tp_size=1, dp_size=2))
    assert not timing_check_allowed(SimpleNamespace(tp_size=2, dp_size=1))
