"""GPU machine only (`pytest -m gpu`): the kvikio and cufile engines on VRAM (and kvikio on DRAM).

An engine whose wheel is not installed is skipped with the reason (`../shared/device/wheels.sh
kvikio` / `wheels.sh cufile`). Every wait has a timeout: a hang fails the test instead of the run.
"""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from hicache_gds import MemKind, PageStore, Pages  # noqa: E402
from hicache_gds.engines import EngineOptions, Op, create_engine  # noqa: E402
from hicache_gds.engines.gds_probe import probe_gds  # noqa: E402
from hicache_gds.errors import EngineUnavailable, RegionError, TransferError  # noqa: E402
from hicache_gds.testing import EngineTests  # noqa: E402

PAGE = 64 << 10
NVFS = os.path.exists("/proc/driver/nvidia-fs/devcount")


def _engine_or_skip(name, **kw):
    try:
        return create_engine(name, EngineOptions(**kw))
    except EngineUnavailable as exc:
        pytest.skip(f"{name}: {exc}")


def _slab(directory, nbytes):
    path = os.path.join(directory, "slab.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, nbytes)
    os.close(fd)
    return path


class VramEngineTests:
    """EngineTests' contract on device memory: random data, poisoned destinations, byte compares."""

    engine_name = ""
    n_pages = 64

    @pytest.fixture
    def engine(self):
        eng = _engine_or_skip(self.engine_name)
        yield eng
        eng.close()

    @pytest.fixture
    def setup(self, engine, tmp_path):
        n = self.n_pages
        g = torch.Generator(device="cuda").manual_seed(n)
        src = torch.randint(0, 256, (n * PAGE,), dtype=torch.uint8, device="cuda", generator=g)
        dst = torch.full((n * PAGE,), 0xA5, dtype=torch.uint8, device="cuda")
        for t in (src, dst):
            engine.register_memory(t.data_ptr(), t.numel(), MemKind.VRAM)
        fid = engine.open_file(_slab(str(tmp_path), n * PAGE))
        yield engine, src, dst, fid
        engine.close_file(fid)

    @staticmethod
    def _descs(base, fid, order, mem_order, size=PAGE):
        mem = np.stack([np.uint64(base) + mem_order.astype(np.uint64) * np.uint64(size),
                        np.full(len(order), size, dtype=np.uint64)], axis=1)
        fil = np.stack([np.full(len(order), fid, dtype=np.uint64), order.astype(np.uint64) * np.uint64(size)], axis=1)
        return mem, fil

    def _roundtrip(self, engine, src, dst, fid, order, size=PAGE):
        step = min(engine.capabilities.max_descs, len(order))
        for op, buf in ((Op.WRITE, src), (Op.READ, dst)):
            for a in range(0, len(order), step):
                mem, fil = self._descs(buf.data_ptr(), fid, order[a:a + step], np.arange(a, min(a + step, len(order))),
                                       size)
                with engine.submit(op, MemKind.VRAM, mem, fil) as t:
                    assert t.wait(60.0) == int(mem[:, 1].sum())
        torch.cuda.synchronize()

    def test_capabilities_name_the_path_and_compat_mode(self, engine):
        caps = engine.capabilities
        assert MemKind.VRAM in caps.mem_kinds
        assert caps.path.startswith(self.engine_name.replace("cufile", "cufile-python"))
        if not NVFS:
            assert "compat mode" in caps.path, caps.path
        assert engine.info()["path"] == caps.path

    def test_roundtrip_random_order(self, setup):
        engine, src, dst, fid = setup
        self._roundtrip(engine, src, dst, fid, np.random.default_rng(2).permutation(self.n_pages))
        assert torch.equal(src, dst)

    def test_large_descriptors(self, setup):
        engine, src, dst, fid = setup
        size = 8 * PAGE * 4  # 2 MiB
        self._roundtrip(engine, src, dst, fid, np.array([1, 0]), size)
        assert torch.equal(src[:2 * size], dst[:2 * size])

    def test_many_descriptors_in_one_request_complete(self, engine, tmp_path):
        """300 descriptors in one request each way (more than cuFile's compat bounce pool holds),
        in shuffled orders, read back and compared byte for byte."""
        n = 300
        g = torch.Generator(device="cuda").manual_seed(300)
        src = torch.randint(0, 256, (n * PAGE,), dtype=torch.uint8, device="cuda", generator=g)
        dst = torch.full((n * PAGE,), 0xA5, dtype=torch.uint8, device="cuda")
        for t in (src, dst):
            engine.register_memory(t.data_ptr(), t.numel(), MemKind.VRAM)
        fid = engine.open_file(_slab(str(tmp_path), n * PAGE))
        try:
            rng = np.random.default_rng(3)
            if engine.capabilities.max_descs < n:
                pytest.skip(f"{engine.name} takes at most {engine.capabilities.max_descs} descriptors per request")
            w = rng.permutation(n)  # memory page w[i] -> file page w[i], posted in this order
            mem, fil = self._descs(src.data_ptr(), fid, w, w)
            with engine.submit(Op.WRITE, MemKind.VRAM, mem, fil) as t:
                assert t.wait(120.0) == n * PAGE
            r = rng.permutation(n)
            mem, fil = self._descs(dst.data_ptr(), fid, r, r)
            with engine.submit(Op.READ, MemKind.VRAM, mem, fil) as t:
                assert t.wait(120.0) == n * PAGE
            torch.cuda.synchronize()
            assert torch.equal(src, dst)
        finally:
            engine.close_file(fid)

    def test_unregistered_memory_is_refused(self, setup):
        engine, src, dst, fid = setup
        other = torch.zeros(PAGE, dtype=torch.uint8, device="cuda")
        mem, fil = self._descs(other.data_ptr(), fid, np.arange(1), np.arange(1))
        with pytest.raises(RegionError, match="outside every registered"):
            engine.submit(Op.WRITE, MemKind.VRAM, mem, fil)

    def test_read_past_end_of_file_is_a_transfer_error(self, setup):
        engine, src, dst, fid = setup
        mem, fil = self._descs(dst.data_ptr(), fid, np.array([self.n_pages + 4]), np.arange(1))
        try:
            t = engine.submit(Op.READ, MemKind.VRAM, mem, fil)
        except TransferError:
            return
        with pytest.raises(TransferError):
            t.wait(60.0)

    def test_concurrent_threads(self, setup):
        engine, src, dst, fid = setup
        errors, n, k = [], self.n_pages, 4

        def worker(w):
            try:
                mine = np.arange(w, n, k)
                for op, buf in ((Op.WRITE, src), (Op.READ, dst)):
                    mem, fil = self._descs(buf.data_ptr(), fid, mine, mine)
                    engine.submit(op, MemKind.VRAM, mem, fil).wait(60.0)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        torch.cuda.synchronize()
        assert not errors and torch.equal(src, dst)


class TestKvikioVram(VramEngineTests):
    engine_name = "kvikio"


class TestCuFileVram(VramEngineTests):
    engine_name = "cufile"


class TestKvikioDram(EngineTests):
    def make_engine(self):
        return _engine_or_skip("kvikio")


def test_cufile_dram_is_refused_clearly():
    eng = _engine_or_skip("cufile")
    try:
        with pytest.raises(RegionError, match="cannot move DRAM"):
            eng.register_memory(1 << 20, 4096, MemKind.DRAM)
    finally:
        eng.close()


@pytest.mark.parametrize("engine", ["kvikio", "cufile"])
@pytest.mark.parametrize("page", [256 << 10, 2 << 20])
def test_pagestore_vram_roundtrip(gds_dir, engine, page):
    _engine_or_skip(engine).close()
    n = 24
    g = torch.Generator(device="cuda").manual_seed(page)
    src = torch.randint(0, 256, (n * page,), dtype=torch.uint8, device="cuda", generator=g)
    dst = torch.full_like(src, 0xEE)
    try:
        store = PageStore(page, {"gpu": engine}, config={"gds_path": gds_dir, "engine": engine,
                                                         "capacity": 2 * n * page}, mem_kinds=(MemKind.VRAM,))
    except EngineUnavailable as exc:  # refused cleanly, never loaded into this process (see the probe test)
        assert "failed its probe" in str(exc) and "cufio-plat" in str(exc), exc
        pytest.xfail(f"{engine} refused after its probe: {exc}")
    with store as s:
        s.register_tensor(src)
        s.register_tensor(dst)
        idx = np.random.default_rng(0).permutation(n)
        keys = [f"v{i}" for i in range(n)]
        assert all(s.put(keys, Pages.contiguous(src.data_ptr(), page, idx, MemKind.VRAM)))
        assert all(s.get(keys, Pages.contiguous(dst.data_ptr(), page, idx, MemKind.VRAM)))
        torch.cuda.synchronize()
        assert torch.equal(src, dst)
        assert ("compat mode" in s.stats()["path"]) == (not NVFS)


@pytest.mark.parametrize("engine", ["kvikio", pytest.param("cufile", marks=pytest.mark.xfail(
    reason="on the H200 and H100 VMs cufile-python aborts in libcufile (cufio-plat:149) when it is a process's "
           "first cuFile user (the probe subprocess is); a named cufile engine is then refused with that reason "
           "instead of being loaded into the serving process",
    strict=False))])
def test_enable_gds_1_accepts_the_engine_after_its_probe(gds_dir, engine, monkeypatch):
    _engine_or_skip(engine).close()
    p = probe_gds(gds_dir, engine, timeout=120)
    assert p.ok, p.reason
    monkeypatch.setenv("ENABLE_GDS", "1")
    with PageStore(1 << 20, {"e": engine}, config={"gds_path": gds_dir, "engine": engine, "capacity": 16 << 20},
                   mem_kinds=(MemKind.VRAM,)) as s:
        assert s.stats()["engine"] == engine and s.stats()["gpu_direct"] in (True, False)


def test_cufile_imports_although_only_libcufile_so_0_is_installed(tmp_path):
    """The nvidia-cufile wheel ships libcufile.so.0 only; load_cufile bridges that in a fresh process."""
    _engine_or_skip("cufile").close()
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"} | {
        "LD_LIBRARY_PATH": ":".join(p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":")
                                    if p and "hicache-gds-cufile" not in p)}
    code = "from hicache_gds.engines.cufile_engine import load_cufile; print(load_cufile().CuFile.__name__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "CuFile" in out.stdout, out.stderr[-2000:]
