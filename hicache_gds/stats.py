"""Counters and a log2 latency histogram for `PageStore.stats()`; thread-safe."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["StoreStats"]

_BUCKETS = 32  # 2^0 .. 2^31 microseconds


class _Hist:
    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.n = 0
        self.total_us = 0.0
        self.max_us = 0.0

    def add(self, us: float) -> None:
        b = min(max(int(us).bit_length() - 1, 0), _BUCKETS - 1)
        self.counts[b] += 1
        self.n += 1
        self.total_us += us
        self.max_us = max(self.max_us, us)

    def percentile(self, q: float) -> float:
        """Upper bound (µs) of the bucket holding the q-th percentile."""
        if not self.n:
            return 0.0
        target, seen = q / 100 * self.n, 0
        for b, c in enumerate(self.counts):
            seen += c
            if seen >= target:
                return float(2 ** (b + 1))
        return self.max_us

    def as_dict(self) -> dict[str, Any]:
        return {"n": self.n, "mean_us": self.total_us / self.n if self.n else 0.0, "max_us": self.max_us,
                "p50_us": self.percentile(50), "p99_us": self.percentile(99),
                "log2_us_buckets": {f"<{2 ** (b + 1)}": c for b, c in enumerate(self.counts) if c}}


class StoreStats:
    """What the store did since it opened: bytes, pages, hits, misses, errors, batch latency."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.c: dict[str, int] = {k: 0 for k in (
            "pages_written", "bytes_written", "pages_read", "bytes_read", "hits", "misses", "put_skipped_present",
            "put_failed", "get_failed", "checksum_mismatches", "timeouts", "staged_pages")}
        self.read_hist = _Hist()
        self.write_hist = _Hist()
        self.read_ns = 0
        self.write_ns = 0

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self.c[k] = self.c.get(k, 0) + v

    def batch(self, write: bool, ns: int) -> None:
        with self._lock:
            (self.write_hist if write else self.read_hist).add(ns / 1000)
            if write:
                self.write_ns += ns
            else:
                self.read_ns += ns

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.c)
            out["write_batch_latency"] = self.write_hist.as_dict()
            out["read_batch_latency"] = self.read_hist.as_dict()
            out["write_gbps"] = self.c["bytes_written"] / self.write_ns if self.write_ns else 0.0
            out["read_gbps"] = self.c["bytes_read"] / self.read_ns if self.read_ns else 0.0
            return out
