"""`GDSLinker`: SGLang's direct L3 path (``UnifiedCacheLinker``) on hicache-gds -- device KV pages
straight to and from NVMe, no host tier.

Selected with (SGLang 0.5.23; exclusive with ``--enable-hierarchical-cache``)::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker":"GDSLinker","linker_module_path":"hicache_gds_sglang",
                                             "linker_extra_config":{"gds_path":"/mnt/nvme0/hicache"}}'

SGLang builds one per worker: ``GDSLinker(server_args, params, components=..., extra_config=...,
forward_stream=...)``. ``extra_config`` takes every hicache-gds key (``gds_path``, ``enable_gds``,
``engine``, ``capacity`` ...; over ``ENABLE_GDS`` / ``GDS_PATH`` / ``HICACHE_GDS_*``) plus
``staging_bytes`` (GPU staging per direction, default 128M, split over ``depth`` buffers),
``depth`` (IO steps in flight per direction, default 2), ``gather_below`` (`GATHER_BELOW`) and
``read_run`` (`READ_RUN`).

Served: the plain MHA (``MHATokenToKVPool``, NHD, unscaled) and MLA (``MLATokenToKVPool``, no DSA)
device pools, component FULL only, without packed draft KV or DCP; anything else is refused at
construction with the reason. The pool's per-layer buffers are pages of segments (`gather`); the
engine comes from ``engines.select`` (``auto``: GDS where a VRAM probe passes, else the bounce
engine's pinned staging) and `stats()` / the start-up log line say which path runs.

Threads. Scheduler thread: `lookup` (in-memory index), `load` / `cancel_queued_load` (queue),
`start_layer_wise_loading` (hands the batch to the load thread), `finish_layer_wise_loading`
(waits for every layer), `offload` (queues), `num_completed_offloads` / `pop_completed_offload`,
`reset`, `close`. The forward calls ``layer_done_counter.wait_until(layer)`` before it reads a
layer; the load thread completes layers in order, each once its bytes are in device memory, so
computing layer i overlaps reading layer i+1 (in layer groups where segments are small). The offload
thread writes whole pages through `PageStore.put` (crash-safe publish, skip-if-present, eviction).
Every IO wait is bounded by ``io_timeout``.

On disk. The namespace identity and keys are HiCacheGDS's (`naming`): a stored page is its
segments in buffer order (MHA ``K_l0..K_lL-1, V_l0..V_lL-1``), the byte order HiCacheGDS calls
``layer_major`` (host ``layer_first`` / ``page_first_direct`` pools), so the two share pages of one
model and rank. Two exceptions get namespaces of their own: pages whose size is not a multiple of
4 KiB are stored padded (cuFile cannot move the unaligned tail), and MLA ranks other than TP 0
keep their own copy.

Integrity. Pages carry the core's one checksum (`hicache_gds.checksum`), computed on the GPU when
they are offloaded (by `PageStore.put`) and checked on the GPU where they landed once a load's
last step is in (`_verify_loaded`), before its last layers are reported: a page that fails is
dropped and the load fails, which SGLang turns into aborting its requests. Pages HiCacheGDS
stored from host memory verify the same way, and the reverse.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from queue import Empty, Queue
from typing import Any, Mapping, Optional

import numpy as np
import torch

from hicache_gds import (ConfigError, Counters, Lease, MemKind, Op, Pages, TransferTimeout, align_up, open_store,
                         parse_size)

from .gather import (ALIGN, GATHER_BELOW, READ_RUN, DevicePages, choose_impl, gather_pages, page_layout_identity, plan_io,
                     scatter_pages)
from .naming import KeyScheme, load_config, namespace_identity, server_topology

try:  # the real base and counter; without SGLang (GPU machine tests, tools) same-shaped stand-ins
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker
    _KV: Any = PoolName.KV
except ImportError:
    from ._linker_compat import LayerWiseLoadCounter, UnifiedCacheLinker  # type: ignore[assignment]
    _KV = "kv"

__all__ = ["GDSLinker", "page_layout_identity", "LINKER_KEYS"]

log = logging.getLogger("hicache_gds_sglang.linker")
LINKER_KEYS = ("staging_bytes", "gather_below", "read_run", "depth")


@dataclass
class _Load:
    rid: str
    keys: list[str]
    indices: torch.Tensor


def _kv(transfers: Any) -> Any:
    for t in transfers or ():
        if str(getattr(t.name, "value", t.name)) == "kv":
            return t
    return None


class GDSLinker(UnifiedCacheLinker):
    """Device KV pool <-> NVMe for SGLang's unified radix cache (see the module docstring)."""

    def __init__(self, server_args: Any, params: Any, *, components: Any = None,
                 extra_config: Optional[Mapping[str, Any]] = None, forward_stream: Any = None,
                 **kwargs: Any) -> None:
        self.forward_stream = forward_stream
        names = {getattr(c, "name", str(c)) for c in (components or ())}
        if names - {"FULL"}:
            raise ConfigError(f"GDSLinker stores the full-attention KV only; components {sorted(names - {'FULL'})} "
                              f"(SWA, Mamba, ...) are not supported yet")
        if getattr(params, "mtp_draft_device_pools", ()) or getattr(params, "sidecar_draft_device_pools", ()):
            raise ConfigError("GDSLinker: speculative-decoding draft KV pools are not stored yet")
        extra = dict(extra_config or {})
        self.staging_bytes = parse_size(extra.pop("staging_bytes", "128M"), key="staging_bytes")
        self.gather_below = parse_size(extra.pop("gather_below", GATHER_BELOW), key="gather_below")
        self.read_run = parse_size(extra.pop("read_run", READ_RUN), key="read_run")
        depth = extra.pop("depth", 2)
        if isinstance(depth, bool) or not str(depth).isdigit() or not 1 <= int(depth) <= 16:
            raise ConfigError(f"GDSLinker: depth={depth!r}: expected an integer from 1 to 16 (IO steps in flight)")
        self.depth = int(depth)
        cfg = load_config(extra)
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.dev = DevicePages(kvcache, self.page_size)
        self.kind = MemKind.VRAM if self.dev.device.type == "cuda" else MemKind.DRAM
        topo = server_topology(server_args, params, self.dev.kind == "mla")
        if topo.dcp_size > 1:
            raise ConfigError("GDSLinker does not serve decode context parallelism (dcp_size > 1)")
        self.scheme = KeyScheme.from_storage_config(topo)
        ident = namespace_identity(self.scheme, "kv", self.dev.geometry)
        if topo.is_mla_model and topo.tp_rank > 0:
            ident["replica"] = str(topo.tp_rank)
        page_bytes = self.dev.table.page_bytes
        self.store_page_bytes = align_up(page_bytes, ALIGN)
        if self.store_page_bytes != page_bytes:
            ident["padded"] = "1"
        self.store = open_store(self.store_page_bytes, ident, config=cfg, mem_kinds=(self.kind,))
        try:
            self._setup()
        except BaseException:
            self.store.close()
            raise
        self.pools = {_KV: kvcache}
        self.layer_done_counter = LayerWiseLoadCounter(self.dev.num_layers)
        self.pending_loads: dict[str, _Load] = {}
        self._loadq: Queue = Queue()
        self._offq: Queue = Queue()
        self._results: Queue = Queue()
        self._closed = False
        work = (("load", self._loadq, self._load_batch), ("offload", self._offq, self._offload))
        self._threads = [threading.Thread(target=self._loop, args=(q, fn), daemon=True, name=f"hicache-gds-linker-{n}")
                         for n, q, fn in work]
        for t in self._threads:
            t.start()
        st = self.store.stats()
        log.info("hicache-gds linker: %s pool, %d layers, %d-token pages of %d bytes (%s); %s: %s; engine %s: %s (%s); "
                 "namespace %s", self.dev.kind.upper(), self.dev.num_layers, self.page_size, page_bytes,
                 self.dev.geometry["dtype"], self.plan.mode, self.plan.reason, st["engine"], st["path"],
                 st["engine_reason"], st["namespace"])

    def _setup(self) -> None:
        caps = self.store.capabilities
        self.plan = plan_io(self.dev.table, self.dev.bases, gather_below=self.gather_below,
                            align=max(caps.alignment, 1), max_descs=caps.max_descs, read_run=self.read_run)
        if self.plan.mode == "direct":
            seen = set()
            for b in self.dev.buffers:  # the pool's allocations, once each (MHA K/V halves share one)
                st = b.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    self.store.register_memory(st.data_ptr(), st.nbytes(), self.kind)
        self._stages: dict[str, torch.Tensor] = {}
        self._putter = ThreadPoolExecutor(self.depth, thread_name_prefix="hicache-gds-linker-put")
        self._graveyard: list[torch.Tensor] = []  # staging a timed-out read may still write: never reused
        self._streams = {n: torch.cuda.Stream(self.dev.device) if self.kind is MemKind.VRAM else None
                         for n in ("load", "offload")}
        self._stats = Counters(("load_batches", "load_pages", "load_failures", "offloads", "offload_pages",
                                "offload_failures", "load_bytes", "offload_bytes", "checksum_mismatches"))
        self._lat = {"load": deque(maxlen=4096), "offload": deque(maxlen=4096)}
        self._lock = threading.Lock()
        self.copy_impl = "torch"
        if self.plan.mode == "gather" and self.kind is MemKind.VRAM:  # compile now, not in the first request
            shapes = [(self.store.slot_bytes, self.dev.table.offsets, None)]
            shapes += [(g.stage_bytes, g.stage_offsets, g.segments) for g in self.plan.groups[:1]]
            self.copy_impl = choose_impl(self.dev.buffers, self.page_size, shapes)


    # -- SGLang's calls (scheduler thread) -------------------------------------------------------
    def lookup(self, rid: str, transfers: list) -> list[int]:
        """Every restorable prefix length in pages: 1 .. the longest run of stored pages."""
        kv = _kv(transfers)
        if kv is None or not kv.keys:
            return []
        return list(range(1, self.store.prefix(self.scheme.keys(list(kv.keys))) + 1))

    def load(self, rid: str, transfers: list) -> bool:
        """Queue a load of the KV transfer; decided on the transfer alone (every rank agrees)."""
        kv = _kv(transfers)
        if self._closed or kv is None or not kv.keys or kv.device_indices is None \
                or kv.device_indices.numel() != len(kv.keys) * self.page_size:
            return False
        if rid in self.pending_loads:
            raise RuntimeError(f"GDSLinker: a load for rid={rid} is already queued")
        self.pending_loads[rid] = _Load(rid, self.scheme.keys(list(kv.keys)), kv.device_indices)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending_loads.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        """Start the queued loads; -1 when there are none."""
        if not self.pending_loads:
            return -1
        batch, self.pending_loads = list(self.pending_loads.values()), {}
        index = self.layer_done_counter.update_producer()
        ready = None
        if self.kind is MemKind.VRAM:  # the indices, and the slots' previous users, are ordered before it
            ready = torch.cuda.Event()
            ready.record()
        self._loadq.put((index, batch, ready))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    def offload(self, transfers: list, session_id: Optional[str] = None) -> bool:
        """Queue the KV pages for writing; one result per accepted offload, in order."""
        kv = _kv(transfers)
        if self._closed or kv is None or not kv.keys or kv.device_indices is None:
            return False
        events = self.record_offload_ready() if self.kind is MemKind.VRAM else []
        self._offq.put((self.scheme.keys(list(kv.keys)), kv.device_indices, events))
        return True

    def num_completed_offloads(self) -> int:
        return self._results.qsize()

    def pop_completed_offload(self) -> bool:
        return self._results.get_nowait()

    def reset(self) -> None:
        """Finish every transfer in flight and drop queued work and results; stored pages stay."""
        self.pending_loads.clear()
        self._loadq.join()
        self._offq.join()
        while True:
            try:
                self._results.get_nowait()
            except Empty:
                break
        self.layer_done_counter.reset()

    def close(self) -> None:
        """Quiesce, stop the threads, close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.reset()
        for q in (self._loadq, self._offq):
            q.put(None)
        for t in self._threads:
            t.join(timeout=self.store.config.io_timeout + 10)
        log.info("hicache-gds linker stats: %s", self.stats())
        self._putter.shutdown(wait=True)
        self.store.close()

    def stats(self) -> dict[str, Any]:
        """Counters, p50/p99 latencies (ms), the IO plan and the engine path that ran."""
        with self._lock:
            out: dict[str, Any] = self._stats.snapshot()
            for op, lat in self._lat.items():
                if lat:
                    v = np.sort(np.fromiter(lat, dtype=np.float64)) * 1e3
                    out[f"{op}_p50_ms"], out[f"{op}_p99_ms"] = float(v[len(v) // 2]), float(v[int(len(v) * 0.99)])
        st = self.store.stats()
        out.update(mode=self.plan.mode, plan=self.plan.reason, layer_groups=len(self.plan.groups),
                   copies=self.copy_impl, engine=st["engine"], path=st["path"], engine_reason=st["engine_reason"],
                   namespace=st["namespace"], page_bytes=self.dev.table.page_bytes,
                   store_page_bytes=self.store_page_bytes)
        return out

    # -- worker threads --------------------------------------------------------------------------
    def _loop(self, q: Queue, fn: Any) -> None:
        if self.kind is MemKind.VRAM:
            torch.cuda.set_device(self.dev.device)
        while True:
            task = q.get()
            try:
                if task is None:
                    return
                fn(*task)
            except BaseException:  # noqa: BLE001 -- the task reported its own failure; keep serving
                log.exception("hicache-gds linker: worker task failed")
            finally:
                q.task_done()

    def _stage(self, name: str, nbytes: int, size: int) -> torch.Tensor:
        """A 4 KiB-aligned staging buffer of >= `size` bytes on the pool's device, registered once."""
        buf = self._stages.get(name)
        if buf is None or buf.numel() < nbytes:
            size = align_up(max(nbytes, size), ALIGN)
            raw = torch.zeros(size + ALIGN, dtype=torch.uint8, device=self.dev.device)  # no stale bytes in padding
            off = (-raw.data_ptr()) % ALIGN
            buf = raw[off:off + size]
            self.store.register_memory(buf.data_ptr(), buf.numel(), self.kind)
            old = self._stages.get(name)
            if old is not None:  # outgrown, and idle (this worker is its only user)
                self.store.deregister_memory(old.data_ptr())
            self._stages[name] = buf
        return buf

    def _wait(self, transfers: list, deadline: float, quiet: bool = False) -> None:
        """Wait for every transfer (never past `deadline`); raise the first error unless `quiet`."""
        first: BaseException | None = None
        for t in transfers:
            try:
                t.wait(max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001
                first = first or exc
            finally:
                t.release()
        if first is not None and not quiet:
            raise first

    def _load_batch(self, index: int, batch: list[_Load], ready: Any) -> None:
        t0 = time.perf_counter()
        keys = [k for ld in batch for k in ld.keys]
        lease: Lease | None = None
        # Steps in flight: a ring of `depth`, step k reusing step k - depth's staging buffer, so that
        # step is finished (its bytes scattered) before step k is posted. A step leaves the ring
        # before it is finished; `_finish_read` waits for and releases its transfers either way.
        ring: deque = deque()
        try:
            if ready is not None:
                ready.synchronize()
            starts = torch.cat([self.dev.starts(ld.indices) for ld in batch])
            lease = self.store.lease(keys)
            missing = int((~lease.present | (lease.nbytes != self.store_page_bytes)).sum())
            if missing:
                raise LookupError(f"{missing} of {len(keys)} pages are no longer stored (evicted after lookup)")
            n, steps = len(keys), []
            for g, grp in enumerate(self.plan.groups):
                per = max(1, (self.staging_bytes // self.depth) // max(grp.stage_bytes, 1))
                steps += [(g, a, min(a + per, n)) for a in range(0, n, per)]

            def landed() -> None:  # before the last layers complete: a caller of finish() sees the stats
                with self._lock:
                    self._stats.add(load_batches=1, load_pages=n, load_bytes=n * self.dev.table.page_bytes)
                    self._lat["load"].append(time.perf_counter() - t0)

            for k, step in enumerate(steps):
                if len(ring) == self.depth:
                    self._finish_read(index, *ring.popleft(), starts, n)
                ring.append((step, k % self.depth, self._post_read(step, k % self.depth, starts, lease)))
            verify = ((lambda: self._verify_loaded(lease, starts)) if self.store.config.verify or not lease.protected
                      else None)
            while ring:
                done = ring.popleft()
                self._finish_read(index, *done, starts, n, *((None, None) if ring else (landed, verify)))
        except BaseException as exc:
            timed_out = isinstance(exc, TransferTimeout)
            self._wait([t for _, _, ts in ring for t in ts], time.monotonic() + self.store.config.io_timeout,
                       quiet=True)
            if timed_out:  # the IO may still land in staging: retire it (still registered, never freed)
                self._graveyard += [self._stages.pop(f"load{i}") for i in range(self.depth) if f"load{i}" in self._stages]
            with self._lock:
                self._stats.add(load_failures=1)
            log.warning("hicache-gds linker: load of %d pages for %s failed: %s: %s", len(keys),
                        ",".join(ld.rid for ld in batch)[:200], type(exc).__name__, exc)
            self.layer_done_counter.fail(index, exc)
        finally:
            if lease is not None:
                lease.release()

    def _verify_loaded(self, lease: Lease, starts: torch.Tensor) -> None:
        """Check every page of a load where it landed against its checksum (on the GPU for device
        pools; `PageStore.page_checksums`), before the batch's last layers are reported. A page that
        fails is dropped from the store and the load fails, so SGLang aborts its requests before
        their output is used (the forward may have read the layers that landed first: a failure is
        reported, never hidden)."""
        segs = tuple(range(len(self.dev.table.row_bytes)))
        addrs = self.dev.seg_addrs(starts, segs)
        lens = np.broadcast_to(np.array(self.dev.table.seg_bytes, dtype=np.uint64), addrs.shape).copy()
        expect = lease.checksums
        got = self.store.page_checksums(Pages(addrs, lens, self.kind), like=expect)
        bad = np.flatnonzero((got != expect) & (expect != 0))
        if not bad.size:
            return
        with self._lock:
            self._stats.add(checksum_mismatches=int(bad.size))
        try:
            lease.reject(bad)
        except OSError as exc:
            log.warning("hicache-gds linker: %s", exc)
        raise LookupError(f"{bad.size} of {len(lease)} loaded pages failed their checksum where they landed "
                          f"(dropped from the store)")

    def _post_read(self, step: tuple[int, int, int], slot: int, starts: torch.Tensor, lease: Lease) -> list:
        g, a, b = step
        grp = self.plan.groups[g]
        if self.plan.mode == "direct":
            addrs = self.dev.seg_addrs(starts[a:b], grp.segments)
            lens = np.broadcast_to(np.array([self.dev.table.seg_bytes[s] for s in grp.segments], dtype=np.uint64),
                                   addrs.shape)
            offs = np.array([self.dev.table.offsets[s] for s in grp.segments], dtype=np.uint64)
        else:
            stage = self._stage(f"load{slot}", (b - a) * grp.stage_bytes, self.staging_bytes // self.depth)
            row = np.arange(b - a, dtype=np.uint64).reshape(-1, 1) * np.uint64(grp.stage_bytes)
            pos = np.cumsum([0] + [n for _, n in grp.runs[:-1]]).astype(np.uint64)
            addrs = np.uint64(stage.data_ptr()) + row + pos
            lens = np.broadcast_to(np.array([n for _, n in grp.runs], dtype=np.uint64), addrs.shape)
            offs = np.array([o for o, _ in grp.runs], dtype=np.uint64)
        foff = lease.offsets[a:b].reshape(-1, 1) + offs
        mem = np.stack([addrs.ravel(), np.ascontiguousarray(lens).ravel()], axis=1)
        fil = np.stack([np.repeat(lease.file_ids[a:b], addrs.shape[1]), foff.ravel()], axis=1)
        return lease.post(Op.READ, self.kind, mem, fil)

    def _finish_read(self, index: int, step: tuple[int, int, int], slot: int, transfers: list,
                     starts: torch.Tensor, n: int, landed: Any = None, verify: Any = None) -> None:
        g, a, b = step
        grp = self.plan.groups[g]
        self._wait(transfers, time.monotonic() + self.store.config.io_timeout)
        if self.plan.mode == "gather":
            stage = self._stages[f"load{slot}"][: (b - a) * grp.stage_bytes].view(b - a, grp.stage_bytes)
            self._copy(scatter_pages, "load", starts[a:b], stage, grp.stage_offsets, grp.segments)
        if b == n:  # the group's last chunk: its layers are in device memory
            if verify is not None:  # the batch's last step: every page has landed; its last layers wait
                verify()
            if landed is not None:
                landed()
            for layer in grp.layers:
                self.layer_done_counter.complete(index, layer)

    def _copy(self, fn: Any, stream: str, starts: torch.Tensor, stage: torch.Tensor, offsets: Any,
              segments: Any) -> None:
        s = self._streams[stream]
        if s is None:
            fn(self.dev.buffers, starts, self.page_size, stage, offsets, segments, impl=self.copy_impl)
            return
        with torch.cuda.stream(s):
            fn(self.dev.buffers, starts, self.page_size, stage, offsets, segments, impl=self.copy_impl)
        s.synchronize()  # report (or write) only once the copies are done

    def _offload_staged(self, keys: list[str], starts: torch.Tensor, todo: list[int]) -> bool:
        """Gather pages into `depth` staging buffers in turn, each written by its own `put`, so the
        disk always has the next chunk queued while one finishes (a lone put drains at its end)."""
        stride, table = self.store.slot_bytes, self.dev.table
        per = max(1, (self.staging_bytes // self.depth) // stride)
        wait_s = self.store.config.io_timeout * 2 + 30  # put bounds its own IO; this bounds the thread
        futs: deque = deque()
        ok = True
        try:
            for c, a in enumerate(range(0, len(todo), per)):
                if len(futs) == self.depth:  # the buffer about to be refilled is free once its put returns
                    ok = futs.popleft().result(timeout=wait_s) and ok
                idx = todo[a:a + per]
                stage = self._stage(f"offload{c % self.depth}", len(idx) * stride, self.staging_bytes // self.depth)
                stage = stage[: len(idx) * stride].view(len(idx), stride)
                self._copy(gather_pages, "offload", starts[idx], stage, table.offsets, None)
                rows = np.arange(len(idx), dtype=np.uint64).reshape(-1, 1)
                addrs = np.uint64(stage.data_ptr()) + rows * np.uint64(stride)
                lens = np.full_like(addrs, self.store_page_bytes)
                futs.append(self._putter.submit(
                    lambda k, p: all(self.store.put(k, p)), [keys[i] for i in idx], Pages(addrs, lens, self.kind)))
        finally:
            while futs:  # never leave a put reading a buffer we may refill
                try:
                    ok = futs.popleft().result(timeout=wait_s) and ok
                except Exception as exc:  # noqa: BLE001 -- that chunk failed; the others still count
                    log.warning("hicache-gds linker: offload chunk failed: %s: %s", type(exc).__name__, exc)
                    ok = False
        return ok

    def _offload(self, keys: list[str], indices: torch.Tensor, events: list) -> None:
        t0 = time.perf_counter()
        ok = False
        try:
            for ev in events:
                ev.synchronize()
            starts = self.dev.starts(indices)
            if len(starts) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(starts)} device pages")
            todo = [i for i, present in enumerate(self.store.exists(keys)) if not present]
            ok, table = True, self.dev.table
            if self.plan.mode == "direct" and todo:
                segs = tuple(range(len(table.row_bytes)))
                addrs = self.dev.seg_addrs(starts[todo], segs)
                lens = np.broadcast_to(np.array(table.seg_bytes, dtype=np.uint64), addrs.shape).copy()
                ok = all(self.store.put([keys[i] for i in todo], Pages(addrs, lens, self.kind)))
            elif todo:
                ok = self._offload_staged(keys, starts, todo)
            with self._lock:
                self._stats.add(offloads=1, offload_pages=len(todo), offload_bytes=len(todo) * table.page_bytes,
                                offload_failures=int(not ok))
                self._lat["offload"].append(time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001 -- reported as a failed offload
            ok = False
            with self._lock:
                self._stats.add(offload_failures=1)
            log.warning("hicache-gds linker: offload of %d pages failed: %s: %s", len(keys), type(exc).__name__, exc)
        finally:
            self._results.put(ok)

