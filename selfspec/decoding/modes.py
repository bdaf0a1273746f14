"""Mode names and their configuration objects (what `--mode` and `mode_config` accept)."""

from __future__ import annotations

import dataclasses
from typing import Any

MODES = ("ar", "ngram", "jacobi", "sjd", "isd", "risd")


def config_class(mode: str):
    mode = normalize_mode(mode)
    if mode == "ar":
        return None
    if mode in ("isd", "risd"):
        from selfspec.decoding.isd import ISDConfig

        return ISDConfig
    if mode == "jacobi":
        from selfspec.decoding.jacobi import JacobiConfig

        return JacobiConfig
    if mode == "sjd":
        from selfspec.decoding.sjd import SJDConfig

        return SJDConfig
    if mode == "ngram":
        from selfspec.decoding.ngram import NgramConfig

        return NgramConfig
    raise AssertionError(mode)


def normalize_mode(mode: str) -> str:
    m = str(mode).strip().lower().replace("-", "_")
    if m not in MODES:
        raise ValueError(f"unknown decoding mode {mode!r}; choose one of {', '.join(MODES)}")
    return m


def parse_mode_config(mode: str, mode_config: Any = None, defaults: dict[str, Any] | None = None):
    """mode_config may be None, a dict of the config's fields, or the config object itself.
    `defaults` (e.g. from selfspec.json: stride, mask_token_id, adapter) fill fields the caller
    left unset."""
    cls = config_class(mode)
    if cls is None:
        if mode_config:
            raise ValueError(f"mode {mode!r} takes no mode_config, got {mode_config!r}")
        return None
    if isinstance(mode_config, cls):
        return mode_config
    given = dict(mode_config or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(given) - names
    if unknown:
        raise ValueError(f"unknown {mode} option(s) {sorted(unknown)}; known: {sorted(names)}")
    for key, value in (defaults or {}).items():
        if key in names and key not in given and value is not None:
            given[key] = value
    return cls(**given)


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


def add_mode_arguments(parser) -> None:
    """`--mode` and `--mode-config` for a command line (e.g. `selfspec generate`)."""
    parser.add_argument("--mode", default="ar", choices=MODES, help="decoding mode (default: ar)")
    parser.add_argument("--mode-config", default=None, metavar="K=V,...",
                        help="mode options, e.g. stride=4,tau=0.5 (isd/risd), block_size=16 (jacobi), "
                             "window=4,history_offset=8 (sjd), num_draft=4 (ngram), adapter=DIR (risd)")


def mode_config_from_args(args) -> dict[str, Any] | None:
    """The `mode_config` argument of `HFEngine.generate` from `add_mode_arguments`' options."""
    return parse_option_string(getattr(args, "mode_config", None)) or None
