"""PageReader: the read-only, lock-free view of a namespace another process writes.

Random page data, poisoned destinations, byte comparisons; a writer process evicting and reusing
slots under a reader process; nothing ever written under GDS_PATH by a reader.
"""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hicache_gds import (Config, ConfigError, MemKind, PageReader, PageStore, Pages, ReadOnlyError, RegionError,
                         namespace_location)
from hicache_gds.memory import HostBuffer, align_up
from hicache_gds.testing import random_bytes

P = 64 << 10
N = 16
IDENT = {"model": "reader-test"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POISON = 0xA5


def cfg(d, engine="nixl-posix", slots=4 * N, page=P, **kw):
    return {"gds_path": d, "capacity": slots * align_up(page), "engine": engine, **kw}


def writer(d, page=P, **kw):
    return PageStore(page, IDENT, config=cfg(d, page=page, **kw))


def reader(d, page=P, **kw):
    return PageReader(page, IDENT, config=cfg(d, page=page, **kw))


def keys(n=N, tag="k"):
    return [f"{tag}{i:05d}" for i in range(n)]


def registered(store, n=N, page=P, seed=None):
    buf = HostBuffer(n * page)
    store.register_memory(buf.addr, buf.nbytes)
    if seed is None:
        buf.numpy()[:] = POISON
    else:
        random_bytes(buf, seed)
    return buf


def tree(d):
    """Everything a write could change under `d`: names, types, modes, owners, sizes, mtimes, ctimes, bytes.

    Run as root, SQLite opening a dead writer's -wal and -shm files re-asserts their owner (a
    fchown to the owner they already have): only their ctime moves, so it is left out for them.
    """
    out = {}
    for base, dirs, files in os.walk(d):
        for name in dirs + files + ["."]:
            p = os.path.join(base, name)
            st = os.lstat(p)
            body = b""
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    body = f.read()
            ctime = None if os.geteuid() == 0 and name.endswith(("-wal", "-shm")) else st.st_ctime_ns
            out[os.path.relpath(p, d)] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, ctime,
                                          hash(body))
    return out


@pytest.mark.parametrize("engine,page", [("nixl-posix", P), ("nixl-posix", 50000), ("bounce", P)])
def test_reads_the_writers_pages_byte_exactly(gds_dir, engine, page):
    with writer(gds_dir, page=page, engine=engine) as w, reader(gds_dir, page=page, engine=engine) as r:
        src = registered(w, page=page, seed=3)
        assert w.put(keys(), Pages.contiguous(src.addr, page, range(N))) == [True] * N
        dst = registered(r, n=N + 2, page=page)
        order = np.random.default_rng(4).permutation(N)
        ks = [keys()[i] for i in order]
        got = r.get(ks[:5] + ["missing"] + ks[5:] + ["also-missing"], Pages.contiguous(dst.addr, page, range(N + 2)))
        assert got == [True] * 5 + [False] + [True] * (N - 5) + [False]
        d, s = dst.numpy(), src.numpy()
        for j, i in enumerate(list(order[:5]) + [None] + list(order[5:]) + [None]):
            want = s[i * page:(i + 1) * page] if i is not None else np.full(page, POISON, np.uint8)
            assert np.array_equal(d[j * page:(j + 1) * page], want), j  # a miss leaves the destination alone
        assert r.exists(["k00003", "nope"]) == [True, False] and r.prefix(keys() + ["nope"]) == N
        st = r.stats()
        assert st["read_only"] is True and st["engine"] == engine and st["pages"] == N
        assert st["hits"] == N and st["misses"] == 2 and st["pages_read"] == N and st["checksum_mismatches"] == 0
        assert (st["staged_pages"] > 0) == (page % 4096 != 0 and engine == "nixl-posix")
        assert r.namespace == w.namespace and r.dirs == w.dirs


def test_each_call_sees_what_the_writer_did_since(gds_dir):
    r = reader(gds_dir)
    w = writer(gds_dir)
    try:
        src, dst = registered(w, seed=5), registered(r)
        ks = keys()
        assert r.prefix(ks) == 0
        assert w.put(ks[:8], Pages.contiguous(src.addr, P, range(8))) == [True] * 8
        assert r.prefix(ks) == 8
        assert w.delete(ks[2:3]) == [True]
        assert r.exists(ks[:4]) == [True, True, False, True]
        assert r.get(ks[2:4], Pages.contiguous(dst.addr, P, [0, 1])) == [False, True]
        w.close()  # a restarted writer keeps serving the reader
        w = writer(gds_dir)
        w.register_memory(src.addr, src.nbytes)
        assert r.prefix(ks) == 2 and w.put(ks[8:], Pages.contiguous(src.addr, P, range(8, N))) == [True] * 8
        assert r.exists(ks) == [True] * 2 + [False] + [True] * (N - 3)
        dst.numpy()[:] = POISON
        assert r.get(ks, Pages.contiguous(dst.addr, P, range(N))) == [True] * 2 + [False] + [True] * (N - 3)
        got, want = dst.numpy(), src.numpy()
        assert np.array_equal(got[3 * P:], want[3 * P:]) and (got[2 * P:3 * P] == POISON).all()
    finally:
        w.close()
        r.close()


