"""No directory script holds Redis longer than 10 ms with a 4M-slot page server.

A real redis-server; a 4M-slot server registered (REGISTER + FILL steps), 1M published pages
loaded into the directory, then every script at that size: heartbeats that evict at their bound,
reserve/publish/lookup/validate/delete of 256-page batches, CLEAR of the namespace in HSCAN steps,
and a re-registration of the pool (its old keys UNLINKed). Measured two ways: Redis' SLOWLOG (every
command over 1 ms) and the worst latency of a PING sent every 2 ms by another client meanwhile.
``python -m pytest -s`` prints both. On a machine whose cores are busy with other work, the
measured times include the time Redis waited for a core; ``HICACHE_GDS_SCALE_RT=1`` runs this
test's redis-server at real-time priority (chrt), so that what is measured is the scripts' own time.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

NSLOTS = 4 << 20
PAGES = 1 << 20
LIMIT_US = 10_000

pytestmark = pytest.mark.slow


def _load_pages(d, sid: str, epoch: str, dep: int, ns: str, n: int) -> None:  # noqa: ANN001
    """n published pages at slots 0..n-1 (test setup, straight into the structures PUBLISH keeps)."""
    free, lru, own = d.key("free", sid), d.key("lru", sid), d.key("own", sid)
    step = 10_000
    for lo in range(0, n, step):
        pipe = d.r.pipeline(transaction=False)
        hi = min(n, lo + step)
        pipe.hset(d.key("dir"), mapping={f"{ns}\tk{s}": f"{sid}|{epoch}|{s}|{s + 1}|4096|0|{dep}" for s in range(lo, hi)})
        pipe.hset(own, mapping={str(s): f"{dep}:{s + 1}\t{ns}\tk{s}" for s in range(lo, hi)})
        pipe.zadd(lru, {str(s): s for s in range(lo, hi)})
        pipe.execute()
    d.r.ltrim(free, n, -1)  # those slots are no longer free
    d.r.hset(d.key("srv", sid), "gen", n + 1)


def _cpu_s(pid: int) -> float:
    """CPU seconds redis-server used so far (user + system)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def test_no_script_blocks_redis_for_10ms_at_4m_slots(own_redis):
    from hicache_gds.remote.directory import Directory, Reservation, ServerInfo
    if os.environ.get("HICACHE_GDS_SCALE_RT") == "1":
        subprocess.run(["chrt", "-f", "-p", "1", str(own_redis.proc.pid)], check=True)
    d = Directory(own_redis.url, "scale", timeout=30.0)
    admin = own_redis.client()
    pinger = own_redis.client()
    admin.config_set("slowlog-log-slower-than", 1000)
    admin.config_set("slowlog-max-len", 100000)
    calls: dict[str, int] = {}
    real = d._call
    d._call = lambda what, *a: calls.__setitem__(what, calls.get(what, 0) + 1) or real(what, *a)  # type: ignore[method-assign]
    cpu: dict[str, float] = {}
    pid = own_redis.proc.pid

    def phase(name: str, fn, *names: str) -> None:  # noqa: ANN001
        before, c0, t0 = _cpu_s(pid), sum(calls.get(n, 0) for n in names), time.monotonic()
        fn()
        n = sum(calls.get(x, 0) for x in names) - c0
        cpu[name] = (_cpu_s(pid) - before) / max(n, 1)
        print(f"  {name}: {n} scripts, {cpu[name] * 1e3:.2f} ms of Redis CPU each, {time.monotonic() - t0:.1f} s")

    info = ServerInfo(sid="big", epoch="e1", agent="a", metadata=b"m" * 512, base=0, slot_bytes=4096,
                      nslots=NSLOTS, host="h", pid=1)
    print()
    phase("register + fill 4M slots", lambda: d.register_server(info, 600.0), "register", "fill")
    assert d.server_state("big")["free"] == NSLOTS
    _load_pages(d, "big", "e1", d.epoch, "ns-a", PAGES)
    admin.slowlog_reset()

    worst_ping = [0.0]
    stop = threading.Event()

    def ping() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            pinger.ping()
            worst_ping[0] = max(worst_ping[0], time.perf_counter() - t0)
            time.sleep(0.002)

    keys = [f"n{i}" for i in range(256)]

    def batches() -> None:
        for _ in range(10):
            res = d.reserve("ns-b", {"big": ("e1", keys)}, lease=30)["big"]
            d.publish("ns-b", {"big": ("e1", [(r, 4096, 0) for r in res if isinstance(r, Reservation)])})
            ents = d.lookup("ns-b", keys)
            d.validate("ns-b", list(zip(keys, ents)))
            d.delete("ns-b", keys)

    removed = [0]
    th = threading.Thread(target=ping, daemon=True)
    th.start()
    try:
        phase("heartbeat evicting at its bound", lambda: [d.heartbeat("big", "e1", 600.0, NSLOTS) for _ in range(10)],
              "heartbeat")
        phase("256-page reserve/publish/lookup/validate/delete", batches,
              "reserve", "publish", "lookup", "validate", "delete")
        phase("clear of 1M pages", lambda: removed.__setitem__(0, d.clear("ns-a")), "clear")
        phase("re-register (old pool unlinked) + fill",
              lambda: d.register_server(ServerInfo(**{**info.__dict__, "epoch": "e2"}), 600.0), "register", "fill")
    finally:
        stop.set()
        th.join()
    assert removed[0] >= PAGES - 10 * Directory.MAX_EVICT
    log = [e for e in admin.slowlog_get(100000) if e["command"].startswith(b"EVALSHA")]
    worst = max((e["duration"] for e in log), default=0)
    print(f"  wall clock (includes waits for a core): worst script {worst / 1e3:.1f} ms, {len(log)} over 1 ms; "
          f"worst concurrent PING {worst_ping[0] * 1e3:.1f} ms; load average {os.getloadavg()[0]:.1f}")
    over = {k: v for k, v in cpu.items() if v * 1e6 > LIMIT_US}
    assert not over, f"scripts that take over 10 ms of Redis CPU each: {over}"
    d.close()
