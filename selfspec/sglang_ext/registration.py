"""`--speculative-algorithm ISD | RISD | JACOBI | SJD`: the spec class SGLang dispatches on.

SGLang 0.5.23's scheduler, memory sizing and CUDA-graph runner branch on `is_ngram()` for the
one draft-free builtin; answering True routes our algorithms through those branches (no draft
KV pool, no draft runners, KV reserved for `speculative_num_draft_tokens` query tokens per
request and step, TARGET_VERIFY graphs captured at that fixed width, the host `seq_lens` mirror
kept). The class also defines the methods 0.5.23 calls on every algorithm but that its
`CustomSpecAlgo` lacks (`carries_draft_hidden_states`, `need_topk`, `create_future_map`,
`get_platform_worker_cls`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from selfspec.decoding import registry
from selfspec.sglang_ext import config as cfgmod

logger = logging.getLogger(__name__)


class SelfSpecAlgo(CustomSpecAlgo):
    """A selfspec mode: draft-free, fixed-width target verify, synchronous scheduling."""

    # -- NGRAM-style routing: draft-free, verify-only ------------------------------------
    def is_ngram(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return False

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def supports_mixed_chunk(self) -> bool:
        return False

    def get_platform_worker_cls(self) -> Optional[type]:
        return None

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        return None

    # -- server arguments ----------------------------------------------------------------
    def handle_server_args(self, server_args: Any) -> None:
        """Runs on a recorder of the server args: every assignment is declared to SGLang."""
        cfg = cfgmod.load_for_worker(server_args)
        if not server_args.disable_overlap_schedule:
            logger.warning("[selfspec] %s runs the scheduler synchronously: overlap scheduling disabled", self.name)
        server_args.disable_overlap_schedule = True
        server_args.enable_mixed_chunk = False
        if server_args.speculative_num_draft_tokens is None:
            server_args.speculative_num_draft_tokens = cfg.width
        server_args.speculative_eagle_topk = 1
        if server_args.speculative_num_steps is None:
            server_args.speculative_num_steps = 1
        if server_args.max_running_requests is None:
            server_args.max_running_requests = 48
            logger.warning("[selfspec] --max-running-requests defaults to 48 for %s; set it explicitly to change",
                           self.name)

    def resolve_max_speculative_num_draft_tokens(self, server_args: Any) -> Optional[int]:
        from sglang.srt.arg_groups.overrides import resolving_view

        return resolving_view(server_args).speculative_num_draft_tokens

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
        return num_draft_tokens

    def create_worker(self, server_args: Any):
        from sglang.srt.arg_groups.overrides import resolving_view

        if not resolving_view(server_args).disable_overlap_schedule:
            raise cfgmod.SelfSpecConfigError(
                f"[selfspec] {self.name} does not support overlap scheduling; it is disabled automatically "
                "unless something re-enabled it")
        return self.factory(server_args)


def validate_server_args(server_args: Any) -> None:
    """Fail fast at startup: resolve the configuration, check the server combination, publish
    the result for the scheduler processes."""
    cfg = cfgmod.resolve(server_args)
    cfgmod.check_server_combination(server_args, cfg)
    cfgmod.publish(cfg)
    logger.info("[selfspec] %s", cfg.describe())


def _worker_factory(server_args: Any):
    from selfspec.sglang_ext.worker import SelfSpecWorker

    return SelfSpecWorker


def _row_headroom_after(result: int, *args, **kwargs) -> int:
    """A request's req_to_token row past the context length, for a selfspec algorithm: room for
    the decode reservation. SGLang 0.5.23 reserves twice the verify width past the committed
    tokens at every decode step (`allocation_sizing.get_alloc_reserve_per_decode`) but leaves
    only 4 + the width of row past the context length at page size 1, so a request that nears
    the context length with a width above 4 writes past its row (IndexError in
    `assign_req_to_token_pool`; stock NGRAM at its 12 draft tokens alike)."""
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode
    from sglang.srt.runtime_context import get_spec

    if registry.for_sglang_algorithm(get_spec().speculative_algorithm) is None:
        return result
    return max(result, 4 + get_alloc_reserve_per_decode())


def _around_spec_prepare(original, batch, *args, **kwargs):
    """SGLang's speculative `prepare_for_decode` (`spec_utils.spec_prepare_for_decode`, which
    reserves the verify width of KV per request): the selfspec worker chooses the step first,
    and a plain AR step takes the plain prepare instead (`SelfSpecWorker.prepare_decode`)."""
    from selfspec.sglang_ext.worker import SelfSpecWorker

    worker = SelfSpecWorker.active
    if worker is not None and worker.prepare_decode(batch):
        return None
    return original(batch, *args, **kwargs)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len",
                          _row_headroom_after, HookType.AFTER)
    HookRegistry.register("sglang.srt.speculative.spec_utils.spec_prepare_for_decode", _around_spec_prepare,
                          HookType.AROUND)


_registered = False


def register_algorithms() -> None:
    global _registered
    if _registered:
        return
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    for name in registry.SGLANG_ALGORITHMS:
        if get_spec(name) is not None:
            continue
        SpeculativeAlgorithm.register(
            name,
            supports_overlap=False,
            validate_server_args=validate_server_args,
            spec_class=SelfSpecAlgo,
        )(_worker_factory)
    _registered = True
