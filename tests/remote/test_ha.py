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
        Bufs(t, 6, PAGE).round_trip(t, [f"r{i}" for i in range(6)])
        assert "sentinel" in t.stats()["redis"]
    finally:
        t.close()


def test_rollback_never_serves_a_reused_slot(own_redis, spawn):
    """The directory rolls back (Redis restarted from an older RDB: what a replica promoted without
    the last writes looks like too). In the lost history the pages of X were deleted and their slots
    rewritten with Y's bytes; the restored directory still names X at those slots. A client that
    does not verify checksums must still get 0 wrong bytes: X's entries carry the old directory
    epoch, so they are served only after their checksum verifies (it fails: misses). A reservation
    made before the rollback is never published after it. Puts work again at once, but what they
    reserve within a lease of the rollback is marked: a late write of the lost history that lands
    over such a page afterwards makes it a miss, never another page's bytes."""
    import numpy as np

    from remote_helpers import page_data
    prefix = "rb" + uuid.uuid4().hex[:6]
    spawn(own_redis.url, "s0", prefix, str(16 * PAGE), PAGE, ttl=20.0, low_water=0.0)
    t = tier(own_redis.url, prefix, PAGE, uuid.uuid4().hex, verify=False, remote_lease=1)
    try:
        x, y = [f"x{i}" for i in range(8)], [f"y{i}" for i in range(15)]
        b = Bufs(t, 16, PAGE)
        assert t.put(x, b.fill(x)) == [True] * 8
        info = t._live()[0].info
        held = t.dir.reserve(t.namespace, {"s0": (info.epoch, ["inflight"])}, lease=60)["s0"][0]
        epoch0 = t.dir.fence_epoch()
        own_redis.client().save()  # the snapshot the directory will roll back to
        assert t.delete(x) == [True] * 8
        assert t.put(y, b.fill(y)) == [True] * 15  # every free slot rewritten, X's among them
        own_redis.stop()
        own_redis.start()  # loads the snapshot: X published at slots that now hold Y's bytes
        time.sleep(0.5)

        def wrong(keys, ok):  # noqa: ANN001, ANN202
            return sum(int(not np.array_equal(b.got(i), page_data(k, PAGE))) for i, (k, o) in enumerate(zip(keys, ok)) if o)

        real = t.dir.is_stale
        t.dir.is_stale = lambda e: False  # without the fence: the hazard is real
        ok = t.get(x, b.poisoned(8))
        assert wrong(x, ok) > 0, "the test must rewrite X's slots in the lost history"
        t.dir.is_stale = real
        ok = t.get(x, b.poisoned(8))
        assert wrong(x, ok) == 0 and ok == [False] * 8
        assert t.dir.fence_epoch() > epoch0
        # the reservation from before the rollback (own and pend restored) is fenced
        pub = t.dir.publish(t.namespace, {"s0": (info.epoch, [(held, PAGE, 1)])})
        assert pub == {"s0": [0]}
        z = [f"z{i}" for i in range(4)]
        assert t.put(z, b.fill(z)) == [True] * 4, "puts must work again at once after the rollback"
        ok = t.get(z, b.poisoned(4))
        assert ok == [True] * 4 and wrong(z, ok) == 0
        entries = t.dir.lookup(t.namespace, z)
        assert all(e.endswith("q") and t.dir.is_stale(e) for e in entries), entries
        # the lost history's late write lands over z0's slot (other bytes): a miss, not wrong bytes
        from hicache_gds.engines.base import Op
        from hicache_gds.remote.directory import parse_entry
        late = b.fill(["late"], salt="lost")
        peer = t._live()[0]
        assert t._move(Op.WRITE, late, {"s0": (peer, [(0, parse_entry(entries[0])[2])])}) == {"s0": ["ok"]}
        ok = t.get(z, b.poisoned(4))
        assert ok == [False, True, True, True] and wrong(z, ok) == 0
    finally:
        t.close()


@pytest.mark.slow
def test_a_write_no_replica_acknowledged_is_not_reported_done(sset, spawn):
    """The replica stops answering (SIGSTOP): publishes are not acknowledged within wait_ms, so
    puts report False -- never True for a write a failover could lose. Once it answers, puts work."""
    import signal
    prefix = "wa" + uuid.uuid4().hex[:6]
    spawn(sset.url, "s0", prefix, "8M", PAGE, ttl=10.0)
    t = tier(sset.url, prefix, PAGE, uuid.uuid4().hex, remote_wait_ms=300)
    try:
        assert t.dir.wait_replicas == 1
        replica = [p for p in sset.ports if p != sset.primary_port()][0]
        keys = [f"w{i}" for i in range(4)]
        b = Bufs(t, 4, PAGE)
        sset.procs[replica].send_signal(signal.SIGSTOP)
        try:
            assert t.put(keys, b.fill(keys)) == [False] * 4
            assert t.stats()["redis_errors"] >= 1
        finally:
            sset.procs[replica].send_signal(signal.SIGCONT)
        time.sleep(0.6)  # the directory's back-off after a failure
        assert _wait(lambda: t.put(keys, b.fill(keys)) == [True] * 4, 10)
        ok = t.get(keys, b.poisoned(4))
        assert ok == [True] * 4
        b.check(keys, ok)
    finally:
        t.close()


