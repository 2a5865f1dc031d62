"""Engine registry: a read-only mapping of names to lazy dotted paths, plus an entry-point group.

Third-party engines register through the `hicache_gds.engines` entry-point group
(`name = "package.module:Class"`) or `register_engine(...)`. Re-registering a name is an error
unless `clobber=True`. An engine class declares its `Traits` (memory kinds, cuFile, GPU, remote,
its rank in `auto`); `auto` and `doctor` read those, so a registered engine is chosen and
diagnosed without a change here or there.
"""

from __future__ import annotations

import importlib
import threading
import types
from importlib import metadata

from ..errors import EngineUnavailable
from .base import Capabilities, EngineOptions, MemKind, Op, Traits, Transfer, TransferEngine, split_batches

__all__ = [
    "registry", "register_engine", "engine_class", "create_engine", "engine_names", "ENTRY_POINT_GROUP",
    "Capabilities", "EngineOptions", "MemKind", "Op", "Traits", "Transfer", "TransferEngine", "split_batches",
]

ENTRY_POINT_GROUP = "hicache_gds.engines"

_NIXL_HINT = "pip install 'hicache-gds[cu13]' or 'hicache-gds[cu12]' (NIXL for CUDA 13 or 12)"
# name -> (dotted path, install hint). Kept sorted.
_known: dict[str, tuple[str, str]] = {
    "bounce": ("hicache_gds.engines.bounce:BounceEngine", ""),
    "cufile": ("hicache_gds.engines.cufile_engine:CuFileEngine", "pip install 'hicache-gds[cufile]'"),
    "kvikio": ("hicache_gds.engines.kvikio_engine:KvikioEngine", "pip install 'hicache-gds[kvikio]'"),
    "nixl-gds": ("hicache_gds.engines.nixl_file:NixlGdsEngine", _NIXL_HINT),
    "nixl-gds-mt": ("hicache_gds.engines.nixl_file:NixlGdsMtEngine", _NIXL_HINT),
    "nixl-posix": ("hicache_gds.engines.nixl_file:NixlPosixEngine", _NIXL_HINT),
    "nixl-ucx": ("hicache_gds.remote.ucx:NixlUcxEngine", _NIXL_HINT),  # the remote tier's: never a store's
}
assert list(_known) == sorted(_known)
registry = types.MappingProxyType(_known)
_loaded_eps = False
_lock = threading.Lock()


def _load_entry_points() -> None:
    global _loaded_eps
    with _lock:
        if _loaded_eps:
            return
        _loaded_eps = True
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name not in _known:
                _known[ep.name] = (ep.value, f"reinstall the package that provides {ep.value}")


def register_engine(name: str, target: str, hint: str = "", clobber: bool = False) -> None:
    """Register `name` -> "module:Class". Raises ValueError if taken, unless `clobber`."""
    with _lock:
        if name in _known and _known[name][0] != target and not clobber:
            raise ValueError(f"engine name {name!r} is already registered to {_known[name][0]}")
        _known[name] = (target, hint)


def engine_names() -> list[str]:
    _load_entry_points()
    return sorted(_known)


def engine_class(name: str) -> type[TransferEngine]:
    """The engine class for `name`; `EngineUnavailable` with an install hint if it cannot import."""
    _load_entry_points()
    if name not in _known:
        raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(sorted(_known))}")
    target, hint = _known[name]
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise EngineUnavailable(f"engine {name!r} cannot be imported ({exc})" + (f"; {hint}" if hint else "")) from exc
    if not (isinstance(cls, type) and issubclass(cls, TransferEngine)):
        raise TypeError(f"{target} is not a TransferEngine subclass")
    return cls


def create_engine(name: str, options: EngineOptions) -> TransferEngine:
    """The one construction path: `engine_class(name)(options)`."""
    return engine_class(name)(options)
