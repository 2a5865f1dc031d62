"""`kvikio`: RAPIDS KvikIO's `CuFile` behind the engine seam (kvikio-cu13 26.10).

Each descriptor becomes one ``CuFile.pread`` / ``pwrite`` (``buf, size, file_offset``), which
returns an ``IOFuture`` served by kvikio's own thread pool; a request is its futures. Device memory
is handed over as a raw ``__cuda_array_interface__`` span (kvikio's Python API takes array-likes,
not pointers), host memory as a memoryview.

Where it runs: kvikio decides per file between cuFile (GPUDirect Storage, or cuFile's compat mode
when nvidia-fs is absent) and its own POSIX path with host bounce buffers (``compat_mode`` ON, or
AUTO when cuFile cannot serve); `capabilities.path` says which. kvikio's thread count and its
O_DIRECT switches are process-wide: constructing this engine raises ``num_threads`` to at least
``io_threads`` and sets ``auto_direct_io_read/write`` to ``direct_io``.

Safety: kvikio maps libcufile at import, and cuFile spins forever without a GPU driver, so the
constructor checks for a GPU (`require_gpu_for_cufile`) before ``import kvikio``.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import EngineUnavailable, TransferError
from ..memory import view
from .base import Capabilities, EngineOptions, MemKind, Op, Traits
from .cufile_env import require_gpu_for_cufile
from .per_descriptor import DescriptorEngine

__all__ = ["KvikioEngine"]

_GiB = 1 << 30


class _DeviceSpan:
    """``nbytes`` of device memory at ``addr`` as a 1-D uint8 CUDA array (what kvikio accepts)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "strides": None, "version": 3}


_UNSET: Any = object()


class _IOFuture:
    """A kvikio IOFuture as `FutureTransfer` wants it: ``exception()`` is None only when the
    descriptor moved all its bytes. Holds the buffer the IO reads or writes, which must outlive it."""

    __slots__ = ("_buf", "_exc", "_future", "_nbytes", "_where")

    def __init__(self, future: Any, buf: Any, nbytes: int, where: tuple[str, Op, int, str]) -> None:
        self._future = future
        self._buf = buf
        self._nbytes = nbytes
        self._where = where  # (engine, op, file offset, path), for the error text
        self._exc: BaseException | None = _UNSET

    def done(self) -> bool:
        return bool(self._future.done())

    def exception(self) -> BaseException | None:
        if self._exc is _UNSET:  # get() once: kvikio's future holds one result
            try:
                got = int(self._future.get())
            except Exception as exc:  # noqa: BLE001 -- kvikio raises RuntimeError with its own text
                self._exc = exc
            else:
                engine, op, offset, path = self._where
                self._exc = None if got == self._nbytes else TransferError(
                    f"{engine}: short {op.value.lower()} at offset {offset} of {path}: {got} of {self._nbytes} bytes")
            self._buf = None
        return self._exc


def _compat_mode_name(value: Any) -> str:
    name = getattr(value, "name", None)
    if name:
        return str(name).upper()
    try:
        return {0: "OFF", 1: "ON", 2: "AUTO"}[int(value)]
    except (TypeError, ValueError, KeyError):
        return str(value).upper()


class KvikioEngine(DescriptorEngine):
    """DRAM or VRAM <-> file through kvikio (cuFile or kvikio's POSIX compat path)."""

    name = "kvikio"
    traits = Traits(mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}), uses_cufile=True, needs_gpu=True,
                    requires=("kvikio",))

    def __init__(self, options: EngineOptions) -> None:
        require_gpu_for_cufile(self.name)  # before import: kvikio maps libcufile, which hangs without a GPU
        super().__init__(options)
        if options.cufile_json and "CUFILE_ENV_PATH_JSON" not in os.environ:
            os.environ["CUFILE_ENV_PATH_JSON"] = options.cufile_json
        try:
            import kvikio
            import kvikio.defaults
        except Exception as exc:  # noqa: BLE001 -- ImportError, or cuda.pathfinder's DynamicLibNotFoundError
            raise EngineUnavailable(f"kvikio cannot be imported ({type(exc).__name__}: {exc}); "
                                    "pip install 'hicache-gds[kvikio]' (kvikio-cu13 needs LD_LIBRARY_PATH to "
                                    "reach libkvikio)") from exc
        self._kvikio = kvikio
        d = kvikio.defaults
        try:
            settings: dict[str, Any] = {"auto_direct_io_read": options.direct_io,
                                        "auto_direct_io_write": options.direct_io}
            if int(d.get("num_threads")) < options.io_threads:
                settings["num_threads"] = options.io_threads
            d.set(settings)
            mode = _compat_mode_name(d.get("compat_mode"))
            posix = bool(d.is_compat_mode_preferred())
        except Exception as exc:  # noqa: BLE001
            raise EngineUnavailable(f"kvikio: configuring it failed ({type(exc).__name__}: {exc})") from exc
        if posix:
            path = f"kvikio (cuFile compat mode {mode}: kvikio's own POSIX IO through host bounce buffers)"
        elif not os.path.exists("/proc/driver/nvidia-fs"):
            path = f"kvikio (cuFile compat mode: no nvidia-fs, POSIX IO inside cuFile; compat_mode {mode})"
        else:
            path = f"kvikio (GPUDirect Storage via nvidia-fs; compat_mode {mode})"
        self._caps = Capabilities(
            mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}), max_descs=1 << 16, max_request_bytes=64 * _GiB,
            max_desc_bytes=_GiB, alignment=4096 if options.direct_io else 1, direct_io=options.direct_io,
            gpu_direct=not posix, path=path + f", {max(options.io_threads, int(d.get('num_threads')))} threads")

    def _register(self, addr: int, nbytes: int, kind: MemKind) -> None:
        pass  # kvikio needs no registration; unregistered buffers go through cuFile's bounce buffers

    def _deregister(self, addr: int, nbytes: int, kind: MemKind) -> None:
        pass

    def _open(self, path: str) -> tuple[int, Any]:
        try:
            f = self._kvikio.CuFile(path, "r+")
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"{self.name}: opening {path} failed: {type(exc).__name__}: {exc}") from exc
        return int(f.fileno()), f

    def _post(self, op: Op, kind: MemKind, f: Any, path: str, addr: int, nbytes: int, offset: int) -> _IOFuture:
        buf = _DeviceSpan(addr, nbytes) if kind is MemKind.VRAM else view(addr, nbytes)
        try:
            fut = (f.pwrite if op is Op.WRITE else f.pread)(buf, nbytes, offset)
        except Exception as exc:  # kvikio raises RuntimeError with its own text
            raise TransferError(f"{self.name}: posting {op.value} of {nbytes} bytes at offset {offset} of {path} "
                                f"failed: {exc}") from exc
        return _IOFuture(fut, buf, nbytes, (self.name, op, offset, path))
