"""hicache-gds for vLLM 0.26 and 0.33: an `OffloadingSpec` for vLLM's `OffloadingConnector`, and `HiCacheGDSConnector`.

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "HiCacheGDSOffloadingSpec",
                                      "spec_module_path": "hicache_gds_vllm", "gds_path": "/mnt/nvme/kv"}}'

`spec.py` (settings, identity), `manager.py` (scheduler side, and how the two sides share the
store), `worker.py` (GPU worker side), `regions.py` (chunk -> memory regions), `sidecar.py`
(files the two sides share).
"""

from .spec import HiCacheGDSOffloadingSpec, HiCacheLoadSpec, HiCacheStoreSpec

__all__ = ["HiCacheGDSOffloadingSpec", "HiCacheLoadSpec", "HiCacheStoreSpec"]
__version__ = "0.1.0"
