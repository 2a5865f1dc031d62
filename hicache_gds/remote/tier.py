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
during the read fails validation: a miss, never wrong bytes) and, for host pages, the checksum.

Failure contract: an unreachable Redis, a dead or unreachable server, a timeout -- each is a miss
(False) and a rate-limited log line, never an exception out of exists/prefix/get/put/delete/clear,
and never a wait without a timeout. Servers that come back (new epoch) are picked up by the
periodic refresh of the server list.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import xxhash

from ..config import ENV_PREFIX, Config
from ..engines.base import MemKind, Op, Transfer, split_batches
from ..errors import RegionError, TransferError, TransferTimeout
from ..layout import Pages, namespace_id
from ..memory import view
from ..stats import StoreStats
from .directory import FULL, LOST, PRESENT, Directory, DirectoryUnavailable, Reservation, ServerInfo, parse_entry
from .ucx import NixlUcxEngine, PeerDisconnected

__all__ = ["RemoteTier", "RemoteOptions", "REMOTE_KEYS"]

log = logging.getLogger("hicache_gds.remote")
MAX_KEY_BYTES = 1024
_EXTRA = ("redis_errors", "peer_errors", "stale_reads", "lost_races", "no_server")


@dataclass(frozen=True)
class RemoteOptions:
    """Remote-tier settings. Config keys: `remote_url`, `remote_prefix`, `remote_timeout`."""

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "hicache"
    redis_timeout: float = 2.0
    """Seconds one Redis call may take."""
    io_timeout: float = 10.0
    """Seconds one batch's transfers may take (from `io_timeout`)."""
    lease: float = 0.0
    """Seconds a reserved slot stays reserved for a writer that never publishes (0: 2*io_timeout + 10)."""
    refresh: float = 1.0
    """Seconds between refreshes of the live server list."""
    verify: bool = True
    """Check host pages' xxh3 checksums after reading (from `verify`)."""
    net_devices: str = "lo"
    """UCX_NET_DEVICES for this process when unset in the environment (loopback only)."""

    @classmethod
    def from_config(cls, cfg: Config, overrides: Mapping[str, Any] | None = None,
                    env: Mapping[str, str] | None = None) -> "RemoteOptions":
        """Dict key > `Config` field (once the core declares it) > `HICACHE_GDS_<KEY>` > default."""
        env = os.environ if env is None else env
        overrides = overrides or {}
        out: dict[str, Any] = {"io_timeout": cfg.io_timeout, "verify": cfg.verify}
        for key, attr in REMOTE_KEYS.items():
            if key in overrides:
                val = overrides[key]
            elif hasattr(cfg, key):
                val = getattr(cfg, key)
            else:
                val = env.get(ENV_PREFIX + key.upper(), "")
            default = getattr(cls, attr)
            out[attr] = default if val in ("", None) else type(default)(val)
        return cls(**out)


REMOTE_KEYS = {"remote_url": "url", "remote_prefix": "prefix", "remote_timeout": "redis_timeout"}
assert set(REMOTE_KEYS.values()) <= {f.name for f in fields(RemoteOptions)}


def _csum(segments: Iterable[tuple[int, int]]) -> int:
    h = xxhash.xxh3_64()
    for addr, n in segments:
        h.update(view(addr, n))
    return h.intdigest() or 1  # 0 means "not recorded" (device pages)


@dataclass
class _Peer:
    info: ServerInfo
    peer_id: int  # 0: not loaded (failed; retried after down_until)
    down_until: float = 0.0


