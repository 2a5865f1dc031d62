"""`--numjobs=N` as fio means it: N processes on one job, here N `PageStore`s on one namespace.

The runner's process opens the namespace first and runs job 0 on its own threads; jobs 1..N-1
are spawned processes (`multiprocessing` "spawn": a fresh interpreter, no NIXL agent inherited)
that open the same namespace with the same identity and configuration, build the same buffers
(same seed: identical source bytes), wait at one barrier and run their share: job c moves the
keys ``c{c}.g{gen}.*``. Their `Measured` records and store counters come back through a queue
and are merged with job 0's (fio's ``group_reporting``): bytes and IOs add up, the runtime is the
longest job's (they start together), latencies are pooled. Every wait has a timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import Counter
from typing import Any, Callable

from .raw import Measured
from .stats import DirStats, LatencyRecorder

__all__ = ["run_jobs", "merge_measured"]

START_TIMEOUT_S = 300.0  # a spawned job imports, opens the store and fills its buffers in this time


def merge_measured(parts: list[Measured]) -> Measured:
    """One record of jobs that ran side by side (see the module docstring)."""
    out = Measured()
    for ddir in ("read", "write"):
        ds = [p.dir(ddir) for p in parts]
        d = DirStats(io_bytes=sum(x.io_bytes for x in ds), total_ios=sum(x.total_ios for x in ds),
                     runtime_ns=max(x.runtime_ns for x in ds), short_ios=sum(x.short_ios for x in ds),
                     drop_ios=sum(x.drop_ios for x in ds))
        for lat in ("slat", "clat", "lat"):
            setattr(d, lat, LatencyRecorder.merged(getattr(x, lat) for x in ds))
        for x in ds:  # each job's own interval samples
            d.rate._bw_kib += x.rate._bw_kib
            d.rate._iops += x.rate._iops
        setattr(out, ddir, d)
    out.depths = sum((p.depths for p in parts), Counter())
    out.failed = sum((p.failed for p in parts), Counter())
    out.issued = sum(p.issued for p in parts)
    out.wall_ns = max(p.wall_ns for p in parts)
    for k in ("usr_cpu", "sys_cpu", "ctx", "majf", "minf"):
        setattr(out, k, sum(getattr(p, k) for p in parts))
    return out


def run_jobs(spec: dict[str, Any], local: Callable[[], Measured], timeout_s: float,
             job_main: Callable[[dict[str, Any], int, Any, Any], None]) -> tuple[Measured, dict[str, int], list[int]]:
    """Run jobs 1..numjobs-1 in spawned processes and `local` (job 0) here, started together.

    `job_main(spec, job, barrier, queue)`, a module-level function (a spawned process imports it):
    rebuilds job `job`'s share from `spec`, waits at `barrier` (`START_TIMEOUT_S`), runs it and
    puts ``(job, Measured, counter deltas, None)`` on `queue`, or ``(job, None, None, traceback)``
    after aborting the barrier. Returns the merged record,
    the spawned jobs' store counters (summed) and the IOs each job issued, job 0 first (time-based
    jobs loop on their own, so they need not end on the same pass). Raises `RuntimeError` naming
    a job that failed."""
    n = spec["opts"].numjobs
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=job_main, args=(spec, c, barrier, q), daemon=True) for c in range(1, n)]
    for p in procs:
        p.start()
    try:
        try:
            barrier.wait(START_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 -- a job failed to start: its error is on the queue
            raise RuntimeError(f"--numjobs={n}: a job process did not start: {_first_error(q)}") from exc
        mine = local()
        parts, counters, issued = [mine], Counter(), [0] * n
        issued[0] = mine.issued
        deadline = time.monotonic() + timeout_s
        for _ in procs:
            job, m, delta, err = q.get(timeout=max(1.0, deadline - time.monotonic()))
            if err is not None:
                raise RuntimeError(f"--numjobs={n}: job {job} failed:\n{err}")
            parts.append(m)
            counters.update(delta)
            issued[job] = m.issued
        return merge_measured(parts), dict(counters), issued
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)


def _first_error(q: Any) -> str:
    try:
        _, _, _, err = q.get(timeout=5)
        return err or "no error reported"
    except Exception:  # noqa: BLE001
        return "no error reported"
