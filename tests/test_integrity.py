"""Integrity under faults (issue 19): each reproduction of a path that lost pages, served wrong bytes
or raised raw errors, as a test. The scenarios live in `hicache_gds.testing.integrity` (the
reliability run reports them too); each names the one fault it injects.
"""

import logging
import os
import re
import sqlite3

import numpy as np
import pytest

from hicache_gds import ConfigError, HiCacheGDSError, MemKind, PageReader, PageStore, Pages, StoreClosedError
from hicache_gds import checksum as C
from hicache_gds.engines import EngineOptions, create_engine
from hicache_gds.memory import HostBuffer
from hicache_gds.testing import integrity as I

from fake_vram import HostAsVram, use_fake_vram

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = I.PAGE


def judge(case):
    assert case.ok, (case.name, case.problems, case.outcome)


# -- 1. failures between reserve and publish -----------------------------------------------------------------

@pytest.mark.parametrize("fault", I.FAULTS)
@pytest.mark.slow
def test_a_failing_put_gives_its_slots_back_and_evicts_nothing(gds_dir, fault):
    """64 slots, 32 acknowledged pages, 8 failing puts of 8 pages; then 16 pages from this process and
    8 from another go in, and the acknowledged pages read byte-exact (none was evicted)."""
    case = I.failed_put_case(gds_dir, fault)
    judge(case)
    assert case.caught == 64 and case.served_ok == 32 and case.wrong_bytes == 0


def test_a_put_whose_staging_cannot_be_registered_takes_no_slot(gds_dir):
    """Staging is registered and filled before slots are reserved: such a put never evicts."""
    with I._store(gds_dir, "nostage", 8, engine="nixl-posix") as s:
        buf = HostBuffer(9 * PAGE)
        s.register_memory(buf.addr, buf.nbytes)
        ks = [f"a{i}" for i in range(8)]
        assert all(s.put(ks, Pages.contiguous(buf.addr, PAGE, range(8))))  # full
        with I._inject("NIXL registration error in staging", s):
            assert s.put(["x0", "x1"], Pages.contiguous(buf.addr + 64, PAGE, range(2))) == [False, False]
        st = s.stats()
        assert st["evictions"] == 0 and st["reserved_slots_all"] == 0 and all(s.exists(ks))


def test_a_duplicate_freed_by_publish_is_not_released_again(gds_dir):
    """publish frees the slot of a key another put stored meanwhile; another call of this process may
    reserve it at once, so the put must not release it again (that call would lose its reservation,
    and two writers would share the slot)."""
    with I._store(gds_dir, "dup", 2) as a, I._store(gds_dir, "dup", 2) as b:
        buf = HostBuffer(2 * PAGE)
        for s in (a, b):
            s.register_memory(buf.addr, buf.nbytes)
        taken = []
        real = a.index.publish

        def racing(items):
            assert b.put(["k"], Pages.contiguous(buf.addr, PAGE, [1])) == [True]  # the same key, first
            out = real(items)  # a duplicate now: its slot goes back to the free list...
            taken.extend(a.index.reserve(1))  # ...and another call of this process takes it at once
            return out
        a.index.publish = racing
        assert a.put(["k"], Pages.contiguous(buf.addr, PAGE, [0])) == [True]  # stored by the other
        del a.index.publish
        held = dict(a.index._rdb.execute("SELECT slot, owner FROM held").fetchall())
        assert len(taken) == 1 and held.get(taken[0]) == a.index.owner, (taken, held)
        a.index.release(taken)


# -- 2. directory order ----------------------------------------------------------------------------------------

def test_a_reordered_gds_path_maps_pages_as_written_and_a_missing_directory_is_refused(gds_dir):
    cases = I.directory_order_cases(gds_dir)
    for case in cases:
        judge(case)
    assert [c.served_ok for c in cases[:2]] == [8, 8] and all(c.caught == 1 for c in cases[2:])


