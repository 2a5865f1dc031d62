"""`bounce`: O_DIRECT pread/pwrite on a thread pool, no NIXL; VRAM goes through pinned staging.

The fallback that runs everywhere. Host memory moves straight between the caller's buffer and
the file (the store stages misaligned pages). VRAM is copied through a pinned host buffer per IO
thread on that thread's own CUDA stream, so the copies of one descriptor overlap the IO of the
others. The pool's size is the queue depth.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import numpy as np

from ..errors import TransferTimeout
from ..memory import Cudart, HostBuffer, view
from .base import Capabilities, EngineOptions, MemKind, Op, Transfer, TransferEngine

__all__ = ["BounceEngine"]

_GiB = 1 << 30
_STAGE = 16 << 20  # per-thread pinned staging for VRAM; larger descriptors go in pieces


def _pio(op: Op, fd: int, mv: memoryview, offset: int) -> None:
    done, n = 0, len(mv)
    while done < n:
        if op is Op.WRITE:
            k = os.pwritev(fd, [mv[done:]], offset + done)
        else:
            k = os.preadv(fd, [mv[done:]], offset + done)
        if k <= 0:
            raise OSError(f"short {'write' if op is Op.WRITE else 'read'}: {done} of {n} bytes at offset {offset}"
                          + (" (past end of file)" if k == 0 else ""))
        done += k


class _FutureTransfer(Transfer):
    def __init__(self, engine: str, op: Op, nbytes: int, what: str, futures: list[Future]) -> None:
        super().__init__(engine, op, nbytes, what)
        self._futures = futures

    def _poll(self) -> bool:
        if all(f.done() for f in self._futures):
            for f in self._futures:
                exc = f.exception()
                if exc is not None:
                    raise exc
            return True
        return False

    def ok_mask(self):
        """Per descriptor: did it complete without error (only once every descriptor finished)."""
        if not all(f.done() for f in self._futures):
            return None
        return np.array([f.exception() is None for f in self._futures], dtype=bool)

    def wait(self, timeout: float | None = None) -> int:
        # docstring inherited
        if self.finished is None and self._error is None:
            _, pending = wait(self._futures, timeout=timeout, return_when=FIRST_EXCEPTION)
            if pending and not any(f.done() and f.exception() for f in self._futures):
                self._error = TransferTimeout(f"{self.engine}: {self.op.value} of {self.what} did not complete "
                                              f"in {timeout:.1f} s")
                raise self._error
        return super().wait(timeout)


class BounceEngine(TransferEngine):
    """Thread-pool O_DIRECT IO; pinned host staging for VRAM."""

    name = "bounce"

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        self._pool = ThreadPoolExecutor(max_workers=options.io_threads, thread_name_prefix="hicache-gds-io")
        self._files: dict[int, str] = {}
        self._tls = threading.local()
        self._cudart: Cudart | None = None
        kinds = {MemKind.DRAM}
        if _gpu():
            kinds.add(MemKind.VRAM)
        self._caps = Capabilities(
            mem_kinds=frozenset(kinds), max_descs=1 << 16, max_request_bytes=64 * _GiB, max_desc_bytes=_GiB,
            alignment=4096 if options.direct_io else 1, direct_io=options.direct_io, gpu_direct=False,
            path=f"{'O_DIRECT ' if options.direct_io else ''}pread/pwrite on {options.io_threads} threads"
                 + (" (VRAM through pinned host staging)" if MemKind.VRAM in kinds else " from host memory"))

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def _register(self, addr: int, nbytes: int, kind: MemKind) -> None:
        if kind is MemKind.VRAM and self._cudart is None:
            self._cudart = Cudart(self.options.device)

    def _deregister(self, addr: int, nbytes: int, kind: MemKind) -> None:
        pass

    def open_file(self, path: str) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if self.options.direct_io else 0)
        fd = os.open(path, flags)
        self._files[fd] = path
        return fd

    def close_file(self, file_id: int) -> None:
        if self._files.pop(file_id, None) is not None:
            os.close(file_id)

    def _staging(self) -> tuple[HostBuffer, int]:
        tls = self._tls
        if getattr(tls, "buf", None) is None:
            assert self._cudart is not None
            tls.buf = HostBuffer(_STAGE, pinned=True)
            tls.stream = self._cudart.new_stream()
        return tls.buf, tls.stream

    def _one(self, op: Op, kind: MemKind, addr: int, nbytes: int, fd: int, offset: int) -> None:
        if kind is MemKind.DRAM:
            _pio(op, fd, view(addr, nbytes), offset)
            return
        cud = self._cudart
        assert cud is not None
        buf, stream = self._staging()
        for piece in range(0, nbytes, _STAGE):
            n = min(_STAGE, nbytes - piece)
            mv = view(buf.addr, n)
            if op is Op.WRITE:
                cud.copy(buf.addr, addr + piece, n, Cudart.D2H, stream)
                _pio(op, fd, mv, offset + piece)
            else:
                _pio(op, fd, mv, offset + piece)
                cud.copy(addr + piece, buf.addr, n, Cudart.H2D, stream)

    def _submit(self, op: Op, kind: MemKind, mem: np.ndarray, file: np.ndarray) -> Transfer:
        futures = [self._pool.submit(self._one, op, kind, int(a), int(n), int(fd), int(off))
                   for (a, n), (fd, off) in zip(mem.tolist(), file.tolist())]
        nbytes = int(mem[:, 1].sum())
        names = ", ".join(sorted({self._files.get(int(fd), f"fd {fd}") for fd in np.unique(file[:, 0])[:3]}))
        return _FutureTransfer(self.name, op, nbytes, f"{len(mem)} regions / {nbytes} bytes with {names}", futures)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in list(self._files):
            self.close_file(fd)


def _gpu() -> bool:
    from .gds_probe import gpu_present
    return gpu_present()


