"""The selfspec speculative worker: SGLang batches in, decoding-core steps out.

One worker serves every mode. It is a thin adapter over `selfspec.decoding`: the mode object
(`ISDMode`, `JacobiMode`, `SJDMode`, built by `config.build_mode`) plans each step's layout
(query tokens, position offsets, visibility, LoRA gate) and decides what to emit and which KV to
keep; this file only maps that onto SGLang:

- prefill (EXTEND): the target forward without SGLang's sampler; the first token is drawn by
  the decoding core's AR rule (`selfspec.decoding.modes.ar.next_tokens`) with the request's seed
  stream, then `mode.start` creates the request's state;
- decode: one TARGET_VERIFY forward of fixed width W per request (`speculative_num_draft_tokens`):
  the step tokens go to the KV slots `[seq_len, seq_len + W)` SGLang reserved for the request
  (`eagle_prepare_for_decode`), at positions `seq_len + offset`, under the mask
  `[committed prefix | step visibility]`; `mode.finish` returns per request the emitted tokens
  and the step indices whose KV joins the prefix (`keep`); kept KV is moved to the front of the
  window (a no-op for causal chains), so `[seq_len, seq_len + len(emit))` is the new committed
  run and everything past it (MASK, rejected, losing branches, padding) is overwritten next
  step or freed with the request. The CPU forward is ragged (unless `SELFSPEC_RAGGED_VERIFY=0`):
  only each request's real tokens go through the model (`RaggedVerify`); the padding to W
  exists in the attention's query block alone.
- plain AR steps (one token per request at forward width 1: sampled batches under the default
  policy, a plan's AR bucket, the run-time check's AR arm, `--selfspec-policy ar`): the worker
  chooses each decode step before SGLang prepares the batch for it (`prepare_decode`, called
  from SGLang's speculative `prepare_for_decode` by `registration._around_spec_prepare`), and
  such a step takes SGLang's plain decode preparation instead of the speculative one
  (`plain_prepare_for_decode`: one new KV slot per request, no reservation of the verify width;
  counted as `ar_steps_plain` in `/server_info`). Its token is drawn by the AR rule with the
  request's seed stream, as every step's is, so a seeded request gives the same tokens alone
  and in any batch.

Per-request state (history, mode state, seed counter, metrics) lives here, keyed by request id,
so continuous batching needs nothing from SGLang but the batch's request list: requests join,
leave, finish and abort independently. EOS, stop strings and max_tokens are applied by SGLang
to the emitted run (`Req.update_finish_state` truncates a multi-token run exactly).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from selfspec.decoding.requests import seeds as seedmod
from selfspec.decoding.requests import watermark
from selfspec.decoding.requests.logits_rules import apply_logits_rules
from selfspec.decoding.metrics import SequenceMetrics
from selfspec.decoding.requests.sampling import SamplingParams
from selfspec.decoding.step import DecodeSequence, StepBatch, StepContext, StepLayout, collate
from selfspec.engines.kernel_choice import ragged_verify_enabled, verify_ops
from selfspec.kernels.lora_gate import gated
from selfspec.sglang_ext import config as cfgmod
from selfspec.sglang_ext.attention import PadBuffer, RaggedVerify
from selfspec.sglang_ext import lora as loramod
from selfspec.sglang_ext.grammar import request_constraint
from selfspec.sglang_ext.logprobs import write_decode_logprobs, write_prefill_logprobs
from selfspec.sglang_ext import metrics as metricsmod
from selfspec.sglang_ext.watermark import request_watermark

logger = logging.getLogger(__name__)

_TOP_K_ALL = 1 << 30
_DEBUG_TIMING = os.environ.get("SELFSPEC_DEBUG_TIMING") == "1"
#: the per-step line `SELFSPEC_DEBUG_TIMING=1` logs (`bench/step_costs.py` reads it)
STEP_TIMING_LOG = ("[selfspec] step bs=%d width %d tokens %d emitted %d plan %.2f ms forward %.2f ms finish %.2f ms "
                   "between %.2f ms")
#: Use the GPU backends' full mask layout on CPU too (exercises that layout in the CPU tests).
_FORCE_FULL_MASK = os.environ.get("SELFSPEC_FULL_MASK") == "1"


def sampling_from_req(req) -> SamplingParams:
    """SGLang's per-request sampling settings in the decoding core's terms (greedy: temperature 0).
    SGLang encodes greedy as top_k == 1 (temperature 0 is rewritten to temperature 1, top_k 1)."""
    sp = req.sampling_params
    bias = tuple(sorted({int(k): float(v) for k, v in (sp.logit_bias or {}).items()}.items()))
    rules = dict(frequency_penalty=float(sp.frequency_penalty or 0.0), presence_penalty=float(sp.presence_penalty or 0.0),
                 repetition_penalty=float(sp.repetition_penalty if sp.repetition_penalty is not None else 1.0),
                 logit_bias=bias, min_new_tokens=int(sp.min_new_tokens or 0))
    top_k = int(sp.top_k) if sp.top_k is not None else -1
    if top_k == 1 or sp.temperature is None or sp.temperature <= 0:
        return SamplingParams(**rules)
    if top_k < 0 or top_k >= _TOP_K_ALL:
        top_k = 0
    top_p = float(sp.top_p) if sp.top_p is not None else 1.0
    return SamplingParams(temperature=float(sp.temperature), top_k=top_k, top_p=top_p,
                          min_p=float(sp.min_p or 0.0), **rules)


def stop_ids_from_req(req) -> frozenset[int]:
    """The tokens min_new_tokens holds back: SGLang's set (`penaltylib/min_new_tokens.py`)."""
    ids = set(req.sampling_params.stop_token_ids or ()) | set(getattr(req, "eos_token_ids", None) or ())
    tok = getattr(req, "tokenizer", None)
    if tok is not None:
        ids |= set(getattr(tok, "additional_stop_token_ids", None) or ())
        if getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
    return frozenset(int(t) for t in ids if t is not None)


