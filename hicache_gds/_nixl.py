"""Import NIXL once, the same way everywhere, and name its errors.

`nixl_cu13` is preferred; the `nixl` meta-package is the fallback (it imports one of nixl_cu12 /
nixl_cu13, which cannot both live in one process).
"""

from __future__ import annotations

import os
import threading
import uuid
from types import ModuleType
from typing import Any

from .errors import EngineUnavailable

__all__ = ["nixl_api", "new_agent", "nixl_version", "loadable_plugins"]

# UCX's InfiniBand module makes every process that created a UCX backend crash at exit (rc 139,
# in a bundled libnl during _dl_fini). Excluding it costs nothing on machines without IB ports.
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")

_api: ModuleType | None = None
_lock = threading.Lock()


def nixl_api() -> ModuleType:
    """The `_api` module of the installed NIXL; `EngineUnavailable` when none imports."""
    global _api
    with _lock:
        if _api is None:
            errors = []
            for name in ("nixl_cu13._api", "nixl._api"):
                try:
                    _api = __import__(name, fromlist=["nixl_agent"])
                    break
                except ImportError as exc:
                    errors.append(f"{name}: {exc}")
            else:
                raise EngineUnavailable("NIXL is not installed (pip install nixl-cu13): " + "; ".join(errors))
        return _api


def nixl_version() -> str:
    from importlib import metadata
    for dist in ("nixl-cu13", "nixl-cu12", "nixl"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def new_agent(role: str, backends: list[str] | None = None, **config: Any) -> Any:
    """A NIXL agent with a unique name, safe to share between threads (NIXL_THREAD_SYNC_RW)."""
    api = nixl_api()
    cfg = api.nixl_agent_config(backends=backends or [], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
                                **config)
    return api.nixl_agent(f"hicache-gds-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}", cfg)


def loadable_plugins() -> dict[str, list[str]]:
    """Plugins NIXL finds, with the memory kinds each supports ([] when it cannot load here)."""
    agent = new_agent("probe", enable_prog_thread=False)
    out = {}
    for plugin in agent.get_plugin_list():
        if plugin in ("GDS", "GDS_MT"):
            continue  # probing them can hang where libcufile loads without a GPU; see gds probe
        try:
            out[plugin] = list(agent.get_plugin_mem_types(plugin))
        except Exception:  # noqa: BLE001 -- NIXL raises plain Exception subclasses
            out[plugin] = []
    return out
