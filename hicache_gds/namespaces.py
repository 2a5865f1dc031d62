"""Namespaces on disk, for operators: find them, check every page's checksum, remove them.

Works on the files alone, next to a live writer: nothing here opens a `PageStore`, loads an
engine or takes a namespace's lock. What each namespace is comes from its ``namespace.json``
(identity, slot size, directories), its page count from its index read through `IndexReader`
(which writes nothing, not even SQLite's -wal/-shm files), and who has it open from `open_by`.

* `find(roots)`: every namespace under the `GDS_PATH` directories `roots`;
* `verify(ns)`: read every page's slot and compare its checksum with the index (the on-disk
  format's placement, directory order and checksum: `ondisk`); a page that
  fails twice with its index row unchanged around both reads is bad, and its exact row
  (key, slot, checksum) is deleted -- safe while a writer works: a page the writer replaced or
  evicted meanwhile is never reported, and a live writer that still lists a dropped page finds it
  failing its checksum at its next read and drops it as well;
* `remove(roots, name)`: delete a namespace's files, refusing an open one unless forced; every
  step goes through directory file descriptors opened without following links, so nothing
  outside `GDS_PATH` is ever removed or followed.
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
from .capacity import NAMESPACE_RE, SLAB_FILE
from .errors import ConfigError
from .index import INDEX_FILE, remove_pages
from .index_reader import IndexReader
from .owners import LOCK_FILE, PROCS_DIR, holders
from .slabs import META_FILE

__all__ = ["LOCK_FILE", "META_FILE", "Namespace", "VerifyReport", "RemoveReport", "open_by", "find", "resolve",
           "verify", "remove"]

_LOOKUP_CHUNK = 4096


# -- who has a namespace open ---------------------------------------------------------------------

def open_by(ns_dir: str) -> list[int]:
    """PIDs of the processes that have namespace `ns_dir` open ([] when none), each once.

    Told by the kernel: every open store holds a lock on its own file in the namespace's
    ``procs/`` (`owners.holders`), dropped however the process ends; nothing is locked or written
    to find out."""
    try:
        return sorted(set(holders(ns_dir)))
    except ConfigError:
        return []


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
    last_use: float | None = None
    """Last open or write (newest mtime of its lock, index and index log), seconds since the epoch."""
    open_by: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["last_use_iso"] = (time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.last_use))
                             if self.last_use else None)
        return d


def _real_dir(parent: str, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(os.path.join(parent, name)).st_mode)
    except OSError:
        return False


def _roots(roots: Sequence[str]) -> list[str]:
    out = []
    for r in roots:
        if not os.path.isdir(r):
            raise ConfigError(f"GDS_PATH: {r} is not a directory")
        out.append(os.path.realpath(r))
    return out


def _describe(name: str, roots: list[str]) -> Namespace:
    ns = Namespace(name, [os.path.join(r, name) for r in roots if _real_dir(r, name)])
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
        if recorded and all(_real_dir(os.path.dirname(d), name) for d in recorded):
            ns.dirs = recorded
        else:
            ns.problems.append(f"its directories ({', '.join(recorded) or '?'}) are not all there: moved, or "
                               f"a GDS_PATH entry is missing")
    elif meta is None:
        ns.problems.append(f"no {META_FILE} (not opened by this version, or being created)")
    for d in ns.dirs:
        try:
            entries = os.listdir(d)
        except OSError:
            continue
        for f in entries:
            try:
                st = os.lstat(os.path.join(d, f))
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            ns.allocated += st.st_blocks * 512
            if f == SLAB_FILE:
                ns.capacity += st.st_size
                if ns.slot_bytes:
                    ns.slots += st.st_size // ns.slot_bytes
            if f in (LOCK_FILE, INDEX_FILE, INDEX_FILE + "-wal"):
                ns.last_use = max(ns.last_use or 0.0, st.st_mtime)
    if ns.dirs:
        ns.open_by = open_by(ns.dirs[0])
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
    rs = _roots(roots)
    names: set[str] = set()
    for r in rs:
        try:
            names.update(n for n in os.listdir(r) if NAMESPACE_RE.fullmatch(n) and _real_dir(r, n))
        except OSError as exc:
            raise ConfigError(f"GDS_PATH: {r} cannot be listed: {exc.strerror}") from exc
    out = [_describe(n, rs) for n in sorted(names)]
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
            raise ConfigError(f"no namespace {typed} under {', '.join(_roots(roots))}")
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
    return "" if csum(got[:entry.nbytes], entry.nbytes) == entry.csum else "checksum mismatch"


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


# -- remove --------------------------------------------------------------------------------------------

@dataclass
class RemoveReport:
    namespace: str
    removed: bool = False
    files: int = 0
    freed: int = 0
    """Bytes the removed files took on disk (returned to the file system once no process holds them)."""
    open_by: list[int] = field(default_factory=list)
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _listing(dirfd: int, name: str) -> list[str] | None:
    """Names in directory `name` (opened without following links) when none of them is a
    directory; else None."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        names = os.listdir(fd)
        if any(stat.S_ISDIR(os.lstat(f, dir_fd=fd).st_mode) for f in names):
            return None
        return names
    finally:
        os.close(fd)


