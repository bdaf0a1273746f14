"""What a served step costs beyond the model forward, measured on a server of the mode.

The cost grid times the HF engine's forward; a served step also schedules, builds the step,
runs SGLang's extend path for a wide step, applies the verify rules to every query row and
streams. To learn that part, servers of the mode run calibration plans whose buckets alternate
by batch size: the "verify batches" (1, then one more than a middle size and the largest) and
the "AR batches" (2, the middle size, the largest), one plan for greedy batches, one for sampled
ones, the online check off. `batch` concurrent identical requests (EOS ignored; sampled ones
share a seed, so every row commits the same tokens and the batch stays whole) of a short and a
long length are timed; (long − short) wall time over (long − short) forwards is one step at
that batch, free of prefill and HTTP set-up. What the step costs beyond the grid's forward is
split as `cost.StepOverhead` prices it: the AR step's excess by batch, and a wider step's excess
over that.

- An AR-only server times AR steps at 1 and the AR batches (a plan maps a batch size to one
  bucket; extrapolated from batch 2, batch 1's AR step was priced 9.9 ms where it served 8.1,
  which made every predicted speed-up at C=1 too high: README "Predicted speed-ups and the
  narrower of near-ties"), and what a request costs besides its decode steps (prefill, HTTP,
  detokenizing: a request for one token, `cost.StepOverhead.request_ms`).
- A lookup server times a lookup step (`lookup_candidate`) at the verify batches and a short one
  (`short_lookup`, the 4-token one) at the AR batches: a lookup step is priced by its own excess,
  not by the mode's own step's (RISD's carries its adapter), by its batch and width
  (`cost.StepOverhead.lookup_by_width`), which a capped or adaptive lookup's ragged forward,
  carrying fewer tokens than any padded width, needs (the served forward's cost grows more
  slowly with query tokens than the HF grid's).
- The calibration server times the mode's own median-width candidate (`middle_width`) at the
  verify batches and its narrowest (`narrow_own`) at the AR batches: two widths, priced alike
  (`cost.StepOverhead.verify_by_width`).

`stock_ar_overhead` times SGLang's own AR server at batch 1 and the AR batches: what the bench
compares a plan with.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from selfspec.decoding.width_plan import PLAN_STEP_MODES
from selfspec.tuning.acceptance import Candidate
from selfspec.tuning.cost import CostTable, StepOverhead

SHORT, LONG = 16, 144
SEED = 1234  # sampled calibration requests share it: identical rows, one batch throughout
SMALL_BATCH_REPEATS = 3  # small-batch steps are a few ms: the median of a few timings
REQUEST_REPEATS = 5


def calibration_batches(batch_sizes: list[int]) -> tuple[list[int], list[int]]:
    """(batches where AR steps are timed, batches where verify steps are): verify at 1 and AR at 2
    (batch 1 is where a wide step's fixed costs weigh most), then AR at a middle size and at the
    largest, each with verify at one more."""
    ar, verify = [2], [1]
    for a in sorted({batch_sizes[len(batch_sizes) // 2], batch_sizes[-1]}):
        if a > max(ar[-1], verify[-1]):
            ar.append(a)
            verify.append(a + 1)
    return ar, verify


def ar_only_plan() -> dict:
    """The second calibration server's plan: AR steps at every batch, greedy and sampled."""
    ar = [{"max_batch": None, "mode": "ar"}]
    return {"greedy": ar, "sampled": list(ar), "online": False}


def calibration_plan(ar_batches: list[int], verify_batches: list[int], greedy: Candidate | None,
                     sampled: Candidate | None, between: dict[str, Candidate | None] | None = None) -> dict:
    """Plan buckets: AR steps at `ar_batches` (or the kind's `between` candidate there), the
    candidate at `verify_batches` (None: AR there too); batches in between fall in the next
    bucket and are never timed."""
    def step(cand: Candidate | None) -> dict:
        return {"mode": "ar"} if cand is None else {"mode": cand.mode, **cand.options}

    def kind(cand: Candidate | None, other: Candidate | None) -> list[dict]:
        steps = {**{b: step(other) for b in ar_batches}, **{b: step(cand) for b in verify_batches}}
        out = [{"max_batch": b, **steps[b]} for b in sorted(steps)]
        out[-1]["max_batch"] = None
        return out

    between = between or {}
    return {"greedy": kind(greedy, between.get("greedy")), "sampled": kind(sampled, between.get("sampled")),
            "online": False}


def _generate(base_url: str, prompt: list[int], tokens: int, temperature: float) -> int:
    """Forwards the request took (prefill included)."""
    params = {"temperature": temperature, "max_new_tokens": tokens, "ignore_eos": True}
    if temperature > 0:
        params["sampling_seed"] = SEED
    body = {"input_ids": prompt, "sampling_params": params}
    req = urllib.request.Request(base_url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        meta = json.loads(r.read())["meta_info"]
    return int(meta.get("selfspec_forwards") or meta["completion_tokens"])


def _run(base_url: str, prompt: list[int], batch: int, tokens: int, temperature: float) -> tuple[float, int]:
    """Wall seconds of `batch` concurrent requests, and the most forwards one of them took."""
    with ThreadPoolExecutor(batch) as ex:
        t0 = time.perf_counter()
        forwards = list(ex.map(lambda _: _generate(base_url, prompt, tokens, temperature), range(batch)))
        return time.perf_counter() - t0, max(forwards)


def step_ms(base_url: str, prompt: list[int], batch: int, temperature: float) -> float:
    """One decode step of `batch` requests, from a long and a short run's difference."""
    def once() -> float:
        wall_s, fw_s = _run(base_url, prompt, batch, SHORT, temperature)
        wall_l, fw_l = _run(base_url, prompt, batch, LONG, temperature)
        return 1e3 * max(wall_l - wall_s, 0.0) / max(fw_l - fw_s, 1)

    return statistics.median(once() for _ in range(SMALL_BATCH_REPEATS if batch <= 2 else 1))


_rotations = itertools.count(1)


def request_ms(base_url: str, prompt: list[int], temperature: float) -> float:
    """What a request costs besides its decode steps: one that asks for a single token (its
    prefill, HTTP, detokenizing), median of `REQUEST_REPEATS`. Each sends the prompt rotated
    anew, so the radix cache holds none of it, as none of a bench request's (a run's wall time
    less its steps was the first estimate: 0-49 ms for the same server, the steps' noise times 15)."""
    def once() -> float:
        k = next(_rotations) % len(prompt)
        t0 = time.perf_counter()
        _generate(base_url, prompt[k:] + prompt[:k], 1, temperature)
        return 1e3 * (time.perf_counter() - t0)

    return statistics.median(once() for _ in range(REQUEST_REPEATS))


def fit_overhead(costs: CostTable, ar_steps: dict[int, float], verify_steps: dict[int, float],
                 width: int, lookup_steps: dict[int, float] | None = None, lookup_width: int = 1,
                 short_steps: dict[int, float] | None = None, short_width: int = 1,
                 narrow_steps: dict[int, float] | None = None, narrow_width: int = 1) -> StepOverhead:
    """`ar_steps`: batch -> measured AR step ms; `verify_steps`: batch -> measured step ms of a
    `width`-token verify candidate, `narrow_steps` of a narrower `narrow_width`-token one of the
    mode's own (then its steps are priced by batch and width, `StepOverhead.verify_by_width`);
    `lookup_steps` the same of a `lookup_width`-token lookup step, `short_steps` of a narrower
    `short_width`-token one (`StepOverhead.lookup_by_width`). Excesses are clamped at 0 (a step
    never costs less than its forward)."""
    ar = {b: max(ms - costs.time_ms(b, 1), 0.0) for b, ms in sorted(ar_steps.items())}
    ov = StepOverhead(ar_ms=ar)

    def by_batch(steps: dict[int, float], w: int) -> dict[int, float]:
        return {b: max(ms - costs.time_ms(b, w) - ov.ms(b), 0.0) for b, ms in sorted(steps.items())}

    def excess(steps: dict[int, float], w: int) -> dict[int, float]:  # keyed by query tokens
        return {b * w: x for b, x in by_batch(steps, w).items()}

    measured = {"ar": dict(ar_steps)}
    if verify_steps:
        measured[f"verify@{width}"] = dict(verify_steps)
    if lookup_steps:
        measured[f"lookup@{lookup_width}"] = dict(lookup_steps)
    def two_widths(what: str, steps: dict[int, float] | None, w: int, second: dict[int, float] | None,
                   w2: int) -> dict[int, dict[int, float]]:
        """Width -> batch -> excess where a step was timed at a second width (else none)."""
        if not (steps and second and w2 != w):
            return {}
        measured[f"{what}@{w2}"] = dict(second)
        return {w: by_batch(steps, w), w2: by_batch(second, w2)}

    return StepOverhead(ar_ms=ar, verify_ms=excess(verify_steps, width),
                        lookup_ms=excess(lookup_steps or {}, lookup_width), measured=measured,
                        lookup_by_width=two_widths("lookup", lookup_steps, lookup_width, short_steps, short_width),
                        verify_by_width=two_widths("verify", verify_steps, width, narrow_steps, narrow_width))


def _by_width(cands: list[Candidate], kind: str, wanted) -> list[Candidate]:
    """The `wanted` candidates that serve `kind`, narrowest first."""
    return sorted((c for c in cands if wanted(c) and math.isfinite(c.tokens_per_step.get(kind, math.nan))),
                  key=lambda c: c.width)


def _own(c: Candidate) -> bool:
    return c.mode not in PLAN_STEP_MODES


def _one_uncapped_lookup(c: Candidate) -> bool:
    return c.is_lookup and c.options.get("branches", 1) == 1 and not c.options.get("caps")


def _median_width(cands: list[Candidate], kind: str, wanted) -> Candidate | None:
    usable = _by_width(cands, kind, wanted)
    return usable[len(usable) // 2] if usable else None


def middle_width(cands: list[Candidate], kind: str) -> Candidate | None:
    """The calibration's verify candidate: the median width of the mode's own candidates that
    serve `kind` (its steps' cost beyond the forward, not a lookup step's)."""
    return _median_width(cands, kind, _own)


def narrow_own(cands: list[Candidate], kind: str, middle: Candidate | None) -> Candidate | None:
    """The calibration's second verify candidate, timed at its AR batches: the narrowest of the
    mode's own candidates that serve `kind`, where narrower than `middle` (a second width: what
    the mode's step costs with its query tokens on the served path)."""
    narrow = next(iter(_by_width(cands, kind, _own)), None)
    return narrow if narrow is not None and middle is not None and narrow.width < middle.width else None


def short_lookup(cands: list[Candidate], kind: str) -> Candidate | None:
    """The lookup step the calibration times at its AR batches: the narrowest one-candidate
    uncapped lookup that serves `kind` (with `lookup_candidate`'s, a second width: what a lookup
    step's cost does with its query tokens on the served path)."""
    return next(iter(_by_width(cands, kind, _one_uncapped_lookup)), None)


def lookup_candidate(cands: list[Candidate], kind: str) -> Candidate | None:
    """The lookup step the calibration times: the median width of the one-candidate lookups
    that serve `kind`, uncapped (its excess is fitted at its padded width: every request drafts
    it in full)."""
    return _median_width(cands, kind, _one_uncapped_lookup)


def _work_dir(log_dir: str | None) -> Path:
    """Where the calibration servers' plans and logs go."""
    work = Path(log_dir or tempfile.mkdtemp(prefix="selfspec-tune-"))
    work.mkdir(parents=True, exist_ok=True)
    return work


def _server(model: str, work: Path, name: str, max_batch: int, args: list[str]):
    from selfspec.serving import ServerProcess, ServerSpec

    return ServerProcess(ServerSpec(model, port=None, extra_args=[*args, "--max-running-requests", str(max_batch)]),
                         log_path=work / f"{name}.log", startup_timeout=900)


def stock_ar_model(model: str) -> str:
    """What the bench's AR row serves for `model`: an adapter-only checkpoint (a RISD gated LoRA)
    is served as RISD by its name, so its AR row serves the base (`benchmarks.serve`)."""
    from selfspec.models import resolve_with_adapter

    return str(resolve_with_adapter(model)[0])


def stock_ar_overhead(model: str, costs: CostTable, prompt: list[int], batch_sizes: list[int], temperature: float,
                      threads: int = 1, log_dir: str | None = None, progress=None) -> dict[str, StepOverhead]:
    """SGLang's own AR server (no speculative algorithm: the bench's AR row) timed at batch 1 and
    the calibration's AR batches, greedy and sampled: what a plan's replayed level is compared
    with. The plan itself chooses against the mode worker's AR steps (what it would run instead),
    but those run on the worker's verify path, 1.1-1.5x stock AR's decode path at wide batches
    here, so a speed-up over them read 20-40% below the bench's ratio over stock AR (README "AR
    steps on the verify path")."""
    from selfspec.serving import server_threads

    batches = [1, *calibration_batches(batch_sizes)[0]]
    work = _work_dir(log_dir)
    out: dict[str, StepOverhead] = {}
    with server_threads(threads), _server(stock_ar_model(model), work, "calibration-stock-ar", batches[-1], []) as server:
        _run(server.base_url, prompt, 1, SHORT, 0.0)  # warm-up
        for kind, temp in (("greedy", 0.0), ("sampled", temperature)):
            steps = {b: step_ms(server.base_url, prompt, b, temp) for b in batches}
            out[kind] = fit_overhead(costs, steps, {}, 1)
            out[kind].request_ms = request_ms(server.base_url, prompt, temp)
            if progress is not None:
                progress.update(len(batches))
    return out


def server_overhead(model: str, mode: str, costs: CostTable, cands: list[Candidate], prompt: list[int],
                    batch_sizes: list[int], temperature: float, threads: int = 1, log_dir: str | None = None,
                    progress=None) -> dict[str, StepOverhead]:
    """Serve `model` under `mode` with an AR-only plan (AR steps at batch 1), then with the
    calibration plan; the overhead per sampling kind."""
    import yaml

    from selfspec.serving import server_threads

    ar_batches, verify_batches = calibration_batches(batch_sizes)
    chosen = {"greedy": middle_width(cands, "greedy"), "sampled": middle_width(cands, "sampled")}
    # a greedy-only mode's server refuses sampled requests: its sampled batches are AR steps
    served_kinds = {"greedy"} | ({"sampled"} if chosen["sampled"] is not None else set())
    lookups = {kind: lookup_candidate(cands, kind) if kind in served_kinds else None for kind in ("greedy", "sampled")}
    shorts = {kind: short_lookup(cands, kind) if lookups[kind] is not None else None for kind in lookups}
    shorts = {kind: c if c is not None and c.width < lookups[kind].width else None for kind, c in shorts.items()}
    work = _work_dir(log_dir)
    kinds = (("greedy", 0.0), ("sampled", temperature))

    def serve(name: str, plan: dict, max_batch: int):
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"mode": mode.upper(), "plan": plan}))
        return _server(model, work, name, max_batch, ["--speculative-algorithm", mode.upper(),
                                                      "--selfspec-config", str(path)])

    narrows = {kind: narrow_own(cands, kind, chosen[kind]) for kind in chosen}
    ar_steps: dict[str, dict[int, float]] = {}  # kind -> batch -> AR step ms
    request_costs: dict[str, float] = {}  # kind -> a request's time besides its decode steps
    lookup_steps: dict[str, dict[int, float]] = {"greedy": {}, "sampled": {}}  # kind -> batch -> step ms
    short_steps: dict[str, dict[int, float]] = {"greedy": {}, "sampled": {}}  # the short lookup's
    with server_threads(threads):
        with serve("calibration-ar", ar_only_plan(), max(ar_batches)) as server:
            _run(server.base_url, prompt, 1, SHORT, 0.0)  # warm-up
            for kind, temp in kinds:
                if kind in served_kinds:  # a greedy-only mode's sampled rows: greedy's
                    ar_steps[kind] = {b: step_ms(server.base_url, prompt, b, temp) for b in [1, *ar_batches]}
                    request_costs[kind] = request_ms(server.base_url, prompt, temp)
                if progress is not None:
                    progress.update(1 + len(ar_batches))
        if any(lookups.values()):
            # the lookup at the verify batches, the short one at the AR batches
            plan = calibration_plan(ar_batches, verify_batches, lookups["greedy"], lookups["sampled"], between=shorts)
            with serve("calibration-lookup", plan, max(ar_batches + verify_batches)) as server:
                _run(server.base_url, prompt, 1, SHORT, 0.0)  # warm-up
                for kind, temp in kinds:
                    if lookups[kind] is not None:
                        lookup_steps[kind] = {b: step_ms(server.base_url, prompt, b, temp) for b in verify_batches}
                    if shorts[kind] is not None:
                        short_steps[kind] = {b: step_ms(server.base_url, prompt, b, temp) for b in ar_batches}
        out: dict[str, StepOverhead] = {}
        # the mode's own candidate at the verify batches, its narrowest at the AR batches
        plan = calibration_plan(ar_batches, verify_batches, chosen["greedy"], chosen["sampled"], between=narrows)
        with serve("calibration", plan, max(ar_batches + verify_batches)) as server:
            _run(server.base_url, prompt, 1, SHORT, 0.0)  # warm-up
            for kind, temp in kinds:
                cand, narrow = chosen[kind], narrows[kind]
                if cand is None and kind == "sampled":  # a greedy-only mode: its sampled batches run AR steps
                    out[kind] = StepOverhead(ar_ms=dict(out["greedy"].ar_ms), request_ms=out["greedy"].request_ms)
                    continue
                verify = {v: step_ms(server.base_url, prompt, v, temp) for v in verify_batches} if cand else {}
                narrow_steps = {a: step_ms(server.base_url, prompt, a, temp) for a in ar_batches} if narrow else {}
                look, short = lookups[kind], shorts[kind]
                out[kind] = fit_overhead(costs, ar_steps[kind], verify, cand.width if cand is not None else 1,
                                         lookup_steps[kind], look.width if look is not None else 1,
                                         short_steps[kind], short.width if short is not None else 1,
                                         narrow_steps, narrow.width if narrow is not None else 1)
                out[kind].request_ms = request_costs[kind]
    return out


