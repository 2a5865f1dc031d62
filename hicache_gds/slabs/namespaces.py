"""Namespaces on disk, for operators: find them, check every page's checksum, remove them.

Works on the files alone, next to a live writer: nothing here opens a `PageStore` or loads an
engine. What each namespace is comes from its ``namespace.json`` (identity, slot size,
directories), its page count from its index read through `IndexReader` (which writes nothing, not
even SQLite's -wal/-shm files), who has it open from `open_by`, and since when it is idle from its
recorded use (`owners.read_use`) and its index's last write.

* `find(roots)`: every namespace under the `GDS_PATH` directories `roots`; `scan(roots)` the same
  without reading the indexes (no page counts), for sizing and eviction;
* `verify(ns)`: read every page's slot and compare its checksum with the index (the on-disk
  format's placement, directory order and checksum: `ondisk`); a page that
  fails twice with its index row unchanged around both reads is bad, and its exact row
  (key, slot, checksum) is deleted -- safe while a writer works: a page the writer replaced or
  evicted meanwhile is never reported, and a live writer that still lists a dropped page finds it
  failing its checksum at its next read and drops it as well.

Removing a namespace is `removal.remove`.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import sqlite3
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from . import ondisk
from ..errors import ConfigError
from ..index import INDEX_FILE, IndexReader, remove_pages
from ..layout import NAMESPACE_RE
from .owners import LOCK_FILE, procs_state, read_use
from .slabset import META_FILE, SlabSet
from ..stats import metric_values

__all__ = ["LOCK_FILE", "META_FILE", "Namespace", "VerifyReport", "open_by", "find", "scan", "resolve", "verify",
           "real_roots", "is_real_dir"]

SLAB_FILE = SlabSet.FILE_NAME
_LOOKUP_CHUNK = 4096


# -- who has a namespace open ---------------------------------------------------------------------

def open_by(ns_dir: str) -> list[int]:
    """PIDs of the processes that have namespace `ns_dir` open ([] when none), each once.

    Told by the kernel: every open store holds a lock on its own file in the namespace's
    ``procs/`` (`owners.holders`), dropped however the process ends; nothing is locked or written
    to find out."""
    return sorted(set(_procs(ns_dir)[0]))


def _procs(ns_dir: str) -> tuple[list[int], int]:
    try:
        return procs_state(ns_dir)
    except ConfigError:
        return [], 0


# -- finding namespaces ----------------------------------------------------------------------------

@dataclass
class Namespace:
    """One namespace as its files describe it (`find`)."""

    name: str
    dirs: list[str]
    identity: dict[str, str] = field(default_factory=dict)
    page_bytes: int = 0
    slot_bytes: int = 0
    pages: int = 0
    bytes: int = 0
    """Bytes of the pages it holds (pages x page size)."""
    capacity: int = 0
    """Bytes of slots (its slab files' sizes)."""
    slots: int = 0
    allocated: int = 0
    """Bytes its files take on disk."""
    dir_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes its files take in each of its directories."""
    opened: float | None = None
    """When a store last opened it (recorded at open), seconds since the epoch."""
    closed: float | None = None
    """When a store last closed it (recorded at close; none for a store killed with SIGKILL)."""
    last_use: float | None = None
    """Its last use: the newest of its recorded open and close and its index's last write."""
    open_by: list[int] = field(default_factory=list)
    idle_since: float | None = None
    """None while a process has it open; else `last_use`: since then nothing has used it."""
    ended: str = ""
    """How its last use ended, while idle: "closed", or "without closing" (its last process was
    killed or crashed: the last write of its index says when)."""
    problems: list[str] = field(default_factory=list)
    whole: bool = True
    """All the directories its namespace.json records are there (False: moved, or a `GDS_PATH`
    entry missing: it is listed, but never evicted)."""

    @property
    def idle(self) -> bool:
        return not self.open_by

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("last_use", "idle_since", "opened", "closed"):
            d[f"{k}_iso"] = _iso(getattr(self, k))
        d["idle"] = self.idle
        # The index's metrics under the names `stats()` and Prometheus use (`hicache_gds.stats.METRICS`).
        d["metrics"] = {m.name: int(v) for m, v in metric_values(d)}
        return d


def _iso(t: float | None) -> str | None:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t)) if t else None


