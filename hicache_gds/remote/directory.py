"""`Directory`: the remote tier's shared state in Redis (schema and scripts: `scripts.py`).

Every method is one round trip (a script call, or a pipeline of them) and every change is a Lua
script, so concurrent clients and servers need no locks of their own. Redis being down or slow
is `DirectoryUnavailable`, raised within `timeout` seconds; after a failure calls fail at once
for a short, growing back-off, so a dead Redis costs callers nothing but misses.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..errors import DirectoryUnavailable
from . import scripts
from .connect import connect, redact

__all__ = ["Directory", "DirectoryUnavailable", "ServerInfo", "Reservation", "SID_RE", "redact"]

log = logging.getLogger("hicache_gds.remote")
SID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
PRESENT, FULL = -2, -1
PUBLISHED, LOST_RACE, LOST = 1, 2, 0


@dataclass(frozen=True)
class ServerInfo:
    """One live page server as registered in Redis."""

    sid: str
    epoch: str
    agent: str
    metadata: bytes
    base: int
    slot_bytes: int
    nslots: int
    host: str = ""
    pid: int = 0
    tcp_tx: int = 0  # its UCX TCP send segment (bytes); 0: not published (earlier releases: <= 64 KiB)


@dataclass(frozen=True)
class Reservation:
    """A slot reserved for `key` on `sid`: write the page there, then publish (or abort)."""

    key: str
    slot: int
    gen: int



class Directory:
    """Client of the Redis directory for one key prefix.

    Parameters
    ----------
    url:
        Redis URL, e.g. ``redis://127.0.0.1:6379/0``, or a Sentinel-monitored primary,
        ``redis+sentinel://h1:26379,h2:26379/service_name`` (`connect.py`).
    prefix:
        Key prefix; deployments sharing one Redis use distinct prefixes. Keys carry it as a hash
        tag, ``{prefix}:...``, so one deployment's keys share one Redis Cluster slot.
    timeout:
        Seconds any Redis call may take (connect and reply).
    wait_replicas, wait_ms:
        Writes that must survive a failover (registration, free-list fill, publish, delete) wait
        until this many replicas acknowledged them (``WAIT``), at most `wait_ms`; one not
        acknowledged in time is a failure (`DirectoryUnavailable`; a publish reads as lost), never
        reported done. The number is capped by the replicas attached (``INFO replication``,
        read again every `refresh` check): no replica, no wait. 0 turns waiting off.
    secret:
        The cluster secret (`trust.py`): registrations are signed with it and records without a
        valid proof are skipped. None: every record is trusted.
    """

    FILL_SLOTS = 8192
    """Free slots one FILL script adds (a few ms of Redis time)."""
    SCAN_COUNT = 128
    """Directory fields one CLEAR step visits."""
    MAX_EVICT = 250
    """Pages one heartbeat evicts at most (the rest at the next one)."""
    SWEEP = 200
    """Directory fields one heartbeat sweeps for entries of dead registrations."""

    def __init__(self, url: str, prefix: str = "hicache", timeout: float = 2.0, *, wait_replicas: int = 1,
                 wait_ms: int = 1000, secret: bytes | None = None) -> None:
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - redis is a declared extra
            from ..errors import EngineUnavailable
            raise EngineUnavailable("the remote tier needs the redis client: pip install 'hicache-gds[remote]'") from exc
        if not prefix or not SID_RE.match(prefix):
            raise ValueError(f"remote prefix {prefix!r} must be 1-128 characters of [A-Za-z0-9_.:-]")
        self._redis_mod = redis
        self.url = redact(url)  # what messages and stats show: never the password
        self.prefix = prefix
        self.timeout = timeout
        self.r, self.sentinel = connect(url, timeout)
        self._s = {name: self.r.register_script(getattr(scripts, name)) for name in scripts.__all__
                   if name != "ENTRY_SEP"}
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0
        self.errors = 0
        self.want_replicas, self.wait_ms = max(0, int(wait_replicas)), int(wait_ms)
        self.wait_replicas = 0
        self.secret = secret
        self.epoch = 0  # the directory epoch last seen (`scripts.py`)
        self.untrusted = 0  # records skipped for a missing or wrong proof
        self._warned_untrusted: set[tuple[str, str]] = set()
        self._ver: Any = None
        self._check_replicas()

    # -- plumbing ----------------------------------------------------------------------------
    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        now = time.monotonic()
        if now < self._down_until:
            raise DirectoryUnavailable(f"redis at {self.url} is unreachable (retrying in "
                                       f"{self._down_until - now:.1f} s); {what} skipped")
        try:
            out = fn(*args)
        except self._redis_mod.RedisError as exc:
            with self._lock:
                self.errors += 1
                self._backoff = min(max(self._backoff * 2, 0.25), 5.0)
                self._down_until = time.monotonic() + self._backoff
            raise DirectoryUnavailable(f"redis at {self.url}: {what} failed: {type(exc).__name__}: {exc}") from exc
        if self._backoff:
            with self._lock:
                if self._backoff:
                    log.info("hicache-gds remote: redis at %s answers again", self.url)
                self._backoff = 0.0
        return out

    def _acked(self, what: str, pipe: Any) -> list[Any]:
        """Run `pipe`, then (replicas attached) WAIT for their ack: its results, or
        DirectoryUnavailable when the replicas did not acknowledge the writes in time."""
        n = self.wait_replicas
        if n:  # within the socket timeout: an ack that is late is a failed write, not a broken connection
            pipe.execute_command("WAIT", n, max(1, min(self.wait_ms, int(self.timeout * 800))))
        out = self._call(what, pipe.execute)
        if n:
            acks = int(out.pop())
            if acks < n:
                self._check_replicas()
                raise DirectoryUnavailable(f"redis at {self.url}: {what} was acknowledged by {acks} of {n} "
                                           f"replica(s) within {self.wait_ms} ms: treated as failed")
        return out

    def _check_replicas(self) -> None:
        if not self.want_replicas:
            return
        try:
            info = self.r.info("replication")
        except self._redis_mod.RedisError:
            return
        self.wait_replicas = min(self.want_replicas, int(info.get("connected_slaves", 0)))

    def key(self, *parts: str) -> str:
        """A key of this deployment: ``{prefix}:part:part`` (`scripts.py`)."""
        return ":".join(("{" + self.prefix + "}",) + parts)

    def _skeys(self, sid: str) -> list[str]:
        return [self.key(k, sid) for k in ("srv", "free", "lru", "own", "pend")]

    def _common(self) -> list[str]:
        return [self.key("dir"), self.key("alive"), self.key("fence")]

    def ping(self) -> bool:
        return bool(self._call("ping", self.r.ping))

    def fence_epoch(self) -> int:
        """The directory epoch recorded in Redis (0 before any script ran)."""
        return int(self._call("fence", self.r.hget, self.key("fence"), "epoch") or 0)

    def is_stale(self, entry: str) -> bool:
        """Whether `entry` was written under an older directory epoch than the one last seen, or
        reserved within a lease of a failover (its epoch marked ``q``): its slot may have been
        reused, or may still take a late write, by writers a failover lost, so it is served only
        once its checksum verifies (`scripts.py`)."""
        dep = entry.rsplit(scripts.ENTRY_SEP, 1)[-1]
        return not dep.isdigit() or int(dep) < self.epoch

    # -- servers ------------------------------------------------------------------------------
    def register_server(self, info: ServerInfo, ttl: float) -> None:
        """Publish a server with a fresh epoch: its pool is all free, older entries are gone. Its
        free list is filled after the registration, in steps: until then puts find fewer slots."""
        from . import trust
        fields = {"md": info.metadata, "agent": info.agent, "base": str(info.base),
                  "slot_bytes": str(info.slot_bytes), "nslots": str(info.nslots), "host": info.host,
                  "pid": str(info.pid), "ts": f"{time.time():.3f}"}
        if info.tcp_tx:
            fields["tcp_tx"] = str(info.tcp_tx)
        if self.secret is not None:
            fields["mac"] = trust.sign(self.secret, {**fields, "sid": info.sid, "epoch": info.epoch})
        argv: list[Any] = [info.sid, info.epoch, int(ttl * 1000), info.nslots]
        for k, v in fields.items():
            argv += [k, v]
        keys = self._skeys(info.sid)
        self._check_replicas()
        pipe = self.r.pipeline(transaction=False)
        self._s["REGISTER"](keys + [self.key("alive"), self.key("fence"), self.key("servers"), self.key("ver")],
                            argv, client=pipe)
        self.epoch = int(self._acked("register", pipe)[0])
        # The free list in bounded steps (scripts.FILL): a 4M-slot pool filled in one script
        # held every other Redis client for over a second.
        for first in range(0, info.nslots, self.FILL_SLOTS):
            n = min(self.FILL_SLOTS, info.nslots - first)
            pipe = self.r.pipeline(transaction=False)
            self._s["FILL"](keys[:2], [info.epoch, int(ttl * 1000), first, n], client=pipe)
            if not self._acked("fill", pipe)[0]:
                break  # registered again meanwhile: that registration fills its own list

    def heartbeat(self, sid: str, epoch: str, ttl: float, low_water: int) -> dict[str, int] | None:
        """Refresh the TTL and keep `low_water` slots free by LRU eviction; None if the epoch is gone."""
        out = self._call("heartbeat", self._s["HEARTBEAT"],
                         self._skeys(sid) + [self.key("dir"), self.key("alive"), self.key("fence"), self.key("servers")],
                         [sid, epoch, int(ttl * 1000), low_water, self.MAX_EVICT, self.SWEEP])
        if out[0] == -1:
            return None
        self.epoch = int(out[4])
        return dict(zip(("free", "used", "pending", "evictions"), (int(x) for x in out[:4])))

    def unregister_server(self, sid: str, epoch: str) -> bool:
        return bool(self._call("unregister", self._s["UNREGISTER"],
                               self._skeys(sid) + [self.key("alive"), self.key("servers"), self.key("ver")], [sid, epoch]))

    def changed(self) -> bool:
        """Whether server records may have changed since the last call: a (un)registration bumped
        the version key, or the directory epoch moved (a failover: every cached record is to be
        reloaded). One round trip; also re-reads how many replicas acknowledge writes."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.key("ver")).hget(self.key("fence"), "epoch")
        if self.want_replicas:
            pipe.info("replication")
        out = self._call("version", pipe.execute)
        if self.want_replicas:
            self.wait_replicas = min(self.want_replicas, int(out[2].get("connected_slaves", 0)))
        ver = (out[0], out[1])
        if out[1] is not None:
            self.epoch = max(self.epoch, int(out[1]))
        if ver == self._ver:
            return False
        self._ver = ver
        return True

    def servers(self) -> list[ServerInfo]:
        """Every live server (TTL not lapsed) whose record carries a valid proof when a secret is
        configured; registrations that lapsed are removed from the set."""
        from . import trust
        sids = sorted(s.decode() for s in self._call("list servers", self.r.smembers, self.key("servers")))
        if not sids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for sid in sids:
            pipe.hgetall(self.key("srv", sid))
        rows = self._call("read servers", pipe.execute)
        out, gone = [], []
        for sid, h in zip(sids, rows):
            if not h or b"epoch" not in h or b"md" not in h:
                gone.append(sid)
                continue
            f = {k.decode(): v for k, v in h.items()}
            if self.secret is not None and not trust.verify(self.secret, {**f, "sid": sid}, f.get("mac", b"")):
                self.untrusted += 1
                if (sid, f["epoch"]) not in self._warned_untrusted:
                    self._warned_untrusted.add((sid, f["epoch"]))
                    log.warning("hicache-gds remote: page server %r (host %r) has no valid proof of the cluster "
                                "secret: skipped", sid, f.get("host", b"").decode(errors="replace"))
                continue
            out.append(ServerInfo(sid=sid, epoch=f["epoch"].decode(), agent=f["agent"].decode(), metadata=f["md"],
                                  base=int(f["base"]), slot_bytes=int(f["slot_bytes"]), nslots=int(f["nslots"]),
                                  host=f.get("host", b"").decode(), pid=int(f.get("pid", b"0")),
                                  tcp_tx=int(f.get("tcp_tx", b"0"))))
        if gone:  # SREM only if still absent: a server may have registered between the reads
            for sid in gone:
                try:
                    if not self.r.exists(self.key("srv", sid)):
                        self.r.srem(self.key("servers"), sid)
                except self._redis_mod.RedisError:
                    break
        return out

    def server_state(self, sid: str) -> dict[str, int]:
        """Slot counts of one server (tests, stats)."""
        k = self._skeys(sid)
        pipe = self.r.pipeline(transaction=False)
        pipe.llen(k[1]).zcard(k[2]).zcard(k[4]).hlen(k[3]).hget(k[0], "evictions")
        free, used, pend, owned, ev = self._call("server state", pipe.execute)
        return {"free": free, "used": used, "pending": pend, "owned": owned, "evictions": int(ev or 0)}

    # -- pages --------------------------------------------------------------------------------
    def reserve(self, ns: str, groups: dict[str, tuple[str, list[str]]], lease: float) -> dict[str, list[int | Reservation]]:
        """Reserve one slot per key on each server: {sid: (epoch, keys)} -> {sid: [Reservation | PRESENT | FULL]}.

        A server whose epoch changed answers [] (refresh the server list and retry later). Not
        acked by a replica: the publish that follows is, and replication keeps order.
        """
        pipe = self.r.pipeline(transaction=False)
        sids = list(groups)
        for sid in sids:
            epoch, keys = groups[sid]
            self._s["RESERVE"](self._skeys(sid) + self._common(), [sid, epoch, int(lease * 1000), ns, *keys], client=pipe)
        rows = self._call("reserve", pipe.execute)
        out: dict[str, list[int | Reservation]] = {}
        for sid, row in zip(sids, rows):
            keys = groups[sid][1]
            if len(row) == 1 and row[0] == -3:
                out[sid] = []
                continue
            res: list[int | Reservation] = []
            for j, key in enumerate(keys):
                slot, gen = int(row[2 * j]), int(row[2 * j + 1])
                res.append(Reservation(key, slot, gen) if slot >= 0 else slot)
            out[sid] = res
        return out

    def publish(self, ns: str, items: dict[str, tuple[str, list[tuple[Reservation, int, int]]]]) -> dict[str, list[int]]:
        """Publish written pages: {sid: (epoch, [(reservation, length, checksum)])} -> {sid: [PUBLISHED | LOST_RACE | LOST]}.
        Raises DirectoryUnavailable when the replicas did not acknowledge the publish."""
        pipe = self.r.pipeline(transaction=False)
        sids = [s for s in items if items[s][1]]
        for sid in sids:
            epoch, rows = items[sid]
            argv: list[Any] = [sid, epoch, ns]
            for r, length, csum in rows:
                argv += [r.key, r.slot, r.gen, length, csum]
            self._s["PUBLISH"](self._skeys(sid) + self._common(), argv, client=pipe)
        rows = self._acked("publish", pipe)
        return {sid: [int(x) for x in row] for sid, row in zip(sids, rows)}

    def abort(self, ns: str, items: dict[str, tuple[str, list[Reservation]]]) -> None:
        """Give back reservations whose write failed."""
        pipe = self.r.pipeline(transaction=False)
        for sid, (epoch, rows) in items.items():
            if rows:
                argv: list[Any] = [sid, epoch, ns]
                for r in rows:
                    argv += [r.key, r.slot, r.gen]
                self._s["ABORT"](self._skeys(sid) + [self.key("alive"), self.key("fence")], argv, client=pipe)
        self._call("abort", pipe.execute)

    def lookup(self, ns: str, keys: Sequence[str]) -> list[str | None]:
        """Directory entry per key ("sid|epoch|slot|gen|len|csum|dep"), None when absent or on a dead server."""
        if not keys:
            return []
        rows = self._call("lookup", self._s["LOOKUP"], self._common(), [ns, *keys])
        self.epoch = max(self.epoch, int(rows[0]))
        return [r.decode() if r else None for r in rows[1:]]

    def validate(self, ns: str, pairs: Iterable[tuple[str, str]]) -> list[bool]:
        """After a read: True per (key, entry) still published unchanged (its LRU time is refreshed)."""
        flat: list[Any] = []
        sids: dict[str, None] = {}
        for k, e in pairs:
            flat += [k, e]
            sids[e.split(scripts.ENTRY_SEP, 1)[0]] = None
        if not flat:
            return []
        keys = [self.key("dir"), self.key("alive")] + [self.key("lru", s) for s in sids]
        return [bool(x) for x in self._call("validate", self._s["VALIDATE"], keys, [ns, len(sids), *sids, *flat])]

    def _srv_args(self, sids: Iterable[str]) -> tuple[list[str], list[Any]]:
        sids = list(sids)
        keys = [self.key("dir"), self.key("alive")]
        for s in sids:
            keys += self._skeys(s)[1:]
        return keys, [len(sids), *sids]

    def _live_sids(self) -> list[str]:
        return [s.decode() for s in self._call("alive", self.r.hkeys, self.key("alive"))]

    def delete(self, ns: str, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        out: list[int] = [2] * len(keys)
        for _ in range(3):  # a page published meanwhile on a server not named: once more with it
            todo = [i for i, x in enumerate(out) if x == 2]
            if not todo:
                break
            skeys, sargs = self._srv_args(self._live_sids())
            pipe = self.r.pipeline(transaction=False)
            self._s["DELETE"](skeys, [ns, *sargs, *(keys[i] for i in todo)], client=pipe)
            for i, x in zip(todo, self._acked("delete", pipe)[0]):
                out[i] = int(x)
        return [x == 1 for x in out]

    def clear(self, ns: str) -> int:
        """Remove every page of `ns`, in bounded steps (`SCAN_COUNT` fields a script)."""
        pattern = _glob_escape(ns) + scripts.FIELD_SEP + "*"
        total = 0
        for _ in range(3):
            skeys, sargs = self._srv_args(self._live_sids())
            cursor, retry = "0", 0
            while True:
                c, n, r = self._call("clear", self._s["CLEAR"], skeys, [ns, *sargs, cursor, self.SCAN_COUNT, pattern])
                total, retry, cursor = total + int(n), retry + int(r), c.decode() if isinstance(c, bytes) else str(c)
                if cursor == "0":
                    break
            if not retry:
                break
        if self.wait_replicas:  # a write acked acks every earlier one: replication keeps order
            self._acked("clear", self.r.pipeline(transaction=False).set(self.key("ack"), total))
        return total

    def count(self, ns: str) -> int:
        """Pages of `ns` on live servers (a scan of the directory: tests and tools)."""
        alive = {s: a.split(b"|")[0] for s, a in self._call("alive", self.r.hgetall, self.key("alive")).items()}
        n = 0
        for _, e in self.r.hscan_iter(self.key("dir"), match=_glob_escape(ns) + scripts.FIELD_SEP + "*", count=1000):
            sid, epoch = e.split(b"|")[:2]
            n += alive.get(sid) == epoch
        return n

    def close(self) -> None:
        try:
            self.r.close()
        except Exception:  # noqa: BLE001
            pass


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def parse_entry(entry: str) -> tuple[str, str, int, int, int, int]:
    """(sid, epoch, slot, gen, length, checksum) of a directory entry."""
    sid, epoch, slot, gen, length, csum = entry.split(scripts.ENTRY_SEP)[:6]
    return sid, epoch, int(slot), int(gen), int(length), int(csum)
