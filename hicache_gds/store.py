"""`PageStore`: the one API adapters use. Keys in, pages (memory regions) in or out, per-page results.

    store = PageStore(page_bytes, {"model": "llama3-8b", "layout": "page_first", ...}, config={...})
    store.register_memory(buf_addr, buf_nbytes)          # once
    store.put(keys, Pages.contiguous(buf_addr, page_bytes, idx))   -> [True, ...]
    store.get(keys, pages) -> [True, False, ...]          # False: miss, failed IO or bad checksum
    store.exists(keys) / store.prefix(keys) / delete / clear / stats / close

Write order (the crash-safety contract, with `Index`): stage the pages (where they must be) ->
reserve free slots (evictions committed first) -> write page bytes and checksum them -> [fdatasync]
-> publish rows. A page is never visible before its bytes are on disk, and `put` returns True
only for published pages. Whatever fails between reserving and publishing, the put settles its
slots itself: back to the free list once their IO is over, kept reserved (lost) while a write may
still land. Reads lease their slots (`Index.lookup_pin`) until the bytes are in memory, and check
every page against its checksum (`hicache_gds.checksum`: one definition for host and device
pages) unless ``verify`` is off. `close` waits for the calls in flight (`gate.CallGate`).

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
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from . import checksum, ondisk
from .capacity import Sizing, gib, size_namespace
from .config import Config
from .engines.base import Batch, MemKind, Op, Transfer, TransferEngine, split_batches, split_rows
from .engines.select import choose_engine
from .errors import ConfigError, RegionError, StoreClosedError, TransferError, TransferTimeout
from .gate import CallGate, gated
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
_ORPHANED: list[Any] = []  # staging and memberships held at close by requests that never finished: kept


_hash_pool: ThreadPoolExecutor | None = None
_hash_pool_lock = threading.Lock()


def _hash_threads() -> int:
    return min(8, os.cpu_count() or 1)


def _hasher() -> ThreadPoolExecutor | None:
    """Threads that checksum a request's pages in parallel (numpy releases the GIL), or None on one core.

    Requests of a batch are all posted at once and the disk serves them interleaved, so most of
    them complete near the end of the batch: hashing them one by one on the caller's thread was
    exposed, not overlapped (about 9% of get throughput on the H100 VM with verification on)."""
    global _hash_pool
    workers = _hash_threads()
    if workers < 2:
        return None
    with _hash_pool_lock:
        if _hash_pool is None:
            _hash_pool = ThreadPoolExecutor(workers, thread_name_prefix="hicache-gds-checksum")
        return _hash_pool


def _forget_hasher_in_child() -> None:
    # A forked child has none of the parent's threads: a copied pool would queue work forever.
    global _hash_pool, _hash_pool_lock
    _hash_pool, _hash_pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_hasher_in_child)


def _recorded_dirs(dirs: Sequence[str]) -> list[str] | None:
    """The directory order a format-1 namespace's namespace.json names (where it has one)."""
    for d in dirs:
        try:
            fd = os.open(os.path.join(d, META_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            with os.fdopen(fd) as f:
                got = json.load(f).get("dirs")
        except (OSError, ValueError, AttributeError):
            return None
        return got if isinstance(got, list) and all(isinstance(x, str) for x in got) else None
    return None


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
    """The request can no longer move bytes: it completed or failed (a timed-out one is polled again).
    An engine that cannot tell (its poll raised something else) is taken at its worst: still running."""
    try:
        return t.done()
    except TransferError:
        return True
    except Exception:  # noqa: BLE001
        return False


@dataclass
class _Prepared:
    """A request's memory side (`PageStore._prepare`): descriptors as (P, S) arrays, the staging
    lent to it, and what was posted (the `Batch`, transfer or None) once it runs."""

    op: Op
    pages: Pages
    buf: HostBuffer | None
    mem_a: np.ndarray
    mem_l: np.ndarray
    transfers: list[tuple[Batch, Transfer | None]] = field(default_factory=list)
    posted: bool = False


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
        self._member: Membership | None = None
        self._gate = CallGate(f"page store {self.namespace}")
        self._lost_io: list[tuple[list[int], list[Transfer]]] = []  # slots whose write may still land, and its IO
        self._lost_lock = threading.Lock()
        own_engine = engine is None
        try:
            # Which directory is which is recorded with the namespace (`ondisk`): a reordered
            # GDS_PATH maps slots as they were written; a missing directory is refused before
            # anything is created.
            ondisk.stripe_order([os.path.join(r, self.namespace) for r in roots], partial="none")
            given = [private_dir(r, self.namespace) for r in roots]
            self.dirs, note = ondisk.ensure_stripe(given, setup_lock, prefer=_recorded_dirs(given))
            if note:
                log.info("hicache-gds store %s: %s", self.namespace, note)
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
            self._gate.closed = True
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
        self._device_sums = checksum.device_checksums  # tests put a host stand-in here (no GPU)
        log.info("hicache-gds store %s: capacity %s (%d slots of %d bytes) in %s, %s; engine %s",
                 self.namespace, gib(self.sizing.capacity), nslots, self.slot_bytes, ",".join(self.dirs),
                 self.sizing.how, self.engine_reason)

    # -- open ------------------------------------------------------------------------------------
    def _write_meta(self) -> None:
        path = os.path.join(self.dirs[0], META_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"identity": self.identity, "slot_bytes": self.slot_bytes, "dirs": self.dirs,
                       ondisk.FORMAT_KEY: ondisk.FORMAT, "checksum": checksum.NAME}, f, indent=1)
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
        if self._gate.closed:
            raise StoreClosedError(f"page store {self.namespace} is closed")

    @property
    def _closed(self) -> bool:
        return self._gate.closed

    # -- queries ---------------------------------------------------------------------------------
    @gated
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is the page present."""
        return self.index.contains(self._check_keys(keys))

    @gated
    def prefix(self, keys: Sequence[str]) -> int:
        """Length of the longest run of present keys from the start."""
        return self.index.prefix_len(self._check_keys(keys))

    @gated
    def register_memory(self, addr: int, nbytes: int, kind: MemKind = MemKind.DRAM) -> None:
        """Register a buffer that pages will point into (once, before put/get)."""
        self.engine.register_memory(addr, nbytes, MemKind(kind))
        if MemKind(kind) is MemKind.VRAM and self._device_sums is checksum.device_checksums:
            checksum.warm_up(checksum.device_of(addr))  # the checksum kernel compiles now, not in a request

    @property
    def file_ids(self) -> list[int]:
        """Engine file ids of the slab files, in `slabs.paths` order (for reads of page ranges)."""
        return list(self._fids)

    @gated
    def deregister_memory(self, addr: int) -> None:
        """Forget a buffer registered with `register_memory` (before freeing it)."""
        self.engine.deregister_memory(addr)

    def register_tensor(self, tensor: Any) -> None:
        self.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                             MemKind.VRAM if tensor.is_cuda else MemKind.DRAM)

    # -- put / get -------------------------------------------------------------------------------
    @gated
    def put(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Write pages; True per page once it is durable and visible. Present keys are not rewritten.

        Device pages are read as they are when `put` is called (the caller has finished the work
        that wrote them, as the engine's DMA follows no CUDA stream; `put` also waits for this
        thread's current stream). A page is False when anything between reserving its slot and
        publishing it fails (IO, fdatasync, checksum, index): its slot goes back to the free list
        once its IO is over, and stays reserved while that IO may still land."""
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
        # Staging (registered with the engine, filled) before any slot is taken: a put that fails
        # there evicts nothing.
        try:
            prep = self._prepare(Op.WRITE, pages.select(todo))
        except (TransferError, OSError) as exc:
            log.warning("hicache-gds: %d pages not written: %s", len(todo), exc)
            prep = None
        slots: list[int] = []
        status = np.zeros(0, dtype=np.int8)
        ok_items: list[tuple[str, int, int, int]] = []
        published: list[bool] = []
        handed: set[int] = set()  # slots publish settled: published, or freed as a duplicate's
        if prep is not None and todo:
            io_over = False
            try:
                self._reap_lost()
                try:
                    slots = self.index.reserve(len(todo), evict=self.config.evict)
                except OSError as exc:
                    log.warning("hicache-gds: no slots for %d pages: %s", len(todo), exc)
                status, sums = self._run(prep, np.asarray(slots, dtype=np.int64), None)
                io_over = True
                ok = status == _OK
                if self.config.sync and ok.any():
                    try:
                        for fd in self._sync_fds:
                            os.fdatasync(fd)
                    except OSError as exc:  # written, but not known to be durable: not published
                        log.error("hicache-gds: fdatasync of the slab files failed (%s); %d pages not published",
                                  exc, int(ok.sum()))
                        status[ok] = _FAIL
                ok_items = [(keys[todo[j]], slots[j], self.page_bytes, int(sums[j])) for j in range(len(slots))
                            if status[j] == _OK]
                try:
                    published = self.index.publish(ok_items)
                    handed = {it[1] for it in ok_items}
                except OSError as exc:
                    log.warning("hicache-gds: %d written pages not published: %s", len(ok_items), exc)
                    published = [False] * len(ok_items)
                    status[status == _OK] = _FAIL
            finally:
                self._settle(slots, status, handed, prep, io_over)
        elif prep is not None:
            self._finish(prep)
        # Not published by this call (a duplicate, no slot, or a failed write) but present now: a
        # concurrent put of the same key -- in this process or another -- stored it. True, as for
        # a present key; an index write failure leaves it False.
        late = [it[0] for it, pub in zip(ok_items, published) if not pub] + [keys[i] for i in todo[len(slots):]]
        now = dict(zip(late, self.index.contains(late))) if late else {}
        for (key, _, _, _), pub in zip(ok_items, published):
            result[first[key]] = pub or now.get(key, False)
        for i in todo[len(slots):]:
            result[i] = now[keys[i]]
        for i, k in enumerate(keys):
            if i != first.get(k, i):
                result[i] = result[first[k]]
        nw = int(sum(published))
        self._stats.add(pages_written=nw, bytes_written=nw * self.page_bytes,
                        put_skipped_present=sum(present), put_failed=len(keys) - sum(result),
                        timeouts=int((status == _TIMEOUT).sum()))
        self._stats.batch(True, time.perf_counter_ns() - t0)
        return result

    def _settle(self, slots: list[int], status: np.ndarray, handed: set[int], prep: _Prepared,
                io_over: bool) -> None:
        """Give back what a put reserved and publish did not settle (`handed`: published, or freed
        by publish as a duplicate's, and maybe reserved again since by another call of this
        process): slots whose IO is over go back to the free list; slots whose write may still
        land (timed out, or the put was cut short while its IO ran) stay reserved -- lost, reaped
        once that IO is seen to finish (`_reap_lost`)."""
        late = self._finish(prep)
        if not slots:
            return
        timed_out = {s for j, s in enumerate(slots) if j < len(status) and status[j] == _TIMEOUT}
        if not io_over and prep.posted:  # cut short while writing: which writes are over is not known
            lost = [s for s in slots if s not in handed]
            back: list[int] = []
        else:
            lost = [s for s in slots if s in timed_out]
            back = [s for s in slots if s not in handed and s not in timed_out]
        self.index.release(back)
        if lost:
            self.index.lose(lost)
            with self._lost_lock:
                self._lost_io.append((lost, late))

    def _reap_lost(self) -> None:
        """Release lost slots whose late writes have finished since."""
        with self._lost_lock:
            if not self._lost_io:
                return
            over = [e for e in self._lost_io if all(_finished(t) for t in e[1])]
            self._lost_io = [e for e in self._lost_io if e not in over]
        if over:
            slots = [s for e in over for s in e[0]]
            log.info("hicache-gds: %d slot(s) of timed-out writes are free again (their IO finished)", len(slots))
            self.index.release(slots)

    @gated
    def get(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Read pages into memory; False per page that is missing, failed, or failed its checksum.

        Device pages are verified on the GPU (one checksum definition for host and device pages,
        `hicache_gds.checksum`), once their bytes are in device memory; a page that fails is a
        miss and is dropped, and its destination holds bytes that must not be used."""
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
            found = self.index.peek(keys)
            entries = [e if e is not None and e.csum else None for e in (found.get(k) for k in keys)]
        hits = [i for i, e in enumerate(entries) if e is not None]
        result = [False] * len(keys)
        try:
            slots = np.array([entries[i].slot for i in hits], dtype=np.int64)
            expect = np.array([entries[i].csum for i in hits], dtype=np.int64)
            verify = self.config.verify or not leased
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
        prep = self._prepare(op, pages)
        if prep is None:
            return np.full(len(pages), _FAIL, dtype=np.int8), np.zeros(len(pages), dtype=np.int64)
        try:
            return self._run(prep, slots, expect)
        finally:
            self._finish(prep)

    def _prepare(self, op: Op, pages: Pages) -> _Prepared | None:
        """The memory side of a request, before any slot is chosen: staging lent (and, for a write,
        filled) where pages must be staged, device writes waited for. Raises (an engine that cannot
        register staging, a misaligned device page) before any IO; None when staging is held by
        timed-out requests beyond `_MAX_HELD_STAGING` (every page fails)."""
        n = len(pages)
        caps = self.engine.capabilities
        lens = pages.lens
        stage = n > 0 and pages.kind is MemKind.DRAM and (
            (caps.alignment > 1 and bool(((pages.addrs % np.uint64(caps.alignment)) | (lens % np.uint64(caps.alignment))).any()))
            or float(lens.mean()) < _MIN_DIRECT_SEGMENT and lens.shape[1] > 1)
        if not stage and pages.kind is MemKind.VRAM and caps.alignment > 1 and bool(
                ((pages.addrs % np.uint64(caps.alignment)) | (lens % np.uint64(caps.alignment))).any()):
            raise RegionError(f"{self.engine.name}: device pages must be {caps.alignment}-byte aligned")
        if stage and self._staging.held_bytes() > _MAX_HELD_STAGING:
            log.error("hicache-gds: %s of %d pages failed at once: staging buffers of requests that timed out "
                      "and never finished hold over %d bytes", op.value, n, _MAX_HELD_STAGING)
            return None
        if n and pages.kind is MemKind.VRAM and op is Op.WRITE and self._device_sums is checksum.device_checksums:
            checksum.wait_for_current_stream(checksum.device_of(int(pages.addrs[0, 0])))
        buf = self._staging.acquire(n * self.slot_bytes) if stage else None
        if buf is None:
            return _Prepared(op, pages, None, pages.addrs, lens)
        try:
            # One aligned descriptor per page: the whole slot, staged in host memory.
            src_addrs = np.uint64(buf.addr) + np.arange(n, dtype=np.uint64) * np.uint64(self.slot_bytes)
            if op is Op.WRITE:
                self._gather(pages, src_addrs)
        except BaseException:
            self._staging.release(buf)
            raise
        self._stats.add(staged_pages=n)
        return _Prepared(op, pages, buf, src_addrs.reshape(n, 1), np.full((n, 1), self.slot_bytes, dtype=np.uint64))

    def _finish(self, prep: _Prepared) -> list[Transfer]:
        """Return the request's staging (held instead while IO that timed out may still land in it);
        returns that IO."""
        late = [t for _, t in prep.transfers if t is not None and not _finished(t)]
        buf, prep.buf = prep.buf, None
        if buf is not None:
            if late:
                self._staging.hold(buf, late)
            else:
                self._staging.release(buf)
        return late

    def _run(self, prep: _Prepared, slots: np.ndarray, expect: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Post the first len(slots) pages of `prep` to/from `slots`, wait for them (never past
        ``io_timeout``), checksum them; (status, checksums of written pages). Once anything is posted
        nothing raises: a failure is a page's status (`_TIMEOUT` where the IO may still land)."""
        op, pages = prep.op, prep.pages
        n = len(slots)
        status = np.full(n, _FAIL, dtype=np.int8)
        sums = np.zeros(n, dtype=np.int64)
        if n == 0:
            return status, sums
        if n < len(pages):
            pages = pages.select(np.arange(n))
        caps = self.engine.capabilities
        fidx, base = self.slabs.place(slots)
        fids = np.asarray(self._fids, dtype=np.uint64)[fidx]
        buf = prep.buf
        mem_a, mem_l = prep.mem_a[:n], prep.mem_l[:n]
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
        kind = MemKind.DRAM if buf is not None else pages.kind
        for bt in plan:
            try:
                t = self.engine.submit(op, kind, mem[bt.row_start:bt.row_stop], fil[bt.row_start:bt.row_stop])
            except (TransferError, OSError, ValueError) as exc:
                log.warning("hicache-gds: %s of %d pages not posted: %s", op.value, bt.stop - bt.start, exc)
                t = None
            prep.transfers.append((bt, t))
            prep.posted = prep.posted or t is not None
        hashed = True
        if op is Op.WRITE:  # overlaps the IO in flight
            try:
                sums[:] = self._page_sums(pages, buf, range(n))
            except Exception as exc:  # noqa: BLE001 -- no checksum, no page: the writes still finish below
                log.error("hicache-gds: checksums of %d written pages failed (%s: %s); not published", n,
                          type(exc).__name__, exc)
                hashed = False
        # A page is done once every request holding its rows is (a page may span several: more rows
        # than one request takes); its status is the worst of theirs: a timeout (the IO may still
        # land) over a failure over success. Reads are scattered and verified (`_finish_read`: the
        # one checksum for host and device pages) only then, after the page's last request.
        left = np.zeros(n, dtype=np.int32)
        worst = np.zeros(n, dtype=np.int8)  # 0 ok, 1 failed, 2 timed out
        for bt, _ in prep.transfers:
            left[bt.start:bt.stop] += 1
        for bt, t in prep.transfers:
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
                except Exception as exc:  # noqa: BLE001 -- the engine's state is unknown: the IO may still land
                    log.error("hicache-gds: waiting for %s of %d pages failed: %s: %s", op.value, b - a,
                              type(exc).__name__, exc)
                    got[:] = 2
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
        if not hashed:
            status[status == _OK] = _FAIL
        return status, sums

    def _finish_read(self, pages: Pages, buf: HostBuffer | None, expect: np.ndarray | None,
                     status: np.ndarray, a: int, b: int) -> None:
        """Scatter staged pages a..b and check their checksums (`_BADSUM` per mismatch); a failure
        of either fails the pages, without judging them."""
        try:
            if buf is not None:
                self._scatter(pages, buf, a, b)
            if expect is not None:
                todo = [j for j in range(a, b) if expect[j]]
                for j, got in zip(todo, self._page_sums(pages, None, todo)):
                    if got != expect[j]:
                        status[j] = _BADSUM
        except Exception as exc:  # noqa: BLE001 -- such pages are failed reads, not bad pages
            log.error("hicache-gds: finishing a read of %d pages failed: %s: %s", b - a, type(exc).__name__, exc)
            status[a:b][status[a:b] == _OK] = _FAIL

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

    def page_checksums(self, pages: Pages) -> np.ndarray:
        """The checksum each page would be stored with (int64 per page; `hicache_gds.checksum`): for
        GPU-direct paths that move a store's pages themselves and check them where they land (pages
        shorter than `page_bytes` count as zero-padded). Device pages are summed on their GPU, after
        the work queued on this thread's stream of it."""
        if len(pages) and int(pages.page_nbytes.max()) > self.page_bytes:
            raise RegionError(f"pages of {int(pages.page_nbytes.max())} bytes exceed this store's {self.page_bytes}")
        if pages.kind is MemKind.VRAM:
            return np.asarray(self._device_sums(pages.addrs, pages.lens, self.page_bytes), dtype=np.int64)
        return np.array([checksum.host_checksum(zip(pages.addrs[j].tolist(), pages.lens[j].tolist()),
                                                self.page_bytes) for j in range(len(pages))], dtype=np.int64)

    def _page_sums(self, pages: Pages, buf: HostBuffer | None, idx: Sequence[int]) -> list[int]:
        """The checksum (`hicache_gds.checksum`) of each page in `idx`: device pages on their GPU, all
        in one launch; host pages on the hashing threads when there are several."""
        idx = list(idx)
        if not idx:
            return []
        if buf is None and pages.kind is MemKind.VRAM:
            sel = pages.select(idx)
            return self._device_sums(sel.addrs, sel.lens, self.page_bytes).tolist()
        if buf is not None:
            segs = [[(buf.addr + j * self.slot_bytes, self.page_bytes)] for j in idx]
        else:
            segs = [list(zip(pages.addrs[j].tolist(), pages.lens[j].tolist())) for j in idx]
        pool = _hasher() if len(idx) > 1 else None
        if pool is None:
            return checksum.host_checksums(segs, self.page_bytes)
        # A few pages per task: the per-page fold is done for a whole group at once.
        step = -(-len(segs) // (4 * _hash_threads()))
        parts = pool.map(lambda a: checksum.host_checksums(segs[a:a + step], self.page_bytes),
                         range(0, len(segs), step))
        return [c for part in parts for c in part]

    # -- maintenance -----------------------------------------------------------------------------
    @gated
    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove pages; True per key that was present."""
        keys = self._check_keys(keys)
        present = self.index.contains(keys)
        self.index.drop(k for k, p in zip(keys, present) if p)
        return present

    @gated
    def clear(self) -> int:
        """Remove every page of this namespace; returns how many there were."""
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
        """Refuse new calls (`StoreClosedError`), wait for the calls in flight (at most
        ``io_timeout``), then release files, buffers, the index and the namespace's lock. Idempotent.

        Calls still in flight after that keep what they use; the last of them closes the store as
        it returns. Slots whose writes timed out and are still in flight stay reserved, and this
        process keeps its place in the namespace (so no other process reclaims them) until it exits."""
        gate = getattr(self, "_gate", None)
        if gate is None:
            return
        busy = gate.close(self.config.io_timeout, self._teardown)
        if busy:
            log.error("hicache-gds: closing %s: %d call(s) still in flight after %.1f s (io_timeout); the store "
                      "closes when the last of them returns", self.namespace, busy, self.config.io_timeout)

    def _teardown(self) -> None:
        keep: list[int] = []
        try:
            try:
                self._reap_lost()
            except Exception as exc:  # noqa: BLE001 -- closing matters more
                log.warning("hicache-gds: %s", exc)
            with self._lost_lock:
                keep = [s for slots, _ in self._lost_io for s in slots]
            self._staging.close()
            for fid in self._fids:
                self.engine.close_file(fid)
            for fd in self._sync_fds:
                os.close(fd)
            self.engine.close()
        finally:
            if keep:
                self.index.close(keep=keep)
            else:
                self.index.close()
            if self._member is not None:
                if keep:  # the kernel drops the lock at exit, once the IO is over: reclaim is safe then
                    log.warning("hicache-gds: %d slot(s) of %s written by requests that never finished stay "
                                "reserved until this process exits", len(keep), self.namespace)
                    _ORPHANED.append(self._member)
                else:
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


