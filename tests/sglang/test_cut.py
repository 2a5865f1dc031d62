"""`cut`: the chunk budget a split request's chunk is formed under, around SGLang's adder methods.

SGLang's real adders are driven in `kit_cut_0523.py` (0.5.23); here each budget rule on its own,
with an adder that spends its budget as SGLang's does (a chunk truncated at ``rem_chunk_tokens``,
or nothing added), and an error inside the cut.
"""

from __future__ import annotations

import logging
import types
from collections import Counter

import pytest

from hicache_gds_sglang import cut, view


class Adder:
    """What `cut` reads of SGLang's ``PrefillAdder``; `add` is its method: it truncates the request's
    chunk at the budget (or adds nothing where `refuse`) and spends what it added."""

    def __init__(self, cache, rem, *, refuse=False):
        self.tree_cache, self.rem_chunk_tokens, self.refuse = cache, rem, refuse
        self.seen = []

    def add(self, req):
        self.seen.append(self.rem_chunk_tokens)
        if self.refuse:
            return "NO_TOKEN"
        n = min(req.left, self.rem_chunk_tokens)
        req.extend = n
        self.rem_chunk_tokens -= n
        return "OTHER" if n < req.left else "CONTINUE"


@pytest.fixture
def world(monkeypatch):
    cfg = types.SimpleNamespace(split_cut=True)
    backend = types.SimpleNamespace(policy_config=cfg)
    pol = types.SimpleNamespace(tails={}, counts=Counter())
    cache = object()
    monkeypatch.setattr(view, "attached", lambda c: pol if c is cache else None)
    monkeypatch.setattr(view, "backend_of", lambda c: backend)
    monkeypatch.setattr(cut, "CUT_HOOKED", [True])
    return types.SimpleNamespace(cfg=cfg, pol=pol, cache=cache)


def _req(w, rid, *, start, on_gpu=0, host=0, left=10_000):
    req = types.SimpleNamespace(rid=rid, prefix_len=on_gpu, host_hit_length=host, left=left, extend=None)
    if start is not None:
        w.pol.tails[rid] = types.SimpleNamespace(load=types.SimpleNamespace(start=start))
    return req


def test_a_head_shorter_than_the_budget_ends_the_chunk_and_the_budget_stays_spent(world):
    req = _req(world, "r", start=3072, on_gpu=1024, host=512)  # 1,536 tokens of head left
    a = Adder(world.cache, 8192)
    assert cut.around_add_one_req(Adder.add, a, req) == "OTHER"
    assert a.seen == [1536] and req.extend == 1536  # SGLang truncated the chunk at the head
    assert a.rem_chunk_tokens == 0 and world.pol.counts["split_cut"] == 1


def test_where_nothing_is_added_the_pass_keeps_its_budget(world):
    req = _req(world, "r", start=2048)
    a = Adder(world.cache, 8192, refuse=True)
    assert cut.capped(Adder.add, a, req) == "NO_TOKEN"
    assert a.seen == [2048] and a.rem_chunk_tokens == 8192 and not world.pol.counts["split_cut"]


@pytest.mark.parametrize("case", ["no tail", "head computed", "head past the budget", "no budget", "off",
                                  "not hooked"])
def test_anything_else_is_left_to_sglang(world, monkeypatch, case):
    start = {"no tail": None, "head computed": 1024, "head past the budget": 9216 + 1024}.get(case, 2048)
    req = _req(world, "r", start=start, on_gpu=1024)
    a = Adder(world.cache, None if case == "no budget" else 8192)
    if case == "off":
        world.cfg.split_cut = False
    if case == "not hooked":
        monkeypatch.setattr(cut, "CUT_HOOKED", [False])
    if case == "no budget":
        a.add = lambda r: a.seen.append(a.rem_chunk_tokens) or "CONTINUE"
        assert cut.capped(lambda ad, r: ad.add(r), a, req) == "CONTINUE"
    else:
        cut.capped(Adder.add, a, req)
        assert req.extend == min(8192, req.left)
    assert a.seen == [None if case == "no budget" else 8192]
    assert not world.pol.counts["split_cut"]


def test_an_adder_of_another_cache_or_no_policy_is_left_alone(world):
    req = _req(world, "r", start=2048)
    a = Adder(object(), 8192)
    cut.capped(Adder.add, a, req)
    assert a.seen == [8192]


def test_an_error_while_cutting_leaves_sglangs_chunk_and_says_so_once(world, monkeypatch, caplog):
    req = _req(world, "r", start=2048)
    monkeypatch.setattr(cut, "head_left", lambda pol, r: 1 // 0)
    monkeypatch.setattr(view, "_logged", set())
    a = Adder(world.cache, 8192)
    with caplog.at_level(logging.WARNING):
        cut.capped(Adder.add, a, req)
        cut.capped(Adder.add, Adder(world.cache, 8192), req)
    assert a.seen == [8192] and req.extend == 8192
    assert caplog.text.count("could not be cut") == 1


def test_an_error_inside_sglangs_method_still_restores_the_budget_and_propagates(world):
    req = _req(world, "r", start=2048)
    a = Adder(world.cache, 8192)

    def boom(adder, r):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        cut.capped(boom, a, req)
    assert a.rem_chunk_tokens == 8192
