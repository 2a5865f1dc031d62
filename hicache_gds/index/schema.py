"""The index database of one namespace: its tables, and the statements every transaction is made of.

One SQLite database in WAL mode per namespace (`INDEX_FILE`, in its first directory) is the one
truth for everything the processes that open it must agree on:

* ``pages``: published pages (key -> slot, size, checksum, LRU clock ``atime``, change number ``seq``);
* slot ownership: every slot is exactly one of published (``pages``), free (``free``, or at or
  above ``clock.top``: never used yet), reserved by a writer (``held``, tagged with the owner's
  token; ``lost`` when its write timed out), or dropped while being read (``doomed``);
* ``leases``: slots a process is reading (owner token per slot). Eviction never picks a leased
  slot, and a leased slot dropped by delete/clear/a bad checksum is ``doomed`` -- reused only once
  no lease names it -- so a slot is never rewritten while another process reads it;
* ``gone``: keys removed, by change number (trimmed as they age), so that every process's map of
  the pages (`keymap`) can catch up without reading them all again;
* ``clock``: the change counter (bumped when the set of pages changes), the LRU clock (one LRU
  per namespace: every process's reads touch it, without a change number, so reads never age
  other processes' maps), the never-used boundary ``top`` and ``trimmed`` (the oldest change
  number ``gone`` still covers).

The functions below run inside a write transaction (``BEGIN IMMEDIATE``, `Index._write`) unless
they say otherwise; any writer of the database -- `Index`, or an operator's tool -- changes it
through them, so the invariants above are kept in one place.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Iterable, Mapping, NamedTuple, Sequence

from ..slabs.ondisk import INDEX_FILE  # the file's name is part of the on-disk format

__all__ = ["Entry", "INDEX_FILE", "SCHEMA", "remove_pages", "select_entries"]

SCHEMA = 2
BUSY_S = 30.0  # how long a transaction waits for another process's (SQLite's busy timeout)
GONE_KEEP = 4096  # change numbers of removed keys kept for other processes' maps to catch up with
TABLES = ("meta", "pages", "gone", "clock", "free", "held", "leases", "doomed")
CREATE = """
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
_LOOKUP_SQL = ("SELECT json_group_array(json_array(key, slot, nbytes, csum)) FROM pages "
               "WHERE key IN (SELECT value FROM json_each(?))")


def _sqlite_has_json() -> bool:
    db = sqlite3.connect(":memory:")
    try:
        db.execute("SELECT json_group_array(1)")
        return True
    except sqlite3.Error:  # built without JSON: lookups cannot be answered from SQLite, so load in place
        return False
    finally:
        db.close()


HAS_JSON = _sqlite_has_json()
# UPDATE ... FROM (SQLite 3.33): a read's LRU touch in one statement.
_HAS_UPDATE_FROM = sqlite3.sqlite_version_info >= (3, 33, 0)
_IN_CHUNK = 500  # keys per `IN (...)` query without JSON: far below SQLite's bound-parameter limit


class Entry(NamedTuple):
    """A published page: its slot, its stored size and its checksum (`hicache_gds.checksum`)."""

    slot: int
    nbytes: int
    csum: int


def connect(path: str) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL, synchronous=NORMAL."""
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=BUSY_S)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
    except BaseException:
        db.close()  # a full disk fails here: no file left open behind the error
        raise
    return db


def damaged(exc: BaseException) -> bool:
    """Is this SQLite error a damaged database (not a busy lock, a full disk or an IO error)?"""
    if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.OperationalError):
        return True
    msg = str(exc)
    return getattr(exc, "sqlite_errorcode", 0) in (11, 26) or "no such table" in msg or "malformed" in msg


def select_entries(db: sqlite3.Connection, keys: Sequence[str]) -> dict[str, Entry]:
    """Rows of `keys` read by primary key (any connection, in or out of a transaction): one
    statement (one GIL round trip) where SQLite has JSON, else `IN (...)` chunks. Raises
    `sqlite3.Error`."""
    if HAS_JSON:
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


# Python's sqlite3 hands the GIL back around every step of a statement, and `executemany` steps once
# per row: beside a thread busy in Python (a serving engine's scheduler) each hand-back costs up to a
# switch interval, so a read that touched and leased its pages row by row spent more time waiting
# for the GIL than SQLite spent working. The read path's statements below are one step each where
# SQLite has JSON, whatever the number of pages.
def touch(db: sqlite3.Connection, keys: Sequence[str], first: int) -> None:
    """The LRU clock of (distinct) `keys`, in order: `first`, `first` + 1, ..."""
    if HAS_JSON and _HAS_UPDATE_FROM:
        db.execute("UPDATE pages SET atime = ? + j.key FROM json_each(?) AS j WHERE pages.key = j.value",
                   (first, json.dumps(list(keys), ensure_ascii=False)))
    else:
        db.executemany("UPDATE pages SET atime = ? WHERE key = ?", zip(range(first, first + len(keys)), keys))


def add_leases(db: sqlite3.Connection, owner: str, slots: Iterable[int]) -> None:
    """`owner` reads `slots` (a lease already held is kept)."""
    slots = [int(s) for s in slots]
    if HAS_JSON:
        db.execute("INSERT OR IGNORE INTO leases SELECT value, ? FROM json_each(?)", (owner, json.dumps(slots)))
    else:
        db.executemany("INSERT OR IGNORE INTO leases VALUES (?, ?)", ((s, owner) for s in slots))


def slot_list(db: sqlite3.Connection, sql: str, *args: object) -> list[int]:
    return [int(s) for (s,) in db.execute(sql, args)]


def bump(db: sqlite3.Connection, atimes: int = 0) -> tuple[int, int]:
    """A new change number (the set of pages changes), and the first of `atimes` new LRU clock
    values; trims ``gone`` as it ages."""
    db.execute("UPDATE clock SET seq = seq + 1, atime = atime + ?", (atimes,))
    seq, atime = db.execute("SELECT seq, atime FROM clock").fetchone()
    if seq % 256 == 0 and seq > GONE_KEEP:
        db.execute("DELETE FROM gone WHERE seq <= ?", (seq - GONE_KEEP,))
        db.execute("UPDATE clock SET trimmed = max(trimmed, ?)", (seq - GONE_KEEP,))
    return seq, atime - atimes


def tick(db: sqlite3.Connection, atimes: int) -> int:
    """The first of `atimes` new LRU clock values, without a change number: reads touch pages, they
    do not change which pages exist, so they never age other processes' maps."""
    db.execute("UPDATE clock SET atime = atime + ?", (atimes,))
    (atime,) = db.execute("SELECT atime FROM clock").fetchone()
    return atime - atimes


