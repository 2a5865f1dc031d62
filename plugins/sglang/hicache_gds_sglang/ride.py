"""Loaded requests ride along a chunked compute (``policy_ride``; off by default until it is
measured in a running server).

While SGLang computes a long prompt in chunks, each pass gives the whole chunk budget
(``--chunked-prefill-size``) to that chunked request before it looks at the waiting queue, so a
request whose L3 load has finished waits on the host, holding host-pool room the disk's next
loads need, until the last chunk is launched, although it needs only the few tokens past its hit
computed. And while such a pass is formed SGLang runs no decode step, so requests that have
finished their prefill keep their GPU memory meanwhile, even those a few tokens from their end:
on the H200 (8B shape, a 49,152-token GPU pool) loaded requests of a burst of 8 waited up to
1.6 s so (run 27's server logs, `benchmarks/results/gpu-h200-run28/NOTES.md`).

So, where a chunked request is about to take its next chunk (`around_chunk`, inside the hold's
hook on ``PrefillAdder.add_chunked_req``, both releases) and finished loads are waiting (the
riders: decided ``load``, read whole, in queue order):

* where the first rider's GPU memory is not there now but would be once the running requests
  that are at most `YIELD_STEPS` decode steps from their end finish, the pass is held
  (`view.hold_batch`: no prefill batch, so SGLang runs a decode step), at most `YIELD_STEPS`
  passes for one rider;
* otherwise the chunked request's chunk is shortened by what the riders that fit in GPU memory
  need (each its tokens past its hit, whole pages, at most `RIDE_SHARE` of the chunk together),
  and for the rest of the pass only riders may be added, each only whole and within its own seat
  (`around_add_one_req`: another request is skipped this pass, as it would have found no budget
  left, and a rider SGLang would have to chunk is skipped too, since a pass has one chunked
  request).

On a multi-rank server each rank forms its batch itself, so every rank's plan is a vote
(`ranks.ride`, each pass a chunked request takes its next chunk): the pass waits a decode step
where every rank would, for the same request, and each finished load gets the smallest seat any
rank gives it (none where one rank gives none), among the first `ranks.VOTES` waiting requests.
Off for a hybrid (SWA, Mamba) or dLLM adder, and where no chunk budget is set.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from . import ranks, view

__all__ = ["RIDE_SHARE", "YIELD_STEPS", "NEVER_CHUNK", "SEATS", "can_ride", "riders", "around_chunk",
           "around_add_one_req"]

log = logging.getLogger("hicache_gds_sglang.policy")

RIDE_SHARE = 0.25  # of a pass's chunk budget riders may take together
YIELD_STEPS = 8  # decode steps a running request may still have for its memory to count as coming back
NEVER_CHUNK = 1 << 40  # a truncation_align_size no chunk reaches: SGLang 0.5.17 then refuses to chunk
SEATS = "_hicache_gds_ride"  # on the adder for one pass: {rid: tokens} of the riders it may add


def can_ride(pol: Any, cache: Any, adder: Any) -> bool:
    """Rides and yields are on and the adder is a plain one with a chunk budget (the same answer
    on every rank)."""
    cfg = getattr(view.backend_of(cache), "policy_config", None)
    if not getattr(cfg, "ride", False):
        return False
    if getattr(adder, "rem_chunk_tokens", None) is None or getattr(adder, "dllm_config", None) is not None:
        return False
    return not (getattr(adder, "is_hybrid_swa", False) or getattr(adder, "is_hybrid_ssm_cache", False)
                or getattr(adder, "rem_mamba_slots", None) is not None)


def _pages(n: int, ps: int) -> int:
    return -(-max(0, int(n)) // ps) * ps


def riders(pol: Any, cache: Any, queue: list, chunked: Any) -> list[tuple[Any, int, int]]:
    """(request, tokens to compute past its hit in whole pages, GPU tokens it needs) for each
    waiting request whose load is read whole, in queue order."""
    ps = view.page_size(cache)
    done = {ld.rid for ld in view.loads(cache) if view.loaded_done(cache, ld.op)}
    out = []
    for req in queue:
        rid = view.rid(req)
        d = pol.decided.get(rid)
        if req is chunked or d is None or not d.loads or not (rid in pol.protected or rid in done):
            continue
        got = pol.protected[rid].tokens if rid in pol.protected else d.hit
        extend = _pages(d.new - got, ps) + ps  # a page more: SGLang's alignment of what is left
        max_new = min(int(getattr(getattr(req, "sampling_params", None), "max_new_tokens", 0) or 0), _clip())
        left, _ = view.req_work(req)  # SGLang's need: every token not on the GPU, its decode, a page
        out.append((req, extend, left + view.host_hit(req) + max_new + ps))
    return out


def _clip() -> int:
    """SGLang's cap on the decode tokens a prefill reserves memory for."""
    try:
        from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS
        return int(CLIP_MAX_NEW_TOKENS)
    except (ImportError, AttributeError, TypeError, ValueError):
        return 4096


