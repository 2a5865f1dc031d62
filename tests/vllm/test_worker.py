"""The worker's region math, and a store/load round trip through it on CPU tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_manager import key
from test_spec import BASE_EXTRA, make_config
from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor,
                                     GPULoadStoreSpec)

from hicache_gds_vllm import HiCacheGDSOffloadingSpec, HiCacheLoadSpec, HiCacheStoreSpec
from hicache_gds_vllm.regions import GroupGeometry, chunks_for, coalesce, plan_group
from hicache_gds_vllm.spec import store_key

PAGE = 4096


def geo(layers=2, bpc=4, stride=PAGE, nblocks=16):
    bases = [0x100000 + layer * nblocks * stride for layer in range(layers)]
    return GroupGeometry.build(bases, [stride] * layers, [PAGE] * layers, bpc)


def test_full_chunks_are_ref_major_and_coalesce_per_layer():
    g = geo()
    plan = plan_group(g, np.array([4, 5, 6, 7, 8, 9, 10, 11]), 0, 0x9000000, 1 << 20)
    assert len(plan) == 2 and plan.real.all() and plan.nbytes == 2 * 2 * 4 * PAGE
    # Page 0 = layer 0 blocks 4..7, then layer 1 blocks 4..7.
    want = [0x100000 + b * PAGE for b in (4, 5, 6, 7)] + [0x100000 + 16 * PAGE + b * PAGE for b in (4, 5, 6, 7)]
    assert plan.addrs[0].tolist() == want
    # Consecutive blocks merge to one segment per layer; layer 0's block 15 would touch layer 1's block 0.
    ((rows, a, ln),) = coalesce(plan.addrs, plan.lens)
    assert rows.tolist() == [0, 1] and a.shape == (2, 2) and (ln == 4 * PAGE).all()


def test_partial_first_and_last_chunk_use_distinct_scratch():
    g = geo()
    ids = np.array([3, 9, 2, 7, 5])  # 5 blocks after skipping 2 sub-blocks: chunks [_ _ 3 9] [2 7 5 _]
    assert chunks_for(5, 2, 4) == 2
    plan = plan_group(g, ids, 2, 0x9000000, 1 << 20)
    assert plan.real.tolist() == [[False, False, True, True] * 2, [True, True, True, False] * 2]
    fake = plan.addrs[~plan.real]
    assert len(set(fake.tolist())) == len(fake) == 6  # never two reads into one scratch address
    assert (fake >= 0x9000000).all() and (fake < 0x9000000 + 6 * PAGE).all()
    assert plan.addrs[0, 2] == 0x100000 + 3 * PAGE and plan.addrs[1, 4] == 0x100000 + 16 * PAGE + 2 * PAGE
    assert plan.nbytes == 5 * 2 * PAGE
    with pytest.raises(ValueError, match="scratch"):
        plan_group(g, ids, 2, 0x9000000, 5 * PAGE)
    with pytest.raises(ValueError, match="skip"):
        plan_group(g, ids, 4, 0x9000000, 1 << 20)


def test_coalesce_buckets_pages_with_different_shapes():
    g = geo(bpc=2)
    plan = plan_group(g, np.array([1, 2, 8, 3]), 0, 0x9000000, 1 << 20)  # chunk 0 contiguous, chunk 1 not
    buckets = coalesce(plan.addrs, plan.lens)
    shapes = {tuple(rows.tolist()): a.shape[1] for rows, a, _ in buckets}
    assert shapes == {(0,): 2, (1,): 4}
    for rows, a, ln in buckets:  # bytes per page unchanged
        assert (ln.sum(axis=1) == plan.lens[rows].sum(axis=1)).all()


def make_worker(gds_dir, layers=3, nblocks=24, bpc=4, seed=0):
    """A worker over CPU 'GPU' tensors laid out as vLLM's LBHNC (one allocation, a view per layer)."""
    page = 2 * PAGE
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randint(0, 256, (layers, nblocks, page), dtype=torch.uint8, generator=gen)
    tensors = [CanonicalKVCacheTensor(kv[i].view(torch.int8), page) for i in range(layers)]
    refs = [[CanonicalKVCacheRef(i, page) for i in range(layers)]]
    extra = {**BASE_EXTRA, "blocks_per_chunk": bpc, "gds_path": gds_dir, "capacity": "16M", "preallocate": False}
    spec = HiCacheGDSOffloadingSpec(make_config(extra, layers=layers, bytes_per_block=layers * page))
    return spec, spec.get_worker(CanonicalKVCaches(tensors, refs)), kv


