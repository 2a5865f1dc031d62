"""`Index`: key -> slot index of one namespace, shared by every process that has it open.

Each change is one ``BEGIN IMMEDIATE`` transaction over the tables of `schema` (SQLite's writer
lock: writers take turns, readers never wait); the crash-safety rules it keeps are in the package
docstring. Lookups (`contains`, `prefix_len`) are answered from this process's `keymap`; reads
(`lookup_pin`) go to the database, in the transaction that leases their slots and touches their
LRU clock. Open and repair are `recovery`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from .keymap import KeyMap
from .recovery import move_aside, open_database, refusal, replaced
from .schema import (Entry, add_leases, bump, damaged, drop_leases, free_doomed, remove_pages, return_owner,
                     select_entries, slot_list, take_free, tick, touch, unpublish)

if TYPE_CHECKING:
    from ..slabs.owners import Membership

__all__ = ["Index"]

log = logging.getLogger("hicache_gds.index")
_RECLAIM_EVERY_S = 1.0  # a put short of free slots looks for dead owners at most this often (open's look aside)


class Index:
    """Thread- and process-safe key -> `Entry` index over `nslots` slots, at `db_path`. `member`:
    this store's `owners.Membership` (its token tags what it holds; it tells live owners from dead
    ones); None for a private index (tools, tests), token ``"-"``, every other token dead."""

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
        self._t0 = time.perf_counter()
        self._rlock = threading.Lock()  # the read connection and the map
        self._wlock = threading.Lock()  # the write connection and this process's pins
        self.keymap = KeyMap(db_path, self._rlock, self._t0)
        self._pins: dict[int, int] = {}  # slot -> reads in flight in this process (one lease row each)
        self._unleased: list[int] = []  # leases whose removal failed: retried with the next write
        self._lost: set[int] = set()  # reserved slots whose write timed out: never reused while we live
        self._wdb: sqlite3.Connection | None = None
        self._rdb: sqlite3.Connection | None = None
        self._ino, self._last_reclaim = 0, 0.0
        self.evictions = self.reclaimed = 0
        self.recovery_s = 0.0
        try:
            self._open(gone, first)
        except sqlite3.DatabaseError as exc:
            if meta is None:
                raise OSError(f"index {db_path} cannot be joined: {exc}") from exc
            if not damaged(exc):  # a full disk or an IO error: moving it aside would drop every page
                self._disconnect()
                raise refusal(db_path, exc) from exc
            self._reset_damaged(exc, locked=True)  # the caller holds the setup lock
        self.reclaim()
        self._last_reclaim = 0.0  # not a put's look: the first put short of slots looks again (an owner died since?)
        rows = self._count("SELECT count(*) FROM pages")
        if load_map:
            hook = type(self)._load_hook  # from the class: a plain function is not bound
            self.keymap.start(self._rdb, rows, self.BACKGROUND_ROWS if background else None,
                              (lambda: hook(self)) if hook is not None else None, self._heal)
        else:
            self.keymap.loaded.set()  # nothing to wait for: lookups go to SQLite
        self.recovery_s = time.perf_counter() - self._t0

    @classmethod
    def join(cls, db_path: str, member: Membership | None, *, load_map: bool = True) -> "Index":
        """The index of an existing namespace other processes write, for lookups and leases only."""
        if not os.path.isfile(db_path) or os.path.islink(db_path):
            raise FileNotFoundError(f"index {db_path}: no such namespace (yet)")
        return cls(db_path, 0, None, member=member, first=False, load_map=load_map)

    @property
    def loaded_s(self) -> float | None:
        """Seconds from open until the map was in place; None while it loads in the background."""
        return self.keymap.loaded_s

    @property
    def map_reloads(self) -> int:
        """Times a lookup read the whole map again (it fell behind the removals kept)."""
        return self.keymap.reloads

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the map is in place (True), the load failed or `timeout` passed (False)."""
        return self.keymap.wait(timeout)

    # -- open / repair (`recovery`) --------------------------------------------------------------
    def _open(self, gone: Iterable[tuple[int, int]], first: bool) -> None:
        opened = open_database(self.db_path, self._meta, self.nslots, existing=self._existing, gone=gone,
                               first=first)
        self._wdb, self._rdb, self._ino, self.nslots = opened

    def _reset_damaged(self, exc: BaseException, locked: bool = False) -> None:
        """Move a damaged database aside and start the namespace empty, under the namespace's setup
        lock (`locked`: the caller holds it); other processes find the new file at their next call
        (`_check_file`)."""
        from ..slabs.owners import setup_lock
        if self._meta is None:  # joined as it is: the namespace's stores recover it, not us
            raise OSError(f"index {self.db_path} is damaged ({exc}); left to the namespace's stores")
        with contextlib.nullcontext() if locked else setup_lock(os.path.dirname(self.db_path)):
            same = not self._ino or (os.path.exists(self.db_path) and not replaced(self.db_path, self._ino))
            if same:
                self._disconnect()
                move_aside(self.db_path, exc)
            else:
                log.error("index %s was damaged (%s); another process has replaced it", self.db_path, exc)
            self._existing = False
            self._reconnect(first=same)

    def _disconnect(self) -> None:
        for c in (self._wdb, self._rdb):
            if c is not None:
                c.close()
        self._wdb = self._rdb = None

    def _reconnect(self, first: bool) -> None:
        self._disconnect()
        self._open((), first)
        self.keymap.reset()
        self._pins.clear()
        self._unleased.clear()
        self._lost.clear()
        self.keymap.load_now(self._rdb)

    def _check_file(self) -> None:
        """Reconnect when another process replaced a damaged database (caller holds `_wlock`)."""
        if replaced(self.db_path, self._ino):
            log.warning("index %s was replaced by another process; reconnecting", self.db_path)
            self._reconnect(first=False)

    def _heal(self, exc: BaseException, force: bool = False) -> None:
        """A read found the database damaged: move it aside and start anew (unless another process did)."""
        with self._wlock:
            try:
                ino = self._ino
                self._check_file()
                if self._ino == ino and (force or damaged(exc)):
                    self._reset_damaged(exc)
            except Exception as exc2:  # noqa: BLE001
                log.error("index %s: could not recover from damage: %s", self.db_path, exc2)

    # -- queries ---------------------------------------------------------------------------------
    def _present(self, keys: Sequence[str]) -> dict[str, Entry]:
        """The map brought up to date, or while it loads the rows of `keys` read from SQLite
        (caller holds `_rlock`)."""
        if self.keymap.closing or self._rdb is None:
            raise ValueError(f"index {self.db_path} is closed")
        try:
            if self.keymap.ready:
                self.keymap.sync(self._rdb)
                return self.keymap.map
            return select_entries(self._rdb, keys)
        except (sqlite3.Error, ValueError) as exc:
            log.warning("index %s: lookup failed (%s); answered as misses", self.db_path, exc)
            if damaged(exc):
                threading.Thread(target=self._heal, args=(exc,), daemon=True).start()
            return {}

    def __len__(self) -> int:
        with self._rlock:
            if self.keymap.ready:
                self._present(())
                return len(self.keymap.map)
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
                    drop_leases(db, self.owner, self._unleased)
                out = fn(db)
                db.execute("COMMIT")
                self._unleased.clear()
                return out
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            if damaged(exc):
                try:
                    self._reset_damaged(exc)
                except Exception as exc2:  # noqa: BLE001
                    log.error("index %s: could not recover from damage: %s", self.db_path, exc2)
            raise OSError(f"index {self.db_path}: write failed: {exc}") from exc

    # -- reads -----------------------------------------------------------------------------------
    def lookup_pin(self, keys: Sequence[str]) -> list[Entry | None]:
        """Entries for `keys` (None for misses) from the database; hits are leased (their slots are
        not reused until `unpin`) and become the namespace's most recently used, in one transaction.
        Raises `OSError` when the index cannot be written (a full disk: `peek` still answers)."""
        def txn(db: sqlite3.Connection) -> dict[str, Entry]:
            found = select_entries(db, keys)
            if found:
                hit = list(dict.fromkeys(k for k in keys if k in found))
                touch(db, hit, tick(db, len(hit)))
                add_leases(db, self.owner, {found[k].slot for k in hit if found[k].slot not in self._pins})
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
                self._write(lambda db: drop_leases(db, self.owner, done))
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
            out = take_free(db, n, self.nslots)
            now = time.monotonic()
            if len(out) < n and now - self._last_reclaim >= _RECLAIM_EVERY_S:
                self._last_reclaim = now
                if self._reclaim(db):
                    out += take_free(db, n - len(out), self.nslots)
            if len(out) < n and evict:
                victims = db.execute("SELECT key, slot, nbytes, csum FROM pages WHERE slot NOT IN "
                                     "(SELECT slot FROM leases) ORDER BY atime LIMIT ?", (n - len(out),)).fetchall()
                if victims:
                    unpublish(db, (k for k, *_ in victims))
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
            mine = set(slot_list(db, "SELECT slot FROM held WHERE owner = ?", self.owner))
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
            mine = set(slot_list(db, "SELECT slot FROM held WHERE owner = ?", self.owner))
            present = select_entries(db, [it[0] for it in items])
            seq, t = bump(db, len(items))
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
            seq, _ = bump(db)
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
        freed = sum(return_owner(db, o) for o in dead)
        if dead:
            free_doomed(db)
            self.reclaimed += freed
            log.info("index %s: reclaimed %d reserved slot(s) and the leases of %d closed or dead process(es)",
                     self.db_path, freed, len(dead))
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
                return {"pages": len(self.keymap.map), "slots": self.nslots, "evictions": self.evictions}
            pages, free, top, held, leased, doomed = self._rdb.execute(
                "SELECT (SELECT count(*) FROM pages), (SELECT count(*) FROM free), (SELECT top FROM clock), "
                "(SELECT count(*) FROM held), (SELECT count(*) FROM leases), (SELECT count(*) FROM doomed)").fetchone()
        with self._wlock:
            pinned, lost = len(self._pins), len(self._lost)
        return {"pages": pages, "free_slots": free + max(0, self.nslots - top), "slots": self.nslots,
                "pinned_slots": pinned, "lost_slots": lost, "evictions": self.evictions,
                "reserved_slots_all": held, "leased_slots_all": leased, "doomed_slots": doomed,
                "reclaimed_slots": self.reclaimed, "map_reloads": self.keymap.reloads}

    def close(self, keep: Sequence[int] = ()) -> None:
        """Return what this process holds (reservations but `keep`, leases) and close. Idempotent.

        `keep`: reserved slots a write may still land in; they stay held under this store's
        token, which its owner keeps alive until that is over (`PageStore.close`)."""
        self.keymap.stop()
        with self._wlock:
            if self._wdb is None:
                return
            db = self._wdb
            try:
                def txn(db: sqlite3.Connection) -> None:
                    return_owner(db, self.owner, keep)
                    free_doomed(db)
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
