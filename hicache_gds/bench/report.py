"""Results of `hicache-gds-bench` jobs, written the way fio writes them.

`to_fio_json` keeps fio's JSON schema and field names exactly (fio 3.33 and master, `stat.c`), so
fio tooling (fio-plot, fio_jsonplus_clat2csv, dashboards) reads our output; everything that is
ours lives in a separate `"hicache_gds"` object per job and at the top level. `to_fio_normal`
prints fio's human summary with fio's number formatting and unit selection, plus one
`hicache_gds` line per job. `parse_fio_json` reads real fio's output for the reference run.

Units as in fio: `runtime` and `job_runtime` in ms, `bw` and `bw_*` in KiB/s, `bw_bytes` in B/s,
`*_ns` latencies in ns. Unlike fio, `bw_bytes` and `iops` are computed from the exact runtime in
ns rather than from whole milliseconds (fio reports `bw_bytes` 0 for runs shorter than 1 ms).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..errors import HiCacheGDSError
from .options import JobOptions, OptionError
from .stats import DirStats, LatencyRecorder, latency_distribution

__all__ = ["DirStats", "JobResult", "FioOutputError", "to_fio_json", "to_fio_normal", "render",
           "parse_fio_json", "fio_job_summary", "fio_argv", "num2str", "bench_version"]

_DEPTH_KEYS = ("1", "2", "4", "8", "16", "32", ">=64")
_SUBMIT_KEYS = ("0", "4", "8", "16", "32", "64", ">=64")


class FioOutputError(HiCacheGDSError, ValueError):
    """Text that should hold fio's JSON output does not."""


@dataclass
class JobResult:
    """Everything measured for one job (one point of a sweep).

    `usr_cpu`/`sys_cpu` are percentages of the job's runtime, as in fio. `iodepth_counts` maps a
    queue depth to the number of IOs issued at that depth; `submit_counts`/`complete_counts` map
    IOs-per-submit (-per-reap) call to the number of calls (all optional; zeros when absent).

    `hicache_gds` holds our additions, written as the job's `"hicache_gds"` JSON object. Keys the
    reports read: `engine` (that ran), `path` (the data path that actually served, e.g.
    `"cuFile compat mode"`), `ratio_to_raw` (this job's bandwidth / the raw O_DIRECT baseline's),
    `baseline` (e.g. `{"raw": {...}, "fio": fio_job_summary(...)}`). Page geometry and the KV
    options are filled in from `options`.
    """

    options: JobOptions
    read: DirStats = field(default_factory=DirStats)
    write: DirStats = field(default_factory=DirStats)
    usr_cpu: float = 0.0
    sys_cpu: float = 0.0
    ctx: int = 0
    majf: int = 0
    minf: int = 0
    error: int = 0
    error_text: str = ""
    groupid: int = 0
    members: int = 1
    pid: int = field(default_factory=os.getpid)
    elapsed_s: float = 0.0
    job_start_ms: int = 0
    iodepth_counts: Mapping[int, int] | None = None
    submit_counts: Mapping[int, int] | None = None
    complete_counts: Mapping[int, int] | None = None
    hicache_gds: dict[str, Any] = field(default_factory=dict)

    @property
    def jobname(self) -> str:
        return self.options.name

    @property
    def directions(self) -> tuple[tuple[str, DirStats], ...]:
        return (("read", self.read), ("write", self.write))

    @property
    def runtime_ns(self) -> int:
        return max(self.read.runtime_ns, self.write.runtime_ns)


