"""The compute-or-load cost model (`hicache_gds.costmodel`): fits, decisions, persistence, bad input."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_gds.costmodel import (HEAD_CANDIDATES, STATE_FILE, CostModel, LoadPace, PrefillModel, ReadRate,
                                   breakeven_prefill_rate, last_chunk, load_state, save_state, split_heads)

KIB = 1024
# An H200-like 32B shape: ~6.2k tokens/s at 18k tokens, 256 KiB of KV per token, a 1.4 GB/s disk.
A, B, C = 1 / 9000, 1.6e-9, 0.004


def truth(n: int, p: int, chunk: int = 8192, a: float = A, b: float = B, c: float = C) -> float:
    t, done = 0.0, 0
    while done < n:
        k = min(chunk, n - done)
        t += a * k + b * k * (p + done + k / 2) + c
        done += k
    return t


def fitted(rng: np.random.Generator, rows: int = 60, noise: float = 0.02, chunk: int = 8192, **kw) -> PrefillModel:
    pm = PrefillModel(chunk=chunk)
    for _ in range(rows):
        n = int(rng.integers(256, chunk + 1))
        p = int(rng.integers(0, 24000))
        pm.observe([n], [p], truth(n, p, chunk=10 ** 9, **kw) * (1 + rng.normal(0, noise)))
    return pm


def test_fit_recovers_the_superlinear_cost_from_noisy_batches():
    pm = fitted(np.random.default_rng(1))
    (a, b, c), source = pm.coefficients()
    assert source.startswith("measured (60 recent prefill batches)")
    assert a == pytest.approx(A, rel=0.1) and b == pytest.approx(B, rel=0.15) and c >= 0
    for n in (4000, 12000, 24000):  # chunked requests, longer than any batch seen
        assert pm.predict(n, 0) == pytest.approx(truth(n, 0), rel=0.05)
    # attention: the per-token cost grows with length
    assert pm.tokens_per_s(24000) < pm.tokens_per_s(4000)


def test_chunked_prediction_is_the_sum_of_its_chunks():
    pm = PrefillModel(chunk=8192)
    pm.seed_coefficients(A, B, C, "test")
    assert pm.predict(20000, 3000) == pytest.approx(truth(20000, 3000), rel=1e-12)


def test_fit_keeps_coefficients_non_negative_for_linear_data():
    rng = np.random.default_rng(2)
    pm = fitted(rng, b=0.0, c=0.0, noise=0.05)
    (a, b, c), _ = pm.coefficients()
    assert min(a, b, c) >= 0 and a == pytest.approx(A, rel=0.1)


def test_batches_of_several_requests_count_once_for_the_fixed_cost():
    rng = np.random.default_rng(3)
    pm = PrefillModel(chunk=8192)
    for _ in range(80):
        k = int(rng.integers(1, 5))
        news = rng.integers(100, 2000, size=k).tolist()
        prefixes = rng.integers(0, 9000, size=k).tolist()
        t = sum(A * n + B * n * (p + n / 2) for n, p in zip(news, prefixes)) + C
        pm.observe(news, prefixes, t)
    (a, b, c), _ = pm.coefficients()
    assert (a, b, c) == pytest.approx((A, B, C), rel=1e-3)


def test_seeds_answer_before_any_batch_and_say_so():
    pm = PrefillModel()
    assert pm.predict(1000) is None and pm.coefficients() == (None, "unknown")
    pm.seed_rate(20000, "configured (test)")
    assert pm.predict(10000) == pytest.approx(0.5) and pm.coefficients()[1] == "configured (test)"
    pm.observe([1000], [0], 0.05)  # one batch: a single rate
    assert pm.coefficients()[1].startswith("measured") and pm.predict(1000) == pytest.approx(0.05)


def test_read_rate_seed_fades_as_measured_gets_pile_up():
    r = ReadRate()
    assert r.rate is None and r.source == "unknown"
    r.seed(1e9, "persisted 3 s ago")
    assert r.rate == pytest.approx(1e9) and r.source == "persisted 3 s ago"
    r.observe(64 << 20, (64 << 20) / 2e9)  # half the seed's weight at 2 GB/s
    assert 1e9 < r.rate < 2e9 and "blended with persisted" in r.source
    for _ in range(8):
        r.observe(256 << 20, (256 << 20) / 2e9)
    assert r.rate == pytest.approx(2e9) and r.source.startswith("measured (9 recent gets")
    r.observe(0, 1.0)  # nothing read: ignored
    r.observe(4096, 0.0)
    assert r.total_gets == 9


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf")])
def test_bad_rates_are_refused(bad):
    with pytest.raises(ValueError, match="read rate"):
        ReadRate().seed(bad, "x")
    with pytest.raises(ValueError, match="prefill rate"):
        PrefillModel().seed_rate(bad, "x")
    with pytest.raises(ValueError, match="bytes_per_token"):
        CostModel(bad)
    with pytest.raises(ValueError):
        breakeven_prefill_rate(1e9, bad)


def test_prefill_observations_of_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="new-token counts"):
        PrefillModel().observe([1, 2], [0], 0.1)


def model(read_gbps: float = 1.4, chunk: int = 8192) -> CostModel:
    pm = PrefillModel(chunk=chunk)
    pm.seed_coefficients(A, B, C, "test")
    return CostModel(256 * KIB, read=ReadRate(read_gbps * 1e9, "test"), prefill=pm)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1024, 40000), frac=st.floats(0.05, 1.0), gbps=st.floats(0.2, 20.0))
def test_a_request_alone_takes_the_faster_of_load_and_recompute(n, frac, gbps):
    m = model(gbps)
    h = int(n * frac)
    d = m.decide(n, 0, h)
    load = h * 256 * KIB / (gbps * 1e9) + m.predict_compute(n - h, h)
    compute = m.predict_compute(n, 0)
    assert d.t_load == pytest.approx(load) and d.t_compute == pytest.approx(compute)
    assert d.action == ("load" if load < compute else "compute")
    assert min(d.t_load, d.t_compute) == pytest.approx(min(load, compute))


def test_loading_part_of_a_hit_is_never_better_than_all_or_none():
    """Sequential load-then-compute is concave in the loaded fraction (module docstring)."""
    m = model(1.4)
    for n in (8000, 18000, 30000):
        times = [m.predict_load(f * n * 256 * KIB) + m.predict_compute(n - int(f * n), int(f * n))
                 for f in np.linspace(0, 1, 41)]
        assert min(times) == pytest.approx(min(times[0], times[-1]))


def simulate_burst(m: CostModel, lengths: list[int]) -> tuple[float, float, list[str]]:
    """Admit a burst one request at a time as the policy does: each to the queue finishing it first."""
    g = d = 0.0
    actions = []
    for n in lengths:
        dec = m.decide(n, 0, n - n % 64, gpu_backlog=g, disk_backlog=d)
        actions.append(dec.action)
        if dec.load:
            d = m.predict_load((n - n % 64) * m.bytes_per_token, d)
        else:
            g += m.predict_compute(n, 0)
    return max(g, d), sum(m.predict_compute(n, 0) for n in lengths), actions


def test_a_burst_splits_between_the_disk_and_the_gpu_near_the_physical_optimum():
    m = model(1.4)
    lengths = [12000 + 1700 * i for i in range(8)]  # 12k-24k tokens, as issue 20's burst
    makespan, recompute, actions = simulate_burst(m, lengths)
    assert "load" in actions and "compute" in actions
    w = sum(lengths)
    disk_tok_s = 1.4e9 / (256 * KIB)
    gpu_tok_s = w / recompute
    optimum = w / (disk_tok_s + gpu_tok_s)
    assert makespan <= 1.2 * optimum and makespan <= 0.65 * recompute


def test_in_flight_waits_while_the_gpu_is_busy_and_stops_when_idle_and_the_disk_is_slow():
    m = model(0.5)  # a slow disk: this hit is not worth loading alone
    n = 18000
    assert m.decide(n, 0, n).action == "compute"
    busy = m.decide(n, 0, n, kept=4096, fetched=6000, in_flight=True, gpu_backlog=20.0)
    assert busy.action == "wait" and "busy" in busy.reason
    idle = m.decide(n, 0, n, kept=4096, fetched=6000, in_flight=True)
    assert idle.action == "stop" and idle.t_compute < idle.t_load
    # what was kept is not recomputed
    assert idle.t_compute == pytest.approx(m.predict_compute(n - 4096, 4096))


def test_the_stop_rule_agrees_with_admission_and_has_hysteresis():
    m = model(1.4)
    n = 20000
    # find the read rate where loading and computing this hit tie, then move 2 % either side
    tie = n * 256 * KIB / (m.predict_compute(n, 0) - m.predict_compute(0, n))
    for gbps, admitted in ((tie * 1.02 / 1e9, "load"), (tie * 0.98 / 1e9, "compute")):
        mm = model(gbps)
        assert mm.decide(n, 0, n).action == admitted
        # nothing loaded yet, GPU idle: a load just below the tie is not stopped (margin 5 %)
        assert mm.decide(n, 0, n, in_flight=True).action == "wait"
    assert model(tie * 0.9 / 1e9).decide(n, 0, n, in_flight=True).action == "stop"


def test_load_pace_is_the_median_overrun_of_finished_loads_and_scales_every_load_time():
    pace = LoadPace()
    m = CostModel(1000.0, read=ReadRate(1e9, "t"), prefill=PrefillModel(6000.0, "t"), pace=pace)
    assert m.predict_load(1e9, 2.0) == pytest.approx(3.0)
    pace.observe(2.0, 3.0)  # 1.5x
    pace.observe(2.0, 2.6)  # 1.3x
    assert pace.factor == 1.0 and m.estimates()["loads_paced"] == 2  # not before three loads
    pace.observe(4.0, 40.0)  # an outlier (a stalled disk): the median ignores it
    assert pace.factor == pytest.approx(1.5)
    assert m.predict_load(1e9, 2.0) == pytest.approx(2.0 + 1.5)  # the backlog is already in paced seconds
    # a forecast made with a pace is judged against what the read rate alone said
    pace.observe(1.5 * 2.0, 1.5 * 2.0 * 1.2, pace_used=1.5)  # 1.8x the unpaced forecast
    assert pace.factor == pytest.approx((1.5 + 1.8) / 2)
    for _ in range(20):
        pace.observe(1.0, 10.0)
    assert pace.factor == 2.0 and m.estimates()["load_pace"] == 2.0  # bounded
    for bad in ((0.0, 1.0), (1.0, 0.0), (math.inf, 1.0), (1.0, math.nan), (-1.0, 1.0)):
        pace.observe(*bad)
    assert m.estimates()["loads_paced"] == 16
    faster = LoadPace()
    for _ in range(3):
        faster.observe(2.0, 0.2)
    assert faster.factor == 0.8


def test_without_estimates_it_loads_as_the_engine_would():
    m = CostModel(128 * KIB)
    d = m.decide(10000, 0, 10000)
    assert d.action == "load" and math.isnan(d.t_load) and "no read rate" in d.reason
    assert m.decide(10000, 0, 10000, in_flight=True).action == "wait"


def test_state_round_trips_and_only_measured_estimates_seed(tmp_path):
    pm = fitted(np.random.default_rng(4))
    m = CostModel(256 * KIB, read=ReadRate(), prefill=pm)
    m.observe_load(1 << 30, 0.7)
    path = str(tmp_path / STATE_FILE)
    assert save_state(path, m.state())
    assert os.listdir(tmp_path) == [STATE_FILE]  # tmp + rename, nothing left behind
    st_ = load_state(path)
    fresh = CostModel(256 * KIB)
    seeded = fresh.seed_from_state(st_)
    assert len(seeded) == 2 and fresh.read.rate == pytest.approx(m.read.rate)
    assert fresh.read.source.startswith("persisted") and fresh.prefill.coefficients()[1].startswith("persisted")
    assert fresh.predict_compute(18000) == pytest.approx(m.predict_compute(18000))
    # a state written from seeds alone (nothing measured) seeds nothing
    unmeasured = CostModel(256 * KIB, read=ReadRate(1e9, "configured"), prefill=PrefillModel(5000, "configured"))
    assert CostModel(256 * KIB).seed_from_state(unmeasured.state()) == []


def test_unreadable_state_is_ignored(tmp_path):
    p = tmp_path / STATE_FILE
    assert load_state(str(p)) is None
    p.write_text("{not json")
    assert load_state(str(p)) is None
    p.write_text(json.dumps({"version": 1, "read_bytes_per_s": "fast", "read_source": "measured"}))
    assert CostModel(1024).seed_from_state(load_state(str(p))) == []
    assert not save_state(str(tmp_path / "no" / "such" / STATE_FILE), {"x": 1})


def test_breakeven_and_estimates():
    assert breakeven_prefill_rate(1.6e9, 256 * KIB) == pytest.approx(1.6e9 / 262144)
    est = model(1.6).estimates()
    assert est["read_gbps"] == pytest.approx(1.6) and est["breakeven_prefill_tokens_per_s"] == pytest.approx(
        1.6e9 / 262144)
    assert est["prefill_coefficients"] == {"a": A, "b": B, "c": C}


def test_a_batch_costs_its_requests_terms_and_one_fixed_cost():
    m = PrefillModel()
    m.seed_coefficients(2e-5, 5e-9, 0.01, "test")
    assert m.predict_batch([8192], [4096]) == pytest.approx(m.predict(8192, 4096))
    two = m.predict_batch([8192, 1000], [0, 20000])
    assert two == pytest.approx(m.predict(8192, 0) + m.predict(1000, 20000) - 0.01)
    assert m.predict_batch([], []) == 0.0
    with pytest.raises(ValueError, match="2 new-token counts but 1 prefixes"):
        m.predict_batch([1, 2], [0])
    assert PrefillModel().predict_batch([8192], [0]) is None


# -- split: the head computed while the tail loads ---------------------------------------------------
def split_time(m: CostModel, n: int, h: int, k: int, g: float, d: float, chunk: int, grain: int | None) -> tuple[float, int]:
    """The module docstring's t_S for head k, written out independently of `CostModel.split`."""
    tok_s = m.read.rate / m.bytes_per_token
    readable = int(max(0.0, g + m.predict_compute(k - chunk, 0) - d) * tok_s) // 64 * 64
    if readable < h - k and grain:
        readable = readable // grain * grain
    f = min(h - k, readable)
    return g + m.predict_compute(k, 0) + m.predict_compute(n - k - f, k + f), f


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2048, 40000), g=st.floats(0.0, 8.0), d=st.floats(0.0, 4.0), gbps=st.floats(0.3, 6.0),
       grain=st.sampled_from([None, 64 * 128]))
