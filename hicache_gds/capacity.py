"""How large a namespace is, and why: the rule `PageStore`, the adapters and `doctor` share.

A namespace's slots are chosen, first rule that applies:

1. **configured**: ``capacity`` (``HICACHE_GDS_CAPACITY``), exactly;
2. **kept**: its slab files from an earlier open, whatever they hold (a restart never resizes);
3. **default**, per `GDS_PATH` directory: ``capacity_fraction`` (0.5) of the space hicache-gds may
   use there -- the space available plus what hicache-gds namespaces already hold in that
   directory -- so a namespace opened after others asks for the same size the first one got,
   not a share of what they left; and never so much that the file system ends up fuller than
   ``max_fill`` (0.9), with fullness counted as SGLang's HiCacheNixl cleaner counts it:
   ``1 - available / total`` (the slab files stay within it; the index adds about 200 bytes a
   page on top). Where the fill ceiling leaves no room the open fails with
   `StoreFullError` saying so, rather than taking the last free space of a shared disk.

Striped directories get equal shares (the smallest directory's), so slot ``s`` always has a place.
Callers that split the default between processes (SGLang's writer ranks, vLLM's workers) divide
`default_budget(...).total` among them; each process then asks for its share of the same budget,
whichever opens first.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from dataclasses import dataclass
from typing import Sequence

from .errors import StoreFullError
from .slabs import SlabSet

__all__ = ["DirSpace", "Budget", "Sizing", "dir_space", "default_budget", "size_namespace", "held_by_namespaces",
           "NAMESPACE_RE", "SLAB_FILE", "gib"]

log = logging.getLogger("hicache_gds.capacity")
NAMESPACE_RE = re.compile(r"ns-[0-9a-f]{20}")
"""Directory names of namespaces (`layout.namespace_id`)."""
SLAB_FILE = SlabSet.FILE_NAME


def gib(n: float) -> str:
    """A byte count for people: 1.5 GiB, 24.0 MiB, 512 KiB."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n / 1024:.0f} KiB"


def held_by_namespaces(root: str, exclude: str = "") -> tuple[int, int]:
    """(bytes allocated, namespace count) of the hicache-gds namespaces directly under `root` (slab
    files, index, ...), except namespace `exclude`. Links, and directories not shaped like a
    namespace, are not counted."""
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
            try:
                st = os.lstat(os.path.join(d, f))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512  # allocated: a sparse (not preallocated) slab holds little
    return total, count


@dataclass(frozen=True)
class DirSpace:
    """One `GDS_PATH` directory's file system, as the default rule sees it."""

    root: str
    total: int
    available: int
    held: int
    """Bytes hicache-gds namespaces (other than the one being sized) hold in this directory."""
    namespaces: int

    @property
    def fill(self) -> float:
        """Fraction used, as SGLang's HiCacheNixl cleaner counts it (reserved blocks count as used)."""
        return 1.0 - self.available / self.total if self.total else 1.0

    def share(self, fraction: float, max_fill: float, own: int = 0) -> int:
        """Bytes a namespace gets here by default; `own`: what its own files already take here."""
        want = fraction * (self.available + self.held + own)
        room = self.available + own - (1.0 - max_fill) * self.total  # stay at or below max_fill
        return max(0, int(min(want, room, self.available + own)))


def dir_space(root: str, exclude: str = "") -> DirSpace:
    st = os.statvfs(root)
    held, n = held_by_namespaces(root, exclude)
    return DirSpace(root, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, held, n)


@dataclass(frozen=True)
class Budget:
    """The default size of a namespace over `GDS_PATH`, before it is cut into slots."""

    per_dir: int
    dirs: tuple[DirSpace, ...]
    how: str

    @property
    def total(self) -> int:
        return self.per_dir * len(self.dirs)

    def no_room(self, max_fill: float) -> StoreFullError:
        """The error for a budget too small for the namespace: which directory, how full, what to do."""
        tight = min(self.dirs, key=lambda s: s.available - (1.0 - max_fill) * s.total)
        return StoreFullError(
            errno.ENOSPC, f"no room for a namespace by default in {tight.root}: the file system is {tight.fill:.0%} "
                          f"full ({gib(tight.available)} available) and default sizing stops at max_fill={max_fill:g}"
                          + (f"; {tight.namespaces} hicache-gds namespace(s) hold {gib(tight.held)} there "
                             f"(`hicache-gds ls`, `hicache-gds clear`)" if tight.namespaces else "")
                          + "; set HICACHE_GDS_CAPACITY, free space, or raise HICACHE_GDS_MAX_FILL")


def default_budget(roots: Sequence[str], fraction: float, max_fill: float, *, exclude: str = "",
                   own: Sequence[int] = ()) -> Budget:
    """The default rule (3 in the module docstring) over the `GDS_PATH` directories `roots`.

    `exclude`: the namespace being sized (its own files are not "held by others"); `own`: bytes
    its files already take in each directory."""
    spaces = tuple(dir_space(r, exclude) for r in roots)
    owns = list(own) + [0] * (len(spaces) - len(own))
    shares = [s.share(fraction, max_fill, o) for s, o in zip(spaces, owns)]
    per_dir = min(shares) if shares else 0
    tight = min(range(len(spaces)), key=lambda i: shares[i])
    s = spaces[tight]
    base = (f"{gib(s.available)} available" + (f" + {gib(s.held)} held by {s.namespaces} other namespace(s)"
                                              if s.namespaces else ""))
    capped = per_dir < int(fraction * (s.available + s.held + owns[tight]))
    how = (f"default: {fraction:g} of {base} in {s.root}"
           + (f", capped so the file system stays at most {max_fill:.0%} full (now {s.fill:.0%})" if capped else "")
           + (f"; the same in each of {len(spaces)} directories" if len(spaces) > 1 else ""))
    return Budget(per_dir, spaces, how)


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

    Raises `StoreFullError` when the default rule leaves no room for one slot per directory (a
    configured capacity too small for one slot is the caller's `ConfigError`)."""
    nd = len(dirs)
    sizes = []
    for d in dirs:
        try:
            sizes.append(os.lstat(os.path.join(d, SLAB_FILE)).st_size)
        except FileNotFoundError:
            sizes.append(0)
    src = cfg.sources.get("capacity", "default")
    if cfg.capacity:
        nslots = cfg.capacity // slot_bytes
        how = f"configured (capacity={cfg.capacity} from {_SOURCES.get(src, src)})"
        _warn_if_over(cfg, dirs, nslots * slot_bytes, sizes)
        return Sizing(nslots, slot_bytes, how)
    if sizes[0]:
        nslots = sum(s // slot_bytes for s in sizes)
        return Sizing(nslots, slot_bytes, "kept from the namespace's first open (its slab files' size)")
    roots = [os.path.dirname(d) for d in dirs]
    own = []
    for d in dirs:
        try:
            own.append(os.lstat(os.path.join(d, SLAB_FILE)).st_blocks * 512)
        except FileNotFoundError:
            own.append(0)
    b = default_budget(roots, cfg.capacity_fraction, cfg.max_fill, exclude=os.path.basename(dirs[0]), own=own)
    nslots = b.per_dir // slot_bytes * nd
    if nslots < nd:
        raise b.no_room(cfg.max_fill)
    return Sizing(nslots, slot_bytes, b.how)


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
