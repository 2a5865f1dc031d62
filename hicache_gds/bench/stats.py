"""Latency and rate recorders with fio's statistics.

`LatencyRecorder` keeps every per-IO latency (ns, int64) and reports what fio's `clat_ns` /
`lat_ns` / `slat_ns` objects hold: `min, max, mean, stddev, N, percentile{...}` (and `bins` for
json+). Differences from fio, on purpose:

* Percentiles are exact: fio's rule (the smallest sample `v` with at least `p% * N` samples
  `<= v`) applied to the raw samples, not to fio's log-linear histogram, whose values are bucket
  midpoints with up to 1/128 relative error. `bins` (json+) do use fio's buckets, so fio's
  json+ tools read them.
* `stddev` is the sample standard deviation (n - 1), as fio computes it.

`DirStats` holds one direction's totals and recorders (what fio reports per `read`/`write`).
`RateRecorder` produces fio's bandwidth/IOPS interval samples (`bw_min`..`iops_samples`): one
sample each time at least `interval_ns` (fio's `bw_avg_time`, 500 ms) has passed since the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterable, Sequence

import numpy as np

__all__ = [
    "DEFAULT_PERCENTILES", "percentile_key", "fio_percentiles", "LatencyRecorder", "LatencySummary",
    "RateRecorder", "RateSummary", "latency_distribution", "fio_bucket_value",
    "LAT_RANGES_NS", "LAT_RANGES_US", "LAT_RANGES_MS", "DirStats",
]

#: fio's default `percentile_list` (options.c): 1:5:10:20:30:40:50:60:70:80:90:95:99:99.5:99.9:99.95:99.99
DEFAULT_PERCENTILES: tuple[float, ...] = (1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0,
                                          90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99)

#: Keys of fio's `latency_ns`, `latency_us` and `latency_ms` distributions (upper bounds).
LAT_RANGES_NS = ("2", "4", "10", "20", "50", "100", "250", "500", "750", "1000")
LAT_RANGES_US = LAT_RANGES_NS
LAT_RANGES_MS = LAT_RANGES_NS + ("2000", ">=2000")
_LAT_EDGES = np.array([2, 4, 10, 20, 50, 100, 250, 500, 750], dtype=np.int64)
_LAT_EDGES_MS = np.array([2, 4, 10, 20, 50, 100, 250, 500, 750, 1000, 2000], dtype=np.int64)

# fio's latency histogram (stat.h): 29 groups of 64 buckets, values below 128 exact.
_PLAT_BITS = 6
_PLAT_VAL = 1 << _PLAT_BITS
_PLAT_NR = 29 * _PLAT_VAL


def percentile_key(p: float) -> str:
    """fio's JSON key for a percentile: C's `%f`, e.g. 99.9 -> `"99.900000"`."""
    return "%f" % p


def fio_percentiles(values: np.ndarray, plist: Sequence[float] = DEFAULT_PERCENTILES) -> dict[float, int]:
    """Exact percentiles of `values` by fio's rule; `{}` for no values.

    For each p, the smallest sample v such that at least `p/100 * N` samples are `<= v`: the
    sample of rank `ceil(p * N / 100)` (1-based, at least 1). Exact rational arithmetic, so that
    99.9% of 1000 samples is rank 999, not 1000 from a rounding error.
    """
    a = np.asarray(values)
    n = int(a.size)
    if n == 0:
        return {}
    ps = sorted(set(float(p) for p in plist))
    if not ps:
        return {}
    ranks = [max(1, math.ceil(Fraction(repr(p)) * n / 100)) - 1 for p in ps]
    part = np.partition(a, sorted(set(ranks)))
    return {p: int(part[r]) for p, r in zip(ps, ranks)}


def _plat_idx(v: np.ndarray) -> np.ndarray:
    """fio's `plat_val_to_idx`, vectorised."""
    v = np.asarray(v, dtype=np.int64)
    msb = np.frexp(np.maximum(v, 1).astype(np.float64))[1].astype(np.int64) - 1
    err = np.maximum(msb - _PLAT_BITS, 0)
    idx = ((err + 1) << _PLAT_BITS) + ((_PLAT_VAL - 1) & (v >> err))
    return np.where(msb <= _PLAT_BITS, v, np.minimum(idx, _PLAT_NR - 1))


def fio_bucket_value(idx: int) -> int:
    """fio's `plat_idx_to_val`: the value a histogram bucket reports (its midpoint)."""
    if idx < (_PLAT_VAL << 1):
        return idx
    err = (idx >> _PLAT_BITS) - 1
    return int((1 << (err + _PLAT_BITS)) + ((idx % _PLAT_VAL) + 0.5) * (1 << err))


