"""The tuner's predicted tok/s beside a served measurement (`bench serve --predictions TUNE.json`).

`selfspec tune --json` records, per tuned mode, the plan it wrote, every candidate's predicted
output tok/s at each batch size of its grid (a steady batch), for greedy and sampled batches, and
each candidate's per-prompt acceptance. A served row whose `--selfspec-config` is that plan gets,
at each concurrency level, the level replayed (`tuning/level.py`: its requests, C in flight,
each advancing by its own acceptance, the batch thinning as they finish, each step running the
plan's bucket for its batch); the AR row gets AR steps replayed alike. A tune without per-prompt
records predicts the steady batch of the bucket the plan runs at min(C, requests) instead (also
kept as `predicted_steady_tok_s`). The replay adds each request's prefill and handling where the
tune measured it (`StepOverhead.request_ms`), and `step_error` compares the step times alone.

Absolute tok/s also move with the machine: this shared VM served plain AR at C=1 anywhere from
95 to 148 tok/s within one session, so a tune made an hour before a bench predicts every row,
AR's included, off by as much. What a plan is for is the speed-up over AR steps on the same
machine at the same time, so `speedup_error` compares the predicted speed-up over AR with the
one measured against the AR row of the same run; the machine's drift cancels in both ratios.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from selfspec.decoding.width_plan import WidthPlan
from selfspec.tuning.acceptance import Candidate


PREDICTION_KEYS = ("predicted_tok_s", "predicted_steady_tok_s", "predicted_ar_tok_s", "prediction_error", "step_error",
                   "predicted_speedup", "speedup_error")


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


def _serves(row: dict[str, Any], tuned: dict[str, Any], mode: str) -> bool:
    """Whether `row` was served with `tuned`'s plan: the plan the bench recorded from the row's
    `--selfspec-config` at serve time equals it (a tuned file is rewritten by the next tune), or,
    in reports from before the bench recorded plans, the row's config is the tune's file."""
    if "selfspec_plan" in row:
        try:
            return (row["selfspec_plan"] is not None and WidthPlan.from_dict(row["selfspec_plan"], mode).to_dict()
                    == WidthPlan.from_dict(tuned["plan"], mode).to_dict())
        except ValueError:
            return False
    config = _config_of(row.get("server_args") or [])
    return config is not None and _same_file(config, tuned["config"])


def served_plan(server_args: list[str]) -> Any:
    """The width plan in the row's `--selfspec-config` file (None: no config or no plan in it),
    read when the row is served."""
    from selfspec.sglang_ext.config import SelfSpecConfigError, load_yaml_config

    config = _config_of(server_args)
    if config is None:
        return None
    try:
        return load_yaml_config(config).get("plan")
    except SelfSpecConfigError:  # the server's start-up reports a bad config; the bench only records
        return None


def _candidate_at(tuned: dict[str, Any], mode: str | None, sampled: bool, batch: int) -> dict[str, Any] | None:
    """The candidate the tuned plan runs at `batch` (mode None: the AR candidate); None where the
    plan names one the tuner did not measure (a hand-edited bucket: no prediction for it)."""
    if mode is None:
        return next((c for c in tuned["candidates"] if c["mode"] == "ar"), None)
    plan = WidthPlan.from_dict(tuned["plan"], mode)
    bucket = (plan.sampled if sampled else plan.greedy)[plan.bucket(batch, sampled)]
    return next((c for c in tuned["candidates"] if c["mode"] == bucket.mode and c["options"] == dict(bucket.options)),
                None)


def _replayed(tune: dict[str, Any], tuned: dict[str, Any], mode: str | None, sampled: bool, level: dict[str, Any],
              tokens: int, stock: bool = False) -> float | None:
    """The level's tok/s replayed from the tune's per-prompt acceptance (`level.replay_level`);
    None where the tune kept none or the plan names a candidate it did not measure. `stock` (AR
    steps, mode None): priced as the stock AR server's steps where the tune timed them."""
    from selfspec.tuning.cost import CostTable, StepOverhead
    from selfspec.tuning.level import replay_level

    kind = "sampled" if sampled else "greedy"
    if not all(c.get("per_request", {}).get(kind) for c in tuned["candidates"]
               if math.isfinite(c.get("tokens_per_step", {}).get(kind, math.nan))):
        return None
    picks: dict[int, Candidate] = {}  # one object per batch: the replay caches rates by candidate

    def pick(batch: int) -> Candidate:
        if batch not in picks:
            found = _candidate_at(tuned, mode, sampled, batch)
            if found is None:
                raise LookupError(batch)
            picks[batch] = Candidate.from_dict(found)
        return picks[batch]

    overhead = (tuned.get("step_overhead") or {}).get(kind)
    if stock and mode is None:
        overhead = ((tune.get("stock_ar") or {}).get("step_overhead") or {}).get(kind) or overhead
    try:
        return replay_level(CostTable(**tune["costs"]), pick, kind, level["concurrency"],
                            level.get("requests") or level["concurrency"], tokens,
                            StepOverhead.from_dict(overhead) if overhead else None).tok_s
    except (LookupError, ValueError):
        return None


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

    - `predicted_speedup` = the prediction over AR's at the same level (`predicted_ar_tok_s`: the
      stock AR server's steps replayed where the tune timed them, else AR steps by the row's own
      mode's calibration, where the level is replayed; else the AR row's prediction), and `speedup_error` = that over the measured `ratio_vs_ar` − 1 (rows other
      than AR, where the report has the ratio).

    All three are positive where the tuner was optimistic."""
    sampled = report["temperature"] > 0
    kind = "sampled" if sampled else "greedy"
    modes = tune.get("modes") or {}
    for row in report["results"]:
        for lv in row.get("levels", []):  # predictions attached before, from another tune
            for key in PREDICTION_KEYS:
                lv.pop(key, None)
        if row.get("status") != "ok":
            continue
        if row["mode"] == "ar":  # every tuned mode's AR candidate is the same AR step
            tuned, mode = next(iter(modes.values()), None), None
        else:
            tuned, mode = modes.get(row["mode"]), row["mode"]
            if tuned is None or not _serves(row, tuned, mode):
                continue
        if tuned is None:
            continue
        for lv in row["levels"]:
            batch = min(lv["concurrency"], lv.get("requests") or lv["concurrency"])
            cand = _candidate_at(tuned, mode, sampled, batch) or {"mode": None, "options": {}, "tokens_per_step": {}}
            steady = (tuned["predicted"].get(kind) or {}).get(str(batch), {}).get(
                Candidate(cand["mode"], cand["options"]).label)
            replayed = (_replayed(tune, tuned, mode, sampled, lv, report["max_tokens"], stock=True)
                        if report.get("max_tokens") else None)
            pred = replayed if replayed is not None else steady
            measured = lv["output_tok_s"]
            if mode is not None and replayed is not None:
                # the AR row is the stock AR server: its steps as the tune timed them, where it did
                # (`calibrate.stock_ar_overhead`); in older tunes, priced by this mode's own
                # calibration, as the plan's are (another mode's calibration carried its noise: an
                # AR step timed 10.6 ms at batch 1 where the next mode's read 7.7 and 6.5 put
                # +40-100% on every other mode's C=1 speed-up)
                lv["predicted_ar_tok_s"] = _replayed(tune, tuned, None, sampled, lv, report["max_tokens"], stock=True)
            lv["predicted_tok_s"] = pred
            lv["predicted_steady_tok_s"] = steady
            lv["prediction_error"] = pred / measured - 1 if pred and measured else None
            offline = cand["tokens_per_step"].get(kind)
            served = served_tokens_per_step(lv) if mode else 1.0
            tpot = lv.get("tpot_ms_p50")
            lv["step_error"] = (tpot * served / (1e3 * batch * offline / steady) - 1
                                if steady and offline and served and tpot else None)
    _attach_speedups(report)


def _attach_speedups(report: dict[str, Any]) -> None:
    ar = next((r for r in report["results"] if r["mode"] == "ar" and r.get("status") == "ok"), None)
    ar_pred = {lv["concurrency"]: lv.get("predicted_tok_s") for lv in (ar["levels"] if ar else [])}
    for row in report["results"]:
        if row is ar or row.get("status") != "ok":
            continue
        for lv in row["levels"]:
            if "predicted_tok_s" not in lv:
                continue
            base = lv.get("predicted_ar_tok_s") or ar_pred.get(lv["concurrency"])
            pred, measured = lv["predicted_tok_s"], lv.get("ratio_vs_ar")
            lv["predicted_speedup"] = pred / base if pred and base else None
            lv["speedup_error"] = (lv["predicted_speedup"] / measured - 1
                                   if lv["predicted_speedup"] and measured else None)
