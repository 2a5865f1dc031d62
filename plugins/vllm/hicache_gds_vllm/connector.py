"""`HiCacheGDSConnector`: vLLM's `OffloadingConnector` with hicache-gds as its spec, where a load
that fails is recomputed instead of stopping the engine.

    --kv-transfer-config '{"kv_connector": "HiCacheGDSConnector",
        "kv_connector_module_path": "hicache_gds_vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"gds_path": "/mnt/nvme0/kv", "blocks_per_chunk": 4}}'

Why a connector and not only the spec: vLLM's `OffloadingConnector` asserts that every transfer
succeeds, so with it a page that cannot be read (EIO, a checksum mismatch, a timeout, a page
another engine evicted meanwhile) can only stop the engine. vLLM's scheduler (0.26 and 0.33)
does know how to recover: a connector reports the GPU blocks that failed to load
(`get_block_ids_with_load_errors`) and, under ``kv_load_failure_policy: "recompute"``, the
scheduler truncates the request's computed tokens at the first failed block and computes the
rest. This subclass changes nothing else:

* it selects `HiCacheGDSOffloadingSpec` unless `spec_name` says otherwise;
* it tells the spec that failed loads are recoverable, so the worker reports a failed load as
  done and hands over its blocks (`HiCacheGDSWorker.take_load_errors`), which this connector
  returns from `get_block_ids_with_load_errors`;
* it sets the scheduler's `kv_load_failure_policy` to "recompute" (vLLM's default, "fail",
  would fail the request; the scheduler reads it after building its connector);
* where the KV cache's dtype is "auto" (vLLM 0.26 reports it so), it records the model's dtype
  for the engine identity (`compat.model_dtype`);
* it fixes the seed of vLLM's block hashes where vLLM would draw it at random
  (`compat.stable_block_hashes`), so that restarted and other engines find the chunks;
* it tells the load-or-recompute model (`costmodel.py`) what it needs: each request's tokens to
  compute and GPU-cached prefix when vLLM looks it up (`manager.note_request`), the prompt tokens
  each step computes (the GPU's queue, `manager.note_scheduled`), and the prefill cost: per step
  of at least `PREFILL_SAMPLE_TOKENS` tokens, each request's new tokens and cached prefix and the
  time the engine took to run it (`manager.observe_step`, `StepClock`);
* a finished request is offloaded only as far as its KV was computed and its blocks allocated
  (`_cap_finished`). vLLM 0.26 offloads a finished request up to all of its tokens, so one
  aborted before its blocks were allocated -- a client that gave up while it waited, after a
  failed load, say -- stops the engine (`assert len(offload_keys) == len(offload_block_ids)` in
  its scheduler, seen on the GPU machine); 0.33 stops an aborted one at its computed tokens.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from . import compat
from .spec import HiCacheGDSOffloadingSpec

__all__ = ["HiCacheGDSConnector", "PREFILL_SAMPLE_TOKENS", "StepClock", "step_requests"]

log = logging.getLogger("hicache_gds_vllm")

PREFILL_SAMPLE_TOKENS = 1024  # steps this large are prefill-bound: their duration is a prefill-rate sample


class HiCacheGDSConnector(OffloadingConnector):
    """`OffloadingConnector` + `HiCacheGDSOffloadingSpec`, recomputing the blocks of failed loads."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        compat.log_through_vllm()
        ktc = vllm_config.kv_transfer_config
        extra = ktc.kv_connector_extra_config
        extra.setdefault("spec_name", HiCacheGDSOffloadingSpec.__name__)
        extra.setdefault("spec_module_path", "hicache_gds_vllm")
        if str(vllm_config.cache_config.cache_dtype) == "auto" and vllm_config.model_config is not None:
            extra.setdefault("model_dtype", str(vllm_config.model_config.dtype).removeprefix("torch."))
        if role == KVConnectorRole.SCHEDULER and ktc.kv_load_failure_policy != "recompute":
            log.info("hicache-gds-vllm: kv_load_failure_policy %r -> 'recompute': a chunk that cannot be read "
                     "from disk is computed again", ktc.kv_load_failure_policy)
            ktc.kv_load_failure_policy = "recompute"
        compat.stable_block_hashes(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None))
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None and isinstance(self.connector_worker.spec, HiCacheGDSOffloadingSpec):
            self.connector_worker.spec.recover_failed_loads = True
        self._clock = StepClock(bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)))
        manager = self._manager()
        if manager is not None and manager.cost is not None and manager.cost.prefill.chunk is None:
            manager.cost.prefill.chunk = vllm_config.scheduler_config.max_num_batched_tokens

    def _manager(self) -> Any:
        return self.connector_scheduler.manager if self.connector_scheduler is not None else None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        # docstring inherited
        manager = self._manager()
        note = getattr(manager, "note_request", None)
        if note is not None:
            note(request.request_id, request.num_tokens - num_computed_tokens, num_computed_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        # docstring inherited
        out = super().request_finished(request, block_ids)
        self._cap_finished(request)
        return out

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        # docstring inherited
        out = super().request_finished_all_groups(request, block_ids)
        self._cap_finished(request)
        return out

    def _cap_finished(self, request: Any) -> None:
        """Offload a finished request no further than its computed tokens and its allocated blocks
        (`max_offload_tokens`, which vLLM's offloading scheduler honours), where less than all of its
        tokens got blocks or it was aborted. See the module docstring."""
        sched = self.connector_scheduler
        state = getattr(sched, "_req_status", {}).get(request.request_id) if sched is not None else None
        if state is None:
            return
        try:
            bpc = sched.config.blocks_per_chunk
            groups = list(zip(sched.config.kv_group_configs, state.group_states))
            allocated = min(len(gs.block_ids) // bpc * gc.tokens_per_chunk for gc, gs in groups)
        except (AttributeError, TypeError, ZeroDivisionError, ValueError):
            return  # another layout of vLLM's state: its own bookkeeping decides
        aborted = getattr(request.status, "name", "") == "FINISHED_ABORTED"
        if not aborted and allocated >= request.num_tokens:
            return
        cap = min(int(request.num_computed_tokens), allocated)
        if state.max_offload_tokens is None or cap < state.max_offload_tokens:
            state.max_offload_tokens = cap

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose load failed since the last call (vLLM recomputes them)."""
        w = self.connector_worker.worker if self.connector_worker is not None else None
        take = getattr(w, "take_load_errors", None)
        return take() if take is not None else set()

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        # docstring inherited
        manager = self._manager()
        news, prefixes = step_requests(scheduler_output)
        sample = self._clock.scheduled(time.monotonic(), news, prefixes)
        if sample is not None and hasattr(manager, "observe_step"):
            manager.observe_step(*sample)
        if hasattr(manager, "note_scheduled"):
            manager.note_scheduled(news, prefixes)
        return super().build_connector_meta(scheduler_output)


class StepClock:
    """How long the engine took to run each scheduled step, from the times steps are scheduled.

    Without async scheduling vLLM schedules step N+1 once step N's output is in: step N took
    the time between the two. With it (vLLM's default where supported) step N+1 is scheduled
    as soon as step N is dispatched, before it runs, and step N+2 once N's output is in: step N
    took the time between N+1 and N+2 (timing N by the gap to N+1 counted nothing of it: the
    prefill rate came out ~6x too fast in a running vLLM 0.26). A step counts only where the
    engine stayed busy: the last of the steps timed shares a request with the one before it (else
    the engine may have idled between them)."""

    def __init__(self, async_scheduling: bool) -> None:
        self.lag = 2 if async_scheduling else 1
        self._steps: deque[tuple[float, dict[str, int], dict[str, int]]] = deque(maxlen=self.lag + 1)

    def scheduled(self, now: float, news: dict[str, int], prefixes: dict[str, int]
                  ) -> tuple[list[int], list[int], float] | None:
        """A step was scheduled at `now`; the prefill sample (new tokens and cached prefix per
        request, seconds) of the step it completes timing, or None."""
        self._steps.append((now, dict(news), dict(prefixes)))
        if len(self._steps) <= self.lag:
            return None
        (_, n0, p0), (t1, n1, _), (t2, n2, _) = self._steps[0], self._steps[-2], self._steps[-1]
        if sum(n0.values()) < PREFILL_SAMPLE_TOKENS or not (n1.keys() & n2.keys()):
            return None
        return list(n0.values()), [p0[r] for r in n0], t2 - t1


def step_requests(scheduler_output: Any) -> tuple[dict[str, int], dict[str, int]]:
    """Per request of a scheduled step: the tokens it computes, and the tokens it had computed
    before (vLLM 0.26 and 0.33 spell both the same)."""
    news = {str(r): int(n) for r, n in (getattr(scheduler_output, "num_scheduled_tokens", None) or {}).items()}
    prefixes: dict[str, int] = {}
    for nr in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        prefixes[nr.req_id] = int(nr.num_computed_tokens)
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        for r, n in zip(cached.req_ids, cached.num_computed_tokens):
            prefixes[r] = int(n)
    return news, {r: prefixes.get(r, 0) for r in news}
