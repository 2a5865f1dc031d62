"""`PageReader`: read-only access to a namespace another process writes.

    reader = PageReader(page_bytes, identity, config={...})   # the writer's PageStore arguments
    reader.register_memory(buf_addr, buf_nbytes)              # once
    reader.get(keys, pages) -> [True, False, ...]   # False: miss, failed IO, or rewritten while read
    reader.exists(keys) / reader.prefix(keys) / stats / close
    reader.put(...) / delete(...) / clear()  -> ReadOnlyError

Any number of processes write a namespace through `PageStore`s; a process that only reads and
must write nothing under `GDS_PATH` (SGLang's MLA ranks that are not the storage writer) reads it
through a `PageReader`.
The on-disk format stays the store's: the same namespace rule (`namespace_location`), index
(`IndexReader`), slot placement (`SlabSet`), engines, IO path and checksum.

The read-only contract:

* **Nothing is written.** No lock is taken; no directory, file, index row or slot is created,
  changed, truncated or evicted under `GDS_PATH`, SQLite's -wal/-shm files included
  (`IndexReader` says how). The one exception is the engine choice with ``ENABLE_GDS=1``, whose
  GPU-direct probe writes and removes a temporary file in the first `GDS_PATH` directory, as it
  does for the writer. Reads do not refresh the writer's LRU order.
* **Every call looks its keys up in the writer's index** (no copy in memory): pages the writer
  publishes are hits from the next call on, pages it evicts or deletes are misses.
* **Every page is verified.** A reader writes no lease (that would write the index), so a writer
  may evict a page and reuse its slot while it is being read. Each page read is checked against the
  checksum of its index row (`hicache_gds.checksum`, the same for pages written from host or GPU
  memory), whatever `verify` says; a reused, torn or vanished page fails it and reads as a miss
  (counted in `checksum_mismatches`), never as wrong bytes. Its destination may then hold any
  bytes. Reads go to host memory only (`RegionError` for VRAM pages).
* **A namespace no writer has opened yet is empty**, not an error: every key is a miss and the
  reader creates nothing; pages appear once a writer publishes them. A `GDS_PATH` entry that is
  missing or not a directory is a `ConfigError`, as for the store, and so is a symbolic link
  where the namespace keeps a directory or file.
* **Writes raise `ReadOnlyError`** (an `io.UnsupportedOperation`: `OSError` and `ValueError`).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..slabs import ondisk
from ..config import Config
from ..engines.base import MemKind, Op, TransferEngine
from ..engines.select import choose_engine
from ..errors import ConfigError, ReadOnlyError, RegionError
from ..gate import gated
from ..index import INDEX_FILE, IndexReader
from ..layout import Pages, namespace_location
from ..slabs.slabset import SlabSet, prepare_root
from .mover import BADSUM, FAIL, MAX_SINGLE_RETRIES, OK, TIMEOUT, PageMover
from .namespace import checked_config
from .protocol import Lease, Store

__all__ = ["PageReader"]

log = logging.getLogger("hicache_gds.reader")


class PageReader(PageMover, Store):
    """The read-only `Store` over a namespace another process writes (module docstring).

    Takes the writer's `page_bytes`, `identity` and `config` (the same values name the same
    namespace); `engine` as for `PageStore`. Thread-safe. `file_ids` is empty until the first
    hit has opened the writer's slab files.
    """

    read_only = True

    def __init__(self, page_bytes: int, identity: Mapping[str, Any] | None = None, *,
                 config: Config | Mapping[str, Any] | None = None, engine: TransferEngine | None = None) -> None:
        cfg = checked_config(page_bytes, config)
        roots = [prepare_root(p, writable=False) for p in cfg.gds_path]
        loc = namespace_location(page_bytes, identity, cfg)
        super().__init__(cfg, page_bytes, loc.identity, loc.namespace, loc.slot_bytes, "page reader of")
        self.dirs = list(loc.dirs)
        self._member = None
        # The writer's recorded directory order, where the namespace exists (`ondisk`); a namespace
        # not created yet, or being created right now, keeps GDS_PATH's order until its files appear.
        self._ordered = False
        try:
            self._order_dirs()
        except ConfigError:  # a link or a missing directory: refused by the first call, as the rest is
            pass
        self._slab_ids: list[tuple[int, int, int]] = []  # (st_dev, st_ino, st_size) of the files `_fids` are open on
        self._opens = 0  # times the slab files were (re)opened
        self._slab_gen = -1  # `index.generation` the slab files were last checked at
        self._retired: list[int] = []  # ids of replaced files: other threads may still read through them
        self._files_lock = threading.Lock()
        if engine is None:
            choice = choose_engine(cfg, roots[0], frozenset({MemKind.DRAM}))
            engine, reason = choice.engine, choice.reason
        else:
            reason = f"{engine.name}: given by the caller"
        self._index_meta = ondisk.index_meta(loc)
        self._old_indexes: list[IndexReader] = []
        self.slabs = SlabSet(self.dirs, self.slot_bytes, 0, create=False)
        self.index = IndexReader(os.path.join(self.dirs[0], INDEX_FILE), self._index_meta)
        self._attach(engine, reason)
        log.info("hicache-gds reader of %s (%s, read-only); engine %s", self.namespace, ",".join(self.dirs),
                 self.engine_reason)

    # -- writes ----------------------------------------------------------------------------------
    def _refuse(self, op: str) -> ReadOnlyError:
        return ReadOnlyError(f"{op}: namespace {self.namespace} is open read-only (PageReader); only the "
                             f"process holding its PageStore writes it")

    def put(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Refused: raises `ReadOnlyError`."""
        raise self._refuse("put")

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Refused: raises `ReadOnlyError`."""
        raise self._refuse("delete")

    def clear(self) -> int:
        """Refused: raises `ReadOnlyError`."""
        raise self._refuse("clear")

    # -- reads -----------------------------------------------------------------------------------
    def _order_dirs(self) -> bool:
        """Put `dirs` in the writer's recorded order once it is complete (at construction, and
        before each call until then); True when it is. The index and the slab files follow."""
        if self._ordered:
            return True
        order = ondisk.stripe_order(self.dirs, partial="none")
        if order is None:
            return False
        if order != self.dirs:
            log.info("hicache-gds reader of %s: GDS_PATH lists the namespace's directories as %s; using their "
                     "recorded order %s", self.namespace, ",".join(self.dirs), ",".join(order))
            if getattr(self, "index", None) is not None:  # found after construction: follow it
                with self._files_lock:
                    self._retired.extend(self._fids)
                    self._fids, self._slab_ids = [], []
                    self._old_indexes.append(self.index)
                    self.dirs = order
                    self.slabs = SlabSet(self.dirs, self.slot_bytes, 0, create=False)
                    self.index = IndexReader(os.path.join(self.dirs[0], INDEX_FILE), self._index_meta)
        self.dirs = order
        self._ordered = True
        return True

    @gated
    def exists(self, keys: Sequence[str]) -> list[bool]:
        # docstring inherited
        self._order_dirs()
        return self.index.contains(self._check_keys(keys))

    @gated
    def prefix(self, keys: Sequence[str]) -> int:
        # docstring inherited
        self._order_dirs()
        return self.index.prefix_len(self._check_keys(keys))

    @gated
    def get(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Read pages into host memory; False per page missing, failed, or not matching its checksum."""
        self._order_dirs()
        keys = self._check_keys(keys)
        if isinstance(pages, Pages) and pages.kind is not MemKind.DRAM:
            raise RegionError("a PageReader verifies every page on the host, so it reads into host (DRAM) "
                              "memory only")
        self._check_pages(keys, pages)
        t0 = time.perf_counter_ns()
        entries = self.index.lookup(keys)
        hits = [i for i, e in enumerate(entries) if e is not None]
        # csum 0 (never written by format 2; format 1 left it on pages from VRAM): cannot be verified.
        todo = [i for i in hits if entries[i].csum and entries[i].nbytes == self.page_bytes]
        status = np.full(len(todo), FAIL, dtype=np.int8)
        if todo and self._open_files():
            slots = np.array([entries[i].slot for i in todo], dtype=np.int64)
            expect = np.array([entries[i].csum for i in todo], dtype=np.int64)
            todo_pages = pages.select(todo)
            status, _ = self._io(Op.READ, todo_pages, slots, expect)
            self._recover(todo_pages, slots, expect, status)
        result = [False] * len(keys)
        for j, i in enumerate(todo):
            result[i] = bool(status[j] == OK)
        nr, bad = sum(result), int((status == BADSUM).sum())
        if bad:
            log.debug("hicache-gds: %d page(s) of %s changed while read (evicted by the writer): misses", bad,
                      self.namespace)
        self._stats.add(hits=len(hits), misses=len(keys) - len(hits), pages_read=nr, bytes_read=nr * self.page_bytes,
                        get_failed=len(hits) - nr - bad, checksum_mismatches=bad,
                        timeouts=int((status == TIMEOUT).sum()))
        self._stats.batch(False, time.perf_counter_ns() - t0)
        return result

    def _recover(self, pages: Pages, slots: np.ndarray, expect: np.ndarray, status: np.ndarray) -> None:
        """After a READ with failed pages: slab files that changed since they were opened (the writer
        grew or shrank them, or they were replaced) are opened again, since an engine may have
        registered the old size; pages whose slot lies past the end of its file stay failed (unlike
        the store, a reader never extends the writer's file); the others are re-read one request
        each when some pages succeeded or the files changed (engines without per-descriptor
        results fail a whole request for one bad slot)."""
        fail = np.flatnonzero(status == FAIL)
        if not fail.size:
            return
        opened = self._opens
        if not self._open_files(force=True):
            return
        fidx, off = self.slabs.place(slots[fail])
        ends = np.asarray([size for _, _, size in self._slab_ids], dtype=np.uint64)[fidx]
        retry = fail[off + np.uint64(self.slot_bytes) <= ends]
        if self._opens != opened or len(retry) < len(status):
            for j in retry[:MAX_SINGLE_RETRIES].tolist():
                st, _ = self._io(Op.READ, pages.select([j]), slots[j:j + 1], expect[j:j + 1])
                status[j] = st[0]

    def _open_files(self, force: bool = False) -> bool:
        """Engine file ids for the writer's slab files, opened once they exist and checked again
        (identity and size) each time the index reader reopens the database, or when `force`;
        False while one is missing. Replaced ids stay open until `close`: other threads may still
        be reading through them."""
        gen = self.index.generation
        with self._files_lock:
            if self._fids and gen == self._slab_gen and not force:
                return True
            ids = []
            for d, path in zip(self.dirs, self.slabs.paths):
                try:
                    dst, st = os.lstat(d), os.lstat(path)
                except FileNotFoundError:
                    return False
                if not stat.S_ISDIR(dst.st_mode) or not stat.S_ISREG(st.st_mode):
                    raise ConfigError(f"GDS_PATH: {d} or its {SlabSet.FILE_NAME} is a symbolic link or of the "
                                      f"wrong type; a reader never follows links inside a namespace (remove it)")
                ids.append((st.st_dev, st.st_ino, st.st_size))
            if ids != self._slab_ids:
                fids: list[int] = []
                try:
                    for path in self.slabs.paths:
                        fids.append(self.engine.open_file(path))
                except BaseException:
                    for fid in fids:
                        self.engine.close_file(fid)
                    raise
                self._retired.extend(self._fids)
                self._fids, self._slab_ids = fids, ids
                self._opens += 1
            self._slab_gen = gen
            return True

    @gated
    def lease(self, keys: Sequence[str]) -> Lease:
        """The present pages of `keys` as the writer's index names them now, unprotected (a reader
        writes no lease: `protected` is False, so the caller checks every page against
        `checksums` where it lands); `reject` drops nothing. Releasing it is free."""
        self._order_dirs()
        keys = self._check_keys(keys)
        entries = self.index.lookup(keys)
        present = np.array([e is not None and bool(e.csum) for e in entries], dtype=bool)
        if present.any() and not self._open_files():
            present[:] = False
        return self._lease_of(keys, entries, present, self._fids or [0] * len(self.dirs), protected=False,
                              unpin=None, drop=None)

    # -- the rest --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters, latency histograms, the engine and the path that ran, and the writer's page count now."""
        out = self._stats_base()
        out.update(read_only=True)
        out.update(self.index.stats())
        return out

    def _teardown(self) -> None:
        try:
            with self._files_lock:
                retired, self._retired = self._retired, []
                old, self._old_indexes = self._old_indexes, []
            for fid in retired:
                self.engine.close_file(fid)
            for ix in old:
                ix.close()
        finally:
            try:
                self._release_io()
            finally:
                self.index.close()