def test_only_servers_with_the_cluster_secret_are_trusted(tmp_path, spawn, monkeypatch, caplog):
    """Redis requires AUTH as an ACL user limited to the deployment's keys ({sec}:*). A server that
    signs its record with the cluster secret is used; one without it (anyone who can write to
    Redis) is skipped with a warning and counted; a secret file readable by others is refused."""
    import logging
    import os

    from remote_procs import RedisProc

    from hicache_gds.remote.trust import load_secret
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    red = RedisProc(tmp_path, extra=("--user", "default", "off", "--user", "hc", "on", ">pw-9x", "~{sec}:*",
                                     "&*", "+@all"), user="hc", password="pw-9x")
    try:
        secret = tmp_path / "secret"
        secret.write_text("s3cr3t-cluster\n")
        os.chmod(secret, 0o644)
        with pytest.raises(PermissionError):
            load_secret(str(secret))
        os.chmod(secret, 0o600)
        assert load_secret(str(secret)) == b"s3cr3t-cluster"
        monkeypatch.setenv("HICACHE_GDS_CLUSTER_SECRET_FILE", str(secret))
        spawn(red.url, "good", "sec", "4M", PAGE, ttl=5.0)
        monkeypatch.delenv("HICACHE_GDS_CLUSTER_SECRET_FILE")
        spawn(red.url, "rogue", "sec", "4M", PAGE, ttl=5.0)  # registers without a proof
        with caplog.at_level(logging.WARNING, logger="hicache_gds.remote"):
            t = tier(red.url, "sec", PAGE, uuid.uuid4().hex, cluster_secret_file=str(secret))
        try:
            assert [p.info.sid for p in t._live()] == ["good"]
            assert t.stats()["untrusted_servers"] >= 1 and "rogue" in caplog.text
            keys = [f"k{i}" for i in range(12)]
            b = Bufs(t, 12, PAGE)
            assert t.put(keys, b.fill(keys)) == [True] * 12
            assert {e.split("|")[0] for e in t.dir.lookup(t.namespace, keys)} == {"good"}
            ok = t.get(keys, b.poisoned(12))
            assert ok == [True] * 12
            b.check(keys, ok)
        finally:
            t.close()
        with pytest.raises(Exception, match="NOPERM|NOAUTH|WRONGPASS|permission"):
            import redis
            redis.Redis.from_url(red.url).set("other:key", 1)  # the ACL user's keys are the deployment's
    finally:
        red.stop()


def test_scripts_build_no_key_names():
    """Every key a script touches comes from KEYS (Redis Cluster's rule): no script builds a key name
    out of strings, and no script keeps the old untagged prefix argument."""
    import re

    from hicache_gds.remote import scripts
    for name in scripts.__all__:
        if name in ("ENTRY_SEP",):
            continue
        src = getattr(scripts, name)
        assert not re.search(r"\.\.\s*':(srv|free|lru|own|pend|dir|servers|alive|fence|ver)", src), name
        assert "local P = ARGV[1]" not in src, name
        for call in re.findall(r"redis\.call\('(?:H\w+|Z\w+|L\w+|R\w+|S\w+|DEL|UNLINK|INCR|PEXPIRE)',\s*([^,)]+)", src):
            assert not call.strip().startswith(("'", '"')), f"{name}: a literal key {call}"


def test_server_records_reload_only_when_the_version_changes(own_redis, spawn):
    """Each refresh reads one version key; the records are read again only after a (un)registration."""
    prefix = "cv" + uuid.uuid4().hex[:6]
    spawn(own_redis.url, "s0", prefix, "4M", PAGE, ttl=5.0)
    t = tier(own_redis.url, prefix, PAGE, uuid.uuid4().hex)
    try:
        t.opts = t.opts.__class__(**{**t.opts.__dict__, "refresh": 0.05})
        loads = []
        real = t.dir.servers
        t.dir.servers = lambda: loads.append(1) or real()
        for _ in range(20):
            t._refresh()
            time.sleep(0.06)
        assert len(loads) == 0, "records reloaded without a change"
        spawn(own_redis.url, "s1", prefix, "4M", PAGE, ttl=5.0)
        assert _wait(lambda: t._refresh() or len(t._live()) == 2, 5)
        assert len(loads) == 1
    finally:
        t.close()


def test_sentinel_url_with_an_acl_user(tmp_path, spawn):
    """Primary and replica require AUTH as an ACL user; the sentinel URL's user:password reaches them
    (the Sentinel itself runs without AUTH), and messages show the password as ***."""
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    from sentinel_procs import SentinelSet
    s = SentinelSet(tmp_path, user="hc", password="pw-7y")
    try:
        assert "hc:pw-7y@" in s.url
        prefix = "sa" + uuid.uuid4().hex[:6]
        spawn(s.url, "s0", prefix, "4M", PAGE, ttl=5.0)
        t = tier(s.url, prefix, PAGE, uuid.uuid4().hex)
        try:
            Bufs(t, 4, PAGE).round_trip(t, [f"a{i}" for i in range(4)])
            assert "pw-7y" not in str(t.stats()) and "hc:***@" in t.stats()["redis"]
        finally:
            t.close()
    finally:
        s.stop()
