"""The prefetch timeline (`hicache_gds_sglang.trace`): its hooks over SGLang's own controller
methods (built without their constructors, as in test_policy), what each line records, the
points it finds in the installed release, and that a tracing error never reaches the call."""

from __future__ import annotations

import json
import logging
import queue
import types

import pytest
import torch

from hicache_gds_sglang import HiCacheGDS, trace
from hicache_gds_sglang.plugin import _resolve
from sgl_helpers import indices, keys, make_pool, page_bytes, poison, storage_config

from sglang.srt.managers.cache_controller import HiCacheController

try:
    from sglang.srt.managers.cache_controller import PrefetchOperation
    from sglang.srt.mem_cache.utils import get_hash_str
except ImportError:
    try:
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation
        from sglang.srt.mem_cache.utils import get_hash_str
    except ImportError as exc:
        pytest.skip(f"SGLang's prefetch classes do not import here ({exc})", allow_module_level=True)

PS = 64


def lines(caplog) -> list[dict]:
    out = []
    for r in caplog.records:
        msg = r.getMessage()
        if msg.startswith("hicache-gds trace {"):
            out.append(json.loads(msg.split(" ", 2)[2]))
    return out


@pytest.fixture
def ctl(gds_dir):
    pool = make_pool("mha", "page_first", pages=32, page_size=PS, layer_num=2, head_num=2, head_dim=64)
    b = HiCacheGDS(storage_config(gds_dir), pool)
    b.register_mem_host_pool_v2(pool, "kv")
    c = object.__new__(HiCacheController)
    c.enable_storage, c.storage_backend, c.storage_backend_type = True, b, "gds"
    c.page_size, c.prefetch_queue = PS, queue.Queue()
    c.get_hash_str = get_hash_str
    try:
        yield c, b, pool
    finally:
        b.close()


def test_env_switch(monkeypatch):
    monkeypatch.delenv(trace.ENV, raising=False)
    assert not trace.enabled()
    for value, on in (("1", True), ("true", True), ("", False), ("0", False), ("off", False)):
        monkeypatch.setenv(trace.ENV, value)
        assert trace.enabled() is on, value


def test_the_points_of_this_release_are_hooked_with_the_right_kinds(caplog):
    got = []
    registry = types.SimpleNamespace(register=lambda path, hook, kind: got.append((path, hook.__name__, kind)))
    kinds = types.SimpleNamespace(AFTER="after", AROUND="around")
    with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.trace"):
        hooked = trace.register(registry, kinds, _resolve)
    # the controller's prefetch path exists in both releases (0.5.17 and 0.5.23)
    for name in ("_storage_hit_query", "_page_get_zero_copy", "_generic_page_get", "_page_transfer"):
        assert f"{trace._CTL}.{name}" in hooked
    # the scheduler imports only where its GPU-side imports do; each point is hooked where it resolves
    assert hooked == [p for p in trace._POINTS if _resolve(p) is not None]
    assert all(kind == ("after" if hook.startswith("after_") else "around") for _, hook, kind in got)
    assert [p for p, _, _ in got] == hooked
    assert any("trace: on" in r.getMessage() for r in caplog.records)


def test_a_query_and_a_get_through_sglangs_own_methods_are_timed_and_counted(ctl, caplog):
    c, b, pool = ctl
    tokens = list(range(5 * PS))
    hashes = get_hash_str(tokens, None, page_size=PS)
    assert all(b.batch_set_v1(hashes[:4], indices(range(4), PS)))  # 4 of the 5 pages stored
    op = PrefetchOperation("r-7", tokens)
    with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.trace"):
        found, n = trace.around_query(HiCacheController._storage_hit_query, c, op)
        assert (found, n) == (hashes[:4], 4 * PS)  # SGLang's own answer, untouched
        op.hash_value, op.host_indices = found, indices(range(10, 14), PS)
        poison(pool, range(10, 14))
        trace.around_get(HiCacheController._page_get_zero_copy, c, op, found, op.host_indices)
    assert all(page_bytes(pool, s) == page_bytes(pool, d) for s, d in zip(range(4), range(10, 14)))
    q, g = lines(caplog)
    assert (q["ev"], q["rid"], q["tokens"], q["backend"]) == ("query", "r-7", 4 * PS, "gds")
    assert (g["ev"], g["rid"], g["pages"], g["landed"], g["backend"]) == ("get", "r-7", 4, 4, "gds")
    for rec in (q, g):
        assert 0 < rec["t0"] <= rec["t"]


