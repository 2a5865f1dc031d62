"""Load or recompute: the manager reports a hit only where loading beats recomputing, given the
queues -- with the core's `hicache_gds.costmodel.CostModel`, the model the SGLang policy asks."""

from __future__ import annotations

import hashlib

import pytest
from test_spec import BASE_EXTRA, make_config
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm_harness import BLOCK, Engine

from hicache_gds import ConfigError
from hicache_gds.costmodel import CostModel
from hicache_gds_vllm import HiCacheGDSOffloadingSpec
from hicache_gds_vllm.costmodel import cost_model_from
from hicache_gds_vllm.manager import HiCacheGDSManager

CHUNK = 32 * 64 * 1024 * 4  # Llama-3-8B: 8 MiB per chunk of 4 blocks (64 tokens)
TOKENS = 64
PER_TOKEN = CHUNK // TOKENS  # 128 KiB of KV per token
PROMPT = list(range(1, 131))


def key(i: int):
    return make_offload_key(hashlib.sha256(str(i).encode()).digest(), 0)


def test_cost_model_from_extra_config():
    assert cost_model_from({"cost_model": "off"}, PER_TOKEN) is None
    m = cost_model_from({"prefill_tokens_per_s": "5000", "load_bytes_per_s": 3e9}, PER_TOKEN, chunk=8192)
    assert isinstance(m, CostModel) and m.bytes_per_token == PER_TOKEN and m.prefill.chunk == 8192
    assert m.read.rate == pytest.approx(3e9) and m.prefill.tokens_per_s(1000) == pytest.approx(5000)
    assert m.read.source == "configured read_bytes_per_s"
    m = cost_model_from({"read_bytes_per_s": 2e9}, PER_TOKEN)  # the core's key, as the SGLang adapter's
    assert m.read.rate == pytest.approx(2e9) and m.read.source == "configured read_bytes_per_s"
    # Nothing known: the model says load (what the adapter does without one).
    unknown = cost_model_from({}, PER_TOKEN)
    assert unknown.read.rate is None and unknown.decide(1000, 0, 1000).action == "load"
    with pytest.raises(ConfigError, match="cost_model"):
        cost_model_from({"cost_model": "nonsense"}, PER_TOKEN)
    with pytest.raises(ConfigError, match="positive"):
        cost_model_from({"prefill_tokens_per_s": "-3"}, PER_TOKEN)
    plugged = cost_model_from({"cost_model": "test_costmodel:Pluggable", "prefill_tokens_per_s": 7}, PER_TOKEN)
    assert isinstance(plugged, Pluggable) and plugged.prefill.tokens_per_s(100) == pytest.approx(7)
    with pytest.raises(ConfigError, match="not a hicache_gds.costmodel.CostModel"):
        cost_model_from({"cost_model": "test_costmodel:NotAModel"}, PER_TOKEN)


class Pluggable(CostModel):
    """A cost model found by import path, built from the extra config."""

    def __init__(self, extra, bytes_per_token):
        super().__init__(bytes_per_token)
        self.prefill.seed_rate(float(extra["prefill_tokens_per_s"]), "test")


class NotAModel:
    def __init__(self, extra, bytes_per_token):
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


def test_idle_queues_and_cheap_loads_hit_at_once(gds_dir):
    # 4 GB/s read = 30.5k tokens/s of KV, faster than a 20k tokens/s prefill: one chunk pays.
    m = make_manager(gds_dir, load_bytes_per_s=4e9, prefill_tokens_per_s=20e3)
    stored(m, [key(i) for i in range(4)])
    m.note_request("r", 4 * TOKENS + 10, 0)
    assert scan(m, "r", [key(i) for i in range(5)]) == [LookupResult.HIT] * 4 + [LookupResult.MISS]
    assert m.advisor.last.action == "load"


