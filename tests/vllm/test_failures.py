"""A load that fails never fails the request or the engine, on both vLLM releases.

Under `HiCacheGDSConnector` vLLM's scheduler recomputes what could not be loaded: the request
finishes with the KV a recompute gives (the stand-in forward's bytes, `Engine.check_kv`), the
unreadable chunks are dropped from the store and forgotten by the manager, and the engine keeps
serving. Faults are injected below the store, where they happen: EIO and hangs in the transfer
engine (`FaultyEngine` through the engine registry), flipped bytes in the slab file (a checksum
mismatch), and a page removed between the lookup and the read.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from vllm_harness import LAYOUTS, Engine

from hicache_gds.engines.base import Op
from hicache_gds.engines.faulty import Faults
from hicache_gds.testing.faults import set_faults
from hicache_gds_vllm.spec import store_key

PROMPT = list(range(1, 131))  # 8 full blocks + 2 tokens = 4 chunks of 2 blocks


@pytest.fixture
def root(tmp_path):
    return str(tmp_path)


@pytest.fixture(autouse=True)
def healed():
    set_faults(None)
    yield
    set_faults(None)


def stored_then_revisit(root, gds_dir, fault, *, layout="per-layer", world_size=1, extra=None):
    """Store PROMPT, drop the GPU prefix cache, apply `fault(engine)`, revisit PROMPT; return the engine."""
    e = Engine(root, gds_dir, connector="hicache", layout=layout, world_size=world_size, seed=5,
               extra={"engine": "faulty-bounce", "io_timeout": 1.0, **(extra or {})})
    e.add("A", PROMPT)
    e.run()
    assert e.manager.stats()["ready"] == 4
    e.check_kv("A", PROMPT)
    assert e.scheduler.reset_prefix_cache()
    e.poison()
    fault(e)
    e.add("B", PROMPT + [900, 901])
    e.run()  # no exception: vLLM asserts every transfer's success, and none is reported failed
    return e


def assert_recomputed(e: Engine, nchunks: int = 4) -> None:
    assert e.load_jobs == 1
    assert e.invalid_blocks, "the failed blocks were not reported to vLLM"
    e.check_kv("B", PROMPT)  # what a recompute gives, not the poison and not a torn page
    st = e.manager.stats()
    assert st["failed_loads"] == nchunks and st["pinned"] == 0
    w = e.worker(0)
    assert w.stats["load_chunks_failed"] == nchunks


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eio_on_read_is_recomputed(root, gds_dir, layout):
    e = stored_then_revisit(root, gds_dir, lambda e: set_faults(Faults(eio=1.0, only=Op.READ)), layout=layout)
    try:
        assert_recomputed(e)
        set_faults(None)
        # Service resumes: the unreadable chunks were dropped; they are stored again from the
        # recompute (0.33 offloads recomputed chunks at once) or from the next visit (0.26 counts
        # them as stored), and a later visit loads them, byte-exact.
        for i, req in enumerate(("C", "D")):
            assert e.scheduler.reset_prefix_cache()
            e.poison()
            e.add(req, PROMPT + [7 + i])
            e.run()
            e.check_kv(req, PROMPT)
        assert e.load_jobs >= 2 and e.manager.stats()["ready"] == 4
        assert e.worker(0).stats["load_jobs_failed"] == 1
    finally:
        e.shutdown()


def test_hang_on_read_times_out_and_is_recomputed(root, gds_dir):
    e = stored_then_revisit(root, gds_dir, lambda e: set_faults(Faults(hang=1.0, only=Op.READ)))
    try:
        assert_recomputed(e)
        assert e.worker(0).stores[0].stats()["timeouts"] >= 1
    finally:
        set_faults(None)
        e.shutdown()


def _flip_pages(e: Engine, rank: int = 0) -> int:
    """Flip bytes inside every stored page of rank `rank`'s store, on disk."""
    st = e.worker(rank).stores[0]
    rng = random.Random(1)
    n = 0
    for k in st.index.keys():
        slot = st.index.peek([k])[k].slot
        fi, off = st.slabs.place(np.array([slot]))
        fd = os.open(st.slabs.paths[int(fi[0])], os.O_RDWR)
        try:
            at = int(off[0]) + rng.randrange(st.page_bytes)
            b = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([b[0] ^ 0xFF]), at)
            os.fsync(fd)
        finally:
            os.close(fd)
        n += 1
    return n