def test_a_reader_follows_the_recorded_order(gds_dir):
    a, b = (os.path.join(gds_dir, x) for x in "ab")
    os.makedirs(a), os.makedirs(b)
    ks = [f"r{i}" for i in range(8)]
    buf = HostBuffer(8 * PAGE)
    with I._store(f"{a},{b}", "reader-order", 16) as s:
        s.register_memory(buf.addr, buf.nbytes)
        I._fill(buf.numpy(), ks, PAGE)
        assert all(s.put(ks, Pages.contiguous(buf.addr, PAGE, range(8))))
    with PageReader(PAGE, {"model": "reader-order"}, config={"gds_path": f"{b},{a}", "engine": "nixl-posix"}) as r:
        assert r.dirs == [os.path.join(a, r.namespace), os.path.join(b, r.namespace)]
        assert I._read_back(r, ks, HostBuffer(8 * PAGE)) == (8, 0, 0)


def test_directories_of_two_namespaces_of_one_name_are_refused(gds_dir):
    """One directory from another namespace of the same name (copied, restored, remounted): refused."""
    a, b, c, d = (os.path.join(gds_dir, x) for x in "abcd")
    for x in (a, b, c, d):
        os.makedirs(x)
    for path in (f"{a},{b}", f"{c},{d}"):
        with I._store(path, "stripes", 16):
            pass
    with pytest.raises(ConfigError, match="two different namespaces"):
        I._store(f"{a},{d}", "stripes", 16)


# -- 3. checksums for GPU pages (host memory standing in for device memory) -----------------------------------

def _fake_store(d, page=PAGE, slots=64, **cfg):
    eng = HostAsVram(create_engine("bounce", EngineOptions(direct_io=cfg.get("direct_io", True))))
    s = PageStore(page, {"model": "device-pages"}, config={"gds_path": d, "capacity": slots * page, **cfg},
                  mem_kinds=(MemKind.VRAM,), engine=eng)
    return use_fake_vram(s)


