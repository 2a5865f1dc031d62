"""RemoteTier against a real redis-server and three page-server processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from remote_procs import PAGE, child_env
from remote_helpers import POISON, Bufs, DeviceBufs, device_paths, tier

from hicache_gds.engines.base import MemKind
from hicache_gds.layout import Pages
from hicache_gds.memory import HostBuffer
from hicache_gds.remote import Directory

HERE = Path(__file__).resolve().parent


@pytest.fixture
def rt(cluster):
    t = tier(cluster["url"], cluster["prefix"], PAGE, uuid.uuid4().hex)
    yield t
    t.clear()
    t.close()


def keys_of(n: int, tag: str = "") -> list[str]:
    return [f"{tag or uuid.uuid4().hex[:6]}-{i}" for i in range(n)]


def test_round_trip_byte_exact(rt):
    keys = keys_of(40)
    b = Bufs(rt, 40, PAGE)
    assert rt.put(keys, b.fill(keys)) == [True] * 40
    ok = rt.get(keys, b.poisoned(40))
    assert ok == [True] * 40
    b.check(keys, ok)
    # a second round reads the same bytes (no reuse of live slots)
    ok = rt.get(keys[::-1], b.poisoned(40))
    b.check(keys[::-1], ok)
    sids = {Directory(rt.opts.url, rt.opts.prefix).lookup(rt.namespace, [k])[0].split("|")[0] for k in keys}
    assert len(sids) >= 2, "rendezvous hashing should spread 40 keys over 3 servers"


def test_multi_segment_pages(rt):
    """Pages of 4 scattered segments (like layer-first KV pools) round-trip segment by segment."""
    n, segs = 8, 4
    seg = PAGE // segs
    src, dst = HostBuffer(2 * n * PAGE, pinned=False), HostBuffer(2 * n * PAGE, pinned=False)
    rt.register_memory(src.addr, src.nbytes)
    rt.register_memory(dst.addr, dst.nbytes)
    src.numpy()[:] = np.random.default_rng(1).integers(0, 256, src.nbytes, dtype=np.uint8)
    # segment s of page p lives at (s * n + p) * 2 * seg: interleaved, with gaps
    off = np.array([[(s * n + p) * 2 * seg for s in range(segs)] for p in range(n)], dtype=np.uint64)
    lens = np.full_like(off, seg)
    keys = keys_of(n)
    assert rt.put(keys, Pages(np.uint64(src.addr) + off, lens)) == [True] * n
    dst.numpy()[:] = POISON
    rev = off[::-1].copy()
    assert rt.get(keys, Pages(np.uint64(dst.addr) + rev, lens)) == [True] * n
    for p in range(n):
        for s in range(segs):
            a, b2 = int(off[p, s]), int(rev[p, s])
            assert np.array_equal(dst.numpy()[b2:b2 + seg], src.numpy()[a:a + seg])


def test_exists_prefix_delete_clear(rt):
    keys = keys_of(10)
    b = Bufs(rt, 10, PAGE)
    assert rt.exists(keys) == [False] * 10
    assert rt.put(keys[:6], b.fill(keys[:6])) == [True] * 6
    assert rt.exists(keys) == [True] * 6 + [False] * 4
    assert rt.prefix(keys) == 6
    assert rt.delete(keys[2:4] + ["absent"]) == [True, True, False]
    assert rt.prefix(keys) == 2
    assert rt.get(keys[:6], b.poisoned(6)) == [True, True, False, False, True, True]
    assert (b.got(2) == POISON).all()
    assert rt.clear() == 4
    assert rt.exists(keys) == [False] * 10


def test_present_pages_are_not_rewritten_and_duplicates_collapse(rt):
    keys = keys_of(6)
    b = Bufs(rt, 8, PAGE)
    pages = b.fill(keys + keys[:2])
    assert rt.put(keys + keys[:2], pages) == [True] * 8
    assert rt.stats()["pages_written"] == 6
    assert rt.put(keys, pages.select(range(6))) == [True] * 6
    s = rt.stats()
    assert s["pages_written"] == 6 and s["put_skipped_present"] == 6


def test_namespaces_are_separate(cluster, rt):
    other = tier(cluster["url"], cluster["prefix"], PAGE, "other-" + uuid.uuid4().hex)
    try:
        keys = keys_of(3)
        b = Bufs(rt, 3, PAGE)
        rt.put(keys, b.fill(keys))
        assert other.exists(keys) == [False] * 3
    finally:
        other.close()


def test_stats_name_engine_and_path(rt):
    s = rt.stats()
    assert s["engine"] == "nixl-ucx"
    assert "UCX one-sided READ/WRITE" in s["path"] and "loopback" in s["path"]
    assert {x["sid"] for x in s["servers"]} >= {"s0", "s1", "s2"}


def test_wrong_page_size_is_an_error(rt):
    b = Bufs(rt, 2, PAGE)
    with pytest.raises(ValueError):
        rt.put(["a", "b"], Pages.contiguous(b.src.addr, PAGE // 2, [0, 1]))


def _client(args: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "remote_client.py"), json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), text=True)


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_same_key_race_leaves_one_copy(cluster):
    """Two processes put the same keys (different bytes) at the same moment: one copy per key survives."""
    ident, keys = uuid.uuid4().hex, keys_of(48)
    base = {"url": cluster["url"], "prefix": cluster["prefix"], "page": PAGE, "ident": ident, "keys": keys}
    start = time.time() + 4.0
    procs = [_client({**base, "op": "put", "salt": s, "start": start, "batch": 8}) for s in ("A", "B")]
    res = [_result(p) for p in procs]
    assert all(all(r["ok"]) for r in res)
    got = _result(_client({**base, "op": "get", "salts": ["A", "B"]}))
    assert got["ok"] == [True] * 48
    assert "CORRUPT" not in got["which"]
    # exactly one directory entry per key, and no slot leaked: owned slots == published entries
    t = tier(cluster["url"], cluster["prefix"], PAGE, ident)
    try:
        d = t.dir
        assert d.count(t.namespace) == 48
        entries = d.lookup(t.namespace, keys)
        own = {}
        for s in cluster["servers"]:
            own.update({(s.name, int(k)): v.decode() for k, v in d.r.hgetall(d.key("own", s.name)).items()})
        for k, e in zip(keys, entries):
            sid, _, slot, gen, *_ = e.split("|")
            dep = e.split("|")[6]
            assert own[(sid, int(slot))] == f"{dep}:{gen}\t{t.namespace}\t{k}"
        mine = [v for v in own.values() if v.split("\t")[1] == t.namespace]
        assert len(mine) == 48, "a losing writer's slot was not given back"
        pend = sum(d.server_state(s.name)["pending"] for s in cluster["servers"])
        assert pend == 0
        assert sum(r["stats"]["lost_races"] for r in res) + sum(r["stats"]["put_skipped_present"] for r in res) >= 48
    finally:
        t.clear()
        t.close()


@pytest.mark.slow
def test_concurrent_clients_in_two_processes(cluster):
    ident = uuid.uuid4().hex
    ka, kb = keys_of(32, "a" + ident[:4]), keys_of(32, "b" + ident[:4])
    base = {"url": cluster["url"], "prefix": cluster["prefix"], "page": PAGE, "ident": ident}
    start = time.time() + 4.0
    res = [_result(p) for p in [_client({**base, "keys": ka, "op": "put", "start": start}),
                                _client({**base, "keys": kb, "op": "put", "start": start})]]
    assert all(all(r["ok"]) for r in res)
    start = time.time() + 4.0
    got = [_result(p) for p in [_client({**base, "keys": kb, "op": "get", "start": start}),
                                _client({**base, "keys": ka, "op": "get", "start": start})]]
    for g in got:
        assert g["ok"] == [True] * 32 and set(g["which"]) == {""}


def test_eviction_is_lru_and_keeps_directory_consistent(own_redis, spawn):
    """A 16-slot server keeps 4 free; 40 puts evict the least recently used, entries and slots agree."""
    prefix = "ev" + uuid.uuid4().hex[:6]
    spawn(own_redis.url, "small", prefix, size=str(16 * PAGE), ttl=5.0, low_water=0.25)
    t = tier(own_redis.url, prefix, PAGE, "ev")
    try:
        b = Bufs(t, 8, PAGE)
        hot = keys_of(2, "hot")
        assert t.put(hot, b.fill(hot)) == [True] * 2
        cold = []
        for r in range(5):
            ks = keys_of(8, f"c{r}")
            cold += ks
            assert t.put(ks, b.fill(ks)) == [True] * 8
            assert t.get(hot, b.poisoned(2)) == [True, True]  # keeps the hot pages recently used
            time.sleep(0.05)
        time.sleep(1.5)  # a heartbeat evicts down to the low-water mark
        d, ns = t.dir, t.namespace
        state = d.server_state("small")
        assert state["evictions"] >= 26
        assert state["free"] + state["used"] + state["pending"] == 16
        assert state["used"] == d.count(ns) == state["owned"]
        assert t.exists(hot) == [True, True]
        assert t.exists(cold[:8]) == [False] * 8
        present = [k for k, f in zip(cold, t.exists(cold)) if f]
        ok = t.get(present[:8], b.poisoned(len(present[:8])))
        assert all(ok)
        b.check(present[:8], ok)
    finally:
        t.close()


def test_unreachable_redis_means_misses_not_errors(caplog):
    dead = f"redis://127.0.0.1:{__import__('remote_procs').free_port()}/0"
    t0 = time.monotonic()
    t = tier(dead, "none", PAGE, "x")
    try:
        b = Bufs(t, 4, PAGE)
        keys = keys_of(4)
        assert t.put(keys, b.fill(keys)) == [False] * 4
        assert t.get(keys, b.poisoned(4)) == [False] * 4
        assert t.exists(keys) == [False] * 4 and t.prefix(keys) == 0
        assert t.delete(keys) == [False] * 4 and t.clear() == 0
        assert t.stats()["redis_errors"] >= 1
    finally:
        t.close()
    assert time.monotonic() - t0 < 20
    assert any("redis" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_device_pages_are_read_through_staging_on_their_device_and_verified(cluster, device):
    """A get of device pages reads into staging on the same device and copies each request's pages
    out as it completes: byte-exact, the READs never pointed at the caller's pages, and a page whose
    bytes changed on its server is a miss while the rest are served (checked by the device
    checksum on the caller's pages)."""
    from hicache_gds.engines.base import Op
    from hicache_gds.remote.directory import parse_entry
    t = tier(cluster["url"], cluster["prefix"], PAGE, uuid.uuid4().hex)
    try:
        device_paths(t, device)
        keys = keys_of(16)
        b = DeviceBufs(t, 16, PAGE, device)
        assert t.put(keys, b.fill(keys)) == [True] * 16
        dests: list = []
        submit = t.engine.submit

        def spy(op, kind, mem, rem):  # noqa: ANN001, ANN202
            if op is Op.READ:
                dests.extend(int(a) for a in mem[:, 0])
                assert kind is MemKind.VRAM  # device staging, not host staging
            return submit(op, kind, mem, rem)

        t.engine.submit = spy
        before = t.stats()
        ok = t.get(keys, b.poisoned(16))
        assert ok == [True] * 16
        b.check(keys, ok)
        assert dests and not any(a in b.dst_range for a in dests)
        assert t.stats()["staged_pages"] - before["staged_pages"] == 16
        assert len(t._stagings.devices) == 1 and t._stagings.host.free == []  # one GPU's staging; no host staging

        entries = Directory(t.opts.url, t.opts.prefix).lookup(t.namespace, keys)
        peers = {p.info.sid: p for p in t._live()}
        ob = Bufs(t, 1, PAGE)
        for i in (2, 11):
            sid, _epoch, slot, *_ = parse_entry(entries[i])
            other = ob.fill([f"other-{i}"], salt="x")
            assert t._move(Op.WRITE, other, {sid: (peers[sid], [(0, slot)])}) == {sid: ["ok"]}
        ok = t.get(keys, b.poisoned(16))
        assert ok == [i not in (2, 11) for i in range(16)]
        b.check(keys, ok)
    finally:
        t.clear()
        t.close()


def _listening(pid: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of TCP sockets `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if path.exists():
            for line in path.read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                    out.append(f[1].split(":")[0])
    return out


def test_page_servers_listen_on_loopback_only(cluster):
    for s in cluster["servers"]:
        addrs = _listening(s.proc.pid)
        assert addrs, "the UCX worker should listen for wire-up"
        assert all(a in ("0100007F", "00000000000000000000000001000000") for a in addrs), addrs


def test_serve_needs_its_network_devices_named(capsys, monkeypatch):
    """A page server opens its pool to whoever reaches its devices: it listens only where told."""
    from hicache_gds.remote.server import main
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    assert main(["--size", "64M", "--redis", "redis://127.0.0.1:1/0"]) == 2
    assert "--net-devices" in capsys.readouterr().err


def test_serve_rejects_a_pool_without_slots(capsys):
    from hicache_gds.remote.server import main
    assert main(["--size", "1M", "--page-bytes", "2M", "--redis", "redis://127.0.0.1:1/0"]) == 2
    assert "holds no slot" in capsys.readouterr().err


def test_every_page_carries_a_checksum_that_any_memory_checks(rt):
    """Pages written from device memory carry hgc1 (one kernel launch on their GPU), host pages
    xxh3: none goes without. A read checks the kind recorded, whichever memory it lands in, so a
    device-written page read into host memory (or the reverse) is verified, and a flipped byte is
    a mismatch. (The GPU kernel runs on the CPU here, on host memory standing in for VRAM.)"""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():  # pagesum hashes a device page through CUDA wherever torch has it
        pytest.skip("host memory stands in for device memory only where torch has no CUDA")
    from hicache_gds.testing.host_as_vram import cpu_device_sums
    n, idx = 4, [0, 1, 2, 3]
    buf = HostBuffer(n * PAGE, pinned=False)
    buf.numpy()[:] = np.random.default_rng(7).integers(0, 256, buf.nbytes, dtype=np.uint8)
    host = Pages.contiguous(buf.addr, PAGE, range(n))
    dev = Pages(host.addrs, host.lens, MemKind.VRAM)
    rt._device_sums = cpu_device_sums()
    from_dev, from_host = rt._sums(dev, idx), rt._sums(host, idx)
    assert all(c & 1 for c in from_dev) and all(c and not c & 1 for c in from_host)
    assert rt._sums(host, idx, like=from_dev) == from_dev  # written from VRAM, read into DRAM
    assert rt._sums(dev, idx, like=from_host) == from_host  # and the reverse
    buf.numpy()[5] ^= 0x10
    assert rt._sums(host, [0], like=from_dev[:1]) != from_dev[:1]
    assert rt._sums(dev, [0], like=from_host[:1]) != from_host[:1]


def test_a_page_whose_bytes_changed_on_its_server_is_a_miss_and_the_rest_are_served(rt):
    """Two pages' slots are overwritten one-sided behind the directory's back (what a late write
    of a lost history would do): a get checks every page's checksum as its request's pages are
    copied out of staging, so those two are misses (their entries dropped, counted), the other 22
    are served byte for byte, and a second get misses them without a transfer."""
    from hicache_gds.engines.base import Op
    from hicache_gds.remote.directory import parse_entry
    keys = keys_of(24)
    b = Bufs(rt, 24, PAGE)
    assert rt.put(keys, b.fill(keys)) == [True] * 24
    entries = Directory(rt.opts.url, rt.opts.prefix).lookup(rt.namespace, keys)
    peers = {p.info.sid: p for p in rt._live()}
    for i in (3, 17):
        sid, _epoch, slot, *_ = parse_entry(entries[i])
        other = b.fill([f"other-{i}"], salt="x")
        assert rt._move(Op.WRITE, other, {sid: (peers[sid], [(0, slot)])}) == {sid: ["ok"]}
    before = rt.stats()
    ok = rt.get(keys, b.poisoned(24))
    assert ok == [i not in (3, 17) for i in range(24)]
    b.check(keys, ok)
    st = rt.stats()
    assert st["checksum_mismatches"] - before["checksum_mismatches"] == 2
    assert st["staged_pages"] - before["staged_pages"] == 24
    ok = rt.get(keys, b.poisoned(24))
    assert ok == [i not in (3, 17) for i in range(24)]
    assert rt.stats()["checksum_mismatches"] == st["checksum_mismatches"]  # dropped: not read again


def test_a_server_that_stops_answering_is_set_aside_then_tried_again(cluster):
    """A server that still heartbeats but whose transfers hang costs one `io_timeout`, not one
    per batch: it is set aside (its pages are misses at once, new keys go to the others), for
    longer with each timeout in a row, and serves again once it answers."""
    from hicache_gds.engines.base import Transfer
    from hicache_gds.errors import TransferTimeout

    class Hung(Transfer):
        def _poll(self) -> bool:
            return False

    t = tier(cluster["url"], cluster["prefix"], PAGE, uuid.uuid4().hex, io_timeout=1)
    try:
        keys = keys_of(24)
        b = Bufs(t, 24, PAGE)
        assert t.put(keys, b.fill(keys)) == [True] * 24
        sids = [e.split("|")[0] for e in Directory(t.opts.url, t.opts.prefix).lookup(t.namespace, keys)]
        hung_sid = sids[0]
        hung_peer = t._peers[hung_sid].peer_id
        on_hung = [s == hung_sid for s in sids]
        real = t.engine.submit

        def submit(op, kind, mem, rem):  # noqa: ANN001, ANN202
            if (rem[:, 0] == hung_peer).any():
                return Hung("nixl-ucx", op, int(mem[:, 1].sum()), "hung server")
            return real(op, kind, mem, rem)

        t.engine.submit = submit
        t0 = time.monotonic()
        ok = t.get(keys, b.poisoned(24))
        assert ok == [not h for h in on_hung] and time.monotonic() - t0 < 5
        b.check(keys, ok)
        assert t.stats()["peers_set_aside"] == 1
        t0 = time.monotonic()
        ok = t.get(keys, b.poisoned(24))  # set aside: no second wait
        assert ok == [not h for h in on_hung] and time.monotonic() - t0 < 0.5
        more = keys_of(16)
        assert t.put(more, b.fill(more)) == [True] * 16
        assert hung_sid not in {e.split("|")[0] for e in Directory(t.opts.url, t.opts.prefix).lookup(t.namespace, more)}
        t.engine.submit = real  # it answers again: after its hold, its pages are hits
        assert wait_for_true(lambda: t.get(keys, b.poisoned(24)) == [True] * 24, 10)
        b.check(keys, [True] * 24)
        assert t._peers[hung_sid].strikes == 0
    finally:
        t.close()


def wait_for_true(fn, timeout: float) -> bool:  # noqa: ANN001
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if fn():
            return True
        time.sleep(0.2)
    return False


def test_tcp_segment_defaults_respect_the_environment(monkeypatch):
    """Agents are made with 1 MiB UCX TCP send and receive segments (gets over TCP come back one
    segment a message), unless the environment names a size; sizes read as UCX reads them."""
    from hicache_gds.remote.ucx import TCP_DEFAULTS, tcp_defaults, tcp_segments, ucx_size
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE", raising=False)
    monkeypatch.delenv("UCX_TCP_RX_SEG_SIZE", raising=False)
    assert tcp_segments() == (8 << 10, 64 << 10)  # UCX's own
    tcp_defaults()
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == TCP_DEFAULTS["UCX_TCP_TX_SEG_SIZE"] == "1m"
    assert os.environ["UCX_TCP_RX_SEG_SIZE"] == TCP_DEFAULTS["UCX_TCP_RX_SEG_SIZE"] == "1m"
    assert tcp_segments() == (1 << 20, 1 << 20)
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "8k")
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "auto")
    tcp_defaults()
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == "8k" and tcp_segments() == (8 << 10, None)
    # UCX opens no TCP interface whose send segment exceeds its receive segment: one size set
    # bounds the other's default
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE")
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "64k")
    tcp_defaults()
    assert tcp_segments() == (64 << 10, 64 << 10)
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "4m")
    monkeypatch.delenv("UCX_TCP_RX_SEG_SIZE")
    tcp_defaults()
    assert tcp_segments() == (4 << 20, 4 << 20)
    assert [ucx_size(v) for v in ("65536", "64K", "1mb", "2G", "inf", "")] == [65536, 65536, 1 << 20, 2 << 30, None,
                                                                                None]


def test_servers_publish_their_send_segment_and_a_client_that_cannot_take_it_skips_them(cluster, monkeypatch,
                                                                                          caplog):
    """A receiver drops the connection on a message larger than its receive segment (tried: every
    page of the batch a miss). Page servers publish their send segment; a client receiving less
    uses none of them and says which setting to change, and one that can take it is served."""
    import logging

    from hicache_gds.remote.directory import ServerInfo
    infos = Directory(cluster["url"], cluster["prefix"]).servers()
    assert len(infos) == 3 and {i.tcp_tx for i in infos} == {1 << 20}
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "64k")  # a client of an earlier release
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "64k")
    monkeypatch.delenv("UCX_TLS", raising=False)
    caplog.set_level(logging.WARNING, logger="hicache_gds")
    t = tier(cluster["url"], cluster["prefix"], PAGE, uuid.uuid4().hex)
    try:
        assert t.engine.tcp_rx == 64 << 10
        keys = keys_of(6)
        b = Bufs(t, 6, PAGE)
        assert t.put(keys, b.fill(keys)) == [False] * 6 and t.get(keys, b.poisoned(6)) == [False] * 6
        assert (b.dst.numpy() == POISON).all()
        lines = [r.getMessage() for r in caplog.records if "UCX_TCP_RX_SEG_SIZE" in r.getMessage()]
        assert lines and "sends TCP segments of 1048576 bytes" in lines[0] and "receives at most 65536" in lines[0]
        assert "UCX_TCP_RX_SEG_SIZE=1048576 here" in lines[0] and "UCX_TCP_TX_SEG_SIZE=65536 on that server" in lines[0]
        # a server of an earlier release publishes nothing: used as before
        old = ServerInfo(**{**infos[0].__dict__, "tcp_tx": 0})
        pid = t._connect(old)
        assert pid
        t._drop_agent(old.agent)
    finally:
        t.close()
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "1m")
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "1m")
    t = tier(cluster["url"], cluster["prefix"], PAGE, uuid.uuid4().hex)
    try:
        keys = keys_of(6)
        b = Bufs(t, 6, PAGE)
        b.round_trip(t, keys)
        t.clear()
    finally:
        t.close()


def test_a_record_signs_its_send_segment_and_earlier_records_still_verify():
    from hicache_gds.remote import trust
    secret = b"s3cret"
    base = {"sid": "s0", "epoch": "e", "agent": "a", "md": b"m", "base": "1", "slot_bytes": "2", "nslots": "3",
            "host": "h", "ts": "1.0"}
    old = trust.sign(secret, base)  # a server of an earlier release: no tcp_tx in its record
    assert trust.verify(secret, base, old)
    new = {**base, "tcp_tx": str(1 << 20)}
    mac = trust.sign(secret, new)
    assert trust.verify(secret, new, mac) and mac != old
    assert not trust.verify(secret, {**new, "tcp_tx": str(64 << 10)}, mac)  # changed by someone without the secret
    assert not trust.verify(secret, base, mac)  # or removed
