"""Finished loads ride along a chunked request's pass (`ride`) in SGLang 0.5.23's real
``PrefillAdder``, on the real ``UnifiedRadixCache`` of `kit_split_0523.py`, run by
`test_kit_0523.py` in a subprocess.

The world is `kit_cut_0523`'s (the plugin's hooks placed on ``add_chunked_req`` and
``add_one_req`` as SGLang's HookRegistry places them). The chunked request has its first chunk
computed and checkpointed; three requests wait: one decided compute, then two whose loads have
finished (decided ``load``, protected), each sharing the chunk's computed prefix. One has a page
left past it, as forecast; the other has three, more than its seat. A pass is asked as
``_get_new_batch_prefill_raw`` asks: the chunked request's next chunk, then the waiting queue in
order until an add answers other than ``CONTINUE``. Each test prints ``KIT-OK <name>``.
"""

from __future__ import annotations

import logging
import os
import sys
from array import array
from dataclasses import replace

sys.path.insert(0, os.path.dirname(__file__))
import kit_0523 as k  # noqa: E402  (the CPU set-up and load_plugins())
import kit_cut_0523 as kc  # noqa: E402

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from hicache_gds_sglang import ride  # noqa: E402
from hicache_gds_sglang.records import Decided, Protected  # noqa: E402

BUDGET = 32  # the pass's chunk budget (tokens; 4-token pages)


class RideOn0523(kc.CutOn0523):
    """`kit_cut_0523`'s world with both adder hooks placed (`kit_park_0523.HoldOn0523`'s hold on
    ``add_chunked_req``, the cut's on ``add_one_req``) and every tail get reading at once."""

    def setUp(self) -> None:
        super().setUp()
        saved = ride.RIDE_SHARE
        ride.RIDE_SHARE = 0.5  # two seats of two pages in a 32-token chunk
        self.addCleanup(lambda: setattr(ride, "RIDE_SHARE", saved))

    def _waiting(self, w, rid, tokens, decided=None):
        r = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        r.output_ids = array("q")
        r.refresh_fill_ids()
        r.prefix_len = 0
        r.init_next_round_input(w.cons)  # the scheduler's match of it in an earlier pass
        if decided is not None:
            w.pol.decided[rid] = decided
            w.pol.protected[rid] = Protected(None, 0.0, decided.hit)
        return r

    def test_ride_a_finished_load_is_added_whole_beside_the_chunk_and_nothing_else_starts_a_chunk(self):
        w = self._world()
        ps = self.cfg.page_size
        backend = w.cons.cache_controller.storage_backend
        backend = getattr(backend, "_backend", backend)
        real = backend.policy_config
        object.__setattr__(backend, "policy_config", replace(real, ride=True))
        self.addCleanup(lambda: object.__setattr__(backend, "policy_config", real))
        self._compute(w, 0, 2 * ps)  # the chunked request's first chunk, checkpointed into the tree
        head = list(w.seq[:2 * ps])
        compute = self._waiting(w, "x", [9] * (3 * ps))
        rider = self._waiting(w, "p", head + [11] * ps, Decided("load", 3 * ps, 0, 2 * ps))
        long_left = self._waiting(w, "q", head + [13] * (3 * ps), Decided("load", 3 * ps, 0, 2 * ps))
        self.assertEqual((rider.prefix_len, long_left.prefix_len), (2 * ps, 2 * ps))  # their loads, in the tree
        w.sched.waiting_queue = [compute, rider, long_left]
        adder = PrefillAdder(ps, w.cons, w.alloc, ScheduleBatch(reqs=[], batch_is_full=False), 0.5, 1 << 20, BUDGET)
        w.req.init_next_round_input()
        kept = adder.add_chunked_req(w.req)
        self.assertIs(kept, w.req)  # still the chunked request
        self.assertEqual(w.req.extend_end, 2 * ps + BUDGET - 4 * ps)  # two seats of two pages given back
        for r in w.sched.waiting_queue:
            res = adder.add_one_req(r, has_chunked_req=kept is not None, truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                break
        self.assertEqual(adder.can_run_list, [w.req, rider])
        self.assertIsNone(adder.new_chunked_req)  # no second chunked request
        self.assertEqual((rider.prefix_len, rider.extend_end), (2 * ps, 3 * ps))  # whole: its last page
        self.assertEqual(w.pol.counts["ride"], 1)
        for rid in ("p", "q"):
            w.pol.protected.pop(rid, None)
            w.pol.decided.pop(rid, None)
        w.cons.unlock(rider.lock)
        self._end(w)
        print("KIT-OK ride")


if __name__ == "__main__":
    logging.getLogger("hicache_gds_sglang.policy").setLevel(logging.INFO)
    k.run_own(RideOn0523, "test_ride")
