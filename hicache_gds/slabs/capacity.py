"""How large a namespace is, and why, and one disk budget per node: the rule `PageStore`, the
adapters and `doctor` share.

A namespace's slots are chosen, first rule that applies:

1. **configured**: ``capacity`` (``HICACHE_GDS_CAPACITY``), exactly;
2. **kept**: its slab files from an earlier open, whatever they hold (a restart never resizes);
3. **default**, per `GDS_PATH` directory: ``capacity_fraction`` (0.5) of the space hicache-gds may
   use there -- the space available plus what hicache-gds namespaces already hold in that
   directory -- so every namespace asks for the same size, whichever opens first; and never so
   much that the file system ends up fuller than ``max_fill`` (0.9), with fullness counted as
   SGLang's HiCacheNixl cleaner counts it: ``1 - available / total`` (the slab files stay within
   it; the index adds about 200 bytes a page on top).

**One budget per node.** The namespaces under a `GDS_PATH` directory share it. A new namespace
(no slab files yet, however sized) that would take a file system past ``max_fill`` first makes
room: the *idle* namespaces there -- no process has them open (`owners`) -- are removed whole,
least recently used first, with the removal ``hicache-gds clear`` uses (`removal.remove`), each
logged at INFO with what, since when idle, and why -- but none where removing them all would
still leave it past ``max_fill`` (a disk filled by other data). So namespaces opened one after
another each get their default size while the disk stays at most ``max_fill`` full, and `StoreFullError` comes
only when namespaces that are open hold the space. The default rule counts idle namespaces' bytes
as room (`DirSpace.idle`), so what `default_budget` promises is what the open then gets.

New namespaces on one directory are sized one at a time (`budget_lock`, a lock on the directory
itself) and claim their space -- their slab files are created, preallocated -- before the next is
sized, so two processes opening new namespaces at once neither count the same free space twice
nor remove each other's: a namespace being opened holds its setup lock and its ``procs/`` entry,
which make it open to everyone else.

Striped directories get equal shares (the smallest directory's), so slot ``s`` always has a place.
Callers that split the default between processes (SGLang's writer ranks, vLLM's workers) divide
`default_budget(...).total` among them; each process then asks for its share of the same budget,
whichever opens first.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..errors import StoreFullError, StoreLockedError
from ..layout import NAMESPACE_RE
from .namespaces import Namespace, scan
from .removal import remove
from .owners import CLOSED_FILE, SETUP_WAIT_S
from .slabset import SlabSet

__all__ = ["DirSpace", "Budget", "Sizing", "dir_space", "default_budget", "size_namespace", "budget_lock",
           "evictable", "gib"]

log = logging.getLogger("hicache_gds.capacity")
SLAB_FILE = SlabSet.FILE_NAME
_BUDGET_LOCK_FILE = ".hicache-gds-budget"  # only where a directory itself cannot be locked (NFS)
_SHOWN = ("model", "model_name", "layout", "kind", "pool", "tp_rank", "rank", "tenant")


def gib(n: float) -> str:
    """A byte count for people: 1.5 GiB, 24.0 MiB, 512 KiB."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n / 1024:.0f} KiB"


@dataclass(frozen=True)
class DirSpace:
    """One `GDS_PATH` directory's file system, as the default rule sees it."""

    root: str
    total: int
    available: int
    held: int
    """Bytes hicache-gds namespaces (other than the one being sized) hold in this directory."""
    namespaces: int
    idle: int = 0
    """... of which idle namespaces hold this many: room a new namespace may take (module docstring)."""
    idle_namespaces: int = 0
    open_by: tuple[int, ...] = ()
    """Pids that have the other namespaces here open."""

    @property
    def fill(self) -> float:
        """Fraction used, as SGLang's HiCacheNixl cleaner counts it (reserved blocks count as used)."""
        return 1.0 - self.available / self.total if self.total else 1.0

    def reserve(self, max_fill: float) -> float:
        """Bytes that must stay available for the file system to be at most `max_fill` full."""
        return (1.0 - max_fill) * self.total

    def share(self, fraction: float, max_fill: float, own: int = 0, evict: bool = True) -> int:
        """Bytes a namespace gets here by default; `own`: what its own files already take here;
        `evict`: idle namespaces' bytes count as room."""
        want = fraction * (self.available + self.held + own)
        free = self.available + own + (self.idle if evict else 0)
        return max(0, int(min(want, free - self.reserve(max_fill), free)))


