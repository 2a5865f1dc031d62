"""The transfer-engine seam: register memory once, open a file once, submit batches, wait on handles.

An engine moves bytes between memory regions (DRAM or VRAM addresses) and file regions (an open
file and an offset). It knows nothing of keys, pages or SGLang. Requests are batches of
descriptor pairs given as numpy arrays, because descriptor lists of thousands of entries are
built ~150x faster from arrays than from Python tuples (NIXL measurement).

    mem  : uint64 array (N, 2) -- (address, nbytes)
    file : uint64 array (N, 2) -- (file_id, file_offset); nbytes is the mem side's

`submit(...)` returns a `Transfer`; `submit(...).wait(timeout)` is the blocking call. A request may
not exceed `capabilities.max_descs` descriptors nor `max_request_bytes`; `split_batches` plans a
large batch into legal requests on item (page) boundaries, and lets an item too large for one
request span several (GDS in cuFile compat mode takes 64 descriptors per request; a vLLM chunk of
per-layer views is layers x blocks of them).
"""

from __future__ import annotations

import bisect
import enum
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, NamedTuple, Sequence

import numpy as np

from ..config import Config
from ..errors import RegionError, TransferError, TransferTimeout

__all__ = [
    "Op",
    "MemKind",
    "Capabilities",
    "Traits",
    "EngineOptions",
    "Transfer",
    "TransferEngine",
    "split_batches",
    "Batch",
]


class Op(str, enum.Enum):
    READ = "READ"  # file -> memory
    WRITE = "WRITE"  # memory -> file


