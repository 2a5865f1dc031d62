"""A store's read rate before its first get: a short O_DIRECT read of its own directories.

A cost model that has never seen a get has no read rate, and a fresh server's first decisions then
have nothing to weigh a load against (a TP=2 server logged "load nan s" and recomputed every L3
hit). `probe_read_rate` measures the directories as the store will read them: one file per
directory (`GDS_PATH`'s drives in parallel, as slots are striped), written with random bytes and
read back with O_DIRECT at a queue depth, then removed. It returns what it measured and how, or None
with the reason; it never raises into an engine's start.

Caveats, which the returned source states: written just before it is read, a file may be served
faster by a virtual disk's host cache than older pages will be; the estimate is a seed, and the
store's own gets replace it (`costmodel.ReadRate`).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .memory import HostBuffer, view

__all__ = ["Probe", "probe_read_rate", "PROBE_BYTES"]

PROBE_BYTES = 256 << 20
"""Bytes read per directory: long enough for a queue to fill, short enough to add under a second to
an engine's start on a 1 GB/s disk."""
_IO_BYTES = 4 << 20
_QD = 8
_PREFIX = ".hicache-gds-probe-"


@dataclass(frozen=True)
class Probe:
    """What `probe_read_rate` measured: bytes/s over all directories, and how."""

    bytes_per_s: float
    source: str
    seconds: float


def _one(directory: str, nbytes: int, io_bytes: int, qd: int, deadline: float) -> tuple[int, float]:
    """Write then read back one probe file in `directory`; (bytes read, seconds reading)."""
    path = os.path.join(directory, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    bufs = [HostBuffer(io_bytes, pinned=False) for _ in range(qd)]
    try:
        rng = np.random.default_rng()
        for b in bufs:  # random bytes: a device that compresses or dedups zeros reads them too fast
            b.numpy()[:] = rng.integers(0, 256, io_bytes, dtype=np.uint8)
        n = max(1, nbytes // io_bytes)
        for i in range(n):
            os.pwritev(fd, [view(bufs[i % qd].addr, io_bytes)], i * io_bytes)
            if time.monotonic() > deadline:
                n = i + 1
                break
        os.fdatasync(fd)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            pass
        nxt = iter(range(n))
        lock = threading.Lock()

        def reader(k: int) -> int:
            got = 0
            mv = [view(bufs[k].addr, io_bytes)]
            while time.monotonic() < deadline:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    break
                got += os.preadv(fd, mv, i * io_bytes)
            return got

        t0 = time.perf_counter()
        with ThreadPoolExecutor(qd, thread_name_prefix="hicache-gds-probe") as pool:
            done = sum(pool.map(reader, range(qd)))
        return done, time.perf_counter() - t0
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def probe_read_rate(dirs: Sequence[str], *, nbytes: int = PROBE_BYTES, io_bytes: int = _IO_BYTES,
                    qd: int = _QD, timeout_s: float = 10.0) -> tuple[Probe | None, str]:
    """Measure the O_DIRECT read rate of `dirs` together (one probe file each, in parallel).

    Returns (Probe, "") or (None, why not). At most `timeout_s` in all; a directory that refuses
    O_DIRECT or runs out of space makes it None."""
    dirs = [d for d in dirs if d]
    if not dirs:
        return None, "no directory to probe"
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    try:
        with ThreadPoolExecutor(len(dirs), thread_name_prefix="hicache-gds-probe-dir") as pool:
            res = list(pool.map(lambda d: _one(d, nbytes, io_bytes, qd, deadline), dirs))
    except OSError as exc:
        return None, f"probe of {', '.join(dirs)} failed: {exc}"
    read = sum(b for b, _ in res)
    secs = max(s for _, s in res)
    if read <= 0 or secs <= 0:
        return None, f"probe of {', '.join(dirs)} read nothing in {timeout_s:.0f} s"
    rate = read / secs
    src = (f"probed at open ({read / 1e6:.0f} MB O_DIRECT read at QD{qd} x {len(dirs)} "
           f"director{'y' if len(dirs) == 1 else 'ies'}, just written)")
    return Probe(rate, src, time.monotonic() - t0), ""
