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
import time

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


REFUSED = "an item of 128 descriptors exceeds the engine's 64 per request"
HOLD_S = 4.0  # the hold after a refused load; the test's requests before it ends take well under a second


def _refuse(store, what):
    """Every `what` ("get" or "put") of `store` raises, as an engine refusing the request does (the
    first GPU run: every load of per-layer chunks refused, again and again)."""
    def refuse(keys, pages):
        raise ValueError(REFUSED)
    real = getattr(store, what)
    setattr(store, what, refuse)
    return lambda: setattr(store, what, real)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_load_the_engine_refuses_costs_one_retry_then_recomputes(root, gds_dir, layout):
    """A load refused by the engine (not about the page: the same load would be refused again) is
    recomputed once, and then the worker's chunks are not offered until a load has succeeded
    again: no retry loop. The first GPU run retried one request 456 times."""
    e = Engine(root, gds_dir, connector="hicache", layout=layout, seed=8,
               extra={"engine": "bounce", "failed_load_backoff_s": HOLD_S})
    try:
        e.add("A", PROMPT)
        e.run()
        assert e.manager.stats()["ready"] == 4
        heal = _refuse(e.worker(0).stores[0], "get")
        assert e.scheduler.reset_prefix_cache()
        e.poison()
        t0 = time.monotonic()
        e.add("B", PROMPT + [900])
        e.run(max_steps=20)
        assert e.load_jobs == 1  # the refused load, then a recompute: one retry
        e.check_kv("B", PROMPT)  # what a recompute gives
        assert e.manager.stats()["held_misses"] >= 1
        assert e.worker(0).stores[0].exists([store_key(k) for k in list(e.manager._entries)[:1]]) == [True]
        # Still refused, and no load is tried while the worker is held: recomputed at once.
        assert e.scheduler.reset_prefix_cache()
        e.poison()
        e.add("C", PROMPT + [901])
        e.run(max_steps=20)
        assert e.load_jobs == 1
        e.check_kv("C", PROMPT)
        assert e.manager.stats()["held_ranks"] == 1
        # The engine works again; after the hold a load is tried, succeeds, and the hold is over.
        heal()
        time.sleep(max(0.0, HOLD_S - (time.monotonic() - t0)) + 0.2)
        for i, req in enumerate(("D", "E")):
            assert e.scheduler.reset_prefix_cache()
            e.poison()
            e.add(req, PROMPT + [902 + i])
            e.run(max_steps=20)
            assert e.load_jobs == 2 + i
            e.check_kv(req, PROMPT)
        assert e.manager.stats()["held_ranks"] == 0
    finally:
        e.shutdown()


@pytest.mark.parametrize("world_size", [1, 2])
def test_eio_on_every_read_costs_one_retry(root, gds_dir, world_size):
    """A load that fails on every read (about the pages): the chunks are dropped and forgotten, and
    a second revisit recomputes without trying again."""
    e = stored_then_revisit(root, gds_dir, lambda e: set_faults(Faults(eio=1.0, only=Op.READ)),
                            world_size=world_size)
    try:
        assert e.load_jobs == 1
        e.check_kv("B", PROMPT)
        assert e.scheduler.reset_prefix_cache()
        e.poison()
        e.add("C", PROMPT + [77])
        e.run(max_steps=20)
        assert e.load_jobs <= 2
        e.check_kv("C", PROMPT)
    finally:
        set_faults(None)
        e.shutdown()


@pytest.mark.parametrize("how", ["refused", "eio"])
def test_chunks_whose_store_failed_are_never_offered(root, gds_dir, how):
    """A store job that failed -- refused by the engine, or EIO on write -- leaves its chunks
    misses: lookup never offers a chunk that was not written."""
    e = Engine(root, gds_dir, connector="hicache", seed=9, extra={"engine": "faulty-bounce"})
    try:
        if how == "refused":
            heal = _refuse(e.worker(0).stores[0], "put")
        else:
            set_faults(Faults(eio=1.0, only=Op.WRITE))
            heal = lambda: set_faults(None)  # noqa: E731
        e.add("A", PROMPT)
        e.run()
        assert e.manager.stats()["ready"] == 0 and e.manager.stats()["failed_chunks"] == 4
        assert e.worker(0).stores[0].stats()["pages"] == 0
        heal()
        assert e.scheduler.reset_prefix_cache()
        e.poison()
        e.add("B", PROMPT + [5])
        e.run()
        assert e.load_jobs == 0  # nothing to load: recomputed (and stored now)
        e.check_kv("B", PROMPT)
        assert e.manager.stats()["ready"] == 4
    finally:
        e.shutdown()


@pytest.mark.parametrize("when", ["waiting", "after-refused-load", "mid-prefill"])
def test_a_request_aborted_before_its_kv_was_computed_never_stops_the_engine(root, gds_dir, when):
    """A client gives up on a request that has no KV yet (still waiting; rescheduled after a failed
    load) or only part of it (mid-prefill): it is offloaded no further than computed -- vLLM 0.26
    offloaded it up to all of its tokens and stopped the engine on an assertion (the first GPU run)
    -- and the engine serves the next requests, byte-exact."""
    from vllm.v1.request import RequestStatus
    e = Engine(root, gds_dir, connector="hicache", seed=10, num_blocks=256,
               extra={"engine": "bounce", "failed_load_backoff_s": 60})
    long = list(range(1, 3001))  # two prefill steps of at most 2048 tokens
    try:
        heal = lambda: None  # noqa: E731
        if when == "after-refused-load":
            e.add("A", PROMPT)
            e.run()
            heal = _refuse(e.worker(0).stores[0], "get")
            assert e.scheduler.reset_prefix_cache()
            e.add("B", PROMPT + [900], max_tokens=50)
            e.step()
            assert e.scheduler.requests["B"].num_computed_tokens == 0
        elif when == "mid-prefill":
            e.add("B", long, max_tokens=50)
            e.step()
            assert 0 < e.scheduler.requests["B"].num_computed_tokens < len(long)
        else:
            e.add("B", long, max_tokens=50)
        e.scheduler.finish_requests("B", RequestStatus.FINISHED_ABORTED)
        e.run()  # the step that offloads what B finished with
        computed = 2048 if when == "mid-prefill" else 0
        assert e.manager.stats()["ready"] <= (4 if when == "after-refused-load" else computed // 32)
        heal()
        assert e.scheduler.reset_prefix_cache()
        e.poison()
        e.add("C", long)
        e.run()
        e.check_kv("C", long)  # whatever was loaded is what compute gives: nothing uncomputed was stored
    finally:
        e.shutdown()
