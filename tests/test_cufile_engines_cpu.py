"""The kvikio and cufile engines' own logic on CPU, against stand-ins for the two libraries.

The real libraries hang without a GPU driver (FACTS.md), so these fakes keep their Python API
(kvikio 26.10: ``CuFile(path, flags)``, ``pread/pwrite(buf, size, file_offset)`` -> IOFuture,
``defaults``; cufile-python 0.2.0: ``CuFile(path, mode, use_direct_io)``, ``open()``,
``read/write(c_void_p, size, file_offset=, dev_offset=)`` -> raw size_t) with POSIX IO underneath.
What is tested is ours: futures, byte-count checks, error text, the engine contract
(`EngineTests`), and bringing the unversioned ``libcufile.so`` name to cufile-python. The real
libraries run in tests/test_gpu_engines.py.
"""

import ctypes
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from hicache_gds.engines import EngineOptions, MemKind, Op
from hicache_gds.errors import TransferError
from hicache_gds.memory import HostBuffer, view
from hicache_gds.testing import EngineTests


class _Future:
    def __init__(self, fn):
        try:
            self._value, self._exc = fn(), None
        except Exception as exc:  # noqa: BLE001
            self._value, self._exc = None, exc

    def done(self):
        return True

    def get(self):
        if self._exc is not None:
            raise self._exc
        return self._value


class _KvikioFile:
    def __init__(self, path, flags="r"):
        self.fd = os.open(path, os.O_RDWR)

    def fileno(self):
        return self.fd

    def close(self):
        os.close(self.fd)

    def _io(self, write, buf, size, off):
        mv = memoryview(buf).cast("B")[:size]

        def run():
            n = (os.pwritev if write else os.preadv)(self.fd, [mv], off)
            if not write and n < size:
                raise RuntimeError("KvikIO failure at: posix_io.hpp:173: POSIX error on pread: EOF")
            return n
        return _Future(run)

    def pread(self, buf, size=None, file_offset=0, task_size=None):
        return self._io(False, buf, size, file_offset)

    def pwrite(self, buf, size=None, file_offset=0, task_size=None):
        return self._io(True, buf, size, file_offset)


def _fake_kvikio():
    k = types.ModuleType("kvikio")
    d = types.ModuleType("kvikio.defaults")
    settings = {"num_threads": 1, "compat_mode": 2, "auto_direct_io_read": False, "auto_direct_io_write": True}
    d.get = settings.__getitem__
    d.set = settings.update
    d.is_compat_mode_preferred = lambda: False
    k.defaults, k.CuFile = d, _KvikioFile
    return k, d, settings


@pytest.fixture
def fake_kvikio(monkeypatch):
    k, d, settings = _fake_kvikio()
    monkeypatch.setitem(sys.modules, "kvikio", k)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", d)
    monkeypatch.setattr("hicache_gds.engines.kvikio_engine.require_gpu_for_cufile", lambda name: None)
    return settings


class TestKvikioEngineContract(EngineTests):
    @pytest.fixture(autouse=True)
    def _fake(self, fake_kvikio):
        yield

    def make_engine(self):
        from hicache_gds.engines.kvikio_engine import KvikioEngine
        return KvikioEngine(EngineOptions())


def test_kvikio_path_says_compat_mode_and_settings_are_raised(fake_kvikio):
    from hicache_gds.engines.kvikio_engine import KvikioEngine
    eng = KvikioEngine(EngineOptions(io_threads=8))
    try:
        assert fake_kvikio["num_threads"] == 8 and fake_kvikio["auto_direct_io_read"] is True
        if not os.path.exists("/proc/driver/nvidia-fs"):
            assert eng.capabilities.path.startswith("kvikio (cuFile compat mode")
        assert eng.capabilities.mem_kinds == {MemKind.DRAM, MemKind.VRAM}
    finally:
        eng.close()


# -- cufile-python ----------------------------------------------------------------------------


class _CuFile:
    """cufile-python's CuFile over POSIX; `result` overrides what read/write return (as size_t)."""

    result = None

    def __init__(self, path, mode="r", use_direct_io=False):
        self.path, self.fd = path, None

    def open(self):
        self.fd = os.open(self.path, os.O_RDWR)

    def close(self):
        os.close(self.fd)

    def get_handle(self):
        return self.fd

    def _io(self, write, ptr, size, file_offset=0, dev_offset=0):
        if _CuFile.result is not None:
            return ctypes.c_size_t(_CuFile.result).value
        mv = view(ptr.value + dev_offset, size)
        return (os.pwritev if write else os.preadv)(self.fd, [mv], file_offset)

    def read(self, dest, size, file_offset=0, dev_offset=0):
        return self._io(False, dest, size, file_offset, dev_offset)

    def write(self, src, size, file_offset=0, dev_offset=0):
        return self._io(True, src, size, file_offset, dev_offset)


@pytest.fixture
def cufile_engine(monkeypatch, tmp_path):
    import torch

    import hicache_gds.engines.cufile_engine as ce
    fake = types.SimpleNamespace(CuFile=_CuFile, CuFileDriver=lambda: object(),
                                 bindings=types.SimpleNamespace(cuFileBufRegister=lambda *a: None,
                                                                cuFileBufDeregister=lambda *a: None))
    monkeypatch.setattr(ce, "require_gpu_for_cufile", lambda name: None)
    monkeypatch.setattr(ce, "load_cufile", lambda: fake)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(_CuFile, "result", None)
    eng = ce.CuFileEngine(EngineOptions(io_threads=4))
    n, page = 32, 64 << 10
    src, dst = HostBuffer(n * page), HostBuffer(n * page)
    for b in (src, dst):  # the engine moves "VRAM": here host memory stands in for it
        eng.register_memory(b.addr, b.nbytes, MemKind.VRAM)
    path = tmp_path / "slab.bin"
    path.write_bytes(b"\0" * n * page)
    fid = eng.open_file(str(path))
    yield eng, src, dst, fid, n, page
    eng.close()


