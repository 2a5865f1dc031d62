"""The ``compute_or_load`` prefetch policy against the installed SGLang's own classes (0.5.17's
HiRadixCache / 0.5.23's UnifiedRadixCache, HiCacheController, PrefetchOperation, their attach
paths), and the backend's side of it (read rate, cancel, progress, persistence).

The caches and controllers are SGLang's classes built without their constructors (those need a
GPU's pools); each test sets the attributes the exercised methods read, and calls the plugin's
hooks exactly as SGLang's HookRegistry wrapper does: ``hook(original, self, *args)``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from hicache_gds import ConfigError
from hicache_gds.costmodel import STATE_FILE
from hicache_gds_sglang import HiCacheGDS, backlog, host, policy, room, view
from hicache_gds_sglang import policy_hooks as hooks
from hicache_gds_sglang import backend as backend_mod
from hicache_gds_sglang import prefill as prefill_mod
from hicache_gds_sglang.records import Decided, Protected
from hicache_gds_sglang.policy import POLICY, PolicyConfig
from sgl_helpers import indices, keys, make_pool, page_bytes, poison, storage_config

from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402

try:  # 0.5.17: dense models' HiCache is HiRadixCache
    from sglang.srt.managers.cache_controller import PrefetchOperation
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache as CACHE
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
    STOP, V23 = "can_terminate_prefetch", False
except ImportError:  # 0.5.23: every HiCache stack is a UnifiedRadixCache
    try:
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache as CACHE
        from sglang.srt.mem_cache.unified_radix_cache import _OngoingPrefetch
        STOP, V23 = "_can_terminate_prefetch", True
    except ImportError as exc:  # noqa: F841
        pytest.skip(f"this SGLang's radix cache does not import here ({exc}); scripts/install-sglang-test-deps.sh "
                    f"installs what it needs", allow_module_level=True)

PS = 64
BPT = 1024  # bytes of KV per token of the pools below (2 layers x 2 heads x 64 x bf16 x K,V)
A = 1 / 6000  # seeded prefill: 6k tokens/s, linear (the formula's b and c are tested in the core)


@pytest.fixture(autouse=True)
def _fresh_rates():
    backend_mod._RATES.clear()
    hooks.SUPPORTED.add(CACHE)
    view._logged.clear()
    yield
    backend_mod._RATES.clear()


def gbps_for(load_over_compute: float) -> float:
    """The read rate (GB/s) at which loading a hit takes `load_over_compute` x recomputing it."""
    return BPT / (A * load_over_compute) / 1e9


def open_backend(gds_dir: str, pages: int = 64, **extra) -> tuple[HiCacheGDS, object]:
    pool = make_pool("mha", "page_first", pages=pages, page_size=PS, layer_num=2, head_num=2, head_dim=64)
    b = HiCacheGDS(storage_config(gds_dir, extra={k: str(v) if isinstance(v, float) else v for k, v in extra.items()}),
                   pool)
    b.register_mem_host_pool_v2(pool, "kv")
    assert b.kv_bytes_per_token() == BPT
    return b, pool


def make_cache(b: HiCacheGDS, *, stop_policy: str = POLICY, host_tokens: int = 98304, queue_reqs=(), chunk=8192):
    """SGLang's cache and controller classes, constructor-less, with what the prefetch paths read."""
    ctl = object.__new__(HiCacheController)
    ctl.enable_storage, ctl.storage_backend, ctl.storage_backend_type = True, b, "gds"
    ctl.page_size, ctl.prefetch_queue, ctl.prefetch_tokens_occupied = PS, queue.Queue(), 0
    ctl.mem_pool_host = types.SimpleNamespace(size=host_tokens, logical_size=host_tokens)
    ctl.prefetch_capacity_limit, ctl.host_memory_mode = host_tokens // 2, "cache"
    cache = object.__new__(CACHE)
    if V23:
        cache.tree_core = types.SimpleNamespace(page_size=PS, enable_storage=True, is_eagle=False)
    else:
        cache.enable_storage, cache.is_eagle = True, False
    cache.page_size, cache.prefetch_threshold, cache.prefetch_stop_policy = PS, 256, stop_policy
    cache.cache_controller, cache.ongoing_prefetch = ctl, {}
    hooks._settle(cache)
    pol = cache._hgds_policy
    pol.prefill.seed_coefficients(A, 0.0, 0.0, "test")
    cache._test_scheduler = Scheduler(waiting_queue=list(queue_reqs), chunked_req=None, chunked_prefill_size=chunk)
    pol.bind(cache._test_scheduler)  # held weakly by the policy, as the real scheduler is
    return cache, ctl, pol


class Scheduler(types.SimpleNamespace):
    """What the policy reads of SGLang's Scheduler (bound by its _prefetch_kvcache hook)."""


