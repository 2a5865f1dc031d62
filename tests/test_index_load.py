"""Index open at scale: lookups and writes served while the map loads in the background,
kill -9 and close during the load; slab files found short at open; staging of timed-out reads."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from hicache_gds import PageStore, Pages
from hicache_gds.engines import EngineOptions, Op, create_engine
from hicache_gds.engines.faulty import Faults, FaultyEngine
from hicache_gds.index import INDEX_FILE, Index
from hicache_gds.memory import HostBuffer
from hicache_gds.testing import random_bytes
from hicache_gds.testing.invariants import index_problems

P = 64 << 10
N = 32


def open_store(d, capacity=2 * N * P, engine="bounce", **cfg):
    c = {"gds_path": d, "capacity": capacity, **cfg}
    if isinstance(engine, str):
        return PageStore(P, {"model": "load"}, config={**c, "engine": engine})
    return PageStore(P, {"model": "load"}, config=c, engine=engine)


def keys(n=N, tag="k"):
    return [f"{tag}{i:05d}" for i in range(n)]


def fill(d, n=N, seed=3):
    """Put n pages of random bytes (pages 0..n-1 of the returned array) and close."""
    with open_store(d) as s:
        src = HostBuffer(2 * n * P)
        s.register_memory(src.addr, src.nbytes)
        data = random_bytes(src, seed).copy()
        assert all(s.put(keys(n), Pages.contiguous(src.addr, P, range(n))))
        s.deregister_memory(src.addr)
    return data


class Gate:
    """An `Index._load_hook` that holds the loader, map built, until released."""

    def __init__(self):
        self.entered, self.go = threading.Event(), threading.Event()

    def __call__(self, index):
        self.entered.set()
        assert self.go.wait(60), "the test never released the load"


@pytest.fixture
def slow_load(monkeypatch):
    gate = Gate()
    monkeypatch.setattr(Index, "BACKGROUND_ROWS", 1)
    monkeypatch.setattr(Index, "_load_hook", gate)
    yield gate
    gate.go.set()


def test_lookups_and_puts_served_while_loading(gds_dir, slow_load):
    data = fill(gds_dir)
    with open_store(gds_dir) as s:
        assert slow_load.entered.wait(60)
        idx = s.index
        assert idx.keymap.load_error is None
        assert idx.loaded_s is None and idx.recovery_s < 3 and s.stats()["index_loaded_s"] is None
        ks = keys()
        # answered from SQLite, before the map is in place
        assert s.exists(ks[:3] + ["absent", "k\n\u00e9\U0001f600\"'"]) == [True, True, True, False, False]
        assert s.prefix(ks + ["absent"]) == N and s.prefix(["absent"] + ks) == 0
        assert len(idx) == N and s.stats()["pages"] == N
        dst = HostBuffer(2 * N * P)
        s.register_memory(dst.addr, dst.nbytes)
        dst.numpy()[:] = 0xEE
        assert s.get(ks[:4] + ["absent"], Pages.contiguous(dst.addr, P, range(5))) == [True] * 4 + [False]
        assert np.array_equal(dst.numpy()[:4 * P], data[:4 * P])
        assert not idx._pins and s.stats()["leased_slots_all"] == 0  # leases taken while loading were returned
        # puts run in the database: they do not wait for the map
        src = HostBuffer(2 * N * P)
        s.register_memory(src.addr, src.nbytes)
        new = random_bytes(src, 11).copy()
        assert s.put(ks[:2], Pages.contiguous(src.addr, P, [0, 1])) == [True, True]  # present: not rewritten
        assert s.put(keys(N, "n"), Pages.contiguous(src.addr, P, range(N))) == [True] * N
        assert idx.loaded_s is None and s.exists(keys(N, "n")) == [True] * N
        slow_load.go.set()
        assert idx.wait_loaded(60) and s.stats()["index_loaded_s"] >= idx.recovery_s
        assert s.exists(ks + keys(N, "n")) == [True] * 2 * N  # the map caught up with the puts made meanwhile
        # the slots are full now; the next put evicts the least recently used: pages read while
        # loading (0..3) were touched in the database, so 4..11 go
        assert s.put(keys(8, "m"), Pages.contiguous(src.addr, P, range(8))) == [True] * 8
        assert s.exists(ks[:12]) == [True] * 4 + [False] * 8
        assert s.get(keys(N, "n"), Pages.contiguous(dst.addr, P, range(N))) == [True] * N
        assert np.array_equal(dst.numpy()[:N * P], new[:N * P])
        assert index_problems(idx) == []
        for b in (src, dst):
            s.deregister_memory(b.addr)


def test_kill9_during_background_load_leaves_index_intact(gds_dir, tmp_path):
    data = fill(gds_dir)
    ready = tmp_path / "ready"
    child = textwrap.dedent(f"""
        import threading, time
        from hicache_gds import PageStore, Pages
        from hicache_gds.index import Index
        from hicache_gds.memory import HostBuffer
        held = threading.Event()
        def hold(index):
            held.set()
            time.sleep(600)
        Index.BACKGROUND_ROWS = 1
        Index._load_hook = hold
        s = PageStore({P}, {{"model": "load"}}, config={{"gds_path": {gds_dir!r}, "capacity": {2 * N * P},
                                                       "engine": "bounce"}})
        dst = HostBuffer({N * P})
        s.register_memory(dst.addr, dst.nbytes)
        ok = s.get(["k00000", "k00001"], Pages.contiguous(dst.addr, {P}, [0, 1]))  # pins, touches
        assert ok == [True, True] and s.index.loaded_s is None, ok
        assert held.wait(60) and s.index.keymap.load_error is None
        open({str(ready)!r}, "w").close()
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", child])
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the child died or never got ready"
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    with open_store(gds_dir) as s:
        assert s.index.wait_loaded(60)
        dst = HostBuffer(N * P)
        s.register_memory(dst.addr, dst.nbytes)
        assert s.get(keys(), Pages.contiguous(dst.addr, P, range(N))) == [True] * N
        assert np.array_equal(dst.numpy(), data[:N * P])
        assert index_problems(s.index) == []
        s.deregister_memory(dst.addr)


