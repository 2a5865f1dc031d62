"""`KeyMap`: this process's map of a namespace's published pages (key -> `Entry`), kept in step with
the database, so lookups (`exists`, `prefix`) cost a dict access instead of a query.

Each lookup asks SQLite whether another connection committed since (``PRAGMA data_version``, no
IO) and, if so, applies the rows published since the last change number the map saw and the keys
removed since (``gone``); a map that fell behind the trim of ``gone``, or a `clear`, is read again
whole (`reloads`). So a page one process publishes is seen by every other at its next lookup.

A large map (`Index.BACKGROUND_ROWS` rows or more) loads in a background thread; until it is in
place (`ready`) the index answers lookups from SQLite by primary key.
"""

from __future__ import annotations

import gc
import logging
import sqlite3
import threading
import time
from contextlib import contextmanager
from itertools import repeat
from typing import Callable, Iterator

import numpy as np

from .schema import HAS_JSON, Entry, connect, damaged

__all__ = ["KeyMap"]

log = logging.getLogger("hicache_gds.index")
# Rows per read step (one SQL aggregate, most of it without the GIL) and per build step (holds the
# GIL: about 10 ms, so lookups in other threads wait no longer than that while the map loads).
_READ_ROWS = 65536
_BUILD_ROWS = 8192
_CHUNK_SQL = ("SELECT count(*), group_concat(key, char(0)), group_concat(slot), group_concat(nbytes), "
              "group_concat(csum) FROM pages WHERE rowid >= ? AND rowid < ?")

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