def test_loads_slower_than_compute_are_misses(gds_dir):
    # 1 GB/s = 7.6k tokens/s of KV against a 20k tokens/s prefill: nothing is worth loading.
    m = make_manager(gds_dir, load_bytes_per_s=1e9, prefill_tokens_per_s=20e3)
    stored(m, [key(i) for i in range(4)])
    m.note_request("r", 4 * TOKENS + 10, 0)
    assert scan(m, "r", [key(i) for i in range(4)]) == [LookupResult.MISS]
    assert m.stats()["cost_misses"] == 1 and m.advisor.last.action == "compute"


def test_each_decision_is_one_line_in_the_engines_log(gds_dir, caplog, monkeypatch):
    """A request's decision is logged when it changes (what a running engine did), and in a vLLM
    server, where vLLM's own logger is the only one with a handler, the line goes through it."""
    import io
    import logging

    from hicache_gds_vllm.compat import log_through_vllm
    m = make_manager(gds_dir, load_bytes_per_s=1e9, prefill_tokens_per_s=20e3)
    stored(m, [key(i) for i in range(4)])
    m.note_request("r", 4 * TOKENS + 10, 0)
    with caplog.at_level(logging.INFO, logger="hicache_gds_vllm"):
        scan(m, "r", [key(i) for i in range(4)])
        scan(m, "r", [key(i) for i in range(4)])  # still waiting, the same decision: not said again
    lines = [r.getMessage() for r in caplog.records if "hicache-gds-vllm cost:" in r.getMessage()]
    assert len(lines) == 1 and "r recompute at chunk 1" in lines[0] and f"{4 * TOKENS + 10} new tokens" in lines[0]

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    for name in ("hicache_gds", "hicache_gds_vllm"):
        lg = logging.getLogger(name)
        monkeypatch.setattr(lg, "handlers", [])
        monkeypatch.setattr(lg, "propagate", True)
        monkeypatch.setattr(lg, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as in a server: vLLM configures only "vllm"
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [handler])
    log_through_vllm()
    m.on_request_finished(ReqContext(req_id="r"))  # "q" alone: nothing queued ahead of it
    m.note_request("q", 4 * TOKENS + 10, 0)
    scan(m, "q", [key(i) for i in range(4)])
    assert "hicache-gds-vllm cost: q recompute" in out.getvalue()


@pytest.mark.parametrize("behind, loads", [(0, False), (1, False), (2, True)])
def test_requests_waiting_behind_make_a_slower_load_worth_it(gds_dir, behind, loads):
    """1 GB/s against a 20k tokens/s prefill: alone, recomputing finishes first (0.013 s against
    0.034 s). With requests added behind it, loading delays it by 0.020 s and frees 0.013 s of GPU
    for each of them: worth it from two on (the queue's mean TTFT falls)."""
    m = make_manager(gds_dir, load_bytes_per_s=1e9, prefill_tokens_per_s=20e3)
    keys = [key(i) for i in range(4)]
    stored(m, keys)
    for r in ["r"] + [f"b{i}" for i in range(behind)]:  # vLLM adds them at once; "r" is looked up first
        m.on_new_request(ReqContext(req_id=r))
    m.note_request("r", 4 * TOKENS + 10, 0)
    assert m.advisor.behind("r") == behind
    if not loads:
        assert scan(m, "r", keys) == [LookupResult.MISS]
        return
    assert scan(m, "r", keys) == [LookupResult.RETRY] * 4  # the run is judged on the next scan
    assert scan(m, "r", keys) == [LookupResult.HIT] * 4
    assert m.advisor.last.action == "load" and "wait behind" in m.advisor.last.reason
    m.on_request_finished(ReqContext(req_id="b0"))
    assert m.advisor.behind("r") == behind - 1