@pytest.mark.parametrize("world_size", [1, 2])
def test_checksum_mismatch_is_recomputed(root, gds_dir, world_size):
    flipped = []
    e = stored_then_revisit(root, gds_dir, lambda e: flipped.append(_flip_pages(e, rank=world_size - 1)),
                            world_size=world_size, extra={"verify": True})
    try:
        assert flipped == [4]
        assert e.load_jobs == 1 and e.invalid_blocks
        e.check_kv("B", PROMPT)
        bad = e.worker(world_size - 1).stores[0].stats()
        assert bad["checksum_mismatches"] == 4  # found, and dropped by the store itself
        assert e.manager.stats()["failed_loads"] == 4 and e.manager.stats()["pinned"] == 0
    finally:
        e.shutdown()


def test_page_gone_after_lookup_is_recomputed(root, gds_dir):
    """Another engine (or `hicache-gds clear`) removes a chunk after vLLM was promised it: the read
    finds nothing, and vLLM recomputes."""
    def remove_at_prepare_load(e):
        real = e.manager.prepare_load

        def prepare_load(keys, ctx):
            out = real(keys, ctx)
            e.worker(0).stores[0].delete([store_key(keys[-1])])
            return out
        e.manager.prepare_load = prepare_load

    e = stored_then_revisit(root, gds_dir, remove_at_prepare_load)
    try:
        assert e.load_jobs == 1
        assert e.invalid_blocks
        e.check_kv("B", PROMPT)
        assert e.manager.stats()["failed_loads"] == 1
    finally:
        e.shutdown()


def test_partial_failure_reports_only_the_failed_chunks_blocks(root, gds_dir):
    """One chunk of four unreadable: only its GPU blocks are reported (vLLM recomputes from the first
    of them on), and the other chunks stay stored."""
    def flip_one(e):
        st = e.worker(0).stores[0]
        k = st.index.keys()[-1]
        slot = st.index.peek([k])[k].slot
        fi, off = st.slabs.place(np.array([slot]))
        fd = os.open(st.slabs.paths[int(fi[0])], os.O_RDWR)
        try:
            os.pwrite(fd, b"\x00" * 64, int(off[0]) + 4096)
            os.fsync(fd)
        finally:
            os.close(fd)

    e = stored_then_revisit(root, gds_dir, flip_one, extra={"verify": True})
    try:
        assert e.load_jobs == 1
        assert len(e.invalid_blocks) == 2  # one chunk = 2 blocks
        e.check_kv("B", PROMPT)
        assert e.manager.stats()["failed_loads"] == 1 and e.manager.stats()["ready"] >= 3
    finally:
        e.shutdown()


def test_plain_offloading_connector_reports_the_failure(root, gds_dir):
    """Without HiCacheGDSConnector a failed load cannot be recomputed (vLLM's OffloadingConnector
    asserts success): the worker says so rather than hand vLLM garbage."""
    e = Engine(root, gds_dir, seed=6, extra={"engine": "faulty-bounce", "io_timeout": 1.0})
    try:
        e.add("A", PROMPT)
        e.run()
        assert e.scheduler.reset_prefix_cache()
        set_faults(Faults(eio=1.0, only=Op.READ))
        e.add("B", PROMPT + [3])
        with pytest.raises(AssertionError):
            e.run()
        assert e.worker(0).stats["load_jobs_failed"] == 1
    finally:
        set_faults(None)
        e.shutdown()