def test_an_empty_wal_left_without_its_shm_reads_as_the_database_file(gds_dir):
    """A writer's close can leave an empty -wal and no -shm, which read-only SQLite cannot open as
    a WAL database; nothing is in that WAL, so the reader reads the database file, and a writer
    that comes back and writes to the WAL is seen on the next call."""
    w = writer(gds_dir)
    src = registered(w, seed=8)
    ks = keys()
    assert w.put(ks[:8], Pages.contiguous(src.addr, P, range(8))) == [True] * 8
    w.close()
    db = os.path.join(namespace_location(P, IDENT, Config.load(cfg(gds_dir))).dirs[0], "index.sqlite3")
    assert not os.path.exists(db + "-shm")
    with open(db + "-wal", "wb"):
        os.chmod(db + "-wal", 0o600)
    r = reader(gds_dir)
    w = None
    try:
        dst = registered(r)
        assert r.get(ks[:8], Pages.contiguous(dst.addr, P, range(8))) == [True] * 8
        assert np.array_equal(dst.numpy()[:8 * P], src.numpy()[:8 * P])
        w = writer(gds_dir)
        w.register_memory(src.addr, src.nbytes)
        assert w.put(ks[8:], Pages.contiguous(src.addr, P, range(8, N))) == [True] * 8
        assert os.path.getsize(db + "-wal") > 0
        dst.numpy()[:] = POISON
        assert r.get(ks, Pages.contiguous(dst.addr, P, range(N))) == [True] * N
        assert np.array_equal(dst.numpy(), src.numpy())
    finally:
        if w is not None:
            w.close()
        r.close()


def test_a_slot_reused_under_a_reader_is_a_miss_never_the_new_bytes(gds_dir):
    """The race, made deterministic: the reader looked the key up, then the writer evicted it and
    wrote another page into its slot before the reader's IO."""
    with writer(gds_dir, slots=1) as w, reader(gds_dir, slots=1) as r:
        src, dst = registered(w, n=2, seed=6), registered(r, n=1)
        assert w.put(["old"], Pages.contiguous(src.addr, P, [0])) == [True]
        stale = r.index.lookup(["old"])
        assert w.put(["new"], Pages.contiguous(src.addr, P, [1])) == [True]  # one slot: "old" is evicted
        assert r.index.lookup(["new"])[0].slot == stale[0].slot
        assert r.exists(["old"]) == [False]  # looked up again: gone
        r.index.lookup = lambda ks: stale  # the lookup that raced with the eviction
        assert r.get(["old"], Pages.contiguous(dst.addr, P, [0])) == [False]
        assert r.stats()["checksum_mismatches"] == 1 and r.stats()["pages_read"] == 0


def test_slot_past_the_end_of_a_shrunk_slab_is_a_miss_and_the_file_is_left_alone(gds_dir):
    with writer(gds_dir) as w, reader(gds_dir) as r:
        src, dst = registered(w, seed=8), registered(r)
        assert w.put(keys(), Pages.contiguous(src.addr, P, range(N))) == [True] * N
        slab = os.path.join(w.dirs[0], "slab.bin")
        last = max(e.slot for e in r.index.lookup(keys()))
        size = os.path.getsize(slab)
        os.truncate(slab, last * P)  # the slot of one page is gone
        got = r.get(keys(), Pages.contiguous(dst.addr, P, range(N)))
        assert sum(got) == N - 1 and os.path.getsize(slab) == last * P  # the store would extend it; a reader never
        for j, ok in enumerate(got):
            if ok:
                assert np.array_equal(dst.numpy()[j * P:(j + 1) * P], src.numpy()[j * P:(j + 1) * P])
        os.truncate(slab, size)


def test_writes_are_refused_with_a_typed_error(gds_dir):
    with writer(gds_dir) as w, reader(gds_dir) as r:
        src = registered(w, seed=9)
        assert w.put(keys(4), Pages.contiguous(src.addr, P, range(4))) == [True] * 4
        r.register_memory(src.addr, src.nbytes)
        for call in (lambda: r.put(keys(4), Pages.contiguous(src.addr, P, range(4))),
                     lambda: r.delete(keys(4)), r.clear):
            with pytest.raises(ReadOnlyError, match="read-only") as exc:
                call()
            assert isinstance(exc.value, io.UnsupportedOperation) and isinstance(exc.value, OSError)
            assert isinstance(exc.value, ValueError) and r.namespace in str(exc.value)
        assert w.exists(keys(4)) == [True] * 4 and r.exists(keys(4)) == [True] * 4
        with pytest.raises(RegionError, match="host"):
            r.get(keys(1), Pages(np.array([[src.addr]], np.uint64), np.array([[P]], np.uint64), MemKind.VRAM))