def test_a_split_is_the_best_head_of_whole_chunks_and_taken_only_where_it_finishes_first(n, g, d, gbps, grain):
    m = model(gbps, chunk=4096)
    h = (n - 1) // 64 * 64
    base = m.decide(n, 0, h, gpu_backlog=g, disk_backlog=d)
    dec = m.decide(n, 0, h, gpu_backlog=g, disk_backlog=d, page=64, split_chunk=4096, split_grain=grain)
    heads = [(split_time(m, n, h, k, g, d, 4096, grain), k) for k in range(4096, h, 4096)]
    heads = [(t, f, k) for (t, f), k in heads if f > 0]
    if dec.action == "split":
        t, f, k = min(heads)
        assert (dec.tokens, dec.tail) == (k, f) and k % 4096 == 0 and 0 < k < h
        assert dec.t_load == pytest.approx(t) and t * 1.05 < min(base.t_load, base.t_compute)
        assert grain is None or f == h - k or f % grain == 0  # a tail counts read a get at a time
    else:
        assert dec.action == base.action
        assert not heads or min(heads)[0] * 1.05 >= min(base.t_load, base.t_compute) - 1e-9


def test_a_split_needs_a_tail_read_in_time_and_pays_alone_where_load_and_compute_are_close():
    m = model(1.6, chunk=8192)  # an 18k-token hit: recompute 2.35 s, load 3.0 s
    n = 18496
    h = n - 64
    assert m.split(n, 0, h, chunk=8192) is not None
    dec = m.decide(n, 0, h, page=64, split_chunk=8192)
    assert dec.action == "split" and dec.tokens == 16384 and dec.tail == h - 16384
    assert dec.t_load < min(m.decide(n, 0, h).t_load, m.decide(n, 0, h).t_compute)
    # the overlapped scheduler joins a chunk early: a head of one chunk gives the disk no time alone
    assert m.split(12352, 0, 12288, chunk=8192) is None
    # behind a GPU backlog the disk reads the tail of a one-chunk head
    assert m.split(12352, 0, 12288, chunk=8192, gpu_backlog=2.0)[0] == 8192
    # a hit no longer than a chunk, or unknown rates: no split
    assert m.split(8000, 0, 8000, chunk=8192) is None
    assert CostModel(256 * KIB, prefill=m.prefill).split(n, 0, h, chunk=8192) is None
    # a tail counts read a get at a time: never sooner than page by page
    slow = model(0.6, chunk=8192)
    got = slow.split(40064, 0, 40000, chunk=8192, gpu_backlog=0.5)
    grained = slow.split(40064, 0, 40000, chunk=8192, gpu_backlog=0.5, grain=8192)
    assert got is not None and got[2] % 64 == 0
    assert grained is not None and (grained[2] == 40000 - grained[0] or grained[2] % 8192 == 0)
    assert grained[1] >= got[1]


