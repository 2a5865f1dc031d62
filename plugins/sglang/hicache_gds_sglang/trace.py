"""Where a revisit's time to first token goes between the scheduler and L3: a per-request
timeline of HiCache's prefetch, for whatever storage backend is attached (ours or SGLang's own),
so two backends can be compared on the same server and prompts.

Opt-in: ``HICACHE_GDS_TRACE=1`` in the server's environment (`plugin.register` hooks the points
below only then). Each event is one INFO line of the logger ``hicache_gds_sglang.trace``::

    hicache-gds trace {"ev": "get", "rid": "p7-...", "t0": 812.40, "t": 812.93, "pages": 128, ...}

Times are ``time.perf_counter()`` seconds (the monotonic clock on Linux, which a client on the
same machine reads too). The events, by the SGLang method they are taken from (those a release
lacks are skipped, and one line says which):

* ``queued`` -- ``Scheduler._add_request_to_queue``: the request entered the waiting queue
  (``tokens``: its prompt length);
* ``query`` -- ``HiCacheController._storage_hit_query`` on the prefetch thread: the backend's
  ``batch_exists`` calls (``t0`` to ``t``; ``tokens`` found);
* ``get`` -- each of the controller's page gets (``_page_get_zero_copy`` / ``_generic_page_get``)
  on the IO thread: ``pages`` asked, ``landed`` of them, the ``backend``;
* ``transfer`` -- ``HiCacheController._page_transfer``: the IO thread's whole operation;
* ``ready`` -- 0.5.17's ``HiRadixCache.check_prefetch_progress``, first true for a request with
  a load: the scheduler has taken the loaded pages;
* ``scheduled`` -- ``Scheduler.get_new_batch_prefill``: the request is in a prefill batch.

`benchmarks/e2e/trace_report.py` turns a server log into a per-request table.
Every hook is fail-soft: a tracing error is logged once and the call goes on untouched.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

__all__ = ["ENV", "enabled", "register"]

ENV = "HICACHE_GDS_TRACE"  # known to the store's config (`hicache_gds.config.ADAPTER_ENV`) as not its own
log = logging.getLogger("hicache_gds_sglang.trace")
_failed: set[str] = set()

_CTL = "sglang.srt.managers.cache_controller.HiCacheController"
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_POINTS = {
    f"{_SCHED}._add_request_to_queue": "after_queued",
    f"{_CTL}._storage_hit_query": "around_query",
    f"{_CTL}._page_get_zero_copy": "around_get",
    f"{_CTL}._generic_page_get": "around_get",
    f"{_CTL}._page_transfer": "around_transfer",
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.check_prefetch_progress": "around_ready",
    f"{_SCHED}.get_new_batch_prefill": "after_scheduled",
}


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _emit(ev: str, rid: Any, **fields: Any) -> None:
    rec = {"ev": ev, "rid": str(rid), **fields}
    rec.setdefault("t", time.perf_counter())
    log.info("hicache-gds trace %s", json.dumps(rec, separators=(",", ":")))


def _once(what: str, exc: BaseException) -> None:
    if what not in _failed:
        _failed.add(what)
        log.warning("hicache-gds trace: %s not traced (%s: %s)", what, type(exc).__name__, exc)


def _backend_name(controller: Any) -> str:
    return str(getattr(controller, "storage_backend_type", None) or type(getattr(controller, "storage_backend",
                                                                                  None)).__name__)


def _landed(out: Any, controller: Any, operation: Any, before: int) -> int:
    """Pages a get or transfer landed: 0.5.23's return them, 0.5.17's count tokens into the
    operation (`before`: its count when the call began)."""
    if isinstance(out, int):
        return out
    return (int(operation.completed_tokens) - before) // max(1, int(getattr(controller, "page_size", 1)))


def after_queued(result: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    try:
        _emit("queued", req.rid, tokens=len(getattr(req, "origin_input_ids", ()) or ()))
    except Exception as exc:  # noqa: BLE001
        _once("queued", exc)
    return None


def around_query(original: Any, controller: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
    t0 = time.perf_counter()
    out = original(controller, operation, *args, **kwargs)
    try:
        _emit("query", operation.request_id, t0=t0, tokens=int(out[1]), backend=_backend_name(controller))
    except Exception as exc:  # noqa: BLE001
        _once("query", exc)
    return out


def around_get(original: Any, controller: Any, operation: Any, hash_values: Any, *args: Any, **kwargs: Any) -> Any:
    before = getattr(operation, "completed_tokens", 0)
    t0 = time.perf_counter()
    out = original(controller, operation, hash_values, *args, **kwargs)
    try:
        _emit("get", operation.request_id, t0=t0, pages=len(hash_values),
              landed=_landed(out, controller, operation, before), backend=_backend_name(controller))
    except Exception as exc:  # noqa: BLE001
        _once("get", exc)
    return out


def around_transfer(original: Any, controller: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
    t0 = time.perf_counter()
    out = original(controller, operation, *args, **kwargs)
    try:
        _emit("transfer", operation.request_id, t0=t0, landed=_landed(out, controller, operation, 0),
              pages=len(getattr(operation, "hash_value", None) or ()))
    except Exception as exc:  # noqa: BLE001
        _once("transfer", exc)
    return out


def around_ready(original: Any, cache: Any, req_id: Any, *args: Any, **kwargs: Any) -> Any:
    had = req_id in getattr(cache, "ongoing_prefetch", {})
    done = original(cache, req_id, *args, **kwargs)
    try:
        if had and done:
            _emit("ready", req_id, tokens=int(getattr(cache, "prefetch_loaded_tokens_by_reqid", {}).get(req_id, 0)))
    except Exception as exc:  # noqa: BLE001
        _once("ready", exc)
    return done


def after_scheduled(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    try:
        batch = getattr(result, "batch_to_run", result)  # a NextBatchPlan (0.5.17, 0.5.23), else the batch
        for req in getattr(batch, "reqs", None) or ():
            if not getattr(req, "_hgds_traced", False):
                req._hgds_traced = True
                pi = getattr(req, "prefix_indices", None)  # a tensor of slots: never its truth value
                _emit("scheduled", req.rid, prefix=0 if pi is None else len(pi),
                      extend=int(getattr(req, "extend_input_len", 0) or 0))
    except Exception as exc:  # noqa: BLE001
        _once("scheduled", exc)
    return None


def register(registry: Any, hook_type: Any, resolve: Any) -> list[str]:
    """Hook the points that exist in this SGLang (`resolve(path)` is None where one does not);
    returns the ones hooked."""
    hooked, missing = [], []
    for path, name in _POINTS.items():
        if resolve(path) is None:
            missing.append(path)
            continue
        hook = globals()[name]
        registry.register(path, hook, hook_type.AFTER if name.startswith("after_") else hook_type.AROUND)
        hooked.append(path)
    log.info("hicache-gds trace: on (%s); %d points hooked%s", ENV, len(hooked),
             f", absent here: {', '.join(p.rsplit('.', 2)[-2] + '.' + p.rsplit('.', 1)[1] for p in missing)}"
             if missing else "")
    return hooked
