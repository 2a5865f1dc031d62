"""Sidecar pools (v2 calls) against HiCacheFile: same hits, same restorable prefixes, same bytes.

0.5.17's HiCacheFile folds several pools differently (the minimum of each pool's longest
restorable prefix, which one pool may be unable to restore); there the expected answer is
built from HiCacheFile's one-pool answers, on which both releases agree.
"""

import itertools

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

from sgl_helpers import (HAS_RESTORABLE, attach, generic_get, generic_set, hicache_file, indices, keys, make_pool,
                         poison, same_pages, storage_config)

try:  # 0.5.17's hybrid controller registers this group as the KV pool (0.5.23: the group's anchor pool)
    from sglang.srt.mem_cache.memory_pool_host import HostPoolGroup, PoolEntry
except ImportError:
    HostPoolGroup = PoolEntry = None

ALL, TRAIL = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES


class StatePool:
    """A Mamba-like sidecar: one state per index (page_size 1), served through the flat-page API only."""

    def __init__(self, n: int = 64, numel: int = 3000, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.page_size, self.layout, self.dtype = 1, "state", torch.float32
        self.buf = torch.randn(n, numel, generator=g)

    def get_data_page(self, index, flat=True):
        return self.buf[index].flatten() if flat else self.buf[index]

    def get_dummy_flat_data_page(self):
        return torch.zeros(self.buf.shape[1], dtype=self.buf.dtype)

    def set_from_flat_data_page(self, index, data_page):
        self.buf[index] = data_page


def _setup(gds_dir, tmp_path, mla=False):
    kind = "mla" if mla else "mha"
    kv, swa, mamba = make_pool(kind, "page_first", seed=1), make_pool("mha", "layer_first", seed=2), StatePool()
    ours = attach(storage_config(gds_dir, is_mla_model=mla), kv)
    ours.register_mem_host_pool_v2(swa, PoolName.SWA)
    ours.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    ours.on_host_pools_registered()
    theirs = hicache_file(str(tmp_path / "file"), kv, is_mla_model=mla)
    for p, name in ((kv, PoolName.KV), (swa, PoolName.SWA), (mamba, PoolName.MAMBA)):
        theirs.register_mem_host_pool_v2(p, name)
    return kv, swa, mamba, ours, theirs


def _write(backends, kv, ks, kv_n, swa_has, mamba_has):
    ours, theirs = backends
    assert ours.batch_set_v1(ks[:kv_n], indices(range(kv_n))) == [True] * kv_n
    assert generic_set(theirs, kv, ks[:kv_n], list(range(kv_n)))
    swa_keys = [ks[i] for i in swa_has]
    mamba_keys = [ks[i] for i in mamba_has]
    transfers = [PoolTransfer(name=PoolName.SWA, host_indices=indices(swa_has), keys=swa_keys),
                 PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor(mamba_has, dtype=torch.int64),
                              keys=mamba_keys)]
    for b in backends:
        res = b.batch_set_v2(transfers)
        assert res[PoolName.SWA] == [True] * len(swa_has) and res[PoolName.MAMBA] == [True] * len(mamba_has)


def _restorable(theirs, probe, transfer):
    """The prefix lengths `transfer`'s pool can restore, by HiCacheFile: one pool at a time, for probe[:p]."""
    t = len(transfer.keys or [])
    out = set()
    for p in range(1, len(probe) + 1):
        one = PoolTransfer(name=transfer.name, keys=probe[p - t:p] if t else None, hit_policy=transfer.hit_policy)
        if theirs.batch_exists_v2(probe[:p], [one]).kv_hit_pages == p:
            out.add(p)
    return out


