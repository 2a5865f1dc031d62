"""Load or recompute: the manager reports a hit only where loading beats recomputing, given the queue."""

from __future__ import annotations

import hashlib

import pytest
from test_spec import BASE_EXTRA, make_config
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm_harness import Engine

from hicache_gds import ConfigError
from hicache_gds_vllm import HiCacheGDSOffloadingSpec
from hicache_gds_vllm.costmodel import CostModel, RateModel, breakeven_chunks, cost_model_from
from hicache_gds_vllm.manager import HiCacheGDSManager

CHUNK = 32 * 64 * 1024 * 4  # Llama-3-8B: 8 MiB per chunk of 4 blocks (64 tokens)
TOKENS = 64
PROMPT = list(range(1, 131))


def key(i: int):
    return make_offload_key(hashlib.sha256(str(i).encode()).digest(), 0)


def test_breakeven_arithmetic():
    # 2 GB/s read, 20k tokens/s prefill: a chunk loads in 4.2 ms, computes in 3.2 ms -> never worth it.
    assert breakeven_chunks(RateModel(read_bytes_per_s=2e9, prefill_tokens_per_s=20e3), TOKENS, CHUNK, 0) is None
    # 4 GB/s: 2.1 ms to load, 3.2 ms to compute: one chunk pays off on an idle disk ...
    m = RateModel(read_bytes_per_s=4e9, prefill_tokens_per_s=20e3)
    assert breakeven_chunks(m, TOKENS, CHUNK, 0) == 1
    # ... behind 1 GB queued (250 ms), a run must save that: 250 / (3.2 - 2.1) ms = 229 chunks.
    need = breakeven_chunks(m, TOKENS, CHUNK, 1 << 30)
    load = m.load_seconds(need * CHUNK, 1 << 30)
    assert load <= m.compute_seconds(need * TOKENS) and m.load_seconds((need - 1) * CHUNK, 1 << 30) > \
        m.compute_seconds((need - 1) * TOKENS)
    # Unknown rates: loading wins (the adapter without a model).
    assert breakeven_chunks(RateModel(), TOKENS, CHUNK, 1 << 30) == 1
    assert breakeven_chunks(RateModel(read_bytes_per_s=1e9), TOKENS, CHUNK, 1 << 30) == 1


def test_rate_model_learns_from_observations():
    m = RateModel(alpha=0.5)
    m.observe_load(8 << 20, 0.004)
    assert m.read_rate == pytest.approx((8 << 20) / 0.004)
    m.observe_load(8 << 20, 0.008)
    assert m.read_rate == pytest.approx(0.5 * (8 << 20) / 0.004 + 0.5 * (8 << 20) / 0.008)
    fixed = RateModel(prefill_tokens_per_s=1000, fixed_prefill=True)
    fixed.observe_prefill(10_000, 1.0)
    assert fixed.prefill_rate == 1000  # a configured rate is the operator's word
    assert isinstance(m, CostModel)


def test_cost_model_from_extra_config():
    assert cost_model_from({"cost_model": "off"}) is None
    m = cost_model_from({"prefill_tokens_per_s": "5000", "load_bytes_per_s": 3e9})
    assert isinstance(m, RateModel) and m.prefill_rate == 5000 and m.read_rate == 3e9 and m.fixed_prefill
    with pytest.raises(ConfigError, match="cost_model"):
        cost_model_from({"cost_model": "nonsense"})
    with pytest.raises(ConfigError, match="positive"):
        cost_model_from({"prefill_tokens_per_s": "-3"})
    plugged = cost_model_from({"cost_model": "test_costmodel:Pluggable", "prefill_tokens_per_s": 7})
    assert isinstance(plugged, Pluggable) and plugged.prefill_rate == 7  # by import path, from the extra config
    with pytest.raises(ConfigError, match="lacks"):
        cost_model_from({"cost_model": "test_costmodel:NotAModel"})


class Pluggable(RateModel):
    """A cost model found by import path (as the core's will be), built from the extra config."""

    def __init__(self, extra):
        super().__init__(prefill_tokens_per_s=float(extra["prefill_tokens_per_s"]))


class NotAModel:
    def __init__(self, extra):
        pass


def make_manager(gds_dir, **cost):
    extra = {**BASE_EXTRA, "gds_path": gds_dir, "capacity": 128 * CHUNK, **cost}
    spec = HiCacheGDSOffloadingSpec(make_config(extra))
    return HiCacheGDSManager(spec, warm_start=False)


def stored(m, keys):
    out = m.prepare_store(keys, ReqContext(req_id="w"))
    m.complete_store(out.keys_to_store, ReqContext(req_id="w"))


def scan(m, req, keys):
    """One step's scan as vLLM does it: in prefix order, stopping at the first MISS."""
    ctx, out = ReqContext(req_id=req), []
    for k in keys:
        r = m.lookup(k, ctx)
        out.append(r)
        if r is LookupResult.MISS:
            break
    m.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    return out