def sequence_from_req(req, mask_token_id: int | None = None) -> DecodeSequence:
    """A request's committed tokens (prompt + output so far) as a decoding-core sequence, with
    its grammar as the sequence's constraint when it has one."""
    sp = req.sampling_params
    constrained = any(getattr(sp, k, None) for k in ("json_schema", "regex", "ebnf", "structural_tag"))
    return DecodeSequence(list(req.origin_input_ids) + list(req.output_ids), sampling_from_req(req),
                          prompt_len=len(req.origin_input_ids), stop_ids=stop_ids_from_req(req),
                          constraint=request_constraint(req, mask_token_id) if constrained else None)


def base_seed_for(req) -> int:
    """The request's seed (`seed` in the OpenAI API), else one derived from its id, so every
    tensor-parallel rank draws the same numbers without communication."""
    seed = getattr(req.sampling_params, "sampling_seed", None)
    if seed is not None:
        return int(seed) & 0x7FFFFFFF
    return int.from_bytes(hashlib.sha256(str(req.rid).encode()).digest()[:4], "little") & 0x7FFFFFFF


@dataclass
class RequestState:
    seq: DecodeSequence
    base_seed: int
    counter: int = 0
    metrics: SequenceMetrics = field(default_factory=SequenceMetrics)
    req: Any = None


def timing_check_allowed(server_args) -> bool:
    """Whether a planned mode's run-time check may choose steps by this process's clock: not
    under tensor parallelism, whose ranks must run the same step (one forward, collectives in
    lock step) while each measures its own periods."""
    return int(getattr(server_args, "tp_size", 1) or 1) == 1


def step_kind(mode) -> str:
    """What kind of step `mode` just planned: "ar" (one token), "lookup" (the context candidate
    alone) or "own" (the mode's own step); a planned mode's bucket decides."""
    name = getattr(getattr(mode, "current", mode), "name", "")
    return {"ar": "ar", "ngram": "lookup"}.get(name, "own")


