"""Training configurations, each field written once: in its dataclass, with its help text.

`LoopConfig` holds what the training loop (`selfspec.training.loop`) reads; an objective's
config (e.g. `selfspec.training.idlm.objective.IDLMConfig`) extends it with its own fields and may
redeclare a loop field to change its default (`lr: float = 3e-3`: the help stays the loop's). Command-line options are generated from the
fields (`add_arguments`) and the config is built back from the parsed namespace (`from_args`):

- `--field-name` per field, default = the field's default, help = `option(help=...)`;
- `int` / `float` / `str` (or `X | None`): `type=X`; `choices`, `nargs`, `const` as given to
  `option`;
- `list[int]` / `list[float]` / `list[str]`: a comma-separated list (`--curriculum 2,3,4`), or
  space-separated values when the field gives `nargs`;
- `bool`: a flag that flips the default (`--no-export` for a field that defaults to True);
- a field without a default is a required option.

Value checks that need several fields (and raise one-line `UsageError`s) live in the config's
`__post_init__`, so they run before any model loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any


def option(default: Any = MISSING, *, help: str | None = None, default_factory: Any = MISSING,
           **argparse_kwargs: Any) -> Any:
    """A config field with its command-line help (and any extra argparse keywords: choices,
    nargs, const)."""
    metadata = {"help": help, "argparse": argparse_kwargs}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(kw_only=True)
class LoopConfig:
    """training loop"""

    out: str = option(help="export directory")
    steps: int = option(1000, help="optimizer steps at most")
    time_budget_minutes: float | None = option(
        None, help="re-plan the steps so that training (schedule and curriculum) ends inside this budget")
    lr: float = option(1e-5, help="peak learning rate (after warmup; cosine decay to --min-lr-ratio of it)")
    min_lr_ratio: float = option(0.1, help="final learning rate as a share of --lr")
    warmup_ratio: float = option(0.03, help="share of the planned steps with a linear warmup")
    weight_decay: float = option(0.0, help="AdamW weight decay of the matrices (not of norms and biases)")
    grad_clip: float = option(1.0, help="gradient-norm clip (0: off)")
    batch_size: int = option(8, help="rows per process per micro-batch")
    grad_accum: int = option(1, help="micro-batches per optimizer step")
    eval_every: int = option(100, help="held-out evaluation every K steps (0: at the end only)")
    eval_tokens: int = option(16384, help="held-out target tokens per evaluation")
    save_every: int = option(0, help="checkpoint every K steps (0: at the end)")
    keep_checkpoints: int = option(1, help="checkpoints kept in --checkpoint-dir")
    checkpoint_dir: str | None = option(None, help="default OUT/checkpoints")
    resume: str | None = option(None, nargs="?", const="auto",
                                help="resume from the latest checkpoint (or the one given)")
    seed: int = option(0, help="seed of the initialisation and of every batch")
    threads: int | None = option(None, help="torch CPU threads")
    mixed_precision: str = option("auto", choices=["auto", "no", "bf16", "fp16"],
                                  help="autocast dtype (auto: bf16 on CUDA, none on CPU)")
    name: str | None = option(None, help="model name recorded in the provenance")
    export: bool = option(True, help="skip the export at the end (the checkpoint is still written)")
    progress_bar: bool = option(True, help="no tqdm progress bar")
    stop_after_steps: int | None = option(
        None, help="leave after this many steps in this process, checkpointed (preemption); --resume continues")


# ------------------------------------------------------------------------------ options
def _list_parser(item: type):
    def parse(text: str) -> list:
        values = [x.strip() for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        try:
            return [item(x) for x in values]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {item.__name__} values, got {text!r}") from None

    parse.__name__ = f"{item.__name__} list"
    return parse


def _unoptional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a config class that are command-line options (not dict-valued ones)."""
    hints = typing.get_type_hints(cls)
    return [f for f in dataclasses.fields(cls)
            if f.init and typing.get_origin(_unoptional(hints[f.name])) is not dict and _unoptional(hints[f.name]) is not dict]


