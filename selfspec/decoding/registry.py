"""The one list of decoding modes. Every other layer (HF engine, SGLang config and request
checks, metrics, CLI, benchmarks, export, evaluation) asks this registry; none lists modes.

A mode is one module in `selfspec/decoding/` (its config dataclass and its `Mode` subclass)
plus one `ModeSpec` entry below. `parse_mode_config` turns options (a dict, `k=v,...` text from
a command line, or a config object) into the mode's config, checking names and types, so a bad
option fails where it is given, not at the first request.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from selfspec.decoding.modes.ar import ARMode
from selfspec.decoding.modes.corpus import SharedCorpus
from selfspec.decoding.modes.isd import ISDConfig, ISDMode
from selfspec.decoding.modes.isd import serving_check as isd_serving_check
from selfspec.decoding.modes.jacobi import JacobiConfig, JacobiMode
from selfspec.decoding.modes.ngram import NgramConfig, NgramMode
from selfspec.decoding.modes.sjd import SJDConfig, SJDMode
from selfspec.decoding.step import Mode


@dataclass(frozen=True)
class ModeResources:
    """What a mode may need from the model it runs on (resolved by the engine)."""

    mask_token_id: int | None = None
    vocab_size: int | None = None
    # the texts served so far, for context candidates across requests (`corpus.py`); None: each
    # `build` makes its own (one per served model: a mode object lives as long as its server;
    # offline, one per generate call, so benchmark rows never see each other's outputs), and a
    # width plan's buckets share theirs
    corpus: SharedCorpus | None = None


@dataclass(frozen=True)
class ModeSpec:
    name: str  # lower case: `--mode` on the HF engine, `mode` in selfspec.json
    summary: str  # one line for --help
    config_class: type | None  # None: the mode takes no options
    mode_class: type[Mode]
    build: Callable[[Any, ModeResources], Mode]  # (parsed config, resources) -> Mode
    sglang_algorithm: str | None  # `--speculative-algorithm` name; None: not served by the plugin
    needs_mask_token: bool = False
    needs_adapter: bool = False  # a gated LoRA adapter (RISD)
    needs_vocab_size: bool = False
    checkpoint_kind: str = "any"  # "any" AR model | "idlm" (an I-DLM conversion) | "adapter"
    #: config fields a checkpoint's selfspec.json fills when the user leaves them unset
    metadata_fields: tuple[str, ...] = ()
    #: served by SGLang itself under this algorithm name (the NGRAM baseline)
    builtin_sglang_algorithm: str | None = None
    #: the mode's own step in the built-in policy's small-batch buckets (`policy.py`), beside
    #: the context candidate the policy adds; options the user sets win over these
    policy_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: the served mode's start-up check of its resolved options (options, their sources) -> the
    #: problem and its fix, or None; the plugin stops the server with it
    serving_check: Callable[[dict, dict], str | None] | None = None

    @property
    def greedy_only(self) -> bool:
        return bool(self.mode_class.greedy_only)

    @property
    def defaults(self) -> dict[str, Any]:
        """The config fields and their default values ({} for a mode without options)."""
        if self.config_class is None:
            return {}
        out = {}
        for f in dataclasses.fields(self.config_class):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                out[f.name] = f.default_factory()  # type: ignore[misc]
        return out


_ISD_FIELDS = ("stride", "mask_token_id")
#: stride 2 (3 query tokens besides the candidate) at small batches: measured on the tune prompts
#: against strides 3 and 4 (bench/results/policy/tune-greedy-small-batches.json)
_ISD_POLICY = {"stride": 2, "context_tail": False}
#: a 4-token block and no pool candidates beside the context candidate: on tiny-idlm's tune
#: prompts 583 / 954 tok/s at C = 1 / 2 against 556 / 855 with the mode's defaults (8, 4 pool
#: candidates); a lookup step of the candidate alone read 676 / 1021, which the run-time check
#: serves where it is measured faster (a Jacobi-Forcing-trained model's blocks may pay)
_JACOBI_POLICY = {"block_size": 4, "verify_size": 0}

_SPECS = (
    ModeSpec("ar", "plain autoregressive decoding, one token per forward (the baseline)", None, ARMode,
             lambda cfg, res: ARMode(), sglang_algorithm=None),
    ModeSpec("ngram", "prompt-lookup drafts from the sequence's own n-grams (SGLang's NGRAM is the served one)",
             NgramConfig, NgramMode, lambda cfg, res: NgramMode(cfg, res.corpus), sglang_algorithm=None, builtin_sglang_algorithm="NGRAM"),
    ModeSpec("isd", "introspective strided decoding: verify last step's [MASK] proposals, propose N new ones",
             ISDConfig, ISDMode, lambda cfg, res: ISDMode(cfg, res.mask_token_id, gated=False, corpus=res.corpus), sglang_algorithm="ISD",
             needs_mask_token=True, checkpoint_kind="idlm", metadata_fields=_ISD_FIELDS, policy_options=_ISD_POLICY,
             serving_check=isd_serving_check),
    ModeSpec("risd", "ISD with a LoRA adapter gated on at [MASK] positions only: the base model's exact output",
             ISDConfig, ISDMode, lambda cfg, res: ISDMode(cfg, res.mask_token_id, gated=True, corpus=res.corpus), sglang_algorithm="RISD",
             needs_mask_token=True, needs_adapter=True, checkpoint_kind="adapter", metadata_fields=_ISD_FIELDS,
             policy_options=_ISD_POLICY, serving_check=isd_serving_check),
    ModeSpec("jacobi", "greedy Jacobi decoding of n-token blocks with rejection-recycling candidates (lossless)",
             JacobiConfig, JacobiMode, lambda cfg, res: JacobiMode(cfg, res.vocab_size, res.corpus), sglang_algorithm="JACOBI",
             needs_vocab_size=True, metadata_fields=("block_size", "max_blocks", "spawn_ratio", "verify_size"),
             policy_options=_JACOBI_POLICY),
    ModeSpec("sjd", "speculative Jacobi decoding: W drafts verified with the p/q rule (keeps the sampling law)",
             SJDConfig, SJDMode, lambda cfg, res: SJDMode(cfg, res.corpus), sglang_algorithm="SJD"),
)

MODES: dict[str, ModeSpec] = {s.name: s for s in _SPECS}
MODE_NAMES: tuple[str, ...] = tuple(MODES)
#: the `--speculative-algorithm` names the SGLang plugin registers, and their modes
SGLANG_ALGORITHMS: dict[str, ModeSpec] = {s.sglang_algorithm: s for s in _SPECS if s.sglang_algorithm}


def get(mode: str) -> ModeSpec:
    """The spec of `mode` (any case, '-' or '_'); ValueError naming the choices otherwise."""
    key = str(mode).strip().lower().replace("-", "_")
    if key not in MODES:
        raise ValueError(f"unknown decoding mode {mode!r}; choose one of {', '.join(MODE_NAMES)}")
    return MODES[key]


def for_sglang_algorithm(algorithm: str | None) -> ModeSpec | None:
    """The mode served under `--speculative-algorithm ALGORITHM` by the plugin, or None."""
    return SGLANG_ALGORITHMS.get(str(algorithm or "").upper())


# ------------------------------------------------------------------------------ options
def parse_mode_config(mode: str, mode_config: Any = None, defaults: dict[str, Any] | None = None):
    """mode_config may be None, a dict of the config's fields, `k=v,...` text, or the config
    object itself. `defaults` (e.g. from selfspec.json) fill fields the caller left unset.
    Unknown names and values of the wrong type raise ValueError naming the option."""
    spec = get(mode)
    cls = spec.config_class
    if isinstance(mode_config, str):
        mode_config = parse_option_string(mode_config)
    if cls is None:
        if mode_config:
            raise ValueError(f"mode {spec.name!r} takes no options, got {mode_config!r}")
        return None
    if isinstance(mode_config, cls):
        return mode_config
    given = dict(mode_config or {})
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"unknown {spec.name} option(s) {unknown}; known: {', '.join(names)}")
    for key, value in (defaults or {}).items():
        if key in names and key not in given and value is not None:
            given[key] = value
    checked = {key: _coerce(spec.name, key, value, hints[key]) for key, value in given.items()}
    return cls(**checked)


def _coerce(mode: str, key: str, value: Any, hint: Any) -> Any:
    """`value` as the field's declared type (int, float, bool, str, tuple[int, ...], X | None)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
    bad = ValueError(f"{mode} option {key}={value!r}: expected {_type_name(hint)}")
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else str(value).replace("-", " ").split()
        inner = typing.get_args(hint)[0]
        return tuple(_coerce(mode, key, v, inner) for v in items)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, str) and value.strip().lstrip("-").isdigit():
                return int(value)
            raise bad
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:
                return float(value)
            except (TypeError, ValueError):
                raise bad from None
        return float(value)
    if hint is str:
        return str(value)
    return value


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return f"a list of {_type_name(typing.get_args(hint)[0])}s (e.g. 3-2)"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