def pad_layout(layout: StepLayout, width: int, pad_token: int) -> StepLayout:
    """Extend a layout to the fixed verify width: padding tokens go last, in their own branch
    (-1: they see the trunk and each other, no real token sees them), gate off."""
    n = len(layout)
    if n > width:
        raise RuntimeError(f"the mode planned {n} query tokens but the verify width is {width}")
    if n == width:
        return layout
    extra = width - n
    offsets = list(layout.offsets) if layout.offsets is not None else list(range(n))
    nxt = (max(offsets) + 1) if offsets else 0
    branch = list(layout.branch) if layout.branch is not None else [0] * n
    gate = list(layout.gate) + [False] * extra if layout.gate is not None else None
    return StepLayout(
        tokens=list(layout.tokens) + [pad_token] * extra,
        offsets=offsets + list(range(nxt, nxt + extra)),
        branch=branch + [-1] * extra,
        gate=gate,
        parent=list(layout.parent) + [0] * extra if layout.parent is not None else None,  # padding sees the root
    )


def build_custom_mask(local: torch.Tensor, seq_lens: list[int], full: bool) -> torch.Tensor:
    """The verify mask in one of SGLang's two layouts. `local` [bs, W, W]: step visibility.
    full=False: the step-only bs*W*W mask (selfspec's torch_native verify path adds the committed
    prefix); full=True: per request the [W, L + W] rows `[ones(W, L) | local]`, flattened and
    concatenated, which the GPU backends read through `NgramVerifyInput.generate_attn_arg_prefill`."""
    if not full:
        return local.flatten()
    W = local.shape[-1]
    parts = [torch.cat([torch.ones(W, int(L), dtype=torch.bool, device=local.device), local[r]], dim=1).flatten()
             for r, L in enumerate(seq_lens)]
    return torch.cat(parts)


@dataclass
class _StepPlan:
    """A decode step as planned: the collated layouts, the forward width W, each request's real
    query tokens and the KV slots of its window."""

    step: StepBatch
    width: int
    real_widths: list[int]
    out_cache_loc: torch.Tensor  # [bs * W]


@dataclass
class _Chosen:
    """A decode step chosen before SGLang prepared the batch for it (`prepare_decode`): the
    requests it is for, their states, the mode's layouts, whether the batch took the plain
    prepare and when the step started."""

    rids: tuple
    states: list
    layouts: list[StepLayout]
    plain: bool
    start: float
    planning: float = 0.0  # seconds the choice took


def plain_prepare_for_decode(batch: ScheduleBatch) -> bool:
    """SGLang's non-speculative decode preparation for a step of one token per request, on the
    speculative scheduler path: one new KV slot at `seq_len` for each request that has none
    there (what `alloc_for_decode` allocates; a request coming from a speculative step still
    holds its reserved window and reuses its first slot), no reservation of the verify width,
    the penalty counts cumulated as SGLang's speculative prepare does. The sequence lengths stay
    the committed ones, as the speculative path keeps them. Returns False, having changed
    nothing, where the batch is not one this applies to (paged KV, a row shorter than its length)."""
    if batch.token_to_kv_pool_allocator.page_size != 1:
        return False
    reqs = batch.reqs
    lens = (batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()).tolist()
    need = []
    for i, (req, n) in enumerate(zip(reqs, lens)):
        have = req.kv.kv_allocated_len
        if have < n:
            return False
        if have == n:
            need.append(i)
    batch.maybe_evict_swa()
    if batch.sampling_info.penalizer_orchestrator.is_required:
        batch.cumulate_penalty_output_tokens()
    if need:
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        locs = alloc_token_slots(batch.tree_cache, len(need))
        if len(need) == len(reqs):
            rows, pos = batch.req_pool_indices, batch.seq_lens
        else:
            idx = torch.tensor(need, dtype=torch.int64, device=batch.seq_lens.device)
            rows, pos = batch.req_pool_indices[idx], batch.seq_lens[idx]
        batch.req_to_token_pool.write((rows, pos), locs.to(torch.int32))
        for i in need:
            reqs[i].kv.kv_allocated_len = lens[i] + 1
    for req in reqs:
        req.decode_batch_idx += 1
    return True


