"""PageStore: round trips, restart, eviction, integrity, bad input, concurrency, full disk."""

import os
import stat
import subprocess
import threading
import time

import numpy as np
import pytest

from hicache_gds import ConfigError, PageStore, Pages, RegionError, StoreFullError
from hicache_gds.engines import EngineOptions, Op, create_engine
from hicache_gds.engines.faulty import Faults, FaultyEngine, _Hung
from hicache_gds.memory import HostBuffer
from hicache_gds.testing import random_bytes
from hicache_gds.testing.faults import fill_filesystem

P = 256 << 10  # page bytes in most tests
N = 32


def open_store(d, engine="nixl-posix", capacity=N * 4 * P, **kw):
    ident = kw.pop("identity", {"model": "test"})
    cfg = {"gds_path": d, "capacity": capacity, **kw.pop("config", {})}
    if isinstance(engine, str):
        cfg["engine"] = engine
    else:
        kw["engine"] = engine
    return PageStore(kw.pop("page_bytes", P), ident, config=cfg, **kw)


def buffers(store, n=N, page=P, seed=0):
    src, dst = HostBuffer(n * page), HostBuffer(n * page)
    store.register_memory(src.addr, src.nbytes)
    store.register_memory(dst.addr, dst.nbytes)
    data = random_bytes(src, seed)
    dst.numpy()[:] = 0xEE  # poison
    return src, dst, data