def req(rid: str, n: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(rid=rid, origin_input_ids=list(range(n)), output_ids=[], prefix_indices=[],
                                 host_hit_length=0)


def handle(rid: str):
    return CacheRequestHandle(rid, 0) if V23 else rid


def operation(rid: str, tokens: int):
    return PrefetchOperation(handle(rid), list(range(tokens)))


def ongoing(cache, rid: str, op, tokens: int) -> None:
    key = RadixKey(list(range(tokens)))
    if V23:
        cache.ongoing_prefetch[handle(rid)] = _OngoingPrefetch(0, key, op.host_indices, op, None, {})
    else:
        cache.ongoing_prefetch[rid] = (TreeNode(), key, op)


# -- configuration -------------------------------------------------------------------------------
def test_policy_keys_are_the_plugins_and_checked(gds_dir):
    cfg = PolicyConfig.from_extra({"policy": POLICY, "policy_read_gbps": "1.5", "policy_host_fraction": 0.6,
                                   "policy_stop_margin": 0})
    assert (cfg.policy, cfg.read_gbps, cfg.host_fraction, cfg.stop_margin) == (POLICY, 1.5, 0.6, 0.0)
    # settings measured not to pay were removed: naming one is an error that says so, as an unknown key is
    removed = [({k: v}, f"{k} was removed") for k, v in (("policy_read_slice", "64M"), ("policy_partial", "off"),
                                                          ("policy_ready_first", "yes"), ("policy_late_split", "on"))]
    for bad, match in (({"policy": "fastest"}, "policy: 'fastest'"), ({"policy_read_gbps": -1}, "policy_read_gbps"),
                       ({"policy_host_fraction": 1.5}, "policy_host_fraction"), *removed):
        with pytest.raises(ConfigError, match=match):
            PolicyConfig.from_extra(bad)
        with pytest.raises(ConfigError, match=match):  # the attach fails with the reason
            HiCacheGDS(storage_config(gds_dir, extra=bad), {})
    b = HiCacheGDS(storage_config(gds_dir, extra={"policy": "wait_complete", "policy_prefill_tokens_per_s": 9000}), {})
    try:
        assert b.policy_config.policy == "wait_complete" and b.policy_config.prefill_tokens_per_s == 9000
    finally:
        b.close()
    # the seeds under the core's keys, shared with the vLLM adapter (the old names above are aliases)
    cfg = PolicyConfig.from_extra({"read_bytes_per_s": 2.5e9, "prefill_tokens_per_s": "8000"})
    assert (cfg.read_gbps, cfg.prefill_tokens_per_s) == (pytest.approx(2.5), 8000.0)
    b = HiCacheGDS(storage_config(gds_dir, extra={"read_bytes_per_s": 2e9, "prefill_tokens_per_s": 9000}), {})
    try:
        assert b.policy_config.read_gbps == pytest.approx(2.0) and b.policy_config.prefill_tokens_per_s == 9000
    finally:
        b.close()


# -- the backend's side: sliced gets, cancel, progress, read rate --------------------------------------
def test_gets_read_the_same_bytes_and_measure_the_rate(gds_dir, monkeypatch):
    b, pool = open_backend(gds_dir)
    try:
        cache, _, _ = make_cache(b)  # the policy in force: gets read whole, as under SGLang's policies
        kv = b._bindings["kv"]
        real_get, calls = kv.get, []
        monkeypatch.setattr(kv, "get", lambda k, h: (calls.append(len(k)), real_get(k, h))[1])
        src, dst = list(range(0, 10)), list(range(20, 30))
        ks = keys(10)
        assert all(b.batch_set_v1(ks, indices(src, PS)))
        poison(pool, dst)
        b.get_stats()  # drain
        assert b.batch_get_v1(ks, indices(dst, PS)) == [True] * 10
        assert all(page_bytes(pool, s) == page_bytes(pool, d) for s, d in zip(src, dst))
        assert calls == [10]
        m = b.get_stats()
        assert m.prefetch_pgs == [10]
        cache.prefetch_stop_policy = "wait_complete"  # SGLang's policy: the same one read
        poison(pool, dst)
        assert b.batch_get_v1(ks, indices(dst, PS)) == [True] * 10 and calls[-1] == 10
        assert all(page_bytes(pool, s) == page_bytes(pool, d) for s, d in zip(src, dst))
        assert b.read_rate.total_gets == 2 and b.read_rate.total_bytes == 2 * 10 * PS * BPT
        assert b.read_rate.source.startswith("measured")
        assert b.stats()["policy"]["read_bytes_per_s"] > 0
    finally:
        b.close()


def test_a_cancelled_prefetch_keeps_the_pages_read_before_and_reads_no_more(gds_dir, monkeypatch):
    """SGLang's zero-copy page get (its real method), batch after batch, over a prefetch the policy
    cancels during its first batch: that get reads whole, the next reads nothing."""
    b, pool = open_backend(gds_dir)
    try:
        _cache = make_cache(b)  # noqa: F841 -- the policy in force
        ks = keys(8)
        assert all(b.batch_set_v1(ks, indices(range(8), PS)))
        dst = list(range(30, 38))
        poison(pool, dst)
        op = operation("r1", 8 * PS)
        op.hash_value, op.host_indices = ks, indices(dst, PS)
        kv = b._bindings["kv"]
        real_get = kv.get
        seen = []

        def get(keys_, host_indices):
            seen.append(b.read_progress(op.host_indices))
            out = real_get(keys_, host_indices)
            if len(seen) == 1:
                b.cancel_read(op.host_indices)  # as the policy does: the prefetch's host_indices
            return out

        monkeypatch.setattr(kv, "get", get)
        ctl = object.__new__(HiCacheController)
        ctl.storage_backend, ctl.page_size = b, PS
        # the controller passes batches of pages, slices of host_indices
        got = ctl._page_get_zero_copy(op, ks[:2], op.host_indices[0:2 * PS], None)
        loaded = got if V23 else op.completed_tokens // PS
        assert loaded == 2 and seen == [0]
        assert all(page_bytes(pool, s) == page_bytes(pool, d) for s, d in zip(range(2), dst[:2]))
        before = kv.store.stats()["pages_read"]
        got = ctl._page_get_zero_copy(op, ks[2:], op.host_indices[2 * PS:8 * PS], None)
        assert (got if V23 else op.completed_tokens // PS - 2) == 0 and seen == [0]  # the next batch: nothing read
        assert kv.store.stats()["pages_read"] == before
        fresh = torch.full_like(pool.get_dummy_flat_data_page().view(torch.uint8), 0xA5)
        assert all(page_bytes(pool, d) == fresh.numpy().tobytes() for d in dst[2:])  # never written
        assert b.read_rate.total_gets == 1  # the whole get counts; a skipped one is no rate
    finally:
        b.close()


def test_a_cancel_stops_only_its_own_prefetch_among_views_of_one_free_slot_tensor(gds_dir, monkeypatch):
    """SGLang's host pool hands out every prefetch's host_indices as a slice of one free-slot
    tensor (``free_slots[:n]``; `LogicalHostPool` allocates as the KV host pools do), so they all
    share one base. Stopping one prefetch must not cut the others' gets (on the GPU machine it
    did: the loads after a stopped one all ended with 0 pages, and were recomputed), and the
    progress of a get in flight counts for its own prefetch only."""
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool
    b, pool = open_backend(gds_dir)
    try:
        _cache = make_cache(b)  # noqa: F841 -- the policy in force
        slots = LogicalHostPool(64 * PS, PS)
        first, second = slots.alloc(4 * PS), slots.alloc(4 * PS)
        assert first._base is not None and first._base is second._base  # one base, as in the server
        ks = keys(8)
        assert all(b.batch_set_v1(ks, indices(range(8), PS)))
        want = [page_bytes(pool, p) for p in range(8)]
        poison(pool, range(4, 12))
        b.cancel_read(first)
        assert b.batch_get_v1(ks[:2], first[0:2 * PS]) == [False, False]  # the stopped one: skipped
        kv = b._bindings["kv"]
        real_get, seen = kv.get, []
        monkeypatch.setattr(kv, "get", lambda k, h: (seen.append((b.read_progress(second), b.read_progress(first))),
                                                     real_get(k, h))[1])
        assert b.batch_get_v1(ks[4:], second[0:4 * PS]) == [True] * 4  # the other one reads on
        assert seen == [(0, 0)]  # one whole get
        assert [page_bytes(pool, p) for p in range(4, 8)] == want[4:]  # second's slots: pages 4-7
        monkeypatch.setattr(kv, "get", real_get)
        del first  # the stopped prefetch is gone: its cancel with it
        assert b._cancelled and b._cancelled[0][0]() is None
        third = slots.alloc(4 * PS)
        assert b.batch_get_v1(ks[:4], third) == [True] * 4
        assert [page_bytes(pool, p) for p in range(8, 12)] == want[:4]
    finally:
        b.close()


def test_read_rate_seeds_persists_and_carries_over_a_reattach(gds_dir):
    b, _ = open_backend(gds_dir, policy_read_gbps=2.5)
    assert b.read_rate.rate == pytest.approx(2.5e9) and b.read_rate.source == "configured (read_bytes_per_s)"
    b.read_rate.observe(1 << 30, 0.5)
    again, _ = open_backend(gds_dir)  # attached again in this process: the same history
    assert again.read_rate is b.read_rate
    cache, _, pol = make_cache(again)
    assert pol.model(again).read is b.read_rate
    for n in (2000, 5000, 8000):  # what the server measured of its prefill
        pol.prefill.observe([n], [0], n * A)
    assert again.save_cost_state(pol.model(again).state())
    path = again._cost_path
    assert os.path.basename(path) == STATE_FILE and os.path.dirname(path) in again.stats()["kv"]["dirs"]
    b.close(), again.close()
    backend_mod._RATES.clear()  # a new process: seeded from the file
    later, _ = open_backend(gds_dir)
    try:
        assert later.read_rate.source.startswith("persisted") and later.read_rate.rate > 0
        _, _, pol2 = make_cache(later)
        pol2.prefill = policy.PrefillModel()  # nothing measured: the persisted fit seeds it
        pol2.cost_model = None
        pol2.model(later)
        assert pol2.prefill.coefficients()[1].startswith("persisted")
    finally:
        later.close()


# -- admission ----------------------------------------------------------------------------------------
def admit(cache, rid: str, tokens: int, calls: list | None = None):
    """The hook around the cache's own prefetch_from_storage (0.5.17: the real one, into the real
    controller's queue; 0.5.23's needs its tree core, so a recorder stands in for it)."""
    if V23:
        def original(c, request, node, toks, *a, **kw):
            calls.append(request.rid)
            ongoing(c, request.rid, PrefetchOperation(request, list(toks)), len(toks))
            return None
        return hooks.around_admit(original, cache, handle(rid), 0, list(range(tokens)), matched_prefix_tokens=[])
    root = TreeNode()
    root.key = RadixKey([])
    out = hooks.around_admit(CACHE.prefetch_from_storage, cache, rid, root, list(range(tokens)))
    if calls is not None and rid in cache.ongoing_prefetch:
        calls.append(rid)
    return out


@pytest.mark.parametrize("ratio,expect", [(1.3, "compute"), (0.7, "load")])
def test_a_request_alone_loads_only_when_loading_is_faster(gds_dir, ratio, expect):
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(ratio))
    try:
        cache, ctl, pol = make_cache(b)
        pol.current_req = req("a", 18000)
        calls: list = []
        admit(cache, "a", 18000 - 64, calls)
        assert pol.counts[expect] == 1 and pol.last["action"] == expect
        if expect == "compute":
            assert calls == [] and not cache.ongoing_prefetch and ctl.prefetch_queue.empty()
        else:
            assert calls == ["a"]
            if not V23:  # SGLang's own controller took it
                op = ctl.prefetch_queue.get_nowait()
                assert op.request_id == "a" and ctl.prefetch_tokens_occupied == len(op.token_ids) > 17000
    finally:
        b.close()


def test_each_decision_logs_the_host_pools_free_tokens(gds_dir, caplog):
    """A load is read into host memory that SGLang allocates once the hit is known (and shortens
    or revokes where it cannot): each decision says how much was free."""
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(0.7))
    try:
        cache, ctl, pol = make_cache(b)
        ctl.mem_pool_host.available_size = lambda: 24576
        pol.current_req = req("h", 18000)
        with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.policy"):
            admit(cache, "h", 18000 - 64, [])
        assert pol.last["host_free"] == 24576
        assert "host pool 24576 tokens free" in caplog.text and " h load " in caplog.text
        del ctl.mem_pool_host.available_size  # a release that does not say
        pol.current_req = req("i", 18000)
        admit(cache, "i", 18000 - 64, [])
        assert pol.last["host_free"] is None
    finally:
        b.close()


