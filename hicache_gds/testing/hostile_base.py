"""Shared pieces of the hostile-input cases (`hostile`, `privacy`): the clear-error check, the
after-check that the store still works, and a GDS_PATH inside a parent whose other files must
not change."""

from __future__ import annotations

import os
from typing import Any, Callable

from .cases import Case, snapshot_tree, tree_changes
from .clients import Client
from .targets import key

__all__: list[str] = []

_CLEAR = (TypeError, ValueError, OSError)  # ConfigError, RegionError subclass ValueError; store errors OSError
SURROGATE = "\udcff"


def _expect_error(case: Case, what: str, fn: Callable[[], Any], errors: tuple = _CLEAR) -> None:
    case.injected += 1
    try:
        out = fn()
    except errors as exc:
        if not str(exc):
            case.problems.append(f"{what}: {type(exc).__name__} without a message")
        else:
            case.caught += 1
        return
    except Exception as exc:  # noqa: BLE001
        case.exceptions += 1
        case.problems.append(f"{what}: {type(exc).__name__} is not a clear error: {exc}")
        return
    case.problems.append(f"{what}: accepted (returned {str(out)[:80]})")


def _still_works(case: Case, c: Client, tag: str) -> None:
    ks = [f"{tag}-ok-{i}" for i in range(4)] if c.backend is None else _sgl_keys(f"{tag}-ok", 4)
    try:
        ok = c.put(ks)
        v = c.verify(ks)
        case.check(all(ok) and v["good"] == 4, f"after {tag}: the store no longer works ({sum(ok)}/4 puts, "
                                               f"{v['good']}/4 reads)")
    except Exception as exc:  # noqa: BLE001
        case.problems.append(f"after {tag}: the store raises {type(exc).__name__}: {exc}")


def _sgl_keys(tag: str, n: int) -> list[str]:
    return [key("sglang", f"{tag}-{i}") for i in range(n)]


class _Parent:
    """GDS_PATH inside a parent that also holds 'outside' files symlinks point at."""

    def __init__(self, root: str, name: str) -> None:
        self.parent = os.path.join(root, name)
        self.gds = os.path.join(self.parent, "gds")
        self.outside = os.path.join(self.parent, "outside")
        os.makedirs(self.gds, exist_ok=True)
        os.makedirs(self.outside, exist_ok=True)
        open(os.path.join(self.parent, "a-file"), "w").close()  # for "GDS_PATH is a file"
        for n in ("victim-slab", "victim-db", "victim-wal", "victim-lock", "victim-json"):
            with open(os.path.join(self.outside, n), "wb") as f:
                f.write(b"precious bytes that must not change\n")
            os.chmod(os.path.join(self.outside, n), 0o644)
        self.before = snapshot_tree(self.parent)

    def outside_changes(self) -> list[str]:
        return tree_changes(self.before, snapshot_tree(self.parent), [self.gds])

    def check_outside(self, cases: list[Case]) -> list[Case]:
        """Fail every case if anything outside GDS_PATH changed; returns `cases`."""
        changed = self.outside_changes()
        for case in cases:
            case.check(not changed, f"changed outside GDS_PATH: {changed[:3]}")
        return cases