def test_close_during_background_load(gds_dir, monkeypatch):
    fill(gds_dir)

    def hook(index):  # hold the loader until close() has begun
        while not index.keymap.closing:
            time.sleep(0.005)

    monkeypatch.setattr(Index, "BACKGROUND_ROWS", 1)
    monkeypatch.setattr(Index, "_load_hook", hook)
    s = open_store(gds_dir)
    assert s.exists(keys()[:1]) == [True]
    s.close()
    assert s.index.loaded_s is None and s.index.keymap.load_error is None
    monkeypatch.setattr(Index, "_load_hook", None)
    with open_store(gds_dir) as s:
        assert s.index.wait_loaded(60) and s.exists(keys()) == [True] * N


def test_malformed_rows_found_by_the_background_load_reset_the_index(gds_dir, monkeypatch):
    fill(gds_dir)
    ns = [e for e in os.scandir(gds_dir) if e.is_dir()][0].path
    db = sqlite3.connect(os.path.join(ns, INDEX_FILE))
    db.execute("UPDATE pages SET nbytes = 'not a number' WHERE key = 'k00003'")
    db.commit()
    db.close()
    monkeypatch.setattr(Index, "BACKGROUND_ROWS", 1)
    with open_store(gds_dir) as s:
        assert s.index.wait_loaded(60) and len(s.index) == 0
        assert any(".damaged-" in f for f in os.listdir(ns))
        src = HostBuffer(N * P)
        s.register_memory(src.addr, src.nbytes)
        random_bytes(src, 4)
        assert all(s.put(keys(4, "x"), Pages.contiguous(src.addr, P, range(4))))
        assert index_problems(s.index) == []
        s.deregister_memory(src.addr)


