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
        Key prefix; deployments sharing one Redis use distinct prefixes.
    timeout:
        Seconds any Redis call may take (connect and reply).
    """

    def __init__(self, url: str, prefix: str = "hicache", timeout: float = 2.0) -> None:
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

    def _skeys(self, sid: str) -> list[str]:
        p = self.prefix
        return [f"{p}:srv:{sid}", f"{p}:free:{sid}", f"{p}:lru:{sid}", f"{p}:own:{sid}", f"{p}:pend:{sid}"]

    def _dir(self, ns: str) -> str:
        return f"{self.prefix}:dir:{ns}"

    def ping(self) -> bool:
        return bool(self._call("ping", self.r.ping))

    # -- servers ------------------------------------------------------------------------------
    FILL_SLOTS = 32768
    """Free slots one FILL script adds (about 10 ms of Redis time)."""

    def register_server(self, info: ServerInfo, ttl: float) -> None:
        """Publish a server with a fresh epoch: its pool is all free, older entries are gone. Its
        free list is filled after the registration, in steps: until then puts find fewer slots."""
        fields = {"md": info.metadata, "agent": info.agent, "base": str(info.base),
                  "slot_bytes": str(info.slot_bytes), "nslots": str(info.nslots), "host": info.host,
                  "pid": str(info.pid)}
        argv: list[Any] = [self.prefix, info.sid, info.epoch, int(ttl * 1000), info.nslots]
        for k, v in fields.items():
            argv += [k, v]
        keys = self._skeys(info.sid)
        self._call("register", self._s["REGISTER"], keys, argv)
        # The free list in bounded steps (scripts.FILL): a 4M-slot pool filled in one script
        # held every other Redis client for over a second.
        for first in range(0, info.nslots, self.FILL_SLOTS):
            n = min(self.FILL_SLOTS, info.nslots - first)
            if not self._call("fill", self._s["FILL"], keys[:2],
                              [self.prefix, info.sid, info.epoch, int(ttl * 1000), first, n]):
                break  # registered again meanwhile: that registration fills its own list

    def heartbeat(self, sid: str, epoch: str, ttl: float, low_water: int) -> dict[str, int] | None:
        """Refresh the TTL and keep `low_water` slots free by LRU eviction; None if the epoch is gone."""
        out = self._call("heartbeat", self._s["HEARTBEAT"], self._skeys(sid),
                         [self.prefix, sid, epoch, int(ttl * 1000), low_water])
        if out[0] == -1:
            return None
        return dict(zip(("free", "used", "pending", "evictions"), (int(x) for x in out)))

    def unregister_server(self, sid: str, epoch: str) -> bool:
        return bool(self._call("unregister", self._s["UNREGISTER"], self._skeys(sid), [self.prefix, sid, epoch]))

    def servers(self) -> list[ServerInfo]:
        """Every live server (TTL not lapsed); registrations that lapsed are removed from the set."""
        sids = sorted(s.decode() for s in self._call("list servers", self.r.smembers, f"{self.prefix}:servers"))
        if not sids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for sid in sids:
            pipe.hgetall(f"{self.prefix}:srv:{sid}")
        rows = self._call("read servers", pipe.execute)
        out, gone = [], []
        for sid, h in zip(sids, rows):
            if not h or b"epoch" not in h or b"md" not in h:
                gone.append(sid)
                continue
            out.append(ServerInfo(sid=sid, epoch=h[b"epoch"].decode(), agent=h[b"agent"].decode(), metadata=h[b"md"],
                                  base=int(h[b"base"]), slot_bytes=int(h[b"slot_bytes"]), nslots=int(h[b"nslots"]),
                                  host=h.get(b"host", b"").decode(), pid=int(h.get(b"pid", b"0"))))
        if gone:  # SREM only if still absent: a server may have registered between the reads
            for sid in gone:
                try:
                    if not self.r.exists(f"{self.prefix}:srv:{sid}"):
                        self.r.srem(f"{self.prefix}:servers", sid)
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

        A server whose epoch changed answers [] (refresh the server list and retry later).
        """
        pipe = self.r.pipeline(transaction=False)
        sids = list(groups)
        for sid in sids:
            epoch, keys = groups[sid]
            self._s["RESERVE"](self._skeys(sid) + [self._dir(ns)],
                               [self.prefix, sid, epoch, int(lease * 1000), ns, *keys], client=pipe)
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
        """Publish written pages: {sid: (epoch, [(reservation, length, checksum)])} -> {sid: [PUBLISHED | LOST_RACE | LOST]}."""
        pipe = self.r.pipeline(transaction=False)
        sids = [s for s in items if items[s][1]]
        for sid in sids:
            epoch, rows = items[sid]
            argv: list[Any] = [self.prefix, sid, epoch, ns]
            for r, length, csum in rows:
                argv += [r.key, r.slot, r.gen, length, csum]
            self._s["PUBLISH"](self._skeys(sid) + [self._dir(ns)], argv, client=pipe)
        rows = self._call("publish", pipe.execute)
        return {sid: [int(x) for x in row] for sid, row in zip(sids, rows)}

    def abort(self, ns: str, items: dict[str, tuple[str, list[Reservation]]]) -> None:
        """Give back reservations whose write failed."""
        pipe = self.r.pipeline(transaction=False)
        for sid, (epoch, rows) in items.items():
            if rows:
                argv: list[Any] = [self.prefix, sid, epoch, ns]
                for r in rows:
                    argv += [r.key, r.slot, r.gen]
                self._s["ABORT"](self._skeys(sid), argv, client=pipe)
        self._call("abort", pipe.execute)

    def lookup(self, ns: str, keys: Sequence[str]) -> list[str | None]:
        """Directory entry per key ("sid|epoch|slot|gen|len|csum"), None when absent or on a dead server."""
        if not keys:
            return []
        rows = self._call("lookup", self._s["LOOKUP"], [self._dir(ns)], [self.prefix, *keys])
        return [r.decode() if r else None for r in rows]

    def validate(self, ns: str, pairs: Iterable[tuple[str, str]]) -> list[bool]:
        """After a read: True per (key, entry) still published unchanged (its LRU time is refreshed)."""
        argv: list[Any] = [self.prefix]
        for k, e in pairs:
            argv += [k, e]
        if len(argv) == 1:
            return []
        return [bool(x) for x in self._call("validate", self._s["VALIDATE"], [self._dir(ns)], argv)]

    def delete(self, ns: str, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return [bool(x) for x in self._call("delete", self._s["DELETE"], [self._dir(ns)], [self.prefix, ns, *keys])]

    def clear(self, ns: str) -> int:
        return int(self._call("clear", self._s["CLEAR"], [self._dir(ns)], [self.prefix, ns]))

    def count(self, ns: str) -> int:
        return int(self._call("count", self.r.hlen, self._dir(ns)))

    def close(self) -> None:
        try:
            self.r.close()
        except Exception:  # noqa: BLE001
            pass


def parse_entry(entry: str) -> tuple[str, str, int, int, int, int]:
    """(sid, epoch, slot, gen, length, checksum) of a directory entry."""
    sid, epoch, slot, gen, length, csum = entry.split(scripts.ENTRY_SEP)
    return sid, epoch, int(slot), int(gen), int(length), int(csum)
