"""The tuner's predicted tok/s beside a served measurement (`bench serve --predictions TUNE.json`).

`selfspec tune --json` records, per tuned mode, the plan it wrote and every candidate's predicted
output tok/s at each batch size of its grid, for greedy and sampled batches. A served row whose
`--selfspec-config` is that plan gets, at each concurrency level, the prediction for the bucket
the plan runs at the level's batch (min(C, requests), where it is on the tuner's grid); the AR
row gets the AR candidate's. The prediction is a steady batch decoding; the measurement also
holds prefill and a batch that thins as requests finish, so the two agree best at small C, and
`step_error` compares the step times alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from selfspec.decoding.width_plan import WidthPlan
from selfspec.tuning.acceptance import Candidate


def load(path: str | Path) -> dict[str, Any]:
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--predictions {path}: cannot read a `selfspec tune --json` report ({e})") from None
    if report.get("schema") != "selfspec.tune/v1":
        raise SystemExit(f"--predictions {path}: not a `selfspec tune --json` report (schema "
                         f"{report.get('schema')!r})")
    return report


def _config_of(server_args: list[str]) -> str | None:
    for flag, value in zip(server_args, server_args[1:]):
        if flag == "--selfspec-config":
            return value
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _candidate_at(tuned: dict[str, Any], mode: str | None, sampled: bool, batch: int) -> dict[str, Any] | None:
    """The candidate the tuned plan runs at `batch` (mode None: the AR candidate); None where the
    plan names one the tuner did not measure (a hand-edited bucket: no prediction for it)."""
    if mode is None:
        return next((c for c in tuned["candidates"] if c["mode"] == "ar"), None)
    plan = WidthPlan.from_dict(tuned["plan"], mode)
    bucket = (plan.sampled if sampled else plan.greedy)[plan.bucket(batch, sampled)]
    return next((c for c in tuned["candidates"] if c["mode"] == bucket.mode and c["options"] == dict(bucket.options)),
                None)


def served_tokens_per_step(level: dict[str, Any]) -> float | None:
    """Tokens a request committed per decode forward at this level (the prefill's token and
    forward left out), from its tokens, requests and TPF."""
    tpf, tokens, n = level.get("tpf"), level.get("tokens"), level.get("requests")
    if not tpf or not tokens or not n:
        return None
    steps = tokens / tpf - n
    return (tokens - n) / steps if steps > 0 else None


def attach(report: dict[str, Any], tune: dict[str, Any]) -> None:
    """Set on the levels of the AR row and of every row served with one of `tune`'s plans, the
    batch being min(C, requests) (a level of 16 requests never batches 32):

    - `predicted_tok_s` and `prediction_error` = predicted / measured output tok/s − 1;
    - `step_error` = measured / predicted step time − 1, the cost model's error alone: the measured
      step is TPOT p50 × the tokens per step the server committed, the predicted one the batch ×
      the tuner's tokens per step over its predicted tok/s. The rest of `prediction_error` is the
      level's acceptance (its prompts are not the tuner's) and a batch that fills and thins.

    Both are positive where the tuner was optimistic."""
    sampled = report["temperature"] > 0
    kind = "sampled" if sampled else "greedy"
    modes = tune.get("modes") or {}
    for row in report["results"]:
        if row.get("status") != "ok":
            continue
        if row["mode"] == "ar":  # every tuned mode's AR candidate is the same AR step
            tuned, mode = next(iter(modes.values()), None), None
        else:
            tuned, mode = modes.get(row["mode"]), row["mode"]
            config = _config_of(row.get("server_args") or [])
            if tuned is None or config is None or not _same_file(config, tuned["config"]):
                continue
        if tuned is None:
            continue
        for lv in row["levels"]:
            batch = min(lv["concurrency"], lv.get("requests") or lv["concurrency"])
            cand = _candidate_at(tuned, mode, sampled, batch) or {"mode": None, "options": {}, "tokens_per_step": {}}
            pred = (tuned["predicted"].get(kind) or {}).get(str(batch), {}).get(
                Candidate(cand["mode"], cand["options"]).label)
            measured = lv["output_tok_s"]
            lv["predicted_tok_s"] = pred
            lv["prediction_error"] = pred / measured - 1 if pred and measured else None
            offline = cand["tokens_per_step"].get(kind)
            served = served_tokens_per_step(lv) if mode else 1.0
            tpot = lv.get("tpot_ms_p50")
            lv["step_error"] = (tpot * served / (1e3 * batch * offline / pred) - 1
                                if pred and offline and served and tpot else None)