def flag(f: dataclasses.Field) -> str:
    """The option string of a field: `--name`, or `--no-name` for a bool that defaults to True."""
    name = f.name.replace("_", "-")
    return f"--no-{name}" if f.default is True else f"--{name}"


def add_arguments(parser: argparse.ArgumentParser, cls: type, only: tuple[str, ...] | None = None,
                  overrides: bool = False) -> None:
    """One option per field of `cls` (or of the fields named in `only`), grouped by the class
    that declares them, the most derived first (an objective's own options before the loop's).
    `overrides=True`: every default is None (the caller keeps its own config's value for an
    option that is not given)."""
    hints = typing.get_type_hints(cls)
    mro = [k for k in cls.__mro__ if dataclasses.is_dataclass(k)]

    def owner(f: dataclasses.Field) -> type:  # the base-most class that declares the field
        return next(k for k in reversed(mro) if f.name in k.__dict__.get("__annotations__", {}))

    groups: dict[type, argparse._ArgumentGroup] = {}
    chosen = [f for f in cli_fields(cls) if only is None or f.name in only]
    for f in sorted(chosen, key=lambda f: mro.index(owner(f))):  # stable: field order within a class
        if owner(f) not in groups:
            title = (owner(f).__doc__ or owner(f).__name__).strip().splitlines()[0]
            groups[owner(f)] = parser.add_argument_group(f"{title} options") if only is None else parser
        group = groups[owner(f)]
        # a subclass that only changes a default (`lr: float = 3e-3`) keeps the declaring class's help
        meta = f.metadata or {g.name: g for g in dataclasses.fields(owner(f))}[f.name].metadata or {}
        kw: dict[str, Any] = {"help": meta.get("help"), "dest": f.name, **meta.get("argparse", {})}
        hint = _unoptional(hints[f.name])
        if hint is bool:
            kw["action"] = "store_false" if f.default is True else "store_true"
            kw["default"] = None if overrides else f.default
            group.add_argument(flag(f), **kw)
            continue
        if typing.get_origin(hint) is list:
            item = typing.get_args(hint)[0]
            kw["type"] = item if "nargs" in kw else _list_parser(item)
        else:
            kw["type"] = hint
        required = f.default is MISSING and f.default_factory is MISSING  # type: ignore[misc]
        if required and not overrides:
            kw["required"] = True
        else:
            kw["default"] = None if overrides or f.default is MISSING else f.default
        group.add_argument(flag(f), **kw)


def from_args(cls: type, args: argparse.Namespace, **given: Any):
    """The config of a parsed namespace (fields the namespace lacks, or that came out None
    where the field has a default factory, keep the class default); `given` overrides."""
    kw: dict[str, Any] = {}
    for f in cli_fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value is None and f.default_factory is not MISSING:  # type: ignore[misc]
            continue
        kw[f.name] = value
    kw.update(given)
    return cls(**kw)


def to_args(cfg: Any) -> list[str]:
    """The command-line words that rebuild `cfg` (the inverse of `from_args`): each option whose
    value is not the field's default."""
    words: list[str] = []
    for f in cli_fields(type(cfg)):
        value = getattr(cfg, f.name)
        if f.default_factory is not MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = f.default  # MISSING for a required field: never equal to a value
        if value is None or value == default:
            continue
        if isinstance(value, bool):
            words.append(flag(f))
        elif isinstance(value, list):
            nargs = (f.metadata or {}).get("argparse", {}).get("nargs")
            words += [flag(f), *map(str, value)] if nargs else [flag(f), ",".join(map(str, value))]
        else:
            words += [flag(f), str(value)]
    return words


def given_options(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` an `overrides=True` parser was given a value for."""
    return {f.name: getattr(args, f.name) for f in cli_fields(cls)
            if getattr(args, f.name, None) is not None}


def command_line() -> str:
    """The command that is running, as the user would type it (recorded in provenance)."""
    return "selfspec " + " ".join(sys.argv[1:]) if Path(sys.argv[0]).name in ("selfspec", "cli.py") \
        else " ".join(sys.argv)
