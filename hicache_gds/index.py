"""Key -> slot index of one namespace, shared by every process that has it open: SQLite in WAL mode.

The database is the one truth for everything processes must agree on, and each change is one
``BEGIN IMMEDIATE`` transaction (SQLite's writer lock: writers take turns, readers never wait):

* ``pages``: published pages (key -> slot, size, checksum, LRU clock ``atime``, change number ``seq``);
* slot ownership: every slot is exactly one of published (``pages``), free (``free``, or at or
  above ``clock.top``: never used yet), reserved by a writer (``held``, tagged with the owner's
  token; ``lost`` when its write timed out), or dropped while being read (``doomed``);
* ``leases``: slots a process is reading (owner token per slot). Eviction never picks a leased
  slot, and a leased slot dropped by delete/clear/a bad checksum is ``doomed`` -- reused only once
  no lease names it -- so a slot is never rewritten while another process reads it;
* ``clock``: the change counter (bumped when the set of pages changes), the LRU clock (one LRU
  per namespace: every process's reads touch it, without a change number, so reads never age
  other processes' maps), the never-used boundary ``top`` and ``trimmed`` (see lookups below).

Crash safety lives here and in the store's write order, nowhere else:

* a page is published (row committed) only after its bytes are on disk, and only into a slot its
  publisher holds (``held``), so no slot ever names two keys;
* a slot is reused only after the row that pointed at it is deleted and committed, and no lease
  names it;
* what a process holds is tagged with its owner token (`owners.Membership`): when that process
  is gone, however it died, the survivors reclaim its reservations and leases
  (`Index.reclaim`), and the first process to open a namespace nobody has open reclaims all.

So after a kill -9 the database names only pages whose bytes were completely written, and every
page whose `put` returned True is there. WAL with synchronous=NORMAL survives process crashes;
`sync=True` in the store adds fdatasync of the data for power loss.

Lookups (`contains`, `prefix_len`) are answered from a per-process map of the pages, kept in
step with the database: each lookup asks SQLite whether another connection committed since
(``PRAGMA data_version``, no IO) and, if so, applies the rows published since the last change
number it saw and the keys removed since (``gone``, trimmed as it ages; a process that fell
behind the trim, or a `clear`, reloads the map). So a page one process publishes is seen by
every other at its next lookup. Reads (`lookup_pin`) go to the database itself, in the
transaction that leases their slots and touches their LRU clock.

Open is quick at any size: an index of `Index.BACKGROUND_ROWS` rows or more loads its map in a
background thread, and until it is in place lookups are answered from SQLite by primary key.
Writes never wait for it: they run in the database. `recovery_s` is open until lookups are
served; `loaded_s` is open until the map is in place.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from itertools import repeat
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from . import ondisk

if TYPE_CHECKING:
    from .owners import Membership

__all__ = ["Entry", "Index", "INDEX_FILE", "SCHEMA", "remove_pages", "select_entries"]

INDEX_FILE = "index.sqlite3"
log = logging.getLogger("hicache_gds.index")
SCHEMA = 2
# Rows per read step (one SQL aggregate, most of it without the GIL) and per build step (holds the
# GIL: about 10 ms, so lookups in other threads wait no longer than that while the map loads).
_READ_ROWS = 65536
_BUILD_ROWS = 8192
_LOOKUP_SQL = ("SELECT json_group_array(json_array(key, slot, nbytes, csum)) FROM pages "
               "WHERE key IN (SELECT value FROM json_each(?))")
_CHUNK_SQL = ("SELECT count(*), group_concat(key, char(0)), group_concat(slot), group_concat(nbytes), "
              "group_concat(csum) FROM pages WHERE rowid >= ? AND rowid < ?")
_TABLES = ("meta", "pages", "gone", "clock", "free", "held", "leases", "doomed")
_CREATE = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pages (key TEXT PRIMARY KEY, slot INTEGER NOT NULL UNIQUE, nbytes INTEGER NOT NULL,
                                  csum INTEGER NOT NULL, atime INTEGER NOT NULL, seq INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS pages_atime ON pages (atime);
CREATE INDEX IF NOT EXISTS pages_seq ON pages (seq);
CREATE TABLE IF NOT EXISTS gone (seq INTEGER NOT NULL, key TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS gone_seq ON gone (seq);
CREATE TABLE IF NOT EXISTS clock (id INTEGER PRIMARY KEY CHECK (id = 0), seq INTEGER NOT NULL,
                                  atime INTEGER NOT NULL, top INTEGER NOT NULL, trimmed INTEGER NOT NULL);
INSERT OR IGNORE INTO clock VALUES (0, 0, 1, 0, 0);
CREATE TABLE IF NOT EXISTS free (slot INTEGER PRIMARY KEY);
CREATE TABLE IF NOT EXISTS held (slot INTEGER PRIMARY KEY, owner TEXT NOT NULL, lost INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (slot INTEGER NOT NULL, owner TEXT NOT NULL, PRIMARY KEY (slot, owner))
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS doomed (slot INTEGER PRIMARY KEY);
"""
_GONE_KEEP = 4096  # change numbers of removed keys kept for other processes' maps to catch up with
_RECLAIM_EVERY_S = 1.0  # a put short of free slots looks for dead owners at most this often
_BUSY_S = 30.0  # how long a transaction waits for another process's (SQLite's busy timeout)


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


