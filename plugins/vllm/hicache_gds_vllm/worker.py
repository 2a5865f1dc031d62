"""`HiCacheGDSWorker`: moves chunks between vLLM's KV cache and this rank's page stores.

One worker per GPU worker process. At start it opens one `PageStore` per KV-cache group (the
namespace of engine identity + rank + group, shared with the same rank of every other engine of
the same model and layout on the node: any number of processes write one namespace) and registers vLLM's KV tensors with it once: as VRAM when they are on a GPU (the
store's `auto` picks NIXL GDS where cuFile works, else its bounce engine through pinned host
buffers), as DRAM when they are host tensors (CPU runs and tests: NIXL POSIX or bounce).

`submit_store` / `submit_load` never block: they record a CUDA event on the current stream (so
the IO starts only after the compute that wrote, or the zeroing that cleared, those blocks) and
queue the job. Two IO threads run jobs in order: one for stores and ordinary loads, one for
expedited (in-step) loads so they never queue behind a long store. Each job's chunks become one
`Pages` batch per group (`regions.py`): one page = one chunk, segments = per-layer block regions,
merged where block ids are consecutive.

Failure contract. A failed store never reaches vLLM (which asserts success): the job is reported
done, and its failed keys are appended to this rank's failure log first, so the manager does not
commit them. A failed load cannot be hidden (vLLM would compute from garbage): it is logged with
the keys and reported as a failed job, which vLLM 0.33 turns into an error.
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

from hicache_gds import MemKind, Pages, PageStore
from hicache_gds.memory import HostBuffer, align_up

from .regions import GroupGeometry, chunks_for, coalesce, plan_group, scratch_bytes_needed
from .sidecar import FailureLog
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
        for refs in kv_caches.group_data_refs:
            ts = [tensors[r.tensor_idx] for r in refs]
            self.geos.append(GroupGeometry.build([t.data_ptr() for t in ts],
                                                 [t.stride(0) * t.element_size() for t in ts],
                                                 [r.page_size_bytes for r in refs], self.bpc))
        scratch = sum(scratch_bytes_needed(g) for g in self.geos)
        self._scratch = {name: _Scratch(scratch, self.kind, self.device) for name in ("main", "expedited")}
        self.stores: list[PageStore] = []
        try:
            for pos, geo in enumerate(self.geos):
                ident = dict(spec.identity, rank=self.rank, group=pos, ref_pages=geo.ref_page.tolist())
                cfg = spec.hicache.replace(capacity=spec.capacity_chunks * align_up(geo.page_bytes),
                                           source=f"vLLM: {spec.capacity_chunks} chunks per rank and group, as the "
                                                  f"scheduler and every worker agreed")
                store = PageStore(geo.page_bytes, ident, config=cfg, mem_kinds=(self.kind,))
                self.stores.append(store)
                for addr, nbytes in self._regions(tensors):
                    store.register_memory(addr, nbytes, self.kind)
        except BaseException:
            self._close_stores()
            raise
        spec.sidecar.write_stores(self.rank, {pos: st.dirs[0] for pos, st in enumerate(self.stores)})
        self._failures = FailureLog(spec.sidecar.failure_log(spec.config.engine_id, self.rank))
        self._mu = threading.Lock()
        self._pending: dict[int, _Job] = {}
        self._results: deque[TransferResult] = deque()
        self._queues = {name: queue.Queue() for name in self._scratch}
        self._threads = [threading.Thread(target=self._loop, args=(name,), name=f"hicache-gds-vllm-{name}", daemon=True)
                         for name in self._queues]
        for t in self._threads:
            t.start()
        log.info("hicache-gds-vllm rank %d: %d group store(s), %d chunks each, pages of %s bytes; %s",
                 self.rank, len(self.stores), spec.capacity_chunks, [g.page_bytes for g in self.geos],
                 self.stores[0].engine_reason)

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
        # docstring inherited
        with self._mu:
            jobs = [self._pending[j] for j in job_ids if j in self._pending]
        for job in jobs:
            job.done.wait()

    def drain(self) -> None:
        """Block until every submitted job has finished (tests, benchmarks, shutdown)."""
        with self._mu:
            ids = set(self._pending)
        self.wait(ids)

    def shutdown(self) -> None:
        # docstring inherited
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=max(60.0, self.spec.hicache.io_timeout * 2))
        self._close_stores()
        self._failures.remove()

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

    def _submit(self, job: _Job, lane: str) -> None:
        if self.kind is MemKind.VRAM:
            import torch
            job.event = torch.cuda.Event()
            job.event.record(torch.cuda.current_stream(self.device))
        with self._mu:
            self._pending[job.job_id] = job
        self._queues[lane].put(job)

    def _loop(self, lane: str) -> None:
        q, scratch = self._queues[lane], self._scratch[lane]
        while (job := q.get()) is not None:
            t0 = time.perf_counter()
            try:
                nbytes, ok = self._run(job, scratch)
            except Exception as exc:  # noqa: BLE001 -- reported below, per the failure contract
                log.error("hicache-gds-vllm rank %d: %s job %d failed: %s: %s", self.rank,
                          "store" if job.store else "load", job.job_id, type(exc).__name__, exc)
                nbytes, ok = 0, False
                if job.store:
                    self._failures.append(job.keys)
            res = TransferResult(job.job_id, ok or job.store, nbytes, time.perf_counter() - t0)
            with self._mu:
                self._results.append(res)
                del self._pending[job.job_id]
            job.done.set()

    def _run(self, job: _Job, scratch: _Scratch) -> tuple[int, bool]:
        """Run one job; return (bytes of KV moved, every chunk succeeded)."""
        if job.store:
            self._apply_drops(job)
        if job.event is not None:
            job.event.synchronize()
        nbytes, failed = 0, []
        for pos, keys, plan in self._plans(job, scratch):
            store = self.stores[pos]
            for rows, addrs, lens in coalesce(plan.addrs, plan.lens):
                pages = Pages(addrs, lens, self.kind)
                sub = [keys[i] for i in rows]
                res = store.put(sub, pages) if job.store else store.get(sub, pages)
                real = plan.real[rows]
                plan_lens = plan.lens[rows]
                for i, ok in enumerate(res):
                    if ok:
                        nbytes += int(plan_lens[i][real[i]].sum())
                    else:
                        failed.append(sub[i])
        if failed:
            if job.store:
                self._failures.append(failed)  # before the job is reported: see manager.py
                log.warning("hicache-gds-vllm rank %d: store job %d: %d of %d chunks not written",
                            self.rank, job.job_id, len(failed), len(job.keys))
            else:
                log.error("hicache-gds-vllm rank %d: load job %d: %d of %d chunks missing or unreadable "
                          "(first %s); vLLM cannot recover a failed load", self.rank, job.job_id, len(failed),
                          len(job.keys), failed[0])
        return nbytes, not failed

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
        """(group position, keys, ChunkPlan) per group of the job, in vLLM's order."""
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
            want = self.spec.config.groups[pos].group_id
            if len(keys) != c or any(int(k[-8:], 16) != want for k in keys):
                raise ValueError(f"job {job.job_id}: group {pos} needs {c} keys of group {want}, got {keys[:3]}...")
            plan = plan_group(self.geos[pos], ids[bpos:bpos + n], skip, scratch.addr + soff, scratch.nbytes - soff)
            soff += int(plan.lens[~plan.real].sum())
            kpos, bpos = kpos + c, bpos + n
            yield pos, keys, plan
        if kpos != len(job.keys) or bpos != len(ids):
            raise ValueError(f"job {job.job_id}: {len(job.keys)} keys / {len(ids)} blocks, used {kpos} / {bpos}")
