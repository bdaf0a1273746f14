"""Optional accelerations of selfspec's rules, each beside a plain-torch reference of the same
signature; `selfspec.kernels.dispatch.resolve` picks one (SELFSPEC_KERNELS=auto|triton|reference),
once per engine or attached layer. Nothing here imports `selfspec.decoding`: kernels sit below it.

  verify_triton       fused p/q speculative verify (online softmax + Gumbel-max), greedy verify,
                      greedy candidate/tree verify (references: selfspec.decoding.modes.verify)
  gated_lora          segment-gated LoRA reference; gated_lora_triton: its cuBLAS and Triton paths
  dispatch            the choice

The Triton modules are imported lazily (only when a kernel is chosen), so importing selfspec
never requires triton.
"""
