"""hicache-gds: a KV-cache page store on NVMe and remote memory, built on NIXL.

The API adapters use is `PageStore`; `Pages` describes where pages live in memory.
"""

from .config import Config
from .engines.base import MemKind, Op
from .errors import (ConfigError, EngineUnavailable, GDSUnavailable, HiCacheGDSError, RegionError,
                     StoreFullError, StoreLockedError, TransferError, TransferTimeout)
from .index import read_keys
from .layout import Pages, namespace_id, page_bytes_for
from .store import PageStore

__version__ = "0.1.0"

__all__ = [
    "Config", "MemKind", "Op", "Pages", "PageStore", "namespace_id", "page_bytes_for", "read_keys",
    "HiCacheGDSError", "ConfigError", "EngineUnavailable", "GDSUnavailable", "RegionError",
    "StoreFullError", "StoreLockedError", "TransferError", "TransferTimeout", "__version__",
]
