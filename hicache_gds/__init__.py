"""hicache-gds: a KV-cache page store on NVMe and remote memory, built on NIXL.

The API adapters use is `PageStore`; `Pages` describes where pages live in memory. Any number of
processes open one namespace through `PageStore`s and share it; `PageReader` reads one without
writing anything.
"""

from .config import Config
from .engines.base import MemKind, Op
from .errors import (ConfigError, EngineUnavailable, GDSUnavailable, HiCacheGDSError, ReadOnlyError, RegionError,
                     StoreClosedError, StoreFullError, StoreLockedError, TransferError, TransferTimeout)
from .index import read_keys
from .layout import Pages, namespace_id, namespace_location, page_bytes_for
from .store import JoinedStore, Lease, PageReader, PageStore, Store, open_store

__version__ = "0.1.0"

__all__ = [
    "Config", "MemKind", "Op", "Pages", "PageStore", "PageReader", "namespace_id", "namespace_location",
    "page_bytes_for", "read_keys",
    "HiCacheGDSError", "ConfigError", "EngineUnavailable", "GDSUnavailable", "ReadOnlyError", "RegionError",
    "StoreClosedError", "StoreFullError", "StoreLockedError", "TransferError", "TransferTimeout", "__version__",
]
