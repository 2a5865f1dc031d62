"""The page servers as one remote-tier client sees them: which are live, which are set aside and
until when, and the NIXL connection to each. `tier.RemoteTier` mixes `PeerBook` in.

A server whose request outlived `io_timeout` is set aside (its pages are misses, new keys go to
the others) for `io_timeout`, doubling with each timeout in a row, and it is reconnected before
its next request: the request left to finish holds the old connection, and after a cut link
that connection sits in TCP's retransmission back-off (the next retry as long after the cut as
the cut lasted, up to two minutes), so every request queued on it would time out too although
the server answers again. A new connection is served at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import xxhash

from ..errors import TransferError
from .directory import ServerInfo
from .ucx import PeerDisconnected, tcp_possible

if TYPE_CHECKING:
    import threading

    from ..stats import StoreStats
    from .directory import Directory
    from .options import RemoteOptions
    from .ucx import NixlUcxEngine

__all__ = ["Peer", "PeerBook", "HOLD_MAX_S"]

HOLD_MAX_S = 300.0  # the longest a server that keeps timing out is set aside before one more try


@dataclass
class Peer:
    info: ServerInfo
    peer_id: int  # 0: not loaded (failed; retried after down_until)
    down_until: float = 0.0  # until then its pages are misses and no key is placed on it
    strikes: int = 0  # timeouts in a row: a server that heartbeats but does not answer is set aside
    reconnect: bool = False  # a request to it timed out: a new connection before its next request


class PeerBook:
    """Peer bookkeeping of `RemoteTier` (which sets the attributes below)."""

    engine: NixlUcxEngine
    dir: Directory
    opts: RemoteOptions
    page_bytes: int
    _stats: StoreStats
    _lock: threading.RLock
    _peers: dict[str, Peer]
    _agents: dict[str, int]  # agent name -> peer id
    _refreshed: float
    _loaded: float
    _warn: Callable[..., Any]

    def _refresh(self, force: bool = False) -> None:
        """Reload the live server list (at most every `opts.refresh` s unless forced)."""
        now = time.monotonic()
        if now - self._refreshed < (0.1 if force else self.opts.refresh):
            return  # forced refreshes too are spaced, so a dead server costs one read per 0.1 s at most
        self._refreshed = now
        if not self.dir.changed() and not force and now - self._loaded < 30:
            return  # no server (un)registered and no failover: the records we hold are current
        infos, self._loaded = self.dir.servers(), now
        with self._lock:
            seen = set()
            for info in infos:
                seen.add(info.sid)
                old = self._peers.get(info.sid)
                pid = self._agents.get(info.agent, 0)
                restarted = old is not None and old.info.agent != info.agent
                if not pid and (old is None or restarted or now >= old.down_until):
                    pid = self._connect(info)
                if restarted:
                    self._drop_agent(old.info.agent)  # the server restarted: a new agent
                kept = old is not None and not restarted
                self._peers[info.sid] = Peer(info, pid, old.down_until if kept else 0.0, old.strikes if kept else 0,
                                             kept and old.reconnect and pid == old.peer_id)
            for sid in [s for s in self._peers if s not in seen]:
                self._drop_agent(self._peers.pop(sid).info.agent)

    def _connect(self, info: ServerInfo) -> int:
        """Load `info`'s agent: its peer id, or 0 (warned) where it cannot be loaded now, or where
        its replies over TCP would not fit this process's receive segment (`ucx.TCP_DEFAULTS`:
        the connection would drop at the first get)."""
        rx = self.engine.tcp_rx
        if rx is not None and info.tcp_tx > rx and tcp_possible():
            self._warn(f"seg:{info.sid}", f"hicache-gds remote: server {info.sid} sends TCP segments of {info.tcp_tx} "
                                          f"bytes (UCX_TCP_TX_SEG_SIZE) and this process receives at most {rx} "
                                          f"(UCX_TCP_RX_SEG_SIZE): its replies would drop the connection, so it is "
                                          f"not used; set UCX_TCP_RX_SEG_SIZE={info.tcp_tx} here, or "
                                          f"UCX_TCP_TX_SEG_SIZE={rx} on that server")
            return 0
        try:
            pid = self.engine.add_peer(info.metadata)
        except TransferError as exc:
            self._warn(f"peer:{info.sid}", f"hicache-gds remote: server {info.sid}: {exc}")
            return 0
        self._agents[info.agent] = pid
        return pid

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

    def _peer_timed_out(self, sid: str) -> None:
        """A request to `sid` outlived `io_timeout`: its server still heartbeats but does not
        answer, so every batch hashed to it would wait as long. Set it aside for `io_timeout`,
        doubling with each timeout in a row, and reconnect before its next request (module notes)."""
        with self._lock:
            p = self._peers.get(sid)
            if p is None:
                return
            p.strikes += 1
            p.reconnect = True
            hold = min(self.opts.io_timeout * 2 ** (p.strikes - 1), HOLD_MAX_S)
            p.down_until = max(p.down_until, time.monotonic() + hold)
        self._stats.add(peers_set_aside=1)
        self._warn(f"aside:{sid}", f"hicache-gds remote: server {sid} timed out ({p.strikes} in a row): misses for {hold:.0f} s")

    def _usable(self, p: Peer, now: float) -> bool:
        """Whether requests may go to `p` now (call with `_lock` held). A peer set aside for a
        timeout gets a new connection first: its agent is dropped (a request still in flight on it
        then fails its next poll as a timeout, `NixlTransfer`: it may still land) and loaded again."""
        if not p.peer_id or now < p.down_until:
            return False
        if p.reconnect:
            p.reconnect = False
            self._drop_agent(p.info.agent)
            p.peer_id = self._connect(p.info)  # 0: loaded again by the next refresh
            return bool(p.peer_id)
        return True

    def _live(self) -> list[Peer]:
        now = time.monotonic()
        with self._lock:
            return [p for p in self._peers.values() if p.info.slot_bytes >= self.page_bytes and self._usable(p, now)]

    @staticmethod
    def _pick(key: str, live: list[Peer]) -> Peer:
        """Weighted rendezvous hashing: every client maps a key to the same server of the same live
        set, servers get keys in proportion to their slots, and a server leaving moves only its keys."""
        def score(p: Peer) -> float:
            u = (xxhash.xxh64_intdigest(f"{p.info.sid}\x00{key}".encode()) + 1) / (2.0 ** 64 + 2)
            return -p.info.nslots / math.log(u)
        return max(live, key=score)

    def _peer_of(self, sid: str, epoch: str) -> Peer | None:
        with self._lock:
            p = self._peers.get(sid)
            if p is None or p.info.epoch != epoch or not self._usable(p, time.monotonic()):
                return None
        return p
