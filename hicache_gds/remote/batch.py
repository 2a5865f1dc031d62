"""The remote tier's per-batch helpers: the tagged checksums of a batch of pages, and waiting
for a batch's transfer requests (`tier.RemoteTier` uses both)."""

from __future__ import annotations

import time
from concurrent.futures import Executor
from typing import Any, Callable, Sequence

import numpy as np

from .. import pagesum
from ..engines.base import MemKind
from ..errors import TransferError
from ..layout import Pages

__all__ = ["tagged_sums", "wait_each"]


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


def wait_each(requests: Sequence[Any], deadline: float) -> list[BaseException | None]:
    """Wait for each transfer request until `deadline` (monotonic): None where it completed, else
    its `TransferError` (a timeout too). One thread polls every request: they share the agent's
    one UCX worker, so each poll advances all of them, and two threads polling it only contended
    for its lock (gets over veth TCP ran at 0.61 GB/s with a thread per request, 0.83 with one,
    same run)."""
    out: list[BaseException | None] = []
    for t in requests:
        try:
            t.wait(max(0.0, deadline - time.monotonic()))
            out.append(None)
        except TransferError as exc:
            out.append(exc)
    return out
