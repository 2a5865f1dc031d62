"""Run benchmark jobs against `PageStore`s: what `hicache-gds-bench` measures.

One IO is one `PageStore.put` (write) or `get` (read) of `batch` pages of the job's page geometry
(`--model`/`--layout`, or one `bs`-byte segment). `iodepth` threads per job keep that many batches
in flight (the store is thread-safe); `numjobs` jobs are processes, as in fio: each opens the one
namespace with its own `PageStore` and moves its own keys, and they are reported together (like
fio's `group_reporting`; `jobs.py`). Per IO: slat = building the
keys and page descriptors, clat = the store call, lat = both.

Keys: job c, pass "generation" g, page i is `c{c}.g{g}.{i}`. Writes always write a fresh
generation (the store never rewrites a present key); reads read the generation a previous job of
the same shape left behind (`write` then `read` shares the store), or one written first, untimed.
Sequential modes take keys in order into consecutive buffer pages; random modes take keys in a
random order and random pages of the buffer. Buffers hold `iodepth * batch` pages per job, laid
out as one plane per segment (segment s of page p at `plane[s] + p * seg[s]`, the way SGLang's
host pools keep K and V apart), source pages filled with random bytes. With `--verify` the
expected xxh3 of every written key is kept, and after the measured phase the job's keys are read
back and compared: a page the store cannot return (its checksum turns corruption into a miss) or
whose bytes differ is a verify error (fio's `err=84`, EILSEQ).
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import math
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..config import Config
from ..engines import engine_class
from ..engines.base import MemKind
from ..engines.cufile_env import gpu_present
from ..errors import ConfigError, EngineUnavailable
from ..memory import align_up
from ..store import PageStore
from .options import JobOptions, OptionError
from .raw import (Bars, Measured, Plan, RawFile, drive, drop_caches, has_reads, run_fio, run_phase, run_raw,
                  scratch_root)
from .report import JobResult
from .workload import Buffers, Workload

__all__ = ["Session", "DEFAULT_SIZE"]

DEFAULT_SIZE = 1 << 30
"""Bytes per job when the job gives no `size`."""
_COUNTERS = ("pages_written", "pages_read", "hits", "misses", "put_failed", "get_failed",
             "checksum_mismatches", "timeouts", "staged_pages")


def _total_bw(summary: dict) -> float:
    return float(sum((summary.get(d) or {}).get("bw_bytes") or 0 for d in ("read", "write")))


@dataclass
class _Entry:
    """An open store of the session and which generation of keys it holds in full."""

    store: PageStore
    capacity_pages: int
    spec: dict[str, Any] = field(default_factory=dict)   # how another process opens the same namespace
    dataset: int | None = None
    next_gen: int = 0
    expected: dict[int, np.ndarray] = field(default_factory=dict)   # gen -> xxh3 per key



class Session:
    """Directories, open stores and baseline files shared by the jobs of one run.

    `run(job, engines)` measures one job (one sweep point) on each engine, then the raw and fio
    baselines, and returns one `JobResult` per engine that ran, each with its ratios. Engines
    that cannot run are recorded in `skipped` (or raise, with `strict`). `close()` closes the
    stores and removes every file and directory the session created.
    """

    def __init__(self, *, bars: Bars | None = None, log: Callable[[str], None] | None = None,
                 fio: str | None = None) -> None:
        self.bars, self.log, self.fio = bars, log or (lambda s: None), fio
        self.skipped: list[dict[str, str]] = []
        self.cache_methods: set[str] = set()
        self._dirs: dict[str | None, list[str]] = {}
        self._created: list[str] = []
        self._stores: dict[tuple, _Entry] = {}
        self._raw: dict[tuple, RawFile] = {}

    # -- places ------------------------------------------------------------------------------
    def directories(self, opts: JobOptions) -> list[str]:
        """Temporary directories (one per root) of `opts.directory`, GDS_PATH or a scratch disk."""
        spec = opts.directory
        if spec not in self._dirs:
            from ..tools.doctor import o_direct_ok
            if spec:
                roots = [r for r in spec.replace(",", ":").split(":") if r]
            else:
                roots = list(Config.load().gds_path) or [scratch_root()]
            made = []
            for root in roots:
                if not os.path.isdir(root):
                    raise OptionError(f"--directory: {root} is not a directory", "directory")
                d = tempfile.mkdtemp(prefix="hicache-gds-bench.", dir=root)
                self._created.append(d)
                ok, why = o_direct_ok(d)
                if opts.direct and not ok:
                    raise OptionError(f"--directory: {root} does not support O_DIRECT ({why}); use a "
                                      f"directory on a real disk, or --direct=0", "directory")
                made.append(d)
            self._dirs[spec] = made
        return self._dirs[spec]

    def _cold(self, files: list[str]) -> str:
        how = drop_caches(files)
        self.cache_methods.add(how)
        return how

    # -- stores ------------------------------------------------------------------------------
    @staticmethod
    def _precheck(engine: str, mem: str) -> None:
        if mem == "vram" and not gpu_present():
            raise EngineUnavailable("--mem=vram needs a CUDA GPU, and none is visible")
        if engine == "auto":
            return
        try:
            cls = engine_class(engine)
        except ValueError as exc:
            raise OptionError(f"--engine: {exc}", "engine") from None
        if cls.traits.remote:
            raise OptionError(f"--engine: {engine} moves pages to page servers' memory, not files", "engine")
        if cls.traits.needs_gpu and not gpu_present():
            raise EngineUnavailable(f"{engine}: no CUDA GPU is visible, and "
                                    + ("cuFile hangs without one" if cls.traits.uses_cufile else "it needs one"))

    def _store(self, opts: JobOptions, engine: str, dirs: list[str], total: int, need: int) -> _Entry:
        g = opts.geometry
        key = (engine, tuple(dirs), g.segments, opts.mem, opts.direct, total)
        e = self._stores.get(key)
        if e is not None and e.capacity_pages >= need:
            return e
        if e is not None:
            self._drop(key)
        slot = align_up(g.page_bytes)
        self._make_room(dirs, need * slot)
        cfg = {"gds_path": list(dirs), "capacity": need * slot, "engine": engine, "direct_io": opts.direct}
        ident = {"bench": "hicache-gds-bench", "engine": engine, "segments": ",".join(map(str, g.segments)),
                 "mem": opts.mem, "pages": total, "capacity": need}
        kinds = (MemKind.VRAM,) if opts.mem == "vram" else (MemKind.DRAM,)
        store = PageStore(g.page_bytes, ident, config=cfg, mem_kinds=kinds)
        spec = {"page_bytes": g.page_bytes, "identity": ident, "config": cfg, "kinds": [k.value for k in kinds]}
        self._stores[key] = e = _Entry(store, need, spec)
        return e

    def _make_room(self, dirs: list[str], nbytes: int) -> None:
        """Close and delete cached stores, oldest first, until `dirs` have room for `nbytes`
        more (plus 5%): later jobs then write their data again instead of failing on ENOSPC."""
        def room() -> int:
            return min(os.statvfs(d).f_bavail * os.statvfs(d).f_frsize for d in dirs) * len(dirs)
        while self._stores and room() < nbytes * 1.05:
            self._drop(next(iter(self._stores)))

    def _drop(self, key: tuple) -> None:
        store = self._stores.pop(key).store
        store.close()
        for d in store.dirs:
            shutil.rmtree(d, ignore_errors=True)

    # -- running -----------------------------------------------------------------------------
    def run(self, opts: JobOptions, engines: Sequence[str], *, strict: bool = False,
            before_verify: Callable[[PageStore, list[str]], None] | None = None) -> list[JobResult]:
        """Measure one job point on `engines`, then its baselines; see the class docstring."""
        g = opts.geometry
        npages = (opts.size or DEFAULT_SIZE) // g.page_bytes
        if npages < 1:
            raise OptionError(f"--size: {opts.size} bytes hold no page of {g.page_bytes} bytes", "size")
        dirs = self.directories(opts)
        results = []
        for engine in engines:
            try:
                self._precheck(engine, opts.mem)
                r = self._run_engine(opts, engine, dirs, npages, len(engines) > 1, before_verify)
            except (EngineUnavailable, ConfigError) as exc:
                if strict or isinstance(exc, OptionError):
                    raise
                why = str(exc).removeprefix(f"{engine}: ")
                if not any(s["engine"] == engine and s["reason"] == why for s in self.skipped):
                    self.log(f"hicache-gds-bench: skipping engine {engine}: {why}")
                self.skipped.append({"job": opts.name, "engine": engine, "reason": why})
                continue
            results.append(r)
        if results:
            self._baselines(opts, dirs, align_up(g.page_bytes), npages, results)
        return results

    def _run_engine(self, opts: JobOptions, engine: str, dirs: list[str], npages: int, multi: bool,
                    before_verify: Callable[[PageStore, list[str]], None] | None) -> JobResult:
        nj, batch, threads = opts.numjobs, opts.batch_size, opts.iodepth * opts.numjobs
        total = nj * npages
        need = total + threads * batch + total // 64 + 16
        if opts.rw == "randrw":
            need += math.ceil(total * (100 - opts.rwmixread) / 100)
        entry = self._store(opts, engine, dirs, total, need)
        store = entry.store
        seed = opts.randseed if opts.randseed is not None else 0x5EED
        nbuf = opts.iodepth * min(batch, npages)  # per job: each job process has its own
        bufs = Buffers(store, opts.mem, opts.geometry, nbuf, seed, dst=has_reads(opts.rw) or bool(opts.verify))
        label = f"{opts.name} {engine}"
        try:
            prefilled, cache = False, None
            known = entry.dataset is not None and (not opts.verify or entry.dataset in entry.expected)
            if has_reads(opts.rw) and not known:
                gen = entry.next_gen
                entry.next_gen += 1
                fill = Workload(dataclasses.replace(opts, rw="write"), store, bufs, npages, gen, None, seed)
                pm = run_phase(threads, Plan(fill.nios), fill.io, self.bars, f"{label} prefill",
                               total * fill.page_bytes)
                if pm.failed["write"]:
                    raise OSError(errno.EIO, f"{engine}: prefill wrote only {total - pm.failed['write']} "
                                             f"of {total} pages")
                entry.dataset, prefilled = gen, True
                if opts.verify:
                    entry.expected[gen] = fill.expected()
            if has_reads(opts.rw) and opts.drop_caches:
                cache = self._cold(list(store.slabs.paths))
            work = Workload(opts, store, bufs, npages, entry.next_gen, entry.dataset, seed)
            os.sync()                      # earlier jobs' dirty pages must not flush during this one
            s0, t_start = store.stats(), time.time()
            if nj == 1:
                m = run_phase(threads, Plan.of(opts, work.nios), work.io, self.bars, label,
                              work.nios and total * work.page_bytes)
                s1 = store.stats()
                per_job = [m.issued]
            else:  # each job process runs its own passes: they need not end on the same one
                m, s1, per_job = self._run_processes(opts, entry, bufs, npages, work, seed, label)
            loops = max(math.ceil(i / work.nb) for i in per_job)
            if opts.rw in ("write", "randwrite", "randrw") and loops:
                if opts.verify:            # xxh3 of the source pages: computed only when asked
                    entry.expected.update(dict.fromkeys(range(work.gen_write, work.gen_write + loops),
                                                        work.expected()))
                entry.next_gen = work.gen_write + loops
            # Jobs that loop on their own evict one another's pages (LRU): a job whose last pass
            # ends before the others' may lose part of it (`_verify` counts those as evicted).
            racing = nj > 1 and opts.time_based and s1.get("evictions", 0) > s0.get("evictions", 0)
            if opts.rw in ("write", "randwrite"):  # every job wrote every page of its last pass
                complete = len(set(per_job)) == 1 and per_job[0] % work.nb == 0 and not racing
                entry.dataset = work.gen_write + loops - 1 if complete and loops else None
            elif opts.rw == "randrw" and loops > 1:
                entry.dataset = None          # later writes may have evicted part of it
            evictable = s1.get("evictions", 0) - s0.get("evictions", 0) if racing else 0
            verify = (self._verify(opts, entry, work, per_job, before_verify, evictable)
                      if opts.verify and m.issued else None)
        finally:
            bufs.close()
        return self._result(opts, engine, multi, m, s0, s1, t_start, prefilled, cache, verify, dirs,
                            threads, work)

    def _run_processes(self, opts: JobOptions, entry: _Entry, bufs: Buffers, npages: int, work: Workload,
                       seed: int, label: str) -> tuple[Measured, dict, list[int]]:
        """The measured phase as `numjobs` processes on the namespace (`jobs.run_jobs`): job 0 here."""
        from .jobs import run_jobs
        store = entry.store
        mine = Workload(opts, store, bufs, npages, work.gen_write, work.gen_read, seed, job=0)
        spec = dict(entry.spec, opts=opts, nbuf=bufs.nbuf, seed=seed, dst="dst" in bufs.base, npages=npages,
                    gen_write=work.gen_write, gen_read=work.gen_read, counters=_COUNTERS + ("evictions",))
        limit = (opts.ramp_time or 0) + (opts.runtime or 0) + 3600
        m, theirs, issued = run_jobs(spec, lambda: run_phase(opts.iodepth, Plan.of(opts, mine.nios), mine.io, self.bars,
                                                     f"{label} (job 0 of {opts.numjobs})",
                                                     mine.nios and npages * mine.page_bytes), limit, _job_main)
        s1 = dict(store.stats())
        for k, v in theirs.items():
            s1[k] = s1.get(k, 0) + v
        return m, s1, issued

    def _verify(self, opts: JobOptions, entry: _Entry, work: Workload, per_job: list[int],
                before_verify: Callable[[PageStore, list[str]], None] | None,
                evictable: int = 0) -> dict[str, Any]:
        """Re-read what the job wrote (writes) or read (reads) and compare with the expected xxh3.

        `evictable`: how many pages the store evicted while jobs that loop on their own raced (see
        `_run_engine`); up to that many pages of a job's last pass that are no longer in the store
        are `evicted` (reported, not failed). A page that is there must have the right bytes."""
        if opts.rw in ("write", "randwrite"):
            # Each job's last pass: job c's i-th IO is IO number i * numjobs + c (`Workload.where`).
            nj = work.njobs
            todo = []
            for c, issued in enumerate(per_job):
                if not issued:
                    continue
                last = (issued - 1) // work.nb
                todo += [(i * nj + c, work.gen_write + last) for i in range(last * work.nb, issued)]
        else:
            todo = [(j, work.gen_read) for j in range(work.nios)]
        batches = []
        for j, gen in todo:
            c, _, idx = work.where(j)
            batches.append((work.keys(c, gen, idx), c * work.npages + idx, gen))
        if before_verify is not None:
            before_verify(entry.store, [k for keys, _, _ in batches for k in keys])
        bad: list[str] = []
        missing = mismatched = checked = evicted = 0
        for keys, gidx, gen in batches:
            if evictable or opts.rw == "randrw":  # only the pages still there are read back
                present = entry.store.exists(keys)
                sel = [i for i, p in enumerate(present) if p]
                gone = len(keys) - len(sel)
                if evictable and gone and evicted + gone <= evictable:
                    evicted += gone
                elif opts.rw != "randrw":  # gone beyond what the store evicted: read, and fail, them all
                    sel = list(range(len(keys)))
                keys, gidx = [keys[i] for i in sel], gidx[sel]
            if not keys:
                continue
            dst = np.arange(len(keys))
            ok = entry.store.get(keys, work.bufs.pages("dst", dst))
            expect = entry.expected[gen][gidx]
            for n, (key, good) in enumerate(zip(keys, ok)):
                checked += 1
                if not good:
                    missing += 1
                    bad.append(key)
                elif work.bufs.page_hash("dst", n) != int(expect[n]):
                    mismatched += 1
                    bad.append(key)
        return {"pages": checked, "failed": missing + mismatched, "unreadable": missing,
                "mismatched": mismatched, "evicted": evicted, "bad_keys": bad[:8], "hash": "xxh3_64"}

    def _result(self, opts: JobOptions, engine: str, multi: bool, m: Measured, s0: dict, s1: dict,
                t_start: float, prefilled: bool, cache: str | None, verify: dict | None,
                dirs: list[str], threads: int, work: Workload) -> JobResult:
        delta = {k: s1.get(k, 0) - s0.get(k, 0) for k in _COUNTERS}
        delta["evictions"] = s1.get("evictions", 0) - s0.get("evictions", 0)
        err, why = 0, []
        if m.failed["write"]:
            err, why = errno.EIO, why + [f"{m.failed['write']} page(s) not written"]
        lost = delta["get_failed"] + delta["checksum_mismatches"] + (delta["misses"] if opts.rw != "randrw" else 0)
        if m.failed["read"] and lost:
            err, why = errno.EIO, why + [f"{lost} page(s) not read ({delta['misses']} missing, "
                                         f"{delta['checksum_mismatches']} failed the checksum)"]
        if verify and verify["failed"]:
            err = errno.EILSEQ
            why.append(f"verify: {verify['failed']} of {verify['pages']} page(s) bad ({verify['unreadable']} "
                       f"unreadable or failed the store checksum, {verify['mismatched']} with wrong bytes), "
                       f"first {verify['bad_keys'][0]}")
        name = f"{opts.name}[{engine}]" if multi else opts.name
        shown = dataclasses.replace(opts, name=name, engine=engine) if multi else opts
        ours = {"engine": s1.get("engine"), "engine_requested": opts.engine, "path": s1.get("path"),
                "engine_reason": s1.get("engine_reason"), "gpu_direct": s1.get("gpu_direct"),
                "direct_io": s1.get("direct_io"), "slot_bytes": s1.get("slot_bytes"),
                "pages": work.npages * opts.numjobs, "ios_per_pass": work.nios, "threads": threads,
                "passes": m.issued / work.nios if work.nios else 0.0, "directory": dirs,
                "prefilled": prefilled, "cache": cache, "store": delta, "verify": verify,
                "slat": "building keys and page descriptors", "clat": "PageStore.put/get of one batch"}
        n = m.total_ios
        return JobResult(shown, read=m.read, write=m.write, usr_cpu=m.usr_cpu, sys_cpu=m.sys_cpu,
                         ctx=m.ctx, majf=m.majf, minf=m.minf, error=err, error_text="; ".join(why),
                         members=opts.numjobs, elapsed_s=m.wall_ns / 1e9, job_start_ms=int(t_start * 1000),
                         iodepth_counts=dict(m.depths), submit_counts={1: n} if n else None,
                         complete_counts={1: n} if n else None, hicache_gds=ours)

    def _baselines(self, opts: JobOptions, dirs: list[str], slot: int, npages: int,
                   results: list[JobResult]) -> None:
        """Raw O_DIRECT and fio on the same pattern; ratios into every result's hicache_gds block."""
        base: dict[str, Any] = {}
        total = npages * opts.numjobs
        for r in results:
            r.hicache_gds.update(ratio_to_raw=None, ratio_to_fio=None)
        if opts.raw:
            key = (dirs[0], slot, total, opts.direct)
            raw = self._raw.get(key) or self._raw.setdefault(key, RawFile(dirs[0], slot, total, opts.direct))
            m, details = run_raw(opts, raw, bars=self.bars, cold=self._cold if opts.drop_caches else None)
            base["raw"] = {**details, **m.summary()}
        if opts.fio is not False and (opts.fio or self.fio or shutil.which("fio")):
            if has_reads(opts.rw) and opts.drop_caches:
                self._cold(glob.glob(os.path.join(dirs[0], "fioref.*")))
            bar = self.bars(f"{opts.name} fio (libaio)", None) if self.bars else None
            try:
                base["fio"] = run_fio(opts, dirs[0], slot, npages, exe=self.fio)
            finally:
                if bar is not None:
                    bar.close()
        for r in results:
            ours = {"read": {"bw_bytes": r.read.bw_bytes}, "write": {"bw_bytes": r.write.bw_bytes}}
            mine = _total_bw(ours)
            r.hicache_gds["baseline"] = base
            r.hicache_gds["ratios"] = {}
            for name, b in base.items():
                theirs = _total_bw(b)
                r.hicache_gds[f"ratio_to_{name}"] = mine / theirs if theirs and mine else None
                for ddir in ("read", "write"):
                    tb = (b.get(ddir) or {}).get("bw_bytes")
                    if tb and ours[ddir]["bw_bytes"]:
                        r.hicache_gds["ratios"][f"{ddir}_vs_{name}"] = ours[ddir]["bw_bytes"] / tb

    def close(self) -> None:
        """Close every store and remove everything the session created. Idempotent."""
        for e in self._stores.values():
            try:
                e.store.close()
            except Exception as exc:  # noqa: BLE001 -- cleanup goes on
                self.log(f"hicache-gds-bench: closing a store: {exc}")
        self._stores.clear()
        for raw in self._raw.values():
            raw.close()
        self._raw.clear()
        for d in self._created:
            shutil.rmtree(d, ignore_errors=True)
        self._created.clear()
        self._dirs.clear()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _job_main(spec: dict[str, Any], job: int, barrier: Any, q: Any) -> None:
    """One spawned job of `--numjobs` (`jobs.run_jobs` says what it must do): open the namespace,
    build its share of the workload, run it, report."""
    from .jobs import START_TIMEOUT_S
    store = bufs = None
    try:
        opts = spec["opts"]
        store = PageStore(spec["page_bytes"], spec["identity"], config=spec["config"],
                          mem_kinds=tuple(MemKind(k) for k in spec["kinds"]))
        bufs = Buffers(store, opts.mem, opts.geometry, spec["nbuf"], spec["seed"], dst=spec["dst"])
        work = Workload(opts, store, bufs, spec["npages"], spec["gen_write"], spec["gen_read"], spec["seed"], job=job)
        s0 = store.stats()
        barrier.wait(START_TIMEOUT_S)
        m = drive(opts.iodepth, Plan.of(opts, work.nios), work.io)
        s1 = store.stats()
        q.put((job, m, {k: s1.get(k, 0) - s0.get(k, 0) for k in spec["counters"]}, None))
    except BaseException:  # noqa: BLE001 -- reported to the runner, which raises it
        barrier.abort()
        q.put((job, None, None, traceback.format_exc()[-3000:]))
    finally:
        if bufs is not None:
            bufs.close()
        if store is not None:
            store.close()