@pytest.mark.parametrize("mla", [False, True])
def test_exists_v2_matches_hicache_file(gds_dir, tmp_path, mla):
    kv, swa, mamba, ours, theirs = _setup(gds_dir, tmp_path, mla)
    try:
        ks = keys(20)
        _write((ours, theirs), kv, ks, 16, [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 13], [2, 5, 9, 10, 11, 14])
        policies = [(ALL, 0), (TRAIL, 1), (TRAIL, 2), (TRAIL, 3), (TRAIL, 5)]
        for n in (20, 16, 12, 10, 7, 1):
            probe = ks[:n]
            for (ps, ns), (pm, nm) in itertools.product(policies, policies[:3]):
                tr = [PoolTransfer(name=PoolName.SWA, keys=probe[n - ns:] if ns else None, hit_policy=ps),
                      PoolTransfer(name=PoolName.MAMBA, keys=probe[n - nm:] if nm else None, hit_policy=pm)]
                a, b = ours.batch_exists_v2(probe, tr), theirs.batch_exists_v2(probe, tr)
                both = sorted(_restorable(theirs, probe, tr[0]) & _restorable(theirs, probe, tr[1]))
                assert (a.kv_hit_pages, getattr(a, "restorable_prefix_pages", both)) == (max(both, default=0), both)
                if HAS_RESTORABLE:
                    assert (a.kv_hit_pages, a.extra_pool_hit_pages, a.restorable_prefix_pages) == \
                           (b.kv_hit_pages, b.extra_pool_hit_pages, b.restorable_prefix_pages), (n, ps, ns, pm, nm)
                else:  # 0.5.17: never a longer prefix than HiCacheFile, each pool's own count the same
                    assert not hasattr(a, "restorable_prefix_pages") and a.kv_hit_pages <= b.kv_hit_pages
                    assert all(b.extra_pool_hit_pages[k] == v for k, v in a.extra_pool_hit_pages.items())
                for one in tr:  # one pool: the releases agree, and so do we
                    a1, b1 = ours.batch_exists_v2(probe, [one]), theirs.batch_exists_v2(probe, [one])
                    assert (a1.kv_hit_pages, a1.extra_pool_hit_pages) == (b1.kv_hit_pages, b1.extra_pool_hit_pages)
            a, b = ours.batch_exists_v2(probe, None), theirs.batch_exists_v2(probe, None)
            assert a.kv_hit_pages == b.kv_hit_pages
            assert getattr(a, "restorable_prefix_pages", None) == getattr(b, "restorable_prefix_pages", None)
    finally:
        ours.close()


def test_exists_v2_answers_in_the_installed_result_shape_and_never_raises(gds_dir, tmp_path):
    """A malformed or unsupported transfer list is a miss, in the PoolTransferResult this SGLang has."""
    kv, swa, mamba, ours, theirs = _setup(gds_dir, tmp_path)
    try:
        ks = keys(4)
        _write((ours, theirs), kv, ks, 4, [0, 1, 2, 3], [3])
        for tr in ([PoolTransfer(name=PoolName.SWA, keys=ks, hit_policy="no-such-policy")], [object()]):
            r = ours.batch_exists_v2(ks, tr)
            assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (0, {})
            assert getattr(r, "restorable_prefix_pages", []) == []
        r = ours.batch_exists_v2(ks, [PoolTransfer(name=PoolName.SWA, keys=ks, hit_policy=ALL)])
        r.update_kv_hit_pages(1)  # what SGLang's controller does with it
        assert r.kv_hit_pages == 4 and r.extra_pool_hit_pages == {PoolName.KV: 4, PoolName.SWA: 4}
    finally:
        ours.close()


def test_get_v2_reads_the_same_bytes_as_hicache_file(gds_dir, tmp_path):
    kv, swa, mamba, ours, theirs = _setup(gds_dir, tmp_path)
    try:
        ks = keys(12)
        swa_has, mamba_has = list(range(10)), [1, 4, 7]
        _write((ours, theirs), kv, ks, 12, swa_has, mamba_has)
        ref_swa = [swa.get_data_page(p * swa.page_size).clone() for p in swa_has]
        ref_mamba = [mamba.get_data_page(s).clone() for s in mamba_has]
        for b in (ours, theirs):
            for p in range(32, 44):
                swa.set_from_flat_data_page(p * swa.page_size, torch.full_like(ref_swa[0], -7))
            mamba.buf[40:50] = -7
            tr = [PoolTransfer(name=PoolName.SWA, host_indices=indices(range(32, 44)), keys=ks),
                  PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([40, 41, 42]),
                               keys=[ks[i] for i in mamba_has])]
            res = b.batch_get_v2(tr)
            assert res[PoolName.SWA] == [True] * 10 + [False] * 2 and res[PoolName.MAMBA] == [True] * 3
            for i in range(10):
                got = swa.get_data_page((32 + i) * swa.page_size).view(torch.uint8)
                assert torch.equal(got, ref_swa[i].view(torch.uint8)), (type(b).__name__, i)
            for i in range(3):
                assert torch.equal(mamba.get_data_page(40 + i).view(torch.uint8), ref_mamba[i].view(torch.uint8))
        bad = PoolTransfer(name=PoolName.SWA, host_indices=indices(range(3)), keys=ks[:4])
        assert ours.batch_get_v2([bad])[PoolName.SWA] == [False] * 4  # wrong index count: a miss, no raise
        unknown = PoolTransfer(name=PoolName.INDEXER, host_indices=indices(range(2)), keys=ks[:2])
        assert ours.batch_set_v2([unknown])[PoolName.INDEXER] == [False] * 2
    finally:
        ours.close()