def _fs(root: str) -> tuple[int, int]:
    """(total, available) bytes of `root`'s file system."""
    st = os.statvfs(root)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _ns_bytes(ns: Namespace, root: str) -> int:
    return ns.dir_bytes.get(os.path.join(root, ns.name), 0)


def evictable(roots: Sequence[str], found: Sequence[Namespace]) -> list[Namespace]:
    """The namespaces of `found` (a `namespaces.scan` of `roots`) that may be removed to make room:
    idle, holding bytes, with all their directories under `roots` (removed whole or not at all);
    least recently used first (one with no recorded use at all goes first)."""
    real = {os.path.realpath(r) for r in roots}
    out = [n for n in found if n.idle and n.whole and n.allocated > 0 and n.dirs
           and all(os.path.dirname(d) in real for d in n.dirs)]
    return sorted(out, key=lambda n: (n.last_use or 0.0, n.name))


def _held(root: str, exclude: str) -> tuple[int, int]:
    """(bytes allocated, namespace count) of the namespaces directly under `root` but `exclude`
    (regular files only; links, and directories not shaped like a namespace, are not counted):
    what the default rule needs when idle namespaces need not be told apart."""
    total = count = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0, 0
    for name in names:
        if name == exclude or not NAMESPACE_RE.fullmatch(name):
            continue
        d = os.path.join(root, name)
        try:
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                continue
            files = os.listdir(d)
        except OSError:
            continue
        count += 1
        for f in files:
            if f == CLOSED_FILE:  # an empty marker (its mtime is the use record): nothing to count
                continue
            try:
                st = os.lstat(os.path.join(d, f))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512  # allocated: a sparse (not preallocated) slab holds little
    return total, count


def _spaces(roots: Sequence[str], exclude: str = "", detail: bool = True) -> tuple[list[DirSpace], list[Namespace]]:
    """Each directory's `DirSpace`, and the namespaces found there (`namespaces.scan`); without
    `detail`, idle namespaces are not told apart (`DirSpace.idle` 0) and none are returned, at the
    cost of a listing per namespace."""
    if not detail:
        out = []
        for r in roots:
            total, avail = _fs(r)
            out.append(DirSpace(r, total, avail, *_held(r, exclude)))
        return out, []
    found = scan(roots, exclude)
    ev = {n.name for n in evictable(roots, found)}
    out = []
    for r in roots:
        real = os.path.realpath(r)
        st = os.statvfs(r)
        here = [n for n in found if _ns_bytes(n, real) or os.path.join(real, n.name) in n.dirs]
        idle = [n for n in here if n.name in ev]
        out.append(DirSpace(r, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize,
                            sum(_ns_bytes(n, real) for n in here), len(here), sum(_ns_bytes(n, real) for n in idle),
                            len(idle), tuple(sorted({p for n in here for p in n.open_by}))))
    return out, found


def dir_space(root: str, exclude: str = "", detail: bool = True) -> DirSpace:
    """`root`'s file system and the hicache-gds namespaces in it (all but `exclude`)."""
    return _spaces([root], exclude, detail)[0][0]


