"""`HiCacheGDSWorker`: moves chunks between vLLM's KV cache and this rank's page stores.

One worker per GPU worker process. At start it opens one `PageStore` per KV-cache group (the
namespace of engine identity + rank + group, shared with the same rank of every other engine of
the same model and layout on the node: any number of processes write one namespace) and registers vLLM's KV tensors with it once: as VRAM when they are on a GPU (the
store's `auto` picks NIXL GDS where cuFile works, else its bounce engine through pinned host
buffers), as DRAM when they are host tensors (CPU runs and tests: NIXL POSIX or bounce).

`submit_store` / `submit_load` never block: they record a CUDA event on vLLM's current stream
(`vllm.utils.torch_utils.current_stream`, the stream the model runner computes on; vLLM's own
CPU offloading orders its copies after the same stream) and queue the job. The IO thread starts
a job only once that event has completed -- so a store never reads a block before the compute
that writes it has finished, and a load never writes one before the work queued on it -- and
gives up after `io_timeout` (the job fails; it never waits unbounded). Two IO threads run jobs in
order: one for stores and ordinary loads, one for expedited (in-step) loads so they never queue
behind a long store. Each job's chunks become one
`Pages` batch per group (`regions.py`): one page = one chunk, segments = per-layer block regions,
merged where block ids are consecutive.

Failure contract. A failed store never reaches vLLM (which asserts success): the job is reported
done, and its failed keys are appended to this rank's failure log first, so the manager does not
commit them. A failed load (a missing page, EIO, a checksum mismatch, a timeout) is never hidden:
its keys go to the failure log and are dropped from the store (so they are stored afresh later),
and then -- under `HiCacheGDSConnector`, whose scheduler recomputes blocks that failed to load --
the job is reported done and the GPU blocks of the failed chunks are handed to the connector
(`take_load_errors`); under vLLM's plain `OffloadingConnector`, which has no such path, the job
is reported failed (vLLM stops on it rather than compute from garbage).

Shutdown stops taking jobs, finishes the one in flight (bounded by `io_timeout`), fails the
queued ones, and closes the stores, which deregisters vLLM's KV memory from every engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker,
                                     TransferResult)

from hicache_gds import HostBuffer, MemKind, Pages, Store, align_up, open_store

from . import compat
from .regions import GroupGeometry, chunk_blocks, chunks_for, coalesce, plan_group, scratch_bytes_needed
from .sidecar import FAULT, LOAD_OK, FailureLog
from .shared import HiCacheLoadSpec, HiCacheStoreSpec, SpecView

__all__ = ["HiCacheGDSWorker"]

log = logging.getLogger("hicache_gds_vllm")


@dataclass
class _Job:
    job_id: int
    store: bool
    keys: list[str]
    gpu: GPULoadStoreSpec
    drops: list[str] = field(default_factory=list)
    clear: bool = False
    event: Any = None  # torch.cuda.Event recorded at submit, or None for host tensors
    done: threading.Event = field(default_factory=threading.Event)
    cancel: threading.Event = field(default_factory=threading.Event)  # `wait` gave up: start no more IO


class _Scratch:
    """Memory for the sub-blocks of partial chunks; one per IO thread, registered with every store."""

    def __init__(self, nbytes: int, kind: MemKind, device: Any) -> None:
        self.nbytes = nbytes
        self._keep: Any = None
        self.addr = 0
        if nbytes == 0:
            return
        if kind is MemKind.VRAM:
            import torch
            t = torch.empty(nbytes + 4096, dtype=torch.uint8, device=device)
            self._keep, self.addr = t, t.data_ptr() + (-t.data_ptr()) % 4096
        else:
            self._keep = HostBuffer(nbytes, pinned=False)
            self.addr = self._keep.addr


class HiCacheGDSWorker(OffloadingWorker):
    """OffloadingWorker over hicache-gds page stores (one per KV-cache group on this rank)."""

    def __init__(self, spec: SpecView, kv_caches: CanonicalKVCaches) -> None:
        self.spec = spec
        self.rank = spec.config.parallel.rank
        self.bpc = spec.blocks_per_chunk
        tensors = [t.tensor for t in kv_caches.tensors]
        if not tensors:
            raise ValueError("vLLM registered no KV cache tensors")
        self.kind = MemKind.VRAM if tensors[0].is_cuda else MemKind.DRAM
        self.device = tensors[0].device
        if len(kv_caches.group_data_refs) != len(spec.config.groups):
            raise ValueError(f"{len(kv_caches.group_data_refs)} KV groups registered, "
                             f"{len(spec.config.groups)} configured")
        self.geos: list[GroupGeometry] = []
        self.handed: list[str] = []  # per group: how vLLM handed its KV over (compat.handed_layout)
        for refs, g in zip(kv_caches.group_data_refs, spec.config.groups):
            ts = [tensors[r.tensor_idx] for r in refs]
            self.geos.append(GroupGeometry.build([t.data_ptr() for t in ts],
                                                 [t.stride(0) * t.element_size() for t in ts],
                                                 [r.page_size_bytes for r in refs], self.bpc))
            self.handed.append(compat.handed_layout(len(refs), len(g.layer_names)))
        scratch = sum(scratch_bytes_needed(g) for g in self.geos)
        self._scratch = {name: _Scratch(scratch, self.kind, self.device) for name in ("main", "expedited")}
        self.stores: list[Store] = []
        try:
            for pos, geo in enumerate(self.geos):
                # The layout handed over is part of the namespace: 0.26's cross-layer blocks and per-layer
                # views order a chunk's bytes differently and must never share pages.
                ident = dict(spec.identity, rank=self.rank, group=pos, handed=self.handed[pos],
                             ref_pages=geo.ref_page.tolist())
                cfg = spec.hicache.replace(capacity=spec.capacity_chunks * align_up(geo.page_bytes),
                                           source=f"vLLM: {spec.capacity_chunks} chunks per rank and group, as the "
                                                  f"scheduler and every worker agreed")
                store = open_store(geo.page_bytes, ident, config=cfg, mem_kinds=(self.kind,))
                self.stores.append(store)
                for addr, nbytes in self._regions(tensors):
                    store.register_memory(addr, nbytes, self.kind)
        except BaseException:
            self._close_stores()
            raise
        spec.sidecar.write_stores(self.rank, {pos: st.dirs[0] for pos, st in enumerate(self.stores)},
                                  spec.config.engine_id)
        self._failures = FailureLog(spec.sidecar.failure_log(spec.config.engine_id, self.rank))
        self._mu = threading.Lock()
        self._pending: dict[int, _Job] = {}
        self._results: deque[TransferResult] = deque()
        self._load_errors: set[int] = set()  # GPU blocks of failed loads, for the connector
        self._held = False  # a load failed as a whole (FAULT logged) and none has succeeded since
        self._closing = False
        self.stats = {"load_jobs_failed": 0, "load_chunks_failed": 0, "store_chunks_failed": 0,
                      "fence_timeouts": 0, "cancelled": 0}
        self._queues = {name: queue.Queue() for name in self._scratch}
        self._threads = [threading.Thread(target=self._loop, args=(name,), name=f"hicache-gds-vllm-{name}", daemon=True)
                         for name in self._queues]
        for t in self._threads:
            t.start()
        log.info("hicache-gds-vllm rank %d: %d group store(s), %d chunks each, pages of %s bytes, KV handed %s; %s",
                 self.rank, len(self.stores), spec.capacity_chunks, [g.page_bytes for g in self.geos],
                 ",".join(self.handed), self.stores[0].engine_reason)
        if self.handed == ["per-layer"] and compat.KV_HANDOFF.startswith("cross-layer"):
            # vLLM 0.26 allocates one cross-layer tensor only in its V1 model runner; the V2 runner,
            # its default for dense models, registers per-layer views (a TODO in vLLM).
            log.warning("hicache-gds-vllm rank %d: vLLM handed per-layer KV views: a chunk is %d regions (layers x "
                        "blocks) where one cross-layer region per block would do. On vLLM 0.26 set "
                        "VLLM_USE_V2_MODEL_RUNNER=0: its V1 model runner hands a single-group model on FlashAttention "
                        "one cross-layer tensor", self.rank, self.geos[0].segments)

    # -- OffloadingWorker ----------------------------------------------------------------------
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        # docstring inherited
        if not isinstance(dst_spec, HiCacheStoreSpec):
            raise TypeError(f"store job {job_id}: expected HiCacheStoreSpec, got {type(dst_spec).__name__}")
        self._submit(_Job(job_id, True, dst_spec.keys, src_spec, dst_spec.drops, dst_spec.clear), "main")
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        # docstring inherited
        if not isinstance(src_spec, HiCacheLoadSpec):
            raise TypeError(f"load job {job_id}: expected HiCacheLoadSpec, got {type(src_spec).__name__}")
        self._submit(_Job(job_id, False, src_spec.keys, dst_spec), "expedited" if expedited else "main")
        return True

    def get_finished(self) -> list[TransferResult]:
        # docstring inherited
        with self._mu:
            out = list(self._results)
            self._results.clear()
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Block until the jobs are done (vLLM reuses their blocks next). Bounded: a job still
        running after its fence and one IO could have taken (2 x `io_timeout`) is cancelled -- it
        starts no further IO, its chunks fail -- and waited for until its IO in flight ends (the
        store bounds that by `io_timeout`), so no IO touches the blocks once this returns."""
        with self._mu:
            jobs = [self._pending[j] for j in job_ids if j in self._pending]
        deadline = time.monotonic() + 2 * self.spec.hicache.io_timeout
        for job in jobs:
            if job.done.wait(max(0.0, deadline - time.monotonic())):
                continue
            log.error("hicache-gds-vllm rank %d: %s job %d not done after %.0f s; cancelling it", self.rank,
                      "store" if job.store else "load", job.job_id, 2 * self.spec.hicache.io_timeout)
            job.cancel.set()
            if not job.done.wait(self.spec.hicache.io_timeout + 5.0):
                log.critical("hicache-gds-vllm rank %d: job %d still in IO after its timeout; its blocks may be "
                             "reused while it runs", self.rank, job.job_id)

    def drain(self) -> None:
        """Block until every submitted job has finished (tests, benchmarks, shutdown)."""
        with self._mu:
            ids = set(self._pending)
        self.wait(ids)

    def take_load_errors(self) -> set[int]:
        """GPU block ids of loads that failed since the last call (reported done under
        `spec.recover_failed_loads`); `HiCacheGDSConnector.get_block_ids_with_load_errors`."""
        with self._mu:
            out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        """Fail the jobs not started, finish the ones in flight, close the stores (deregistering
        vLLM's KV memory) and remove this engine's side files. Idempotent; never waits unbounded."""
        if self._closing:
            return
        self._closing = True
        for q in self._queues.values():
            q.put(None)
        limit = time.monotonic() + 2 * self.spec.hicache.io_timeout + 5.0
        for t in self._threads:
            t.join(timeout=max(0.0, limit - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:  # an IO the store could not time out: leave the engines to the process's exit
            log.critical("hicache-gds-vllm rank %d: IO threads %s still busy at shutdown; stores left open",
                         self.rank, alive)
            return
        self._close_stores()
        self.spec.sidecar.forget_engine(self.spec.config.engine_id, self.rank)

    # -- internals -----------------------------------------------------------------------------
    def _regions(self, tensors: list[Any]) -> list[tuple[int, int]]:
        """KV tensors and scratch as maximal contiguous spans: a merged segment may cross from one
        layer's tensor into the next, and must still lie inside one registered region."""
        spans = [(t.data_ptr(), t.data_ptr() + (t.shape[0] - 1) * t.stride(0) * t.element_size()
                  + t.shape[1] * t.element_size()) for t in tensors]
        spans += [(s.addr, s.addr + s.nbytes) for s in self._scratch.values() if s.nbytes]
        out: list[list[int]] = []
        for a, b in sorted(spans):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return [(a, b - a) for a, b in out]

    def _close_stores(self) -> None:
        for st in self.stores:
            st.close()

    def _fence(self) -> Any:
        """An event on the stream vLLM computes on, recorded now (None for host tensors): work
        queued on that stream before this call -- the forward that wrote the blocks of a store, the
        zeroing of a load's blocks -- has finished once it `query()`s True."""
        if self.kind is not MemKind.VRAM:
            return None
        import torch
        try:
            from vllm.utils.torch_utils import current_stream
            stream = current_stream()
        except ImportError:
            stream = torch.cuda.current_stream(self.device)
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _await_fence(self, job: _Job) -> None:
        """Wait for the job's fence, polling, at most `io_timeout` (a GPU that never gets there
        fails the job instead of hanging the IO thread)."""
        ev = job.event
        if ev is None:
            return
        deadline = time.monotonic() + self.spec.hicache.io_timeout
        pause = 20e-6
        while not ev.query():
            if time.monotonic() > deadline or job.cancel.is_set():
                self.stats["fence_timeouts"] += 1
                raise TimeoutError(f"the GPU work queued before {'store' if job.store else 'load'} job {job.job_id} "
                                   f"did not finish within {self.spec.hicache.io_timeout:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _submit(self, job: _Job, lane: str) -> None:
        job.event = self._fence()
        with self._mu:
            self._pending[job.job_id] = job
        self._queues[lane].put(job)

    def _loop(self, lane: str) -> None:
        q, scratch = self._queues[lane], self._scratch[lane]
        while (job := q.get()) is not None:
            t0 = time.perf_counter()
            bad_blocks: set[int] = set()
            fault = None
            try:
                if self._closing:
                    self.stats["cancelled"] += 1
                    raise RuntimeError("the worker is shutting down")
                nbytes, failed, bad_blocks = self._run(job, scratch)
                unreadable = not job.store
            except Exception as exc:  # noqa: BLE001 -- reported below, per the failure contract
                log.error("hicache-gds-vllm rank %d: %s job %d failed: %s: %s", self.rank,
                          "store" if job.store else "load", job.job_id, type(exc).__name__, exc)
                nbytes, failed, unreadable = 0, list(job.keys), False  # the pages themselves may be fine
                bad_blocks = {int(b) for b in np.asarray(job.gpu.block_ids).tolist()}
                fault = f"{type(exc).__name__}: {exc}"
            ok = self._settle(job, failed, bad_blocks, unreadable, fault)
            res = TransferResult(job.job_id, ok, nbytes, time.perf_counter() - t0)
            with self._mu:
                self._results.append(res)
                del self._pending[job.job_id]
            job.done.set()

    def _settle(self, job: _Job, failed: list[str], bad_blocks: set[int], unreadable: bool,
                fault: str | None = None) -> bool:
        """Record a job's failed chunks where the manager and the connector look, before the job is
        reported; return the success vLLM is told. `unreadable`: the store could not read them (drop
        them) -- not a job that never got to read. `fault`: the job failed as a whole (the engine
        refused it, a fence timed out, shutdown): a load failing so says nothing about its pages, and
        would fail again, so the manager holds this rank's chunks back (`FAULT`) until a load of
        this rank succeeds again (`LOAD_OK`)."""
        if not failed:
            if not job.store and self._held:
                self._held = False
                self._failures.append([LOAD_OK])
                log.info("hicache-gds-vllm rank %d: load job %d succeeded: this rank's chunks are offered again",
                         self.rank, job.job_id)
            return True
        if not job.store and fault is not None:
            self._held = True
            self._failures.append(failed + [FAULT + " " + " ".join(fault.split())[:200]])
            log.warning("hicache-gds-vllm rank %d: load job %d failed as a whole (%s); this rank's chunks are held "
                        "back (recomputed) until a load succeeds again", self.rank, job.job_id, fault)
        else:
            self._failures.append(failed)  # read by the manager before it commits (stores) or keeps (loads) them
        if job.store:
            self.stats["store_chunks_failed"] += len(failed)
            log.warning("hicache-gds-vllm rank %d: store job %d: %d of %d chunks not written",
                        self.rank, job.job_id, len(failed), len(job.keys))
            return True
        self.stats["load_jobs_failed"] += 1
        self.stats["load_chunks_failed"] += len(failed)
        if unreadable:
            self._drop(failed)
        if self.spec.recover_failed_loads:
            log.warning("hicache-gds-vllm rank %d: load job %d: %d of %d chunks unreadable (first %s); their %d "
                        "blocks are recomputed", self.rank, job.job_id, len(failed), len(job.keys), failed[0],
                        len(bad_blocks))
            with self._mu:
                self._load_errors |= bad_blocks
            return True
        log.error("hicache-gds-vllm rank %d: load job %d: %d of %d chunks unreadable (first %s); vLLM's "
                  "OffloadingConnector cannot recompute them (use HiCacheGDSConnector)", self.rank, job.job_id,
                  len(failed), len(job.keys), failed[0])
        return False

    def _drop(self, keys: list[str]) -> None:
        """Remove chunks that failed to load from this rank's stores, so they are written afresh
        (a page that is missing, unreadable or fails its checksum would fail again)."""
        by_pos: dict[int, list[str]] = {}
        for k in keys:
            pos = self.spec.group_pos.get(int(k[-8:], 16))
            if pos is not None:
                by_pos.setdefault(pos, []).append(k)
        for pos, ks in by_pos.items():
            try:
                self.stores[pos].delete(ks)
            except Exception as exc:  # noqa: BLE001 -- best effort: the manager forgets them anyway
                log.warning("hicache-gds-vllm rank %d: could not drop %d unreadable chunks: %s", self.rank, len(ks),
                            exc)

    def _run(self, job: _Job, scratch: _Scratch) -> tuple[int, list[str], set[int]]:
        """Run one job; return (bytes of KV moved, keys of the chunks that failed, their GPU blocks)."""
        if job.store:
            self._apply_drops(job)
        self._await_fence(job)
        nbytes, failed, bad_blocks = 0, [], set()
        for pos, keys, plan, blocks in self._plans(job, scratch):
            store = self.stores[pos]
            for rows, addrs, lens in coalesce(plan.addrs, plan.lens):
                sub = [keys[i] for i in rows]
                if job.cancel.is_set():  # `wait` gave up on this job: no more IO into or out of its blocks
                    res = [False] * len(sub)
                else:
                    pages = Pages(addrs, lens, self.kind)
                    res = store.put(sub, pages) if job.store else store.get(sub, pages)
                real = plan.real[rows]
                plan_lens = plan.lens[rows]
                for i, ok in enumerate(res):
                    if ok:
                        nbytes += int(plan_lens[i][real[i]].sum())
                    else:
                        failed.append(sub[i])
                        bad_blocks.update(blocks[int(rows[i])])
        return nbytes, failed, bad_blocks

    def _apply_drops(self, job: _Job) -> None:
        if job.clear:
            for st in self.stores:
                st.clear()
        by_pos: dict[int, list[str]] = {}
        for k in job.drops:
            pos = self.spec.group_pos.get(int(k[-8:], 16))
            if pos is not None:
                by_pos.setdefault(pos, []).append(k)
        for pos, keys in by_pos.items():
            self.stores[pos].delete(keys)

    def _plans(self, job: _Job, scratch: _Scratch):
        """(group position, keys, ChunkPlan, GPU block ids per chunk) per group of the job, in vLLM's order."""
        gpu = job.gpu
        ids = np.asarray(gpu.block_ids)
        sizes = list(gpu.group_sizes) if gpu.group_sizes is not None else [len(ids)]
        starts = list(gpu.block_indices) if gpu.block_indices is not None else [0] * len(sizes)
        if len(sizes) != len(self.geos):
            raise ValueError(f"job {job.job_id}: {len(sizes)} groups in the GPU spec, {len(self.geos)} registered")
        kpos = bpos = soff = 0
        for pos, (n, start) in enumerate(zip(sizes, starts)):
            if n == 0:
                continue
            skip = int(start) % self.bpc
            c = chunks_for(n, skip, self.bpc)
            keys = job.keys[kpos:kpos + c]
            want = compat.group_id(self.spec.config.groups[pos], pos)
            if len(keys) != c or any(int(k[-8:], 16) != want for k in keys):
                raise ValueError(f"job {job.job_id}: group {pos} needs {c} keys of group {want}, got {keys[:3]}...")
            gids = ids[bpos:bpos + n]
            plan = plan_group(self.geos[pos], gids, skip, scratch.addr + soff, scratch.nbytes - soff)
            soff += int(plan.lens[~plan.real].sum())
            kpos, bpos = kpos + c, bpos + n
            yield pos, keys, plan, chunk_blocks(gids, skip, self.bpc)
        if kpos != len(job.keys) or bpos != len(ids):
            raise ValueError(f"job {job.job_id}: {len(job.keys)} keys / {len(ids)} blocks, used {kpos} / {bpos}")
