"""`IndexReader`: the index of a namespace other processes write, read without writing anything.

The writers' side is `index.Index`; the schema, `SCHEMA` and `INDEX_FILE` live in `schema`. This
is the read half for `PageReader` and tools (`read_keys`); it imports `schema` only.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from ..errors import ConfigError
from ..slabs.ondisk import FORMAT_KEY
from .schema import INDEX_FILE, SCHEMA, Entry, select_entries

__all__ = ["IndexReader", "read_keys"]

log = logging.getLogger("hicache_gds.index")
_T = TypeVar("_T")
_READ_TRIES = 4  # a query is retried this often when the writer changed the files under it


class IndexReader:
    """Lookups in another process's index; nothing held in memory, nothing written.

    Every call queries the database, so pages the writer publishes are found, and pages it evicts
    are gone, at the next call. Nothing is written under the namespace, not even SQLite's ``-wal``
    and ``-shm`` files (a plain ``mode=ro`` connection creates both when no writer has the
    database open, and leaves them behind):

    * while the ``-wal`` file holds frames (a writer has the database open, or died with it open),
      the connection is ``mode=ro&readonly_shm=1``: SQLite's reader that never writes the shared
      memory file, coordinating with the live writer through it;
    * otherwise (no ``-wal``, or an empty one, which a writer's close can leave without its
      ``-shm``) the database is quiescent and is opened ``mode=ro&immutable=1``. Such a connection
      neither locks nor notices changes, so a query counts only if the files look the same after
      it as before (the ``-wal`` still absent or empty; same inode, size, mtime and ctime); a
      writer that opened or wrote meanwhile makes it run again, on the other kind of connection.

    Either way a query whose files changed under it (another inode of the database, ``-wal`` or
    ``-shm``: a writer reset a damaged index, or a new writer started) is run again. A database
    that is absent (no writer has opened the namespace yet), being created, of other settings or
    unreadable reads as empty, with a log line (at most one a minute) for the last two. A symbolic
    link where the namespace directory or the database should be raises `ConfigError`, as it
    does for the writer.
    """

    def __init__(self, db_path: str, meta: Mapping[str, str] | None = None) -> None:
        """`meta`: the settings the writer records (`slabs.ondisk.index_meta`); a database that
        records other values reads as empty."""
        self.db_path = db_path
        self._want = dict(meta or {}, schema=str(SCHEMA))
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._db_state: tuple | None = None
        self._db_usable = False
        self._closed = False
        self._last_warning = -1e9
        self.generation = 0
        """Bumped whenever a connection is (re)opened: the database may be another file now."""
        self.recovery_s = 0.0  # nothing is loaded (the writer's `Index` reports its own)

    # -- files -----------------------------------------------------------------------------------
    def _state(self) -> tuple | None:
        """What the files look like now; None while the database is absent."""
        parent = os.path.dirname(self.db_path)
        try:
            pst = os.lstat(parent)
            st = os.lstat(self.db_path)
        except FileNotFoundError:
            return None
        for path, mode, want in ((parent, pst.st_mode, stat.S_IFDIR), (self.db_path, st.st_mode, stat.S_IFREG)):
            if stat.S_IFMT(mode) != want:
                raise ConfigError(f"GDS_PATH: {path} is a symbolic link or not a plain "
                                  f"{'directory' if want == stat.S_IFDIR else 'file'}; the index is never read "
                                  f"through one (remove it)")
        side = []
        for suffix in ("-wal", "-shm"):
            try:
                s = os.lstat(self.db_path + suffix)
                side.append((s.st_dev, s.st_ino, s.st_size))
            except FileNotFoundError:
                side.append(None)
        wal, shm = side
        # An empty WAL holds nothing the database file lacks, and a writer's close can leave one
        # without its -shm (read-only SQLite cannot open a WAL database without one): read the file
        # as it is. A writer appending to the WAL changes its size, so the view is looked at again.
        if wal is not None and wal[2] > 0:
            return ("live", st.st_dev, st.st_ino, wal[:2], shm and shm[:2])
        return ("quiescent", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, wal, shm and shm[:2])

    def _connect(self, state: tuple) -> sqlite3.Connection | None:
        """The connection for `state`, reused while the files stay the same; None: other settings."""
        if self._db is not None and state == self._db_state:
            return self._db if self._db_usable else None
        self._disconnect()
        how = "readonly_shm=1" if state[0] == "live" else "immutable=1"
        uri = f"file:{urllib.parse.quote(self.db_path)}?mode=ro&{how}"
        db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None, timeout=5)
        try:
            stored = dict(db.execute("SELECT name, value FROM meta"))
        except BaseException:
            db.close()
            raise
        self._db, self._db_state, self.generation = db, state, self.generation + 1
        if stored and FORMAT_KEY not in stored:  # written before formats were recorded: format 1
            stored[FORMAT_KEY] = "1"
        other = sorted(k for k, v in self._want.items() if k in stored and stored[k] != v)
        self._db_usable = not other
        if other:
            self._warn(f"index {self.db_path} was written with other settings ({', '.join(other)}); "
                       f"reading nothing from it")
            return None
        return db

    def _disconnect(self) -> None:
        if self._db is not None:
            self._db.close()
        self._db, self._db_state = None, None

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 60.0:
            self._last_warning = now
            log.warning("%s", msg)

    def _read(self, query: Callable[[sqlite3.Connection], _T], empty: _T) -> _T:
        """`query` on a consistent view of the database; `empty` while there is none."""
        with self._lock:
            if self._closed:
                raise ValueError(f"the index reader of {self.db_path} is closed")
            problem = ""
            for _ in range(_READ_TRIES):
                state = self._state()
                if state is None or state[0] == "quiescent" and state[3] == 0:  # absent, or being created
                    self._disconnect()
                    return empty
                try:
                    db = self._connect(state)
                    if db is None:
                        return empty
                    out = query(db)
                except sqlite3.Error as exc:  # being created, replaced, or damaged: look again
                    self._disconnect()
                    problem = f"{type(exc).__name__}: {exc}"
                    continue
                if self._state() == state:
                    return out
                problem = "the writer changed it during every try"
            self._warn(f"index {self.db_path} cannot be read now ({problem}); its pages read as misses")
            return empty

    # -- queries ---------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[str]) -> list[Entry | None]:
        """Entries for `keys` as the writer has them now (None for misses)."""
        rows = self._read(lambda db: select_entries(db, keys), {})
        return [rows.get(k) for k in keys]

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return [e is not None for e in self.lookup(keys)]

    def prefix_len(self, keys: Sequence[str]) -> int:
        present = self.contains(keys)
        return next((i for i, p in enumerate(present) if not p), len(keys))

    def keys(self) -> list[str]:
        """Every key, least recently used first (every read's touch is committed with its lease)."""
        return self._read(lambda db: [k for (k,) in db.execute("SELECT key FROM pages ORDER BY atime")], [])

    def settings(self) -> dict[str, str]:
        """The settings the writer recorded (slot size, format ...); {} while there is no database."""
        return self._read(lambda db: {str(k): str(v) for k, v in db.execute("SELECT name, value FROM meta")}, {})

    def __len__(self) -> int:
        return self._read(lambda db: int(db.execute("SELECT count(*) FROM pages").fetchone()[0]), 0)

    def stats(self) -> dict[str, int]:
        return {"pages": len(self)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._disconnect()


def read_keys(namespace_dir: str) -> list[str]:
    """Keys a namespace holds, least recently used first, read without writing or locking.

    For processes that do not open the store: a vLLM scheduler rebuilding its view of what
    workers hold, tools, tests. Reads through `IndexReader`, so not even SQLite's -wal / -shm
    files are created. Any failure returns [].
    """
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