@dataclass(frozen=True)
class LatencySummary:
    """`min`/`max` in ns (ints), `mean`/`stddev` in ns (floats), `n` samples, `percentiles` {p: ns}."""

    min: int
    max: int
    mean: float
    stddev: float
    n: int
    percentiles: dict[float, int]


class LatencyRecorder:
    """Every per-IO latency of one kind (slat, clat or lat) of one direction, in nanoseconds.

    Appends are amortised O(1) (the int64 buffer doubles); statistics are computed on demand.
    Not thread-safe: give each submitter thread its own recorder and `merge` them.
    """

    def __init__(self, values: Iterable[int] | np.ndarray = (), *, capacity: int = 1024) -> None:
        init = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, np.int64)
        self._buf = np.empty(max(capacity, init.size, 1), dtype=np.int64)
        self._buf[:init.size] = init
        self._n = int(init.size)

    def _reserve(self, extra: int) -> None:
        need = self._n + extra
        if need > self._buf.size:
            grown = np.empty(max(need, 2 * self._buf.size), dtype=np.int64)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown

    def add(self, ns: int) -> None:
        """Record one latency; negative values are a caller bug and raise ValueError."""
        if ns < 0:
            raise ValueError(f"latency cannot be negative: {ns} ns")
        self._reserve(1)
        self._buf[self._n] = ns
        self._n += 1

    def extend(self, ns: Iterable[int] | np.ndarray) -> None:
        """Record many latencies at once."""
        a = np.asarray(ns if isinstance(ns, np.ndarray) else list(ns), dtype=np.int64).ravel()
        if a.size and int(a.min()) < 0:
            raise ValueError("latency cannot be negative")
        self._reserve(a.size)
        self._buf[self._n:self._n + a.size] = a
        self._n += int(a.size)

    def __len__(self) -> int:
        return self._n

    @property
    def values(self) -> np.ndarray:
        """A read-only view of the recorded latencies, in recording order."""
        v = self._buf[:self._n].view()
        v.flags.writeable = False
        return v

    @classmethod
    def merged(cls, recorders: Iterable["LatencyRecorder"]) -> "LatencyRecorder":
        """One recorder holding the samples of all `recorders` (e.g. per-thread ones)."""
        parts = [r.values for r in recorders]
        return cls(np.concatenate(parts) if parts else np.empty(0, np.int64))

    def summary(self, percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> LatencySummary:
        """fio's statistics; all zeros (and no percentiles) when nothing was recorded."""
        v = self.values
        if not self._n:
            return LatencySummary(0, 0, 0.0, 0.0, 0, {})
        dev = float(np.std(v, ddof=1)) if self._n > 1 else 0.0
        return LatencySummary(int(v.min()), int(v.max()), float(np.mean(v, dtype=np.float64)), dev,
                              self._n, fio_percentiles(v, percentiles))

    def bins(self) -> dict[str, int]:
        """json+ `bins`: {bucket value (ns, as string): count} over fio's histogram buckets."""
        if not self._n:
            return {}
        counts = np.bincount(_plat_idx(self.values), minlength=_PLAT_NR)
        return {str(fio_bucket_value(int(i))): int(counts[i]) for i in np.flatnonzero(counts)}

    def to_fio(self, percentiles: Sequence[float] | None = DEFAULT_PERCENTILES, *,
               bins: bool = False) -> dict:
        """fio's `*_ns` JSON object. `percentiles=None` leaves `percentile` out (fio's default
        for slat and lat); like fio, `percentile` and `bins` appear only when N > 0."""
        s = self.summary(percentiles or ())
        out: dict = {"min": s.min, "max": s.max, "mean": s.mean, "stddev": s.stddev, "N": s.n}
        if percentiles and s.n:
            out["percentile"] = {percentile_key(p): s.percentiles[p] for p in sorted(s.percentiles)}
            if bins:
                out["bins"] = self.bins()
        return out


def latency_distribution(recorders: Iterable[LatencyRecorder], total: int | None = None
                         ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """fio's `latency_ns`, `latency_us`, `latency_ms`: % of IOs per completion-latency range.

    fio counts clat of reads and writes together; a non-empty bucket shows at least 0.01%.
    `total` defaults to the number of samples.
    """
    v = np.concatenate([r.values for r in recorders] or [np.empty(0, np.int64)])
    total = int(v.size) if total is None else total

    def pct(counts: np.ndarray, keys: Sequence[str]) -> dict[str, float]:
        out = {}
        for k, c in zip(keys, counts):
            p = 100.0 * int(c) / total if total else 0.0
            out[k] = 0.01 if (c and p < 0.01) else p
        return out

    ns = v[v < 1000]
    us = v[(v >= 1000) & (v < 1_000_000)] // 1000
    ms = v[v >= 1_000_000] // 1_000_000
    n_c = np.bincount(np.searchsorted(_LAT_EDGES, ns, side="right"), minlength=10)
    u_c = np.bincount(np.searchsorted(_LAT_EDGES, us, side="right"), minlength=10)
    m_c = np.bincount(np.searchsorted(_LAT_EDGES_MS, ms, side="right"), minlength=12)
    return pct(n_c, LAT_RANGES_NS), pct(u_c, LAT_RANGES_US), pct(m_c, LAT_RANGES_MS)


@dataclass(frozen=True)
class RateSummary:
    """fio's interval statistics: `min`/`max` ints, `mean`/`stddev` floats, `samples` count."""

    min: int
    max: int
    mean: float
    stddev: float
    samples: int


def _rate_summary(vals: list[int]) -> RateSummary:
    if not vals:
        return RateSummary(0, 0, 0.0, 0.0, 0)
    a = np.asarray(vals, dtype=np.float64)
    return RateSummary(int(a.min()), int(a.max()), float(a.mean()),
                       float(a.std(ddof=1)) if a.size > 1 else 0.0, int(a.size))


class RateRecorder:
    """Bandwidth and IOPS samples over time, as fio's `bw_*` (KiB/s) and `iops_*` fields.

    Call `start(t_ns)` when IO starts, then `add(t_ns, nbytes)` at each completion (timestamps
    from `time.perf_counter_ns()` or any monotonic ns clock). A sample is taken at the first
    completion at least `interval_ns` after the previous sample: (bytes since) / (time since).
    """

    def __init__(self, interval_ns: int = 500_000_000) -> None:
        if interval_ns <= 0:
            raise ValueError(f"interval must be positive, got {interval_ns} ns")
        self.interval_ns = interval_ns
        self._last: int | None = None
        self._bytes = 0
        self._ios = 0
        self._bw_kib: list[int] = []
        self._iops: list[int] = []

    def start(self, t_ns: int) -> None:
        self._last, self._bytes, self._ios = t_ns, 0, 0

    def add(self, t_ns: int, nbytes: int, ios: int = 1) -> None:
        if self._last is None:
            self.start(t_ns)
        self._bytes += nbytes
        self._ios += ios
        dt = t_ns - self._last
        if dt >= self.interval_ns:
            self.add_sample(self._bytes * 1e9 / dt, self._ios * 1e9 / dt)
            self.start(t_ns)

    def add_sample(self, bytes_per_s: float, iops: float) -> None:
        """Record one interval directly (bandwidth in bytes/s, IOPS)."""
        self._bw_kib.append(int(bytes_per_s // 1024))
        self._iops.append(int(iops))

    @property
    def bw(self) -> RateSummary:
        """Bandwidth samples in KiB/s (fio's `bw_min`, `bw_max`, `bw_mean`, `bw_dev`, `bw_samples`)."""
        return _rate_summary(self._bw_kib)

    @property
    def iops(self) -> RateSummary:
        return _rate_summary(self._iops)


@dataclass
class DirStats:
    """One direction (read or write) of one job: totals and per-IO latency recorders.

    `slat` is submission latency, `clat` submission-to-completion, `lat` their sum (fio's
    definitions); `rate` holds the bandwidth/IOPS interval samples. `runtime_ns` is the time
    this direction was active.
    """

    io_bytes: int = 0
    total_ios: int = 0
    runtime_ns: int = 0
    short_ios: int = 0
    drop_ios: int = 0
    slat: LatencyRecorder = field(default_factory=LatencyRecorder)
    clat: LatencyRecorder = field(default_factory=LatencyRecorder)
    lat: LatencyRecorder = field(default_factory=LatencyRecorder)
    rate: RateRecorder = field(default_factory=RateRecorder)

    @property
    def bw_bytes(self) -> int:
        """Bytes per second over `runtime_ns` (0 before anything ran)."""
        return self.io_bytes * 1_000_000_000 // self.runtime_ns if self.runtime_ns > 0 else 0

    @property
    def iops(self) -> float:
        return self.total_ios * 1e9 / self.runtime_ns if self.runtime_ns > 0 else 0.0
