"""`hicache-gds serve --metrics-port`: Prometheus metrics of a page server, scraped over HTTP from a
real server process while a client writes pages and while Redis goes away and comes back."""

from __future__ import annotations

import time
import urllib.request
import uuid

import pytest

from remote_helpers import Bufs, tier
from remote_procs import PAGE, ServerProc, free_port

pytest.importorskip("prometheus_client", reason="prometheus-client is not installed (hicache-gds[remote])")


def scrape(port: int) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def until(port: int, ok, what: str, limit: float = 30.0) -> dict:
    """Scrape until `ok(metrics)` (a heartbeat must come by first); fail naming `what` after `limit` s."""
    deadline = time.monotonic() + limit
    while True:
        m = scrape(port)
        if ok(m):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: never seen; last scrape {m}")
        time.sleep(0.1)


def slots(m: dict, state: str) -> float:
    return m[("hicache_gds_server_slots", (("state", state),))]


def test_metrics_follow_the_pool_and_redis(own_redis, tmp_path):
    port, prefix = free_port(), "m" + uuid.uuid4().hex[:8]
    srv = ServerProc(own_redis.url, "metrics0", prefix, "16M", PAGE, 1.0, log_dir=tmp_path,
                     extra=("--metrics-port", str(port)))
    try:
        m = scrape(port)
        total = 16 * (1 << 20) // PAGE
        assert m[("hicache_gds_server_slots_total", ())] == total
        assert m[("hicache_gds_server_slot_bytes", ())] == PAGE
        assert m[("hicache_gds_server_pool_bytes", ())] == 16 << 20
        assert m[("hicache_gds_server_registered", ())] == 1
        assert m[("hicache_gds_server_registrations_total", ())] == 1
        (info,) = [dict(k[1]) for k in m if k[0] == "hicache_gds_server_info"]
        assert info["name"] == "metrics0" and len(info["epoch"]) == 12
        # a client writes 10 pages: the next heartbeat counts them as used
        t = tier(own_redis.url, prefix, PAGE, "metrics")
        try:
            bufs = Bufs(t, 10, PAGE)
            keys = [f"k{i}" for i in range(10)]
            assert t.put(keys, bufs.fill(keys)) == [True] * 10
            m = until(port, lambda m: slots(m, "used") == 10, "10 used slots")
            assert slots(m, "free") + slots(m, "used") + slots(m, "pending") == total
            assert m[("hicache_gds_server_heartbeats_total", ())] >= 1
            # Redis goes away: heartbeats fail and are counted; the server keeps serving
            own_redis.stop()
            until(port, lambda m: m[("hicache_gds_server_heartbeat_failures_total", ())] >= 1, "a failed heartbeat")
            # Redis is back, empty: the server registers again under a new epoch, every slot free
            own_redis.start()
            m = until(port, lambda m: m[("hicache_gds_server_registrations_total", ())] == 2, "a re-registration")
            m = until(port, lambda m: slots(m, "free") == total, "an empty pool after the re-registration")
            assert m[("hicache_gds_server_registered", ())] == 1
        finally:
            t.close()
    finally:
        srv.stop()


def test_metrics_port_in_use_is_a_clear_error(own_redis, capsys):
    import socket

    from hicache_gds.remote.server import main
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc = main(["--redis", own_redis.url, "--size", "1M", "--page-bytes", "256K", "--prefix",
                   "m" + uuid.uuid4().hex[:8], "--metrics-port", str(port), "--log-level", "ERROR"])
    assert rc == 2 and f"metrics on 127.0.0.1:{port}" in capsys.readouterr().err
