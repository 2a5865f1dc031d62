"""GDSLinker checks every loaded page against its checksum where it landed (CPU pools here; the GPU
version is tests/test_gpu_checksum.py): a damaged page fails the load before its last layers are
reported, and is dropped; pages stored by HiCacheGDS from host memory verify the same way."""

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "plugins", "sglang"))

from hicache_gds import MemKind, pagesum  # noqa: E402
from hicache_gds_sglang.linker import GDSLinker  # noqa: E402

import linker_helpers as lh  # noqa: E402


def _linker(pool, gds_dir, **extra):
    cfg = {"gds_path": gds_dir, "capacity": "32M", **extra}
    return GDSLinker(lh.server_args(), lh.make_params(pool), components=None, extra_config=cfg)


def _keys(n, tag="k"):
    return [f"{tag}{i:063x}"[:64] for i in range(n)]


def _damage(lk, key):
    store = lk.store
    e = store.index.peek([key])[key]
    fi, off = store.slabs.place(np.array([e.slot]))
    fd = os.open(store.slabs.paths[int(fi[0])], os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xa5" * 256, int(off[0]) + 1024)
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind, extra", [("mha", {}), ("mha", {"gather_below": 64 << 10}), ("mla", {}),
                                         ("mla", {"engine": "bounce"})])
def test_a_damaged_page_fails_the_load_before_its_last_layers_and_is_dropped(gds_dir, kind, extra):
    pool = lh.make_pool(kind, pages=24, page_size=16, layers=4)
    lh.fill_random(pool, 3)
    lk = _linker(pool, gds_dir, **extra)
    try:
        keys = _keys(4)
        assert lk.offload([lh.kv_transfer(keys, lh.page_indices(range(4), 16))])
        assert lh.wait_offloads(lk, 1) == [True]
        stored = lk.scheme.keys(keys)
        rows = lk.store.index.peek(stored)
        # the offloaded pages' checksums, over the page as stored: xxh3 from host memory, hgc1 from device memory
        kind = pagesum.HGC1 if lk.kind is MemKind.VRAM else pagesum.XXH3
        assert [rows[k].csum for k in stored] == [pagesum.page_sum(lh.page_bytes(pool, p).numpy(), lk.store_page_bytes,
                                                                   kind) for p in range(4)]
        assert lh.run_load(lk, pool, "ok", keys, range(8, 12))
        _damage(lk, stored[1])
        done = []
        real = lk.layer_done_counter.complete
        lk.layer_done_counter.complete = lambda i, layer: (done.append(layer), real(i, layer))
        assert not lh.run_load(lk, pool, "bad", keys, range(12, 16))
        last = lk.plan.groups[-1].layers
        assert not set(done) & set(last)  # the last layers were never reported landed
        st = lk.stats()
        assert st["checksum_mismatches"] == 1 and st["load_failures"] == 1
        assert lk.lookup("again", [lh.kv_transfer(keys)]) == [1]  # dropped: the prefix ends before it
        assert lk.store.index.stats()["pinned_slots"] == 0
    finally:
        lk.close()


def test_verification_off_loads_without_checking(gds_dir):
    pool = lh.make_pool("mha", pages=16, page_size=16, layers=2)
    lh.fill_random(pool, 4)
    lk = _linker(pool, gds_dir, verify=False)
    try:
        keys = _keys(2)
        lk.offload([lh.kv_transfer(keys, lh.page_indices(range(2), 16))])
        assert lh.wait_offloads(lk, 1) == [True]
        lk.page_checksums_called = 0
        real = lk.store.page_checksums
        lk.store.page_checksums = lambda p, **kw: (setattr(lk, "page_checksums_called", 1), real(p, **kw))[1]
        assert lh.run_load(lk, pool, "r", keys, [8, 9]) and lk.page_checksums_called == 0
    finally:
        lk.close()