def bench_version() -> str:
    """This package's version, for fio's `"fio version"` field."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("hicache-gds")
    except (ImportError, PackageNotFoundError):
        return "0+unknown"


def _jsonable(v: Any) -> Any:
    """Plain JSON types: numpy scalars/arrays, tuples, dataclasses, paths; NaN/inf -> None."""
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _jsonable(dataclasses.asdict(v))
    if isinstance(v, (list, tuple, set, np.ndarray)):
        return [_jsonable(x) for x in (v.tolist() if isinstance(v, np.ndarray) else v)]
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, PurePath):
        return str(v)
    return v


# --------------------------------------------------------------------------- aggregation

@dataclass
class _Group:
    iobytes: dict[str, int] = field(default_factory=lambda: {"read": 0, "write": 0})
    min_run: dict[str, int] = field(default_factory=dict)       # ns
    max_run: dict[str, int] = field(default_factory=dict)
    min_bw: dict[str, int] = field(default_factory=dict)        # B/s
    max_bw: dict[str, int] = field(default_factory=dict)

    def agg(self, ddir: str) -> int:
        run = self.max_run.get(ddir, 0)
        return self.iobytes[ddir] * 1_000_000_000 // run if run else 0


def _groups(results: Sequence[JobResult]) -> dict[int, _Group]:
    groups: dict[int, _Group] = {}
    for r in results:
        g = groups.setdefault(r.groupid, _Group())
        for ddir, d in r.directions:
            if not d.runtime_ns:
                continue
            g.iobytes[ddir] += d.io_bytes
            g.min_run[ddir] = min(g.min_run.get(ddir, d.runtime_ns), d.runtime_ns)
            g.max_run[ddir] = max(g.max_run.get(ddir, 0), d.runtime_ns)
            g.min_bw[ddir] = min(g.min_bw.get(ddir, d.bw_bytes), d.bw_bytes)
            g.max_bw[ddir] = max(g.max_bw.get(ddir, 0), d.bw_bytes)
    return groups


def _dist(counts: Mapping[int, int] | None, keys: Sequence[str], bucket) -> dict[str, float]:
    """fio's stat_calc_dist: % per bucket, a non-empty bucket shows at least 0.1%."""
    acc = [0] * len(keys)
    for k, n in (counts or {}).items():
        acc[bucket(int(k))] += int(n)
    total = sum(acc)
    return {key: (max(100.0 * n / total, 0.1) if n else 0.0) if total else 0.0
            for key, n in zip(keys, acc)}


def _depth_bucket(d: int) -> int:
    return min(6, max(0, d.bit_length() - 1))            # 1, 2-3, 4-7, ... , >=64


def _submit_bucket(n: int) -> int:
    return 0 if n <= 0 else min(6, max(1, (n - 1).bit_length() - 1))   # 0, 1-4, 5-8, ..., >64


# --------------------------------------------------------------------------- JSON

def _dir_json(r: JobResult, d: DirStats, group: _Group, ddir: str, json_plus: bool) -> dict:
    plist = r.options.percentile_list
    bw, iops = d.rate.bw, d.rate.iops
    agg_kib = group.agg(ddir) / 1024.0
    bw_agg = min(100.0, bw.mean * 100.0 / agg_kib) if (bw.samples and agg_kib > 1) else (
        100.0 if bw.samples else 0.0)
    return {
        "io_bytes": d.io_bytes, "io_kbytes": d.io_bytes >> 10, "bw_bytes": d.bw_bytes,
        "bw": d.bw_bytes // 1024, "iops": d.iops, "runtime": d.runtime_ns // 1_000_000,
        "total_ios": d.total_ios, "short_ios": d.short_ios, "drop_ios": d.drop_ios,
        "slat_ns": d.slat.to_fio(None), "clat_ns": d.clat.to_fio(plist, bins=json_plus),
        "lat_ns": d.lat.to_fio(None),
        "bw_min": bw.min, "bw_max": bw.max, "bw_agg": bw_agg, "bw_mean": bw.mean,
        "bw_dev": bw.stddev, "bw_samples": bw.samples,
        "iops_min": iops.min, "iops_max": iops.max, "iops_mean": iops.mean,
        "iops_stddev": iops.stddev, "iops_samples": iops.samples,
    }


def _ours(r: JobResult) -> dict:
    o = r.options
    block: dict[str, Any] = {"engine": o.engine, "mem": o.mem, "batch": list(o.batch),
                             "model": o.model, "layout": o.layout, "page_tokens": o.page_tokens}
    try:
        g = o.geometry
        block.update(page_bytes=g.page_bytes, segments=list(g.segments))
    except OptionError:                    # a sweep was reported unexpanded: no single geometry
        pass
    block.update(r.hicache_gds)
    return _jsonable(block)


