"""TPF and accepted length of the selfspec modes, per request and aggregated.

Conventions are those of `selfspec.decoding.metrics` (forwards include the prefill; the
accepted length of a decode forward is the tokens it committed, drafts plus the corrected /
bonus token).

- Per request: SGLang already returns `spec_verify_ct` (decode forwards) and `completion_tokens`
  in the native API's `meta_info`; an AFTER hook on the tokenizer manager's
  `_calculate_spec_decoding_metrics` adds `selfspec_mode`, `selfspec_tpf` =
  completion_tokens / (verify forwards + 1 prefill) and `selfspec_accept_length` =
  (completion_tokens - 1) / verify forwards.
- Aggregate: the worker's `AggregateStats` logs one line every `LOG_EVERY` decode steps in the
  scheduler log ("[selfspec] ISD: TPF ..., accepted length ..., ...") and, with
  `--enable-metrics`, sets the Prometheus gauges `selfspec:tokens_per_forward`,
  `selfspec:accept_length` and `selfspec:compute_overhead` served by SGLang's /metrics (beside
  SGLang's own `sglang:spec_accept_length`).
"""

from __future__ import annotations

import logging
import os
import time

from selfspec.decoding import registry
from selfspec.decoding.metrics import SequenceMetrics

logger = logging.getLogger(__name__)

LOG_EVERY = int(os.environ.get("SELFSPEC_LOG_EVERY", "40"))


def request_metrics(completion_tokens: int, verify_ct: int) -> dict[str, float]:
    forwards = verify_ct + 1
    return {
        "selfspec_tpf": completion_tokens / forwards if forwards else 0.0,
        "selfspec_accept_length": (completion_tokens - 1) / verify_ct if verify_ct else 0.0,
        "selfspec_forwards": forwards,
    }


def _after_spec_metrics(result, self, meta_info, recv_obj, i, *args, **kwargs):
    try:
        from sglang.srt.runtime_context import get_spec

        algo = (get_spec().speculative_algorithm or "").upper()
    except Exception:
        return result
    if registry.for_sglang_algorithm(algo) is None:
        return result
    completion = recv_obj.completion_tokens[i]
    verify_ct = recv_obj.spec_verify_ct[i] if getattr(recv_obj, "spec_verify_ct", None) else 0
    meta_info["selfspec_mode"] = algo
    meta_info.update(request_metrics(completion, verify_ct))
    return result


