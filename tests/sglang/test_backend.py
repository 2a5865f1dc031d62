"""HiCacheGDS driven like SGLang's controller, on the mimic host pools, for every layout x MHA/MLA.

Random page data, poisoned destinations, byte comparisons against the source pages and against
SGLang's own HiCacheFile fed the same calls.
"""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from hicache_gds import ConfigError, PageReader
from hicache_gds_sglang import HiCacheGDS
from sgl_helpers import (KINDS, LAYOUTS, FailureInjector, attach, dp_group, generic_get, generic_set, hicache_file,
                         indices, keys, leading, make_pool, needs_injector, page_bytes, poison, same_pages,
                         storage_config)

GRID = [(k, lay) for k in KINDS for lay in LAYOUTS]
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("kind,layout", GRID)
def test_zero_copy_roundtrip_and_prefix(gds_dir, kind, layout):
    pool = make_pool(kind, layout)
    b = attach(storage_config(gds_dir, is_mla_model=kind == "mla"), pool)
    try:
        ks = keys(16)
        assert b.batch_exists(ks) == 0
        assert b.batch_set_v1(ks, indices(range(16))) == [True] * 16
        assert b.batch_set_v1(ks[:4], indices(range(4))) == [True] * 4  # present: not rewritten
        assert b.batch_exists(ks) == 16 and b.batch_exists(ks[:5] + keys(1, "x") + ks[5:]) == 5
        poison(pool, range(32, 48))
        assert b.batch_get_v1(ks, indices(range(32, 48))) == [True] * 16
        assert same_pages(pool, list(range(16)), pool, list(range(32, 48)))
        poison(pool, range(32, 35))
        got = b.batch_get_v1([ks[0], keys(1, "miss")[0], ks[2]], indices(range(32, 35)))
        assert got == [True, False, True] and page_bytes(pool, 32) == page_bytes(pool, 0)
        st = b.stats()["kv"]
        assert st["pool_path"] == "zero-copy" and st["pages_written"] == 16 and st["put_skipped_present"] == 4
        m = b.get_stats()
        assert m.backup_pgs == [16, 4] and m.prefetch_pgs == [16, 2] and b.get_stats().prefetch_pgs == []
    finally:
        b.close()


@pytest.mark.parametrize("kind,layout", GRID + [("mha", "page_head")])
def test_same_bytes_and_answers_as_hicache_file(gds_dir, tmp_path, kind, layout):
    mla = kind == "mla"
    pool = make_pool(kind, layout, pages=96)
    ours = attach(storage_config(gds_dir, is_mla_model=mla), pool)
    theirs = hicache_file(str(tmp_path / "file"), pool, is_mla_model=mla)
    try:
        ks, src = keys(24), list(range(24))
        # each fed as SGLang feeds it: ours through the zero-copy functions, HiCacheFile through the copy ones
        assert ours.batch_set_v1(ks[:20], indices(src[:20])) == [True] * 20
        assert generic_set(theirs, pool, ks[:20], src[:20])
        for probe in (ks, ks[:7], ks[20:], keys(3, "z") + ks, ks[:10] + keys(1, "z") + ks[10:]):
            assert ours.batch_exists(probe) == theirs.batch_exists(probe)
        for i, k in enumerate(ks[:20]):
            path = os.path.join(str(tmp_path / "file"), f"{k}{theirs.config_suffix}.bin")
            stored = open(path, "rb").read()
            assert stored == page_bytes(pool, i)
            got = ours.get(k, pool.get_dummy_flat_data_page())  # our copy path, from our zero-copy write
            assert got.contiguous().view(torch.uint8).numpy().tobytes() == stored
        poison(pool, range(32, 56))
        poison(pool, range(64, 88))
        assert leading(ours.batch_get_v1(ks, indices(range(32, 56)))) == 20
        assert generic_get(theirs, pool, ks, list(range(64, 88))) == 20
        assert same_pages(pool, list(range(32, 52)), pool, list(range(64, 84)))
        assert same_pages(pool, src[:20], pool, list(range(32, 52)))
    finally:
        ours.close()


