"""`SELFSPEC_DEBUG_TIMING=1`: the scheduler's phases of every decode step, on any server.

Installed in every SGLang process the plugin loads into, stock AR included (no speculative
algorithm), so a plain server and a selfspec one are timed by the same clock at the same places
of SGLang's synchronous event loop (`Scheduler.event_loop_normal`):

- prepare: `get_next_batch_to_run` (the running batch's update: `prepare_for_decode`, KV
  allocation, batch selection);
- run: `run_batch` (the forward and the sampling; on the selfspec worker its plan / forward /
  finish, which the worker's own line splits);
- result: `process_batch_result` (tokens appended, finish checks, streaming out);
- loop: the rest of the loop since the last step's result (receiving requests).

One line per decode step (`SCHED_TIMING_LOG`; `bench/step_breakdown.py` reads it).
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("SELFSPEC_DEBUG_TIMING") == "1"
#: the per-decode-step line of the scheduler's phases
SCHED_TIMING_LOG = "[selfspec] sched step bs=%d prepare %.3f ms run %.3f ms result %.3f ms loop %.3f ms"

_state = {"start": None, "prepare": 0.0, "run": 0.0, "last_end": None}


def _around_next_batch(original, self, *args, **kwargs):
    t = time.perf_counter()
    out = original(self, *args, **kwargs)
    _state["start"], _state["prepare"] = t, time.perf_counter() - t
    return out


def _around_run_batch(original, self, batch, *args, **kwargs):
    t = time.perf_counter()
    out = original(self, batch, *args, **kwargs)
    _state["run"] = time.perf_counter() - t
    return out


def _around_process_result(original, self, batch, *args, **kwargs):
    decode = batch.forward_mode.is_decode()  # a speculative step's mode is DECODE again by now
    t = time.perf_counter()
    out = original(self, batch, *args, **kwargs)
    end = time.perf_counter()
    start, last = _state["start"], _state["last_end"]
    if decode and start is not None:
        loop = (start - last) * 1e3 if last is not None and start - last < 1.0 else float("nan")
        logger.info(SCHED_TIMING_LOG, len(batch.reqs), _state["prepare"] * 1e3, _state["run"] * 1e3,
                    (end - t) * 1e3, loop)
    _state["last_end"] = end
    return out


def install() -> None:
    if not ENABLED:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    base = "sglang.srt.managers.scheduler.Scheduler."
    HookRegistry.register(base + "get_next_batch_to_run", _around_next_batch, HookType.AROUND)
    HookRegistry.register(base + "run_batch", _around_run_batch, HookType.AROUND)
    HookRegistry.register(base + "process_batch_result", _around_process_result, HookType.AROUND)
