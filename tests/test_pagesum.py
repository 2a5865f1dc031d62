"""Format 3's two checksum kinds (`hicache_gds.pagesum`): xxh3 for pages written from host memory,
hgc1 for pages written from GPU memory, told apart by the recorded value's lowest bit. Each is
checked wherever its page lands (host or "device": host memory standing in for it, `fake_vram`),
a damaged page of either kind is a miss on every path, `verify` checks both, and a namespace of the
format before opens empty. Also the read-rate probe a fresh store seeds its cost model with."""

from __future__ import annotations

import json
import logging
import os
import sqlite3

import numpy as np
import pytest
import xxhash

from hicache_gds import MemKind, PageStore, Pages, pagesum
from hicache_gds import checksum as C
from hicache_gds.cli import main as cli
from hicache_gds.engines import EngineOptions, create_engine
from hicache_gds.memory import HostBuffer
from hicache_gds.probe import probe_read_rate
from hicache_gds.slabs import ondisk

from fake_vram import HostAsVram, use_fake_vram

PAGE = 64 << 10


def rand(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_the_kinds_are_told_apart_by_the_lowest_bit_and_never_zero():
    for seed in range(200):
        b = rand(4096 + seed, seed)
        x = pagesum.page_sum(b)
        h = pagesum.page_sum(b, kind=pagesum.HGC1)
        assert x and x % 2 == 0 and pagesum.kind_of(x) == pagesum.XXH3
        assert h % 2 == 1 and pagesum.kind_of(h) == pagesum.HGC1 and h == C.checksum(b) | 1
        want = xxhash.xxh3_64_intdigest(b.tobytes()) & ~1
        assert x == C.to_sqlite(want) or (want == 0 and x == 2)
    assert pagesum.tag(pagesum.XXH3, 0) == 2 and pagesum.tag(pagesum.XXH3, 1) == 2
    assert pagesum.kinds_of(np.array([2, 3, -4, -5])).tolist() == [False, True, False, True]
    with pytest.raises(ValueError, match="unknown checksum kind"):
        pagesum.tag("crc", 5)


def test_xxh3_of_segments_is_the_page_zero_padded_to_its_stored_length():
    b = rand(3 * 4096 + 100, 1)
    parts = [np.ascontiguousarray(b[:1000]), np.ascontiguousarray(b[1000:9000]), np.ascontiguousarray(b[9000:])]
    segs = [(p.ctypes.data, p.size) for p in parts]
    assert pagesum.xxh3_of(segs, b.size) == pagesum.page_sum(b)
    longer = b.size + 5 * (1 << 20)  # past the zero buffer: padded in steps
    padded = np.concatenate([b, np.zeros(longer - b.size, np.uint8)])
    assert pagesum.xxh3_of(segs, longer) == pagesum.page_sum(padded) == pagesum.page_sum(b, longer)
    assert pagesum.xxh3_of(segs, longer) != pagesum.page_sum(b)
    with pytest.raises(ValueError, match="shorter"):
        pagesum.xxh3_of(segs, b.size - 1)
    mixed = pagesum.host_sums([segs, segs], b.size, [False, True])
    assert mixed == [pagesum.page_sum(b), C.checksum(b) | 1]


def _store(d: str, slots: int = 32, **cfg) -> PageStore:
    eng = HostAsVram(create_engine("bounce", EngineOptions(direct_io=True)))
    return use_fake_vram(PageStore(PAGE, {"model": "pagesum"}, config={"gds_path": d, "capacity": slots * PAGE, **cfg},
                                   mem_kinds=(MemKind.DRAM, MemKind.VRAM), engine=eng))


def _damage(store: PageStore, key: str) -> None:
    e = store.index.peek([key])[key]
    fi, off = store.slabs.place(np.array([e.slot]))
    fd = os.open(store.slabs.paths[int(fi[0])], os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xa5" * 512, int(off[0]) + PAGE // 3 // 512 * 512)
    finally:
        os.close(fd)


def test_each_kind_is_checked_where_its_page_lands_and_a_damaged_one_is_a_miss_everywhere(gds_dir):
    """Host-written pages (xxh3) read into host and device memory, device-written pages (hgc1)
    read into both: right bytes where intact, a miss (dropped) where damaged, on all four paths."""
    n = 6
    with _store(gds_dir) as s:
        host, dev = HostBuffer(n * PAGE), HostBuffer(n * PAGE)
        s.register_memory(host.addr, host.nbytes, MemKind.DRAM)
        s.register_memory(dev.addr, dev.nbytes, MemKind.VRAM)
        hd, dd = rand(n * PAGE, 11), rand(n * PAGE, 12)
        host.numpy()[:], dev.numpy()[:] = hd, dd
        hk, vk = [f"h{i}" for i in range(n)], [f"v{i}" for i in range(n)]
        assert all(s.put(hk, Pages.contiguous(host.addr, PAGE, range(n))))
        assert all(s.put(vk, Pages.contiguous(dev.addr, PAGE, range(n), MemKind.VRAM)))
        rows = s.index.peek(hk + vk)
        assert [rows[k].csum for k in hk] == [pagesum.page_sum(hd[i * PAGE:(i + 1) * PAGE]) for i in range(n)]
        assert [rows[k].csum for k in vk] == [C.checksum(dd[i * PAGE:(i + 1) * PAGE]) | 1 for i in range(n)]
        for k in ("h1", "h4", "v2", "v5"):
            _damage(s, k)
        # host pages into "device" memory (xxh3 copied out and hashed), device pages into host (hgc1 on the CPU)
        dev.numpy()[:] = 0xEE
        assert s.get(hk, Pages.contiguous(dev.addr, PAGE, range(n), MemKind.VRAM)) == \
            [True, False, True, True, False, True]
        host.numpy()[:] = 0xEE
        assert s.get(vk, Pages.contiguous(host.addr, PAGE, range(n))) == [True, True, False, True, True, False]
        for i in (0, 2, 3, 5):
            assert dev.numpy()[i * PAGE:(i + 1) * PAGE].tobytes() == hd[i * PAGE:(i + 1) * PAGE].tobytes()
        for i in (0, 1, 3, 4):
            assert host.numpy()[i * PAGE:(i + 1) * PAGE].tobytes() == dd[i * PAGE:(i + 1) * PAGE].tobytes()
        assert s.exists(["h1", "h4", "v2", "v5"]) == [False] * 4
        assert s.stats()["checksum_mismatches"] == 4
        # what a GPU-direct path compares with a lease's checksums: each page of its recorded kind
        with s.lease(["h0", "v0"]) as lease:
            both = Pages(np.array([[dev.addr], [host.addr]], dtype=np.uint64),  # h0's bytes, v0's bytes
                         np.full((2, 1), PAGE, dtype=np.uint64), MemKind.DRAM)
            assert s.page_checksums(both, like=lease.checksums).tolist() == lease.checksums.tolist()
            assert [pagesum.kind_of(int(c)) for c in lease.checksums] == [pagesum.XXH3, pagesum.HGC1]
            assert s.page_checksums(both).tolist()[0] == int(lease.checksums[0])  # host bytes: xxh3 by default


def test_verify_checks_both_kinds(gds_dir, capsys):
    n = 4
    with _store(gds_dir) as s:
        host, dev = HostBuffer(n * PAGE), HostBuffer(n * PAGE)
        s.register_memory(host.addr, host.nbytes, MemKind.DRAM)
        s.register_memory(dev.addr, dev.nbytes, MemKind.VRAM)
        host.numpy()[:], dev.numpy()[:] = rand(n * PAGE, 21), rand(n * PAGE, 22)
        assert all(s.put([f"h{i}" for i in range(n)], Pages.contiguous(host.addr, PAGE, range(n))))
        assert all(s.put([f"v{i}" for i in range(n)], Pages.contiguous(dev.addr, PAGE, range(n), MemKind.VRAM)))
        _damage(s, "h2")
        _damage(s, "v3")
    rc = cli(["verify", "--path", gds_dir, "--json"])
    (rep,) = json.loads(capsys.readouterr().out)["reports"]
    assert rc == 1 and rep["checked"] == 2 * n and rep["ok"] == 2 * n - 2 and rep["dropped"] == 2


def test_a_format_2_namespace_opens_empty_with_one_info_line(gds_dir, caplog):
    with _store(gds_dir) as s:
        host = HostBuffer(2 * PAGE)
        s.register_memory(host.addr, host.nbytes)
        host.numpy()[:] = rand(2 * PAGE, 31)
        assert all(s.put(["a", "b"], Pages.contiguous(host.addr, PAGE, range(2))))
        db_path = os.path.join(s.stats()["dirs"][0], "index.sqlite3")
    db = sqlite3.connect(db_path)
    try:  # what the version before wrote: every page hgc1, unmarked
        db.execute("UPDATE meta SET value = '2' WHERE name = ?", (ondisk.FORMAT_KEY,))
        db.commit()
    finally:
        db.close()
    with caplog.at_level(logging.INFO):
        with _store(gds_dir) as s:
            assert s.exists(["a", "b"]) == [False, False]
    assert "on-disk format 2" in caplog.text and "starting the namespace empty" in caplog.text
    assert ondisk.page_checksum(2) is not ondisk.page_checksum(3)
    b = rand(PAGE, 32)
    assert ondisk.page_checksum(2)(b, PAGE, 0) == C.checksum(b)
    assert ondisk.page_checksum(3)(b, PAGE, 5) == C.checksum(b) | 1
    with pytest.raises(Exception, match="format 9"):
        ondisk.page_checksum(9)


def test_the_probe_measures_every_directory_and_leaves_nothing(tmp_path):
    dirs = [str(tmp_path / f"d{i}") for i in range(2)]
    for d in dirs:
        os.makedirs(d)
    got, why = probe_read_rate(dirs, nbytes=8 << 20, chunk=1 << 20, threads=4)
    assert got is not None and why == "" and got.bytes_per_s > 0
    assert "2 directories" in got.source and "O_DIRECT" in got.source
    assert all(os.listdir(d) == [] for d in dirs)
    none, why = probe_read_rate([str(tmp_path / "missing")])
    assert none is None and "missing" in why
    assert probe_read_rate([]) == (None, "no directory to probe")
