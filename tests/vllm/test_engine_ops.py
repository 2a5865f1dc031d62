"""What a running engine exposes: start and shutdown, a second engine and a restart on one GDS_PATH,
the KV layout in the namespace, and the ordering of IO against the compute that writes the blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm_harness import CROSS_LAYER, LAYOUTS, Engine

from hicache_gds.engines.base import Op
from hicache_gds.engines.faulty import Faults
from hicache_gds.testing.faults import set_faults
from hicache_gds_vllm import HiCacheStoreSpec, compat
from hicache_gds_vllm.spec import engine_identity, store_key

PROMPT = list(range(1, 131))  # 8 full blocks + 2 tokens = 4 chunks of 2 blocks
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def root(tmp_path):
    return str(tmp_path)


# -- start and shutdown -------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shutdown_deregisters_kv_memory_and_leaves_nothing_running(root, gds_dir, layout):
    """NIXL POSIX (a real NIXL agent on CPU): vLLM's KV memory is registered with every store's
    engine at start and deregistered at shutdown; the IO threads end; the engine's side files go."""
    e = Engine(root, gds_dir, world_size=2, layout=layout, connector="hicache", extra={"engine": "nixl-posix"})
    e.add("A", PROMPT)
    e.run()
    w = e.worker(1)
    engine = w.stores[0].engine
    assert engine.name == "nixl-posix" and engine._regs and engine._regions  # registered at start
    side = os.listdir(w.spec.sidecar.path)
    assert any(n.startswith("stores-") and e.vllm_config.kv_transfer_config.engine_id in n for n in side)
    t = time.monotonic()
    e.shutdown()
    assert time.monotonic() - t < 10
    for r in range(2):
        for st in e.worker(r).stores:
            assert st.engine._regs == {} and st.engine._regions == [], "KV memory still registered with NIXL"
        assert not any(th.is_alive() for th in e.worker(r)._threads)
    left = os.listdir(w.spec.sidecar.path)
    assert not any(e.vllm_config.kv_transfer_config.engine_id in n for n in left), left
    e.worker(0).shutdown()  # idempotent


def test_shutdown_with_hung_io_is_bounded(root, gds_dir):
    """A write that never completes: shutdown fails the queued jobs without IO, waits for the one in
    flight only until the store's timeout, and returns."""
    e = Engine(root, gds_dir, extra={"engine": "faulty-bounce", "io_timeout": 1.0})
    w = e.worker(0)
    set_faults(Faults(hang=1.0, only=Op.WRITE))
    try:
        keys = [[store_key(bytes([i]) * 32 + b"\0\0\0\0")] for i in range(4)]
        for j, k in enumerate(keys):
            w.submit_store(100 + j, GPULoadStoreSpec([2 * j, 2 * j + 1], [2], [0]), HiCacheStoreSpec(k))
        time.sleep(0.2)  # the first job is in its (hung) write
        t = time.monotonic()
        w.shutdown()
        took = time.monotonic() - t
    finally:
        set_faults(None)
    assert took < 2 * 1.0 + 5, took
    assert w.stats["cancelled"] >= 2  # queued jobs failed without IO
    done = {r.job_id: r.success for r in w.get_finished()}
    assert sorted(done) == [100, 101, 102, 103] and all(done.values())  # stores never fail vLLM's job
    assert not any(th.is_alive() for th in w._threads)
    e.shutdown()


# -- a second engine, a restart ------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_second_engine_same_gds_path_loads_the_first_engines_chunks(root, gds_dir, layout):
    a = Engine(root, gds_dir, connector="hicache", layout=layout, seed=31)
    b = Engine(root, gds_dir, connector="hicache", layout=layout, seed=31)
    try:
        a.add("A", PROMPT)
        a.run()
        b.poison()
        b.add("B", PROMPT + [1, 2])
        b.run()
        assert b.load_jobs == 1 and b.manager.stats()["adopted"] == 4
        b.check_kv("B", PROMPT)  # a's bytes, which are what b computes for these tokens
    finally:
        a.shutdown()
        b.shutdown()


