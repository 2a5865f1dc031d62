"""Namespaces on disk as their files describe them, for sizing, eviction and operators.

Works on the files alone, next to a live writer: nothing here opens a `PageStore`, loads an
engine or reads an index. What each namespace is comes from its ``namespace.json`` (identity, slot
size, directories), who has it open from `open_by`, and since when it is idle from its recorded
use (`owners.read_use`) and its index file's last write.

* `scan(roots)`: every namespace under the `GDS_PATH` directories `roots`, for sizing and
  eviction; page counts come from a caller that reads the indexes (`count_pages`: the index is
  above this package; `hicache_gds.tools.namespaces.find` passes its reader).

Finding namespaces with their page counts and verifying their pages is
`hicache_gds.tools.namespaces`; removing a namespace is `removal.remove`.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from ..errors import ConfigError
from ..layout import NAMESPACE_RE
from .ondisk import INDEX_FILE
from .owners import LOCK_FILE, procs_state, read_use
from .slabset import META_FILE, SlabSet
from ..stats import metric_values

__all__ = ["LOCK_FILE", "META_FILE", "SLAB_FILE", "Namespace", "open_by", "scan", "real_roots", "is_real_dir"]

SLAB_FILE = SlabSet.FILE_NAME


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
    """One namespace as its files describe it (`scan`)."""

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


def _describe(name: str, roots: list[str], count_pages: Callable[[str], int] | None) -> Namespace:
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
    if ns.dirs and count_pages is not None:
        try:
            ns.pages = count_pages(ns.dirs[0])
        except ConfigError as exc:
            ns.problems.append(str(exc))
        ns.bytes = ns.pages * ns.page_bytes
    return ns


def scan(roots: Sequence[str], exclude: str = "", *,
         count_pages: Callable[[str], int] | None = None) -> list[Namespace]:
    """Every namespace under the `GDS_PATH` directories `roots` but `exclude` (oldest use first),
    at the cost of a few system calls per namespace. Page counts (`pages`, `bytes`) stay 0 unless
    `count_pages` reads them from a namespace's first directory (where its index is); a
    `ConfigError` it raises becomes one of that namespace's `problems`."""
    rs = real_roots(roots)
    names: set[str] = set()
    for r in rs:
        try:
            names.update(n for n in os.listdir(r) if NAMESPACE_RE.fullmatch(n) and n != exclude and is_real_dir(r, n))
        except OSError as exc:
            raise ConfigError(f"GDS_PATH: {r} cannot be listed: {exc.strerror}") from exc
    out = [_describe(n, rs, count_pages) for n in sorted(names)]
    return sorted(out, key=lambda n: (n.last_use or 0.0, n.name))
