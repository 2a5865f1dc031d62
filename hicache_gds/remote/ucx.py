"""`NixlUcxEngine`: one-sided NIXL UCX READ/WRITE between local memory and page servers' pools.

It is a `TransferEngine` whose "files" are peers: `add_peer(metadata)` loads a page server's
NIXL agent metadata (published in Redis, so no listener threads are needed) and returns the id
used in the file column of descriptors, whose offset column is the remote address:

    mem  : uint64 (N, 2) -- (local address, nbytes)
    file : uint64 (N, 2) -- (peer id, remote address)

The agent runs without a progress thread; `Transfer.wait` polls it (a progress thread competing
for the CPU made loopback transfers 2-4x slower on the 2-core CI machine). A peer whose process
died makes the transfer fail with `PeerDisconnected` at once.
"""

from __future__ import annotations

import os
import re
from typing import MutableMapping

import numpy as np

from ..engines.base import Capabilities, EngineOptions, MemKind, Op, Traits, Transfer
from ..engines.nixl_agent import NIXL_MODULES, NixlAgentEngine, NixlTransfer
from ..errors import PeerDisconnected, TransferError

__all__ = ["NixlUcxEngine", "PeerDisconnected", "ucx_path", "TCP_DEFAULTS", "tcp_defaults", "tcp_segments", "ucx_size",
           "tcp_possible"]

_GiB = 1 << 30

TCP_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
"""UCX settings the tier's agents are created with where the environment does not set them.

Over TCP, UCX has no native one-sided GET: a get is served by the page server's worker, which
sends the bytes back as active messages of at most one send segment each, copied into a bounce
buffer and out of the receiver's receive segment. UCX's defaults (8 KiB send, 64 KiB receive)
cut every 2 MiB page into 256 messages; 1 MiB segments on both sides cut it into two and moved
gets over veth TCP from 2.04 to 2.22 GB/s in one run (64 KiB: 2.04, 256 KiB 2.10, 512 KiB 2.13;
benchmarks/results/cpu-run23). Only the TCP transport reads them: RDMA and shared-memory paths
are unchanged.

A receiver drops the connection on a message larger than its receive segment, so a page server's
send segment must not exceed its clients' receive segment: servers publish theirs (`tcp_tx` in
their record) and a client skips a server whose replies it could not take (`peers`), saying which
setting to change. Clients of earlier releases receive 64 KiB and do not check: upgrade clients
before page servers, or run servers with ``UCX_TCP_TX_SEG_SIZE=64k`` until every client is new."""

