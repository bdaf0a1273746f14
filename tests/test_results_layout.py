"""bench/results/ stays small and reproducible: at most 48 files, each named by its topic, every
one written by a line of `make results`, and every bench/results path the docs cite there."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MAX_FILES = 48
PATH = re.compile(r"bench/results(?:/[\w.*-]+)*/?")


def result_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def test_results_hold_at_most_48_files_named_by_topic():
    files = result_files()
    assert len(files) <= MAX_FILES, (
        f"bench/results holds {len(files)} files (at most {MAX_FILES}): keep the repeats of one "
        "experiment in one file (bench/median_table.py --save-runs)")
    numbered = [str(p.relative_to(RESULTS)) for p in files if re.search(r"-\d+\.json$", p.name)]
    assert not numbered, f"one file per topic, not per run: {numbered}"


def test_every_result_file_is_written_by_make_results():
    recipe = (REPO / "Makefile").read_text().split("\nresults:", 1)[1]
    written = set(re.findall(r"\$\(R\)/([\w./-]+)", recipe))
    missing = [str(rel) for rel in (p.relative_to(RESULTS) for p in result_files())
               if str(rel) not in written and not any(str(parent) in written for parent in rel.parents)]
    assert not missing, f"no line of `make results` in the Makefile writes {missing}"


def test_every_cited_result_path_exists():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "selfspec").rglob("*.py")),
            *sorted((REPO / "bench").glob("*.py")), *sorted((REPO / "bench").glob("*.sh"))]
    missing = []
    for doc in docs:
        for cited in PATH.findall(doc.read_text()):
            cited = cited.rstrip(".")
            if not (list(REPO.glob(cited)) if "*" in cited else (REPO / cited).exists()):
                missing.append(f"{doc.relative_to(REPO)}: {cited}")
    assert not missing, "cited but not under bench/results: " + ", ".join(missing)