def flip_byte(store, key, offset, mask):
    """XOR one byte of `key`'s stored page (at `offset` in its slot) in the slab file, and drop the
    file's cached pages so the next read sees it."""
    slot = store.index.lookup_pin([key])[0].slot
    store.index.unpin([slot])
    slab = store.slabs.paths[0]
    with open(slab, "r+b") as f:
        f.seek(slot * store.slot_bytes + offset)
        b = f.read(1)
        f.seek(slot * store.slot_bytes + offset)
        f.write(bytes([b[0] ^ mask]))
    fd = os.open(slab, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def keys(n=N, tag="k"):
    return [f"{tag}{i:05d}" for i in range(n)]


@pytest.mark.parametrize("engine", ["nixl-posix", "bounce"])
def test_roundtrip_random_data(gds_dir, engine):
    with open_store(gds_dir, engine) as s:
        src, dst, data = buffers(s)
        idx = np.random.default_rng(1).permutation(N)
        assert s.put(keys(), Pages.contiguous(src.addr, P, idx)) == [True] * N
        assert s.get(keys(), Pages.contiguous(dst.addr, P, idx)) == [True] * N
        assert np.array_equal(dst.numpy(), data)
        st_ = s.stats()
        assert st_["engine"] == engine and st_["path"] and st_["pages_written"] == N and st_["hits"] == N
        assert st_["write_batch_latency"]["n"] == 1


def test_exists_prefix_misses_and_per_page_results(gds_dir):
    with open_store(gds_dir) as s:
        src, dst, data = buffers(s)
        ks = keys()
        assert s.put(ks[:10], Pages.contiguous(src.addr, P, range(10))) == [True] * 10
        assert s.prefix(ks) == 10 and s.prefix(["zz"] + ks) == 0
        assert s.exists(["k00003", "nope", "k00009"]) == [True, False, True]
        got = s.get(["k00001", "nope", "k00002"], Pages.contiguous(dst.addr, P, [0, 1, 2]))
        assert got == [True, False, True]
        d = dst.numpy()
        assert np.array_equal(d[:P], data[P:2 * P]) and np.array_equal(d[2 * P:3 * P], data[2 * P:3 * P])
        assert (d[P:2 * P] == 0xEE).all()  # a miss leaves the destination alone


def test_present_keys_are_not_rewritten_and_duplicates_in_a_batch(gds_dir):
    with open_store(gds_dir) as s:
        src, dst, data = buffers(s)
        assert s.put(["a", "b", "a"], Pages.contiguous(src.addr, P, [0, 1, 2])) == [True, True, True]
        assert s.put(["a"], Pages.contiguous(src.addr, P, [5])) == [True]
        assert s.stats()["pages_written"] == 2
        assert s.get(["a"], Pages.contiguous(dst.addr, P, [0])) == [True]
        assert np.array_equal(dst.numpy()[:P], data[:P])  # the first copy stays


def test_restart_keeps_pages(gds_dir):
    with open_store(gds_dir) as s:
        src, _, data = buffers(s)
        assert all(s.put(keys(), Pages.contiguous(src.addr, P, range(N))))
    with open_store(gds_dir) as s:
        _, dst, _ = buffers(s, seed=9)
        assert s.prefix(keys()) == N
        assert all(s.get(keys(), Pages.contiguous(dst.addr, P, range(N))))
        assert np.array_equal(dst.numpy(), data)
        assert s.stats()["index_recovery_s"] < 3


def test_lru_eviction_under_capacity(gds_dir):
    with open_store(gds_dir, capacity=8 * P) as s:
        src, dst, data = buffers(s)
        ks = keys()
        assert all(s.put(ks[:8], Pages.contiguous(src.addr, P, range(8))))
        assert all(s.get(ks[:2], Pages.contiguous(dst.addr, P, range(2))))  # 0, 1 become recent
        assert all(s.put(ks[8:12], Pages.contiguous(src.addr, P, range(8, 12))))
        present = s.exists(ks[:12])
        assert present[:2] == [True, True] and present[2:6] == [False] * 4 and all(present[6:12])
        assert s.stats()["evictions"] == 4
        assert all(s.get(ks[8:12], Pages.contiguous(dst.addr, P, range(8, 12))))
        assert np.array_equal(dst.numpy()[8 * P:12 * P], data[8 * P:12 * P])


def test_lru_order_survives_restart(gds_dir):
    with open_store(gds_dir, capacity=4 * P) as s:
        src, dst, _ = buffers(s)
        ks = keys()
        assert all(s.put(ks[:4], Pages.contiguous(src.addr, P, range(4))))
        assert all(s.get(ks[:1], Pages.contiguous(dst.addr, P, [0])))
    with open_store(gds_dir, capacity=4 * P) as s:
        src, _, _ = buffers(s)
        assert all(s.put(ks[4:5], Pages.contiguous(src.addr, P, [4])))
        assert s.exists(ks[:5]) == [True, False, True, True, True]


def test_corrupted_page_is_a_miss_and_dropped(gds_dir):
    with open_store(gds_dir) as s:
        src, dst, data = buffers(s)
        assert all(s.put(keys(4), Pages.contiguous(src.addr, P, range(4))))
        flip_byte(s, "k00002", 1234, 0xFF)  # behind the store's back
        got = s.get(keys(4), Pages.contiguous(dst.addr, P, range(4)))
        assert got == [True, True, False, True]
        assert s.exists(["k00002"]) == [False]
        assert s.stats()["checksum_mismatches"] == 1


def test_segmented_and_misaligned_pages_are_staged(gds_dir):
    # MLA layer_first-like pages: 8 segments of 4.5 KiB each, not 4 KiB aligned.
    seg, S, n = 4608, 8, 16
    page = seg * S
    with open_store(gds_dir, page_bytes=page, capacity=64 * 40960) as s:
        src, dst = HostBuffer(n * page * 2), HostBuffer(n * page * 2)
        s.register_memory(src.addr, src.nbytes)
        s.register_memory(dst.addr, dst.nbytes)
        data = random_bytes(src, 5)
        dst.numpy()[:] = 0x11
        # segment j of page i lives at layer j's region (stride n*seg), like a layer-first pool
        addrs = np.array([[i * seg + j * n * seg for j in range(S)] for i in range(n)], dtype=np.uint64)
        lens = np.full_like(addrs, seg)
        assert all(s.put(keys(n), Pages(addrs + np.uint64(src.addr), lens)))
        assert all(s.get(keys(n), Pages(addrs + np.uint64(dst.addr), lens)))
        assert np.array_equal(dst.numpy()[:n * page], data[:n * page])
        assert s.stats()["staged_pages"] == 2 * n


@pytest.mark.parametrize("bad_keys,err", [
    ("abc", TypeError), ([1, 2], TypeError), ([b"x"], TypeError), ([""], ValueError),
    (["a\x00b"], ValueError), (["x" * 5000], ValueError)])
def test_bad_keys_get_clear_errors(gds_dir, bad_keys, err):
    with open_store(gds_dir) as s:
        src, _, _ = buffers(s, n=2)
        with pytest.raises(err):
            s.put(bad_keys, Pages.contiguous(src.addr, P, range(len(bad_keys) if isinstance(bad_keys, list) else 1)))
        with pytest.raises(err):
            s.exists(bad_keys)


def test_path_like_keys_stay_inside_the_namespace(gds_dir):
    with open_store(gds_dir) as s:
        src, dst, data = buffers(s, n=2)
        ks = ["../../etc/passwd", "/abs/../x"]
        assert all(s.put(ks, Pages.contiguous(src.addr, P, range(2))))
        assert all(s.get(ks, Pages.contiguous(dst.addr, P, range(2))))
    files = [os.path.join(r, f) for r, _, fs in os.walk(gds_dir) for f in fs]
    assert all(os.path.realpath(f).startswith(os.path.realpath(gds_dir)) for f in files)
    assert not os.path.exists(os.path.join(os.path.dirname(gds_dir), "etc"))


def test_bad_regions_get_clear_errors(gds_dir):
    with open_store(gds_dir) as s:
        src, dst, _ = buffers(s, n=4)  # keep dst alive: a freed mapping could be reused below
        with pytest.raises(RegionError, match="page 0 has 4096 bytes"):
            s.put(["a"], Pages.contiguous(src.addr, 4096, [0]))
        with pytest.raises(RegionError, match="outside every registered"):
            s.put(["a"], Pages.contiguous(src.addr, P, [10]))
        with pytest.raises(ValueError, match="2 keys but 1 pages"):
            s.put(["a", "b"], Pages.contiguous(src.addr, P, [0]))
        other = HostBuffer(P)
        with pytest.raises(RegionError):
            s.get(["a"], Pages.contiguous(other.addr, P, [0]))


def test_private_permissions(gds_dir):
    with open_store(gds_dir) as s:
        src, _, _ = buffers(s, n=2)
        s.put(["a"], Pages.contiguous(src.addr, P, [0]))
        for root, dirs, files in os.walk(gds_dir):
            for d in dirs:
                assert stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o700, d
            for f in files:
                assert stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) == 0o600, f