class SelfSpecWorker(BaseSpecWorker):
    #: the worker of this scheduler process (one per process), for the prepare hook
    #: (`registration._around_spec_prepare`)
    active: "SelfSpecWorker | None" = None

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        self.server_args = server_args
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.device = self.model_runner.device
        self.cfg = cfgmod.load_for_worker(server_args)
        self._fixed_forward_width = torch.device(self.device).type == "cuda"
        # ragged verify forwards need the verify attention of `sglang_ext.attention` (CPU)
        self._ragged_verify = torch.device(self.device).type == "cpu" and ragged_verify_enabled()
        self._padded_logits = PadBuffer()
        # the forward of one-token steps: SGLang's decode forward, or the (ragged) verify
        # forward. On a CPU the decode forward for a plain AR step of one request (torch_native's
        # decode loop over requests is then one SDPA call, with no mask or gather to build: read
        # 0.97-1.04x stock AR against 0.87-0.94x for the verify forward, greedy, C=1, in
        # `selfspec bench serve --modes ar,worker-ar=isd --mode-args "worker-ar=--selfspec-policy
        # ar"`), the verify forward for wider batches (one batched SDPA, `sglang_ext.attention`,
        # against that loop: the worker-ar row of the same command at C >= 4). Elsewhere the
        # decode forward (and its graphs)
        self._ar_as_decode = torch.device(self.device).type != "cpu"
        self.mode = cfgmod.build_mode(self.cfg, padded=not self._ragged_verify)
        if getattr(self.mode, "check", None) is not None and not timing_check_allowed(server_args):
            self.mode.check = None  # every rank follows the plan as written
            logger.info("[selfspec] tensor parallel: the plan's run-time check is off, every rank runs the plan")
        self.width = int(get_spec().speculative_num_draft_tokens)
        if self.width < self.cfg.width:
            raise cfgmod.SelfSpecConfigError(
                f"[selfspec] verify width {self.cfg.width} exceeds speculative_num_draft_tokens {self.width}")
        self.speculative_num_draft_tokens = self.width
        self.pad_token = int(self.cfg.mask_token_id) if self.cfg.mask_token_id is not None else 0
        self.states: dict[str, RequestState] = {}
        self.stats = metricsmod.AggregateStats(self.cfg.algorithm)
        self.verify_ops = verify_ops(self.device)
        self.gate = None  # the gated LoRA's gate (modes that need an adapter)
        # the last decode step's start and outcomes: its period ends where the next step starts
        self._last_step: tuple[float, list] | None = None
        self._chosen: _Chosen | None = None  # the next decode step, chosen before its prepare
        self._last_end: float | None = None  # when the last decode step returned (debug timing)
        if self.cfg.spec.needs_adapter:
            handle = loramod.attach_to_sglang_model(self.model_runner.model, self.cfg.adapter)
            logger.info("[selfspec] %s gated LoRA attached: %r", self.cfg.algorithm, handle)
            self.gate = handle.gate
            self.stats.adapter = {"path": str(self.cfg.adapter), "layers": len(handle.layers),
                                  "embeddings": len(handle.embeddings)}
            if torch.device(self.device).type == "cuda":
                self.gate.buffer = torch.zeros(self._max_graph_tokens(), dtype=torch.bool, device=self.device)
        SelfSpecWorker.active = self
        logger.info("[selfspec] worker ready: %s", self.cfg.describe())

    # ------------------------------------------------------------------ SGLang plumbing
    @property
    def draft_worker(self):
        return None  # draft-free: the target model drafts for itself

    def alloc_memory_pool(self, **kwargs):
        # Shares the target's pools (the target pools exist only after __init__).
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()

    def clear_cache_pool(self):
        self.states.clear()

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        st = self.states.pop(rid, None)
        if st is not None:
            # what SGLang keeps of the output (a step's run may pass EOS / a stop / max_tokens);
            # the same count it reports as completion_tokens
            kept = len(getattr(st.req, "output_ids_through_stop", st.req.output_ids)) if st.req is not None else None
            self.stats.finish(st.metrics, kept)

    def collect_finished(self) -> None:
        """Count the requests that finished without SGLang's finish hook: it runs for requests
        finished by a decode step, not for those a prefill finishes (max_new_tokens=1, a stop at
        the first token). Called every step and before the metrics are read, so a read never
        misses a finished request."""
        for rid in [rid for rid, st in self.states.items() if st.req is not None and st.req.finished()]:
            self.note_request_finished(rid=rid, natural_stop=False)

    # ------------------------------------------------------------------ one scheduler step
    def forward_batch_generation(self, batch: ScheduleBatch, on_publish=None, pp_proxy_tensors=None
                                 ) -> GenerationBatchResult:
        if batch.forward_mode.is_decode():
            return self._decode(batch, on_publish)
        return self._extend(batch, on_publish)

    def _context(self, states: list[RequestState], width: int, columns: int | None = None) -> StepContext:
        """The step's sampling context: `columns` seeds per request (default: all `width`), each
        request's seed counter advanced by `width`."""
        params = [st.seq.sampling for st in states]
        columns = width if columns is None else columns
        if all(p.greedy for p in params):
            seeds = torch.zeros((len(states), columns), dtype=torch.long)
        else:
            seeds = seedmod.step_seeds([st.base_seed for st in states], [st.counter for st in states], columns)
        for st in states:
            st.counter += width
        return StepContext.from_params(params, seeds.to(self.device), self.verify_ops)

    def _extend(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        self._last_step = None  # a prefill in between: the last decode step's period is not its own
        bs = len(batch.reqs)
        with self._gate_off():
            result = self._target_worker.forward_batch_generation(batch, is_verify=True)
        states = [self._fresh_state(req) for req in batch.reqs]
        # [bs, V]: the last prompt position of each request
        logits = apply_logits_rules(result.logits_output.next_token_logits.unsqueeze(1), [st.seq for st in states],
                                    None)[:, 0]
        logits = _custom_processors(batch, logits, 1)
        ctx = self._context(states, 1)
        tokens = watermark.first_tokens(logits, [st.seq for st in states], ctx)
        if batch.return_logprob:  # the logits before any watermark forcing, as SGLang reports them
            write_prefill_logprobs(batch, result.logits_output, logits, tokens)
        for req, st, tok in zip(batch.reqs, states, tokens.tolist()):
            st.seq.history.append(int(tok))
            st.metrics.record_prefill(1)
            self.mode.start(st.seq)
            self.states[req.rid] = st
        next_token_ids = tokens.to(torch.int64)
        new_seq_lens = batch.seq_lens.clone()
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)
        accept_tokens = torch.zeros(bs, self.width, dtype=torch.int64, device=self.device)
        accept_tokens[:, 0] = next_token_ids
        if on_publish is not None:
            on_publish(new_seq_lens)
        return _batch_result(result, next_token_ids, accept_tokens.flatten(), accept_lens, new_seq_lens, self.width)

    def _fresh_state(self, req) -> RequestState:
        """The state of a request being prefilled. A retracted request comes back with its output
        so far and is prefilled again: its seed counter carries on (a restart at 0 would reuse
        the uniforms its earlier tokens used), and so do its metrics."""
        st = self._new_state(req)
        old = self.states.get(req.rid)
        if old is not None and req.output_ids:
            st.counter, st.metrics = old.counter, old.metrics
            if st.seq.watermark is not None and old.seq.watermark is not None:
                st.seq.watermark.forced = old.seq.watermark.forced
        return st

    def _new_state(self, req) -> RequestState:
        st = RequestState(sequence_from_req(req, self.cfg.mask_token_id), base_seed_for(req), req=req)
        st.seq.watermark = request_watermark(req, getattr(self, "model_runner", None), self.cfg.mask_token_id)
        return st

    def _state_for(self, req) -> RequestState:
        st = self.states.get(req.rid)
        if st is None:  # e.g. state dropped by clear_cache_pool: rebuild from what SGLang holds
            st = self._new_state(req)
            self.mode.start(st.seq)
            self.states[req.rid] = st
        return st

    def prepare_decode(self, batch: ScheduleBatch) -> bool:
        """Choose the next decode step before SGLang prepares the batch for it (SGLang's
        speculative `prepare_for_decode` calls this first: `registration._around_spec_prepare`).
        A plain AR step (one query token per request, forward width 1, no gate: a sampled batch,
        the plan's AR bucket, the online check's AR arm) takes the plain prepare
        (`plain_prepare_for_decode`) instead of the speculative one: no reservation of the verify
        width, no speculative bookkeeping. Returns whether it did; False leaves the batch to
        SGLang's speculative prepare. The step runs as chosen here (`_decode`)."""
        t0 = time.perf_counter()
        states = [self._state_for(r) for r in batch.reqs]
        self._report_period(t0)
        layouts = self.mode.layouts([st.seq for st in states])
        planning = time.perf_counter() - t0  # the step's plan time; the prepare is SGLang's part
        plain = (self._forward_width() == 1 and all(lay.gate is None for lay in layouts)
                 and plain_prepare_for_decode(batch))
        self._chosen = _Chosen(tuple(r.rid for r in batch.reqs), states, layouts, plain, t0, planning)
        return plain

    def _decode(self, batch: ScheduleBatch, on_publish) -> GenerationBatchResult:
        """One decode step: the mode plans each request's layout (before SGLang's prepare, where
        `prepare_decode` ran), one forward runs them all, the logits rules and the mode decide
        what each request emits, the kept KV moves into place and the scheduler gets the emitted
        runs."""
        t_run = time.perf_counter()
        chosen, self._chosen = self._chosen, None
        if chosen is None or chosen.rids != tuple(r.rid for r in batch.reqs):
            if chosen is not None and chosen.plain:
                raise RuntimeError("[selfspec] a batch prepared for a plain AR step changed before its forward")
            states = [self._state_for(r) for r in batch.reqs]
            self._report_period(t_run)
            chosen = _Chosen((), states, self.mode.layouts([st.seq for st in states]), False, t_run)
        states, seqs = chosen.states, [st.seq for st in chosen.states]
        seq_lens = batch.seq_lens  # as the step starts (the forward may rebind the batch's)
        plan = self._plan_step(batch, chosen.layouts)
        t1 = time.perf_counter()
        result = self._forward_step(batch, plan, chosen.plain)
        logits = apply_logits_rules(result.logits_output.next_token_logits.view(len(seqs), plan.width, -1), seqs,
                                    plan.step)
        logits = _custom_processors(batch, logits.reshape(-1, logits.shape[-1]), plan.width).view(logits.shape)
        t2 = time.perf_counter()
        ctx = self._context(states, self.mode.seeds_per_step, self.mode.step_seed_columns)
        outcomes = watermark.finish_step(self.mode, seqs, plan.step, logits, ctx)  # logprobs: the logits before forcing
        if batch.return_logprob:
            write_decode_logprobs(batch, result.logits_output, logits, outcomes, self.width)
        accept_lens, next_token_ids = self._commit_step(states, outcomes, plan)
        new_seq_lens = seq_lens + accept_lens.to(seq_lens.dtype)
        batch.forward_mode = ForwardMode.DECODE
        if on_publish is not None:
            on_publish(new_seq_lens)
        t3 = time.perf_counter()
        self._record_step(plan, outcomes, chosen, (t_run, t1, t2, t3))
        out = _batch_result(result, next_token_ids, next_token_ids, accept_lens, new_seq_lens, self.width)
        self._last_end = time.perf_counter()
        return out

    def _forward_width(self) -> int:
        """The forward width W of the step the mode just planned: SGLang reserves self.width KV
        slots per request for a speculative step; a planned mode runs narrower steps in the
        first W of them. CUDA graphs were captured at one width, so GPU steps keep it (padding)."""
        return self.width if self._fixed_forward_width else min(self.width, self.mode.step_width)

    def _plan_step(self, batch: ScheduleBatch, layouts: list[StepLayout]) -> _StepPlan:
        """The mode's layouts, padded to the step's forward width W and collated; the batch's
        input ids and the KV slots `[seq_len, seq_len + W)` of each request (SGLang's
        reservation, or the plain prepare's one slot)."""
        W = self._forward_width()
        step = collate([pad_layout(lay, W, self.pad_token) for lay in layouts], self.pad_token, device=self.device)
        seq_lens = batch.seq_lens
        window = seq_lens.to(torch.int64).unsqueeze(1) + torch.arange(W, device=self.device)
        out_cache_loc = batch.req_to_token_pool.req_to_token[
            batch.req_pool_indices.to(torch.int64).unsqueeze(1), window].to(torch.int64).flatten()
        batch.input_ids = step.tokens.flatten()
        batch.out_cache_loc = out_cache_loc
        self.stats.tree_request_steps += sum(lay.parent is not None for lay in layouts)
        return _StepPlan(step, W, [len(lay) for lay in layouts], out_cache_loc)

    def _forward_step(self, batch: ScheduleBatch, plan: _StepPlan, plain: bool = False):
        """The step's forward: a one-token step as SGLang's decode forward where that is the
        faster path, otherwise one TARGET_VERIFY forward (ragged on a CPU: only the real
        tokens), the gated LoRA switched per token; logits come back [bs * W, V]. `plain`: the
        batch took the plain prepare (`prepare_decode`)."""
        seq_lens = batch.seq_lens
        seq_lens_cpu = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else seq_lens.cpu()
        step, W, dev = plan.step, plan.width, self.device
        if W == 1:
            self.stats.ar_steps += 1
            self.stats.ar_steps_plain += plain
        if W == 1 and step.gate is None and (self._ar_as_decode or (plain and len(batch.reqs) == 1)):
            self.stats.ar_steps_as_decode += 1
            return self._plain_decode_forward(batch, seq_lens, seq_lens_cpu)
        positions = (seq_lens.to(torch.int64).unsqueeze(1) + step.offsets).flatten()
        custom_mask = self._custom_mask(step.local, seq_lens_cpu.tolist())
        gate = step.gate.flatten() if step.gate is not None else None
        ragged = RaggedVerify.of(plan.real_widths, W, dev) if self._ragged_verify else None
        if ragged is not None:  # only the real tokens: the model's cost is per token on CPU
            batch.input_ids, batch.out_cache_loc = ragged.take(batch.input_ids), ragged.take(plan.out_cache_loc)
            positions = ragged.take(positions)
            gate = ragged.take(gate) if gate is not None else None
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.spec_info = NgramVerifyInput(
            draft_token=batch.input_ids, custom_mask=custom_mask, positions=positions,
            retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None, draft_token_num=W,
        )
        batch.spec_info.selfspec_ragged = ragged  # read by sglang_ext.attention
        with gated(self.gate, gate):
            result = self._target_worker.forward_batch_generation(batch, is_verify=True)
        if ragged is not None:
            result.logits_output.next_token_logits = ragged.pad(result.logits_output.next_token_logits,
                                                                 self._padded_logits)
        return result

    def _commit_step(self, states: list["RequestState"], outcomes: list, plan: _StepPlan
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's emitted run joins its history and metrics; kept KV moves to the front
        of its window. Returns (accept_lens [bs], next_token_ids [bs * self.width]: the emitted
        runs, zero-padded to the stride the scheduler reads)."""
        W = plan.width
        accept_lens, emitted_rows, src, tgt = [], [], [], []
        for r, (st, out) in enumerate(zip(states, outcomes)):
            n = len(out.emit)
            if n < 1 or len(out.keep) != n:
                raise RuntimeError(f"mode {self.mode.name} returned emit {out.emit} / keep {out.keep}")
            emitted_rows.append(list(out.emit) + [0] * (self.width - n))
            for j, k in enumerate(out.keep):
                if k != j:
                    src.append(r * W + k)
                    tgt.append(r * W + j)
            accept_lens.append(n)
            st.seq.history.extend(int(t) for t in out.emit)
            st.metrics.record_step(plan.real_widths[r], n)
        dev = self.device
        if src:
            loc = plan.out_cache_loc
            self._move_kv(loc[torch.tensor(tgt, device=dev)], loc[torch.tensor(src, device=dev)])
        return (torch.tensor(accept_lens, dtype=torch.int32, device=dev),
                torch.tensor(emitted_rows, dtype=torch.int64).to(dev).flatten())

    def _record_step(self, plan: _StepPlan, outcomes: list, chosen: _Chosen,
                     times: tuple[float, float, float, float]) -> None:
        """The step's statistics, its period for the run-time check, the finished requests.
        The step's plan time counts its choice before SGLang's prepare (`prepare_decode`) and
        its collation inside the forward call."""
        t_run, t1, t2, t3 = times
        bs, emitted = len(outcomes), sum(len(o.emit) for o in outcomes)
        plan_s = chosen.planning + (t1 - t_run)
        if _DEBUG_TIMING:  # between: the scheduler's time since the last step returned, less the plan's
            between = ((t_run - self._last_end - chosen.planning) * 1e3 if self._last_end else float("nan"))
            logger.info(STEP_TIMING_LOG, bs, plan.width, sum(plan.real_widths), emitted, plan_s * 1e3,
                        (t2 - t1) * 1e3, (t3 - t2) * 1e3, between)
        self.stats.step(bs, emitted, sum(plan.real_widths), plan_s + (t3 - t1), plan.width, step_kind(self.mode))
        self._last_step = (chosen.start, outcomes)
        self.collect_finished()

    # ------------------------------------------------------------------ helpers
    def _report_period(self, now: float) -> None:
        """The last decode step's wall-clock period, scheduler time included, to a planned
        mode's online check (`online_check.OnlineCheck`); a gap of a second or more is idle time."""
        observe = getattr(self.mode, "observe", None)
        if observe is not None and self._last_step is not None and now - self._last_step[0] < 1.0:
            observe(self._last_step[1], now - self._last_step[0])
        self._last_step = None

    def _plain_decode_forward(self, batch: ScheduleBatch, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor):
        """A step of one token per request as SGLang's own decode forward (`_ar_as_decode`; on a
        CPU a plain AR step of one request). Decode reads each request's length including the
        token being written, which the slot at seq_len (reserved, or the plain prepare's) holds;
        the logits are returned unsampled (is_verify) and decided by the mode like any other
        step's."""
        saved = (batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info)
        batch.forward_mode = ForwardMode.DECODE
        batch.seq_lens = seq_lens + 1
        batch.seq_lens_cpu = seq_lens_cpu + 1
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        batch.spec_info = None
        try:
            return self._target_worker.forward_batch_generation(batch, is_verify=True)
        finally:
            batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum, batch.spec_info = saved

    def _gate_off(self):
        return self.gate.off() if self.gate is not None else nullcontext()

    def _max_graph_tokens(self) -> int:
        """Query tokens of the largest batch a verify forward (eager or captured) can have."""
        from sglang.srt.runtime_context import get_exec, get_schedule

        max_bs = get_schedule().max_running_requests or 1
        graph = get_exec().graph.cuda_graph_config
        if graph is not None and graph.decode is not None and graph.decode.max_bs:
            max_bs = max(max_bs, int(graph.decode.max_bs))
        return max_bs * self.width

    def _custom_mask(self, local: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        full = torch.device(self.device).type != "cpu" or _FORCE_FULL_MASK
        return build_custom_mask(local, seq_lens, full)

    def _move_kv(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        pool = self.token_to_kv_pool_allocator.get_kvcache()
        if torch.device(self.device).type == "cuda":
            pool.move_kv_cache(tgt, src)
            return
        for buf in list(pool.k_buffer) + list(pool.v_buffer):
            buf[tgt] = buf[src]


def _custom_processors(batch, logits: torch.Tensor, rows_per_request: int) -> torch.Tensor:
    """Requests' custom logit processors on every row of the step, after the logits rules: what
    SGLang's own speculative verifiers do (`apply_custom_logit_processor(...,
    num_tokens_in_batch)`, as in `speculative/dflash_utils.py`). A processor sees each row with
    its request's custom_params, so one that bans or biases tokens is exact; one that reads the
    request's output (a thinking budget) sees the committed output at every row, SGLang's own
    approximation in speculative decoding."""
    info = batch.sampling_info
    if info is None or not info.has_custom_logit_processor:
        return logits
    from sglang.srt.layers.sampler import apply_custom_logit_processor

    logits = logits.contiguous()
    apply_custom_logit_processor(logits, info, num_tokens_in_batch=rows_per_request)
    return logits


def _batch_result(result, next_token_ids, accept_tokens, accept_lens, new_seq_lens, width: int):
    """What the scheduler expects back from a verify step (NGRAM's shape: draft-free)."""
    return GenerationBatchResult(
        logits_output=result.logits_output,
        next_token_ids=next_token_ids,
        can_run_cuda_graph=result.can_run_cuda_graph,
        accept_lens=accept_lens,
        new_seq_lens=new_seq_lens,
        next_draft_input=NgramVerifyInput(draft_token_num=width, new_seq_lens=new_seq_lens,
                                          accept_tokens=accept_tokens, accept_lens=accept_lens),
        speculative_num_draft_tokens=width,
    )