def is_real_dir(parent: str, name: str) -> bool:
    """`parent`/`name` is a directory itself (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(os.path.join(parent, name)).st_mode)
    except OSError:
        return False


def real_roots(roots: Sequence[str]) -> list[str]:
    """The `GDS_PATH` directories `roots` as real paths; `ConfigError` for one that is not a directory."""
    out = []
    for r in roots:
        if not os.path.isdir(r):
            raise ConfigError(f"GDS_PATH: {r} is not a directory")
        out.append(os.path.realpath(r))
    return out


def _describe(name: str, roots: list[str], pages: bool = True) -> Namespace:
    ns = Namespace(name, [os.path.join(r, name) for r in roots if is_real_dir(r, name)])
    meta = None
    for d in ns.dirs:
        try:
            fd = os.open(os.path.join(d, META_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        with os.fdopen(fd) as f:
            try:
                meta = json.load(f)
            except ValueError as exc:
                ns.problems.append(f"{META_FILE} unreadable: {exc}")
        break
    if isinstance(meta, dict):
        ns.identity = {str(k): str(v) for k, v in dict(meta.get("identity") or {}).items()}
        ns.slot_bytes = int(meta.get("slot_bytes") or 0)
        ns.page_bytes = int(ns.identity.get("page_bytes") or 0)
        # The writer's directory order places slots (slot s lives in directory s % n): use it.
        recorded = [d for d in meta.get("dirs") or [] if isinstance(d, str) and os.path.basename(d) == name]
        if recorded and all(is_real_dir(os.path.dirname(d), name) for d in recorded):
            ns.dirs = recorded
        else:
            ns.whole = False
            ns.problems.append(f"its directories ({', '.join(recorded) or '?'}) are not all there: moved, or "
                               f"a GDS_PATH entry is missing")
    elif meta is None:
        ns.problems.append(f"no {META_FILE} (not opened by this version, or being created)")
    for d in ns.dirs:
        try:
            entries = os.listdir(d)
        except OSError:
            continue
        held = 0
        for f in entries:
            try:
                st = os.lstat(os.path.join(d, f))
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            held += st.st_blocks * 512
            if f == SLAB_FILE:
                ns.capacity += st.st_size
                if ns.slot_bytes:
                    ns.slots += st.st_size // ns.slot_bytes
            if f in (INDEX_FILE, INDEX_FILE + "-wal"):  # every put, delete and lease commits to it
                ns.last_use = max(ns.last_use or 0.0, st.st_mtime)
        ns.dir_bytes[d] = held
        ns.allocated += held
    if ns.dirs:
        pids, dead = _procs(ns.dirs[0])
        ns.open_by = sorted(set(pids))
        use = read_use(ns.dirs[0])
        ns.opened, ns.closed = use.opened, use.closed
        ns.last_use = max(ns.last_use or 0.0, use.opened or 0.0, use.closed or 0.0) or None
        if not ns.open_by:
            ns.idle_since = ns.last_use
            if dead or (use.opened and (use.closed or 0.0) < use.opened):
                ns.ended = "without closing"
            elif use.closed:
                ns.ended = "closed"
    if ns.dirs and pages:
        try:
            reader = IndexReader(os.path.join(ns.dirs[0], INDEX_FILE))
            try:
                ns.pages = len(reader)
            finally:
                reader.close()
        except ConfigError as exc:
            ns.problems.append(str(exc))
        ns.bytes = ns.pages * ns.page_bytes
    return ns


def find(roots: Sequence[str]) -> list[Namespace]:
    """Every namespace under the `GDS_PATH` directories `roots` (oldest use first)."""
    return _find(roots, pages=True)


def scan(roots: Sequence[str], exclude: str = "") -> list[Namespace]:
    """`find` without reading the indexes (`pages` stays 0) and without namespace `exclude`: what
    sizing and eviction need, at the cost of a few system calls per namespace."""
    return _find(roots, pages=False, exclude=exclude)


def _find(roots: Sequence[str], pages: bool, exclude: str = "") -> list[Namespace]:
    rs = real_roots(roots)
    names: set[str] = set()
    for r in rs:
        try:
            names.update(n for n in os.listdir(r) if NAMESPACE_RE.fullmatch(n) and n != exclude and is_real_dir(r, n))
        except OSError as exc:
            raise ConfigError(f"GDS_PATH: {r} cannot be listed: {exc.strerror}") from exc
    out = [_describe(n, rs, pages) for n in sorted(names)]
    return sorted(out, key=lambda n: (n.last_use or 0.0, n.name))


def resolve(roots: Sequence[str], names: Iterable[str], found: Sequence[Namespace] | None = None) -> list[str]:
    """Namespace names from what an operator typed: a full name, or a prefix of one (at least
    ``ns-`` and 4 hex digits) that names exactly one namespace. `ConfigError` otherwise.
    `found`: `find(roots)`'s answer where the caller has it already (each `find` reads every
    namespace's index)."""
    have = sorted({n.name for n in (find(roots) if found is None else found)})
    out = []
    for typed in names:
        if not isinstance(typed, str) or not typed.startswith("ns-") or not all(
                c in "0123456789abcdef" for c in typed[3:]) or len(typed) < 7:
            raise ConfigError(f"{typed!r} is not a namespace name (ns- and 20 hex digits, as `hicache-gds ls` "
                              f"shows; a unique prefix of at least ns-xxxx will do)")
        hits = [n for n in have if n == typed] or [n for n in have if n.startswith(typed)]
        if not hits:
            raise ConfigError(f"no namespace {typed} under {', '.join(real_roots(roots))}")
        if len(hits) > 1:
            raise ConfigError(f"{typed} names {len(hits)} namespaces ({', '.join(hits)}); give more digits")
        out.append(hits[0])
    return list(dict.fromkeys(out))


