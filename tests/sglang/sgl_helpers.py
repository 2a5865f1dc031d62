"""Shared helpers for tests/sglang: storage configs, pools, SGLang-controller-like calls, byte checks.

They run against the installed SGLang (0.5.17 or 0.5.23) and do what its controller does there;
features one release lacks are named here (`HAS_*`, `needs_*`) so tests skip with the reason.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache import hicache_storage
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorage, HiCacheStorageConfig

import sglang_pools
from hicache_gds_sglang import HiCacheGDS

DYNAMIC = {"backend_name": "gds", "module_path": "hicache_gds_sglang", "class_name": "HiCacheGDS", "interface_v1": 1}
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
KINDS = ("mha", "mla")
PS = 4  # tokens per page in most tests
CAPACITY = "64M"

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(HiCacheStorageConfig)}
HAS_DP_RANK = "dp_rank" in _CONFIG_FIELDS  # 0.5.17: the controller keeps dp_rank to itself
HAS_DCP = "dcp_size" in _CONFIG_FIELDS
HAS_RESTORABLE = "restorable_prefix_pages" in {f.name for f in dataclasses.fields(hicache_storage.PoolTransferResult)}
FailureInjector = getattr(hicache_storage, "HiCacheStorageFailureInjector", None)

needs_dcp = pytest.mark.skipif(not HAS_DCP, reason="this SGLang's HiCacheStorageConfig has no dcp_size "
                                                   "(no decode-context-parallel storage)")
needs_injector = pytest.mark.skipif(FailureInjector is None, reason="this SGLang has no "
                                                                    "HiCacheStorageFailureInjector")


def storage_config(gds_dir: str | None, *, extra: dict | None = None, **kw: Any) -> HiCacheStorageConfig:
    """A HiCacheStorageConfig as the controller builds it (TP 1, MHA unless told). `dp_rank` is
    dropped where the installed SGLang's config has no such field (0.5.17; `dp_group` sets that
    release's DP state instead)."""
    ex = dict(extra or {})
    if gds_dir is not None:
        ex.setdefault("gds_path", gds_dir)
        ex.setdefault("capacity", CAPACITY)
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                enable_storage_metrics=True, is_page_first_layout=True, model_name="meta-llama/Test-1B",
                extra_config=ex)
    base.update(kw)
    if not HAS_DP_RANK:
        base.pop("dp_rank", None)
    return HiCacheStorageConfig(**base)


def make_pool(kind: str, layout: str, pages: int = 64, page_size: int = PS, seed: int | None = 0, *,
              layer_num: int = 3, head_num: int = 2, head_dim: int | None = None,
              dtype: torch.dtype = torch.bfloat16) -> Any:
    """A CPU mimic of SGLang's MHA/MLA host pool (tests/sglang_pools.py), random-filled unless seed is None.

    Small pages by default (MHA 6 KiB, MLA 13.5 KiB: not 4 KiB multiples, so the core stages them).
    """
    if head_dim is None:
        head_dim = 64 if kind == "mha" else 576
    return sglang_pools.make_host_pool(kind, layout, layer_num=layer_num, head_num=head_num, head_dim=head_dim,
                                       page_size=page_size, dtype=dtype, num_pages=pages, fill=seed is not None,
                                       seed=seed or 0)


def dp_group(monkeypatch: Any, rank: int) -> dict:
    """`storage_config` kwargs for a rank of attention-DP group `rank`: the config's `dp_rank` where it
    has one (0.5.23); else SGLang's DP-attention state, which 0.5.17's controller reads instead."""
    if HAS_DP_RANK:
        return {"dp_rank": rank}
    from sglang.srt.layers import dp_attention
    monkeypatch.setattr(dp_attention, "is_dp_attention_enabled", lambda: True)
    monkeypatch.setattr(dp_attention, "get_attention_dp_rank", lambda: rank)
    return {}


def attach(sc: HiCacheStorageConfig, pool: Any, name: str = "dynamic") -> HiCacheGDS:
    """Create and register as HiCacheController.attach_storage_backend does (`on_host_pools_registered`
    only where SGLang has it)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    extra = sc.extra_config
    if name == "dynamic":
        extra.update(DYNAMIC)
    backend = StorageBackendFactory.create_backend(name, sc, pool)
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(pool, "kv")
    if hasattr(HiCacheStorage, "on_host_pools_registered"):
        backend.on_host_pools_registered()
    return backend


def hicache_file(path: str, pool: Any, **kw: Any) -> HiCacheFile:
    """SGLang's own HiCacheFile, built as the factory builds it, in `path` (0.5.17 takes only the
    argument, 0.5.23 the injected extra-config key first)."""
    f = HiCacheFile(storage_config(None, extra={"file_storage_path": path}, **kw), path)
    f.register_mem_pool_host(pool)
    return f


def indices(pages: list[int] | range, page_size: int = PS) -> torch.Tensor:
    """host_indices for whole pages, as the controller passes them (int64, page_size per page)."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size, dtype=torch.int64) for p in pages]) \
        if len(pages) else torch.empty(0, dtype=torch.int64)


def page_bytes(pool: Any, page: int) -> bytes:
    """The flat page's bytes (what every backend stores for it)."""
    return pool.get_data_page(page * pool.page_size, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def poison(pool: Any, pages: list[int] | range, value: int = 0xA5) -> None:
    t = torch.full_like(pool.get_dummy_flat_data_page().view(torch.uint8), value)
    for p in pages:
        pool.set_from_flat_data_page(p * pool.page_size, t.view(pool.get_dummy_flat_data_page().dtype))


def keys(n: int, tag: str = "k", start: int = 0) -> list[str]:
    """SGLang-like page keys: 64 lowercase hex characters."""
    return [f"{tag}{i:x}".rjust(64, "0") for i in range(start, start + n)]


def generic_set(backend: Any, pool: Any, ks: list[str], pages: list[int]) -> bool:
    """HiCacheController._generic_page_set."""
    return backend.batch_set(ks, [pool.get_data_page(p * pool.page_size) for p in pages])


def generic_get(backend: Any, pool: Any, ks: list[str], pages: list[int]) -> int:
    """HiCacheController._generic_page_get: leading hits, copied into the pool."""
    data = backend.batch_get(ks, [pool.get_dummy_flat_data_page() for _ in ks])
    n = 0
    for d, p in zip(data, pages):
        if d is None:
            break
        pool.set_from_flat_data_page(p * pool.page_size, d)
        n += 1
    return n


def leading(res: list[bool]) -> int:
    return next((i for i, r in enumerate(res) if not r), len(res))


def same_pages(a: Any, pa: list[int], b: Any, pb: list[int]) -> bool:
    return all(page_bytes(a, x) == page_bytes(b, y) for x, y in zip(pa, pb))


def file_bytes(path: str, key: str, suffix: str) -> bytes | None:
    f = os.path.join(path, f"{key}{suffix}.bin")
    return open(f, "rb").read() if os.path.exists(f) else None


def rng_pages(n: int, total: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).choice(total, size=n, replace=False).tolist()