def test_seed_read_rate_configured_then_persisted_then_probed(tmp_path):
    """Every adapter seeds its read rate one way: configured, else an earlier run's measurement
    (only one of this version, only one measured), else a probe of the directories, else none."""
    import time as _time

    from hicache_gds import ReadRate, seed_read_rate
    from hicache_gds.rates import _STATE_VERSION
    r = ReadRate()
    assert "configured (policy_read_gbps)" in seed_read_rate(r, configured=2e9, key="policy_read_gbps")
    assert r.rate == pytest.approx(2e9) and not r.seed_alone  # set for the rank as it serves
    st = {"version": _STATE_VERSION, "saved_at": _time.time(), "read_bytes_per_s": 1.5e9, "read_source": "measured"}
    r = ReadRate()
    assert "persisted" in seed_read_rate(r, state=st, dirs=[str(tmp_path)], probe_bytes=8 << 20) and r.rate == pytest.approx(1.5e9)
    assert not r.seed_alone  # learnt from gets as they were served
    r = ReadRate()
    said = seed_read_rate(r, state={**st, "read_source": "configured"}, dirs=[str(tmp_path)], probe_bytes=8 << 20)
    assert "probed at open" in said and r.rate > 0 and os.listdir(tmp_path) == []  # the probe leaves no file
    assert r.seed_alone  # read by this process alone: `hicache_gds_sglang.ranks.seed` shares it
    r.seed(1e9, "agreed")
    assert not r.seed_alone
    r = ReadRate()
    assert "read_probe is 0" in seed_read_rate(r, dirs=[str(tmp_path)]) and r.rate is None