# -- verify ------------------------------------------------------------------------------------------

@dataclass
class VerifyReport:
    namespace: str
    checked: int = 0
    ok: int = 0
    bad: list[dict[str, Any]] = field(default_factory=list)
    """Pages whose bytes do not match their checksum: {key, slot, reason}."""
    unverifiable: int = 0
    """Pages without a checksum (format 1 left pages written from GPU memory so)."""
    changed: int = 0
    """Pages the writer replaced, evicted or deleted while they were checked (not judged)."""
    dropped: int = 0
    open_by: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _SlotReader:
    """Reads whole slots from a namespace's slab files (O_DIRECT where the file system has it)."""

    def __init__(self, dirs: list[str], slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.ndirs = len(dirs)
        self.buf = mmap.mmap(-1, slot_bytes)
        self.fds: list[int | None] = []
        for d in dirs:
            path = os.path.join(d, SLAB_FILE)
            fd = None
            for flags in (os.O_DIRECT, 0):
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | flags)
                    break
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        break
            self.fds.append(fd)

    def read(self, slot: int) -> memoryview | str:
        """The slot's bytes, or why they cannot be read."""
        fi, off = ondisk.place([slot], self.ndirs, self.slot_bytes)
        fd = self.fds[int(fi[0])]
        if fd is None:
            return "its slab file is missing"
        off = int(off[0])
        try:
            n = os.preadv(fd, [self.buf], off)
        except OSError as exc:
            return f"read failed: {exc.strerror}"
        if n < self.slot_bytes:
            return "past the end of its slab file"
        return memoryview(self.buf)

    def close(self) -> None:
        for fd in self.fds:
            if fd is not None:
                os.close(fd)
        self.buf.close()


