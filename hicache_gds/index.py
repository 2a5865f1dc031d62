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

Open is quick at any size: the constructor opens the database (SQLite replays its WAL after a
crash) and returns; an index of `Index.BACKGROUND_ROWS` rows or more loads its in-memory map in a
background thread. Until the map is in place:

* lookups (`contains`, `prefix_len`, `lookup_pin`) are answered from SQLite by primary key under
  the lock; pins are counted as usual, and hits are replayed as LRU touches when the map arrives;
* writes (`reserve`, `publish`, `drop`, `clear`, ...) wait for the map (`LOAD_WAIT_S` at most,
  then `OSError`), so the loader reads a database nobody changes and the swap loses nothing;
* the loader only reads, so a kill -9 during the load leaves the index as it was.

`recovery_s` is open until lookups are served; `loaded_s` is open until the map is in place.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sqlite3
import threading
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager
from itertools import repeat
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

__all__ = ["Entry", "Index", "read_keys", "INDEX_FILE", "LOAD_WAIT_S"]

INDEX_FILE = "index.sqlite3"
LOAD_WAIT_S = 120.0
"""How long a write waits for a background load before it fails with `OSError`."""

log = logging.getLogger("hicache_gds.index")
SCHEMA = 1
# Rows per read step (one SQL aggregate, most of it without the GIL) and per build step (holds the
# GIL: about 10 ms, so lookups in other threads wait no longer than that while the map loads).
_READ_ROWS = 65536
_BUILD_ROWS = 8192
_LOOKUP_SQL = ("SELECT json_group_array(json_array(key, slot, nbytes, csum)) FROM pages "
               "WHERE key IN (SELECT value FROM json_each(?))")
_CHUNK_SQL = ("SELECT count(*), group_concat(key, char(0)), group_concat(slot), group_concat(nbytes), "
              "group_concat(csum), group_concat(atime) FROM pages WHERE rowid >= ? AND rowid < ?")


def _sqlite_has_json() -> bool:
    db = sqlite3.connect(":memory:")
    try:
        db.execute("SELECT json_group_array(1)")
        return True
    except sqlite3.Error:  # built without JSON: lookups cannot be answered from SQLite, so load in place
        return False
    finally:
        db.close()


_HAS_JSON = _sqlite_has_json()
_IN_CHUNK = 500  # keys per `IN (...)` query without JSON: far below SQLite's bound-parameter limit


def select_entries(db: sqlite3.Connection, keys: Sequence[str]) -> dict[str, "Entry"]:
    """Rows of `keys` read by primary key: one statement (one GIL round trip) where SQLite has
    JSON, else `IN (...)` chunks. Raises `sqlite3.Error`."""
    if _HAS_JSON:
        (js,) = db.execute(_LOOKUP_SQL, (json.dumps(list(keys), ensure_ascii=False),)).fetchone()
        return {k: Entry(s, n, c) for k, s, n, c in json.loads(js)}
    uniq = list(dict.fromkeys(keys))
    found: dict[str, Entry] = {}
    for i in range(0, len(uniq), _IN_CHUNK):
        chunk = uniq[i:i + _IN_CHUNK]
        sql = f"SELECT key, slot, nbytes, csum FROM pages WHERE key IN ({','.join('?' * len(chunk))})"
        for k, slot, nbytes, csum in db.execute(sql, chunk):
            found[k] = Entry(int(slot), int(nbytes), int(csum))
    return found


def read_keys(namespace_dir: str) -> list[str]:
    """Keys a namespace holds, least recently used first, read without writing or locking.

    For processes that must not open the store (it has one writer): a vLLM scheduler
    rebuilding its view of what workers hold, tools, tests. Reads through `IndexReader`, so not
    even SQLite's -wal / -shm files are created. Any failure returns [].
    """
    from .index_reader import IndexReader  # index_reader imports this module

    path = os.path.join(namespace_dir, INDEX_FILE)
    if not os.path.exists(path):
        return []
    try:
        reader = IndexReader(path)
        try:
            return reader.keys()
        finally:
            reader.close()
    except Exception as exc:  # noqa: BLE001 -- documented: any failure (a planted link too) is an empty answer
        log.warning("index %s cannot be read (%s)", path, exc)
        return []


