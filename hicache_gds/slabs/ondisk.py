"""The on-disk format of a namespace, defined once: where a slot lives, which directory is which, and
how a page is checksummed. The store (`PageStore`, `PageReader`) and `hicache-gds verify` both use
this module, so they can never disagree.

Format 3 (`FORMAT`), recorded with the namespace (its index's ``format`` setting, and
``namespace.json``):

* **Slot placement** (`place`): slot s lives in the namespace's directory s % n, at offset
  (s // n) * slot_bytes of its ``slab.bin``, n being the number of directories.
* **Directory order** (`stripe_order`): which directory is "directory i" is recorded, not taken
  from `GDS_PATH`'s order: each of the namespace's directories holds an empty file
  ``stripe-<id>-<i>-of-<n>`` naming the namespace's stripe (a random id drawn when the namespace
  was created) and the directory's position. An open finds the namespace's directories in any order (and uses the recorded one,
  with an INFO line); a directory that is missing, or holds no part of this namespace (another
  stripe, no marker), is refused with an error naming it -- never read as if it were another.
* **Page checksum** (`hicache_gds.pagesum`): every page carries one, of the kind its writer
  computes fastest, told by the recorded value's lowest bit: xxh3 (even) for pages written from
  host memory, hgc1 (odd, `hicache_gds.checksum`) for pages written from GPU memory. A reader
  checks the kind recorded, on host or device pages alike.

Format 2: as 3, but every page carried hgc1 unmarked (its numpy sums cost host reads most of their
rate on fast devices with few cores). A store opens such a namespace empty (one INFO line);
`verify` still checks its pages.

Format 1 (before): slots placed by `GDS_PATH`'s order (only the count was recorded), xxh3-64
checksums of host pages and 0 (never verified) for pages written from GPU memory. A store opens
such a namespace empty (one INFO line); `verify` still checks its host pages with xxh3.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .. import checksum, pagesum
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..layout import NamespaceLocation

__all__ = ["FORMAT", "FORMAT_KEY", "INDEX_FILE", "index_meta", "place", "stripe_order", "ensure_stripe",
           "page_checksum", "legacy_format"]

log = logging.getLogger("hicache_gds.ondisk")

FORMAT = 3
FORMAT_KEY = "format"
"""The index setting (and namespace.json field) that records a namespace's format."""
INDEX_FILE = "index.sqlite3"
"""The namespace's index database (`hicache_gds.index`), in its first directory."""


def index_meta(loc: NamespaceLocation) -> dict[str, str]:
    """The settings the index of the namespace at `loc` records, so that a namespace reopened
    differently (another slot size, page size, directory count or format) is never misread."""
    return {"slot_bytes": str(loc.slot_bytes), "page_bytes": loc.identity["page_bytes"],
            "ndirs": str(len(loc.dirs)), FORMAT_KEY: str(FORMAT)}


