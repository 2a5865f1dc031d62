"""Baselines measured in the same run as every job, and the IO loop they share with the store runs.

* `drive` is the loop of every measured phase: `nthreads` threads take IO numbers 0, 1, 2, ...
  from one counter (one thread per IO in flight, so the number of threads is the queue depth)
  until the `Plan` says stop, and record fio's per-IO statistics for the IOs issued after the ramp.
* `run_raw` is the job as plain O_DIRECT `os.pwritev`/`os.preadv` of one page per IO, with a queue
  depth of `batch * iodepth * numjobs` IOs, on a file in the same directory, moving the same bytes:
  what the disk gives a program that does nothing but IO. Every job's `ratio_to_raw` divides by it.
* `run_fio` runs real fio (libaio, the same queue depth, bs = one page slot, same directory and
  size) when fio is on PATH: the number people already trust.
* `drop_caches` empties the page cache before cold reads (as root through /proc, otherwise
  `posix_fadvise(DONTNEED)` on the files read).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from ..memory import HostBuffer, view
from .options import JobOptions, OptionError
from .report import DirStats, FioOutputError, fio_argv, fio_job_summary, parse_fio_json

__all__ = ["Plan", "Outcome", "Measured", "drive", "run_phase", "Bars", "RawFile", "run_raw", "run_fio", "drop_caches",
           "queue_depth", "has_reads", "scratch_root", "MAX_QUEUE_DEPTH", "fill_random", "DROPPED_ALL"]

MAX_QUEUE_DEPTH = 256
"""Most page IOs the raw and fio baselines keep in flight (threads for raw, iodepth for fio)."""

# fio options that only make sense for GPU engines; the libaio reference run drops them.
_FIO_GPU_ONLY = frozenset(("gpu_dev_ids", "cuda_io"))


def has_reads(rw: str) -> bool:
    """Does rw mode `rw` read (and so need data written first)?"""
    return rw in ("read", "randread", "randrw")


def queue_depth(opts: JobOptions) -> int:
    """Page IOs in flight in the baselines: one job's `batch * iodepth * numjobs`, capped."""
    return max(1, min(opts.batch_size * opts.iodepth * opts.numjobs, MAX_QUEUE_DEPTH))


def fill_random(addr: int, nbytes: int, seed: int) -> None:
    """Fill host memory with random bytes (never a zero page), 64 MiB at a time."""
    rng = np.random.default_rng(seed)
    mv = view(addr, nbytes)
    step = 64 << 20
    for off in range(0, nbytes, step):
        n = min(step, nbytes - off)
        mv[off:off + n] = rng.bytes(n)


# --------------------------------------------------------------------------- the IO loop

@dataclass(frozen=True)
class Plan:
    """When a measured phase stops.

    `nios` IOs make one pass over the data. Without `time_based` the phase issues one pass after
    the ramp (and stops early at `runtime`, if set); with it, it loops over the data until
    `runtime` has passed. IOs issued during the first `ramp` seconds are not recorded.
    """

    nios: int
    runtime: float = 0.0
    time_based: bool = False
    ramp: float = 0.0

    @classmethod
    def of(cls, opts: JobOptions, nios: int, *, measured: bool = True) -> "Plan":
        """The plan of `opts`; `measured=False` gives one plain pass (prefill)."""
        if not measured:
            return cls(nios)
        if opts.time_based and not opts.runtime:
            raise OptionError("--time_based needs --runtime (how long to loop over the data)",
                              "time_based")
        return cls(nios, opts.runtime, opts.time_based, opts.ramp_time)


@dataclass
class Outcome:
    """What one IO did: its direction ("read"/"write"), bytes moved, submission and completion
    latency (ns), and how many of its pages failed."""

    ddir: str
    nbytes: int
    slat_ns: int
    clat_ns: int
    failed: int = 0