def test_a_transfer_line_says_how_much_of_the_operation_landed(ctl, caplog):
    c, b, pool = ctl
    ks = keys(3)
    assert all(b.batch_set_v1(ks, indices(range(3), PS)))
    op = PrefetchOperation("r-8", list(range(3 * PS)))
    op.hash_value, op.host_indices = ks, indices(range(20, 23), PS)
    c.page_get_func, c.has_draft, c.prefetch_sync_queue = c._page_get_zero_copy, False, queue.Queue()
    poison(pool, range(20, 23))
    with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.trace"):
        trace.around_transfer(HiCacheController._page_transfer, c, op)
    assert all(page_bytes(pool, s) == page_bytes(pool, d) for s, d in zip(range(3), range(20, 23)))
    (t,) = lines(caplog)
    assert (t["ev"], t["rid"], t["landed"], t["pages"]) == ("transfer", "r-8", 3, 3)


def test_a_tracing_error_is_logged_once_and_the_call_goes_on(ctl, caplog):
    c, b, pool = ctl
    calls = []

    def original(controller, operation, hashes, *a):
        calls.append(len(hashes))
        return "result"

    broken = types.SimpleNamespace(request_id="r-9")  # no completed_tokens (0.5.17's count): the line fails
    trace._failed.discard("get")
    with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.trace"):
        assert trace.around_get(original, c, broken, ["a", "b"]) == "result"
        assert trace.around_get(original, c, broken, ["a"]) == "result"
    assert calls == [2, 1]
    warned = [r for r in caplog.records if "not traced" in r.getMessage()]
    assert len(warned) == 1 and "get" in warned[0].getMessage()


def test_queued_and_scheduled_lines(caplog):
    """`get_new_batch_prefill` returns SGLang's own `NextBatchPlan` (its `batch_to_run`, both
    releases) or a batch: each request scheduled is one line, once."""
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    def req(rid, n, prefix):  # the scheduler holds the prefix as a tensor of slots (empty: none)
        return types.SimpleNamespace(rid=rid, origin_input_ids=list(range(n)), prefix_indices=torch.arange(prefix),
                                     extend_input_len=n - prefix)

    r1, r2, r3 = req("r-1", 300, 128), req("r-2", 200, 64), req("r-3", 100, 0)
    with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.trace"):
        trace.after_queued(None, object(), r1)
        plan = NextBatchPlan(batch_to_run=types.SimpleNamespace(reqs=[r1]), running_batch=types.SimpleNamespace(reqs=[]))
        trace.after_scheduled(plan, object())
        trace.after_scheduled(plan, object())  # the same request again: no second line
        trace.after_scheduled(types.SimpleNamespace(reqs=[r1, r2, r3]), object())  # a bare batch
        trace.after_scheduled(NextBatchPlan(batch_to_run=None, running_batch=None), object())  # nothing to run
        trace.after_scheduled(None, object())
    q, s1, s2, s3 = lines(caplog)
    assert (q["ev"], q["tokens"]) == ("queued", 300)
    assert (s1["ev"], s1["rid"], s1["prefix"], s1["extend"]) == ("scheduled", "r-1", 128, 172)
    assert (s2["ev"], s2["rid"], s2["prefix"], s2["extend"]) == ("scheduled", "r-2", 64, 136)
    assert (s3["rid"], s3["prefix"], s3["extend"]) == ("r-3", 0, 100)
    assert "scheduled" not in trace._failed
