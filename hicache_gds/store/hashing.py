"""Page checksums on the host's threads, for `PageMover`: the shared pools and `page_sums`.

Two pools per process, made when first needed and forgotten in a forked child (it has none of the
parent's threads: a copied pool would queue work forever):

* `hasher`: threads that sum one request's or one batch's host pages in parallel (numpy and
  xxh3 release the GIL);
* `verifier`: threads that finish host pages beside the IO (a read's scatter and checksum per
  request, a write's checksums); they fan out to `hasher`, whose tasks never wait, so the two
  pools cannot deadlock.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from .. import pagesum
from ..engines.base import MemKind
from ..layout import Pages
from ..memory import HostBuffer

__all__ = ["hasher", "verifier", "hash_threads", "page_sums"]

# xxh3 hashes 25-30 GB/s a core: a request's pages (1/8 of a batch) are hashed on the thread that
# finishes them; a whole batch's (a write's, 256 MiB) are cut across the hashing threads.
XXH3_SPLIT_BYTES = 64 << 20

_hash_pool: ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()
_verify_pool: ThreadPoolExecutor | None = None


def hash_threads() -> int:
    """How many threads `hasher` has (at most 8, one per core)."""
    return min(8, os.cpu_count() or 1)


def hasher() -> ThreadPoolExecutor | None:
    """Threads that checksum a request's pages in parallel (numpy releases the GIL), or None on one core.

    Requests of a batch are all posted at once and the disk serves them interleaved, so most of
    them complete near the end of the batch: hashing them one by one on the caller's thread was
    exposed, not overlapped (about 9% of get throughput on the H100 VM with verification on)."""
    global _hash_pool
    workers = hash_threads()
    if workers < 2:
        return None
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = ThreadPoolExecutor(workers, thread_name_prefix="hicache-gds-checksum")
        return _hash_pool


def verifier() -> ThreadPoolExecutor:
    """Threads that finish host pages beside the IO: a read's scatter and checksum per request
    (`PageMover._finish_read`), a write's checksums."""
    global _verify_pool
    with _hash_pool_lock:
        if _verify_pool is None:
            _verify_pool = ThreadPoolExecutor(4, thread_name_prefix="hicache-gds-verify")
        return _verify_pool


def _forget_pools_in_child() -> None:
    # A forked child has none of the parent's threads: a copied pool would queue work forever.
    global _hash_pool, _hash_pool_lock, _verify_pool
    _hash_pool, _verify_pool, _hash_pool_lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_in_child)


def page_sums(pages: Pages, buf: HostBuffer | None, idx: Sequence[int], *, page_bytes: int, slot_bytes: int,
              threads: int, device_sums: Callable[..., Any], like: Any = None) -> list[int]:
    """The checksum (`hicache_gds.pagesum`) of each page in `idx` (from `buf`, slot by slot of
    `slot_bytes`, where staged): of the kind its `like` value records, else xxh3 for bytes summed
    in host memory and hgc1 for device pages (on their GPU, all in one launch, by `device_sums`).
    Host pages are cut across at most `threads` hashing threads (0: all of them) where there are
    several hgc1 pages or `XXH3_SPLIT_BYTES` of xxh3 (5x faster: below that the caller's thread
    does it, sparing the hand-offs)."""
    idx = list(idx)
    if not idx:
        return []
    odd = None if like is None else pagesum.kinds_of(np.asarray(like, dtype=np.int64).reshape(-1))
    if buf is None and pages.kind is MemKind.VRAM:
        sel = pages.select(idx)
        return pagesum.device_sums(sel.addrs, sel.lens, page_bytes, odd, device_sums).tolist()
    if buf is not None:
        segs = [[(buf.addr + j * slot_bytes, page_bytes)] for j in idx]
    else:
        segs = [list(zip(pages.addrs[j].tolist(), pages.lens[j].tolist())) for j in idx]
    hgc1 = [False] * len(idx) if odd is None else odd.tolist()
    threads = min(hash_threads(), threads or hash_threads())
    split = sum(hgc1) > 1 or len(idx) * page_bytes >= XXH3_SPLIT_BYTES
    pool = hasher() if split and len(idx) > 1 and threads > 1 else None
    if pool is None:
        return pagesum.host_sums(segs, page_bytes, hgc1)
    # One task per thread: a task sums its pages' segments that lie end to end in one numpy
    # call and folds them at once; every task and call is a GIL hand-off, which a busy thread
    # in the host process makes cost up to a switch interval.
    step = -(-len(segs) // threads)
    parts = pool.map(lambda a: pagesum.host_sums(segs[a:a + step], page_bytes, hgc1[a:a + step]),
                     range(0, len(segs), step))
    return [c for part in parts for c in part]
