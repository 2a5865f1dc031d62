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
import threading
from typing import Any

import numpy as np

from ..errors import EngineUnavailable, TransferError
from ..memory import view
from .base import Capabilities, EngineOptions, MemKind, Op, Transfer, TransferEngine
from .gds_probe import require_gpu_for_cufile

__all__ = ["KvikioEngine"]

_GiB = 1 << 30


class _DeviceSpan:
    """``nbytes`` of device memory at ``addr`` as a 1-D uint8 CUDA array (what kvikio accepts)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "strides": None, "version": 3}


class _KvikioTransfer(Transfer):
    """One request: kvikio IOFutures, each checked for its full byte count."""

    def __init__(self, engine: str, op: Op, nbytes: int, what: str, futures: list[tuple[Any, int]],
                 keep: list[Any], error: BaseException | None = None) -> None:
        super().__init__(engine, op, nbytes, what)
        self._futures = futures
        self._keep = keep  # the spans/views must outlive the IO
        self._post_error = error

    def _poll(self) -> bool:
        if not all(f.done() for f, _ in self._futures):
            return False
        if self._post_error is not None:
            raise self._post_error
        for i, (f, want) in enumerate(self._futures):
            got = int(f.get())
            if got != want:
                raise TransferError(f"{self.engine}: short {self.op.value.lower()} in {self.what}: descriptor {i} "
                                    f"moved {got} of {want} bytes")
        self._keep = []
        return True


def _compat_mode_name(value: Any) -> str:
    name = getattr(value, "name", None)
    if name:
        return str(name).upper()
    try:
        return {0: "OFF", 1: "ON", 2: "AUTO"}[int(value)]
    except (TypeError, ValueError, KeyError):
        return str(value).upper()


class KvikioEngine(TransferEngine):
    """DRAM or VRAM <-> file through kvikio (cuFile or kvikio's POSIX compat path)."""

    name = "kvikio"
    uses_cufile = True

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
        self._files: dict[int, tuple[str, Any]] = {}
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def _register(self, addr: int, nbytes: int, kind: MemKind) -> None:
        pass  # kvikio needs no registration; unregistered buffers go through cuFile's bounce buffers

    def _deregister(self, addr: int, nbytes: int, kind: MemKind) -> None:
        pass

    def open_file(self, path: str) -> int:
        try:
            f = self._kvikio.CuFile(path, "r+")
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"{self.name}: opening {path} failed: {type(exc).__name__}: {exc}") from exc
        fid = int(f.fileno())
        with self._lock:
            self._files[fid] = (path, f)
        return fid

    def close_file(self, file_id: int) -> None:
        with self._lock:
            entry = self._files.pop(file_id, None)
        if entry is not None:
            entry[1].close()

    def _submit(self, op: Op, kind: MemKind, mem: np.ndarray, file: np.ndarray) -> Transfer:
        futures: list[tuple[Any, int]] = []
        keep: list[Any] = []
        error: BaseException | None = None
        nbytes = int(mem[:, 1].sum())
        names = ", ".join(sorted({self._files.get(int(fd), (f"fd {fd}",))[0] for fd in np.unique(file[:, 0])[:3]}))
        what = f"{len(mem)} regions / {nbytes} bytes of {kind.value} with {names}"
        for (addr, n), (fid, off) in zip(mem.tolist(), file.tolist()):
            entry = self._files.get(int(fid))
            if entry is None:
                error = TransferError(f"{self.name}: file id {fid} is not open")
                break
            buf = _DeviceSpan(addr, n) if kind is MemKind.VRAM else view(addr, n)
            keep.append(buf)
            try:
                fut = (entry[1].pwrite if op is Op.WRITE else entry[1].pread)(buf, n, off)
            except Exception as exc:  # noqa: BLE001 -- kvikio raises RuntimeError with its own text
                error = TransferError(f"{self.name}: posting {op.value} of {n} bytes at offset {off} of {entry[0]} "
                                      f"failed: {exc}")
                break
            futures.append((fut, n))
        # A failed post still waits for what was posted before it (done() polls them all).
        return _KvikioTransfer(self.name, op, nbytes, what, futures, keep, error)

    def close(self) -> None:
        for fid in list(self._files):
            try:
                self.close_file(fid)
            except Exception:  # noqa: BLE001
                pass