def test_one_chunk_over_a_batch_boundary_does_not_make_a_slow_run_a_hit(gds_dir):
    """With a fixed cost per prefill batch, the first chunk of a prompt one chunk longer than whole
    batches "saves" a batch when batches are counted whole (266 tokens in batches of 128: three;
    202: two). The first scan's shortcut judges that chunk at the margin instead, so a run that
    loads slower than it computes is a MISS -- and stays one while the request waits, step after
    step, instead of alternating with a HIT judged on the one chunk the MISS let vLLM scan.

    (An 8B-shape vLLM server loaded every 16,448-token revisit this way, at 2.4x recompute.)"""
    m = make_manager(gds_dir, load_bytes_per_s=1e9, prefill_tokens_per_s=20e3)
    m.cost.prefill.seed_coefficients(5e-5, 0.0, 8e-3, "test")  # 20k tokens/s plus 8 ms a batch
    m.cost.prefill.chunk = 2 * TOKENS
    keys = [key(i) for i in range(4)]
    stored(m, keys)
    new = 4 * TOKENS + 10
    m.note_request("r", new, 0)
    whole = m.cost.decide(new, 0, TOKENS)
    assert whole.action == "load"  # whole batches: one chunk seems to pay ...
    assert m.cost.decide(new, 0, TOKENS, smooth=True).action == "compute"  # ... at the margin it does not
    assert m.cost.decide(new, 0, 4 * TOKENS).action == "compute"  # nor does the run
    # All of it in the store would pay (no batch left to compute): the first scan looks for the run ...
    assert scan(m, "r", keys + [key(999)]) == [LookupResult.RETRY] * 4 + [LookupResult.MISS]
    for _ in range(3):  # ... which does not; waiting, it is looked up at every step
        assert scan(m, "r", keys + [key(999)]) == [LookupResult.MISS]
        assert m.advisor.last.action == "compute"
    assert m.stats()["cost_misses"] == 3


def test_a_disk_queue_defers_the_decision_to_the_run_found(gds_dir):
    """Behind a disk queue, a run must be long enough to pay it back: the first scan keeps going
    (RETRY) to find the run; the next scan answers from it."""
    m = make_manager(gds_dir, load_bytes_per_s=4e9, prefill_tokens_per_s=20e3)
    stored(m, [key(i) for i in range(40)])
    # 30 chunks of another request being stored: 240 MiB queued, ~63 ms; a chunk saves ~1.1 ms.
    m.prepare_store([key(100 + i) for i in range(30)], ReqContext(req_id="other"))
    assert m.stats()["inflight_bytes"] == 30 * CHUNK
    short = [key(i) for i in range(4)] + [key(999)]
    # A request of 4 chunks: even all of it loaded cannot pay the queue back, decided at once.
    m.note_request("tiny", 4 * TOKENS, 0)
    assert scan(m, "tiny", short) == [LookupResult.MISS]
    # A request of 100 chunks could pay it back, were enough of it stored: the run is looked for ...
    m.note_request("short", 100 * TOKENS, 0)
    assert scan(m, "short", short) == [LookupResult.RETRY] * 4 + [LookupResult.MISS]
    assert scan(m, "short", short) == [LookupResult.MISS]  # ... and 4 chunks cannot: recompute
    assert m.advisor.last.action == "compute"
    long = [key(i) for i in range(40)]
    m.note_request("long", 40 * TOKENS, 0)
    m.cost.prefill.seed_rate(2e3, "test")  # slower compute: a chunk saves ~30 ms, 3 chunks pay the queue back
    assert scan(m, "long", long) == [LookupResult.RETRY] * 40
    assert scan(m, "long", long) == [LookupResult.HIT] * 40
    assert m.stats()["cost_deferrals"] == 2 and m.stats()["cost_misses"] == 2


