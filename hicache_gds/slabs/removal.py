"""Removing a namespace: what `hicache-gds clear` does, and what eviction does to make room.

`remove(roots, name)` deletes a namespace's files in every `GDS_PATH` directory, refusing an open
one (or one a store is opening) unless forced. Every step goes through directory file descriptors
opened without following links, only regular files of the namespace and its ``procs/`` entries are
unlinked, and a namespace holding anything else is left alone, so nothing outside `GDS_PATH` is
ever removed or followed. It holds the namespace's setup lock while it removes
(`owners.setup_lock_if_free`), so no store opens the namespace meanwhile; a store that waited for
it finds the namespace gone and starts it empty (`owners.setup_lock`).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ..errors import ConfigError
from ..layout import NAMESPACE_RE
from .namespaces import is_real_dir, open_by, real_roots
from .owners import PROCS_DIR, setup_lock_if_free
from .slabset import META_FILE

__all__ = ["RemoveReport", "remove"]


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
        done = len(entries) + len(procs or ()), sum(b for _, b in entries)
        try:
            os.rmdir(name, dir_fd=rootfd)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            return *done, (f"{os.path.join(root, name)}: its files were removed, but a process created new ones "
                           f"meanwhile; left in place")
        return *done, ""
    finally:
        os.close(rootfd)


def remove(roots: Sequence[str], name: str, *, force: bool = False) -> RemoveReport:
    """Delete namespace `name` (its directory in every `GDS_PATH` entry). An open namespace, or one
    a store is opening, is refused unless `force`: its writer keeps writing into deleted files,
    whose space returns only when it exits."""
    if not NAMESPACE_RE.fullmatch(name):
        raise ConfigError(f"{name!r} is not a namespace name")
    rs = real_roots(roots)
    rep = RemoveReport(name)
    dirs = [os.path.join(r, name) for r in rs if is_real_dir(r, name)]
    if not dirs:  # none, or only links and files under its name: each refused by name below
        return _remove_dirs(rs, name, rep)
    # The setup lock lives in the namespace's first directory: the one holding namespace.json.
    first = next((d for d in dirs if os.path.lexists(os.path.join(d, META_FILE))), dirs[0])
    with setup_lock_if_free(first) as held:
        for d in dirs:
            rep.open_by = sorted(set(rep.open_by) | set(open_by(d)))
        if not held and not force:
            rep.reason = "a store is opening it now; try again once it is open (and closed)"
            return rep
        if rep.open_by and not force:
            rep.reason = (f"open by pid {', '.join(map(str, rep.open_by))}; stop it first, or use --force (the "
                          f"writer then writes into deleted files until it exits)")
            return rep
        return _remove_dirs(rs, name, rep)


def _remove_dirs(rs: list[str], name: str, rep: RemoveReport) -> RemoveReport:
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
