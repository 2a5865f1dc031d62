"""`bounce`: O_DIRECT pread/pwrite on a thread pool, no NIXL; VRAM goes through pinned staging.

The fallback that runs everywhere. Host memory moves straight between the caller's buffer and
the file (the store stages misaligned pages). VRAM is copied through a pinned host buffer per IO
thread on that thread's own CUDA stream, so the copies of one descriptor overlap the IO of the
others. The pool's size is the queue depth.
"""

from __future__ import annotations

import os
import threading

from ..memory import Cudart, HostBuffer, view
from .base import Capabilities, EngineOptions, MemKind, Op, Traits
from .per_descriptor import ThreadPoolEngine

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


class BounceEngine(ThreadPoolEngine):
    """Thread-pool O_DIRECT IO; pinned host staging for VRAM."""

    name = "bounce"
    traits = Traits(mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}), auto_rank=10)  # the fallback: last

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options, "hicache-gds-io")
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

    def _register(self, addr: int, nbytes: int, kind: MemKind) -> None:
        if kind is MemKind.VRAM and self._cudart is None:
            self._cudart = Cudart(self.options.device)

    def _deregister(self, addr: int, nbytes: int, kind: MemKind) -> None:
        pass

    def _open(self, path: str) -> tuple[int, int]:
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if self.options.direct_io else 0)
        fd = os.open(path, flags)
        return fd, fd  # the handle is the fd itself

    def _close_handle(self, fd: int) -> None:
        os.close(fd)

    def _staging(self) -> tuple[HostBuffer, int]:
        tls = self._tls
        if getattr(tls, "buf", None) is None:
            assert self._cudart is not None
            tls.buf = HostBuffer(_STAGE, pinned=True)
            tls.stream = self._cudart.new_stream()
        return tls.buf, tls.stream

    def _one(self, op: Op, kind: MemKind, fd: int, path: str, addr: int, nbytes: int, offset: int) -> None:
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


def _gpu() -> bool:
    from .cufile_env import gpu_present
    return gpu_present()