def test_a_load_the_host_pool_cannot_keep_is_recomputed(gds_dir):
    """SGLang allocates a load's host memory once its hit is known and shortens or revokes what
    does not fit: the disk then reads for nothing and the request is recomputed after waiting (a
    32B burst on the GPU machine lost most of its loads so). Admission counts the host pool's free
    tokens, the host-only pages SGLang may evict, less the loads admitted and not yet allocated."""
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(0.7))
    try:
        cache, ctl, pol = make_cache(b)
        ctl.mem_pool_host.available_size = lambda: 12288
        calls: list = []
        pol.current_req = req("h", 18000)
        admit(cache, "h", 18000 - 64, calls)  # 17920 tokens of L3 hit, 12288 free
        assert pol.last["action"] == "compute" and "host pool has room for 12288 tokens" in pol.last["reason"]
        assert calls == []
        if not V23:  # 0.5.17's radix cache keeps its evictable host-only leaves
            leaf = TreeNode()
            leaf.host_value = torch.arange(8192)
            leaf.value = None  # evicted from the GPU: host only
            cache.evictable_host_leaves = {leaf}
            assert leaf.evicted and host.host_room(cache) == 12288 + 8192
            pol.current_req = req("j", 18000)
            admit(cache, "j", 18000 - 64, calls)
            assert pol.last["action"] == "load" and calls == ["j"]
            # "j" is admitted and its host memory not yet allocated: the next load does not fit
            assert host.host_room(cache) == 12288 + 8192 - (18000 - 64) // PS * PS
            pol.current_req = req("k", 8000)
            admit(cache, "k", 8000 - 64, calls)
            assert pol.last["action"] == "compute" and calls == ["j"]
    finally:
        b.close()


@pytest.mark.skipif(V23, reason="0.5.17's radix cache keeps the evictable host-only leaves")
def test_host_room_counts_a_chain_of_host_only_nodes_as_evict_host_frees_it():
    """A prefix cached in chunks is a chain of nodes; only its deepest is an evictable leaf, and
    SGLang's ``evict_host`` frees its ancestors as they become leaves. All of it is room; a node
    with another child still cached (or on the GPU, or referenced) is not."""
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    class _Pool:
        def available_size(self):
            return 1000

    cache = HiRadixCache.__new__(HiRadixCache)
    cache.root_node = TreeNode()

    def node(parent, n, on_gpu=False):
        x = TreeNode()
        x.host_value = torch.arange(n)
        x.value = torch.arange(n) if on_gpu else None
        x.parent = parent
        parent.children[len(parent.children)] = x
        return x

    a = node(cache.root_node, 8192)
    b_ = node(a, 8192)
    c = node(b_, 4096)           # chain a -> b -> c, all host only
    d = node(cache.root_node, 2048, on_gpu=True)
    e = node(d, 1024)            # host-only leaf under a node still on the GPU
    f = node(cache.root_node, 512)
    g = node(f, 256)
    h = node(f, 128, on_gpu=True)  # f keeps a child on the GPU: f stays
    cache.evictable_host_leaves = {c, e, g}
    cache.ongoing_prefetch = {}
    cache.cache_controller = type("C", (), {"mem_pool_host": _Pool()})()
    assert view.host_evictable(cache) == 8192 + 8192 + 4096 + 1024 + 256
    assert host.host_room(cache) == 1000 + 8192 + 8192 + 4096 + 1024 + 256
    b_.host_ref_counter = 1  # a protected node (a finished load) keeps itself and its ancestors
    assert view.host_evictable(cache) == 4096 + 1024 + 256
    assert h.value is not None


def _check_progress(cache, rid: str, original=None) -> bool:
    """The release's ``check_prefetch_progress`` hook for `rid` (`original`: SGLang's answer)."""
    original = original or (lambda c, key, *a, **kw: True)
    if V23:
        return hooks.around_check_progress_0523(original, cache, handle(rid))
    return hooks.around_check_progress(original, cache, rid)


def test_a_load_turned_down_for_host_room_waits_for_room_then_loads(gds_dir, monkeypatch, caplog):
    """A load admission turned down only because the host pool is full is held in the waiting
    queue (the scheduler skips it, as a load in flight) while something gives room back, and
    prefetched through SGLang's own path once the pool has room (an H200 burst of MLA prompts
    recomputed 54k tokens, 10 s of GPU, while the loads ahead landed within a second). Past its
    deadline (what loading was ahead by, `room.ROOM_SHARE` of it) it is computed as admission
    said; with nothing in flight to give room back, or the knob off, it is computed at once."""
    monkeypatch.setattr(room, "HOOKED", [True])
    monkeypatch.setattr(policy, "LATE_EVERY_S", 60.0)
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(0.1))  # loading takes 0.1x computing
    try:
        cache, ctl, pol = make_cache(b)
        free = [12288]
        ctl.mem_pool_host.available_size = lambda: free[0]
        sched = cache._test_scheduler
        ahead, m = req("ahead", 8192 + 64), req("m", 18000)
        in_flight(cache, b, "ahead", 8192, kept=0)  # a load ahead holds host pages: room comes back
        calls: list = []

        def prefetch_kvcache(r):  # Scheduler._prefetch_kvcache: match again, then the cache's prefetch
            return hooks.around_prefetch_kvcache(lambda s, q: admit(cache, q.rid, 18000 - 64, calls), sched, r)

        sched._prefetch_kvcache, sched.tree_cache = prefetch_kvcache, cache
        pol.current_req = m
        with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.policy"):
            admit(cache, "m", 18000 - 64, calls)
        assert pol.last["action"] == "compute" and calls == [] and "m" in pol.room_wait
        assert "m waits for host room (needs 17920 tokens" in caplog.text
        sched.waiting_queue = [ahead, m]
        assert _check_progress(cache, "m", lambda *a, **kw: pytest.fail("held: SGLang is not asked")) is False
        assert _check_progress(cache, "other") is True  # any other request: SGLang's answer
        pol.late_look = 0.0
        hooks.after_new_prefill_batch(None, sched)  # still no room: held, nothing prefetched
        assert calls == [] and "m" in pol.room_wait and pol.counts["late"] == 0

        free[0] = 30000  # the load ahead reached the GPU; its host pages are the tree's to evict
        pol.late_look = 0.0
        with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.policy"):
            hooks.after_new_prefill_batch(None, sched)
        assert calls == ["m"] and pol.decided["m"].action == "load" and "m" not in pol.room_wait
        assert pol.counts["room_load"] == 1 and "m has host room after" in caplog.text
        assert _check_progress(cache, "m", lambda *a, **kw: "sglang's") == "sglang's"  # a load in flight now

        # past its deadline a held request is computed, as admission said
        free[0] = 12288
        pol.current_req = n = req("n", 18000)
        admit(cache, "n", 18000 - 64, calls)
        w = pol.room_wait["n"]
        assert 0 < w.until - w.since <= room.ROOM_MAX_S
        sched.waiting_queue = [ahead, n]
        pol.room_wait["n"] = w._replace(until=w.since - 1)
        assert _check_progress(cache, "n") is True and "n" not in pol.room_wait and pol.counts["room_timeout"] == 1
        # asked again while held, the first deadline stands
        pol.current_req = req("o", 18000)
        admit(cache, "o", 18000 - 64, calls)
        first = pol.room_wait["o"].until
        admit(cache, "o", 18000 - 64, calls)
        assert pol.room_wait["o"].until == first and pol.counts["room_wait"] == 3
        # a request that left the queue is forgotten
        pol.late_look = 0.0
        hooks.after_new_prefill_batch(None, sched)
        assert "o" not in pol.room_wait

        # a hold that fails is no hold: computed, logged once
        pol.current_req = req("p", 18000)
        admit(cache, "p", 18000 - 64, calls)
        monkeypatch.setattr(room, "holds", lambda *a: 1 / 0)
        with caplog.at_level(logging.WARNING, logger="hicache_gds_sglang"):
            assert _check_progress(cache, "p") is True and not pol.room_wait

        # nothing in flight or protected gives room back: computed at once
        cache.ongoing_prefetch.clear()
        pol.current_req = req("q", 18000)
        admit(cache, "q", 18000 - 64, calls)
        assert pol.last["action"] == "compute" and "q" not in pol.room_wait
    finally:
        b.close()
    b2, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(0.1), policy_room_wait=False)
    try:
        cache, ctl, pol = make_cache(b2)
        ctl.mem_pool_host.available_size = lambda: 12288
        in_flight(cache, b2, "ahead", 8192, kept=0)
        pol.current_req = req("m", 18000)
        admit(cache, "m", 18000 - 64, [])
        assert pol.last["action"] == "compute" and not pol.room_wait  # the knob off: computed, as before
    finally:
        b2.close()


