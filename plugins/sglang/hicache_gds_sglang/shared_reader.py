"""Read-only access to a namespace another process writes: MLA ranks that are not the storage writer.

Under MLA, SGLang writes KV from one rank (``HiCacheStorageConfig.is_storage_writer``) and every
TP rank reads it. `PageStore` holds an exclusive lock per namespace, so the other ranks cannot
open the writer's store; this reader reads it without the lock:

* the key -> slot rows come from the writer's SQLite index (WAL: a reader never blocks the
  writer, and a row is committed only after its page bytes are on disk -- the core's
  publish-after-data rule);
* the page bytes come from the slab files with ``preadv`` straight into the host pool's slots;
* every page is checked against the xxh3 checksum in its row. The writer may evict and reuse a
  slot while we read it (we cannot pin slots in another process); a reused slot fails the
  checksum and reads as a miss, never as wrong bytes.

STOPGAP: this duplicates the core's on-disk format (index table, slot placement, checksum) and is
to be replaced by a read-only `PageStore` mode (see the plugin README, "Core changes"). The
placement and checksum are checked against a real `PageStore` by the tests.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import xxhash

from hicache_gds import Config, Pages
from hicache_gds.index import INDEX_FILE
from hicache_gds.memory import view
from hicache_gds.slabs import SlabSet

from .naming import store_dirs

__all__ = ["SharedReader", "page_checksum"]

log = logging.getLogger("hicache_gds_sglang.reader")
_IOV_MAX = 1024


def page_checksum(segments: Sequence[memoryview]) -> int:
    """The core's page checksum: xxh3-64 of the segments in order, as a signed SQLite integer, never 0."""
    h = xxhash.xxh3_64()
    for s in segments:
        h.update(s)
    d = h.intdigest()
    return (d - (1 << 64) if d >= 1 << 63 else d) or 1


class SharedReader:
    """The read half of `PageStore` (exists, prefix, get, stats, close) over another process's namespace."""

    def __init__(self, config: Config, identity: Mapping[str, Any], page_bytes: int, threads: int = 4) -> None:
        self.page_bytes = page_bytes
        self.namespace, self.dirs, self.slot_bytes = store_dirs(config, identity, page_bytes)
        self._db_path = os.path.join(self.dirs[0], INDEX_FILE)
        self._db: sqlite3.Connection | None = None
        self._db_ino = -1
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hicache-gds-reader")
        self._closed = False
        self._warned = False
        self._c = {"hits": 0, "misses": 0, "pages_read": 0, "bytes_read": 0, "checksum_mismatches": 0,
                   "get_failed": 0}
        log.info("hicache-gds: reading namespace %s written by the MLA storage writer (%s)", self.namespace,
                 ",".join(self.dirs))

    # -- index -----------------------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection | None:
        """The writer's index, (re)opened when it appears or is replaced; None while it is absent."""
        try:
            ino = os.stat(self._db_path).st_ino
        except FileNotFoundError:
            return None
        if self._db is not None and ino == self._db_ino:
            return self._db
        if self._db is not None:
            self._db.close()
            self._db = None
        db = sqlite3.connect(f"file:{self._db_path}?mode=ro", uri=True, check_same_thread=False, timeout=10)
        meta = dict(db.execute("SELECT name, value FROM meta"))
        want = {"slot_bytes": str(self.slot_bytes), "page_bytes": str(self.page_bytes),
                "ndirs": str(len(self.dirs))}
        bad = sorted(k for k, v in want.items() if k in meta and meta[k] != v)
        if bad:
            db.close()
            if not self._warned:
                self._warned = True
                log.warning("hicache-gds: namespace %s has other geometry (%s); reading nothing from it",
                            self.namespace, ", ".join(bad))
            return None
        self._db, self._db_ino = db, ino
        return db

    def _rows(self, keys: Sequence[str]) -> dict[str, tuple[int, int, int]]:
        uniq = list(dict.fromkeys(keys))
        out: dict[str, tuple[int, int, int]] = {}
        with self._lock:
            if self._closed:
                raise ValueError("the reader is closed")
            db = self._conn()
            if db is None:
                return out
            for i in range(0, len(uniq), 500):
                chunk = uniq[i:i + 500]
                q = f"SELECT key, slot, nbytes, csum FROM pages WHERE key IN ({','.join('?' * len(chunk))})"
                for k, slot, nbytes, csum in db.execute(q, chunk):
                    out[k] = (int(slot), int(nbytes), int(csum))
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        rows = self._rows(keys)
        return [k in rows for k in keys]

    def prefix(self, keys: Sequence[str]) -> int:
        rows = self._rows(keys)
        return next((i for i, k in enumerate(keys) if k not in rows), len(keys))

    # -- data ------------------------------------------------------------------------------------
    def _fd(self, i: int) -> int:
        with self._lock:
            fd = self._fds.get(i)
            if fd is None:
                fd = os.open(os.path.join(self.dirs[i], SlabSet.FILE_NAME), os.O_RDONLY | os.O_CLOEXEC)
                self._fds[i] = fd
            return fd

    def _read_one(self, row: tuple[int, int, int], addrs: list[int], lens: list[int]) -> int:
        """0: ok, 1: failed, 2: checksum mismatch."""
        slot, nbytes, csum = row
        if nbytes != self.page_bytes or csum == 0:
            return 1
        nd = len(self.dirs)
        fd, off = self._fd(slot % nd), (slot // nd) * self.slot_bytes
        segs = [view(a, n) for a, n in zip(addrs, lens)]
        pos = off
        for i in range(0, len(segs), _IOV_MAX):
            part = segs[i:i + _IOV_MAX]
            want = sum(len(s) for s in part)
            if os.preadv(fd, part, pos) != want:
                return 1
            pos += want
        return 0 if page_checksum(segs) == csum else 2

    def get(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Read pages into memory; False per page missing, unreadable, or rewritten while read."""
        if len(pages) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
        rows = self._rows(keys)
        hits = [j for j, k in enumerate(keys) if k in rows]
        futs = [self._pool.submit(self._read_one, rows[keys[j]], pages.addrs[j].tolist(), pages.lens[j].tolist())
                for j in hits]
        result = [False] * len(keys)
        codes = [f.result() for f in futs]
        for j, code in zip(hits, codes):
            result[j] = code == 0
        n = sum(result)
        with self._lock:
            self._c["hits"] += len(hits)
            self._c["misses"] += len(keys) - len(hits)
            self._c["pages_read"] += n
            self._c["bytes_read"] += n * self.page_bytes
            self._c["checksum_mismatches"] += codes.count(2)
            self._c["get_failed"] += codes.count(1)
        return result

    def put(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """A reader never writes: every page is False."""
        return [False] * len(keys)

    def register_memory(self, addr: int, nbytes: int, kind: Any = None) -> None:
        """Nothing to register: reads are plain preadv into host memory."""

    def clear(self) -> int:
        """Only the writer clears its namespace."""
        return 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._c)
        out.update(engine="shared-reader", path="preadv of the MLA writer's slabs (read-only)",
                   namespace=self.namespace, dirs=list(self.dirs), page_bytes=self.page_bytes)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._db is not None:
                self._db.close()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        self._pool.shutdown(wait=True)
