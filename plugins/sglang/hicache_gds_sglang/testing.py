"""The SGLang test target of hicache-gds's reliability runs: storage configs, mimic host pools,
attach like SGLang, and SGLang's own failure injector around the backend.

Registered as the ``sglang`` target (entry-point group ``hicache_gds.testing.targets``), so the
core's runs reach it by name without importing this plugin (`hicache_gds.testing.targets` says
what a target provides). Needs SGLang 0.5.17–0.5.23 (the `scripts/install-sglang-test-deps.sh`
environment) and the CPU mimics of SGLang's host pools in the repository's
``tests/sglang_pools.py`` (SGLang's real pools load CUDA kernels at import; found on ``sys.path``
first, so put that directory on ``PYTHONPATH`` when this plugin is not run from the repository --
an environment variable of ours would be a ``HICACHE_GDS_*`` name, which strict config refuses).

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

from .plugin import DYNAMIC_EXTRA_CONFIG

__all__ = ["available", "why_unavailable", "storage_config", "make_pool", "attach", "host_indices", "page_bytes",
           "set_page", "sgl_key", "key", "kv_store", "open_client", "AdapterClient", "fault_cases", "injector_case",
           "POOL_SHAPES"]


# (kind, layout, layer_num, head_num, head_dim, page_size): page bytes 32 KiB / 32 KiB / 27 KiB.
# layer_first MHA is the reordered zero-copy path; MLA page_first_direct one segment per page.
POOL_SHAPES = [("mha", "page_first", 4, 2, 64, 16), ("mha", "layer_first", 4, 2, 64, 16),
               ("mla", "page_first_direct", 3, 1, 576, 8)]


def _tests_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))  # <repo>/plugins/sglang/hicache_gds_sglang
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(here))), "tests")


def why_unavailable() -> str:
    """'' when SGLang, the plugin and the mimic pools import; else the reason."""
    try:
        from . import backend  # noqa: F401
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
    except Exception as exc:  # noqa: BLE001 -- any import failure means "not this environment"
        return (f"SGLang or hicache_gds_sglang is not importable ({type(exc).__name__}: {exc}); "
                f"use the scripts/install-sglang-test-deps.sh environment")
    try:
        _pools()
    except Exception as exc:  # noqa: BLE001
        return f"tests/sglang_pools.py (the CPU host-pool mimics) cannot be imported: {exc}"
    return ""


def available() -> bool:
    return not why_unavailable()


def _pools() -> Any:
    try:  # on sys.path already (PYTHONPATH names the repository's tests directory)
        import sglang_pools
        return sglang_pools
    except ImportError:
        pass
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
        sc.extra_config.update(DYNAMIC_EXTRA_CONFIG)
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


def key(tag: str) -> str:
    """The target's page key for `tag` (`hicache_gds.testing.targets` contract)."""
    return sgl_key(tag)


class AdapterClient:
    """`HiCacheGDS` on a mimic host pool, driven as SGLang's controller drives it (v1 zero-copy calls).

    The `hicache_gds.testing.clients.Client` of the ``sglang`` target delegates here: page bytes
    go through host-pool pages ``at .. at + n`` and ``batch_set_v1`` / ``batch_get_v1``."""

    def __init__(self, gds_path: str, *, slots: int, pages: int, shape: int, identity: Any = None,
                 extra: dict | None = None, options: dict | None = None) -> None:
        """`identity` is not used: SGLang names the namespace from its storage config (`options`)."""
        from hicache_gds import align_up
        sh = POOL_SHAPES[shape % len(POOL_SHAPES)]
        self.pool = pool_for_shape(sh, pages)
        self.page = flat_page_nbytes(self.pool)
        kw = dict(options or {})
        kw.setdefault("is_mla_model", sh[0] == "mla")
        sc = storage_config(gds_path, capacity=slots * align_up(self.page), extra=dict(extra or {}), **kw)
        self.backend = attach(sc, self.pool)
        self.raw = inner(self.backend)
        self.binding = self.raw._bindings["kv"]
        self.store = self.binding.store

    def store_keys(self, keys: Sequence[str]) -> list[str]:
        return self.binding.skeys(list(keys))

    def put(self, keys: list[str], blobs: list[Any], at: int) -> list[bool]:
        for j, blob in enumerate(blobs):
            set_page(self.pool, at + j, blob)
        return self.backend.batch_set_v1(keys, host_indices(self.pool, range(at, at + len(keys))))

    def read(self, keys: list[str], at: int) -> list[bytes | None]:
        import numpy as np
        poison = np.full(self.page, 0xEE, dtype=np.uint8)
        for j in range(len(keys)):
            set_page(self.pool, at + j, poison)
        res = self.backend.batch_get_v1(keys, host_indices(self.pool, range(at, at + len(keys))))
        return [page_bytes(self.pool, at + j) if ok else None for j, ok in enumerate(res)]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [bool(self.backend.exists(k)) for k in keys]

    def prefix(self, keys: Sequence[str]) -> int:
        return self.backend.batch_exists(list(keys))

    def clear(self) -> bool:
        return bool(self.backend.clear())

    def close(self) -> None:
        self.backend.close()