def test_tenants_and_identities_are_isolated(gds_dir):
    with open_store(gds_dir, config={"namespace": "tenant-a"}) as a, \
         open_store(gds_dir, config={"namespace": "tenant-b"}) as b:
        src, dst, _ = buffers(a, n=2)
        assert all(a.put(["shared-key"], Pages.contiguous(src.addr, P, [0])))
        assert b.exists(["shared-key"]) == [False]
        assert a.namespace != b.namespace
    with open_store(gds_dir, identity={"model": "other"}) as c:
        assert c.exists(["shared-key"]) == [False]


def test_missing_bad_and_symlinked_gds_path(tmp_path):
    with pytest.raises(ConfigError, match="GDS_PATH is not set"):
        PageStore(P, config={"gds_path": ""})
    with pytest.raises(ConfigError, match="does not exist"):
        open_store(str(tmp_path / "missing"))
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        open_store(str(f))
    d = tmp_path / "d"
    d.mkdir()
    with open_store(str(d)) as s:
        ns = s.namespace
    os.rename(d / ns, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", d / ns)
    with pytest.raises(ConfigError, match="not a plain directory"):
        open_store(str(d))


def test_unwritable_gds_path(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:
        # root ignores mode bits: use a read-only bind of a tmpfs instead
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], capture_output=True)
        if r.returncode:
            pytest.skip("cannot mount a read-only tmpfs here")
        try:
            with pytest.raises(ConfigError, match="not writable"):
                open_store(str(d))
        finally:
            subprocess.run(["umount", str(d)])
    else:
        os.chmod(d, 0o500)
        with pytest.raises(ConfigError, match="not writable"):
            open_store(str(d))