def parse_option_string(text: str | None) -> dict[str, Any]:
    """'stride=4,tau=0.5,fixed_width=false' -> {'stride': 4, 'tau': 0.5, 'fixed_width': False}
    (for command lines)."""
    out: dict[str, Any] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, raw = part.partition("=")
        if not sep:
            raise ValueError(f"mode option {part!r} is not key=value")
        raw = raw.strip()
        low = raw.lower()
        value: Any
        if low in ("true", "false"):
            value = low == "true"
        elif low in ("none", "null"):
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        out[key.strip()] = value
    return out


def build(mode: str, config: Any, resources: ModeResources = ModeResources()) -> Mode:
    """The Mode object of a parsed config; ValueError when a needed resource is missing."""
    spec = get(mode)
    if resources.corpus is None:
        resources = dataclasses.replace(resources, corpus=SharedCorpus())
    if spec.needs_mask_token and resources.mask_token_id is None:
        raise ValueError(f"{spec.name.upper()} needs a [MASK] token id")
    if spec.needs_vocab_size and resources.vocab_size is None:
        raise ValueError(f"{spec.name.upper()} needs the model's vocabulary size")
    return spec.build(config, resources)


def build_planned(mode: str, base_options: dict[str, Any], plan: Any,
                  resources: ModeResources = ModeResources()) -> Mode:
    """The `planned_mode.PlannedMode` of `plan` (a WidthPlan or its dict form) for `mode`: each
    bucket's mode built from `base_options` overridden by the bucket's options (a lookup bucket,
    `mode: ngram`, from its own options alone: the base options are the plan mode's)."""
    from selfspec.decoding.widths.planned_mode import PlannedMode
    from selfspec.decoding.widths.width_plan import PLAN_STEP_MODES, WidthPlan

    spec = get(mode)
    if resources.corpus is None:  # one corpus for all the buckets
        resources = dataclasses.replace(resources, corpus=SharedCorpus())
    if not isinstance(plan, WidthPlan):
        plan = WidthPlan.from_dict(plan, spec.name)

    def one(bucket) -> Mode:
        if bucket.mode in PLAN_STEP_MODES:
            return build(bucket.mode, parse_mode_config(bucket.mode, bucket.options or None), resources)
        return build(spec.name, parse_mode_config(spec.name, {**base_options, **bucket.options}), resources)

    greedy, sampled = [one(b) for b in plan.greedy], [one(b) for b in plan.sampled]
    lookups = {}  # the check's third arm, for greedy batches (sampled ones follow the plan alone)
    for m in greedy:
        cfg = getattr(m, "config", None)
        if m.name == spec.name and getattr(cfg, "context_tokens", 0) > 0:  # the candidate alone
            lookups[id(m)] = build("ngram", NgramConfig(cfg.context_tokens, cfg.context_match_sizes, cfg.context_corpus,
                                                        cfg.context_caps, length_factor=cfg.context_length_factor),
                                   resources)
    return PlannedMode(plan, greedy, sampled, spec.name, ar_mode=build("ar", None, resources), lookup_modes=lookups)


def unpadded(mode: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` for layouts that end at their last real token (a ragged CPU verify forward):
    `fixed_width=False` for the modes that pad to a fixed width (ISD, RISD)."""
    return {**options, "fixed_width": False} if "fixed_width" in get(mode).defaults else dict(options)


def help_text() -> str:
    """One line per mode, for --help."""
    return "; ".join(f"{s.name}: {s.summary}" for s in _SPECS)
