"""Waiting for host room: a load turned down only because the host pool is full waits for room
instead of being recomputed, while waiting still finishes first.

A load is read into host memory and keeps it until the GPU takes the request
(`host.protect`), so admission turns a load down where the host pool cannot keep its hit
(`policy.admission_verdict`), and the request is computed. Where a token's KV is small and its
prefill slow that costs far more than it saves: on the H200, a burst of 8 DeepSeek-V3-shaped
(MLA, 6,912 bytes of KV per token) prompts recomputed three of them (54k tokens, 10 s of the
GPU) because the four loads admitted before them held the host pool, and those loads had landed
within a second. SGLang offers no "later" at admission, but it skips a waiting request whose
``check_prefetch_progress`` says not ready, as it does for a load in flight.

So such a request is held (`holds`: the check says not ready) until the host pool has room for
its hit, when it is prefetched through SGLang's own path (`take`: ``Scheduler._prefetch_kvcache``,
which asks admission again, now with room; after each prefill batch is formed, every held request
that fits, in queue order), or until its deadline, when it is computed as admission said. "Room"
is the host pool's (`host.host_room`) and the prefetches' share of it (`host.share_full`: SGLang
drops a load started past that share). The deadline is the GPU work ahead of the request at
admission (it would not start before that ends) plus `ROOM_SHARE` of what loading was ahead by,
at most `ROOM_MAX_S`: a hold never costs more than the load saves. SGLang asks only between
forward passes, which a long prefill makes seconds apart; a request whose deadline passed during
one but which fits now stays held for the prefetch at the end of that pass (never past
`ROOM_MAX_S`). A request is held only where something in flight or protected will give room back
(a load, or a finished load the GPU has not taken yet).

On a multi-rank server every rank holds the same requests at the same step: a request is held
where every rank either turned its load down for room or would have loaded it (`agree`, in the
admission's own collectives); each check of a held request is agreed (held while any rank's
deadline has not passed), and a held request is prefetched when every rank has room
(`ranks.first_all`, as late admission).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import host, ranks, view
from .policy_config import PolicyConfig
from .records import RoomWait

__all__ = ["ROOM_SHARE", "ROOM_MAX_S", "HOOKED", "after_admission", "agree", "holds", "take", "can_wait"]

log = logging.getLogger("hicache_gds_sglang.policy")

ROOM_SHARE = 0.5  # of the time loading is ahead by (admission's forecasts), a hold may take
ROOM_MAX_S = 10.0


HOOKED = [False]  # a check_prefetch_progress hook is in place (`plugin`)


def can_wait(pol: Any, cache: Any, backend: Any) -> bool:
    """Holds are on and this release has the point to hold at (the same on every rank)."""
    return bool(getattr(getattr(backend, "policy_config", None), "room_wait", False) and HOOKED[0])


def _fits(cache: Any, backend: Any, hit: int) -> bool:
    """A load of `hit` tokens would be admitted now: the host pool has room and prefetches are
    within their share."""
    r = host.host_room(cache)
    fraction = getattr(getattr(backend, "policy_config", None), "host_fraction", PolicyConfig.host_fraction)
    return (r is None or r >= hit) and host.share_full(cache, fraction) is None  # None: the release does not say


def _gives_room(pol: Any, cache: Any) -> bool:
    """Something will give host room back: a load in flight, or a finished one still protected."""
    return bool(pol.protected) or next(view.loads(cache), None) is not None


def after_admission(pol: Any, cache: Any, backend: Any, rid: str, dec: Any, verdict: Any, hit: int,
                    ahead: float = 0.0) -> None:
    """Admission decided `dec` (the cost model's) and `verdict` (after the host pool's veto) for
    `rid`'s `hit` tokens, with `ahead` seconds of GPU work before it: hold it where only the host
    room turned its load down."""
    if not (dec.load and not verdict.load):
        pol.room_wait.pop(rid, None)
        return
    gain = float(dec.t_compute) - float(dec.t_load)
    if not gain > 0 or not can_wait(pol, cache, backend) or not _gives_room(pol, cache):
        pol.room_wait.pop(rid, None)
        return
    now = time.monotonic()
    w = pol.room_wait.get(rid)
    if w is None:  # asked again (`take`): the first deadline stands
        wait = min(ROOM_MAX_S, max(0.0, float(ahead)) + gain * ROOM_SHARE)
        w = pol.room_wait[rid] = RoomWait(now + wait, hit, now)
        pol.counts["room_wait"] += 1
    log.info("hicache-gds policy: %s waits for host room (needs %d tokens; %s; loading is ahead by %.3f s, GPU "
             "work ahead %.3f s): held at most %.3f s more, then computed", rid, hit, verdict.reason, gain,
             ahead, max(0.0, w.until - now))


def agree(pol: Any, cache: Any, backend: Any, rid: str, hit: int, would_load: bool) -> None:
    """A multi-rank server agreed not to load `rid` (`policy_hooks._agree_not_loaded`, on every
    rank at this step): it is held on every rank where each rank turned it down for room or would
    have loaded it (`would_load`: this rank's own admission), else on none."""
    if not can_wait(pol, cache, backend):
        return
    ok = ranks.all_ok(cache, rid in pol.room_wait or would_load)
    if not ok:
        pol.room_wait.pop(rid, None)
    elif rid not in pol.room_wait:  # this rank had room: the others' deadlines decide (`holds`)
        now = time.monotonic()
        pol.room_wait[rid] = RoomWait(now, hit, now)
        pol.counts["room_wait"] += 1


def holds(pol: Any, cache: Any, key: Any) -> bool:
    """``check_prefetch_progress`` for the request `key`: True while it waits for host room (the
    scheduler skips it, as a load in flight), or past its deadline where it fits now (`take`
    prefetches it at the end of this pass), never past `ROOM_MAX_S`; else it is released to the
    GPU. On a multi-rank server held while any rank holds it (every rank checks the same held
    requests at the same step, as SGLang's own progress check)."""
    rid = view.rid(key)
    w = pol.room_wait.get(rid)
    if w is None or view.loading_entry(cache, key) is not None:
        return False
    now = time.monotonic()
    held = now < w.until or (now < w.since + ROOM_MAX_S and _fits(cache, view.backend_of(cache), w.hit))
    if ranks.multi(cache):
        held = not ranks.all_ok(cache, not held)
    if held:
        return True
    del pol.room_wait[rid]
    pol.counts["room_timeout"] += 1
    log.info("hicache-gds policy: %s waited %.3f s for host room and is computed (room for %s of its %d tokens)",
             rid, now - w.since, host.host_room(cache), w.hit)
    return False


def take(pol: Any, cache: Any, scheduler: Any) -> str | None:
    """After a prefill batch is formed: each held request whose hit the host pool now has room
    for, in queue order, is prefetched through SGLang's own path (returns the first one's rid);
    held requests that left the queue are forgotten. Each prefetch is admitted, and so counted
    as pending host memory (`host.host_room`), before the next is looked at."""
    if not pol.room_wait:
        return None
    queue = view.waiting(scheduler)
    queued = {view.rid(r) for r in queue}
    for rid in [r for r in pol.room_wait if r not in queued]:
        del pol.room_wait[rid]
    backend = view.backend_of(cache)
    first: str | None = None
    tried: set[str] = set()
    while True:
        loading = view.loading_rids(cache)
        held = [r for r in queue if view.rid(r) in pol.room_wait and view.rid(r) not in loading
                and view.rid(r) not in tried]
        if not held:
            return first
        votes = [_fits(cache, backend, pol.room_wait[view.rid(r)].hit) for r in held]
        if ranks.multi(cache):
            pick = ranks.first_all(cache, [view.rid(r) for r in held], votes)
        else:
            pick = votes.index(True) if True in votes else None
        if pick is None:
            return first
        req = held[pick]
        rid = view.rid(req)
        tried.add(rid)
        w = pol.room_wait[rid]
        log.info("hicache-gds policy: %s has host room after %.3f s (%s tokens; needs %d): prefetched",
                 rid, time.monotonic() - w.since, host.host_room(cache), w.hit)
        pol.counts["room_load"] += 1
        view.prefetch_again(scheduler, req)  # admission decides again, and ends the hold unless turned down again
        first = first or rid
