"""Where the package's own files lie, and where the files a run writes go.

selfspec reads only what it ships inside the package (`selfspec/assets/`, `selfspec/data/`),
wherever it is installed, and writes work files (checkpoints, generated data) under the current
working directory's `runs/` (or wherever `--out` says), never beside the package.

The one exception is rebuilding an embedded model: its recipe exports into `selfspec/assets/`,
which only a source checkout may change (`check_package_write`); installed from a wheel, such a
command asks for `--out` instead.
"""

from __future__ import annotations

from pathlib import Path

from selfspec.errors import UsageError

PACKAGE_DIR = Path(__file__).resolve().parent


def runs_dir(*parts: str) -> Path:
    """`runs/<parts>` under the working directory: relative, so it is resolved where it is used."""
    return Path("runs", *parts)


def source_checkout() -> Path | None:
    """The root of the source tree the package runs from (a clone of the repository, installed
    editable or put on sys.path), or None when it runs from an installed wheel."""
    root = PACKAGE_DIR.parent
    try:
        text = (root / "pyproject.toml").read_text()
    except OSError:
        return None
    return root if 'name = "selfspec"' in text else None


def check_package_write(path: str | Path, command: str, fix: str = "give --out DIR to write elsewhere") -> None:
    """UsageError when `path` lies inside an installed package (not a source checkout): only a
    checkout's embedded models may be rebuilt or re-measured in place."""
    target = Path(path).resolve()
    if target.is_relative_to(PACKAGE_DIR) and source_checkout() is None:
        raise UsageError(f"`{command}` would write into the installed package ({target}), which only a source "
                         f"checkout of selfspec may change: {fix}")


def recorded_path(value: str) -> str:
    """A path as provenance records it, the same on every machine: the package's files relative
    to the package's parent (`selfspec/assets/tiny-base`), files under the working directory
    relative to it (`runs/tiny-idlm`); anything else as given."""
    path = Path(value)
    if not path.is_absolute():
        return value
    if path.is_relative_to(PACKAGE_DIR):
        return str(path.relative_to(PACKAGE_DIR.parent))
    cwd = Path.cwd().resolve()
    return str(path.relative_to(cwd)) if path.is_relative_to(cwd) else value