def test_worker_round_trip_partial_first_chunk_byte_exact(gds_dir):
    spec, w, kv = make_worker(gds_dir, nblocks=32)
    keys = [store_key(key(i)) for i in range(3)]
    w.submit_store(1, GPULoadStoreSpec(list(range(1, 13)), [12], [0]), HiCacheStoreSpec(keys))
    w.drain()
    assert [r.success for r in w.get_finished()] == [True]
    want = kv[:, 2:13].clone()  # sub-blocks 1..11 of the three chunks
    kv[:, 13:].fill_(0x5A)
    scratch_before = kv[:, 13:].clone()
    dst = [31, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]  # scattered, non-contiguous first block
    w.submit_load(2, HiCacheLoadSpec(keys), GPULoadStoreSpec(dst, [11], [1]), expedited=True)
    w.wait({2})
    (res,) = w.get_finished()
    assert res.success and res.transfer_size == 11 * 3 * 2 * PAGE
    for i, b in enumerate(dst):
        assert torch.equal(kv[:, b], want[:, i]), f"block {b}"
    untouched = [b for b in range(13, 32) if b not in dst]
    assert torch.equal(kv[:, untouched], scratch_before[:, [b - 13 for b in untouched]])
    w.shutdown()


def test_store_failure_is_reported_done_and_logged(gds_dir, monkeypatch):
    spec, w, kv = make_worker(gds_dir)
    monkeypatch.setattr(w.stores[0], "put", lambda keys, pages: [False] * len(keys))
    keys = [store_key(key(i)) for i in range(2)]
    w.submit_store(5, GPULoadStoreSpec(list(range(8)), [8], [0]), HiCacheStoreSpec(keys))
    w.drain()
    (res,) = w.get_finished()
    assert res.success and res.transfer_size == 0  # vLLM asserts success: a store failure stays ours
    from hicache_gds_vllm.sidecar import FailureLog
    assert FailureLog(spec.sidecar.failure_log(spec.config.engine_id, 0)).poll() == keys
    w.shutdown()


def test_missing_chunk_on_load_is_a_failed_job(gds_dir):
    spec, w, kv = make_worker(gds_dir)
    w.submit_load(3, HiCacheLoadSpec([store_key(key(99))]), GPULoadStoreSpec([0, 1, 2, 3], [4], [0]))
    w.drain()
    (res,) = w.get_finished()
    assert not res.success
    w.shutdown()


def test_drops_and_clear_apply_before_the_write(gds_dir):
    spec, w, kv = make_worker(gds_dir)
    a, b, c = (store_key(key(i)) for i in range(3))
    w.submit_store(1, GPULoadStoreSpec(list(range(8)), [8], [0]), HiCacheStoreSpec([a, b]))
    w.drain()
    assert w.stores[0].exists([a, b]) == [True, True]
    w.submit_store(2, GPULoadStoreSpec(list(range(4)), [4], [0]), HiCacheStoreSpec([c], drops=[a]))
    w.drain()
    assert w.stores[0].exists([a, b, c]) == [False, True, True]
    w.submit_store(3, GPULoadStoreSpec(list(range(4)), [4], [0]), HiCacheStoreSpec([a], clear=True))
    w.drain()
    assert w.stores[0].exists([a, b, c]) == [True, False, False]
    w.shutdown()