def refit(costs: CostTable, measured: dict[str, dict[int, float]], request_cost: float = 0.0) -> StepOverhead:
    """The overhead `fit_overhead` fits from the served steps a `StepOverhead.measured` holds ("ar",
    "verify@W" at one or two widths, "lookup@W" at one or two: the wider is the candidate timed at
    the verify batches, the narrower the one at the AR batches)."""
    def wide_and_narrow(what: str) -> tuple[tuple[dict[int, float] | None, int], tuple[dict[int, float] | None, int]]:
        ws = sorted(int(k.split("@", 1)[1]) for k in measured if k.startswith(what + "@"))
        at = lambda w: (measured[f"{what}@{w}"], w)  # noqa: E731
        return (at(ws[-1]) if ws else (None, 1)), (at(ws[0]) if len(ws) > 1 else (None, 1))

    (v, vw), (n, nw) = wide_and_narrow("verify")
    (look, lw), (short, sw) = wide_and_narrow("lookup")
    out = fit_overhead(costs, measured["ar"], v or {}, vw, look, lw, short, sw, n, nw)
    out.request_ms = request_cost
    return out


#: the steps every worker of one model runs alike, whatever its mode: plain AR steps and lookup
#: steps (a plan's `mode: ngram` bucket). Adapter modes (RISD) apart: their steps carry the adapter.
SHARED_STEPS = ("ar", "lookup@")


