"""`Store`: the one protocol every store implements and every adapter uses; `Lease`: pages held
for a GPU-direct read that moves their bytes itself.

    with open_store(page_bytes, identity, config=cfg) as store:      # PageStore, PageReader or TieredStore
        store.register_memory(addr, nbytes)                          # once
        store.put(keys, pages) -> [True, ...]; store.get(keys, pages) -> [True, False, ...]
        store.exists(keys) / prefix(keys) / delete(keys) / clear() / stats()
        with store.lease(keys) as lease:                             # GPU-direct paths
            rows = lease.file_ids, lease.offsets                     # where each present page lives
            transfers = lease.post(Op.READ, kind, mem, fil)          # the store's engine, within its limits

Batches are the unit and results are per page, in order; a miss is False, never an exception.
Bad input raises a typed error (`TypeError`, `ValueError`, `RegionError`); writes to a read-only
store raise `ReadOnlyError`; calls after `close` raise `StoreClosedError`.
"""

from __future__ import annotations

import abc
import threading
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..config import Config
from ..engines.base import MemKind, Op, Transfer
from ..layout import Pages

__all__ = ["Lease", "Store"]


class Lease:
    """Present pages of `keys` held until released: their slots are not reused meanwhile (for a
    `PageStore`; a `PageReader` writes no lease, so `protected` is False and every page must be
    checked against `checksums` where it lands). Per key, in order: `present`; and for present
    keys `file_ids` (the store engine's file id), `offsets` (bytes into that file), `nbytes` and
    `checksums` (`hicache_gds.checksum`, 0 where none was recorded). `post` submits descriptor
    rows through the store's engine; `reject` drops pages found bad where they landed.

    A context manager; `release(which)` returns the leases of some positions early (each at most
    once), `release()` the rest. Thread-safe."""

    def __init__(self, keys: Sequence[str], present: np.ndarray, file_ids: np.ndarray, offsets: np.ndarray,
                 nbytes: np.ndarray, checksums: np.ndarray, *, slots: np.ndarray,
                 post: Callable[[Op, MemKind, np.ndarray, np.ndarray], list[Transfer]],
                 unpin: Callable[[list[int]], None] | None, drop: Callable[[list[str], list[int]], Any] | None,
                 protected: bool) -> None:
        self.keys = list(keys)
        self.present, self.file_ids, self.offsets = present, file_ids, offsets
        self.nbytes, self.checksums = nbytes, checksums
        self.protected = protected
        self._slots = slots
        self._post, self._unpin, self._drop = post, unpin, drop
        self._held = set(np.flatnonzero(present).tolist()) if unpin is not None else set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def missing(self) -> int:
        """Keys not present (a load that needs them all fails)."""
        return int(len(self.keys) - self.present.sum())

    def post(self, op: Op, kind: MemKind, mem: np.ndarray, fil: np.ndarray) -> list[Transfer]:
        """Submit (addr, nbytes) x (file id, offset) rows through the store's engine, in requests
        within its limits; the caller waits for (never without a timeout) and releases each."""
        return self._post(op, kind, mem, fil)

    def reject(self, which: Iterable[int]) -> None:
        """Drop the pages at positions `which` from the store (they failed their checksum where
        they landed); each only while its key still names the slot that was read. Raises `OSError`
        when the index cannot be written; a read-only store drops nothing."""
        idx = [int(i) for i in which if self.present[int(i)]]
        if idx and self._drop is not None:
            self._drop([self.keys[i] for i in idx], [int(self._slots[i]) for i in idx])

    def release(self, which: Iterable[int] | None = None) -> None:
        """Return the leases of positions `which` (all still held when None)."""
        with self._lock:
            if which is None:
                done, self._held = sorted(self._held), set()
            else:
                done = [i for i in (int(w) for w in which) if i in self._held]
                self._held.difference_update(done)
        if done and self._unpin is not None:
            self._unpin([int(self._slots[i]) for i in done])

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Store(abc.ABC):
    """Fixed-size pages under string keys (module docstring). `PageStore` (read-write),
    `PageReader` (read-only) and `TieredStore` (NVMe and remote memory) implement it, and
    `open_store` opens the one the configuration asks for. `hicache_gds.testing.StoreTests` is
    the conformance suite."""

    config: Config
    page_bytes: int  # every page's size
    slot_bytes: int  # a page's room in a slab file: page_bytes rounded up to 4 KiB
    namespace: str  # the namespace's directory name (hash of its identity)
    dirs: list[str]  # its directories, one per GDS_PATH entry (none for a store without a local tier)
    read_only: bool = False

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is the page present."""

    def prefix(self, keys: Sequence[str]) -> int:
        """Length of the longest run of present keys from the start."""
        for i, present in enumerate(self.exists(keys)):
            if not present:
                return i
        return len(keys)

    @abc.abstractmethod
    def put(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Write pages; True per page once it is durable and visible. Present keys are not rewritten."""

    @abc.abstractmethod
    def get(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Read pages into memory; False per page missing, failed, or failing its checksum."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove pages; True per key that was present."""

    @abc.abstractmethod
    def clear(self) -> int:
        """Remove every page of the namespace; returns how many there were."""

    @abc.abstractmethod
    def lease(self, keys: Sequence[str]) -> Lease:
        """Hold the present pages of `keys` for a read that moves their bytes itself (`Lease`)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters (`hicache_gds.stats.COUNTERS`), latency histograms, the engine and the path."""

    @abc.abstractmethod
    def register_memory(self, addr: int, nbytes: int, kind: MemKind = MemKind.DRAM) -> None:
        """Register a buffer that pages will point into (once, before put/get)."""

    @abc.abstractmethod
    def deregister_memory(self, addr: int) -> None:
        """Forget a buffer registered with `register_memory` (before freeing it)."""

    @abc.abstractmethod
    def page_checksums(self, pages: Pages, like: np.ndarray | None = None) -> np.ndarray:
        """The checksum each page would be stored with (int64 per page; `hicache_gds.pagesum`); with
        `like` (recorded checksums, e.g. a lease's), each of the kind its `like` value is of: what a
        path that reads pages itself compares with the recorded ones."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> Any:
        """The engine's declared capabilities (alignment, descriptor and request limits, memory kinds)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for the calls in flight (bounded), release everything. Idempotent."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

