"""`HiCacheGDS`: SGLang's HiCache L3 storage backend on hicache-gds page stores.

Construction (both work)::

    HiCacheGDS(storage_config, {})              # --hicache-storage-backend dynamic (SGLang's loader)
    HiCacheGDS(storage_config, mem_pool_host)   # --hicache-storage-backend gds (this plugin's hook)

Then SGLang calls `register_mem_pool_host` (the KV anchor pool, or 0.5.17's `HostPoolGroup` of
it), `register_mem_host_pool_v2` for every pool of the group (KV included) and, where SGLang has
it (0.5.23), `on_host_pools_registered` -- all on the scheduler thread. Each pool is bound to its
own `PageStore` namespace (`naming`), its ``kv_buffer`` registered once; a pool or layout we
cannot serve raises `ConfigError` there, which fails the attach with the reason.

Data path (called from three SGLang threads at once): `batch_exists`, `batch_get_v1`,
`batch_set_v1` (zero-copy between host-pool slots and NVMe), the copy path `get` / `set` /
`batch_get` / `batch_set` / `exists` (same bytes, same namespace), and the v2 calls for sidecar
pools with HiCacheFile's hit semantics. None of them raises: a failure is logged and reads as a
miss (False / 0 / None).

MLA: one rank writes (``is_storage_writer``); the others skip writes (True, as SGLang expects)
and read the writer's namespace through the core's read-only `PageReader` (no lock, nothing
written, every page checked against its checksum).

For the ``compute_or_load`` prefetch policy (`policy`): `read_rate` measures the KV store's gets
(bytes and seconds of each `batch_get_v1`, seeded before the first from ``read_bytes_per_s``, the
estimate persisted in the KV namespace directory, or a short O_DIRECT read of its directories),
`read_progress` says how far the get in flight has come, and `cancel_read` skips the gets of a
prefetch the policy stopped (between SGLang's batches of pages; the get in flight reads whole).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from typing import Any, Dict, List

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from hicache_gds import COST_STATE_FILE as STATE_FILE
from hicache_gds import (ConfigError, ReadRate, align_up, default_budget, load_state, namespace_created,
                         namespace_location, open_store, save_state, seed_read_rate)

from .backend_paths import CopyAndPoolPaths, pool_name
from .naming import KeyScheme, load_config, namespace_identity
from .policy_config import PolicyConfig
from .pools import PoolBinding, describe_pool

__all__ = ["HiCacheGDS"]

log = logging.getLogger("hicache_gds_sglang")
GET_ENDS_KEPT = 4096  # gets whose end `get_ended` remembers: far more than loads in flight at once


# Read rates by KV namespace directory, for the life of the process: a backend attached again (a
# runtime detach/attach, a policy switch) goes on from what the last one measured.
_RATES: dict[str, ReadRate] = {}
_RATES_LOCK = threading.Lock()


def _region(t: Any) -> tuple[Any, int, int] | None:
    """(base tensor, first element, end) of the index storage `t` covers, or None where `t` is
    no 1-D tensor. A prefetch's ``host_indices`` is a view of the host pool's free-slot tensor,
    which every allocation slices forward (``free_slots[:n]``, then ``free_slots[n:]``): all
    prefetches share one base, and only the region tells one prefetch's slices from another's."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        return None
    off = int(t.storage_offset())
    base = t._base  # the tensor `t` is a view of; None where `t` is no view
    return t if base is None else base, off, off + int(t.numel())


def _within(inner: tuple[Any, int, int] | None, outer: tuple[Any, int, int] | None) -> bool:
    """Whether region `inner` starts inside region `outer` of the same base."""
    return inner is not None and outer is not None and inner[0] is outer[0] and outer[1] <= inner[1] < outer[2]


