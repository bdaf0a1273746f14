"""I-DLM conversion (and the gated LoRA of R-ISD): the objective, its training layout and mask,
the per-token LoRA gate.
"""
