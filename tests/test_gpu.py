"""GPU machine only (`pytest -m gpu`): NIXL GDS / GDS_MT and bounce from VRAM, cuFile compat mode."""


import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from hicache_gds import MemKind, PageStore, Pages  # noqa: E402
from hicache_gds.engines.gds_probe import probe_gds  # noqa: E402
from hicache_gds.engines.cufile_env import cufile_bounce_pool, gds_compat_mode  # noqa: E402
from hicache_gds.testing import EngineTests  # noqa: E402


class TestNixlGdsDram(EngineTests):
    engine_name = "nixl-gds"


class TestNixlGdsMtDram(EngineTests):
    engine_name = "nixl-gds-mt"


@pytest.mark.parametrize("engine", ["nixl-gds", "nixl-gds-mt"])
def test_probe_passes_and_names_compat_mode(gds_dir, engine):
    p = probe_gds(gds_dir, engine, timeout=120)
    assert p.ok, p.reason
    assert p.compat_mode == gds_compat_mode()


def _vram_pages(n, page, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    src = torch.randint(0, 256, (n * page,), dtype=torch.uint8, device="cuda", generator=g)
    dst = torch.full((n * page,), 0xEE, dtype=torch.uint8, device="cuda")
    return src, dst


@pytest.mark.parametrize("engine", ["nixl-gds", "nixl-gds-mt", "bounce"])
@pytest.mark.parametrize("page", [256 << 10, 2 << 20, 8 << 20])
def test_vram_roundtrip(gds_dir, engine, page):
    n = 24
    src, dst = _vram_pages(n, page, seed=page)
    with PageStore(page, {"gpu": engine}, config={"gds_path": gds_dir, "engine": engine, "capacity": 2 * n * page},
                   mem_kinds=(MemKind.VRAM,)) as s:
        s.register_tensor(src)
        s.register_tensor(dst)
        idx = np.random.default_rng(0).permutation(n)
        keys = [f"v{i}" for i in range(n)]
        assert all(s.put(keys, Pages.contiguous(src.data_ptr(), page, idx, MemKind.VRAM)))
        assert all(s.get(keys, Pages.contiguous(dst.data_ptr(), page, idx, MemKind.VRAM)))
        torch.cuda.synchronize()
        assert torch.equal(src, dst)
        st = s.stats()
        if engine != "bounce":
            assert ("compat mode" in st["path"]) == gds_compat_mode()


@pytest.mark.parametrize("engine", ["nixl-gds", "nixl-gds-mt"])
def test_more_descriptors_than_the_bounce_pool_never_hang(gds_dir, engine):
    pool = min(c for s, c in cufile_bounce_pool() if s > 4096)
    n, page = pool * 3 + 7, 256 << 10  # ~200 descriptors of 256 KiB: hangs cuFile if sent at once
    src, dst = _vram_pages(n, page, seed=7)
    with PageStore(page, {"many": engine}, config={"gds_path": gds_dir, "engine": engine,
                                                   "capacity": 2 * n * page, "io_timeout": 120},
                   mem_kinds=(MemKind.VRAM,)) as s:
        s.register_tensor(src)
        s.register_tensor(dst)
        keys = [f"m{i}" for i in range(n)]
        assert all(s.put(keys, Pages.contiguous(src.data_ptr(), page, range(n), MemKind.VRAM)))
        assert all(s.get(keys, Pages.contiguous(dst.data_ptr(), page, range(n), MemKind.VRAM)))
        torch.cuda.synchronize()
        assert torch.equal(src, dst)


def test_enable_gds_1_picks_a_gpu_direct_engine(gds_dir, monkeypatch):
    monkeypatch.setenv("ENABLE_GDS", "1")
    with PageStore(1 << 20, {"auto": 1}, config={"gds_path": gds_dir, "capacity": 64 << 20}) as s:
        st = s.stats()
        assert st["gpu_direct"] and st["engine"].startswith("nixl-gds"), st["engine_reason"]
        assert "probe passed" in st["engine_reason"]


def test_auto_for_vram_clients_prefers_gds_and_says_why(gds_dir):
    with PageStore(1 << 20, {"auto": 2}, config={"gds_path": gds_dir, "capacity": 64 << 20},
                   mem_kinds=(MemKind.VRAM,)) as s:
        assert s.stats()["gpu_direct"]


def test_dram_pages_through_gds_engine(gds_dir):
    page, n = 1 << 20, 16
    src = torch.randint(0, 256, (n * page,), dtype=torch.uint8).pin_memory()
    dst = torch.full((n * page,), 0xEE, dtype=torch.uint8).pin_memory()
    with PageStore(page, {"dram": 1}, config={"gds_path": gds_dir, "engine": "nixl-gds",
                                              "capacity": 2 * n * page}) as s:
        s.register_tensor(src)
        s.register_tensor(dst)
        keys = [f"d{i}" for i in range(n)]
        assert all(s.put(keys, Pages.contiguous(src.data_ptr(), page, range(n))))
        assert all(s.get(keys, Pages.contiguous(dst.data_ptr(), page, range(n))))
        assert torch.equal(src, dst)




def test_host_written_page_reads_into_vram_with_verify_on(gds_dir):
    page = 1 << 20
    src = torch.randint(0, 256, (page,), dtype=torch.uint8).pin_memory()
    dst = torch.full((page,), 0xEE, dtype=torch.uint8, device="cuda")
    with PageStore(page, {"mix": 1}, config={"gds_path": gds_dir, "capacity": 8 * page, "verify": True},
                   mem_kinds=(MemKind.DRAM, MemKind.VRAM)) as s:
        s.register_tensor(src)
        s.register_tensor(dst)
        assert s.put(["k"], Pages.contiguous(src.data_ptr(), page, [0])) == [True]
        assert s.get(["k"], Pages.contiguous(dst.data_ptr(), page, [0], MemKind.VRAM)) == [True]
        torch.cuda.synchronize()
        assert torch.equal(src, dst.cpu()) and s.exists(["k"]) == [True]
