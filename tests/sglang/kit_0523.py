"""SGLang 0.5.23's own storage test kit (``sglang.test.kits.unified_radix_cache``) with hicache-gds
in place of its ``file`` backend, on CPU: run by `test_kit_0523.py` in a subprocess (the plugin's
hooks, placed by ``load_plugins()``, change SGLang's classes for the whole process).

The kit builds real ``UnifiedRadixCache`` stacks (tree core, host pools, cache controller, the
storage factory) for a GPU. On CPU the kit needs, and this module applies before it runs:

* the device: ``cpu`` (the kit asks ``get_device()``, which knows no CPU);
* host pools without ``cudaHostRegister`` and the ``direct`` / ``layer_first`` transfer path with a
  torch copy for ``transfer_kv_direct`` (sgl-kernel's CUDA kernel), the dummy page unpinned;
* no host-memory reserve (SGLang keeps some GB free of any host pool; the fixtures' are tiny);
* a stub ``datasets`` module (imported by ``sglang.test.test_utils`` for benchmarks only).

Each test prints ``KIT-OK <name>`` when it passes; the exit status is unittest's.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
import types
import unittest
from array import array

if "datasets" not in sys.modules:  # sglang.test.test_utils imports it for its benchmarks only
    sys.modules["datasets"] = types.ModuleType("datasets")
    sys.modules["datasets"].load_dataset = None

import torch  # noqa: E402

import sglang.srt.mem_cache.pool_host.base as host_base  # noqa: E402
import sglang.srt.mem_cache.pool_host.common as host_common  # noqa: E402
import sglang.srt.mem_cache.pool_host.mha as host_mha  # noqa: E402
import sglang.test.kits.unified_radix_cache.fixtures as kit_fixtures  # noqa: E402
import sglang.test.kits.unified_radix_cache.mixins as kit_mixins  # noqa: E402

GDS_DIR = tempfile.mkdtemp(prefix="hgds-kit-")
atexit.register(shutil.rmtree, GDS_DIR, True)  # the store's slab files: never left behind
EXTRA = {"gds_path": GDS_DIR, "capacity": "64M", "prefetch_threshold": 1, "policy_read_gbps": 100.0}


def _cpu() -> None:
    kit_fixtures.get_device = lambda: "cpu"
    host_common._cuda_host_register = lambda *a, **k: None
    host_common._cuda_host_unregister = lambda *a, **k: None
    host_common._cuda_host_unregister_ranges = lambda *a, **k: None
    host_base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 0

    def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=1, **_):
        for src, dst in zip(src_layers, dst_layers):
            dst[dst_indices.long()] = src[src_indices.long()].to(dst.dtype)

    host_mha.transfer_kv_direct = transfer_kv_direct
    host_mha.MHATokenToKVPoolHost.get_dummy_flat_data_page = lambda self: torch.zeros(
        (2, self.layer_num, self.page_size, self.head_num, self.head_dim), dtype=self.dtype).flatten()
    server_args = kit_mixins.ServerArgs

    def cpu_server_args(*args, **kw):
        if "hicache_io_backend" in kw:
            kw.update(hicache_io_backend="direct", hicache_mem_layout="layer_first")
        if kw.get("hicache_storage_backend") == "gds":
            kw["hicache_storage_backend_extra_config"] = json.dumps(EXTRA)
            kw["hicache_storage_prefetch_policy"] = "compute_or_load"
        return server_args(*args, **kw)

    kit_mixins.ServerArgs = cpu_server_args


_cpu()
from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()  # the plugin's hook table, as every SGLang process places it

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType  # noqa: E402
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import node_host_lock_ref, node_host_value  # noqa: E402
from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures  # noqa: E402

from hicache_gds_sglang import HiCacheGDS, plugin, policy_hooks, view  # noqa: E402
from hicache_gds_sglang.records import Decided  # noqa: E402


def _hook_as_sglang_does(target: str) -> None:
    """Place one AROUND hook of `plugin.HOOKS` as SGLang's HookRegistry does (its group needs the
    scheduler, which imports only with a server's packages: not placed by ``load_plugins`` here)."""
    h = next(h for h in plugin.HOOKS if h.target == target)
    cls = plugin._resolve(h.target.rsplit(".", 1)[0])
    name = h.target.rsplit(".", 1)[1]
    original = getattr(cls, name)
    fn = plugin._hook_fn(h.hook)

    def wrapper(self, *args, **kwargs):
        return fn(original, self, *args, **kwargs)

    wrapper.__wrapped__ = original
    setattr(cls, name, wrapper)


