"""Where the reliability runs send pages: the store itself, or an engine adapter that registered a harness.

The runs (torture, corruption, faults, hostile, stress) drive pages through a *target*:
``store`` (built in: `PageStore` from a host buffer) or an adapter's backend, such as ``sglang``
(SGLang's HiCache backend on mimic host pools). The core never imports an adapter: an adapter
ships a harness module and names it in the ``hicache_gds.testing.targets`` entry-point group,

    [project.entry-points."hicache_gds.testing.targets"]
    sglang = "hicache_gds_sglang.testing"

and the runs load it from there by name. A harness module provides

* ``why_unavailable() -> str``: '' where it can run, else the reason (the engine missing, ...);
* ``key(tag) -> str``: a key of the adapter's own shape, derived from `tag`;
* ``open_client(gds_path, *, slots, pages, shape, identity, extra, options) -> AdapterClient``,
  with ``page``, ``store``, ``backend``, ``put(keys, blobs, at)``, ``read(keys, at)``,
  ``exists``, ``prefix``, ``clear``, ``close`` (see `clients.Client`);
* optionally ``fault_cases(root, seconds) -> list[Case]``: faults only the adapter can inject.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from types import ModuleType

from ..errors import HiCacheGDSError

__all__ = ["STORE", "ENTRY_POINT_GROUP", "TargetUnavailable", "names", "harness", "why_unavailable", "key"]

STORE = "store"
ENTRY_POINT_GROUP = "hicache_gds.testing.targets"
_loaded: dict[str, ModuleType] = {}


class TargetUnavailable(HiCacheGDSError, ImportError):
    """A target no installed adapter provides, or whose harness cannot import; the message says why."""


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
    """``store`` and every target an installed adapter registered."""
    return [STORE] + sorted(_entry_points())


def harness(name: str) -> ModuleType:
    """The harness module of adapter target `name`; `TargetUnavailable` naming the fix if none."""
    if name in _loaded:
        return _loaded[name]
    ep = _entry_points().get(name)
    if ep is None:
        raise TargetUnavailable(f"no installed adapter registers the test target {name!r} (entry-point group "
                                f"{ENTRY_POINT_GROUP}); install the adapter, e.g. pip install -e plugins/{name}")
    try:
        mod = importlib.import_module(ep.value.split(":")[0])
    except Exception as exc:  # noqa: BLE001 -- any import failure: the target cannot run here
        raise TargetUnavailable(f"test target {name!r}: {ep.value} cannot be imported "
                                f"({type(exc).__name__}: {exc})") from exc
    _loaded[name] = mod
    return mod


def why_unavailable(name: str) -> str:
    """'' when target `name` can run in this environment, else the reason."""
    if name == STORE:
        return ""
    try:
        return harness(name).why_unavailable()
    except TargetUnavailable as exc:
        return str(exc)


def key(target: str, tag: str) -> str:
    """A page key for `target` derived from `tag` (the tag itself for the store)."""
    return tag if target == STORE else harness(target).key(tag)