@dataclass
class Measured:
    """The recorded IOs of one phase, fio's way, plus CPU use of the whole process."""

    read: DirStats = field(default_factory=DirStats)
    write: DirStats = field(default_factory=DirStats)
    depths: Counter = field(default_factory=Counter)
    failed: Counter = field(default_factory=Counter)
    issued: int = 0                        # IOs issued, ramp included
    wall_ns: int = 0
    usr_cpu: float = 0.0
    sys_cpu: float = 0.0
    ctx: int = 0
    majf: int = 0
    minf: int = 0

    def dir(self, ddir: str) -> DirStats:
        return self.read if ddir == "read" else self.write

    def summary(self) -> dict[str, Any]:
        """Headline numbers per active direction (the shape of `fio_job_summary`) and CPU use."""
        out: dict[str, Any] = {"usr_cpu": self.usr_cpu, "sys_cpu": self.sys_cpu}
        for ddir, d in (("read", self.read), ("write", self.write)):
            if d.total_ios:
                s = d.clat.summary((50.0, 99.0))
                out[ddir] = {"bw_bytes": d.bw_bytes, "iops": d.iops, "io_bytes": d.io_bytes,
                             "runtime_ms": d.runtime_ns // 1_000_000, "clat_mean_ns": s.mean,
                             "clat_p50_ns": s.percentiles.get(50.0), "clat_p99_ns": s.percentiles.get(99.0)}
        return out

    @property
    def total_ios(self) -> int:
        return self.read.total_ios + self.write.total_ios

    @property
    def bw_bytes(self) -> int:
        """Bytes per second over both directions (their runtimes are the phase's runtime)."""
        run = max(self.read.runtime_ns, self.write.runtime_ns)
        return (self.read.io_bytes + self.write.io_bytes) * 1_000_000_000 // run if run else 0


