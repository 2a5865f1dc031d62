"""Builders of vLLM's offloading types for tests and benchmarks, for whichever vLLM is installed.

vLLM 0.26 and 0.33 spell the same things differently: `OffloadingConfig` and its parts gained
fields in 0.33 (`group_id`, `max_model_len`, `data_parallel_size`, `kv_cache_layout`, ...), and
`KVCacheTensor` changed from one tensor per layer (`size, shared_by, offset, block_stride`) to one
placement of all layers in one allocation (`size, layers, layer_stride, block_stride, offset,
host_resident`). These builders take what both need and pass each release only the fields its
classes have (read from the dataclasses, not from a version string).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)

__all__ = ["offloading_config", "kv_cache_tensors", "llama_layer_names"]


def _make(cls: type, **kw: Any) -> Any:
    """`cls(**kw)` with only the fields `cls` has (the others are what another release added)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in kw.items() if k in names})


def llama_layer_names(layers: int) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))


def offloading_config(extra: Mapping[str, Any], *, layers: int = 32, tokens_per_block: int = 16,
                      bytes_per_block: int = 32 * 64 * 1024, rank: int = 0, world_size: int = 1,
                      dtype: str = "bfloat16", model: str = "meta-llama/Meta-Llama-3-8B", events: bool = False,
                      engine_id: str = "engine-0", kv_cache_layout: str = "LBHNC",
                      max_model_len: int = 8192) -> OffloadingConfig:
    """An `OffloadingConfig` as vLLM builds it for one full-attention group (Llama-3-8B by default:
    32 layers, 64 KiB pages, 16-token blocks); `blocks_per_chunk` from `extra`."""
    group = _make(OffloadingGroupConfig, tokens_per_block=tokens_per_block, layer_names=llama_layer_names(layers),
                  group_id=0)
    parallel = _make(OffloadingParallelConfig, rank=rank, world_size=world_size, tp_size=world_size, pp_size=1,
                     pcp_size=1, dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                     data_parallel_rank_local=None, is_parallelism_agnostic=world_size == 1)
    return _make(OffloadingConfig, groups=(group,), worker_kv_bytes_per_block=bytes_per_block,
                 enable_kv_cache_events=events, extra_config=extra, engine_id=engine_id,
                 model=_make(OffloadingModelConfig, name=model, dtype=dtype, max_model_len=max_model_len),
                 cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block,
                                             blocks_per_chunk=int(extra.get("blocks_per_chunk", 1))),
                 parallel=parallel, kv_cache_layout=kv_cache_layout)


def kv_cache_tensors(layer_names: Sequence[str], page_bytes: int, num_blocks: int) -> list[Any]:
    """`KVCacheConfig.kv_cache_tensors` for layers of one page size, each layer's blocks contiguous
    (what vLLM's allocator plans for a single full-attention group)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor
    names = {f.name for f in dataclasses.fields(KVCacheTensor)}
    if "shared_by" in names:  # 0.26: one tensor per layer
        return [KVCacheTensor(size=page_bytes * num_blocks, shared_by=[n]) for n in layer_names]
    # 0.33: one backing allocation, layer-outermost
    return [KVCacheTensor(size=page_bytes * num_blocks * len(layer_names), layers=list(layer_names),
                          layer_stride=page_bytes * num_blocks, block_stride=page_bytes)]