class Entry(NamedTuple):
    slot: int
    nbytes: int
    csum: int


def select_entries(db: sqlite3.Connection, keys: Sequence[str]) -> dict[str, Entry]:
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


def _damage(exc: BaseException) -> bool:
    """Is this SQLite error a damaged database (not a busy lock, a full disk or an IO error)?"""
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        return True
    msg = str(exc)
    return getattr(exc, "sqlite_errorcode", 0) in (11, 26) or "no such table" in msg or "malformed" in msg


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


def _connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=_BUSY_S)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


def _slot_list(db: sqlite3.Connection, sql: str, *args: object) -> list[int]:
    return [int(s) for (s,) in db.execute(sql, args)]


def _bump(db: sqlite3.Connection, atimes: int = 0) -> tuple[int, int]:
    """A new change number (the set of pages changes), and the first of `atimes` new LRU clock
    values (inside a write transaction)."""
    db.execute("UPDATE clock SET seq = seq + 1, atime = atime + ?", (atimes,))
    seq, atime = db.execute("SELECT seq, atime FROM clock").fetchone()
    if seq % 256 == 0 and seq > _GONE_KEEP:
        db.execute("DELETE FROM gone WHERE seq <= ?", (seq - _GONE_KEEP,))
        db.execute("UPDATE clock SET trimmed = max(trimmed, ?)", (seq - _GONE_KEEP,))
    return seq, atime - atimes


def _tick(db: sqlite3.Connection, atimes: int) -> int:
    """The first of `atimes` new LRU clock values, without a change number: reads touch pages, they
    do not change which pages exist, so they never age other processes' maps (inside a write
    transaction)."""
    db.execute("UPDATE clock SET atime = atime + ?", (atimes,))
    (atime,) = db.execute("SELECT atime FROM clock").fetchone()
    return atime - atimes


def _unpublish(db: sqlite3.Connection, keys: Iterable[str]) -> None:
    """Delete these pages' rows under a new change number, with `gone` rows: every process's map
    drops the keys at its next lookup. Their slots are the caller's."""
    keys = list(keys)
    seq, _ = _bump(db)
    db.executemany("DELETE FROM pages WHERE key = ?", ((k,) for k in keys))
    db.executemany("INSERT INTO gone VALUES (?, ?)", ((seq, k) for k in keys))


def remove_pages(db: sqlite3.Connection, slots: Mapping[str, int]) -> None:
    """Delete published pages (key -> its slot), inside a write transaction, the way every open
    `Index` sees it: a change number and `gone` rows (each process's map drops the keys at its
    next lookup); leased slots become doomed, the others free. Any writer of the database --
    `Index` itself, or an operator's tool -- removes pages through this."""
    _unpublish(db, slots)
    leased = set(_slot_list(db, "SELECT DISTINCT slot FROM leases"))
    db.executemany("INSERT INTO doomed VALUES (?)", ((s,) for s in slots.values() if s in leased))
    db.executemany("INSERT INTO free VALUES (?)", ((s,) for s in slots.values() if s not in leased))


