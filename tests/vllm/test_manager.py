"""The scheduler-side state machine: MISS / HIT_PENDING / HIT / RETRY, pins, LRU eviction, failures, reset."""

from __future__ import annotations

import hashlib
import threading

import pytest
from test_spec import BASE_EXTRA, make_config
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from hicache_gds_vllm import HiCacheGDSOffloadingSpec, HiCacheStoreSpec
from hicache_gds_vllm import manager as manager_mod
from hicache_gds_vllm.manager import HiCacheGDSManager
from hicache_gds_vllm.sidecar import FailureLog
from hicache_gds_vllm.spec import store_key

CTX = ReqContext(req_id="r0")
CHUNK = 32 * 64 * 1024 * 4  # Llama-3-8B chunk of 4 blocks, one rank


def key(i: int, group: int = 0):
    return make_offload_key(hashlib.sha256(str(i).encode()).digest(), group)


def make_manager(gds_dir, chunks: int = 3, world_size: int = 1, events: bool = False, warm: bool = False):
    # read_probe 0: no read rate before the first load, so the cost model answers "load" and these
    # tests see the manager's own bookkeeping (test_costmodel.py covers the model's answers).
    extra = {**BASE_EXTRA, "gds_path": gds_dir, "capacity": chunks * CHUNK, "read_probe": 0}
    spec = HiCacheGDSOffloadingSpec(make_config(extra, world_size=world_size, events=events))
    assert spec.capacity_chunks == chunks
    return HiCacheGDSManager(spec, warm_start=warm)


def store(m, keys, ok=True):
    out = m.prepare_store(keys, CTX)
    m.complete_store(out.keys_to_store, CTX, success=ok)
    return out


def test_pending_then_ready(gds_dir):
    m = make_manager(gds_dir)
    assert m.lookup(key(1), CTX) is LookupResult.MISS
    out = m.prepare_store([key(1), key(2)], CTX)
    assert out.keys_to_store == [key(1), key(2)] and out.evicted_keys == []
    assert isinstance(out.store_spec, HiCacheStoreSpec)
    assert out.store_spec.keys == [store_key(key(1)), store_key(key(2))]
    assert not out.store_spec.clear  # the stores are shared with other engines: a new manager clears nothing
    assert m.lookup(key(1), CTX) is LookupResult.HIT_PENDING
    # Offered again while pending or stored: nothing new to write.
    assert m.prepare_store([key(1)], CTX).keys_to_store == []
    m.complete_store([key(1), key(2)], CTX)
    assert m.lookup(key(1), CTX) is LookupResult.HIT and m.lookup(key(2), CTX) is LookupResult.HIT
    assert m.prepare_store([key(2), key(3)], CTX).keys_to_store == [key(3)]
    assert not m.prepare_store([key(4)], CTX).store_spec.clear


def test_lru_eviction_skips_pinned_and_offered_keys(gds_dir):
    m = make_manager(gds_dir, chunks=3)
    store(m, [key(1), key(2), key(3)])
    spec = m.prepare_load([key(1)], CTX)  # pinned until complete_load
    assert spec.keys == [store_key(key(1))]
    m.touch([key(2)], CTX)  # LRU order now 3, 2 (1 pinned)
    out = m.prepare_store([key(4)], CTX)
    assert out.keys_to_store == [key(4)] and out.evicted_keys == [key(3)]
    # Nothing is deleted: the stores are shared, and evict by their own LRU (key 3 may be another engine's hit).
    assert out.store_spec.drops == []
    assert m.lookup(key(3), CTX) is LookupResult.MISS
    m.complete_store([key(4)], CTX)
    out = m.prepare_store([key(5)], CTX)
    assert out.evicted_keys == [key(2)] and out.store_spec.drops == []
    m.complete_store([key(5)], CTX)
    # Everything left is pinned or pending: no room at all -> None (vLLM counts an allocation failure).
    m.prepare_load([key(4), key(5)], CTX)
    assert m.prepare_store([key(6)], CTX) is None
    m.complete_load([key(1), key(4), key(5)], CTX)
    assert m.prepare_store([key(6)], CTX).evicted_keys == [key(1)]


def test_groups_have_their_own_capacity(gds_dir):
    m = make_manager(gds_dir, chunks=2)
    store(m, [key(1, 0), key(2, 0)])
    out = m.prepare_store([key(1, 1), key(2, 1)], CTX)
    assert out.keys_to_store == [key(1, 1), key(2, 1)] and out.evicted_keys == []