def _descs(addr, fid, n, page):
    mem = np.stack([np.uint64(addr) + np.arange(n, dtype=np.uint64) * np.uint64(page),
                    np.full(n, page, dtype=np.uint64)], axis=1)
    fil = np.stack([np.full(n, fid, dtype=np.uint64), np.arange(n, dtype=np.uint64)[::-1] * np.uint64(page)], axis=1)
    return mem, fil


def test_cufile_engine_roundtrip_and_path(cufile_engine):
    eng, src, dst, fid, n, page = cufile_engine
    src.numpy()[:] = np.random.default_rng(0).integers(0, 256, src.nbytes, dtype=np.uint8)
    for op, buf in ((Op.WRITE, src), (Op.READ, dst)):
        mem, fil = _descs(buf.addr, fid, n, page)
        assert eng.submit(op, MemKind.VRAM, mem, fil).wait(30) == n * page
    assert np.array_equal(src.numpy(), dst.numpy())
    assert eng.capabilities.path.startswith("cufile-python (")
    assert eng.capabilities.mem_kinds == {MemKind.VRAM}


@pytest.mark.parametrize("result, match", [(-5, "returned -5"), (-1, "returned -1"), (4096, "short read"),
                                           (0, "past end of file")])
def test_cufile_engine_checks_the_raw_byte_counts(cufile_engine, monkeypatch, result, match):
    eng, src, dst, fid, n, page = cufile_engine
    monkeypatch.setattr(_CuFile, "result", result)
    mem, fil = _descs(dst.addr, fid, 2, page)
    with pytest.raises(TransferError, match=match):
        eng.submit(Op.READ, MemKind.VRAM, mem, fil).wait(30)


def test_load_cufile_bridges_the_unversioned_library_name(tmp_path):
    """cufile-python dlopens "libcufile.so"; nvidia-cufile ships only libcufile.so.0. A real
    library (libm) stands in for libcufile, a two-line package for cufile-python."""
    pkg = tmp_path / "pkgs" / "cufile"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('import ctypes\nlib = ctypes.CDLL("libcufile.so")\n')
    import ctypes.util
    libm = ctypes.util.find_library("m")
    target = next((p for p in ("/lib/x86_64-linux-gnu/" + (libm or ""), "/usr/lib64/" + (libm or ""))
                   if libm and os.path.exists(p)), None)
    if target is None:
        pytest.skip("no libm path to stand in for libcufile")
    code = ("import os, hicache_gds.engines.cufile_engine as ce\n"
            f"ce._libcufile_path = lambda: {target!r}\n"
            "m = ce.load_cufile()\n"
            "d = [p for p in os.environ['LD_LIBRARY_PATH'].split(':') if 'hicache-gds-cufile' in p][0]\n"
            "print(os.path.realpath(os.path.join(d, 'libcufile.so')), oct(os.stat(d).st_mode & 0o777), m.lib._name)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "pkgs"), os.getcwd(),
                                                        os.environ.get("PYTHONPATH", "")]))
    env.pop("LD_LIBRARY_PATH", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    real, mode, name = out.stdout.split()
    assert real == os.path.realpath(target) and mode == "0o700" and name.endswith("/libcufile.so")


def test_load_cufile_uses_the_libcufile_already_in_the_process(tmp_path):
    """Two copies of libcufile in one process abort cuFileDriverOpen (cufio-plat:149, found by
    benchmarks/cufile_bisect.py on the H100 VM: a libcufile dlopened before cufile-python, which then
    loaded another one by name). Here a copy of libm stands in for each: the wheel's
    ``libcufile.so.0`` is loaded first (as `libcufile_loadable` does), a different ``libcufile.so``
    is on the loader path (the system's); cufile-python must get the first, and the process must
    map one libcufile only."""
    import ctypes.util
    libm = ctypes.util.find_library("m")
    src = next((p for p in ("/lib/x86_64-linux-gnu/" + (libm or ""), "/usr/lib64/" + (libm or ""))
                if libm and os.path.exists(p)), None)
    if src is None:
        pytest.skip("no libm path to stand in for libcufile")
    wheel, system, pkg = tmp_path / "wheel", tmp_path / "system", tmp_path / "pkgs" / "cufile"
    for d in (wheel, system, pkg):
        d.mkdir(parents=True)
    shutil.copyfile(src, wheel / "libcufile.so.0")
    shutil.copyfile(src, system / "libcufile.so")
    (pkg / "__init__.py").write_text('import ctypes\nlib = ctypes.CDLL("libcufile.so")\n')
    code = ("import ctypes, os, hicache_gds.engines.cufile_engine as ce\n"
            f"ctypes.CDLL({str(wheel / 'libcufile.so.0')!r}, mode=ctypes.RTLD_GLOBAL)\n"
            "m = ce.load_cufile()\n"
            "maps = {l.split()[-1] for l in open('/proc/self/maps') if 'libcufile' in l}\n"
            "print(os.path.realpath(m.lib._name), len({os.path.realpath(p) for p in maps}))\n")
    env = dict(os.environ, LD_LIBRARY_PATH=str(system),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "pkgs"), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    real, copies = out.stdout.split()
    assert real == os.path.realpath(wheel / "libcufile.so.0") and copies == "1", out.stdout
