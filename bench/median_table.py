"""Repeated `selfspec bench serve` runs of the same rows as one table of medians.

Each run is one interleaved report (`--json`); per row and concurrency level this prints the
median over the runs of output tok/s over AR's and over NGRAM's in the same run, on all outputs
and on the non-looping ones (their per-request tok/s), the tokens per forward, and which kind of
step committed the row's tokens. A run's ratios compare rows that met the same machine at the
same time; the median of three keeps one disturbed run from deciding a cell.

    python bench/median_table.py RUN1.json RUN2.json RUN3.json [--markdown] [--json OUT] [--save-runs RUNS.json]
    python bench/median_table.py RUNS.json [--markdown]

Runs may measure different levels (a level measured again on its own): each level's median is
over the runs that measured it, and the legend says how many. A file is one report or a runs file, `{"schema": "selfspec.bench.serve.runs/v1", "runs": [report,
...]}`, the repeats of one set kept together (what `--save-runs` writes from the reports read, and
what bench/results/defaults/ holds). Reports of different prompt sets get a table each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


RUNS_SCHEMA = "selfspec.bench.serve.runs/v1"


def load_reports(path: str | Path) -> list[dict]:
    """The reports in one file: a `bench serve --json` report, or every run of a runs file."""
    data = json.loads(Path(path).read_text())
    return list(data["runs"]) if data.get("schema") == RUNS_SCHEMA else [data]


def _level(row: dict, c: int) -> dict | None:
    return next((lv for lv in row.get("levels", []) if lv["concurrency"] == c), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def levels_of(reports: list[dict]) -> list[int]:
    """Every concurrency level any of the reports measured, ascending (a run may measure some
    levels only: each level's median is over the runs that measured it)."""
    return sorted({c for rep in reports for c in rep["concurrency"]})


def cells(reports: list[dict]) -> dict:
    """label -> concurrency -> the medians over the reports."""
    out: dict = {}
    labels = [r["label"] for r in reports[0]["results"] if r["status"] == "ok"]
    for label in labels:
        for c in levels_of(reports):
            per_run = []
            for rep in reports:
                rows = {r["label"]: r for r in rep["results"] if r["status"] == "ok"}
                lv, ar = _level(rows.get(label, {}), c), _level(rows.get("ar", {}), c)
                ng = _level(rows.get("ngram", {}), c)
                if lv is None:
                    continue
                nl = lv.get("non_loop") or {}
                nl_rate = nl.get("tokens_per_s")
                per_run.append({
                    "tok_s": lv["output_tok_s"], "x_ar": _ratio(lv["output_tok_s"], ar and ar["output_tok_s"]),
                    "x_ngram": _ratio(lv["output_tok_s"], ng and ng["output_tok_s"]),
                    "nl_x_ar": _ratio(nl_rate, ar and (ar.get("non_loop") or {}).get("tokens_per_s")),
                    "nl_x_ngram": _ratio(nl_rate, ng and (ng.get("non_loop") or {}).get("tokens_per_s")),
                    "tpf": lv.get("tpf"), "nl_tpf": nl.get("tpf"), "loops": lv.get("repetition_loops"),
                    "kinds": lv.get("tokens_by_step_kind")})
            med = {k: _median([p[k] for p in per_run]) for k in ("tok_s", "x_ar", "x_ngram", "nl_x_ar", "nl_x_ngram",
                                                                   "tpf", "nl_tpf")}
            med["runs"] = len(per_run)
            med["x_ngram_runs"] = [p["x_ngram"] for p in per_run]
            kinds: dict = {}
            for p in per_run:
                for k, v in (p["kinds"] or {}).items():
                    kinds.setdefault(k, []).append(v)
            med["kinds"] = {k: round(statistics.median(v), 2) for k, v in sorted(kinds.items())}
            out.setdefault(label, {})[c] = med
    return out


def table(reports: list[dict], markdown: bool) -> str:
    med = cells(reports)
    levels = levels_of(reports)

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    head = ["row"] + [f"C={c}" for c in levels] + ["TPF " + " / ".join(str(c) for c in levels)]
    lines = []
    for label, by_c in med.items():
        row = [label]
        for c in levels:
            m = by_c[c]
            row.append(f"{f(m['x_ar'])} ({f(m['nl_x_ar'])}) [{f(m['x_ngram'])} / {f(m['nl_x_ngram'])}]")
        row.append(" / ".join(f(by_c[c]["tpf"]) for c in levels))
        lines.append(row)
    kinds = [f"{label}: " + "; ".join(f"C={c} " + ", ".join(f"{k} {v:.0%}" for k, v in by_c[c]["kinds"].items())
                                      for c in levels if by_c[c]["kinds"])
             for label, by_c in med.items() if any(by_c[c]["kinds"] for c in levels)]
    runs = {c: sum(c in rep["concurrency"] for rep in reports) for c in levels}
    counted = (f"median of {len(reports)} runs" if len(set(runs.values())) == 1 and runs[levels[0]] == len(reports)
               else "median of the runs of each level (" + ", ".join(f"C={c}: {n}" for c, n in runs.items()) + ")")
    legend = (f"{counted}; cell: x AR (non-looping x AR) [x NGRAM / non-looping x NGRAM]; "
              f"prompts {reports[0].get('prompts_file')}, T={reports[0].get('temperature')}")
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in lines]
    else:
        widths = [max(len(r[i]) for r in [head, *lines]) for i in range(len(head))]
        out = ["  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in [head, *lines]]
    return "\n".join(out + ["", legend, "tokens by kind of step (median share): " + (" | ".join(kinds) or "-")])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="`selfspec bench serve --json` reports of the same rows, or runs files")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json", default=None, help="write the medians here")
    p.add_argument("--save-runs", default=None, metavar="RUNS.json",
                   help="write every report read, in order, as one runs file")
    args = p.parse_args(argv)
    reports = [rep for path in args.reports for rep in load_reports(path)]
    # a median across prompt sets means nothing: one table per set, in the order first read
    sets: dict[str, list[dict]] = {}
    for rep in reports:
        sets.setdefault(str(rep.get("prompts_file")), []).append(rep)
    print("\n\n".join(table(reps, args.markdown) for reps in sets.values()))
    if args.json:
        out = cells(reports) if len(sets) == 1 else {name: cells(reps) for name, reps in sets.items()}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.save_runs:
        Path(args.save_runs).write_text(json.dumps({"schema": RUNS_SCHEMA, "runs": reports}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