def test_failed_store_on_any_rank_is_not_committed(gds_dir):
    m = make_manager(gds_dir, world_size=2)
    out = m.prepare_store([key(1), key(2)], CTX)
    # Rank 1 could not write key(2): it says so before it reports the job done.
    FailureLog(m.spec.sidecar.failure_log(m.spec.config.engine_id, 1)).append([store_key(key(2))])
    m.complete_store(out.keys_to_store, CTX)
    assert m.lookup(key(1), CTX) is LookupResult.HIT
    assert m.lookup(key(2), CTX) is LookupResult.MISS
    assert m.stats()["failed_chunks"] == 1
    # Rank 0's shard of key(2) stays until its store evicts it (a chunk loads only from every rank).
    assert m.prepare_store([key(3)], CTX).store_spec.drops == []
    store(m, [key(2)])  # and it can be stored again later
    assert m.lookup(key(2), CTX) is LookupResult.HIT


def test_success_false_drops_the_chunk(gds_dir):
    m = make_manager(gds_dir)
    store(m, [key(1)], ok=False)
    assert m.lookup(key(1), CTX) is LookupResult.MISS


def test_reset_cache(gds_dir):
    m = make_manager(gds_dir, events=True)
    store(m, [key(1)])
    pending = m.prepare_store([key(2)], CTX)
    list(m.take_events())
    m.reset_cache()
    assert m.lookup(key(1), CTX) is LookupResult.MISS and m.lookup(key(2), CTX) is LookupResult.MISS
    (ev,) = m.take_events()
    assert ev.removed and ev.keys == [key(1)]
    m.complete_store(pending.keys_to_store, CTX)  # a pre-reset job reporting late is ignored
    assert m.lookup(key(2), CTX) is LookupResult.MISS
    out = m.prepare_store([key(3)], CTX)
    assert out.store_spec.clear and out.store_spec.drops == []
    if hasattr(m, "on_reset_flushed"):  # 0.33's manager API (inherited default); 0.26 has none
        m.on_reset_flushed()


def test_events_are_emitted_for_stores_and_evictions(gds_dir):
    m = make_manager(gds_dir, chunks=1, events=True)
    store(m, [key(1)])
    store(m, [key(2)])
    evs = list(m.take_events())
    assert [(e.removed, e.keys) for e in evs] == [(False, [key(1)]), (True, [key(1)]), (False, [key(2)])]
    assert list(m.take_events()) == []


def test_retry_until_warm_start_finishes(gds_dir, monkeypatch):
    gate = threading.Event()
    k = key(7)

    def fake_read(namespace_dir):
        gate.wait(10)
        return [store_key(k)]

    monkeypatch.setattr(manager_mod, "read_store_keys", fake_read)
    m = make_manager(gds_dir, warm=False)
    m.spec.sidecar.write_stores(0, {0: "/nonexistent/ns"})
    m = HiCacheGDSManager(m.spec, warm_start=True)
    with m.lock:
        assert m.lookup(k, CTX) is LookupResult.RETRY
        assert m.has_pending_work()
    gate.set()
    m.shutdown()
    with m.lock:
        assert m.lookup(k, CTX) is LookupResult.HIT
        assert m.lookup(key(8), CTX) is LookupResult.MISS
        assert not m.has_pending_work()


def test_warm_start_needs_every_rank_and_leaves_the_rest(gds_dir, monkeypatch):
    held = {"/r0": [store_key(key(1)), store_key(key(2))], "/r1": [store_key(key(2)), store_key(key(3))]}
    monkeypatch.setattr(manager_mod, "read_store_keys", lambda d: held[d])
    m = make_manager(gds_dir, world_size=2)
    m.spec.sidecar.write_stores(0, {0: "/r0"})
    m.spec.sidecar.write_stores(1, {0: "/r1"})
    m = HiCacheGDSManager(m.spec, warm_start=True)
    m.shutdown()
    assert m.lookup(key(2), CTX) is LookupResult.HIT
    assert m.lookup(key(1), CTX) is LookupResult.MISS and m.lookup(key(3), CTX) is LookupResult.MISS
    spec = m.prepare_store([key(4)], CTX).store_spec
    assert spec.drops == [] and not spec.clear  # another engine may be storing them right now


@pytest.mark.parametrize("chunks", [1, 4])
def test_capacity_is_never_exceeded(gds_dir, chunks):
    m = make_manager(gds_dir, chunks=chunks)
    for i in range(20):
        out = m.prepare_store([key(i), key(i + 100)], CTX)
        if out is not None:
            m.complete_store(out.keys_to_store, CTX)
        st = m.stats()
        assert st["ready"] + st["pending"] <= chunks