def open_client(gds_path: str, **kw: Any) -> AdapterClient:
    """An `AdapterClient` (`hicache_gds.testing.targets` contract)."""
    return AdapterClient(gds_path, **kw)


# -- SGLang's failure injector ----------------------------------------------------------------------------

def injector_case(root: str, *, delay: float = 0.002, failure: float = 0.3, seconds: float = 5.0) -> Any:
    """Three SGLang-like threads through SGLang's HiCacheStorageFailureInjector around HiCacheGDS."""
    import threading
    import time

    from hicache_gds.testing.cases import Case, guarded
    from hicache_gds.testing.clients import expected
    from hicache_gds.testing.crash import page_bytes_of
    from hicache_gds.testing.invariants import index_problems

    case = Case("faults", f"SGLang injector (delay<={delay}s, failure {failure})", "sglang")
    os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY"] = str(delay)
    os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"] = str(failure)
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

        d = os.path.join(root, "sglang-injector")
        os.makedirs(d, exist_ok=True)
        pool = make_pool("mha", "page_first", pages=96)
        b = attach(storage_config(d, capacity="32M"), pool)
    finally:
        os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", None)
        os.environ.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", None)
    if not case.check(isinstance(b, HiCacheStorageFailureInjector), "SGLang did not wrap the backend"):
        b.close()
        return case
    injected, calls = [0], [0]
    orig = b._inject_failure

    def counting(name: str) -> bool:
        hit = orig(name)
        injected[0] += hit
        calls[0] += 1
        return hit
    b._inject_failure = counting
    page = flat_page_nbytes(pool)
    keys = [sgl_key(f"inj-{i}") for i in range(32)]
    for j, k in enumerate(keys):
        set_page(pool, j, page_bytes_of(k, page))
    stop = threading.Event()
    errors: list[str] = []
    counts = {"set": 0, "get": 0, "exists": 0, "hits": 0}

    def run(fn: Any) -> None:
        try:
            while not stop.is_set():
                fn()
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")

    def setter() -> None:
        res = b.batch_set_v1(keys, host_indices(pool, range(32)))
        counts["set"] += len(res)

    def getter() -> None:
        res = b.batch_get_v1(keys[:16], host_indices(pool, range(40, 56)))
        counts["get"] += len(res)
        for i, ok in enumerate(res):
            if ok:
                counts["hits"] += 1
                if page_bytes(pool, 40 + i) != expected(keys[i], page):
                    case.wrong_bytes += 1

    def exister() -> None:
        n = b.batch_exists(keys)
        counts["exists"] += 1
        if not 0 <= n <= 32:
            errors.append(f"batch_exists returned {n}")
    ts = [threading.Thread(target=run, args=(f,)) for f in (setter, getter, exister)]
    for t in ts:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in ts:
        t.join(60)
    case.exceptions = len(errors)
    case.problems.extend(errors[:5])
    case.check(not any(t.is_alive() for t in ts), "a thread hung")
    case.check(case.wrong_bytes == 0, f"{case.wrong_bytes} hit(s) with wrong bytes")
    case.injected = injected[0]
    case.caught = injected[0]
    with guarded(case, "after"):
        case.check(b._backend.batch_exists(keys) == 32, "not every page got stored")
    case.problems.extend(index_problems(kv_store(b).index))
    b.close()
    case.outcome = (f"{injected[0]} of {calls[0]} calls failed by the injector; "
                    f"{counts['hits']} hits all byte-exact; every page stored in the end; exceptions {len(errors)}")
    return case


def fault_cases(root: str, seconds: float = 5.0) -> list[Any]:
    """Faults only SGLang can inject: its random failures and delays around the backend
    (`hicache_gds.testing.targets` contract)."""
    return [injector_case(root, seconds=seconds), injector_case(root, delay=0.05, failure=0.0, seconds=seconds)]