def test_a_missing_namespace_reads_as_empty_and_creates_nothing(gds_dir, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        reader(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        reader(str(tmp_path / "file"))
    before = tree(gds_dir)
    r = reader(gds_dir)
    try:
        dst = registered(r)
        assert r.exists(keys(3)) == [False] * 3 and r.prefix(keys()) == 0
        assert r.get(keys(), Pages.contiguous(dst.addr, P, range(N))) == [False] * N
        assert (dst.numpy() == POISON).all()
        assert r.stats()["pages"] == 0 and r.stats()["misses"] == N and r.file_ids == []
        assert tree(gds_dir) == before and os.listdir(gds_dir) == []
        with writer(gds_dir) as w:  # a writer appears later: the same reader sees its pages
            src = registered(w, seed=10)
            assert w.put(keys(), Pages.contiguous(src.addr, P, range(N))) == [True] * N
            assert r.get(keys(), Pages.contiguous(dst.addr, P, range(N))) == [True] * N
            assert np.array_equal(dst.numpy(), src.numpy())
    finally:
        r.close()


_KILLED_WRITER = textwrap.dedent("""
    import os, sys
    from hicache_gds import PageStore, Pages
    from hicache_gds.memory import HostBuffer
    from hicache_gds.testing import random_bytes
    d, page, cap, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    w = PageStore(page, {"model": "reader-test"}, config={"gds_path": d, "capacity": cap, "engine": "nixl-posix"})
    buf = HostBuffer(n * page)
    random_bytes(buf, 11)
    w.register_memory(buf.addr, buf.nbytes)
    assert w.put([f"k{i:05d}" for i in range(n)], Pages.contiguous(buf.addr, page, range(n))) == [True] * n
    os.kill(os.getpid(), 9)
""")


@pytest.mark.parametrize("writer_end", ["closed", "killed"])
def test_a_reader_never_writes_under_gds_path(gds_dir, writer_end):
    if writer_end == "closed":
        with writer(gds_dir) as w:
            src = registered(w, seed=11)
            assert w.put(keys(), Pages.contiguous(src.addr, P, range(N))) == [True] * N
    else:  # kill -9: the -wal and -shm files stay behind, and a plain read-only SQLite open would change them
        p = subprocess.run([sys.executable, "-c", _KILLED_WRITER, gds_dir, str(P), str(4 * N * P), str(N)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, check=False)
        assert p.returncode == -signal.SIGKILL, p.stderr
        src = HostBuffer(N * P)
        random_bytes(src, 11)
    ns = namespace_location(P, IDENT, Config.load(cfg(gds_dir)))
    names = sorted(os.listdir(ns.dirs[0]))
    assert ("index.sqlite3-wal" in names) == (writer_end == "killed")
    before = tree(gds_dir)
    r = reader(gds_dir)
    try:
        dst = registered(r, n=N + 1)
        for _ in range(3):
            assert r.exists(keys() + ["nope"]) == [True] * N + [False] and r.prefix(keys()) == N
            assert r.get(keys() + ["nope"], Pages.contiguous(dst.addr, P, range(N + 1))) == [True] * N + [False]
            assert np.array_equal(dst.numpy()[:N * P], src.numpy())
        with pytest.raises(ReadOnlyError):
            r.clear()
        assert r.stats()["pages"] == N
    finally:
        r.close()
    assert tree(gds_dir) == before


def test_namespace_location_is_the_page_stores_and_creates_nothing(gds_dir):
    c = Config.load({"gds_path": gds_dir, "capacity": "8M", "namespace": "t1"})
    ident = {"model": "m", "pool": "kv", "x": 1}
    loc = namespace_location(12345, ident, c)
    assert os.listdir(gds_dir) == []
    with PageStore(12345, ident, config=c) as s:
        assert (loc.identity, loc.namespace, loc.dirs, loc.slot_bytes) == (s.identity, s.namespace, s.dirs,
                                                                           s.slot_bytes)


def test_a_symlinked_namespace_is_refused(gds_dir, tmp_path):
    with writer(gds_dir) as w:
        src = registered(w, seed=12)
        assert w.put(keys(2), Pages.contiguous(src.addr, P, range(2))) == [True] * 2
        ns_dir = w.dirs[0]
    os.rename(ns_dir, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", ns_dir)
    with reader(gds_dir) as r, pytest.raises(ConfigError, match="symbolic link"):
        r.exists(keys(2))


# -- a writer process evicting and reusing slots under a reader process ----------------------------

_RACE = textwrap.dedent("""
    import json, select, sys, time, zlib
    import numpy as np
    from hicache_gds import PageReader, PageStore, Pages
    from hicache_gds.memory import HostBuffer
    role, d, engine = sys.argv[1], sys.argv[2], sys.argv[3]
    page, slots, nkeys, seconds = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
    names = [f"page-{i:04d}" for i in range(nkeys)]
    # A page's bytes are a function of its key, so a reader can tell any other page's bytes apart.
    pages = np.stack([np.random.default_rng(zlib.crc32(k.encode())).integers(0, 256, page, dtype=np.uint8)
                      for k in names])
    conf = {"gds_path": d, "engine": engine, "capacity": slots * ((page + 4095) // 4096 * 4096)}
    rng = np.random.default_rng(7 if role == "writer" else 8)
    out = {}
    if role == "writer":
        s = PageStore(page, {"model": "race"}, config=conf)
        buf = HostBuffer(nkeys * page)
        buf.numpy()[:] = pages.reshape(-1)
        s.register_memory(buf.addr, buf.nbytes)
        s.put(names[:slots], Pages.contiguous(buf.addr, page, range(slots)))
        print("ready", flush=True)
        puts, deletes = 0, 0
        while not select.select([sys.stdin], [], [], 0)[0]:  # until the test says stop (the reader is done)
            idx = rng.choice(nkeys, 8, replace=False)
            puts += sum(s.put([names[i] for i in idx], Pages.contiguous(buf.addr, page, idx)))
            if rng.random() < 0.3:
                deletes += sum(s.delete([names[i] for i in rng.choice(nkeys, 4, replace=False)]))
        out = {"puts": puts, "deletes": deletes, "evictions": s.stats().get("evictions", 0)}
    else:
        s = PageReader(page, {"model": "race"}, config=conf)
        lookup = s.index.lookup

        def slow_lookup(ks):  # half the time, descheduled between its lookup and its IO (GIL, load)
            found = lookup(ks)
            if rng.random() < 0.5:
                time.sleep(float(rng.uniform(0, 0.002)))
            return found

        s.index.lookup = slow_lookup
        batch = 12
        dst = HostBuffer(batch * page)
        s.register_memory(dst.addr, dst.nbytes)
        view = dst.numpy().reshape(batch, page)
        end, gets, hits, wrong = time.monotonic() + seconds, 0, 0, 0
        while time.monotonic() < end:
            idx = rng.choice(nkeys, batch, replace=False)
            view[:] = 0xA5
            got = s.get([names[i] for i in idx], Pages.contiguous(dst.addr, page, range(batch)))
            gets += 1
            for j, ok in enumerate(got):
                if ok:
                    hits += 1
                    wrong += not np.array_equal(view[j], pages[idx[j]])
            if gets % 16 == 0:
                s.exists(names[:8])
                s.prefix(names[:8])
        st = s.stats()
        out = {"gets": gets, "hits": hits, "wrong": wrong, "checksum_mismatches": st["checksum_mismatches"],
               "get_failed": st["get_failed"], "staged_pages": st["staged_pages"]}
    s.close()
    print(json.dumps(out), flush=True)
""")


@pytest.mark.parametrize("engine,page", [("nixl-posix", P), ("nixl-posix", 50000), ("bounce", 16 << 10)])
@pytest.mark.slow
def test_concurrent_writer_process_never_makes_a_reader_process_return_wrong_bytes(gds_dir, engine, page):
    seconds, slots, nkeys = 3.0, 16, 48
    args = [gds_dir, engine, str(page), str(slots), str(nkeys), str(seconds)]
    w = subprocess.Popen([sys.executable, "-c", _RACE, "writer", *args], cwd=ROOT, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert w.stdout.readline().strip() == "ready", w.stderr.read()
        r = subprocess.run([sys.executable, "-c", _RACE, "reader", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, check=False)
        wout, werr = w.communicate("stop\n", timeout=120)
    finally:
        if w.poll() is None:
            w.kill()
    assert r.returncode == 0 and w.returncode == 0, r.stderr[-3000:] + werr[-3000:]
    rs, ws = json.loads(r.stdout.strip().splitlines()[-1]), json.loads(wout.strip().splitlines()[-1])
    print(engine, page, "reader", rs, "writer", ws)
    assert rs["wrong"] == 0  # the checksum turns every reused or torn slot into a miss
    assert rs["hits"] > 100 and ws["evictions"] > 100 and ws["deletes"] > 10
    assert rs["checksum_mismatches"] > 0  # slots were reused under the reader: the race was run
    assert (rs["staged_pages"] > 0) == (page % 4096 != 0)
