"""`RemoteTier`: pages in page servers' DRAM, found through a Redis directory, moved by NIXL UCX.

Same batch API as `PageStore`:

    tier = RemoteTier(page_bytes, {"model": ...}, config={"remote_url": "redis://127.0.0.1:6379/0"})
    tier.register_memory(buf_addr, buf_nbytes)            # DRAM, or VRAM where UCX has CUDA
    tier.put(keys, pages) -> [True, ...]     tier.get(keys, pages) -> [True, False, ...]
    tier.exists(keys) / prefix(keys) / delete / clear / stats / close

put: reserve a slot per key on the server its key hashes to (rendezvous hashing over live
servers, so racing clients meet on one server), WRITE the bytes one-sided, then publish in one
script; a key published meanwhile by someone else keeps that copy and our slot goes back. get:
look up, READ one-sided, then validate that each entry is unchanged (a slot evicted and reused
during the read fails validation: a miss, never wrong bytes) and the page's checksum: xxh3 for
pages written from host memory, hgc1 for pages written from GPU memory, each checked wherever it lands.
Pages are read into the tier's own registered staging (host memory for host pages, memory on the
same GPU for device pages), and each request's pages are copied out (and checksummed) as it
completes, while the rest still move, before get returns: a READ still running at the batch's
deadline is a miss, and its staging stays out of use until it finishes (neither a timeout nor
dropping the peer's agent stops what a connection still carries), so its bytes never land in
memory the caller was told holds no page.

Failure contract: an unreachable Redis, a dead or unreachable server, a timeout -- each is a miss
(False) and a rate-limited log line, never an exception out of exists/prefix/get/put/delete/clear,
and never a wait without a timeout. Server records are reloaded when the directory says they changed.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import checksum
from ..config import Config
from ..engines.base import MemKind, Op, split_batches
from ..gil import shorten_switch_interval
from ..errors import RegionError, TransferError, TransferTimeout
from ..layout import Pages, namespace_id
from ..stats import StoreStats
from ..store.staging import MAX_HELD_STAGING, ORPHANED
from .batch import LateRequest, tagged_sums, wait_each
from .directory import FULL, LOST, PRESENT, Directory, DirectoryUnavailable, Reservation, parse_entry
from .options import REMOTE_KEYS, RemoteOptions
from .peers import Peer, PeerBook
from .stagings import Stagings
from .ucx import NixlUcxEngine

__all__ = ["RemoteTier", "RemoteOptions", "REMOTE_KEYS"]

log = logging.getLogger("hicache_gds.remote")
MAX_KEY_BYTES = 1024
# Staged gets are cut into requests of at most this many bytes, so a server's first pages are
# copied out while its later ones are still on the wire (copying the whole batch after its last
# byte held gets to 0.83-0.96x the unstaged tier's over veth TCP; 8 MiB: 0.95-0.96x, 4 or 16: less)
STAGED_REQUEST_BYTES = 8 << 20
_EXTRA = ("redis_errors", "peer_errors", "stale_reads", "lost_races", "no_server", "peers_set_aside")


class RemoteTier(PeerBook):
    """Fixed-size pages under string keys in remote DRAM pools.

    Parameters
    ----------
    page_bytes, identity:
        As for `PageStore`: the namespace is `namespace_id(identity + page_bytes + tenant)`.
    config:
        A `Config` or a dict of overrides; the remote keys (`REMOTE_KEYS`) may be in the dict.
    options:
        `RemoteOptions` to use instead of reading them from `config`.
    """

    def __init__(self, page_bytes: int, identity: Mapping[str, Any] | None = None, *,
                 config: Config | Mapping[str, Any] | None = None, options: RemoteOptions | None = None) -> None:
        if isinstance(config, Config):
            cfg, over = config, {}
        else:
            over = dict(config or {})
            cfg = Config.load(over, ignore=tuple(REMOTE_KEYS))
        if not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError(f"page_bytes must be a positive integer, got {page_bytes!r}")
        self.config = cfg
        shorten_switch_interval(cfg.switch_interval)  # its UCX waits and xxh3 threads hand the GIL over too
        self.opts = options or RemoteOptions.from_config(cfg, over)
        self.page_bytes = page_bytes
        ident = {str(k): str(v) for k, v in (identity or {}).items()}
        ident.update(page_bytes=str(page_bytes), tenant=cfg.namespace)
        self.identity = ident
        self.namespace = namespace_id(ident)
        self.lease = self.opts.lease or 2 * self.opts.io_timeout + 10
        if self.opts.net_devices:
            os.environ.setdefault("UCX_NET_DEVICES", self.opts.net_devices)
        self.engine = NixlUcxEngine()
        self._device_sums = checksum.device_checksums  # tests put a host stand-in here (no GPU)
        self._pool = ThreadPoolExecutor(max(1, self.opts.threads), thread_name_prefix="hicache-gds-ucx")
        self._stagings = Stagings(self.engine)  # where gets read first (see the module's docstring)
        self.dir = Directory(self.opts.url, self.opts.prefix, self.opts.redis_timeout, **self.opts.directory_kwargs())
        self._peers: dict[str, Peer] = {}
        self._agents: dict[str, int] = {}  # agent name -> peer id
        self._lock = threading.RLock()
        self._refreshed = self._loaded = -1e9
        self._warned: dict[str, float] = {}
        self._stats = StoreStats(extra=_EXTRA)
        self._closed = False
        try:
            self._refresh()
        except DirectoryUnavailable as exc:
            self._warn("redis", f"hicache-gds remote: {exc}; pages are misses until it answers")
        log.info("hicache-gds remote tier %s: redis %s prefix %s, %d server(s)", self.namespace, self.dir.url,
                 self.opts.prefix, len(self._peers))

    # -- plumbing ------------------------------------------------------------------------------
    def _warn(self, what: str, msg: str, every: float = 5.0) -> None:
        now = time.monotonic()
        if now - self._warned.get(what, -1e9) >= every:
            self._warned[what] = now
            log.warning(msg)

    def _redis_failed(self, exc: DirectoryUnavailable) -> None:
        self._stats.add(redis_errors=1)
        self._warn("redis", f"hicache-gds remote: {exc}; treated as misses")

    # -- validation ------------------------------------------------------------------------------
    def _check(self, keys: Sequence[str], pages: Pages | None = None) -> list[str]:
        if self._closed:
            raise ValueError("the remote tier is closed")
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise TypeError(f"keys must be a list of str, got {type(keys).__name__}")
        for i, k in enumerate(keys):
            if not isinstance(k, str) or not k or len(k) > MAX_KEY_BYTES or "\x00" in k:
                raise ValueError(f"key {i} must be a non-empty str of at most {MAX_KEY_BYTES} characters without NUL")
        if pages is not None:
            if not isinstance(pages, Pages):
                raise TypeError(f"pages must be hicache_gds.Pages, got {type(pages).__name__}")
            if len(pages) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(pages)} pages")
            bad = np.flatnonzero(pages.page_nbytes != self.page_bytes)
            if bad.size:
                raise RegionError(f"page {int(bad[0])} has {int(pages.page_nbytes[bad[0]])} bytes; "
                                  f"pages of this tier have {self.page_bytes}")
            if len(pages):
                self.engine.check_regions(pages.kind, np.stack([pages.addrs.ravel(), pages.lens.ravel()], axis=1))
        return list(keys)

    # -- API -------------------------------------------------------------------------------------
    def register_memory(self, addr: int, nbytes: int, kind: MemKind = MemKind.DRAM) -> None:
        """Register a buffer that pages will point into (once, before put/get)."""
        self.engine.register_memory(addr, nbytes, MemKind(kind))

    def register_tensor(self, tensor: Any) -> None:
        self.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                             MemKind.VRAM if tensor.is_cuda else MemKind.DRAM)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: is the page published on a live server."""
        keys = self._check(keys)
        try:
            return [e is not None for e in self.dir.lookup(self.namespace, keys)]
        except DirectoryUnavailable as exc:
            self._redis_failed(exc)
            return [False] * len(keys)

    def prefix(self, keys: Sequence[str]) -> int:
        """Length of the longest run of present keys from the start."""
        found = self.exists(keys)
        return found.index(False) if False in found else len(found)

    def put(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Write pages; True per page once it is published (by us or, for the same key, by another)."""
        keys = self._check(keys, pages)
        t0 = time.perf_counter_ns()
        result = [False] * len(keys)
        first: dict[str, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        try:
            self._refresh()
            live = self._live()
            if not live:
                self._stats.add(no_server=1, put_failed=len(keys))
                self._warn("none", f"hicache-gds remote: no live page server holds {self.page_bytes}-byte pages")
                return result
            groups: dict[str, list[int]] = {}
            for i in first.values():
                groups.setdefault(self._pick(keys[i], live).info.sid, []).append(i)
            peers = {p.info.sid: p for p in live}
            res = self.dir.reserve(self.namespace, {s: (peers[s].info.epoch, [keys[i] for i in idx])
                                                    for s, idx in groups.items()}, self.lease)
        except DirectoryUnavailable as exc:
            self._redis_failed(exc)
            self._stats.add(put_failed=len(keys))
            return result
        present = 0
        writes: dict[str, list[tuple[int, Reservation]]] = {}
        for sid, idx in groups.items():
            if not res.get(sid):
                self._refreshed = self._loaded = -1e9  # re-registered or lapsed: reload before the next batch
                continue
            for i, r in zip(idx, res[sid]):
                if r == PRESENT:
                    result[i] = True
                    present += 1
                elif r != FULL:
                    writes.setdefault(sid, []).append((i, r))
        sums: dict[int, int] = {}
        todo = [i for w in writes.values() for i, _ in w]
        self._stagings.wait_for_writers(pages, todo)
        done = self._move(Op.WRITE, pages, {s: (peers[s], [(i, r.slot) for i, r in w]) for s, w in writes.items()},
                          during=lambda: sums.update(zip(todo, self._sums(pages, todo, parallel=False))))
        ok: dict[str, tuple[str, list[tuple[Reservation, int, int]]]] = {}
        failed: dict[str, tuple[str, list[Reservation]]] = {}
        for sid, w in writes.items():
            epoch = peers[sid].info.epoch
            for j, (i, r) in enumerate(w):
                st = done[sid][j]
                if st == "ok":
                    ok.setdefault(sid, (epoch, []))[1].append((r, self.page_bytes, sums.get(i, 0)))
                elif st == "fail":  # a timed-out write may still land: its slot waits for the lease
                    failed.setdefault(sid, (epoch, []))[1].append(r)
        try:
            if failed:
                self.dir.abort(self.namespace, failed)
            pub = self.dir.publish(self.namespace, ok) if ok else {}
        except DirectoryUnavailable as exc:
            self._redis_failed(exc)
            pub = {}
        nw = races = 0
        for sid, (_, rows) in ok.items():
            for (r, _, _), code in zip(rows, pub.get(sid, [LOST] * len(rows))):
                result[first[r.key]] = code != LOST
                nw += code == 1
                races += code == 2
        for i, k in enumerate(keys):
            result[i] = result[first[k]]
        self._stats.add(pages_written=nw, bytes_written=nw * self.page_bytes, put_skipped_present=present,
                        put_failed=len(keys) - sum(result), lost_races=races)
        self._stats.batch(True, time.perf_counter_ns() - t0)
        return result

    def get(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Read pages into memory; False per page that is missing, unreachable, reused meanwhile or corrupt."""
        keys = self._check(keys, pages)
        t0 = time.perf_counter_ns()
        result = [False] * len(keys)
        try:
            entries = self.dir.lookup(self.namespace, keys)
            self._refresh()
            hits: dict[str, list[tuple[int, str, int, int]]] = {}
            parsed = {}
            for i, e in enumerate(entries):
                if e is not None:
                    parsed[i] = parse_entry(e)
            if any(self._peer_of(p[0], p[1]) is None for p in parsed.values()):
                self._refresh(force=True)  # a server we have not loaded yet, or a new epoch
            peers: dict[str, Peer] = {}
            for i, (sid, epoch, slot, _gen, length, csum) in parsed.items():
                p = self._peer_of(sid, epoch)
                if p is None or length != self.page_bytes:
                    continue
                peers[sid] = p
                hits.setdefault(sid, []).append((i, entries[i], slot, csum))
        except DirectoryUnavailable as exc:
            self._redis_failed(exc)
            self._stats.add(misses=len(keys))
            return result
        order = [i for h in hits.values() for i, *_ in h]
        buf = None
        stg = self._stagings.for_pages(pages) if order else None
        if stg is not None:
            if stg.held_bytes() > MAX_HELD_STAGING:
                self._warn("staging", "hicache-gds remote: staging held by reads that timed out is past its cap; "
                                      "gets are misses until those reads finish")
                self._stats.add(misses=len(keys), get_failed=len(order))
                return result
            try:
                buf = stg.acquire(len(order) * self.page_bytes)
            except Exception as exc:  # noqa: BLE001 -- out of (GPU) memory, a registration refused: misses
                self._warn("staging-alloc", f"hicache-gds remote: no {stg.kind.value} staging for a get of "
                                            f"{len(order)} pages ({type(exc).__name__}: {exc}); they are misses")
                self._stats.add(misses=len(keys), get_failed=len(order))
                return result
        at = {i: j for j, i in enumerate(order)} if buf is not None else {i: i for i in order}
        src = Pages.contiguous(buf.addr, self.page_bytes, range(len(order)), stg.kind) if buf is not None else pages
        late: list[LateRequest] = []
        finished = False
        plan = {s: (peers[s], [(at[i], slot) for i, _, slot, _ in h]) for s, h in hits.items()}
        copied: set[int] = set()
        # the recorded checksum of each page to check (`verify`, or an entry of an older epoch); staged
        # pages are checksummed as each request's pages are copied out, while the rest still move
        # (their bytes are final then: the request completed, the buffer is this get's)
        want = {i: c for h in hits.values() for i, e, _, c in h if c and (self.opts.verify or self.dir.is_stale(e))}
        early: dict[int, int] = {}

        def arrived(sid: str, a: int, b: int) -> None:  # a request's pages, staged whole: to the caller now
            js = [j for j, _ in plan[sid][1][a:b]]
            self._stagings.copy_out(stg, dst, buf, js, self.page_bytes)
            copied.update(js)
            idx = [order[j] for j in js if order[j] in want]
            early.update(zip(idx, self._sums(pages, idx, parallel=False, like=[want[i] for i in idx])))

        try:
            dst = pages.select(order) if buf is not None else None
            done = self._move(Op.READ, src, plan, late=late, arrived=arrived if buf is not None else None,
                              request_bytes=STAGED_REQUEST_BYTES if buf is not None else None)
            # a page is read once its request completed (and, staged, once it was copied out)
            read = [(i, e, c) for s, h in hits.items() for (i, e, _, c), st in zip(h, done[s])
                    if st == "ok" and (buf is None or at[i] in copied)]
            if buf is not None:
                self._stats.add(staged_pages=len(copied))
            try:
                valid = self.dir.validate(self.namespace, [(keys[i], e) for i, e, _ in read])
            except DirectoryUnavailable as exc:
                self._redis_failed(exc)
                valid = [False] * len(read)
            # an entry of an older directory epoch is served only once its checksum verifies (scripts.py)
            check = [i for (i, _, _), v in zip(read, valid) if v and i in want]
            rest = [i for i in check if i not in early]
            actual = dict(zip(rest, self._sums(pages, rest, like=[want[i] for i in rest])))
            actual.update((i, early[i]) for i in check if i in early)
            bad, stale = [], 0
            for (i, e, csum), v in zip(read, valid):
                if not v or (not csum and self.dir.is_stale(e)):
                    stale += 1
                elif i in actual and actual[i] != csum:
                    bad.append(keys[i])
                else:
                    result[i] = True
            finished = True
        finally:
            if buf is not None:
                if late:
                    stg.hold(buf, late)
                elif finished:
                    stg.release(buf)
                else:  # an unexpected error with requests maybe in flight: never lent again
                    ORPHANED.append(buf)
        if bad:
            log.warning("hicache-gds remote: %d page(s) failed their checksum in %s and were dropped", len(bad),
                        self.namespace)
            try:
                self.dir.delete(self.namespace, bad)
            except DirectoryUnavailable:
                pass
        nh = sum(len(h) for h in hits.values())
        nr = sum(result)
        self._stats.add(hits=nh, misses=len(keys) - nh, pages_read=nr, bytes_read=nr * self.page_bytes,
                        get_failed=nh - nr - len(bad), checksum_mismatches=len(bad), stale_reads=stale)
        self._stats.batch(False, time.perf_counter_ns() - t0)
        return result

    def _sums(self, pages: Pages, idx: list[int], parallel: bool = True, like: Sequence[int] | None = None) -> list[int]:
        """Tagged checksums of pages `idx` (`batch.tagged_sums`)."""
        return tagged_sums(pages, idx, self.page_bytes, threads=self.opts.threads if parallel else 1, pool=self._pool,
                           device_sums=self._device_sums, like=like)

    def _move(self, op: Op, pages: Pages, plan: dict[str, tuple[Peer, list[tuple[int, int]]]],
              during: Callable[[], Any] | None = None, late: list[LateRequest] | None = None,
              arrived: Callable[[str, int, int], Any] | None = None,
              request_bytes: int | None = None) -> dict[str, list[str]]:
        """Move pages[i] <-> slot on each server; per server and item "ok", "fail" or "timeout".

        Requests are polled by one transfer thread; `during` runs in the caller meanwhile, then
        `arrived(sid, a, b)` for each request that completed (items a..b of that server's), as it
        completes, while the rest are still moving. Nothing here waits past `io_timeout` (a request
        still running then is a timeout, and is left to finish; `late` collects such requests, for
        whoever must keep their memory out of use). Requests carry at most `request_bytes`.
        """
        # Per server and item, the worst outcome of the requests holding its rows (an item may span
        # several: more segments than one request takes): 0 ok, 1 failed, 2 timed out.
        worst = {sid: np.zeros(len(items), dtype=np.int8) for sid, (_, items) in plan.items()}
        caps = self.engine.capabilities
        deadline = time.monotonic() + self.opts.io_timeout
        posted: list[tuple[str, int, int, Any]] = []
        for sid, (peer, items) in plan.items():
            if not items:
                continue
            sel = pages.select([i for i, _ in items])
            n, segs = sel.addrs.shape
            slots = np.asarray([s for _, s in items], dtype=np.uint64)
            base = np.uint64(peer.info.base) + slots * np.uint64(peer.info.slot_bytes)
            seg_off = np.cumsum(sel.lens, axis=1) - sel.lens
            mem = np.stack([sel.addrs.ravel(), sel.lens.ravel()], axis=1)
            rem = np.stack([np.full(n * segs, peer.peer_id, dtype=np.uint64), (base.reshape(n, 1) + seg_off).ravel()],
                           axis=1)
            for bt in split_batches(np.full(n, segs), np.full(n, self.page_bytes), caps,
                                    request_bytes or self.opts.request_bytes, row_bytes=mem[:, 1]):
                try:
                    t = self.engine.submit(op, sel.kind, mem[bt.row_start:bt.row_stop], rem[bt.row_start:bt.row_stop])
                except (TransferError, ValueError) as exc:
                    self._peer_failed(sid, exc)
                    worst[sid][bt.start:bt.stop] = np.maximum(worst[sid][bt.start:bt.stop], 1)
                    continue
                posted.append((sid, bt.start, bt.stop, t))

        done_q: queue.SimpleQueue = queue.SimpleQueue()

        def wait_all() -> list[BaseException | None]:
            try:
                return wait_each([t for *_, t in posted], deadline, done_q.put if arrived is not None else None)
            finally:
                done_q.put(None)

        waiting = self._pool.submit(wait_all) if posted else None
        if during is not None:
            during()
        while arrived is not None and waiting is not None:
            try:
                k = done_q.get(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
            except queue.Empty:
                break
            if k is None:
                break
            sid, a, b, _ = posted[k]
            arrived(sid, a, b)
        try:
            errors = waiting.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0) if waiting else []
        except FutureTimeout as exc:
            errors = [exc] * len(posted)
        for (sid, a, b, t), err in zip(posted, errors):
            try:
                if err is not None:
                    raise err
            except (TransferTimeout, FutureTimeout) as exc:
                if late is not None:
                    late.append(LateRequest(t))
                self._stats.add(timeouts=1)
                worst[sid][a:b] = 2
                self._warn(f"peer:{sid}", f"hicache-gds remote: server {sid}: {exc or 'transfer timed out'}")
            except TransferError as exc:
                self._peer_failed(sid, exc)
                worst[sid][a:b] = np.maximum(worst[sid][a:b], 1)
        for sid, ws in worst.items():
            if (ws == 2).any():
                self._peer_timed_out(sid)
            elif not ws.any() and sid in self._peers and self._peers[sid].strikes:
                self._peers[sid].strikes = 0  # it answers again
        return {sid: [("ok", "fail", "timeout")[int(w)] for w in ws] for sid, ws in worst.items()}

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove pages; True per key that was present."""
        keys = self._check(keys)
        try:
            return self.dir.delete(self.namespace, keys)
        except DirectoryUnavailable as exc:
            self._redis_failed(exc)
            return [False] * len(keys)

    def clear(self) -> int:
        """Remove every page of this namespace; returns how many there were (0 if Redis is down)."""
        self._check([])
        try:
            return self.dir.clear(self.namespace)
        except DirectoryUnavailable as exc:
            self._redis_failed(exc)
            return 0

    def stats(self) -> dict[str, Any]:
        """Counters, latency histograms, the engine and path, and the servers in use."""
        out = self._stats.snapshot()
        out.update(self.engine.info())
        with self._lock:
            servers = [{"sid": p.info.sid, "epoch": p.info.epoch, "host": p.info.host, "pid": p.info.pid,
                        "slot_bytes": p.info.slot_bytes, "nslots": p.info.nslots, "loaded": bool(p.peer_id)}
                       for p in self._peers.values()]
        out.update(namespace=self.namespace, page_bytes=self.page_bytes, redis=self.dir.url, untrusted_servers=self.dir.untrusted,
                   prefix=self.opts.prefix, servers=servers)
        return out

    def close(self) -> None:
        """Release the agent, registrations and the Redis connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False)
        try:
            self._stagings.close()
            self.engine.close()
        finally:
            self.dir.close()

    def __enter__(self) -> "RemoteTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