class _Metrics:
    """Per-operation pages and GB/s for `get_stats` (drained by SGLang each tick; bounded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lists = {k: deque(maxlen=4096) for k in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth",
                                                      "backup_bandwidth")}

    def record(self, write: bool, pages: int, nbytes: int, seconds: float) -> None:
        if pages <= 0:
            return
        kind = "backup" if write else "prefetch"
        with self._lock:
            self.lists[f"{kind}_pgs"].append(pages)
            self.lists[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def drain(self) -> dict[str, list]:
        with self._lock:
            out = {k: list(v) for k, v in self.lists.items()}
            for v in self.lists.values():
                v.clear()
        return out


class HiCacheGDS(CopyAndPoolPaths, HiCacheStorage):
    """SGLang HiCache storage backend on hicache-gds (see the module docstring for the contract)."""

    supports_compute_or_load = True  # read_rate, read_progress, cancel_read: what policy.py asks of a backend

    def __init__(self, storage_config: HiCacheStorageConfig, mem_pool_host: Any = None, *args: Any,
                 **kwargs: Any) -> None:
        if isinstance(mem_pool_host, dict):  # the `dynamic` loader passes its kwargs dict here
            mem_pool_host = None
        sc = storage_config
        self.storage_config = sc
        self.config = load_config(sc.extra_config)
        if getattr(sc, "dcp_size", 1) > 1:
            raise ConfigError("hicache-gds does not serve decode context parallelism (dcp_size > 1) yet; "
                              "use --hicache-storage-backend file")
        if getattr(sc, "should_split_heads", False):
            raise ConfigError("hicache-gds does not serve heterogeneous-TP split heads (page_head with "
                              "tp_lcm_size); use --hicache-storage-backend mooncake")
        extra = sc.extra_config or {}
        if "module_path" in extra and not extra.get("interface_v1"):
            log.warning("hicache-gds: loaded as `dynamic` without \"interface_v1\": 1, so SGLang will use its copy "
                        "path (get_data_page / set_from_flat_data_page) instead of zero-copy; add it")
        self.scheme = KeyScheme.from_storage_config(sc)
        self.is_mla = bool(sc.is_mla_model)
        # 0.5.23's `is_storage_writer`; older releases (0.5.17) back MLA KV up from TP rank 0 only.
        self.is_writer = bool(getattr(sc, "is_storage_writer", not sc.is_mla_model or sc.tp_rank == 0))
        # namespaces of this server that preallocate slabs: one per writing rank
        self._writers = max(1, sc.pp_size * sc.attn_cp_size * (1 if self.is_mla else sc.tp_size))
        self.mem_pool_host = None
        self.registered_pools: dict = {}
        self._bindings: Dict[str, PoolBinding] = {}
        self._ctl = threading.RLock()
        self._metrics = _Metrics()
        self._last_log: dict[str, float] = {}
        self._closed = False
        self.policy_config = PolicyConfig.from_extra(extra)
        self.read_rate = ReadRate()
        self._cost_path: str | None = None
        self._cost_saves = False  # MLA readers read the writer's estimates, and write none
        self.read_device: int | None = None  # st_dev of the KV namespace's first directory (`ranks.seed`)
        self._reading: tuple[Any, int] | None = None  # (`_region` of the get in flight, pages read)
        self._read_returned = threading.Event()  # set as each get or existence query returns (`wait_for_reads`)
        # last key of each whole get -> when it returned (`get_ended`), the most recent GET_ENDS_KEPT
        self._get_ended: OrderedDict[str, float] = OrderedDict()
        self.idle_wait_s = self.policy_config.idle_wait_ms / 1e3
        # cancelled prefetches: (their host_indices, held weakly, and its `_region`)
        self._cancelled: list[tuple[weakref.ref, tuple[Any, int, int]]] = []
        self._cancel_lock = threading.Lock()
        if mem_pool_host is not None:
            self.register_mem_pool_host(mem_pool_host)

    # -- attach (scheduler thread) ----------------------------------------------------------------
    def _store_config(self, name: str, ident: dict, page_bytes: int):
        """Capacity when none is configured: this server's writer ranks split the core's default
        budget (`hicache_gds.slabs.capacity.default_budget`: `capacity_fraction` of the space available
        plus what hicache-gds namespaces hold, never past `max_fill`) evenly, so every rank gets the
        same share whichever opens first; a sidecar gets as many slots as KV within that share. An
        existing namespace keeps the size chosen when it was created (the core's rule)."""
        cfg = self.config
        if cfg.capacity:
            return cfg
        if namespace_created(page_bytes, ident, cfg):
            return cfg
        budget = default_budget(cfg.gds_path, cfg.capacity_fraction, cfg.max_fill,
                                exclude=namespace_location(page_bytes, ident, cfg).namespace)
        sc = self.storage_config
        writers = sc.pp_size * sc.attn_cp_size * sc.tp_size if name == "mamba" else self._writers  # per-rank state
        share = budget.total // writers
        how = f"SGLang: 1/{writers} of the {budget.how}"
        kv = self._bindings.get("kv")
        if name != "kv" and kv is not None and not kv.read_only and "slots" in (kv_st := kv.store.stats()):
            kv_bytes = int(kv_st["slots"]) * align_up(page_bytes)
            if kv_bytes < share:
                share, how = kv_bytes, f"SGLang: as many slots as the KV namespace ({how})"
        if share < align_up(page_bytes) * len(cfg.gds_path):
            raise budget.no_room(cfg.max_fill)
        return cfg.replace(capacity=share, source=how)

    def _bind(self, name: str, pool: Any) -> PoolBinding:
        geo = describe_pool(pool, name)
        ident = namespace_identity(self.scheme, name, geo.identity)
        if self.is_mla and not self.is_writer and name != "mamba":  # the MLA storage writer is another rank
            store = open_store(geo.page_bytes, ident, config=self.config, read_only=True)
        else:  # with remote_url configured: NVMe and page servers' DRAM behind one API
            store = open_store(geo.page_bytes, ident, config=self._store_config(name, ident, geo.page_bytes))
        try:
            binding = PoolBinding(name, pool, geo, store, self.scheme)
        except BaseException:
            store.close()
            raise
        binding.read_only = bool(getattr(store, "read_only", False))
        log.info("hicache-gds: pool %s (%s, %s, %d bytes/page, %s) -> namespace %s%s", name, type(pool).__name__,
                 geo.layout, geo.page_bytes, "zero-copy" if geo.zero_copy else "copy path", store.stats()["namespace"],
                 " (read-only: the MLA storage writer is another rank)" if binding.read_only else "")
        return binding

    def _set_binding(self, name: str, pool: Any) -> None:
        with self._ctl:
            if self._closed:
                raise ValueError("HiCacheGDS is closed")
            old = self._bindings.get(name)
            if old is not None and old.pool is pool:
                return
            if old is not None:  # first: a new pool of the same geometry reopens the same namespace
                del self._bindings[name]
                old.close()
            self._bindings[name] = self._bind(name, pool)
            if name == "kv":
                self._seed_read_rate(self._bindings[name])

    def _seed_read_rate(self, kv: PoolBinding) -> None:
        """The KV namespace's read rate: the one this process already measures for it (a backend
        detached and attached again keeps its history), else a new one seeded before the first get
        with ``read_bytes_per_s`` (or its old name ``policy_read_gbps``), else with the estimate an
        earlier run persisted in the namespace directory (`hicache_gds.costmodel.STATE_FILE`), else
        with a short O_DIRECT read of the namespace's directories (`hicache_gds.probe`, ``read_probe`` bytes each: 0.25-0.5 s at 1 GB/s)."""
        try:
            dirs = kv.store.stats().get("dirs") or []
            # every rank reads the estimates persisted in its KV namespace (a rank-replicated MLA
            # namespace is the same on every rank: its readers seed as its writer does)
            self._cost_path = os.path.join(dirs[0], STATE_FILE) if dirs else None
            self._cost_saves = not kv.read_only
            self.read_device = os.stat(dirs[0]).st_dev if dirs else None
            ident = dirs[0] if dirs else None
            with _RATES_LOCK:
                known = _RATES.get(ident) if ident else None
                if known is None and ident:
                    _RATES[ident] = self.read_rate
            if known is not None:
                self.read_rate = known
                if self.policy_config.read_gbps:
                    self.read_rate.seed(self.policy_config.read_gbps * 1e9, "configured (read_bytes_per_s)")
                return
            gbps = self.policy_config.read_gbps
            log.info("hicache-gds: %s", seed_read_rate(
                self.read_rate, configured=gbps * 1e9 if gbps else None, key="read_bytes_per_s",
                state=None if gbps else self.cost_state(), dirs=dirs, probe_bytes=self.config.read_probe))
        except Exception as exc:  # noqa: BLE001 -- an estimate is never worth failing the attach
            log.warning("hicache-gds: no read-rate estimate from an earlier run (%s)", exc)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the KV anchor pool: its own namespace, its kv_buffer registered once.

        A hybrid model's controller hands over its anchor pool (0.5.23) or, in 0.5.17, the whole
        ``HostPoolGroup``, whose page methods only forward to the anchor's: the anchor is bound
        either way, so KV pages take the zero-copy path and land in the same namespace."""
        self.mem_pool_host = mem_pool_host
        anchor = getattr(getattr(mem_pool_host, "anchor_entry", None), "host_pool", None)
        self._set_binding("kv", mem_pool_host if anchor is None else anchor)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Bind a pool of the host pool group; "kv" is the anchor, bound by `register_mem_pool_host`."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = pool_name(host_pool_name)
        if name == "kv":
            if "kv" not in self._bindings:
                self.register_mem_pool_host(host_pool)
            return
        self._set_binding(name, host_pool)

    def on_host_pools_registered(self) -> None:
        if "kv" not in self._bindings:
            raise ConfigError("hicache-gds: no KV host pool was registered")
        log.info("hicache-gds backend ready: pools %s, %s rank, keys ..%s", ", ".join(sorted(self._bindings)),
                 "MLA writer" if self.is_mla and self.is_writer else "MLA reader" if self.is_mla else "MHA",
                 self.scheme.config_suffix)

    # -- helpers ---------------------------------------------------------------------------------
    def _fail(self, op: str, exc: BaseException | str) -> None:
        """Log a data-path failure (at most one full line per operation every 10 s)."""
        now = time.monotonic()
        if now - self._last_log.get(op, -1e9) >= 10.0:
            self._last_log[op] = now
            if isinstance(exc, BaseException):
                log.warning("hicache-gds: %s failed: %s: %s", op, type(exc).__name__, exc, exc_info=exc)
            else:
                log.warning("hicache-gds: %s failed: %s", op, exc)

    def _route(self, key: str) -> tuple[PoolBinding | None, str]:
        """Copy-path keys: ``{hash}.{pool}`` goes to that sidecar's namespace, anything else to KV."""
        base, _, pool = key.rpartition(".")
        if base and pool in self._bindings and pool != "kv":
            return self._bindings[pool], base
        return self._bindings.get("kv"), key

    def _io(self, op: str, binding: PoolBinding | None, keys: List[str], host_indices: Any, write: bool,
            record: bool = True) -> List[bool]:
        try:
            n = len(keys)
        except TypeError:
            self._fail(op, f"keys must be a list of str, got {type(keys).__name__}")
            return []
        try:
            if binding is None:
                self._fail(op, "no host pool is registered for it")
                return [False] * n
            if write and binding.read_only:
                return [True] * n  # MLA: the storage writer rank stores this page
            if not binding.check_indices(keys, host_indices):
                self._fail(op, f"{n} keys but {0 if host_indices is None else host_indices.numel()} host indices "
                               f"(page size {binding.geo.page_size})")
                return [False] * n
            t0 = time.perf_counter()
            res = binding.put(keys, host_indices) if write else binding.get(keys, host_indices)
            if not write and n and all(res):
                self._get_ended[keys[-1]] = time.monotonic()
                if len(self._get_ended) > GET_ENDS_KEPT:
                    self._get_ended.popitem(last=False)
            if binding.name == "kv" and record:
                self._metrics.record(write, sum(res), sum(res) * binding.geo.page_bytes, time.perf_counter() - t0)
            return res
        except Exception as exc:  # noqa: BLE001 -- never raise into SGLang's storage threads
            self._fail(op, exc)
            return [False] * n

    # -- zero-copy contract ----------------------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """Number of consecutive keys present from the first."""
        try:
            kv = self._bindings.get("kv")
            return kv.prefix(keys) if kv is not None and keys else 0
        except Exception as exc:  # noqa: BLE001
            self._fail("batch_exists", exc)
            return 0
        finally:
            self._read_returned.set()

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Read pages into the host pool's slots; per-page result (SGLang uses the leading run).

        A get into the slots of a prefetch the policy stopped (`cancel_read`) reads nothing and
        reports False (SGLang keeps the leading run its earlier gets read)."""
        kv = self._bindings.get("kv")
        try:
            n = len(keys)
        except TypeError:
            return self._io("batch_get_v1", kv, keys, host_indices, write=False)
        region = _region(host_indices)
        if self._is_cancelled(region):
            return [False] * n
        if kv is None or not n or not isinstance(host_indices, torch.Tensor) or \
                not kv.check_indices(keys, host_indices):
            return self._io("batch_get_v1", kv, keys, host_indices, write=False)  # says what is wrong
        t0 = time.perf_counter()
        self._reading = (region, 0)
        try:
            out: List[bool] = list(self._io("batch_get_v1", kv, keys, host_indices, write=False, record=False))
        finally:
            self._reading = None
            self._read_returned.set()
        secs = time.perf_counter() - t0
        got = sum(out)
        self._metrics.record(False, got, got * kv.geo.page_bytes, secs)
        if got and len(out) == n and all(out):
            self.read_rate.observe(got * kv.geo.page_bytes, secs)  # whole gets only: a cut one is no rate
        return out + [False] * (n - len(out))

    def get_ended(self, key: str) -> float | None:
        """`time.monotonic()` when the latest whole get ending with page `key` returned, if recent.
        A load's last page is read when that get returns, which the policy sees only at its next
        check, between forward passes: seconds later inside a long prefill."""
        return self._get_ended.get(key)

    def wait_for_reads(self, timeout_s: float) -> bool:
        """Block the caller (the scheduler, on an idle pass: `idle`) until one of this backend's
        gets or existence queries returns, or `timeout_s` passes; True when one returned. The
        wait releases the GIL the reads need."""
        ev = self._read_returned
        ev.clear()
        return ev.wait(timeout_s)

    # -- the compute_or_load policy's view of the reads (policy.py) -------------------------------
    def kv_bytes_per_token(self) -> float | None:
        """Bytes of this rank's KV per token in the store (a KV page / its tokens)."""
        kv = self._bindings.get("kv")
        return None if kv is None else kv.geo.page_bytes / max(1, kv.geo.page_size)

    def read_progress(self, host_indices: Any) -> int:
        """Pages read so far by the get in flight into `host_indices` (a prefetch's host slots)."""
        cur = self._reading
        return cur[1] if cur is not None and _within(cur[0], _region(host_indices)) else 0

    def cancel_read(self, host_indices: Any) -> None:
        """Skip the reads into `host_indices` (a stopped prefetch's slots): gets into slices of it
        return False from the next get on; gets of other prefetches, views of the same free-slot
        tensor, read on. Held weakly: forgotten with the prefetch (whose view keeps the base, and
        so its identity, alive until then)."""
        region = _region(host_indices)
        if region is None:
            return
        with self._cancel_lock:
            self._cancelled = [(r, g) for r, g in self._cancelled if r() is not None]
            self._cancelled.append((weakref.ref(host_indices), region))

    def _is_cancelled(self, region: tuple[Any, int, int] | None) -> bool:
        with self._cancel_lock:
            return any(r() is not None and _within(region, g) for r, g in self._cancelled)

    def cost_state(self) -> dict | None:
        """The estimates an earlier run persisted in the KV namespace directory, or None."""
        return load_state(self._cost_path) if self._cost_path else None

    def save_cost_state(self, state: dict) -> bool:
        """Persist the policy's estimates in the KV namespace directory (MLA readers write nothing)."""
        return bool(self._cost_path) and self._cost_saves and save_state(self._cost_path, state)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Write pages from the host pool's slots; present pages are not rewritten (True)."""
        return self._io("batch_set_v1", self._bindings.get("kv"), keys, host_indices, write=True)

    # -- control ---------------------------------------------------------------------------------
    def clear(self) -> bool:
        """Drop every page of this rank's namespaces (MLA readers: nothing; the writer clears)."""
        try:
            n = sum(b.store.clear() for b in list(self._bindings.values()) if not b.read_only)
            log.info("hicache-gds: cleared %d pages", n)
            return True
        except Exception as exc:  # noqa: BLE001
            self._fail("clear", exc)
            return False

    def stats(self) -> dict[str, dict]:
        """hicache-gds's counters per pool (`PageStore.stats()`), plus how the pool is served."""
        out = {}
        for name, b in list(self._bindings.items()):
            st = b.store.stats()
            st.update(pool_class=type(b.pool).__name__, layout=b.geo.layout, read_only=b.read_only,
                      pool_path="zero-copy" if b.geo.zero_copy else "copy", page_order=b.geo.identity["page_order"])
            out[name] = st
        out["policy"] = self.policy_stats()
        return out

    def policy_stats(self) -> dict:
        """The prefetch policy's estimates and decisions where it runs in this process, else the
        read rate this backend measured."""
        from .policy import process_policies
        for pol in process_policies():
            if pol.serves(self):
                return pol.stats()
        return {"policy": None, **self.read_rate.snapshot(), "kv_bytes_per_token": self.kv_bytes_per_token()}

    def get_stats(self):
        """SGLang's `StorageMetrics` for the operations since the previous call."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception as exc:  # noqa: BLE001
            self._fail("get_stats", exc)
            return None
        m = StorageMetrics()
        for k, v in self._metrics.drain().items():
            getattr(m, k).extend(v)
        from .policy_hooks import publish_metrics
        publish_metrics(self)
        return m

    def close(self) -> None:
        """Close every namespace (flush indexes, release the namespace locks). Idempotent."""
        with self._ctl:
            if self._closed:
                return
            self._closed = True
            bindings, self._bindings = list(self._bindings.values()), {}
        for b in bindings:
            try:
                b.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("hicache-gds: closing pool %s: %s", b.name, exc)
