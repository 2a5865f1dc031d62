"""The GIL and the host process: what the store's threads need from a busy serving engine."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("hicache_gds")

__all__ = ["shorten_switch_interval"]


def shorten_switch_interval(seconds: float) -> float:
    """Lower the process's thread switch interval to `seconds` (never raise it; 0: leave it alone);
    returns the interval in force.

    Why: a get is many short GIL hand-offs (posting requests, polling NIXL POSIX, which advances
    only when polled, and checksum threads between numpy calls). A serving engine's scheduler
    thread that is busy in Python holds the GIL for the whole switch interval (5 ms by default)
    each time one of them wants it back -- the convoy effect: on the CPU machine, one busy Python
    thread cut a 1 GiB get to 0.1-0.4x its idle rate, and 0.5 ms brought it back to 0.86-0.94x
    (`benchmarks/bench_busy_host.py`). The
    interval is process-wide, so this is logged once."""
    now = sys.getswitchinterval()
    if seconds and seconds < now:
        sys.setswitchinterval(seconds)
        log.info("hicache-gds: Python thread switch interval %.2f -> %.2f ms for the store's IO threads "
                 "(switch_interval; 0 leaves it alone)", now * 1e3, seconds * 1e3)
        return seconds
    return now