def _free_soon(adder: Any) -> int:
    """GPU tokens the running requests at most `YIELD_STEPS` decode steps from their end hold."""
    rb = getattr(adder, "running_batch", None)
    freed = 0
    for r in list(getattr(rb, "reqs", None) or ()):
        out = len(getattr(r, "output_ids", None) or ())
        left = int(getattr(getattr(r, "sampling_params", None), "max_new_tokens", 0) or 0) - out
        if 0 <= left <= YIELD_STEPS:
            freed += len(getattr(r, "origin_input_ids", None) or ()) + out
    return freed


def _plan(pol: Any, cache: Any, adder: Any, req: Any, can_hold: bool) -> tuple[str, Any]:
    """("hold", (the first rider, GPU tokens it needs, free beside the chunk, held by running
    requests near their end)) where the pass waits a decode step; ("seats", {rid: tokens})
    for the riders the chunk leaves room to; ("none", None) for SGLang's own pass."""
    sched = pol.scheduler()
    rem = adder.rem_chunk_tokens
    found = riders(pol, cache, view.waiting(sched), req) if sched is not None and rem > 0 else []
    live = {view.rid(r) for r, _, _ in found}
    for rid in [r for r in pol.ride_yields if r not in live]:
        del pol.ride_yields[rid]
    if not found:
        return "none", None
    ps = view.page_size(cache)
    room = getattr(adder, "rem_total_tokens", None)
    room = None if room is None else int(room) - _pages(rem, ps) - ps  # less what this chunk takes
    first, _, first_need = found[0]
    if room is not None and first_need > room and can_hold and pol.ride_yields.get(view.rid(first), 0) < YIELD_STEPS:
        freed = _free_soon(adder)
        if first_need <= room + freed:
            return "hold", (first, first_need, room, freed)
    budget, seats = int(rem * RIDE_SHARE) // ps * ps, {}
    for r, extend, need in found:
        if extend > budget or (room is not None and need > room):
            break
        seats[view.rid(r)] = extend
        budget -= extend
        if room is not None:
            room -= need
    return ("seats", seats) if seats else ("none", None)


def _agreed(pol: Any, cache: Any, kind: str, plan: Any) -> tuple[str, Any]:
    """The plan every rank takes (`ranks.ride`), from this rank's `kind` and `plan`."""
    queue = view.waiting(pol.scheduler())[:ranks.VOTES]
    names = [view.rid(r) for r in queue]
    hold_at = names.index(view.rid(plan[0])) if kind == "hold" and view.rid(plan[0]) in names else None
    mine = [plan.get(name, 0) if kind == "seats" else 0 for name in names]
    at, seats = ranks.ride(cache, names, hold_at, mine)
    if at is not None:  # every rank voted to hold for this request (its own plan says why)
        return "hold", plan if kind == "hold" else (queue[at], -1, -1, -1)
    agreed = {name: s for name, s in zip(names, seats) if s > 0}
    return ("seats", agreed) if agreed else ("none", None)


