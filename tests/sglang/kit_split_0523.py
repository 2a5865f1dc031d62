"""A split hit on SGLang 0.5.23's real ``UnifiedRadixCache`` (the kit's stacks, `kit_0523.py`'s CPU
set-up), run by `test_kit_0523.py` in a subprocess.

A producer stores a prompt of random tokens with random KV through ``gds``; a consumer's GPU pool
is poisoned, a real ``Req`` holds a KV row, and the GPU "computes" the head (its true bytes) while
the tail loads from L3 as SGLang's own prefetches. SGLang's ``checkpoint(req, up_to=...)`` caches
the chunk (as ``stash_chunked_request`` does), then the plugin's join hook grows the request's
prefix by the tail. Every page the request's row points at is compared with the producer's bytes.
Each test prints ``KIT-OK <name>``.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import types
from array import array

sys.path.insert(0, os.path.dirname(__file__))
import kit_0523 as k  # noqa: E402  (the CPU set-up and load_plugins())

import torch  # noqa: E402

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix  # noqa: E402

from hicache_gds_sglang import HiCacheGDS, plugin, policy_hooks, split_policy, view  # noqa: E402
from hicache_gds_sglang import split as split_mod  # noqa: E402
from hicache_gds_sglang.records import SplitPlan  # noqa: E402

PAGES, HEAD = 12, 8  # 4-token pages: a 48-token prompt, its first 8 tokens computed by the GPU
END = 44  # where a whole load of the prompt ends: SGLang loads at most all but its last token, whole pages
POISON = -77.0


def _layers(alloc):
    pool = alloc.get_kvcache()
    pool = getattr(pool, "full_kv_pool", pool)
    return [(pool.get_key_buffer(i), pool.get_value_buffer(i)) for i in range(pool.start_layer,
                                                                               pool.start_layer + pool.layer_num)]


class SplitOn0523(k.GDSInPlaceOfFile):
    def setUp(self) -> None:
        super().setUp()
        if not getattr(SplitOn0523, "_hooked", False):
            k._hook_as_sglang_does(f"{plugin._UNIFIED}._handle_prefetch_result")
            SplitOn0523._hooked = True
        self.assertIn("split@0.5.23", plugin.hooked_groups(plugin.present_groups() | {"protect@0.5.23",
                                                                                       "split@0.5.23"}))
        split_policy.SPLIT_HOOKED[0] = True  # as plugin.register sets it where the join point is hooked
        self.rng = random.Random(self.id())

    def _produce_random(self, seq):
        """Random KV for `seq`, backed up to L3 through gds; returns its bytes per layer (K, V)."""
        prod, alloc, rtp = build_fixture(self.cfg)
        self._init_hicache(prod, storage_backend="gds", storage_dir=k.GDS_DIR, prefetch_threshold=1)
        self._insert(prod, alloc, rtp, seq)
        leaf = match_prefix(prod, seq).last_device_node
        idx = prod.path_device_indices(leaf).long()
        g = torch.Generator().manual_seed(self.rng.randrange(1 << 30))
        truth = []
        for kb, vb in _layers(alloc):
            kb[idx] = torch.randn(kb[idx].shape, generator=g).to(kb.dtype)
            vb[idx] = torch.randn(vb[idx].shape, generator=g).to(vb.dtype)
            truth.append((kb[idx].clone(), vb[idx].clone()))
        self._backup_node(prod, leaf)
        self._write_path_to_l3(prod, leaf)
        self._flush_l3_backups(prod)
        return truth

    def _world(self):
        seq = [self.rng.randrange(1, 30000) for _ in range(PAGES * self.cfg.page_size)]
        truth = self._produce_random(seq)
        cons, alloc, rtp = self._consumer()
        for kb, vb in _layers(alloc):
            kb.fill_(POISON)
            vb.fill_(POISON)
        req = Req(rid="s", origin_input_text="", origin_input_ids=array("q", seq),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        req.output_ids = array("q")
        req.refresh_fill_ids()
        rtp.alloc([req])
        req.last_node = cons.root_node_handle()
        req.lock = cons.lock(req.last_node)
        sched = k.Scheduler(waiting_queue=[], tree_cache=cons, chunked_req=req, chunked_prefill_size=HEAD)
        pol = view.attached(cons)
        pol.bind(sched)
        return types.SimpleNamespace(seq=seq, truth=truth, cons=cons, alloc=alloc, rtp=rtp, req=req, pol=pol,
                                     sched=sched)

    def _start(self, w, head=HEAD):
        """Admission chose a split (the GPU computes `head` tokens, the rest loads), through the
        cache's ``prefetch_from_storage`` hook as the scheduler calls it on 0.5.23."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        w.pol.split_plans["s"] = SplitPlan(head, len(w.seq) - head, len(w.seq))
        w.pol.admit = lambda *a, **kw: 0  # the decision (its cost model is test_policy's)
        w.pol.current_req = w.req
        fill = w.req.full_untruncated_fill_ids  # what the scheduler prefetches: up to its last token

        def load(*a, **kw):
            raise AssertionError("a split is not a load")

        try:
            policy_hooks.around_admit(load, w.cons, CacheRequestHandle("s", 0), w.cons.root_node_handle(),
                                      fill[:w.req._compute_max_prefix_len(len(fill))], None, None,
                                      matched_prefix_tokens=fill[:0], extra_key=None, cache_salt=None,
                                      storage_hit_end=None)
        finally:
            w.pol.current_req = None
        self.assertIn("s", w.pol.tails)
        return w.pol.tails["s"].load

    def _compute(self, w, start, end):
        """The GPU computes tokens [start, end) of the request: true bytes into fresh slots, then
        SGLang caches the chunk and sets where the next starts (``stash_chunked_request``)."""
        req = w.req
        slots = w.alloc.alloc(end - start)
        w.rtp.write((req.kv.req_pool_idx, slice(start, end)), slots.to(w.rtp.req_to_token.dtype))
        for (kb, vb), (tk, tv) in zip(_layers(w.alloc), w.truth):
            kb[slots.long()] = tk[start:end]
            vb[slots.long()] = tv[start:end]
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end
        w.cons.checkpoint(req, up_to=end)
        req.prefix_len = end

    def _pump(self, w, tail, timeout=10.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            w.cons.check_hicache_events()
            if not split_mod.progress(w.cons, tail)[2]:
                return
            time.sleep(0.01)
        self.fail("the tail did not finish reading")

    def _finish_loads(self, w):
        if w.cons.ready_to_load_host_cache() != -1:
            for ack in list(w.cons.cache_controller.ack_load_queue):
                ack.finish_event.synchronize()
        w.cons.loading_check()

    def _check_row(self, w, n):
        """The request's first `n` tokens point at the producer's bytes, every layer."""
        row = w.rtp.req_to_token[w.req.kv.req_pool_idx, :n].long()
        for (kb, vb), (tk, tv) in zip(_layers(w.alloc), w.truth):
            self.assertTrue(torch.equal(kb[row], tk[:n]))
            self.assertTrue(torch.equal(vb[row], tv[:n]))

    def test_split_tail_joins_byte_exact_where_the_chunk_reaches_it(self):
        w = self._world()
        self.assertTrue(split_policy.can_split(w.pol, w.cons, view.backend_of(w.cons)))  # 0.5.23's cache has it all
        tail = self._start(w)
        self.assertEqual((tail.start, tail.end), (HEAD, END))
        self._pump(w, tail)
        self._compute(w, 0, HEAD)
        head = w.req.last_node
        policy_hooks.after_stash_chunked(None, w.sched, w.req)
        self._finish_loads(w)
        self.assertTrue(w.cons.is_backuped(head))  # write-through: the head went to host before the tail joined it
        self.assertNotIn("s", w.pol.tails)
        self.assertEqual(w.pol.counts["split_tokens"], END - HEAD)
        # tokens and pages as a whole load gives, in the tree and the request's row
        self.assertEqual(w.req.prefix_len, END)
        self.assertEqual(w.req.kv.cache_protected_len, END)
        self.assertEqual(match_prefix(w.cons, w.seq).device_prefix_len, END)
        self._check_row(w, END)
        self._compute(w, END, len(w.seq))  # the last page: computed, as after a whole load
        self._check_row(w, len(w.seq))
        w.cons.unlock(w.req.lock)
        w.cons.sanity_check()
        print("KIT-OK split-join")

    def test_split_tail_pages_the_gpu_computed_first_are_freed_and_the_rest_join(self):
        w = self._world()
        host = w.cons.cache_controller.mem_pool_host
        tail = self._start(w)
        self._pump(w, tail)
        self._compute(w, 0, 2 * HEAD)  # a chunk past the head: the GPU computed 8 tokens of the tail
        free_before = host.available_size()
        policy_hooks.after_stash_chunked(None, w.sched, w.req)
        self._finish_loads(w)
        self.assertEqual(w.req.prefix_len, END)
        self._check_row(w, END)
        # the tail's 8 tokens the GPU computed: their host pages freed; the 16 computed backed up to host
        self.assertEqual(host.available_size(), free_before + HEAD - 2 * HEAD)
        w.cons.unlock(w.req.lock)
        w.cons.sanity_check()
        print("KIT-OK split-overlap")

    def test_split_a_tail_read_that_fails_midway_joins_only_the_pages_read_and_the_gpu_computes_the_rest(self):
        w = self._world()
        ps = self.cfg.page_size
        good = 3  # tail pages read before the failure
        real = HiCacheGDS.batch_get_v1

        def failing(backend, keys, host_indices, extra_info=None):
            out = real(backend, keys[:good], host_indices[:good * ps], extra_info)
            host = w.cons.cache_controller.mem_pool_host
            host.kv_buffer[:, :, host_indices[good * ps:].long()] = POISON  # what a torn read left
            return list(out) + [False] * (len(keys) - good)

        HiCacheGDS.batch_get_v1 = failing
        try:
            tail = self._start(w)
            self._pump(w, tail)
        finally:
            HiCacheGDS.batch_get_v1 = real
        self._compute(w, 0, HEAD)
        policy_hooks.after_stash_chunked(None, w.sched, w.req)
        self._finish_loads(w)
        grown = good * ps
        self.assertEqual(w.req.prefix_len, HEAD + grown)
        self._check_row(w, HEAD + grown)
        self._compute(w, HEAD + grown, len(w.seq))  # the request computes the rest
        self._check_row(w, len(w.seq))
        self.assertEqual(match_prefix(w.cons, w.seq).device_prefix_len, len(w.seq))
        w.cons.unlock(w.req.lock)
        w.cons.sanity_check()
        print("KIT-OK split-fault")

    def test_split_a_tail_still_reading_when_the_chunk_reaches_it_is_dropped_and_frees_its_host_pages(self):
        w = self._world()
        host = w.cons.cache_controller.mem_pool_host
        before = host.available_size()
        gate = threading.Event()
        real = HiCacheGDS.batch_get_v1

        def stalled(backend, keys, host_indices, extra_info=None):
            gate.wait(10)  # the disk times out: nothing is counted until the chunk reached the tail
            host.kv_buffer[:, :, host_indices.long()] = POISON
            return [False] * len(keys)

        HiCacheGDS.batch_get_v1 = stalled
        try:
            self._start(w)
            t0 = time.time()
            while time.time() - t0 < 5 and next(iter(w.cons.ongoing_prefetch.values())).host_indices is None:
                w.cons.check_hicache_events()
                time.sleep(0.01)
            self._compute(w, 0, HEAD)
            policy_hooks.after_stash_chunked(None, w.sched, w.req)
            self.assertNotIn("s", w.pol.tails)
            self.assertEqual(w.req.prefix_len, HEAD)  # nothing joined: the request computes on
            self.assertFalse(any(split_mod._SUFFIX in str(h.rid) for h in w.cons.ongoing_prefetch))
        finally:
            gate.set()
            HiCacheGDS.batch_get_v1 = real
        t0 = time.time()
        while time.time() - t0 < 5 and host.available_size() < before:
            w.cons.check_hicache_events()  # SGLang's ack drain releases what the read held
            time.sleep(0.01)
        self.assertEqual(host.available_size(), before)
        self.assertEqual(w.cons.cache_controller.prefetch_tokens_occupied, 0)
        self._compute(w, HEAD, len(w.seq))
        self._check_row(w, len(w.seq))
        w.cons.unlock(w.req.lock)
        w.cons.sanity_check()
        print("KIT-OK split-timeout")


if __name__ == "__main__":
    k.run_own(SplitOn0523, "test_split")  # not kit_0523's
