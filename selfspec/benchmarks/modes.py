"""Which modes a benchmark runs: `--modes ar,ngram,isd,isd-ctx=isd`. An entry `LABEL=MODE` is a
variant of a registered mode under its own name (its options given for that label: `--mode-config
LABEL:k=v` offline, `--mode-args 'LABEL=--selfspec-options k=v'` served), so several settings of
one mode are measured side by side in one run. AR always runs first, once."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.decoding import registry


@dataclass(frozen=True)
class ModeRun:
    label: str  # how the row is named (the mode's name unless a label was given)
    mode: str  # the registry name


def parse_modes(text: str | list[str]) -> list[ModeRun]:
    entries = text.split(",") if isinstance(text, str) else list(text)
    runs: list[ModeRun] = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        label, sep, mode = entry.partition("=")
        name = registry.get(mode if sep else label).name  # ValueError names the choices
        run = ModeRun(label.strip().lower() if sep else name, name)
        if run.label in {r.label for r in runs}:
            raise ValueError(f"--modes lists {run.label!r} twice; give variants their own labels (LABEL=MODE)")
        runs.append(run)
    return [ModeRun("ar", "ar")] + [r for r in runs if r.label != "ar"]


#: The rows `--breakdown` adds before each served selfspec mode (which runs its default policy):
#: label suffix -> the `--selfspec-policy` that isolates one part of what the mode buys
#: (`decoding/widths/policy.py`): the worker's own AR steps against stock AR (its batched verify
#: attention against SGLang's decode forward), lookup steps only, the mode's own steps only.
BREAKDOWN_POLICIES = (("ar-steps", "ar"), ("lookup", "lookup"), ("own", "own"))


def breakdown(runs: list[ModeRun]) -> tuple[list[ModeRun], list[str]]:
    """`runs` with each served selfspec mode preceded by its breakdown rows (`BREAKDOWN_POLICIES`),
    and the `--mode-args` entries that serve them."""
    out: list[ModeRun] = []
    mode_args: list[str] = []
    for run in runs:
        if registry.get(run.mode).sglang_algorithm is not None:
            for suffix, policy in BREAKDOWN_POLICIES:
                label = f"{run.label}:{suffix}"
                out.append(ModeRun(label, run.mode))
                mode_args.append(f"{label}=--selfspec-policy {policy}")
        out.append(run)
    return out, mode_args