def test_a_busy_gpu_makes_a_slow_load_worth_it(gds_dir):
    """Loading loses to computing alone (1 GB/s against a 20k tokens/s prefill), but not behind a
    second of prefill queued for a request looked up first: the load runs while the GPU is busy."""
    m = make_manager(gds_dir, load_bytes_per_s=1e9, prefill_tokens_per_s=20e3)
    stored(m, [key(i) for i in range(4)])
    run = [key(i) for i in range(4)]
    m.note_request("alone", 4 * TOKENS, 0)
    assert scan(m, "alone", run) == [LookupResult.MISS]
    m.on_request_finished(ReqContext(req_id="alone"))
    m.note_request("first", 20_000, 0)  # one second of prefill, not scheduled yet
    m.note_request("second", 4 * TOKENS, 0)
    assert scan(m, "second", run) == [LookupResult.RETRY] * 4
    assert scan(m, "second", run) == [LookupResult.HIT] * 4
    assert m.advisor.last.action == "load" and m.advisor.gpu_backlog("second") == pytest.approx(1.0)
    # Once the first request's prefill is computed, nothing is queued ahead any more.
    m.note_scheduled({"first": 20_000}, {"first": 0})
    assert m.advisor.gpu_backlog("second") == 0.0


def test_behind_a_busy_gpu_the_part_of_a_run_that_loads_meanwhile_is_a_hit_and_no_more(gds_dir):
    """The disk (1 GB/s) is slower than the GPU (20k tokens/s): alone, no run pays. Behind 0.5 s
    of prefill queued ahead, the chunks that land within it cost nothing, and every chunk past them
    costs more to load than to compute: the scan answers HIT for those and MISS after them, where
    the whole run (and the old rule: all or nothing) would be a MISS. A HIT judged on a run found
    earlier covers that run only, however many chunks the next scan finds."""
    m = make_manager(gds_dir, load_bytes_per_s=1e9, prefill_tokens_per_s=20e3)
    run = [key(i) for i in range(100)]
    stored(m, run)
    m.note_request("first", 10_000, 0)  # 0.5 s of prefill, looked up first, not computed yet
    new = 100 * TOKENS
    m.note_request("second", new, 0)
    assert m.cost.decide(new, 0, new, gpu_backlog=0.5).action == "compute"  # all of it: a loss
    assert scan(m, "second", run) == [LookupResult.RETRY] * 100
    got = scan(m, "second", run)
    hidden = int(0.5 / (PER_TOKEN / 1e9)) // TOKENS  # chunks read within the 0.5 s: 59
    assert got == [LookupResult.HIT] * hidden + [LookupResult.MISS]
    assert m.advisor.last.action == "load"

    # judged on 3 chunks, then the next scan finds 100: the HIT covers the 3
    m.on_request_finished(ReqContext(req_id="second"))
    m.note_request("r", new, 0)
    assert scan(m, "r", run[:3] + [key(999)]) == [LookupResult.RETRY] * 3 + [LookupResult.MISS]
    assert scan(m, "r", run) == [LookupResult.HIT] * 3 + [LookupResult.MISS]


def test_queue_drains_when_jobs_complete_or_reset(gds_dir):
    m = make_manager(gds_dir, load_bytes_per_s=4e9, prefill_tokens_per_s=20e3)
    out = m.prepare_store([key(i) for i in range(3)], ReqContext(req_id="a"))
    assert m.stats()["inflight_bytes"] == 3 * CHUNK
    m.complete_store(out.keys_to_store, ReqContext(req_id="a"))
    assert m.stats()["inflight_bytes"] == 0
    m.prepare_load([key(0)], ReqContext(req_id="b"))
    assert m.stats()["inflight_bytes"] == CHUNK
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
        e = Engine(root_dir, d, connector="hicache", seed=71, extra={"cost_model": "on", **cost})
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
    e = Engine(root_dir, gds_dir, connector="hicache", seed=72, num_blocks=160, extra={"cost_model": "on"})
    try:
        e.add("A", list(range(1, 1100)))  # one step of >= 1024 tokens: a prefill-rate sample
        e.run()
        assert e.manager.cost.prefill.batches >= 1 and e.manager.cost.prefill.tokens_per_s(1000) > 0
        assert e.manager.cost.prefill.coefficients()[1].startswith("measured")
        assert e.scheduler.reset_prefix_cache()
        e.add("B", list(range(1, 1100)) + [3])
        e.run()
        assert e.load_jobs == 1 or e.manager.stats()["cost_misses"] == 1
        if e.load_jobs:
            assert e.manager.cost.read.total_gets == 1 and e.manager.cost.read.rate > 0
    finally:
        e.shutdown()