def _damage(store, key, page):
    e = store.index.peek([key])[key]
    fi, off = store.slabs.place(np.array([e.slot]))
    fd = os.open(store.slabs.paths[int(fi[0])], os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x5a" * 512, int(off[0]) + page // 2)
    finally:
        os.close(fd)


def test_device_pages_carry_a_checksum_and_a_damaged_one_reads_as_a_miss(gds_dir):
    n = 8
    with _fake_store(gds_dir) as s:
        src, dst = HostBuffer(n * PAGE), HostBuffer(n * PAGE)
        for b in (src, dst):
            s.register_memory(b.addr, b.nbytes, MemKind.VRAM)
        data = np.random.default_rng(3).integers(0, 256, n * PAGE, dtype=np.uint8)
        src.numpy()[:] = data
        ks = [f"d{i}" for i in range(n)]
        assert s.put(ks, Pages.contiguous(src.addr, PAGE, range(n), MemKind.VRAM)) == [True] * n
        rows = s.index.peek(ks)
        # device pages carry hgc1 (odd): the GPU kernel's value is the host definition's for the same bytes
        assert [rows[k].csum for k in ks] == [C.checksum(data[i * PAGE:(i + 1) * PAGE]) | 1 for i in range(n)]
        _damage(s, ks[2], PAGE)
        _damage(s, ks[5], PAGE)
        dst.numpy()[:] = 0xEE
        got = s.get(ks, Pages.contiguous(dst.addr, PAGE, range(n), MemKind.VRAM))
        assert got == [True, True, False, True, True, False, True, True]
        for i in (0, 1, 3, 4, 6, 7):
            assert np.array_equal(dst.numpy()[i * PAGE:(i + 1) * PAGE], data[i * PAGE:(i + 1) * PAGE])
        assert s.exists(ks) == [True, True, False, True, True, False, True, True]  # the bad ones dropped
        assert s.stats()["checksum_mismatches"] == 2


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_host_and_device_pages_verify_across(gds_dir, impl):
    if impl == "triton" and (os.environ.get("TRITON_INTERPRET") != "1" or not C.triton_available()):
        pytest.skip("Triton on host memory runs in the Triton interpreter subprocess test (test_checksum.py)")
    n = 6
    with _fake_store(gds_dir) as s:
        s._device_sums = __import__("fake_vram").cpu_device_sums(impl)
        host, dev = HostBuffer(n * PAGE), HostBuffer(n * PAGE)
        s.register_memory(host.addr, host.nbytes, MemKind.DRAM)
        s.register_memory(dev.addr, dev.nbytes, MemKind.VRAM)
        hd = np.random.default_rng(4).integers(0, 256, n * PAGE, dtype=np.uint8)
        dd = np.random.default_rng(5).integers(0, 256, n * PAGE, dtype=np.uint8)
        host.numpy()[:], dev.numpy()[:] = hd, dd
        assert all(s.put([f"h{i}" for i in range(n)], Pages.contiguous(host.addr, PAGE, range(n))))
        assert all(s.put([f"v{i}" for i in range(n)], Pages.contiguous(dev.addr, PAGE, range(n), MemKind.VRAM)))
        host.numpy()[:] = 0xEE
        dev.numpy()[:] = 0xEE
        assert all(s.get([f"h{i}" for i in range(n)], Pages.contiguous(dev.addr, PAGE, range(n), MemKind.VRAM)))
        assert all(s.get([f"v{i}" for i in range(n)], Pages.contiguous(host.addr, PAGE, range(n))))
        assert np.array_equal(dev.numpy(), hd) and np.array_equal(host.numpy(), dd)


def test_device_pages_in_segments_are_checksummed_as_their_concatenation(gds_dir):
    """layer_first pages: a page is its segments in order, wherever they lie."""
    seg, nseg, n = 4096 + 256, 3, 4  # segments that are not whole blocks
    page = seg * nseg
    with _fake_store(gds_dir, page=page, slots=16, direct_io=False) as s:  # segments not 4 KiB aligned
        pool = HostBuffer(n * page)
        s.register_memory(pool.addr, pool.nbytes, MemKind.VRAM)
        data = np.random.default_rng(6).integers(0, 256, n * page, dtype=np.uint8)
        pool.numpy()[:] = data
        # page i's segment k lives at layer k's region: pool + k * n * seg + i * seg
        addrs = np.array([[pool.addr + (k * n + i) * seg for k in range(nseg)] for i in range(n)], dtype=np.uint64)
        lens = np.full_like(addrs, seg)
        ks = [f"s{i}" for i in range(n)]
        assert all(s.put(ks, Pages(addrs, lens, MemKind.VRAM)))
        rows = s.index.peek(ks)
        arr = data.reshape(nseg, n, seg)
        assert [rows[k].csum for k in ks] == [C.checksum(arr[:, i, :].ravel()) | 1 for i in range(n)]
        pool.numpy()[:] = 0
        assert all(s.get(ks, Pages(addrs, lens, MemKind.VRAM))) and np.array_equal(pool.numpy(), data)


def test_device_pages_spanning_requests_are_verified_once_after_their_last_request(gds_dir):
    """An engine that takes 3 descriptors per request (as cuFile's compat pool takes 64) is handed
    device pages of 8 segments: each page spans 3 requests, and the device checksum judges it once,
    whole, after its last; a page damaged in the rows of its last request reads as a miss."""
    from hicache_gds.engines.faulty import Faults, FaultyEngine

    seg, nseg, n = 64 << 10, 8, 4
    page = seg * nseg
    eng = FaultyEngine(HostAsVram(create_engine("bounce", EngineOptions(direct_io=True))), Faults(max_descs=3))
    s = use_fake_vram(PageStore(page, {"model": "device-pages-wide"},
                                config={"gds_path": gds_dir, "capacity": 16 * page, "verify": True},
                                mem_kinds=(MemKind.VRAM,), engine=eng))
    judged: list[int] = []
    sums = s._device_sums

    def recording(addrs, lens, page_bytes):
        judged.append(len(addrs))
        assert (lens.sum(axis=1) == page).all()  # whole pages only, never a part of one
        return sums(addrs, lens, page_bytes)

    s._device_sums = recording
    with s:
        pool = HostBuffer(n * page)
        s.register_memory(pool.addr, pool.nbytes, MemKind.VRAM)
        data = np.random.default_rng(8).integers(0, 256, n * page, dtype=np.uint8)
        pool.numpy()[:] = data
        addrs = np.array([[pool.addr + (k * n + i) * seg for k in range(nseg)] for i in range(n)], dtype=np.uint64)
        wide = Pages(addrs, np.full_like(addrs, seg), MemKind.VRAM)
        ks = [f"w{i}" for i in range(n)]
        assert s.put(ks, wide) == [True] * n
        arr = data.reshape(nseg, n, seg)
        rows = s.index.peek(ks)
        assert [rows[k].csum for k in ks] == [C.checksum(arr[:, i, :].ravel()) | 1 for i in range(n)]
        _damage(s, ks[1], 2 * page - seg)  # the page's 8th segment: rows of its last request
        pool.numpy()[:] = 0xEE
        judged.clear()
        assert s.get(ks, wide) == [True, False, True, True]
        for i in (0, 2, 3):
            assert np.array_equal(pool.numpy().reshape(nseg, n, seg)[:, i, :], arr[:, i, :])
        assert sum(judged) == n and s.stats()["checksum_mismatches"] == 1
        assert s.exists(ks) == [True, False, True, True]


def test_a_namespace_of_the_old_format_opens_empty_and_verify_checks_it_with_xxh3(gds_dir, caplog):
    import xxhash

    from hicache_gds.tools import namespaces
    ks = [f"o{i}" for i in range(6)]
    buf = HostBuffer(6 * PAGE)
    with I._store(gds_dir, "old-format", 16) as s:
        s.register_memory(buf.addr, buf.nbytes)
        I._fill(buf.numpy(), ks, PAGE)
        assert all(s.put(ks, Pages.contiguous(buf.addr, PAGE, range(6))))
        db_path = s.index.db_path
    # What an earlier version left: xxh3 checksums, no format recorded.
    db = sqlite3.connect(db_path, isolation_level=None)
    for i, k in enumerate(ks):
        d = xxhash.xxh3_64_intdigest(buf.numpy()[i * PAGE:(i + 1) * PAGE].tobytes())
        db.execute("UPDATE pages SET csum = ? WHERE key = ?", (C.to_sqlite(d), k))
    db.execute("DELETE FROM meta WHERE name = 'format'")
    db.close()
    (ns,) = namespaces.find([gds_dir])
    rep = namespaces.verify(ns, drop=False)
    assert rep.checked == 6 and rep.ok == 6 and not rep.bad  # its own algorithm, never this one's
    with PageReader(PAGE, {"model": "old-format"}, config={"gds_path": gds_dir, "engine": "nixl-posix"}) as r:
        assert r.exists(ks) == [False] * 6  # other settings: nothing is read from it
    with caplog.at_level(logging.INFO, logger="hicache_gds"):
        with I._store(gds_dir, "old-format", 16) as s:
            assert s.exists(ks) == [False] * 6
    said = [r for r in caplog.records if "on-disk format 1" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO


# -- 4. close during IO --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["bounce", "nixl-posix"])
def test_close_waits_for_calls_in_flight_and_refuses_later_ones(gds_dir, engine):
    case = I.close_during_io_case(gds_dir, engine)
    judge(case)
    assert case.injected >= 1 and case.exceptions == 0


def test_a_write_still_in_flight_keeps_its_slots_after_close(gds_dir):
    judge(I.late_write_case(gds_dir))


def test_slots_of_a_timed_out_write_come_back_once_it_finishes(gds_dir):
    from hicache_gds.engines import Op
    from hicache_gds.engines.faulty import Faults, FaultyEngine
    faulty = FaultyEngine(create_engine("bounce", EngineOptions()), Faults(delay_s=1.0, only=Op.WRITE))
    with I._store(gds_dir, "slow", 16, engine_obj=faulty, io_timeout=0.2) as s:
        buf = HostBuffer(4 * PAGE)
        s.register_memory(buf.addr, buf.nbytes)
        assert s.put(["a", "b"], Pages.contiguous(buf.addr, PAGE, range(2))) == [False, False]
        assert s.stats()["lost_slots"] == 2
        faulty.heal()
        import time
        time.sleep(1.2)  # the slow write finishes
        assert s.put(["c"], Pages.contiguous(buf.addr, PAGE, [2])) == [True]
        st = s.stats()
        assert st["lost_slots"] == 0 and st["reserved_slots_all"] == 0


def test_every_call_on_a_closed_store_raises_store_closed_error(gds_dir):
    s = I._store(gds_dir, "closed", 8)
    buf = HostBuffer(PAGE)
    s.register_memory(buf.addr, buf.nbytes)
    s.close()
    s.close()  # idempotent
    p = Pages.contiguous(buf.addr, PAGE, [0])
    for call in (lambda: s.put(["a"], p), lambda: s.get(["a"], p), lambda: s.exists(["a"]), lambda: s.prefix(["a"]),
                 lambda: s.delete(["a"]), lambda: s.clear(), lambda: s.register_memory(buf.addr, buf.nbytes)):
        with pytest.raises(StoreClosedError, match="closed") as ei:
            call()
        assert isinstance(ei.value, HiCacheGDSError) and isinstance(ei.value, ValueError)


# -- 5. membership ----------------------------------------------------------------------------------------------------

def test_a_membership_is_never_judged_dead_while_it_is_being_created(gds_dir):
    case = I.membership_race_case(gds_dir, opens=15)
    judge(case)


@pytest.mark.slow
def test_processes_opening_and_closing_one_namespace_never_judge_a_live_one_dead(gds_dir):
    case = I.membership_processes_case(gds_dir, processes=3, seconds=2)
    judge(case)
    assert case.injected > 3


# -- 6. an idle process after others read ------------------------------------------------------------------------

def test_reads_by_others_do_not_make_an_idle_process_reload_its_map(gds_dir):
    case = I.idle_map_case(gds_dir, reads=4500)
    judge(case)


def test_an_idle_process_still_sees_removals_made_meanwhile(gds_dir):
    with I._store(gds_dir, "idle2", 64, engine="bounce") as a, I._store(gds_dir, "idle2", 64, engine="bounce") as b:
        buf = HostBuffer(8 * PAGE)
        b.register_memory(buf.addr, buf.nbytes)
        ks = [f"j{i}" for i in range(8)]
        assert all(b.put(ks, Pages.contiguous(buf.addr, PAGE, range(8))))
        assert a.exists(ks) == [True] * 8
        for i in range(300):
            e = b.index.lookup_pin([ks[i % 8]])
            b.index.unpin([e[0].slot])
        b.delete(ks[:3])
        assert a.exists(ks) == [False] * 3 + [True] * 5 and a.stats()["map_reloads"] == 0


# -- 7. no documented variable breaks strict config -------------------------------------------------------------

def test_every_hicache_gds_variable_the_code_reads_is_a_config_key():
    """Strict config refuses unknown HICACHE_GDS_* variables: nothing may document or read one."""
    from hicache_gds.config import ADAPTER_ENV, ENV_PREFIX, Config, describe_keys
    known = {env for _, env, _, _ in describe_keys()} | ADAPTER_ENV  # an adapter's own (the plugin's trace)
    found = {}
    for base in ("hicache_gds", "plugins", "README.md"):
        top = os.path.join(REPO, base)
        walk = os.walk(top) if os.path.isdir(top) else [(REPO, [], [base])]
        for d, _, files in walk:
            if os.path.join("hicache_gds", "testing") in d:  # the reliability harness names bad ones on purpose
                continue
            for f in files:
                if f.endswith((".py", ".md")):
                    text = open(os.path.join(d, f), encoding="utf-8").read()
                    for name in re.findall(r"\b(HICACHE_GDS_[A-Z0-9_]*[A-Z0-9])\b", text):
                        found.setdefault(name, os.path.relpath(os.path.join(d, f), REPO))
    stray = {n: where for n, where in found.items() if n not in known and n + "_" != ENV_PREFIX}
    assert not stray, f"HICACHE_GDS_* names that strict config refuses: {stray}"
    Config.load(env={n: "" for n in found if n in known})


def test_the_sglang_test_target_finds_its_pools_without_a_variable(monkeypatch):
    pytest.importorskip("hicache_gds_sglang")
    from hicache_gds_sglang import testing
    monkeypatch.delenv("HICACHE_GDS_TESTS_DIR", raising=False)
    assert testing._pools().__name__ == "sglang_pools"


def test_a_call_outliving_close_s_bound_closes_the_store_as_it_returns():
    import threading
    import time

    from hicache_gds.gate import CallGate
    g, torn = CallGate("test store"), []
    entered = threading.Event()

    def call():
        with g.call():
            entered.set()
            time.sleep(0.4)

    t = threading.Thread(target=call)
    t.start()
    entered.wait(5)
    assert g.close(0.05, lambda: torn.append(1)) == 1 and torn == []  # still in flight: deferred
    with pytest.raises(StoreClosedError):
        with g.call():
            pass
    t.join(5)
    assert torn == [1] and g.close(1, lambda: torn.append(2)) == 0 and torn == [1]  # once
