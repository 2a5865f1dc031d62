"""Bookkeeping shared by the reliability scenarios: case records, log capture, directory snapshots."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

__all__ = ["Case", "capture_logs", "snapshot_tree", "tree_changes", "guarded"]


@dataclass
class Case:
    """One injected fault or damage and what the store made of it."""

    area: str
    name: str
    target: str = "store"
    injected: int = 0
    """Pages (or calls) the fault touched."""
    caught: int = 0
    """... of which the store answered as a miss / False / a clear error, as it must."""
    served_ok: int = 0
    """Untouched pages still served byte-exact."""
    served_total: int = 0
    wrong_bytes: int = 0
    exceptions: int = 0
    """Exceptions that escaped a data-path call (or, for SGLang, any call)."""
    stale_present: int = 0
    """Damaged pages still reported present (exists) before anything read them."""
    outcome: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def check(self, cond: bool, problem: str) -> bool:
        if not cond:
            self.problems.append(problem)
        return cond

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self, level: int = logging.DEBUG) -> str:
        return "\n".join(self.format(r) for r in self.records if r.levelno >= level)


@contextlib.contextmanager
def capture_logs(level: int = logging.DEBUG) -> Iterator[_ListHandler]:
    """Capture every log record at `level` and above from every logger (root handler)."""
    root = logging.getLogger()
    h = _ListHandler()
    h.setLevel(level)
    old = root.level
    root.addHandler(h)
    root.setLevel(min(level, old) if old else level)
    try:
        yield h
    finally:
        root.removeHandler(h)
        root.setLevel(old)


def snapshot_tree(root: str) -> dict[str, tuple]:
    """path -> (kind, mode, size, mtime_ns, content hash for files up to 1 MiB); symlinks not followed."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            kind = "l" if stat.S_ISLNK(st.st_mode) else "d" if stat.S_ISDIR(st.st_mode) else "f"
            digest = ""
            if kind == "f" and st.st_size <= 1 << 20:
                try:
                    with open(p, "rb") as f:
                        digest = hashlib.blake2b(f.read(), digest_size=8).hexdigest()
                except OSError:
                    digest = "?"
            elif kind == "l":
                digest = os.readlink(p)
            out[p] = (kind, stat.S_IMODE(st.st_mode), st.st_size if kind != "d" else 0,
                      st.st_mtime_ns if kind == "f" else 0, digest)
    return out


def tree_changes(before: dict[str, tuple], after: dict[str, tuple], allowed: list[str]) -> list[str]:
    """Paths created, removed or changed outside the `allowed` directories."""
    allowed = [os.path.join(os.path.realpath(a), "") for a in allowed] + [os.path.join(a, "") for a in allowed]
    changed = []
    for p in set(before) | set(after):
        if before.get(p) != after.get(p) and not any(p.startswith(a) for a in allowed):
            changed.append(p)
    return sorted(changed)


@contextlib.contextmanager
def guarded(case: Case, what: str) -> Iterator[None]:
    """Count an exception escaping a call as a problem of `case` (and swallow it)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001
        case.exceptions += 1
        case.problems.append(f"{what} raised {type(exc).__name__}: {exc}")
