"""Visual on-policy distillation: the GKD limits, the VarKD-style selection, the rollout's
train/eval handling, one step per backend lowering the loss, and resume."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from selfspec.training.losses import generalized_jsd, varkd_lite


def test_gkd_limits_are_the_two_kls():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 20, generator=gen), torch.randn(3, 5, 20, generator=gen)
    log_s, log_t = s.log_softmax(-1), t.log_softmax(-1)
    forward = F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1).mean()  # KL(p_T || p_S)
    reverse = F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1).mean()  # KL(p_S || p_T)
    torch.testing.assert_close(generalized_jsd(s, t, 0.0), forward)
    torch.testing.assert_close(generalized_jsd(s, t, 1.0), reverse)
    mid = generalized_jsd(s, t, 0.5)
    assert 0 < mid < min(forward, reverse)  # a JSD is bounded by both KLs' halves... and by log 2
    assert mid <= torch.log(torch.tensor(2.0))
    assert generalized_jsd(t, t, 0.5).abs() < 1e-6
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 2] = True
    one = F.kl_div(log_s[0, 2], log_t[0, 2], reduction="sum", log_target=True)
    torch.testing.assert_close(generalized_jsd(s, t, 0.0, mask), one)
    # code-restricted logits (-inf outside the codes) stay finite
    s2, t2 = s.clone(), t.clone()
    s2[..., 15:] = float("-inf")
    t2[..., 15:] = float("-inf")
    s2.requires_grad_(True)
    for beta in (0.0, 0.5, 1.0):
        value = generalized_jsd(s2, t2, beta)
        (grad,) = torch.autograd.grad(value, s2)
        assert torch.isfinite(value) and torch.isfinite(grad).all() and (grad[..., 15:] == 0).all()


def test_float_weights_are_a_weighted_mean():
    gen = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 4, 12, generator=gen), torch.randn(2, 4, 12, generator=gen)
    per = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), reduction="none", log_target=True).sum(-1)
    weights = torch.tensor([[0.0, 0.5, 1.0, 1.0], [0.5, 0.5, 1.0, 0.0]])
    torch.testing.assert_close(generalized_jsd(s, t, 0.0, weights), (per * weights).sum() / weights.sum())
    bool_mask = weights > 0.7
    torch.testing.assert_close(generalized_jsd(s, t, 0.0, bool_mask), generalized_jsd(s, t, 0.0, bool_mask.float()))
    tokens = torch.randint(0, 12, (2, 4), generator=gen)
    a, share_a = varkd_lite(s, t, tokens, bool_mask, confidence=0.0, top_k=4)
    b, share_b = varkd_lite(s, t, tokens, bool_mask.float(), confidence=0.0, top_k=4)
    torch.testing.assert_close(a, b)
    assert share_a == share_b == 1.0  # confidence 0 selects every weighted position


def test_varkd_selects_and_truncates():
    teacher = torch.full((1, 3, 10), -10.0)
    teacher[0, 0, 2] = 10.0  # confident
    teacher[0, 1] = 0.0
    teacher[0, 1, :2] = 1.0  # two favourites, neither confident; the token (0) is one of them
    teacher[0, 2] = 0.0
    teacher[0, 2, 5], teacher[0, 2, 6] = 1.0, 0.9  # unconfident, and the token (9) outside the top-2
    tokens = torch.tensor([[3, 0, 9]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    student = torch.zeros(1, 3, 10)
    loss, share = varkd_lite(student, teacher, tokens, mask, confidence=0.5, top_k=2)
    assert share == pytest.approx(2 / 3)  # position 2 is not supervised
    # under a uniform student: position 0's truncated target is one-hot (KL = log 10), position
    # 1's is 1/2, 1/2 on its two favourites (KL = log 5)
    assert float(loss) == pytest.approx((2.302585 + 1.609438) / 2, rel=1e-3)


# ------------------------------------------------------------------------------ the OPD loop
def _micro_image_model(out: Path, hidden: int, seed: int) -> Path:
    from selfspec.training.export import export_full
    from selfspec.images.gpt import (
        ImageGPTConfig, ImageTokenLayout, build_image_model, export_image_side_files, image_metadata,
    )

    torch.manual_seed(seed)
    layout = ImageTokenLayout()
    cfg = ImageGPTConfig(out=str(out), hidden_size=hidden, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                         intermediate_size=2 * hidden)
    export_full(build_image_model(cfg, layout), None, out, image_metadata(layout, "test", {"history": []}), {})
    export_image_side_files(out)
    return out


@pytest.fixture(scope="module")
def micro_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("opd")
    return _micro_image_model(root / "teacher", 48, 0), _micro_image_model(root / "student", 32, 1)


def _cfg(micro_pair, tmp_path, **kw):
    from selfspec.images.opd import OPDConfig

    teacher, student = micro_pair
    base = OPDConfig(out=str(tmp_path / "out"), teacher=str(teacher), student=str(student), batch_size=4,
                     prefix_ratio=0.9, steps=4, eval_every=0, eval_images=20, lr=3e-3, warmup_ratio=0.0,
                     checkpoint_dir=str(tmp_path / "ck"), progress_bar=False, threads=1)
    return replace(base, **kw)


def test_rollout_leaves_the_student_training(micro_pair, tmp_path):
    from selfspec.images.opd import OPDObjective

    obj = OPDObjective(_cfg(micro_pair, tmp_path))
    model = obj.build_model(torch.device("cpu"))
    obj.setup_training(model, print)
    model.train()
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(m.training))
    res = obj.rollout(model, torch.tensor([1, 2]), obj.codes[:2, :100].long(), seed=0)
    assert model.training and seen and not any(seen)  # rolled out in eval mode, back to training after
    assert res.codes.shape == (2, 196) and torch.equal(res.codes[:, :100], obj.codes[:2, :100].long())


def test_prefix_weight_and_null_rows_reach_the_loss(micro_pair, tmp_path):
    """The real prefix's positions carry `prefix_weight` (the suffix 1), and a dropped row is
    distilled with the null class for the student and the teacher alike."""
    from selfspec.images.opd import OPDObjective

    obj = OPDObjective(_cfg(micro_pair, tmp_path, prefix_weight=0.25, on_policy=0.0))
    model = obj.build_model(torch.device("cpu"))
    obj.setup_training(model, print)
    plen = round(0.9 * obj.layout.tokens)
    batch = obj.batch(0, 0, 0)
    batch["null_rows"] = torch.tensor([True, False, False, True])
    out = obj.forward(model, batch, {})
    assert (out["mask"][:, :plen] == 0.25).all() and (out["mask"][:, plen:] == 1.0).all()
    lay = obj.layout
    cls = torch.tensor([lay.null_id, *lay.class_ids(batch["labels"][1:3]).tolist(), lay.null_id])
    x = torch.cat([cls[:, None], batch["codes"]], 1)[:, :-1]
    with torch.no_grad():
        want_s, want_t = model(input_ids=x).logits, obj.teacher.model(input_ids=x).logits
    torch.testing.assert_close(out["student"][..., : lay.codebook_size].detach(), want_s[..., : lay.codebook_size])
    torch.testing.assert_close(out["teacher"][..., : lay.codebook_size], want_t[..., : lay.codebook_size])
    drawn = torch.stack([obj.batch(step, 0, 0)["null_rows"] for step in range(200)]).float().mean()
    assert 0.05 < drawn < 0.15  # --label-dropout 0.1


@pytest.mark.parametrize("rollout,objective", [("ar", "gkd"), ("hbsjd", "gkd"), ("hbsjd", "varkd")])
def test_opd_steps_lower_the_loss(micro_pair, tmp_path, rollout, objective):
    """Training on a fixed on-policy batch lowers the distillation loss (the objective's own
    forward and loss, the loop's optimizer), whichever backend rolled it out."""
    from selfspec.images.opd import OPDObjective

    obj = OPDObjective(_cfg(micro_pair, tmp_path, rollout=rollout, objective=objective))
    model = obj.build_model(torch.device("cpu"))
    obj.setup_training(model, print)
    model.train()
    batch = obj.batch(0, 0, 0)
    out = obj.forward(model, batch, {})
    assert batch["on_policy"] and out["stats"]["rounds"] > 0
    fixed = {**batch, "codes": out["codes"], "on_policy": False}  # the rollout, kept
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss, _ = obj.loss(obj.forward(model, fixed, {}), fixed, {})
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_both_backends_train_identically_and_resume(micro_pair, tmp_path):
    """Greedy HB-SJD rollouts are cached AR's, so the two backends' runs match; a run stopped and
    resumed equals the uninterrupted one."""
    from safetensors.torch import load_file

    from selfspec.images.opd import train_opd

    runs = {}
    for name, kw in {"ar": dict(rollout="ar"), "hbsjd": dict(rollout="hbsjd")}.items():
        res = train_opd(_cfg(micro_pair, tmp_path / name, export=False, **kw))
        runs[name] = res["model"].state_dict()
        assert res["state"]["rollout_seconds"] > 0
    for k in runs["ar"]:
        torch.testing.assert_close(runs["ar"][k], runs["hbsjd"][k])
    part = tmp_path / "resumed"
    train_opd(_cfg(micro_pair, part, export=False, stop_after_steps=2))
    res = train_opd(_cfg(micro_pair, part, export=False, resume="auto"))
    for k, v in res["model"].state_dict().items():
        torch.testing.assert_close(v, runs["hbsjd"][k])


def test_compare_run_reports_both_backends_and_stages(micro_pair, tmp_path):
    from selfspec.images.opd import OPDConfig
    from selfspec.images.opd_compare import compare, format_report

    teacher, student = micro_pair
    base = OPDConfig(out=str(tmp_path / "unused"), teacher=str(teacher), student=str(student), batch_size=4,
                     prefix_ratio=0.9, steps=3, eval_every=0, eval_images=20, threads=1, progress_bar=False)
    report = compare(base, tmp_path / "cmp")
    assert set(report["runs"]) == {"ar", "hbsjd"} and len(report["stages"]) == 3
    for run in report["runs"].values():
        assert run["steps"] == 3 and run["rollout_s"] > 0 and run["before"]["fid"] > 0 and run["after"]["fid"] > 0
        assert 0 < run["rollout_s"] <= run["loop_s"] < run["end_to_end_s"] and run["eval_s"] > 0
    assert report["max_weight_difference"] < 1e-5  # greedy: the same training whichever backend rolled out
    assert set(report["metric_noise"]) >= {"fid", "conditional_accuracy"}
    assert report["rollout_speedup"] > 0 and report["loop_speedup_predicted"] > 0
    assert "rollout speedup" in format_report(report)
    assert (tmp_path / "cmp" / "compare.json").exists()