def _job_json(r: JobResult, group: _Group, json_plus: bool) -> dict:
    o = r.options
    lat_n, lat_u, lat_m = latency_distribution([r.read.clat, r.write.clat],
                                               r.read.total_ios + r.write.total_ios or None)
    job: dict[str, Any] = {
        "jobname": r.jobname, "groupid": r.groupid, "job_start": r.job_start_ms,
        "error": r.error, "eta": 0, "elapsed": int(round(r.elapsed_s)),
        "job options": o.fio_options(),
        "read": _dir_json(r, r.read, group, "read", json_plus),
        "write": _dir_json(r, r.write, group, "write", json_plus),
        "trim": _dir_json(r, DirStats(), group, "trim", json_plus),
        "sync": {"total_ios": 0, "lat_ns": LatencyRecorder().to_fio(None)},
        "job_runtime": r.runtime_ns // 1_000_000,
        "usr_cpu": float(r.usr_cpu), "sys_cpu": float(r.sys_cpu),
        "ctx": r.ctx, "majf": r.majf, "minf": r.minf,
        "iodepth_level": _dist(r.iodepth_counts, _DEPTH_KEYS, _depth_bucket),
        "iodepth_submit": _dist(r.submit_counts, _SUBMIT_KEYS, _submit_bucket),
        "iodepth_complete": _dist(r.complete_counts, _SUBMIT_KEYS, _submit_bucket),
        "latency_ns": lat_n, "latency_us": lat_u, "latency_ms": lat_m,
        "latency_depth": o.iodepth, "latency_target": 0, "latency_target_ns": 0,
        "latency_percentile": 100.0, "latency_window": 0, "latency_window_us": 0,
    }
    job["hicache_gds"] = _ours(r)
    return job


def to_fio_json(results: Sequence[JobResult],
                global_options: JobOptions | Mapping[str, Any] | None = None, *,
                json_plus: bool = False, now: float | None = None,
                extra: Mapping[str, Any] | None = None) -> dict:
    """fio's `--output-format=json` document (json+ adds latency `bins`) for `results`.

    `global_options` becomes `"global options"` (a `JobOptions` contributes its non-default
    options); `extra` is added to the top-level `"hicache_gds"` object (run-wide facts: the
    directory used, how caches were dropped, engines skipped). Returns a dict of plain JSON
    types; `json.dumps` it.
    """
    now = time.time() if now is None else now
    if isinstance(global_options, JobOptions):
        gopts = global_options.fio_options()
    else:
        gopts = {str(k): "" if v is None else str(v) for k, v in (global_options or {}).items()}
    groups = _groups(results)
    return {
        "fio version": f"hicache-gds-bench-{bench_version()}",
        "timestamp": int(now), "timestamp_ms": int(now * 1000),
        "time": time.ctime(now),
        "global options": gopts,
        "jobs": [_job_json(r, groups[r.groupid], json_plus) for r in results],
        "disk_util": [],
        "hicache_gds": {"version": bench_version(),
                        "percentiles": "exact (fio's rank rule on raw samples, not histogram buckets)",
                        "bins": "fio histogram buckets" if json_plus else None,
                        **_jsonable(dict(extra or {}))},
    }


# --------------------------------------------------------------------------- normal output

_SI = ("", "k", "M", "G", "T", "P", "E")
_IEC = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")


def num2str(num: int, maxlen: int = 4, base: int = 1, pow2: bool = False, unit: str = "") -> str:
    """fio's `num2str` (lib/num2str.c): at most `maxlen` digits, then a prefix, then `unit`."""
    thousand = 1024 if pow2 else 1000
    prefixes = _IEC if pow2 else _SI
    num = int(num)
    post = 0
    while base > 1:
        base //= thousand
        post += 1
    modulo, carry = None, False
    while post < len(prefixes) and len(str(num)) > maxlen:
        modulo, num = num % thousand, num // thousand
        carry = modulo >= thousand // 2
        post += 1
    if post >= len(prefixes):
        post = 0
    if modulo is None:
        return f"{num}{prefixes[post]}{unit}"
    decimals = maxlen - len(str(num)) - 1
    if decimals <= 0:
        return f"{num + int(carry)}{prefixes[post]}{unit}"
    frac = "%.*f" % (decimals, modulo / thousand)
    if frac[0] == "1":
        num += 1
    return f"{num}.{frac[2:]}{prefixes[post]}{unit}"


