"""A split's head cut where it ends (`cut`) in SGLang 0.5.23's real ``PrefillAdder``, on the real
``UnifiedRadixCache`` of `kit_split_0523.py`, run by `test_kit_0523.py` in a subprocess.

The world is `kit_park_0523`'s (random tokens and KV stored through ``gds``, a poisoned GPU pool,
a real ``Req`` with a KV row, the plugin's hooks placed on ``add_one_req`` and
``add_chunked_req`` as SGLang's HookRegistry places them). The pass's chunk budget is larger than
the split's head, so without the cut SGLang's first chunk would run past the tail's start; with
it the chunk ends at the head, the tail joins there, and the request's next chunk starts after
the tail. Each test prints ``KIT-OK <name>``.
"""

from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import kit_0523 as k  # noqa: E402  (the CPU set-up and load_plugins())
import kit_park_0523 as kp  # noqa: E402

from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import match_prefix  # noqa: E402

from hicache_gds_sglang import cut, plugin, policy_hooks  # noqa: E402

ADD = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"


class CutOn0523(kp.HoldOn0523):
    def setUp(self) -> None:
        super().setUp()
        if not getattr(CutOn0523, "_cut_placed", False):
            kp.place_adder_hook(ADD, "cut@0.5.23")
            CutOn0523._cut_placed = True
        self.assertIn("cut@0.5.23", plugin.hooked_groups(plugin.present_groups() | {
            "protect@0.5.23", "split@0.5.23", "park@0.5.23", "cut@0.5.23"}))
        saved = cut.CUT_HOOKED[0]
        cut.CUT_HOOKED[0] = True  # as plugin.register sets it where both adder points are hooked
        self.addCleanup(lambda: cut.CUT_HOOKED.__setitem__(0, saved))
        self.gate.set()  # every get of the tail reads at once

    def _split(self, w, head):
        """Admission chose a split with a `head`-token head; its whole tail is read."""
        tail = self._start(w, head)
        self.assertEqual(tail.start, head)
        self._pump_until(w, tail, lambda read, complete, alive: complete)
        return tail

    def _first_pass(self, w, budget):
        """SGLang's adder adds the request as a waiting one (its first chunk)."""
        adder = PrefillAdder(self.cfg.page_size, w.cons, w.alloc, ScheduleBatch(reqs=[], batch_is_full=False),
                             0.5, 1 << 20, budget)
        w.req.init_next_round_input(w.cons)
        res = adder.add_one_req(w.req, has_chunked_req=False, truncation_align_size=None)
        return adder, res

    def _finish(self, w, joined):
        """The joined prefix is the producer's bytes, every page in the tree; the GPU computes the
        rest, and the whole row is the producer's bytes."""
        self._finish_loads(w)
        self._check_row(w, joined)
        self.assertEqual(match_prefix(w.cons, w.seq).device_prefix_len, joined)
        self._compute(w, joined, len(w.seq))
        self._check_row(w, len(w.seq))
        self._end(w)

    def test_cut_a_split_requests_first_chunk_ends_at_its_head_and_its_tail_joins_there_byte_exact(self):
        w = self._world()
        ps = self.cfg.page_size
        head = 2 * ps
        tail = self._split(w, head)
        adder, res = self._first_pass(w, budget=8 * ps)  # SGLang's chunk would be 8 pages
        self.assertIs(adder.new_chunked_req, w.req)
        self.assertEqual(adder.can_run_list, [w.req])
        self.assertEqual((w.req.prefix_len, w.req.extend_end), (0, head))  # cut at the head
        self.assertLessEqual(adder.rem_chunk_tokens, 0)  # the chunk is spent: nothing else starts a chunk
        self.assertNotEqual(res, AddReqResult.CONTINUE)
        self.assertEqual(w.pol.counts["split_cut"], 1)
        self._compute(w, 0, head)  # the GPU computes the head, SGLang checkpoints it
        policy_hooks.after_stash_chunked(None, w.sched, w.req)  # the join point
        self.assertEqual(w.req.prefix_len, tail.end)  # the whole tail joined at the head's end
        self.assertEqual(w.pol.counts["split_tokens"], tail.end - head)
        adder, kept = self._pass(w)  # the next chunk starts after the tail: the last tokens
        self.assertIsNone(kept)
        self.assertEqual(w.req.extend_end, len(w.seq))
        self._finish(w, tail.end)
        print("KIT-OK cut-first")

    def test_cut_a_head_past_the_first_chunk_is_cut_in_the_chunked_requests_next_chunk(self):
        w = self._world()
        ps = self.cfg.page_size
        head, budget = 3 * ps, 2 * ps  # the head spans a whole chunk and one page of the next
        tail = self._split(w, head)
        adder, _ = self._first_pass(w, budget)
        self.assertEqual(w.req.extend_end, budget)  # a whole chunk: the head ends beyond it
        self.assertEqual(w.pol.counts["split_cut"], 0)
        self._compute(w, 0, budget)
        policy_hooks.after_stash_chunked(None, w.sched, w.req)  # not at the tail yet: nothing joins
        self.assertEqual(w.req.prefix_len, budget)
        adder = PrefillAdder(ps, w.cons, w.alloc, ScheduleBatch(reqs=[], batch_is_full=False), 0.5, 1 << 20, budget)
        w.req.init_next_round_input()
        kept = adder.add_chunked_req(w.req)
        self.assertIs(kept, w.req)
        self.assertEqual(w.req.extend_end, head)  # the next chunk cut at the head: one page
        self.assertLessEqual(adder.rem_chunk_tokens, 0)
        self.assertEqual(w.pol.counts["split_cut"], 1)
        self._compute(w, budget, head)
        policy_hooks.after_stash_chunked(None, w.sched, w.req)
        self.assertEqual(w.req.prefix_len, tail.end)
        self._finish(w, tail.end)
        print("KIT-OK cut-next")

    def test_cut_off_by_config_the_chunk_keeps_sglangs_size(self):
        w = self._world()
        ps = self.cfg.page_size
        head = 2 * ps
        self._split(w, head)
        backend = w.cons.cache_controller.storage_backend
        backend = getattr(backend, "_backend", backend)
        real = backend.policy_config
        object.__setattr__(backend, "policy_config", type(real)(**{**real.__dict__, "split_cut": False}))
        try:
            adder, _ = self._first_pass(w, budget=4 * ps)
        finally:
            object.__setattr__(backend, "policy_config", real)
        self.assertEqual(w.req.extend_end, 4 * ps)  # SGLang's chunk: past the tail's start
        self.assertEqual(w.pol.counts["split_cut"], 0)
        self._compute(w, 0, 4 * ps)
        policy_hooks.after_stash_chunked(None, w.sched, w.req)  # the tail joins past what the GPU computed
        self._finish(w, w.req.prefix_len)
        print("KIT-OK cut-off")


if __name__ == "__main__":
    logging.getLogger("hicache_gds_sglang.policy").setLevel(logging.INFO)
    k.run_own(CutOn0523, "test_cut")