class Scheduler(types.SimpleNamespace):
    """What the policy reads of SGLang's Scheduler."""


class GDSInPlaceOfFile(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
    cfg = CacheConfig(page_size=4)

    def setUp(self) -> None:
        override = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        override.__enter__()
        self.addCleanup(override.__exit__, None, None, None)

    def _host_kv(self, cache, seq: list[int]) -> tuple:
        """The host pool's K and V of `seq`'s tokens (first layer), as the tree holds them."""
        node = match_prefix(cache, seq).last_host_node
        idx = torch.cat([node_host_value(cache, n, ComponentType.FULL) for n in self._path_chain(cache, node)])
        kv = cache.cache_controller.mem_pool_host.kv_buffer
        return kv[0, 0, idx.long()].clone(), kv[1, 0, idx.long()].clone()

    def _produce(self, seq: list[int], marker: int):
        """The kit's `_l3_produce`, with ``gds``: KV filled with `marker`, backed up to L3."""
        prod, alloc, rtp = build_fixture(self.cfg)
        self._init_hicache(prod, storage_backend="gds", storage_dir=GDS_DIR, prefetch_threshold=1)
        self._insert(prod, alloc, rtp, seq)
        leaf = match_prefix(prod, seq).last_device_node
        indices = prod.path_device_indices(leaf)
        self._fill_full_kv(alloc, indices, marker=marker)
        self._backup_node(prod, leaf)
        self._write_path_to_l3(prod, leaf)
        self._flush_l3_backups(prod)
        return prod

    def _consumer(self):
        cons, alloc, rtp = build_fixture(self.cfg)
        self._init_hicache(cons, storage_backend="gds", storage_dir=GDS_DIR, prefetch_threshold=1)
        backend = cons.cache_controller.storage_backend
        self.assertIsInstance(backend, HiCacheGDS)
        self.assertEqual(cons.prefetch_stop_policy, "compute_or_load")
        self.assertIsNotNone(view.attached(cons))
        return cons, alloc, rtp

    def test_a_prefix_stored_through_gds_prefetches_into_the_host_tier_under_the_policy(self):
        seq = self._make_seq(1, 6)
        prod = self._produce(seq, marker=7)
        cons, _, _ = self._consumer()
        pol = view.attached(cons)
        self._consume_prefetch(cons, seq, CacheRequestHandle("r", 0))
        self.assertEqual(match_prefix(cons, seq).host_hit_length, len(seq))
        self.assertEqual(pol.decided["r"].action, "load")
        # the bytes: the consumer's host pool holds what the producer's held (device -> host -> gds -> host)
        for a, b in zip(self._host_kv(prod, seq), self._host_kv(cons, seq)):
            self.assertTrue(torch.equal(a, b))
        self.assertTrue(bool((self._host_kv(cons, seq)[0] == 7).all()))
        print("KIT-OK round-trip")

    def test_a_finished_load_keeps_its_host_pages_until_the_gpu_takes_the_request(self):
        _hook_as_sglang_does(f"{plugin._UNIFIED}._handle_prefetch_result")
        self.assertIn("protect@0.5.23", plugin.hooked_groups(plugin.present_groups() | {"protect@0.5.23"}))
        seq = self._make_seq(100, 5)
        self._produce(seq, marker=3)
        cons, _, _ = self._consumer()
        pol = view.attached(cons)
        req = types.SimpleNamespace(rid="p", full_untruncated_fill_ids=array("q", seq), storage_prefetch_last_match_len=0,
                                    extra_key=None, origin_input_ids=seq, output_ids=[], prefix_len=0,
                                    host_hit_length=0)
        sched = Scheduler(waiting_queue=[req], tree_cache=cons, chunked_req=None, chunked_prefill_size=64)
        pol.bind(sched)
        self._consume_prefetch(cons, seq, CacheRequestHandle("p", 0))
        self.assertIn("p", pol.protected)
        node = match_prefix(cons, seq).last_host_node
        self.assertGreater(node_host_lock_ref(cons, node, ComponentType.FULL), 0)
        cons.evict_host(len(seq) * 4)  # another prefill's write-through, host pool full
        policy_hooks.after_new_prefill_batch(None, sched)  # a batch without it: still waiting
        cons.evict_host(len(seq) * 4)
        self.assertEqual(match_prefix(cons, seq).host_hit_length, len(seq))
        sched.waiting_queue = []  # the scheduler took it
        policy_hooks.after_new_prefill_batch(None, sched)
        self.assertNotIn("p", pol.protected)
        self.assertEqual(node_host_lock_ref(cons, node, ComponentType.FULL), 0)
        cons.evict_host(len(seq) * 4)
        self.assertEqual(match_prefix(cons, seq).host_hit_length, 0)
        print("KIT-OK protect")

    def test_a_queued_request_sent_to_the_gpu_is_given_to_the_disk_once_it_loads_in_time(self):
        seq = self._make_seq(300, 5)
        self._produce(seq, marker=5)
        cons, _, _ = self._consumer()
        pol = view.attached(cons)
        self.assertTrue(view.single_rank(cons))
        pol.prefill.seed_coefficients(1 / 100, 0.0, 0.0, "test")  # 100 tokens/s: the GPU is far behind
        ahead = types.SimpleNamespace(rid="big", origin_input_ids=list(range(2000)), output_ids=[], prefix_len=0,
                                      host_hit_length=0)
        req = types.SimpleNamespace(rid="q", full_untruncated_fill_ids=array("q", seq), storage_prefetch_last_match_len=0,
                                    extra_key=None, origin_input_ids=seq, output_ids=[], prefix_len=0, host_hit_length=0)
        handle = CacheRequestHandle("q", 0)
        calls = []

        def prefetch_kvcache(r):  # Scheduler._prefetch_kvcache: the cache's prefetch from its last host node
            calls.append(r.rid)
            return policy_hooks.around_prefetch_kvcache(
                lambda s, q: cons.prefetch_from_storage(handle, cons.root_node_handle(), q.full_untruncated_fill_ids,
                                                        None, None), sched, r)

        sched = Scheduler(waiting_queue=[ahead, req], tree_cache=cons, chunked_req=None, chunked_prefill_size=64,
                          _prefetch_kvcache=prefetch_kvcache)
        pol.bind(sched)
        pol.decided["q"] = Decided("compute", len(seq), 0, len(seq))  # admission sent it to the GPU
        policy_hooks.after_new_prefill_batch(None, sched)  # SGLang formed a batch: a look at the queue
        self.assertEqual(calls, ["q"])
        self.assertEqual(pol.counts["late"], 1)
        self.assertEqual(pol.decided["q"].action, "load")
        self._run_prefetch_to_completion(cons, handle)
        self.assertEqual(match_prefix(cons, seq).host_hit_length, len(seq))
        print("KIT-OK late")


def run_own(cls: type, prefix: str) -> None:
    """Run the tests of `cls` whose names start with `prefix` (a kit's own, not the ones it
    inherits), then leave the process with their verdict (``os._exit``: SGLang's threads stay)."""
    loader = unittest.TestLoader()
    suite = unittest.TestSuite(cls(n) for n in loader.getTestCaseNames(cls) if n.startswith(prefix))
    ok = unittest.TextTestRunner(verbosity=2).run(suite).wasSuccessful()
    sys.stdout.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    assert UnifiedRadixCache is not None
    unittest.main(argv=[sys.argv[0], *sys.argv[1:]], verbosity=2)
    os._exit(0)
