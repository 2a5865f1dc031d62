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
which asks admission again, now with room; one per scheduler pass), or until its deadline, when
it is computed as admission said. The deadline is `ROOM_SHARE` of what loading was ahead by at
admission, at most `ROOM_MAX_S`: a hold never costs more than the load saves. A request is held
only where something in flight or protected will give room back (a load, or a finished load the
GPU has not taken yet), and only on a single-rank server (ranks would have to agree on every
held request at every pass; there the request is computed, as before).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import host, ranks, view
from .records import RoomWait

__all__ = ["ROOM_SHARE", "ROOM_MAX_S", "HOOKED", "after_admission", "holds", "take", "can_wait"]

log = logging.getLogger("hicache_gds_sglang.policy")

ROOM_SHARE = 0.5  # of the time loading is ahead by (admission's forecasts), a hold may take
ROOM_MAX_S = 10.0


HOOKED = [False]  # a check_prefetch_progress hook is in place (`plugin`)


def can_wait(pol: Any, cache: Any, backend: Any) -> bool:
    """Holds are on, this release has the point to hold at, and the server has one rank."""
    return bool(getattr(backend.policy_config, "room_wait", False) and HOOKED[0] and not ranks.multi(cache))


def _gives_room(pol: Any, cache: Any) -> bool:
    """Something will give host room back: a load in flight, or a finished one still protected."""
    return bool(pol.protected) or next(view.loads(cache), None) is not None


def after_admission(pol: Any, cache: Any, backend: Any, rid: str, dec: Any, verdict: Any, hit: int) -> None:
    """Admission decided `dec` (the cost model's) and `verdict` (after the host pool's veto) for
    `rid`'s `hit` tokens: hold it where only the host room turned its load down."""
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
        w = pol.room_wait[rid] = RoomWait(now + min(ROOM_MAX_S, gain * ROOM_SHARE), hit, now)
        pol.counts["room_wait"] += 1
    log.info("hicache-gds policy: %s waits for host room (needs %d tokens; loading is ahead by %.3f s): held at "
             "most %.3f s more, then computed", rid, hit, gain, max(0.0, w.until - now))


def holds(pol: Any, cache: Any, key: Any) -> bool:
    """``check_prefetch_progress`` for the request `key`: True while it waits for host room (the
    scheduler skips it, as a load in flight); past its deadline it is released to the GPU."""
    rid = view.rid(key)
    w = pol.room_wait.get(rid)
    if w is None or view.loading_entry(cache, key) is not None:
        return False
    now = time.monotonic()
    if now < w.until:
        return True
    del pol.room_wait[rid]
    pol.counts["room_timeout"] += 1
    log.info("hicache-gds policy: %s waited %.3f s for host room and is computed (room for %s of its %d tokens)",
             rid, now - w.since, host.host_room(cache), w.hit)
    return False


def take(pol: Any, cache: Any, scheduler: Any) -> str | None:
    """After a prefill batch is formed: the first held request whose hit the host pool now has
    room for is prefetched through SGLang's own path (returns its rid); held requests that left
    the queue are forgotten."""
    if not pol.room_wait:
        return None
    queue = view.waiting(scheduler)
    queued = {view.rid(r) for r in queue}
    for rid in [r for r in pol.room_wait if r not in queued]:
        del pol.room_wait[rid]
    loading = view.loading_rids(cache)
    for req in queue:
        rid = view.rid(req)
        w = pol.room_wait.get(rid)
        if w is None or rid in loading:
            continue
        room = host.host_room(cache)
        if room is None or room < w.hit:
            return None  # in queue order: the first held request gets the room first
        log.info("hicache-gds policy: %s has host room after %.3f s (%d tokens; needs %d): prefetched",
                 rid, time.monotonic() - w.since, room, w.hit)
        pol.counts["room_load"] += 1
        view.prefetch_again(scheduler, req)  # admission decides again, and ends the hold unless turned down again
        return rid
    return None