def test_a_parked_split_balances_the_head_against_the_tail_where_an_unparked_one_loses_to_the_load():
    # the fast device of the GPU machine: 3.66 GB/s, 8B shape (128 KiB per token), chunks of 8192,
    # prefill fitted on its recompute (a per token, b attention): C(26688) ~ 1.9 s, L(26624) ~ 0.95 s
    pm = PrefillModel()
    pm.seed_coefficients(1.66e-5, 4.11e-9, 0.0, "test")
    m = CostModel(128 * KIB, read=ReadRate(3.66e9, "test"), prefill=pm)
    new, hit = 26688, 26624
    plain = m.decide(new, 0, hit, page=64, split_chunk=8192)
    assert plain.action == "load"  # the head's last chunk starts too late for much of the tail
    parked = m.decide(new, 0, hit, page=64, split_chunk=8192, split_park=True)
    assert parked.action == "split" and parked.tokens == 8192 and parked.tail == hit - 8192
    t_head, t_tail = m.predict_compute(8192), m.predict_load((hit - 8192) * 128 * KIB)
    assert parked.t_load == pytest.approx(max(t_head, t_tail) + m.predict_compute(new - hit, hit))
    assert parked.t_load < 0.75 * plain.t_load and "waiting for them" in parked.reason
    # a head never waits for a tail that a whole load would beat, nor for what the disk cannot read
    slow = CostModel(128 * KIB, read=ReadRate(0.02e9, "test"), prefill=pm)
    assert slow.decide(new, 0, hit, page=64, split_chunk=8192, split_park=True).action == "compute"
    assert m.decide(new, 0, 8192, page=64, split_chunk=8192, split_park=True).action != "split"


