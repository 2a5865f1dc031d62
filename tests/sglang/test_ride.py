"""`ride`: finished loads ride along a chunked request's pass, and a pass waits a decode step where
that gives a finished load its GPU memory.

Each rule on its own here, with an adder that spends its budget as SGLang's does; SGLang 0.5.17's
real ``PrefillAdder`` and radix cache in `test_split.py`
(``test_a_finished_load_rides_along_a_chunked_requests_pass_in_sglangs_real_adder``).
"""

from __future__ import annotations

import logging
import types
from collections import Counter

import pytest

from hicache_gds_sglang import cut, policy_hooks, ride, view
from hicache_gds_sglang.records import Decided, Protected

AddReqResult = pytest.importorskip("sglang.srt.managers.schedule_policy").AddReqResult

PS = 64
CHUNK = 32 * PS


class Adder:
    """What the hooks read of SGLang's ``PrefillAdder``: a chunk budget, GPU room, a running batch;
    `add_chunked` and `add_one` spend the budget as SGLang's methods do (truncated at the budget,
    or nothing added where the room is short), and record what they were called with."""

    def __init__(self, cache, *, rem=CHUNK, room=10 ** 6, running=()):
        self.tree_cache, self.rem_chunk_tokens, self.rem_total_tokens = cache, rem, room
        self.running_batch = types.SimpleNamespace(reqs=list(running))
        self.prefill_max_requests = None
        self.can_run_list, self.new_chunked_req, self.calls = [], None, []

    def add_chunked(self, req):
        n = min(req.left, self.rem_chunk_tokens)
        req.extend = n
        self.rem_chunk_tokens -= n
        self.rem_total_tokens -= n
        self.can_run_list.append(req)
        return req if n < req.left else None

    def add_one(self, req, has_chunked_req=False, truncation_align_size=None):
        self.calls.append((req.rid, has_chunked_req, truncation_align_size))
        if self.prefill_max_requests == 0 or self.rem_chunk_tokens <= 0:
            return AddReqResult.OTHER
        need = req.left
        if req.need > self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if need > self.rem_chunk_tokens:  # SGLang would chunk it: refused under a truncation no chunk reaches
            if truncation_align_size is not None and truncation_align_size > self.rem_chunk_tokens:
                return AddReqResult.OTHER
            self.new_chunked_req = req
            need = self.rem_chunk_tokens
        req.extend = need
        self.rem_chunk_tokens -= need
        self.rem_total_tokens -= req.need
        self.can_run_list.append(req)
        return AddReqResult.OTHER if self.rem_chunk_tokens <= 0 else AddReqResult.CONTINUE


def _req(rid, left, need=0, *, max_new=8, out=0, prompt=0):
    return types.SimpleNamespace(rid=rid, left=left, need=need, extend=None, output_ids=[0] * out,
                                 origin_input_ids=[0] * prompt,
                                 sampling_params=types.SimpleNamespace(max_new_tokens=max_new))


@pytest.fixture
def world(monkeypatch):
    cfg = types.SimpleNamespace(ride=True, split_cut=True)
    backend = types.SimpleNamespace(policy_config=cfg)
    sched = types.SimpleNamespace(waiting_queue=[])
    cache = types.SimpleNamespace(page_size=PS, ongoing_prefetch={})
    pol = types.SimpleNamespace(tails={}, parked={}, counts=Counter(), decided={}, protected={}, ride_yields={},
                                scheduler=lambda: sched)
    monkeypatch.setattr(view, "attached", lambda c: pol if c is cache else None)
    monkeypatch.setattr(view, "backend_of", lambda c: backend)
    monkeypatch.setattr(view, "single_rank", lambda c: True)
    monkeypatch.setattr(cut, "CUT_HOOKED", [True])
    monkeypatch.setattr(view, "_logged", set())
    return types.SimpleNamespace(cfg=cfg, pol=pol, cache=cache, sched=sched)


def _loaded(w, rid, tokens=20_000, *, extra=PS):
    """A waiting request whose load of `tokens` is read and protected: `extra` tokens past it."""
    w.pol.decided[rid] = Decided("load", tokens + extra, 0, tokens)
    w.pol.protected[rid] = Protected(None, 0.0, tokens)
    req = _req(rid, extra, tokens + extra + 8 + PS, prompt=tokens + extra)
    w.sched.waiting_queue.append(req)
    return req


