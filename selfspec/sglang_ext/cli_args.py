"""`--selfspec-*` flags on SGLang's own command line (`python -m sglang.launch_server`, `sglang serve`).

Installed through SGLang's HookRegistry by the plugin (no patched files):
- after `ServerArgs.add_cli_args`: an argument group "selfspec" (so `--help` lists the flags);
- around `ServerArgs.from_cli_args`: the flags are taken off the parsed namespace and published
  as JSON in `SELFSPEC_SERVER_FLAGS`; SGLang's scheduler processes are spawned later from this
  process and inherit it. A `--selfspec-config` preset that names its mode also supplies
  `--speculative-algorithm` when that flag is absent;
- what a published checkpoint needs SGLang to load it as (`config.server_arg_additions`: an SDAR
  checkpoint's causal class, I-DLM's default sampling parameters) is set on the parsed
  arguments before SGLang builds anything from them.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from selfspec.decoding import registry
from selfspec.decoding.widths.policy import POLICY_NAMES
from selfspec.sglang_ext import config as cfgmod
from selfspec.checkpoints.files import is_repo_id
from selfspec.checkpoints.published import PRESETS

_DESTS = ("selfspec_config", "selfspec_stride", "selfspec_tau", "selfspec_mask_token_id", "selfspec_lora",
          "selfspec_options", "selfspec_policy", "selfspec_preset")


def add_selfspec_args(parser: argparse.ArgumentParser) -> None:
    if any(a.dest == "selfspec_config" for a in parser._actions):
        return
    g = parser.add_argument_group(
        "selfspec", f"Self-speculative decoding (--speculative-algorithm {' | '.join(registry.SGLANG_ALGORITHMS)}). "
        "Defaults come from the checkpoint's selfspec.json, then the mode's defaults.")
    g.add_argument("--selfspec-config", default=None, metavar="FILE.yaml",
                   help="mode options in one YAML file (examples: the repository's serving_configs/*.yaml), or "
                   "I-DLM's own algorithm config (idlm_blockN4_config.yaml: gen_block_size is the stride, "
                   "verify_alpha the relaxed acceptance, its sampling keys the server's defaults); flags below "
                   "override it")
    g.add_argument("--selfspec-preset", default=None, choices=sorted(PRESETS),
                   help="the decoding settings a published checkpoint family recommends: "
                   + "; ".join(f"{k}: {p.summary}" for k, p in PRESETS.items())
                   + " (picked by itself for a Hub name of that family)")
    g.add_argument("--selfspec-policy", default=None, choices=POLICY_NAMES,
                   help="what runs at each batch size when no --selfspec-config plan is given. auto (default): the "
                   "mode's own step with the context candidate at small greedy batches, lookup steps at wider ones "
                   "(long, cut short where they break early, up to 18 requests; 4 tokens beyond), the own step at "
                   "batch 1 and AR steps beyond when sampling; a run-time check swaps in plain AR steps wherever "
                   "they measure faster. own: the mode alone at its options on every step. lookup: auto with "
                   "lookup steps for the own steps. ar: plain AR steps (what the worker adds to stock AR)")
    g.add_argument("--selfspec-stride", type=int, default=None, metavar="N",
                   help="ISD/RISD stride N: up to N tokens per step, 2N-1 query tokens (1 with "
                   "--selfspec-options context_tokens=K: lookup steps, the context candidate alone)")
    g.add_argument("--selfspec-tau", type=float, default=None, metavar="TAU",
                   help="ISD/RISD relaxed acceptance min(1,(1+tau)p/q); 0 keeps the AR distribution")
    g.add_argument("--selfspec-mask-token-id", type=int, default=None, metavar="ID",
                   help="ISD/RISD [MASK] token id (default: selfspec.json, then config.json's mask_token_id, then "
                   "the tokenizer's mask token)")
    g.add_argument("--selfspec-lora", default=None, metavar="DIR|ORG/NAME",
                   help="RISD gated LoRA adapter: a PEFT folder or Hub name, no selfspec.json needed "
                   "(default: selfspec.json 'adapter')")
    g.add_argument("--selfspec-options", default=None, metavar="K=V,...",
                   help="any option of the mode's decoding config, e.g. 'block_size=16,max_blocks=2' (JACOBI) "
                   "or 'window=8' (SJD); checked when the server starts. Options: "
                   + "; ".join(f"{s.sglang_algorithm}: {', '.join(s.defaults)}"
                               for s in registry.SGLANG_ALGORITHMS.values()))


def flags_from_namespace(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "selfspec_config", None):
        out["config"] = os.path.abspath(os.path.expanduser(args.selfspec_config))
    for key in ("stride", "tau", "mask_token_id", "lora", "policy", "preset"):
        v = getattr(args, "selfspec_" + key, None)
        if v is not None:
            out[key] = _local_or_hub(v) if key == "lora" else v
    if getattr(args, "selfspec_options", None):
        try:
            out["options"] = registry.parse_option_string(args.selfspec_options)
        except ValueError as e:
            raise cfgmod.SelfSpecConfigError(f"[selfspec] --selfspec-options: {e}") from None
    return out


def _local_or_hub(path: str) -> str:
    """An absolute path for a folder (the servers' working directory may differ), a Hub name as given."""
    return path if is_repo_id(path) else os.path.abspath(os.path.expanduser(path))


def _apply_published_checkpoint(ns: argparse.Namespace, flags: dict[str, Any]) -> None:
    if registry.for_sglang_algorithm(getattr(ns, "speculative_algorithm", None)) is None:
        return
    add = cfgmod.server_arg_additions(str(ns.model_path), getattr(ns, "revision", None), flags,
                                      getattr(ns, "json_model_override_args", None),
                                      bool(getattr(ns, "trust_remote_code", False)))
    if "json_model_override_args" in add:
        ns.json_model_override_args = add["json_model_override_args"]
    if "preferred_sampling_params" in add and not getattr(ns, "preferred_sampling_params", None):
        ns.preferred_sampling_params = add["preferred_sampling_params"]


def _after_add_cli_args(result, parser, *args, **kwargs):
    add_selfspec_args(parser)
    return result


def _around_from_cli_args(original, *args, **kwargs):
    ns = kwargs.get("args")
    if ns is None:
        ns = next((a for a in args if isinstance(a, argparse.Namespace)), None)
    if ns is not None:
        from selfspec.sglang_ext.cpu_defaults import fill_server_args, fill_thread_binding

        fill_server_args(ns)
        fill_thread_binding(ns)
        flags = flags_from_namespace(ns)
        if flags:
            os.environ[cfgmod.FLAGS_ENV] = json.dumps(flags)
            if flags.get("config") and not getattr(ns, "speculative_algorithm", None):
                mode = cfgmod.load_yaml_config(flags["config"]).get("mode")
                if mode:
                    ns.speculative_algorithm = str(mode).upper()
        _apply_published_checkpoint(ns, flags)
        for d in _DESTS:
            if hasattr(ns, d):
                delattr(ns, d)
    return original(*args, **kwargs)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", _around_from_cli_args, HookType.AROUND)