@dataclass(frozen=True)
class Budget:
    """The default size of a namespace over `GDS_PATH`, before it is cut into slots."""

    per_dir: int
    dirs: tuple[DirSpace, ...]
    how: str
    capped: bool = False
    """Less than `capacity_fraction` asks for, to stay below `max_fill`."""

    @property
    def total(self) -> int:
        return self.per_dir * len(self.dirs)

    def no_room(self, max_fill: float) -> StoreFullError:
        """The error for a budget too small for the namespace: which directory, how full, what holds it."""
        tight = min(self.dirs, key=lambda s: s.available + s.idle - s.reserve(max_fill))
        held = tight.held - tight.idle
        return StoreFullError(
            errno.ENOSPC, f"no room for a namespace by default in {tight.root}: the file system is {tight.fill:.0%} "
                          f"full ({gib(tight.available)} available) and default sizing stops at max_fill={max_fill:g}"
                          + (f"; {tight.namespaces - tight.idle_namespaces} hicache-gds namespace(s) hold "
                             f"{gib(held)} there and are open"
                             + (f" (pid {', '.join(map(str, tight.open_by))})" if tight.open_by else "")
                             + ", so none can be removed to make room (`hicache-gds ls`)"
                             if tight.namespaces > tight.idle_namespaces else "")
                          + "; set HICACHE_GDS_CAPACITY, free space, or raise HICACHE_GDS_MAX_FILL")


def default_budget(roots: Sequence[str], fraction: float, max_fill: float, *, exclude: str = "",
                   own: Sequence[int] = (), evict: bool = True, detail: bool = False) -> Budget:
    """The default rule (3 in the module docstring) over the `GDS_PATH` directories `roots`.

    `exclude`: the namespace being sized (its own files are not "held by others"); `own`: bytes
    its files already take in each directory; `evict`: count idle namespaces' bytes as room (what
    opening a new namespace makes of them). Idle namespaces are told apart only where the room
    without them falls short, or with `detail` (the `DirSpace` fields then say who holds what)."""
    b = _budget(tuple(_spaces(roots, exclude, detail)[0]), fraction, max_fill, own, evict and detail)
    if detail or not evict or not b.capped:
        return b
    return _budget(tuple(_spaces(roots, exclude)[0]), fraction, max_fill, own, evict)


def _budget(spaces: tuple[DirSpace, ...], fraction: float, max_fill: float, own: Sequence[int],
            evict: bool) -> Budget:
    owns = list(own) + [0] * (len(spaces) - len(own))
    shares = [s.share(fraction, max_fill, o, evict) for s, o in zip(spaces, owns)]
    per_dir = min(shares) if shares else 0
    tight = min(range(len(spaces)), key=lambda i: shares[i])
    s = spaces[tight]
    base = (f"{gib(s.available)} available" + (f" + {gib(s.held)} held by {s.namespaces} other namespace(s)"
                                              if s.namespaces else ""))
    capped = per_dir < int(fraction * (s.available + s.held + owns[tight]))
    takes_idle = evict and any(sh > x.share(fraction, max_fill, o, False) for sh, x, o in zip(shares, spaces, owns))
    how = (f"default: {fraction:g} of {base} in {s.root}"
           + (f", capped so the file system stays at most {max_fill:.0%} full (now {s.fill:.0%})" if capped else "")
           + (f"; room made by removing idle namespaces, least recently used first ({s.idle_namespaces} hold "
              f"{gib(s.idle)} here)" if takes_idle else "")
           + (f"; the same in each of {len(spaces)} directories" if len(spaces) > 1 else ""))
    return Budget(per_dir, spaces, how, capped)


@dataclass(frozen=True)
class Sizing:
    """Slots of one namespace and how they were chosen (the INFO line at open says both)."""

    nslots: int
    slot_bytes: int
    how: str

    @property
    def capacity(self) -> int:
        return self.nslots * self.slot_bytes


_SOURCES = {"env": "HICACHE_GDS_CAPACITY", "config": "the config's capacity key"}


