"""Host buffers and raw-address views.

`HostBuffer` is page-aligned host memory: pinned (cudaHostAlloc through torch) where a GPU is
present, an anonymous mmap elsewhere (the CPU build of torch cannot pin). Both suit O_DIRECT.
`view(addr, nbytes)` gives a writable memoryview over any host address, which is how the bounce
engine and checksums touch memory described only by (address, length).
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import numpy as np

__all__ = ["HostBuffer", "DeviceBuffer", "view", "ALIGN", "align_up", "Cudart"]

ALIGN = 4096


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def view(addr: int, nbytes: int) -> memoryview:
    """A writable byte view of host memory at `addr` (the caller guarantees it stays alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


class HostBuffer:
    """`nbytes` of page-aligned host memory; pinned when `pinned` and a GPU allow it."""

    def __init__(self, nbytes: int, pinned: bool = True) -> None:
        self.nbytes = nbytes
        self.pinned = False
        self._keep: Any = None
        if pinned:
            try:
                import torch
                if torch.cuda.is_available():
                    t = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
                    off = (-t.data_ptr()) % ALIGN
                    self._keep = t
                    self.addr = t.data_ptr() + off
                    self.pinned = True
                    return
            except Exception:  # noqa: BLE001 -- fall back to pageable memory
                pass
        mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._keep = mm
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))

    def numpy(self) -> np.ndarray:
        return np.frombuffer(view(self.addr, self.nbytes), dtype=np.uint8)

    def close(self) -> None:
        keep, self._keep = self._keep, None
        if isinstance(keep, mmap.mmap):
            try:
                keep.close()
            except BufferError:  # views still alive; the GC frees it later
                self._keep = keep


class DeviceBuffer:
    """`nbytes` of memory on a torch `device`, shaped like `HostBuffer` (``addr``, ``nbytes``,
    ``close``): GPU memory for staging device pages; host memory where tests pass device cpu."""

    def __init__(self, nbytes: int, device: Any) -> None:
        import torch
        self.nbytes = nbytes
        self.device = torch.device(device)
        self._keep: Any = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.addr = int(self._keep.data_ptr())

    def close(self) -> None:
        self._keep = None


class Cudart:
    """The few CUDA runtime calls the bounce path needs, through the libcudart torch loaded."""

    H2D, D2H = 1, 2

    def __init__(self, device: int = 0) -> None:
        import torch
        torch.cuda.init()
        self.device = device
        lib = None
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise OSError("libcudart is not loadable")
        self.lib = lib
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cudaSetDevice.argtypes = [ctypes.c_int]

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(f"{what} failed with CUDA error {rc}")

    def new_stream(self) -> int:
        self._check(self.lib.cudaSetDevice(self.device), "cudaSetDevice")
        s = ctypes.c_void_p()
        self._check(self.lib.cudaStreamCreateWithFlags(ctypes.byref(s), 1), "cudaStreamCreate")  # non-blocking
        return s.value or 0

    def copy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        """Copy and wait for it on `stream` (each IO thread owns one stream, so copies overlap IO)."""
        self._check(self.lib.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")
        self._check(self.lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
