"""Staging: aligned buffers registered with the engine, lent to one request at a time.

Pages that cannot go to the engine as they are (misaligned host memory, or many small segments)
are gathered into a staging buffer, one whole slot per page, and scattered back after a read.
A buffer whose request timed out is held, not lent again, until that request finishes (its IO may
still land there). Staging is host memory, or the memory of one GPU (`Staging(engine, VRAM,
device)`, copied out by `scatter_device`) for reads of device pages that must not land in place.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..engines.base import Batch, MemKind, Op, Transfer, TransferEngine
from ..errors import TransferError
from ..layout import Pages
from ..memory import DeviceBuffer, HostBuffer, align_up, view

__all__ = ["MAX_HELD_STAGING", "ORPHANED", "Prepared", "Staging", "finished", "gather", "scatter", "scatter_device"]

log = logging.getLogger("hicache_gds.store")
# Staging lent to requests that timed out stays out of use until they finish; past this many bytes
# held, staged IO fails at once instead of allocating more (a drive that stopped answering).
MAX_HELD_STAGING = 2 << 30
ORPHANED: list[Any] = []  # staging and memberships held at close by requests that never finished: kept


def finished(t: Transfer) -> bool:
    """The request can no longer move bytes: it completed or failed (a timed-out one is polled again).
    An engine that cannot tell (its poll raised something else) is taken at its worst: still running."""
    try:
        return t.done()
    except TransferError:
        return True
    except Exception:  # noqa: BLE001
        return False


@dataclass
class Prepared:
    """A request's memory side (`PageMover._prepare`): descriptors as (P, S) arrays, the staging
    lent to it, and what was posted (the `Batch`, transfer or None) once it runs."""

    op: Op
    pages: Pages
    buf: HostBuffer | None
    mem_a: np.ndarray
    mem_l: np.ndarray
    transfers: list[tuple[Batch, Transfer | None]] = field(default_factory=list)
    posted: bool = False


class Staging:
    """Aligned buffers registered with the engine, lent to one call at a time: host memory, or
    (`kind` VRAM) memory on the torch `device`.

    A buffer whose call saw a request time out is held (`hold`), not lent again, until that
    request finishes, since its IO may still land there; `acquire` hands finished ones back."""

    def __init__(self, engine: TransferEngine, kind: MemKind = MemKind.DRAM, device: Any = None) -> None:
        self.engine = engine
        self.kind = MemKind(kind)
        if self.kind is MemKind.VRAM and device is None:
            raise ValueError("device staging needs its device")
        self.device = device
        # free buffers kept for the next call: a few of host memory; one of GPU memory, which the
        # serving engine sized its pools against
        self.keep = 6 if self.kind is MemKind.DRAM else 1
        self.free: list[Any] = []  # HostBuffer, or DeviceBuffer for VRAM
        self.held: list[tuple[Any, list[Transfer]]] = []
        self.lock = threading.Lock()

    def hold(self, buf: Any, late: list[Transfer]) -> None:
        with self.lock:
            self.held.append((buf, late))

    def held_bytes(self) -> int:
        with self.lock:
            return sum(b.nbytes for b, _ in self.held)

    def _reap(self) -> None:
        with self.lock:
            done, still = [], []
            for h in self.held:
                (done if all(finished(t) for t in h[1]) else still).append(h)
            self.held = still
        for buf, _ in done:
            self.release(buf)

    def acquire(self, nbytes: int) -> Any:
        if self.held:
            self._reap()
        with self.lock:
            fits = [b for b in self.free if b.nbytes >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self.free.remove(buf)
                return buf
        n = align_up(nbytes, 1 << 20)
        buf = HostBuffer(n) if self.kind is MemKind.DRAM else DeviceBuffer(n, self.device)
        try:
            self.engine.register_memory(buf.addr, buf.nbytes, self.kind)
        except BaseException:
            buf.close()
            raise
        return buf

    def release(self, buf: Any) -> None:
        with self.lock:
            self.free.append(buf)
            if len(self.free) > self.keep:  # the rest go back to the OS (or to torch's allocator)
                old = min(self.free, key=lambda b: b.nbytes)
                self.free.remove(old)
                self.engine.deregister_memory(old.addr)
                old.close()

    def close(self) -> None:
        self._reap()
        with self.lock:
            for b in self.free:
                self.engine.deregister_memory(b.addr)
                b.close()
            self.free.clear()
            if self.held:
                log.warning("hicache-gds: %d staging buffer(s) still lent to requests that never finished; "
                            "left mapped", len(self.held))
                ORPHANED.extend(b for b, _ in self.held)
                self.held.clear()



def gather(pages: Pages, dst: np.ndarray, page_bytes: int) -> None:
    """Copy each page's segments into one contiguous run at dst[j] (staging before a write)."""
    for j in range(len(pages)):
        out = view(int(dst[j]), page_bytes)
        pos = 0
        for addr, n in zip(pages.addrs[j].tolist(), pages.lens[j].tolist()):
            out[pos:pos + n] = view(addr, n)
            pos += n


def scatter(pages: Pages, buf: HostBuffer, a: int, b: int, slot_bytes: int, page_bytes: int) -> None:
    """Copy staged pages a..b (one slot each in `buf`) out to their segments (after a read)."""
    for j in range(a, b):
        src = view(buf.addr + j * slot_bytes, page_bytes)
        pos = 0
        for addr, n in zip(pages.addrs[j].tolist(), pages.lens[j].tolist()):
            view(addr, n)[:] = src[pos:pos + n]
            pos += n


def scatter_device(pages: Pages, buf: Any, js: Any, slot_bytes: int, device: Any) -> None:
    """Copy staged pages `js` (one slot each in device staging `buf`) out to their segments in
    memory of the same device; returns once the copies are done (on that device's current stream,
    then synchronized: the checksums that follow run on a stream of their own). Segments that
    follow each other on both sides go as one copy."""
    import torch

    from ..checksum import tensor_at
    runs: list[list[int]] = []  # [dst, src, nbytes]
    for j in js:
        src = buf.addr + j * slot_bytes
        for addr, n in zip(pages.addrs[j].tolist(), pages.lens[j].tolist()):
            if runs and runs[-1][0] + runs[-1][2] == addr and runs[-1][1] + runs[-1][2] == src:
                runs[-1][2] += n
            elif n:
                runs.append([addr, src, n])
            src += n
    for dst, src, n in runs:
        tensor_at(dst, n, device).copy_(tensor_at(src, n, device), non_blocking=True)
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()
