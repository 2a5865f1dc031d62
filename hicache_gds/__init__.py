"""hicache-gds: a KV-cache page store on NVMe and remote memory, built on NIXL.

This namespace is the public API, and the only part of the core adapters import (besides
`hicache_gds.testing`): `open_store` opens a `Store` (`PageStore` read-write, `PageReader`
read-only, `TieredStore` with a remote tier, `JoinedStore` for lookups and leases); `Pages`
describes where pages live in memory. Any number of processes open one namespace and share it.
The rest are the helpers adapters share: memory (`HostBuffer`, `view`, `align_up`), sizes and
switches (`parse_size`, `parse_bool`, `default_budget`), the load-or-compute model (`CostModel`,
`PrefillModel`, `ReadRate`, `LoadPace` and their persisted state) and namespace directories
(`prepare_root`, `private_dir`).
"""

from .slabs.capacity import default_budget
from .config import Config, parse_bool, parse_size
from .costmodel import STATE_FILE as COST_STATE_FILE
from .costmodel import CostModel, Decision, LoadPace, PrefillModel, ReadRate, load_state, save_state
from .rates import SEED_ALIASES, SEED_KEYS, seed_read_rate, seed_settings
from .engines.base import MemKind, Op
from .errors import (ConfigError, EngineUnavailable, GDSUnavailable, HiCacheGDSError, ReadOnlyError, RegionError,
                     StoreClosedError, StoreFullError, StoreLockedError, TransferError, TransferTimeout)
from .factory import open_store
from .index import read_keys
from .layout import Pages, namespace_id, namespace_location, page_bytes_for
from .memory import HostBuffer, align_up, view
from .probe import Probe, probe_read_rate
from .slabs.slabset import prepare_root, private_dir
from .stats import METRICS, Counters, metric_values
from .store import JoinedStore, Lease, PageReader, PageStore, Store
from .store.namespace import namespace_created

__version__ = "0.1.0"

__all__ = [
    "Store", "Lease", "open_store", "PageStore", "PageReader", "TieredStore", "JoinedStore",
    "Config", "MemKind", "Op", "Pages", "namespace_created", "namespace_id", "namespace_location",
    "page_bytes_for", "read_keys",
    "HostBuffer", "align_up", "view", "parse_size", "parse_bool", "default_budget", "prepare_root", "private_dir",
    "METRICS", "Counters", "metric_values", "CostModel", "Decision", "LoadPace", "PrefillModel", "ReadRate", "COST_STATE_FILE", "load_state", "save_state", "seed_read_rate",
    "SEED_KEYS", "SEED_ALIASES", "seed_settings",
    "Probe", "probe_read_rate",
    "HiCacheGDSError", "ConfigError", "EngineUnavailable", "GDSUnavailable", "ReadOnlyError", "RegionError",
    "StoreClosedError", "StoreFullError", "StoreLockedError", "TransferError", "TransferTimeout", "__version__",
]


def __getattr__(name: str) -> object:
    # The tiered store imports the remote tier's client (Redis, UCX): only when asked for.
    if name == "TieredStore":
        from .remote.tiered import TieredStore
        return TieredStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
