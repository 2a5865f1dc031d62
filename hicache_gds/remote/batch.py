"""The remote tier's per-batch helpers: the tagged checksums of a batch of pages, and waiting
for a batch's transfer requests (`tier.RemoteTier` uses both)."""

from __future__ import annotations

import time
from concurrent.futures import Executor
from typing import Any, Callable, Sequence

import numpy as np

from .. import pagesum
from ..engines.base import MemKind
from ..errors import TransferError, TransferTimeout
from ..layout import Pages

__all__ = ["tagged_sums", "wait_each", "LateRequest", "UNKNOWN_HOLD_S"]

UNKNOWN_HOLD_S = 120.0
"""Seconds the staging of a request whose fate is unknown (`LateRequest`) stays out of use."""


def tagged_sums(pages: Pages, idx: list[int], page_bytes: int, *, threads: int, pool: Executor | None,
                device_sums: Callable | None, like: Sequence[int] | None = None) -> list[int]:
    """Tagged checksums (`pagesum`) of pages `idx`: of the kind each `like` value records (a
    read's check), else the writer's own kind: xxh3 for host pages, hgc1 for device pages (one
    GPU kernel launch for the batch). Every page carries one, a device page too. Host pages hash
    in `threads` chunks on `pool` (xxhash releases the GIL)."""
    if not idx:
        return []
    odd = None if like is None else pagesum.kinds_of(np.asarray(like, dtype=np.int64))
    if pages.kind is MemKind.VRAM:
        return pagesum.device_sums(pages.addrs[idx], pages.lens[idx], page_bytes, odd, device_sums).tolist()
    hgc1 = None if odd is None else odd.tolist()

    def chunk(lo: int, hi: int) -> list[int]:
        segs = [list(zip(pages.addrs[i].tolist(), pages.lens[i].tolist())) for i in idx[lo:hi]]
        return pagesum.host_sums(segs, page_bytes, None if hgc1 is None else hgc1[lo:hi])

    if pool is None or threads < 2 or len(idx) < 8:
        return chunk(0, len(idx))
    step = -(-len(idx) // threads)
    return [c for part in pool.map(lambda lo: chunk(lo, lo + step), range(0, len(idx), step)) for c in part]


def wait_each(requests: Sequence[Any], deadline: float,
              on_done: Callable[[int], Any] | None = None) -> list[BaseException | None]:
    """Wait for every transfer request until `deadline` (monotonic): None where it completed, else
    its `TransferError` (a timeout too: `TransferTimeout`, the request left to finish).

    One thread polls them all: they share the agent's one UCX worker, and two threads polling it
    only contended for its lock (gets over veth TCP ran at 0.61 GB/s with a thread per request,
    0.83 with one, same run). Every request is posted (its first poll) before any is waited on,
    and the pending ones are polled in turn: NIXL requests are posted at their first poll, so
    waiting for them one after the other kept a batch's second server idle until the first one's
    request had finished (a 64-page put over veth TCP took 141 ms where both servers at once took
    89, same run). `on_done(i)` runs (in this thread) as each request i completes."""
    out: list[BaseException | None] = [None] * len(requests)
    pending = list(range(len(requests)))
    spins = 0
    while pending:
        still = []
        for i in pending:
            try:
                if not requests[i].done():
                    still.append(i)
                elif on_done is not None:
                    on_done(i)
            except TransferError as exc:
                out[i] = exc
        pending = still
        if not pending:
            break
        if time.monotonic() > deadline:
            for i in pending:
                t = requests[i]
                out[i] = TransferTimeout(f"{t.engine}: {t.op.value} of {t.what} did not complete by the batch's "
                                         "deadline (io_timeout)")
            break
        spins += 1
        # The agent has no progress thread: its requests advance only when polled, so stay close.
        time.sleep(0 if spins < 64 else 5e-5)
    return out


class LateRequest:
    """A request that was still running at its batch's deadline, as `store.staging.Staging.hold`
    sees it: finished once it completed or failed. One whose peer's agent this process replaced
    while it was in flight ends in `TransferTimeout` (NIXL no longer knows it, and the old
    connection may still carry its bytes): finished only `hold_s` after that, when a TCP
    connection's retransmissions have long given up."""

    def __init__(self, request: Any, hold_s: float | None = None) -> None:
        self.request = request
        self.hold_s = UNKNOWN_HOLD_S if hold_s is None else hold_s
        self.until: float | None = None

    def done(self) -> bool:
        if self.until is None:
            try:
                return bool(self.request.done())
            except TransferTimeout:
                self.until = time.monotonic() + self.hold_s
            except TransferError:
                return True
        return time.monotonic() >= self.until
