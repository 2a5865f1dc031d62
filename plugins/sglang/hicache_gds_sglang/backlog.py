"""Backlogs: the seconds of work ahead of a request on the GPU and on the disk.

The GPU backlog sums the prefill batches launched and not yet finished (`prefill.PrefillClock`),
the chunked request's chunks not yet launched (less what a split's tail is forecast to join), and
the waiting queue, each request at what its decision leaves it to prefill; it is summed once per
scheduler pass (`BACKLOG_TTL_S`), and as it walks the queue it notes the decided requests still
waiting and drops those that left. The disk backlog sums the loads in flight, one after another,
at the cost model's read rate.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hicache_gds import CostModel

from . import view
from .records import Backlog, DiskSlot, Queued

__all__ = ["BACKLOG_TTL_S", "gpu_backlog", "disk_backlog"]

log = logging.getLogger("hicache_gds_sglang.policy")

BACKLOG_TTL_S = 0.005  # one scheduler pass: the waiting queue's backlog is summed once per pass


def _compute_s(pol: Any, model: CostModel, rid: str, req: Any) -> float:
    """Seconds of prefill a queued request takes, as its decision leaves it."""
    d = pol.decided.get(rid)
    if d is not None:
        if d.loads:
            return model.predict_compute(d.new - d.hit, d.held + d.hit) or 0.0
        if d.action == "split":
            got = _joined_after(pol, rid, 0)
            return (model.predict_compute(d.hit, d.held) or 0.0) + (
                model.predict_compute(d.new - d.hit - got, d.held + d.hit + got) or 0.0)
        return model.predict_compute(d.new, d.held) or 0.0
    new, held = view.req_work(req)
    return model.predict_compute(new, held) or 0.0


def _joined_after(pol: Any, rid: str, upto: int) -> int:
    """Tokens past position `upto` of split request `rid` that its tail is forecast to bring (the
    join adds them to its prefix): prefill its chunks will not compute."""
    t = pol.tails.get(rid)
    if t is None:
        return 0
    end = t.load.start + min(t.load.expect, t.load.tokens)
    return max(0, end - max(upto, t.load.start))


def gpu_backlog(pol: Any, cache: Any, model: CostModel) -> tuple[dict[str, float], float]:
    """Seconds of prefill ahead of each queued request (by rid), and of the whole queue."""
    sched = pol.scheduler()
    now = time.monotonic()
    if sched is None:
        return {}, pol.clock.in_flight(time.perf_counter())
    queue = view.waiting(sched)
    chunked = view.chunked(sched)
    key = view.queue_key(sched)
    cached = pol.backlog
    if cached is not None and cached.key == key and now - cached.at < BACKLOG_TTL_S:
        return cached.ahead, cached.ahead.get("", 0.0)
    acc = pol.clock.in_flight(time.perf_counter())
    if chunked is not None:
        new, held = view.req_work(chunked)
        # its chunks on the GPU are counted above (SGLang may not have cached them yet)
        crid = view.rid(chunked)
        through = pol.clock.launched_through(crid)
        if through > held:
            new, held = max(0, new - (through - held)), through
        # a split request computes its head in chunks: what its tail brings is not prefill (counted
        # whole, a burst's first request, split, put its tail's compute ahead of every later admission)
        new = max(0, new - _joined_after(pol, crid, held))
        acc += model.predict_compute(new, held) or 0.0
    ahead: dict[str, float] = {}
    live = set()
    for req in queue:
        rid = view.rid(req)
        live.add(rid)
        ahead[rid] = acc
        acc += _compute_s(pol, model, rid, req)
        if rid in pol.decided:
            q = pol.queued.get(rid)
            if q is None:
                pol.queued[rid] = Queued(req, now, now)
            else:
                q.last = now
    ahead[""] = acc
    loading = view.loading_rids(cache)
    for rid in [r for r in pol.decided if r not in live and r not in loading]:
        _left_queue(pol, rid)
        del pol.decided[rid]
        pol.late.discard(rid)
    for rid in [r for r in pol.loads if r not in loading]:
        w = pol.loads.pop(rid)
        pol.counts["unseen"] += 1
        log.info("hicache-gds policy: %s load left SGLang's prefetches after %.3f s unseen by the policy (revoked "
                 "for want of host memory or of hits, or settled without asking); host pool %s tokens free", rid,
                 now - w.since, view.host_free(cache))
    pol.backlog = Backlog(key, ahead, now)
    return ahead, acc


def _left_queue(pol: Any, rid: str) -> None:
    """A decided request left the waiting queue (scheduled, or aborted): one INFO line with
    what it held then against what was decided, so a log shows a load whose pages did not
    survive until the GPU took the request (evicted from the host pool, revoked)."""
    q = pol.queued.pop(rid, None)
    if q is None:
        return
    d = pol.decided[rid]
    log.info("hicache-gds policy: %s left the queue after %.3f s holding %d tokens (%d on host) of %d new; "
             "decided %s with %d in L3", rid, q.last - q.first, view.on_gpu(q.req), view.host_hit(q.req), d.new,
             d.action, d.hit)


def disk_backlog(cache: Any, model: CostModel, backend: Any) -> tuple[dict[str, DiskSlot], float]:
    """Per loading request (by rid) its `DiskSlot` -- loads run one after another, in order --
    and the seconds of the whole disk queue."""
    out: dict[str, DiskSlot] = {}
    acc = 0.0
    ps = view.page_size(cache)
    for ld in view.loads(cache):
        kept = view.kept(ld.op)
        fetched = kept + backend.read_progress(view.host_indices(ld.op)) * ps
        rem = max(0, ld.hit - fetched)
        acc += model.predict_load(rem * model.bytes_per_token) or 0.0
        out[ld.rid] = DiskSlot(acc, ld.hit, kept, fetched)
    return out, acc
