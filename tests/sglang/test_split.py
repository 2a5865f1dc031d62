"""A split hit (`hicache_gds_sglang.split`): the GPU computes a prefix's head while the disk loads
its tail, and the tail joins the request's prefix where its chunks reach it.

Against SGLang 0.5.17's real radix cache (``HiRadixCache``: its insert, match, host insert and
load back), its real controller paths (``prefetch``, ``_storage_hit_query``, ``_page_transfer``,
``_page_get_zero_copy``), its real ``cache_unfinished_req`` and ``ReqToTokenPool``, over a
hicache-gds store on disk. The GPU is a CPU tensor of pages: "computing" a chunk writes each
page's true bytes there, and a load back copies the host page. Every test checks, page by page,
that what the request's prefix points at is the bytes of that page of the prompt.

0.5.23 keeps its tree in a core of its own: its split (`split_0523`) is tested on its real
cache in `test_kit_0523.py` (`kit_split_0523.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from array import array
import types

import numpy as np
import pytest
import torch

from hicache_gds_sglang import HiCacheGDS, split_policy, view
from hicache_gds_sglang import policy_hooks as hooks
from hicache_gds_sglang import split as split_mod
from hicache_gds_sglang import backend as backend_mod
from hicache_gds_sglang.policy import POLICY
from sgl_helpers import make_pool, page_bytes, poison, storage_config

try:
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.mem_cache.utils import get_hash_str
except ImportError as exc:  # 0.5.23: no HiRadixCache; the last test runs there alone
    HiRadixCache = None
    _WHY = str(exc)

PS = 64
BPT = 1024  # bytes of KV per token of the pool below
CHUNK = 4 * PS
PAGES = 16  # the prompt's pages in L3
N = PAGES * PS + PS  # the prompt: the stored prefix and one page of new tokens
A = 1 / 6000  # prefill seconds per token (linear)

needs_0517 = pytest.mark.skipif(HiRadixCache is None, reason="SGLang 0.5.17's HiRadixCache (this SGLang has none)")


@pytest.fixture(autouse=True)
def _state():
    backend_mod._RATES.clear()
    view._logged.clear()
    hooked = split_policy.SPLIT_HOOKED[0]
    split_policy.SPLIT_HOOKED[0] = True  # as plugin.register does where the join point exists
    if HiRadixCache is not None:
        hooks.SUPPORTED.add(HiRadixCache)
    yield
    split_policy.SPLIT_HOOKED[0] = hooked
    backend_mod._RATES.clear()


class Scheduler(types.SimpleNamespace):
    """What the policy reads of SGLang's Scheduler (held weakly by the policy, as the real one)."""


