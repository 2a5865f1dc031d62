"""`HiCacheGDSOffloadingSpec`: vLLM's OffloadingConnector storing KV chunks in hicache-gds.

Select it with

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "HiCacheGDSOffloadingSpec",
            "spec_module_path": "hicache_gds_vllm", "blocks_per_chunk": 4,
            "gds_path": "/mnt/nvme0/kv,/mnt/nvme1/kv", "capacity": "512G"}}'

Settings: every `kv_connector_extra_config` key that is a hicache-gds `Config` key (`gds_path`,
`enable_gds`, `capacity`, `engine`, ...; `GDS_PATH` / `ENABLE_GDS` / `HICACHE_GDS_*` spellings are
accepted too) overrides the environment; vLLM's own keys are ignored; anything else is an error.

vLLM builds the spec in the scheduler process and in every worker process. Both compute the same
engine identity (model, dtype, KV layout, block geometry, parallelism) and the same chunk
capacity, so the scheduler's bookkeeping and the workers' stores describe one
cache. `get_manager` runs in the scheduler, `get_worker` in each worker; see `manager.py` for how
the two share the store.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig

from hicache_gds import Config, ConfigError, align_up, default_budget, namespace_id

from . import compat, costmodel
from .shared import HiCacheLoadSpec, HiCacheStoreSpec, store_key
from .sidecar import SideDir

__all__ = ["HiCacheGDSOffloadingSpec", "HiCacheLoadSpec", "HiCacheStoreSpec", "VLLM_KEYS", "hicache_config",
           "engine_identity", "store_key"]

# Keys of kv_connector_extra_config that vLLM's offloading code (or another spec) reads.
VLLM_KEYS = (
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "offload_prompt_only",
    "self_describing_kv_events", "canonical_layout", "sync_load_budget_bytes", "cpu_bytes_to_use",
    "eviction_policy", "cache_policy_module_path", "store_threshold", "max_tracker_size", "secondary_tiers",
    "tier_poll_interval_s", "backpressure", "kv_load_tiers",
)
# Keys of this adapter that are not hicache-gds settings: the cost model's (`costmodel.py`), the
# model's dtype as `HiCacheGDSConnector` resolved it where vLLM 0.26 says "auto", and how long a
# rank whose loads fail as a whole is not offered (`manager.py`).
ADAPTER_KEYS = costmodel.KEYS + ("model_dtype", "failed_load_backoff_s")
_ENV_SPELLINGS = {"ENABLE_GDS": "enable_gds", "GDS_PATH": "gds_path"}
ADAPTER_FORMAT = "vllm-offloading/2"  # bump when the page layout below changes


def hicache_config(extra: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Config:
    """hicache-gds settings from `kv_connector_extra_config` (keys win over the environment)."""
    overrides: dict[str, Any] = {}
    for k, v in extra.items():
        name = _ENV_SPELLINGS.get(k, k)
        if name.upper().startswith("HICACHE_GDS_"):
            name = name[len("HICACHE_GDS_"):]
        overrides[name.lower() if name not in VLLM_KEYS + ADAPTER_KEYS else name] = v
    return Config.load(overrides, env=env, ignore=VLLM_KEYS + ADAPTER_KEYS)


def engine_identity(config: OffloadingConfig) -> dict[str, Any]:
    """Everything that makes a stored chunk's bytes meaningful, except the rank (added per worker).

    vLLM's keys carry only a prefix hash and a group index, so two engines whose model, dtype,
    layout, block geometry or parallelism differ must never share a namespace. Nothing else is in
    it -- not the data-parallel index, not the engine id -- so engines that agree on all of that
    (DP replicas, a second engine on the node) share their chunks. `kv_handoff` says how this vLLM
    release hands KV to workers (0.26: cross-layer blocks where it can; 0.33: per-layer views);
    each worker adds the layout it was actually handed to its stores' namespaces.
    """
    par = config.parallel
    groups = [
        {"id": compat.group_id(g, i), "tokens_per_block": g.tokens_per_block, "window": compat.sliding_window(g),
         "layers": hashlib.sha256("\n".join(g.layer_names).encode()).hexdigest()[:16], "nlayers": len(g.layer_names)}
        for i, g in enumerate(config.groups)
    ]
    return {
        "format": ADAPTER_FORMAT, "model": config.model.name, "dtype": compat.model_dtype(config),
        "kv_handoff": compat.KV_HANDOFF, "kv_cache_layout": compat.kv_cache_layout(config),
        "canonical_layout": compat.canonical_layout(config),
        "tokens_per_hash": config.cache.tokens_per_hash, "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block, "groups": groups,
        "world_size": par.world_size, "tp": par.tp_size, "pp": par.pp_size, "pcp": par.pcp_size,
        "dcp": par.dcp_size,
    }


def _proposed_capacity(cfg: Config, config: OffloadingConfig) -> int:
    """Chunks per (rank, group) namespace.

    `capacity` is read as bytes per rank (all groups); 0 means the core's default budget under
    `GDS_PATH` (`hicache_gds.slabs.capacity.default_budget`: `capacity_fraction` of the space available
    plus what hicache-gds namespaces hold, never past `max_fill`), shared by `world_size` ranks. A
    chunk is counted at vLLM's padded per-block size, an upper bound of the un-padded page each
    worker stores.
    """
    chunk = align_up(max(1, config.worker_kv_bytes_per_block) * config.cache.blocks_per_chunk)
    ngroups = max(1, len(config.groups))
    if cfg.capacity:
        per_rank = cfg.capacity
    else:
        budget = default_budget(cfg.gds_path, cfg.capacity_fraction, cfg.max_fill)
        per_rank = budget.total // max(1, config.parallel.world_size)
    chunks = per_rank // (chunk * ngroups)
    if chunks < 1:
        raise ConfigError(f"capacity: {per_rank} bytes per rank hold no chunk of {chunk * ngroups} bytes; "
                          f"raise HICACHE_GDS_CAPACITY or lower blocks_per_chunk")
    return chunks


class HiCacheGDSOffloadingSpec(OffloadingSpec):
    """OffloadingSpec whose chunks live in hicache-gds page stores (NVMe through NIXL, or bounce)."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        compat.stable_block_hashes()  # built before vLLM seeds its block hashes: see compat
        self.hicache = hicache_config(self.extra_config)
        if not self.hicache.gds_path:
            raise ConfigError("GDS_PATH is not set: give gds_path in kv_connector_extra_config or the GDS_PATH "
                              "environment variable (one directory per NVMe drive, comma-separated)")
        self.identity = engine_identity(config)
        # The adapter's own directory: per engine identity, tenant and directory set, so a manifest
        # or capacity record can never describe another configuration's stores.
        self.spec_id = namespace_id({**self.identity, "tenant": self.hicache.namespace,
                                     "gds_path": ",".join(self.hicache.gds_path)})
        self.sidecar = SideDir(self.hicache.gds_path[0], self.spec_id)
        self.capacity_chunks = self.sidecar.agreed_capacity(
            _proposed_capacity(self.hicache, config), explicit=bool(self.hicache.capacity))
        # Group position (order of config.groups / kv_caches.group_data_refs) by vLLM group id.
        self.group_pos = {compat.group_id(g, i): i for i, g in enumerate(config.groups)}
        # Set by `HiCacheGDSConnector`, whose scheduler recomputes the blocks of a failed load: the
        # worker then reports a failed load's blocks instead of failing the job (which vLLM asserts).
        self.recover_failed_loads = False

    def get_manager(self) -> OffloadingManager:
        from .manager import HiCacheGDSManager
        return HiCacheGDSManager(self)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        from .worker import HiCacheGDSWorker
        return HiCacheGDSWorker(self, kv_caches)
