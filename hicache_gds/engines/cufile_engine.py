"""`cufile`: cuFile through cufile-python 0.2.0 (``cufile.CuFile``), one thread per IO in flight.

cufile-python is ~150 lines of ctypes: ``CuFile(path, "r+", use_direct_io=True).open()`` registers
the file, ``read/write(ctypes.c_void_p(ptr), nbytes, file_offset=, dev_offset=)`` are synchronous
and return the raw ``size_t`` of cuFileRead/cuFileWrite -- a negative error comes back as a huge
number -- so every result is checked here. Descriptors run on this engine's thread pool (its size
is the queue depth); a request is their futures, and every wait has a timeout.

Loading: cufile-python dlopens the *unversioned* ``libcufile.so``, which the nvidia-cufile wheel
does not ship (it has ``libcufile.so.0`` under ``site-packages/nvidia/cu13/lib``). When the plain
import fails, `load_cufile` makes a per-user directory with a ``libcufile.so`` symlink (created by
atomic rename, so concurrent ranks cannot trip over each other), puts it on ``LD_LIBRARY_PATH``
for child processes (the GDS probe runs in one), and redirects this process's one
``ctypes.CDLL("libcufile.so")`` to it during the import.

Device memory only: cuFile's host-memory support is not relied on. Buffers are offered to
``cuFileBufRegister``; where that fails (large pools, compat mode) IO still works, through
cuFile's internal bounce buffers.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import stat
import sys
import tempfile
import threading
from typing import Any

from ..errors import EngineUnavailable, TransferError
from .base import Capabilities, EngineOptions, MemKind, Op, Traits
from .cufile_env import libcufile_loadable, require_gpu_for_cufile
from .per_descriptor import ThreadPoolEngine

__all__ = ["CuFileEngine", "load_cufile"]

log = logging.getLogger("hicache_gds.engines")
_GiB = 1 << 30
_import_lock = threading.Lock()


def _mapped_libcufile(maps: str = "/proc/self/maps") -> str:
    """Path of the libcufile already loaded into this process (by NIXL, kvikio or `libcufile_loadable`), or ''."""
    try:
        with open(maps) as f:
            for line in f:
                p = line.split()[-1]
                if "/libcufile.so" in p and os.path.exists(p):
                    return p
    except OSError:
        pass
    return ""


def _libcufile_path() -> str:
    """Absolute path of the libcufile.so.0 cufile-python must use, or ''.

    The one already in the process comes first: a second copy of libcufile in one process (say
    nvidia-cufile's wheel loaded by `libcufile_loadable`, then the system's by cufile-python)
    aborts in cuFileDriverOpen ("Assertion failure, file index :cufio-plat line :149"; measured
    on the H100 VM by benchmarks/cufile_bisect.py)."""
    loaded = _mapped_libcufile()
    if loaded:
        return loaded
    try:
        import nvidia  # type: ignore  # nvidia-cufile's namespace package
        for base in nvidia.__path__:
            for sub in ("cu13/lib", "cufile/lib", "cu12/lib"):
                p = os.path.join(base, sub, "libcufile.so.0")
                if os.path.exists(p):
                    return p
    except ImportError:
        pass
    if libcufile_loadable():  # loaded from the system's loader path: find where from
        return _mapped_libcufile()
    return ""


def _symlink_dir(target: str) -> str:
    """A private directory holding ``libcufile.so -> target`` (created or refreshed atomically)."""
    d = os.path.join(tempfile.gettempdir(), f"hicache-gds-cufile-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o022:
        raise EngineUnavailable(f"cufile: {d} is not a private directory of this user; remove it")
    link = os.path.join(d, "libcufile.so")
    if os.path.realpath(link) != os.path.realpath(target):
        tmp = f"{link}.{os.getpid()}.{threading.get_ident()}"
        os.symlink(target, tmp)
        os.replace(tmp, link)  # atomic: another rank sees the old link or the new one, never none
    return d


def load_cufile() -> Any:
    """Import cufile-python, providing the unversioned libcufile.so it needs. EngineUnavailable if impossible."""
    with _import_lock:
        if "cufile" in sys.modules:
            return sys.modules["cufile"]
        # cufile-python dlopens "libcufile.so" by name, which may find another copy than the one
        # this process already has; it is pointed at that one (see `_libcufile_path`).
        if not _mapped_libcufile():
            try:
                import cufile
                return cufile
            except ImportError as exc:
                raise EngineUnavailable(f"cufile-python is not installed ({exc}); "
                                        "pip install 'hicache-gds[cufile]'") from exc
            except OSError:
                pass  # libcufile.so (unversioned) is not on the loader path
        elif importlib.util.find_spec("cufile") is None:
            raise EngineUnavailable("cufile-python is not installed; pip install 'hicache-gds[cufile]'")
        target = _libcufile_path()
        if not target:
            raise EngineUnavailable("cufile: no libcufile.so.0 found "
                                    "(pip install nvidia-cufile, or install CUDA's GDS)")
        d = _symlink_dir(target)
        old = os.environ.get("LD_LIBRARY_PATH", "")
        if d not in old.split(":"):
            os.environ["LD_LIBRARY_PATH"] = f"{d}:{old}" if old else d
        real = ctypes.CDLL
        link = os.path.join(d, "libcufile.so")

        class _Redirect(real):  # type: ignore[misc,valid-type]
            def __init__(self, name: Any, *args: Any, **kwargs: Any) -> None:
                super().__init__(link if name == "libcufile.so" else name, *args, **kwargs)

        ctypes.CDLL = _Redirect  # type: ignore[misc]
        try:
            import cufile
        except OSError as exc:
            raise EngineUnavailable(f"cufile: loading {target} through {link} failed: {exc}") from exc
        finally:
            ctypes.CDLL = real  # type: ignore[misc]
        return cufile


def _signed(n: int) -> int:
    return n - (1 << 64) if n >= 1 << 63 else n


class CuFileEngine(ThreadPoolEngine):
    """VRAM <-> file through cuFile (cufile-python); GPUDirect Storage, or cuFile's compat mode."""

    name = "cufile"
    traits = Traits(mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}), uses_cufile=True, needs_gpu=True,
                    requires=("cufile",))

    def __init__(self, options: EngineOptions) -> None:
        require_gpu_for_cufile(self.name)  # cuFileDriverOpen spins forever without a GPU driver
        super().__init__(options, "hicache-gds-cufile")
        if options.cufile_json and "CUFILE_ENV_PATH_JSON" not in os.environ:
            os.environ["CUFILE_ENV_PATH_JSON"] = options.cufile_json
        self._cufile = load_cufile()
        import torch
        torch.cuda.init()
        try:
            self._driver = self._cufile.CuFileDriver()  # cuFileDriverOpen, once per process
        except Exception as exc:  # noqa: BLE001
            raise EngineUnavailable(f"cufile: cuFileDriverOpen failed ({exc})") from exc
        self._bufs: set[int] = set()
        compat = not os.path.exists("/proc/driver/nvidia-fs/devcount")
        self._caps = Capabilities(
            mem_kinds=frozenset({MemKind.VRAM}), max_descs=1 << 16, max_request_bytes=64 * _GiB, max_desc_bytes=_GiB,
            alignment=4096 if options.direct_io else 1, direct_io=options.direct_io, gpu_direct=True,
            path=("cufile-python (cuFile compat mode: no nvidia-fs, POSIX IO through cuFile's bounce buffers)"
                  if compat else "cufile-python (GPUDirect Storage via nvidia-fs)") + f", {options.io_threads} threads")

    def _thread_init(self) -> None:
        import torch
        torch.cuda.set_device(self.options.device)

    def _register(self, addr: int, nbytes: int, kind: MemKind) -> None:
        try:
            self._cufile.bindings.cuFileBufRegister(ctypes.c_void_p(addr), nbytes, 0)
            self._bufs.add(addr)
        except RuntimeError as exc:  # unregistered device memory still works, through bounce buffers
            log.info("cufile: %d bytes at %#x not registered with cuFile (%s); IO goes through its bounce buffers",
                     nbytes, addr, exc)

    def _deregister(self, addr: int, nbytes: int, kind: MemKind) -> None:
        if addr in self._bufs:
            self._bufs.discard(addr)
            self._cufile.bindings.cuFileBufDeregister(ctypes.c_void_p(addr))

    def _open(self, path: str) -> tuple[int, Any]:
        f = self._cufile.CuFile(path, "r+", use_direct_io=self.options.direct_io)
        try:
            f.open()  # os.open + cuFileHandleRegister
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"{self.name}: opening {path} failed: {exc}") from exc
        return int(f.get_handle()), f

    def _one(self, op: Op, kind: MemKind, f: Any, path: str, addr: int, n: int, off: int) -> None:
        call = f.write if op is Op.WRITE else f.read
        got = _signed(int(call(ctypes.c_void_p(addr), n, file_offset=off, dev_offset=0)))
        if got < 0:
            raise OSError(f"cuFile{'Write' if op is Op.WRITE else 'Read'} of {n} bytes at offset {off} of {path} "
                          f"returned {got} (-1: an IO error, see cufile.log; lower: minus a CUfileOpError code)")
        if got != n:
            raise OSError(f"short {'write' if op is Op.WRITE else 'read'} at offset {off} of {path}: {got} of {n} bytes"
                          + (" (past end of file)" if got == 0 else ""))