# UCX's own defaults, where neither the environment nor `TCP_DEFAULTS` set a size
_UCX_TX, _UCX_RX = 8 << 10, 64 << 10
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def tcp_defaults(env: MutableMapping[str, str] | None = None) -> None:
    """Set `TCP_DEFAULTS` in `env` (this process's environment) where unset, before a UCX agent is
    made. UCX refuses a send segment larger than the receive segment (no TCP interface opens), so
    a size the environment sets bounds the other's default."""
    env = os.environ if env is None else env
    tx, rx = (ucx_size(env.get(k)) for k in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"))
    want = ucx_size(TCP_DEFAULTS["UCX_TCP_TX_SEG_SIZE"]) or 0
    if "UCX_TCP_TX_SEG_SIZE" not in env:
        env["UCX_TCP_TX_SEG_SIZE"] = str(rx) if rx is not None and rx < want else TCP_DEFAULTS["UCX_TCP_TX_SEG_SIZE"]
    if "UCX_TCP_RX_SEG_SIZE" not in env:
        env["UCX_TCP_RX_SEG_SIZE"] = str(tx) if tx is not None and tx > want else TCP_DEFAULTS["UCX_TCP_RX_SEG_SIZE"]


def ucx_size(value: str | None) -> int | None:
    """Bytes of a UCX memory-units setting (``65536``, ``64k``, ``1M``, ``1mb``); None for ``auto``,
    ``inf`` or anything else UCX might take that is not a plain size."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)b?\s*", value or "", re.IGNORECASE)
    return int(m.group(1)) * _UNITS[m.group(2).lower()] if m else None


def tcp_segments() -> tuple[int | None, int | None]:
    """(send, receive) segment bytes this process's UCX agents use over TCP (None: not a plain size)."""
    tx, rx = os.environ.get("UCX_TCP_TX_SEG_SIZE"), os.environ.get("UCX_TCP_RX_SEG_SIZE")
    return (_UCX_TX if tx is None else ucx_size(tx)), (_UCX_RX if rx is None else ucx_size(rx))


def tcp_possible() -> bool:
    """Whether UCX may move this process's bytes over TCP (``UCX_TLS`` unset, ``all``, or naming tcp
    and not excluding it)."""
    tls = os.environ.get("UCX_TLS", "").strip().lower()
    if not tls or tls == "all":
        return True
    if tls.startswith("^"):
        return "tcp" not in tls[1:].split(",")
    return "tcp" in tls.split(",")


def ucx_path() -> str:
    """The data path in words, from the UCX settings this process runs with."""
    devs = os.environ.get("UCX_NET_DEVICES", "")
    if devs == "lo":
        return "NIXL UCX one-sided READ/WRITE (cma/tcp on loopback)"
    tls = os.environ.get("UCX_TLS", "") or "transports chosen by UCX"
    return f"NIXL UCX one-sided READ/WRITE ({tls}; net devices {devs or 'all'})"


class NixlUcxEngine(NixlAgentEngine):
    """NIXL UCX backend; DRAM (and VRAM where UCX was built with CUDA) to remote DRAM pools."""

    name = "nixl-ucx"
    traits = Traits(mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}), remote=True, requires=NIXL_MODULES)
    plugin = "UCX"

    def __init__(self, options: EngineOptions | None = None) -> None:
        tcp_defaults()
        super().__init__(options or EngineOptions(direct_io=False))
        self.tcp_tx, self.tcp_rx = tcp_segments()  # as UCX read them when the agent was made
        kinds = {MemKind.DRAM}
        try:
            if "VRAM_SEG" in self.agent.get_backend_mem_types("UCX"):
                kinds.add(MemKind.VRAM)
        except Exception:  # noqa: BLE001
            pass
        self._caps = Capabilities(mem_kinds=frozenset(kinds), max_descs=4096, max_request_bytes=4 * _GiB,
                                  max_desc_bytes=_GiB, alignment=1, direct_io=False, gpu_direct=MemKind.VRAM in kinds,
                                  path=ucx_path())
        self._peers: dict[int, str] = {}
        self._next_peer = 1

    # -- peers take the place of files ------------------------------------------------------
    def add_peer(self, metadata: bytes) -> int:
        """Load a remote agent's metadata (from `get_agent_metadata()`); returns its peer id."""
        try:
            name = self.agent.add_remote_agent(metadata)
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"{self.name}: loading a page server's agent metadata failed: "
                                f"{type(exc).__name__}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        with self._lock:
            pid = self._next_peer
            self._next_peer += 1
            self._peers[pid] = name
        return pid

    def remove_peer(self, peer_id: int) -> None:
        with self._lock:
            name = self._peers.pop(peer_id, None)
        if name is not None and name not in self._peers.values():
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 -- already gone
                pass

    def open_file(self, path: str) -> int:
        raise TransferError(f"{self.name} moves memory to remote pools, not files; peers come from add_peer()")

    def close_file(self, file_id: int) -> None:
        self.remove_peer(file_id)

    def _submit(self, op: Op, kind: MemKind, mem: np.ndarray, file: np.ndarray) -> Transfer:
        peers = np.unique(file[:, 0])
        if len(peers) != 1:
            raise ValueError(f"{self.name}: one request moves to one peer, got {len(peers)}")
        name = self._peers.get(int(peers[0]))
        if name is None:
            raise TransferError(f"{self.name}: peer {int(peers[0])} is not loaded")
        nbytes = int(mem[:, 1].sum())
        what = f"{len(mem)} regions / {nbytes} bytes of {kind.value} with {name}"
        handle = self._prepare(op, kind, mem, file[:, 1], 0, "DRAM", name, what)
        # Posted at the first poll, by the waiting thread (the agent has no progress thread).
        return NixlTransfer(self, handle, op, nbytes, what, peer=name)

    def close(self) -> None:
        for pid in list(self._peers):
            self.remove_peer(pid)
        super().close()
