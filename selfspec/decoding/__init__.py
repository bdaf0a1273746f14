"""Engine-agnostic decoding algorithms: pure functions and small per-sequence states over tensors.

Nothing here imports SGLang, transformers or `selfspec.kernels`; the HF reference engine
(`selfspec.engines.hf`) and the SGLang worker drive the same objects, and hand each step the
verify implementation they chose (`verify.VerifyOps`).

- `verify`, `sampling`, `rng`: the acceptance rules, AR sampling's distribution, counter RNG
- `seeds`: per-sequence seed streams (reproducible whatever the batch)
- `step`: the step protocol (`StepLayout` -> forward -> `StepOutcome`), `Mode` base, collation
- `progress`: stop conditions (stop ids, max_new_tokens) for every mode
- `metrics`: forwards, committed tokens, TPF, accepted-length histogram, compute overhead
- `ar`, `isd` (ISD and RISD), `sjd`, `jacobi` (+ `ngram_pool`), `ngram` (baseline): the modes
- `registry`: the one list of modes (config class, builder, what each needs, SGLang name) and
  option parsing; `metadata`: selfspec.json (`SelfspecMetadata`, `weights_sha256`)
"""
