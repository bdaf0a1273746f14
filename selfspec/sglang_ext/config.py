"""What a selfspec mode runs with inside SGLang, where each setting comes from, and the checks.

Sources, highest precedence first:
1. `--selfspec-*` flags on the SGLang command line (see `cli_args.py`);
2. `--selfspec-config FILE.yaml` (presets in `serving_configs/`);
3. the checkpoint's `selfspec.json` (`selfspec.decoding.metadata`): mode, stride, mask token,
   RISD adapter, so `--speculative-algorithm ISD --model-path <I-DLM checkpoint>` needs nothing else;
4. the mode's own defaults (its config class in `selfspec.decoding.registry`).

`resolve(server_args)` merges them, builds the decoding-core mode once to learn its fixed
verify width, and checks everything a server would otherwise discover mid-request. Each
failure is a `SelfSpecConfigError` whose message names the fix. The resolved configuration is
published in the environment (`RESOLVED_ENV`) so the scheduler processes, which SGLang spawns
after resolution, run exactly what the launcher validated.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.decoding import registry
from selfspec.errors import UserError
from selfspec.decoding.metadata import (
    MetadataError, SelfspecMetadata, load_metadata, model_fingerprint, weights_sha256,
)
from selfspec.decoding.policy import PolicyConfig, policy_plan
#: JSON of the `--selfspec-*` flags, set by the CLI hook in the launching process.
FLAGS_ENV = "SELFSPEC_SERVER_FLAGS"
#: JSON of the resolved configuration, set after validation for the scheduler processes.
RESOLVED_ENV = "SELFSPEC_RESOLVED_CONFIG"

MAX_WIDTH = 256  # query tokens per request and step; a larger tree is a configuration mistake


class SelfSpecConfigError(UserError):
    """A server argument or checkpoint the selfspec plugin cannot serve; the message says why and how to fix it."""


def _err(msg: str) -> SelfSpecConfigError:
    return SelfSpecConfigError(f"[selfspec] {msg}")


@dataclass
class ResolvedConfig:
    algorithm: str  # ISD | RISD | JACOBI | SJD
    model_path: str
    options: dict[str, Any]  # fields of the decoding-core config class of the mode
    width: int  # fixed verify width per request (query tokens per step)
    mask_token_id: int | None = None
    adapter: str | None = None  # RISD: PEFT adapter directory
    sources: dict[str, str] = field(default_factory=dict)  # option -> where it came from
    plan: dict[str, Any] | None = None  # a width plan (`decoding/width_plan.py`): per batch size, its options
    policy: str | None = None  # the built-in policy that wrote `plan` (`decoding/policy.py`); None: a plan file

    @property
    def spec(self) -> registry.ModeSpec:
        return registry.for_sglang_algorithm(self.algorithm)

    @property
    def mode(self) -> str:
        return self.spec.name

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "ResolvedConfig":
        return ResolvedConfig(**json.loads(text))

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v!r} ({self.sources.get(k, 'default')})" for k, v in sorted(self.options.items()))
        plan = ""
        if self.plan is not None:
            from selfspec.decoding.width_plan import WidthPlan

            plan = f"; width plan ({self.sources.get('plan', '?')}): {WidthPlan.from_dict(self.plan, self.mode).describe()}"
        elif self.policy is not None:
            plan = f"; built-in policy {self.policy}: the mode alone on every step"
        return f"{self.algorithm}: width {self.width}; {opts}{plan}"


# ---------------------------------------------------------------------------------- inputs
def load_yaml_config(path: str | Path) -> dict[str, Any]:
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise _err(f"--selfspec-config {path}: no such file (presets live in serving_configs/)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise _err(f"--selfspec-config {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise _err(f"--selfspec-config {path} must be a mapping of option: value")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    if "options" in data:  # nested form: {mode: X, options: {...}}
        nested = data.pop("options") or {}
        data.update({str(k).replace("-", "_"): v for k, v in nested.items()})
    return data


def cli_flags_from_env() -> dict[str, Any]:
    raw = os.environ.get(FLAGS_ENV)
    return json.loads(raw) if raw else {}


def _tokenizer_mask_id(tokenizer_dir: str) -> int | None:
    """The tokenizer's mask token id, read from its files (no model load)."""
    d = Path(tokenizer_dir)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d))
    except Exception:
        return None
    if getattr(tok, "mask_token", None) is None:
        return None
    tid = tok.mask_token_id
    return int(tid) if tid is not None else None