class Index:
    """Thread- and process-safe key -> `Entry` index over `nslots` slots, at `db_path` (module docstring).

    `member` is this store's `owners.Membership` (its token tags what it holds; it tells live
    owners from dead ones); None for a private index (tools, tests), whose token is ``"-"`` and
    which treats every other token as dead.
    """

    BACKGROUND_ROWS = 50_000
    """Indexes with at least this many rows load their map in a background thread; smaller ones
    (tens of milliseconds) before the constructor returns."""
    _load_hook: Callable[[Index], None] | None = None
    """Tests: called in the loader thread with the map built, just before it is put in place."""

    def __init__(self, db_path: str, nslots: int, meta: dict[str, str] | None, existing: bool = False,
                 gone: Iterable[tuple[int, int]] = (), background: bool = True, *,
                 member: Membership | None = None, first: bool = True, load_map: bool = True) -> None:
        """`existing`: the namespace holds slots from an earlier run, so a database without our
        settings means the index was lost (emptied, deleted, or its WAL removed before a checkpoint).
        `gone`: (first, step) pairs naming slots whose bytes no longer exist (slab files found short
        at open): their rows are deleted. `background`: allow the background load. `first`: no
        other process has the namespace open (the caller holds `owners.setup_lock`), so this open
        recovers it: reservations and leases of earlier runs are freed, the size may change, and a
        database of other settings is started anew. `meta=None` (with `first=False`): join the
        namespace as its stores made it, whatever its settings, `nslots` read from it -- for
        processes that only look up and lease (a vLLM scheduler). `load_map=False`: no map in
        memory, lookups go to SQLite."""
        self.db_path = db_path
        self.nslots = nslots
        self.member = member
        self.owner = member.token if member is not None else "-"
        self._meta = meta
        self._existing = existing
        self._rlock = threading.Lock()  # the read connection and the map
        self._wlock = threading.Lock()  # the write connection and this process's pins
        self._map: dict[str, Entry] = {}
        self._seq = 0  # the change number the map reflects
        self._dv: int | None = None  # the read connection's data_version at the last sync
        self._pins: dict[int, int] = {}  # slot -> reads in flight in this process (one lease row each)
        self._unleased: list[int] = []  # leases whose removal failed: retried with the next write
        self._lost: set[int] = set()  # reserved slots whose write timed out: never reused while we live
        self._ready = False  # the map is in place (until then lookups go to SQLite)
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._rows = 0
        self._loader: threading.Thread | None = None
        self._loader_db: sqlite3.Connection | None = None
        self._closing = False
        self._wdb: sqlite3.Connection | None = None
        self._rdb: sqlite3.Connection | None = None
        self._ino = 0
        self._last_reclaim = 0.0
        self.evictions = 0
        self.reclaimed = 0
        self.map_reloads = 0  # times a lookup read the whole map again (it fell behind the removals kept)
        self.recovery_s = 0.0
        self.loaded_s: float | None = None
        self._t0 = time.perf_counter()
        try:
            self._open(gone, first)
        except sqlite3.DatabaseError as exc:
            if meta is None:
                raise OSError(f"index {db_path} cannot be joined: {exc}") from exc
            self._reset_damaged(exc, locked=True)  # the caller holds the setup lock
        self.reclaim()
        self._rows = self._count("SELECT count(*) FROM pages")
        if load_map:
            self._start_load(background)
        else:
            self._loaded.set()  # nothing to wait for: lookups go to SQLite
        self.recovery_s = time.perf_counter() - self._t0

    @classmethod
    def join(cls, db_path: str, member: Membership | None, *, load_map: bool = True) -> "Index":
        """The index of an existing namespace other processes write, for lookups and leases only."""
        if not os.path.isfile(db_path) or os.path.islink(db_path):
            raise FileNotFoundError(f"index {db_path}: no such namespace (yet)")
        return cls(db_path, 0, None, member=member, first=False, load_map=load_map)

    # -- open / recover --------------------------------------------------------------------------
    def _open(self, gone: Iterable[tuple[int, int]], first: bool) -> None:
        fd = os.open(self.db_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
        db = self._wdb = _connect(self.db_path)
        self._ino = os.stat(self.db_path).st_ino
        for suffix in ("-wal", "-shm"):
            if os.path.exists(self.db_path + suffix):
                os.chmod(self.db_path + suffix, 0o600)
        has_meta = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
        stored = dict(db.execute("SELECT name, value FROM meta")) if has_meta else {}
        if self._meta is None:  # joining as it is
            if stored.get("schema") != str(SCHEMA):
                raise OSError(f"index {self.db_path} is of schema {stored.get('schema')}, not {SCHEMA}")
            self.nslots = self.nslots or int(stored.get("nslots", 0))
            self._rdb = _connect(self.db_path)
            return
        want = dict(self._meta, schema=str(SCHEMA))
        changed = sorted(k for k, v in want.items() if k != "nslots" and stored and stored.get(k) != v)
        if first:
            if not stored and self._existing:
                log.warning("index %s was lost (empty, deleted, or its WAL removed before a checkpoint) while the "
                            "namespace's slab file remains; starting the namespace empty", self.db_path)
            if changed == [ondisk.FORMAT_KEY]:  # an earlier version's namespace: its pages are never served
                log.info("index %s holds pages of on-disk format %s (an earlier hicache-gds); this version writes "
                         "format %s (one checksum for host and GPU pages, directory order recorded): starting the "
                         "namespace empty", self.db_path, ondisk.legacy_format(stored), self._meta[ondisk.FORMAT_KEY])
            elif changed:
                log.warning("index %s was written with other settings (%s); starting the namespace empty",
                            self.db_path, ", ".join(changed))
            if changed:
                for t in _TABLES:
                    db.execute(f"DROP TABLE IF EXISTS {t}")
        elif changed:
            raise OSError(f"index {self.db_path} is open in other processes with other settings "
                          f"({', '.join(changed)}); close them first")
        db.executescript(_CREATE)
        self._rdb = _connect(self.db_path)
        if not first:
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            n = self.nslots
            db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [*want.items(), ("nslots", str(n))])
            # Nobody else has the namespace open: whatever earlier runs held is free again.
            for t in ("held", "doomed"):
                db.execute(f"INSERT OR IGNORE INTO free SELECT slot FROM {t}")
                db.execute(f"DELETE FROM {t}")
            db.execute("DELETE FROM leases")
            # Fewer slots than last time: the pages beyond the end are gone.
            db.execute("DELETE FROM pages WHERE slot >= ?", (n,))
            db.execute("DELETE FROM free WHERE slot >= ?", (n,))
            lost = 0
            for first_slot, step in gone:  # slots of a slab file truncated or deleted while closed
                lost += db.execute("DELETE FROM pages WHERE slot >= ? AND (slot - ?) % ? = 0",
                                   (first_slot, first_slot, step)).rowcount
            self._repair_free(db)  # the slots of rows dropped above are free
            db.execute("DELETE FROM gone")
            db.execute("UPDATE clock SET top = min(top, ?), trimmed = seq", (n,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        if lost:
            log.error("index %s: %d page(s) lie past the end of their slab file (truncated or deleted while the "
                      "store was closed); dropped", self.db_path, lost)

    def _repair_free(self, db: sqlite3.Connection) -> None:
        """Every slot below ``top`` that no table names is free (rows dropped at open leave such holes)."""
        (top,) = db.execute("SELECT top FROM clock").fetchone()
        (named,) = db.execute("SELECT (SELECT count(*) FROM pages WHERE slot < ?1) + (SELECT count(*) FROM free "
                              "WHERE slot < ?1) + (SELECT count(*) FROM held WHERE slot < ?1) + (SELECT count(*) "
                              "FROM doomed WHERE slot < ?1)", (min(top, self.nslots),)).fetchone()
        if named == min(top, self.nslots):
            return
        used = np.zeros(min(top, self.nslots), dtype=bool)
        for t in ("pages", "free", "held", "doomed"):
            s = np.fromiter((x for (x,) in db.execute(f"SELECT slot FROM {t} WHERE slot < ?", (len(used),))), np.int64)
            used[s] = True
        db.executemany("INSERT INTO free VALUES (?)", ((int(s),) for s in np.flatnonzero(~used)))

    def _reset_damaged(self, exc: BaseException, locked: bool = False) -> None:
        """Move a damaged database aside and start the namespace empty, under the namespace's setup
        lock (`locked`: the caller holds it); other processes find the new file at their next call
        (`_check_file`)."""
        from .owners import setup_lock
        if self._meta is None:  # joined as it is: the namespace's stores recover it, not us
            raise OSError(f"index {self.db_path} is damaged ({exc}); left to the namespace's stores")
        with contextlib.nullcontext() if locked else setup_lock(os.path.dirname(self.db_path)):
            try:
                same = os.stat(self.db_path).st_ino == self._ino or not self._ino
            except FileNotFoundError:
                same = False
            if same:
                bad = f"{self.db_path}.damaged-{int(time.time())}"
                log.error("index %s is damaged (%s); moved it to %s and starting the namespace empty",
                          self.db_path, exc, bad)
                for c in (self._wdb, self._rdb):
                    if c is not None:
                        c.close()
                self._wdb = self._rdb = None
                for suffix in ("", "-wal", "-shm"):
                    try:
                        os.replace(self.db_path + suffix, bad + suffix)
                    except OSError:
                        pass
            else:
                log.error("index %s was damaged (%s); another process has replaced it", self.db_path, exc)
            self._existing = False
            self._reconnect(first=same)

    def _reconnect(self, first: bool) -> None:
        for c in (self._wdb, self._rdb):
            if c is not None:
                c.close()
        self._wdb = self._rdb = None
        self._open((), first)
        with self._rlock:
            self._map, self._seq, self._dv = {}, 0, None
            self._ready = False
        self._pins.clear()
        self._unleased.clear()
        self._lost.clear()
        self._install_now()

    def _check_file(self) -> None:
        """Reconnect when another process replaced a damaged database (caller holds `_wlock`)."""
        try:
            ino = os.stat(self.db_path).st_ino
        except FileNotFoundError:
            ino = -1
        if ino != self._ino and ino != -1:
            log.warning("index %s was replaced by another process; reconnecting", self.db_path)
            self._reconnect(first=False)

    # -- the map ---------------------------------------------------------------------------------
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
                if self._closing:
                    raise _Closing
                ents = map(new, repeat(Entry), zip(slot[a:a + _BUILD_ROWS].tolist(), nbytes[a:a + _BUILD_ROWS].tolist(),
                                                   csum[a:a + _BUILD_ROWS].tolist()))
                m.update(zip(keys[a:a + _BUILD_ROWS], ents))
                gc.collect(0)  # untracks this chunk's Entry tuples now, not in one long pass later
        return m, seq

    def _install(self, m: dict[str, Entry], seq: int) -> None:
        with self._rlock:
            self._map, self._seq, self._dv = m, seq, None  # the next lookup catches up from `seq`
            self._ready = True
            self.loaded_s = time.perf_counter() - self._t0
        self._loaded.set()

    def _install_now(self) -> None:
        """Load the map in this thread (small indexes, reloads)."""
        with self._rlock:
            db = self._rdb
            m, seq = self._build(*self._read(db))
        self._install(m, seq)

    def _start_load(self, background: bool) -> None:
        if background and self._rows >= self.BACKGROUND_ROWS and _HAS_JSON:
            self._loaded.clear()
            self._loader = threading.Thread(target=self._load_in_background, name="hicache-gds-index-load",
                                            daemon=True)
            self._loader.start()
        else:
            self._install_now()

    def _load_in_background(self) -> None:
        try:
            db = _connect(self.db_path)
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
                self._heal(exc, force=True)
        except BaseException as exc:  # noqa: BLE001
            if not self._closing:
                self._load_error = exc
                log.error("index %s: loading the map failed (%s: %s); lookups are answered from SQLite",
                          self.db_path, type(exc).__name__, exc)
        finally:
            self._loaded.set()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the map is in place (True), the load failed or `timeout` passed (False)."""
        self._loaded.wait(timeout)
        return self._ready

    def _sync(self) -> None:
        """Bring the map up to the database (caller holds `_rlock`, the map is in place)."""
        db = self._rdb
        (dv,) = db.execute("PRAGMA data_version").fetchone()
        if dv == self._dv:
            return
        db.execute("BEGIN")
        try:
            seq, trimmed = db.execute("SELECT seq, trimmed FROM clock").fetchone()
            if trimmed > self._seq:  # removals we missed were trimmed, or a clear: read it all again
                db.execute("COMMIT")
                self._map, self._seq = self._build(*self._read(db))
                self.map_reloads += 1
            elif seq != self._seq:
                m = self._map
                for (k,) in db.execute("SELECT key FROM gone WHERE seq > ?", (self._seq,)):
                    m.pop(k, None)
                for k, s, n, c in db.execute("SELECT key, slot, nbytes, csum FROM pages WHERE seq > ?", (self._seq,)):
                    m[k] = Entry(s, n, c)
                self._seq = seq
        finally:
            if db.in_transaction:
                db.execute("COMMIT")
        self._dv = dv

    def _present(self, keys: Sequence[str]) -> dict[str, Entry]:
        """The map brought up to date, or while it loads the rows of `keys` read from SQLite
        (caller holds `_rlock`)."""
        if self._closing or self._rdb is None:
            raise ValueError(f"index {self.db_path} is closed")
        try:
            if self._ready:
                self._sync()
                return self._map
            return select_entries(self._rdb, keys)
        except (sqlite3.Error, ValueError) as exc:
            log.warning("index %s: lookup failed (%s); answered as misses", self.db_path, exc)
            if _damage(exc):
                threading.Thread(target=self._heal, args=(exc,), daemon=True).start()
            return {}

    def _heal(self, exc: BaseException, force: bool = False) -> None:
        """A read found the database damaged: move it aside and start anew (unless another process did)."""
        with self._wlock:
            try:
                ino = self._ino
                self._check_file()
                if self._ino == ino and (force or _damage(exc)):
                    self._reset_damaged(exc)
            except Exception as exc2:  # noqa: BLE001
                log.error("index %s: could not recover from damage: %s", self.db_path, exc2)

    # -- queries ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._rlock:
            if self._ready:
                self._present(())
                return len(self._map)
        return self._count("SELECT count(*) FROM pages")

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.contains([key])[0]

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._rlock:
            m = self._present(keys)
            return [k in m for k in keys]

    def prefix_len(self, keys: Sequence[str]) -> int:
        with self._rlock:
            m = self._present(keys)
            for i, k in enumerate(keys):
                if k not in m:
                    return i
        return len(keys)

    def peek(self, keys: Sequence[str]) -> dict[str, Entry]:
        """Entries of the present `keys`, from the database, without pinning or touching them."""
        with self._rlock:
            try:
                return select_entries(self._rdb, keys)
            except (sqlite3.Error, ValueError) as exc:
                log.warning("index %s: lookup failed (%s); answered as misses", self.db_path, exc)
                return {}

    def keys(self) -> list[str]:
        """Every key, least recently used first, from the database."""
        with self._rlock:
            return [k for (k,) in self._rdb.execute("SELECT key FROM pages ORDER BY atime")]

    def _count(self, sql: str, *args: object) -> int:
        with self._rlock:
            return int(self._rdb.execute(sql, args).fetchone()[0])

    # -- transactions ----------------------------------------------------------------------------
    def _write(self, fn: Callable[[sqlite3.Connection], object]) -> object:
        """Run fn(db) in one BEGIN IMMEDIATE transaction (caller holds `_wlock`); `OSError` if
        SQLite cannot write. A damaged database is moved aside and started anew (logged)."""
        if self._wdb is None:
            raise ValueError(f"index {self.db_path} is closed")
        self._check_file()
        db = self._wdb
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                if self._unleased:
                    self._drop_leases(db, self._unleased)
                out = fn(db)
                db.execute("COMMIT")
                self._unleased.clear()
                return out
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            if _damage(exc):
                try:
                    self._reset_damaged(exc)
                except Exception as exc2:  # noqa: BLE001
                    log.error("index %s: could not recover from damage: %s", self.db_path, exc2)
            raise OSError(f"index {self.db_path}: write failed: {exc}") from exc

    def _take_free(self, db: sqlite3.Connection, n: int) -> list[int]:
        out = _slot_list(db, "SELECT slot FROM free LIMIT ?", n)
        db.executemany("DELETE FROM free WHERE slot = ?", ((s,) for s in out))
        if len(out) < n:
            (top,) = db.execute("SELECT top FROM clock").fetchone()
            new = min(n - len(out), self.nslots - top)
            if new > 0:
                out.extend(range(top, top + new))
                db.execute("UPDATE clock SET top = ?", (top + new,))
        return out

    def _drop_leases(self, db: sqlite3.Connection, slots: Sequence[int]) -> None:
        db.executemany("DELETE FROM leases WHERE slot = ? AND owner = ?", ((s, self.owner) for s in slots))
        self._free_doomed(db)

    @staticmethod
    def _free_doomed(db: sqlite3.Connection) -> None:
        db.execute("INSERT INTO free SELECT slot FROM doomed WHERE slot NOT IN (SELECT slot FROM leases)")
        db.execute("DELETE FROM doomed WHERE slot IN (SELECT slot FROM free)")

    # -- reads -----------------------------------------------------------------------------------
    def lookup_pin(self, keys: Sequence[str]) -> list[Entry | None]:
        """Entries for `keys` (None for misses) from the database; hits are leased (their slots are
        not reused until `unpin`) and become the namespace's most recently used, in one transaction.
        Raises `OSError` when the index cannot be written (a full disk: `peek` still answers)."""
        def txn(db: sqlite3.Connection) -> dict[str, Entry]:
            found = select_entries(db, keys)
            if found:
                hit = list(dict.fromkeys(k for k in keys if k in found))
                t = _tick(db, len(hit))
                db.executemany("UPDATE pages SET atime = ? WHERE key = ?", zip(range(t, t + len(hit)), hit))
                new = {found[k].slot for k in hit if found[k].slot not in self._pins}
                db.executemany("INSERT OR IGNORE INTO leases VALUES (?, ?)", ((s, self.owner) for s in new))
            return found

        with self._wlock:
            found = self._write(txn)
            out = [found.get(k) for k in keys]  # type: ignore[union-attr]
            for e in out:
                if e is not None:
                    self._pins[e.slot] = self._pins.get(e.slot, 0) + 1
        return out

    def unpin(self, slots: Iterable[int]) -> None:
        """End reads of `lookup_pin`: leases whose last read ended are returned."""
        with self._wlock:
            done = []
            for s in slots:
                c = self._pins.get(s, 0) - 1
                if c <= 0:
                    self._pins.pop(s, None)
                    done.append(s)
                else:
                    self._pins[s] = c
            if not done:
                return
            try:
                self._write(lambda db: self._drop_leases(db, done))
            except (OSError, ValueError) as exc:
                self._unleased.extend(done)  # retried with the next write; freed by others if we die
                log.warning("hicache-gds: %d lease(s) not returned yet: %s", len(done), exc)

    # -- writes ----------------------------------------------------------------------------------
    def reserve(self, n: int, evict: bool = True) -> list[int]:
        """Up to `n` slots held for this process's write: free ones first, then -- after looking
        for dead owners' reservations -- the least recently used unleased pages' (evicted, committed
        in the same transaction). With `evict=False` only free slots are handed out."""
        if n <= 0:
            return []

        def txn(db: sqlite3.Connection) -> list[int]:
            out = self._take_free(db, n)
            now = time.monotonic()
            if len(out) < n and now - self._last_reclaim >= _RECLAIM_EVERY_S:
                self._last_reclaim = now
                if self._reclaim(db):
                    out += self._take_free(db, n - len(out))
            if len(out) < n and evict:
                victims = db.execute("SELECT key, slot, nbytes, csum FROM pages WHERE slot NOT IN "
                                     "(SELECT slot FROM leases) ORDER BY atime LIMIT ?", (n - len(out),)).fetchall()
                if victims:
                    _unpublish(db, (k for k, *_ in victims))
                    out += [s for _, s, _, _ in victims]
                    self.evictions += len(victims)
            db.executemany("INSERT INTO held VALUES (?, ?, 0)", ((s, self.owner) for s in out))
            return out

        with self._wlock:
            return self._write(txn)  # type: ignore[return-value]

    def release(self, slots: Iterable[int]) -> None:
        """Return reserved slots whose write failed or was not published (its IO completed or never
        started; lost ones too, once their IO is seen to have finished)."""
        slots = list(slots)
        if not slots:
            return

        def txn(db: sqlite3.Connection) -> None:
            mine = set(_slot_list(db, "SELECT slot FROM held WHERE owner = ?", self.owner))
            back = [s for s in slots if s in mine]
            db.executemany("DELETE FROM held WHERE slot = ?", ((s,) for s in back))
            db.executemany("INSERT INTO free VALUES (?)", ((s,) for s in back))

        with self._wlock:
            try:
                self._write(txn)
                self._lost.difference_update(slots)
            except (OSError, ValueError) as exc:  # they stay held: freed when this process closes or dies
                log.warning("hicache-gds: %d reserved slot(s) not returned yet: %s", len(slots), exc)

    def lose(self, slots: Iterable[int]) -> None:
        """Retire reserved slots whose write timed out: the IO may still land, so they stay held
        by this process until its owner releases them (`release`, once the IO finished), or it
        dies. `close(keep=...)` keeps them held past close."""
        slots = list(slots)
        if not slots:
            return
        with self._wlock:
            self._lost.update(slots)
            try:
                self._write(lambda db: db.executemany("UPDATE held SET lost = 1 WHERE slot = ? AND owner = ?",
                                                      ((s, self.owner) for s in slots)))
            except (OSError, ValueError) as exc:
                log.warning("hicache-gds: %s", exc)

    def publish(self, items: Sequence[tuple[str, int, int, int]]) -> list[bool]:
        """Make (key, slot, nbytes, csum) visible; True per item unless the key was published meanwhile.

        The caller has finished writing every slot, and holds it (`reserve`). A key already
        present keeps its first copy and the new slot is freed, so concurrent puts of one key --
        in this process or another -- leave exactly one copy. A slot this process does not hold is
        never published (False, logged). Raises `OSError` when the index cannot be written."""
        if not items:
            return []

        def txn(db: sqlite3.Connection) -> list[bool]:
            mine = set(_slot_list(db, "SELECT slot FROM held WHERE owner = ?", self.owner))
            present = select_entries(db, [it[0] for it in items])
            seq, t = _bump(db, len(items))
            result, fresh, dup, seen, foreign = [], [], [], set(), 0
            for i, (key, slot, nbytes, csum) in enumerate(items):
                if slot not in mine:
                    foreign += 1
                    result.append(False)
                elif key in present or key in seen:
                    dup.append(slot)
                    result.append(False)
                else:
                    seen.add(key)
                    fresh.append((key, slot, nbytes, csum, t + i, seq))
                    result.append(True)
            if foreign:
                log.error("index %s: %d slot(s) to publish are not held by this process (the index was reset "
                          "under it?); not published", self.db_path, foreign)
            db.executemany("INSERT INTO pages VALUES (?, ?, ?, ?, ?, ?)", fresh)
            done = [(f[1],) for f in fresh] + [(s,) for s in dup]
            db.executemany("DELETE FROM held WHERE slot = ?", done)
            db.executemany("INSERT INTO free VALUES (?)", ((s,) for s in dup))
            return result

        with self._wlock:
            return self._write(txn)  # type: ignore[return-value]

    def drop(self, keys: Iterable[str], slots: Iterable[int] | None = None) -> int:
        """Remove keys (deleted, or failed their checksum). Returns how many were present.

        `slots`: remove each key only while it still names that slot (a page found bad in one
        slot may have been published again elsewhere since)."""
        keys = list(keys)
        if not keys:
            return 0
        only = dict(zip(keys, slots)) if slots is not None else None

        def txn(db: sqlite3.Connection) -> int:
            found = select_entries(db, keys)
            if only is not None:
                found = {k: e for k, e in found.items() if only.get(k) == e.slot}
            if found:
                remove_pages(db, {k: e.slot for k, e in found.items()})
            return len(found)

        with self._wlock:
            return self._write(txn)  # type: ignore[return-value]

    def clear(self) -> int:
        """Remove every page of the namespace (for every process); returns how many there were.
        Every process's map is read again at its next lookup."""
        def txn(db: sqlite3.Connection) -> int:
            (n,) = db.execute("SELECT count(*) FROM pages").fetchone()
            seq, _ = _bump(db)
            db.execute("INSERT INTO doomed SELECT slot FROM pages WHERE slot IN (SELECT slot FROM leases)")
            db.execute("INSERT INTO free SELECT slot FROM pages WHERE slot NOT IN (SELECT slot FROM leases)")
            db.execute("DELETE FROM pages")
            db.execute("DELETE FROM gone")
            db.execute("UPDATE clock SET trimmed = ?", (seq,))
            return int(n)

        with self._wlock:
            return self._write(txn)  # type: ignore[return-value]

    # -- owners ----------------------------------------------------------------------------------
    def _reclaim(self, db: sqlite3.Connection) -> int:
        """Free what owners that are gone held (in a write transaction); returns the slots freed."""
        owners = {o for (o,) in db.execute("SELECT DISTINCT owner FROM held UNION SELECT DISTINCT owner FROM leases")}
        alive = self.member.alive if self.member is not None else (lambda t: t == self.owner)
        dead = [o for o in owners if o != self.owner and not alive(o)]
        freed = sum(self._return_owner(db, o) for o in dead)
        if dead:
            self._free_doomed(db)
            self.reclaimed += freed
            log.info("index %s: reclaimed %d reserved slot(s) and the leases of %d closed or dead process(es)",
                     self.db_path, freed, len(dead))
        return freed

    @staticmethod
    def _return_owner(db: sqlite3.Connection, owner: str, keep: Sequence[int] = ()) -> int:
        """Free `owner`'s reservations but `keep` and drop its leases (in a write transaction;
        doomed slots are the caller's `_free_doomed`); returns the slots freed."""
        if keep:
            kept = set(keep)
            back = [s for s in _slot_list(db, "SELECT slot FROM held WHERE owner = ?", owner) if s not in kept]
            db.executemany("DELETE FROM held WHERE slot = ?", ((s,) for s in back))
            db.executemany("INSERT INTO free VALUES (?)", ((s,) for s in back))
            freed = len(back)
        else:
            freed = db.execute("INSERT INTO free SELECT slot FROM held WHERE owner = ?", (owner,)).rowcount
            db.execute("DELETE FROM held WHERE owner = ?", (owner,))
        db.execute("DELETE FROM leases WHERE owner = ?", (owner,))
        return freed

    def reclaim(self) -> int:
        """Free the reservations and leases of owners that closed or died; returns the slots freed."""
        with self._wlock:
            self._last_reclaim = time.monotonic()
            try:
                return self._write(self._reclaim)  # type: ignore[return-value]
            except (OSError, ValueError) as exc:
                log.warning("hicache-gds: %s", exc)
                return 0

    def stats(self) -> dict[str, int]:
        with self._rlock:
            if self._rdb is None:  # closed
                return {"pages": len(self._map), "slots": self.nslots, "evictions": self.evictions}
            pages, free, top, held, leased, doomed = self._rdb.execute(
                "SELECT (SELECT count(*) FROM pages), (SELECT count(*) FROM free), (SELECT top FROM clock), "
                "(SELECT count(*) FROM held), (SELECT count(*) FROM leases), (SELECT count(*) FROM doomed)").fetchone()
        with self._wlock:
            pinned, lost = len(self._pins), len(self._lost)
        return {"pages": pages, "free_slots": free + max(0, self.nslots - top), "slots": self.nslots,
                "pinned_slots": pinned, "lost_slots": lost, "evictions": self.evictions,
                "reserved_slots_all": held, "leased_slots_all": leased, "doomed_slots": doomed,
                "reclaimed_slots": self.reclaimed, "map_reloads": self.map_reloads}

    def close(self, keep: Sequence[int] = ()) -> None:
        """Return what this process holds (reservations but `keep`, leases) and close. Idempotent.

        `keep`: reserved slots a write may still land in; they stay held under this store's
        token, which its owner keeps alive until that is over (`PageStore.close`)."""
        self._closing = True
        loader_db = self._loader_db
        if loader_db is not None:
            try:
                loader_db.interrupt()  # a read in progress stops; the build stops at its next chunk
            except sqlite3.Error:  # the loader closed it meanwhile
                pass
        if self._loader is not None and self._loader is not threading.current_thread():
            self._loader.join()
        with self._wlock:
            if self._wdb is None:
                return
            db = self._wdb
            try:
                def txn(db: sqlite3.Connection) -> None:
                    self._return_owner(db, self.owner, keep)
                    self._free_doomed(db)
                self._write(txn)
                alone = self.member is None or not self.member.others()
                db.execute(f"PRAGMA wal_checkpoint({'TRUNCATE' if alone else 'PASSIVE'})")
            except (OSError, sqlite3.Error) as exc:
                log.warning("index %s: closing without returning its slots or a checkpoint: %s", self.db_path, exc)
            finally:
                with self._rlock:
                    if self._rdb is not None:
                        self._rdb.close()
                    self._rdb = None
                db.close()
                self._wdb = None