@pytest.fixture
def root_dir(tmp_path):
    return str(tmp_path)


def test_a_restarted_engine_starts_from_the_measured_estimates(root_dir, gds_dir):
    e = Engine(root_dir, gds_dir, connector="hicache", seed=73, num_blocks=160, extra={"cost_model": "on"})
    try:
        e.add("A", list(range(1, 1100)))
        e.run()
        coef, _ = e.manager.cost.prefill.coefficients()
    finally:
        e.shutdown()
    e = Engine(root_dir, gds_dir, connector="hicache", seed=73, num_blocks=160, extra={"cost_model": "on"})
    try:
        again, source = e.manager.cost.prefill.coefficients()
        assert source.startswith("persisted") and again == pytest.approx(coef)
    finally:
        e.shutdown()


def _prefix_hits(root: str, gds_path: str, connector, extra: dict, *, nb: int = 56, blocks: int = 24) -> dict:
    """Tokens each request found in vLLM's GPU prefix cache when scheduled: three prompts cold,
    revisited one at a time, then all at once (more KV than the GPU blocks hold)."""
    e = Engine(root, gds_path, connector=connector, seed=73, num_blocks=nb, extra=extra, max_num_seqs=8)
    prompts = [[1000 * (p + 1) + i for i in range(blocks * BLOCK)] for p in range(3)]
    seen: dict = {}
    schedule = e.scheduler.schedule

    def recording():
        so = schedule()
        seen.update({nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs})
        return so
    e.scheduler.schedule = recording
    try:
        for phase in ("cold", "revisit"):
            for p, toks in enumerate(prompts):
                e.add(f"{phase}{p}", toks + [1 if phase == "cold" else 2])
                e.run(2000)
        for p, toks in enumerate(prompts):
            e.add(f"burst{p}", toks + [3])
        e.run(4000)
        return seen
    finally:
        e.shutdown()


def test_recomputing_by_the_cost_model_keeps_vllms_gpu_prefix_hits(root_dir, gds_dir, monkeypatch):
    """A connector whose cost model recomputes leaves vLLM's GPU prefix cache as it would be without
    a connector, with stores still running while the engine steps: every request finds the same
    tokens there. (The GPU run's 32B `gds-cost` burst found 0 % there against recompute's 66 %:
    this rules out the scheduler's and the connector's logic; what is left is engine timing.)"""
    import os
    import time
    from hicache_gds_vllm import worker as W
    run = W.HiCacheGDSWorker._run

    def slow_store(self, job, scratch):
        if job.store:
            time.sleep(0.05)  # stores outlast several steps
        return run(self, job, scratch)
    monkeypatch.setattr(W.HiCacheGDSWorker, "_run", slow_store)
    monkeypatch.setattr(W.HiCacheGDSWorker, "drain", lambda self: time.sleep(0.005))  # no waiting per step
    d = os.path.join(gds_dir, "c")
    os.makedirs(d)
    plain = _prefix_hits(root_dir, gds_dir, None, {})
    ours = _prefix_hits(root_dir, d, "hicache", {"cost_model": "on", "load_bytes_per_s": 1e6,
                                                 "prefill_tokens_per_s": 1e9})
    assert ours == plain
    assert plain["revisit0"] > 0 and plain["burst2"] > 0 and plain["cold0"] == 0  # the cache served some


