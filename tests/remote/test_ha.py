"""The directory on Redis with Sentinel: the sentinel URL, failover of the primary, acked writes.

Real processes: a primary, its replica and a Sentinel on loopback (`sentinel_procs.py`), page
servers (`hicache-gds serve`), and a `RemoteTier` in this process; pages are random bytes compared
byte for byte.
"""

from __future__ import annotations

import time
import uuid

import pytest

from remote_procs import PAGE, REDIS
from remote_helpers import Bufs, tier

from hicache_gds.remote.connect import parse_url, redact


@pytest.fixture
def sset(tmp_path):
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    pytest.importorskip("redis")
    from sentinel_procs import SentinelSet
    s = SentinelSet(tmp_path)
    yield s
    s.stop()


def test_sentinel_url_parse_and_redact():
    u = parse_url("redis+sentinel://u:p%40ss@10.0.0.1:26379,[::1]:26380,h3/svc?db=2&sentinel_password=x")
    assert u.sentinels == (("10.0.0.1", 26379), ("::1", 26380), ("h3", 26379))
    assert (u.service, u.db, u.username, u.password, u.tls) == ("svc", 2, "u", "p@ss", False)
    assert u.sentinel_kwargs == {"password": "x"}
    assert parse_url("rediss+sentinel://h:1/s").tls
    assert parse_url("redis://h:1/0") is None
    with pytest.raises(ValueError):
        parse_url("redis+sentinel://h:1/")
    assert redact("redis+sentinel://u:secret@a:1,b:2/svc?sentinel_password=zz") == \
        "redis+sentinel://u:***@a:1,b:2/svc?sentinel_password=***"
    assert redact("redis+sentinel://a:1,b:2/svc") == "redis+sentinel://a:1,b:2/svc"


def _wait(pred, timeout: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_failover_keeps_acked_pages(sset, spawn):
    """SIGKILL the primary mid-run: pages whose put returned True are read back byte-exact after
    the Sentinel failover (their publish was acked by the replica), puts work again, 0 wrong bytes."""
    prefix = "ha" + uuid.uuid4().hex[:6]
    for i in range(2):
        spawn(sset.url, f"s{i}", prefix, "16M", PAGE, ttl=6.0)
    t = tier(sset.url, prefix, PAGE, uuid.uuid4().hex, remote_lease=3)
    try:
        assert t.dir.wait_replicas == 1, "a replica is attached: writes must wait for its ack"
        keys = [f"k{i}" for i in range(24)]
        b = Bufs(t, 24, PAGE)
        ok = t.put(keys, b.fill(keys))
        assert ok == [True] * 24
        epoch0 = t.dir.fence_epoch()
        sset.kill_primary()
        # puts during the failover: any result, but no True may be lost afterwards
        during = [f"d{i}" for i in range(8)]
        b2 = Bufs(t, 8, PAGE)
        t0 = time.monotonic()
        acked: list[str] = []
        assert _wait(lambda: (acked.extend(k for k, o in zip(during, t.put(during, b2.fill(during))) if o)
                              or bool(acked)), 40), "puts never worked again after the failover"
        recovery = time.monotonic() - t0
        got = t.get(keys, b.poisoned(24))
        b.check(keys, got)  # 0 wrong bytes
        assert got == [True] * 24, "an acked page was lost in the failover"
        got2 = t.get(during, b2.poisoned(8))
        b2.check(during, got2)
        assert all(got2[during.index(k)] for k in acked)
        assert t.dir.fence_epoch() > epoch0, "the new primary must carry a new directory epoch"
        print(f"recovery {recovery:.1f} s")
    finally:
        t.close()


def test_sentinel_url_round_trip(sset, spawn):
    """Servers and clients given the sentinel URL find the primary through the Sentinel."""
    prefix = "hs" + uuid.uuid4().hex[:6]
    spawn(sset.url, "s0", prefix, "8M", PAGE, ttl=5.0)
    t = tier(sset.url, prefix, PAGE, uuid.uuid4().hex)
    try:
        keys = [f"r{i}" for i in range(6)]
        b = Bufs(t, 6, PAGE)
        assert t.put(keys, b.fill(keys)) == [True] * 6
        got = t.get(keys, b.poisoned(6))
        assert got == [True] * 6
        b.check(keys, got)
        assert "sentinel" in t.stats()["redis"]
    finally:
        t.close()