class Entry(NamedTuple):
    slot: int
    nbytes: int
    csum: int


_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic-GC passes over a map growing by a million entries (they double the build time).

    Counted, so loads in several threads restore the collector only when the last one ends."""
    global _gc_pauses, _gc_was_enabled
    with _gc_lock:
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


class _Closing(Exception):
    """The index was closed while its map was loading."""


class Index:
    """Thread-safe key -> `Entry` map over `nslots` slots, persisted at `db_path`."""

    BACKGROUND_ROWS = 50_000
    """Indexes with at least this many rows load their map in a background thread; smaller ones
    (tens of milliseconds) before the constructor returns."""
    _load_hook: Callable[[Index], None] | None = None
    """Tests: called in the loader thread with the map built, just before it is put in place."""

    def __init__(self, db_path: str, nslots: int, meta: dict[str, str], existing: bool = False,
                 gone: Iterable[tuple[int, int]] = (), background: bool = True) -> None:
        """`existing`: the namespace holds slots from an earlier run, so a database without our
        settings means the index was lost (emptied, deleted, or its WAL removed before a checkpoint).
        `gone`: (first, step) pairs naming slots whose bytes no longer exist (slab files found short
        at open): their rows are deleted. `background`: allow the background load."""
        self.db_path = db_path
        self._existing = existing
        self.nslots = nslots
        self._lock = threading.Lock()
        self._map: OrderedDict[str, Entry] = OrderedDict()  # oldest first
        self._free: list[int] = []
        self._clock = 1
        self._pins: Counter[int] = Counter()
        self._doomed: set[int] = set()  # dropped while pinned: freed on unpin
        self._lost: set[int] = set()  # written by a timed-out request: never reused in this process
        self._touched: dict[str, int] = {}
        self._ready = False  # the map is in place (until then lookups go to SQLite)
        self._loaded = threading.Event()  # the load ended, in place or failed (`_load_error`)
        self._load_error: BaseException | None = None
        self._early: dict[str, None] = {}  # keys hit while loading, oldest first: LRU touches to replay
        self._rows = 0  # rows at open: the page count while loading
        self._loader: threading.Thread | None = None
        self._loader_db: sqlite3.Connection | None = None
        self._closing = False
        self._db: sqlite3.Connection | None = None
        self.evictions = 0
        self.recovery_s = 0.0
        self.loaded_s: float | None = None
        self._t0 = time.perf_counter()
        try:
            self._db = self._open(meta, gone)
            self._rows = self._db.execute("SELECT count(*) FROM pages").fetchone()[0]
            if background and self._rows >= self.BACKGROUND_ROWS and _HAS_JSON:
                self._loader = threading.Thread(target=self._load_in_background, args=(meta,),
                                                name="hicache-gds-index-load", daemon=True)
                self._loader.start()
            else:
                self._install(*self._build(*self._read(self._db)))
        except sqlite3.DatabaseError as exc:
            self._reset_damaged(exc, meta)
        self.recovery_s = time.perf_counter() - self._t0

    # -- open / recover --------------------------------------------------------------------------
    def _open(self, meta: dict[str, str], gone: Iterable[tuple[int, int]]) -> sqlite3.Connection:
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
        lost = 0
        for first, step in gone:  # slots of a slab file that was truncated or deleted while closed
            lost += db.execute("DELETE FROM pages WHERE slot >= ? AND (slot - ?) % ? = 0",
                               (first, first, step)).rowcount
        db.execute("COMMIT")
        if lost:
            log.error("index %s: %d page(s) lie past the end of their slab file (truncated or deleted while the "
                      "store was closed); dropped", self.db_path, lost)
        return db

    def _read(self, db: sqlite3.Connection) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every row, as columns (keys; slot, nbytes, csum, atime), in one read transaction.

        Chunks of rowids, each one aggregate step: SQLite works without the GIL, and Python
        splits a few MB of text per chunk instead of building a tuple and five objects per row."""
        keys: list[str] = []
        cols: list[list[np.ndarray]] = []
        db.execute("BEGIN")
        try:
            n = db.execute("SELECT count(*) FROM pages").fetchone()[0]
            starts, span = range(0), 1
            if n:  # spans of rowids holding about _READ_ROWS rows each, however sparse the rowids
                lo = db.execute("SELECT min(rowid) FROM pages").fetchone()[0]
                hi = db.execute("SELECT max(rowid) FROM pages").fetchone()[0]
                span = _READ_ROWS * max(1, (hi - lo + 1) // n)
                starts = range(lo, hi + 1, span)
            for a in starts:
                if self._closing:
                    raise _Closing
                m, k, *ints = db.execute(_CHUNK_SQL, (a, a + span)).fetchone()
                if not m:
                    continue
                ks = k.split("\0")
                try:
                    arr = [np.fromstring(x, dtype=np.int64, sep=",") for x in ints]
                except (ValueError, DeprecationWarning):
                    arr = []
                if len(ks) != m or len(arr) != 4 or any(len(x) != m for x in arr):
                    raise sqlite3.DatabaseError(f"malformed rows among rowids {a}..{a + span - 1} "
                                                f"(a key holding NUL, or a number that is not an integer)")
                keys.extend(ks)
                cols.append(arr)
        finally:
            db.execute("COMMIT")
        if not cols:
            return keys, *(np.zeros(0, dtype=np.int64) for _ in range(4))  # type: ignore[return-value]
        slot, nbytes, csum, atime = (np.concatenate(c) for c in zip(*cols))
        return keys, slot, nbytes, csum, atime

    def _build(self, keys: list[str], slot: np.ndarray, nbytes: np.ndarray, csum: np.ndarray,
               atime: np.ndarray) -> tuple[OrderedDict[str, Entry], list[int], int]:
        """The map in LRU order (numpy sorts atime: no ORDER BY, a temp B-tree in SQLite), the free
        list, the clock. Entry is built without its Python-level __new__, in chunks that each
        return to the interpreter so lookups in other threads get the GIL."""
        order = np.argsort(atime, kind="stable")
        m: OrderedDict[str, Entry] = OrderedDict()
        new = tuple.__new__
        with _gc_paused():
            for a in range(0, len(order), _BUILD_ROWS):
                if self._closing:
                    raise _Closing
                o = order[a:a + _BUILD_ROWS]
                ents = map(new, repeat(Entry), zip(slot[o].tolist(), nbytes[o].tolist(), csum[o].tolist()))
                m.update(zip(map(keys.__getitem__, o.tolist()), ents))
                gc.collect(0)  # untracks this chunk's Entry tuples now, not in one long pass later
        used = np.zeros(self.nslots, dtype=bool)
        used[slot] = True
        free = np.flatnonzero(~used)[::-1].tolist()
        return m, free, int(atime.max()) + 1 if len(atime) else 1

    def _install(self, m: OrderedDict[str, Entry], free: list[int], clock: int) -> None:
        """Put a loaded map in place; lookups made while loading become LRU touches."""
        with self._lock:
            for k in self._early:
                if k in m:
                    m.move_to_end(k)
                    self._touched[k] = clock
                    clock += 1
            self._early.clear()
            self._map, self._free, self._clock = m, free, clock
            self._ready = True
            self.loaded_s = time.perf_counter() - self._t0
        self._loaded.set()

    def _load_in_background(self, meta: dict[str, str]) -> None:
        try:
            db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None, timeout=30)
            self._loader_db = db  # close() interrupts it
            try:
                if self._closing:
                    raise _Closing
                cols = self._read(db)
            finally:
                self._loader_db = None
                db.close()
            built = self._build(*cols)
            del cols
            hook = type(self)._load_hook  # from the class: a plain function is not bound
            if hook is not None:
                hook(self)
            if self._closing:
                raise _Closing
            self._install(*built)
        except _Closing:
            pass
        except sqlite3.DatabaseError as exc:
            if not self._closing:  # closing interrupts the read with an OperationalError
                try:
                    self._reset_damaged(exc, meta)
                except BaseException as exc2:  # noqa: BLE001
                    self._load_failed(exc2)
        except BaseException as exc:  # noqa: BLE001
            self._load_failed(exc)
        finally:
            self._loaded.set()

    def _load_failed(self, exc: BaseException) -> None:
        self._load_error = exc
        log.error("index %s: loading the map failed (%s: %s); lookups are answered from SQLite and writes fail",
                  self.db_path, type(exc).__name__, exc)

    def _reset_damaged(self, exc: Exception, meta: dict[str, str]) -> None:
        bad = f"{self.db_path}.damaged-{int(time.time())}"
        log.error("index %s is damaged (%s); moved it to %s and starting the namespace empty",
                  self.db_path, exc, bad)
        with self._lock:
            if self._db is not None:
                self._db.close()
            for suffix in ("", "-wal", "-shm"):
                try:
                    os.replace(self.db_path + suffix, bad + suffix)
                except OSError:
                    pass
            self._db = self._open(meta, ())
            self._rows = 0
            pinned = set(self._pins)  # lookups served while loading read them: freed on unpin
            self._doomed |= pinned
        self._install(OrderedDict(), [s for s in range(self.nslots - 1, -1, -1) if s not in pinned], 1)

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the map is in place (True), the load failed or `timeout` passed (False)."""
        self._loaded.wait(timeout)
        return self._ready

    def _writable(self) -> None:
        """Writes start once the map is in place: wait for a background load, boundedly."""
        if not self._loaded.is_set() and not self._loaded.wait(LOAD_WAIT_S):
            raise OSError(f"index {self.db_path}: still loading after {LOAD_WAIT_S:.0f} s; nothing written")
        if not self._ready:
            raise OSError(f"index {self.db_path}: the map did not load ({self._load_error}); nothing written")

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
    def _rows_for(self, keys: Sequence[str]) -> dict[str, Entry]:
        """Rows of `keys` read from SQLite by primary key, in one statement (caller holds the lock;
        the map is still loading). One result row, so one GIL round trip however many keys."""
        try:
            return select_entries(self._db, keys)
        except (sqlite3.Error, ValueError) as exc:
            log.warning("index %s: lookup while loading failed (%s); answered as misses", self.db_path, exc)
            return {}

    def __len__(self) -> int:
        return len(self._map) if self._ready else self._rows

    def __contains__(self, key: object) -> bool:
        if self._ready:
            return key in self._map
        return isinstance(key, str) and self.contains([key])[0]

    def _present(self, keys: Sequence[str]) -> dict[str, Entry]:
        """The map, or while it loads the rows of `keys` read from SQLite."""
        if self._ready:
            return self._map
        with self._lock:
            return self._map if self._ready else self._rows_for(keys)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        m = self._present(keys)
        return [k in m for k in keys]

    def prefix_len(self, keys: Sequence[str]) -> int:
        m = self._present(keys)
        for i, k in enumerate(keys):
            if k not in m:
                return i
        return len(keys)

    def lookup_pin(self, keys: Sequence[str]) -> list[Entry | None]:
        """Entries for `keys` (None for misses); hits are pinned and become most recently used."""
        out: list[Entry | None] = []
        with self._lock:
            if not self._ready:
                found = self._rows_for(keys)
                for k in keys:
                    e = found.get(k)
                    if e is not None:
                        if self._load_error is None:
                            self._early.pop(k, None)
                            self._early[k] = None
                        self._pins[e.slot] += 1
                    out.append(e)
                return out
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
        if n <= 0:
            return []
        self._writable()
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
        if not items:
            return []
        self._writable()
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
        keys = list(keys)
        if not keys:
            return 0
        self._writable()
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
        self._writable()
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
            free = len(self._free) if self._ready else self.nslots - self._rows
            return {"pages": len(self), "free_slots": free, "slots": self.nslots,
                    "pinned_slots": len(self._pins), "lost_slots": len(self._lost), "evictions": self.evictions}

    def close(self) -> None:
        self._closing = True
        loader_db = self._loader_db
        if loader_db is not None:
            try:
                loader_db.interrupt()  # a read in progress stops; the build stops at its next chunk
            except sqlite3.Error:  # the loader closed it meanwhile
                pass
        if self._loader is not None and self._loader is not threading.current_thread():
            self._loader.join()
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
                self._db = None
