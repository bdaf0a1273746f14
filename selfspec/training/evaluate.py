"""Measurements of a converted model: held-out perplexity of the AR path, the introspective
acceptance rate alpha of its ISD proposals, and TPF of ISD / RISD decoding on the HF engine.

alpha, the introspective acceptance rate, is the share of the model's own MASK proposals that
its verify step accepts: for each token x_k the model generated from a distribution q_k, a
separate forward with all tokens revealed gives the causal distribution p_k; alpha = mean_k
min(1, p_k(x_k) / q_k(x_k)), the p/q acceptance probability of ISD's verify. For ISD proposals: the model generates by strides, as a diffusion
model would with its own proposals and no verification: one forward over
[context, MASK * (N-1)] gives the next token x_0 from the last clean row (an exact AR token,
not counted) and the N-1 proposals x_1..x_{N-1} ~ q from the MASK rows; all N are appended; the
next forward (context now revealing them) gives each proposal's p from the row before it.
Temperature 1 samples x ~ q and uses the full distributions; `temperature=0` uses argmax
proposals and one-hot p, so alpha is the greedy match rate.
"""

from __future__ import annotations

import math

import torch

from selfspec.training.tiny_base import heldout_loss, tokenize_files


@torch.no_grad()
def heldout_ar_perplexity(model, tokenizer, seq_len: int = 512, batch_size: int = 8) -> dict:
    """Perplexity of the plain causal (AR) forward over the whole held-out split of the stdlib
    corpus, windows of `seq_len` (tiny-base's own evaluation)."""
    from selfspec.corpus import load_stdlib_split

    split = load_stdlib_split()
    tokens = tokenize_files(tokenizer, [f.text for f in split.heldout])
    loss = heldout_loss(model, tokens, seq_len, batch_size)
    return {"heldout_loss": loss, "heldout_perplexity": math.exp(loss), "tokens": int(len(tokens))}


@torch.no_grad()
def introspective_acceptance(model, prompt_ids: list[list[int]], stride: int, mask_token_id: int,
                             new_tokens: int = 64, temperature: float = 1.0, seed: int = 0, gate=None) -> dict:
    """alpha of ISD proposals (see the module docstring). `gate`: a LoRAGate for gated adapters
    (on at the MASK rows)."""
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    block = stride - 1
    total, count = 0.0, 0
    by_offset = [[0.0, 0] for _ in range(block)]

    def dist(row: torch.Tensor) -> torch.Tensor:
        if temperature <= 0:
            return torch.nn.functional.one_hot(row.argmax(), row.shape[-1]).float()
        return torch.softmax(row.float() / temperature, dim=-1)

    def draw(p: torch.Tensor) -> int:
        return int(p.argmax()) if temperature <= 0 else int(torch.multinomial(p.cpu(), 1, generator=gen))

    for ids in prompt_ids:
        seq = list(ids)
        pending: list[tuple[int, int, float, int]] = []  # (position, token, q(token), offset)
        made = 0
        while True:
            x = torch.tensor([seq + [mask_token_id] * block], device=device)
            if gate is not None:
                m = torch.zeros_like(x, dtype=torch.bool)
                m[:, len(seq):] = True
                with gate.active(m):
                    logits = model(input_ids=x).logits[0]
            else:
                logits = model(input_ids=x).logits[0]
            for pos, tok, q, j in pending:
                p = float(dist(logits[pos - 1])[tok])
                a = min(1.0, p / q) if q > 0 else 0.0
                total += a
                count += 1
                by_offset[j][0] += a
                by_offset[j][1] += 1
            if made >= new_tokens:
                break
            start = len(seq)
            x0 = draw(dist(logits[start - 1]))
            props, qs = [], []
            for j in range(block):
                q = dist(logits[start + j])
                t = draw(q)
                props.append(t)
                qs.append(float(q[t]))
            seq += [x0] + props
            pending = [(start + 1 + j, props[j], qs[j], j) for j in range(block)]
            made += 1 + block
    return {"alpha": total / max(1, count), "proposals": count, "stride": stride, "temperature": temperature,
            "alpha_by_offset": [s / max(1, n) for s, n in by_offset]}


def decode_tpf(engine, prompt_ids: list[list[int]], mode: str, max_new_tokens: int, *, stride: int | None = None,
               tau: float = 0.0, temperature: float = 0.0, seed: int = 0, batch_size: int = 16) -> dict:
    """TPF and outputs of one decoding configuration on the HF engine."""
    from selfspec.decoding import registry
    from selfspec.decoding.metrics import aggregate
    from selfspec.decoding.requests.sampling import SamplingParams

    cfg = None
    if registry.get(mode).needs_mask_token:  # the ISD family: stride and tau
        cfg = {"tau": tau}
        if stride is not None:
            cfg["stride"] = stride
    outs = engine.generate(prompt_ids, max_new_tokens=max_new_tokens, sampling=SamplingParams(temperature=temperature),
                           seed=seed, mode=mode, mode_config=cfg, batch_size=batch_size)
    agg = aggregate(o.metrics for o in outs)
    return {"mode": mode, "stride": stride, "tau": tau, "temperature": temperature,
            "tpf": agg["tokens_per_forward"], "mean_accepted_length": agg["mean_accepted_length"],
            "compute_overhead": agg["compute_overhead"], "tokens": agg["committed_tokens"],
            "outputs": [o.token_ids for o in outs]}
