"""A directory's O_DIRECT read rate, measured: for `doctor`'s break-even and for a store's first decisions.

A cost model that has never seen a get has no read rate, and a fresh server's first decisions then
have nothing to weigh a load against (a TP=2 server logged "load nan s" and recomputed every L3
hit). `probe_read_rate` measures a store's directories as it will read them: `probe_dir` on each
(`GDS_PATH`'s drives in parallel, as slots are striped over them), a file written with random
bytes and read back with O_DIRECT, several requests in flight, then removed. It returns what it
measured and how, or None with the reason; it never raises into an engine's start.

Caveat, which the returned source states: written just before it is read, a file may be served
faster by a virtual disk's host cache than older pages will be; the estimate is a seed, and the
store's own gets replace it (`costmodel.ReadRate`).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Probe", "probe_dir", "probe_read_rate", "PROBE_BYTES"]

PROBE_BYTES = 256 << 20
"""Bytes read per directory: long enough for a queue to fill, short enough to add a quarter of a
second to an engine's start at 1 GB/s."""


@dataclass(frozen=True)
class Probe:
    """What `probe_read_rate` measured: bytes/s over all directories, and how."""

    bytes_per_s: float
    source: str
    seconds: float


def probe_dir(directory: str, nbytes: int = 256 << 20, chunk: int = 8 << 20, threads: int = 4) -> dict[str, Any]:
    """Write `nbytes` of random data to a temporary file in `directory` with O_DIRECT, read it
    back with O_DIRECT, `threads` requests of `chunk` bytes in flight (as a prefetch's batch
    keeps several in flight), and delete it. Cold reads: O_DIRECT bypasses the page cache."""
    chunk = max(4096, chunk // 4096 * 4096)
    n = max(1, nbytes // chunk)
    try:
        fd, path = tempfile.mkstemp(prefix=".hicache-gds-readprobe-", dir=directory)
        os.close(fd)
    except OSError as exc:
        return {"path": directory, "error": f"cannot create a file: {exc.strerror}"}
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]
    try:
        for b in bufs:
            b.write(os.urandom(chunk))
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        try:
            t0 = time.perf_counter()
            for i in range(n):
                if os.pwrite(fd, bufs[i % threads], i * chunk) != chunk:
                    return {"path": directory, "error": "short O_DIRECT write"}
            os.fsync(fd)
            t_write = time.perf_counter() - t0
            errors: list[str] = []
            nxt = iter(range(n))
            lock = threading.Lock()

            def reader(buf: mmap.mmap) -> None:
                while True:
                    with lock:
                        i = next(nxt, None)
                    if i is None:
                        return
                    try:
                        if os.preadv(fd, [buf], i * chunk) != chunk:
                            errors.append("short O_DIRECT read")
                            return
                    except OSError as exc:
                        errors.append(exc.strerror or str(exc))
                        return

            t0 = time.perf_counter()
            ts = [threading.Thread(target=reader, args=(b,)) for b in bufs]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            t_read = time.perf_counter() - t0
        finally:
            os.close(fd)
        if errors:
            return {"path": directory, "error": errors[0]}
        return {"path": directory, "bytes": n * chunk, "chunk": chunk, "threads": threads,
                "read_bytes_per_s": n * chunk / t_read, "write_bytes_per_s": n * chunk / t_write}
    except OSError as exc:
        return {"path": directory, "error": f"O_DIRECT: {exc.strerror or exc}"}
    finally:
        for b in bufs:
            b.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def probe_read_rate(dirs: Sequence[str], *, nbytes: int = PROBE_BYTES, chunk: int = 8 << 20,
                    threads: int = 8) -> tuple[Probe | None, str]:
    """The O_DIRECT read rate of `dirs` together (`probe_dir` on each, in parallel): (Probe, "")
    or (None, why not) when a directory cannot be probed."""
    dirs = [d for d in dirs if d]
    if not dirs:
        return None, "no directory to probe"
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(dirs), thread_name_prefix="hicache-gds-probe") as pool:
        res = list(pool.map(lambda d: probe_dir(d, nbytes, chunk, threads), dirs))
    bad = [r for r in res if "error" in r]
    if bad:
        return None, "; ".join(f"probe of {r['path']}: {r['error']}" for r in bad)
    rate = sum(r["read_bytes_per_s"] for r in res)
    read = sum(r["bytes"] for r in res)
    src = (f"probed at open ({read / 1e6:.0f} MB O_DIRECT read, {threads} x {chunk >> 20} MiB in flight, "
           f"{len(dirs)} director{'y' if len(dirs) == 1 else 'ies'}, just written)")
    return Probe(rate, src, time.monotonic() - t0), ""