def test_cut_heads_are_whole_pages_spread_over_the_hit_with_every_whole_chunk_head():
    assert split_heads(26624, 8192, 64) == [8192, 16384, 24576]
    heads = split_heads(26624, 8192, 64, cut=True)
    assert {8192, 16384, 24576} <= set(heads) and heads == sorted(set(heads))
    assert all(k % 64 == 0 and 0 < k < 26624 for k in heads)
    assert len(heads) <= HEAD_CANDIDATES + 3 and heads[0] <= 26624 // HEAD_CANDIDATES + 64
    assert split_heads(640, 8192, 64, cut=True) == list(range(64, 640, 64))  # short hits: every page
    assert split_heads(64, 8192, 64, cut=True) == []  # no tail left
    assert [last_chunk(k, 8192) for k in (64, 8192, 13000, 16384, 16448)] == [64, 8192, 4808, 8192, 64]


def test_a_cut_head_balances_a_short_hit_between_the_gpu_and_the_disk_where_whole_chunks_cannot():
    # the fast device of the GPU machine (as above): a 10,240-token hit, one chunk and 2,048 tokens
    pm = PrefillModel()
    pm.seed_coefficients(1.66e-5, 4.11e-9, 0.0, "test")
    m = CostModel(128 * KIB, read=ReadRate(3.66e9, "test"), prefill=pm)
    new, hit = 10304, 10240
    whole = m.decide(new, 0, hit, page=64, split_chunk=8192, split_park=True)
    cut = m.decide(new, 0, hit, page=64, split_chunk=8192, split_park=True, split_cut=True)
    assert cut.action == "split" and cut.tokens % 64 == 0 and 0 < cut.tokens < 8192
    assert cut.t_load < 0.75 * min(whole.t_load, m.decide(new, 0, hit).t_load)
    t_head, t_tail = m.predict_compute(cut.tokens), m.predict_load((hit - cut.tokens) * 128 * KIB)
    assert cut.t_load == pytest.approx(max(t_head, t_tail) + m.predict_compute(new - hit, hit))
    assert abs(t_head - t_tail) < 0.3 * max(t_head, t_tail)  # near the balance of the GPU and the disk
    # unparked: the head's last (cut) chunk starts the join deadline
    plain = m.split(new, 0, hit, chunk=8192, page=64, cut=True)
    if plain is not None:
        k, t, f = plain
        s_k = m.predict_compute(k - last_chunk(k, 8192))
        assert f <= int(s_k * 3.66e9 / (128 * KIB)) // 64 * 64 + 64
    # a hit of one page leaves no tail; unknown rates: no split
    assert m.split(128, 0, 64, chunk=8192, page=64, cut=True) is None
    assert CostModel(128 * KIB, prefill=pm).split(new, 0, hit, chunk=8192, page=64, cut=True) is None


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2048, 40000), g=st.floats(0.0, 4.0), d=st.floats(0.0, 2.0), gbps=st.floats(0.3, 12.0))
def test_cut_heads_never_forecast_later_than_whole_chunks(n, g, d, gbps):
    m = model(gbps, chunk=4096)
    h = (n - 1) // 64 * 64
    kw = dict(gpu_backlog=g, disk_backlog=d, page=64, split_chunk=4096, split_park=True)
    whole, cut = m.decide(n, 0, h, **kw), m.decide(n, 0, h, split_cut=True, **kw)
    assert min(cut.t_load, cut.t_compute) <= min(whole.t_load, whole.t_compute) + 1e-9
    if cut.action == "split":
        assert cut.tokens % 64 == 0 and 0 < cut.tokens < h