def test_idle_disk_and_cheap_loads_hit_at_once(gds_dir):
    m = make_manager(gds_dir, load_bytes_per_s=4e9, prefill_tokens_per_s=20e3)
    stored(m, [key(i) for i in range(4)])
    assert scan(m, "r", [key(i) for i in range(5)]) == [LookupResult.HIT] * 4 + [LookupResult.MISS]


def test_loads_slower_than_compute_are_misses(gds_dir):
    m = make_manager(gds_dir, load_bytes_per_s=1e9, prefill_tokens_per_s=20e3)
    stored(m, [key(i) for i in range(4)])
    assert scan(m, "r", [key(i) for i in range(4)]) == [LookupResult.MISS]
    assert m.stats()["cost_misses"] == 1


def test_a_queue_defers_the_decision_to_the_run_found(gds_dir):
    """Behind a queue, a run must be long enough to pay it back: the first scan keeps going (RETRY)
    to find the run; the next scan answers from it."""
    m = make_manager(gds_dir, load_bytes_per_s=4e9, prefill_tokens_per_s=20e3)
    stored(m, [key(i) for i in range(40)])
    # 30 chunks of another request being stored: 240 MiB queued, ~63 ms; a chunk saves ~1.1 ms.
    m.prepare_store([key(100 + i) for i in range(30)], ReqContext(req_id="other"))
    need = breakeven_chunks(m.cost, TOKENS, m.chunk_bytes, m.stats()["inflight_bytes"])
    assert 4 < need < 100
    short = [key(i) for i in range(4)] + [key(999)]
    assert scan(m, "short", short) == [LookupResult.RETRY] * 4 + [LookupResult.MISS]
    assert scan(m, "short", short) == [LookupResult.MISS]  # 4 chunks cannot pay the queue back: recompute
    long = [key(i) for i in range(40)]
    m.cost.prefill_rate = 2e3  # slower compute: a chunk saves ~30 ms, 3 chunks pay the queue back
    assert breakeven_chunks(m.cost, TOKENS, m.chunk_bytes, m.stats()["inflight_bytes"]) == 3
    assert scan(m, "long", long) == [LookupResult.RETRY] * 40
    assert scan(m, "long", long) == [LookupResult.HIT] * 40
    assert m.stats()["cost_deferrals"] == 2 and m.stats()["cost_misses"] == 1


def test_queue_drains_when_jobs_complete_or_reset(gds_dir):
    m = make_manager(gds_dir, load_bytes_per_s=4e9, prefill_tokens_per_s=20e3)
    out = m.prepare_store([key(i) for i in range(3)], ReqContext(req_id="a"))
    assert m.stats()["inflight_bytes"] == 3 * m.chunk_bytes
    m.complete_store(out.keys_to_store, ReqContext(req_id="a"))
    assert m.stats()["inflight_bytes"] == 0
    m.prepare_load([key(0)], ReqContext(req_id="b"))
    assert m.stats()["inflight_bytes"] == m.chunk_bytes
    m.reset_cache()  # vLLM drops the jobs in flight: their completions never come
    assert m.stats()["inflight_bytes"] == 0


def test_engine_recomputes_when_loading_would_be_slower(root_dir, gds_dir):
    """vLLM's real scheduler: a revisit whose chunks load slower than they compute is recomputed
    (no load job); with the model off the same revisit loads."""
    import os
    for i, (cost, loads) in enumerate((({"load_bytes_per_s": 1e6, "prefill_tokens_per_s": 1e9}, 0),
                                       ({"cost_model": "off"}, 1))):
        d = os.path.join(gds_dir, str(i))
        os.makedirs(d)
        e = Engine(root_dir, d, connector="hicache", seed=71, extra={"cost_model": "rate", **cost})
        try:
            e.add("A", PROMPT)
            e.run()
            assert e.scheduler.reset_prefix_cache()
            e.poison()
            e.add("B", PROMPT + [5])
            e.run()
            assert e.load_jobs == loads
            e.check_kv("B", PROMPT)
        finally:
            e.shutdown()


def test_engine_measures_load_rate_and_prefill_rate(root_dir, gds_dir):
    e = Engine(root_dir, gds_dir, connector="hicache", seed=72, num_blocks=160, extra={"cost_model": "rate"})
    try:
        e.add("A", list(range(1, 1100)))  # one step of >= 1024 tokens: a prefill-rate sample
        e.run()
        assert e.manager.cost.prefills >= 1 and e.manager.cost.prefill_rate > 0
        assert e.scheduler.reset_prefix_cache()
        e.add("B", list(range(1, 1100)) + [3])
        e.run()
        assert e.load_jobs == 1 or e.manager.stats()["cost_misses"] == 1
        if e.load_jobs:
            assert e.manager.cost.loads == 1 and e.manager.cost.read_rate > 0
    finally:
        e.shutdown()


@pytest.fixture
def root_dir(tmp_path):
    return str(tmp_path)