class KeyMap:
    """The map and its loading. `lock` is the index's read lock, which also guards its read
    connection: `sync` and `reset` are called with it held, the loads take it to install."""

    def __init__(self, db_path: str, lock: threading.Lock, t0: float) -> None:
        self.db_path = db_path
        self.lock = lock
        self.map: dict[str, Entry] = {}
        self.seq = 0  # the change number the map reflects
        self.dv: int | None = None  # the read connection's data_version at the last sync
        self.ready = False  # the map is in place (until then lookups go to SQLite)
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.loaded_s: float | None = None  # index open until the map was in place
        self.reloads = 0  # times a sync read the whole map again (it fell behind the removals kept)
        self.closing = False  # set by `stop`: the loads give up at their next step
        self._t0 = t0
        self._loader: threading.Thread | None = None
        self._loader_db: sqlite3.Connection | None = None

    # -- loading ---------------------------------------------------------------------------------
    def _read(self, db: sqlite3.Connection) -> tuple[int, list[str], np.ndarray, np.ndarray, np.ndarray]:
        """The change number and every row, as columns (keys; slot, nbytes, csum), in one read
        transaction. Chunks of rowids, each one aggregate step: SQLite works without the GIL, and
        Python splits a few MB of text per chunk instead of building a tuple and four objects per row."""
        keys: list[str] = []
        cols: list[list[np.ndarray]] = []
        db.execute("BEGIN")
        try:
            (seq,) = db.execute("SELECT seq FROM clock").fetchone()
            n = db.execute("SELECT count(*) FROM pages").fetchone()[0]
            starts, span = range(0), 1
            if n:  # spans of rowids holding about _READ_ROWS rows each, however sparse the rowids
                lo = db.execute("SELECT min(rowid) FROM pages").fetchone()[0]
                hi = db.execute("SELECT max(rowid) FROM pages").fetchone()[0]
                span = _READ_ROWS * max(1, (hi - lo + 1) // n)
                starts = range(lo, hi + 1, span)
            for a in starts:
                if self.closing:
                    raise _Closing
                m, k, *ints = db.execute(_CHUNK_SQL, (a, a + span)).fetchone()
                if not m:
                    continue
                ks = k.split("\0")
                try:
                    arr = [np.fromstring(x, dtype=np.int64, sep=",") for x in ints]
                except (ValueError, DeprecationWarning):
                    arr = []
                if len(ks) != m or len(arr) != 3 or any(len(x) != m for x in arr):
                    raise sqlite3.DatabaseError(f"malformed rows among rowids {a}..{a + span - 1} "
                                                f"(a key holding NUL, or a number that is not an integer)")
                keys.extend(ks)
                cols.append(arr)
        finally:
            db.execute("COMMIT")
        if not cols:
            return seq, keys, *(np.zeros(0, dtype=np.int64) for _ in range(3))  # type: ignore[return-value]
        slot, nbytes, csum = (np.concatenate(c) for c in zip(*cols))
        return seq, keys, slot, nbytes, csum

    def _build(self, seq: int, keys: list[str], slot: np.ndarray, nbytes: np.ndarray,
               csum: np.ndarray) -> tuple[dict[str, Entry], int]:
        """The map, built without Entry's Python-level __new__, in chunks that each return to the
        interpreter so lookups in other threads get the GIL."""
        m: dict[str, Entry] = {}
        new = tuple.__new__
        with _gc_paused():
            for a in range(0, len(keys), _BUILD_ROWS):
                if self.closing:
                    raise _Closing
                ents = map(new, repeat(Entry), zip(slot[a:a + _BUILD_ROWS].tolist(), nbytes[a:a + _BUILD_ROWS].tolist(),
                                                   csum[a:a + _BUILD_ROWS].tolist()))
                m.update(zip(keys[a:a + _BUILD_ROWS], ents))
                gc.collect(0)  # untracks this chunk's Entry tuples now, not in one long pass later
        return m, seq

    def _install(self, m: dict[str, Entry], seq: int) -> None:
        with self.lock:
            self.map, self.seq, self.dv = m, seq, None  # the next lookup catches up from `seq`
            self.ready = True
            self.loaded_s = time.perf_counter() - self._t0
        self.loaded.set()

    def load_now(self, db: sqlite3.Connection) -> None:
        """Load the map in this thread from the read connection `db` (small indexes, reloads)."""
        with self.lock:
            m, seq = self._build(*self._read(db))
        self._install(m, seq)

    def start(self, db: sqlite3.Connection, rows: int, background_rows: int | None,
              hook: Callable[[], None] | None, on_damage: Callable[[BaseException], None]) -> None:
        """Load the map: in a background thread when the database has at least `background_rows`
        rows (None: never), else now. `hook` runs in the loader with the map built, before it is
        installed (tests); `on_damage(exc)` when the loader finds the database damaged."""
        if background_rows is not None and rows >= background_rows and HAS_JSON:
            self.loaded.clear()
            self._loader = threading.Thread(target=self._load_in_background, args=(hook, on_damage),
                                            name="hicache-gds-index-load", daemon=True)
            self._loader.start()
        else:
            self.load_now(db)

    def _load_in_background(self, hook: Callable[[], None] | None,
                            on_damage: Callable[[BaseException], None]) -> None:
        try:
            db = connect(self.db_path)
            self._loader_db = db  # stop() interrupts it
            try:
                if self.closing:
                    raise _Closing
                cols = self._read(db)
            finally:
                self._loader_db = None
                db.close()
            built = self._build(*cols)
            del cols
            if hook is not None:
                hook()
            if self.closing:
                raise _Closing
            self._install(*built)
        except _Closing:
            pass
        except BaseException as exc:  # noqa: BLE001
            if self.closing:  # closing interrupts the read with an OperationalError
                pass
            elif isinstance(exc, sqlite3.DatabaseError) and damaged(exc):
                on_damage(exc)
            else:  # a full disk or an IO error is no damage: the database stays as it is
                self.load_error = exc
                log.error("index %s: loading the map failed (%s: %s); lookups are answered from SQLite",
                          self.db_path, type(exc).__name__, exc)
        finally:
            self.loaded.set()

    def stop(self) -> None:
        """Make a load in progress give up (its read is interrupted, its build stops at the next
        chunk) and wait for it."""
        self.closing = True
        loader_db = self._loader_db
        if loader_db is not None:
            try:
                loader_db.interrupt()
            except sqlite3.Error:  # the loader closed it meanwhile
                pass
        if self._loader is not None and self._loader is not threading.current_thread():
            self._loader.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the map is in place (True), the load failed or `timeout` passed (False)."""
        self.loaded.wait(timeout)
        return self.ready

    def reset(self) -> None:
        """Forget the map (the database was replaced); lookups go to SQLite until `load_now`."""
        with self.lock:
            self.map, self.seq, self.dv = {}, 0, None
            self.ready = False

    # -- keeping up ------------------------------------------------------------------------------
    def sync(self, db: sqlite3.Connection) -> None:
        """Bring the map up to the database through the read connection `db` (caller holds `lock`,
        the map is in place)."""
        (dv,) = db.execute("PRAGMA data_version").fetchone()
        if dv == self.dv:
            return
        db.execute("BEGIN")
        try:
            seq, trimmed = db.execute("SELECT seq, trimmed FROM clock").fetchone()
            if trimmed > self.seq:  # removals we missed were trimmed, or a clear: read it all again
                db.execute("COMMIT")
                self.map, self.seq = self._build(*self._read(db))
                self.reloads += 1
            elif seq != self.seq:
                m = self.map
                for (k,) in db.execute("SELECT key FROM gone WHERE seq > ?", (self.seq,)):
                    m.pop(k, None)
                for k, s, n, c in db.execute("SELECT key, slot, nbytes, csum FROM pages WHERE seq > ?", (self.seq,)):
                    m[k] = Entry(s, n, c)
                self.seq = seq
        finally:
            if db.in_transaction:
                db.execute("COMMIT")
        self.dv = dv
