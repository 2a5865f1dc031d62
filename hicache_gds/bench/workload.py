"""A job's memory and its IO pattern over a store: `Buffers` (source and destination pages,
random bytes, their hashes) and `Workload` (which pages each IO moves, under which keys)."""

from __future__ import annotations

import math
import time

import numpy as np
import xxhash

from ..engines.base import MemKind
from ..layout import Pages
from ..memory import HostBuffer, view
from ..store import PageStore
from .options import JobOptions, PageGeometry
from .raw import Outcome, fill_random

__all__ = ["Buffers", "Workload"]


class Buffers:
    """Source (random bytes) and destination pages of one job run, registered with the store."""

    def __init__(self, store: PageStore, mem: str, geometry: PageGeometry, nbuf: int, seed: int,
                 dst: bool = True) -> None:
        self.nbuf, self.geometry = nbuf, geometry
        self.seg = np.asarray(geometry.segments, dtype=np.uint64)
        planes = self.seg * np.uint64(nbuf)
        self.plane_off = np.cumsum(planes) - planes
        self.nbytes = nbuf * geometry.page_bytes
        self.kind = MemKind.VRAM if mem == "vram" else MemKind.DRAM
        self._store, self._keep = store, {}
        if self.kind is MemKind.VRAM:
            import torch
            g = torch.Generator(device="cuda").manual_seed(seed)
            self._keep = {"src": torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, device="cuda",
                                               generator=g)}
            if dst:
                self._keep["dst"] = torch.full((self.nbytes,), 0xEE, dtype=torch.uint8, device="cuda")
            self.base = {k: t.data_ptr() for k, t in self._keep.items()}
        else:
            self._keep = {k: HostBuffer(self.nbytes, pinned=mem == "pinned") for k in ("src", "dst")[:1 + dst]}
            fill_random(self._keep["src"].addr, self.nbytes, seed)
            if dst:                        # touch every page before timing
                self._keep["dst"].numpy().fill(0xEE)
            self.base = {k: b.addr for k, b in self._keep.items()}
        for addr in self.base.values():
            store.register_memory(addr, self.nbytes, self.kind)
        self._src_hash: np.ndarray | None = None

    def pages(self, which: str, idx: np.ndarray) -> Pages:
        """Pages `idx` of the source or destination buffer."""
        idx = np.asarray(idx, dtype=np.uint64).reshape(-1, 1)
        addrs = np.uint64(self.base[which]) + self.plane_off.reshape(1, -1) + idx * self.seg.reshape(1, -1)
        return Pages(addrs, np.broadcast_to(self.seg, addrs.shape).copy(), self.kind)

    def page_hash(self, which: str, p: int) -> int:
        h = xxhash.xxh3_64()
        pages = self.pages(which, np.array([p]))
        for addr, n in zip(pages.addrs[0].tolist(), pages.lens[0].tolist()):
            if self.kind is MemKind.VRAM:
                t = self._keep[which]
                off = addr - self.base[which]
                h.update(t[off:off + n].cpu().numpy().tobytes())
            else:
                h.update(view(addr, n))
        return h.intdigest()

    def src_hashes(self) -> np.ndarray:
        if self._src_hash is None:
            self._src_hash = np.array([self.page_hash("src", p) for p in range(self.nbuf)], dtype=np.uint64)
        return self._src_hash

    def close(self) -> None:
        for addr in self.base.values():
            self._store.deregister_memory(addr)
        for b in self._keep.values():
            if isinstance(b, HostBuffer):
                b.close()
        self._keep = {}


class Workload:
    """Which keys and buffer pages IO number j moves (see the module docstring)."""

    def __init__(self, opts: JobOptions, store: PageStore, bufs: Buffers, npages: int,
                 gen_write: int, gen_read: int | None, seed: int, job: int | None = None) -> None:
        """`job`: only that job's IOs (a job process of `--numjobs`); None: every job's."""
        self.opts, self.store, self.bufs, self.npages = opts, store, bufs, npages
        self.job = job
        self.batch, self.njobs = min(opts.batch_size, npages), opts.numjobs if job is None else 1
        self.nb = math.ceil(npages / self.batch)
        self.nios = self.nb * self.njobs
        self.gen_write, self.gen_read = gen_write, gen_read
        self.page_bytes = bufs.geometry.page_bytes
        self.random = opts.rw.startswith("rand")
        rng = np.random.default_rng(seed)
        self.order = rng.permutation(npages) if self.random else np.arange(npages)
        total = npages * opts.numjobs  # drawn alike in every job process: the same bytes per key
        self.src_page = (rng.integers(0, bufs.nbuf, total) if self.random
                         else np.arange(total) % bufs.nbuf)
        self.is_read = (rng.random(self.nios) * 100 < opts.rwmixread if opts.rw == "randrw"
                        else np.full(self.nios, "read" in opts.rw))
        nthreads = opts.iodepth * self.njobs
        self.rngs = [np.random.default_rng([seed, t]) for t in range(nthreads)]

    def where(self, j: int) -> tuple[int, int, np.ndarray]:
        """(job, pass, page indices) of IO number j."""
        k, c = divmod(j, self.njobs)
        loop, b = divmod(k, self.nb)
        return c if self.job is None else self.job, loop, self.order[b * self.batch:(b + 1) * self.batch]

    @staticmethod
    def keys(c: int, gen: int, idx: np.ndarray) -> list[str]:
        return [f"c{c}.g{gen}.{i}" for i in idx.tolist()]

    def expected(self) -> np.ndarray:
        """xxh3 of every key this workload writes, by global page index."""
        return self.bufs.src_hashes()[self.src_page]

    def io(self, j: int, t: int) -> Outcome:
        t0 = time.perf_counter_ns()
        c, loop, idx = self.where(j)
        n = len(idx)
        if self.is_read[j % self.nios]:
            keys = self.keys(c, self.gen_read, idx)
            # Thread t owns pages t, t+T, t+2T, ...: concurrent reads never share a destination
            # page (the store hashes a page after reading it). Random: its pages in random order,
            # scattered over the whole buffer; sequential: a contiguous region of its own.
            nthreads = len(self.rngs)
            dst = (self.rngs[t].permutation(self.batch)[:n] * nthreads + t if self.random
                   else t * self.batch + np.arange(n))
            pages = self.bufs.pages("dst", dst)
            t1 = time.perf_counter_ns()
            ok = self.store.get(keys, pages)
            ddir = "read"
        else:
            keys = self.keys(c, self.gen_write + loop, idx)
            pages = self.bufs.pages("src", self.src_page[c * self.npages + idx])
            t1 = time.perf_counter_ns()
            ok = self.store.put(keys, pages)
            ddir = "write"
        return Outcome(ddir, n * self.page_bytes, t1 - t0, time.perf_counter_ns() - t1, n - sum(ok))