def test_a_load_past_the_prefetches_share_of_the_host_pool_waits_for_it_then_loads(gds_dir, monkeypatch, caplog):
    """SGLang asks its prefetch limit after admission and drops a load started past it without a
    word (an H200 burst of 8 MLA prompts recomputed three admitted loads so, with half the host
    pool free). Admission heeds the limit: such a load is held as one short of host room, and
    prefetched once the loads ahead give their share back: every held request that fits, in one
    pass; a hold whose deadline passed during a long forward pass but that fits now stays held
    for that prefetch, never past `room.ROOM_MAX_S`."""
    monkeypatch.setattr(room, "HOOKED", [True])
    monkeypatch.setattr(policy, "LATE_EVERY_S", 60.0)
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(0.1))
    try:
        cache, ctl, pol = make_cache(b)  # 98,304 host tokens: a share of 73,728 (policy_host_fraction 0.75)
        ctl.mem_pool_host.available_size = lambda: 90000  # room: the share is what turns loads down
        sched = cache._test_scheduler
        ahead = req("ahead", 8192 + 64)
        in_flight(cache, b, "ahead", 8192, kept=0)
        ctl.prefetch_tokens_occupied = 75000
        calls: list = []

        def prefetch_kvcache(r):
            return hooks.around_prefetch_kvcache(lambda s, q: admit(cache, q.rid, 18000 - 64, calls), sched, r)

        sched._prefetch_kvcache, sched.tree_cache = prefetch_kvcache, cache
        held = {}
        with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.policy"):
            for rid in ("m", "n", "o"):
                pol.current_req = held[rid] = req(rid, 18000)
                admit(cache, rid, 18000 - 64, calls)
                assert pol.last["action"] == "compute" and rid in pol.room_wait
                assert "prefetches hold 75000 tokens, their share of the host pool is 73728" in pol.last["reason"]
        assert calls == [] and "m waits for host room (needs 17920 tokens; prefetches hold 75000" in caplog.text
        if not V23:
            assert ctl.prefetch_queue.empty()  # SGLang was never asked: nothing to drop
        sched.waiting_queue = [ahead, *held.values()]
        assert _check_progress(cache, "m", lambda *a, **kw: pytest.fail("held: SGLang is not asked")) is False
        pol.late_look = 0.0
        hooks.after_new_prefill_batch(None, sched)  # still past the share: nothing prefetched
        assert calls == [] and set(pol.room_wait) == {"m", "n", "o"}

        # the loads ahead were taken: the share has room again. "m"'s deadline passed meanwhile
        ctl.prefetch_tokens_occupied = 0
        w = pol.room_wait["m"]
        pol.room_wait["m"] = w._replace(until=w.since - 1)
        assert _check_progress(cache, "m") is False  # past its deadline, but it fits: held for the prefetch
        pol.late_look = 0.0
        with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.policy"):
            hooks.after_new_prefill_batch(None, sched)
        assert calls == ["m", "n", "o"] and not pol.room_wait and pol.counts["room_load"] == 3
        assert all(pol.decided[r].action == "load" for r in ("m", "n", "o"))

        # never held past ROOM_MAX_S, even where it fits
        ctl.prefetch_tokens_occupied = 75000
        pol.current_req = p_ = req("p", 18000)
        admit(cache, "p", 18000 - 64, calls)
        sched.waiting_queue = [ahead, p_]
        ctl.prefetch_tokens_occupied = 0
        w = pol.room_wait["p"]
        pol.room_wait["p"] = w._replace(until=w.since - 1, since=w.since - room.ROOM_MAX_S - 1)
        assert _check_progress(cache, "p") is True and "p" not in pol.room_wait
    finally:
        b.close()


def test_a_busy_gpu_sends_the_next_request_of_a_burst_to_the_disk(gds_dir):
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(1.3))
    try:
        ahead = [req(f"q{i}", 18000) for i in range(2)]  # two recomputes already queued
        cache, _, pol = make_cache(b, queue_reqs=ahead)
        pol.current_req = req("c", 18000)
        calls: list = []
        admit(cache, "c", 18000 - 64, calls)
        assert pol.last["action"] == "load" and calls == ["c"]
        assert pol.last["gpu_backlog"] == pytest.approx(2 * 18000 * A)
        # and the queue's next one, with this load ahead of it on the disk, is weighed against both
        pol.current_req = req("d", 18000)
        admit(cache, "d", 18000 - 64, calls)
        assert pol.last["disk_backlog"] > 0
    finally:
        b.close()


def test_a_queued_request_sent_to_the_gpu_is_given_to_the_disk_once_it_loads_in_time(gds_dir, monkeypatch):
    """Admission split the queue on a read rate that turned out low: the disk then idles while
    requests it could serve wait for the GPU. After a prefill batch is formed, the first waiting
    request decided "compute" whose hit loads before the GPU reaches it is prefetched through the
    scheduler's own path, which asks admission again with its place in the queue; one per pass,
    each at most once, not where the GPU reaches it first (on several ranks: where every rank
    votes for it, `test_multirank`)."""
    # passes are spaced by the test (late_look = 0), not by a loaded machine's clock
    monkeypatch.setattr(policy, "LATE_EVERY_S", 60.0)
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(8.0))  # loading takes 8x computing
    try:
        big = req("q0", 60000)  # 10 s of prefill queued ahead, not ours to decide
        r1, r2, r3 = req("r1", 18000), req("r2", 18000), req("r3", 18000)
        cache, ctl, pol = make_cache(b, queue_reqs=[big])
        sched = cache._test_scheduler
        calls: list = []
        for r in (r1, r2):
            pol.current_req = r
            admit(cache, r.rid, 18000 - 64, calls)
            assert pol.last["action"] == "compute"
            sched.waiting_queue.append(r)  # the scheduler queues it after admission
        assert calls == [] and pol.counts["compute"] == 2

        def prefetch_kvcache(r):  # Scheduler._prefetch_kvcache: match again, then the cache's prefetch
            return hooks.around_prefetch_kvcache(lambda s, q: admit(cache, q.rid, 18000 - 64, calls), sched, r)

        sched._prefetch_kvcache, sched.tree_cache = prefetch_kvcache, cache
        assert pol.late_admit(sched) is None  # still slow: nothing is given to the disk
        b.read_rate.seed(gbps_for(0.5) * 1e9, "test")  # the disk turns out 10x faster than forecast
        pol.late_look = 0.0
        hooks.after_new_prefill_batch(None, sched)
        assert calls == ["r1"] and pol.counts["late"] == 1 and pol.decided["r1"].action == "load"
        assert pol.last["gpu_backlog"] == pytest.approx(60000 * A)  # admitted with what is ahead of it only
        assert pol.late_admit(sched) is None  # one per pass, at most every _LATE_EVERY_S
        pol.late_look = 0.0
        assert pol.late_admit(sched) == "r2" and calls == ["r1", "r2"]  # behind r1's load, still in time
        pol.late_look = 0.0
        assert pol.late_admit(sched) is None and pol.counts["late"] == 2  # nothing decided "compute" is left

        # where the GPU reaches it before its hit could land, it stays with the GPU
        cache2, _, pol2 = make_cache(b, queue_reqs=[req("small", 1000)])
        b.read_rate.seed(gbps_for(5.0) * 1e9, "test")
        pol2.current_req = r3
        admit(cache2, "r3", 18000 - 64, calls)
        assert pol2.last["action"] == "compute"
        s2 = cache2._test_scheduler
        s2.waiting_queue.append(r3)
        s2.tree_cache = cache2
        s2._prefetch_kvcache = lambda r: pytest.fail("not in time: must stay with the GPU")
        b.read_rate.seed(gbps_for(0.5) * 1e9, "test")
        assert pol2.late_admit(s2) is None  # loads in 0.9 s, the GPU reaches it in 0.17 s
        s2.waiting_queue.insert(0, big)  # in time now
        pol2.late_look = 0.0
        s2._prefetch_kvcache = lambda r: calls.append(f"late {r.rid}")
        assert pol2.late_admit(s2) == "r3" and calls[-1] == "late r3"
    finally:
        b.close()


def test_sglangs_policies_and_other_backends_are_untouched(gds_dir):
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(5.0))  # loading would be slow
    try:
        cache, _, pol = make_cache(b, stop_policy="wait_complete")
        calls: list = []
        admit(cache, "w", 18000, calls)
        assert calls == ["w"] and not pol.counts  # SGLang's own path, no decision taken
        cache.prefetch_stop_policy = POLICY
        cache.cache_controller.storage_backend = object()  # not ours: the policy is not in force
        assert policy.policy_of(cache) is None
    finally:
        b.close()


