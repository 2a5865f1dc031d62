"""What the plugin adds to a request that L3 does not serve (a host-only hit), against HiCacheNixl.

    python benchmarks/bench_host_hit.py [--dir DIR] [--tokens 10240] [--reps 200] [--json OUT]

SGLang 0.5.23's real classes on CPU, as the scheduler and the prefetch thread call them for one
request whose prompt the host pool holds and whose new tail (``--tail`` tokens) L3 does not:

* the existence query: ``batch_exists`` on the keys of the prompt's pages (none stored), the call
  the prefetch thread makes before it reads (`HiCacheController`'s ``_storage_hit_query``, in
  batches of 128 keys), for HiCacheGDS and HiCacheNixl on the same directory's device;
* the policy hooks of plugins/sglang that run per request or per scheduler step when they decide
  nothing -- ``Scheduler._prefetch_kvcache`` (every admitted request), the cache's
  ``prefetch_from_storage`` (admission of the tail), ``_can_terminate_prefetch`` (every step while
  the prefetch runs), ``prefetch_rate_limited`` (the prefetch thread) and
  ``TpModelWorker.forward_batch_generation`` (every prefill batch) -- each timed around a no-op
  `original` against the no-op alone: what the hook adds.

Prints per-call microseconds (median, p99) and the per-request total in ms: one existence query
of ``--tokens`` / page tokens keys, each hook once, ``--steps`` scheduler steps of the
termination check. The issue's bound: at most 5 ms per request; anything above 1 ms is a bug.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests"), os.path.join(HERE, "..", "tests", "sglang"),
                os.path.join(HERE, "..", "plugins", "sglang"), HERE]

PS, LAYERS, HEADS, HEAD_DIM = 64, 4, 2, 64


def timed(fn, reps: int) -> dict:
    out = []
    for _ in range(reps):
        t = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t) / 1e3)
    out.sort()
    return {"median_us": round(statistics.median(out), 1), "p99_us": round(out[int(0.99 * (len(out) - 1))], 1)}


def nixl_backend(root: str, pool):
    from hicache_gds._nixl import nixl_api
    api = nixl_api()
    sys.modules.setdefault("nixl", sys.modules[api.__name__.split(".")[0]])
    sys.modules.setdefault("nixl._api", api)
    os.environ["SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"] = os.path.join(root, "nixl")
    os.environ.setdefault("SGLANG_HICACHE_NIXL_BACKEND_PLUGIN", "POSIX")
    from sglang.srt.mem_cache.storage.nixl.hicache_nixl import HiCacheNixl
    from sgl_helpers import storage_config
    b = HiCacheNixl(storage_config(None, extra={"l3_cleaner_enabled": False}))
    b.register_mem_pool_host(pool)
    return b


class Scheduler(types.SimpleNamespace):
    """What the policy reads of SGLang's Scheduler (held weakly by the policy, as the real one)."""