@pytest.mark.parametrize("kind,layout", GRID)
def test_copy_and_zero_copy_paths_read_each_other(gds_dir, kind, layout):
    pool = make_pool(kind, layout, pages=96)
    b = attach(storage_config(gds_dir, is_mla_model=kind == "mla"), pool)
    try:
        ks = keys(16)
        assert generic_set(b, pool, ks[:8], list(range(8)))  # copy path: get_data_page(flat)
        assert b.batch_set_v1(ks[8:], indices(range(8, 16))) == [True] * 8  # zero-copy
        poison(pool, range(32, 48))
        assert b.batch_get_v1(ks, indices(range(32, 48))) == [True] * 16
        poison(pool, range(64, 80))
        assert generic_get(b, pool, ks, list(range(64, 80))) == 16
        assert same_pages(pool, list(range(16)), pool, list(range(32, 48)))
        assert same_pages(pool, list(range(16)), pool, list(range(64, 80)))
        assert all(b.exists(k) for k in ks) and not b.exists(keys(1, "no")[0])
    finally:
        b.close()


@pytest.mark.parametrize("kind", KINDS)
def test_layouts_with_the_same_byte_order_share_pages(gds_dir, kind):
    mla = kind == "mla"
    src = make_pool(kind, "layer_first", seed=3)
    ks = keys(8)
    with_b = attach(storage_config(gds_dir, is_mla_model=mla), src)
    assert with_b.batch_set_v1(ks, indices(range(8))) == [True] * 8
    with_b.close()
    direct = make_pool(kind, "page_first_direct", seed=None)
    b = attach(storage_config(gds_dir, is_mla_model=mla), direct)
    try:
        assert b.batch_get_v1(ks, indices(range(8))) == [True] * 8
        assert same_pages(src, list(range(8)), direct, list(range(8)))
    finally:
        b.close()
    other = attach(storage_config(gds_dir, is_mla_model=mla), make_pool(kind, "page_first", seed=None))
    try:
        assert other.batch_exists(ks) == 0  # another byte order: another namespace
    finally:
        other.close()


_WRITER = textwrap.dedent("""
    import sys
    sys.path[:0] = sys.argv[2:4]
    from sgl_helpers import *
    for i, (kind, layout) in enumerate([(k, l) for k in KINDS for l in LAYOUTS]):
        pool = make_pool(kind, layout, seed=100 + i)
        b = attach(storage_config(sys.argv[1], is_mla_model=kind == "mla"), pool)
        assert b.batch_set_v1(keys(12, kind + layout), indices(range(12))) == [True] * 12
        b.close()
    print("WROTE")
""")


