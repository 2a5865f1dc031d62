"""NIXL storage engines: POSIX (DRAM<->file through Linux AIO / io_uring) and GDS / GDS_MT
(DRAM or VRAM<->file through cuFile).

The three differ only in the plugin name, its init params and its limits, so they share one
implementation. One agent per engine instance, shared by the caller's threads under
NIXL_THREAD_SYNC_RW (the default sync mode corrupts the heap with several threads).
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, ClassVar

import numpy as np

from .._nixl import new_agent, nixl_api
from ..errors import EngineUnavailable, TransferError
from .base import Capabilities, EngineOptions, MemKind, Op, Transfer, TransferEngine

__all__ = ["NixlPosixEngine", "NixlGdsEngine", "NixlGdsMtEngine", "cufile_bounce_pool", "gds_compat_mode"]

_GiB = 1 << 30


def gds_compat_mode() -> bool:
    """True when cuFile has no nvidia-fs driver and will run in compat mode (POSIX underneath)."""
    return not os.path.exists("/proc/driver/nvidia-fs/devcount")


def _strip_json_comments(text: str) -> str:
    # cufile.json allows // comments; drop them outside strings.
    return re.sub(r'("(?:\\.|[^"\\])*")|//[^\n]*', lambda m: m.group(1) or "", text)


def cufile_bounce_pool(cufile_json: str = "") -> list[tuple[int, int]]:
    """(slab bytes, buffer count) of cuFile's compat-mode POSIX bounce pool, smallest slab first.

    Read from `CUFILE_ENV_PATH_JSON`, then `cufile_json`, then /etc/cufile.json; libcufile's
    defaults when none says otherwise.
    """
    sizes_kb, counts = [4, 1024, 16384], [128, 64, 64]
    for path in (os.environ.get("CUFILE_ENV_PATH_JSON", ""), cufile_json, "/etc/cufile.json"):
        if path and os.path.isfile(path):
            try:
                with open(path) as f:
                    props = json.loads(_strip_json_comments(f.read())).get("properties", {})
                sizes_kb = [int(x) for x in props.get("posix_pool_slab_size_kb", sizes_kb)]
                counts = [int(x) for x in props.get("posix_pool_slab_count", counts)]
            except (OSError, ValueError, TypeError):
                pass
            break
    return sorted(zip((s << 10 for s in sizes_kb), counts))


class _DescBudget:
    """Process-wide cap on descriptors in flight (cuFile's compat bounce pool is per process).

    A request holding more descriptors than free bounce buffers waits forever inside cuFile, and
    two requests that each hold part of the pool can deadlock the same way; so requests take
    their descriptor count from this budget before they are posted.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self.cv = threading.Condition()

    def acquire(self, n: int, timeout: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: self.free >= n, timeout=timeout) and self._take(n)

    def _take(self, n: int) -> bool:
        self.free -= n
        return True

    def release(self, n: int) -> None:
        with self.cv:
            self.free += n
            self.cv.notify_all()


class _NixlTransfer(Transfer):
    def __init__(self, engine: "_NixlFileEngine", handle: Any, op: Op, nbytes: int, what: str,
                 budget: _DescBudget | None, ndescs: int) -> None:
        super().__init__(engine.name, op, nbytes, what)
        self._engine = engine
        self._handle = handle
        self._budget = budget
        self._ndescs = ndescs
        self._posted = False
        self._lock = threading.Lock()

    def _poll(self) -> bool:
        with self._lock:
            if self._handle is None:
                return True
            agent = self._engine.agent
            try:
                state = agent.transfer(self._handle) if not self._posted else agent.check_xfer_state(self._handle)
                self._posted = True
            except Exception:
                self._posted = True
                self._finish()
                raise
            if state == "ERR":
                self._finish()
                raise TransferError(f"{self.engine}: {self.op.value} of {self.what} reported ERR")
            if state == "DONE":
                self._finish()
                return True
            return False

    def _finish(self) -> None:
        if self._handle is not None:
            try:
                self._engine.agent.release_xfer_handle(self._handle)
            except Exception:  # noqa: BLE001 -- a failed handle may refuse release; the agent stays usable
                pass
            self._handle = None
        if self._budget is not None:
            self._budget.release(self._ndescs)
            self._budget = None

    # release() stays the inherited no-op: a finished or failed request was released in
    # _finish, and a request still in flight (timed out) keeps its handle and its bounce budget,
    # because the IO may land later and reusing either would corrupt memory or hang cuFile.


class _NixlFileEngine(TransferEngine):
    plugin: ClassVar[str] = ""
    _mem_kinds: ClassVar[frozenset[MemKind]] = frozenset({MemKind.DRAM})

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        api = nixl_api()
        self._api = api
        self.agent = new_agent(self.name.replace("nixl-", ""), enable_prog_thread=False)
        params = self._init_params()
        try:
            self.agent.create_backend(self.plugin, params)
        except Exception as exc:  # noqa: BLE001
            raise EngineUnavailable(f"{self.name}: NIXL could not create the {self.plugin} backend "
                                    f"({type(exc).__name__}); {self._unavailable_hint()}") from exc
        self._regs: dict[int, Any] = {}
        self._files: dict[int, tuple[str, Any]] = {}
        self._budget = self._make_budget()
        self._caps = self._make_caps()
        self._lock = threading.Lock()

    # -- per-plugin hooks ----------------------------------------------------------------------
    def _init_params(self) -> dict[str, str]:
        return {}

    def _unavailable_hint(self) -> str:
        return "is the plugin installed?"

    def _make_budget(self) -> _DescBudget | None:
        return None

    def _make_caps(self) -> Capabilities:
        raise NotImplementedError

    # -- engine ----------------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def _register(self, addr: int, nbytes: int, kind: MemKind) -> None:
        dev = self.options.device if kind is MemKind.VRAM else 0
        try:
            self._regs[addr] = self.agent.register_memory([(addr, nbytes, dev, "")], kind.value)
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"{self.name}: registering {nbytes} bytes of {kind.value} at {addr:#x} "
                                f"failed: {type(exc).__name__}") from exc

    def _deregister(self, addr: int, nbytes: int, kind: MemKind) -> None:
        reg = self._regs.pop(addr, None)
        if reg is not None:
            self.agent.deregister_memory(reg)

    def open_file(self, path: str) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if self.options.direct_io else 0)
        fd = os.open(path, flags)
        try:
            size = os.fstat(fd).st_size
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
        n = len(mem)
        dev = self.options.device if kind is MemKind.VRAM else 0
        local = np.empty((n, 3), dtype=np.uint64)
        local[:, 0] = mem[:, 0]
        local[:, 1] = mem[:, 1]
        local[:, 2] = dev
        remote = np.empty((n, 3), dtype=np.uint64)
        remote[:, 0] = file[:, 1]
        remote[:, 1] = mem[:, 1]
        remote[:, 2] = file[:, 0]
        nbytes = int(mem[:, 1].sum())
        fds = np.unique(file[:, 0])
        names = ", ".join(self._files.get(int(fd), ("fd %d" % fd,))[0] for fd in fds[:3])
        what = f"{n} regions / {nbytes} bytes of {kind.value} with {names}"
        if self._budget is not None and not self._budget.acquire(n, timeout=60.0):
            raise TransferError(f"{self.name}: cuFile's bounce pool stayed busy for 60 s ({what})")
        try:
            handle = self.agent.initialize_xfer(op.value, self.agent.get_xfer_descs(local, kind.value),
                                                self.agent.get_xfer_descs(remote, "FILE"), self.agent.name)
        except Exception as exc:  # noqa: BLE001
            if self._budget is not None:
                self._budget.release(n)
            raise TransferError(f"{self.name}: preparing {op.value} of {what} failed: {type(exc).__name__}") from exc
        return _NixlTransfer(self, handle, op, nbytes, what, self._budget, n)

    def close(self) -> None:
        for fd in list(self._files):
            try:
                self.close_file(fd)
            except Exception:  # noqa: BLE001
                pass
        for addr in list(self._regs):
            self.deregister_memory(addr)


