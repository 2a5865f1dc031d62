"""GPU machine only (`pytest -m gpu`): GDSLinker on CUDA device pools shaped like SGLang's.

Device pools are `linker_helpers` mimics of MHATokenToKVPool / MLATokenToKVPool (SGLang itself is
not installed there); the linker runs with its SGLang stand-ins. The GPU-direct engine is chosen
once per session the way `auto` would (NIXL GDS_MT if its VRAM probe passes, else bounce), so
each case does not pay a probe subprocess; `test_auto_*` checks `auto` itself.
"""

import logging
import os
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plugins", "sglang"))

from hicache_gds.engines.gds_probe import probe_gds  # noqa: E402
from hicache_gds.engines.cufile_env import cufile_bounce_pool  # noqa: E402
from hicache_gds.errors import EngineUnavailable  # noqa: E402
from hicache_gds_sglang.gather import DevicePages, gather_pages, scatter_pages  # noqa: E402
from hicache_gds_sglang.linker import GDSLinker  # noqa: E402

import linker_helpers as lh  # noqa: E402

NVFS = os.path.exists("/proc/driver/nvidia-fs/devcount")


@pytest.fixture(scope="session")
def gds_engine(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("probe"))
    p = probe_gds(d, "nixl-gds-mt", timeout=180)
    return "nixl-gds-mt" if p.ok else "bounce"


def _linker(pool, gds_dir, engine, **extra):
    cfg = {"gds_path": gds_dir, "capacity": "128M", "engine": engine, "io_timeout": 120, **extra}
    return GDSLinker(lh.server_args(), lh.make_params(pool), components=None, extra_config=cfg)


def _keys(n, tag="k"):
    return [f"{tag}{i:063x}"[:64] for i in range(n)]


def _same(pool, a, b):
    return all(torch.equal(lh.page_bytes(pool, x), lh.page_bytes(pool, y)) for x, y in zip(a, b))


def _roundtrip(pool, lk, n, seed=0):
    rng = np.random.default_rng(seed)
    pages = rng.permutation(2 * n)
    src, dst = sorted(pages[:n].tolist()), pages[n:].tolist()
    keys = _keys(n)
    lh.fill_random(pool, seed)
    assert lk.offload([lh.kv_transfer(keys, lh.page_indices(src, pool.page_size, "cuda"))])
    assert lh.wait_offloads(lk, 1) == [True]
    assert lk.lookup("r", [lh.kv_transfer(keys)]) == list(range(1, n + 1))
    for b in pool.buffers():  # poison the destinations
        rows = lh.page_indices(dst, pool.page_size, "cuda")
        b.view(torch.uint8)[rows] = 0xEE
    assert lh.run_load(lk, pool, "r", keys, dst)
    torch.cuda.synchronize()
    assert _same(pool, src, dst)


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_offload_and_layer_wise_load_are_byte_exact(gds_dir, gds_engine, kind, dtype, page):
    pool = lh.make_pool(kind, pages=96, page_size=page, dtype=dtype, layers=4, heads=2, head_dim=128,
                        kv_cache_dim=576, device="cuda")
    lk = _linker(pool, gds_dir, gds_engine)
    try:
        _roundtrip(pool, lk, 40, seed=page)
        st = lk.stats()
        assert st["engine"] == gds_engine and st["load_failures"] == 0 and st["offload_failures"] == 0
        if gds_engine != "bounce":
            assert ("compat mode" in st["path"]) == (not NVFS)
    finally:
        lk.close()


def test_direct_mode_for_large_segments(gds_dir, gds_engine):
    torch.cuda.empty_cache()  # fresh cudaMalloc segments: 4 KiB-aligned buffers, as direct IO needs
    pool = lh.make_pool("mha", pages=64, page_size=128, layers=2, heads=8, head_dim=128, device="cuda")  # 256 KiB
    lk = _linker(pool, gds_dir, gds_engine)
    try:
        assert lk.plan.mode == "direct", lk.plan.reason
        _roundtrip(pool, lk, 24)
    finally:
        lk.close()