def drive(nthreads: int, plan: Plan, do_io: Callable[[int, int], Outcome],
          progress: Callable[[int], None] | None = None) -> Measured:
    """Run `do_io(io_number, thread_index)` on `nthreads` threads until `plan` stops; record it.

    An exception in any IO stops the phase and is raised here after every thread has finished.
    """
    m = Measured()
    lock = threading.Lock()
    ns = time.perf_counter_ns
    t0 = ns()
    t_measure = t0 + int(plan.ramp * 1e9)
    deadline = t_measure + int(plan.runtime * 1e9) if plan.runtime else None
    state = {"next": 0, "measured": 0, "inflight": 0, "first": None, "last": 0}
    errors: list[BaseException] = []
    for d in (m.read, m.write):
        d.rate.start(t_measure)

    def take() -> tuple[int, bool, int] | None:
        with lock:
            now = ns()
            if errors or (deadline is not None and now >= deadline):
                return None
            measured = now >= t_measure
            if measured and not plan.time_based and state["measured"] >= plan.nios:
                return None
            j = state["next"]
            state["next"] += 1
            state["inflight"] += 1
            if measured:
                state["measured"] += 1
                m.depths[state["inflight"]] += 1
                if state["first"] is None:
                    state["first"] = now
            return j, measured, now

    def worker(t: int) -> None:
        while True:
            got = take()
            if got is None:
                return
            j, measured, _ = got
            try:
                out = do_io(j, t)
            except BaseException as exc:  # noqa: BLE001 -- re-raised by drive()
                with lock:
                    errors.append(exc)
                    state["inflight"] -= 1
                return
            t_end = ns()
            with lock:
                state["inflight"] -= 1
                if measured:
                    d = m.dir(out.ddir)
                    d.total_ios += 1
                    d.io_bytes += out.nbytes
                    d.slat.add(out.slat_ns)
                    d.clat.add(out.clat_ns)
                    d.lat.add(out.slat_ns + out.clat_ns)
                    d.rate.add(t_end, out.nbytes)
                    m.failed[out.ddir] += out.failed
                    state["last"] = max(state["last"], t_end)
            if progress is not None:
                progress(out.nbytes)

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    threads = [threading.Thread(target=worker, args=(t,), name=f"bench-io-{t}", daemon=True)
               for t in range(max(1, nthreads))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    m.wall_ns = max(1, ns() - t0)
    if errors:
        raise errors[0]
    run = state["last"] - state["first"] if state["first"] is not None else 0
    for d in (m.read, m.write):
        d.runtime_ns = run if d.total_ios else 0
    m.issued = state["next"]
    m.usr_cpu = 100.0 * (ru1.ru_utime - ru0.ru_utime) * 1e9 / m.wall_ns
    m.sys_cpu = 100.0 * (ru1.ru_stime - ru0.ru_stime) * 1e9 / m.wall_ns
    m.ctx = (ru1.ru_nvcsw - ru0.ru_nvcsw) + (ru1.ru_nivcsw - ru0.ru_nivcsw)
    m.majf, m.minf = ru1.ru_majflt - ru0.ru_majflt, ru1.ru_minflt - ru0.ru_minflt
    return m


Bars = Callable[[str, "int | None"], Any]
"""A progress-bar factory: `bars(label, total_bytes)` -> an object with `update(n)` and `close()`."""


def run_phase(nthreads: int, plan: Plan, do_io: Callable[[int, int], Outcome],
              bars: Bars | None = None, label: str = "", total: int | None = None) -> Measured:
    """`drive` with a progress bar from `bars` (None: no bar) for the phase."""
    bar = bars(label, None if plan.time_based else total) if bars is not None else None
    try:
        return drive(nthreads, plan, do_io, bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()


# --------------------------------------------------------------------------- places and caches

def scratch_root() -> str:
    """A directory on a real disk for a temporary GDS_PATH: $TMPDIR, the current directory or
    /var/tmp, the first whose file system is not in memory and accepts O_DIRECT."""
    from ..tools.doctor import fs_info, o_direct_ok
    tried = []
    for cand in (os.environ.get("TMPDIR", ""), os.getcwd(), "/var/tmp"):
        if not cand or not os.path.isdir(cand) or not os.access(cand, os.W_OK):
            continue
        fs = fs_info(cand)
        ok, why = o_direct_ok(cand)
        if fs["fstype"] not in ("tmpfs", "ramfs") and ok:
            return os.path.realpath(cand)
        tried.append(f"{cand} ({fs['fstype']}{'' if ok else ', ' + why})")
    raise OptionError("no directory on a real disk for the benchmark; tried " + "; ".join(tried)
                      + ". Give --directory or set GDS_PATH", "directory")



DROPPED_ALL = "drop_caches=3"
"""What `drop_caches` returns where it emptied the whole page cache."""


def drop_caches(files: Iterable[str] = (), *, use_proc: bool = True) -> str:
    """Empty the page cache before a cold read; returns how, in words (`DROPPED_ALL`: everything).

    As root, `sync; echo 3 > /proc/sys/vm/drop_caches` (everything). Otherwise each file in
    `files` is synced and `posix_fadvise(POSIX_FADV_DONTNEED)`-ed, which drops its clean pages
    (files that cannot be opened are skipped). The one way the benchmarks drop caches.
    """
    if use_proc and os.access("/proc/sys/vm/drop_caches", os.W_OK):
        try:
            os.sync()                      # dirty pages are not dropped, only clean ones
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return DROPPED_ALL
        except OSError:
            pass
    n = 0
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return f"posix_fadvise(DONTNEED) on {n} file(s)"


# --------------------------------------------------------------------------- raw O_DIRECT

class RawFile:
    """The raw baseline's file: `npages` slots of `slot_bytes` in `directory`, written once.

    Kept by the session so a read job after a write job of the same shape reads what was written
    instead of writing it again; `close()` removes it.
    """

    def __init__(self, directory: str, slot_bytes: int, npages: int, direct: bool = True) -> None:
        self.path = os.path.join(directory, f"raw-{slot_bytes}x{npages}.dat")
        self.slot_bytes = slot_bytes
        self.npages = npages
        self.direct = direct
        self.written = False
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        self.fd = os.open(self.path, flags, 0o600)
        size = slot_bytes * npages
        os.ftruncate(self.fd, size)
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError:
            pass  # sparse is fine: the first pass writes every byte

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path)
            except OSError:
                pass


def _pio(write: bool, fd: int, mv: memoryview, offset: int) -> None:
    done = 0
    while done < len(mv):
        k = (os.pwritev if write else os.preadv)(fd, [mv[done:]], offset + done)
        if k <= 0:
            raise OSError(f"raw baseline: short {'write' if write else 'read'} at offset {offset}")
        done += k


def run_raw(opts: JobOptions, raw: RawFile, *, bars: Bars | None = None,
            cold: Callable[[list[str]], str] | None = None) -> tuple[Measured, dict]:
    """The job as O_DIRECT pread/pwrite of one page per IO on `raw`; returns (measured, details).

    Same rw mode, order (random = a permutation of the slots), mix, runtime and ramp as the
    job; reads first fill the file once (not measured) and call `cold(files)` before measuring.
    """
    qd = queue_depth(opts)
    slot, npages = raw.slot_bytes, raw.npages
    seed = opts.randseed if opts.randseed is not None else 0x5EED
    rng = np.random.default_rng(seed)
    order = rng.permutation(npages) if opts.rw.startswith("rand") else np.arange(npages)
    is_read = (rng.random(npages) * 100 < opts.rwmixread if opts.rw == "randrw"
               else np.full(npages, "read" in opts.rw))
    buf = HostBuffer(qd * slot, pinned=False)
    fill_random(buf.addr, buf.nbytes, seed)
    regions = [view(buf.addr + t * slot, slot) for t in range(qd)]
    details = {"path": f"{'O_DIRECT ' if raw.direct else ''}os.pwritev/os.preadv, one page per IO, "
                       f"{qd} threads", "queue_depth": qd, "file": raw.path}

    def io(write: bool, j: int, t: int) -> Outcome:
        off = int(order[j % npages]) * slot
        t0 = time.perf_counter_ns()
        _pio(write, raw.fd, regions[t], off)
        return Outcome("write" if write else "read", slot, 0, time.perf_counter_ns() - t0)

    try:
        if has_reads(opts.rw) and not raw.written:
            run_phase(qd, Plan(npages), lambda j, t: io(True, j, t), bars, "raw prefill", npages * slot)
            raw.written = True
        if has_reads(opts.rw) and cold is not None:
            details["cache"] = cold([raw.path])
        plan = Plan.of(opts, npages)
        os.sync()                          # earlier jobs' dirty pages must not flush during this one
        m = run_phase(qd, plan, lambda j, t: io(not is_read[j % npages], j, t), bars,
                      f"{opts.name} raw", npages * slot)
        if "write" in opts.rw and not plan.time_based:
            raw.written = True
        return m, details
    finally:
        buf.close()


# --------------------------------------------------------------------------- real fio

def run_fio(opts: JobOptions, directory: str, slot_bytes: int, npages: int, *,
            exe: str | None = None, timeout: float | None = None) -> dict:
    """Real fio (libaio) on the job's pattern: bs = one slot, iodepth = `queue_depth(opts)`, the
    same size, directory, rw mode and times. Returns `fio_job_summary` plus the command line, or
    `{"error": why}` when fio is missing or fails. Its files stay in `directory` for later jobs."""
    exe = exe or shutil.which("fio")
    if not exe:
        return {"error": "fio is not on PATH (apt-get install fio)"}
    qd = queue_depth(opts)
    extra = tuple((k, v) for k, v in opts.fio_passthrough if k not in _FIO_GPU_ONLY)
    if "group_reporting" not in dict(extra):
        extra += (("group_reporting", None),)
    ref = dataclasses.replace(opts, name="fioref", bs=(slot_bytes,), model=None, batch=(1,),
                              size=slot_bytes * npages, iodepth=max(1, qd // opts.numjobs),
                              directory=directory, filename=None, verify=None, fio_passthrough=extra)
    argv = [exe, *fio_argv(ref, ioengine="libaio")]
    os.sync()
    if timeout is None:
        timeout = opts.runtime + opts.ramp_time + 300 if opts.runtime else 900
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"fio did not finish in {timeout:.0f} s", "argv": argv}
    try:
        job = parse_fio_json(out.stdout)["jobs"][0]
    except (FioOutputError, IndexError, KeyError):
        tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or [f"exit status {out.returncode}"]
        return {"error": f"fio failed: {tail[0][:300]}", "argv": argv}
    summary = fio_job_summary(job)
    summary.update(ioengine="libaio", iodepth=ref.iodepth, bs=slot_bytes, argv=argv)
    if job.get("error"):
        summary["error"] = f"fio reported error {job['error']}"
    return summary