class RemoteTier:
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
        self.opts = options or RemoteOptions.from_config(cfg, over)
        self.page_bytes = page_bytes
        ident = {str(k): str(v) for k, v in (identity or {}).items()}
        ident.update(page_bytes=str(page_bytes), tenant=cfg.namespace)
        self.identity = ident
        self.namespace = namespace_id(ident)
        self.lease = self.opts.lease or 2 * self.opts.io_timeout + 10
        os.environ.setdefault("UCX_NET_DEVICES", self.opts.net_devices)
        self.engine = NixlUcxEngine()
        self.dir = Directory(self.opts.url, self.opts.prefix, self.opts.redis_timeout)
        self._peers: dict[str, _Peer] = {}
        self._agents: dict[str, int] = {}  # agent name -> peer id
        self._lock = threading.RLock()
        self._refreshed = 0.0
        self._warned: dict[str, float] = {}
        self._stats = StoreStats()
        for k in _EXTRA:
            self._stats.c.setdefault(k, 0)
        self._closed = False
        try:
            self._refresh(force=True)
        except DirectoryUnavailable as exc:
            self._warn("redis", f"hicache-gds remote: {exc}; pages are misses until it answers")
        log.info("hicache-gds remote tier %s: redis %s prefix %s, %d server(s)", self.namespace, self.opts.url,
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

    def _refresh(self, force: bool = False) -> None:
        """Reload the live server list (at most every `opts.refresh` s unless forced)."""
        now = time.monotonic()
        if not force and now - self._refreshed < self.opts.refresh:
            return
        self._refreshed = now
        infos = self.dir.servers()
        with self._lock:
            seen = set()
            for info in infos:
                seen.add(info.sid)
                old = self._peers.get(info.sid)
                pid = self._agents.get(info.agent, 0)
                if not pid and (old is None or now >= old.down_until):
                    try:
                        pid = self.engine.add_peer(info.metadata)
                        self._agents[info.agent] = pid
                    except TransferError as exc:
                        self._warn(f"peer:{info.sid}", f"hicache-gds remote: server {info.sid}: {exc}")
                        pid = 0
                if old is not None and old.peer_id and old.info.agent != info.agent:
                    self._drop_agent(old.info.agent)  # the server restarted: a new agent
                self._peers[info.sid] = _Peer(info, pid, old.down_until if old else 0.0)
            for sid in [s for s in self._peers if s not in seen]:
                self._drop_agent(self._peers.pop(sid).info.agent)

    def _drop_agent(self, agent: str) -> None:
        pid = self._agents.pop(agent, 0)
        if pid:
            self.engine.remove_peer(pid)

    def _peer_failed(self, sid: str, exc: Exception) -> None:
        self._stats.add(peer_errors=1)
        self._warn(f"peer:{sid}", f"hicache-gds remote: server {sid}: {exc}; its pages are misses")
        if isinstance(exc, PeerDisconnected):
            with self._lock:
                p = self._peers.get(sid)
                if p is not None:
                    self._drop_agent(p.info.agent)
                    p.peer_id, p.down_until = 0, time.monotonic() + max(self.opts.refresh, 1.0)

    def _live(self) -> list[_Peer]:
        now = time.monotonic()
        with self._lock:
            return [p for p in self._peers.values()
                    if p.peer_id and now >= p.down_until and p.info.slot_bytes >= self.page_bytes]

    @staticmethod
    def _pick(key: str, live: list[_Peer]) -> _Peer:
        """Rendezvous hashing: every client maps a key to the same server of the same live set."""
        return max(live, key=lambda p: xxhash.xxh64_intdigest(f"{p.info.sid}\x00{key}".encode()))

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
                self._refreshed = 0.0  # the server re-registered: reload before the next batch
                continue
            for i, r in zip(idx, res[sid]):
                if r == PRESENT:
                    result[i] = True
                    present += 1
                elif r != FULL:
                    writes.setdefault(sid, []).append((i, r))
        done = self._move(Op.WRITE, pages, {s: (peers[s], [(i, r.slot) for i, r in w]) for s, w in writes.items()})
        ok: dict[str, tuple[str, list[tuple[Reservation, int, int]]]] = {}
        failed: dict[str, tuple[str, list[Reservation]]] = {}
        for sid, w in writes.items():
            epoch = peers[sid].info.epoch
            for j, (i, r) in enumerate(w):
                st = done[sid][j]
                if st == "ok":
                    csum = 0 if pages.kind is MemKind.VRAM else _csum(zip(pages.addrs[i].tolist(), pages.lens[i].tolist()))
                    ok.setdefault(sid, (epoch, []))[1].append((r, self.page_bytes, csum))
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
            peers: dict[str, _Peer] = {}
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
        done = self._move(Op.READ, pages, {s: (peers[s], [(i, slot) for i, _, slot, _ in h]) for s, h in hits.items()})
        read = [(i, e, c) for s, h in hits.items() for (i, e, _, c), st in zip(h, done[s]) if st == "ok"]
        try:
            valid = self.dir.validate(self.namespace, [(keys[i], e) for i, e, _ in read])
        except DirectoryUnavailable as exc:
            self._redis_failed(exc)
            valid = [False] * len(read)
        bad, stale = [], 0
        for (i, _, csum), v in zip(read, valid):
            if not v:
                stale += 1
            elif (self.opts.verify and csum and pages.kind is MemKind.DRAM
                  and _csum(zip(pages.addrs[i].tolist(), pages.lens[i].tolist())) != csum):
                bad.append(keys[i])
            else:
                result[i] = True
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

    def _peer_of(self, sid: str, epoch: str) -> _Peer | None:
        with self._lock:
            p = self._peers.get(sid)
        if p is None or p.info.epoch != epoch or not p.peer_id or time.monotonic() < p.down_until:
            return None
        return p

    def _move(self, op: Op, pages: Pages, plan: dict[str, tuple[_Peer, list[tuple[int, int]]]]) -> dict[str, list[str]]:
        """Move pages[i] <-> slot on each server; per server and item "ok", "fail" or "timeout"."""
        out = {sid: ["fail"] * len(items) for sid, (_, items) in plan.items()}
        caps = self.engine.capabilities
        deadline = time.monotonic() + self.opts.io_timeout
        posted: list[tuple[str, int, int, Transfer]] = []
        for sid, (peer, items) in plan.items():
            if not items:
                continue
            idx = [i for i, _ in items]
            sel = pages.select(idx)
            n, segs = sel.addrs.shape
            slots = np.asarray([s for _, s in items], dtype=np.uint64)
            base = np.uint64(peer.info.base) + slots * np.uint64(peer.info.slot_bytes)
            seg_off = np.cumsum(sel.lens, axis=1) - sel.lens
            mem = np.stack([sel.addrs.ravel(), sel.lens.ravel()], axis=1)
            rem = np.stack([np.full(n * segs, peer.peer_id, dtype=np.uint64), (base.reshape(n, 1) + seg_off).ravel()],
                           axis=1)
            for a, b in split_batches(np.full(n, segs), np.full(n, self.page_bytes), caps):
                try:
                    posted.append((sid, a, b, self.engine.submit(op, sel.kind, mem[a * segs:b * segs],
                                                                 rem[a * segs:b * segs])))
                except (TransferError, ValueError) as exc:
                    self._peer_failed(sid, exc)
        for sid, a, b, t in posted:
            try:
                t.wait(max(0.0, deadline - time.monotonic()))
                out[sid][a:b] = ["ok"] * (b - a)
            except TransferTimeout as exc:
                self._stats.add(timeouts=1)
                out[sid][a:b] = ["timeout"] * (b - a)
                self._warn(f"peer:{sid}", f"hicache-gds remote: {exc}")
            except TransferError as exc:
                self._peer_failed(sid, exc)
            finally:
                t.release()
        return out

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
        out.update(namespace=self.namespace, page_bytes=self.page_bytes, redis=self.opts.url,
                   prefix=self.opts.prefix, servers=servers)
        return out

    def close(self) -> None:
        """Release the agent, registrations and the Redis connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.close()
        finally:
            self.dir.close()

    def __enter__(self) -> "RemoteTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