class MemKind(str, enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do; the store branches on these, never on engine names."""

    mem_kinds: frozenset[MemKind]
    """Memory kinds a descriptor may point into."""
    max_descs: int
    """Most descriptors in one request."""
    max_request_bytes: int
    """Most bytes in one request."""
    max_desc_bytes: int
    """Largest single descriptor; larger regions are split by the caller."""
    alignment: int
    """Addresses, offsets and lengths must be multiples of this (1: no constraint)."""
    direct_io: bool
    """Files are opened with O_DIRECT (the page cache is bypassed)."""
    gpu_direct: bool
    """VRAM moves to storage without a host copy made by us (cuFile/GDS, compat mode included)."""
    path: str
    """What actually runs, in words: e.g. 'NIXL POSIX (Linux AIO, O_DIRECT)'."""


@dataclass(frozen=True)
class Traits:
    """What an engine class declares before any instance exists. `auto` (`engines.select`) and
    `doctor` read these, never engine names, to decide which engines to try, probe and list, so an
    engine registered through the entry-point group is chosen and diagnosed like a built-in one.

    An instance may offer less than its class declares (`capabilities`: the bounce engine moves
    VRAM only where a GPU is visible)."""

    mem_kinds: frozenset[MemKind] = frozenset({MemKind.DRAM})
    """The memory kinds it can move at best."""
    uses_cufile: bool = False
    """GPU-direct through cuFile: loaded in a process only after its VRAM round trip passed in a
    subprocess (`gds_probe`); what ``ENABLE_GDS=1`` asks for, and what ``ENABLE_GDS=0`` refuses."""
    needs_gpu: bool = False
    """Cannot be built without a CUDA GPU (its constructor raises `EngineUnavailable`)."""
    remote: bool = False
    """Moves bytes to other processes' memory (page servers), not to files: never serves slab files."""
    auto_rank: int = 0
    """Preference of `auto` among the engines that fit (higher first); 0: used only when named."""
    requires: tuple[str, ...] = ()
    """Modules it imports, any one of which will do (`doctor` says "not installed" when none can be
    found; looked up without importing them)."""

    def describe(self) -> str:
        """The traits in a few words, for `doctor`."""
        bits = ["+".join(sorted(k.value for k in self.mem_kinds))]
        bits += [w for w, on in (("cuFile", self.uses_cufile), ("needs a GPU", self.needs_gpu),
                                 ("remote memory", self.remote)) if on]
        bits.append(f"auto rank {self.auto_rank}" if self.auto_rank > 0 else "only when named")
        return ", ".join(bits)


@dataclass(frozen=True)
class EngineOptions:
    """Settings every engine reads; built from a `Config` by `from_config`."""

    direct_io: bool = True
    io_threads: int = 16
    nixl_queue: str = "aio"
    max_request_bytes: int = 0
    device: int = 0
    cufile_json: str = ""
    extra: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_config(cls, cfg: Config, **extra: Any) -> "EngineOptions":
        return cls(direct_io=cfg.direct_io, io_threads=cfg.io_threads, nixl_queue=cfg.nixl_queue,
                   max_request_bytes=cfg.max_request_bytes, cufile_json=cfg.cufile_json,
                   extra=tuple(sorted((k, str(v)) for k, v in extra.items())))


class Transfer(ABC):
    """Handle of one submitted request. Also a context manager that releases on exit.

    `wait(timeout)` returns the bytes moved or raises `TransferError` / `TransferTimeout`.
    After a timeout the IO may still land: see `TransferTimeout`.
    """

    def __init__(self, engine: str, op: Op, nbytes: int, what: str) -> None:
        self.engine = engine
        self.op = op
        self.nbytes = nbytes
        self.what = what
        self.started = time.perf_counter_ns()
        self.finished: int | None = None
        self._error: BaseException | None = None

    @abstractmethod
    def _poll(self) -> bool:
        """Advance the request; True once complete. Raise the engine's own error on failure."""

    def _fail(self, exc: BaseException) -> TransferError:
        if isinstance(exc, TransferError):
            return exc
        err = TransferError(f"{self.engine}: {self.op.value} of {self.what} failed: "
                            f"{type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err

    def done(self) -> bool:
        """True when complete; raises `TransferError` if the request failed.

        A request that timed out is polled again, so its owner can tell when its IO has stopped."""
        if self.finished is not None:
            return True
        if self._error is not None and not isinstance(self._error, TransferTimeout):
            raise self._error
        try:
            ok = self._poll()
        except BaseException as exc:  # noqa: BLE001 -- engine errors come in many types
            self._error = self._fail(exc)
            raise self._error from exc
        if ok:
            self.finished = time.perf_counter_ns()
        return ok

    def wait(self, timeout: float | None = None) -> int:
        """Block until complete; return bytes moved. Never waits past `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        spins = 0
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                self._error = TransferTimeout(
                    f"{self.engine}: {self.op.value} of {self.what} did not complete in {timeout:.1f} s")
                raise self._error
            spins += 1
            # Engines without a progress thread (NIXL POSIX) advance only when polled: stay close.
            time.sleep(0 if spins < 64 else 5e-5)
        return self.nbytes

    @property
    def latency_ns(self) -> int | None:
        return None if self.finished is None else self.finished - self.started

    def release(self) -> None:
        """Free engine resources of a finished request (no-op by default)."""

    def __enter__(self) -> "Transfer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class TransferEngine(ABC):
    """A way to move bytes between memory and files. Subclasses set `name` and `capabilities`.

    Construction is `cls(options)`; availability problems raise `EngineUnavailable` there.
    All methods are safe to call from several threads.
    """

    name: ClassVar[str] = "abstract"
    traits: ClassVar[Traits] = Traits()
    """What the class declares (`Traits`); `auto` and `doctor` go by these."""

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self._regions: list[tuple[int, int, MemKind]] = []  # sorted (start, end, kind)
        self._regions_lock = threading.Lock()

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this engine instance can do on this machine."""

    @abstractmethod
    def _register(self, addr: int, nbytes: int, kind: MemKind) -> None:
        """Engine-specific memory registration."""

    @abstractmethod
    def _deregister(self, addr: int, nbytes: int, kind: MemKind) -> None:
        """Engine-specific memory deregistration."""

    @abstractmethod
    def open_file(self, path: str) -> int:
        """Open (and register) a file once; return the file id used in descriptors."""

    @abstractmethod
    def close_file(self, file_id: int) -> None:
        """Deregister and close a file opened with `open_file`."""

    @abstractmethod
    def _submit(self, op: Op, kind: MemKind, mem: np.ndarray, file: np.ndarray) -> Transfer:
        """Post one request that is within the limits; return its handle."""

    @abstractmethod
    def close(self) -> None:
        """Release every resource; the engine is unusable afterwards."""

    # -- concrete surface -------------------------------------------------------------------

    def register_memory(self, addr: int, nbytes: int, kind: MemKind = MemKind.DRAM) -> None:
        """Register [addr, addr+nbytes) once, before descriptors point into it."""
        kind = MemKind(kind)
        if kind not in self.capabilities.mem_kinds:
            raise RegionError(f"{self.name}: cannot move {kind.value} memory "
                              f"(supports {', '.join(sorted(k.value for k in self.capabilities.mem_kinds))})")
        if addr <= 0 or nbytes <= 0:
            raise RegionError(f"{self.name}: bad memory region addr={addr:#x} nbytes={nbytes}")
        with self._regions_lock:
            for start, end, _ in self._regions:
                if start == addr and end == addr + nbytes:
                    return  # already registered: idempotent
            self._register(addr, nbytes, kind)
            bisect.insort(self._regions, (addr, addr + nbytes, kind))

    def deregister_memory(self, addr: int) -> None:
        with self._regions_lock:
            for i, (start, end, kind) in enumerate(self._regions):
                if start == addr:
                    self._deregister(start, end - start, kind)
                    del self._regions[i]
                    return

    def check_regions(self, kind: MemKind, mem: np.ndarray) -> None:
        """Raise `RegionError` unless every (addr, nbytes) lies inside one registered region of `kind`."""
        with self._regions_lock:
            regions = [r for r in self._regions if r[2] == kind]
        if not regions:
            raise RegionError(f"{self.name}: no {kind.value} memory is registered")
        starts = np.fromiter((r[0] for r in regions), dtype=np.uint64, count=len(regions))
        ends = np.fromiter((r[1] for r in regions), dtype=np.uint64, count=len(regions))
        addr, nbytes = mem[:, 0], mem[:, 1]
        idx = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        end = ends[safe]
        # Never addr + nbytes: it wraps in uint64 near 2**64 and would pass the check.
        ok &= (nbytes > 0) & (addr <= end) & (nbytes <= end - np.minimum(addr, end))
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise RegionError(f"{self.name}: descriptor {bad} ({int(addr[bad]):#x}, {int(nbytes[bad])} bytes) "
                              f"lies outside every registered {kind.value} buffer")

    def submit(self, op: Op, kind: MemKind, mem: np.ndarray, file: np.ndarray) -> Transfer:
        """Validate one request against the capabilities and post it."""
        caps = self.capabilities
        n = len(mem)
        if n == 0 or len(file) != n:
            raise ValueError(f"{self.name}: {n} memory and {len(file)} file descriptors")
        if n > caps.max_descs:
            raise ValueError(f"{self.name}: {n} descriptors exceed the engine's {caps.max_descs} per request")
        total = int(mem[:, 1].sum())
        if total > caps.max_request_bytes:
            raise ValueError(f"{self.name}: {total} bytes exceed the engine's {caps.max_request_bytes} per request")
        if int(mem[:, 1].max()) > caps.max_desc_bytes:
            raise ValueError(f"{self.name}: a descriptor exceeds {caps.max_desc_bytes} bytes")
        if caps.alignment > 1:
            a = np.uint64(caps.alignment)
            if ((mem[:, 0] % a) | (mem[:, 1] % a) | (file[:, 1] % a)).any():
                raise RegionError(f"{self.name}: O_DIRECT needs {caps.alignment}-byte aligned addresses, "
                                  f"offsets and lengths")
        self.check_regions(MemKind(kind), mem)
        return self._submit(Op(op), MemKind(kind), mem, file)

    def info(self) -> dict[str, Any]:
        """Engine name and path, for stats and bench output."""
        caps = self.capabilities
        return {"engine": self.name, "path": caps.path, "gpu_direct": caps.gpu_direct,
                "direct_io": caps.direct_io, "mem_kinds": sorted(k.value for k in caps.mem_kinds)}

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split_rows(addrs: np.ndarray, lens: np.ndarray, offsets: np.ndarray, limit: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split descriptor rows longer than `limit` bytes into consecutive pieces of at most `limit`.

    Takes flat uint64 arrays of memory addresses, lengths and file offsets; returns them split,
    and how many pieces each input row became (int64, 1 where a row was short enough)."""
    if not len(lens) or int(lens.max()) <= limit:
        return addrs, lens, offsets, np.ones(len(lens), dtype=np.int64)
    pieces = ((lens + np.uint64(limit - 1)) // np.uint64(limit)).astype(np.int64)
    rep = np.repeat(np.arange(len(lens)), pieces)
    k = np.arange(len(rep)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    off = k.astype(np.uint64) * np.uint64(limit)
    return addrs[rep] + off, np.minimum(lens[rep] - off, np.uint64(limit)), offsets[rep] + off, pieces


class Batch(NamedTuple):
    """One request of a planned batch: descriptor rows [row_start, row_stop) of the items
    [start, stop) it touches. Where an item spans several requests (more rows or bytes than one
    request may carry), the requests that hold its rows are consecutive and it is in each of them;
    its outcome is the AND of theirs."""

    start: int
    stop: int
    row_start: int
    row_stop: int


def split_batches(item_descs: Sequence[int] | np.ndarray, item_bytes: Sequence[int] | np.ndarray,
                  caps: Capabilities, max_request_bytes: int = 0, *,
                  row_bytes: Sequence[int] | np.ndarray | None = None) -> Iterator[Batch]:
    """Plan items (pages) into requests within `caps`: yields `Batch`es in item and row order.

    `item_descs[i]` is the descriptor count (rows) of item i, `item_bytes[i]` its size, and
    `row_bytes` (optional) the size of every row, items' rows in order. Items are packed whole,
    up to `caps.max_descs` rows and `max_request_bytes` (a soft limit, 0: none; never past
    `caps.max_request_bytes`) per request. An item that cannot fit one request -- more rows than
    `caps.max_descs`, or more bytes than `caps.max_request_bytes` -- is never refused: it gets
    requests of its own, its rows cut into consecutive runs within the limits (row sizes from
    `row_bytes`, else the item's bytes spread evenly over its rows). Its caller takes it as done
    only once all of them are, and as failed if any failed.
    """
    hard = int(caps.max_request_bytes)
    limit = hard if not max_request_bytes else min(int(max_request_bytes), hard)
    max_descs = max(1, int(caps.max_descs))
    rb = None if row_bytes is None else np.asarray(row_bytes, dtype=np.int64)
    start, descs, nbytes, row = 0, 0, 0, 0
    for i, (d, b) in enumerate(zip(item_descs, item_bytes)):
        d, b = int(d), int(b)
        if d > max_descs or b > hard:
            if i > start:
                yield Batch(start, i, row - descs, row)
            sizes = rb[row:row + d] if rb is not None else np.full(d, -(-b // max(d, 1)), dtype=np.int64)
            yield from _span(i, row, sizes, max_descs, limit)
            row += d
            start, descs, nbytes = i + 1, 0, 0
            continue
        if i > start and (descs + d > max_descs or nbytes + b > limit):
            yield Batch(start, i, row - descs, row)
            start, descs, nbytes = i, 0, 0
        descs += d
        nbytes += b
        row += d
    if start < len(item_descs):
        yield Batch(start, len(item_descs), row - descs, row)


def _span(item: int, row0: int, sizes: np.ndarray, max_descs: int, limit: int) -> Iterator[Batch]:
    """The requests of one item too large for one: consecutive runs of its rows, each at most
    `max_descs` rows and `limit` bytes (a row larger than `limit` goes alone)."""
    a, n = 0, len(sizes)
    while a < n:
        ends = np.cumsum(sizes[a:a + max_descs])
        k = max(1, int(np.searchsorted(ends, limit, side="right")))
        yield Batch(item, item + 1, row0 + a, row0 + a + k)
        a += k
