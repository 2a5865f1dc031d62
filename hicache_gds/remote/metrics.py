"""Prometheus metrics of a page server (`hicache-gds serve --metrics-port PORT`).

Read from the server's own state at every scrape (a prometheus-client custom collector), so the
serving loop does no metrics work. The slot counts are those of the last heartbeat, which keeps
the directory in Redis honest; the counters are the process's since it started.

    hicache_gds_server_info{name, epoch}                 1
    hicache_gds_server_slots{state="free|used|pending"}  slots by state (pending: reserved, being written)
    hicache_gds_server_slots_total                       slots of the pool
    hicache_gds_server_slot_bytes                        bytes per slot
    hicache_gds_server_pool_bytes                        bytes of DRAM served
    hicache_gds_server_registered                        1 while registered in Redis
    hicache_gds_server_evictions_total                   pages evicted to keep --low-water free (this epoch)
    hicache_gds_server_heartbeats_total                  heartbeats Redis answered
    hicache_gds_server_heartbeat_failures_total          heartbeats that found Redis unreachable
    hicache_gds_server_registrations_total               registrations (a new epoch each; >1: it re-registered)
    hicache_gds_server_heartbeat_age_seconds             seconds since the last answered heartbeat
"""

from __future__ import annotations

import time
from typing import Any, Iterator

from ..stats import prometheus_families

__all__ = ["ServerCollector", "start_metrics"]


class ServerCollector:
    """A prometheus-client collector over a `PageServer` (`collect` reads it at scrape time)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def describe(self) -> list:
        return []  # unchecked collector: families are built at scrape time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
        s = self.server
        info = InfoMetricFamily("hicache_gds_server", "The page server", labels=["name"])
        info.add_metric([s.name], {"epoch": s.epoch or ""})
        yield info
        slots = GaugeMetricFamily("hicache_gds_server_slots", "Slots by state, as of the last heartbeat",
                                  labels=["state"])
        for state in ("free", "used", "pending"):
            slots.add_metric([state], float(s.last_state.get(state, 0)))
        yield slots
        for name, doc, value in (
                ("slots_total", "Slots of the pool", s.nslots),
                ("slot_bytes", "Bytes per slot", s.slot_bytes),
                ("pool_bytes", "Bytes of DRAM served", s.nslots * s.slot_bytes),
                ("registered", "1 while registered in Redis", int(s.registered)),
                ("heartbeat_age_seconds", "Seconds since the last heartbeat Redis answered",
                 time.monotonic() - s.last_beat if s.last_beat else float("nan"))):
            yield GaugeMetricFamily(f"hicache_gds_server_{name}", doc, value=float(value))
        # The counters, as `hicache_gds.stats.METRICS` defines them (names and help text).
        counts = {**s.counts.snapshot(), "server_evictions": s.last_state.get("evictions", 0)}
        yield from prometheus_families(counts, "hicache_gds_server_", rename={"server_evictions": "evictions"})


def start_metrics(server: Any, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve `server`'s metrics over HTTP at ``addr:port/metrics`` from a daemon thread; returns
    the HTTP server (``shutdown()`` stops it). Needs prometheus-client (``hicache-gds[remote]``)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:
        from ..errors import EngineUnavailable
        raise EngineUnavailable("--metrics-port needs prometheus-client: pip install 'hicache-gds[remote]'") from exc
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(server))
    httpd, _thread = start_http_server(port, addr=addr, registry=registry)
    return httpd