# -- in flight -----------------------------------------------------------------------------------------
def in_flight(cache, b, rid: str, tokens: int, kept: int):
    op = operation(rid, tokens)
    op.hash_value = keys(tokens // PS)
    op.storage_hit_count = tokens
    op.host_indices = torch.arange(1000, 1000 + tokens, dtype=torch.int64)
    op.completed_tokens = kept
    ongoing(cache, rid, op, tokens)
    return op


def test_a_slow_load_is_stopped_when_the_gpu_is_free_and_kept_where_it_is_busy(gds_dir):
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(2.0))
    try:
        cache, _, pol = make_cache(b)
        op = in_flight(cache, b, "s", 16384, kept=4096)
        pol.decided["s"] = Decided("load", 16448, 0, 16384)
        assert hooks.around_can_terminate(getattr(CACHE, STOP), cache, op) is True
        assert pol.counts["stop"] == 1 and pol.last["kept"] == 4096
        assert b._is_cancelled(backend_mod._region(op.host_indices))  # its reads left are skipped
        # the same load behind a busy GPU runs on
        cache2, _, pol2 = make_cache(b, queue_reqs=[req("big", 60000), req("s2", 16448)])
        op2 = in_flight(cache2, b, "s2", 16384, kept=4096)
        pol2.decided["s2"] = Decided("load", 16448, 0, 16384)
        assert hooks.around_can_terminate(getattr(CACHE, STOP), cache2, op2) is False
        assert pol2.counts["stop"] == 0 and not b._is_cancelled(backend_mod._region(op2.host_indices))
    finally:
        b.close()


def test_an_admitted_load_on_time_is_not_redecided_until_a_batch_lands_or_it_runs_late(gds_dir, monkeypatch,
                                                                                        caplog):
    # Admitted as a load (loading is faster); then the estimates drift so that stopping looks
    # better. On time and with no new batch kept, the admission stands; when a batch lands (its
    # pages are kept by a stop) or the load runs late against its forecast, it is re-decided.
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(0.7))
    try:
        cache, ctl, pol = make_cache(b)
        pol.current_req = req("t", 16448)
        with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.policy"):
            admit(cache, "t", 16384, [])
        assert pol.last["action"] == "load" and "t load (16448 new" in caplog.text and "GB/s" in caplog.text
        pol.current_req = None
        forecast = pol.loads["t"].io_s
        assert 0 < forecast < math.inf
        op = in_flight(cache, b, "t", 16384, kept=0)
        b.read_rate.seed(gbps_for(2.0) * 1e9, "drifted")  # now loading looks twice as slow as computing
        b.read_rate._obs.clear()
        stop = getattr(CACHE, STOP)
        clock = [time.monotonic()]
        monkeypatch.setattr(policy.time, "monotonic", lambda: clock[0])
        clock[0] += 0.05
        assert hooks.around_can_terminate(stop, cache, op) is False  # on time, nothing new kept
        assert pol.counts["stop"] == 0
        op.completed_tokens = 4096  # a batch landed: looked at again, and stopped (keeping it)
        clock[0] += 0.05
        assert hooks.around_can_terminate(stop, cache, op) is True
        assert pol.counts["stop"] == 1 and pol.last["kept"] == 4096
        # a second load: no batch lands, but it runs past 1.25x its forecast
        cache.ongoing_prefetch.clear()  # SGLang settled the stopped one
        pol.current_req = req("u", 16448)
        b.read_rate.seed(gbps_for(0.7) * 1e9, "back")
        admit(cache, "u", 16384, [])
        pol.current_req = None
        assert pol.last["action"] == "load"
        op2 = in_flight(cache, b, "u", 16384, kept=0)
        b.read_rate.seed(gbps_for(2.0) * 1e9, "drifted")
        clock[0] += 0.05
        assert hooks.around_can_terminate(stop, cache, op2) is False
        clock[0] += pol.loads["u"].io_s * 1.25 + 0.2
        assert hooks.around_can_terminate(stop, cache, op2) is True
        assert pol.counts["stop"] == 2 and pol.last["kept"] == 0
    finally:
        b.close()


def test_a_finished_load_is_settled_as_each_release_does(gds_dir):
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(2.0))
    try:
        cache, _, _ = make_cache(b)
        op = in_flight(cache, b, "f", 8192, kept=8192)
        # 0.5.17 inserts it when the policy says so; 0.5.23 through its acknowledgements
        assert hooks.around_can_terminate(getattr(CACHE, STOP), cache, op) is (not V23)
        assert not b._is_cancelled(backend_mod._region(op.host_indices))
    finally:
        b.close()


def _tree(cache, ctl, host_free: int = 128):
    """0.5.17's radix tree state on a constructor-less HiRadixCache: its root as ``reset`` builds
    it, the host pool's free/evict calls, one rank, no events."""
    from sglang.srt.mem_cache.evict_policy import LRUStrategy
    root = TreeNode(priority=-sys.maxsize)
    root.key, root.value, root.host_value, root.lock_ref, root.hash_value = RadixKey([]), [], [], 1, []
    cache.root_node, cache.evictable_leaves, cache.evictable_host_leaves = root, set(), set()
    cache.eviction_strategy, cache.enable_kv_cache_events, cache.enable_storage_metrics = LRUStrategy(), False, False
    cache.attn_cp_group = cache.attn_tp_group = None
    cache.tp_world_size, cache.prefetch_loaded_tokens_by_reqid = 1, {}
    freed: list[int] = []
    ctl.mem_pool_host.available_size = lambda: host_free
    ctl.mem_pool_host.free = lambda idx: freed.append(len(idx)) or len(idx)
    ctl.mem_pool_host.page_size = PS
    ctl.host_mem_release_queue = queue.Queue()
    return root, freed


def test_a_finished_load_keeps_its_host_pages_until_the_gpu_takes_the_request(gds_dir, caplog):
    """0.5.17 inserts a finished load into the tree when the scheduler reaches the request, even
    when the batch cannot take it; the pages then sit as evictable host-only leaves, and other
    prefills' write-through evicts them when the host pool is full (a 32B burst on the GPU machine
    read prefixes from disk, then recomputed them). With the policy the inserted pages survive
    SGLang's own host eviction until the request leaves the waiting queue, or `_PROTECT_MAX_S`;
    without it (SGLang's policy) the same eviction takes them at once."""
    if V23:
        pytest.skip("0.5.17's tree; 0.5.23's host protection runs on its real tree in test_kit_0523.py")
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(0.5))
    try:
        cache, ctl, pol = make_cache(b)
        root, freed = _tree(cache, ctl)
        waiting = req("loaded", 8192 + 512)
        sched = cache._test_scheduler
        sched.waiting_queue, sched.tree_cache = [waiting], cache
        op = in_flight(cache, b, "loaded", 8192, kept=8192)
        cache.ongoing_prefetch["loaded"] = (root, RadixKey(list(range(8192))), op)
        root.protect_host()  # as prefetch_from_storage does for the node a prefetch hangs under
        ctl.prefetch_tokens_occupied = 8192
        with caplog.at_level(logging.INFO, logger="hicache_gds_sglang"):
            assert hooks.around_check_progress(CACHE.check_prefetch_progress, cache, "loaded") is True
            assert "loaded" not in cache.ongoing_prefetch and root.host_ref_counter == 0  # SGLang settled it
            node = cache._match_prefix_helper(root, RadixKey(list(range(8192))))[1]
            assert node is not root and len(node.host_value) == 8192 and node in cache.evictable_host_leaves
            assert node.host_value.tolist() == list(range(1000, 1000 + 8192))  # the pages the load read into
            assert sum(freed) == 0  # none of them were there already

            cache.evict_host(8192)  # another prefill's write-through, host pool full
            hooks.after_new_prefill_batch(None, sched)  # a batch without it: still waiting
            cache.evict_host(8192)
            assert sum(freed) == 0 and cache._match_prefix_helper(root, RadixKey(list(range(8192))))[1] is node

            sched.waiting_queue = []  # the scheduler took it (its load back holds the pages now)
            hooks.after_new_prefill_batch(None, sched)
            assert node.host_ref_counter == 0 and pol.counts["protect"] == 1
            cache.evict_host(8192)
            assert sum(freed) == 8192 and cache._match_prefix_helper(root, RadixKey(list(range(8192))))[1] is root
        said = [r.getMessage() for r in caplog.records]
        assert any("loaded load of 8192 tokens protected on host" in m for m in said)
        assert any("loaded host protection of 8192 tokens released" in m and "left the waiting queue" in m
                   for m in said)

        # a request that never leaves the queue cannot pin host memory
        op2 = in_flight(cache, b, "stuck", 4096, kept=4096)
        key2 = RadixKey(list(range(50000, 54096)))
        cache.ongoing_prefetch["stuck"] = (root, key2, op2)
        root.protect_host()
        sched.waiting_queue = [req("stuck", 5000)]
        hooks.around_check_progress(CACHE.check_prefetch_progress, cache, "stuck")
        node2 = cache._match_prefix_helper(root, key2)[1]
        assert node2.host_ref_counter == 1
        node_, since, n = pol.protected["stuck"]
        pol.protected["stuck"] = Protected(node_, since - host.PROTECT_MAX_S - 1, n)
        hooks.after_new_prefill_batch(None, sched)
        assert node2.host_ref_counter == 0 and "stuck" not in pol.protected
    finally:
        b.close()


