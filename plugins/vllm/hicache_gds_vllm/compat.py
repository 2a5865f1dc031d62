"""What differs between the vLLM releases this adapter runs on (0.26 and 0.33), in one place.

Everything here is found by looking at vLLM's own classes (an import, a field), never by its
version string:

* `STORAGE_MEDIUM`: what an `OffloadingEvent` names our medium (0.33's `Medium.STORAGE`; 0.26
  has no `Medium` and takes a string, "FS" as its file-system tier does);
* `group_id` / `sliding_window` / `kv_cache_layout` / `canonical_layout`: fields 0.26's
  `OffloadingConfig` lacks (0.26 hands every KV-cache group over, a key's group index is its
  position; no sliding-window groups, no canonical layout, no layout field);
* `KV_HANDOFF`: how this release hands the KV cache to the worker, so that chunks whose bytes
  are ordered differently never share a namespace (0.26's connector prefers *cross-layer
  blocks*: one (num_blocks, layers x page) tensor whose blocks hold every layer; 0.33 hands
  per-layer LBHNC views);
* `model_dtype`: 0.26 reports the KV-cache dtype as configured, "auto" when it follows the
  model, which would let a float16 and a bfloat16 run of one model share pages;
* `stable_block_hashes`: 0.26 seeds its block hashes (our keys) with random bytes per process
  unless PYTHONHASHSEED is set, so a restarted engine or a second one would never find a chunk.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig, OffloadingGroupConfig

__all__ = ["STORAGE_MEDIUM", "log_through_vllm", "KV_HANDOFF", "group_id", "sliding_window", "kv_cache_layout", "canonical_layout",
           "model_dtype", "handed_layout", "stable_block_hashes", "HASH_SEED"]

log = logging.getLogger("hicache_gds_vllm")

try:  # 0.33
    from vllm.v1.kv_offload.base import Medium
    STORAGE_MEDIUM: Any = Medium.STORAGE
except ImportError:  # 0.26: OffloadingEvent.medium is a string
    STORAGE_MEDIUM = "FS"


def _handoff() -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
    if hasattr(OffloadingConnectorWorker, "register_cross_layers_kv_cache"):
        return "cross-layer-or-per-layer-HND"  # 0.26: one cross-layer tensor when the backend allows it
    return "per-layer-canonical"  # 0.33: per-layer views in the layout of `kv_cache_layout`


KV_HANDOFF = _handoff()
"""The offloading connector's way of handing KV to workers; part of every engine identity."""


def group_id(group: OffloadingGroupConfig, position: int) -> int:
    """vLLM's id of a KV-cache group: 0.33 names it; 0.26 hands every group, in order."""
    return getattr(group, "group_id", position)


def sliding_window(group: OffloadingGroupConfig) -> int | None:
    """Chunks a sliding-window group keeps (None: full attention, and always on 0.26)."""
    return getattr(group, "sliding_window_size_in_chunks", None)


def kv_cache_layout(config: OffloadingConfig) -> str:
    return getattr(config, "kv_cache_layout", None) or ""


def canonical_layout(config: OffloadingConfig) -> bool:
    return bool(getattr(config, "canonical_layout", False))


def model_dtype(config: OffloadingConfig) -> str:
    """The KV cache's dtype. Where vLLM says "auto" (0.26: the cache follows the model), the model's
    dtype as `HiCacheGDSConnector` recorded it (extra key `model_dtype`), else from the vLLM config
    being built in this process; "auto" only when neither is known (logged)."""
    dtype = str(config.model.dtype)
    if dtype != "auto":
        return dtype
    given = config.extra_config.get("model_dtype")
    if given:
        return str(given).removeprefix("torch.")
    try:
        from vllm.config import get_current_vllm_config_or_none
        vc = get_current_vllm_config_or_none()
        if vc is not None and vc.model_config is not None:
            return str(vc.model_config.dtype).removeprefix("torch.")
    except Exception:  # noqa: BLE001 -- best effort; the identity then says "auto"
        pass
    log.warning("hicache-gds-vllm: the KV cache dtype is 'auto' and the model's dtype is unknown here; "
                "use kv_connector HiCacheGDSConnector (or --kv-cache-dtype) so that runs of one model in "
                "different dtypes never share pages")
    return "auto"


def handed_layout(nrefs: int, nlayers: int) -> str:
    """How one group's KV reached the worker: 'per-layer' (a ref per layer), 'cross-layer' (one ref
    holding every layer of a block: 0.26's uniform cross-layer tensor, or a packed layout), or
    'refs-N' for anything else. Part of each store's namespace, with the page sizes."""
    if nrefs == nlayers:
        return "per-layer"
    if nrefs == 1 and nlayers > 1:
        return "cross-layer"
    return f"refs-{nrefs}"


HASH_SEED = "0"  # PYTHONHASHSEED where this adapter has to fix it (any fixed value does)


def stable_block_hashes(hash_algo: str | None = None) -> bool:
    """Make vLLM's block hashes -- the keys of every stored chunk -- the same in every engine process.

    vLLM derives them from a seed it draws at engine start (`init_none_hash`, after the scheduler
    and its connector are built): 0.26 draws random bytes unless PYTHONHASHSEED is set; 0.33 does so
    only for non-cryptographic hashes (xxhash). Where the seed would be random, set PYTHONHASHSEED
    (to `HASH_SEED`) before vLLM draws it; an operator's own value is kept. `hash_algo`: vLLM's
    `prefix_caching_hash_algo` where known. Returns whether it set the variable."""
    if os.environ.get("PYTHONHASHSEED") is not None:
        return False
    from vllm.v1.core import kv_cache_utils
    if hasattr(kv_cache_utils, "resolve_none_hash_seed"):  # 0.33: random only for non-cryptographic hashes
        if hash_algo is None or not str(hash_algo).startswith("xxhash"):
            return False
    os.environ["PYTHONHASHSEED"] = HASH_SEED
    log.info("hicache-gds-vllm: PYTHONHASHSEED=%s, so that block hashes (the keys of stored chunks) are the same "
             "in every engine process and a restarted engine finds its chunks", HASH_SEED)
    return True


def log_through_vllm() -> None:
    """Send the INFO lines of ``hicache_gds`` and ``hicache_gds_vllm`` to vLLM's log handler.

    vLLM configures only its own ``vllm`` logger (it does not propagate), so a plugin's INFO lines
    (which engine ran, the cost model's decisions) would be dropped in a running server. Only where
    nothing else handles them: with a handler on the root logger (an application's, pytest's) they
    propagate there as before."""
    root = logging.getLogger()
    source = logging.getLogger("vllm")
    if root.handlers or not source.handlers:
        return
    for name in ("hicache_gds", "hicache_gds_vllm"):
        lg = logging.getLogger(name)
        if lg.handlers:
            continue
        for h in source.handlers:
            lg.addHandler(h)
        if lg.level == logging.NOTSET:
            lg.setLevel(logging.INFO)
        lg.propagate = False
