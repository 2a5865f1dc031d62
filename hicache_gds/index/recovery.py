"""Opening a namespace's index database, and repairing it: recovery after a crash, a resize, slab
files found short, a database of other settings, a damaged database.

The first process to open a namespace nobody has open (it holds `owners.setup_lock`) recovers it
(`open_database` with ``first=True``): every reservation and lease of earlier runs is freed (their
owners are gone), pages past a smaller size or in slab files found truncated are dropped, and
slots no table names are freed again. A database written with other settings (another page size,
an earlier on-disk format) is started anew; one that is damaged is moved aside (`move_aside`) and
started anew, by whichever process finds it so, and the others reconnect when they see the file
replaced (`replaced`).
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import time
from typing import Iterable, Mapping, NamedTuple

import numpy as np

from ..errors import StoreFullError
from ..slabs import ondisk
from .schema import CREATE, SCHEMA, TABLES, connect

__all__ = ["Opened", "open_database", "move_aside", "replaced"]

log = logging.getLogger("hicache_gds.index")


class Opened(NamedTuple):
    wdb: sqlite3.Connection  # the write connection
    rdb: sqlite3.Connection  # the read connection (lookups, the map)
    ino: int  # the database file's inode when opened (`replaced`)
    nslots: int


def open_database(db_path: str, meta: Mapping[str, str] | None, nslots: int, *, existing: bool,
                  gone: Iterable[tuple[int, int]], first: bool) -> Opened:
    """Open (creating) the database at `db_path` and, when `first`, recover it (module docstring).

    `meta`: the settings this namespace is written with; None joins the database as its stores
    made it (its `nslots` read from it), refusing only another schema. `existing`: the namespace
    holds slots from an earlier run (a database without our settings was lost, not new). `gone`:
    (first slot, step) pairs of slots whose bytes no longer exist. Raises `sqlite3.DatabaseError`
    for a damaged database, `OSError` for one that cannot be used as it is."""
    fd = os.open(db_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)
    db = connect(db_path)
    rdb: sqlite3.Connection | None = None
    try:
        ino = os.stat(db_path).st_ino
        for suffix in ("-wal", "-shm"):
            if os.path.exists(db_path + suffix):
                os.chmod(db_path + suffix, 0o600)
        has_meta = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone()
        stored = dict(db.execute("SELECT name, value FROM meta")) if has_meta else {}
        if meta is None:  # joining as it is
            if stored.get("schema") != str(SCHEMA):
                raise OSError(f"index {db_path} is of schema {stored.get('schema')}, not {SCHEMA}")
            rdb = connect(db_path)
            return Opened(db, rdb, ino, nslots or int(stored.get("nslots", 0)))
        want = dict(meta, schema=str(SCHEMA))
        changed = sorted(k for k, v in want.items() if k != "nslots" and stored and stored.get(k) != v)
        if first:
            if not stored and existing:
                log.warning("index %s was lost (empty, deleted, or its WAL removed before a checkpoint) while the "
                            "namespace's slab file remains; starting the namespace empty", db_path)
            if changed == [ondisk.FORMAT_KEY]:  # an earlier version's namespace: its pages are never served
                log.info("index %s holds pages of on-disk format %s (an earlier hicache-gds); this version writes "
                         "format %s (checksums host reads verify at xxh3 speed; see hicache_gds.slabs.ondisk): starting the "
                         "namespace empty", db_path, ondisk.legacy_format(stored), meta[ondisk.FORMAT_KEY])
            elif changed:
                log.warning("index %s was written with other settings (%s); starting the namespace empty",
                            db_path, ", ".join(changed))
            if changed:
                for t in TABLES:
                    db.execute(f"DROP TABLE IF EXISTS {t}")
        elif changed:
            raise OSError(f"index {db_path} is open in other processes with other settings "
                          f"({', '.join(changed)}); close them first")
        db.executescript(CREATE)
        rdb = connect(db_path)
        if first:
            _recover(db, db_path, want, nslots, gone)
        return Opened(db, rdb, ino, nslots)
    except BaseException:
        for c in (rdb, db):
            if c is not None:
                c.close()
        raise


def _recover(db: sqlite3.Connection, db_path: str, want: Mapping[str, str], n: int,
             gone: Iterable[tuple[int, int]]) -> None:
    """Nobody else has the namespace open: free what earlier runs held, drop pages that no longer
    exist, record the settings and size."""
    db.execute("BEGIN IMMEDIATE")
    try:
        db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [*want.items(), ("nslots", str(n))])
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
        _repair_free(db, n)  # the slots of rows dropped above are free
        db.execute("DELETE FROM gone")
        db.execute("UPDATE clock SET top = min(top, ?), trimmed = seq", (n,))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    if lost:
        log.error("index %s: %d page(s) lie past the end of their slab file (truncated or deleted while the "
                  "store was closed); dropped", db_path, lost)


def _repair_free(db: sqlite3.Connection, nslots: int) -> None:
    """Every slot below ``top`` that no table names is free (rows dropped at open leave such holes)."""
    (top,) = db.execute("SELECT top FROM clock").fetchone()
    (named,) = db.execute("SELECT (SELECT count(*) FROM pages WHERE slot < ?1) + (SELECT count(*) FROM free "
                          "WHERE slot < ?1) + (SELECT count(*) FROM held WHERE slot < ?1) + (SELECT count(*) "
                          "FROM doomed WHERE slot < ?1)", (min(top, nslots),)).fetchone()
    if named == min(top, nslots):
        return
    used = np.zeros(min(top, nslots), dtype=bool)
    for t in ("pages", "free", "held", "doomed"):
        s = np.fromiter((x for (x,) in db.execute(f"SELECT slot FROM {t} WHERE slot < ?", (len(used),))), np.int64)
        used[s] = True
    db.executemany("INSERT INTO free VALUES (?)", ((int(s),) for s in np.flatnonzero(~used)))


def replaced(db_path: str, ino: int) -> bool:
    """Has the database file been replaced since it was opened as inode `ino` (another process
    moved a damaged one aside and started anew)? A file gone for the moment is not."""
    try:
        now = os.stat(db_path).st_ino
    except FileNotFoundError:
        return False
    return now != ino


def move_aside(db_path: str, exc: BaseException) -> None:
    """Move a damaged database (and its -wal/-shm) to ``<path>.damaged-<time>``; the caller holds
    the namespace's setup lock and has closed its connections."""
    bad = f"{db_path}.damaged-{int(time.time())}"
    log.error("index %s is damaged (%s); moved it to %s and starting the namespace empty", db_path, exc, bad)
    for suffix in ("", "-wal", "-shm"):
        try:
            os.replace(db_path + suffix, bad + suffix)
        except OSError:
            pass


SQLITE_FULL = 13  # sqlite3's code for a full disk (Python 3.11 gives codes, not names)


def refusal(db_path: str, exc: sqlite3.Error) -> OSError:
    """The error for an index that cannot be opened but is not damaged (a full disk, an IO
    error): the open is refused and the file kept, since moving it aside would drop every
    acknowledged page. SQLite reports a WAL it cannot grow as an IO error, hence the statvfs."""
    try:
        full = os.statvfs(os.path.dirname(db_path)).f_bavail == 0
    except OSError:
        full = False
    if full or getattr(exc, "sqlite_errorcode", 0) == SQLITE_FULL:
        return StoreFullError(errno.ENOSPC, f"index {db_path} cannot be opened: the file system is full "
                              f"({exc}); free space there or move GDS_PATH")
    return OSError(f"index {db_path} cannot be opened: {exc}")
