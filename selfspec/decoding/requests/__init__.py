"""Request features every mode honours: per-row logits rules (penalties, bias, min_p, grammars),
AR sampling's distribution and its filters, counter-based RNG and per-sequence seed streams,
watermarking.
"""
