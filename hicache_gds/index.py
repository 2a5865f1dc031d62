"""Key -> slot index: in memory for speed, in SQLite (WAL) for durability.

Crash safety lives here and in the store's write order, nowhere else:

* a page is published (row committed) only after its bytes are on disk;
* a slot is reused only after the row that pointed at it is deleted and committed;
* slots being read are pinned, so eviction never hands them to a writer mid-read.

So after a kill -9 the database names only pages whose bytes were completely written, and every
page whose `put` returned True is there. WAL with synchronous=NORMAL survives process crashes;
`sync=True` in the store adds fdatasync of the data for power loss.

LRU order survives restarts through a logical clock stored per row (`atime`), flushed with the
next write transaction rather than on every read.
"""

from __future__ import annotations

import gc
import logging
import os
import sqlite3
import threading
import time
from collections import Counter, OrderedDict
from typing import Iterable, NamedTuple, Sequence

import numpy as np

__all__ = ["Entry", "Index", "read_keys", "INDEX_FILE"]

INDEX_FILE = "index.sqlite3"

log = logging.getLogger("hicache_gds.index")
SCHEMA = 1


def read_keys(namespace_dir: str) -> list[str]:
    """Keys a namespace holds, least recently used first, read without writing or locking.

    For processes that must not open the store (it has one writer): a vLLM scheduler
    rebuilding its view of what workers hold, tools, tests. Any failure returns [].
    """
    path = os.path.join(namespace_dir, INDEX_FILE)
    if not os.path.exists(path):
        return []
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return [k for (k,) in db.execute("SELECT key FROM pages ORDER BY atime")]
        finally:
            db.close()
    except sqlite3.Error as exc:
        log.warning("index %s cannot be read (%s)", path, exc)
        return []


class Entry(NamedTuple):
    slot: int
    nbytes: int
    csum: int