@pytest.fixture
def small_tmpfs(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(d)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount tmpfs: {r.stderr.decode().strip()}")
    yield str(d)
    subprocess.run(["umount", str(d)])


def test_full_disk_at_open_is_a_clear_error(small_tmpfs):
    with pytest.raises(StoreFullError, match="no room"):
        open_store(small_tmpfs, capacity=64 * P)


def test_full_disk_while_writing_fails_pages_not_the_store(small_tmpfs):
    with open_store(small_tmpfs, engine="bounce", capacity=64 * P, config={"preallocate": False}) as s:
        src, dst, data = buffers(s, n=N)
        ks = keys()
        assert all(s.put(ks[:4], Pages.contiguous(src.addr, P, range(4))))
        filler = fill_filesystem(small_tmpfs)
        res = s.put(ks[4:], Pages.contiguous(src.addr, P, range(4, N)))
        assert not all(res)
        assert s.exists(ks[4:]) == res  # failed pages are never visible
        assert all(s.get(ks[:4], Pages.contiguous(dst.addr, P, range(4))))
        assert np.array_equal(dst.numpy()[:4 * P], data[:4 * P])
        os.unlink(filler)  # the fault clears: service resumes
        assert all(s.put(ks[4:12], Pages.contiguous(src.addr, P, range(4, 12))))
        assert all(s.get(ks[4:12], Pages.contiguous(dst.addr, P, range(4, 12))))
        assert np.array_equal(dst.numpy()[4 * P:12 * P], data[4 * P:12 * P])


def test_reopen_on_a_full_disk_never_drops_the_pages(small_tmpfs):
    """A namespace reopened on a full file system (another program filled it) is refused with a
    clear error or opens and serves its pages; never is its index taken for damaged and moved
    aside, which would drop every acknowledged page. Once space is freed, every page reads back."""
    cfg = {"preallocate": False}
    with open_store(small_tmpfs, engine="bounce", capacity=8 * P, config=cfg) as s:
        src, dst, data = buffers(s, n=8)
        assert all(s.put(keys(4), Pages.contiguous(src.addr, P, range(4))))
    filler = fill_filesystem(small_tmpfs)
    try:
        with open_store(small_tmpfs, engine="bounce", capacity=8 * P, config=cfg) as s:
            _, dst, _ = buffers(s, n=8)
            assert all(s.get(keys(4), Pages.contiguous(dst.addr, P, range(4))))
            assert dst.numpy()[:4 * P].tobytes() == data[:4 * P].tobytes()
    except StoreFullError as exc:
        assert "full" in str(exc) and small_tmpfs in str(exc)
    damaged = [f for _, _, fs in os.walk(small_tmpfs) for f in fs if ".damaged-" in f]
    assert damaged == []
    os.unlink(filler)
    with open_store(small_tmpfs, engine="bounce", capacity=8 * P, config=cfg) as s:
        _, dst, _ = buffers(s, n=8)
        assert all(s.get(keys(4), Pages.contiguous(dst.addr, P, range(4))))
        assert dst.numpy()[:4 * P].tobytes() == data[:4 * P].tobytes()


def test_io_errors_and_hangs_fail_pages_then_service_resumes(gds_dir):
    eng = FaultyEngine(create_engine("bounce", EngineOptions()), Faults(eio=1.0, only=Op.WRITE))
    with open_store(gds_dir, engine=eng, config={"io_timeout": 1}) as s:
        src, dst, data = buffers(s)
        assert s.put(keys(4), Pages.contiguous(src.addr, P, range(4))) == [False] * 4
        eng.faults = Faults(hang=1.0, only=Op.WRITE)
        assert s.put(keys(4), Pages.contiguous(src.addr, P, range(4))) == [False] * 4
        st_ = s.stats()
        assert st_["timeouts"] == 4 and st_["lost_slots"] == 4
        eng.heal()
        assert s.put(keys(4), Pages.contiguous(src.addr, P, range(4))) == [True] * 4
        eng.faults = Faults(eio=1.0, only=Op.READ)
        assert s.get(keys(4), Pages.contiguous(dst.addr, P, range(4))) == [False] * 4
        eng.heal()
        assert s.get(keys(4), Pages.contiguous(dst.addr, P, range(4))) == [True] * 4
        assert np.array_equal(dst.numpy()[:4 * P], data[:4 * P])


def test_three_threads_like_sglang(gds_dir):
    n = 96
    with open_store(gds_dir, capacity=64 * P) as s:  # smaller than the key set: eviction races reads
        src, _, data = buffers(s, n=n)
        dsts = [HostBuffer(n * P) for _ in range(2)]
        for d in dsts:
            s.register_memory(d.addr, d.nbytes)
        ks = keys(n)
        errors, stop = [], threading.Event()

        def writer():
            try:
                for r in range(6):
                    for a in range(0, n, 16):
                        s.put(ks[a:a + 16], Pages.contiguous(src.addr, P, range(a, a + 16)))
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            finally:
                stop.set()

        def reader(dst):
            try:
                while not stop.is_set():
                    res = s.get(ks, Pages.contiguous(dst.addr, P, range(n)))
                    for i, ok in enumerate(res):
                        if ok and not np.array_equal(dst.numpy()[i * P:(i + 1) * P], data[i * P:(i + 1) * P]):
                            errors.append(AssertionError(f"page {i} served wrong bytes"))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        def exister():
            while not stop.is_set():
                s.prefix(ks)
                s.exists(ks)

        ts = [threading.Thread(target=writer), threading.Thread(target=reader, args=(dsts[0],)),
              threading.Thread(target=reader, args=(dsts[1],)), threading.Thread(target=exister)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(t.is_alive() for t in ts), "deadlock"
        assert not errors, errors[:3]
        st_ = s.stats()
        assert st_["pages"] + st_["free_slots"] + st_["lost_slots"] == st_["slots"]


def test_delete_and_clear(gds_dir):
    with open_store(gds_dir) as s:
        src, _, _ = buffers(s, n=4)
        s.put(keys(4), Pages.contiguous(src.addr, P, range(4)))
        assert s.delete(["k00001", "nope"]) == [True, False]
        assert s.exists(keys(4)) == [True, False, True, True]
        assert s.clear() == 3 and s.exists(keys(4)) == [False] * 4
        assert s.stats()["free_slots"] == s.stats()["slots"]


def test_closed_store_refuses_calls(gds_dir):
    s = open_store(gds_dir)
    s.close()
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.exists(["a"])


def test_damaged_index_is_reset_with_a_log_line(gds_dir, caplog):
    with open_store(gds_dir) as s:
        src, _, _ = buffers(s, n=2)
        s.put(["a"], Pages.contiguous(src.addr, P, [0]))
        db = s.index.db_path
    with open(db, "r+b") as f:
        f.write(os.urandom(4096))
    with open_store(gds_dir) as s:
        assert s.exists(["a"]) == [False]
    assert any("damaged" in r.message for r in caplog.records)


def test_read_keys_lists_lru_order_without_the_lock(gds_dir):
    from hicache_gds import read_keys
    with open_store(gds_dir) as s:
        src, dst, _ = buffers(s, n=3)
        s.put(keys(3), Pages.contiguous(src.addr, P, range(3)))
        s.get(keys(1), Pages.contiguous(dst.addr, P, [0]))
        assert read_keys(s.dirs[0]) == ["k00001", "k00002", "k00000"]  # read while the writer has it open
        ns = s.dirs[0]
    assert read_keys(os.path.join(gds_dir, "nothing-here")) == []
    before = sorted(os.listdir(ns))
    assert read_keys(ns) == ["k00001", "k00002", "k00000"]  # the writer is gone: still read, nothing created
    assert sorted(os.listdir(ns)) == before and not any(n.endswith(("-wal", "-shm")) for n in before)
    # Any failure is an empty answer, never an exception into the caller (a vLLM scheduler):
    # here a link planted where the index should be, which the reader refuses to follow.
    planted = os.path.join(gds_dir, "planted")
    os.makedirs(planted)
    os.symlink(os.path.join(ns, "index.sqlite3"), os.path.join(planted, "index.sqlite3"))
    assert read_keys(planted) == []


def test_no_evict_mode_fails_puts_into_a_full_store(gds_dir):
    with open_store(gds_dir, capacity=4 * P, config={"evict": False}) as s:
        src, _, _ = buffers(s, n=6)
        assert s.put(keys(6), Pages.contiguous(src.addr, P, range(6))) == [True] * 4 + [False] * 2
        assert s.stats()["evictions"] == 0 and s.exists(keys(4)) == [True] * 4


@pytest.mark.parametrize("name", ["slab.bin", "index.sqlite3", "lock"])
def test_planted_symlink_is_refused_with_a_config_error(gds_dir, tmp_path, name):
    with open_store(gds_dir) as s:
        ns_dir = s.dirs[0]
    target = tmp_path / "outside"
    target.write_bytes(b"x")
    path = os.path.join(ns_dir, name)
    os.unlink(path)
    os.symlink(target, path)
    with pytest.raises(ConfigError, match="symbolic link"):
        open_store(gds_dir)
    assert target.read_bytes() == b"x"  # nothing written through the link


def test_checksums_run_in_parallel_and_survive_fork(gds_dir, monkeypatch):
    """Pages are hashed on a shared thread pool; a forked child (torture workers, SGLang ranks)
    must get its own pool, not the parent's copied one whose threads do not exist there."""
    import time

    from hicache_gds.store import hashing
    # xxh3 batches below XXH3_SPLIT_BYTES hash on the caller's thread; make this small batch split,
    # so the pool is made here whatever ran before this test.
    monkeypatch.setattr(hashing, "XXH3_SPLIT_BYTES", P)
    for d in ("parent", "child"):
        os.makedirs(os.path.join(gds_dir, d), mode=0o700)
    with open_store(os.path.join(gds_dir, "parent")) as s:
        src, dst, _ = buffers(s, n=8)
        assert all(s.put(keys(8), Pages.contiguous(src.addr, P, range(8))))
        dst.numpy()[:] = 0x5A
        assert all(s.get(keys(8), Pages.contiguous(dst.addr, P, range(8))))
        assert dst.numpy()[: 8 * P].tobytes() == src.numpy()[: 8 * P].tobytes()
    parent_pool = hashing._hash_pool
    assert parent_pool is not None or (os.cpu_count() or 1) < 2
    pid = os.fork()
    if pid == 0:  # child: hash with a fresh pool, then leave without running the parent's atexit
        code = 1
        try:
            assert hashing._hash_pool is None
            with open_store(os.path.join(gds_dir, "child")) as c:
                a, b, _ = buffers(c, n=8, seed=3)
                ok = all(c.put(keys(8), Pages.contiguous(a.addr, P, range(8))))
                ok = ok and all(c.get(keys(8), Pages.contiguous(b.addr, P, range(8))))
                code = 0 if ok and b.numpy()[: 8 * P].tobytes() == a.numpy()[: 8 * P].tobytes() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("a forked child hung hashing pages (the parent's hashing pool was inherited)")


@pytest.mark.parametrize("threads,per_task", [(0, 2), (2, 4), (1, 8)])
def test_checksum_threads_cut_a_batch_across_that_many_tasks(gds_dir, monkeypatch, threads, per_task):
    """`checksum_threads` (0: the hashing pool's size, here made 4) is how many tasks one batch's
    host checksums are cut into; 1 sums them on the calling thread. Whatever the cut, every byte
    round-trips and a flipped byte is still a miss."""
    from hicache_gds import pagesum as ps
    from hicache_gds.store import hashing
    monkeypatch.setattr(hashing, "hash_threads", lambda: 4)
    monkeypatch.setattr(hashing, "XXH3_SPLIT_BYTES", 0)  # cut even these few small pages
    sizes, real = [], ps.host_sums
    monkeypatch.setattr(ps, "host_sums", lambda segs, nbytes, odd=None: sizes.append(len(segs)) or real(segs, nbytes, odd))
    if threads == 1:
        monkeypatch.setattr(hashing, "hasher", lambda: pytest.fail("checksum_threads=1 used the hashing pool"))
    with open_store(gds_dir, config={"checksum_threads": threads, "max_request_bytes": 8 * P}) as s:
        src, dst, _ = buffers(s, n=8)
        assert all(s.put(keys(8), Pages.contiguous(src.addr, P, range(8))))
        assert all(s.get(keys(8), Pages.contiguous(dst.addr, P, range(8))))
        assert dst.numpy()[: 8 * P].tobytes() == src.numpy()[: 8 * P].tobytes()
        assert sizes and set(sizes) == {per_task}, sizes
        flip_byte(s, "k00005", 777, 0x01)
        dst.numpy()[:] = 0xEE
        assert s.get(keys(8), Pages.contiguous(dst.addr, P, range(8))) == [True] * 5 + [False] + [True] * 2


class _Counting(FaultyEngine):
    """A faulty engine that records the descriptor count of every request it is handed."""

    def __init__(self, inner, faults):
        super().__init__(inner, faults)
        self.requests: list[tuple[Op, int]] = []

    def _submit(self, op, kind, mem, file):
        self.requests.append((op, len(mem)))
        return super()._submit(op, kind, mem, file)


SEG = 128 << 10  # segments this large go straight to the engine (no staging)
SEGS = 8


def _wide_pages(buf, n, seed=3):
    """n pages of SEGS scattered 128 KiB segments each (a page's segment j at layer j's region)."""
    order = np.random.default_rng(seed).permutation(n)
    addrs = np.array([[int(order[i]) * SEG + j * n * SEG for j in range(SEGS)] for i in range(n)], dtype=np.uint64)
    return Pages(addrs + np.uint64(buf.addr), np.full_like(addrs, SEG))


def _page_bytes(buf, pages, i):
    return np.concatenate([buf.numpy()[int(a) - buf.addr:int(a) - buf.addr + SEG] for a in pages.addrs[i]])


@pytest.mark.parametrize("engine", ["nixl-posix", "bounce"])
def test_pages_with_more_segments_than_a_request_takes_span_requests(gds_dir, engine):
    """An engine that takes 3 descriptors per request (as GDS in compat mode takes 64) is handed
    pages of 8: each page spans 3 requests, never refused, byte-exact, verified after all of them."""
    n = 6
    eng = _Counting(create_engine(engine, EngineOptions()), Faults(max_descs=3))
    assert eng.capabilities.max_descs == 3
    with open_store(gds_dir, engine=eng, page_bytes=SEG * SEGS, capacity=16 * SEG * SEGS,
                    config={"verify": True}) as s:
        src, dst, _ = buffers(s, n, SEG * SEGS, seed=11)  # random source, poisoned destination
        put_pages, get_pages = _wide_pages(src, n), _wide_pages(dst, n)
        assert s.put(keys(n), put_pages) == [True] * n
        assert s.get(keys(n), get_pages) == [True] * n
        for i in range(n):
            assert np.array_equal(_page_bytes(dst, get_pages, i), _page_bytes(src, put_pages, i))
        st_ = s.stats()
        assert st_["staged_pages"] == 0 and st_["checksum_mismatches"] == 0
        assert eng.requests and max(d for _, d in eng.requests) <= 3
        assert sum(d for op, d in eng.requests if op is Op.WRITE) == n * SEGS


def test_a_failed_request_fails_only_the_page_it_holds_rows_of(gds_dir):
    """EIO in one request of a page that spans three: that page is not stored (a write) or not
    served (a read, also when re-read), and every other page is stored and read byte-exact."""
    n = 4
    eng = _Counting(create_engine("nixl-posix", EngineOptions()), Faults(max_descs=3))
    with open_store(gds_dir, engine=eng, page_bytes=SEG * SEGS, capacity=16 * SEG * SEGS,
                    config={"verify": True, "max_request_bytes": 1}) as s:  # one page's rows per request
        src, dst, _ = buffers(s, n, SEG * SEGS, seed=12)  # random source, poisoned destination
        put_pages, get_pages = _wide_pages(src, n), _wide_pages(dst, n)
        # Requests of a page of 8 rows of 128 KiB under a 1-byte soft limit: one row each. Page 1's
        # rows are requests 8..15; the 12th request (its 5th row) fails.
        eng.set(Faults(max_descs=3, nth=(12,), only=Op.WRITE))
        assert s.put(keys(n), put_pages) == [True, False, True, True]
        assert s.exists(keys(n)) == [True, False, True, True]
        eng.set(Faults(max_descs=3))
        assert s.put(keys(n), put_pages) == [True] * n
        # A read: page 2's 3rd row fails, and again when the page is re-read on its own.
        eng.set(Faults(max_descs=3, nth=(18, 32 + 2), only=Op.READ))
        assert s.get(keys(n), get_pages) == [True, True, False, True]
        for i in (0, 1, 3):
            assert np.array_equal(_page_bytes(dst, get_pages, i), _page_bytes(src, put_pages, i))
        # Fails once only: the re-read of the page alone serves it, verified.
        dst.numpy()[:] = 0x5A
        eng.set(Faults(max_descs=3, nth=(18,), only=Op.READ))
        assert s.get(keys(n), get_pages) == [True] * n
        for i in range(n):
            assert np.array_equal(_page_bytes(dst, get_pages, i), _page_bytes(src, put_pages, i))
        assert s.stats()["checksum_mismatches"] == 0


def test_a_hung_request_of_a_spanning_page_times_it_out(gds_dir):
    """The last of page 0's requests never completes: page 0 times out (its slot is lost: the write
    may still land), page 1 is stored."""
    n = 2

    class LastOfFirstPageHangs(FaultyEngine):
        count = 0

        def _submit(self, op, kind, mem, file):
            self.count += 1
            if self.count == SEGS:  # one row per request: request 8 is page 0's last
                return _Hung(self.name, op, int(mem[:, 1].sum()), "a request that never completes")
            return super()._submit(op, kind, mem, file)

    eng = LastOfFirstPageHangs(create_engine("bounce", EngineOptions()), Faults(max_descs=3))
    with open_store(gds_dir, engine=eng, page_bytes=SEG * SEGS, capacity=16 * SEG * SEGS,
                    config={"io_timeout": 1, "max_request_bytes": 1}) as s:
        src = HostBuffer(n * SEGS * SEG)
        s.register_memory(src.addr, src.nbytes)
        random_bytes(src, 13)
        assert s.put(keys(n), _wide_pages(src, n)) == [False, True]
        st_ = s.stats()
        assert st_["timeouts"] == 1 and st_["lost_slots"] == 1


@pytest.fixture
def switch_interval():
    import sys
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield sys
    sys.setswitchinterval(before)


@pytest.mark.parametrize("asked,after", [(0.0005, 0.0005), (0, 0.005), (0.02, 0.005)])
def test_open_lowers_the_thread_switch_interval_never_raises_it(tmp_path, switch_interval, asked, after):
    """A busy Python thread in the host process holds the GIL a whole switch interval each time
    the store's IO and checksum threads want it back: the store lowers it (never raises it; 0:
    leaves it alone). A get beside such a thread still returns every byte."""
    store = open_store(str(tmp_path), config={"switch_interval": asked})
    try:
        assert switch_interval.getswitchinterval() == pytest.approx(after)
        src, dst, data = buffers(store, n=8)
        keys = [f"s{i}" for i in range(8)]
        assert all(store.put(keys, Pages.contiguous(src.addr, P, range(8))))
        stop = threading.Event()
        busy = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
        busy.start()
        try:
            assert all(store.get(keys, Pages.contiguous(dst.addr, P, range(8))))
        finally:
            stop.set()
            busy.join()
        assert dst.numpy().tobytes() == data.tobytes()
    finally:
        store.close()


@pytest.mark.parametrize("bad", ["-1", "1", "soon"])
def test_switch_interval_rejects_bad_values(bad):
    with pytest.raises(ConfigError, match="switch_interval"):
        from hicache_gds.config import Config
        Config.load({"switch_interval": bad})


def test_stats_split_a_gets_time_between_waiting_for_io_and_verifying(tmp_path):
    """`read_wait_ns` and `read_verify_ns`: where the time of gets went (IO or checksums), both
    inside the get's own time; verify off, no verifying time."""
    for verify, has_verify in ((True, True), (False, False)):
        d = tmp_path / str(verify)
        d.mkdir()
        store = open_store(str(d), config={"verify": verify})
        try:
            src, dst, data = buffers(store, n=8)
            keys = [f"w{i}" for i in range(8)]
            assert all(store.put(keys, Pages.contiguous(src.addr, P, range(8))))
            assert all(store.get(keys, Pages.contiguous(dst.addr, P, range(8))))
            assert dst.numpy().tobytes() == data.tobytes()
            st = store.stats()
            spent = st["read_batch_latency"]["mean_us"] * st["read_batch_latency"]["n"] * 1000
            assert 0 < st["read_wait_ns"] and st["read_wait_ns"] + st["read_verify_ns"] <= spent
            assert (st["read_verify_ns"] > 0) == has_verify
        finally:
            store.close()


class _InFlight:
    """Counts a faulty engine's requests posted and not yet released, at each post."""

    def __init__(self, eng: FaultyEngine) -> None:
        self.at_post: list[int] = []
        self._open = 0
        inner = eng.submit

        def submit(*a, **k):
            self.at_post.append(self._open)
            t = inner(*a, **k)
            self._open += 1
            release = t.release

            def released():
                self._open -= 1
                release()
            t.release = released
            return t
        eng.submit = submit


def _slow_posting_store(d, monkeypatch, n):
    """A store whose read requests take 20 ms to post (a device with a full queue), 8 requests of
    4 pages per get of 32, and a read window of two requests."""
    from hicache_gds.store import posting
    monkeypatch.setattr(posting, "READ_WINDOW_BYTES", 2 * 4 * P)
    monkeypatch.setattr(posting, "DEVICE_POST_SHARE", {})  # nothing measured in this process yet
    eng = FaultyEngine(create_engine("nixl-posix", EngineOptions()), Faults(post_s=0.02, only=Op.READ))
    store = open_store(d, engine=eng, config={"max_request_bytes": 4 * P, "io_timeout": 2})
    return store, eng


def test_reads_post_within_a_window_where_posting_blocks_and_every_byte_still_checks(tmp_path, monkeypatch):
    """Where posting waits for the device, reads of host pages keep two requests posted ahead and
    verify each request's pages while the next are read; the first get (nothing measured yet)
    posts all at once. `stats()` says which; bytes equal the source every time."""
    store, eng = _slow_posting_store(str(tmp_path), monkeypatch, N)
    try:
        src, dst, data = buffers(store)
        ks = keys()
        assert all(store.put(ks, Pages.contiguous(src.addr, P, range(N))))
        spy = _InFlight(eng)
        assert store.stats()["read_posting"] == "all at once"
        assert all(store.get(ks, Pages.contiguous(dst.addr, P, range(N))))
        assert dst.numpy().tobytes() == data.tobytes()
        # eight requests, all posted before the first blocking wait; those already complete are
        # settled (released, their pages verified) between posts
        assert len(spy.at_post) == 8 and max(spy.at_post) < 7
        st = store.stats()
        assert st["read_post_share"] > 0.5 and st["read_posting"].startswith("within")
        for _ in range(2):
            spy.at_post.clear()
            dst.numpy()[:] = 0xEE
            assert all(store.get(ks, Pages.contiguous(dst.addr, P, range(N))))
            assert dst.numpy().tobytes() == data.tobytes()
            assert len(spy.at_post) == 8 and max(spy.at_post) == 1  # the window: one ahead of the one waited for
        assert store.stats()["read_post_ns"] > 0
    finally:
        store.close()


def test_a_store_opened_again_on_a_blocking_device_posts_its_first_get_within_the_window(tmp_path, monkeypatch):
    """What one store measured about posting on its devices, the next one opened on them in the
    process starts from (SGLang's runtime backend switch opens a new store): its first get is
    already windowed. Windowed reads do not move the measurement (they hide the blocking); every
    `WINDOW_PROBE_EVERY`-th read posts all at once to measure again. Another engine on the same
    directory starts from nothing."""
    from hicache_gds.store import posting
    monkeypatch.setattr(posting, "WINDOW_PROBE_EVERY", 4)
    d = str(tmp_path)
    store, eng = _slow_posting_store(d, monkeypatch, N)
    ks = keys()
    try:
        src, dst, data = buffers(store)
        assert all(store.put(ks, Pages.contiguous(src.addr, P, range(N))))
        assert all(store.get(ks, Pages.contiguous(dst.addr, P, range(N))))
        share = store.stats()["read_post_share"]
        assert share > 0.5
    finally:
        store.close()
    eng = FaultyEngine(create_engine("nixl-posix", EngineOptions()), Faults(post_s=0.02, only=Op.READ))
    store = open_store(d, engine=eng, config={"max_request_bytes": 4 * P, "io_timeout": 2})
    try:
        src, dst, data = buffers(store)
        assert store.stats()["read_posting"].startswith("within")
        spy = _InFlight(eng)
        posted_ahead, shares, exact = [], [], []
        before = dict(posting.DEVICE_POST_SHARE)  # unrounded: a probe may measure what was measured
        for i in range(5):
            spy.at_post.clear()
            dst.numpy()[:] = 0xEE
            assert all(store.get(ks, Pages.contiguous(dst.addr, P, range(N))))
            assert dst.numpy().tobytes() == data.tobytes()
            posted_ahead.append(max(spy.at_post))
            shares.append(store.stats()["read_post_share"])
            exact.append(dict(posting.DEVICE_POST_SHARE))
        # windowed reads leave the measurement as it was; the fourth read probes: all at once,
        # measured (requests already complete are settled between its posts)
        assert posted_ahead[:3] == [1, 1, 1] and posted_ahead[4] == 1
        assert shares[:3] == [share] * 3 and shares[4] == shares[3]
        assert exact[:3] == [before] * 3 and exact[3] != before and exact[4] == exact[3]
        assert store.stats()["read_posting"].startswith("within")
    finally:
        store.close()
    store = open_store(d, engine="nixl-posix", config={"max_request_bytes": 4 * P})
    try:
        assert store.stats()["read_posting"] == "all at once"
    finally:
        store.close()


def test_windowed_reads_fail_only_the_pages_hit_by_eio_a_bad_checksum_or_a_hang(tmp_path, monkeypatch):
    """Faults while reads post within a window and verify beside the IO: a request's EIO has its
    pages read again (every request failing fails them all), a flipped byte fails its page
    (checksum), a hang times out and leaves the rest of the get unposted; no wrong byte is
    returned, and the store serves again once healed."""
    store, eng = _slow_posting_store(str(tmp_path), monkeypatch, N)
    try:
        src, dst, data = buffers(store)
        ks = keys()
        assert all(store.put(ks, Pages.contiguous(src.addr, P, range(N))))
        for _ in range(2):
            assert all(store.get(ks, Pages.contiguous(dst.addr, P, range(N))))
        assert store.stats()["read_posting"].startswith("within")
        want = np.frombuffer(data.tobytes(), dtype=np.uint8).reshape(N, P)

        def get():
            dst.numpy()[:] = 0xEE
            ok = store.get(ks, Pages.contiguous(dst.addr, P, range(N)))
            got = dst.numpy().reshape(N, P)
            for i in np.flatnonzero(ok):
                assert got[i].tobytes() == want[i].tobytes(), f"page {i}: wrong bytes served"
            return ok

        eng.set(Faults(post_s=0.02, only=Op.READ, nth=(2,)))  # the third request: pages 8..11, read again
        assert all(get()) and eng.injected["eio"] == 1
        eng.set(Faults(post_s=0.02, only=Op.READ, eio=1.0))
        assert not any(get())

        eng.set(Faults(post_s=0.02, only=Op.READ))
        entry = store.index.lookup_pin([ks[21]])[0]
        store.index.unpin([entry.slot])
        fd = os.open(store.slabs.paths[entry.slot % len(store.dirs)], os.O_RDWR)
        try:
            off = (entry.slot // len(store.dirs)) * store.slot_bytes + 777
            os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0x10]), off)
            os.fsync(fd)
        finally:
            os.close(fd)
        before = store.stats()["checksum_mismatches"]
        ok = get()
        assert ok == [i != 21 for i in range(N)]
        assert store.stats()["checksum_mismatches"] == before + 1

        spy = _InFlight(eng)
        eng.set(Faults(post_s=0.02, only=Op.READ, hang=1.0))
        t0 = time.monotonic()
        ok = get()
        assert not any(ok) and time.monotonic() - t0 < 6
        # the window's requests, posted before the first wait; the rest never once it timed out
        assert spy.at_post == list(range(len(spy.at_post))) and len(spy.at_post) <= 3
        eng.heal()
        ok = get()
        assert ok == [i != 21 for i in range(N)]  # the bad page was dropped; the rest read again
    finally:
        store.close()