_RESTART = r"""
import json, os, sys
sys.path.insert(0, {here!r})
import conftest  # vLLM's CPU platform (0.26)
from vllm_harness import Engine
e = Engine({root!r}, {gds!r}, connector={connector!r}, seed=41)
e.add("R", list(range(1, 131)) + [int(sys.argv[1])])
e.run()
print("RESULT", json.dumps({{"load_jobs": e.load_jobs, "ready": e.manager.stats()["ready"]}}))
e.check_kv("R", list(range(1, 131)))
e.shutdown()
"""


@pytest.mark.parametrize("connector", ["offloading", "hicache"])
def test_restart_in_a_new_process_hits(root, gds_dir, connector):
    """Two engine processes, one after the other, on one GDS_PATH: the second loads what the first
    stored. vLLM 0.26 seeds block hashes (our keys) randomly per process unless PYTHONHASHSEED is
    set: the adapter fixes the seed, or a restart would never hit."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    code = _RESTART.format(here=HERE, root=root, gds=gds_dir, connector=connector)
    out = []
    for arg in ("1", "2"):
        p = subprocess.run([sys.executable, "-c", code, arg], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        out.append(json.loads(p.stdout.split("RESULT", 1)[1].splitlines()[0]))
    assert out[0] == {"load_jobs": 0, "ready": 4}
    assert out[1]["load_jobs"] == 1 and out[1]["ready"] == 4


# -- the KV layout is part of the namespace ----------------------------------------------------------
def test_handoff_of_another_release_is_another_namespace(root, gds_dir, monkeypatch):
    """0.26 (cross-layer blocks) and 0.33 (per-layer views) order a chunk's bytes differently: an
    engine of one release never sees the other's chunks (another spec directory, other stores)."""
    from test_spec import BASE_EXTRA, make_config

    from hicache_gds_vllm import HiCacheGDSOffloadingSpec
    extra = {**BASE_EXTRA, "gds_path": gds_dir, "capacity": "1G"}
    this = HiCacheGDSOffloadingSpec(make_config(extra))
    other = "per-layer-canonical" if CROSS_LAYER else "cross-layer-or-per-layer-HND"
    monkeypatch.setattr(compat, "KV_HANDOFF", other)
    that = HiCacheGDSOffloadingSpec(make_config(extra))
    assert this.identity["kv_handoff"] != that.identity["kv_handoff"]
    assert this.spec_id != that.spec_id and this.sidecar.path != that.sidecar.path
    assert engine_identity(make_config(extra)) == that.identity


@pytest.mark.skipif(not CROSS_LAYER, reason="this vLLM hands KV over per layer only")
def test_cross_layer_and_per_layer_engines_never_share_pages(root, gds_dir):
    """vLLM 0.26 hands KV over as cross-layer blocks or as per-layer views, depending on the
    attention backend: two engines of one model, one of each, running at once on one GDS_PATH,
    open different namespaces and each loads only its own chunks, byte-exact."""
    a = Engine(root, gds_dir, layout="per-layer", connector="hicache", seed=51)
    b = Engine(root, gds_dir, layout="cross-layer", connector="hicache", seed=51)
    try:
        sa, sb = a.worker(0).stores[0], b.worker(0).stores[0]
        assert sa.namespace != sb.namespace
        assert a.worker(0).handed == ["per-layer"] and b.worker(0).handed == ["cross-layer"]
        assert sa.page_bytes == sb.page_bytes  # same size, different byte order: only the namespace tells
        a.add("A", PROMPT)
        a.run()
        b.poison()
        b.add("B", PROMPT + [3])
        b.run()
        assert b.load_jobs == 0 and b.manager.stats()["adopted"] == 0  # a's chunks are not b's
        b.check_kv("B", PROMPT)
        # each manager reads its own workers' namespaces, though both engines share a spec directory
        assert a.worker(0).spec.sidecar.path == b.worker(0).spec.sidecar.path
        for eng, name in ((a, "A2"), (b, "B2")):
            assert eng.scheduler.reset_prefix_cache()
            eng.poison()
            eng.add(name, PROMPT + [9])
            eng.run()
            assert eng.load_jobs == 1
            eng.check_kv(name, PROMPT)
    finally:
        a.shutdown()
        b.shutdown()