class AggregateStats:
    """Aggregate over finished and running requests of one worker (scheduler process)."""

    def __init__(self, algorithm: str):
        self.algorithm = algorithm
        self.finished = SequenceMetrics()
        self.num_finished = 0
        self.steps = 0
        self.window_tokens = 0
        self.window_req_forwards = 0
        self.window_query = 0
        self.window_time = 0.0
        self.window_width = 0  # sum of the steps' forward widths (a width plan varies it)
        self.last_step_width = 0
        self.ar_steps = 0  # one-token steps (an AR bucket's, the online check's AR arm)
        self.ar_steps_as_decode = 0  # those run as SGLang's own decode forward (on a CPU: one request)
        # those whose batch took SGLang's plain decode preparation (one KV slot per request, no
        # speculative reservation: `SelfSpecWorker.prepare_decode`)
        self.ar_steps_plain = 0
        # request-steps that verified a draft tree (a lookup bucket's `tree`: `StepLayout.parent`)
        self.tree_request_steps = 0
        # per kind of step ("own": the mode's own, "lookup", "ar"): [steps, request-steps, tokens];
        # what part of the output each kind of step committed
        self.by_kind: dict[str, list[int]] = {}
        self.by_width: dict[int, int] = {}  # steps per forward width (query tokens per request)
        self.adapter: dict | None = None  # the gated LoRA attached (modes that need one)
        self._gauges = None
        self._last_log = time.monotonic()

    def finish(self, m: SequenceMetrics, kept_tokens: int | None = None) -> None:
        """A finished request; `kept_tokens`: its output after SGLang's truncation (a step's run
        past EOS / a stop / max_tokens is emitted but not kept, and must not count)."""
        committed = m.committed_tokens if kept_tokens is None else min(kept_tokens, m.committed_tokens)
        self.window_tokens = max(0, self.window_tokens - (m.committed_tokens - committed))
        self.num_finished += 1
        self.finished.forwards += m.forwards
        self.finished.committed_tokens += committed
        self.finished.query_tokens += m.query_tokens
        self.finished.accept_hist.update(m.accept_hist)

    def step(self, batch_size: int, committed: int, query_tokens: int, seconds: float, width: int = 0,
             kind: str = "own") -> None:
        self.steps += 1
        counts = self.by_kind.setdefault(kind, [0, 0, 0])
        counts[0] += 1
        counts[1] += batch_size
        counts[2] += committed
        self.by_width[width] = self.by_width.get(width, 0) + 1
        self.window_width += width
        self.last_step_width = width
        self.window_req_forwards += batch_size
        self.window_tokens += committed
        self.window_query += query_tokens
        self.window_time += seconds
        if self.steps % LOG_EVERY == 0:
            self.flush()

    def summary(self) -> dict:
        out = self.finished.to_dict()
        out["requests"] = self.num_finished
        out["mode"] = self.algorithm
        out["last_step_width"] = self.last_step_width
        out["ar_steps"] = self.ar_steps
        out["ar_steps_as_decode"] = self.ar_steps_as_decode
        out["ar_steps_plain"] = self.ar_steps_plain
        out["tree_request_steps"] = self.tree_request_steps
        out["steps_by_kind"] = {k: {"steps": v[0], "request_steps": v[1], "tokens": v[2]} for k, v in self.by_kind.items()}
        out["steps_by_width"] = {str(k): v for k, v in sorted(self.by_width.items())}
        out["adapter"] = self.adapter
        return out

    def flush(self) -> None:
        if not self.window_req_forwards:
            return
        accept = self.window_tokens / self.window_req_forwards
        overhead = self.window_query / max(self.window_tokens, 1)
        fin = self.finished
        tpf = fin.tokens_per_forward if fin.forwards else float("nan")
        logger.info("[selfspec] %s: accepted length %.2f (last %d steps), TPF %.2f over %d finished requests, "
                    "query tokens per committed token %.2f, step width %.1f, worker step %.1f ms", self.algorithm,
                    accept, LOG_EVERY, tpf, self.num_finished, overhead, self.window_width / max(1, LOG_EVERY),
                    1e3 * self.window_time / max(1, LOG_EVERY))
        # no TPF before a request has finished (it is a per-request quantity, not the accept length)
        self._set_gauges(tpf, accept, overhead, self.window_width / max(1, LOG_EVERY))
        self.window_tokens = self.window_req_forwards = self.window_query = self.window_width = 0
        self.window_time = 0.0

    def _set_gauges(self, tpf: float, accept: float, overhead: float, width: float) -> None:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return
        try:
            if self._gauges is None:
                from prometheus_client import Gauge

                def g(name, doc):
                    return Gauge(name, doc, labelnames=["mode"], multiprocess_mode="mostrecent")

                self._gauges = (
                    g("selfspec:tokens_per_forward", "Tokens per forward of finished requests (prefill included)."),
                    g("selfspec:accept_length", "Tokens committed per request per decode forward (recent steps)."),
                    g("selfspec:compute_overhead", "Query tokens per committed token (recent steps)."),
                    g("selfspec:step_width", "Query tokens per request of the verify forward (recent steps' mean)."),
                )
            for gauge, value in zip(self._gauges, (tpf, accept, overhead, width)):
                gauge.labels(mode=self.algorithm).set(value)
        except Exception as e:  # metrics must never break serving
            logger.debug("selfspec gauges unavailable: %s", e)


def _after_add_speculative(result, self, state, *args, **kwargs):
    """/server_info internal state: `kv_tokens_in_use` (KV slots held by requests, i.e. not free
    and not evictable cache: 0 when idle) and, under a selfspec mode, `selfspec` aggregates
    (with a width plan, its online check's choice and measured rates per batch-size class)."""
    scheduler = self.scheduler
    try:
        state["kv_tokens_in_use"] = int(scheduler.pool_stats_observer.get_pool_stats().full_num_used)
    except Exception as e:  # never break /server_info
        logger.debug("kv_tokens_in_use unavailable: %s", e)
    worker = getattr(scheduler, "draft_worker", None)
    stats = getattr(worker, "stats", None)
    if isinstance(stats, AggregateStats):
        worker.collect_finished()
        state["selfspec"] = stats.summary()
        cfg = getattr(worker, "cfg", None)  # what the server runs: its plan, and the policy that wrote it
        state["selfspec"]["plan"] = getattr(cfg, "plan", None)
        state["selfspec"]["policy"] = getattr(cfg, "policy", None)
        if cfg is not None:  # what the server resolved and loaded: options with their sources, the model class
            model = getattr(getattr(worker, "model_runner", None), "model", None)
            state["selfspec"]["resolved"] = {
                "options": cfg.options, "sources": cfg.sources, "mask_token_id": cfg.mask_token_id,
                "adapter": cfg.adapter, "model_dir": cfg.model_dir, "notes": cfg.notes,
                "model_class": type(model).__name__ if model is not None else None}
        check = getattr(getattr(worker, "mode", None), "check", None)
        if check is not None:  # a width plan's online check: per batch-size class, what runs
            state["selfspec"]["online_check"] = check.summary()
            state["selfspec"]["online_check_watch_probes"] = check.watch_probes
    return result


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._calculate_spec_decoding_metrics",
        _after_spec_metrics, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_speculative",
        _after_add_speculative, HookType.AFTER)
