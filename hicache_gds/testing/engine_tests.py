"""`EngineTests`: what every TransferEngine must do, as a pytest class to subclass.

Subclasses set `engine_name` (or override `make_engine`). Data is random, destinations are
poisoned before reads, and comparisons are on bytes.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from ..engines import EngineOptions, MemKind, Op, create_engine
from ..errors import RegionError, TransferError
from ..memory import HostBuffer

__all__ = ["EngineTests", "random_bytes"]

PAGE = 64 << 10


def random_bytes(buf: HostBuffer, seed: int) -> np.ndarray:
    arr = buf.numpy()
    arr[:] = np.random.default_rng(seed).integers(0, 256, arr.size, dtype=np.uint8)
    return arr


def _file(directory: str, nbytes: int) -> str:
    path = os.path.join(directory, "slab.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, nbytes)
    os.close(fd)
    return path


class EngineTests:
    engine_name = ""
    n_pages = 64

    def make_engine(self):
        return create_engine(self.engine_name, EngineOptions())

    @pytest.fixture
    def engine(self):
        eng = self.make_engine()
        yield eng
        eng.close()

    @pytest.fixture
    def setup(self, engine, tmp_path):
        n = self.n_pages
        src, dst = HostBuffer(n * PAGE), HostBuffer(n * PAGE)
        engine.register_memory(src.addr, src.nbytes, MemKind.DRAM)
        engine.register_memory(dst.addr, dst.nbytes, MemKind.DRAM)
        fid = engine.open_file(_file(str(tmp_path), n * PAGE))
        yield engine, src, dst, fid
        engine.close_file(fid)

    def _descs(self, base: int, fid: int, order: np.ndarray, mem_order: np.ndarray | None = None):
        n = len(order)
        mem_order = np.arange(n) if mem_order is None else mem_order
        mem = np.stack([np.uint64(base) + mem_order.astype(np.uint64) * np.uint64(PAGE),
                        np.full(n, PAGE, dtype=np.uint64)], axis=1)
        fil = np.stack([np.full(n, fid, dtype=np.uint64), order.astype(np.uint64) * np.uint64(PAGE)], axis=1)
        return mem, fil

    def _roundtrip(self, engine, src, dst, fid, order):
        caps = engine.capabilities
        n = len(order)
        step = min(caps.max_descs, n)
        for op, buf in ((Op.WRITE, src), (Op.READ, dst)):
            for a in range(0, n, step):
                mem, fil = self._descs(buf.addr, fid, order[a:a + step], np.arange(a, min(a + step, n)))
                with engine.submit(op, MemKind.DRAM, mem, fil) as t:
                    assert t.wait(30.0) == int(mem[:, 1].sum())

    def test_capabilities_name_the_path(self, engine):
        caps = engine.capabilities
        assert caps.path and MemKind.DRAM in caps.mem_kinds and caps.max_descs >= 1
        info = engine.info()
        assert engine.name in info["engine"] and info["path"] == caps.path

    def test_roundtrip_random_order(self, setup):
        engine, src, dst, fid = setup
        data = random_bytes(src, 1)
        dst.numpy()[:] = 0xA5
        order = np.random.default_rng(2).permutation(self.n_pages)
        self._roundtrip(engine, src, dst, fid, order)
        assert np.array_equal(dst.numpy(), data)

    def test_unregistered_memory_is_refused(self, setup):
        engine, src, dst, fid = setup
        other = HostBuffer(PAGE)
        mem, fil = self._descs(other.addr, fid, np.arange(1))
        with pytest.raises(RegionError, match="outside every registered"):
            engine.submit(Op.WRITE, MemKind.DRAM, mem, fil)

    def test_region_running_past_buffer_end_is_refused(self, setup):
        engine, src, dst, fid = setup
        mem, fil = self._descs(src.addr + (self.n_pages - 1) * PAGE, fid, np.arange(2))
        with pytest.raises(RegionError):
            engine.submit(Op.WRITE, MemKind.DRAM, mem, fil)

    def test_misaligned_descriptor_is_refused(self, setup):
        engine, src, dst, fid = setup
        if engine.capabilities.alignment <= 1:
            pytest.skip("engine has no alignment constraint")
        mem, fil = self._descs(src.addr + 512, fid, np.arange(1))
        mem[:, 1] = PAGE - 512
        with pytest.raises(RegionError, match="aligned"):
            engine.submit(Op.WRITE, MemKind.DRAM, mem, fil)

    def test_too_many_descriptors_is_refused(self, setup):
        engine, src, dst, fid = setup
        n = engine.capabilities.max_descs + 1
        if n > 1 << 16:
            pytest.skip("limit too large to exercise")
        mem = np.tile([[src.addr, 4096]], (n, 1)).astype(np.uint64)
        fil = np.tile([[fid, 0]], (n, 1)).astype(np.uint64)
        with pytest.raises(ValueError, match="exceed"):
            engine.submit(Op.WRITE, MemKind.DRAM, mem, fil)

    def test_read_past_end_of_file_fails_with_transfer_error(self, setup):
        engine, src, dst, fid = setup
        mem, fil = self._descs(dst.addr, fid, np.array([self.n_pages + 4]))
        try:
            t = engine.submit(Op.READ, MemKind.DRAM, mem, fil)
        except TransferError:
            return  # refused at submit: also a clear error
        with pytest.raises(TransferError):
            t.wait(30.0)

    def test_concurrent_threads(self, setup):
        engine, src, dst, fid = setup
        data = random_bytes(src, 3)
        dst.numpy()[:] = 0x5A
        errors = []
        n, k = self.n_pages, 4

        def worker(w: int) -> None:
            try:
                mine = np.arange(w, n, k)
                for op, buf in ((Op.WRITE, src), (Op.READ, dst)):
                    for _ in range(3):
                        mem, fil = self._descs(buf.addr, fid, mine, mine)
                        engine.submit(op, MemKind.DRAM, mem, fil).wait(30.0)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        assert np.array_equal(dst.numpy(), data)