def _check(reader: _SlotReader, entry: Any, csum: Callable[[Any, int], int]) -> str:
    """'' when the slot holds the page its index row describes, else why not."""
    got = reader.read(entry.slot)
    if isinstance(got, str):
        return got
    if entry.nbytes > reader.slot_bytes:
        return f"its row says {entry.nbytes} bytes, more than a slot"
    return "" if csum(got[:entry.nbytes], entry.nbytes, entry.csum) == entry.csum else "checksum mismatch"


def verify(ns: Namespace, *, drop: bool = True, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check every page of `ns` (module docstring); drop the bad ones unless `drop` is False."""
    t0 = time.monotonic()
    rep = VerifyReport(ns.name, open_by=list(ns.open_by))
    if ns.problems or not ns.slot_bytes or str(len(ns.dirs)) != ns.identity.get("ndirs"):
        # A wrong directory list would place slots wrongly, and good pages would look bad.
        raise ConfigError(f"namespace {ns.name} cannot be verified: "
                          f"{'; '.join(ns.problems) or 'its slot size or directory count is not recorded'}")
    # The recorded directory order places slots; a format-1 namespace records none (its
    # namespace.json's order is what `find` gave).
    dirs = ondisk.stripe_order(ns.dirs) or ns.dirs
    index = IndexReader(os.path.join(dirs[0], INDEX_FILE))
    try:
        csum = ondisk.page_checksum(ondisk.legacy_format(index.settings()))
    except BaseException:
        index.close()
        raise
    reader = _SlotReader(dirs, ns.slot_bytes)
    doomed = []
    try:
        keys = index.keys()
        for a in range(0, len(keys), _LOOKUP_CHUNK):
            chunk = keys[a:a + _LOOKUP_CHUNK]
            for key, e in zip(chunk, index.lookup(chunk)):
                if e is None:
                    rep.changed += 1
                    continue
                rep.checked += 1
                if not e.csum:
                    rep.unverifiable += 1
                    continue
                if not _check(reader, e, csum):
                    rep.ok += 1
                    continue
                # Bad only if it fails again with the same row before and after the second read: a
                # writer that evicted the page and reused its slot has changed or removed the row
                # first (it deletes a row before it reuses the slot).
                if index.lookup([key])[0] != e:
                    rep.changed += 1
                    continue
                why = _check(reader, e, csum)
                if index.lookup([key])[0] != e:
                    rep.changed += 1
                    continue
                if not why:
                    rep.ok += 1
                    continue
                rep.bad.append({"key": key, "slot": e.slot, "reason": why})
                doomed.append((key, e.slot, e.csum))
            if progress is not None:
                progress(min(a + _LOOKUP_CHUNK, len(keys)), len(keys))
    finally:
        reader.close()
        index.close()
    if drop and doomed:
        rep.dropped = _drop_rows(os.path.join(dirs[0], INDEX_FILE), doomed)
    rep.seconds = time.monotonic() - t0
    return rep


def _drop_rows(db_path: str, rows: list[tuple[str, int, int]]) -> int:
    """Remove exactly these (key, slot, csum) pages, as `Index` removes pages (`remove_pages`: every
    process that has the namespace open drops the keys, and the slots go back to the free list); a
    row a writer changed since is left alone."""
    st = os.lstat(db_path)
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"GDS_PATH: {db_path} is not a plain file; not written through")
    db = sqlite3.connect(db_path, timeout=30, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        same = {key: slot for key, slot, csum in rows
                if db.execute("SELECT 1 FROM pages WHERE key = ? AND slot = ? AND csum = ?",
                              (key, slot, csum)).fetchone()}
        if same:
            remove_pages(db, same)
        db.execute("COMMIT")
        return len(same)
    finally:
        db.close()