# -- IO against compute ------------------------------------------------------------------------------
class _Fence:
    """A stand-in for the CUDA event the worker records on vLLM's compute stream: complete once the
    test says the compute queued before it has run."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done.is_set()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_store_reads_blocks_only_after_the_compute_that_writes_them(root, gds_dir, layout):
    """vLLM submits a store while the forward that writes its blocks may still run on the GPU. The
    worker must read the blocks only once the fence recorded at submit has completed: what it
    stores is the forward's output, never what the blocks held before."""
    e = Engine(root, gds_dir, layout=layout, seed=61, extra={"io_timeout": 5.0})
    w = e.worker(0)
    fences: list[_Fence] = []
    w._fence = lambda: fences.append(_Fence()) or fences[-1]
    try:
        before = {b: e.block_bytes(0, b) for b in (4, 5)}
        key = store_key(b"\x07" * 32 + b"\0\0\0\0")
        w.submit_store(7, GPULoadStoreSpec([4, 5], [2], [0]), HiCacheStoreSpec([key]))
        time.sleep(0.3)
        assert fences[0].queries > 0 and not w.get_finished()  # waiting on the fence, not reading
        after = {b: torch.randint(0, 256, before[b].shape, dtype=torch.uint8) for b in (4, 5)}
        for b, data in after.items():  # the "forward" that was still running writes its blocks
            e.write_block(0, b, data)
        fences[0].done.set()
        w.drain()
        (res,) = w.get_finished()
        assert res.success and res.transfer_size > 0
        e.poison(0x11)
        w.submit_load(8, HiCacheLoadSpecFor([key]), GPULoadStoreSpec([10, 11], [2], [0]))
        fences[1].done.set()
        w.drain()
        assert all(r.success for r in w.get_finished())
        assert torch.equal(e.block_bytes(0, 10), after[4]) and torch.equal(e.block_bytes(0, 11), after[5])
    finally:
        e.shutdown()


def HiCacheLoadSpecFor(keys):
    from hicache_gds_vllm import HiCacheLoadSpec
    return HiCacheLoadSpec(keys)


def test_fence_that_never_completes_fails_the_job_in_bounded_time(root, gds_dir):
    """A GPU that never reaches the fence (a hung kernel): the job fails after io_timeout -- a store
    is not committed, a load is recomputed -- and wait() returns."""
    e = Engine(root, gds_dir, connector="hicache", extra={"io_timeout": 1.0})
    w = e.worker(0)
    w._fence = _Fence
    try:
        key = store_key(b"\x09" * 32 + b"\0\0\0\0")
        t = time.monotonic()
        w.submit_store(1, GPULoadStoreSpec([0, 1], [2], [0]), HiCacheStoreSpec([key]))
        w.submit_load(2, HiCacheLoadSpecFor([key]), GPULoadStoreSpec([2, 3], [2], [0]))
        w.wait({1, 2})
        assert time.monotonic() - t < 2 * 1.0 + 6
        res = {r.job_id: r.success for r in w.get_finished()}
        assert res == {1: True, 2: True}  # both "done" for vLLM ...
        assert w.take_load_errors() == {2, 3}  # ... the load's blocks handed back for recompute
        assert w.stats["fence_timeouts"] == 2
        assert not w.stores[0].exists([key])[0]  # the store never read the blocks, nothing committed
    finally:
        e.shutdown()