def unpublish(db: sqlite3.Connection, keys: Iterable[str]) -> None:
    """Delete these pages' rows under a new change number, with `gone` rows: every process's map
    drops the keys at its next lookup. Their slots are the caller's."""
    keys = list(keys)
    seq, _ = bump(db)
    db.executemany("DELETE FROM pages WHERE key = ?", ((k,) for k in keys))
    db.executemany("INSERT INTO gone VALUES (?, ?)", ((seq, k) for k in keys))


def remove_pages(db: sqlite3.Connection, slots: Mapping[str, int]) -> None:
    """Delete published pages (key -> its slot) the way every open `Index` sees it: a change
    number and `gone` rows (each process's map drops the keys at its next lookup); leased slots
    become doomed, the others free."""
    unpublish(db, slots)
    leased = set(slot_list(db, "SELECT DISTINCT slot FROM leases"))
    db.executemany("INSERT INTO doomed VALUES (?)", ((s,) for s in slots.values() if s in leased))
    db.executemany("INSERT INTO free VALUES (?)", ((s,) for s in slots.values() if s not in leased))


def take_free(db: sqlite3.Connection, n: int, nslots: int) -> list[int]:
    """Up to `n` free slots, taken off the free list first, then from the never-used ones."""
    out = slot_list(db, "SELECT slot FROM free LIMIT ?", n)
    db.executemany("DELETE FROM free WHERE slot = ?", ((s,) for s in out))
    if len(out) < n:
        (top,) = db.execute("SELECT top FROM clock").fetchone()
        new = min(n - len(out), nslots - top)
        if new > 0:
            out.extend(range(top, top + new))
            db.execute("UPDATE clock SET top = ?", (top + new,))
    return out


def free_doomed(db: sqlite3.Connection) -> None:
    """Doomed slots no lease names any more are free."""
    db.execute("INSERT INTO free SELECT slot FROM doomed WHERE slot NOT IN (SELECT slot FROM leases)")
    db.execute("DELETE FROM doomed WHERE slot IN (SELECT slot FROM free)")


def drop_leases(db: sqlite3.Connection, owner: str, slots: Sequence[int]) -> None:
    """`owner`'s reads of `slots` are over; doomed slots no lease names any more are free."""
    if HAS_JSON:
        db.execute("DELETE FROM leases WHERE owner = ? AND slot IN (SELECT value FROM json_each(?))",
                   (owner, json.dumps([int(s) for s in slots])))
    else:
        db.executemany("DELETE FROM leases WHERE slot = ? AND owner = ?", ((s, owner) for s in slots))
    free_doomed(db)


def return_owner(db: sqlite3.Connection, owner: str, keep: Sequence[int] = ()) -> int:
    """Free `owner`'s reservations but `keep` and drop its leases (doomed slots are the caller's
    `free_doomed`); returns the slots freed."""
    if keep:
        kept = set(keep)
        back = [s for s in slot_list(db, "SELECT slot FROM held WHERE owner = ?", owner) if s not in kept]
        db.executemany("DELETE FROM held WHERE slot = ?", ((s,) for s in back))
        db.executemany("INSERT INTO free VALUES (?)", ((s,) for s in back))
        freed = len(back)
    else:
        freed = db.execute("INSERT INTO free SELECT slot FROM held WHERE owner = ?", (owner,)).rowcount
        db.execute("DELETE FROM held WHERE owner = ?", (owner,))
    db.execute("DELETE FROM leases WHERE owner = ?", (owner,))
    return freed
