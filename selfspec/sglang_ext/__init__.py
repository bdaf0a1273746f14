"""selfspec's SGLang plugin: ISD, RISD, JACOBI and SJD served by stock SGLang 0.5.23.

Installed with selfspec (entry point `sglang.srt.plugins` -> `plugin.register`), so plain

    python -m sglang.launch_server --model-path M --speculative-algorithm ISD   # RISD | JACOBI | SJD

works, on GPU and on CPU (without an accelerator the plugin fills the CPU settings). Modules:

- `plugin`: the entry point (CPU stand-ins for sgl_kernel first, then everything below);
- `registration`: `SpeculativeAlgorithm.register` + the spec class 0.5.23's scheduler needs;
- `config`: flags / `--selfspec-config FILE.yaml` / the checkpoint's selfspec.json, merged and
  validated at startup (every failure names its fix);
- `cli_args`: the `--selfspec-*` flags on SGLang's own command line;
- `worker`: the one speculative worker, a thin adapter from SGLang batches to the
  `selfspec.decoding` modes (fixed-width TARGET_VERIFY forwards, KV commit, per-request state);
- `attention`: TARGET_VERIFY for the torch_native (CPU) attention backend;
- `lora`: RISD's per-token gated LoRA inside SGLang's linear layers (CUDA-graph capturable);
- `metrics`: per-request TPF / accepted length in meta_info, aggregates in logs, /metrics and
  /server_info;
- `request_checks`: HTTP 400 for what a mode cannot honour (sampling with JACOBI, penalties,
  grammars, logprobs).
- `cpu_compat`: pure-torch stand-ins for the sgl_kernel ops SGLang's CPU path imports.
"""