def _model_config(model_path: str) -> dict[str, Any]:
    f = Path(model_path) / "config.json"
    return json.loads(f.read_text()) if f.is_file() else {}


# ---------------------------------------------------------------------------------- resolution
def build_mode(cfg: ResolvedConfig, padded: bool = True):
    """The decoding-core Mode object for a resolved configuration (one source of truth).
    `padded=False` (a worker whose verify forwards are ragged, on CPU): ISD / RISD layouts end
    at their last real token instead of MASK padding to the fixed width; the padding is never
    seen by a real position, so the step decides the same, for fewer query tokens."""
    spec = cfg.spec
    vocab = _model_config(cfg.model_path).get("vocab_size")
    if spec.needs_vocab_size and vocab is None:
        raise _err(f"{cfg.algorithm} needs the vocabulary size: {cfg.model_path}/config.json has no vocab_size")
    resources = registry.ModeResources(cfg.mask_token_id, int(vocab) if vocab is not None else None)
    options = dict(cfg.options) if padded else registry.unpadded(spec.name, cfg.options)
    if cfg.plan is not None:
        return registry.build_planned(spec.name, options, cfg.plan, resources)
    config = registry.parse_mode_config(spec.name, options)
    return registry.build(spec.name, config, resources)


def resolve(server_args: Any, algorithm: str | None = None) -> ResolvedConfig:
    """Merge flags, YAML, checkpoint metadata and defaults; validate; return the configuration."""
    algorithm = (algorithm or server_args.speculative_algorithm or "").upper()
    spec = registry.for_sglang_algorithm(algorithm)
    if spec is None:
        raise _err(f"--speculative-algorithm {algorithm} is not a selfspec mode "
                   f"({', '.join(registry.SGLANG_ALGORITHMS)})")
    model_path = str(server_args.model_path)
    flags = cli_flags_from_env()
    yaml_cfg = load_yaml_config(flags["config"]) if flags.get("config") else {}
    meta = _load_metadata(model_path)

    yaml_mode = yaml_cfg.pop("mode", None)
    plan = yaml_cfg.pop("plan", None)
    plan_model = yaml_cfg.pop("model_fingerprint", None)
    policy_value = flags.get("policy", yaml_cfg.pop("policy", None))
    if yaml_mode is not None and str(yaml_mode).upper() != algorithm:
        raise _err(f"--selfspec-config {flags['config']} is a {str(yaml_mode).upper()} preset but "
                   f"--speculative-algorithm is {algorithm}: use the matching preset or algorithm")
    if plan is not None and policy_value is not None:
        raise _err(f"--selfspec-config {flags['config']} gives a width plan, which replaces the built-in policy: "
                   "drop the policy (--selfspec-policy or policy:) or the plan")
    if plan is not None and plan_model is not None:
        _check_plan_model(str(flags["config"]), plan_model, model_path)

    defaults = spec.defaults
    known = set(defaults)
    options: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def put(key: str, value: Any, source: str) -> None:
        if value is None:
            return
        if key not in known:
            raise _err(f"{source}: unknown {algorithm} option {key!r}; known options: {', '.join(sorted(known))}")
        options[key] = value
        sources[key] = source

    # 4. defaults, 3. checkpoint metadata (RISD: the base's, then the adapter's), 2. YAML, 1. flags
    for k, v in defaults.items():
        put(k, v, "default")
    metas = [meta]
    if spec.needs_adapter:
        adapter = flags.get("lora") or yaml_cfg.get("adapter") or (meta.adapter_path if meta else None)
        if adapter and Path(adapter).expanduser().is_dir():
            metas.append(_load_metadata(Path(adapter).expanduser()))
    for m in metas:
        if m is None:
            continue
        src = f"{m.path}/selfspec.json"
        for key in spec.metadata_fields:
            put(key, m.option(key), src)
    for k, v in yaml_cfg.items():
        put(k, v, f"--selfspec-config {flags['config']}")
    flag_opts = dict(flags.get("options") or {})
    for k in ("stride", "tau"):
        if flags.get(k) is not None:
            flag_opts[k] = flags[k]
    for k, v in flag_opts.items():
        put(k, v, f"--selfspec-{k.replace('_', '-')}" if k in ("stride", "tau") else "--selfspec-options")

    cfg = ResolvedConfig(algorithm=algorithm, model_path=model_path, options=options, width=0, sources=sources)
    if plan is not None:
        cfg.plan, sources["plan"] = plan, f"--selfspec-config {flags['config']}"
    else:
        _apply_policy(cfg, policy_value)
    _check_mode_specific(cfg, server_args, flags, meta)
    try:
        mode = build_mode(cfg)
    except SelfSpecConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise _err(f"invalid {algorithm} configuration: {e}") from None
    cfg.width = int(mode.max_width)
    _check_width(cfg, server_args)
    return cfg