def test_step_clock_times_each_step_by_the_engines_own_pace():
    """The prefill samples of a 3-chunk prompt ("a": 8192, 8192, 64 tokens) then decodes: without
    async scheduling step N took until step N+1 was scheduled; with it (steps scheduled one ahead)
    until N+2 was, after N+1; an idle gap (no request shared by the two steps) is no sample."""
    from hicache_gds_vllm.connector import StepClock

    def run(clock, times, steps):
        return [clock.scheduled(t, news, {r: 0 for r in news}) for t, news in zip(times, steps)]
    steps = [{"a": 8192}, {"a": 8192}, {"a": 64}, {"a": 1}, {"a": 1}]
    # synchronous: each step scheduled when the one before finished (1.0 s, 1.1 s, 0.1 s ...)
    out = run(StepClock(False), [0.0, 1.0, 2.1, 2.2, 2.25], steps)
    assert out[0] is None and out[1] == ([8192], [0], 1.0) and out[2] == ([8192], [0], 1.1)
    assert out[3] is None  # 64 tokens: below PREFILL_SAMPLE_TOKENS
    # async: step 2 scheduled right after step 1 was dispatched; step 3 once step 1's output is in
    out = run(StepClock(True), [0.0, 0.01, 1.0, 2.1, 2.2], steps)
    assert out[:2] == [None, None] and out[2] == ([8192], [0], pytest.approx(0.99))
    assert out[3] == ([8192], [0], pytest.approx(1.1))
    # the engine idled between two steps that share no request: not a sample
    clock = StepClock(False)
    assert clock.scheduled(0.0, {"a": 8192}, {"a": 0}) is None
    assert clock.scheduled(30.0, {"b": 8192}, {"b": 0}) is None


def test_a_waiting_request_keeps_its_answer_near_a_tie(gds_dir):
    """A request looked up step after step keeps its last answer while the other one is less than
    the model's margin (5 %) sooner: the estimates' small drifts no longer flip it between load and
    recompute. A clear change of the rates still changes the answer, both ways."""
    m = make_manager(gds_dir, load_bytes_per_s=1e9, prefill_tokens_per_s=20e3)
    keys = [key(i) for i in range(4)]
    stored(m, keys)
    new = 8 * TOKENS  # half of it stored: the run found is weighed against the whole prefill
    m.note_request("r", new, 0)
    tie = TOKENS / (CHUNK / 1e9)  # the prefill rate at which a chunk loads as fast as it computes

    def plain(rate):
        m.cost.prefill.seed_rate(rate, "test")
        return m.cost.decide(new, 0, 4 * TOKENS).action

    assert plain(tie * 1.2) == "compute"
    assert scan(m, "r", keys) == [LookupResult.MISS]  # waiting: looked up again at the next step
    assert plain(tie * 0.98) == "load"  # loading 2 % sooner: not enough to change the answer
    assert scan(m, "r", keys) == [LookupResult.MISS]
    assert "recompute kept" in m.advisor.last.reason
    assert plain(tie * 0.8) == "load"  # 20 % sooner: it changes
    assert scan(m, "r", keys) == [LookupResult.HIT] * 4
    assert plain(tie * 1.02) == "compute"  # and back: computing 2 % sooner keeps the load
    assert scan(m, "r", keys) == [LookupResult.HIT] * 4
    assert "load kept" in m.advisor.last.reason
    assert plain(tie * 1.2) == "compute"
    assert scan(m, "r", keys)[0] is LookupResult.MISS


def test_a_fresh_manager_probes_the_read_rate_unless_told_or_persisted(gds_dir):
    """The read rate before the first load: configured (`load_bytes_per_s`), else an earlier run's
    persisted measurement, else an O_DIRECT probe of GDS_PATH at start (`read_probe` bytes, the
    SGLang adapter's way, `hicache_gds.seed_read_rate`); `read_probe` 0 leaves it unknown."""
    m = make_manager(gds_dir)
    assert m.cost.read.rate and m.cost.read.rate > 0 and m.cost.read.source.startswith("probed at open")
    m = make_manager(gds_dir, load_bytes_per_s=3e9)
    assert m.cost.read.rate == pytest.approx(3e9) and "configured" in m.cost.read.source
    m = make_manager(gds_dir, read_probe=0)
    assert m.cost.read.rate is None
