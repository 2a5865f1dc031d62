"""`PageStore`: the read-write `Store`. Keys in, pages (memory regions) in or out, per-page results.

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
LRU and capacity through the index (`hicache_gds.index`), and a dead one's reservations are reclaimed
(`owners.py`). Bytes move straight between each process's memory and the slab files.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..slabs.capacity import gib
from ..config import Config
from ..engines.base import MemKind, Op, TransferEngine
from ..errors import TransferError
from ..gate import gated
from ..layout import Pages
from .mover import BADSUM, FAIL, MAX_KEY_BYTES, MAX_SINGLE_RETRIES, OK, TIMEOUT, PageMover
from .namespace import checked_config, open_namespace
from .protocol import Lease, Store
from .staging import ORPHANED, Prepared, finished

__all__ = ["PageStore", "MAX_KEY_BYTES"]

log = logging.getLogger("hicache_gds.store")


class PageStore(PageMover, Store):
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
        cfg = checked_config(page_bytes, config)
        self._member = None
        ns = open_namespace(cfg, page_bytes, identity, mem_kinds, engine)
        super().__init__(cfg, page_bytes, ns.identity, ns.namespace, ns.slot_bytes, "page store")
        self.dirs, self.sizing, self.slabs, self.index, self._member = ns.dirs, ns.sizing, ns.slabs, ns.index, ns.member
        try:
            self._fids = [ns.engine.open_file(p) for p in self.slabs.paths]
            self._sync_fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in self.slabs.paths] if cfg.sync else []
        except BaseException:
            self._gate.closed = True
            for fid in self._fids:
                ns.engine.close_file(fid)
            if engine is None:
                ns.engine.close()
            self.index.close()
            self._member.close()
            raise
        self._attach(ns.engine, ns.engine_reason)
        log.info("hicache-gds store %s: capacity %s (%d slots of %d bytes) in %s, %s; engine %s",
                 self.namespace, gib(self.sizing.capacity), self.sizing.nslots, self.slot_bytes, ",".join(self.dirs),
                 self.sizing.how, self.engine_reason)

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
    def lease(self, keys: Sequence[str]) -> Lease:
        """Lease the present pages of `keys` (`Lease`): their slots are not reused, and they become
        the namespace's most recently used, until released. Raises `OSError` when the index cannot
        be written (a full disk)."""
        keys = self._check_keys(keys)
        entries = self.index.lookup_pin(keys)
        present = np.array([e is not None for e in entries], dtype=bool)
        return self._lease_of(keys, entries, present, self._fids, protected=True, unpin=self.index.unpin,
                              drop=self.index.drop)

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
                ok = status == OK
                if self.config.sync and ok.any():
                    try:
                        for fd in self._sync_fds:
                            os.fdatasync(fd)
                    except OSError as exc:  # written, but not known to be durable: not published
                        log.error("hicache-gds: fdatasync of the slab files failed (%s); %d pages not published",
                                  exc, int(ok.sum()))
                        status[ok] = FAIL
                ok_items = [(keys[todo[j]], slots[j], self.page_bytes, int(sums[j])) for j in range(len(slots))
                            if status[j] == OK]
                try:
                    published = self.index.publish(ok_items)
                    handed = {it[1] for it in ok_items}
                except OSError as exc:
                    log.warning("hicache-gds: %d written pages not published: %s", len(ok_items), exc)
                    published = [False] * len(ok_items)
                    status[status == OK] = FAIL
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
                        timeouts=int((status == TIMEOUT).sum()))
        self._stats.batch(True, time.perf_counter_ns() - t0)
        return result

    def _settle(self, slots: list[int], status: np.ndarray, handed: set[int], prep: Prepared,
                io_over: bool) -> None:
        """Give back what a put reserved and publish did not settle (`handed`: published, or freed
        by publish as a duplicate's, and maybe reserved again since by another call of this
        process): slots whose IO is over go back to the free list; slots whose write may still
        land (timed out, or the put was cut short while its IO ran) stay reserved -- lost, reaped
        once that IO is seen to finish (`_reap_lost`)."""
        late = self._finish(prep)
        if not slots:
            return
        timed_out = {s for j, s in enumerate(slots) if j < len(status) and status[j] == TIMEOUT}
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
            over = [e for e in self._lost_io if all(finished(t) for t in e[1])]
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
        badj = [j for j in range(len(hits)) if status[j] == BADSUM or gone[j]]
        bad = [keys[hits[j]] for j in badj]
        if bad:
            log.warning("hicache-gds: %d page(s) failed their checksum in %s and were dropped", len(bad),
                        self.namespace)
            try:
                self.index.drop(bad, [int(slots[j]) for j in badj])
            except OSError as exc:
                log.warning("hicache-gds: %s", exc)
        for j, i in enumerate(hits):
            result[i] = bool(status[j] == OK)
        nr = sum(result)
        self._stats.add(hits=len(hits), misses=len(keys) - len(hits), pages_read=nr, bytes_read=nr * self.page_bytes,
                        get_failed=len(hits) - nr - len(bad), checksum_mismatches=len(bad),
                        timeouts=int((status == TIMEOUT).sum()))
        self._stats.batch(False, time.perf_counter_ns() - t0)
        return result

    def _recover_failed_reads(self, pages: Pages, slots: np.ndarray, expect: np.ndarray | None,
                              status: np.ndarray) -> np.ndarray:
        """After a READ, for pages that failed (not timed out): a slot past the end of its slab file
        (truncated under the store) re-extends the file and marks the page gone, to be dropped and
        written again; the others are re-read one request each, so a bad page cannot fail its whole
        request (engines without per-descriptor results fail every page of it)."""
        gone = np.zeros(len(status), dtype=bool)
        fail = np.flatnonzero(status == FAIL)
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
            for j in retry[:MAX_SINGLE_RETRIES]:
                st, _ = self._io(Op.READ, pages.select([j]), slots[j:j + 1],
                                 None if expect is None else expect[j:j + 1])
                status[j] = st[0]
        return gone

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
        out = self._stats_base()
        out.update(index_recovery_s=self.index.recovery_s, index_loaded_s=self.index.loaded_s,
                   staging_held_bytes=self._staging.held_bytes())
        out.update(self.index.stats())
        return out

    def _teardown(self) -> None:
        keep: list[int] = []
        try:
            try:
                self._reap_lost()
            except Exception as exc:  # noqa: BLE001 -- closing matters more
                log.warning("hicache-gds: %s", exc)
            with self._lost_lock:
                keep = [s for slots, _ in self._lost_io for s in slots]
            self._release_io()
        finally:
            if keep:
                self.index.close(keep=keep)
            else:
                self.index.close()
            if self._member is not None:
                if keep:  # the kernel drops the lock at exit, once the IO is over: reclaim is safe then
                    log.warning("hicache-gds: %d slot(s) of %s written by requests that never finished stay "
                                "reserved until this process exits", len(keep), self.namespace)
                    ORPHANED.append(self._member)
                else:
                    self._member.close()