class Device:
    """GPU memory as a CPU tensor of pages, with SGLang's allocator contract (whole pages)."""

    def __init__(self, pages: int) -> None:
        self.pages = torch.full((pages, PS * BPT), 0x5A, dtype=torch.uint8)
        self.free_pages = list(range(1, pages))
        self.freed: list[int] = []

    def alloc(self, tokens: int) -> torch.Tensor | None:
        n = tokens // PS
        if n > len(self.free_pages):
            return None
        got, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return torch.cat([torch.arange(p * PS, (p + 1) * PS, dtype=torch.int64) for p in got])

    def write(self, indices: torch.Tensor, page_data: list[bytes]) -> None:
        for i, data in zip(range(0, len(indices), PS), page_data):
            self.pages[int(indices[i]) // PS] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def page(self, index: int) -> bytes:
        return self.pages[int(index) // PS].numpy().tobytes()

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        self.freed.extend(int(i) for i in indices[::PS])


class World:
    """One prompt stored in L3, SGLang's cache and controller over a host pool, a GPU of pages."""

    def __init__(self, gds_dir: str, *, read_ratio: float = 1.0, seed: int = 7, extra: dict | None = None) -> None:
        self.pool = make_pool("mha", "page_first", pages=96, page_size=PS, layer_num=2, head_num=2, head_dim=64)
        gbps = BPT / (A * read_ratio) / 1e9  # loading a token takes read_ratio x computing it
        self.b = HiCacheGDS(storage_config(gds_dir, extra={"policy": POLICY, "policy_split": True,
                                                          "policy_read_gbps": gbps, **(extra or {})}), self.pool)
        self.b.register_mem_host_pool_v2(self.pool, "kv")
        assert self.b.kv_bytes_per_token() == BPT
        rng = np.random.default_rng(seed)
        self.tokens = array("q", rng.integers(1000, 30000, size=N).tolist())  # SGLang's token container
        self.hashes = get_hash_str(self.tokens[:PAGES * PS], None, page_size=PS)
        hi = self.pool.alloc(PAGES * PS)
        assert self.b.batch_set_v1(self.hashes, hi) == [True] * PAGES
        self.truth = [page_bytes(self.pool, int(hi[j * PS]) // PS) for j in range(PAGES)]
        assert len(set(self.truth)) == PAGES
        poison(self.pool, range(PAGES))
        self.pool.free(hi)
        self.host_total = self.pool.available_size()
        self.dev = Device(64)
        self.cache = self._cache()
        self.pol = self.cache._hgds_policy
        self.pol.prefill.seed_coefficients(A, 0.0, 0.0, "test")
        self.sched = Scheduler(waiting_queue=[], chunked_req=None, chunked_prefill_size=CHUNK, tree_cache=self.cache)
        self.pol.bind(self.sched)

    def _cache(self):
        ctl = object.__new__(HiCacheController)
        ctl.enable_storage, ctl.storage_backend, ctl.storage_backend_type = True, self.b, "gds"
        ctl.page_size, ctl.prefetch_queue, ctl.prefetch_tokens_occupied = PS, queue.Queue(), 0
        ctl.mem_pool_host, ctl.prefetch_capacity_limit, ctl.host_memory_mode = self.pool, 10 ** 6, "cache"
        ctl.write_policy, ctl.host_mem_release_queue, ctl.has_draft = "write_back", queue.Queue(), False
        ctl.get_hash_str = get_hash_str
        ctl.page_get_func = ctl._page_get_zero_copy
        ctl.loads = []

        def load(host_indices, node_id=None, **kw):  # HiCacheController.load: H2D into fresh device slots
            dev = self.dev.alloc(len(host_indices))
            if dev is None:
                return None
            self.dev.write(dev, [page_bytes(self.pool, int(host_indices[i]) // PS)
                                 for i in range(0, len(host_indices), PS)])
            ctl.loads.append((len(host_indices), node_id))
            return dev

        ctl.load = load
        cache = object.__new__(HiRadixCache)
        cache.disable, cache.page_size, cache.is_eagle, cache.device = False, PS, False, "cpu"
        cache.evictable_leaves, cache.evictable_host_leaves = set(), set()
        cache.enable_storage, cache.enable_kv_cache_events = True, False
        cache.load_back_threshold, cache.ongoing_load_back, cache.ongoing_prefetch = 10, {}, {}
        cache.prefetch_threshold, cache.prefetch_stop_policy = 256, POLICY
        cache.cache_controller, cache.token_to_kv_pool_host = ctl, self.pool
        cache.req_to_token_pool = ReqToTokenPool(size=4, max_context_len=2 * N, device="cpu",
                                                 enable_memory_saver=False)
        cache.token_to_kv_pool_allocator = self.dev
        RadixCache.reset(cache)
        hooks._settle(cache)
        return cache

    def request(self, rid: str = "r1"):
        r = types.SimpleNamespace(rid=rid, origin_input_ids=self.tokens, output_ids=[], extra_key=None,
                                  prefix_indices=torch.empty(0, dtype=torch.int64), host_hit_length=0,
                                  last_node=self.cache.root_node, cache_protected_len=0, req_pool_idx=1,
                                  full_untruncated_fill_ids=self.tokens, cached_tokens_storage=0, done=False)
        r.finished = lambda: r.done
        r.fill_upto = 0
        r.get_fill_ids = lambda: self.tokens[:r.fill_upto]
        return r

    def admitted(self, rid: str = "r1"):
        req = self.request(rid)
        self.admit(req)
        return req

    def admit(self, req) -> None:
        """Scheduler._prefetch_kvcache through the policy's hooks."""
        self.pol.current_req = req
        try:
            hooks.around_admit(HiRadixCache.prefetch_from_storage, self.cache, req.rid, self.cache.root_node,
                               self.tokens[:N - 1], None, None)
        finally:
            self.pol.current_req = None

    def tail_ops(self, rid: str = "r1") -> list:
        """The tail's prefetch operations still in flight, in token order."""
        return [e[2] for k, e in sorted(self.cache.ongoing_prefetch.items()) if k.startswith(f"{rid}{split_mod._SUFFIX}")]

    def tail_op(self, rid: str = "r1", i: int = 0):
        return self.cache.ongoing_prefetch[f"{rid}{split_mod._SUFFIX}{i}"][2]

    def query(self, op) -> bool:
        """The controller's prefetch thread for one operation (its hit query) and the host memory the
        scheduler allocates for it; False where SGLang revokes it (no hit)."""
        ctl = self.cache.cache_controller
        if op.is_terminated():  # the thread skips its query and revokes it
            self.cache._revoke_pending_prefetch(op.request_id)
            return False
        hv, count = ctl._storage_hit_query(op)
        if count < self.cache.prefetch_threshold:  # SGLang revokes it (the drain of its revoke queue)
            self.cache._revoke_pending_prefetch(op.request_id)
            return False
        op.hash_value, op.storage_hit_count = hv[:count // PS], count
        op.host_indices = self.pool.alloc(count)
        return True

    def read_tail(self, rid: str = "r1", *, gets: int | None = None, ops: int | None = None) -> None:
        """The controller's prefetch thread and IO thread for the tail's operations (the first `ops`
        of them), one after another: each one's query, host memory, then its pages read, a get of
        `BATCH` pages at a time (the first `gets` in all only: the next get fails, a short read,
        and SGLang ends that operation)."""
        ctl = self.cache.cache_controller
        real, calls = self.b.batch_get_v1, []

        def get(ks, hi, *a):
            calls.append(len(ks))
            return real(ks, hi, *a) if gets is None or len(calls) <= gets else [False] * len(ks)

        done = 0
        while not ctl.prefetch_queue.empty() and (ops is None or done < ops):
            op = ctl.prefetch_queue.get_nowait()
            done += 1
            if not self.query(op):
                continue
            self.b.batch_get_v1 = get
            try:
                ctl._page_transfer(op)
            finally:
                del self.b.batch_get_v1
            ctl.append_host_mem_release(op.host_indices[op.completed_tokens:])  # what its IO thread does after

    def compute_chunk(self, req, upto: int) -> None:
        """The GPU computes the request's next chunk (its true bytes into fresh slots), and SGLang
        caches it before forming the next one (``cache_unfinished_req``, with the plugin's hook)."""
        start = len(req.prefix_indices)
        slots = self.dev.alloc(upto - start)
        self.dev.write(slots, self.truth[start // PS:upto // PS])
        pool = self.cache.req_to_token_pool
        pool.write((req.req_pool_idx, slice(0, start)), req.prefix_indices.to(torch.int32))
        pool.write((req.req_pool_idx, slice(start, upto)), slots.to(torch.int32))
        req.fill_upto = upto
        self.cache.cache_unfinished_req(req, chunked=True)
        hooks.after_cache_unfinished(None, self.cache, req)

    def check_prefix(self, req) -> None:
        """Every page the request's prefix points at holds that page of the prompt."""
        for j in range(len(req.prefix_indices) // PS):
            assert self.dev.page(req.prefix_indices[j * PS]) == self.truth[j], f"page {j}"

    def release(self, req) -> None:
        """The request finished: SGLang drops its lock; every host page not in the tree is free."""
        self.load_done()
        self.cache.dec_lock_ref(req.last_node)
        self.drain_host()
        assert self.pool.available_size() == self.host_total - self.host_in_tree()
        assert self.cache.cache_controller.prefetch_tokens_occupied == 0
        assert self.cache.root_node.host_ref_counter == 0

    def load_done(self) -> None:
        """HiRadixCache.loading_check once the load backs finished: their transfer locks end."""
        for node_id in list(self.cache.ongoing_load_back):
            self.cache.dec_lock_ref(self.cache.ongoing_load_back.pop(node_id))

    def drain_host(self) -> None:
        q = self.cache.cache_controller.host_mem_release_queue
        while not q.empty():
            self.pool.free(q.get_nowait())

    def host_in_tree(self) -> int:
        n, stack = 0, [self.cache.root_node]
        while stack:
            node = stack.pop()
            if node is not self.cache.root_node and node.host_value is not None:
                n += len(node.host_value)
            stack.extend(node.children.values())
        return n

    def close(self) -> None:
        self.b.close()


BATCH = 2  # pages per get of a prefetch (SGLang's STORAGE_BATCH_SIZE, 128, shrunk to the prompt)


@pytest.fixture
def world(gds_dir, monkeypatch):
    if HiRadixCache is None:
        pytest.skip(f"SGLang 0.5.17's HiRadixCache: {_WHY}")
    import sglang.srt.managers.cache_controller as cc_mod
    import sglang.srt.mem_cache.hicache_storage as hs_mod
    monkeypatch.setattr(cc_mod, "STORAGE_BATCH_SIZE", BATCH)
    monkeypatch.setattr(hs_mod, "STORAGE_BATCH_SIZE", BATCH)
    w = World(gds_dir)
    yield w
    w.close()


@needs_0517
def test_the_tail_joins_where_the_chunks_reach_it_byte_exact(world):
    w = world
    req = w.admitted()
    assert w.pol.counts["split"] == 1 and w.pol.decided["r1"].action == "split"
    tail = w.pol.tails["r1"].load
    assert (tail.start, tail.end) == (2 * CHUNK, PAGES * PS)  # the hash chain continued over the head
    assert len(tail.keys) == 2  # 4-page operations (SGLang's threshold: 256 tokens), each read in 2 gets
    w.read_tail()
    assert sum(op.completed_tokens for op in w.tail_ops()) == tail.tokens
    w.compute_chunk(req, CHUNK)  # not there yet: nothing joins
    assert len(req.prefix_indices) == CHUNK and "r1" in w.pol.tails
    w.compute_chunk(req, 2 * CHUNK)
    assert len(req.prefix_indices) == PAGES * PS, "the whole tail joined"
    assert req.cache_protected_len == PAGES * PS and req.cached_tokens_storage == tail.tokens
    w.check_prefix(req)
    assert "r1" not in w.pol.tails and not w.tail_ops()
    assert w.pol.counts["split_joined"] == 1 and w.pol.counts["split_tokens"] == tail.tokens
    # the request holds its whole prefix: one lock along it, released as SGLang releases it
    w.load_done()
    m = w.cache.match_prefix(MatchPrefixParams(key=RadixKey(w.tokens[:PAGES * PS])))
    assert len(m.device_indices) == PAGES * PS and m.last_device_node is req.last_node
    assert req.last_node.lock_ref == 1 and w.cache.root_node.host_ref_counter == 0
    w.release(req)  # host memory: the tail's pages are the tree's, everything else is back in the pool
    assert w.cache.protected_size_ == 0


@needs_0517
def test_a_short_read_joins_only_the_pages_read_and_the_gpu_computes_the_rest(world):
    w = world
    req = w.admitted()
    tail = w.pol.tails["r1"].load
    w.read_tail(gets=2)  # 2 gets of 2 pages (the first operation), then a failed get
    assert w.tail_op(i=0).completed_tokens == 2 * BATCH * PS and w.tail_op(i=1).completed_tokens == 0
    w.compute_chunk(req, CHUNK)
    w.compute_chunk(req, 2 * CHUNK)
    assert len(req.prefix_indices) == tail.start + 2 * BATCH * PS
    w.check_prefix(req)
    # the GPU computes on from there, and SGLang caches it over the joined pages
    w.load_done()
    w.compute_chunk(req, PAGES * PS)
    assert len(req.prefix_indices) == PAGES * PS
    w.check_prefix(req)
    w.release(req)


@needs_0517
def test_a_tail_not_read_when_the_chunks_reach_it_is_dropped_and_its_query_finds_it_gone(world):
    w = world
    req = w.admitted()
    w.compute_chunk(req, CHUNK)
    w.compute_chunk(req, 2 * CHUNK)  # the disk has not even queried it: nothing joins
    assert len(req.prefix_indices) == 2 * CHUNK and not w.pol.tails and not w.cache.ongoing_prefetch
    assert w.pol.counts["split_dropped"] == 1 and w.cache.root_node.host_ref_counter == 0
    q = w.cache.cache_controller.prefetch_queue
    assert q.qsize() == 2
    while not q.empty():
        op = q.get_nowait()
        assert op.is_terminated()  # the controller's thread skips its query and revokes it: a no-op now
        w.cache._revoke_pending_prefetch(op.request_id)
    w.check_prefix(req)
    assert w.cache.cache_controller.prefetch_tokens_occupied == 0 and w.pool.available_size() == w.host_total


@needs_0517
def test_a_request_that_leaves_before_its_chunks_reach_the_tail_frees_it(world):
    w = world
    req = w.admitted()
    w.read_tail()
    w.sched.chunked_req = req
    hooks.after_new_prefill_batch(None, w.sched)
    assert "r1" in w.pol.tails  # still being chunked
    req.done = True  # aborted
    hooks.after_new_prefill_batch(None, w.sched)
    assert not w.pol.tails and not w.cache.ongoing_prefetch and w.pol.counts["split_dropped"] == 1
    w.drain_host()
    assert w.pool.available_size() == w.host_total and w.cache.root_node.host_ref_counter == 0


@needs_0517
def test_pages_stored_under_another_prefix_never_join(world):
    """A prompt that shares the tail's tokens but not the head's: the tail's keys continue this
    prompt's own hash chain, so the pages of the stored prompt are not found, and nothing joins."""
    w = world
    other = array("q", w.tokens)
    other[5] += 1  # the first page differs
    w.tokens = other
    req = w.request()
    w.admit(req)
    assert "r1" in w.pol.tails
    w.read_tail()  # no hit: SGLang revokes it
    assert not w.cache.ongoing_prefetch
    slots = w.dev.alloc(2 * CHUNK)  # the GPU computed this prompt's head: its own slots, no stored page
    pool = w.cache.req_to_token_pool
    pool.write((req.req_pool_idx, slice(0, 2 * CHUNK)), slots.to(torch.int32))
    req.fill_upto = 2 * CHUNK
    w.cache.cache_unfinished_req(req, chunked=True)
    hooks.after_cache_unfinished(None, w.cache, req)
    assert len(req.prefix_indices) == 2 * CHUNK and torch.equal(req.prefix_indices, slots)
    assert not w.pol.tails and w.pol.counts["split_joined"] == 0


@needs_0517
def test_a_failure_inside_the_join_leaves_the_request_as_sglang_left_it(world, monkeypatch, caplog):
    w = world
    req = w.admitted()
    w.read_tail()
    w.compute_chunk(req, CHUNK)

    def broken(*a, **k):
        raise RuntimeError("injected: load back failed")

    monkeypatch.setattr(w.cache, "init_load_back", broken)
    with caplog.at_level(logging.WARNING, logger="hicache_gds_sglang.policy"):
        w.compute_chunk(req, 2 * CHUNK)
    assert "could not join" in caplog.text and "injected" in caplog.text
    assert len(req.prefix_indices) == 2 * CHUNK and req.cache_protected_len == 2 * CHUNK
    w.check_prefix(req)
    assert not w.pol.tails and not w.cache.ongoing_prefetch and w.cache.root_node.host_ref_counter == 0
    # the pages read are in the tree as host pages under the request's chunks, byte for byte
    m = w.cache.match_prefix(MatchPrefixParams(key=RadixKey(w.tokens[:PAGES * PS])))
    assert m.host_hit_length == PAGES * PS - 2 * CHUNK
    node, host = m.last_host_node, []
    while node.evicted:
        host[:0] = [int(node.host_value[i]) // PS for i in range(0, len(node.host_value), PS)]
        node = node.parent
    assert [page_bytes(w.pool, p) for p in host] == w.truth[2 * CHUNK // PS:]
    monkeypatch.undo()
    w.release(req)


@needs_0517
def test_a_cached_prefix_ending_in_a_partial_page_drops_the_tail(world):
    w = world
    req = w.admitted()
    w.read_tail()
    w.compute_chunk(req, CHUNK)
    tail = w.pol.tails["r1"].load
    req.prefix_indices = torch.cat([req.prefix_indices, w.dev.alloc(CHUNK)])  # as if 2 chunks held
    req.cache_protected_len = CHUNK  # ... but only the first cached: SGLang's partial-page state
    assert split_mod.join(w.cache, req, tail) == 0
    assert not w.cache.ongoing_prefetch and len(req.prefix_indices) == 2 * CHUNK
    w.drain_host()
    assert w.pool.available_size() == w.host_total


def test_policy_split_is_checked_and_off_where_sglang_has_no_join_point(gds_dir):
    from hicache_gds import ConfigError
    from hicache_gds_sglang import plugin
    from hicache_gds_sglang.policy import PolicyConfig
    assert PolicyConfig.from_extra({}).split == "idle"
    assert [PolicyConfig.from_extra({"policy_split": v}).split for v in ("off", "IDLE", True, "no")] == [
        "off", "idle", "always", "off"]
    with pytest.raises(ConfigError, match="policy_split: 'sometimes'"):
        PolicyConfig.from_extra({"policy_split": "sometimes"})
    with pytest.raises(ConfigError, match="policy_split"):
        HiCacheGDS(storage_config(gds_dir, extra={"policy_split": 3}), {})
    assert PolicyConfig.from_extra({}).split_get == 128 << 20
    assert PolicyConfig.from_extra({"policy_split_get": "64M"}).split_get == 64 << 20
    assert PolicyConfig.from_extra({"policy_split_get": 0}).split_get == 0
    with pytest.raises(ConfigError, match="policy_split_get"):
        PolicyConfig.from_extra({"policy_split_get": "lots"})
    # 0.5.23 has no HiRadixCache to hook: its join point is the scheduler's stash of a chunked
    # request (`split_0523`, tested on its real cache in test_kit_0523.py)
    assert (plugin._resolve(plugin._JOIN) is None) == (HiRadixCache is None)


@needs_0517
def test_a_split_request_being_chunked_counts_in_the_gpu_backlog_without_what_its_tail_joins(world):
    """A burst's first request is split, and SGLang computes its head in chunks while the rest of
    the burst is admitted. The GPU work ahead of those is its head's chunks left and what follows
    the tail, not the tokens its tail is forecast to join: counted whole, every later admission of
    a burst saw the GPU busier by the tail's compute (run 26: 1.017 s behind a split whose head
    was forecast at 0.38 s), and gave the disk more than its share."""
    w = world
    req = w.admitted()
    d, tail = w.pol.decided["r1"], w.pol.tails["r1"].load
    assert d.action == "split" and tail.expect > 0 and tail.start >= 2 * CHUNK
    model = w.pol.cost_model
    w.sched.waiting_queue[:] = []
    w.sched.chunked_req = req
    w.compute_chunk(req, CHUNK)  # the head's first chunk cached; the rest of the head still to come
    held = len(req.prefix_indices)
    new, _ = view.req_work(req)
    joined = min(tail.expect, tail.tokens)
    w.pol.backlog = None
    _, total = w.pol.gpu_backlog(w.cache, model)
    assert total == pytest.approx(model.predict_compute(new - joined, held), rel=1e-6)
    assert total < model.predict_compute(new, held) - 0.5 * model.predict_compute(joined, held)
    w.pol.tails.pop("r1")  # a tail dropped (or never started): the request is computed whole
    w.pol.backlog = None
    assert w.pol.gpu_backlog(w.cache, model)[1] == pytest.approx(model.predict_compute(new, held), rel=1e-6)


@needs_0517
def test_a_request_admitted_again_keeps_its_one_tail(world):
    """SGLang admits a request again when it is retracted, and the policy's late admission asks
    again for a queued one: a request with a tail in flight is never split twice."""
    w = world
    req = w.admitted()
    first = w.pol.tails["r1"].load
    w.admit(req)
    assert w.pol.tails["r1"].load is first and len(set(w.cache.ongoing_prefetch) - set(first.keys)) <= 1
    assert w.pol.counts["split"] == 1
    ctl = w.cache.cache_controller
    for key in list(w.cache.ongoing_prefetch):
        if key not in first.keys:  # admission's own prefetch of the whole hit, as SGLang runs it
            w.cache._revoke_pending_prefetch(key)
    ops = [ctl.prefetch_queue.get_nowait() for _ in range(ctl.prefetch_queue.qsize())]
    for op in ops:
        if op.request_id in first.keys:
            ctl.prefetch_queue.put(op)
    w.read_tail()
    w.compute_chunk(req, CHUNK)
    w.compute_chunk(req, 2 * CHUNK)
    assert len(req.prefix_indices) == PAGES * PS
    w.check_prefix(req)
    w.release(req)


@needs_0517
def test_where_the_disk_reads_the_rest_before_the_gpu_computes_a_chunk_the_join_waits_one_chunk(world):
    """A tail still reading when the chunks reach it: where its rest lands before the GPU computes
    one more chunk, and that finishes first, the request computes that chunk and joins the rest
    after it; the pages the chunk computed are freed, not inserted twice."""
    w = world
    req = w.admitted()
    tail = w.pol.tails["r1"].load
    ctl = w.cache.cache_controller
    first, second = ctl.prefetch_queue.get_nowait(), ctl.prefetch_queue.get_nowait()
    assert w.query(first) and w.query(second)
    ctl._page_get_zero_copy(first, first.hash_value[:2], first.host_indices[:2 * PS])  # a get: 2 of 8 pages
    w.b.read_rate.seed(100e9, "test: a disk far faster than the GPU")
    w.compute_chunk(req, CHUNK)
    w.compute_chunk(req, 2 * CHUNK)
    assert len(req.prefix_indices) == 2 * CHUNK and "r1" in w.pol.tails  # waits one chunk
    ctl._page_get_zero_copy(first, first.hash_value[2:], first.host_indices[2 * PS:])  # the rest lands meanwhile
    ctl._page_transfer(second)
    w.compute_chunk(req, 3 * CHUNK)
    assert len(req.prefix_indices) == tail.end and not w.pol.tails
    w.check_prefix(req)
    w.release(req)


@needs_0517
def test_a_tail_read_as_several_operations_joins_those_counted_when_the_chunks_reach_it(world):
    """The second of the tail's operations has not been read (not even queried) when the chunks
    reach the tail: the first one's pages join, and the GPU computes the rest."""
    w = world
    req = w.admitted()
    tail = w.pol.tails["r1"].load
    w.read_tail(ops=1)
    w.compute_chunk(req, CHUNK)
    w.compute_chunk(req, 2 * CHUNK)
    assert len(req.prefix_indices) == tail.start + 4 * PS and req.cached_tokens_storage == 4 * PS
    w.check_prefix(req)
    assert not w.tail_ops() and w.pol.counts["split_tokens"] == 4 * PS
    w.read_tail()  # the controller's thread reaches the second one: ended, it is skipped and revoked
    w.load_done()
    w.compute_chunk(req, PAGES * PS)
    w.check_prefix(req)
    w.release(req)


@needs_0517
def test_an_operation_sglang_revoked_ends_the_join_before_it(world):
    """SGLang revokes the tail's first operation (no host memory for it) and reads the second:
    nothing past the revoked pages is contiguous with the head, so nothing joins and the second
    one's pages go back to the pool."""
    w = world
    req = w.admitted()
    ctl = w.cache.cache_controller
    first = ctl.prefetch_queue.get_nowait()
    w.cache._revoke_pending_prefetch(first.request_id)  # what its drain does when host memory is short
    w.read_tail()
    assert w.tail_ops()[0].completed_tokens == 4 * PS
    w.compute_chunk(req, CHUNK)
    w.compute_chunk(req, 2 * CHUNK)
    assert len(req.prefix_indices) == 2 * CHUNK and w.pol.counts["split_joined"] == 0
    assert not w.pol.tails and not w.tail_ops() and w.pol.counts["split_dropped"] == 1
    w.check_prefix(req)
    w.release(req)


@needs_0517
def test_policy_split_get_0_reads_the_tail_as_one_operation(gds_dir, monkeypatch):
    if HiRadixCache is None:
        pytest.skip(f"SGLang 0.5.17's HiRadixCache: {_WHY}")
    import sglang.srt.managers.cache_controller as cc_mod
    import sglang.srt.mem_cache.hicache_storage as hs_mod
    monkeypatch.setattr(cc_mod, "STORAGE_BATCH_SIZE", 8)
    monkeypatch.setattr(hs_mod, "STORAGE_BATCH_SIZE", 8)
    w = World(gds_dir, extra={"policy_split_get": 0})
    try:
        req = w.admitted()
        tail = w.pol.tails["r1"].load
        assert len(tail.keys) == 1
        w.read_tail()
        for upto in range(CHUNK, tail.start + 1, CHUNK):
            w.compute_chunk(req, upto)
        assert len(req.prefix_indices) == tail.end and w.pol.counts["split_tokens"] == tail.tokens
        w.check_prefix(req)
        w.release(req)
    finally:
        w.close()


def test_tail_pages_are_whole_gets_no_shorter_than_sglangs_threshold(monkeypatch):
    import sglang.srt.mem_cache.hicache_storage as hs_mod
    monkeypatch.setattr(hs_mod, "STORAGE_BATCH_SIZE", 128)
    mib = 1 << 20
    assert split_mod.tail_pages(8 * mib, 128 * mib, 4) == 16  # 8B shape, 64-token pages
    assert split_mod.tail_pages(16 * mib, 128 * mib, 4) == 8  # 32B shape
    assert split_mod.tail_pages(64 << 10, 128 * mib, 4) == 128  # never more than one of SGLang's gets
    assert split_mod.tail_pages(64 * mib, 128 * mib, 4) == 4  # never below the prefetch threshold
    assert split_mod.tail_pages(8 * mib, 0, 4) is None  # 0: one operation


@needs_0517
def test_a_failed_cancel_of_the_tails_reads_still_joins_what_was_read(world, monkeypatch, caplog):
    """The backend's cancel of unposted reads raises (injected) while the join ends the tail's
    operations: the pages counted join byte for byte, the rest are released as SGLang releases a
    stopped prefetch, and nothing is left in flight."""
    w = world
    req = w.admitted()
    w.read_tail(ops=1)

    def broken(*a, **k):
        raise OSError("injected: cancel failed")

    monkeypatch.setattr(w.b, "cancel_read", broken)
    w.compute_chunk(req, CHUNK)
    with caplog.at_level(logging.WARNING, logger="hicache_gds_sglang.policy"):
        w.compute_chunk(req, 2 * CHUNK)
    assert "injected: cancel failed" in caplog.text
    assert len(req.prefix_indices) == 2 * CHUNK + 4 * PS and not w.tail_ops() and not w.pol.tails
    w.check_prefix(req)
    monkeypatch.undo()
    w.read_tail()  # the second operation, ended before its query: skipped and revoked
    w.release(req)


def _held(w, monkeypatch):
    """A split admitted where the request may be held for its tail (as plugin.register sets it
    where ``PrefillAdder.add_chunked_req`` exists), the tail's first 2 of 8 pages read, a disk far
    faster than the GPU, and the chunks computed up to the tail: the request is held there."""
    monkeypatch.setattr(split_policy, "PARK_HOOKED", [True])
    monkeypatch.setattr(split_policy, "PARK_CHECK_S", 0.0)  # every pass looks
    req = w.admitted()
    rounds: list[int] = []
    req.init_next_round_input = lambda *a, **k: rounds.append(len(req.prefix_indices))
    tail = w.pol.tails["r1"].load
    assert w.pol.decided["r1"].action == "split" and (tail.start, tail.end) == (2 * CHUNK, PAGES * PS)
    assert len(tail.keys) == 1  # forecast read whole by the join: one operation, SGLang's own gets
    ctl = w.cache.cache_controller
    op = ctl.prefetch_queue.get_nowait()
    assert w.query(op)
    ctl._page_get_zero_copy(op, op.hash_value[:2], op.host_indices[:2 * PS])
    w.b.read_rate.seed(100e9, "test: a disk far faster than the GPU")
    w.compute_chunk(req, CHUNK)
    w.compute_chunk(req, 2 * CHUNK)
    assert len(req.prefix_indices) == 2 * CHUNK and "r1" in w.pol.parked and "r1" in w.pol.tails
    return req, tail, rounds, (op,)


def _read_rest(w, ops) -> None:
    (op,) = ops
    w.cache.cache_controller._page_get_zero_copy(op, op.hash_value[2:], op.host_indices[2 * PS:])


class _Adder:
    """What the hook reads of SGLang's PrefillAdder; `add` stands for its own add_chunked_req."""

    def __init__(self, cache) -> None:
        self.tree_cache, self.added, self.prefill_max_requests = cache, [], None

    def add(self, adder, req):
        self.added.append(req)
        return None


@needs_0517
def test_a_split_request_is_held_until_its_whole_tail_is_read_then_joins_it_byte_exact(world, monkeypatch):
    w = world
    req, tail, rounds, ops = _held(w, monkeypatch)
    adder = _Adder(w.cache)
    assert hooks.around_add_chunked_req(adder.add, adder, req) is req and not adder.added  # held this pass
    assert adder.prefill_max_requests == 0  # and no other request added to it
    adder = _Adder(w.cache)
    assert hooks.around_add_chunked_req(adder.add, adder, req) is req and not adder.added  # and the next
    _read_rest(w, ops)  # the rest lands
    adder = _Adder(w.cache)
    assert hooks.around_add_chunked_req(adder.add, adder, req) is None and adder.added == [req]
    assert adder.prefill_max_requests is None
    assert len(req.prefix_indices) == tail.end and rounds == [tail.end]  # its next round formed again
    assert not w.pol.tails and "r1" not in w.pol.parked and w.pol.counts["split_tokens"] == tail.tokens
    w.check_prefix(req)
    w.release(req)


@needs_0517
def test_a_held_request_whose_tail_runs_past_its_limit_joins_what_is_read_and_computes_the_rest(
        world, monkeypatch, caplog):
    w = world
    req, tail, rounds, ops = _held(w, monkeypatch)
    adder = _Adder(w.cache)
    w.pol.parked["r1"] = 0.0  # its hold limit passed (the disk stalled)
    with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.policy"):
        assert hooks.around_add_chunked_req(adder.add, adder, req) is None and adder.added == [req]
    assert "past its forecast" in caplog.text
    assert len(req.prefix_indices) == tail.start + 2 * PS and rounds == [tail.start + 2 * PS]
    assert not w.pol.tails and not w.pol.parked
    w.check_prefix(req)
    _io_threads_end(w, ops)
    w.release(req)


def _io_threads_end(w, ops) -> None:
    """The controller's IO thread after an operation was ended mid-read: it releases the host
    memory past what the operation counted (`prefetch_io_aux_func`)."""
    for op in ops:
        w.cache.cache_controller.append_host_mem_release(op.host_indices[op.completed_tokens:])


@needs_0517
def test_a_held_request_that_leaves_frees_its_tail_and_its_hold(world, monkeypatch):
    w = world
    req, _, _, ops = _held(w, monkeypatch)
    _read_rest(w, ops)
    w.sched.chunked_req = None
    req.done = True  # aborted while held
    hooks.after_new_prefill_batch(None, w.sched)
    assert not w.pol.tails and not w.pol.parked and not w.cache.ongoing_prefetch
    assert hooks.around_add_chunked_req(_Adder(w.cache).add, _Adder(w.cache), req) is None  # nothing held
    w.load_done()
    w.cache.dec_lock_ref(req.last_node)
    w.drain_host()
    assert w.pool.available_size() == w.host_total - w.host_in_tree() and w.cache.root_node.host_ref_counter == 0


@needs_0517
def test_a_failure_while_holding_drops_the_tail_and_the_request_computes_on(world, monkeypatch, caplog):
    w = world
    req, _, _, ops = _held(w, monkeypatch)
    monkeypatch.setattr(split_mod, "progress", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    adder = _Adder(w.cache)
    assert hooks.around_add_chunked_req(adder.add, adder, req) is None and adder.added == [req]
    assert "could not be held" in caplog.text and not w.pol.tails and not w.pol.parked
    assert len(req.prefix_indices) == 2 * CHUNK
    monkeypatch.undo()
    _io_threads_end(w, ops)
    w.release(req)


@needs_0517
def test_an_adder_without_a_request_cap_never_holds_the_request(world, monkeypatch):
    w = world
    req, tail, rounds, ops = _held(w, monkeypatch)
    adder = types.SimpleNamespace(tree_cache=w.cache, added=[])
    assert hooks.around_add_chunked_req(lambda a, r: a.added.append(r), adder, req) is None and adder.added == [req]
    assert len(req.prefix_indices) == tail.start + 2 * PS and rounds == [tail.start + 2 * PS]  # what was read joined
    assert not w.pol.tails and not w.pol.parked
    w.check_prefix(req)
    _io_threads_end(w, ops)
    w.release(req)


def _write_through(w, *, host_ok):
    """The cache writes through (SGLang's default): backing a node up copies its device pages into
    host slots (`host_ok()` False: the host pool refuses), evicting from the GPU frees its slots."""
    from sglang.srt.mem_cache.evict_policy import LRUStrategy
    ctl, cache = w.cache.cache_controller, w.cache
    ctl.write_policy = "write_through"
    cache.write_through_threshold, cache.ongoing_write_through = 1, {}
    cache.eviction_strategy = LRUStrategy()
    cache.kv_cache = None

    def write(device_indices, node_id=None, **kw):  # the copy itself is SGLang's: slots suffice here
        return w.pool.alloc(len(device_indices)) if host_ok() else None

    ctl.write = write
    ctl.evict_device = lambda idx: w.dev.free_segment(idx)
    ctl.mem_pool_device_allocator = types.SimpleNamespace(free=lambda idx: w.dev.free_segment(idx))


@needs_0517
def test_under_write_through_a_joined_tails_head_stays_locked_until_it_is_backed_up(world):
    """SGLang backs a chunked request's chunks up only when it finishes, and evicts a node not
    backed up only as a leaf with no children at all: a tail joined under its head must keep
    that head from eviction until the head is backed up (else the scheduler stops on its
    assertion), and a host pool that refuses the backup only delays it."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    w = world
    room = [False]
    _write_through(w, host_ok=lambda: room[0])
    req = w.admitted()
    w.read_tail()
    w.compute_chunk(req, CHUNK)
    w.compute_chunk(req, 2 * CHUNK)
    assert len(req.prefix_indices) == PAGES * PS
    assert len(w.pol.guards) == 1
    head = w.pol.guards[0].node
    assert not head.backuped and head.lock_ref >= 2  # the request's lock and the guard's
    w.load_done()
    req.done = True  # the request finished; SGLang could not back its head up (no host room)
    w.cache.dec_lock_ref(req.last_node)
    hooks.after_new_prefill_batch(None, w.sched)
    assert len(w.pol.guards) == 1 and head.lock_ref == 1  # still guarded
    tail_nodes = split_mod._path(w.cache, req.last_node)
    tail_nodes = tail_nodes[:tail_nodes.index(head)]
    assert tail_nodes and all(n.backuped for n in tail_nodes)
    for n in tail_nodes:
        w.cache._evict_backuped(n)  # the tail leaves the GPU (it is on host)
    w.cache.evict(EvictParams(num_tokens=10 ** 6))  # no assertion: the head is locked
    assert head.value is not None
    room[0] = True  # host memory comes back: the next pass backs the head up and lets it go
    hooks.after_new_prefill_batch(None, w.sched)
    assert not w.pol.guards and head.backuped and head.lock_ref == 1  # SGLang's write-through lock only


@needs_0517
def test_a_cut_head_ends_sglangs_first_chunk_in_its_real_adder_and_the_tail_joins_there_byte_exact(world, monkeypatch):
    """0.5.17's real ``PrefillAdder.add_one_req`` with the plugin's cut around it (`cut`): a split
    head of 3 pages, a chunk budget of 4, so SGLang's own chunk would run a page into the tail; the
    chunk ends at the head, the pass's budget stays spent, and the tail joins there."""
    import sglang.srt.managers.schedule_policy as sp
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    from hicache_gds_sglang import cut
    from hicache_gds_sglang.records import SplitPlan

    w = world
    monkeypatch.setattr(cut, "CUT_HOOKED", [True])
    # the server's parallel settings the adder reads (published by a server's start): one rank, no DSA
    monkeypatch.setattr(sp, "is_dsa_prefill_cp_in_seq_split", lambda: False)
    monkeypatch.setattr(sp, "is_prefill_context_parallel_enabled", lambda: False)
    head = 3 * PS
    req = w.request()
    req.sampling_params = types.SimpleNamespace(ignore_eos=False, max_new_tokens=1)
    req.retracted_stain, req.swa_host_hit_length = False, 0
    req.needs_host_load_back = lambda: False
    req.set_extend_range = lambda a, b: setattr(req, "extend_range", (a, b))
    w.pol.split_plans["r1"] = SplitPlan(head, PAGES * PS - head, PAGES * PS)
    monkeypatch.setattr(w.pol, "admit", lambda *a, **kw: 0)  # the decision (its cost model is test_costmodel's)
    w.admit(req)
    tail = w.pol.tails["r1"].load
    assert (tail.start, tail.end) == (head, PAGES * PS)
    w.read_tail()
    w.dev.available_size = lambda: len(w.dev.free_pages) * PS
    adder = PrefillAdder(PS, w.cache, w.dev, None, 0.5, 1 << 20, CHUNK)
    res = cut.around_add_one_req(PrefillAdder.add_one_req, adder, req, False, None)
    assert adder.new_chunked_req is req and adder.can_run_list == [req]
    assert req.extend_range == (0, head)  # cut at the head, not SGLang's 4-page chunk
    assert adder.rem_chunk_tokens <= 0 and res != AddReqResult.CONTINUE
    assert w.pol.counts["split_cut"] == 1
    w.cache.dec_lock_ref(req.last_node)  # the adder's lock, as SGLang drops it after the batch
    w.compute_chunk(req, head)
    assert len(req.prefix_indices) == PAGES * PS, "the whole tail joined at the head"
    w.check_prefix(req)
    assert w.pol.counts["split_tokens"] == tail.tokens
    w.release(req)


def test_a_hold_counts_the_heads_last_chunk_the_gpu_still_runs():
    """SGLang's overlapped scheduler reaches the join point as it launches the head's last chunk:
    the hold weighs the tail's read against computing on after that chunk, not from now (a
    balanced split's tail, read in about the head's compute, was dropped whole on the GPU machine)."""
    from hicache_gds import CostModel, PrefillModel, ReadRate

    pm = PrefillModel()
    pm.seed_coefficients(1.66e-5, 4.11e-9, 0.0, "test")
    model = CostModel(128 * 1024, read=ReadRate(2.0e9, "test"), prefill=pm)
    head, end, n = 5952, 10240, 10304
    tail = split_mod.TailLoad("r", ("r-t0",), None, head, end, end - head, since=time.monotonic())
    req = types.SimpleNamespace(rid="r", origin_input_ids=[0] * n, output_ids=[], prefix_indices=[0] * head,
                                host_hit_length=0)

    class Clock:
        def __init__(self, through, busy):
            self.through, self.busy = through, busy

        def launched_through(self, rid):
            return self.through

        def in_flight(self, now):
            return self.busy

    io_left = model.predict_load((end - head) * 128 * 1024)
    now = model.predict_compute(n - head, head)
    assert io_left > now  # from now, waiting for the tail loses to computing on
    for clock, pays in [(None, False), (Clock(head, 0.2), True), (Clock(head - 64, 0.2), False),
                        (Clock(head, 0.0), False)]:
        pol = types.SimpleNamespace(cost_model=model, clock=clock)
        assert split_policy._hold_pays(pol, req, tail, head, 0) is pays, clock and vars(clock)
    # SGLang counts a tail's pages a get at a time: 0 read, but the disk has read since the tail started
    pol = types.SimpleNamespace(cost_model=model, clock=None)
    started = split_mod.TailLoad("r", ("r-t0",), None, head, end, end - head, since=time.monotonic() - io_left / 2)
    assert split_policy._hold_pays(pol, req, started, head, 0)
    left = split_policy._tail_costs(pol, req, started, head, 0)[0]
    assert left == pytest.approx(io_left / 2, rel=0.05)
    # ... once its reads are under way: a tail still waiting for its query has read nothing
    assert split_policy._tail_costs(pol, req, started, head, 0, False)[0] == pytest.approx(io_left, rel=1e-6)
    assert not split_policy._hold_pays(pol, req, started, head, 0, False)
    # never more than what the pages counted leave
    assert split_policy._tail_costs(pol, req, tail, head, (end - head) // 2)[0] == \
        pytest.approx(model.predict_load((end - head) // 2 * 128 * 1024), rel=1e-6)


@needs_0517
def test_a_finished_load_rides_along_a_chunked_requests_pass_in_sglangs_real_adder(world, monkeypatch):
    """0.5.17's real ``PrefillAdder`` (`ride`): a chunked request takes its next chunk, a request
    decided compute waits ahead of a finished load in the queue. The chunk gives the load's last
    tokens their pages back, the compute request is skipped, the load is added whole beside the
    chunk, and no second chunked request starts; a load with more left than its seat is refused
    by SGLang's own chunk rule, not chunked."""
    import sglang.srt.managers.schedule_policy as sp
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    from hicache_gds_sglang import cut, ride
    from hicache_gds_sglang.records import Decided, Protected

    w = world
    monkeypatch.setattr(cut, "CUT_HOOKED", [True])
    monkeypatch.setattr(sp, "is_dsa_prefill_cp_in_seq_split", lambda: False)
    monkeypatch.setattr(sp, "is_prefill_context_parallel_enabled", lambda: False)
    monkeypatch.setattr(w.b, "policy_config", dataclasses.replace(w.b.policy_config, ride=True))  # off by default
    w.dev.available_size = lambda: len(w.dev.free_pages) * PS
    budget = 16 * PS

    def req(rid, held):
        r = w.request(rid)
        r.sampling_params = types.SimpleNamespace(ignore_eos=False, max_new_tokens=1)
        r.retracted_stain, r.swa_host_hit_length, r.inflight_middle_chunks = False, 0, 0
        r.needs_host_load_back = lambda: False
        r.set_extend_range = lambda a, b, r=r: setattr(r, "extend_range", types.SimpleNamespace(
            start=a, end=b, length=b - a))
        if held:  # its load is read and back on the GPU: all but its last page
            r.prefix_indices = w.dev.alloc(held)
        return r

    chunked, compute, loaded, long_left = req("c", 0), req("x", 0), req("p3", N - PS), req("p4", N - 4 * PS)
    for r, got in ((loaded, N - PS), (long_left, N - 4 * PS)):
        w.pol.decided[r.rid] = Decided("load", N, 0, N - PS)  # the decision forecast one page left for both
        w.pol.protected[r.rid] = Protected(None, 0.0, N - PS)
    w.sched.waiting_queue, w.sched.chunked_req = [compute, long_left, loaded], chunked
    adder = PrefillAdder(PS, w.cache, w.dev, None, 0.5, 1 << 20, budget)
    try:
        out = hooks.hold_or_add(PrefillAdder.add_chunked_req, adder, chunked, True)
        assert out is chunked and (chunked.extend_range.start, chunked.extend_range.end) == (0, budget - 4 * PS)  # two pages a load
        for r in w.sched.waiting_queue:  # the scheduler's loop
            res = cut.around_add_one_req(PrefillAdder.add_one_req, adder, r, has_chunked_req=True,
                                         truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                break
        assert adder.can_run_list == [chunked, loaded] and adder.new_chunked_req is None
        assert (loaded.extend_range.start, loaded.extend_range.end) == (N - PS, N)  # whole: its last page beside the chunk
        assert not hasattr(long_left, "extend_range")  # more than its seat: refused by SGLang's own chunk rule
        assert w.pol.counts["ride"] == 1 and adder.rem_chunk_tokens >= 0
    finally:
        for r in (compute, long_left, loaded):
            w.pol.protected.pop(r.rid, None)
            w.pol.decided.pop(r.rid, None)
        w.sched.waiting_queue, w.sched.chunked_req = [], None