def test_without_the_policy_a_finished_load_is_left_to_sglangs_eviction(gds_dir):
    if V23:
        pytest.skip("0.5.17's tree; 0.5.23's host protection runs on its real tree in test_kit_0523.py")
    b, _ = open_backend(gds_dir)
    try:
        cache, ctl, pol = make_cache(b, stop_policy="wait_complete")
        root, freed = _tree(cache, ctl)
        op = in_flight(cache, b, "loaded", 8192, kept=8192)
        op.mark_terminate()
        cache.ongoing_prefetch["loaded"] = (root, RadixKey(list(range(8192))), op)
        root.protect_host()
        assert hooks.around_check_progress(CACHE.check_prefetch_progress, cache, "loaded") is True
        assert pol.counts["protect"] == 0 and not pol.protected
        cache.evict_host(8192)
        assert sum(freed) == 8192
    finally:
        b.close()


def test_a_load_is_paced_by_when_its_last_get_returned_not_by_when_the_scheduler_saw_it(gds_dir, caplog):
    """In a burst the scheduler sees a finished load only between forward passes, seconds after its
    last get returned: paced by that, every forecast doubled (the bound) and loads that would win
    were computed. The backend stamps each whole get's end; the pace is the real read's overrun."""
    b, pool = open_backend(gds_dir, policy_read_gbps=gbps_for(0.5))
    try:
        cache, ctl, pol = make_cache(b)
        stop = getattr(CACHE, STOP)
        for i in range(3):
            rid = f"p{i}"
            pol.current_req = req(rid, 8256)
            admit(cache, rid, 8192, [])
            assert pol.last["action"] == "load"
            w = pol.loads[rid]
            op = in_flight(cache, b, rid, 8192, kept=8192)
            op.hash_value = keys(8192 // PS, tag=rid)
            last = op.hash_value[-2:]  # the load's last get: real pages, read back byte for byte
            assert b.batch_set_v1(last, indices([4 + i, 5 + i], PS)) == [True, True]
            poison(pool, [40, 41])
            assert b.batch_get_v1(last, indices([40, 41], PS)) == [True, True]
            ended = b.get_ended(last[-1])
            assert ended is not None and ended <= time.monotonic()
            w.since = ended - 1.25 * w.io_s  # admitted so long before the get returned
            assert page_bytes(pool, 40) == page_bytes(pool, 4 + i) and page_bytes(pool, 41) == page_bytes(pool, 5 + i)
            time.sleep(0.4 * w.io_s)  # the pass that was running when the get returned
            with caplog.at_level(logging.INFO, logger="hicache_gds_sglang"):
                hooks.around_can_terminate(stop, cache, op)
            cache.ongoing_prefetch.clear()
        # seen by the scheduler alone, the overrun would read 1.65x or more
        assert pol.pace.factor == pytest.approx(1.25, abs=0.01), pol.pace.factor
        lines = [r.getMessage() for r in caplog.records if "load done" in r.getMessage()]
        assert len(lines) == 3 and all("s later)" in x for x in lines), lines
    finally:
        b.close()


def test_finished_loads_pace_the_forecasts_and_loads_ended_by_sglang_are_logged(gds_dir, caplog):
    """Loads in a running server took 1.1-1.5x what the read rate forecast (gaps between gets):
    each finished load's overrun paces the forecasts after it. A load SGLang ends itself (a short
    read, an abort) or drops unseen (revoked) gets a line saying so."""
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(0.5))
    try:
        cache, ctl, pol = make_cache(b)
        stop = getattr(CACHE, STOP)
        model = pol.model(b)
        before = model.predict_load(8192 * BPT)
        for i in range(3):
            rid = f"r{i}"
            pol.current_req = req(rid, 8256)
            admit(cache, rid, 8192, [])
            assert pol.last["action"] == "load"
            pol.loads[rid].since -= 1.5 * pol.loads[rid].io_s  # it took 1.5x its forecast
            op = in_flight(cache, b, rid, 8192, kept=8192)
            hooks.around_can_terminate(stop, cache, op)
            cache.ongoing_prefetch.clear()
        assert pol.pace.factor == pytest.approx(1.5, rel=0.02)
        assert model.predict_load(8192 * BPT) == pytest.approx(1.5 * before, rel=0.02)
        assert pol.stats()["load_pace"] == pytest.approx(1.5, rel=0.02)

        with caplog.at_level(logging.INFO, logger="hicache_gds_sglang"):
            pol.current_req = req("short", 8256)
            admit(cache, "short", 8192, [])
            op = in_flight(cache, b, "short", 8192, kept=4096)
            op.mark_terminate()  # a get returned fewer pages than asked: SGLang ends the prefetch
            assert hooks.around_can_terminate(stop, cache, op) is True
            cache.ongoing_prefetch.clear()
            pol.current_req = req("gone", 8256)
            admit(cache, "gone", 8192, [])
            cache.ongoing_prefetch.clear()  # revoked: no host memory for its hit
            time.sleep(2 * backlog.BACKLOG_TTL_S)
            pol.gpu_backlog(cache, model)
        said = [r.getMessage() for r in caplog.records]
        assert any("short load ended by SGLang after 4096 of 8192 tokens" in m for m in said)
        assert any("gone load left SGLang's prefetches" in m and "unseen" in m for m in said)
        assert pol.counts["short"] == 1 and pol.counts["unseen"] == 1
        assert pol.pace.factor == pytest.approx(1.5, rel=0.02)  # neither paces the forecasts
    finally:
        b.close()


def test_a_load_whose_query_has_not_answered_waits_when_loading_is_faster(gds_dir):
    b, _ = open_backend(gds_dir, policy_read_gbps=gbps_for(0.5))
    try:
        cache, _, _ = make_cache(b)
        op = operation("q", 8192)
        ongoing(cache, "q", op, 8192)
        assert hooks.around_can_terminate(getattr(CACHE, STOP), cache, op) is False
    finally:
        b.close()


def test_sglangs_stop_rule_runs_when_the_policy_is_not_selected(gds_dir):
    b, _ = open_backend(gds_dir)
    try:
        cache, _, _ = make_cache(b, stop_policy="best_effort")
        op = in_flight(cache, b, "b", 8192, kept=0)
        calls = []
        assert hooks.around_can_terminate(lambda c, o: calls.append(o) or "sglang", cache, op) == "sglang"
        assert calls == [op]
    finally:
        b.close()


def test_a_failing_decision_waits_and_logs_once(gds_dir, monkeypatch, caplog):
    b, _ = open_backend(gds_dir)
    try:
        cache, _, pol = make_cache(b)
        op = in_flight(cache, b, "e", 8192, kept=0)
        monkeypatch.setattr(pol, "stop", lambda *a: 1 / 0)
        with caplog.at_level(logging.WARNING, logger="hicache_gds_sglang.policy"):
            assert hooks.around_can_terminate(getattr(CACHE, STOP), cache, op) is False
            assert hooks.around_can_terminate(getattr(CACHE, STOP), cache, op) is False
        assert caplog.text.count("stop decision failed") == 1
        monkeypatch.setattr(pol, "admit", lambda *a: 1 / 0)
        calls: list = []
        admit(cache, "e2", 8192, calls)
        assert calls == ["e2"]  # admission falls back to loading, as SGLang would
    finally:
        b.close()


# -- host pool, attach, settle -------------------------------------------------------------------------
def test_prefetches_may_hold_more_of_the_host_pool_than_sglang_allows(gds_dir):
    b, _ = open_backend(gds_dir)
    try:
        cache, ctl, _ = make_cache(b, host_tokens=100000)
        real = HiCacheController.prefetch_rate_limited
        ctl.prefetch_tokens_occupied = 60000  # over SGLang's half, under our three quarters
        assert real(ctl) is True and hooks.around_rate_limited(real, ctl) is False
        ctl.prefetch_tokens_occupied = 75000
        assert hooks.around_rate_limited(real, ctl) is True
        cache.prefetch_stop_policy = "timeout"  # SGLang's policy: SGLang's limit
        ctl.prefetch_tokens_occupied = 60000
        assert hooks.around_rate_limited(real, ctl) is True
    finally:
        b.close()


