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
import threading
from typing import Any

import numpy as np

from .._nixl import new_agent, nixl_api
from ..engines.base import Capabilities, EngineOptions, MemKind, Op, Transfer, TransferEngine
from ..errors import EngineUnavailable, PeerDisconnected, TransferError

__all__ = ["NixlUcxEngine", "PeerDisconnected", "ucx_path"]

_GiB = 1 << 30


def ucx_path() -> str:
    """The data path in words, from the UCX settings this process runs with."""
    devs = os.environ.get("UCX_NET_DEVICES", "")
    if devs == "lo":
        return "NIXL UCX one-sided READ/WRITE (cma/tcp on loopback)"
    tls = os.environ.get("UCX_TLS", "") or "transports chosen by UCX"
    return f"NIXL UCX one-sided READ/WRITE ({tls}; net devices {devs or 'all'})"


class _UcxTransfer(Transfer):
    def __init__(self, engine: "NixlUcxEngine", handle: Any, op: Op, nbytes: int, what: str, peer: str) -> None:
        super().__init__(engine.name, op, nbytes, what)
        self._engine = engine
        self._handle = handle
        self._peer = peer
        self._posted = False
        self._lock = threading.Lock()

    def _poll(self) -> bool:
        with self._lock:
            if self._handle is None:
                return True
            agent = self._engine.agent
            try:
                state = agent.check_xfer_state(self._handle) if self._posted else agent.transfer(self._handle)
                self._posted = True
            except Exception as exc:
                self._posted = True
                self._finish()
                if type(exc).__name__ == "nixlRemoteDisconnectError":
                    raise PeerDisconnected(f"{self.engine}: {self.op.value} of {self.what}: peer {self._peer} "
                                           f"disconnected") from exc
                raise
            if state == "ERR":
                self._finish()
                raise TransferError(f"{self.engine}: {self.op.value} of {self.what} reported ERR")
            if state == "DONE":
                self._finish()
                return True
            return False

    def _finish(self) -> None:
        if self._handle is not None:
            try:
                self._engine.agent.release_xfer_handle(self._handle)
            except Exception:  # noqa: BLE001 -- a failed handle may refuse release; the agent stays usable
                pass
            self._handle = None

    # release() stays a no-op: a request still in flight after a timeout keeps its handle, since
    # the remote write or read may still land and the memory must not be reused meanwhile.


class NixlUcxEngine(TransferEngine):
    """NIXL UCX backend; DRAM (and VRAM where UCX was built with CUDA) to remote DRAM pools."""

    name = "nixl-ucx"

    def __init__(self, options: EngineOptions | None = None) -> None:
        super().__init__(options or EngineOptions(direct_io=False))
        self._api = nixl_api()
        self.agent = new_agent("ucx", enable_prog_thread=False)
        try:
            self.agent.create_backend("UCX", {})
        except Exception as exc:  # noqa: BLE001
            raise EngineUnavailable(f"{self.name}: NIXL could not create the UCX backend ({type(exc).__name__})") from exc
        kinds = {MemKind.DRAM}
        try:
            if "VRAM_SEG" in self.agent.get_backend_mem_types("UCX"):
                kinds.add(MemKind.VRAM)
        except Exception:  # noqa: BLE001
            pass
        self._caps = Capabilities(mem_kinds=frozenset(kinds), max_descs=4096, max_request_bytes=4 * _GiB,
                                  max_desc_bytes=_GiB, alignment=1, direct_io=False, gpu_direct=MemKind.VRAM in kinds,
                                  path=ucx_path())
        self._regs: dict[int, Any] = {}
        self._peers: dict[int, str] = {}
        self._next_peer = 1
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def _register(self, addr: int, nbytes: int, kind: MemKind) -> None:
        dev = self.options.device if kind is MemKind.VRAM else 0
        try:
            self._regs[addr] = self.agent.register_memory([(addr, nbytes, dev, "")], kind.value)
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"{self.name}: registering {nbytes} bytes of {kind.value} at {addr:#x} failed: "
                                f"{type(exc).__name__}") from exc

    def _deregister(self, addr: int, nbytes: int, kind: MemKind) -> None:
        reg = self._regs.pop(addr, None)
        if reg is not None:
            self.agent.deregister_memory(reg)

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

    def peer_name(self, peer_id: int) -> str:
        return self._peers.get(peer_id, f"peer {peer_id}")

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
        n = len(mem)
        dev = self.options.device if kind is MemKind.VRAM else 0
        local = np.empty((n, 3), dtype=np.uint64)
        local[:, 0], local[:, 1], local[:, 2] = mem[:, 0], mem[:, 1], dev
        remote = np.empty((n, 3), dtype=np.uint64)
        remote[:, 0], remote[:, 1], remote[:, 2] = file[:, 1], mem[:, 1], 0
        nbytes = int(mem[:, 1].sum())
        what = f"{n} regions / {nbytes} bytes of {kind.value} with {name}"
        try:
            handle = self.agent.initialize_xfer(op.value, self.agent.get_xfer_descs(local, kind.value),
                                                self.agent.get_xfer_descs(remote, "DRAM"), name)
        except Exception as exc:  # noqa: BLE001
            raise TransferError(f"{self.name}: preparing {op.value} of {what} failed: {type(exc).__name__}") from exc
        return _UcxTransfer(self, handle, op, nbytes, what, name)

    def close(self) -> None:
        for pid in list(self._peers):
            self.remove_peer(pid)
        for addr in list(self._regs):
            try:
                self.deregister_memory(addr)
            except Exception:  # noqa: BLE001
                pass