@pytest.mark.parametrize("ndirs", [1, 2])
def test_slab_file_truncated_while_closed_drops_its_pages_at_open(tmp_path, ndirs):
    dirs = [tmp_path / f"d{i}" for i in range(ndirs)]
    for d in dirs:
        d.mkdir()
    path = ",".join(map(str, dirs))
    data = fill(path)
    with open_store(path) as s:
        slots = {k: e.slot for k, e in s.index.peek(keys()).items()}
        slab = s.slabs.paths[-1]
    keep = 5  # the last file keeps its first 5 slots
    os.truncate(slab, keep * s.slot_bytes)
    gone = {k for k, sl in slots.items() if sl % ndirs == ndirs - 1 and sl // ndirs >= keep}
    assert gone and len(gone) < N
    with open_store(path) as s:
        assert s.exists(keys()) == [k not in gone for k in keys()]  # at once, before any read fails
        assert os.path.getsize(slab) == s.slabs.file_bytes[-1]
        live = [i for i, k in enumerate(keys()) if k not in gone]
        dst = HostBuffer(N * P)
        s.register_memory(dst.addr, dst.nbytes)
        assert all(s.get([keys()[i] for i in live], Pages.contiguous(dst.addr, P, live)))
        for i in live:
            assert np.array_equal(dst.numpy()[i * P:(i + 1) * P], data[i * P:(i + 1) * P])
        assert index_problems(s.index) == []
        s.deregister_memory(dst.addr)


def test_staging_of_a_timed_out_read_is_lent_again_once_the_read_finishes(gds_dir):
    data = fill(gds_dir)
    eng = FaultyEngine(create_engine("bounce", EngineOptions()))
    seg, S = P // 4, 4  # pages of 4 segments of 16 KiB: gathered through staging
    with open_store(gds_dir, engine=eng, io_timeout=0.3) as s:
        dst = HostBuffer(2 * N * P)
        s.register_memory(dst.addr, dst.nbytes)
        addrs = np.array([[dst.addr + (i * S + j) * seg for j in range(S)] for i in range(4)], dtype=np.uint64)
        pages = Pages(addrs, np.full_like(addrs, seg))
        eng.faults = Faults(delay_s=1.5, only=Op.READ)  # lands after the 0.3 s timeout
        assert s.get(keys(4), pages) == [False] * 4
        st = s.stats()
        assert st["timeouts"] == 4 and st["staging_held_bytes"] > 0 and st["pages"] == N
        eng.heal()
        time.sleep(1.6)  # the late read has landed
        assert s.get(keys(4), pages) == [True] * 4
        assert np.array_equal(dst.numpy()[:4 * P], data[:4 * P])
        st = s.stats()
        assert st["staging_held_bytes"] == 0 and st["staged_pages"] == 8
        s.deregister_memory(dst.addr)


def test_select_entries_answers_the_same_with_and_without_sqlite_json(tmp_path, monkeypatch):
    """Lookups by primary key (loading index, read-only reader): one JSON statement, or IN chunks."""
    import sqlite3

    from hicache_gds import index as index_mod
    from hicache_gds.index import schema
    idx = index_mod.Index(str(tmp_path / "index.sqlite3"), 2000, {"t": "1"})
    rng = np.random.default_rng(7)
    keys = [f"k{i}-{rng.integers(1 << 60):x}" for i in range(1200)] + ["ключ\n🙂"]
    slots = idx.reserve(len(keys))
    idx.publish([(k, s, 4096, int(rng.integers(1, 1 << 62))) for k, s in zip(keys, slots)])
    asked = keys[::3] + ["absent", keys[0]]  # more than one IN chunk, a miss, a repeat
    db = sqlite3.connect(idx.db_path)
    try:
        with_json = index_mod.select_entries(db, asked)
        monkeypatch.setattr(schema, "HAS_JSON", False)
        without = index_mod.select_entries(db, asked)
    finally:
        db.close()
        idx.close()
    assert with_json == without and "absent" not in without and len(without) == len(set(asked)) - 1


@pytest.mark.parametrize("mode", ["json", "no update-from", "no json"])
def test_a_reads_touch_and_leases_are_the_same_in_one_statement_as_row_by_row(tmp_path, monkeypatch, mode):
    """The read path's LRU touch and leases (one statement each where SQLite has JSON, so a read
    hands the GIL back a few times, not per page) leave the tables as the row-by-row form does."""
    import sqlite3

    from hicache_gds.index import schema
    rng = np.random.default_rng(11)
    keys = [f"k{i}-{rng.integers(1 << 60):x}" for i in range(700)] + ["ключ\n🙂"]

    def run(one_statement: bool) -> tuple[list, list]:
        path = tmp_path / f"{mode}-{one_statement}.sqlite3"
        db = schema.connect(str(path))
        db.executescript(schema.CREATE)
        db.executemany("INSERT INTO pages VALUES (?, ?, 4096, 1, 0, 0)", ((k, i) for i, k in enumerate(keys)))
        db.execute("INSERT INTO leases VALUES (5, 'other')")
        if not one_statement:
            monkeypatch.setattr(schema, "HAS_JSON", False)
        elif mode == "no update-from":
            monkeypatch.setattr(schema, "_HAS_UPDATE_FROM", False)
        elif mode == "no json":
            monkeypatch.setattr(schema, "HAS_JSON", False)
        try:
            hit = keys[::2][::-1]  # any order: the clock follows the order given
            schema.touch(db, hit, 1000)
            schema.add_leases(db, "me", [3, 5, 7, 3])
            schema.add_leases(db, "me", [7, 9])  # held already: kept once
            schema.drop_leases(db, "me", [3, 9, 11])
            pages = db.execute("SELECT key, atime FROM pages ORDER BY key").fetchall()
            leases = db.execute("SELECT slot, owner FROM leases ORDER BY slot, owner").fetchall()
        finally:
            monkeypatch.undo()
            db.close()
        return pages, leases

    one, rows = run(True), run(False)
    assert one == rows
    pages, leases = one
    assert dict(pages)[keys[-1 - (len(keys) - 1) % 2]] == 1000 and dict(pages)[keys[0]] == 1000 + len(keys[::2]) - 1
    assert leases == [(5, "me"), (5, "other"), (7, "me")]
