"""The remote memory tier: page servers' DRAM pools, a Redis directory, NIXL UCX one-sided IO.

- `server.main` is `hicache-gds serve` (a page server);
- `RemoteTier` is the client, with `PageStore`'s batch API;
- `TieredStore` composes a local `PageStore` and a `RemoteTier` behind the same API.

Redis schema and scripts: `scripts.py`.
"""

from .directory import Directory, DirectoryUnavailable, ServerInfo
from .options import REMOTE_KEYS, RemoteOptions
from .tier import RemoteTier
from .tiered import TieredStore
from .ucx import NixlUcxEngine, PeerDisconnected

__all__ = ["Directory", "DirectoryUnavailable", "ServerInfo", "RemoteTier", "RemoteOptions", "REMOTE_KEYS",
           "TieredStore", "NixlUcxEngine", "PeerDisconnected"]
