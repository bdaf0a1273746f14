"""ABBA means of a `selfspec bench serve` report, with the tuner's predicted speed-ups beside them.

This VM's speed drifts by more than the differences worth measuring (AR at C=1 read 95-148 tok/s
in one session), so comparisons of record run every configuration twice in mirrored order
(`--modes ar,ngram,a=isd,b=isd,b2=isd,a2=isd,ngram2=ngram,ar2=ar`): a row labelled X and one
labelled X2 or X-2 are the same configuration, and each cell here is their mean. Ratios are of means at
the same concurrency, for all outputs and for the non-looping ones (tokens over the sum of their
latencies). With `--predictions TUNE.json` (what `selfspec tune --json` wrote), each row served
with one of its plans also gets the predicted speed-up over AR and its error against the
measured one (`selfspec.benchmarks.predictions`).

    python bench/abba_table.py bench/results/serve-greedy-m.json --predictions bench/results/tune-vm-isd-m.json
    python bench/abba_table.py bench/results/serve-interleaved-u-greedy.json --plot u-greedy.png

Several reports pool: a label's rows in each are runs of it (two `bench serve --interleave`
runs, whose rows each ran once, give means and a spread this way).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def _base(label: str, labels: set[str]) -> str:
    """The row a mirrored twin repeats: X2 or X-2 of a label X in the report."""
    for suffix in ("-2", "2"):
        if label.endswith(suffix) and label[: -len(suffix)] in labels:
            return label[: -len(suffix)]
    return label


def abba_means(report: dict[str, Any]) -> dict[str, dict[int, dict[str, float | None]]]:
    """label -> concurrency -> mean output tok/s, mean non-looping tok/s and TPF, over the row
    and its mirrored twin."""
    rows = [r for r in report["results"] if r.get("status") == "ok"]
    labels = {r.get("label", r["mode"]) for r in rows}
    cells: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        for lv in r["levels"]:
            cells[_base(r.get("label", r["mode"]), labels)][lv["concurrency"]].append(lv)

    def mean(values: list[float | None]) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.mean(values) if values else None

    interleaved = bool(report.get("interleave"))

    def spread(label: str, c: int, lvs: list[dict[str, Any]]) -> float | None:
        """The runs' difference over their mean: this VM's noise on the cell (none for a row run
        once). Runs of `bench serve --interleave`: of each run's ratio to the same run's AR (the
        runs drift apart by more than the modes do within one)."""
        if len(lvs) < 2:
            return None
        values = [lv["output_tok_s"] for lv in lvs]
        ar_runs = cells.get("ar", {}).get(c, [])
        if interleaved and label != "ar" and len(ar_runs) == len(lvs):
            values = [v / a["output_tok_s"] for v, a in zip(values, ar_runs)]
        return (max(values) - min(values)) / statistics.mean(values)

    return {label: {c: {"tok_s": mean([lv["output_tok_s"] for lv in lvs]),
                        "non_loop_tok_s": mean([(lv.get("non_loop") or {}).get("tokens_per_s") for lv in lvs]),
                        "tpf": mean([lv.get("tpf") for lv in lvs]),
                        "predicted_speedup": mean([lv.get("predicted_speedup") for lv in lvs]),
                        "spread": spread(label, c, lvs),
                        "runs": len(lvs)}
                    for c, lvs in sorted(by_c.items())}
            for label, by_c in cells.items()}


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def _spread(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def table(report: dict[str, Any]) -> str:
    means = abba_means(report)
    ar, ngram = means.get("ar", {}), means.get("ngram", {})
    head = ["row", "C", "runs", "tok/s", "spread", "TPF", "xAR", "xAR NL", "xNGRAM", "xNGRAM NL", "pred xAR", "xAR err"]
    out = [head]
    for label, by_c in means.items():
        for c, m in by_c.items():
            a, n = ar.get(c, {}), ngram.get(c, {})
            speedup = m["predicted_speedup"]
            measured = m["tok_s"] / a["tok_s"] if a.get("tok_s") else None
            out.append([label, str(c), str(m["runs"]), f"{m['tok_s']:.0f}", _spread(m["spread"]),
                        f"{m['tpf']:.2f}" if m["tpf"] else "-",
                        _ratio(m["tok_s"], a.get("tok_s")), _ratio(m["non_loop_tok_s"], a.get("non_loop_tok_s")),
                        _ratio(m["tok_s"], n.get("tok_s")), _ratio(m["non_loop_tok_s"], n.get("non_loop_tok_s")),
                        f"{speedup:.2f}" if speedup else "-",
                        f"{speedup / measured - 1:+.0%}" if speedup and measured else "-"])
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    return "\n".join(" ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))
                     for row in out)


def markdown(report: dict[str, Any]) -> str:
    """The README's form: per row and concurrency, x AR (non-looping x AR) [x NGRAM all /
    non-looping] and the spread of its two runs; AR's row in tok/s; TPF per level last."""
    means = abba_means(report)
    ar, ngram = means.get("ar", {}), means.get("ngram", {})
    levels = sorted({c for by_c in means.values() for c in by_c})
    lines = ["| | " + " | ".join(f"C={c}" for c in levels) + " | TPF " + " / ".join(map(str, levels)) + " |",
             "|---" * (len(levels) + 2) + "|"]

    for label, by_c in means.items():
        cells = []
        for c in levels:
            m, a, n = by_c.get(c), ar.get(c, {}), ngram.get(c, {})
            if m is None:
                cells.append("-")
            elif label == "ar":
                cells.append(f"{m['tok_s']:.0f}" + (f" (±{m['spread']:.0%})" if m["spread"] is not None else ""))
            else:
                vs_ngram = "" if label == "ngram" else f" [{_ratio(m['tok_s'], n.get('tok_s'))} / " \
                    f"{_ratio(m['non_loop_tok_s'], n.get('non_loop_tok_s'))}]"
                cells.append(f"{_ratio(m['tok_s'], a.get('tok_s'))} ({_ratio(m['non_loop_tok_s'], a.get('non_loop_tok_s'))})"
                             f"{vs_ngram}" + (f" ±{m['spread']:.0%}" if m["spread"] is not None else ""))
        tpf = " / ".join(f"{by_c[c]['tpf']:.2f}" if c in by_c and by_c[c]["tpf"] else "-" for c in levels)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {tpf} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], out: str) -> list[str]:
    """Each row's output tok/s over AR's at each concurrency (a plan's rows, labelled *tuned*,
    solid; AR and NGRAM dotted; fixed configurations dashed), written to `out`; the labels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = abba_means(report)
    ar = means.get("ar", {})
    levels = sorted(c for c in ar if ar[c].get("tok_s"))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    drawn = []
    for label, by_c in means.items():
        cs = [c for c in levels if c in by_c]
        if not cs:
            continue
        style = ":" if label in ("ar", "ngram") else "-" if "tuned" in label else "--"
        ax.plot(cs, [by_c[c]["tok_s"] / ar[c]["tok_s"] for c in cs], style, marker="o", label=label,
                linewidth=2.2 if "tuned" in label else 1.2)
        drawn.append(label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s × AR (same run)")
    temperature = report.get("temperature")
    ax.set_title(f"{Path(str(report.get('model', ''))).name}, "
                 + ("greedy" if not temperature else f"T={temperature}"))
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", metavar="REPORT",
                   help="`selfspec bench serve --json` reports; rows of one label in several reports are runs of it")
    p.add_argument("--predictions", default=None, metavar="TUNE.json",
                   help="a `selfspec tune --json` report: attach its predictions first (as --predictions does)")
    p.add_argument("--markdown", action="store_true", help="the README's table form instead")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="also plot each row's x AR by concurrency")
    args = p.parse_args()
    for path in filter(None, (*args.reports, args.predictions)):
        if not Path(path).is_file():
            p.error(f"{path}: no such file")
    reports = []
    for path in args.reports:
        try:
            reports.append(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            p.error(f"{path}: not a JSON report ({e})")
    if args.predictions:
        from selfspec.benchmarks import predictions

        tune = predictions.load(args.predictions)
        for report in reports:
            predictions.attach(report, tune)
    report = dict(reports[0], results=[row for r in reports for row in r["results"]])
    print(markdown(report) if args.markdown else table(report))
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
