"""Namespaces on disk with their indexes read, for operators (`hicache-gds ls | verify | clear`).

`hicache_gds.slabs.namespaces` describes the namespaces under `GDS_PATH` from their files alone;
this module adds what only their index (`hicache_gds.index`) tells, next to a live writer
(`IndexReader` writes nothing, not even SQLite's -wal/-shm files):

* `find(roots)`: every namespace under the `GDS_PATH` directories `roots`, with its page count;
* `resolve(roots, names)`: namespace names from what an operator typed (a unique prefix will do);
* `verify(ns)`: read every page's slot and compare its checksum with the index (the on-disk
  format's placement, directory order and checksum: `slabs.ondisk`); a page that
  fails twice with its index row unchanged around both reads is bad, and its exact row
  (key, slot, checksum) is deleted -- safe while a writer works: a page the writer replaced or
  evicted meanwhile is never reported, and a live writer that still lists a dropped page finds it
  failing its checksum at its next read and drops it as well.
"""

from __future__ import annotations

import errno
import mmap
import os
import sqlite3
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ..errors import ConfigError
from ..index import INDEX_FILE, IndexReader, remove_pages
from ..slabs import ondisk
from ..slabs.namespaces import SLAB_FILE, Namespace, real_roots, scan

__all__ = ["Namespace", "VerifyReport", "find", "resolve", "verify"]

_LOOKUP_CHUNK = 4096


def find(roots: Sequence[str]) -> list[Namespace]:
    """Every namespace under the `GDS_PATH` directories `roots` (oldest use first), with its page
    count read from its index (`slabs.namespaces.scan` reads none)."""
    return scan(roots, count_pages=_count_pages)


def _count_pages(ns_dir: str) -> int:
    reader = IndexReader(os.path.join(ns_dir, INDEX_FILE))
    try:
        return len(reader)
    finally:
        reader.close()


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