def size_namespace(cfg, dirs: Sequence[str], slot_bytes: int) -> Sizing:  # noqa: ANN001 -- a Config
    """Slots for the namespace whose directories (one per `GDS_PATH` entry) are `dirs`.

    A new namespace (no slab files yet) is sized under `budget_lock`, makes room by removing idle
    namespaces where it would take a file system past `max_fill`, and claims its space -- its slab
    files are created (preallocated where `cfg.preallocate`) -- before the lock goes. Raises
    `StoreFullError` when the default rule leaves no room for one slot per directory (a configured
    capacity too small for one slot is the caller's `ConfigError`)."""
    nd = len(dirs)
    sizes = []
    for d in dirs:
        try:
            sizes.append(os.lstat(os.path.join(d, SLAB_FILE)).st_size)
        except FileNotFoundError:
            sizes.append(0)
    fresh = not any(sizes)
    roots = [os.path.dirname(d) for d in dirs]
    name = os.path.basename(dirs[0])
    src = cfg.sources.get("capacity", "default")
    if cfg.capacity:
        nslots = cfg.capacity // slot_bytes
        how = f"configured (capacity={cfg.capacity} from {_SOURCES.get(src, src)})"
        if not fresh or nslots < 1:
            _warn_if_over(cfg, dirs, nslots * slot_bytes, sizes)
            return Sizing(nslots, slot_bytes, how)
        with budget_lock(roots):
            need = SlabSet(list(dirs), slot_bytes, nslots, create=False).file_bytes
            gone = _make_room(roots, need, cfg.max_fill, name)
            _warn_if_over(cfg, dirs, nslots * slot_bytes, sizes)
            SlabSet(list(dirs), slot_bytes, nslots, cfg.preallocate, create=True)
        return Sizing(nslots, slot_bytes, how + _removed(gone))
    if sizes[0]:
        nslots = sum(s // slot_bytes for s in sizes)
        return Sizing(nslots, slot_bytes, "kept from the namespace's first open (its slab files' size)")
    own = []
    for d in dirs:
        try:
            own.append(os.lstat(os.path.join(d, SLAB_FILE)).st_blocks * 512)
        except FileNotFoundError:
            own.append(0)
    with budget_lock(roots):
        b = default_budget(roots, cfg.capacity_fraction, cfg.max_fill, exclude=name, own=own)
        nslots = b.per_dir // slot_bytes * nd
        if nslots < nd:
            raise b.no_room(cfg.max_fill)
        need = SlabSet(list(dirs), slot_bytes, nslots, create=False).file_bytes
        gone = _make_room(roots, need, cfg.max_fill, name)
        how = b.how + _removed(gone)
        room = min(int(a + o - (1.0 - cfg.max_fill) * t) for (t, a), o in zip(map(_fs, roots), own))
        if room < max(need):  # an idle namespace counted as room was opened meanwhile: what is there now
            nslots = max(0, room) // slot_bytes * nd
            if nslots < nd:
                raise default_budget(roots, cfg.capacity_fraction, cfg.max_fill, exclude=name, own=own,
                                     evict=False, detail=True).no_room(cfg.max_fill)
            how += f"; cut to {gib(nslots * slot_bytes)}: idle namespaces it counted on were opened meanwhile"
        SlabSet(list(dirs), slot_bytes, nslots, cfg.preallocate, create=True)
    return Sizing(nslots, slot_bytes, how)


def _removed(gone: Sequence[str]) -> str:
    return f"; removed {len(gone)} idle namespace(s) to make room ({', '.join(gone)})" if gone else ""


def _make_room(roots: Sequence[str], need: Sequence[int], max_fill: float, name: str) -> list[str]:
    """Remove idle namespaces under `roots`, least recently used first, until each directory has
    `need` bytes (for namespace `name`) available above the `max_fill` reserve, or none is left.
    Returns the names removed.

    Nothing is removed where removing every idle namespace would still not make that room -- a
    file system filled past `max_fill` by other data: their pages would be lost for nothing (logged
    once, with the sizes)."""
    gone: list[str] = []
    tried: set[str] = set()
    while True:
        short = [(r, n, *_fs(r)) for r, n in zip(roots, need)]
        short = [(r, n, t, a) for r, n, t, a in short if a - n < (1.0 - max_fill) * t]
        if not short:  # the common case costs one statvfs per directory: no namespace is looked at
            return gone
        real = [os.path.realpath(r) for r, *_ in short]
        idle = evictable(roots, scan(roots, name))
        if not tried:  # the first look: would removing every idle namespace make the room at all?
            for (r, n, t, a), rr in zip(short, real):
                short_by, could_free = int((1.0 - max_fill) * t - (a - n)), sum(_ns_bytes(ns, rr) for ns in idle)
                if could_free < short_by:
                    log.info("hicache-gds: no idle namespace removed for new namespace %s: it needs %s in %s, which "
                             "is %.0f%% full with %s available; staying under max_fill %.0f%% needs %s more, and "
                             "the %d idle namespace(s) there hold %s", name, gib(n), r, 100 * (1 - a / t) if t else 100,
                             gib(a), 100 * max_fill, gib(short_by), len(idle), gib(could_free))
                    return gone
        pick = next((ns for ns in idle if ns.name not in tried and any(_ns_bytes(ns, r) for r in real)), None)
        if pick is None:
            return gone
        tried.add(pick.name)
        r, n, t, a = short[0]
        rep = remove(roots, pick.name)
        if rep.removed or rep.freed:
            log.info("hicache-gds: removed idle namespace %s (%s; %s%s; %s freed) to make room for new namespace "
                     "%s: it needs %s in %s, which is %.0f%% full with %s available, and max_fill is %.0f%%",
                     pick.name, _what(pick), _idle_for(pick.last_use),
                     f", its last use ended {pick.ended}" if pick.ended else "",
                     gib(rep.freed), name, gib(n), r, 100 * (1 - a / t) if t else 100, gib(a), 100 * max_fill)
        if rep.removed:
            gone.append(pick.name)
        else:
            log.info("hicache-gds: idle namespace %s was left in place: %s", pick.name, rep.reason)


def _what(ns: Namespace) -> str:
    shown = [f"{k}={ns.identity[k]}" for k in _SHOWN if ns.identity.get(k)]
    return ", ".join(shown) or "identity not recorded"


def _idle_for(t: float | None) -> str:
    if not t:
        return "no recorded use"
    s = max(0.0, time.time() - t)
    ago = next((f"{s / n:.1f} {u}" for u, n in (("days", 86400), ("hours", 3600), ("minutes", 60)) if s >= n),
               f"{s:.0f} s")
    return f"idle since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))} ({ago} ago)"


@contextmanager
def budget_lock(roots: Sequence[str], timeout: float = SETUP_WAIT_S) -> Iterator[None]:
    """Size new namespaces on `roots` one at a time: an exclusive `flock` on each directory itself
    (no file is created), taken in one order (`StoreLockedError` after `timeout` s)."""
    fds: list[int] = []
    try:
        for r in sorted({os.path.realpath(r) for r in roots}):
            fd = os.open(r, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fds.append(fd)
            if not _flock(fd, timeout):
                raise StoreLockedError(f"GDS_PATH: {r}: another process has been sizing a new namespace there for "
                                       f"over {timeout:.0f} s; nothing was opened")
        yield
    finally:
        for fd in fds:
            os.close(fd)


def _flock(fd: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        except OSError as exc:  # a file system that cannot lock a directory (NFS): lock a file in it
            if exc.errno not in (errno.EBADF, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            path = os.path.join(f"/proc/self/fd/{fd}", _BUDGET_LOCK_FILE)
            lf = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.dup2(lf, fd)  # the directory's descriptor now holds the file: closed with the others
            os.close(lf)


def _warn_if_over(cfg, dirs: Sequence[str], capacity: int, sizes: Sequence[int]) -> None:  # noqa: ANN001
    """A configured capacity is honoured, but say so when it takes a file system past `max_fill`."""
    per_dir = -(-capacity // len(dirs))
    for d, have in zip(dirs, sizes):
        try:
            st = os.statvfs(os.path.dirname(d))
        except OSError:
            continue
        total, avail = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        after = 1.0 - (avail + have - per_dir) / total if total else 1.0
        if cfg.preallocate and after > cfg.max_fill:
            log.warning("hicache-gds: capacity %s takes %s to %.0f%% full (above max_fill %.0f%%)", gib(capacity),
                        os.path.dirname(d), 100 * after, 100 * cfg.max_fill)
