"""How a row of logits becomes the distribution p that AR sampling draws from.

One definition shared by AR sampling in every engine and by the speculative verify rules, so
that speculative acceptance with tau = 0 reproduces AR sampling's distribution exactly.

It follows SGLang 0.5.23's torch sampler (`layers/sampler.py`,
`top_k_top_p_min_p_sampling_from_probs_torch`, the path its CPU server takes; its GPU path,
FlashInfer's `top_k_top_p_sampling_from_probs(filter_apply_order="joint")`, keeps the same set):
probs = softmax(logits / temperature), then three filters, each measured on those *unfiltered*
probs, and a token is kept iff all three keep it:
- top-k: among the k largest (ties at the k-th value are kept; SGLang's sort breaks such
  ties in an unspecified order, a measure-zero event for real logits);
- top-p: the probability mass strictly before it in descending order is <= top_p (so the top
  token is always kept);
- min-p: its probability is >= min_p * the largest probability.
The kept probabilities are renormalised. temperature == 0 means greedy: one-hot at the first
argmax (no filter changes an argmax).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from selfspec.decoding.argmax import first_argmax


class SamplingFilters(NamedTuple):
    """The settings that make logits the sampling distribution p, in `logits_to_probs`'s argument
    order (`logits_to_probs(logits, *filters)`): each one value for every row or a tensor of
    per-row values. `top_k <= 0`, `top_p >= 1` and `min_p <= 0` switch a filter off."""

    temperature: torch.Tensor | float
    top_k: torch.Tensor | int = 0
    top_p: torch.Tensor | float = 1.0
    min_p: torch.Tensor | float = 0.0


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; `top_k <= 0` and `top_p >= 1` switch the filter off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # Logits rules (`selfspec.decoding.requests.logits_rules`), applied before temperature and the filters
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_new_tokens: int = 0  # stop tokens are masked while fewer tokens have been generated

    def __post_init__(self) -> None:
        # SGLang's rules (SamplingParams.verify), so the engines refuse what a server refuses;
        # top_p = 0 would otherwise give all-NaN probabilities and emit token 0.
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def filters(self) -> SamplingFilters:
        return SamplingFilters(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def filtered(self) -> bool:
        """Whether top-k, top-p or min-p is on."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0

    @property
    def has_logits_rules(self) -> bool:
        """Whether any rule of `selfspec.decoding.requests.logits_rules` changes this request's logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_new_tokens)


def _broadcast(value: torch.Tensor | float | int, rows: torch.Size, dtype, device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device)
    while t.dim() < len(rows):
        t = t.unsqueeze(-1)
    return t.expand(rows)


def _neutral(value, neutral: float) -> bool:
    return not isinstance(value, torch.Tensor) and value == neutral


def logits_to_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int = 0,
    top_p: torch.Tensor | float = 1.0,
    min_p: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] in fp32.

    `temperature`, `top_k`, `top_p`, `min_p` are scalars or tensors broadcastable from the left
    (e.g. shape [B] for logits [B, T, V]: one setting per sequence).
    """
    logits = logits.float()
    rows = logits.shape[:-1]
    vocab = logits.shape[-1]
    if not isinstance(temperature, torch.Tensor) and temperature > 0:  # one temperature, no greedy row
        greedy = None
        scaled = logits / float(temperature)
    else:
        temp = _broadcast(temperature, rows, torch.float32, logits.device)
        greedy = temp <= 0
        scaled = logits / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(-1)
    probs = torch.softmax(scaled, dim=-1)
    keep = None

    # a filter given as its neutral scalar costs nothing (a step's context passes them so when
    # no row uses one: each check below is several small ops, a real share of a batch-1 step)
    if not _neutral(top_k, 0):
        k = _broadcast(top_k, rows, torch.long, logits.device)
        k_active = (k > 0) & (k < vocab)
        if bool(k_active.any()):
            k_rows = torch.where(k_active, k, torch.ones_like(k))
            kth = scaled.topk(int(k_rows.max()), dim=-1).values.gather(-1, (k_rows - 1).unsqueeze(-1))
            keep = ~k_active.unsqueeze(-1) | (scaled >= kth)

    if not _neutral(top_p, 1.0):
        p_cut = _broadcast(top_p, rows, torch.float32, logits.device)
        p_active = p_cut < 1.0
        if bool(p_active.any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop_sorted = (sorted_p.cumsum(-1) - sorted_p) > p_cut.unsqueeze(-1)
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            keep_p = ~(p_active.unsqueeze(-1) & drop)
            keep = keep_p if keep is None else keep & keep_p

    if not _neutral(min_p, 0.0):
        m_cut = _broadcast(min_p, rows, torch.float32, logits.device)
        m_active = m_cut > 0
        if bool(m_active.any()):
            keep_m = ~m_active.unsqueeze(-1) | (probs >= m_cut.unsqueeze(-1) * probs.amax(-1, keepdim=True))
            keep = keep_m if keep is None else keep & keep_m

    if keep is not None:
        # renormalise only the rows a filter cut: a row that keeps everything must come out with
        # the bits it has alone, or a seeded sampled request draws differently when a filtered
        # request shares its batch (tests/test_decoding_sampling.py, the SJD mixed burst)
        cut = ~keep.all(-1, keepdim=True)
        probs = torch.where(keep, probs, 0.0)
        probs = torch.where(cut, probs / probs.sum(-1, keepdim=True), probs)

    if greedy is not None and bool(greedy.any()):
        one_hot = torch.nn.functional.one_hot(first_argmax(logits), vocab).to(probs.dtype)
        probs = torch.where(greedy.unsqueeze(-1), one_hot, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of probs [..., V] from one counter-based uniform per row.

    u = `rng.uniform(seed, 0)`; the token is the one whose interval of the cumulative
    distribution (token-id order, scaled to the row's total) holds u; a zero-probability token
    never wins. float32 rounding moves interval ends by ~1e-7 of the mass, the resolution of the
    23-bit uniform itself. One hash per row rather than one per vocabulary entry (a Gumbel-max
    draw hashes all V, which made sampling a large share of a served AR step on a CPU). The
    verify rules keep their own Gumbel convention (`verify.py`, offsets v + 1, shared with the
    Triton kernels); this draw uses offset 0, so the two never share a uniform. seeds has
    probs' leading shape.
    """
    from selfspec.decoding.requests import rng

    vocab = probs.shape[-1]
    cdf = (probs if probs.dtype == torch.float32 else probs.float()).cumsum(-1)
    target = rng.uniform_at(seeds, 0) * cdf[..., -1]
    token = torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)
    # only u * total rounded up to the total falls past every interval (a token inside one has
    # mass: the cdf rises there); the last token with mass takes it
    over = token >= vocab
    if bool(over.any()):
        last = vocab - 1 - (probs > 0).flip(-1).int().argmax(-1)
        token = torch.where(over, last, token)
    return token


def sample(logits: torch.Tensor, seeds: torch.Tensor, filters: SamplingFilters) -> torch.Tensor:
    """AR sampling: logits [..., V] -> tokens [...]; greedy rows give the first argmax."""
    return sample_from_probs(logits_to_probs(logits, *filters), seeds)