def _display_lat(name: str, s) -> str:
    lo, hi, mean, dev, unit = s.min, s.max, s.mean, s.stddev, "nsec"
    if lo > 2_000_000 and hi > 99_999_999 and dev > 1e6:
        lo, hi, mean, dev, unit = lo // 1_000_000, hi // 1_000_000, mean / 1e6, dev / 1e6, "msec"
    elif lo > 2000 and hi > 99_999 and dev > 1000.0:
        lo, hi, mean, dev, unit = lo // 1000, hi // 1000, mean / 1e3, dev / 1e3, "usec"
    return (f"    {name} ({unit}): min={num2str(lo, 6)}, max={num2str(hi, 6)}, "
            f"avg=%5.02f, stdev=%5.02f\n" % (mean, dev))


def _percentile_block(pre: str, pcts: Mapping[float, int], precision: int = 2) -> str:
    ps = sorted(pcts)
    vals = [pcts[p] for p in ps]
    lo, hi = min(vals), max(vals)
    if lo > 2_000_000 and hi > 99_999_999:
        scale, div, unit = 2, 1_000_000, "msec"
    elif lo > 2000 and hi > 99_999:
        scale, div, unit = 1, 1000, "usec"
    else:
        scale, div, unit = 0, 1, "nsec"
    width = max(5, int(math.log10(hi // div)) + 1) if hi // div > 0 else 5
    per_line = (80 - 7) // (precision + 10 + width)
    out = [f"    {pre} percentiles ({unit}):\n     |"]
    for j, (p, v) in enumerate(zip(ps, vals)):
        if j and j % per_line == 0:
            out.append("     |")
        for _ in range(scale):
            v = (v + 999) // 1000
        last = j == len(ps) - 1
        out.append(" %*.*fth=[%*d]%s" % (precision + 3, precision, p, width, v, "\n" if last else ","))
        if not last and j % per_line == per_line - 1:
            out.append("\n")
    return "".join(out)


def _lat_lines(pct: Mapping[str, float], unit: str) -> str:
    shown = [(k, v) for k, v in pct.items() if v > 0.0]
    lines = []
    for i in range(0, len(shown), 5):
        body = ", ".join(f"{k}=%3.2f%%" % v for k, v in shown[i:i + 5])
        lines.append(f"  lat ({unit})   : {body}\n")
    return "".join(lines)


def _dir_normal(r: JobResult, ddir: str, d: DirStats, group: _Group) -> str:
    bw = d.bw_bytes
    out = [f"  {ddir}: IOPS={num2str(int(d.iops))}, BW={num2str(bw, pow2=True, unit='B/s')} "
           f"({num2str(bw, unit='B/s')})({num2str(d.io_bytes, pow2=True, unit='B')}/"
           f"{d.runtime_ns // 1_000_000}msec)\n"]
    for name, rec in (("slat", d.slat), ("clat", d.clat), (" lat", d.lat)):
        if len(rec):
            out.append(_display_lat(name, rec.summary(())))
    if len(d.clat):
        out.append(_percentile_block("clat", d.clat.summary(r.options.percentile_list).percentiles))
    b = d.rate.bw
    if b.samples:
        agg_kib = group.agg(ddir) / 1024.0
        per = min(100.0, b.mean * 100.0 / agg_kib) if agg_kib > 1 else 100.0
        unit, lo, hi, mean, dev = "KiB", b.min, b.max, b.mean, b.stddev
        if mean > 1024 * 1024:
            unit, lo, hi, mean, dev = "MiB", lo // 1024, hi // 1024, mean / 1024, dev / 1024
        out.append(f"   bw ({unit:>5s}/s): min={lo:5d}, max={hi:5d}, per=%3.2f%%, avg=%5.02f, "
                   f"stdev=%5.02f, samples={b.samples}\n" % (per, mean, dev))
    i = d.rate.iops
    if i.samples:
        out.append(f"   iops        : min={i.min:5d}, max={i.max:5d}, avg=%5.02f, stdev=%5.02f, "
                   f"samples={i.samples}\n" % (i.mean, i.stddev))
    return "".join(out)


def _ours_line(r: JobResult) -> str:
    ours = r.hicache_gds
    parts = [f"engine={ours.get('engine', r.options.engine)}", f"path={ours.get('path', '?')}"]
    try:
        g = r.options.geometry
        parts.append(f"page={num2str(g.page_bytes, pow2=True, unit='B')} x{len(g.segments)} seg, "
                     f"batch={r.options.batch_size}")
    except OptionError:
        pass
    ratio = ours.get("ratio_to_raw")
    parts.append(f"vs raw={ratio:.2f}x" if isinstance(ratio, (int, float)) else "vs raw=n/a")
    fio = ours.get("ratio_to_fio")
    parts += [f"vs fio={fio:.2f}x"] if isinstance(fio, (int, float)) else []
    line = "  hicache_gds  : " + ", ".join(parts) + "\n"
    shown = [_baseline(name, b) for name, b in (ours.get("baseline") or {}).items() if isinstance(b, Mapping)]
    line += "  baseline     : " + "; ".join(shown) + "\n" if shown else ""
    return line + (f"  engine       : {ours['engine_reason']}\n" if ours.get("engine_reason") else "")


def _baseline(name: str, b: Mapping[str, Any]) -> str:
    """`raw O_DIRECT qd=128: write=850MiB/s` from a baseline block (raw or fio)."""
    bws = [f"{d}={num2str(int(b[d]['bw_bytes']), pow2=True, unit='B/s')}" for d in ("read", "write")
           if isinstance(b.get(d), Mapping) and b[d].get("bw_bytes")]
    if b.get("error") and not bws:
        return f"{name}: {b['error']}"
    how = (f"raw O_DIRECT qd={b.get('queue_depth', '?')}" if name == "raw"
           else f"{name} {b.get('ioengine', '')} qd={b.get('iodepth', '?')}")
    return f"{how}: {', '.join(bws) or 'no IO'}"


def to_fio_normal(results: Sequence[JobResult], *, now: float | None = None) -> str:
    """fio's human-readable summary (`--output-format=normal`) for `results`."""
    stamp = time.ctime(time.time() if now is None else now)
    groups = _groups(results)
    out: list[str] = []
    for r in results:
        err = f"err={r.error:2d}" + (f" ({r.error_text})" if r.error and r.error_text else "")
        out.append(f"{r.jobname}: (groupid={r.groupid}, jobs={r.members}): {err}: pid={r.pid}: "
                   f"{stamp}\n")
        for ddir, d in r.directions:
            if d.io_bytes and d.runtime_ns:
                out.append(_dir_normal(r, ddir, d, groups[r.groupid]))
        lat_n, lat_u, lat_m = latency_distribution([r.read.clat, r.write.clat],
                                                   r.read.total_ios + r.write.total_ios or None)
        out += [_lat_lines(lat_n, "nsec"), _lat_lines(lat_u, "usec"), _lat_lines(lat_m, "msec")]
        out.append(f"  cpu          : usr=%3.2f%%, sys=%3.2f%%, ctx={r.ctx}, majf={r.majf}, "
                   f"minf={r.minf}\n" % (r.usr_cpu, r.sys_cpu))
        if r.iodepth_counts:
            dist = _dist(r.iodepth_counts, _DEPTH_KEYS, _depth_bucket)
            out.append("  IO depths    : " + ", ".join(f"{k}=%3.1f%%" % v for k, v in dist.items())
                       + "\n")
        out.append(f"     issued rwts: total={r.read.total_ios},{r.write.total_ios},0,0 "
                   f"short={r.read.short_ios},{r.write.short_ios},0,0 "
                   f"dropped={r.read.drop_ios},{r.write.drop_ios},0,0\n")
        out.append(_ours_line(r))
    for gid, g in groups.items():
        out.append(f"\nRun status group {gid} (all jobs):\n")
        for ddir in ("read", "write"):
            if not g.max_run.get(ddir):
                continue
            agg, lo, hi = g.agg(ddir), g.min_bw[ddir], g.max_bw[ddir]
            b2 = lambda n: num2str(n, pow2=True, unit="B/s")      # noqa: E731
            b10 = lambda n: num2str(n, unit="B/s")                # noqa: E731
            out.append(f"{ddir.upper():>7s}: bw={b2(agg)} ({b10(agg)}), {b2(lo)}-{b2(hi)} "
                       f"({b10(lo)}-{b10(hi)}), io={num2str(g.iobytes[ddir], pow2=True, unit='B')} "
                       f"({num2str(g.iobytes[ddir], unit='B')}), "
                       f"run={g.min_run[ddir] // 1_000_000}-{g.max_run[ddir] // 1_000_000}msec\n")
    return "".join(out)


def render(results: Sequence[JobResult], output_format: Iterable[str] = ("normal",),
           global_options: JobOptions | Mapping[str, Any] | None = None, *,
           now: float | None = None, extra: Mapping[str, Any] | None = None) -> str:
    """All requested formats in fio's order: one JSON document first, then the normal summary
    (fio 3.33 with `--output-format=json,normal` prints them so)."""
    fmts = set(output_format)
    parts = []
    if fmts & {"json", "json+"}:
        doc = to_fio_json(results, global_options, json_plus="json+" in fmts, now=now, extra=extra)
        parts.append(json.dumps(doc, indent=2) + "\n")
    if "normal" in fmts:
        parts.append(to_fio_normal(results, now=now))
    return "".join(parts)


# --------------------------------------------------------------------------- running real fio

def fio_argv(opts: JobOptions, *, ioengine: str = "psync", output_format: str = "json") -> list[str]:
    """Arguments for real fio running the raw IO pattern of one (non-sweep) job, as a reference."""
    args = [f"--name={opts.name}", f"--rw={opts.rw}", f"--bs={opts.block_size}",
            f"--ioengine={ioengine}", f"--iodepth={opts.iodepth}", f"--numjobs={opts.numjobs}",
            f"--direct={int(opts.direct)}", f"--output-format={output_format}"]
    args += [f"--rwmixread={opts.rwmixread}"] if opts.rw == "randrw" else []
    args += [f"--{k}={max(1, round(getattr(opts, k) * 1000))}ms"
             for k in ("runtime", "ramp_time") if getattr(opts, k)]
    args += ["--time_based"] if opts.time_based else []
    args += [f"--{k}={getattr(opts, k)}" for k in ("size", "directory", "filename", "randseed")
             if getattr(opts, k) is not None]
    return args + [f"--{k}" if v is None else f"--{k}={v}" for k, v in opts.fio_passthrough]


def parse_fio_json(text: str) -> dict:
    """fio's JSON document from its output, skipping anything before or after it.

    fio may print warnings (`fio: ...`) before the JSON, and with `--output-format=normal,json`
    the normal summary too. Raises `FioOutputError` when no document with `"jobs"` is found.
    """
    dec = json.JSONDecoder()
    for m in re.finditer(r"^\s*\{", text, re.M):
        try:
            doc, _ = dec.raw_decode(text, m.end() - 1)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict) and "jobs" in doc:
            return doc
    head = text.strip().splitlines()[0][:200] if text.strip() else "(empty)"
    raise FioOutputError(f"no fio JSON document in the output; it starts: {head!r}")


def fio_job_summary(job: Mapping[str, Any]) -> dict[str, Any]:
    """The headline numbers of one fio JSON job, per active direction, for `baseline` blocks."""
    out: dict[str, Any] = {"jobname": job.get("jobname"), "error": job.get("error", 0)}
    for ddir in ("read", "write"):
        d = job.get(ddir) or {}
        if not d.get("io_bytes"):
            continue
        pct = (d.get("clat_ns") or {}).get("percentile") or {}
        out[ddir] = {"bw_bytes": d.get("bw_bytes"), "iops": d.get("iops"),
                     "io_bytes": d.get("io_bytes"), "runtime_ms": d.get("runtime"),
                     "clat_mean_ns": (d.get("clat_ns") or {}).get("mean"),
                     "clat_p50_ns": pct.get("50.000000"), "clat_p99_ns": pct.get("99.000000")}
    return out
