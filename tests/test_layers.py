"""The architecture's layering (docs/architecture.md "Layers"), checked on the source: which
package may import which, no import cycles among the modules of one package, and none between
packages (the top-level modules count as packages of their own)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "selfspec"

# package -> packages of selfspec it must never import (lazily or not)
FORBIDDEN = {
    "checkpoints": {"decoding", "kernels", "engines", "sglang_ext", "training", "benchmarks", "tuning", "images"},
    "decoding": {"kernels", "engines", "sglang_ext", "training", "benchmarks", "tuning", "images"},
    "kernels": {"decoding", "engines", "sglang_ext", "training", "benchmarks", "tuning", "images"},
    "engines": {"sglang_ext", "training", "benchmarks", "tuning", "images"},
    "sglang_ext": {"training", "benchmarks", "tuning", "images"},
    "tuning": {"sglang_ext", "training", "images"},
    "training": {"sglang_ext", "images"},
    "benchmarks": {"training", "images"},
}


def imports_of(path: Path) -> set[str]:
    """Every `selfspec.*` module a file imports, at any depth of the file."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("selfspec")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("selfspec"):
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_files(package: str) -> list[Path]:
    return sorted((PKG / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_layers_below_it(package):
    bad = []
    for f in package_files(package):
        for name in imports_of(f):
            top = name.split(".")[1] if name.count(".") >= 1 else ""
            if top in FORBIDDEN[package]:
                bad.append(f"{f.relative_to(PKG)} imports {name}")
    assert not bad, "\n".join(bad)


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_cycles_within_a_package(package):
    files = package_files(package)
    modules = {module_name(f): f for f in files}
    graph = {m: {n for n in imports_of(f) if n in modules and n != m} for m, f in modules.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycles_between_packages():
    units = {p.name if p.is_dir() else p.stem: p for p in PKG.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    graph: dict[str, set[str]] = {}
    for unit, path in units.items():
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        graph[unit] = {name.split(".")[1] for f in files for name in imports_of(f)
                       if name.count(".") >= 1 and name.split(".")[1] in units and name.split(".")[1] != unit}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle)


def test_no_folder_holds_more_than_15_modules():
    """One folder per subsystem, one module per job: a folder that outgrows 15 modules mixes
    subsystems and is split (docs/architecture.md)."""
    crowded = {str(d.relative_to(PKG.parent)): n for d in [PKG, *PKG.rglob("*")]
               if d.is_dir() and (n := len(list(d.glob("*.py")))) > 15}
    assert not crowded, crowded