def _remove_dir(root: str, name: str) -> tuple[int, int, str] | None:
    """Remove `root`/`name` and the files in it, through descriptors: (files, bytes, refusal), or
    None when there is no such entry."""
    rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            nsfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rootfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return 0, 0, f"{os.path.join(root, name)} is a symbolic link or not a directory; left alone"
            raise
        try:
            entries, procs = [], None
            for f in os.listdir(nsfd):
                st = os.lstat(f, dir_fd=nsfd)
                if stat.S_ISDIR(st.st_mode):
                    if f != PROCS_DIR:
                        return 0, 0, (f"{os.path.join(root, name)} holds a directory ({f}), which no namespace "
                                      f"has; left alone")
                    procs = _listing(nsfd, f)
                    if procs is None:
                        return 0, 0, (f"{os.path.join(root, name, f)} holds a directory, which no namespace has; "
                                      f"left alone")
                    continue
                entries.append((f, st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0))
            if procs is not None:  # the open stores' lock files (`owners`): removed first, then the directory
                pfd = os.open(PROCS_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=nsfd)
                try:
                    for f in procs:
                        os.unlink(f, dir_fd=pfd)
                finally:
                    os.close(pfd)
                os.rmdir(PROCS_DIR, dir_fd=nsfd)
            for f, _ in entries:
                os.unlink(f, dir_fd=nsfd)  # a link is removed itself; its target is never touched
        finally:
            os.close(nsfd)
        os.rmdir(name, dir_fd=rootfd)
        return len(entries) + len(procs or ()), sum(b for _, b in entries), ""
    finally:
        os.close(rootfd)


def remove(roots: Sequence[str], name: str, *, force: bool = False) -> RemoveReport:
    """Delete namespace `name` (its directory in every `GDS_PATH` entry). An open namespace is
    refused unless `force`: its writer keeps writing into deleted files, whose space returns only
    when it exits."""
    if not NAMESPACE_RE.fullmatch(name):
        raise ConfigError(f"{name!r} is not a namespace name")
    rs = _roots(roots)
    rep = RemoveReport(name)
    dirs = [os.path.join(r, name) for r in rs if _real_dir(r, name)]
    for d in dirs:
        rep.open_by = sorted(set(rep.open_by) | set(open_by(d)))
    if rep.open_by and not force:
        rep.reason = (f"open by pid {', '.join(map(str, rep.open_by))}; stop it first, or use --force (the "
                      f"writer then writes into deleted files until it exits)")
        return rep
    refusals, found = [], 0
    for r in rs:
        done = _remove_dir(r, name)
        if done is None:
            continue
        found += 1
        files, freed, refusal = done
        rep.files += files
        rep.freed += freed
        if refusal:
            refusals.append(refusal)
    rep.removed = found > 0 and not refusals
    rep.reason = "; ".join(refusals) or ("" if found else f"no namespace {name} under {', '.join(rs)}")
    return rep