def test_runtime_attach_takes_the_policy_sglang_would_reject(gds_dir):
    b, _ = open_backend(gds_dir)
    try:
        cache, ctl, _ = make_cache(b, stop_policy="timeout")
        if V23:
            from sglang.srt.mem_cache.unified_cache.storage_attachment import StorageAttachment
            cache._storage_attachment = StorageAttachment(cache)
            cache.token_to_kv_pool_allocator = object()
            cache.is_write_back = False
        real = CACHE.attach_storage_backend
        ok, msg = real(cache, "gds", None, None, POLICY)  # SGLang alone: not one of its three
        assert not ok and "Invalid hicache_storage_prefetch_policy" in msg
        ok, _ = hooks.around_attach(real, cache, "gds", None, None, POLICY)
        assert ok and cache.prefetch_stop_policy == POLICY and policy.policy_of(cache) is not None
        ok, _ = hooks.around_attach(real, cache, "gds", hicache_storage_prefetch_policy="wait_complete")
        assert ok and cache.prefetch_stop_policy == "wait_complete" and policy.policy_of(cache) is None
    finally:
        b.close()


def test_our_name_turns_into_sglangs_default_where_the_policy_cannot_run(gds_dir):
    b, _ = open_backend(gds_dir, policy="wait_complete")
    try:
        cache, ctl, _ = make_cache(b)  # the extra config's `policy` wins at settle
        assert cache.prefetch_stop_policy == "wait_complete"
        cache.prefetch_stop_policy = POLICY
        ctl.storage_backend, ctl.storage_backend_type = object(), "nixl"
        hooks._settle(cache)
        assert cache.prefetch_stop_policy == policy.FALLBACK
        other = types.SimpleNamespace(prefetch_stop_policy=POLICY, cache_controller=None)  # a cache we do not hook
        hooks._settle(other)
        assert other.prefetch_stop_policy == policy.FALLBACK
    finally:
        b.close()


# -- measuring the engine ----------------------------------------------------------------------------
def test_prefill_batches_are_timed_and_decode_batches_ignored(gds_dir):
    b, _ = open_backend(gds_dir)
    try:
        _, _, pol = make_cache(b)
        pol.prefill = policy.PrefillModel()
        mode = types.SimpleNamespace(is_extend=lambda: True, is_mixed=lambda: False)
        decode = types.SimpleNamespace(is_extend=lambda: False)
        batch = types.SimpleNamespace(forward_mode=mode, extend_lens=[4000, 96], prefix_lens=[0, 8000])
        worker = object()

        def forward(w, bt):
            time.sleep(0.002)  # the GPU's time (wall clock on a machine without one)
            return "ran", bt

        slow = types.SimpleNamespace(forward_mode=mode, extend_lens=[64], prefix_lens=[0])
        hooks.around_forward(lambda w, bt: time.sleep(0.05), worker, slow)  # the first: kernels compile
        for _ in range(3):
            assert hooks.around_forward(forward, worker, batch) == ("ran", batch)
        hooks.around_forward(lambda w, bt: None, worker, types.SimpleNamespace(forward_mode=decode))
        pol.poll()
        assert pol.prefill.batches == 3  # the first batch a server runs is not a prefill cost
        assert pol.stats()["prefill_batches_observed"] == 3
        assert pol.prefill.predict(64) < 0.01
    finally:
        b.close()


def test_the_prefill_clock_measures_the_streams_time_between_prefill_batches(gds_dir, monkeypatch, caplog):
    """The fit sees a batch's GPU time only; the time between prefill batches (decode steps, the
    GPU idle while the scheduler prepares the next) is measured from the same events and logged
    every window, and a pause longer than `GAP_MAX_S` (no work) is not a gap."""
    monkeypatch.setattr(prefill_mod, "GAP_WINDOW", 4)
    monkeypatch.setattr(prefill_mod, "GAP_MAX_S", 0.5)
    b, _ = open_backend(gds_dir)
    try:
        _, _, pol = make_cache(b)
        mode = types.SimpleNamespace(is_extend=lambda: True, is_mixed=lambda: False)
        batch = types.SimpleNamespace(forward_mode=mode, extend_lens=[4000], prefix_lens=[0])
        worker = object()
        hooks.around_forward(lambda w, bt: time.sleep(0.01), worker, batch)  # the first: kernels compile
        assert pol.clock.gaps() == {}
        pauses = [0.6, 0.03, 0.03, 0.03]  # the first after the warm-up batch: a server without work
        with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.policy"):
            for pause in pauses:
                time.sleep(pause)
                hooks.around_forward(lambda w, bt: time.sleep(0.02), worker, batch)
                pol.poll()
        got = pol.stats()["prefill_gaps"]
        assert got["batches"] == 4 and got["gaps"] == 3
        assert 0.08 <= got["gpu_s"] < 0.4  # four batches of 20 ms (wall clock on a machine without a GPU)
        assert 0.09 <= got["gap_s"] < 0.3 and 30 <= got["gap_median_ms"] < 100 and got["gap_max_ms"] < 500
        # what was forecast for them at launch: the first from the test's seed (4000 tokens x A), each
        # later one from the fit of the 20 ms batches before it
        assert 4000 * A + 0.04 <= got["forecast_s"] < 4000 * A + 0.4 and 0.5 <= got["ran_over_forecast"] <= 2.0
        # this policy's clock logged its window once (policies other tests left in this process see the
        # same batches and log their own windows)
        mine = (f"prefill clock: 4 prefill batches ran {got['gpu_s']:.3f} s on the GPU (forecast at launch "
                f"{got['forecast_s']:.3f} s; per batch ran/forecast median {got['ran_over_forecast']:.2f}); between "
                f"them the stream spent {got['gap_s']:.3f} s elsewhere (decode steps, idle; 3 gaps")
        assert sum(mine in r.getMessage() for r in caplog.records) == 1
    finally:
        b.close()


class _Running:
    """A CUDA event the GPU has not reached yet."""

    def query(self) -> bool:
        return False


def test_a_prefill_in_progress_counts_in_the_gpu_backlog_once_and_chunk_after_chunk(gds_dir, monkeypatch):
    """SGLang's overlapped scheduler launches a long prompt's next chunk while the GPU still runs
    the one before, caches a chunk as soon as it is launched, and admits arrivals in between. The
    backlog is the chunks one after another from the first's launch, then what of the chunked
    request no batch has reached."""
    b, _ = open_backend(gds_dir)
    try:
        cache, _, pol = make_cache(b)
        model = pol.model(b)
        monkeypatch.setattr(prefill_mod, "_event", _Running)
        mode = types.SimpleNamespace(is_extend=lambda: True, is_mixed=lambda: False)
        long = req("long", 32768)
        for k in range(2):  # the second chunk launched right after the first, both on the GPU
            batch = types.SimpleNamespace(forward_mode=mode, extend_lens=[8192], prefix_lens=[8192 * k], reqs=[long])
            hooks.around_forward(lambda w, bt: None, object(), batch)
        t0 = pol.clock.pending[0].t0
        chunk = 8192 * A
        # 0.6 chunks later: the first has 0.4 left and the second all of its own after it
        assert pol.clock.in_flight(t0 + 0.6 * chunk) == pytest.approx(1.4 * chunk, rel=0.01)
        # the first seen finished (SGLang admits arrivals right then): the second has just started
        first = pol.clock.pending.popleft()
        assert pol.clock.in_flight(t0 + chunk) == pytest.approx(chunk, rel=0.01)
        pol.clock.pending.appendleft(first)
        assert pol.clock.in_flight(t0 + 3 * chunk) == 0.0
        long.prefix_indices = list(range(16384))  # SGLang cached both chunks at launch
        cache._test_scheduler.chunked_req = long
        _, total = pol.gpu_backlog(cache, model)
        in_flight = pol.clock.in_flight(time.perf_counter())
        assert 1.9 * chunk < in_flight <= 2 * chunk
        assert total == pytest.approx(in_flight + 16384 * A, rel=0.01)  # the last 16k once, not the chunks again
        long.prefix_indices = list(range(8192))  # cached one chunk behind: the same work left
        pol.backlog = None
        assert pol.gpu_backlog(cache, model)[1] == pytest.approx(total, rel=0.01)
    finally:
        b.close()


def test_a_broken_batch_forecast_never_becomes_a_gpu_backlog(gds_dir, monkeypatch, caplog):
    """On an H200 an early fit had attention alone (0.055 s per unit of attention sum): one
    8192-token batch was forecast at 1.8e6 s, and the chain of forecast batch ends carried it into
    every later admission. Such a forecast is logged once and counted as 0, and over-forecasts
    never outlast the batches pending (the backlog is at most their forecasts from now)."""
    b, _ = open_backend(gds_dir)
    try:
        cache, _, pol = make_cache(b)
        monkeypatch.setattr(prefill_mod, "_event", _Running)
        mode = types.SimpleNamespace(is_extend=lambda: True, is_mixed=lambda: False)

        def launch(n: int) -> None:
            batch = types.SimpleNamespace(forward_mode=mode, extend_lens=[n], prefix_lens=[0], reqs=[req("x", n)])
            hooks.around_forward(lambda w, bt: None, object(), batch)

        pol.prefill.seed_coefficients(0.0, 0.055, 0.0, "a broken fit")
        with caplog.at_level(logging.WARNING, logger="hicache_gds_sglang.policy"):
            launch(8192)
        assert "forecast at 1.8" in caplog.text and "counted as 0" in caplog.text
        assert pol.clock.in_flight(pol.clock.pending[0].t0) == 0.0
        pol.prefill.seed_coefficients(A, 0.0, 0.0, "test")
        launch(8192)  # a sane forecast after it: the broken one left nothing behind
        t1 = pol.clock.pending[-1].t0
        assert pol.clock.in_flight(t1) == pytest.approx(8192 * A, rel=0.01)
        # batches seen finished leave the backlog; a forecast never carries past the ones pending
        pol.clock.pending.clear()
        pol.clock.gpu_until = t1 + 1e6  # as the carried forecast was
        launch(4096)
        assert pol.clock.in_flight(pol.clock.pending[-1].t0) == pytest.approx(4096 * A, rel=0.01)
    finally:
        b.close()


