"""A server's cost per step beyond the model forward, measured.

The cost grid times the HF engine's forward; a served step also schedules, builds the step,
samples and streams. To learn that part, serve the mode with a plan of plain AR steps (so the
step is the worker's own width-1 verify forward), send `batch` concurrent greedy requests of a
short and a long length (EOS ignored) and take the difference: (long − short) wall time over
(long − short) tokens is one decode step at that batch, free of prefill and HTTP set-up. The
overhead at a batch is that step time minus the grid's forward time at width 1; a line through
the smallest and largest batch measured gives `StepOverhead`.
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from selfspec.tuning.cost import CostTable, StepOverhead

SHORT, LONG = 16, 80


def _generate(base_url: str, prompt: list[int], tokens: int) -> None:
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True}}
    req = urllib.request.Request(base_url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def _wall(base_url: str, prompts: list[list[int]], tokens: int) -> float:
    with ThreadPoolExecutor(len(prompts)) as ex:
        t0 = time.perf_counter()
        list(ex.map(lambda p: _generate(base_url, p, tokens), prompts))
        return time.perf_counter() - t0


def server_overhead(model: str, mode: str, costs: CostTable, prompt: list[int], batches: list[int],
                    threads: int = 1, log_dir: str | None = None, progress=None) -> StepOverhead:
    """Serve `model` under `mode` with all-AR steps and measure its step time at each batch."""
    import os

    import yaml

    from selfspec.serving import ServerProcess, ServerSpec

    work = Path(log_dir or tempfile.mkdtemp(prefix="selfspec-tune-"))
    work.mkdir(parents=True, exist_ok=True)
    plan = work / "all-ar.yaml"
    plan.write_text(yaml.safe_dump({"mode": mode.upper(), "plan": [{"max_batch": None, "mode": "ar"}]}))
    args = ["--speculative-algorithm", mode.upper(), "--selfspec-config", str(plan),
            "--max-running-requests", str(max(batches))]
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    measured: dict[int, float] = {}
    try:
        with ServerProcess(ServerSpec(model, port=None, extra_args=args), log_path=work / "server.log",
                           startup_timeout=900) as server:
            _wall(server.base_url, [prompt], SHORT)  # warm-up
            for b in batches:
                prompts = [prompt] * b
                step_s = (_wall(server.base_url, prompts, LONG) - _wall(server.base_url, prompts, SHORT)) / (LONG - SHORT)
                measured[b] = 1e3 * max(step_s, 0.0)
                if progress is not None:
                    progress.update(1)
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    return fit_overhead(costs, measured)


def fit_overhead(costs: CostTable, measured: dict[int, float]) -> StepOverhead:
    """The line through the overheads (measured step − forward at width 1) of the smallest and
    largest batch; never negative."""
    over = {b: ms - costs.time_ms(b, 1) for b, ms in measured.items()}
    lo, hi = min(over), max(over)
    slope = (over[hi] - over[lo]) / (hi - lo) if hi > lo else 0.0
    slope = max(slope, 0.0)
    base = max(over[lo] - slope * lo, 0.0)
    return StepOverhead(base, slope, dict(measured))
