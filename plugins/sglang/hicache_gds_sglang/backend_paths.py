"""`HiCacheGDS`'s copy path and hybrid-pool (v2) calls, over its pool bindings.

The copy path (`get` / `set` / `batch_get` / `batch_set` / `exists`) moves SGLang's flat pages
(``get_data_page(flat=True)``) through a registered staging buffer, in the same namespaces and
with the same bytes as the zero-copy calls; the v2 calls serve sidecar pools with HiCacheFile's
hit semantics. As everywhere in the backend, none of them raises: a failure is logged
(`HiCacheGDS._fail`) and reads as a miss.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult

from .pools import PoolBinding

__all__ = ["CopyAndPoolPaths", "pool_name"]

log = logging.getLogger("hicache_gds_sglang")


def pool_name(name: Any) -> str:
    """A pool's name as a string (SGLang passes a `PoolName` or its value)."""
    return str(getattr(name, "value", name))


# 0.5.23's PoolTransferResult carries the restorable prefix lengths (its controller intersects
# them across ranks); 0.5.17's has only the two counts, and a third argument is a TypeError.
HAS_RESTORABLE = "restorable_prefix_pages" in {f.name for f in dataclasses.fields(PoolTransferResult)}


def _transfer_result(kv_pages: int, hit_count: dict, restorable: List[int]) -> PoolTransferResult:
    """`PoolTransferResult` in the installed SGLang's shape."""
    if HAS_RESTORABLE:
        return PoolTransferResult(kv_pages, hit_count, restorable)
    return PoolTransferResult(kv_pages, hit_count)


class CopyAndPoolPaths:
    """Mixin of `HiCacheGDS`: it provides ``_bindings``, ``_route``, ``_io``, ``_fail`` and ``_metrics``."""

    # -- copy path (SGLang's generic page functions) ----------------------------------------------
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        out = self.batch_get([key], [target_location])
        return out[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Read flat pages into `target_locations` (allocated when None); None per miss."""
        n = len(keys)
        targets = list(target_locations) if target_locations is not None else [None] * n
        ok = [False] * n
        try:
            groups: dict[int, tuple[PoolBinding, list[int], list[str]]] = {}
            for i, k in enumerate(keys):
                b, base = self._route(k)
                if b is None:
                    continue
                if targets[i] is None:
                    targets[i] = torch.empty(b.geo.page_bytes // b.geo.flat_dtype.itemsize, dtype=b.geo.flat_dtype)
                groups.setdefault(id(b), (b, [], []))[1].append(i)
                groups[id(b)][2].append(base)
            for b, idx, base_keys in groups.values():
                t0 = time.perf_counter()
                res = b.get_tensors(base_keys, [targets[i] for i in idx])
                if b.name == "kv":
                    self._metrics.record(False, sum(res), sum(res) * b.geo.page_bytes, time.perf_counter() - t0)
                for i, r in zip(idx, res):
                    ok[i] = r
        except Exception as exc:  # noqa: BLE001
            self._fail("batch_get", exc)
        return [t if good else None for t, good in zip(targets, ok)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Write flat pages (``get_data_page(i, flat=True)``); True when every page is stored."""
        try:
            values = list(values or [])
            if len(values) != len(keys):
                self._fail("batch_set", f"{len(keys)} keys but {len(values)} values")
                return False
            groups: dict[int, tuple[PoolBinding, list[int], list[str]]] = {}
            for i, k in enumerate(keys):
                b, base = self._route(k)
                if b is None:
                    self._fail("batch_set", "no host pool is registered")
                    return False
                groups.setdefault(id(b), (b, [], []))[1].append(i)
                groups[id(b)][2].append(base)
            good = True
            for b, idx, base_keys in groups.values():
                if b.read_only:
                    continue
                t0 = time.perf_counter()
                res = b.put_tensors(base_keys, [values[i] for i in idx])
                if b.name == "kv":
                    self._metrics.record(True, sum(res), sum(res) * b.geo.page_bytes, time.perf_counter() - t0)
                good = good and all(res)
            return good
        except Exception as exc:  # noqa: BLE001
            self._fail("batch_set", exc)
            return False

    def exists(self, key: str) -> bool:
        try:
            b, base = self._route(key)
            return bool(b is not None and b.exists([base])[0])
        except Exception as exc:  # noqa: BLE001
            self._fail("exists", exc)
            return False

    # -- hybrid pools (v2) -----------------------------------------------------------------------
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Any = None) -> PoolTransferResult:
        """HiCacheFile's fold (0.5.23): KV longest prefix, then each pool's hit policy.

        `kv_hit_pages` is the longest prefix every pool can restore, and `restorable_prefix_pages`
        all such lengths where the installed `PoolTransferResult` has that field. 0.5.17's has not
        (nor does its controller read it); the counts are the same answer, which is never longer
        than 0.5.17's HiCacheFile gives and shorter only when two pools' trailing windows end at
        different lengths (where HiCacheFile 0.5.17 reports a prefix one pool cannot restore).
        """
        try:
            kv = self._bindings.get("kv")
            kv_pages = kv.prefix(keys) if kv is not None and keys else 0
            hit_count: dict = {PoolName.KV: kv_pages} if kv_pages else {}
            restorable = list(range(1, kv_pages + 1))
            for t in pool_transfers or []:
                if not restorable:
                    break
                b = self._bindings.get(pool_name(t.name))
                has = b.exists(keys[:kv_pages]) if b is not None else [False] * kv_pages
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    boundary = next((i for i, h in enumerate(has) if not h), kv_pages)
                    pool_ok = set(range(1, boundary + 1))
                elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    trailing = max(1, len(t.keys) if t.keys else 1)
                    pool_ok, run = set(), 0
                    for p in range(1, kv_pages + 1):
                        run = run + 1 if has[p - 1] else 0
                        if run >= min(trailing, p):
                            pool_ok.add(p)
                    boundary = max(pool_ok, default=0)
                else:
                    self._fail("batch_exists_v2", f"hit policy {t.hit_policy} of pool {t.name} is not supported")
                    return _transfer_result(0, {}, [])
                if boundary:
                    hit_count[t.name] = boundary
                restorable = [p for p in restorable if p in pool_ok]
            return _transfer_result(restorable[-1] if restorable else 0, hit_count, restorable)
        except Exception as exc:  # noqa: BLE001
            self._fail("batch_exists_v2", exc)
            return _transfer_result(0, {}, [])

    def _batch_v2(self, op: str, transfers: List[PoolTransfer], write: bool) -> dict:
        out = {}
        try:
            for t in transfers:
                keys = list(t.keys or [])
                out[t.name] = self._io(f"{op}[{pool_name(t.name)}]", self._bindings.get(pool_name(t.name)), keys,
                                       t.host_indices, write)
        except Exception as exc:  # noqa: BLE001 -- a malformed transfer list: never raise into SGLang
            self._fail(op, exc)
        return out

    def batch_get_v2(self, transfers: List[PoolTransfer], extra_info: Any = None) -> dict:
        """Per pool: read pages into `registered_pools[name]` at ``host_indices[i*page_size]``."""
        return self._batch_v2("batch_get_v2", transfers, write=False)

    def batch_set_v2(self, transfers: List[PoolTransfer], extra_info: Any = None) -> dict:
        """Per pool: write pages from its host pool."""
        return self._batch_v2("batch_set_v2", transfers, write=True)
