"""`PageMover`: moving pages between memory and slab slots, the part every store shares.

A request is prepared (`_prepare`: staging lent and filled where pages must be staged), posted in
requests within the engine's limits (`_run`: descriptors cut to ``max_desc_bytes``, batches of
about an eighth of the call so checksums of one overlap the IO of the next), waited for (never
past ``io_timeout``) and checksummed (`hicache_gds.pagesum`: xxh3 where the bytes are summed in
host memory, hgc1 on the GPU; a read checks the kind its page records). Once anything is posted
nothing raises: a failure is a page's status (`TIMEOUT` where its IO may still land, and the
staging it used is held until it finishes).

`PageStore` and `PageReader` are page movers over their own index. `posting`: `post_rows`, the
same posting for GPU-direct paths that build their own descriptors (the SGLang linker, through
`Lease.post`), and the read window; `hashing`: the host threads that checksum pages.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

from .. import checksum
from ..config import Config
from ..engines.base import MemKind, Op, Transfer, TransferEngine, split_batches, split_rows
from ..errors import RegionError, StoreClosedError, TransferError, TransferTimeout
from ..gate import CallGate, gated
from ..gil import shorten_switch_interval
from ..layout import Pages
from ..memory import HostBuffer
from ..stats import StoreStats
from . import hashing, posting
from .posting import post_rows
from .protocol import Lease
from .staging import MAX_HELD_STAGING, Prepared, Staging, finished, gather, scatter

__all__ = ["PageMover", "MAX_KEY_BYTES", "OK", "FAIL", "TIMEOUT", "BADSUM", "MAX_SINGLE_RETRIES", "post_rows"]

log = logging.getLogger("hicache_gds.store")
MAX_KEY_BYTES = 1024
# A batch is cut into about this many requests, posted ahead of the one waited for, so checksums
# of request k overlap the IO of the later ones and only the last one's checksum is exposed.
_PIPELINE_PARTS = 8
_PIPELINE_MIN_BYTES = 8 << 20
_MIN_DIRECT_SEGMENT = 128 << 10  # smaller segments are gathered into one aligned IO per page
OK, FAIL, TIMEOUT, BADSUM = 1, 0, 2, 3  # a page's status after a request
MAX_SINGLE_RETRIES = 64  # failed pages of a read re-read one request each, at most


def _ready(t: Transfer | None) -> bool:
    """Whether waiting for request `t` (None: refused) returns at once (its failure counts)."""
    try:
        return t is None or t.done()
    except Exception:  # noqa: BLE001 -- raised again by its wait, where it is handled
        return True


class PageMover(posting.ReadPacing):
    """What `PageStore` and `PageReader` share: key and page checks, memory registration, the
    request path (module docstring), page checksums, and close. Subclasses call `__init__`, set
    `slabs` and their index, and `_attach` an engine."""

    read_only = False

    def __init__(self, config: Config, page_bytes: int, identity: Mapping[str, Any], namespace: str,
                 slot_bytes: int, what: str) -> None:
        self.config = config
        self.page_bytes = page_bytes
        self.identity, self.namespace, self.slot_bytes = dict(identity), namespace, slot_bytes
        self._gate = CallGate(f"{what} {namespace}")
        self._lost_io: list[tuple[list[int], list[Transfer]]] = []  # slots whose write may still land, and its IO
        self._lost_lock = threading.Lock()
        self._fids: list[int] = []
        self._sync_fds: list[int] = []
        self._stats = StoreStats()
        self._device_sums = checksum.device_checksums  # tests put a host stand-in here (no GPU)
        self._post_share: float | None = None  # of recent reads' time, spent posting (`posting`)
        self._windowed_reads = 0  # since the last read posted all at once
        self._devices: tuple[Any, ...] | None = None

    def _attach(self, engine: TransferEngine, reason: str) -> None:
        self.engine, self.engine_reason = engine, reason
        self._devices = None  # `_device_key` names the engine
        shorten_switch_interval(self.config.switch_interval)
        self._staging = Staging(engine)

    def _stats_base(self) -> dict[str, Any]:
        """What `PageStore.stats` and `PageReader.stats` both report first: the counters and
        histograms, the engine that ran and why, how reads post, and the namespace's shape."""
        out = self._stats.snapshot()
        out.update(self.engine.info())
        out.update(self._posting())
        out.update(engine_reason=self.engine_reason, namespace=self.namespace, dirs=list(self.dirs),
                   page_bytes=self.page_bytes, slot_bytes=self.slot_bytes, checksum_engine=checksum.host_engine())
        return out

    @property
    def capabilities(self) -> Any:
        """The engine's declared capabilities (`engines.base.Capabilities`): alignment, limits, memory kinds."""
        return self.engine.capabilities

    def _lease_of(self, keys: list[str], entries: Sequence[Any], present: np.ndarray, fids: Sequence[int], *,
                  protected: bool, unpin: Any, drop: Any) -> Lease:
        """The `Lease` of `keys` from their index `entries` (None: absent) and the rows the caller
        counts as `present`: file ids and offsets from the slot placement, sizes and checksums;
        absent rows hold zeros. `fids`: the open slab files, one per directory."""
        slots = np.array([e.slot if e is not None else 0 for e in entries], dtype=np.int64)
        fidx, base = self.slabs.place(slots)
        fid = np.asarray(fids, dtype=np.uint64)[fidx]
        fid[~present] = 0
        base = np.where(present, base, np.uint64(0)).astype(np.uint64)
        nbytes = np.array([e.nbytes if e is not None else 0 for e in entries], dtype=np.int64)
        sums = np.array([e.csum if e is not None else 0 for e in entries], dtype=np.int64)
        return Lease(keys, present, fid, base, nbytes, sums, slots=slots, protected=protected,
                     post=lambda op, kind, mem, fil: post_rows(self.engine, self.config, op, kind, mem, fil),
                     unpin=unpin, drop=drop)

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

    # -- memory ----------------------------------------------------------------------------------

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

    # -- the request path ------------------------------------------------------------------------
    def _io(self, op: Op, pages: Pages, slots: np.ndarray, expect: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Move pages to/from slots. Returns (status per page, checksum per page for writes)."""
        prep = self._prepare(op, pages)
        if prep is None:
            return np.full(len(pages), FAIL, dtype=np.int8), np.zeros(len(pages), dtype=np.int64)
        try:
            return self._run(prep, slots, expect)
        finally:
            self._finish(prep)

    def _prepare(self, op: Op, pages: Pages) -> Prepared | None:
        """The memory side of a request, before any slot is chosen: staging lent (and, for a write,
        filled) where pages must be staged, device writes waited for. Raises (an engine that cannot
        register staging, a misaligned device page) before any IO; None when staging is held by
        timed-out requests beyond `MAX_HELD_STAGING` (every page fails)."""
        n = len(pages)
        caps = self.engine.capabilities
        lens = pages.lens
        stage = n > 0 and pages.kind is MemKind.DRAM and (
            (caps.alignment > 1 and bool(((pages.addrs % np.uint64(caps.alignment)) | (lens % np.uint64(caps.alignment))).any()))
            or float(lens.mean()) < _MIN_DIRECT_SEGMENT and lens.shape[1] > 1)
        if not stage and pages.kind is MemKind.VRAM and caps.alignment > 1 and bool(
                ((pages.addrs % np.uint64(caps.alignment)) | (lens % np.uint64(caps.alignment))).any()):
            raise RegionError(f"{self.engine.name}: device pages must be {caps.alignment}-byte aligned")
        if stage and self._staging.held_bytes() > MAX_HELD_STAGING:
            log.error("hicache-gds: %s of %d pages failed at once: staging buffers of requests that timed out "
                      "and never finished hold over %d bytes", op.value, n, MAX_HELD_STAGING)
            return None
        if n and pages.kind is MemKind.VRAM and op is Op.WRITE and self._device_sums is checksum.device_checksums:
            checksum.wait_for_current_stream(checksum.device_of(int(pages.addrs[0, 0])))
        buf = self._staging.acquire(n * self.slot_bytes) if stage else None
        if buf is None:
            return Prepared(op, pages, None, pages.addrs, lens)
        try:
            # One aligned descriptor per page: the whole slot, staged in host memory.
            src_addrs = np.uint64(buf.addr) + np.arange(n, dtype=np.uint64) * np.uint64(self.slot_bytes)
            if op is Op.WRITE:
                self._gather(pages, src_addrs)
        except BaseException:
            self._staging.release(buf)
            raise
        self._stats.add(staged_pages=n)
        return Prepared(op, pages, buf, src_addrs.reshape(n, 1), np.full((n, 1), self.slot_bytes, dtype=np.uint64))

    def _finish(self, prep: Prepared) -> list[Transfer]:
        """Return the request's staging (held instead while IO that timed out may still land in it);
        returns that IO."""
        late = [t for _, t in prep.transfers if t is not None and not finished(t)]
        buf, prep.buf = prep.buf, None
        if buf is not None:
            if late:
                self._staging.hold(buf, late)
            else:
                self._staging.release(buf)
        return late

    def _run(self, prep: Prepared, slots: np.ndarray, expect: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Post the first len(slots) pages of `prep` to/from `slots`, wait for them (never past
        ``io_timeout``), checksum them; (status, checksums of written pages). Once anything is posted
        nothing raises: a failure is a page's status (`TIMEOUT` where the IO may still land)."""
        op, pages = prep.op, prep.pages
        n = len(slots)
        status = np.full(n, FAIL, dtype=np.int8)
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
        # Host-side checksums and scatters run on the verifier threads, beside the IO and the
        # caller's posting (device pages are summed on their GPU, on the caller's stream).
        beside = pages.kind is MemKind.DRAM or (op is Op.WRITE and buf is not None)
        finishing = op is Op.READ and (expect is not None or buf is not None)  # pages to scatter or check
        window = len(plan)
        if finishing and beside and self._share() > posting.BLOCKING_POST_SHARE:
            self._windowed_reads += 1
            if self._windowed_reads % posting.WINDOW_PROBE_EVERY:
                window = max(posting.READ_WINDOW_MIN,
                             -(-posting.READ_WINDOW_BYTES * len(plan) // max(1, n * self.slot_bytes)))
        posted_ns = 0
        t_run = time.perf_counter_ns()

        def post(bt: Any) -> None:
            nonlocal posted_ns
            tp = time.perf_counter_ns()
            try:
                t = self.engine.submit(op, kind, mem[bt.row_start:bt.row_stop], fil[bt.row_start:bt.row_stop])
            except (TransferError, OSError, ValueError) as exc:
                log.warning("hicache-gds: %s of %d pages not posted: %s", op.value, bt.stop - bt.start, exc)
                t = None
            posted_ns += time.perf_counter_ns() - tp
            prep.transfers.append((bt, t))
            prep.posted = prep.posted or t is not None

        hashed = True
        sums_job = None
        if op is Op.WRITE and beside:  # summed while the requests are posted and written
            sums_job = hashing.verifier().submit(self._page_sums, pages, buf, range(n))
        # A page is done once every request holding its rows is (a page may span several: more rows
        # than one request takes); its status is the worst of theirs: a timeout (the IO may still
        # land) over a failure over success. Reads are scattered and verified (`_finish_read`: the
        # one checksum for host and device pages) only then, after the page's last request: for
        # host pages on the verifier threads while the caller waits for (and posts) the next.
        left = np.zeros(n, dtype=np.int32)
        worst = np.zeros(n, dtype=np.int8)  # 0 ok, 1 failed, 2 timed out
        waited = verified = 0  # ns: where a read's time goes (`read_wait_ns`, `read_verify_ns`)
        verifying: list[Any] = []
        for bt in plan:
            left[bt.start:bt.stop] += 1

        def settle(i: int) -> np.ndarray:
            nonlocal waited, verified
            bt = plan[i]
            a, b = bt.start, bt.stop
            got = np.zeros(b - a, dtype=np.int8)
            if i >= len(prep.transfers):
                got[:] = 2  # left unposted: the get's deadline passed (no retry, as for a timeout)
            elif (t := prep.transfers[i][1]) is None:
                got[:] = 1  # the engine refused it
            else:
                tw = time.perf_counter_ns()
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
                    waited += time.perf_counter_ns() - tw
            np.maximum(worst[a:b], got, out=worst[a:b])
            left[a:b] -= 1
            done = np.flatnonzero(left[a:b] == 0) + a
            if len(done):
                status[done] = np.where(worst[done] == 2, TIMEOUT, np.where(worst[done] == 1, FAIL, OK))
            if finishing and len(done):
                ok = done[worst[done] == 0]
                runs = [(int(r[0]), int(r[-1]) + 1) for r in np.split(ok, np.flatnonzero(np.diff(ok) != 1) + 1)] \
                    if len(ok) else []
                if beside:  # disjoint page ranges: each job writes only its own pages' status
                    verifying.extend(hashing.verifier().submit(self._finish_read, pages, buf, expect, status, ra, rb)
                                     for ra, rb in runs)
                else:
                    tv = time.perf_counter_ns()
                    for ra, rb in runs:
                        self._finish_read(pages, buf, expect, status, ra, rb)
                    verified += time.perf_counter_ns() - tv
            return got

        # Reads posted all at once: requests already complete are settled between posts (which block
        # once the device queue is full), so their pages are verified beside the IO, still in cache.
        early = finishing and beside and window == len(plan)
        settled = 0
        for bt in plan[:window]:
            post(bt)
            while early and settled < len(prep.transfers) and _ready(prep.transfers[settled][1]):
                settle(settled)
                settled += 1
        if op is Op.WRITE and sums_job is None:  # overlaps the IO in flight
            try:
                sums[:] = self._page_sums(pages, buf, range(n))
            except Exception as exc:  # noqa: BLE001 -- no checksum, no page: the writes still finish below
                log.error("hicache-gds: checksums of %d written pages failed (%s: %s); not published", n,
                          type(exc).__name__, exc)
                hashed = False
        for i in range(settled, len(plan)):
            got = settle(i)
            # The next request of the window, once this one is over and its pages are being
            # verified: where the device queue is short, posting waits for earlier IO to finish.
            if window + i < len(plan) and time.monotonic() < deadline and not (got == 2).any():
                post(plan[window + i])
        if verifying:
            tv = time.perf_counter_ns()
            for job in verifying:
                job.result()  # `_finish_read` turns its failures into the pages' status
            verified += time.perf_counter_ns() - tv
        if sums_job is not None:
            try:
                sums[:] = sums_job.result()
            except Exception as exc:  # noqa: BLE001 -- no checksum, no page
                log.error("hicache-gds: checksums of %d written pages failed (%s: %s); not published", n,
                          type(exc).__name__, exc)
                hashed = False
        if not hashed:
            status[status == OK] = FAIL
        if op is Op.READ:
            self._stats.add(read_wait_ns=waited, read_verify_ns=verified, read_post_ns=posted_ns)
            if 1 < len(plan) == window:  # posted all at once: what posting costs on this device
                self._note_share(posted_ns / max(1, time.perf_counter_ns() - t_run))
        return status, sums

    def _finish_read(self, pages: Pages, buf: HostBuffer | None, expect: np.ndarray | None,
                     status: np.ndarray, a: int, b: int) -> None:
        """Scatter staged pages a..b and check their checksums (`BADSUM` per mismatch); a failure
        of either fails the pages, without judging them."""
        try:
            if buf is not None:
                self._scatter(pages, buf, a, b)
            if expect is not None:
                todo = [j for j in range(a, b) if expect[j]]
                for j, got in zip(todo, self._page_sums(pages, None, todo, like=expect[todo])):
                    if got != expect[j]:
                        status[j] = BADSUM
        except Exception as exc:  # noqa: BLE001 -- such pages are failed reads, not bad pages
            log.error("hicache-gds: finishing a read of %d pages failed: %s: %s", b - a, type(exc).__name__, exc)
            status[a:b][status[a:b] == OK] = FAIL

    @staticmethod
    def _cut(mem_a: np.ndarray, mem_l: np.ndarray, file_off: np.ndarray, limit: int):
        """Flatten (P, S) descriptors to rows, splitting any longer than `limit`; rows per page."""
        n = mem_a.shape[0]
        a, l, f, pieces = split_rows(mem_a.ravel(), mem_l.ravel(), file_off.ravel(), limit)
        return a, l, f, pieces.reshape(n, mem_a.shape[1]).sum(axis=1)

    def _gather(self, pages: Pages, dst: np.ndarray) -> None:
        gather(pages, dst, self.page_bytes)

    def _scatter(self, pages: Pages, buf: HostBuffer, a: int, b: int) -> None:
        scatter(pages, buf, a, b, self.slot_bytes, self.page_bytes)

    def page_checksums(self, pages: Pages, like: np.ndarray | None = None) -> np.ndarray:
        """The checksum each page would be stored with (int64 per page; `hicache_gds.pagesum`): for
        GPU-direct paths that move a store's pages themselves and check them where they land (pages
        shorter than `page_bytes` count as zero-padded). Host pages get xxh3, device pages hgc1 (on
        their GPU, after the work queued on this thread's stream of it); with `like` (recorded
        checksums, one per page), each page gets the kind its `like` value is of, as a read that
        verifies it must."""
        if len(pages) and int(pages.page_nbytes.max()) > self.page_bytes:
            raise RegionError(f"pages of {int(pages.page_nbytes.max())} bytes exceed this store's {self.page_bytes}")
        return np.asarray(self._page_sums(pages, None, range(len(pages)), like=like), dtype=np.int64)

    def _page_sums(self, pages: Pages, buf: HostBuffer | None, idx: Sequence[int],
                   like: Any = None) -> list[int]:
        """`hashing.page_sums` of pages `idx` (from `buf`, where staged), with this store's sizes,
        ``checksum_threads`` and device checksums."""
        return hashing.page_sums(pages, buf, idx, page_bytes=self.page_bytes, slot_bytes=self.slot_bytes,
                                 threads=self.config.checksum_threads, device_sums=self._device_sums, like=like)

    # -- maintenance -----------------------------------------------------------------------------
    def close(self) -> None:
        """Refuse new calls (`StoreClosedError`), wait for the calls in flight (at most
        ``io_timeout``), then release files, buffers, the index (and, for a store, the namespace's lock). Idempotent.

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

    def _release_io(self) -> None:
        """Staging, engine file ids, fdatasync descriptors and the engine (`_teardown`)."""
        self._staging.close()
        for fid in self._fids:
            self.engine.close_file(fid)
        for fd in self._sync_fds:
            os.close(fd)
        self.engine.close()

    def _teardown(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "PageMover":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # noqa: BLE001
            pass