def _pass(w, adder, chunked, *, can_hold=True):
    """One prefill pass as SGLang's scheduler forms it: the chunked request, then the waiting
    queue in order until an add answers other than CONTINUE."""
    out = policy_hooks.hold_or_add(lambda a, r: a.add_chunked(r), adder, chunked, can_hold)
    for req in list(w.sched.waiting_queue):
        res = cut.around_add_one_req(Adder.add_one, adder, req, has_chunked_req=out is not None,
                                     truncation_align_size=None)
        if res != AddReqResult.CONTINUE:
            break
    return out


def test_a_finished_load_rides_along_the_chunked_requests_pass_whole(world):
    chunked = _req("c", 50_000)
    compute = _req("x", 19_000)  # decided compute, ahead of the load in the queue
    world.sched.waiting_queue.append(compute)
    rider = _loaded(world, "p3", 17_216)
    adder = Adder(world.cache)
    out = _pass(world, adder, chunked)
    assert out is chunked and chunked.extend == CHUNK - 2 * PS  # its chunk gave the rider's pages back
    assert adder.can_run_list == [chunked, rider] and rider.extend == PS  # the rider whole
    assert adder.new_chunked_req is None  # no second chunked request
    assert [c[0] for c in adder.calls] == ["p3"]  # the compute request was skipped, never asked
    assert adder.calls[0][2] == ride.NEVER_CHUNK
    assert world.pol.counts["ride"] == 1


def test_a_rider_sglang_would_chunk_is_skipped_and_no_second_chunked_request_starts(world):
    chunked = _req("c", 50_000)
    rider = _loaded(world, "p3", 17_216)
    rider.left = 5 * PS  # more left past its hit than its seat (the decision's forecast was short)
    adder = Adder(world.cache)
    out = _pass(world, adder, chunked)
    assert out is chunked and adder.can_run_list == [chunked]
    assert adder.new_chunked_req is None and rider.extend is None
    assert not world.pol.counts["ride"]


def test_riders_take_at_most_their_share_of_the_chunk_and_only_what_gpu_room_allows(world):
    chunked = _req("c", 50_000)
    riders = [_loaded(world, f"p{i}", 10_000) for i in range(10)]
    adder = Adder(world.cache, room=CHUNK + 2 * (10_000 + 2 * PS + 8) + 3 * PS)  # room for two riders beside the chunk
    _pass(world, adder, chunked)
    assert adder.can_run_list == [chunked, *riders[:2]]
    assert chunked.extend == CHUNK - 4 * PS
    adder = Adder(world.cache)  # room for all: the share caps them (a quarter of the chunk, 2 pages each)
    for r in riders:
        r.extend = None
    _pass(world, adder, chunked)
    assert len(adder.can_run_list) == 1 + int(CHUNK * ride.RIDE_SHARE) // (2 * PS)


def test_the_chunks_last_pass_leaves_sglangs_budget_to_everyone(world):
    chunked = _req("c", 10 * PS)  # its last chunk: shorter than the budget
    compute = _req("x", 4 * PS)
    world.sched.waiting_queue.append(compute)
    rider = _loaded(world, "p3", 17_216)
    adder = Adder(world.cache)
    out = _pass(world, adder, chunked)
    assert out is None and chunked.extend == 10 * PS
    assert adder.can_run_list == [chunked, compute, rider]  # SGLang's own pass: no seats
    assert [c[2] for c in adder.calls] == [None, None]


def test_a_pass_waits_a_decode_step_where_that_gives_the_first_rider_its_gpu_memory(world):
    chunked = _req("c", 50_000)
    rider = _loaded(world, "p3", 17_216)
    ending = _req("p0", 0, prompt=22_000, max_new=8, out=3)  # 5 decode steps from its end
    adder = Adder(world.cache, room=CHUNK + 10_000, running=[ending])
    out = _pass(world, adder, chunked)
    assert out is chunked and adder.prefill_max_requests == 0  # held: SGLang forms no prefill batch
    assert chunked.extend is None and adder.can_run_list == []
    assert world.pol.counts["ride_yield"] == 1
    for _ in range(ride.YIELD_STEPS + 2):  # bounded: the memory never came back
        _pass(world, Adder(world.cache, room=CHUNK + 10_000, running=[ending]), chunked)
    assert world.pol.counts["ride_yield"] == ride.YIELD_STEPS
    adder = Adder(world.cache, room=CHUNK + 40_000)  # it came back: the rider rides, the streak ends
    _pass(world, adder, chunked)
    assert adder.can_run_list == [chunked, rider] and world.pol.counts["ride"] == 1


