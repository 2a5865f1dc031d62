"""`PageStore`: the one API adapters use. Keys in, pages (memory regions) in or out, per-page results.

    store = PageStore(page_bytes, {"model": "llama3-8b", "layout": "page_first", ...}, config={...})
    store.register_memory(buf_addr, buf_nbytes)          # once
    store.put(keys, Pages.contiguous(buf_addr, page_bytes, idx))   -> [True, ...]
    store.get(keys, pages) -> [True, False, ...]          # False: miss, failed IO or bad checksum
    store.exists(keys) / store.prefix(keys) / delete / clear / stats / close

Write order (the crash-safety contract, with `Index`): reserve free slots (evictions committed
first) -> write page bytes -> [fdatasync] -> publish rows. A page is never visible before its
bytes are on disk, and `put` returns True only for published pages. Reads lease their slots
(`Index.lookup_pin`) until the bytes are in memory.

Thread-safe (SGLang calls exists, get and put from three threads at once) and process-safe: any
number of processes open one namespace, each its own `PageStore`; they share its pages, slots,
LRU and capacity through the index (`index.py`), and a dead one's reservations are reclaimed
(`owners.py`). Bytes move straight between each process's memory and the slab files.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import xxhash

from .capacity import Sizing, gib, size_namespace
from .config import Config
from .engines.base import Batch, MemKind, Op, Transfer, TransferEngine, split_batches, split_rows
from .engines.select import choose_engine
from .errors import ConfigError, RegionError, TransferError, TransferTimeout
from .index import INDEX_FILE, Index
from .layout import Pages, namespace_location
from .memory import HostBuffer, align_up, view
from .owners import Membership, setup_lock
from .slabs import META_FILE, SlabSet, prepare_root, private_dir
from .stats import StoreStats

__all__ = ["PageStore", "MAX_KEY_BYTES"]

log = logging.getLogger("hicache_gds.store")
MAX_KEY_BYTES = 1024
# A batch is cut into about this many requests, all posted at once, so checksums of request k
# overlap the IO of the later ones and only the last one's checksum is exposed.
_PIPELINE_PARTS = 8
_PIPELINE_MIN_BYTES = 8 << 20
_MIN_DIRECT_SEGMENT = 128 << 10  # smaller segments are gathered into one aligned IO per page
_OK, _FAIL, _TIMEOUT, _BADSUM = 1, 0, 2, 3
_MAX_SINGLE_RETRIES = 64  # failed pages of a read re-read one request each, at most
# Staging lent to requests that timed out stays out of use until they finish; past this many bytes
# held, staged IO fails at once instead of allocating more (a drive that stopped answering).
_MAX_HELD_STAGING = 2 << 30
_ORPHANED: list[HostBuffer] = []  # held at close by requests that never finished: never unmapped


_hash_pool: ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()


def _hasher() -> ThreadPoolExecutor | None:
    """Threads that checksum a request's pages in parallel (xxhash releases the GIL), or None on one core.

    Requests of a batch are all posted at once and the disk serves them interleaved, so most of
    them complete near the end of the batch: hashing them one by one on the caller's thread was
    exposed, not overlapped (about 9% of get throughput on the H100 VM with verification on)."""
    global _hash_pool
    workers = min(8, os.cpu_count() or 1)
    if workers < 2:
        return None
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = ThreadPoolExecutor(workers, thread_name_prefix="hicache-gds-xxh3")
        return _hash_pool


def _forget_hasher_in_child() -> None:
    # A forked child has none of the parent's threads: a copied pool would queue work forever.
    global _hash_pool, _hash_pool_lock
    _hash_pool, _hash_pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_hasher_in_child)


def _csum(segments: Iterable[tuple[int, int]]) -> int:
    h = xxhash.xxh3_64()
    for addr, n in segments:
        h.update(view(addr, n))
    d = h.intdigest()
    # SQLite integers are signed 64-bit; 0 means "not recorded" (VRAM pages).
    return (d - (1 << 64) if d >= 1 << 63 else d) or 1


def _checked_config(page_bytes: int, config: Config | Mapping[str, Any] | None) -> Config:
    """The `Config` a `PageStore` or `PageReader` opens with; `ConfigError` for a bad page size or no GDS_PATH."""
    cfg = config if isinstance(config, Config) else Config.load(config)
    if not isinstance(page_bytes, int) or page_bytes <= 0:
        raise ConfigError(f"page_bytes must be a positive integer, got {page_bytes!r}")
    if not cfg.gds_path:
        raise ConfigError("GDS_PATH is not set: give one directory, or comma-separated directories "
                          "(one per NVMe drive), in the GDS_PATH environment variable or the gds_path key")
    return cfg


def _refuse_link(exc: OSError) -> ConfigError | None:
    """A symlink planted where the store keeps a file (O_NOFOLLOW gives ELOOP): a clear refusal."""
    if exc.errno != errno.ELOOP:
        return None
    return ConfigError(f"GDS_PATH: {exc.filename} is a symbolic link; the store never follows links "
                       f"inside its namespace (remove it)")


def _finished(t: Transfer) -> bool:
    """The request can no longer move bytes: it completed or failed (a timed-out one is polled again)."""
    try:
        return t.done()
    except TransferError:
        return True


class _Staging:
    """Aligned host buffers registered with the engine, lent to one call at a time.

    A buffer whose call saw a request time out is held (`hold`), not lent again, until that
    request finishes, since its IO may still land there; `acquire` hands finished ones back."""

    def __init__(self, engine: TransferEngine) -> None:
        self.engine = engine
        self.free: list[HostBuffer] = []
        self.held: list[tuple[HostBuffer, list[Transfer]]] = []
        self.lock = threading.Lock()

    def hold(self, buf: HostBuffer, late: list[Transfer]) -> None:
        with self.lock:
            self.held.append((buf, late))

    def held_bytes(self) -> int:
        with self.lock:
            return sum(b.nbytes for b, _ in self.held)

    def _reap(self) -> None:
        with self.lock:
            done, still = [], []
            for h in self.held:
                (done if all(_finished(t) for t in h[1]) else still).append(h)
            self.held = still
        for buf, _ in done:
            self.release(buf)

    def acquire(self, nbytes: int) -> HostBuffer:
        if self.held:
            self._reap()
        with self.lock:
            fits = [b for b in self.free if b.nbytes >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self.free.remove(buf)
                return buf
        buf = HostBuffer(align_up(nbytes, 1 << 20))
        self.engine.register_memory(buf.addr, buf.nbytes, MemKind.DRAM)
        return buf

    def release(self, buf: HostBuffer) -> None:
        with self.lock:
            self.free.append(buf)
            if len(self.free) > 6:  # keep a few; the rest go back to the OS
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
                _ORPHANED.extend(b for b, _ in self.held)
                self.held.clear()


class PageStore:
    """Fixed-size pages under string keys, in slab files under `GDS_PATH`, moved by one engine.

    Parameters
    ----------
    page_bytes:
        Size of every page in this namespace.
    identity:
        What makes the bytes meaningful (model, dtype, layout, geometry, rank...). Hashed into the
        namespace directory; `config.namespace` (tenant) is mixed in too.
    config:
        A `Config`, or a dict of overrides on top of the environment.
    mem_kinds:
        Memory kinds the caller will pass (VRAM makes `auto` prefer GPU-direct engines).
    engine:
        An engine to use instead of choosing one (tests, benchmarks, wrappers).

    The namespace holds `config.capacity // slot_bytes` slots (`slot_bytes` = `page_bytes`
    rounded up to 4 KiB), so callers that must agree on a page count can size it exactly. Opened
    while other processes have it open, a namespace keeps the size it has (a different capacity
    is logged and applied at an open when nobody else has it open).
    """

    read_only = False  # True for `PageReader`, the lock-free read-only view of a namespace

    def __init__(self, page_bytes: int, identity: Mapping[str, Any] | None = None, *,
                 config: Config | Mapping[str, Any] | None = None,
                 mem_kinds: Iterable[MemKind] = (MemKind.DRAM,), engine: TransferEngine | None = None) -> None:
        cfg = _checked_config(page_bytes, config)
        self.config = cfg
        self.page_bytes = page_bytes
        roots = [prepare_root(p) for p in cfg.gds_path]
        loc = namespace_location(page_bytes, identity, cfg)
        self.identity, self.namespace, self.slot_bytes = loc.identity, loc.namespace, loc.slot_bytes
        self.dirs = [private_dir(r, self.namespace) for r in roots]
        self._member: Membership | None = None
        self._closed = False
        own_engine = engine is None
        try:
            # Opens of one namespace take turns (`setup_lock`): the first opener of a namespace no
            # other process has open sizes and recovers it; later ones join it as it is.
            with setup_lock(self.dirs):
                self._member = Membership(self.dirs[0])
                others = self._member.others()
                # The engine first: one that cannot run here must not cost a full fallocate.
                if engine is None:
                    choice = choose_engine(cfg, self.dirs[0], frozenset(MemKind(k) for k in mem_kinds))
                    engine, self.engine_reason = choice.engine, choice.reason
                else:
                    self.engine_reason = f"{engine.name}: given by the caller"
                self.engine = engine
                if not others:
                    self._write_meta()
                slab0 = os.path.join(self.dirs[0], SlabSet.FILE_NAME)
                had_slots = os.path.exists(slab0) and os.path.getsize(slab0) > 0  # before sizing creates it
                self.sizing = self._nslots(cfg) if not others else self._joined_nslots(cfg, len(others))
                nslots = self.sizing.nslots
                gone = self._short_slabs(nslots) if not others else []  # before SlabSet extends the files back
                self.slabs = SlabSet(self.dirs, self.slot_bytes, nslots, cfg.preallocate, create=not others)
                self.index = Index(os.path.join(self.dirs[0], INDEX_FILE), nslots, loc.index_meta,
                                   existing=had_slots, gone=gone, member=self._member, first=not others)
            self._fids = [engine.open_file(p) for p in self.slabs.paths]
            self._sync_fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in self.slabs.paths] if cfg.sync else []
        except BaseException as exc:
            if own_engine and engine is not None:
                engine.close()
            if getattr(self, "index", None) is not None:
                self.index.close()
            if self._member is not None:
                self._member.close()
            link = _refuse_link(exc) if isinstance(exc, OSError) else None
            if link is not None:
                raise link from exc
            raise
        self._staging = _Staging(engine)
        self._stats = StoreStats()
        log.info("hicache-gds store %s: capacity %s (%d slots of %d bytes) in %s, %s; engine %s",
                 self.namespace, gib(self.sizing.capacity), nslots, self.slot_bytes, ",".join(self.dirs),
                 self.sizing.how, self.engine_reason)

    # -- open ------------------------------------------------------------------------------------
    def _write_meta(self) -> None:
        path = os.path.join(self.dirs[0], META_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"identity": self.identity, "slot_bytes": self.slot_bytes, "dirs": self.dirs}, f, indent=1)
        os.replace(tmp, path)

    def _nslots(self, cfg: Config) -> Sizing:
        """Slots of this namespace and how they were chosen (`capacity.size_namespace` has the rule)."""
        sizing = size_namespace(cfg, self.dirs, self.slot_bytes)
        if sizing.nslots < 1:
            raise ConfigError(f"capacity: {cfg.capacity} bytes hold no page of {self.slot_bytes} bytes; "
                              f"raise HICACHE_GDS_CAPACITY")
        return sizing

    def _joined_nslots(self, cfg: Config, others: int) -> Sizing:
        """The size of a namespace other processes have open: kept as it is (a different
        configured capacity is logged, not applied: the others address its slots)."""
        sizes = []
        for p in (os.path.join(d, SlabSet.FILE_NAME) for d in self.dirs):
            try:
                sizes.append(os.lstat(p).st_size)
            except FileNotFoundError:
                sizes.append(0)
        nslots = sum(s // self.slot_bytes for s in sizes)
        want = SlabSet(self.dirs, self.slot_bytes, nslots, create=False).file_bytes
        if nslots < 1 or sizes != want:
            raise ConfigError(f"namespace {self.dirs[0]} is open in {others} other process(es) but its slab files "
                              f"have sizes {sizes}, not those of one namespace; close those processes first")
        if cfg.capacity and cfg.capacity // self.slot_bytes != nslots:
            log.warning("hicache-gds: namespace %s is open in %d other process(es) with %d slots; capacity %d "
                        "(%d slots) is not applied while they have it open", self.namespace, others, nslots,
                        cfg.capacity, cfg.capacity // self.slot_bytes)
        return Sizing(nslots, self.slot_bytes, f"as sized by its first opener (open in {others} other process(es))")

    def _short_slabs(self, nslots: int) -> list[tuple[int, int]]:
        """Slots past the end of a slab file truncated or deleted while the store was closed, as
        (first slot, step) for `Index`: their pages are gone, so their rows are dropped at open
        rather than reported present until a read fails."""
        want = SlabSet(self.dirs, self.slot_bytes, nslots, create=False)  # the sizes, nothing touched
        nd = len(self.dirs)
        out = []
        for i, (path, full) in enumerate(zip(want.paths, want.file_bytes)):
            try:
                size = os.lstat(path).st_size
            except FileNotFoundError:
                size = 0
            if size < full:
                out.append((size // self.slot_bytes * nd + i, nd))
        return out

    # -- validation ------------------------------------------------------------------------------
    @staticmethod
    def _check_keys(keys: Sequence[str]) -> list[str]:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise TypeError(f"keys must be a list of str, got {type(keys).__name__}")
        for i, k in enumerate(keys):
            if not isinstance(k, str):
                raise TypeError(f"key {i} is {type(k).__name__}, not str")
            if not k or len(k) > MAX_KEY_BYTES or "\x00" in k:
                raise ValueError(f"key {i} is empty, longer than {MAX_KEY_BYTES} characters, or contains NUL")
            try:
                k.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"key {i} is not UTF-8 text (it holds a lone surrogate)") from None
        return list(keys)

    def _check_pages(self, keys: list[str], pages: Pages) -> None:
        if not isinstance(pages, Pages):
            raise TypeError(f"pages must be hicache_gds.Pages, got {type(pages).__name__}")
        if len(pages) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
        sizes = pages.page_nbytes
        bad = np.flatnonzero(sizes != self.page_bytes)
        if bad.size:
            i = int(bad[0])
            raise RegionError(f"page {i} has {int(sizes[i])} bytes; pages of this store have {self.page_bytes}")
        if len(pages):
            mem = np.stack([pages.addrs.ravel(), pages.lens.ravel()], axis=1)
            self.engine.check_regions(pages.kind, mem)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the page store is closed")

    # -- queries ---------------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is the page present."""
        self._check_open()
        return self.index.contains(self._check_keys(keys))

    def prefix(self, keys: Sequence[str]) -> int:
        """Length of the longest run of present keys from the start."""
        self._check_open()
        return self.index.prefix_len(self._check_keys(keys))

    def register_memory(self, addr: int, nbytes: int, kind: MemKind = MemKind.DRAM) -> None:
        """Register a buffer that pages will point into (once, before put/get)."""
        self._check_open()
        self.engine.register_memory(addr, nbytes, MemKind(kind))

    @property
    def file_ids(self) -> list[int]:
        """Engine file ids of the slab files, in `slabs.paths` order (for reads of page ranges)."""
        return list(self._fids)

    def deregister_memory(self, addr: int) -> None:
        """Forget a buffer registered with `register_memory` (before freeing it)."""
        self._check_open()
        self.engine.deregister_memory(addr)

    def register_tensor(self, tensor: Any) -> None:
        self.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                             MemKind.VRAM if tensor.is_cuda else MemKind.DRAM)

    # -- put / get -------------------------------------------------------------------------------
    def put(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Write pages; True per page once it is durable and visible. Present keys are not rewritten."""
        self._check_open()
        keys = self._check_keys(keys)
        self._check_pages(keys, pages)
        t0 = time.perf_counter_ns()
        result = [False] * len(keys)
        present = self.index.contains(keys)
        first: dict[str, int] = {}
        todo = []
        for i, k in enumerate(keys):
            if present[i]:
                result[i] = True
            elif k not in first:
                first[k] = i
                todo.append(i)
        try:
            slots = self.index.reserve(len(todo), evict=self.config.evict)
        except OSError as exc:
            log.warning("hicache-gds: no slots for %d pages: %s", len(todo), exc)
            slots = []
        todo_w = todo[:len(slots)]
        status, sums = self._io(Op.WRITE, pages.select(todo_w), np.asarray(slots, dtype=np.int64), None)
        if self.config.sync and (status == _OK).any():
            for fd in self._sync_fds:
                os.fdatasync(fd)
        ok_items = [(keys[i], slots[j], self.page_bytes, int(sums[j])) for j, i in enumerate(todo_w)
                    if status[j] == _OK]
        try:
            published = self.index.publish(ok_items)
        except OSError as exc:
            log.warning("hicache-gds: %d written pages not published: %s", len(ok_items), exc)
            published = [False] * len(ok_items)
            for j in range(len(todo_w)):
                if status[j] == _OK:
                    status[j] = _FAIL
        # Not published by this call (a duplicate, no slot, or a failed write) but present now: a
        # concurrent put of the same key -- in this process or another -- stored it. True, as for
        # a present key; an index write failure leaves it False.
        late = [it[0] for it, pub in zip(ok_items, published) if not pub] + [keys[i] for i in todo[len(slots):]]
        now = dict(zip(late, self.index.contains(late))) if late else {}
        for (key, _, _, _), pub in zip(ok_items, published):
            result[first[key]] = pub or now.get(key, False)
        for i in todo[len(slots):]:
            result[i] = now[keys[i]]
        self.index.release(slots[j] for j in range(len(todo_w)) if status[j] in (_FAIL, _BADSUM))
        self.index.lose(slots[j] for j in range(len(todo_w)) if status[j] == _TIMEOUT)
        for i, k in enumerate(keys):
            if i != first.get(k, i):
                result[i] = result[first[k]]
        nw = int(sum(published))
        self._stats.add(pages_written=nw, bytes_written=nw * self.page_bytes,
                        put_skipped_present=sum(present), put_failed=len(keys) - sum(result),
                        timeouts=int((status == _TIMEOUT).sum()))
        self._stats.batch(True, time.perf_counter_ns() - t0)
        return result

    def get(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Read pages into memory; False per page that is missing, failed, or failed its checksum."""
        self._check_open()
        keys = self._check_keys(keys)
        self._check_pages(keys, pages)
        t0 = time.perf_counter_ns()
        try:
            entries = self.index.lookup_pin(keys)
            leased = True
        except OSError as exc:
            # The index cannot be written (a full disk, or another process holding it too long): the
            # slots cannot be leased, so another process may reuse one mid-read. Read them anyway
            # when each page can be checked against its checksum; a reused slot then reads as a miss.
            leased = False
            log.warning("hicache-gds: %s; reading %d pages unleased, each checked against its checksum", exc,
                        len(keys))
            found = self.index.peek(keys) if pages.kind is MemKind.DRAM else {}
            entries = [e if e is not None and e.csum else None for e in (found.get(k) for k in keys)]
        hits = [i for i, e in enumerate(entries) if e is not None]
        result = [False] * len(keys)
        try:
            slots = np.array([entries[i].slot for i in hits], dtype=np.int64)
            expect = np.array([entries[i].csum for i in hits], dtype=np.int64)
            # Device pages are not hashed on the host, so reads into VRAM are not verified.
            verify = (self.config.verify or not leased) and pages.kind is MemKind.DRAM
            status, _ = self._io(Op.READ, pages.select(hits), slots, expect if verify else None)
            gone = self._recover_failed_reads(pages.select(hits), slots, expect if verify else None, status)
        finally:
            if leased:
                self.index.unpin(entries[i].slot for i in hits)
        badj = [j for j in range(len(hits)) if status[j] == _BADSUM or gone[j]]
        bad = [keys[hits[j]] for j in badj]
        if bad:
            log.warning("hicache-gds: %d page(s) failed their checksum in %s and were dropped", len(bad),
                        self.namespace)
            try:
                self.index.drop(bad, [int(slots[j]) for j in badj])
            except OSError as exc:
                log.warning("hicache-gds: %s", exc)
        for j, i in enumerate(hits):
            result[i] = bool(status[j] == _OK)
        nr = sum(result)
        self._stats.add(hits=len(hits), misses=len(keys) - len(hits), pages_read=nr, bytes_read=nr * self.page_bytes,
                        get_failed=len(hits) - nr - len(bad), checksum_mismatches=len(bad),
                        timeouts=int((status == _TIMEOUT).sum()))
        self._stats.batch(False, time.perf_counter_ns() - t0)
        return result

    def _recover_failed_reads(self, pages: Pages, slots: np.ndarray, expect: np.ndarray | None,
                              status: np.ndarray) -> np.ndarray:
        """After a READ, for pages that failed (not timed out): a slot past the end of its slab file
        (truncated under the store) re-extends the file and marks the page gone, to be dropped and
        written again; the others are re-read one request each, so a bad page cannot fail its whole
        request (engines without per-descriptor results fail every page of it)."""
        gone = np.zeros(len(status), dtype=bool)
        fail = np.flatnonzero(status == _FAIL)
        if not fail.size:
            return gone
        fidx, off = self.slabs.place(slots[fail])
        for i, path in enumerate(self.slabs.paths):
            try:
                size = os.stat(path).st_size
            except OSError:
                continue
            short = (fidx == i) & (off + np.uint64(self.slot_bytes) > np.uint64(size))
            if short.any():
                gone[fail[short]] = True
                log.error("hicache-gds: slab file %s is %d bytes, shorter than its %d bytes of slots (truncated "
                          "under the store?); extended it back, its pages past the old end are dropped",
                          path, size, self.slabs.file_bytes[i])
                os.truncate(path, self.slabs.file_bytes[i])
        retry = [int(j) for j in fail if not gone[j]]
        if len(retry) < len(status):  # pages of a request that others made fail: one request each
            for j in retry[:_MAX_SINGLE_RETRIES]:
                st, _ = self._io(Op.READ, pages.select([j]), slots[j:j + 1],
                                 None if expect is None else expect[j:j + 1])
                status[j] = st[0]
        return gone

    def _io(self, op: Op, pages: Pages, slots: np.ndarray, expect: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Move pages to/from slots. Returns (status per page, checksum per page for writes)."""
        n = len(pages)
        status = np.full(n, _FAIL, dtype=np.int8)
        sums = np.zeros(n, dtype=np.int64)
        if n == 0:
            return status, sums
        caps = self.engine.capabilities
        fidx, base = self.slabs.place(slots)
        fids = np.asarray(self._fids, dtype=np.uint64)[fidx]
        lens = pages.lens
        stage = pages.kind is MemKind.DRAM and (
            (caps.alignment > 1 and bool(((pages.addrs % np.uint64(caps.alignment)) | (lens % np.uint64(caps.alignment))).any()))
            or float(lens.mean()) < _MIN_DIRECT_SEGMENT and lens.shape[1] > 1)
        if not stage and pages.kind is MemKind.VRAM and caps.alignment > 1 and bool(
                ((pages.addrs % np.uint64(caps.alignment)) | (lens % np.uint64(caps.alignment))).any()):
            raise RegionError(f"{self.engine.name}: device pages must be {caps.alignment}-byte aligned")
        if stage and self._staging.held_bytes() > _MAX_HELD_STAGING:
            log.error("hicache-gds: %s of %d pages failed at once: staging buffers of requests that timed out "
                      "and never finished hold over %d bytes", op.value, n, _MAX_HELD_STAGING)
            return status, sums
        buf = self._staging.acquire(n * self.slot_bytes) if stage else None
        posted: list[tuple[Batch, Transfer | None]] = []
        try:
            if buf is not None:
                # One aligned descriptor per page: the whole slot, staged in host memory.
                src_addrs = np.uint64(buf.addr) + np.arange(n, dtype=np.uint64) * np.uint64(self.slot_bytes)
                if op is Op.WRITE:
                    self._gather(pages, src_addrs)
                mem_a = src_addrs.reshape(n, 1)
                mem_l = np.full((n, 1), self.slot_bytes, dtype=np.uint64)
                self._stats.add(staged_pages=n)
            else:
                mem_a, mem_l = pages.addrs, lens
            seg_off = np.cumsum(mem_l, axis=1) - mem_l
            file_off = base.reshape(n, 1) + seg_off
            mem_a, mem_l, file_off, per_page = self._cut(mem_a, mem_l, file_off, caps.max_desc_bytes)
            rows = np.concatenate([[0], np.cumsum(per_page)])
            mem = np.stack([mem_a, mem_l], axis=1)
            fil = np.stack([np.repeat(fids, per_page), file_off], axis=1)
            pipeline = max(_PIPELINE_MIN_BYTES, n * self.slot_bytes // _PIPELINE_PARTS)
            plan = list(split_batches(per_page, np.full(n, self.slot_bytes), caps,
                                      self.config.max_request_bytes or pipeline, row_bytes=mem_l))
            deadline = time.monotonic() + self.config.io_timeout
            for bt in plan:
                try:
                    t = self.engine.submit(op, MemKind.DRAM if buf is not None else pages.kind,
                                           mem[bt.row_start:bt.row_stop], fil[bt.row_start:bt.row_stop])
                except (TransferError, OSError, ValueError) as exc:
                    log.warning("hicache-gds: %s of %d pages not posted: %s", op.value, bt.stop - bt.start, exc)
                    t = None
                posted.append((bt, t))
            if op is Op.WRITE:  # overlaps the IO in flight
                sums[:] = self._page_sums(pages, buf, range(n))
            # A page is done once every request holding its rows is (a page may span several: more
            # rows than one request takes); its status is the worst of theirs: a timeout (the IO may
            # still land) over a failure over success. Reads are scattered and verified only then.
            left = np.zeros(n, dtype=np.int32)
            worst = np.zeros(n, dtype=np.int8)  # 0 ok, 1 failed, 2 timed out
            for bt, _ in posted:
                left[bt.start:bt.stop] += 1
            for bt, t in posted:
                a, b = bt.start, bt.stop
                got = np.zeros(b - a, dtype=np.int8)
                if t is None:
                    got[:] = 1
                else:
                    try:
                        t.wait(max(0.0, deadline - time.monotonic()))
                    except TransferTimeout as exc:
                        log.error("hicache-gds: %s", exc)
                        got[:] = 2
                    except TransferError as exc:
                        log.warning("hicache-gds: %s", exc)
                        got[:] = 1
                        ok_rows = getattr(t, "ok_mask", lambda: None)()
                        if ok_rows is not None:  # the engine knows which descriptors landed
                            for j in range(a, b):
                                r0, r1 = max(int(rows[j]), bt.row_start), min(int(rows[j + 1]), bt.row_stop)
                                if ok_rows[r0 - bt.row_start:r1 - bt.row_start].all():
                                    got[j - a] = 0
                    finally:
                        t.release()
                np.maximum(worst[a:b], got, out=worst[a:b])
                left[a:b] -= 1
                done = np.flatnonzero(left[a:b] == 0) + a
                if not len(done):
                    continue
                status[done] = np.where(worst[done] == 2, _TIMEOUT, np.where(worst[done] == 1, _FAIL, _OK))
                if op is Op.READ:
                    ok = done[worst[done] == 0]
                    for run in np.split(ok, np.flatnonzero(np.diff(ok) != 1) + 1) if len(ok) else ():
                        self._finish_read(pages, buf, expect, status, int(run[0]), int(run[-1]) + 1)
            return status, sums
        finally:
            if buf is not None:
                late = [t for _, t in posted if t is not None and not _finished(t)]
                if late:  # timed out: the IO may still land in it, so it is lent again only after
                    self._staging.hold(buf, late)
                else:
                    self._staging.release(buf)

    def _finish_read(self, pages: Pages, buf: HostBuffer | None, expect: np.ndarray | None,
                     status: np.ndarray, a: int, b: int) -> None:
        if buf is not None:
            self._scatter(pages, buf, a, b)
        if expect is not None:
            todo = [j for j in range(a, b) if expect[j]]
            for j, got in zip(todo, self._page_sums(pages, None, todo)):
                if got != expect[j]:
                    status[j] = _BADSUM

    @staticmethod
    def _cut(mem_a: np.ndarray, mem_l: np.ndarray, file_off: np.ndarray, limit: int):
        """Flatten (P, S) descriptors to rows, splitting any longer than `limit`; rows per page."""
        n = mem_a.shape[0]
        a, l, f, pieces = split_rows(mem_a.ravel(), mem_l.ravel(), file_off.ravel(), limit)
        return a, l, f, pieces.reshape(n, mem_a.shape[1]).sum(axis=1)

    def _gather(self, pages: Pages, dst: np.ndarray) -> None:
        for j in range(len(pages)):
            out = view(int(dst[j]), self.page_bytes)
            pos = 0
            for addr, n in zip(pages.addrs[j].tolist(), pages.lens[j].tolist()):
                out[pos:pos + n] = view(addr, n)
                pos += n

    def _scatter(self, pages: Pages, buf: HostBuffer, a: int, b: int) -> None:
        for j in range(a, b):
            src = view(buf.addr + j * self.slot_bytes, self.page_bytes)
            pos = 0
            for addr, n in zip(pages.addrs[j].tolist(), pages.lens[j].tolist()):
                view(addr, n)[:] = src[pos:pos + n]
                pos += n

    def _page_sums(self, pages: Pages, buf: HostBuffer | None, idx: Sequence[int]) -> list[int]:
        """`_page_sum` of each page in `idx`, on the hashing threads when there are several."""
        pool = _hasher() if len(idx) > 1 and (buf is not None or pages.kind is not MemKind.VRAM) else None
        if pool is None:
            return [self._page_sum(pages, buf, j) for j in idx]
        return list(pool.map(lambda j: self._page_sum(pages, buf, j), idx))

    def _page_sum(self, pages: Pages, buf: HostBuffer | None, j: int) -> int:
        if buf is not None:
            return _csum([(buf.addr + j * self.slot_bytes, self.page_bytes)])
        if pages.kind is MemKind.VRAM:
            return 0  # not hashed on the host; reads of such pages are not verified
        return _csum(zip(pages.addrs[j].tolist(), pages.lens[j].tolist()))

    # -- maintenance -----------------------------------------------------------------------------
    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove pages; True per key that was present."""
        self._check_open()
        keys = self._check_keys(keys)
        present = self.index.contains(keys)
        self.index.drop(k for k, p in zip(keys, present) if p)
        return present

    def clear(self) -> int:
        """Remove every page of this namespace; returns how many there were."""
        self._check_open()
        return self.index.clear()

    def stats(self) -> dict[str, Any]:
        """Counters, latency histograms, the engine and the path that actually ran.

        `index_recovery_s`: index open until lookups were served; `index_loaded_s`: until its
        in-memory map was in place and writes could proceed (None while it loads in the
        background); `staging_held_bytes`: staging kept from reuse by requests that timed out."""
        out = self._stats.snapshot()
        out.update(self.engine.info())
        out.update(engine_reason=self.engine_reason, namespace=self.namespace, dirs=list(self.dirs),
                   page_bytes=self.page_bytes, slot_bytes=self.slot_bytes, index_recovery_s=self.index.recovery_s,
                   index_loaded_s=self.index.loaded_s, staging_held_bytes=self._staging.held_bytes())
        out.update(self.index.stats())
        return out

    def close(self) -> None:
        """Flush the index and release files, buffers and the namespace lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._staging.close()
            for fid in self._fids:
                self.engine.close_file(fid)
            for fd in self._sync_fds:
                os.close(fd)
            self.engine.close()
        finally:
            self.index.close()
            if self._member is not None:
                self._member.close()

    def __enter__(self) -> "PageStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # noqa: BLE001
            pass