def pool_shared_steps(costs: CostTable, overheads: dict[str, dict[str, StepOverhead]],
                      group_of: Callable[[str], Hashable]) -> dict[str, dict[str, StepOverhead]]:
    """Each mode's overhead refitted with the AR and lookup steps (and request cost) of every mode
    of its group (`group_of(mode)`, same model and adapter) pooled: per batch, the median over the
    modes' servers. Each server times each of these points once, and one slow point decided a plan
    (SJD's lookup step at batch 1 read 9.3 ms where ISD's and JACOBI's read 8.0 and 7.7, and its
    sampled batch 1 ran AR steps, served 0.90x the lookups: README "Shared steps pooled").
    Idempotent: pooled overheads pool to themselves."""
    out = {m: dict(kinds) for m, kinds in overheads.items()}
    for kind in {k for kinds in overheads.values() for k in kinds}:
        groups: dict[Hashable, list[str]] = {}
        for m, kinds in overheads.items():
            if kind in kinds and kinds[kind].measured.get("ar"):
                groups.setdefault(group_of(m), []).append(m)
        for members in groups.values():
            if len(members) < 2:
                continue
            pooled: dict[str, dict[int, float]] = {}
            keys = {k for m in members for k in overheads[m][kind].measured if k.startswith(SHARED_STEPS)}
            for key in keys:
                runs = [overheads[m][kind].measured[key] for m in members if key in overheads[m][kind].measured]
                batches = {b for run in runs for b in run}
                pooled[key] = {b: statistics.median(run[b] for run in runs if b in run) for b in sorted(batches)}
            request = statistics.median(overheads[m][kind].request_ms for m in members)
            for m in members:
                own = overheads[m][kind].measured
                measured = {k: pooled.get(k, v) for k, v in own.items()}
                out[m][kind] = refit(costs, measured, request)
    return out
