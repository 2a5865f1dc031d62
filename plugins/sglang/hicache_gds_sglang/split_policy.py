"""The policy's side of a split (`split` moves the pages): when a hit may be split, starting its
tail, joining it where the request's chunks reach it, holding the request there until its tail
is read where that finishes it first (`park`), and dropping the tails of requests gone.

On by `PolicyConfig.split` where this SGLang has the join point (`SPLIT_HOOKED`, set by the
plugin's hook table) and the cache has what `split` uses; on a multi-rank server every step is
agreed by the ranks (`ranks`: the split and its head, the tail's start, each join or hold verdict
and the tokens joined, the hold's end), each voting from its own rates and reads. A request is held
where SGLang adds a chunked request's next chunk (`PARK_HOOKED`; SGLang's own path for a parked
chunk: the request stays the scheduler's chunked request and the GPU runs what else waits), at
most `PARK_LATE_FACTOR` times its tail's forecast (plus `PARK_SLACK_S`): a tail that reads late
joins with what it has, and the request computes the rest.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hicache_gds import CostModel

from . import cut, ranks, view
from . import split as split_mod
from .records import Decided, Tail

__all__ = ["SPLIT_HOOKED", "PARK_HOOKED", "may_split", "can_split", "can_park", "tail_pages", "start_tail", "join_tail", "park",
           "drop_tail", "sweep_tails"]

log = logging.getLogger("hicache_gds_sglang.policy")

SPLIT_HOOKED = [False]  # the join point of a split (0.5.17 ``cache_unfinished_req``, 0.5.23 ``stash_chunked_request``)
PARK_HOOKED = [False]  # where a chunked request is held (``PrefillAdder.add_chunked_req``, both releases) is hooked
PARK_LATE_FACTOR, PARK_SLACK_S = 1.5, 0.1  # a request is held at most this much past its tail's forecast
PARK_CHECK_S = 0.002  # a held request's tail is looked at no more often


def may_split(cache: Any) -> bool:
    """Splits are on and this SGLang has what they use (the same answer on every rank: where
    ranks agree a split, `ranks.split_plan`, this gates the agreement)."""
    backend = view.backend_of(cache)
    return bool(backend is not None and backend.policy_config.split != "off" and SPLIT_HOOKED[0]
                and split_mod.supported(cache))


def can_split(pol: Any, cache: Any, backend: Any) -> bool:
    """Splits are on, this SGLang has what they use, and the scheduler chunks prefills (on a
    multi-rank server each rank proposes, and the ranks agree: `ranks.split_plan`)."""
    return bool(backend.policy_config.split != "off" and SPLIT_HOOKED[0] and pol.prefill.chunk
                and split_mod.supported(cache))


def can_park(backend: Any) -> bool:
    """A split request may be held after its head until its tail is read (`park`)."""
    return bool(PARK_HOOKED[0] and getattr(backend.policy_config, "split_park", False))


def tail_pages(cache: Any, backend: Any, model: CostModel) -> int | None:
    """Pages per operation (and get) of a split's tail (`split.tail_pages`; None: the tail is
    one operation, read in SGLang's own gets)."""
    ps = view.page_size(cache)
    threshold = -(-view.threshold(cache) // ps)
    return split_mod.tail_pages(int(model.bytes_per_token * ps), backend.policy_config.split_get, threshold)


def split_args(pol: Any, cache: Any, backend: Any, model: CostModel, weigh: bool) -> dict[str, Any]:
    """`CostModel.decide`'s split arguments for an admission that may weigh a split (`weigh`,
    and `can_split`): the chunk its head is computed in, whether it may park or cut, and the
    grain its tail is read in; none where it may not."""
    chunk = pol.prefill.chunk if weigh and can_split(pol, cache, backend) else None
    if not chunk:
        return {"split_chunk": None}
    pages = tail_pages(cache, backend, model) or split_mod.batch_pages()
    return {"split_chunk": chunk, "split_park": can_park(backend), "split_cut": cut.can_cut(backend),
            "split_grain": pages * view.page_size(cache)}


def start_tail(pol: Any, cache: Any, rid: str, last_host_node: Any, tokens: Any, last_hash: Any,
               prefix_keys: Any) -> bool:
    """Admission chose a split for `rid`: prefetch the tail of its hit. False (and the request
    is a plain recompute) where the tail cannot be started."""
    plan = pol.split_plans.pop(rid, None)
    req = pol.current_req if pol.current_req is not None and view.rid(pol.current_req) == rid else None
    if plan is None or req is None or rid in pol.tails:
        return False
    matched = view.on_gpu(req) + view.host_hit(req)
    backend, model = view.backend_of(cache), pol.cost_model
    # A tail forecast read whole by the join (a held request waits for it) is read as one
    # operation, in SGLang's own gets: read in gets of `split_get`, one after another, the tails
    # of held requests on the GPU machine read at 0.4-0.8x a whole load's rate, ran past their
    # hold limit, and taught the read rate those slower gets
    whole = plan.expect >= plan.hit - plan.head
    per_op = None if backend is None or model is None or whole else tail_pages(cache, backend, model)
    tail = split_mod.start(cache, rid, last_host_node, tokens, last_hash, prefix_keys, matched=matched,
                           head=plan.head, expect=plan.expect, pages_per_op=per_op, req=req)
    if tail is None:
        d = pol.decided.get(rid)
        if d is not None:
            pol.decided[rid] = Decided("compute", d.new, d.held, plan.hit)
        return False
    pol.tails[rid] = Tail(tail, req)  # until it joins or is swept: the request may leave meanwhile
    return True


def join_tail(pol: Any, cache: Any, req: Any) -> int:
    """SGLang cached the chunks of `req`: once they reach its tail, join the pages read (or wait
    one more chunk, where the disk reads the rest before the GPU computes it and that finishes
    first). Returns the tokens joined."""
    rid = view.rid(req)
    entry = pol.tails.get(rid)
    if entry is None:
        return 0
    tail = entry.load
    cached = view.cached_prefix(req)
    if cached < tail.start:
        return 0
    multi = ranks.multi(cache)
    try:
        read, complete, alive = split_mod.progress(cache, tail)
        started = split_mod.reading(cache, tail)
        verdict = ranks.JOIN
        if complete and multi:
            verdict = ranks.HOLD  # read whole here: the ranks still reading decide (the agreement's minimum)
        elif alive and not complete:
            backend = view.backend_of(cache)
            if backend is not None and can_park(backend) and _hold_pays(pol, req, tail, cached, read, started):
                verdict = ranks.HOLD  # held where SGLang adds the chunk (`park`), which joins the tail once read
            elif _wait_for_tail(pol, req, tail, cached, read, started):
                verdict = ranks.WAIT
    except Exception as exc:  # noqa: BLE001 -- alone: the hook drops the tail; with peers: a vote to drop it
        if not multi:
            raise
        view.once("split-look", "hicache-gds policy: a split tail's progress could not be read (%s: %s); it is "
                  "dropped on every rank", type(exc).__name__, exc)
        read, complete, alive, verdict = 0, False, False, ranks.JOIN
    if multi:
        read, complete, alive, verdict = ranks.tail(cache, read, complete, alive or complete, verdict)
        if complete or not alive:  # read whole on every rank, or failed on one: join what every rank read
            verdict = ranks.JOIN
    if verdict == ranks.HOLD:
        pol.parked[rid] = time.monotonic() + _hold_limit(pol, tail, read)
        return 0
    if verdict == ranks.WAIT:
        return 0
    return _join(pol, cache, req, tail, cached, read, limit=read if multi else None)


def park(pol: Any, cache: Any, req: Any, *, hold: bool = True) -> bool:
    """Where SGLang adds a chunked request's next chunk: True holds `req` this pass (its split
    tail is still being read, waiting for it finishes the request first, and the hold is within
    its limit); otherwise (or where the pass cannot be held: `hold`) the tail joins here, with
    what is read, and the request runs on."""
    rid = view.rid(req)
    until = pol.parked.get(rid)
    entry = pol.tails.get(rid)
    if until is None or entry is None:
        pol.parked.pop(rid, None)
        return False
    now = time.monotonic()
    multi = ranks.multi(cache)
    if not multi and hold and now < pol.park_checked.get(rid, 0.0) + PARK_CHECK_S and now < until:
        return True  # looked less than PARK_CHECK_S ago: the idle scheduler asks every pass (alone: a timer)
    pol.park_checked[rid] = now
    tail = entry.load
    cached = view.cached_prefix(req)
    try:
        read, complete, alive = split_mod.progress(cache, tail)
        started = split_mod.reading(cache, tail)
        if multi:  # a rank whose tail is read whole votes to hold on: the ranks still reading decide
            stay = bool(hold and cached >= tail.start and now < until and
                        (complete or (alive and _hold_pays(pol, req, tail, cached, read, started))))
        else:
            stay = bool(hold and alive and not complete and cached >= tail.start and now < until
                        and _hold_pays(pol, req, tail, cached, read, started))
    except Exception as exc:  # noqa: BLE001 -- alone: the hook drops the tail; with peers: a vote to end the hold
        if not multi:
            raise
        view.once("split-look", "hicache-gds policy: a split tail's progress could not be read (%s: %s); it is "
                  "dropped on every rank", type(exc).__name__, exc)
        read, complete, alive, stay = 0, False, False, False
    if multi:  # the hold ends on every rank when one rank's ends (its tail failed, its limit passed)
        read, complete, alive, verdict = ranks.tail(cache, read, complete, alive or complete,
                                                    ranks.HOLD if stay else ranks.JOIN)
        stay = verdict == ranks.HOLD and alive and not complete
    if stay:
        return True
    if hold and alive and not complete and now >= until:
        log.info("hicache-gds policy: %s split tail still reading %.3f s past its forecast: %d of %d tokens "
                 "join, the rest is computed", rid, now - until, read, tail.tokens)
    del pol.parked[rid]
    pol.park_checked.pop(rid, None)
    if cached < tail.start:
        return False
    grown = _join(pol, cache, req, tail, cached, read, limit=read if multi else None)
    if grown > 0:
        view.refresh_next_round(req)  # SGLang formed its next round before the prefix grew
    return False


def _hold_pays(pol: Any, req: Any, tail: "split_mod.TailLoad", cached: int, read: int, started: bool = True) -> bool:
    """Waiting for the rest of the tail, then computing what follows it, finishes before
    computing on from what is read now. Both wait for the chunk that ends at `cached` where the
    GPU still runs it (`_head_in_flight`), and the disk reads on meanwhile."""
    costs = _tail_costs(pol, req, tail, cached, read, started)
    if costs is None:
        return False
    io_left, later, now = costs
    busy = _head_in_flight(pol, req, cached)
    return max(io_left, busy) + later < busy + now


def _head_in_flight(pol: Any, req: Any, cached: int) -> float:
    """Seconds until the GPU finishes the prefill batches launched so far, where one of them
    computes `req` up to `cached` (0 once it ran). SGLang's overlapped scheduler reaches the join
    point as it launches the head's last chunk: measured from there, a balanced split's tail
    (read in about the head's compute) looked slower than computing on, and an H200 run dropped
    the whole tail of the first request of each measurement 0.03 s after admission."""
    clock = getattr(pol, "clock", None)
    if clock is None:
        return 0.0
    try:
        if clock.launched_through(view.rid(req)) < cached:
            return 0.0
        return float(clock.in_flight(time.monotonic()))
    except Exception:  # noqa: BLE001 -- no timing: judged as if the chunk had run
        return 0.0


def _tail_costs(pol: Any, req: Any, tail: "split_mod.TailLoad", cached: int,
                read: int, started: bool = True) -> tuple[float, float, float] | None:
    """Seconds to read the rest of the tail, to compute what follows the whole tail, and to
    compute on from what is read now (None where a rate is unknown).

    SGLang counts a tail's pages a get at a time, so `read` stays 0 until the first get returns
    while the disk has been reading since the tail started: the time left is at most the whole
    tail's forecast less the time since then (a virtio run's 6,464-token tail, one get, was
    judged 0.57 s from its end 0.26 s into its read, and dropped). Only once its reads are under
    way (`started`: `split.reading`): a tail the disk has not queried yet has read nothing."""
    model = pol.cost_model
    if model is None:
        return None
    n = sum(view.req_work(req))  # the request's tokens: left to prefill and held
    frontier = max(cached, tail.start + read)
    io_left = model.predict_load((tail.end - tail.start - read) * model.bytes_per_token)
    whole = model.predict_load((tail.end - tail.start) * model.bytes_per_token)
    if io_left is not None and whole is not None and started:
        io_left = min(io_left, max(0.0, whole - (time.monotonic() - tail.since)))
    later = model.predict_compute(n - tail.end, tail.end)
    now = model.predict_compute(n - frontier, frontier)
    return None if None in (io_left, later, now) else (io_left, later, now)


def _hold_limit(pol: Any, tail: "split_mod.TailLoad", read: int) -> float:
    """Seconds a request may be held for its tail: the forecast of the rest, with room."""
    model = pol.cost_model
    left = None if model is None else model.predict_load((tail.tokens - read) * model.bytes_per_token)
    return (left or 0.0) * PARK_LATE_FACTOR + PARK_SLACK_S


def _join(pol: Any, cache: Any, req: Any, tail: "split_mod.TailLoad", cached: int, read: int,
          limit: int | None = None) -> int:
    """Join the tail's pages read (at most `limit` tail tokens: what every rank read)."""
    rid = view.rid(req)
    head = req.last_node
    grown = split_mod.join(cache, req, tail, limit=limit)  # where it raises, the hook drops the tail (`drop_tail`)
    del pol.tails[rid]
    if grown > 0:
        g = split_mod.guard_head(cache, head, req)
        if g is not None:
            pol.guards.append(g)
        pol.counts["split_joined"] += 1
        pol.counts["split_tokens"] += grown
        view.count_storage_tokens(req, grown)
    else:
        pol.counts["split_dropped"] += 1
    log.info("hicache-gds policy: %s split joined %d of its %d tail tokens at %d (%d read, forecast %d; %.3f s "
             "after admission; %d prefetch operations)", rid, grown, tail.tokens, cached, read, tail.expect,
             time.monotonic() - tail.since, len(tail.keys))
    return grown


def _wait_for_tail(pol: Any, req: Any, tail: "split_mod.TailLoad", cached: int, read: int,
                   started: bool = True) -> bool:
    """Whether to compute one more chunk before joining: the disk reads the rest of the tail
    before the GPU computes that chunk, and that finishes the request first."""
    chunk = pol.prefill.chunk
    model = pol.cost_model
    if not chunk or model is None or cached + chunk >= tail.end:
        return False
    costs = _tail_costs(pol, req, tail, cached, read, started)
    c_chunk = model.predict_compute(chunk, cached)
    if costs is None or c_chunk is None:
        return False
    io_left, later, now = costs
    return io_left <= c_chunk and c_chunk + later < now


def drop_tail(pol: Any, cache: Any, rid: str) -> None:
    """Drop the tail of `rid` (after a failed join): its reads stop and its host memory is freed."""
    entry = pol.tails.pop(rid, None)
    pol.parked.pop(rid, None)
    pol.park_checked.pop(rid, None)
    if entry is not None:
        split_mod.cancel(cache, entry.load)


def sweep_tails(pol: Any, scheduler: Any) -> None:
    """Drop the tails of requests no longer waiting or being chunked (finished, aborted, or
    prefilled past them without a join), and release the heads of joined tails SGLang has
    backed up (`split.HeadGuard`)."""
    if pol.guards:
        _settle_guards(pol, view.tree_cache(scheduler))
    if not pol.tails:
        return
    cache = view.tree_cache(scheduler)
    chunked = view.chunked(scheduler)
    waiting = {id(r) for r in view.waiting(scheduler)}
    for rid, (tail, req) in list(pol.tails.items()):
        if (req is chunked or id(req) in waiting) and not view.is_finished(req):
            continue
        del pol.tails[rid]
        pol.parked.pop(rid, None)
        pol.park_checked.pop(rid, None)
        if cache is not None:
            split_mod.cancel(cache, tail)
        pol.counts["split_dropped"] += 1
        log.info("hicache-gds policy: %s split tail of %d tokens dropped: the request left before its chunks "
                 "reached it", rid, tail.tokens)


def _settle_guards(pol: Any, cache: Any) -> None:
    if cache is None:
        return
    keep = []
    for g in pol.guards:
        if not split_mod.settle_guard(cache, g, view.is_finished(g.req)):
            keep.append(g)
    pol.guards = keep