def test_mla_sidecars_follow_sglang_writers(gds_dir):
    """Mamba state is per TP rank (every rank writes it); other MLA sidecars are the writer rank's."""
    pools = [(make_pool("mla", "page_first", seed=s), make_pool("mha", "page_first", seed=s + 1),
              StatePool(seed=s + 2)) for s in (0, 10)]
    backends = []
    for rank, (kv, swa, mamba) in enumerate(pools):
        b = attach(storage_config(gds_dir, is_mla_model=True, tp_rank=rank, tp_size=2), kv)
        b.register_mem_host_pool_v2(swa, PoolName.SWA)
        b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        backends.append(b)
    w, r = backends
    ks = keys(4)
    try:
        for b, (kv, swa, mamba) in zip(backends, pools):
            tr = [PoolTransfer(name=PoolName.SWA, host_indices=indices(range(4)), keys=ks),
                  PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(4), keys=ks)]
            assert b.batch_set_v2(tr) == {PoolName.SWA: [True] * 4, PoolName.MAMBA: [True] * 4}
        assert r.stats()["swa"]["read_only"] is True and r.stats()["mamba"]["read_only"] is False  # PageReader
        r_swa, r_mamba = pools[1][1], pools[1][2]
        tr = [PoolTransfer(name=PoolName.SWA, host_indices=indices(range(8, 12)), keys=ks),
              PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(8, 12), keys=ks)]
        assert r.batch_get_v2(tr) == {PoolName.SWA: [True] * 4, PoolName.MAMBA: [True] * 4}
        w_swa = pools[0][1]
        for i in range(4):  # SWA came from the writer; Mamba state is the reader's own
            assert torch.equal(r_swa.get_data_page((8 + i) * 4).view(torch.uint8),
                               w_swa.get_data_page(i * 4).view(torch.uint8))
            assert torch.equal(r_mamba.buf[8 + i], r_mamba.buf[i])
    finally:
        for b in backends:
            b.close()


@pytest.mark.skipif(HostPoolGroup is None, reason="this SGLang hands storage backends the hybrid group's anchor pool, "
                                                  "not its HostPoolGroup")
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_a_host_pool_group_is_served_zero_copy_through_its_anchor(gds_dir, kind):
    kv, mamba = make_pool(kind, "page_first", seed=3), StatePool(seed=4)
    group = HostPoolGroup([PoolEntry(PoolName.KV, kv, None, lambda layer: layer, is_primary_index_anchor=True),
                           PoolEntry(PoolName.MAMBA, mamba, None, lambda layer: None)])
    b = attach(storage_config(gds_dir, is_mla_model=kind == "mla"), group)  # create_backend + register_mem_pool_host
    try:
        for entry in group.entries:  # then HybridCacheController.attach_storage_backend's burst
            b.register_mem_host_pool_v2(entry.host_pool, entry.name)
        st = b.stats()
        assert st["kv"]["pool_path"] == "zero-copy" and st["kv"]["pool_class"] == type(kv).__name__
        assert b.mem_pool_host is group and st["mamba"]["pool_path"] == "copy"
        ks = keys(8)
        assert b.batch_set_v1(ks, indices(range(8))) == [True] * 8
        poison(kv, range(16, 24))
        assert b.batch_get_v1(ks, indices(range(16, 24))) == [True] * 8
        assert same_pages(kv, list(range(8)), kv, list(range(16, 24)))
        assert generic_get(b, group, ks, list(range(32, 40))) == 8  # the controller's copy path, through the group
        assert same_pages(kv, list(range(8)), kv, list(range(32, 40)))
    finally:
        b.close()