def test_layers_land_in_order_and_compute_overlaps_the_reads(gds_dir, gds_engine):
    """Llama-like 2 MiB pages: 8-layer groups. Each layer is checked when wait_until returns for it."""
    pool = lh.make_pool("mha", pages=320, page_size=16, layers=32, heads=8, head_dim=128, device="cuda")
    lk = _linker(pool, gds_dir, gds_engine, staging_bytes="64M", capacity="512M")
    try:
        assert lk.plan.mode == "gather" and len(lk.plan.groups) == 4, lk.plan.reason
        n, P = 150, 16
        lh.fill_random(pool, 3)
        src, dst = list(range(n)), list(range(160, 160 + n))
        keys = _keys(n)
        lk.offload([lh.kv_transfer(keys, lh.page_indices(src, P, "cuda"))])
        assert lh.wait_offloads(lk, 1) == [True]
        done, seen = [], []
        real = lk.layer_done_counter.complete
        lk.layer_done_counter.complete = lambda i, layer: (done.append((layer, time.perf_counter())), real(i, layer))
        rows_s, rows_d = lh.page_indices(src, P, "cuda"), lh.page_indices(dst, P, "cuda")

        def on_layer(layer):  # the "forward": layer must be complete now, later ones need not be
            seen.append((layer, time.perf_counter()))
            for b in (pool.k_buffer[layer], pool.v_buffer[layer]):
                assert torch.equal(b[rows_s].view(torch.uint8), b[rows_d].view(torch.uint8)), layer

        assert lh.run_load(lk, pool, "r", keys, dst, on_layer=on_layer)
        assert [layer for layer, _ in done] == list(range(32))
        t_first, t_last = done[0][1], done[-1][1]
        assert seen[0][1] < t_last and t_first < t_last  # layer 0 was usable before the last group landed
    finally:
        lk.close()


def test_fallback_through_pinned_host_staging(gds_dir):
    pool = lh.make_pool("mha", pages=64, page_size=16, layers=4, device="cuda")
    lk = _linker(pool, gds_dir, "bounce")
    try:
        _roundtrip(pool, lk, 24)
        st = lk.stats()
        assert st["engine"] == "bounce" and "pinned host staging" in st["path"]
    finally:
        lk.close()


def test_enable_gds_0_makes_auto_take_the_bounce_path_and_say_why(gds_dir, caplog):
    pool = lh.make_pool("mla", pages=32, page_size=16, layers=3, device="cuda")
    caplog.set_level(logging.INFO)
    lk = _linker(pool, gds_dir, "auto", enable_gds="0")
    try:
        st = lk.stats()
        assert st["engine"] == "bounce" and "ENABLE_GDS=0" in st["engine_reason"]
        assert any("hicache-gds linker:" in r.getMessage() and "bounce" in r.getMessage() for r in caplog.records)
        _roundtrip(pool, lk, 8)
    finally:
        lk.close()


def test_auto_picks_gpu_direct_when_the_probe_passes(gds_dir, gds_engine):
    pool = lh.make_pool("mha", pages=16, page_size=16, layers=2, device="cuda")
    lk = _linker(pool, gds_dir, "auto")
    try:
        st = lk.stats()
        if gds_engine == "bounce":
            assert st["engine"] == "bounce"
        else:
            assert st["engine"].startswith("nixl-gds") and "probe passed" in st["engine_reason"], st["engine_reason"]
        _roundtrip(pool, lk, 6)
    finally:
        lk.close()


@pytest.mark.parametrize("mode", ["direct", "gather"])
def test_more_descriptors_than_the_compat_bounce_pool_never_hang(gds_dir, mode):
    """300 pages of 4 x 256 KiB segments: 600 descriptors per layer read, 1200 per offload."""
    pool_n = min(c for s, c in cufile_bounce_pool() if s > 4096)
    n = max(300, 4 * pool_n + 7)
    torch.cuda.empty_cache()
    pool = lh.make_pool("mha", pages=2 * n + 2, page_size=128, layers=2, heads=8, head_dim=128, device="cuda")
    lk = _linker(pool, gds_dir, "nixl-gds", capacity=f"{n + 8}M",
                 **({} if mode == "direct" else {"gather_below": 64 << 20}))
    try:
        assert lk.plan.mode == mode
        t0 = time.monotonic()
        _roundtrip(pool, lk, n)
        assert time.monotonic() - t0 < 240
    finally:
        lk.close()


