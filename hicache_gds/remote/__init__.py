"""The remote memory tier: page servers' DRAM pools, a Redis directory, NIXL UCX one-sided IO.

- `server.main` is `hicache-gds serve` (a page server);
- `RemoteTier` is the client, with `PageStore`'s batch API;
- `TieredStore` composes a local `PageStore` and a `RemoteTier` behind the same API.

Redis schema and scripts: `scripts.py`. The names below are imported when first asked for, so
importing one module of this package (the engine registry imports `ucx` to read its traits)
does not import the rest.
"""

from importlib import import_module
from typing import Any

_WHERE = {"Directory": "directory", "DirectoryUnavailable": "directory", "ServerInfo": "directory",
          "RemoteTier": "tier", "RemoteOptions": "options", "REMOTE_KEYS": "options", "TieredStore": "tiered",
          "NixlUcxEngine": "ucx", "PeerDisconnected": "ucx"}

__all__ = ["Directory", "DirectoryUnavailable", "ServerInfo", "RemoteTier", "RemoteOptions", "REMOTE_KEYS",
           "TieredStore", "NixlUcxEngine", "PeerDisconnected"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
