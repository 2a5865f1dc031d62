"""One stats model: every counter and gauge hicache-gds reports is defined once, in `METRICS`.

`stats()` of every store (and of the remote tier, the tiered store and the SGLang linker) counts
through `Counters`, which accepts only names defined here; SGLang's metrics
(`hicache_gds_sglang.policy_hooks.publish_metrics`), the page servers' Prometheus endpoint
(`remote.metrics`) and `hicache-gds ls --json` read the same names, with the same help text,
through `metric_values` and `prometheus_families`. A new counter is one line in `_DEFS`.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Iterator, Mapping, NamedTuple

__all__ = ["METRICS", "Counters", "Metric", "StoreStats", "metric_values", "prometheus_families"]

_BUCKETS = 32  # 2^0 .. 2^31 microseconds


class Metric(NamedTuple):
    name: str
    doc: str
    kind: str = "counter"  # "counter" (only grows while the process lives) or "gauge"


_DEFS = (
    # every store's calls (`PageStore`, `PageReader`, `RemoteTier`)
    Metric("pages_written", "Pages written and published"),
    Metric("bytes_written", "Bytes of pages written and published"),
    Metric("pages_read", "Pages read, checksum verified where checked"),
    Metric("bytes_read", "Bytes of pages read"),
    Metric("hits", "Keys found by get"),
    Metric("misses", "Keys get did not find"),
    Metric("put_skipped_present", "Pages put did not write: their key was present"),
    Metric("put_failed", "Pages put could not store"),
    Metric("get_failed", "Pages found but not read (IO failed or timed out)"),
    Metric("checksum_mismatches", "Pages whose bytes did not match their checksum (dropped, read as misses)"),
    Metric("timeouts", "Pages of requests that timed out"),
    Metric("staged_pages", "Pages moved through host staging buffers"),
    Metric("read_wait_ns", "Nanoseconds get callers waited for read requests to complete"),
    Metric("read_verify_ns", "Nanoseconds get callers waited for pages read to be scattered and checksummed"),
    Metric("read_post_ns", "Nanoseconds get callers spent posting read requests (a short device queue makes it wait for IO)"),
    # the index of a namespace (`Index.stats`, read by `hicache-gds ls` too)
    Metric("pages", "Pages the namespace holds", "gauge"),
    Metric("slots", "Page slots of the namespace", "gauge"),
    Metric("free_slots", "Slots holding no page", "gauge"),
    Metric("evictions", "Pages evicted for room (least recently used first)"),
    Metric("reclaimed_slots", "Slots reclaimed from processes that closed or died"),
    Metric("map_reloads", "Times the in-memory key map was read again whole"),
    Metric("pinned_slots", "Slots this process is reading", "gauge"),
    Metric("lost_slots", "Slots of timed-out writes this process keeps reserved", "gauge"),
    Metric("reserved_slots_all", "Slots reserved by writers, all processes", "gauge"),
    Metric("leased_slots_all", "Slots leased by readers, all processes", "gauge"),
    Metric("doomed_slots", "Slots dropped while being read, freed when the read ends", "gauge"),
    # the remote tier's client
    Metric("redis_errors", "Redis calls that failed"),
    Metric("peer_errors", "Transfers with a page server that failed"),
    Metric("stale_reads", "Remote pages that changed while read (read as misses)"),
    Metric("lost_races", "Remote puts that lost to a concurrent put of the same key"),
    Metric("no_server", "Remote puts with no page server registered"),
    Metric("peers_set_aside", "Times a page server that timed out was set aside (its pages misses for a while)"),
    # the tiered store
    Metric("promoted", "Remote hits written to local NVMe"),
    Metric("writeback_queued", "Pages queued for write-back to the remote tier"),
    Metric("writeback_done", "Pages written back to the remote tier"),
    Metric("writeback_dropped", "Pages not written back: the queue was full"),
    Metric("writeback_failed", "Pages whose write-back failed"),
    # the SGLang linker (device pool <-> store)
    Metric("load_batches", "Load batches the linker finished"),
    Metric("load_pages", "Pages the linker loaded into the device pool"),
    Metric("load_bytes", "Bytes the linker loaded into the device pool"),
    Metric("load_failures", "Load batches that failed (their requests recompute)"),
    Metric("offloads", "Offload batches the linker ran"),
    Metric("offload_pages", "Pages the linker offloaded"),
    Metric("offload_bytes", "Bytes the linker offloaded"),
    Metric("offload_failures", "Offload batches that failed"),
    # a page server (`hicache-gds serve`)
    Metric("heartbeats", "Heartbeats Redis answered"),
    Metric("heartbeat_failures", "Heartbeats that found Redis unreachable"),
    Metric("registrations", "Registrations in Redis (each a new epoch)"),
    Metric("server_evictions", "Pages evicted to keep the low-water mark free (this epoch)"),
)
METRICS: Mapping[str, Metric] = {m.name: m for m in _DEFS}
STORE_COUNTERS = tuple(m.name for m in _DEFS[:15])
assert len(METRICS) == len(_DEFS), "a metric is defined twice"


class Counters:
    """Thread-safe counters of names defined in `METRICS` (a name not defined there is a `KeyError`)."""

    def __init__(self, names: Iterable[str]) -> None:
        names = tuple(names)
        unknown = [n for n in names if n not in METRICS]
        if unknown:
            raise KeyError(f"counters not defined in hicache_gds.stats.METRICS: {unknown}")
        self._lock = threading.Lock()
        self.c: dict[str, int] = {k: 0 for k in names}

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self.c[k] += v  # KeyError: count only what was declared

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.c)


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


class StoreStats(Counters):
    """What a store did since it opened: `STORE_COUNTERS` (and `extra` names), batch latency."""

    def __init__(self, extra: Iterable[str] = ()) -> None:
        super().__init__(STORE_COUNTERS + tuple(extra))
        self.read_hist = _Hist()
        self.write_hist = _Hist()
        self.read_ns = 0
        self.write_ns = 0

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


def metric_values(stats: Mapping[str, Any]) -> Iterator[tuple[Metric, float]]:
    """The defined metrics among `stats` (a `stats()` dict), with their values, in `METRICS` order."""
    for m in _DEFS:
        v = stats.get(m.name)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            yield m, float(v)


def prometheus_families(stats: Mapping[str, Any], prefix: str, rename: Mapping[str, str] | None = None,
                        labels: Mapping[str, str] | None = None) -> list[Any]:
    """Prometheus metric families (prometheus-client's core types) for the defined metrics in
    `stats`: ``prefix + name`` (`rename` maps a metric to another name), counters as counters
    (``_total``), gauges as gauges, help text from `METRICS`."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    rename = rename or {}
    keys, vals = list((labels or {}).keys()), list((labels or {}).values())
    out = []
    for m, v in metric_values(stats):
        cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
        fam = cls(prefix + rename.get(m.name, m.name), m.doc, labels=keys)
        fam.add_metric(vals, v)
        out.append(fam)
    return out