def around_chunk(pol: Any, cache: Any, adder: Any, req: Any, can_hold: bool,
                 add: Callable[[], Any]) -> Any:
    """The chunked request `req`'s next chunk, formed by `add` (SGLang's method, cut where its
    split head ends): held for a decode step, or shortened for riders (module docstring)."""
    try:
        kind, plan = _plan(pol, cache, adder, req, can_hold)
    except Exception as exc:  # noqa: BLE001 -- SGLang's own pass: finished loads wait for the chunk
        view.once("ride-plan", "hicache-gds policy: no ride along a chunk (%s: %s); finished loads wait for it",
                  type(exc).__name__, exc)
        kind, plan = "none", None
    if ranks.multi(cache):  # every rank reaches this step: its plan is a vote
        kind, plan = _agreed(pol, cache, kind, plan)
    if kind == "hold":
        first, need, room, freed = plan
        rid = view.rid(first)
        pol.ride_yields[rid] = pol.ride_yields.get(rid, 0) + 1
        pol.counts["ride_yield"] += 1
        log.info("hicache-gds policy: %s's next chunk waits a decode step: loaded %s needs %d GPU tokens, %d are "
                 "free beside the chunk, running requests near their end hold %d", view.rid(req), rid, need, room,
                 freed)
        view.hold_batch(adder)
        return req
    if kind != "seats":
        return add()
    reserve = sum(plan.values())
    rem = adder.rem_chunk_tokens
    adder.rem_chunk_tokens = rem - reserve
    try:
        out = add()
    finally:
        left = adder.rem_chunk_tokens
        adder.rem_chunk_tokens = (left if left is not None else 0) + reserve
    if out is not None:  # still the chunked request: only riders may use what is left this pass
        setattr(adder, SEATS, plan)
        log.debug("hicache-gds policy: %s's chunk leaves %d tokens to %d loaded requests", view.rid(req), reserve,
                  len(plan))
    return out


def around_add_one_req(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """``PrefillAdder.add_one_req`` in a pass whose chunk left room to riders: a rider is added
    whole or skipped, anything else skipped (``CONTINUE``: the scheduler goes on to the next
    waiting request); in any other pass SGLang's own (`original`)."""
    seats = getattr(adder, SEATS, None)
    if seats is None:
        return original(adder, req, *args, **kwargs)
    rid = view.rid(req)
    from sglang.srt.managers.schedule_policy import AddReqResult

    if rid not in seats:
        return AddReqResult.CONTINUE
    seat = seats.pop(rid)
    before = len(adder.can_run_list)
    rem = adder.rem_chunk_tokens
    cap = min(rem, seat)
    adder.rem_chunk_tokens = cap  # its own seat: a rider never takes the next one's
    try:
        # whole or not at all: no chunk is as long as NEVER_CHUNK's alignment, so SGLang refuses to chunk it
        res = original(adder, req, has_chunked_req=True, truncation_align_size=NEVER_CHUNK)
    finally:
        adder.rem_chunk_tokens = rem - (cap - adder.rem_chunk_tokens)
    if len(adder.can_run_list) > before and adder.can_run_list[-1] is req:
        pol = view.attached(getattr(adder, "tree_cache", None))
        if pol is not None:
            pol.counts["ride"] += 1
        fill = getattr(req, "full_untruncated_fill_ids", None)
        log.info("hicache-gds policy: %s rides along the chunked request's pass (%d tokens past its prefix of %d)",
                 rid, len(fill) - view.on_gpu(req) if fill is not None else -1, view.on_gpu(req))
        return res if res != AddReqResult.OTHER or not seats else AddReqResult.CONTINUE
    return res if res == AddReqResult.NO_TOKEN else AddReqResult.CONTINUE
