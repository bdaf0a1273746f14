"""The embedded models' corpus: the running interpreter's standard-library sources.

Every machine has them, so the recipe needs no download. The split into train and held-out
is by a hash of each file's path relative to the stdlib root, so it is the same on every
machine with the same interpreter, and it is recorded in the provenance.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Directory names that hold tests at any depth (Lib/test, unittest/test, ctypes/test,
# distutils/tests, idlelib/idle_test, ...). Tests are excluded so the model learns library
# code, and so no test file leaks between the splits.
_EXCLUDED_DIR_NAMES = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}


def _is_excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIR_NAMES or name.startswith("test_") or name.endswith("_test")


@dataclass(frozen=True)
class CorpusFile:
    relpath: str
    text: str

    @property
    def heldout(self) -> bool:
        return is_heldout(self.relpath)


@dataclass(frozen=True)
class CorpusSplit:
    root: str
    train: list[CorpusFile]
    heldout: list[CorpusFile]

    def digest(self) -> str:
        """sha256 over (path, text) of every file, in sorted path order: identifies the corpus."""
        h = hashlib.sha256()
        for f in sorted(self.train + self.heldout, key=lambda f: f.relpath):
            h.update(f.relpath.encode())
            h.update(b"\0")
            h.update(f.text.encode())
            h.update(b"\0")
        return h.hexdigest()


HELDOUT_PERCENT = 5


def is_heldout(relpath: str) -> bool:
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % 100
    return bucket < HELDOUT_PERCENT


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_stdlib_files(root: Path | None = None) -> list[CorpusFile]:
    root = root or stdlib_root()
    files: list[CorpusFile] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(_is_excluded_dir(part) for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(CorpusFile(rel.as_posix(), text))
    return files


def load_stdlib_split(root: Path | None = None) -> CorpusSplit:
    files = iter_stdlib_files(root)
    return CorpusSplit(
        root=str(root or stdlib_root()),
        train=[f for f in files if not f.heldout],
        heldout=[f for f in files if f.heldout],
    )
