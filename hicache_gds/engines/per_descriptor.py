"""Engines that move each descriptor by itself: one future per descriptor, a request is its futures.

`bounce`, `cufile` and `kvikio` differ only in how a file is opened and how one descriptor is
posted. The rest lives here: the table of open files, the request loop (`DescriptorEngine`), the
request's handle (`FutureTransfer`), and for engines that run descriptors on a thread pool of
their own (`ThreadPoolEngine`) the pool and a close that waits for running IO with a timeout.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ..errors import TransferError, TransferTimeout
from .base import Capabilities, EngineOptions, MemKind, Op, Transfer, TransferEngine

__all__ = ["DescriptorEngine", "FutureTransfer", "ThreadPoolEngine"]

log = logging.getLogger("hicache_gds.engines")

_CLOSE_WAIT_S = 30.0


class FutureTransfer(Transfer):
    """One request as one future per descriptor, in request order.

    A future has ``done()`` and ``exception()`` (None when the descriptor moved all its bytes), as
    `concurrent.futures.Future` has; other libraries' futures are adapted to that. When every
    future is a `concurrent.futures.Future`, `wait` blocks on them instead of polling.
    """

    def __init__(self, engine: str, op: Op, nbytes: int, what: str, futures: list[Any]) -> None:
        super().__init__(engine, op, nbytes, what)
        self._futures = futures
        self._blocking = all(isinstance(f, Future) for f in futures)

    def _poll(self) -> bool:
        if all(f.done() for f in self._futures):
            for f in self._futures:
                exc = f.exception()
                if exc is not None:
                    raise exc
            return True
        return False

    def ok_mask(self) -> np.ndarray | None:
        """Per descriptor: did it complete without error (only once every descriptor finished)."""
        if not all(f.done() for f in self._futures):
            return None
        return np.array([f.exception() is None for f in self._futures], dtype=bool)

    def wait(self, timeout: float | None = None) -> int:
        # docstring inherited
        if self._blocking and self.finished is None and self._error is None:
            _, pending = wait(self._futures, timeout=timeout, return_when=FIRST_EXCEPTION)
            if pending and not any(f.done() and f.exception() for f in self._futures):
                self._error = TransferTimeout(f"{self.engine}: {self.op.value} of {self.what} did not complete "
                                              f"in {timeout:.1f} s")
                raise self._error
        return super().wait(timeout)


def _failed(exc: BaseException) -> Future:
    fut: Future = Future()
    fut.set_exception(exc)
    return fut


class DescriptorEngine(TransferEngine):
    """An engine that posts every descriptor of a request by itself.

    Subclasses set ``self._caps``, open a file (`_open`) and post one descriptor (`_post`). A
    descriptor whose file is not open, or whose post raises, fails alone: the request's other
    descriptors still run, and `FutureTransfer.ok_mask` tells which landed.
    """

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        self._caps: Capabilities
        self._files: dict[int, tuple[str, Any]] = {}  # file id -> (path, handle)
        self._lock = threading.Lock()

    @abstractmethod
    def _open(self, path: str) -> tuple[int, Any]:
        """Open `path`; return its file id and the handle `_post` and `_close_handle` get."""

    def _close_handle(self, handle: Any) -> None:
        handle.close()

    @abstractmethod
    def _post(self, op: Op, kind: MemKind, handle: Any, path: str, addr: int, nbytes: int, offset: int) -> Any:
        """Start one descriptor's IO; return its future (see `FutureTransfer`)."""

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def open_file(self, path: str) -> int:
        fid, handle = self._open(path)
        with self._lock:
            self._files[fid] = (path, handle)
        return fid

    def close_file(self, file_id: int) -> None:
        with self._lock:
            entry = self._files.pop(file_id, None)
        if entry is not None:
            self._close_handle(entry[1])

    def _submit(self, op: Op, kind: MemKind, mem: np.ndarray, file: np.ndarray) -> Transfer:
        futures = []
        for (addr, n), (fid, off) in zip(mem.tolist(), file.tolist()):
            entry = self._files.get(int(fid))
            if entry is None:
                futures.append(_failed(TransferError(f"{self.name}: file id {fid} is not open")))
                continue
            try:
                futures.append(self._post(op, kind, entry[1], entry[0], int(addr), int(n), int(off)))
            except Exception as exc:  # noqa: BLE001 -- the descriptor fails; its owner sees it on wait
                futures.append(_failed(exc))
        nbytes = int(mem[:, 1].sum())
        names = ", ".join(sorted({self._files.get(int(fd), (f"fd {fd}",))[0] for fd in np.unique(file[:, 0])[:3]}))
        return FutureTransfer(self.name, op, nbytes, f"{len(mem)} regions / {nbytes} bytes of {kind.value} with "
                                                     f"{names}", futures)

    def close(self) -> None:
        for fid in list(self._files):
            try:
                self.close_file(fid)
            except Exception:  # noqa: BLE001 -- closing the rest matters more
                pass
        with self._regions_lock:
            addrs = [start for start, _, _ in self._regions]
        for addr in addrs:
            self.deregister_memory(addr)


class ThreadPoolEngine(DescriptorEngine):
    """A `DescriptorEngine` whose descriptors run as synchronous calls (`_one`) on its thread pool.

    The pool's size (``io_threads``) is the queue depth. `close` waits at most 30 s for IO
    still running, and leaves files and memory registered if some never returns.
    """

    def __init__(self, options: EngineOptions, thread_name_prefix: str) -> None:
        super().__init__(options)
        # Threads start at the first submit, so `_thread_init` may use what the subclass sets up later.
        self._pool = ThreadPoolExecutor(max_workers=options.io_threads, thread_name_prefix=thread_name_prefix,
                                        initializer=self._thread_init)
        self._inflight: set[Future] = set()

    def _thread_init(self) -> None:
        """Runs once in each IO thread before its first descriptor."""

    @abstractmethod
    def _one(self, op: Op, kind: MemKind, handle: Any, path: str, addr: int, nbytes: int, offset: int) -> None:
        """Move one descriptor, synchronously, in an IO thread; raise on any failure or short count."""

    def _post(self, op: Op, kind: MemKind, handle: Any, path: str, addr: int, nbytes: int, offset: int) -> Future:
        fut = self._pool.submit(self._one, op, kind, handle, path, addr, nbytes, offset)
        with self._lock:
            self._inflight.add(fut)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, fut: Future) -> None:
        with self._lock:
            self._inflight.discard(fut)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = list(self._inflight)
        _, stuck = wait(running, timeout=_CLOSE_WAIT_S)
        if stuck:  # an IO call that never returns: closing its file under it would be worse than a leak
            log.error("%s: %d IOs still running after %.0f s; leaving their files open", self.name, len(stuck),
                      _CLOSE_WAIT_S)
            return
        super().close()

