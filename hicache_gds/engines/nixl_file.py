"""NIXL storage engines: POSIX (DRAM<->file through Linux AIO / io_uring) and GDS / GDS_MT
(DRAM or VRAM<->file through cuFile).

The three differ only in the plugin name, its init params and its limits, so they share one
implementation. One agent per engine instance, shared by the caller's threads under
NIXL_THREAD_SYNC_RW (the default sync mode corrupts the heap with several threads).
"""

from __future__ import annotations

import functools
import os
import stat
import threading
import time
import weakref
from typing import Any, ClassVar

import numpy as np

from ..errors import TransferError
from .base import Capabilities, EngineOptions, MemKind, Op, Traits, Transfer
from .cufile_env import cufile_bounce_pool, gds_compat_mode, require_gpu_for_cufile
from .nixl_agent import NIXL_MODULES, NixlAgentEngine, NixlTransfer

__all__ = ["NixlPosixEngine", "NixlGdsEngine", "NixlGdsMtEngine"]

_GiB = 1 << 30


class _DescBudget:
    """Counted resources a request holds while in flight: descriptors per cuFile bounce-slab class,
    or NIXL GDS batches (one class).

    cuFile's compat-mode bounce pool is per process. A request holding more descriptors of a
    class than that class has buffers waits forever inside cuFile, and two requests that each
    hold part of a class can deadlock the same way; so requests take their descriptor counts from
    this budget before they are posted, and give them back when they finish.
    """

    def __init__(self, pool: list[tuple[int, int]]) -> None:
        self.sizes = np.array([s for s, _ in pool], dtype=np.uint64)
        self.free = [c for _, c in pool]
        self.cv = threading.Condition()

    def need(self, lens: np.ndarray) -> list[int]:
        cls = np.minimum(np.searchsorted(self.sizes, lens, side="left"), len(self.sizes) - 1)
        return np.bincount(cls, minlength=len(self.sizes)).tolist()

    def acquire(self, need: list[int], timeout: float, progress=None) -> bool:
        """Take `need`; while short, call `progress()` (which polls requests in flight, whose
        completion is what gives buffers back) until `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            with self.cv:
                if all(f >= n for f, n in zip(self.free, need)):
                    self.free = [f - n for f, n in zip(self.free, need)]
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if progress is None:
                    self.cv.wait(timeout=left)
                    continue
            progress()
            time.sleep(5e-5)

    def release(self, need: list[int]) -> None:
        with self.cv:
            self.free = [f + n for f, n in zip(self.free, need)]
            self.cv.notify_all()


_SHARED_LOCK = threading.Lock()
_SHARED: dict[tuple, tuple[_DescBudget, "weakref.WeakSet[NixlTransfer]"]] = {}


def _process_budget(pool: list[tuple[int, int]]) -> tuple[_DescBudget, "weakref.WeakSet[NixlTransfer]"]:
    """The process's bounce-pool budget and the requests holding it, shared by every engine
    instance (cuFile has one bounce pool per process, however many agents use it)."""
    with _SHARED_LOCK:
        key = tuple(pool)
        if key not in _SHARED:
            _SHARED[key] = (_DescBudget(pool), weakref.WeakSet())
        return _SHARED[key]


def _gds_batches(lens: np.ndarray, max_request: int, batch_limit: int) -> int:
    """cuFile batches NIXL's GDS plugin takes for a request: descriptors split at `max_request`
    bytes, up to `batch_limit` of those per batch."""
    parts = int(((lens + np.uint64(max_request - 1)) // np.uint64(max_request)).sum())
    return -(-parts // batch_limit)


class _NixlFileEngine(NixlAgentEngine):
    _mem_kinds: ClassVar[frozenset[MemKind]] = frozenset({MemKind.DRAM})

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        self._files: dict[int, tuple[str, Any]] = {}
        self._inflight: weakref.WeakSet[NixlTransfer] = weakref.WeakSet()
        self._budget = self._make_budget()
        self._batches = self._make_batch_budget()
        self._caps = self._make_caps()

    # -- per-plugin hooks ----------------------------------------------------------------------
    def _unavailable_hint(self) -> str:
        return "is the plugin installed?"

    def _make_budget(self) -> _DescBudget | None:
        return None

    def _make_batch_budget(self) -> _DescBudget | None:
        return None

    def _batches_needed(self, lens: np.ndarray) -> int:
        return 0

    def _make_caps(self) -> Capabilities:
        raise NotImplementedError

    # -- engine ----------------------------------------------------------------------------------
    def open_file(self, path: str) -> int:
        # cuFile refuses handles whose open flags include O_NOFOLLOW (err 5019), so the symlink
        # check is an lstat before and an inode comparison after (Python adds O_CLOEXEC itself).
        before = os.lstat(path)
        if not stat.S_ISREG(before.st_mode):
            raise TransferError(f"{self.name}: {path} is not a regular file")
        fd = os.open(path, os.O_RDWR | (os.O_DIRECT if self.options.direct_io else 0))
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
                raise TransferError(f"{self.name}: {path} changed while it was opened")
            size = st.st_size
            reg = self.agent.register_memory([(0, size, fd, path)], "FILE")
        except Exception as exc:
            os.close(fd)
            raise TransferError(f"{self.name}: registering file {path} failed: {type(exc).__name__}") from exc
        with self._lock:
            self._files[fd] = (path, reg)
        return fd

    def close_file(self, file_id: int) -> None:
        with self._lock:
            entry = self._files.pop(file_id, None)
        if entry is None:
            return
        try:
            self.agent.deregister_memory(entry[1])
        finally:
            os.close(file_id)

    def _submit(self, op: Op, kind: MemKind, mem: np.ndarray, file: np.ndarray) -> Transfer:
        nbytes = int(mem[:, 1].sum())
        fds = np.unique(file[:, 0])
        names = ", ".join(self._files.get(int(fd), ("fd %d" % fd,))[0] for fd in fds[:3])
        what = f"{len(mem)} regions / {nbytes} bytes of {kind.value} with {names}"
        held: list[tuple[_DescBudget, list[int]]] = []  # what this request holds until it finishes
        if self._batches is not None:  # NIXL's GDS plugin fails a post when its batch pool is empty
            need = [self._batches_needed(mem[:, 1])]
            if not self._batches.acquire(need, 60.0, self._progress):
                raise TransferError(f"{self.name}: NIXL's GDS batch pool stayed busy for 60 s ({what})")
            held.append((self._batches, need))
        if self._budget is not None:
            # The bounce-pool budget; a request still in flight after a timeout keeps it, because
            # cuFile may still be using those buffers.
            need = self._budget.need(mem[:, 1])
            if not self._budget.acquire(need, 60.0, self._progress):
                self._give_back(held)
                raise TransferError(f"{self.name}: cuFile's bounce pool stayed busy for 60 s ({what})")
            held.append((self._budget, need))
        try:
            handle = self._prepare(op, kind, mem, file[:, 1], file[:, 0], "FILE", self.agent.name, what)
        except TransferError:
            self._give_back(held)
            raise
        if not held:
            return NixlTransfer(self, handle, op, nbytes, what, post_now=True)
        t = NixlTransfer(self, handle, op, nbytes, what, post_now=True,
                         on_finish=functools.partial(self._give_back, held))
        self._inflight.add(t)
        return t

    @staticmethod
    def _give_back(held: list[tuple[_DescBudget, list[int]]]) -> None:
        for budget, need in held:
            budget.release(need)

    def _progress(self) -> None:
        """Poll every request in flight: NIXL advances them, and hands bounce buffers back, only when polled."""
        for t in list(self._inflight):
            try:
                t.done()
            except Exception:  # noqa: BLE001 -- its owner sees the error on its own wait
                pass

    def close(self) -> None:
        for fd in list(self._files):
            try:
                self.close_file(fd)
            except Exception:  # noqa: BLE001
                pass
        super().close()


class NixlPosixEngine(_NixlFileEngine):
    """NIXL POSIX plugin: DRAM <-> file with Linux AIO (default), io_uring or POSIX AIO."""

    name = "nixl-posix"
    traits = Traits(mem_kinds=frozenset({MemKind.DRAM}), auto_rank=20, requires=NIXL_MODULES)
    plugin = "POSIX"
    _QUEUES = {"aio": ("use_aio", "Linux AIO"), "uring": ("use_uring", "io_uring"),
               "posix_aio": ("use_posix_aio", "POSIX AIO")}

    def _init_params(self) -> dict[str, str]:
        return {self._QUEUES[self.options.nixl_queue][0]: "true"}

    def _make_caps(self) -> Capabilities:
        queue = self._QUEUES[self.options.nixl_queue][1]
        return Capabilities(mem_kinds=frozenset({MemKind.DRAM}), max_descs=4096, max_request_bytes=8 * _GiB,
                            max_desc_bytes=_GiB, alignment=4096 if self.options.direct_io else 1,
                            direct_io=self.options.direct_io, gpu_direct=False,
                            path=f"NIXL POSIX ({queue}{', O_DIRECT' if self.options.direct_io else ''}) "
                                 f"from host memory")


class NixlGdsEngine(_NixlFileEngine):
    """NIXL GDS plugin: DRAM or VRAM <-> file through cuFile's batch API.

    Where nvidia-fs is absent cuFile runs in compat mode; requests then stay within its POSIX
    bounce pool (`cufile_bounce_pool`), since a request with more descriptors than free bounce
    buffers never completes.
    """

    name = "nixl-gds"
    traits = Traits(mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}), uses_cufile=True, needs_gpu=True,
                    auto_rank=20, requires=NIXL_MODULES)
    plugin = "GDS"

    def __init__(self, options: EngineOptions) -> None:
        require_gpu_for_cufile(self.name)
        if options.cufile_json and "CUFILE_ENV_PATH_JSON" not in os.environ:
            os.environ["CUFILE_ENV_PATH_JSON"] = options.cufile_json
        self.compat = gds_compat_mode()
        super().__init__(options)

    def _unavailable_hint(self) -> str:
        return "GDS needs libcufile and a GPU (see `hicache-gds doctor`)"

    def _pool(self) -> list[tuple[int, int]]:
        return cufile_bounce_pool(self.options.cufile_json)

    # NIXL GDS plugin settings (its defaults: 16 batches of up to 128 IOs, IOs split at 16 MiB).
    # A post that finds the batch pool empty fails ("GDS batch pool exhausted"), so requests take
    # their batches from a budget of the same size first.
    BATCH_POOL = 64
    BATCH_LIMIT = 128
    MAX_REQUEST = 16 << 20

    def _init_params(self) -> dict[str, str]:
        return {"batch_pool_size": str(self.BATCH_POOL), "batch_limit": str(self.BATCH_LIMIT),
                "max_request_size": str(self.MAX_REQUEST)}

    def _make_batch_budget(self) -> _DescBudget | None:
        return _DescBudget([(1 << 62, self.BATCH_POOL)])

    def _batches_needed(self, lens: np.ndarray) -> int:
        return _gds_batches(lens, self.MAX_REQUEST, self.BATCH_LIMIT)

    def _make_budget(self) -> _DescBudget | None:
        if not self.compat:
            return None
        budget, inflight = _process_budget(self._pool())
        self._inflight = inflight  # progress polls every request holding the process's bounce pool
        return budget

    def _make_caps(self) -> Capabilities:
        pool = self._pool()
        if self.compat:
            max_descs = min(c for s, c in pool if s > 4096)
            max_desc = max(s for s, _ in pool)
            path = f"cuFile compat mode via NIXL {self.plugin} (no nvidia-fs: POSIX IO through cuFile's bounce buffers)"
        else:
            max_descs, max_desc = 128, 16 << 20
            path = f"GPUDirect Storage via NIXL {self.plugin} (nvidia-fs P2P DMA)"
        return Capabilities(mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}), max_descs=max_descs,
                            max_request_bytes=max_descs * max_desc, max_desc_bytes=max_desc, alignment=4096,
                            direct_io=True, gpu_direct=True, path=path)


class NixlGdsMtEngine(NixlGdsEngine):
    """NIXL GDS_MT plugin: like GDS, with its own thread pool issuing synchronous cuFile IO."""

    name = "nixl-gds-mt"
    traits = Traits(mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}), uses_cufile=True, needs_gpu=True,
                    auto_rank=30, requires=NIXL_MODULES)  # preferred to GDS: no batch pool to run out of
    plugin = "GDS_MT"

    def _init_params(self) -> dict[str, str]:
        return {"thread_count": str(min(self.options.io_threads, 64))}

    def _make_batch_budget(self) -> _DescBudget | None:
        return None  # GDS_MT issues synchronous cuFile IO from its threads: no batch pool