def _apply_policy(cfg: ResolvedConfig, value: Any) -> None:
    """The built-in policy's plan (`decoding/policy.py`) where no plan file gives one. The mode's
    own buckets take the policy's options for the mode except those the user set (flags, YAML):
    what a user asks for wins over what the policy would choose."""
    spec = cfg.spec
    try:
        policy = PolicyConfig.parse(value)
    except ValueError as e:
        raise _err(f"{e} (from {'--selfspec-policy' if value is not None else 'the default'})") from None
    cfg.policy = policy.name
    plan = policy_plan(spec.name, spec.policy_options, policy)
    if plan is None:
        return
    user_set = {k for k, src in cfg.sources.items() if src.startswith("--selfspec")}
    for buckets in (plan["greedy"], plan["sampled"]):
        for bucket in buckets:
            if bucket["mode"] == spec.name:
                for key in user_set & set(bucket):
                    del bucket[key]
    cfg.plan, cfg.sources["plan"] = plan, f"built-in policy {policy.name}"


def _check_plan_model(config: str, recorded: Any, model_path: str) -> None:
    """A plan records the model it was measured on (`model_fingerprint`); another model's plan
    would serve widths chosen from another model's acceptance."""
    try:
        have = model_fingerprint(model_path)
    except FileNotFoundError:
        return  # no weights on disk to compare (a hub name): nothing to check against
    if str(recorded) != have:
        raise _err(f"--selfspec-config {config} is a plan measured on another model (model_fingerprint "
                   f"{str(recorded)[:12]}..., {model_path} has {have[:12]}...): re-tune it for this model with "
                   "`selfspec tune`, or serve without it (the built-in policy needs no measurement)")


def _load_metadata(directory: str | Path) -> SelfspecMetadata | None:
    if not Path(directory).is_dir():
        return None
    try:
        return load_metadata(directory)
    except MetadataError as e:
        raise _err(str(e)) from None


