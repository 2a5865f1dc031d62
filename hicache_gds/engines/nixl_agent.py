"""What the NIXL engines share: one agent with one backend plugin, memory registration, descriptor
lists built from arrays, and the request handle (post, poll, release).

`nixl_file` (POSIX, GDS, GDS_MT: memory <-> files) and `remote.ucx` (UCX: memory <-> page
servers' pools) differ only in what the remote side of a descriptor is and when a request is
posted. The agent runs without a progress thread (one competing for the CPU made loopback UCX
transfers 2-4x slower on the 2-core CI machine): a request advances when it is polled, and
`Transfer.wait` polls it, never past its timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .._nixl import new_agent, nixl_api
from ..errors import EngineUnavailable, PeerDisconnected, TransferError, TransferTimeout
from .base import Capabilities, EngineOptions, MemKind, Op, Transfer, TransferEngine

__all__ = ["NixlAgentEngine", "NixlTransfer", "NIXL_MODULES"]

NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")
"""NIXL's importable modules, any one of which serves (`Traits.requires`; `_nixl` picks)."""


class NixlTransfer(Transfer):
    """One NIXL xfer handle: posted at construction (`post_now`) or at the first poll, polled to
    DONE or ERR, and released once it finished or failed; `on_finish` runs then, once.

    A remote agent that went away fails the request with `PeerDisconnected`. `release()` stays the
    inherited no-op: a request still in flight after a timeout keeps its handle (and what
    `on_finish` would give back), because the IO may still land and the memory must not be reused
    meanwhile.
    """

    def __init__(self, engine: NixlAgentEngine, handle: Any, op: Op, nbytes: int, what: str, *, peer: str = "",
                 post_now: bool = False, on_finish: Callable[[], None] | None = None) -> None:
        super().__init__(engine.name, op, nbytes, what)
        self._agent = engine.agent
        self._handle = handle
        self._peer = peer
        self._on_finish = on_finish
        self._posted = False
        self._lock = threading.Lock()
        if post_now:
            self._post()

    def _post(self) -> None:
        # Posting at submit rather than at the first wait puts all of a batch's requests in flight.
        try:
            state = self._agent.transfer(self._handle)
        except Exception as exc:  # noqa: BLE001 -- kept as the request's error, raised by its wait
            self._finish()
            self._error = self._fail(self._nixl_error(exc))
            return
        self._posted = True
        if state == "DONE":
            self._finish()
            self.finished = time.perf_counter_ns()

    def _poll(self) -> bool:
        with self._lock:
            if self._handle is None:
                return True
            posted = self._posted
            try:
                agent = self._agent
                state = agent.check_xfer_state(self._handle) if posted else agent.transfer(self._handle)
                self._posted = True
            except Exception as exc:
                self._posted = True
                self._finish()
                err = self._nixl_error(exc, posted)
                if err is exc:
                    raise
                raise err from exc
            if state == "ERR":
                self._finish()
                raise TransferError(f"{self.engine}: {self.op.value} of {self.what} reported ERR")
            if state == "DONE":
                self._finish()
                return True
            return False

    def _nixl_error(self, exc: Exception, posted: bool = False) -> BaseException:
        """The typed error for what NIXL raised (`_fail` wraps the rest in a `TransferError`).

        A posted request whose remote agent this process removed meanwhile (NIXL: not found) is
        a `TransferTimeout`, not a failure: its bytes may still land (removing the agent does not
        cancel what the old connection carries), so its memory and remote slot stay held."""
        name = type(exc).__name__
        if name == "nixlRemoteDisconnectError":
            err: TransferError = PeerDisconnected(f"{self.engine}: {self.op.value} of {self.what}: peer {self._peer} "
                                                  "disconnected")
        elif name == "nixlNotFoundError" and posted and self._peer:
            err = TransferTimeout(f"{self.engine}: {self.op.value} of {self.what}: peer {self._peer} was reconnected "
                                  "while the request was in flight; it may still land")
        else:
            return exc
        err.__cause__ = exc
        return err

    def _finish(self) -> None:
        if self._handle is not None:
            try:
                self._agent.release_xfer_handle(self._handle)
            except Exception:  # noqa: BLE001 -- a failed handle may refuse release; the agent stays usable
                pass
            self._handle = None
        if self._on_finish is not None:
            on_finish, self._on_finish = self._on_finish, None
            on_finish()


class NixlAgentEngine(TransferEngine):
    """A `TransferEngine` over one NIXL agent (no progress thread) with the backend `plugin`.

    Subclasses set ``self._caps`` and build each request with `_prepare` and `NixlTransfer`.
    """

    plugin: ClassVar[str] = ""

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        self._api = nixl_api()
        self.agent = new_agent(self.name.replace("nixl-", ""), enable_prog_thread=False)
        try:
            self.agent.create_backend(self.plugin, self._init_params())
        except Exception as exc:
            hint = self._unavailable_hint()
            raise EngineUnavailable(f"{self.name}: NIXL could not create the {self.plugin} backend "
                                    f"({type(exc).__name__})" + (f"; {hint}" if hint else "")) from exc
        self._caps: Capabilities
        self._regs: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _init_params(self) -> dict[str, str]:
        """The backend's init params (from ``self.options``)."""
        return {}

    def _unavailable_hint(self) -> str:
        """What to check when the backend cannot be created ('' for nothing)."""
        return ""

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    def _register(self, addr: int, nbytes: int, kind: MemKind) -> None:
        dev = self.options.device if kind is MemKind.VRAM else 0
        try:
            self._regs[addr] = self.agent.register_memory([(addr, nbytes, dev, "")], kind.value)
        except Exception as exc:
            raise TransferError(f"{self.name}: registering {nbytes} bytes of {kind.value} at {addr:#x} failed: "
                                f"{type(exc).__name__}") from exc

    def _deregister(self, addr: int, nbytes: int, kind: MemKind) -> None:
        reg = self._regs.pop(addr, None)
        if reg is not None:
            self.agent.deregister_memory(reg)

    def _prepare(self, op: Op, kind: MemKind, mem: np.ndarray, remote_addr: np.ndarray, remote_dev: np.ndarray | int,
                 remote_kind: str, peer: str, what: str) -> Any:
        """An xfer handle moving each ``mem`` row (address, nbytes) to or from (``remote_addr``,
        ``remote_dev``) of ``remote_kind`` at agent ``peer``; `TransferError` if NIXL refuses it."""
        n = len(mem)
        local = np.empty((n, 3), dtype=np.uint64)
        local[:, 0], local[:, 1], local[:, 2] = mem[:, 0], mem[:, 1], self.options.device if kind is MemKind.VRAM else 0
        remote = np.empty((n, 3), dtype=np.uint64)
        remote[:, 0], remote[:, 1], remote[:, 2] = remote_addr, mem[:, 1], remote_dev
        try:
            return self.agent.initialize_xfer(op.value, self.agent.get_xfer_descs(local, kind.value),
                                              self.agent.get_xfer_descs(remote, remote_kind), peer)
        except Exception as exc:
            raise TransferError(f"{self.name}: preparing {op.value} of {what} failed: {type(exc).__name__}") from exc

    def close(self) -> None:
        for addr in list(self._regs):
            try:
                self.deregister_memory(addr)
            except Exception:  # noqa: BLE001 -- the engine is going away; release what still can be
                pass
