"""Host-pool accounting: the room a new load gets, the protection of finished loads, and the
share of the host pool prefetches may hold.

A finished load becomes ordinary host-pool pages once SGLang inserts it into the radix tree, and
0.5.17 inserts it whenever the scheduler reaches the request, schedulable or not (0.5.23: as soon
as its acknowledgement is drained, each scheduler pass). While other
requests' prefills fill the batches, the pages wait there as evictable host-only leaves, and
those prefills' write-through evicts them when the host pool is full: on the GPU machine a 32B
burst read a prefix from disk, then found "0 on host" when the GPU took it and recomputed it.
So the deepest node a finished load inserted is protected (SGLang's own host lock count, which
`evict_host` and the write-back drop respect; a protected leaf keeps its ancestors as well, as
only leaves are evicted) until the request leaves the waiting queue (its load back to the GPU
then holds the pages), and for at most `PROTECT_MAX_S`, so a request that never runs cannot pin
host memory. The prefills' write-through then finds less room: their host backup is what gives
way, not a load the GPU is about to use.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import view
from .records import Protected

__all__ = ["PROTECT_MAX_S", "host_room", "protect", "release_protected", "rate_limited", "share_full"]

log = logging.getLogger("hicache_gds_sglang.policy")

PROTECT_MAX_S = 60.0


def host_room(cache: Any) -> int | None:
    """Host-pool tokens a new load can still get: free, plus host-only pages SGLang may evict
    (`view.host_evictable`), less what admitted loads will take once their L3 hit is known
    (SGLang allocates then, and shortens or revokes a load it cannot fit). None where the release
    does not say."""
    free = view.host_free(cache)
    if free is None:
        return None
    pending = sum(ld.hit for ld in view.loads(cache) if not view.allocated(ld.op))
    return free + view.host_evictable(cache) - pending


def protect(pol: Any, cache: Any, rid: str, entry: Any) -> None:
    """SGLang just inserted the finished load of `rid` (its ``ongoing_prefetch`` `entry`: the
    node it hangs under, its key, its operation) into the tree: protect the deepest node it
    reached until the request leaves the waiting queue (`PROTECT_MAX_S`). 0.5.17 inserts it in
    ``check_prefetch_progress``, 0.5.23 in ``_handle_prefetch_result`` (from its acknowledgement
    drain, every scheduler pass, or ``check_prefetch_progress``)."""
    last_host_node, key, op = view.loading_parts(entry)
    ps = view.page_size(cache)
    usable = view.kept(op) // ps * ps
    if not view.allocated(op) or usable <= 0 or rid in pol.protected:
        return
    req = view.find_waiting(pol.scheduler(), rid)  # 0.5.23 finds the node by the request's tokens
    node = view.protect_loaded(cache, last_host_node, key, usable, req)
    if node is None:
        return
    pol.protected[rid] = Protected(node, time.monotonic(), usable)
    pol.counts["protect"] += 1
    log.info("hicache-gds policy: %s load of %d tokens protected on host until the GPU takes it; host pool %s "
             "tokens free", rid, usable, view.host_free(cache))


def release_protected(pol: Any, waiting: Any) -> None:
    """Release the protection of every loaded request no longer in `waiting` (the scheduler's
    waiting queue: scheduled, whose load back holds the pages now, or aborted), or protected
    for longer than `PROTECT_MAX_S`."""
    if not pol.protected:
        return
    now = time.monotonic()
    queued = {view.rid(r) for r in (waiting or ())}
    for rid, p in list(pol.protected.items()):
        late = now - p.since > PROTECT_MAX_S
        if rid in queued and not late:
            continue
        del pol.protected[rid]
        view.release_node(p.node)
        log.info("hicache-gds policy: %s host protection of %d tokens released after %.3f s (%s)", rid, p.tokens,
                 now - p.since, "still waiting: held too long" if late else "left the waiting queue")


def rate_limited(controller: Any, host_fraction: float) -> bool:
    """Prefetches hold their share of the host pool (`PolicyConfig.host_fraction`, or SGLang's
    own limit where that is larger): admit no more."""
    return _past_share(controller, host_fraction) is not None


def _past_share(controller: Any, host_fraction: float) -> tuple[int, int] | None:
    held, limit = view.host_limit(controller, host_fraction)
    return (held, limit) if held >= limit else None


def share_full(cache: Any, host_fraction: float) -> tuple[int, int] | None:
    """(tokens prefetches hold, their share) where `rate_limited` turns the next prefetch away,
    else None. SGLang asks it after admission, and drops a load admission chose without a word
    (an H200 burst of MLA prompts recomputed three loads so, with the host pool half free): a
    load is admitted only where it would also pass this limit. 0.5.23's buffer mode parks such
    a load rather than dropping it: no limit to heed there."""
    cc = getattr(cache, "cache_controller", None)
    if cc is None or not hasattr(cc, "prefetch_tokens_occupied") or view.buffer_only(cc):
        return None
    return _past_share(cc, host_fraction)