@pytest.mark.parametrize("case", ["far from their end", "no running request", "cannot hold"])
def test_no_wait_where_the_memory_would_not_come_back_soon_or_the_pass_cannot_be_held(world, case):
    chunked = _req("c", 50_000)
    _loaded(world, "p3", 17_216)
    running = {"far from their end": [_req("p0", 0, prompt=22_000, max_new=100, out=3)],
               "no running request": [], "cannot hold": [_req("p0", 0, prompt=22_000, max_new=8, out=3)]}[case]
    adder = Adder(world.cache, room=CHUNK + 10_000, running=running)
    out = _pass(world, adder, chunked, can_hold=case != "cannot hold")
    assert out is chunked and chunked.extend == CHUNK and adder.can_run_list == [chunked]
    assert adder.prefill_max_requests is None and not world.pol.counts["ride_yield"]


@pytest.mark.parametrize("case", ["off", "no chunk budget", "hybrid adder", "not a finished load"])
def test_anything_else_is_sglangs_own_pass(world, monkeypatch, case):
    chunked = _req("c", 50_000)
    compute = _req("x", 4 * PS)
    rider = _loaded(world, "p3", 17_216)
    world.sched.waiting_queue.append(compute)
    adder = Adder(world.cache, rem=None if case == "no chunk budget" else CHUNK)
    if case == "off":
        world.cfg.ride = False
    if case == "hybrid adder":
        adder.is_hybrid_swa = True
    if case == "not a finished load":
        del world.pol.protected["p3"]
    if case == "no chunk budget":
        assert policy_hooks.hold_or_add(lambda a, r: "added", adder, chunked, True) == "added"
        return
    out = _pass(world, adder, chunked)
    assert out is chunked and chunked.extend == CHUNK  # the whole chunk, as SGLang sizes it
    assert adder.calls == [("p3", True, None)]  # the loop stops at the first waiting request, as SGLang's
    assert rider.extend is None and not world.pol.counts["ride"]


@pytest.mark.parametrize("agreed", ["no seat", "a smaller seat", "hold", "other requests"])
def test_on_a_multi_rank_server_the_ranks_agreed_plan_is_taken(world, monkeypatch, agreed):
    """Each rank's plan is a vote (`ranks.ride`; its collectives: `test_multirank.py`)."""
    from hicache_gds_sglang import ranks

    monkeypatch.setattr(view, "single_rank", lambda c: False)
    chunked = _req("c", 50_000)
    rider = _loaded(world, "p3", 17_216)
    votes = []

    def agree(cache, names, hold_at, seats):
        votes.append((list(names), hold_at, list(seats)))
        return {"no seat": (None, [0]), "a smaller seat": (None, [PS]), "hold": (0, [0]),
                "other requests": (None, [0])}[agreed]

    monkeypatch.setattr(ranks, "ride", agree)
    adder = Adder(world.cache)
    out = _pass(world, adder, chunked)
    assert votes == [(["p3"], None, [2 * PS])]  # this rank's vote: a seat of two pages for p3
    assert out is chunked
    if agreed == "hold":  # every rank voted to wait a decode step for p3
        assert adder.prefill_max_requests == 0 and adder.can_run_list == []
    elif agreed == "a smaller seat":
        assert chunked.extend == CHUNK - PS and adder.can_run_list == [chunked, rider] and rider.extend == PS
    else:
        assert chunked.extend == CHUNK and adder.can_run_list == [chunked] and rider.extend is None


def test_an_error_while_riding_leaves_sglangs_chunk_and_says_so_once(world, monkeypatch, caplog):
    chunked = _req("c", 50_000)
    _loaded(world, "p3", 17_216)
    monkeypatch.setattr(ride, "can_ride", lambda *a: 1 // 0)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            chunked.extend = None
            out = policy_hooks.hold_or_add(lambda a, r: a.add_chunked(r), Adder(world.cache), chunked, True)
            assert out is chunked and chunked.extend == CHUNK
    assert caplog.text.count("cannot ride along") == 1


def test_policy_ride_is_a_checked_key():
    from hicache_gds import ConfigError
    from hicache_gds_sglang.policy_config import PolicyConfig

    assert PolicyConfig().ride is False  # off until measured in a running server
    assert PolicyConfig.from_extra({"policy_ride": "true"}).ride is True
    with pytest.raises(ConfigError, match="policy_ride"):
        PolicyConfig.from_extra({"policy_ride": "sometimes"})
