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
