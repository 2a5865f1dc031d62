"""SGLang-side helpers for the reliability runs: storage configs, mimic host pools, attach like SGLang.

Needs SGLang 0.5.23 and `hicache_gds_sglang` importable (the `.venv-sgl` environment), and the
CPU mimics of SGLang's host pools in the repository's ``tests/sglang_pools.py`` (SGLang's real
pools load CUDA kernels at import). Nothing here is imported by the core.

    sc = storage_config(gds_path, capacity="64M")
    pool = make_pool("mha", "page_first", pages=64)
    backend = attach(sc, pool)          # StorageBackendFactory, like HiCacheController
    backend.batch_set_v1(keys, host_indices(pool, range(16)))
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any, Iterable, Sequence

__all__ = ["available", "why_unavailable", "storage_config", "make_pool", "attach", "host_indices", "page_bytes",
           "set_page", "sgl_key", "kv_store", "POOL_SHAPES"]

DYNAMIC = {"backend_name": "gds", "module_path": "hicache_gds_sglang", "class_name": "HiCacheGDS", "interface_v1": 1}

# (kind, layout, layer_num, head_num, head_dim, page_size): page bytes 32 KiB / 32 KiB / 27 KiB.
# layer_first MHA is the reordered zero-copy path; MLA page_first_direct one segment per page.
POOL_SHAPES = [("mha", "page_first", 4, 2, 64, 16), ("mha", "layer_first", 4, 2, 64, 16),
               ("mla", "page_first_direct", 3, 1, 576, 8)]


def _tests_dir() -> str:
    env = os.environ.get("HICACHE_GDS_TESTS_DIR")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(os.path.dirname(here)), "tests")


def why_unavailable() -> str:
    """'' when SGLang, the plugin and the mimic pools import; else the reason."""
    try:
        import hicache_gds_sglang.backend  # noqa: F401
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- any import failure means "not this environment"
        return f"SGLang or hicache_gds_sglang is not importable ({type(exc).__name__}: {exc}); use .venv-sgl"
    try:
        _pools()
    except Exception as exc:  # noqa: BLE001
        return f"tests/sglang_pools.py (the CPU host-pool mimics) cannot be imported: {exc}"
    return ""


def available() -> bool:
    return not why_unavailable()


def _pools() -> Any:
    d = _tests_dir()
    if d not in sys.path:
        sys.path.insert(0, d)
    import sglang_pools
    return sglang_pools


def storage_config(gds_path: str | None, *, capacity: Any = "64M", extra: dict | None = None, **kw: Any) -> Any:
    """A HiCacheStorageConfig as HiCacheController builds it (TP 1, MHA unless told)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    ex = dict(extra or {})
    if gds_path is not None:
        ex.setdefault("gds_path", gds_path)
    if capacity is not None:
        ex.setdefault("capacity", capacity)
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                enable_storage_metrics=True, is_page_first_layout=True, model_name="meta-llama/Reliability-1B",
                extra_config=ex)
    base.update(kw)
    return HiCacheStorageConfig(**base)


def make_pool(kind: str = "mha", layout: str = "page_first", pages: int = 64, *, layer_num: int = 4,
              head_num: int = 2, head_dim: int | None = None, page_size: int = 16, seed: int | None = None) -> Any:
    """A CPU mimic of SGLang's MHA/MLA host pool (zero-filled unless `seed`)."""
    import torch
    if head_dim is None:
        head_dim = 64 if kind == "mha" else 576
    return _pools().make_host_pool(kind, layout, layer_num=layer_num, head_num=head_num, head_dim=head_dim,
                                   page_size=page_size, dtype=torch.bfloat16, num_pages=pages,
                                   fill=seed is not None, seed=seed or 0)


def pool_for_shape(shape: Sequence[Any], pages: int) -> Any:
    kind, layout, layer_num, head_num, head_dim, page_size = shape
    return make_pool(kind, layout, pages, layer_num=layer_num, head_num=head_num, head_dim=head_dim,
                     page_size=page_size)


def attach(sc: Any, pool: Any, name: str = "dynamic") -> Any:
    """Create and register a backend as HiCacheController.attach_storage_backend does.

    Goes through SGLang's `StorageBackendFactory`, so SGLang's failure injector
    (SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY / _RANDOM_FAILURE) wraps it when those are set.
    """
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    if name == "dynamic":
        sc.extra_config.update(DYNAMIC)
    backend = StorageBackendFactory.create_backend(name, sc, pool)
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(pool, "kv")
    backend.on_host_pools_registered()
    return backend


def inner(backend: Any) -> Any:
    """The HiCacheGDS under SGLang's failure injector (or the backend itself)."""
    return getattr(backend, "_backend", backend)


def kv_store(backend: Any) -> Any:
    """The KV namespace's PageStore of a HiCacheGDS."""
    return inner(backend)._bindings["kv"].store


def host_indices(pool: Any, pages: Iterable[int]) -> Any:
    """host_indices for whole pages, as the controller passes them (int64, page_size per page)."""
    import torch
    ps = pool.page_size
    pages = list(pages)
    if not pages:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64) for p in pages])


def page_bytes(pool: Any, page: int) -> bytes:
    """The flat page's bytes (what every backend stores for it)."""
    import torch
    return pool.get_data_page(page * pool.page_size, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def flat_page_nbytes(pool: Any) -> int:
    d = pool.get_dummy_flat_data_page()
    return d.numel() * d.element_size()


def set_page(pool: Any, page: int, data: Any) -> None:
    """Write `data` (uint8 numpy array of the flat page size) into host page `page`."""
    import torch
    t = torch.from_numpy(data.copy()).view(pool.get_dummy_flat_data_page().dtype)
    pool.set_from_flat_data_page(page * pool.page_size, t)


def sgl_key(tag: str) -> str:
    """An SGLang-like page key (64 lowercase hex characters) derived from `tag`."""
    return hashlib.sha256(tag.encode()).hexdigest()