@pytest.mark.parametrize("engine", ["kvikio", "cufile"])
def test_alternative_engines_under_the_linker(gds_dir, engine):
    pool = lh.make_pool("mha", pages=64, page_size=16, layers=4, device="cuda")
    try:
        lk = _linker(pool, gds_dir, engine)
    except EngineUnavailable as exc:
        pytest.skip(str(exc))
    try:
        assert lk.stats()["engine"] == engine
        _roundtrip(pool, lk, 24)
    finally:
        lk.close()


@pytest.mark.parametrize("kind, dtype, page, dim, shift", [
    ("mha", torch.bfloat16, 16, 128, 0), ("mha", torch.bfloat16, 16, 128, 4), ("mha", torch.float16, 3, 3, 2),
    ("mla", torch.float8_e4m3fn, 1, 576, 1), ("mla", torch.float16, 5, 7, 0)])
def test_triton_gather_and_scatter_match_the_reference(kind, dtype, page, dim, shift):
    """`shift` moves the staging offsets so the kernel copies in 8-, 4-, 2- and 1-byte units."""
    pool = lh.make_pool(kind, pages=50, page_size=page, dtype=dtype, layers=3, heads=3, head_dim=dim,
                        kv_cache_dim=dim, device="cuda")
    lh.fill_random(pool, 9)
    t = DevicePages(pool, page).table
    starts = torch.tensor([7, 0, 49, 13, 2], device="cuda") * page
    offs = [o + shift for o in t.offsets]
    a = torch.zeros((5, t.page_bytes + 8), dtype=torch.uint8, device="cuda")
    b = a.clone()
    gather_pages(pool.buffers(), starts, page, a, offs, impl="torch")
    gather_pages(pool.buffers(), starts, page, b, offs, impl="triton")
    torch.cuda.synchronize()
    assert torch.equal(a, b)
    for x in pool.buffers():
        x.view(torch.uint8).zero_()
    scatter_pages(pool.buffers(), starts, page, b, offs, impl="triton")
    c = torch.zeros_like(a)
    gather_pages(pool.buffers(), starts, page, c, offs, impl="torch")
    torch.cuda.synchronize()
    assert torch.equal(a, c)


def test_pages_written_by_the_linker_are_read_by_the_hicache_backend(gds_dir, gds_engine):
    """Device pages (checksummed on the GPU) read back through HiCacheGDS's binding of a layer_first
    host pool, verified on the host, and the reverse (host pages into VRAM, verified on the GPU)."""
    from test_linker_cpu import _host_binding

    import sglang_pools
    host, binding = _host_binding("mha", "layer_first", gds_dir, 16, 4, torch.bfloat16)
    keys = _keys(6)
    try:
        assert all(binding.put(keys[:3], sglang_pools.host_indices_for_pages(host, [1, 2, 3])))
    finally:
        binding.store.close()
    pool = lh.make_pool("mha", pages=16, page_size=16, layers=4, heads=2, head_dim=128, device="cuda")
    lh.fill_random(pool, 2)
    lk = _linker(pool, gds_dir, gds_engine, capacity="32M")
    try:
        assert lh.run_load(lk, pool, "r", keys[:3], [4, 5, 6])
        assert all(sglang_pools.page_flat_bytes(host, h) == lh.page_bytes(pool, d).numpy().tobytes()
                   for h, d in zip([1, 2, 3], [4, 5, 6]))
        lk.offload([lh.kv_transfer(keys[3:], lh.page_indices([8, 9, 10], 16, "cuda"))])
        assert lh.wait_offloads(lk, 1) == [True]
    finally:
        lk.close()
    host2, binding = _host_binding("mha", "layer_first", gds_dir, 16, 4, torch.bfloat16)
    try:
        assert binding.get(keys[3:], sglang_pools.host_indices_for_pages(host2, [11, 12, 13])) == [True] * 3
        assert binding.store.stats()["checksum_mismatches"] == 0
        assert all(sglang_pools.page_flat_bytes(host2, h) == lh.page_bytes(pool, d).numpy().tobytes()
                   for h, d in zip([11, 12, 13], [8, 9, 10]))
    finally:
        binding.store.close()