def place(slots: Any, ndirs: int, slot_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(directory index, byte offset in its slab file) arrays for an array of slots."""
    s = np.asarray(slots, dtype=np.uint64)
    nd = np.uint64(ndirs)
    return (s % nd).astype(np.int64), (s // nd) * np.uint64(slot_bytes)


# -- page checksums by format ------------------------------------------------------------------------

def _xxh3(data: Any, nbytes: int, recorded: int = 0) -> int:
    import xxhash
    return checksum.to_sqlite(xxhash.xxh3_64_intdigest(data))


def _hgc1(data: Any, nbytes: int, recorded: int = 0) -> int:
    return checksum.checksum(data, nbytes)


def _tagged(data: Any, nbytes: int, recorded: int = 0) -> int:
    return pagesum.page_sum(data, nbytes, pagesum.kind_of(recorded) if recorded else pagesum.XXH3)


def page_checksum(fmt: int = FORMAT) -> Callable[[Any, int, int], int]:
    """fn(bytes-like page, page length, its recorded checksum) -> the checksum format `fmt` records
    for it (format 3: of the kind the recorded value is of)."""
    if fmt == FORMAT:
        return _tagged
    if fmt == 2:
        return _hgc1
    if fmt == 1:
        return _xxh3
    raise ConfigError(f"namespace format {fmt} is not known to this version (it knows 1 to {FORMAT})")


def legacy_format(stored: dict[str, str]) -> int:
    """The format an index's settings record (1 where none is: written before formats were recorded)."""
    try:
        return int(stored.get(FORMAT_KEY, "1"))
    except ValueError:
        return 0


# -- directory order -----------------------------------------------------------------------------------

_MARKER_RE = re.compile(r"stripe-([0-9a-f]{16})-(\d{1,6})-of-(\d{1,6})")


def _read_marker(d: str) -> dict | None | str:
    """The stripe marker of namespace directory `d`: a dict, None when `d` or its marker is absent,
    or why it cannot be used."""
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return f"{d} exists but is a symbolic link or not a plain directory; remove it or choose another GDS_PATH"
    found = [m for m in map(_MARKER_RE.fullmatch, os.listdir(d)) if m]
    if not found:
        return None
    if len(found) > 1:
        return (f"{d} holds {len(found)} stripe markers ({', '.join(m.group(0) for m in found)}); the "
                f"namespace's directory order cannot be read")
    m = found[0]
    return {"stripe": m.group(1), "position": int(m.group(2)), "count": int(m.group(3))}


def _names(dirs: Sequence[str]) -> str:
    return ", ".join(dirs)


def stripe_order(dirs: Sequence[str], *, partial: str = "raise") -> list[str] | None:
    """The namespace directories `dirs` (given in `GDS_PATH`'s order) in their recorded order.

    None when none of them records one (a namespace not created yet, or of format 1). Raises
    `ConfigError` naming the directory when one is missing or holds no part of the namespace,
    when two hold different stripes, or when the recorded positions do not make one stripe of
    len(dirs) directories. `partial="none"`: where some directories have no marker yet (being
    created right now, or missing), answer None instead of raising (readers, which take no lock)."""
    dirs = list(dirs)
    marks = [_read_marker(d) for d in dirs]
    bad = [(d, m) for d, m in zip(dirs, marks) if isinstance(m, str)]
    if bad:
        raise ConfigError(f"GDS_PATH: {bad[0][1]}")
    have = [(d, m) for d, m in zip(dirs, marks) if isinstance(m, dict)]
    if not have:
        return None
    d0, m0 = have[0]
    for d, m in have[1:]:
        if m["stripe"] != m0["stripe"]:
            raise ConfigError(f"GDS_PATH: {d0} and {d} hold parts of two different namespaces of the same name "
                              f"(stripes {m0['stripe']} and {m['stripe']}): a directory was copied or restored "
                              f"from elsewhere; remove the namespace (`hicache-gds rm`) to start it anew")
    lacking = [d for d, m in zip(dirs, marks) if m is None]
    if lacking:
        # A creator makes every directory before it writes any marker: one that does not exist is
        # missing, whatever `partial` says; one without a marker may be being written right now.
        gone = [d for d in lacking if not os.path.lexists(d)]
        if partial == "none" and not gone:
            return None
        what = "is missing" if gone else "holds no part of it"
        raise ConfigError(f"GDS_PATH: namespace directory {_names(gone or lacking)} {what}: the namespace spans "
                          f"{m0['count']} directories and {d0} is one of them (position {m0['position'] + 1} of "
                          f"{m0['count']}); a drive was replaced, unmounted or its directory removed. Restore it, "
                          f"or remove the namespace (`hicache-gds rm`) to start it anew")
    positions = [m["position"] for _, m in have]
    if sorted(positions) != list(range(len(dirs))) or any(m["count"] != len(dirs) for _, m in have):
        raise ConfigError(f"GDS_PATH: the stripe markers of {_names(dirs)} record positions {positions} of "
                          f"{[m['count'] for _, m in have]} directories, not one namespace of {len(dirs)}")
    out = [""] * len(dirs)
    for d, m in have:
        out[m["position"]] = d
    return out


def _write_marker(d: str, stripe: str, position: int, count: int) -> None:
    # An empty file: its name is the record (nothing to tear, no block taken from a small disk).
    fd = os.open(os.path.join(d, f"stripe-{stripe}-{position}-of-{count}"),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.close(fd)


def ensure_stripe(dirs: Sequence[str], lock: Callable[[str], Any],
                  prefer: Sequence[str] | None = None) -> tuple[list[str], str]:
    """The namespace directories `dirs` (existing, in `GDS_PATH`'s order) in their recorded order,
    and a line for the log ('' when that is `GDS_PATH`'s order). Where no order is recorded yet
    (a new namespace, or one of format 1) it is recorded first: `prefer` where it lists the same
    directories (the order a format-1 namespace's namespace.json names), else `dirs`' order.

    Recording holds `lock(d)` (a context manager: `owners.setup_lock`) of the first directory in
    sorted order, which openers that list the directories in any order agree on, so they never
    record two orders. `ConfigError` as for `stripe_order`."""
    dirs = list(dirs)
    order = stripe_order(dirs, partial="none")
    if order is None:
        with lock(min(dirs)):
            order = stripe_order(dirs)  # under the lock: no creator is half-way; a missing marker is final
            if order is None:
                order = list(prefer) if prefer is not None and sorted(prefer) == sorted(dirs) else dirs
                stripe = secrets.token_hex(8)
                for i, d in enumerate(order):
                    _write_marker(d, stripe, i, len(order))
                _sync_dirs(order)
    note = "" if order == dirs else (f"GDS_PATH lists the namespace's directories as {_names(dirs)}; they were "
                                     f"recorded as {_names(order)}: using the recorded order")
    return order, note


def _sync_dirs(dirs: Sequence[str]) -> None:
    for d in dirs:
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