class Index:
    """Thread-safe key -> `Entry` map over `nslots` slots, persisted at `db_path`."""

    def __init__(self, db_path: str, nslots: int, meta: dict[str, str], existing: bool = False) -> None:
        """`existing`: the namespace holds slots from an earlier run, so a database without our
        settings means the index was lost (emptied, deleted, or its WAL removed before a checkpoint)."""
        self.db_path = db_path
        self._existing = existing
        self.nslots = nslots
        self._lock = threading.Lock()
        self._map: OrderedDict[str, Entry] = OrderedDict()  # oldest first
        self._pins: Counter[int] = Counter()
        self._doomed: set[int] = set()  # dropped while pinned: freed on unpin
        self._lost: set[int] = set()  # written by a timed-out request: never reused in this process
        self._touched: dict[str, int] = {}
        self.evictions = 0
        self.recovery_s = 0.0
        t0 = time.perf_counter()
        try:
            self._db = self._open(meta)
            self._load()
        except sqlite3.DatabaseError as exc:
            self._reset_damaged(exc, meta)
        self.recovery_s = time.perf_counter() - t0

    # -- open / recover --------------------------------------------------------------------------
    def _open(self, meta: dict[str, str]) -> sqlite3.Connection:
        fd = os.open(self.db_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
        db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("CREATE TABLE IF NOT EXISTS pages (key TEXT PRIMARY KEY, slot INTEGER NOT NULL UNIQUE, "
                   "nbytes INTEGER NOT NULL, csum INTEGER NOT NULL, atime INTEGER NOT NULL)")
        for suffix in ("-wal", "-shm"):
            if os.path.exists(self.db_path + suffix):
                os.chmod(self.db_path + suffix, 0o600)
        stored = dict(db.execute("SELECT name, value FROM meta"))
        want = dict(meta, schema=str(SCHEMA))
        if not stored and self._existing:
            log.warning("index %s was lost (empty, deleted, or its WAL removed before a checkpoint) while the "
                        "namespace's slab file remains; starting the namespace empty", self.db_path)
        if stored and any(stored.get(k) != v for k, v in want.items() if k != "nslots"):
            changed = sorted(k for k, v in want.items() if k != "nslots" and stored.get(k) != v)
            log.warning("index %s was written with other settings (%s); starting the namespace empty",
                        self.db_path, ", ".join(changed))
            db.execute("DELETE FROM pages")
        db.execute("BEGIN")
        db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", want.items())
        # Fewer slots than last time: the pages beyond the end are gone.
        db.execute("DELETE FROM pages WHERE slot >= ?", (self.nslots,))
        db.execute("COMMIT")
        return db

    def _load(self) -> None:
        # Millions of rows: no ORDER BY (a temp B-tree in SQLite; numpy sorts faster), no cyclic-GC
        # passes over the growing map, Entry built without its Python-level __new__.
        was = gc.isenabled()
        gc.disable()
        try:
            rows = self._db.execute("SELECT key, slot, nbytes, csum, atime FROM pages").fetchall()
            n = len(rows)
            atime = np.fromiter((r[4] for r in rows), dtype=np.int64, count=n)
            new = tuple.__new__
            self._map = OrderedDict([(r[0], new(Entry, r[1:4]))
                                     for r in map(rows.__getitem__, np.argsort(atime, kind="stable").tolist())])
            self._clock = int(atime.max()) + 1 if n else 1
            used = np.zeros(self.nslots, dtype=bool)
            used[np.fromiter((r[1] for r in rows), dtype=np.int64, count=n)] = True
            self._free = np.flatnonzero(~used)[::-1].tolist()
        finally:
            if was:
                gc.enable()

    def _reset_damaged(self, exc: Exception, meta: dict[str, str]) -> None:
        bad = f"{self.db_path}.damaged-{int(time.time())}"
        log.error("index %s is damaged (%s); moved it to %s and starting the namespace empty",
                  self.db_path, exc, bad)
        for suffix in ("", "-wal", "-shm"):
            try:
                os.replace(self.db_path + suffix, bad + suffix)
            except OSError:
                pass
        self._db = self._open(meta)
        self._load()

    def _txn(self, *statements: tuple[str, Iterable]) -> None:
        """Run statements in one transaction (caller holds the lock); OSError if SQLite cannot write."""
        try:
            self._db.execute("BEGIN")
            for sql, rows in statements:
                self._db.executemany(sql, rows)
            self._flush_touches()
            self._db.execute("COMMIT")
        except BaseException as exc:  # any exception: never leave the transaction open
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            if isinstance(exc, sqlite3.Error):
                raise OSError(f"index {self.db_path}: write failed: {exc}") from exc
            raise

    # -- queries ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def contains(self, keys: Sequence[str]) -> list[bool]:
        m = self._map
        return [k in m for k in keys]

    def prefix_len(self, keys: Sequence[str]) -> int:
        m = self._map
        for i, k in enumerate(keys):
            if k not in m:
                return i
        return len(keys)

    def lookup_pin(self, keys: Sequence[str]) -> list[Entry | None]:
        """Entries for `keys` (None for misses); hits are pinned and become most recently used."""
        out: list[Entry | None] = []
        with self._lock:
            for k in keys:
                e = self._map.get(k)
                if e is not None:
                    self._map.move_to_end(k)
                    self._touched[k] = self._clock
                    self._clock += 1
                    self._pins[e.slot] += 1
                out.append(e)
        return out

    def unpin(self, slots: Iterable[int]) -> None:
        with self._lock:
            for s in slots:
                self._pins[s] -= 1
                if self._pins[s] <= 0:
                    del self._pins[s]
                    if s in self._doomed:
                        self._doomed.discard(s)
                        self._free.append(s)

    # -- writes ----------------------------------------------------------------------------------
    def reserve(self, n: int, evict: bool = True) -> list[int]:
        """Up to `n` free slots, evicting least recently used pages as needed (committed first).

        With `evict=False` only free slots are handed out."""
        with self._lock:
            if evict and len(self._free) < n:
                victims = []
                need = n - len(self._free)
                for k, e in self._map.items():
                    if e.slot not in self._pins:
                        victims.append(k)
                        if len(victims) == need:
                            break
                if victims:
                    self._txn(("DELETE FROM pages WHERE key = ?", [(k,) for k in victims]))
                    for k in victims:
                        self._free.append(self._map.pop(k).slot)
                        self._touched.pop(k, None)
                    self.evictions += len(victims)
            take = min(n, len(self._free))
            out = self._free[len(self._free) - take:]
            del self._free[len(self._free) - take:]
            return out[::-1]

    def release(self, slots: Iterable[int]) -> None:
        """Return reserved slots whose write failed (its IO completed or never started)."""
        with self._lock:
            self._free.extend(slots)

    def lose(self, slots: Iterable[int]) -> None:
        """Retire reserved slots whose write timed out: the IO may still land, so never reuse them here."""
        with self._lock:
            self._lost.update(slots)

    def publish(self, items: Sequence[tuple[str, int, int, int]]) -> list[bool]:
        """Make (key, slot, nbytes, csum) visible; True per item unless the key was published meanwhile.

        The caller has finished writing every slot. A key already present keeps its first copy
        and the new slot is freed, so concurrent puts of one key leave exactly one copy.
        """
        with self._lock:
            fresh = []
            result = []
            dup_slots = []
            seen: set[str] = set()
            for key, slot, nbytes, csum in items:
                if key in self._map or key in seen:
                    dup_slots.append(slot)
                    result.append(False)
                else:
                    seen.add(key)
                    fresh.append((key, slot, nbytes, csum, self._clock))
                    self._clock += 1
                    result.append(True)
            if fresh:
                self._txn(("INSERT INTO pages VALUES (?, ?, ?, ?, ?)", fresh))
                for key, slot, nbytes, csum, _ in fresh:
                    self._map[key] = Entry(slot, nbytes, csum)
            self._free.extend(dup_slots)
            return result

    def drop(self, keys: Iterable[str]) -> int:
        """Remove keys (deleted, or failed their checksum). Returns how many were present."""
        with self._lock:
            gone = {k: self._map[k] for k in keys if k in self._map}  # a key named twice is dropped once
            if not gone:
                return 0
            self._txn(("DELETE FROM pages WHERE key = ?", [(k,) for k in gone]))
            for k, e in gone.items():
                del self._map[k]
                self._touched.pop(k, None)
                if e.slot in self._pins:
                    self._doomed.add(e.slot)
                else:
                    self._free.append(e.slot)
            return len(gone)

    def clear(self) -> int:
        with self._lock:
            keys = list(self._map)
        return self.drop(keys)

    def _flush_touches(self) -> None:
        if self._touched:
            self._db.executemany("UPDATE pages SET atime = ? WHERE key = ?",
                                 ((t, k) for k, t in self._touched.items()))
            self._touched.clear()

    def flush(self) -> None:
        with self._lock:
            if self._touched:
                self._txn()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"pages": len(self._map), "free_slots": len(self._free), "slots": self.nslots,
                    "pinned_slots": len(self._pins), "lost_slots": len(self._lost), "evictions": self.evictions}

    def close(self) -> None:
        with self._lock:
            if self._db is None:
                return
            try:
                if self._touched:
                    self._txn()
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except (OSError, sqlite3.Error) as exc:
                log.warning("index %s: closing without a checkpoint: %s", self.db_path, exc)
            finally:
                self._db.close()
                self._db = None  # type: ignore[assignment]