def test_both_adapters_seed_keys_are_the_cores_with_their_old_names_as_aliases(caplog):
    """One set of seed keys (`hicache_gds.SEED_KEYS`) for the SGLang and vLLM adapters; their old
    names convert and log a deprecation line; one key given twice differently, or not positive,
    is an error naming it."""
    import logging

    from hicache_gds import ConfigError, seed_settings
    from hicache_gds import rates
    rates._DEPRECATED_SEEN.clear()
    assert seed_settings({"read_bytes_per_s": "2e9", "prefill_tokens_per_s": 9000}) == \
        {"read_bytes_per_s": 2e9, "prefill_tokens_per_s": 9000.0}
    with caplog.at_level(logging.WARNING, logger="hicache_gds.rates"):
        assert seed_settings({"policy_read_gbps": 2.5}) == {"read_bytes_per_s": pytest.approx(2.5e9)}
        assert seed_settings({"load_bytes_per_s": 3e9, "policy_prefill_tokens_per_s": "7000"}) == \
            {"read_bytes_per_s": 3e9, "prefill_tokens_per_s": 7000.0}
    assert "policy_read_gbps is deprecated; use read_bytes_per_s" in caplog.text
    assert "load_bytes_per_s is deprecated; use read_bytes_per_s" in caplog.text
    assert seed_settings({"read_bytes_per_s": 2e9, "policy_read_gbps": 2}) == {"read_bytes_per_s": 2e9}
    with pytest.raises(ConfigError, match="read_bytes_per_s twice"):
        seed_settings({"read_bytes_per_s": 2e9, "load_bytes_per_s": 1e9})
    with pytest.raises(ConfigError, match="load_bytes_per_s: expected a positive number"):
        seed_settings({"load_bytes_per_s": 0})
    assert seed_settings(None) == {} and seed_settings({"read_bytes_per_s": ""}) == {}
