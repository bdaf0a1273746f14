"""Engine-agnostic decoding algorithms: pure functions and small per-sequence states over tensors.

Nothing here imports SGLang, transformers or `selfspec.kernels`; the HF reference engine
(`selfspec.engines.hf`) and the SGLang worker drive the same objects, and hand each step the
verify implementation they chose (`verify.VerifyOps`).

- `step`: the step protocol (`StepLayout` -> forward -> `StepOutcome`), `Mode` base, collation
- `progress`: stop conditions (stop ids, max_new_tokens) for every mode
- `metrics`: forwards, committed tokens, TPF, accepted-length histogram, compute overhead
- `registry`: the one list of modes (config class, builder, what each needs, SGLang name) and
  option parsing
- `modes/`: `ar`, `isd` (ISD and RISD), `sjd`, `jacobi` (+ `ngram_pool`), `ngram` (baseline and
  context candidates, + `corpus`), and the verify rules (`verify`, `tree_verify`)
- `widths/`: the built-in policy and width plans (what runs at each batch size)
- `requests/`: logits rules, sampling, counter RNG, per-sequence seeds, watermarking
"""
