"""What the spec, the manager and the worker share, below all three.

* `HiCacheLoadSpec` / `HiCacheStoreSpec`: the jobs vLLM pickles from the scheduler (manager) to
  the workers every step;
* `store_key`: the store key of a vLLM offload key;
* `SpecView`: the part of `HiCacheGDSOffloadingSpec` the manager and the worker read.

`spec.py` builds the manager and the worker; they depend on this module, never on `spec.py`.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from vllm.v1.kv_offload.base import LoadStoreSpec, OffloadKey
from vllm.v1.kv_offload.config import OffloadingConfig

from hicache_gds import Config

from .sidecar import SideDir

__all__ = ["HiCacheLoadSpec", "HiCacheStoreSpec", "SpecView", "store_key"]


def store_key(key: OffloadKey) -> str:
    """The store key of a vLLM offload key (block hash + group index, as hex)."""
    return bytes(key).hex()


class HiCacheLoadSpec(LoadStoreSpec):
    """What a worker reads: the keys, in vLLM's group-then-chunk order. Pickled every step."""

    __slots__ = ("keys",)

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def __repr__(self) -> str:
        return f"HiCacheLoadSpec({len(self.keys)} keys)"


class HiCacheStoreSpec(LoadStoreSpec):
    """What a worker writes (`keys`), and what it must delete first (`drops`, or everything when
    `clear`: the manager's `reset_cache` rides on the next store job). This manager sends no
    drops: the shared stores evict by their own LRU."""

    __slots__ = ("keys", "drops", "clear")

    def __init__(self, keys: list[str], drops: list[str] | None = None, clear: bool = False) -> None:
        self.keys = keys
        self.drops = drops or []
        self.clear = clear

    def __repr__(self) -> str:
        return f"HiCacheStoreSpec({len(self.keys)} keys, {len(self.drops)} drops, clear={self.clear})"


class SpecView(Protocol):
    """What the manager and the worker read from the spec (`HiCacheGDSOffloadingSpec` has it all)."""

    config: OffloadingConfig
    """vLLM's offloading config: parallelism, KV-cache groups, engine id."""
    hicache: Config
    """hicache-gds settings from `kv_connector_extra_config` over the environment."""
    identity: Mapping[str, Any]
    """The engine identity every rank's namespaces are named from (rank and group added per store)."""
    sidecar: SideDir
    """The directory the scheduler and the workers share."""
    capacity_chunks: int
    """Chunks per (rank, group) namespace, the same number on both sides."""
    group_pos: Mapping[int, int]
    """Position of each vLLM group id in `config.groups`."""
    blocks_per_chunk: int
    """vLLM blocks per offloaded chunk (set by vLLM's `OffloadingSpec`)."""
    recover_failed_loads: bool
    """The connector recomputes the blocks of a failed load (`HiCacheGDSConnector`): the worker
    reports their block ids instead of failing the job."""