def _check_mode_specific(cfg: ResolvedConfig, server_args: Any, flags: dict, meta: SelfspecMetadata | None) -> None:
    algo = cfg.algorithm
    if cfg.spec.serving_check is not None:
        problem = cfg.spec.serving_check(cfg.options, cfg.sources)
        if problem:
            raise _err(f"{algo}: {problem}")
    if not cfg.spec.needs_mask_token:
        return
    # mask token: flag, options, metadata, tokenizer
    mask_id = flags.get("mask_token_id")
    if mask_id is None:
        mask_id = cfg.options.get("mask_token_id")
    tokenizer_dir = getattr(server_args, "tokenizer_path", None) or cfg.model_path
    if mask_id is None:
        mask_id = _tokenizer_mask_id(str(tokenizer_dir))
    if mask_id is None:
        raise _err(f"{algo} appends [MASK] tokens, but {cfg.model_path} has no mask token (no mask_token_id in "
                   "selfspec.json, no mask_token in the tokenizer). Serve an I-DLM checkpoint (selfspec train "
                   "writes selfspec.json), or name the token with --selfspec-mask-token-id ID, or use "
                   "--speculative-algorithm JACOBI / SJD, which need no mask token")
    vocab = _model_config(cfg.model_path).get("vocab_size")
    if vocab is not None and not 0 <= int(mask_id) < int(vocab):
        raise _err(f"mask token id {mask_id} is outside the model's vocabulary (vocab_size {vocab}); "
                   "fix --selfspec-mask-token-id or selfspec.json mask_token_id")
    cfg.mask_token_id = int(mask_id)
    cfg.options["mask_token_id"] = int(mask_id)
    cfg.sources.setdefault("mask_token_id", "resolved")

    if cfg.spec.needs_adapter:
        adapter = flags.get("lora") or cfg.options.get("adapter") or (meta.adapter_path if meta else None)
        if not adapter:
            raise _err("RISD needs a gated LoRA adapter, and none was given: pass --selfspec-lora ADAPTER_DIR "
                       "(a PEFT LoRA directory trained for RISD on this base), or add \"adapter\": \"DIR\" to "
                       f"{cfg.model_path}/selfspec.json")
        adapter = str(Path(adapter).expanduser().resolve()) if Path(adapter).expanduser().exists() else adapter
        check_adapter(adapter, cfg.model_path)
        cfg.adapter = adapter
        cfg.options["adapter"] = adapter
        cfg.sources["adapter"] = "--selfspec-lora" if flags.get("lora") else "selfspec.json / --selfspec-config"


