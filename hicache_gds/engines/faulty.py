"""`FaultyEngine`: wraps any engine and injects failures, for tests and reliability runs.

Faults are data, not code paths in the engines: EIO (a `TransferError`), hangs (a request that
never completes, so the caller's timeout fires), delays, and slow posting (`submit` itself
taking time, as it does where a device's queue is full), each with a probability per request
and optionally limited to one operation; EIO on chosen requests by their number (`nth`); and a
declared cap on descriptors per request (`max_descs`: the wrapped engine then says it takes no
more, as GDS in cuFile compat mode says 64). `heal()` turns them off: service must resume.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..errors import TransferError
from .base import Capabilities, MemKind, Op, Transfer, TransferEngine

__all__ = ["Faults", "FaultyEngine"]


@dataclass
class Faults:
    eio: float = 0.0
    """Probability that a request fails with an IO error."""
    hang: float = 0.0
    """Probability that a request never completes."""
    delay_s: float = 0.0
    """Added latency per request."""
    post_s: float = 0.0
    """Time `submit` itself takes per request (posting blocks where the device's queue is full)."""
    only: Op | None = None
    """Limit faults to reads or writes."""
    seed: int = 0
    nth: tuple[int, ...] = ()
    """Requests that fail with EIO, by number: 0 is the first request submitted (of `only`'s
    operation, where set) since this engine was built or its faults last set."""
    max_descs: int = 0
    """Declare at most this many descriptors per request (0: the wrapped engine's own limit)."""


class _Failed(Transfer):
    def _poll(self) -> bool:
        raise TransferError(f"{self.engine}: injected EIO on {self.op.value} of {self.what}")


class _Hung(Transfer):
    def _poll(self) -> bool:
        return False


class _Delayed(Transfer):
    def __init__(self, inner: Transfer, until: float) -> None:
        super().__init__(inner.engine, inner.op, inner.nbytes, inner.what)
        self.inner, self.until = inner, until

    def _poll(self) -> bool:
        return self.inner.done() and time.monotonic() >= self.until

    def release(self) -> None:
        self.inner.release()


class FaultyEngine(TransferEngine):
    """Delegates to `inner`, injecting `faults` on submitted requests."""

    name = "faulty"

    def __init__(self, inner: TransferEngine, faults: Faults | None = None) -> None:
        super().__init__(inner.options)
        self.inner = inner
        self.faults = faults or Faults()
        self._rng = random.Random(self.faults.seed)
        self._lock = threading.Lock()
        self._count = 0  # requests submitted that `nth` counts
        self.injected = {"eio": 0, "hang": 0, "delay": 0}

    def heal(self) -> None:
        self.set(Faults())

    def set(self, faults: Faults) -> None:
        """New faults; the same sequence of victims as a fresh engine with them."""
        with self._lock:
            self.faults = faults
            self._rng = random.Random(faults.seed)
            self._count = 0

    @property
    def capabilities(self) -> Capabilities:
        caps = self.inner.capabilities
        cap = self.faults.max_descs
        if cap and cap < caps.max_descs:
            return dataclasses.replace(caps, max_descs=cap, max_request_bytes=min(caps.max_request_bytes,
                                                                                  cap * caps.max_desc_bytes))
        return caps

    def _register(self, addr: int, nbytes: int, kind: MemKind) -> None:
        self.inner.register_memory(addr, nbytes, kind)

    def _deregister(self, addr: int, nbytes: int, kind: MemKind) -> None:
        self.inner.deregister_memory(addr)

    def open_file(self, path: str) -> int:
        return self.inner.open_file(path)

    def close_file(self, file_id: int) -> None:
        self.inner.close_file(file_id)

    def _submit(self, op: Op, kind: MemKind, mem: np.ndarray, file: np.ndarray) -> Transfer:
        f = self.faults
        nbytes = int(mem[:, 1].sum())
        what = f"{len(mem)} regions / {nbytes} bytes"
        if f.post_s and (f.only is None or f.only is op):
            time.sleep(f.post_s)
        if f.only is None or f.only is op:
            with self._lock:
                r = self._rng.random()
                nth = self._count
                self._count += 1
            if r < f.eio or nth in f.nth:
                self.injected["eio"] += 1
                return _Failed(self.name, op, nbytes, what)
            if r < f.eio + f.hang:
                self.injected["hang"] += 1
                return _Hung(self.name, op, nbytes, what)
        t = self.inner.submit(op, kind, mem, file)
        if f.delay_s:
            self.injected["delay"] += 1
            return _Delayed(t, time.monotonic() + f.delay_s)
        return t

    def info(self) -> dict:
        out = self.inner.info()
        out["engine"] = f"faulty({out['engine']})"
        return out

    def close(self) -> None:
        self.inner.close()
