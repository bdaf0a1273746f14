"""The report of `selfspec bench serve`: ratios to AR, the non-looping split, the notes, the
table and the plot."""

from __future__ import annotations

import math
from pathlib import Path

from selfspec.benchmarks.load import level_sizes
from selfspec.benchmarks.repetition import set_ratio_vs_ar


def ngram_verifies_greedily(device: str) -> bool:
    """Whether SGLang's builtin NGRAM commits argmax tokens even at temperature > 0 on `device`.

    SGLang 0.5.23: the NGRAM worker verifies with `eagle_sample` (speculative/ngram_worker.py:27,
    :479), which takes the greedy tree walk on argmax targets when `_verify_uses_greedy(...)` holds
    (speculative/eagle_utils.py:641-660), and that is `is_all_greedy or is_cpu or is_xpu or (is_hip and
    not use_rejection_sampling)` (eagle_utils.py:500): on the CPU engine (SGLANG_USE_CPU_ENGINE=1,
    what `ServerProcess` starts without CUDA) every request is verified by argmax. On ROCm too
    (NGRAM has no draft distribution for rejection sampling)."""
    if device == "cpu":
        return True
    try:
        import torch

        return getattr(torch.version, "hip", None) is not None
    except ImportError:
        return False


NGRAM_GREEDY_NOTE = ("NGRAM verifies greedily on this build: its sampled rows are argmax outputs (every token "
                     "after the first is the target's argmax, whatever the temperature)")


REPEAT_NOTE = ("this server saw these prompts at an earlier level: the levels' windows wrap around the prompt "
               "set, and its n-gram corpus keeps every earlier output, so it drafts what it already wrote (keep "
               "the levels' requests, each max(--num-prompts, C), within the set's prompts)")


def finish_report(report: dict) -> None:
    """Fill what needs every mode: the ratios to AR at each concurrency (all requests and the
    non-looping ones), and the notes on rows whose baseline cannot honour the run's settings."""
    from selfspec.decoding import registry

    ar = next((r for r in report["results"] if r["mode"] == "ar" and r["status"] == "ok"), None)
    ar_by_c = {lv["concurrency"]: lv for lv in (ar["levels"] if ar else [])}
    greedy_ngram = report["temperature"] > 0 and ngram_verifies_greedily(report["device"])
    sent = sum(level_sizes(report.get("concurrency", []), report.get("num_prompts", 0)))
    repeats = sent > report.get("prompts_available", math.inf)  # the levels' windows wrap around the set
    report["prompts_reused"] = repeats
    for r in report["results"]:
        notes = r.setdefault("notes", [])
        if r["status"] == "ok" and registry.get(r["mode"]).builtin_sglang_algorithm == "NGRAM":
            notes += [NGRAM_GREEDY_NOTE] if greedy_ngram else []
        if r["status"] == "ok" and r["mode"] != "ar" and repeats:
            notes.append(REPEAT_NOTE)
        for lv in r.get("levels", []):
            base = ar_by_c.get(lv["concurrency"])
            lv["ratio_vs_ar"] = lv["output_tok_s"] / base["output_tok_s"] if base and base["output_tok_s"] else None
            set_ratio_vs_ar(lv.get("non_loop"), (base or {}).get("non_loop"))


def step_kind_shares(kinds: list[dict[str, int] | None]) -> dict[str, float] | None:
    """The share of a level's decode tokens each kind of step committed (None without the counts)."""
    counted = [k for k in kinds if k is not None]
    if not counted:
        return None
    total: dict[str, int] = {}
    for k in counted:
        for name, n in k.items():
            total[name] = total.get(name, 0) + n
    s = sum(total.values())
    return {name: round(n / s, 3) for name, n in sorted(total.items())} if s > 0 else None


def format_table(report: dict) -> str:
    def num(value, fmt: str) -> str:
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    head = ["mode", "C", "tok/s", "xAR", "TPOT p50", "TPOT p99", "TPF", "genai tok/s", "loops", "req tok/s",
            "NL req tok/s", "NL xAR", "NL TPF"]
    rows, tails = [head], [""]
    for r in report["results"]:
        if r["status"] != "ok":
            rows.append([r.get("label", r["mode"]), "", r["status"]] + [""] * (len(head) - 3))
            tails.append(f": {str(r['reason']).splitlines()[0] if r['reason'] else ''}")
            continue
        for lv in r["levels"]:
            nl = lv.get("non_loop") or {}
            loops = lv.get("repetition_loops")
            rows.append([
                r.get("label", r["mode"]), str(lv["concurrency"]), num(lv["output_tok_s"], ".1f"), num(lv.get("ratio_vs_ar"), ".2f"),
                num(lv["tpot_ms_p50"], ".1f"), num(lv["tpot_ms_p99"], ".1f"), num(lv.get("tpf"), ".2f"),
                num((lv.get("genai_bench") or {}).get("output_tok_s"), ".1f"),
                "-" if loops is None else f"{loops}/{lv['requests']}", num(lv.get("per_request_tok_s"), ".1f"),
                num(nl.get("tokens_per_s"), ".1f"), num(nl.get("ratio_vs_ar"), ".2f"), num(nl.get("tpf"), ".2f"),
            ])
            tails.append("".join(f"  [{n.split(':')[0]}]" for n in r.get("notes") or []))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [" ".join(row[0].ljust(widths[0]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))
             .rstrip() + tail for row, tail in zip(rows, tails)]
    lines.append("NL: requests whose output does not end in a repetition loop (per mode); req tok/s: tokens over "
                 "the sum of the requests' latencies; NL xAR: NL req tok/s over AR's at the same C")
    for r in report["results"]:
        for note in r.get("notes") or []:
            lines.append(f"note ({r['mode']}): {note}")
    return "\n".join(lines)


def plot(report: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in report["results"]:
        if r["status"] != "ok" or not r["levels"]:
            continue
        xs = [lv["tpot_ms_p50"] for lv in r["levels"]]
        ys = [lv["output_tok_s"] for lv in r["levels"]]
        ax.plot(xs, ys, marker="o", label=r.get("label", r["mode"]))
        for lv, x, y in zip(r["levels"], xs, ys):
            ax.annotate(f"C={lv['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("TPOT p50 (ms per output token, lower is better)")
    ax.set_ylabel("output tokens/s (higher is better)")
    ax.set_title(f"selfspec modes served by SGLang: {Path(report['model']).name} ({report['device']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
