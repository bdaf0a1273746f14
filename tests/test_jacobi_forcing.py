"""Jacobi Forcing: the packed layout and its masks, trajectories, the noise schedule, the loss,
training on the loop (loss goes down, resume is exact), rounds, export into the JACOBI decoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from selfspec.training.jacobi_forcing import masks as JM
from selfspec.training.jacobi_forcing.data import (
    Trajectory, first_error, noise_levels, pack, pack_trajectories, pick_state, state_noise, target_noise,
)
from selfspec.training.jacobi_forcing.masks import JFLayout

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------ masks, cell by cell
def _reference_mask(P: int, n: int, T: int, context: str, w: int) -> torch.Tensor:
    """The visibility table of jacobi_forcing.masks' docstring, written out per cell with plain ints."""
    def where(i):
        if i < P:
            return ("prompt", -1, i)
        r = i - P
        return ("noisy" if r % (2 * n) < n else "clean", r // (2 * n), r % n)

    L = P + 2 * T * n
    out = torch.zeros(L, L, dtype=torch.bool)
    for q in range(L):
        qk, qj, qt = where(q)
        for k in range(L):
            kk, kj, kt = where(k)
            if qk == "prompt":
                ok = kk == "prompt" and k <= q
            elif kk == "prompt":
                ok = True
            elif kj > qj:
                ok = False
            elif kj == qj:
                ok = kk == qk and kt <= qt
            elif qk == "clean":
                ok = kk == "clean"
            elif context == "nc":
                ok = kk == "noisy"
            elif context == "cllm":
                ok = kk == "clean"
            else:  # nc_ic
                same_window = qj // w == kj // w
                ok = (kk == "clean") if same_window else (kk == "noisy")
            out[q, k] = ok
    return out


@pytest.mark.parametrize("context, window", [("nc", 1), ("cllm", 1), ("nc_ic", 2), ("nc_ic", 3)])
@pytest.mark.parametrize("P, n, T", [(3, 2, 4), (5, 3, 3)])
def test_jf_mask_equals_the_table_cell_by_cell(context, window, P, n, T):
    layout = JFLayout(P, n, T, context, window)
    assert torch.equal(JM.dense_mask(layout)[0, 0], _reference_mask(P, n, T, context, window))


def test_mask_variants_differ_where_the_seed_says():
    P, n, T = 2, 2, 4
    nc, cllm, ncic = (JM.dense_mask(JFLayout(P, n, T, c, 2))[0, 0] for c in ("nc", "cllm", "nc_ic"))
    k3 = JFLayout(P, n, T).noisy_index(3)
    k0, c0, k2, c2 = (JFLayout(P, n, T).noisy_index(0), JFLayout(P, n, T).clean_index(0),
                      JFLayout(P, n, T).noisy_index(2), JFLayout(P, n, T).clean_index(2))
    assert nc[k3, k0] and not nc[k3, c0]  # NC: earlier noisy blocks, never clean ones
    assert cllm[k3, c0] and not cllm[k3, k0]  # CLLM: earlier clean blocks
    assert ncic[k3, k0] and not ncic[k3, c0]  # NC-IC, other window (block 0 vs 3, w = 2): noisy
    assert ncic[k3, c2] and not ncic[k3, k2]  # same window: clean
    for m in (nc, cllm, ncic):  # clean rows identical in every variant, and nothing sees the future
        clean_rows = JFLayout(P, n, T).clean_indices().flatten()
        assert torch.equal(m[clean_rows], nc[clean_rows])
        assert not m[k0, c0:].any()


@pytest.mark.parametrize("block", [8, 16])
def test_flex_block_mask_equals_the_dense_mask(block):
    from selfspec.training.idlm.masks import block_mask_to_dense

    for context in ("nc", "cllm", "nc_ic"):
        layout = JFLayout(5, 4, 5, context, 2)
        dense = JM.dense_mask(layout)[0, 0]
        assert torch.equal(block_mask_to_dense(JM.flex_block_mask(layout, device="cpu", block_size=block)), dense)


def test_left_padding_and_position_ids():
    layout = JFLayout(4, 2, 2, "nc")
    lens = torch.tensor([4, 2])
    pos = JM.position_ids(layout, lens)
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7]  # noisy block j shares its clean block's ids
    assert pos[1].tolist()[2:] == [0, 1, 2, 3, 2, 3, 4, 5, 4, 5]
    mask = JM.dense_mask(layout, lens)
    assert not mask[1, 0, :, :2].any(-1)[2:].any()  # nobody sees the padding
    assert mask[1, 0, 0, 0] and mask[1, 0, 0].sum() == 1  # a padding query sees only itself
    assert torch.equal(mask[0, 0], JM.dense_mask(layout)[0, 0])


