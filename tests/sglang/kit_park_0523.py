"""A split request held for its tail on SGLang 0.5.23 (`park_0523`), on the real
``UnifiedRadixCache`` of `kit_split_0523.py`, run by `test_kit_0523.py` in a subprocess.

The world is `kit_split_0523`'s (random tokens and KV stored through ``gds``, a poisoned GPU pool,
a real ``Req`` with a KV row); the disk is far faster than the GPU, so once the head's chunk is
checkpointed (``stash_chunked_request``) the request is held. Each prefill pass is SGLang's own
``PrefillAdder`` (real class, the plugin's hook placed on ``add_chunked_req`` as SGLang's
HookRegistry does), asked for the chunked request as ``_get_new_batch_prefill_raw`` asks, then
for a waiting request through its real ``add_one_req``. The tail's gets are gated, so a test
decides when its pages land. Each test prints ``KIT-OK <name>``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from array import array

sys.path.insert(0, os.path.dirname(__file__))
import kit_0523 as k  # noqa: E402  (the CPU set-up and load_plugins())
import kit_split_0523 as ks  # noqa: E402

import sglang.srt.managers.cache_controller as cc_mod  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import match_prefix  # noqa: E402

from hicache_gds_sglang import HiCacheGDS, plugin, policy_hooks, split_policy  # noqa: E402
from hicache_gds_sglang import split as split_mod  # noqa: E402

HEAD, END = ks.HEAD, ks.END
ADDER = "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req"


def place_adder_hook(target: str, group: str) -> None:
    """The row of `plugin.HOOKS` for `group` on a ``PrefillAdder`` method, placed as SGLang's
    HookRegistry places an AROUND hook (its group needs the scheduler, which imports only with a
    server's packages)."""
    (h,) = [h for h in plugin.HOOKS if h.target == target and h.group == group]
    fn = plugin._hook_fn(h.hook)
    name = target.rsplit(".", 1)[1]
    original = getattr(PrefillAdder, name)

    def wrapper(self, *args, **kwargs):
        return fn(original, self, *args, **kwargs)

    wrapper.__wrapped__ = original
    setattr(PrefillAdder, name, wrapper)


def _place_hold_hook() -> None:
    place_adder_hook(ADDER, "park@0.5.23")


class HoldOn0523(ks.SplitOn0523):
    def setUp(self) -> None:
        super().setUp()
        if not getattr(HoldOn0523, "_placed", False):
            _place_hold_hook()
            HoldOn0523._placed = True
        self.assertIn("park@0.5.23", plugin.hooked_groups(plugin.present_groups() | {
            "protect@0.5.23", "split@0.5.23", "park@0.5.23"}))
        saved = (split_policy.PARK_HOOKED[0], split_policy.PARK_CHECK_S, split_policy.PARK_SLACK_S,
                 cc_mod.STORAGE_BATCH_SIZE, HiCacheGDS.batch_get_v1)
        split_policy.PARK_HOOKED[0] = True  # as plugin.register sets it where the adder is hooked
        split_policy.PARK_CHECK_S = 0.0  # every pass looks
        split_policy.PARK_SLACK_S = 60.0  # a slow test machine never runs past the hold limit by itself
        cc_mod.STORAGE_BATCH_SIZE = 2  # SGLang counts a tail's pages 2 at a time
        self.gate = threading.Event()  # the tail's gets past the first wait for it
        self.fail_rest = False  # ... and then fail (a torn read)
        self.gets = 0
        real = HiCacheGDS.batch_get_v1
        test = self

        def gated(backend, keys, host_indices, extra_info=None):
            test.gets += 1
            if test.gets > 1:
                test.gate.wait(20)
                if test.fail_rest:
                    test.host.kv_buffer[:, :, host_indices.long()] = ks.POISON  # what a torn read left
                    return [False] * len(keys)
            return real(backend, keys, host_indices, extra_info)

        HiCacheGDS.batch_get_v1 = gated

        def restore():
            self.gate.set()
            (split_policy.PARK_HOOKED[0], split_policy.PARK_CHECK_S, split_policy.PARK_SLACK_S,
             cc_mod.STORAGE_BATCH_SIZE, HiCacheGDS.batch_get_v1) = saved

        self.addCleanup(restore)

    def _held(self):
        """A split whose tail's first get (2 pages) has landed and the rest is gated; the GPU is
        far slower than the disk; the head's chunk computed and checkpointed: the request is held."""
        w = self._world()
        self.addCleanup(self.gate.set)  # before the fixture stops the controller's threads
        w.pol.prefill.seed_coefficients(1 / 100, 0.0, 0.0, "test")  # 100 tokens/s: the GPU is far behind
        self.host = w.cons.cache_controller.mem_pool_host
        w.host_before = self.host.available_size()
        tail = self._start(w)
        self._pump_until(w, tail, lambda read, complete, alive: read >= 2 * self.cfg.page_size)
        self._compute(w, 0, HEAD)
        policy_hooks.after_stash_chunked(None, w.sched, w.req)  # SGLang's stash: the join point
        self.assertIn("s", w.pol.parked)
        self.assertIn("s", w.pol.tails)
        self.assertEqual(w.req.prefix_len, HEAD)
        w.other = Req(rid="o", origin_input_text="", origin_input_ids=array("q", [7] * 12),
                      sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        w.other.output_ids = array("q")
        w.other.refresh_fill_ids()
        w.other.prefix_len = 0
        return w, tail

    def _compute(self, w, start, end):
        super()._compute(w, start, end)
        w.req.extend_end = end  # what SGLang's adder set, then checkpointed (``prefix_len = extend_end``)

    def _pump_until(self, w, tail, cond, timeout=10.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            w.cons.check_hicache_events()
            if cond(*split_mod.progress(w.cons, tail)):
                return
            time.sleep(0.01)
        self.fail(f"the tail did not get there: {split_mod.progress(w.cons, tail)}")

    def _pass(self, w):
        """One prefill pass of 0.5.23's scheduler with `w.req` its chunked request: SGLang's own
        adder, asked as ``_get_new_batch_prefill_raw`` asks (a held pass also asks it to add `w.other`,
        a waiting request: `_held_pass`)."""
        adder = PrefillAdder(self.cfg.page_size, w.cons, w.alloc, ScheduleBatch(reqs=[], batch_is_full=False),
                             0.5, 1 << 20, HEAD)
        w.req.init_next_round_input()
        return adder, adder.add_chunked_req(w.req)

    def _held_pass(self, w):
        adder, kept = self._pass(w)
        w.other.init_next_round_input(w.cons)  # the scheduler's match of a waiting request, then its add
        res = adder.add_one_req(w.other, has_chunked_req=kept is not None, truncation_align_size=None)
        self.assertIs(kept, w.req)  # still the chunked request
        self.assertEqual(adder.can_run_list, [])  # nothing added: no batch is formed this pass
        self.assertEqual(res, AddReqResult.OTHER)  # the waiting request is not added either
        self.assertEqual(w.req.extend_end, w.req.prefix_len)  # nothing for SGLang to stash next pass
        self.assertEqual(w.req.prefix_len, HEAD)

    def _end(self, w):
        self.gate.set()
        self._finish_loads(w)
        w.cons.unlock(w.req.lock)
        w.cons.sanity_check()

    def test_hold_a_held_request_joins_its_whole_tail_once_read_byte_exact(self):
        w, tail = self._held()
        self._held_pass(w)
        self._held_pass(w)  # and the next
        self.gate.set()  # the rest lands
        self._pump_until(w, tail, lambda read, complete, alive: complete)
        adder, kept = self._pass(w)
        self.assertIsNone(kept)  # the last chunk: the 4 tokens after the hit
        self.assertEqual(adder.can_run_list[0], w.req)
        self.assertEqual(w.req.prefix_len, END)  # the whole tail joined
        self.assertEqual((w.req.extend_end, w.req.kv.cache_protected_len), (len(w.seq), END))
        self.assertNotIn("s", w.pol.tails)
        self.assertNotIn("s", w.pol.parked)
        self.assertEqual(w.pol.counts["split_tokens"], tail.tokens)
        self._finish_loads(w)
        self._check_row(w, END)
        self.assertEqual(match_prefix(w.cons, w.seq).device_prefix_len, END)
        self._compute(w, END, len(w.seq))
        self._check_row(w, len(w.seq))
        self._end(w)
        print("KIT-OK hold-join")

    def test_hold_a_hold_past_its_limit_joins_what_is_read_and_the_head_computes_on(self):
        w, tail = self._held()
        self._held_pass(w)
        w.pol.parked["s"] = 0.0  # its hold limit passed (the disk stalled)
        log = _Lines()
        logging.getLogger("hicache_gds_sglang.policy").addHandler(log)
        adder, kept = self._pass(w)
        logging.getLogger("hicache_gds_sglang.policy").removeHandler(log)
        self.assertTrue(any("past its forecast" in m for m in log.lines), log.lines)
        grown = 2 * self.cfg.page_size  # the first get's pages
        self.assertEqual(w.req.prefix_len, HEAD + grown)
        self.assertIs(kept, w.req)  # a chunk of HEAD tokens from there, more to come
        self.assertEqual(adder.can_run_list[0], w.req)
        self.assertEqual(w.req.extend_end, HEAD + grown + HEAD)
        self.assertFalse(w.pol.tails or w.pol.parked)
        self.assertFalse(any(split_mod._SUFFIX in str(h.rid) for h in w.cons.ongoing_prefetch))
        self._finish_loads(w)
        self._check_row(w, HEAD + grown)
        self._compute(w, HEAD + grown, len(w.seq))  # the GPU computes the rest
        self._check_row(w, len(w.seq))
        self.gate.set()
        self._drain(w, lambda: not w.cons.cache_controller.prefetch_tokens_occupied and not w.cons.ongoing_prefetch)
        self._end(w)
        print("KIT-OK hold-limit")

    def test_hold_a_tail_failing_while_held_joins_what_was_read_and_the_gpu_computes_the_rest(self):
        w, tail = self._held()
        self._held_pass(w)
        self.fail_rest = True
        self.gate.set()  # the rest of the tail's gets fail
        self._pump_until(w, tail, lambda read, complete, alive: not alive)
        adder, kept = self._pass(w)
        grown = 2 * self.cfg.page_size
        self.assertEqual(w.req.prefix_len, HEAD + grown)
        self.assertEqual(adder.can_run_list[0], w.req)
        self.assertFalse(w.pol.tails or w.pol.parked)
        self._finish_loads(w)
        self._check_row(w, HEAD + grown)
        self._compute(w, HEAD + grown, len(w.seq))
        self._check_row(w, len(w.seq))
        self.assertEqual(match_prefix(w.cons, w.seq).device_prefix_len, len(w.seq))
        self.gate.set()
        self._drain(w, lambda: not w.cons.cache_controller.prefetch_tokens_occupied and not w.cons.ongoing_prefetch)
        self._end(w)
        print("KIT-OK hold-fault")

    def test_hold_a_request_aborted_while_held_frees_its_tail_and_its_hold(self):
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        w, tail = self._held()
        self._held_pass(w)
        # SGLang's process_pending_chunked_abort: the request finishes, its KV is released, and it is
        # no longer the chunked request; then a prefill pass forms (or not) and the hook sweeps
        w.req.finished_reason = FINISH_ABORT("aborted while held")
        release_kv_cache(w.req, w.cons, checkpoint=False)
        w.sched.chunked_req = None
        policy_hooks.after_new_prefill_batch(None, w.sched)
        self.assertFalse(w.pol.tails or w.pol.parked)
        self.assertFalse(any(split_mod._SUFFIX in str(h.rid) for h in w.cons.ongoing_prefetch))
        self.assertEqual(w.cons.cache_controller.prefetch_tokens_occupied, 0)
        self.gate.set()  # the gated reads end; SGLang's ack drain releases the host pages they held
        # every host page of the tail back (the head's chunk is the tree's: on host where backed up)
        m = match_prefix(w.cons, w.seq)
        self.assertEqual(m.device_prefix_len, HEAD)
        want = w.host_before - (HEAD if w.cons.is_backuped(m.last_device_node) else 0)
        self._drain(w, lambda: self.host.available_size() >= want)
        self.assertEqual(self.host.available_size(), want)
        w.cons.sanity_check()
        print("KIT-OK hold-abort")

    def _drain(self, w, done=lambda: False, timeout=3.0):
        """SGLang's ack drain releases what the tail's ended reads held (until `done`)."""
        t0 = time.time()
        while time.time() - t0 < timeout and not done():
            w.cons.check_hicache_events()
            time.sleep(0.01)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


if __name__ == "__main__":
    logging.getLogger("hicache_gds_sglang.policy").setLevel(logging.INFO)
    k.run_own(HoldOn0523, "test_hold")