def check_adapter(adapter: str, model_path: str) -> None:
    """RISD adapter sanity: a PEFT LoRA dir whose shapes fit this base and whose recorded base
    fingerprint (selfspec.json lora.base_sha256), when present, is this base's."""
    from selfspec.engines.lora import load_adapter_state

    a = Path(adapter)
    if not a.is_dir():
        raise _err(f"RISD adapter {adapter} is not a directory; pass --selfspec-lora with a PEFT adapter dir")
    try:
        config, state = load_adapter_state(a)
    except (FileNotFoundError, ValueError) as e:
        raise _err(f"RISD adapter {adapter}: {e}") from None
    meta = _load_metadata(a)
    want = meta.lora.base_sha256 if meta is not None and meta.lora is not None else None
    if want:
        try:
            have = weights_sha256(model_path)
        except FileNotFoundError:
            raise _err(f"RISD adapter {adapter} records the weights hash of its base, but {model_path} has no "
                       "*.safetensors to compare it with: serve a safetensors checkpoint") from None
        if have != want:
            base_hint = f" (it names base {meta.base_model!r})" if meta.base_model else ""
            raise _err(f"RISD adapter {adapter} was trained on another base{base_hint}: its selfspec.json "
                       f"records base_sha256 {want[:12]}..., but {model_path} has {have[:12]}.... Serve the base "
                       "it was trained on, or train an adapter for this base")
    mc = _model_config(model_path)
    if not mc:
        return
    hidden = mc.get("hidden_size")
    heads = mc.get("num_attention_heads")
    kv_heads = mc.get("num_key_value_heads", heads)
    head_dim = mc.get("head_dim") or (hidden // heads if hidden and heads else None)
    inter = mc.get("intermediate_size")
    layers = mc.get("num_hidden_layers")
    dims = {
        "q_proj": (hidden, heads * head_dim if heads and head_dim else None),
        "k_proj": (hidden, kv_heads * head_dim if kv_heads and head_dim else None),
        "v_proj": (hidden, kv_heads * head_dim if kv_heads and head_dim else None),
        "o_proj": (heads * head_dim if heads and head_dim else None, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    import re

    for key, t in state.items():
        m = re.search(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])", key)
        if not m:
            continue
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if layers is not None and layer >= layers:
            raise _err(f"RISD adapter {adapter} was trained on another base: it has layer {layer}, the base "
                       f"{model_path} has {layers} layers")
        if proj not in dims:
            continue
        d_in, d_out = dims[proj]
        bad = (ab == "A" and d_in is not None and t.shape[-1] != d_in) or (
            ab == "B" and d_out is not None and t.shape[0] != d_out)
        if bad:
            raise _err(f"RISD adapter {adapter} was trained on another base: {key} has shape {tuple(t.shape)}, "
                       f"which does not fit {proj} of {model_path} ({d_in} -> {d_out})")


def _check_width(cfg: ResolvedConfig, server_args: Any) -> None:
    w = cfg.width
    if w < 1 or w > MAX_WIDTH:
        raise _err(f"{cfg.algorithm} would verify {w} query tokens per request and step; the supported range "
                   f"is 1..{MAX_WIDTH}: shrink the window / tree options ({cfg.describe()})")
    ndt = getattr(server_args, "speculative_num_draft_tokens", None)
    steps = getattr(server_args, "speculative_num_steps", None) or 1
    topk = getattr(server_args, "speculative_eagle_topk", None) or 1
    if ndt is not None:
        reserved = max(int(ndt), int(steps) * int(topk))
        if w > reserved:
            raise _err(f"{cfg.algorithm} verifies {w} tokens per request and step, but --speculative-num-draft-tokens "
                       f"{ndt} reserves only {reserved} KV slots per request and step: remove "
                       f"--speculative-num-draft-tokens (selfspec sets it to {w}) or set it to at least {w}")


# ---------------------------------------------------------------------------------- unsupported combinations
def check_server_combination(server_args: Any, cfg: ResolvedConfig) -> None:
    """Server features the selfspec worker does not support, each named with its fix."""
    a = server_args
    algo = cfg.algorithm

    def get(name, default=None):
        return getattr(a, name, default)

    if get("speculative_draft_model_path"):
        raise _err(f"{algo} is draft-free (the model drafts for itself): remove --speculative-draft-model-path")
    if get("enable_dp_attention") or (get("attn_dp_size") or 1) > 1:
        raise _err(f"{algo} does not support DP attention: remove --enable-dp-attention (plain --dp-size "
                   "data parallelism works)")
    if (get("pp_size") or 1) > 1:
        raise _err(f"{algo} does not support pipeline parallelism: use --pp-size 1 (tensor parallel --tp-size works)")
    if get("enable_two_batch_overlap") or get("enable_single_batch_overlap"):
        raise _err(f"{algo} does not support two/single-batch overlap: remove --enable-two-batch-overlap / "
                   "--enable-single-batch-overlap")
    if get("speculative_adaptive"):
        raise _err(f"{algo} has a fixed verify width: remove --speculative-adaptive")
    if (get("disaggregation_mode") or "null") != "null":
        raise _err(f"{algo} does not support prefill/decode disaggregation: remove --disaggregation-mode")
    if (get("page_size") or 1) != 1:
        raise _err(f"{algo} commits accepted tokens slot by slot and needs --page-size 1 (got {get('page_size')})")
    if get("enable_mixed_chunk"):
        raise _err(f"{algo} cannot mix prefill chunks into verify batches: remove --enable-mixed-chunk")
    if get("dllm_algorithm"):
        raise _err(f"{algo} and --dllm-algorithm are alternatives: use one of them")
    if cfg.spec.needs_adapter and get("enable_lora"):
        raise _err("RISD installs its own gated LoRA in the linear layers: remove --enable-lora / --lora-paths")
    if get("device") == "cpu":
        backend = get("attention_backend")
        if backend not in (None, "torch_native"):
            raise _err(f"{algo} on CPU verifies through the torch_native attention backend (selfspec adds its "
                       f"target-verify path); got --attention-backend {backend}: use --attention-backend torch_native")


def publish(cfg: ResolvedConfig) -> None:
    os.environ[RESOLVED_ENV] = cfg.to_json()


def load_for_worker(server_args: Any) -> ResolvedConfig:
    """The configuration the launcher validated (or a fresh resolution when run without it)."""
    raw = os.environ.get(RESOLVED_ENV)
    algo = str(server_args.speculative_algorithm).upper()
    if raw:
        cfg = ResolvedConfig.from_json(raw)
        if cfg.algorithm == algo and cfg.model_path == str(server_args.model_path):
            return cfg
    return resolve(server_args, algo)