@pytest.mark.slow
def test_pages_survive_a_process_restart(gds_dir):
    tests = os.path.dirname(HERE)
    out = subprocess.run([sys.executable, "-c", _WRITER, gds_dir, HERE, tests], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "WROTE" in out.stdout, out.stderr[-4000:]
    for i, (kind, layout) in enumerate(GRID):
        ref = make_pool(kind, layout, seed=100 + i)
        pool = make_pool(kind, layout, seed=None)
        poison(pool, range(16, 28))
        b = attach(storage_config(gds_dir, is_mla_model=kind == "mla"), pool)
        try:
            ks = keys(12, kind + layout)
            assert b.batch_exists(ks) == 12
            assert b.batch_get_v1(ks, indices(range(16, 28))) == [True] * 12
            assert same_pages(ref, list(range(12)), pool, list(range(16, 28)))
        finally:
            b.close()


_PEER = textwrap.dedent("""
    import sys
    sys.path[:0] = sys.argv[2:4]
    from sgl_helpers import *
    kind, layout = sys.argv[4], sys.argv[5]
    pool = make_pool(kind, layout, seed=200)
    b = attach(storage_config(sys.argv[1], is_mla_model=kind == "mla", dp_rank=1), pool)
    assert b.batch_set_v1(keys(12, "peer"), indices(range(12))) == [True] * 12
    print("WROTE", flush=True)
    for line in sys.stdin:  # read what the other server stored, while both have the namespace open
        n = int(line)
        poison(pool, range(32, 32 + n))
        got = b.batch_get_v1(keys(n, "main"), indices(range(32, 32 + n)))
        ref = make_pool(kind, layout, seed=201)
        print("READ", sum(got), same_pages(ref, list(range(n)), pool, list(range(32, 32 + n))), flush=True)
    b.close()
""")


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_first_direct")])
@pytest.mark.slow
def test_two_servers_in_two_processes_share_pages_byte_exact(gds_dir, kind, layout):
    """Two HiCacheGDS backends (DP ranks 0 and 1: once two servers' worth of namespaces) in two
    processes, both attached at once: each loads what the other stored, byte-exact."""
    tests = os.path.dirname(HERE)
    peer = subprocess.Popen([sys.executable, "-c", _PEER, gds_dir, HERE, tests, kind, layout], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = peer.stdout.readline()
        assert line.strip() == "WROTE", peer.stderr.read()[-4000:]
        pool = make_pool(kind, layout, seed=201)
        b = attach(storage_config(gds_dir, is_mla_model=kind == "mla", dp_rank=0), pool)
        try:
            ref = make_pool(kind, layout, seed=200)
            peer_keys = keys(12, "peer")
            assert b.batch_exists(peer_keys) == 12
            poison(pool, range(40, 52))
            assert b.batch_get_v1(peer_keys, indices(range(40, 52))) == [True] * 12
            assert same_pages(ref, list(range(12)), pool, list(range(40, 52)))
            assert b.batch_set_v1(keys(10, "main"), indices(range(10))) == [True] * 10
            peer.stdin.write("10\n")
            peer.stdin.flush()
            assert peer.stdout.readline().split() == ["READ", "10", "True"]
            assert b.batch_set_v1(peer_keys[:4], indices(range(10, 14))) == [True] * 4  # present: stored once
            assert b.stats()["kv"]["put_skipped_present"] == 4
        finally:
            b.close()
        peer.stdin.close()
        assert peer.wait(120) == 0, peer.stderr.read()[-4000:]
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "layer_first"), ("mha", "layer_first")])
def test_three_threads_at_once(gds_dir, kind, layout):
    """SGLang's backup, prefetch-IO and prefetch threads call concurrently."""
    pool = make_pool(kind, layout, pages=256)
    b = attach(storage_config(gds_dir, is_mla_model=kind == "mla"), pool)
    base = keys(16, "base")
    assert b.batch_set_v1(base, indices(range(16))) == [True] * 16
    new = keys(96, "new")
    errors, stop = [], threading.Event()

    def writer():
        try:
            for c in range(0, 96, 16):
                assert b.batch_set_v1(new[c:c + 16], indices(range(16 + c, 32 + c))) == [True] * 16
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            stop.set()

    def exister():
        try:
            last = 0
            while not stop.is_set():
                n = b.batch_exists(new)
                assert last <= n <= 96
                last = n
                assert b.batch_exists(base) == 16
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def reader():
        try:
            rounds = 0
            while not stop.is_set() or rounds < 3:
                assert b.batch_get_v1(base, indices(range(200, 216))) == [True] * 16
                assert same_pages(pool, list(range(16)), pool, list(range(200, 216)))
                poison(pool, range(200, 216))
                rounds += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=f) for f in (writer, exister, reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert not errors, errors
        assert b.batch_exists(new) == 96
        poison(pool, range(112, 208))
        assert b.batch_get_v1(new, indices(range(112, 208))) == [True] * 96
        assert same_pages(pool, list(range(16, 112)), pool, list(range(112, 208)))
    finally:
        b.close()


def test_tp_and_pp_ranks_are_isolated(gds_dir):
    ks = keys(8)
    ranks = [dict(tp_rank=0, tp_size=2), dict(tp_rank=1, tp_size=2),
             dict(tp_rank=0, tp_size=2, pp_rank=1, pp_size=2)]
    pools = [make_pool("mha", "page_first", seed=10 + i) for i in range(len(ranks))]
    backends = [attach(storage_config(gds_dir, **r), p) for r, p in zip(ranks, pools)]
    try:
        assert backends[0].batch_set_v1(ks, indices(range(8))) == [True] * 8
        assert [b.batch_exists(ks) for b in backends] == [8, 0, 0]
        for b in backends[1:]:
            assert b.batch_set_v1(ks, indices(range(8))) == [True] * 8
        for b, p in zip(backends, pools):
            poison(p, range(16, 24))
            assert b.batch_get_v1(ks, indices(range(16, 24))) == [True] * 8
            assert same_pages(p, list(range(8)), p, list(range(16, 24)))
        assert not same_pages(pools[0], [0], pools[1], [0])
    finally:
        for b in backends:
            b.close()


def test_dp_attention_groups_share_one_namespace_and_both_write(gds_dir, monkeypatch):
    """DP attention: every group's rank 0 has tp_rank 0 and writes (DeepSeek's deployment). Both
    attach as writers of one namespace (in 0.5.17 too, whose storage config has no dp_rank) and
    each loads the pages the other stored."""
    ks = keys(12)
    pools = [make_pool("mla", "page_first", seed=40 + r) for r in range(2)]
    backends = []
    try:
        for r, pool in enumerate(pools):
            backends.append(attach(storage_config(gds_dir, is_mla_model=True, **dp_group(monkeypatch, r)), pool))
        namespaces = [b.stats()["kv"]["namespace"] for b in backends]
        assert namespaces[0] == namespaces[1] and not any(b.stats()["kv"]["read_only"] for b in backends)
        assert backends[0].batch_set_v1(ks[:6], indices(range(6))) == [True] * 6
        assert backends[1].batch_set_v1(ks[6:], indices(range(6, 12))) == [True] * 6
        for b in backends:
            assert b.batch_exists(ks) == 12
        # each group loads the other's pages, byte-exact
        poison(pools[1], range(16, 22))
        assert backends[1].batch_get_v1(ks[:6], indices(range(16, 22))) == [True] * 6
        assert same_pages(pools[0], list(range(6)), pools[1], list(range(16, 22)))
        poison(pools[0], range(16, 22))
        assert backends[0].batch_get_v1(ks[6:], indices(range(16, 22))) == [True] * 6
        assert same_pages(pools[1], list(range(6, 12)), pools[0], list(range(16, 22)))
    finally:
        for b in backends:
            b.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_one_writer_every_rank_reads(gds_dir, layout):
    ks = keys(12)
    wpool = make_pool("mla", layout, seed=5)
    rpool = make_pool("mla", layout, seed=None)
    reader = attach(storage_config(gds_dir, is_mla_model=True, tp_rank=1, tp_size=2), rpool)
    try:
        assert reader.batch_exists(ks) == 0  # the writer has not even opened its namespace yet
        assert reader.batch_set_v1(ks, indices(range(12))) == [True] * 12  # skipped: the writer's job
        writer = attach(storage_config(gds_dir, is_mla_model=True, tp_rank=0, tp_size=2), wpool)
        assert writer.batch_exists(ks) == 0  # the reader wrote nothing
        assert writer.batch_set_v1(ks[:8], indices(range(8))) == [True] * 8
        assert reader.batch_exists(ks) == 8
        poison(rpool, range(16, 28))
        assert reader.batch_get_v1(ks, indices(range(16, 28))) == [True] * 8 + [False] * 4
        assert same_pages(wpool, list(range(8)), rpool, list(range(16, 24)))
        assert generic_get(reader, rpool, ks, list(range(32, 44))) == 8
        assert same_pages(wpool, list(range(8)), rpool, list(range(32, 40)))
        writer.close()  # a restarted writer keeps serving the readers
        writer = attach(storage_config(gds_dir, is_mla_model=True, tp_rank=0, tp_size=2), wpool)
        assert writer.batch_set_v1(ks[8:], indices(range(8, 12))) == [True] * 4
        assert reader.batch_exists(ks) == 12
        writer.close()
    finally:
        reader.close()


def test_mla_reader_never_returns_bytes_of_a_reused_slot(gds_dir):
    wpool, rpool = make_pool("mla", "page_first", seed=6), make_pool("mla", "page_first", seed=None)
    writer = attach(storage_config(gds_dir, is_mla_model=True), wpool)
    reader = attach(storage_config(gds_dir, is_mla_model=True, tp_rank=1, tp_size=2), rpool)
    try:
        k = keys(1)
        assert writer.batch_set_v1(k, indices([0])) == [True]
        slab = os.path.join(reader.stats()["kv"]["dirs"][0], "slab.bin")
        with open(slab, "r+b") as f:  # what a concurrent reuse of the slot looks like to the reader
            f.write(b"\x00" * 4096)
        assert reader.batch_get_v1(k, indices([5])) == [False]
        assert reader.stats()["kv"]["checksum_mismatches"] == 1
    finally:
        reader.close()
        writer.close()


def test_mla_reader_is_the_core_read_only_store_and_writes_nothing(gds_dir):
    rpool, wpool = make_pool("mla", "page_first", seed=None), make_pool("mla", "page_first", seed=7)
    reader = attach(storage_config(gds_dir, is_mla_model=True, tp_rank=1, tp_size=2), rpool)
    try:
        store = reader._bindings["kv"].store
        assert isinstance(store, PageReader) and reader.stats()["kv"]["read_only"] is True
        ks = keys(4)
        assert reader.batch_set_v1(ks, indices(range(4))) == [True] * 4 and reader.batch_set(ks[:1], [None]) is True
        assert reader.clear() is True  # the writer's job: nothing to do, not a failure
        assert os.listdir(gds_dir) == []  # no namespace directory, no lock, no index
        writer = attach(storage_config(gds_dir, is_mla_model=True, tp_rank=0, tp_size=2), wpool)
        try:
            assert writer._bindings["kv"].store.namespace == store.namespace
            assert writer.batch_set_v1(ks, indices(range(4))) == [True] * 4
            assert reader.clear() is True and reader.batch_exists(ks) == 4  # a reader's clear drops nothing
        finally:
            writer.close()
    finally:
        reader.close()


@needs_injector
def test_failure_injector_never_raises_and_hits_stay_correct(gds_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    pool = make_pool("mha", "page_first", pages=128)
    b = attach(storage_config(gds_dir), pool)
    assert isinstance(b, FailureInjector) and isinstance(b._backend, HiCacheGDS)
    ks = keys(32)
    try:
        written = 0
        for _ in range(40):
            res = b.batch_set_v1(ks, indices(range(32)))
            assert len(res) == 32
            written = max(written, b._backend.batch_exists(ks))
            n = b.batch_exists(ks)
            assert 0 <= n <= 32
            poison(pool, range(64, 96))
            got = b.batch_get_v1(ks, indices(range(64, 96)))
            for i, ok in enumerate(got):
                if ok:
                    assert page_bytes(pool, 64 + i) == page_bytes(pool, i)
            data = b.batch_get(ks[:4], [pool.get_dummy_flat_data_page() for _ in range(4)])
            for i, d in enumerate(data):
                if d is not None:
                    assert d.contiguous().view(torch.uint8).numpy().tobytes() == page_bytes(pool, i)
        assert written == 32
    finally:
        b.close()


def test_bad_calls_and_a_closed_backend_never_raise(gds_dir):
    pool = make_pool("mha", "page_first")
    b = attach(storage_config(gds_dir), pool)
    ks = keys(4)
    assert b.batch_set_v1(ks, indices(range(3))) == [False] * 4  # 3 pages of indices for 4 keys
    assert b.batch_get_v1(ks, None) == [False] * 4
    assert b.batch_set(ks, [torch.zeros(3)] * 4) is False  # wrong page size
    assert b.batch_set_v1(ks, indices(range(4))) == [True] * 4
    assert b.clear() is True and b.batch_exists(ks) == 0
    b.close()
    b.close()
    assert b.batch_exists(ks) == 0 and b.batch_get_v1(ks, indices(range(4))) == [False] * 4
    assert b.batch_set_v1(ks, indices(range(4))) == [False] * 4
    assert b.get(ks[0]) is None and b.exists(ks[0]) is False and b.set(ks[0], torch.zeros(1)) is False


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mha", "page_first_direct"), ("mla", "page_first")])
def test_aligned_pages_go_straight_from_the_pool_to_disk(gds_dir, kind, layout):
    """Llama/DeepSeek-like geometry: 4 KiB-aligned segments of >= 128 KiB are never staged."""
    pool = make_pool(kind, layout, pages=24, page_size=16, layer_num=8, head_num=4,
                     head_dim=128 if kind == "mha" else 576)
    b = attach(storage_config(gds_dir, is_mla_model=kind == "mla"), pool)
    try:
        ks = keys(8)
        assert b.batch_set_v1(ks, indices(range(8), 16)) == [True] * 8
        poison(pool, range(8, 16))
        assert b.batch_get_v1(ks, indices(range(8, 16), 16)) == [True] * 8
        assert same_pages(pool, list(range(8)), pool, list(range(8, 16)))
        st = b.stats()["kv"]
        assert st["pool_path"] == "zero-copy" and st["staged_pages"] == 0 and st["direct_io"]
    finally:
        b.close()


def test_a_pool_whose_meta_disagrees_with_its_flat_page_gets_the_copy_path(gds_dir, caplog):
    import sglang_pools

    class Swapped(sglang_pools.MHAHostPoolMimic):
        """Lists V before K: zero-copy would store other bytes than get_data_page."""

        def get_page_buffer_meta(self, indices):
            p, s = super().get_page_buffer_meta(indices)
            return [x for i in range(0, len(p), 2) for x in (p[i + 1], p[i])], s

        def get_data_page(self, index, flat=True):
            return super().get_data_page(index, flat)

        def get_dummy_flat_data_page(self):
            return super().get_dummy_flat_data_page()

        def set_from_flat_data_page(self, index, data_page):
            return super().set_from_flat_data_page(index, data_page)

    pool = Swapped(layout="page_first", layer_num=3, head_num=2, head_dim=64, page_size=4, dtype=torch.bfloat16,
                   num_pages=32)
    sglang_pools.fill_random(pool, seed=9)
    b = attach(storage_config(gds_dir), pool)
    try:
        assert b.stats()["kv"]["pool_path"] == "copy" and "disagree" in caplog.text
        ks = keys(4)
        assert b.batch_set_v1(ks, indices(range(4))) == [True] * 4
        poison(pool, range(8, 12))
        assert b.batch_get_v1(ks, indices(range(8, 12))) == [True] * 4
        assert same_pages(pool, list(range(4)), pool, list(range(8, 12)))
    finally:
        b.close()


class _NoFlatPool:
    layout, page_size = "page_first", 4
    kv_buffer = torch.zeros(16)


class _LogicalAnchor:
    layout, page_size, kv_buffer = "page_first", 4, None

    def get_data_page(self, index, flat=True):
        return torch.zeros(4)

    def get_dummy_flat_data_page(self):
        return torch.zeros(4)

    def set_from_flat_data_page(self, index, data_page):
        pass


@pytest.mark.parametrize("pool,match", [(_NoFlatPool(), "no get_data_page"), (_LogicalAnchor(), "no materialized")])
def test_pools_we_cannot_serve_are_refused_at_attach(gds_dir, pool, match):
    b = HiCacheGDS(storage_config(gds_dir), {})
    try:
        with pytest.raises(ConfigError, match=match):
            b.register_mem_pool_host(pool)
        with pytest.raises(ConfigError, match="no KV host pool"):
            b.on_host_pools_registered()
    finally:
        b.close()


def test_default_capacity_is_split_between_writer_ranks_and_kept_on_restart(gds_dir):
    from hicache_gds.slabs.capacity import default_budget
    # max_fill 1: the split is tested here, not the fill ceiling (a shared disk may be above 90 % used)
    extra = {"gds_path": gds_dir, "preallocate": False, "capacity": 0, "max_fill": 1.0}
    want = default_budget([gds_dir], 0.5, 1.0).total / 4
    pool = make_pool("mha", "page_first")
    b = attach(storage_config(gds_dir, extra=dict(extra), tp_size=4, tp_rank=1), pool)
    kv_bytes = b.stats()["kv"]["slots"] * b.stats()["kv"]["slot_bytes"]
    b.close()
    assert abs(kv_bytes - want) < want * 0.02
    # a second rank, opened after the first: the same share (the first's slab counts as held, not gone)
    other = attach(storage_config(gds_dir, extra=dict(extra), tp_size=4, tp_rank=2), pool)
    try:
        assert abs(other.stats()["kv"]["slots"] * other.stats()["kv"]["slot_bytes"] - kv_bytes) < want * 0.02
    finally:
        other.close()
    again = attach(storage_config(gds_dir, extra=dict(extra, capacity_fraction=0.1), tp_size=4, tp_rank=1), pool)
    try:
        assert again.stats()["kv"]["slots"] * again.stats()["kv"]["slot_bytes"] == kv_bytes
    finally:
        again.close()


def test_writer_ranks_get_equal_preallocated_shares_whichever_opens_first(tmp_path):
    # On a 64 MiB tmpfs, 4 TP ranks with the default capacity: each preallocates 1/4 of half the
    # mount, the same size in the order they open (earlier ranks' slabs count as held by hicache-gds).
    from hicache_gds.testing.faults import small_tmpfs
    with small_tmpfs(str(tmp_path / "mnt"), "64m") as mnt:
        if mnt is None:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        extra = {"gds_path": mnt, "engine": "bounce", "direct_io": False, "capacity": 0}
        pool = make_pool("mha", "page_first")
        opened = []
        try:
            for rank in (2, 0, 3, 1):
                opened.append(attach(storage_config(mnt, extra=dict(extra), tp_size=4, tp_rank=rank), pool))
            sizes = [b.stats()["kv"]["slots"] * b.stats()["kv"]["slot_bytes"] for b in opened]
            slot = opened[0].stats()["kv"]["slot_bytes"]
            assert max(sizes) - min(sizes) <= slot and abs(sizes[0] - (8 << 20)) <= 2 * slot, sizes
            ks = keys(4)
            assert opened[3].batch_set_v1(ks, indices(range(4))) == [True] * 4
            poison(pool, range(8, 12))
            assert opened[3].batch_get_v1(ks, indices(range(8, 12))) == [True] * 4
            assert same_pages(pool, list(range(4)), pool, list(range(8, 12)))
        finally:
            for b in opened:
                b.close()


def test_models_served_one_after_another_each_get_the_default_share(tmp_path, caplog):
    # Three models, one after another, on a 64 MiB tmpfs already 68 % full, no capacity configured:
    # each server's default share counts the idle namespaces of the ones before as room, and its
    # open removes them (least recently used first); every model opens, the mount stays <= 90 %.
    import logging

    from hicache_gds.slabs.capacity import dir_space
    from hicache_gds.testing.faults import small_tmpfs
    caplog.set_level(logging.INFO, logger="hicache_gds.capacity")
    with small_tmpfs(str(tmp_path / "mnt"), "64m") as mnt:
        if mnt is None:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        s = dir_space(mnt)
        with open(os.path.join(mnt, "other-data"), "wb") as f:
            f.write(os.urandom(int(0.68 * s.total)))
        extra = {"gds_path": mnt, "engine": "bounce", "direct_io": False, "capacity": 0}
        pool = make_pool("mha", "page_first")
        sizes = []
        for model in ("org/model-a", "org/model-b", "org/model-c"):
            b = attach(storage_config(mnt, extra=dict(extra), model_name=model), pool)
            try:
                st = b.stats()["kv"]
                sizes.append(st["slots"] * st["slot_bytes"])
                ks = keys(4)
                assert b.batch_set_v1(ks, indices(range(4))) == [True] * 4
                poison(pool, range(8, 12))
                assert b.batch_get_v1(ks, indices(range(8, 12))) == [True] * 4
                assert same_pages(pool, list(range(4)), pool, list(range(8, 12)))
                assert dir_space(mnt).fill <= 0.9 + 0.01  # slab files within max_fill (+ small index files)
            finally:
                b.close()
        assert len(set(sizes)) == 1 and sizes[0] > 8 << 20, sizes
        assert sum("removed idle namespace" in r.getMessage() for r in caplog.records) == 2


def test_a_new_host_pool_rebinds_the_same_namespace(gds_dir):
    first, second = make_pool("mla", "page_first", seed=1), make_pool("mla", "page_first", seed=None)
    b = attach(storage_config(gds_dir, is_mla_model=True), first)
    try:
        ks = keys(4)
        assert b.batch_set_v1(ks, indices(range(4))) == [True] * 4
        b.register_mem_pool_host(second)
        assert b.batch_get_v1(ks, indices(range(4))) == [True] * 4
        assert same_pages(first, list(range(4)), second, list(range(4)))
    finally:
        b.close()


@pytest.mark.slow
def test_mla_eight_ranks_one_writer_seven_readers_at_once(gds_dir):
    """TP=8 on an MLA model (DeepSeek-V3 at TP=8): rank 0 writes, ranks 1-7 read the same pages in
    their own threads while the writer keeps adding new ones, then the writer restarts. Every get
    returns exactly the writer's bytes or a miss (its destination poisoned first, so a partial copy
    shows); readers' sets are no-ops that report success and write nothing."""
    tp, batch, first, later = 8, 4, 32, 8
    ks = keys(first + later, "mla8")
    wpool = make_pool("mla", "page_first", seed=int.from_bytes(os.urandom(4), "little"))
    src = {k: page_bytes(wpool, i) for i, k in enumerate(ks)}  # key i is the writer's page i
    writer = attach(storage_config(gds_dir, is_mla_model=True, tp_rank=0, tp_size=tp), wpool)
    rpools = [make_pool("mla", "page_first", seed=None) for _ in range(1, tp)]  # a host pool per rank
    readers = [attach(storage_config(gds_dir, is_mla_model=True, tp_rank=r, tp_size=tp), pool)
               for r, pool in zip(range(1, tp), rpools)]
    done = threading.Event()
    wrong: list[str] = []
    hits = [0] * len(readers)

    def write(lo: int, hi: int) -> None:
        for s in range(lo, hi, batch):
            assert writer.batch_set_v1(ks[s:s + batch], indices(range(s, s + batch))) == [True] * batch

    def read(n: int) -> None:
        reader, pool = readers[n], rpools[n]
        dst = list(range(first))
        while True:
            last = done.is_set()  # one more full pass after the writer's last batch
            poison(pool, dst, value=0x5A + n)
            got = reader.batch_get_v1(ks[:first], indices(dst))
            for k, d, ok in zip(ks, dst, got):
                if ok:
                    hits[n] += 1
                    if page_bytes(pool, d) != src[k]:
                        wrong.append(f"rank {n + 1}: {k} in page {d}")
            assert reader.batch_set_v1(ks[:batch], indices(dst[:batch])) == [True] * batch  # the writer's job
            if last:
                assert got == [True] * first, f"rank {n + 1} missed pages the writer had finished"
                return

    errors: list[BaseException] = []

    def guarded(f, *args) -> None:
        try:
            f(*args)
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the test's thread
            errors.append(exc)
        finally:
            if f is write:
                done.set()  # the readers' next pass is their last (also when the writer failed)

    try:
        threads = [threading.Thread(target=guarded, args=(read, n)) for n in range(len(readers))]
        threads.append(threading.Thread(target=guarded, args=(write, 0, first)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[0]
        assert not wrong, wrong[:5]
        assert all(hits), hits
        writer.close()  # a restarted writer keeps serving the readers, and adds to what they find
        writer = attach(storage_config(gds_dir, is_mla_model=True, tp_rank=0, tp_size=tp), wpool)
        write(first, first + later)
        for n, (reader, pool) in enumerate(zip(readers, rpools)):
            assert reader.batch_exists(ks) == first + later
            dst = list(range(first + later))
            poison(pool, dst, value=0xC3)
            assert reader.batch_get_v1(ks, indices(dst)) == [True] * (first + later)
            assert all(page_bytes(pool, d) == src[k] for k, d in zip(ks, dst)), f"rank {n + 1}"
        # the readers' sets wrote nothing: keys only a reader was given stay unknown to the writer
        only_read = keys(batch, "mla8-reader")
        assert all(r.batch_set_v1(only_read, indices(range(batch))) == [True] * batch for r in readers)
        assert writer.batch_exists(only_read) == 0
    finally:
        writer.close()
        for r in readers:
            r.close()


def test_mla_readers_seed_their_read_rate_from_the_writers_persisted_estimates(gds_dir):
    """A rank-replicated MLA namespace is the same on every TP rank: its readers start from the
    read rate its writer persisted, as the writer does (a fresh multi-rank server's ranks start
    alike), and write no estimates of their own."""
    from hicache_gds import PrefillModel
    from hicache_gds.rates import estimates_state
    from hicache_gds_sglang import backend as backend_mod
    wpool, rpool = make_pool("mla", "page_first", seed=7), make_pool("mla", "page_first", seed=None)
    writer = attach(storage_config(gds_dir, is_mla_model=True, tp_rank=0, tp_size=2), wpool)
    try:
        writer.read_rate.observe(1 << 30, 0.25)  # 4.3 GB/s measured
        assert writer.save_cost_state(estimates_state(writer.read_rate, PrefillModel(), writer.kv_bytes_per_token()))
        backend_mod._RATES.clear()  # the reader is another process
        reader = attach(storage_config(gds_dir, is_mla_model=True, tp_rank=1, tp_size=2), rpool)
        try:
            assert reader.read_rate.source.startswith("persisted")
            assert reader.read_rate.rate == pytest.approx((1 << 30) / 0.25)
            before = os.path.getmtime(reader._cost_path)
            assert reader.save_cost_state({"version": 0}) is False and os.path.getmtime(reader._cost_path) == before
        finally:
            reader.close()
    finally:
        writer.close()
        backend_mod._RATES.clear()