class NixlPosixEngine(_NixlFileEngine):
    """NIXL POSIX plugin: DRAM <-> file with Linux AIO (default), io_uring or POSIX AIO."""

    name = "nixl-posix"
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
    plugin = "GDS"
    uses_cufile = True

    def __init__(self, options: EngineOptions) -> None:
        from .gds_probe import require_gpu_for_cufile
        require_gpu_for_cufile(self.name)
        if options.cufile_json and "CUFILE_ENV_PATH_JSON" not in os.environ:
            os.environ["CUFILE_ENV_PATH_JSON"] = options.cufile_json
        self.compat = gds_compat_mode()
        super().__init__(options)

    def _unavailable_hint(self) -> str:
        return "GDS needs libcufile and a GPU (see `hicache-gds doctor`)"

    def _pool(self) -> list[tuple[int, int]]:
        return cufile_bounce_pool(self.options.cufile_json)

    def _make_budget(self) -> _DescBudget | None:
        if not self.compat:
            return None
        # Descriptors up to the largest slab draw on the pool; the smallest count of the slabs
        # above 4 KiB bounds what may be in flight at once.
        return _DescBudget(min(c for s, c in self._pool() if s > 4096))

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
    plugin = "GDS_MT"

    def _init_params(self) -> dict[str, str]:
        return {"thread_count": str(min(self.options.io_threads, 64))}
