"""An idle scheduler pass yields to the L3 reads that waiting requests wait for.

While a request waits on an L3 load (any prefetch policy), or a split request is held for its
tail (`split_policy.park`), SGLang's scheduler has nothing to run: its loop returns to
``Scheduler.on_idle`` at once and, since the waiting queue is not empty, goes round again. That
loop is Python and keeps the GIL for a whole switch interval each time another thread asks for
it. The reads need the GIL between their IOs (posting, polling NIXL, the checksums), so they ran
at half the device's rate beside it: on an H200 with a RAM-backed device (raw 3.6 GB/s), a held
split's tail read at 1.3-2.3 GB/s, and the same gets at 3.2-4.5 GB/s while the GPU computed and
the scheduler sat in CUDA calls (run 17, `benchmarks/results/gpu-h200-run17/`).

After such a pass, `after_idle` blocks the scheduler thread on the backend's read event
(`HiCacheGDS.wait_for_reads`), which releases the GIL, until one of its gets or existence
queries returns, or ``policy_idle_wait_ms`` passes (2 ms by default; 0 turns it off). A new
request therefore waits at most that long for the next pass, and a finished read wakes the
scheduler at once. Nothing waits while the GPU has work (a running batch), when no read is in
flight, or when another backend is attached.
"""

from __future__ import annotations

import logging
from typing import Any

from . import view

__all__ = ["after_idle"]

log = logging.getLogger(__name__)


def after_idle(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """``Scheduler.on_idle`` (AFTER): wait, bounded, for this backend's next read to return."""
    try:
        cache = view.tree_cache(scheduler)
        backend = view.backend_of(cache)
        wait_s = float(getattr(backend, "idle_wait_s", 0.0) or 0.0)
        if wait_s <= 0 or not view.reads_pending(cache) or not view.gpu_idle(scheduler):
            return None
        backend.wait_for_reads(wait_s)
    except Exception as exc:  # noqa: BLE001 -- an idle pass must never break the scheduler
        view.once("idle", "hicache-gds: idle scheduler pass not yielded to L3 reads (%s: %s)",
                  type(exc).__name__, exc)
    return None
