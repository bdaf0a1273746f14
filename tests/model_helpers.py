"""Small helpers for tests and cross-engine checks: tiny random models, adapters, exact
distributions and the greedy reference with its near-tie excuse rule."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from selfspec.decoding.requests.logits_rules import apply_logits_rules
from selfspec.decoding.requests.sampling import SamplingParams, logits_to_probs
from selfspec.decoding.step import DecodeSequence


def tiny_qwen3(
    vocab_size: int = 97,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    eos_token_id: int | list[int] | None = None,
    initializer_range: float = 0.1,
    tie_word_embeddings: bool = False,
):
    """A random-weight Qwen3ForCausalLM in fp32, eval mode, sdpa attention.

    The defaults (untied head, weights ~ N(0, 0.1)) give varied greedy outputs; a small-init
    tied model mostly repeats its last token, which makes a weak test."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=4096, initializer_range=initializer_range,
        eos_token_id=eos_token_id, tie_word_embeddings=tie_word_embeddings, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    if initializer_range > 0.02:  # post_init's RMSNorm ones are fine; spread the logits further
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, initializer_range)
    return model


def add_mask_token(model) -> int:
    """Append one embedding row (the [MASK] token) and return its id."""
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(old + 1, mean_resizing=False)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1234)
        row = torch.randn(model.get_input_embeddings().weight.shape[1], generator=gen) * 0.02
        model.get_input_embeddings().weight[old] = row
        out = model.get_output_embeddings()
        if out.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
            out.weight[old] = row
    return old


def save_random_adapter(
    model,
    directory: str | Path,
    rank: int = 4,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    modules_to_save: list[str] | None = None,
    seed: int = 0,
    scale: float = 0.5,
) -> Path:
    """Write a PEFT LoRA adapter with non-zero random weights for (a copy of) `model`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(
        copy.deepcopy(model),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False,
                   modules_to_save=modules_to_save),
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, scale / rank**0.5)
            elif "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.05)
    directory = Path(directory)
    peft_model.save_pretrained(str(directory))
    return directory


@torch.no_grad()
def exact_distribution(model, prompt: list[int], steps: int, sampling: SamplingParams) -> dict[tuple[int, ...], float]:
    """Exact probability of every sequence of the first `steps` sampled tokens (vocab^steps)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    seqs = list(itertools.product(range(vocab), repeat=steps))
    ids = torch.tensor([list(prompt) + list(s) for s in seqs])
    logits = model(input_ids=ids).logits.float()
    start = len(prompt) - 1
    rows = logits[:, start : start + steps]
    if sampling.has_logits_rules:  # each position's rules see the path before it, as AR does
        rows = torch.stack([
            apply_logits_rules(rows[:, t : t + 1], [DecodeSequence(list(prompt) + list(s[:t]), sampling,
                                                                   prompt_len=len(prompt)) for s in seqs], None)[:, 0]
            for t in range(steps)], dim=1)
    probs = logits_to_probs(rows, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    toks = torch.tensor(seqs).unsqueeze(-1)
    joint = probs.gather(-1, toks).squeeze(-1).double().prod(-1)
    return {s: float(p) for s, p in zip(seqs, joint)}


def chi_square_pvalue(counts: dict, expected_probs: dict, min_expected: float = 5.0) -> tuple[float, float, int]:
    """Pearson chi-square goodness of fit; cells with expected count < min_expected are pooled.
    Returns (statistic, p-value, degrees of freedom)."""
    total = sum(counts.values())
    stat, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for key, p in expected_probs.items():
        e = p * total
        o = counts.get(key, 0)
        if e < min_expected:
            pooled_obs += o
            pooled_exp += e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    unknown = sum(c for k, c in counts.items() if k not in expected_probs)
    pooled_obs += unknown
    if pooled_exp > 0 or pooled_obs > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-12)
        cells += 1
    dof = max(1, cells - 1)
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, pvalue, dof


def two_sample_pvalue(a: dict, b: dict, min_count: float = 10.0) -> tuple[float, float, int]:
    """Chi-square test of homogeneity of two samples given as counts per outcome: are they
    drawn from one distribution? Outcomes seen fewer than min_count times in both samples
    together are pooled. Returns (statistic, p-value, degrees of freedom)."""
    from scipy.stats import chi2_contingency

    keys = set(a) | set(b)
    rows, pooled = [], [0, 0]
    for k in keys:
        pair = [a.get(k, 0), b.get(k, 0)]
        if sum(pair) < min_count:
            pooled[0] += pair[0]
            pooled[1] += pair[1]
        else:
            rows.append(pair)
    if sum(pooled):
        rows.append(pooled)
    if len(rows) < 2:  # one outcome only: identical distributions
        return 0.0, 1.0, 0
    res = chi2_contingency(rows, correction=False)
    return float(res.statistic), float(res.pvalue), int(res.dof)


def total_variation(counts: dict, expected_probs: dict) -> float:
    total = sum(counts.values())
    keys = set(counts) | set(expected_probs)
    return 0.5 * sum(abs(counts.get(k, 0) / total - expected_probs.get(k, 0.0)) for k in keys)


@dataclass
class GreedyComparison:
    compared: int
    identical: int
    excused: int  # divergences at a genuine near tie of the reference step (top-2 gap < tol)
    failures: list[str]


@torch.no_grad()
def compare_greedy(model, prompts, outputs, reference, tol: float = 1e-5) -> GreedyComparison:
    """Compare token lists to the greedy reference; a divergence is excused only if, at the
    first differing step, the reference model's top two logits (one unbatched full forward over
    prompt + the common prefix) are within `tol`."""
    identical, excused, failures = 0, 0, []
    for i, (prompt, out, ref) in enumerate(zip(prompts, outputs, reference)):
        if out == ref:
            identical += 1
            continue
        k = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        ids = torch.tensor([list(prompt) + list(ref[:k])])
        top2 = model(input_ids=ids).logits[0, -1].float().topk(2).values
        gap = float(top2[0] - top2[1])
        if gap < tol:
            excused += 1
        else:
            failures.append(f"sequence {i}: first difference at token {k} (top-2 logit gap {gap:.3g}): "
                            f"got {out[k:k + 4]} vs reference {ref[k:k + 4]}")
    return GreedyComparison(len(outputs), identical, excused, failures)


def random_prompts(count: int, vocab_size: int, min_len: int = 1, max_len: int = 16, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