def test_policy_metrics_reach_prometheus(gds_dir):
    prometheus_client = pytest.importorskip("prometheus_client")
    b, _ = open_backend(gds_dir, policy_read_gbps=1.25)
    try:
        cache, _, pol = make_cache(b)
        pol.counts["load"] += 2
        hooks._last_publish[0] = 0.0
        b.get_stats()
        reg = prometheus_client.REGISTRY
        assert reg.get_sample_value("hicache_gds:read_rate_bytes_per_second") == pytest.approx(1.25e9)
        assert reg.get_sample_value("hicache_gds:prefetch_decisions", {"decision": "load"}) == 2
        assert reg.get_sample_value("hicache_gds:breakeven_prefill_tokens_per_second") == pytest.approx(1.25e9 / BPT)
    finally:
        b.close()


_REGISTER = textwrap.dedent("""
    import argparse, sys
    import sglang.srt.plugins as P
    P.load_plugins()
    from sglang.srt.server_args import ServerArgs
    from hicache_gds_sglang import plugin, policy, policy_hooks
    p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)
    action = next(a for a in p._actions if a.dest == "hicache_storage_prefetch_policy")
    assert plugin._policy_ready, "policy hooks not registered"
    assert action.default == policy.POLICY and {"best_effort", "wait_complete", "timeout", policy.POLICY} <= set(
        action.choices), action.choices
    args = p.parse_args(["--model-path", "m", "--hicache-storage-prefetch-policy", "wait_complete"])
    assert args.hicache_storage_prefetch_policy == "wait_complete"
    cls = next(iter(policy_hooks.SUPPORTED))
    stop = "_can_terminate_prefetch" if hasattr(cls, "_can_terminate_prefetch") else "can_terminate_prefetch"
    for m in ("prefetch_from_storage", stop, "attach_storage_backend"):
        assert hasattr(getattr(cls, m), "__wrapped__"), m
    from sglang.srt.managers.cache_controller import HiCacheController
    assert hasattr(HiCacheController.prefetch_rate_limited, "__wrapped__")
    # a finished load's host pages protected until scheduled, where the scheduler imports
    # (here it needs the server's packages: the hooks themselves are tested with the cache's classes)
    batch = plugin._resolve(plugin._PROTECT[1])
    protects = batch is not None
    settle = cls.check_prefetch_progress if cls.__name__ == "HiRadixCache" else cls._handle_prefetch_result
    assert hasattr(settle, "__wrapped__") is protects
    assert batch is None or hasattr(batch, "__wrapped__") is protects
    # SGLang's prefill batch order is left alone (the removed policy_ready_first hooked it); a
    # chunked request's next chunk is hooked only where a split request may be held (0.5.17)
    from sglang.srt.managers.schedule_policy import PrefillAdder, SchedulePolicy
    for m in (SchedulePolicy.calc_priority, PrefillAdder.add_one_req):
        assert not hasattr(m, "__wrapped__"), m
    from hicache_gds_sglang import split_policy
    assert hasattr(PrefillAdder.add_chunked_req, "__wrapped__") is split_policy.PARK_HOOKED[0]
    assert split_policy.PARK_HOOKED[0] is (cls.__name__ == "HiRadixCache"), cls
    print("POLICY-OK", cls.__name__)
""")


def test_load_plugins_installs_the_policy_and_makes_it_the_default():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _REGISTER], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "POLICY-OK " + CACHE.__name__ in out.stdout, out.stderr[-4000:]


def test_without_decision_points_sglangs_policies_are_all_there_is(monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookType

    from hicache_gds_sglang import plugin
    monkeypatch.setattr(plugin, "_policy_ready", False)
    gone = "sglang.srt.mem_cache.no_such_cache.Cache"
    monkeypatch.setattr(plugin, "HOOKS", tuple(h._replace(target=f"{gone}.{h.target.rsplit('.', 1)[1]}")
                                              if h.group.startswith("policy@") else h for h in plugin.HOOKS))
    registered = []
    reg = types.SimpleNamespace(register=lambda *a: registered.append(a))
    with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.plugin"):
        plugin._register_policy(reg, HookType)
    assert registered == [] and plugin._policy_ready is False and "SGLang's own prefetch policies run" in caplog.text


def test_store_counters_reach_prometheus_under_their_defined_names(gds_dir):
    """SGLang's metrics read the same counters as `stats()` (`hicache_gds.stats.METRICS`), per pool."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from hicache_gds import metric_values
    b, _ = open_backend(gds_dir, policy_read_gbps=1.25)
    try:
        hooks._last_publish[0] = 0.0
        b.get_stats()
        want = {m.name: v for m, v in metric_values(b.stats()["kv"])}
        assert want["slots"] > 0 and "pages_written" in want
        reg = prometheus_client.REGISTRY
        for name, v in want.items():
            if name not in ("free_slots", "leased_slots_all", "reserved_slots_all"):  # may move between reads
                assert reg.get_sample_value(f"hicache_gds:{name}", {"pool": "kv"}) == v, name
    finally:
        b.close()


def test_a_fresh_store_decides_with_a_probed_read_rate(gds_dir, caplog):
    """Nothing configured, nothing persisted: the KV namespace's directories are read at attach
    (O_DIRECT), so the first L3 hit is weighed against a known rate, not recomputed for want of
    one ("load nan s"); the probe leaves no file behind. A configured rate wins over it."""
    with caplog.at_level(logging.INFO, logger="hicache_gds_sglang"):
        b, _ = open_backend(gds_dir)
    try:
        assert b.read_rate.rate and b.read_rate.source.startswith("probed at open"), b.read_rate.source
        assert "probed at open" in caplog.text
        dirs = b.stats()["kv"]["dirs"] if "dirs" in b.stats().get("kv", {}) else []
        assert not [f for d in dirs for f in os.listdir(d) if "probe" in f]
        cache, ctl, pol = make_cache(b)
        pol.current_req = req("fresh", 18000)
        admit(cache, "fresh", 18000 - 64, [])
        assert pol.last["t_load"] is not None and math.isfinite(pol.last["t_load"])
    finally:
        b.close()
    other = os.path.join(gds_dir, "other")
    os.makedirs(other)
    b, _ = open_backend(other, policy_read_gbps=1.5)
    try:
        assert b.read_rate.source.startswith("configured") and abs(b.read_rate.rate - 1.5e9) < 1
    finally:
        b.close()


_RANK = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    try:
        from sglang.srt.mem_cache.hiradix_cache import HiRadixCache as CACHE
    except ImportError:
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache as CACHE
    from hicache_gds_sglang import view
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cache = object.__new__(CACHE)  # what SGLang's own _all_reduce reads at TP=world, one PP stage
    cache.tp_world_size, cache.tp_group, cache.pp_rank, cache.pp_size, cache.pp_group = \\
        world, dist.group.WORLD, 0, 1, None
    cache.attn_cp_group = cache.attn_tp_group = None
    out = {"load": view.agree(cache, rank != 5, "MIN"),     # one rank cannot load: none does
           "stop": view.agree(cache, rank == 3, "MAX"),     # one rank stops: all stop
           "take": view.agree_int(cache, 1000 * (rank + 1) + 64, "MIN"),  # the tokens all of them hold
           "single": view.single_rank(cache)}
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    # gloo's threads can abort the interpreter's own teardown ("terminate called without an active
    # exception", seen once in CI after the work was done): leave without it
    import os
    os._exit(0)
""")


@pytest.mark.slow
def test_decisions_are_agreed_across_eight_tp_ranks_through_sglangs_all_reduce():
    """TP=8 (DeepSeek-V3 at TP=8): eight processes, a gloo group standing in for SGLang's TP group,
    SGLang's own cache class doing the reduction; every rank ends with the same verdicts although
    each started from its own."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), "8", port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(8)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert outs == [{"load": False, "stop": True, "take": 1064, "single": False}] * 8
