"""What a selfspec mode runs with inside SGLang, where each setting comes from, and the checks.

Sources, highest precedence first:
1. `--selfspec-*` flags on the SGLang command line (see `cli_args.py`);
2. `--selfspec-config FILE.yaml` (presets in `serving_configs/`);
3. a preset for a published checkpoint (`--selfspec-preset`, or picked by the model's Hub
   organisation: `published.PRESETS`);
4. the checkpoint's `selfspec.json` (`selfspec.checkpoints.metadata`): mode, stride, mask token,
   RISD adapter, so `--speculative-algorithm ISD --model-path <I-DLM checkpoint>` needs nothing else;
5. the mode's own defaults (its config class in `selfspec.decoding.registry`).

The checkpoint's files are read wherever SGLang reads them (a folder, or a Hub name through the
Hub cache: `checkpoint_files`), and a published release that carries no selfspec.json is
recognised from what it does carry (`published`): the mask token from config.json, an SDAR
checkpoint served through SGLang's causal class, I-DLM's own algorithm config file.

`resolve(server_args)` merges them, builds the decoding-core mode once to learn its fixed
verify width, and checks everything a server would otherwise discover mid-request. Each
failure is a `SelfSpecConfigError` whose message names the fix. The resolved configuration is
published in the environment (`RESOLVED_ENV`) so the scheduler processes, which SGLang spawns
after resolution, run exactly what the launcher validated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.decoding import registry
from selfspec.errors import UserError
from selfspec.checkpoints.metadata import (
    MetadataError, SelfspecMetadata, load_metadata, model_fingerprint, weights_sha256,
)
from selfspec.decoding.widths.policy import PolicyConfig, policy_plan
from selfspec.checkpoints import files as checkpoint_files
from selfspec.checkpoints import published

logger = logging.getLogger(__name__)

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
    plan: dict[str, Any] | None = None  # a width plan (`decoding/widths/width_plan.py`): per batch size, its options
    policy: str | None = None  # the built-in policy that wrote `plan` (`decoding/widths/policy.py`); None: a plan file
    model_dir: str = ""  # the folder of the model's files (a Hub name's cache snapshot)
    architecture: str | None = None  # the class SGLang serves the model as, where not its own (SDAR)
    sampling_defaults: dict[str, Any] | None = None  # the server's default sampling parameters (I-DLM's config)
    notes: list[str] = field(default_factory=list)  # what was recognised and mapped, for the start-up log

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
            from selfspec.decoding.widths.width_plan import WidthPlan

            plan = f"; width plan ({self.sources.get('plan', '?')}): {WidthPlan.from_dict(self.plan, self.mode).describe()}"
        elif self.policy is not None:
            plan = f"; built-in policy {self.policy}: the mode alone on every step"
        served = f"; served as {self.architecture} (causal)" if self.architecture else ""
        notes = "".join(f"; {n}" for n in self.notes)
        return f"{self.algorithm}: width {self.width}; {opts}{plan}{served}{notes}"


# ---------------------------------------------------------------------------------- inputs
def load_yaml_config(path: str | Path) -> dict[str, Any]:
    import yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise _err(f"--selfspec-config {path}: no such file (example files: serving_configs/ in the selfspec "
                   "repository; the settings a published checkpoint family recommends: --selfspec-preset)")
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


def _model_config(model_dir: str | Path) -> dict[str, Any]:
    return checkpoint_files.read_json(Path(model_dir), "config.json")


def _local(path: str, revision: str | None = None, what: str = "small") -> Path:
    try:
        return checkpoint_files.local_dir(path, revision, files=what)
    except UserError as e:
        raise _err(str(e)) from None


def model_files(model_path: str, revision: str | None) -> tuple[Path, dict[str, Any], str | None]:
    """(the model's folder, its config.json, the architecture a selfspec mode serves it as)."""
    model_dir = _local(model_path, revision)
    config = _model_config(model_dir)
    try:
        return model_dir, config, published.served_architecture(config, model_path)
    except UserError as e:
        raise _err(str(e)) from None


def server_arg_additions(model_path: str, revision: str | None, flags: dict[str, Any],
                         override_json: str | None, trust_remote_code: bool) -> dict[str, Any]:
    """Server arguments a published checkpoint needs before SGLang loads it (the CLI hook sets
    them, `resolve` checks them): the causal class for an SDAR checkpoint, the default sampling
    parameters of I-DLM's algorithm config."""
    out: dict[str, Any] = {}
    _, config, arch = model_files(model_path, revision)
    if not trust_remote_code and config.get("auto_map") and not _known_model_type(config.get("model_type")):
        raise _err(f"{model_path} declares its config class as remote code (auto_map in its config.json, "
                   f"model_type {config.get('model_type')!r}), which SGLang loads only with --trust-remote-code: "
                   "add --trust-remote-code")
    if arch is not None:
        override = _override_args(override_json)
        override["architectures"] = [arch]
        out["json_model_override_args"] = json.dumps(override)
    if flags.get("config"):
        data = load_yaml_config(flags["config"])
        if published.is_idlm_algorithm_config(data):
            sampling = _idlm_settings(data, flags["config"]).sampling
            if sampling:
                out["preferred_sampling_params"] = json.dumps(sampling)
    return out


def _known_model_type(model_type: Any) -> bool:
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def _override_args(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise _err(f"--json-model-override-args is not valid JSON ({e})") from None
    return value if isinstance(value, dict) else {}


def _idlm_settings(data: dict[str, Any], source: str) -> published.IdlmSettings:
    try:
        return published.from_idlm_algorithm_config(data, f"--selfspec-config {source}")
    except (UserError, TypeError, ValueError) as e:
        raise _err(str(e)) from None


# ---------------------------------------------------------------------------------- resolution
def build_mode(cfg: ResolvedConfig, padded: bool = True):
    """The decoding-core Mode object for a resolved configuration (one source of truth).
    `padded=False` (a worker whose verify forwards are ragged, on CPU): ISD / RISD layouts end
    at their last real token instead of MASK padding to the fixed width; the padding is never
    seen by a real position, so the step decides the same, for fewer query tokens."""
    spec = cfg.spec
    vocab = checkpoint_files.vocab_size(_model_config(cfg.model_dir or cfg.model_path))
    if spec.needs_vocab_size and vocab is None:
        raise _err(f"{cfg.algorithm} needs the vocabulary size: {cfg.model_path}'s config.json has no vocab_size "
                   "(nor text_config.vocab_size)")
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
    revision = getattr(server_args, "revision", None)
    model_dir, model_config, architecture = model_files(model_path, revision)
    if architecture is not None:
        _check_served_as(architecture, model_path, getattr(server_args, "json_model_override_args", None))
    flags = cli_flags_from_env()
    yaml_cfg = load_yaml_config(flags["config"]) if flags.get("config") else {}
    meta = _load_metadata(model_dir)
    notes: list[str] = []
    sampling_defaults = None
    if published.is_idlm_algorithm_config(yaml_cfg):
        if spec.checkpoint_kind not in ("idlm", "adapter"):
            raise _err(f"--selfspec-config {flags['config']} is I-DLM's algorithm config (gen_block_size), which "
                       f"configures ISD / RISD, not {algorithm}")
        idlm = _idlm_settings(yaml_cfg, flags["config"])
        yaml_cfg, sampling_defaults = dict(idlm.options), idlm.sampling or None
        notes.append(f"I-DLM config {flags['config']}: " + ", ".join(idlm.mapped))
        if idlm.unmapped:
            notes.append("not mapped: " + "; ".join(idlm.unmapped))
            logger.warning("[selfspec] --selfspec-config %s: keys with no ISD equivalent, not applied: %s",
                           flags["config"], "; ".join(idlm.unmapped))
    try:
        preset = published.preset_for(flags.get("preset"), model_path, algorithm)
    except UserError as e:
        raise _err(str(e)) from None

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
        _check_plan_model(str(flags["config"]), plan_model, str(model_dir))

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

    # 5. defaults, 4. checkpoint metadata (RISD: the base's, then the adapter's), 3. a preset, 2. YAML, 1. flags
    for k, v in defaults.items():
        put(k, v, "default")
    metas = [meta]
    if spec.needs_adapter:
        adapter = flags.get("lora") or yaml_cfg.get("adapter") or (meta.adapter_path if meta else None)
        if adapter:
            metas.append(_load_metadata(_local(str(adapter), what="all")))
    for m in metas:
        if m is None:
            continue
        src = f"{m.path}/selfspec.json"
        for key in spec.metadata_fields:
            put(key, m.option(key), src)
    if preset is not None:
        name, chosen = preset
        how = f"--selfspec-preset {name}" if flags.get("preset") else f"preset {name} (its Hub organisation)"
        for k, v in chosen.options.items():
            put(k, v, how)
        notes.append(f"{how}: {chosen.summary}")
    for k, v in yaml_cfg.items():
        put(k, v, f"--selfspec-config {flags['config']}")
    flag_opts = dict(flags.get("options") or {})
    for k in ("stride", "tau"):
        if flags.get(k) is not None:
            flag_opts[k] = flags[k]
    for k, v in flag_opts.items():
        put(k, v, f"--selfspec-{k.replace('_', '-')}" if k in ("stride", "tau") else "--selfspec-options")

    cfg = ResolvedConfig(algorithm=algorithm, model_path=model_path, options=options, width=0, sources=sources,
                         model_dir=str(model_dir), architecture=architecture, sampling_defaults=sampling_defaults,
                         notes=notes)
    if plan is not None:
        cfg.plan, sources["plan"] = plan, f"--selfspec-config {flags['config']}"
    else:
        _apply_policy(cfg, policy_value)
    _check_mode_specific(cfg, server_args, flags, meta, model_config)
    try:
        mode = build_mode(cfg)
    except SelfSpecConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise _err(f"invalid {algorithm} configuration: {e}") from None
    cfg.width = int(mode.max_width)
    _check_width(cfg, server_args)
    return cfg


def _check_served_as(architecture: str, model_path: str, override_json: str | None) -> None:
    """A model that must be served as another class (an SDAR checkpoint, causally) is refused
    unless SGLang was told to (the CLI hook tells it; a server built in code must say it)."""
    if _override_args(override_json).get("architectures") != [architecture]:
        raise _err(f"{model_path} must be served as {architecture} (the causal model the selfspec modes verify "
                   "against; SGLang's own class of this checkpoint prefills non-causally): launch it with "
                   "`python -m sglang.launch_server`, which sets this, or pass json_model_override_args="
                   f"'{{\"architectures\": [\"{architecture}\"]}}'")


def _apply_policy(cfg: ResolvedConfig, value: Any) -> None:
    """The built-in policy's plan (`decoding/widths/policy.py`) where no plan file gives one. The mode's
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
    user_set = {k for k, src in cfg.sources.items() if src.startswith(("--selfspec", "preset"))}
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


def _check_mode_specific(cfg: ResolvedConfig, server_args: Any, flags: dict, meta: SelfspecMetadata | None,
                         model_config: dict[str, Any]) -> None:
    algo = cfg.algorithm
    if cfg.spec.serving_check is not None:
        problem = cfg.spec.serving_check(cfg.options, cfg.sources)
        if problem:
            raise _err(f"{algo}: {problem}")
    if not cfg.spec.needs_mask_token:
        return
    _resolve_mask_token(cfg, server_args, flags, model_config)
    if cfg.spec.needs_adapter:
        adapter = flags.get("lora") or cfg.options.get("adapter") or (meta.adapter_path if meta else None)
        if not adapter:
            raise _err("RISD needs a gated LoRA adapter, and none was given: pass --selfspec-lora ADAPTER "
                       "(a PEFT LoRA folder or Hub name trained for RISD on this base), or add \"adapter\": \"DIR\" "
                       f"to {cfg.model_path}/selfspec.json")
        adapter_dir = str(_local(str(adapter), what="all").resolve())
        check_adapter(adapter_dir, cfg.model_dir or cfg.model_path)
        cfg.adapter = adapter_dir
        cfg.options["adapter"] = adapter_dir
        cfg.sources["adapter"] = "--selfspec-lora" if flags.get("lora") else "selfspec.json / --selfspec-config"


def _resolve_mask_token(cfg: ResolvedConfig, server_args: Any, flags: dict, model_config: dict[str, Any]) -> None:
    """The [MASK] id, first found of: --selfspec-mask-token-id, the options (selfspec.json, a
    config file, --selfspec-options), config.json's mask_token_id, the tokenizer's mask_token."""
    mask_id, source = flags.get("mask_token_id"), "--selfspec-mask-token-id"
    if mask_id is None:
        mask_id, source = cfg.options.get("mask_token_id"), cfg.sources.get("mask_token_id", "")
    if mask_id is None:
        mask_id, source = checkpoint_files.config_mask_token_id(model_config), "config.json mask_token_id"
    if mask_id is None:
        tokenizer = getattr(server_args, "tokenizer_path", None) or cfg.model_path
        tokenizer_dir = cfg.model_dir if tokenizer == cfg.model_path else _local(str(tokenizer), None)
        mask_id, source = checkpoint_files.tokenizer_mask_token_id(Path(tokenizer_dir)), "the tokenizer's mask_token"
    if mask_id is None:
        raise _err(f"{cfg.algorithm} appends [MASK] tokens, but {cfg.model_path} names no mask token (no mask_token_id "
                   "in selfspec.json or config.json, no mask_token in the tokenizer). Serve an I-DLM checkpoint, "
                   "or name the token with --selfspec-mask-token-id ID (I-DLM's <|MASK|> is 151669 on Qwen3's "
                   "vocabulary), or use --speculative-algorithm JACOBI / SJD, which need no mask token")
    vocab = checkpoint_files.vocab_size(model_config)
    if vocab is not None and not 0 <= int(mask_id) < int(vocab):
        raise _err(f"mask token id {mask_id} (from {source}) is outside the model's vocabulary (vocab_size {vocab}); "
                   "fix --selfspec-mask-token-id or selfspec.json mask_token_id")
    cfg.mask_token_id = int(mask_id)
    cfg.options["mask_token_id"] = int(mask_id)
    cfg.sources["mask_token_id"] = source


#: each LoRA target's (in, out) features on a Qwen3 / Qwen2 / Llama base, from its config.json
def _projection_shapes(mc: dict[str, Any]) -> dict[str, tuple[int | None, int | None]]:
    hidden = mc.get("hidden_size")
    heads = mc.get("num_attention_heads")
    kv_heads = mc.get("num_key_value_heads", heads)
    head_dim = mc.get("head_dim") or (hidden // heads if hidden and heads else None)
    inter = mc.get("intermediate_size")
    q = heads * head_dim if heads and head_dim else None
    kv = kv_heads * head_dim if kv_heads and head_dim else None
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def check_adapter(adapter: str, model_path: str) -> None:
    """RISD adapter sanity, at start-up: a PEFT LoRA folder whose every target is a projection of
    this base with the base's in / out features and the adapter's rank, and whose recorded base
    fingerprint (selfspec.json lora.base_sha256), when present, is this base's."""
    import re

    from selfspec.engines.lora import load_adapter_state

    a = Path(adapter)
    if not a.is_dir():
        raise _err(f"RISD adapter {adapter} is not a directory; pass --selfspec-lora with a PEFT adapter folder")
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
    mc = checkpoint_files.text_config(_model_config(model_path))
    if not mc:
        return
    named = config.get("base_model_name_or_path")
    other = f" (its adapter_config.json names base {named!r})" if named else ""
    layers = mc.get("num_hidden_layers")
    dims = _projection_shapes(mc)
    rank = config.get("r")
    for key, t in state.items():
        m = re.search(r"(?:layers\.(\d+)\.)?(?:[\w.]*\.)?(\w+)\.lora_([AB])(?:\.\w+)?\.weight$", key)
        if not m:
            continue
        layer, proj, ab = m.group(1), m.group(2), m.group(3)
        if layer is not None and layers is not None and int(layer) >= layers:
            raise _err(f"RISD adapter {adapter} was trained on another base{other}: it has layer {layer}, the base "
                       f"{model_path} has {layers} layers")
        if proj not in dims:
            raise _err(f"RISD adapter {adapter} was trained on another base{other}: it adapts module {proj!r} "
                       f"({key}), which the base {model_path} does not have (projections: {', '.join(dims)})")
        d_in, d_out = dims[proj]
        r = t.shape[0] if ab == "A" else t.shape[-1]
        features = t.shape[-1] if ab == "A" else t.shape[0]
        expected = d_in if ab == "A" else d_out
        if expected is not None and features != expected:
            raise _err(f"RISD adapter {adapter} was trained on another base{other}: {key} has shape "
                       f"{tuple(t.shape)}, which does not fit {proj} of {model_path} ({d_in} -> {d_out})")
        if rank is not None and _rank_of(config, key, proj) != r:
            raise _err(f"RISD adapter {adapter}: {key} has rank {r}, but its adapter_config.json says "
                       f"{_rank_of(config, key, proj)}: the folder's weights and config disagree")


def _rank_of(config: dict[str, Any], key: str, proj: str) -> int:
    """The rank PEFT gives `key`: rank_pattern's entry for the module, else r."""
    for pattern, value in (config.get("rank_pattern") or {}).items():
        if pattern in key or pattern == proj:
            return int(value)
    return int(config["r"])


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