def policy_cache(b):
    """SGLang 0.5.23's UnifiedRadixCache and HiCacheController, constructor-less, with what the
    prefetch paths read (as tests/sglang/test_policy.py builds them), the plugin's policy settled on it."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from hicache_gds_sglang import policy_hooks as hooks
    from hicache_gds_sglang.policy import POLICY
    hooks.SUPPORTED.add(UnifiedRadixCache)
    ctl = object.__new__(HiCacheController)
    ctl.enable_storage, ctl.storage_backend, ctl.storage_backend_type = True, b, "gds"
    ctl.page_size, ctl.prefetch_queue, ctl.prefetch_tokens_occupied = PS, queue.Queue(), 0
    ctl.mem_pool_host = types.SimpleNamespace(size=98304, logical_size=98304)
    ctl.prefetch_capacity_limit, ctl.host_memory_mode = 98304 // 2, "cache"
    cache = object.__new__(UnifiedRadixCache)
    cache.tree_core = types.SimpleNamespace(page_size=PS, enable_storage=True, is_eagle=False)
    cache.page_size, cache.prefetch_threshold, cache.prefetch_stop_policy = PS, 256, POLICY
    cache.cache_controller, cache.ongoing_prefetch = ctl, {}
    hooks._settle(cache)
    return cache, ctl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory for both backends (default: a temporary one)")
    ap.add_argument("--tokens", type=int, default=10240, help="prompt tokens (keys: tokens / 64)")
    ap.add_argument("--tail", type=int, default=512, help="new tokens admitted for a prefetch L3 cannot serve")
    ap.add_argument("--steps", type=int, default=4, help="scheduler steps the prefetch is checked on")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    root = tempfile.mkdtemp(dir=args.dir, prefix="host-hit-")
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args, root: str) -> None:
    import torch
    from sgl_helpers import make_pool, storage_config
    from hicache_gds_sglang import HiCacheGDS
    from hicache_gds_sglang import policy_hooks as hooks
    from sglang.srt.managers.cache_controller import PrefetchOperation  # noqa: F401 -- 0.5.17's place
    pool = make_pool("mha", "page_first", pages=64, page_size=PS, layer_num=LAYERS, head_num=HEADS,
                     head_dim=HEAD_DIM)
    os.makedirs(os.path.join(root, "gds"))
    gds = HiCacheGDS(storage_config(os.path.join(root, "gds"), extra={"capacity": "64M"}), pool)
    gds.register_mem_host_pool_v2(pool, "kv")
    nixl = nixl_backend(root, pool)
    # some pages stored, so the index and the directory are not empty
    idx = torch.arange(8 * PS)
    gds.batch_set_v1([f"stored-{i:04d}" for i in range(8)], idx)
    nixl.batch_set_v1([f"stored-{i:04d}" for i in range(8)], idx)
    npages = args.tokens // PS
    res: dict = {"tokens": args.tokens, "keys": npages, "calls": {}}

    def exists_all(b):
        keys = [f"{os.urandom(8).hex()}{i:056x}" for i in range(npages)]

        def call():
            for i in range(0, len(keys), 128):  # the prefetch thread's batches
                b.batch_exists(keys[i:i + 128])
        return call
    for name, b in (("HiCacheGDS", gds), ("HiCacheNixl", nixl)):
        call = exists_all(b)
        res["calls"][f"batch_exists {npages} keys (none stored): {name}"] = timed(call, args.reps)
        one = [f"{os.urandom(8).hex()}"]
        res["calls"][f"batch_exists 1 key: {name}"] = timed(lambda: b.batch_exists(one), args.reps)

    cache, ctl = policy_cache(gds)
    noop = lambda *a, **k: None  # noqa: E731
    sched = Scheduler(tree_cache=cache, waiting_queue=[], chunked_req=None, chunked_prefill_size=8192,
                                  running_batch=None)
    req = types.SimpleNamespace(rid="r0", origin_input_ids=list(range(args.tokens)), output_ids=[],
                                prefix_indices=list(range(args.tokens - args.tail)), host_hit_length=0,
                                fill_ids=list(range(args.tokens)))
    tail = list(range(args.tail))
    op = types.SimpleNamespace(request_id="r0", hash_value=[], completed_tokens=0, host_indices=None,
                               _terminated_flag=False, is_terminated=lambda: False, increment=lambda n: None,
                               mark_terminate=lambda: None)
    mode = types.SimpleNamespace(is_extend=lambda: True, is_mixed=lambda: False)
    batch = types.SimpleNamespace(forward_mode=mode, extend_lens=[args.tail], prefix_lens=[args.tokens - args.tail])
    worker = types.SimpleNamespace()
    hook_calls = {
        "_prefetch_kvcache (per request)": (lambda: hooks.around_prefetch_kvcache(noop, sched, req), 1),
        "prefetch_from_storage (tail not in L3)": (
            lambda: hooks.around_admit(noop, cache, "r0", None, tail, None, None), 1),
        "_can_terminate_prefetch (per step)": (lambda: hooks.around_can_terminate(noop, cache, op), args.steps),
        "prefetch_rate_limited (prefetch thread)": (lambda: hooks.around_rate_limited(noop, ctl), 1),
        "forward_batch_generation (prefill)": (lambda: hooks.around_forward(noop, worker, batch), 1),
    }
    base = timed(lambda: noop(sched, req), args.reps)["median_us"]
    per_request_us = 0.0
    for name, (fn, times) in hook_calls.items():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 -- reported, not timed
            res["calls"][f"hook {name}"] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        t = timed(fn, args.reps)
        t["added_us"] = round(t["median_us"] - base, 1)
        t["per_request"] = times
        res["calls"][f"hook {name}"] = t
        per_request_us += t["added_us"] * times
    gds_q = res["calls"][f"batch_exists {npages} keys (none stored): HiCacheGDS"]["median_us"]
    nixl_q = res["calls"][f"batch_exists {npages} keys (none stored): HiCacheNixl"]["median_us"]
    res["per_request_ms"] = {"HiCacheGDS existence query": round(gds_q / 1e3, 3),
                             "HiCacheNixl existence query": round(nixl_q / 1e3, 3),
                             "policy hooks added": round(per_request_us / 1e3, 3),
                             "plugin total": round((gds_q + per_request_us) / 1e3, 3),
                             "plugin total minus HiCacheNixl's query": round((gds_q + per_request_us - nixl_q) / 1e3, 3)}
    for k, v in res["calls"].items():
        print(f"{k:60s} {v}")
    print(json.dumps(res["per_request_ms"], indent=1))
    gds.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
