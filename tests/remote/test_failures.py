"""Failures: a page server killed mid-stream, a hung server's TTL, Redis restarted, servers rejoining.

Each test has its own redis-server and servers (TTL 2 s), so killing them disturbs no other test.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid

import pytest

from remote_procs import PAGE
from remote_helpers import Bufs, tier


def wait_for(cond, timeout: float, every: float = 0.1) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


def sids_of(t, keys):  # noqa: ANN001
    return [e.split("|")[0] if e else None for e in t.dir.lookup(t.namespace, keys)]


@pytest.mark.slow
def test_server_killed_mid_stream_gives_misses_not_errors(own_redis, spawn):
    prefix = "k" + uuid.uuid4().hex[:6]
    servers = [spawn(own_redis.url, f"m{i}", prefix, size="24M", ttl=2.0) for i in range(2)]
    t = tier(own_redis.url, prefix, PAGE, "kill")
    b = Bufs(t, 16, PAGE)
    errors, rounds, misses = [], [0], [0]
    stop = threading.Event()

    def stream() -> None:
        bb = Bufs(t, 16, PAGE)
        r = 0
        while not stop.is_set():
            try:
                keys = [f"s{r}-{i}" for i in range(16)]
                t.put(keys, bb.fill(keys))
                ok = t.get(keys, bb.poisoned(16))
                bb.check(keys, ok)
                misses[0] += ok.count(False)
                t.delete(keys)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
            r += 1
            rounds[0] = r

    keys = [f"k{i}" for i in range(16)]
    try:
        assert t.put(keys, b.fill(keys)) == [True] * 16
        owner = sids_of(t, keys)
        assert set(owner) == {"m0", "m1"}
        th = threading.Thread(target=stream)
        th.start()
        assert wait_for(lambda: rounds[0] >= 3, 30)
        servers[0].kill(signal.SIGKILL)
        n0 = rounds[0]
        assert wait_for(lambda: rounds[0] >= n0 + 5, 60)
        ok = t.get(keys, b.poisoned(16))  # before the TTL lapses: the dead server's pages fail the READ
        assert ok == [o == "m1" for o in owner]
        b.check(keys, ok)
        assert wait_for(lambda: t.exists(keys) == [o == "m1" for o in owner], 10)  # TTL lapsed: misses
        stop.set()
        th.join(60)
        assert not th.is_alive() and not errors, errors[:3]
        assert t.stats()["peer_errors"] >= 1
        # the server comes back under the same name: it rejoins, and pages land on it again
        servers[0].start()
        more = [f"r{i}" for i in range(16)]
        assert wait_for(lambda: t.put(more, b.fill(more)) == [True] * 16 and "m0" in sids_of(t, more), 20)
        ok = t.get(more, b.poisoned(16))
        assert ok == [True] * 16
        b.check(more, ok)
    finally:
        stop.set()
        t.close()


def test_hung_server_expires_then_rejoins_with_a_new_epoch(own_redis, spawn):
    prefix = "h" + uuid.uuid4().hex[:6]
    srv = spawn(own_redis.url, "hung", prefix, size="8M", ttl=1.5)
    t = tier(own_redis.url, prefix, PAGE, "hang")
    try:
        b = Bufs(t, 8, PAGE)
        keys = [f"h{i}" for i in range(8)]
        assert t.put(keys, b.fill(keys)) == [True] * 8
        epoch = t.dir.r.hget(t.dir.key("srv", "hung"), "epoch")
        srv.kill(signal.SIGSTOP)
        assert wait_for(lambda: t.exists(keys) == [False] * 8, 6), "a silent server's pages must become misses"
        assert t.get(keys, b.poisoned(8)) == [False] * 8
        assert t.put(keys[:2], b.fill(keys[:2])) == [False, False]  # no live server: refused, no error
        srv.kill(signal.SIGCONT)
        assert wait_for(lambda: t.dir.r.hget(t.dir.key("srv", "hung"), "epoch") not in (None, epoch), 10)
        assert t.exists(keys) == [False] * 8  # the old incarnation's pages stay gone
        assert wait_for(lambda: t.put(keys, b.fill(keys)) == [True] * 8, 10)
        ok = t.get(keys, b.poisoned(8))
        assert ok == [True] * 8
        b.check(keys, ok)
    finally:
        t.close()


def test_redis_restart(own_redis, spawn):
    prefix = "r" + uuid.uuid4().hex[:6]
    spawn(own_redis.url, "rs", prefix, size="8M", ttl=2.0)
    t = tier(own_redis.url, prefix, PAGE, "restart")
    try:
        b = Bufs(t, 8, PAGE)
        keys = [f"r{i}" for i in range(8)]
        assert t.put(keys, b.fill(keys)) == [True] * 8
        own_redis.stop()
        t0 = time.monotonic()
        assert t.get(keys, b.poisoned(8)) == [False] * 8
        assert t.exists(keys) == [False] * 8
        assert t.put(keys, b.fill(keys)) == [False] * 8
        assert t.prefix(keys) == 0 and t.delete(keys) == [False] * 8
        assert time.monotonic() - t0 < 10, "a dead Redis must not make calls hang"
        own_redis.start()  # empty: no persistence
        assert wait_for(lambda: t.put(keys, b.fill(keys)) == [True] * 8, 20), "the server did not re-register"
        ok = t.get(keys, b.poisoned(8))
        assert ok == [True] * 8
        b.check(keys, ok)
        assert t.stats()["redis_errors"] >= 1
    finally:
        t.close()


def test_lapsed_reservation_is_reclaimed(own_redis, spawn):
    """A writer that reserved slots and died: its slots come back when the lease runs out."""
    prefix = "l" + uuid.uuid4().hex[:6]
    spawn(own_redis.url, "lease", prefix, size=str(8 * PAGE), ttl=5.0, low_water=0.0)
    t = tier(own_redis.url, prefix, PAGE, "lease")
    try:
        info = t.dir.servers()[0]
        res = t.dir.reserve(t.namespace, {"lease": (info.epoch, [f"x{i}" for i in range(8)])}, lease=0.5)
        assert all(not isinstance(r, int) for r in res["lease"])
        assert t.dir.server_state("lease")["pending"] == 8
        time.sleep(0.7)
        b = Bufs(t, 8, PAGE)
        keys = [f"y{i}" for i in range(8)]
        assert t.put(keys, b.fill(keys)) == [True] * 8
        assert t.exists([f"x{i}" for i in range(8)]) == [False] * 8
    finally:
        t.close()


def test_no_server_at_all_is_a_miss(own_redis):
    t = tier(own_redis.url, "empty" + uuid.uuid4().hex[:6], PAGE, "none")
    try:
        b = Bufs(t, 2, PAGE)
        assert t.put(["a", "b"], b.fill(["a", "b"])) == [False, False]
        assert t.get(["a", "b"], b.poisoned(2)) == [False, False]
        assert t.stats()["no_server"] >= 1
    finally:
        t.close()


def test_redis_auth_in_the_url_and_never_in_a_message(tmp_path, spawn, caplog):
    """Redis AUTH through the URL (``redis://:password@host``, as redis-py reads it) for clients
    and page servers alike; the password never shows in stats or logs; a wrong one is misses and
    a clear log line, never an exception."""
    import logging
    import subprocess

    import pytest
    from remote_procs import REDIS, free_port

    from hicache_gds.remote.directory import redact
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    assert redact("rediss://u:s3cr3t@[::1]:6380/0") == "rediss://u:***@[::1]:6380/0"
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    port = free_port()
    proc = subprocess.Popen([REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path), "--requirepass", "s3cr3t"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://:s3cr3t@127.0.0.1:{port}/0"
        deadline = time.monotonic() + 15
        while True:
            try:
                spawn(url, "auth", "auth", size="8M")
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        caplog.set_level(logging.INFO, logger="hicache_gds")
        t = tier(url, "auth", PAGE, "auth")
        try:
            keys = [f"a{i}" for i in range(4)]
            Bufs(t, 4, PAGE).round_trip(t, keys)
            assert "s3cr3t" not in str(t.stats()) and ":***@" in t.stats()["redis"]
        finally:
            t.close()
        bad = tier(f"redis://:wrong@127.0.0.1:{port}/0", "auth", PAGE, "auth")
        try:
            assert bad.exists(keys) == [False] * 4
            assert bad.get(keys, Bufs(bad, 4, PAGE).poisoned(4)) == [False] * 4
        finally:
            bad.close()
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "s3cr3t" not in text and "wrong" not in text and ":***@" in text
    finally:
        proc.kill()
        proc.wait(10)


def test_a_large_pool_is_registered_in_bounded_steps(own_redis, monkeypatch):
    """The free list is filled after REGISTER in scripts of at most `FILL_SLOTS` slots (a 4M-slot
    pool in one script held Redis for over a second); every slot ends up free exactly once, and a
    fill of an epoch registered over meanwhile stops."""
    from hicache_gds.remote.directory import Directory, ServerInfo
    monkeypatch.setattr(Directory, "FILL_SLOTS", 7)
    d = Directory(own_redis.url, "fill")
    calls = []
    real = d._call
    monkeypatch.setattr(d, "_call", lambda what, *a: calls.append(what) or real(what, *a))
    info = ServerInfo(sid="s1", epoch="e1", agent="a1", metadata=b"md", base=0, slot_bytes=4096, nslots=100,
                      host="h", pid=1)
    d.register_server(info, 30.0)
    assert calls == ["register"] + ["fill"] * 15
    free = [int(x) for x in d.r.lrange("{fill}:free:s1", 0, -1)]
    assert sorted(free) == list(range(100)) and 0 < d.r.pttl("{fill}:free:s1") <= 30000
    d.register_server(ServerInfo(**{**info.__dict__, "epoch": "e2"}), 30.0)
    stale = d._s["FILL"](keys=["{fill}:srv:s1", "{fill}:free:s1"], args=["e1", 30000, 100, 7])
    assert stale == 0 and d.r.llen("{fill}:free:s1") == 100