# ------------------------------------------------------------------------------ the free tests
def _micro(micro_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(micro_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


def _random_rows(vocab: int, bsz=2, P=5, n=4, T=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (P,), generator=g).tolist() for _ in range(bsz)]
    clean = torch.randint(3, vocab, (bsz, T, n), generator=g)
    noisy = clean.clone()
    noisy[..., 2:] = torch.randint(3, vocab, (bsz, T, n - 2), generator=g)
    return prompts, noisy, clean


@pytest.mark.parametrize("context", ["nc", "cllm", "nc_ic"])
def test_clean_rows_are_a_plain_causal_forward(micro_dir, context):
    from selfspec.training.jacobi_forcing.forward import forward

    model = _micro(micro_dir)
    prompts, noisy, clean = _random_rows(model.config.vocab_size)
    batch = pack(prompts, noisy, clean, 0, context, window=2)
    with torch.no_grad():
        chain = forward(model, batch, "sdpa").chain
        plain = model(input_ids=batch.plain_ids).logits
    P = batch.layout.prompt_len
    torch.testing.assert_close(chain, plain[:, P - 1 :], atol=1e-5, rtol=1e-5)


def test_cllm_noisy_rows_are_one_single_block_jacobi_step(micro_dir):
    from selfspec.training.jacobi_forcing.forward import forward, jacobi_update

    model = _micro(micro_dir)
    prompts, noisy, clean = _random_rows(model.config.vocab_size)
    batch = pack(prompts, noisy, clean, 0, "cllm")
    with torch.no_grad():
        got = jacobi_update(forward(model, batch, "sdpa", chain=False).noisy, noisy)
        n = noisy.shape[-1]
        for b, p in enumerate(prompts):
            for j in range(noisy.shape[1]):
                row = torch.tensor([p + clean[b, :j].flatten().tolist() + noisy[b, j].tolist()])
                step = model(input_ids=row).logits[0, -n:].argmax(-1)
                assert got[b, j, 0] == noisy[b, j, 0]
                assert got[b, j, 1:].tolist() == step[:-1].tolist()


# ------------------------------------------------------------------------------ trajectories
@pytest.fixture(scope="module")
def trajectories(micro_dir, data_file, tmp_path_factory):
    from selfspec.training.jacobi_forcing.trajectories import TrajectoryConfig, collect

    out = tmp_path_factory.mktemp("traj")
    cfg = TrajectoryConfig(model=str(micro_dir), out=str(out), block_size=4, new_tokens=16, prompt_tokens=12,
                           num_prompts=12, heldout_prompts=4, data=[str(data_file)], batch_size=4, shard_size=4,
                           progress_bar=False)
    return cfg, collect(cfg)


def test_trajectories_start_at_the_draft_and_end_at_greedy_ar(micro_dir, trajectories):
    from selfspec.engines.hf import HFEngine
    from selfspec.training.jacobi_forcing.trajectories import initial_drafts, load_trajectories

    cfg, manifest = trajectories
    assert manifest["splits"]["train"]["kept"] == 12 and manifest["splits"]["train"]["dropped"] == 0
    trajs = load_trajectories(cfg.out)
    engine = HFEngine.from_pretrained(str(micro_dir))
    greedy = engine.generate([t.prompt_ids for t in trajs], max_new_tokens=16, mode="ar", stop_token_ids=[])
    first_shard = trajs[:4]
    drafts = initial_drafts([t.prompt_ids for t in first_shard], [t.response_ids for t in first_shard], 4,
                            salt=cfg.seed * 1_000_003)
    for k, (tr, g) in enumerate(zip(trajs, greedy)):
        assert tr.response_ids == g.token_ids  # the fixed points are the model's greedy AR output
        assert tr.num_blocks == 4 and tr.block_size == 4
        for j, states in enumerate(tr.states):
            assert states[-1] == tr.fixed(j)
            assert states[0][0] == tr.fixed(j)[0]
            context = set(tr.prompt_ids + tr.response_ids[: 4 * j])
            assert set(states[0][1:]) <= context  # the draft comes from the context's own tokens
            if k < 4:
                assert states[0] == drafts[k, j].tolist()  # the stored first state is the initial draft
            prefix = [first_error(s, tr.fixed(j)) for s in states]
            assert all(b > a for a, b in zip(prefix, prefix[1:]))  # each Jacobi step fixes >= 1 token
    assert any(len(s) > 2 for tr in trajs for s in tr.states)  # not a trivial collection


def test_trajectory_collection_resumes_and_refuses_other_settings(trajectories):
    from dataclasses import replace

    from selfspec.errors import UsageError
    from selfspec.training.jacobi_forcing.trajectories import collect

    cfg, _ = trajectories
    shard = Path(cfg.out) / "train" / "shard-00001.jsonl"
    before = shard.read_text()
    shard.unlink()
    again = collect(cfg)
    assert shard.read_text() == before and again["splits"]["train"]["kept"] == 12
    with pytest.raises(UsageError, match="other settings"):
        collect(replace(cfg, block_size=8))


# ------------------------------------------------------------------------------ schedule
def test_noise_schedule_and_state_selection():
    assert noise_levels(4) == [0, 0.25, 0.5, 0.75]
    assert [target_noise("progressive", i, 4) for i in range(6)] == [0, 0.25, 0.5, 0.75, 0, 0.25]
    assert [target_noise("reverse", i, 4) for i in range(4)] == [0.75, 0.5, 0.25, 0]
    assert [target_noise("progressive", i, 4, phase=1) for i in range(4)] == [0.25, 0.5, 0.75, 0]
    g = torch.Generator().manual_seed(0)
    draws = {target_noise("random", 0, 4, generator=g) for _ in range(50)}
    assert draws == set(noise_levels(4))
    fixed = [1, 2, 3, 4]
    states = [[1, 9, 9, 9], [1, 2, 9, 9], [1, 2, 3, 9], fixed]
    assert [state_noise(s, fixed) for s in states] == [0.75, 0.5, 0.25, 0.0]
    assert pick_state(states, fixed, 0.5) == [1, 2, 9, 9]
    assert pick_state(states, fixed, 0.6) == [1, 2, 9, 9]
    assert pick_state(states, fixed, 0.375) == [1, 2, 9, 9]  # a tie goes to the first recorded
    assert pick_state(states, fixed, 1.0) == [1, 9, 9, 9]
    tr = Trajectory([7, 7], fixed * 2, [states, states])
    batch = pack_trajectories([tr], 0, "progressive", 2, "nc", phase=0)
    assert batch.noisy[0].tolist() == [fixed, [1, 2, 9, 9]]  # t = 0, then 1/2
    batch = pack_trajectories([tr], 0, "progressive", 2, "nc", phase=1)
    assert batch.noisy[0].tolist() == [[1, 2, 9, 9], fixed]  # the next epoch's phase


# ------------------------------------------------------------------------------ loss
def test_consistency_counts_from_the_first_error_and_nothing_after_eos():
    from selfspec.training.jacobi_forcing.losses import chain_labels, consistency_labels
    from selfspec.training.losses import IGNORE_INDEX as X

    clean = torch.tensor([[[1, 2, 3, 4], [5, 6, 0, 8]]])  # EOS (0) at response offset 6
    noisy = torch.tensor([[[1, 2, 9, 9], [5, 9, 0, 8]]])
    batch = pack([[3, 3]], noisy, clean, 0, eos_at=[6])
    assert consistency_labels(batch).tolist() == [[[X, X, 0, 0], [X, 0, X, X]]]
    assert chain_labels(batch).tolist() == [[1, 2, 3, 4, 5, 6, 0, X, X]]
    batch = pack([[3, 3]], noisy, clean, 0)
    assert consistency_labels(batch).tolist() == [[[X, X, 0, 0], [X, 0, 0, 0]]]
    assert chain_labels(batch).tolist() == [[1, 2, 3, 4, 5, 6, 0, 8, X]]


def test_jf_loss_is_zero_consistency_when_noisy_equals_clean_and_gradients_flow(micro_dir):
    from selfspec.training.jacobi_forcing.forward import forward
    from selfspec.training.jacobi_forcing.losses import jf_loss

    model = _micro(micro_dir).train()
    prompts, noisy, clean = _random_rows(model.config.vocab_size)
    same = jf_loss(forward(model, pack(prompts, clean, clean, 0), "sdpa"), pack(prompts, clean, clean, 0), 1.0)
    assert same.counted == 0 and same.consistency == 0.0
    batch = pack(prompts, noisy, clean, 0)
    out = jf_loss(forward(model, batch, "sdpa"), batch, 1.0)
    assert out.counted > 0 and out.consistency_kl > 0
    out.total.backward()
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------ training
def _jf_config(micro_dir, collected, out: Path, **kw):
    from selfspec.training.jacobi_forcing.objective import JFConfig

    cfg, _ = collected
    base = dict(base=str(micro_dir), out=str(out), trajectories=cfg.out, block_size=4, window=4, new_tokens=16,
                batch_size=4, steps=20, lr=3e-3, warmup_ratio=0.1, eval_every=0, eval_tokens=512, threads=1,
                progress_bar=False, checkpoint_dir=str(out / "ckpt"))
    base.update(kw)
    return JFConfig(**base)


def test_twenty_step_run_lowers_the_consistency_loss(micro_dir, trajectories, tmp_path):
    from selfspec.training.jacobi_forcing.objective import train_jf

    # the consistency term alone (the micro model is untrained: its AR terms would dominate)
    result = train_jf(_jf_config(micro_dir, trajectories, tmp_path / "run", ar_weight=0.0, anchor_weight=0.0, lr=1e-2))
    state = result["state"]
    before, after = state["base_eval"], state["history"][-1]["heldout"]
    assert after["consistency_kl"] < 0.8 * before["consistency_kl"], (before, after)
    assert before["gain_by_noise"] and len(after["accuracy_by_offset"]) == 4
    meta = json.loads((tmp_path / "run" / "selfspec.json").read_text())
    assert meta["mode"] == "jacobi" and meta["jacobi"]["block_size"] == 4 and meta["jacobi"]["max_blocks"] == 2


def test_resume_equals_uninterrupted_run(micro_dir, trajectories, tmp_path):
    from selfspec.training.jacobi_forcing.objective import train_jf

    kw = dict(steps=6, eval_every=3, export=False, schedule="random")
    whole = train_jf(_jf_config(micro_dir, trajectories, tmp_path / "a", **kw))
    first = train_jf(_jf_config(micro_dir, trajectories, tmp_path / "b", stop_after_steps=3, **kw))
    assert first.get("interrupted") and first["state"]["step"] == 3
    resumed = train_jf(_jf_config(micro_dir, trajectories, tmp_path / "b", resume="auto", **kw))
    a, b = whole["model"].state_dict(), resumed["model"].state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [h["consistency"] for h in whole["state"]["history"]] == [h["consistency"] for h in resumed["state"]["history"]]


def test_rounds_collect_with_the_previous_rounds_model(micro_dir, data_file, trajectories, tmp_path):
    from selfspec.training.jacobi_forcing.objective import train_jf
    from selfspec.training.jacobi_forcing.trajectories import load_trajectories

    cfg = _jf_config(micro_dir, trajectories, tmp_path / "out", trajectories=None, rounds=["2:2:6", "4:2"], steps=4,
                     num_prompts=8, heldout_prompts=2, prompt_tokens=12, data=[str(data_file)],
                     checkpoint_dir=str(tmp_path / "work"))
    result = train_jf(cfg)
    assert [r["block_size"] for r in result["rounds"]] == [2, 4]
    r1 = tmp_path / "work" / "round-1"
    r2 = tmp_path / "work" / "round-2"
    assert len(load_trajectories(r1 / "trajectories")) == 6 and len(load_trajectories(r2 / "trajectories")) == 8
    assert json.loads((r2 / "trajectories" / "manifest.json").read_text())["settings"]["model"] == str(r1 / "model")
    assert load_trajectories(r2 / "trajectories")[0].block_size == 4
    meta = json.loads((tmp_path / "out" / "selfspec.json").read_text())
    assert meta["jacobi"]["block_size"] == 4 and meta["converted_from"] == str(Path(micro_dir).resolve())


def test_anchor_model_is_the_given_frozen_model(micro_dir, trajectories, tmp_path):
    from selfspec.training.jacobi_forcing.objective import JFObjective, train_jf

    first = _jf_config(micro_dir, trajectories, tmp_path / "r1", steps=3)
    train_jf(first)  # a "round 1" that moved away from the micro model
    cfg = _jf_config(micro_dir, trajectories, tmp_path / "r2", base=str(tmp_path / "r1"), anchor_model=str(micro_dir))
    objective = JFObjective(cfg)
    model = objective.build_model(torch.device("cpu"))
    objective.setup_training(model, lambda _: None)
    original = _micro(micro_dir).state_dict()
    teacher = objective.teacher.state_dict()
    assert all(torch.equal(teacher[k], original[k]) for k in original)
    assert any(not torch.equal(model.state_dict()[k], original[k]) for k in original)
    assert not any(p.requires_grad for p in objective.teacher.parameters())


def test_bad_options_fail_before_any_model_loads(tmp_path):
    from selfspec.errors import UsageError
    from selfspec.training.jacobi_forcing.objective import JFConfig
    from selfspec.training.jacobi_forcing.trajectories import TrajectoryConfig

    with pytest.raises(UsageError, match="BLOCK:WINDOW"):
        JFConfig(base="b", out="o", rounds=["8-8"])
    with pytest.raises(UsageError, match="multiple of every block size"):
        JFConfig(base="b", out="o", rounds=["8:8", "48:8"])
    with pytest.raises(UsageError, match="no manifest"):
        JFConfig(base="b", out="o", trajectories=str(tmp_path))
    with pytest.raises(UsageError, match="multiple of --block-size"):
        TrajectoryConfig(model="m", out="o", block_size=8, new_tokens=20)


def test_export_serves_jacobi_with_the_trained_settings_exactly(micro_dir, trajectories, tmp_path):
    from selfspec.engines.hf import HFEngine

    from selfspec.training.jacobi_forcing.objective import train_jf

    train_jf(_jf_config(micro_dir, trajectories, tmp_path / "m", steps=3, serve_verify_size=2))
    engine = HFEngine.from_pretrained(str(tmp_path / "m"))
    mode = engine.build_mode("jacobi")
    assert (mode.config.block_size, mode.config.max_blocks, mode.config.verify_size) == (4, 2, 2)
    prompts = [t.prompt_ids for t in _trajectory_prompts(trajectories)]
    ar = engine.generate(prompts, max_new_tokens=24, mode="ar")
    jac = engine.generate(prompts, max_new_tokens=24, mode="jacobi")
    assert [o.token_ids for o in jac] == [o.token_ids for o in ar]


def _trajectory_prompts(trajectories):
    from selfspec.training.jacobi_forcing.trajectories import load_trajectories

    return load_trajectories(trajectories[0].out)[:6]


# ------------------------------------------------------------------------------ the decoder
def test_jacobi_never_spends_a_forward_without_a_draft(tiny_base_path, heldout_prompts):
    """When the pending token lands on the real-active block's last slot, the next block drafts at
    once (before: one forward with the pending token alone, candidates dropped)."""
    from selfspec.decoding.modes.jacobi import Block, JacobiConfig, JacobiMode, JacobiState, update_blocks
    from selfspec.engines.hf import HFEngine

    cfg = JacobiConfig(block_size=4, max_blocks=2, spawn_ratio=0.5)
    st = JacobiState(Block([11, 12, 13], 0), [Block([21, 22, 23, 24], 0)])
    update_blocks(st, cfg, committed=3, predictions=[11, 12, 90, 91], main_predictions=[11, 12, 90, 21, 22, 23, 24, 5],
                  fresh=[7] * 4)
    assert st.ra.tokens == [21, 22, 23, 24] and st.ra.accepted == -1 and st.pseudo == []

    engine = HFEngine.from_pretrained(tiny_base_path)
    widths = []

    class Recording(JacobiMode):
        def layouts(self, seqs):
            out = super().layouts(seqs)
            widths.extend(len(lay.tokens) for lay in out)
            return out

    prompts = [engine.tokenizer(p)["input_ids"] for p in heldout_prompts[:6]]
    for options in ({"block_size": 4, "max_blocks": 1, "verify_size": 0}, {"block_size": 6, "max_blocks": 2}):
        widths.clear()
        mode = Recording(JacobiConfig(**options), engine.vocab_size)
        jac = engine.generate(prompts, max_new_tokens=40, mode=mode)
        ar = engine.generate(prompts, max_new_tokens=40, mode="ar")
        assert [o.token_ids for o in jac] == [o.token_ids for o in ar]
        assert min(widths) >= 2
        assert max(widths) <= mode.max_width


def test_embedded_tiny_jf_carries_its_recipe_and_jacobi_settings():
    import dataclasses

    from selfspec.checkpoints.metadata import load_metadata
    from selfspec.engines.hf import HFEngine
    from selfspec.models import resolve_model

    path = resolve_model("tiny-jf")
    meta = load_metadata(path)
    assert meta.mode == "jacobi" and meta.converted_from == "tiny-base"
    recipe = meta.recipe["config"]
    assert meta.recipe["command"] == "selfspec train tiny-jf"
    assert recipe["anchor_model"] == "tiny-base"  # every step held to the model it converts
    prov = json.loads((path / "provenance.json").read_text())
    # the rounds it ran are the recipe's (block:window:prompts each), and the served settings the
    # last round's block size with the recipe's serve_* options
    assert [(r["block_size"], r["window"]) for r in prov["rounds"]] == \
        [tuple(int(x) for x in r.split(":")[:2]) for r in recipe["rounds"]] and prov["history"]
    served = dataclasses.asdict(meta.jacobi)
    assert (served["block_size"], served["max_blocks"], served["verify_size"], served["spawn_ratio"]) == (
        prov["rounds"][-1]["block_size"], recipe["serve_max_blocks"], recipe["serve_verify_size"],
        recipe["serve_spawn_ratio"])
    engine = HFEngine.from_pretrained(path)
    cfg = engine.build_mode("jacobi").config  # the settings of selfspec.json, no options given
    assert {k: getattr(cfg, k) for k in served} == served
    other = served["block_size"] + 3
    assert engine.build_mode("jacobi", {"block_size": other}).config.block_size == other  # an option still wins


def test_trajectory_prompts_from_a_jsonl_file(tmp_path):
    """`jf-trajectories --prompts FILE`: the file's prompts in order, the last --heldout-prompts held out."""
    import json

    from selfspec.training.jacobi_forcing.trajectories import TrajectoryConfig, load_prompt_ids

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "x" * (i + 1)}) + "\n" for i in range(6)))

    class Tokenizer:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(text)]}

    cfg = TrajectoryConfig(model="m", out=str(tmp_path / "out"), prompts=str(prompts), num_prompts=3,
                           heldout_prompts=2)
    train, held, described = load_prompt_ids(cfg, Tokenizer())
    assert train == [[1], [2], [3]] and held == [[5], [6]] and described["lines"] == 6
