"""vLLM's real Scheduler + OffloadingConnector with our spec: store, reset, load back byte-exact."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm_harness import LAYOUTS, Engine

PROMPT = list(range(1, 131))  # 8 full blocks + 2 tokens = 4 chunks of 2 blocks


@pytest.fixture
def root(tmp_path):
    return str(tmp_path)


def engine(root, gds_dir, **kw) -> Engine:
    return Engine(root, gds_dir, **kw)


def stored_bytes(e: Engine, req: str, nblocks: int = 8) -> dict:
    blocks = e.block_ids[req][:nblocks]
    return {(r, i): e.block_bytes(r, b) for r in range(len(e.workers)) for i, b in enumerate(blocks)}


def assert_loaded(e: Engine, req: str, want: dict, first: int = 0, nblocks: int = 8) -> None:
    for (r, i), data in want.items():
        if first <= i < nblocks:
            got = e.block_bytes(r, e.block_ids[req][i])
            assert torch.equal(got, data), f"rank {r} block {i} (id {e.block_ids[req][i]}) differs"


@pytest.mark.parametrize("connector", ["offloading", "hicache"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2])
def test_store_reset_load_byte_exact(root, gds_dir, world_size, layout, connector):
    e = engine(root, gds_dir, world_size=world_size, seed=world_size, layout=layout, connector=connector)
    e.add("A", PROMPT)
    e.run()
    assert e.manager.stats()["ready"] == 4  # every rank acknowledged every store job
    want = stored_bytes(e, "A")
    assert e.scheduler.reset_prefix_cache()
    e.poison()
    e.add("B", PROMPT + [999, 998])
    e.run()
    assert e.load_jobs == 1
    assert e.scheduler.connector.connector_scheduler.manager.stats()["pinned"] == 0
    assert_loaded(e, "B", want)
    e.check_kv("B", PROMPT)
    assert not e.invalid_blocks
    e.shutdown()


def test_partial_first_chunk(root, gds_dir):
    e = engine(root, gds_dir, world_size=2, seed=3)
    e.add("A", PROMPT)
    e.run()
    want = stored_bytes(e, "A")
    assert e.scheduler.reset_prefix_cache()
    e.poison(0x3C)
    # C leaves block 0 of the prompt in the GPU prefix cache: B then loads from sub-block 1 of chunk 0.
    e.add("C", PROMPT[:16] + [500] * 4, max_tokens=1)
    e.run()
    block0 = {r: e.block_bytes(r, e.block_ids["C"][0]) for r in range(2)}
    e.add("B", PROMPT + [7])
    e.run()
    assert e.load_jobs == 1
    assert e.block_ids["B"][0] == e.block_ids["C"][0]  # the GPU prefix hit
    assert_loaded(e, "B", want, first=1)
    for r in range(2):  # the skipped sub-block went to scratch, not over the GPU-cached block
        assert torch.equal(e.block_bytes(r, e.block_ids["B"][0]), block0[r])
    e.shutdown()


def test_store_failure_on_one_rank_is_a_miss_not_a_crash(root, gds_dir):
    e = engine(root, gds_dir, world_size=2)
    store = e.worker(1).stores[0]
    real_put = store.put
    store.put = lambda keys, pages: [False] * len(keys)
    e.add("A", PROMPT)
    e.run()  # vLLM asserts every job's success: this must not raise
    st = e.manager.stats()
    assert st["ready"] == 0 and st["failed_chunks"] == 4
    store.put = real_put
    assert e.scheduler.reset_prefix_cache()
    e.add("B", PROMPT + [5])
    e.run()
    assert e.load_jobs == 0  # nothing was committed, so nothing is loaded
    assert e.manager.stats()["ready"] == 4  # B stored them again (rank 0 still held its shards: kept)
    e.shutdown()


def test_reset_connector_cache_then_workers_clear(root, gds_dir):
    e = engine(root, gds_dir)
    e.add("A", PROMPT)
    e.run()
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    assert e.manager.stats()["ready"] == 0
    ctx = ReqContext(req_id="x")
    assert all(e.manager.lookup(k, ctx) is LookupResult.MISS for k in list(e.manager._entries))
    e.add("B", PROMPT + [3])
    e.run()
    assert e.load_jobs == 0
    assert e.worker(0).stores[0].stats()["pages"] == 4  # cleared, then B's 4 chunks written
    e.shutdown()


def test_warm_restart_loads_from_disk(root, gds_dir):
    e = engine(root, gds_dir, seed=11)
    e.add("A", PROMPT)
    e.run()
    want = stored_bytes(e, "A")
    e.shutdown()
    # A new engine (new processes, new engine id) over the same GDS_PATH finds the chunks.
    e2 = engine(root, gds_dir, seed=12)
    assert e2.manager.stats()["ready"] == 4
    e2.poison()
    e2.add("B", PROMPT + [1])
    e2.run()
    assert e2.load_jobs == 1
    for (r, i), data in want.items():
        assert torch.equal(e2.block_bytes(r, e2.block_ids["B"][i]), data)
    e2.shutdown()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2])
def test_two_engines_share_chunks_and_a_load_is_leased(root, gds_dir, world_size, layout):
    """Two engines of the same model and layout (two engine ids) open the same namespaces: chunks
    one stores are hits for the other (a miss in its own map checked against the shared indexes),
    loaded byte-exact, and leased on every rank while the load is in flight."""
    a = engine(root, gds_dir, world_size=world_size, seed=21, layout=layout)
    b = engine(root, gds_dir, world_size=world_size, seed=22, layout=layout)
    try:
        assert a.worker(0).stores[0].namespace == b.worker(0).stores[0].namespace
        a.add("A", PROMPT)
        a.run()
        want = stored_bytes(a, "A")
        assert a.manager.stats()["ready"] == 4
        b.poison()
        leases = []
        real = b.manager.shared.lease

        def spy(sks, pos):
            out = real(sks, pos)
            leases.append([len(held) for held in out[0]])
            st = a.worker(0).stores[0].stats()
            leases.append(st["leased_slots_all"])
            return out

        b.manager.shared.lease = spy
        b.add("B", PROMPT + [4, 5])
        b.run()
        assert b.load_jobs == 1 and b.manager.stats()["adopted"] == 4
        assert leases[0] == [world_size] * 4 and leases[1] == 4  # every chunk leased on every rank
        assert_loaded(b, "B", want)
        assert a.worker(0).stores[0].stats()["leased_slots_all"] == 0  # returned at complete_load
        assert b.worker(0).stores[0].stats()["pages_written"] == 0  # nothing stored twice
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunks_of_more_regions_than_an_engine_request_takes_store_and_load(root, gds_dir, layout):
    """An engine that takes 3 descriptors per request (GDS in cuFile compat mode takes 64; a chunk of
    the 8B shape's per-layer views is 32 x 4): every chunk is stored and loaded, in several requests,
    byte-exact -- the first GPU run refused every one of them. 128 KiB pages go to the engine
    unstaged, as VRAM does."""
    from hicache_gds.engines.faulty import Faults
    from hicache_gds.testing.faults import set_faults
    set_faults(Faults(max_descs=3))
    try:
        e = engine(root, gds_dir, layout=layout, connector="hicache", seed=21, layers=4, heads=16, head_dim=128,
                   extra={"engine": "faulty-nixl-posix", "verify": True})
        try:
            st = e.worker(0).stores[0]
            assert st.engine.capabilities.max_descs == 3 and e.worker(0).geos[0].segments == (8 if layout == "per-layer"
                                                                                            else 2)
            e.add("A", PROMPT)
            e.run()
            assert e.manager.stats()["ready"] == 4 and e.worker(0).stats["store_chunks_failed"] == 0
            want = stored_bytes(e, "A")
            assert e.scheduler.reset_prefix_cache()
            e.poison()
            e.add("B", PROMPT + [999])
            e.run()
            assert e.load_jobs == 1 and not e.invalid_blocks
            assert_loaded(e, "B", want)
            e.check_kv("B", PROMPT)
            assert st.stats()["staged_pages"] == 0 and st.stats()["checksum_mismatches"] == 0
        finally:
            e.shutdown()
    finally:
        set_faults(None)
