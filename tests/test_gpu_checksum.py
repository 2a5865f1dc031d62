"""GPU machine only (`pytest -m gpu`): the page checksum on CUDA memory, and what it catches there.

* the Triton kernel and the torch fallback give numpy's value on device pages (contiguous, in
  segments at odd boundaries, padded);
* a page damaged on disk and read into VRAM (PageStore, GDSLinker) is a miss, dropped, its
  destination not trusted; host pages read into VRAM verify, and the reverse;
* a put right after the kernel that wrote its pages, without a sync by the caller, stores (and
  checksums) the finished bytes.
"""

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plugins", "sglang"))

from hicache_gds import MemKind, PageStore, Pages  # noqa: E402
from hicache_gds import checksum as C  # noqa: E402
from hicache_gds.engines.gds_probe import probe_gds  # noqa: E402
from hicache_gds.testing import integrity  # noqa: E402

import linker_helpers as lh  # noqa: E402


@pytest.fixture(scope="session")
def gds_engine(tmp_path_factory):
    p = probe_gds(str(tmp_path_factory.mktemp("probe")), "nixl-gds-mt", timeout=180)
    return "nixl-gds-mt" if p.ok else "bounce"


def _host(t):
    return t.cpu().numpy()


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("n", [1, 6, 4095, 4096, 5000, 65536 + 12, 2 << 20])
def test_device_checksums_equal_the_host_definition(impl, n):
    if impl == "triton":
        assert C.triton_available(), C._triton_state.get("why")
    g = torch.Generator(device="cuda").manual_seed(n)
    pages = torch.randint(0, 256, (3, n + 64), dtype=torch.uint8, device="cuda", generator=g)
    addrs = np.array([[pages[i].data_ptr()] for i in range(3)], dtype=np.uint64)
    lens = np.full((3, 1), n, dtype=np.uint64)
    host = _host(pages)
    want = [C.checksum(host[i, :n]) for i in range(3)]
    assert C.device_checksums(addrs, lens, n, impl=impl).tolist() == want
    assert C.device_checksums(addrs, lens, n + 8192, impl=impl).tolist() == [C.checksum(host[i, :n], n + 8192)
                                                                            for i in range(3)]
    if n > 16:  # each page cut in three at odd places, the pieces scattered (layer_first)
        rng = np.random.default_rng(n)
        cuts = [sorted(rng.integers(1, n, 2).tolist()) for _ in range(3)]
        pieces = [[pages[i, :c[0]].clone(), pages[i, c[0]:c[1]].clone(), pages[i, c[1]:n].clone()]
                  for i, c in enumerate(cuts)]
        sa = np.array([[p.data_ptr() for p in ps] for ps in pieces], dtype=np.uint64)
        sl = np.array([[p.numel() for p in ps] for ps in pieces], dtype=np.uint64)
        assert C.device_checksums(sa, sl, n, impl=impl).tolist() == want


def test_store_device_pages_damaged_on_disk_are_misses_and_verify_across_host_and_device(gds_dir, gds_engine):
    for case in integrity.gpu_corruption_cases(gds_dir, engine=gds_engine):
        assert case.ok, (case.problems, case.outcome)
        assert case.caught == case.injected == 4 and case.wrong_bytes == 0


@pytest.mark.parametrize("engine", ["bounce", "gds"])
def test_a_put_right_after_the_kernel_that_wrote_the_pages_stores_the_finished_bytes(gds_dir, gds_engine, engine):
    eng = gds_engine if engine == "gds" else "bounce"
    page, n = 1 << 20, 32
    a = torch.randn((n * page // 4,), device="cuda")
    with PageStore(page, {"sync": engine}, config={"gds_path": gds_dir, "engine": eng, "capacity": 4 * n * page},
                   mem_kinds=(MemKind.VRAM,)) as s:
        src = torch.empty((n * page,), dtype=torch.uint8, device="cuda")
        dst = torch.full_like(src, 0xEE)
        s.register_tensor(src)
        s.register_tensor(dst)
        for _ in range(20):  # queue enough work that the last write is still running when put starts
            a = a * 1.0001 + 0.5
        src.view(torch.float32).copy_(a)  # no synchronize: put must wait for this stream's work
        keys = [f"k{i}" for i in range(n)]
        assert all(s.put(keys, Pages.contiguous(src.data_ptr(), page, range(n), MemKind.VRAM)))
        assert all(s.get(keys, Pages.contiguous(dst.data_ptr(), page, range(n), MemKind.VRAM)))
        torch.cuda.synchronize()
        assert torch.equal(src, dst)


def test_linker_load_of_a_damaged_page_fails_before_its_last_layers(gds_dir, gds_engine):
    pool = lh.make_pool("mha", pages=32, page_size=16, layers=4, heads=2, head_dim=128, device="cuda")
    lh.fill_random(pool, 11)
    from hicache_gds_sglang.linker import GDSLinker
    lk = GDSLinker(lh.server_args(), lh.make_params(pool), components=None,
                   extra_config={"gds_path": gds_dir, "capacity": "64M", "engine": gds_engine, "io_timeout": 120})
    try:
        keys = [f"k{i:063x}"[:64] for i in range(6)]
        assert lk.offload([lh.kv_transfer(keys, lh.page_indices(range(6), 16, "cuda"))])
        assert lh.wait_offloads(lk, 1) == [True]
        stored = lk.scheme.keys(keys)
        rows = lk.store.index.peek(stored)
        torch.cuda.synchronize()
        # pages written from GPU memory carry hgc1 (odd): the kernel's value, the host definition's
        assert [rows[k].csum for k in stored] == [C.checksum(lh.page_bytes(pool, p).numpy(), lk.store_page_bytes) | 1
                                                  for p in range(6)]
        assert lh.run_load(lk, pool, "ok", keys, range(8, 14))
        e = rows[stored[3]]
        fi, off = lk.store.slabs.place(np.array([e.slot]))
        fd = os.open(lk.store.slabs.paths[int(fi[0])], os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x5a" * 4096, int(off[0]) + 4096)
        finally:
            os.close(fd)
        done = []
        real = lk.layer_done_counter.complete
        lk.layer_done_counter.complete = lambda i, layer: (done.append(layer), real(i, layer))
        assert not lh.run_load(lk, pool, "bad", keys, range(16, 22))
        assert not set(done) & set(lk.plan.groups[-1].layers)
        assert lk.stats()["checksum_mismatches"] == 1
        assert lk.lookup("again", [lh.kv_transfer(keys)]) == [1, 2, 3]
    finally:
        lk.close()
