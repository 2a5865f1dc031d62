"""Forked workers for the reliability runs: a child per call or per worker, its output back
through a pipe, read with timeouts (a child that hangs is killed, never waited on forever)."""

from __future__ import annotations

import json
import os
import select
import signal
import time
import traceback
from typing import Any, Callable

from .targets import STORE, why_unavailable

__all__ = ["fork_call"]


def _fork(fn: Callable[..., Any], *args: Any) -> tuple[int, int]:
    """Run fn(write_fd, *args) in a forked child; returns (pid, read end of its pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            fn(w, *args)
        except BaseException:  # noqa: BLE001
            code = 1
            try:
                os.write(w, ("ERR " + traceback.format_exc().replace("\n", " | ") + "\n").encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def fork_call(fn: Callable[..., Any], *args: Any, timeout: float = 600.0) -> Any:
    """fn(*args) in a forked child; its JSON-able result comes back through a pipe."""
    def child(w: int, *a: Any) -> None:
        res = fn(*a)
        os.write(w, (json.dumps(res) + "\n").encode())

    pid, r = _fork(child, *args)
    data = _read_until_eof(r, timeout)
    if data is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish in {timeout} s")
    os.waitpid(pid, 0)
    text = data.decode(errors="replace").strip()
    last = text.splitlines()[-1] if text else ""
    if last.startswith("ERR "):
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in the child: {last[4:].replace(' | ', chr(10))}")
    return json.loads(last)


def _read_until_eof(fd: int, timeout: float) -> bytes | None:
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                b = os.read(fd, 1 << 16)
                if not b:
                    return b"".join(chunks)
                chunks.append(b)
    finally:
        os.close(fd)


class _Lines:
    """Line reader over a pipe with timeouts (select; no threads, so forking stays safe)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf, self.eof = fd, b"", False

    def next(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                b = os.read(self.fd, 1 << 16)
                if not b:
                    self.eof = True
                self.buf += b
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(errors="replace")

    def rest(self) -> list[str]:
        while not self.eof:
            b = os.read(self.fd, 1 << 16)
            if not b:
                self.eof = True
            self.buf += b
        os.close(self.fd)
        return [ln.decode(errors="replace") for ln in self.buf.split(b"\n") if ln]


def _preload(target: str) -> None:
    """Heavy imports before forking, so every worker and checker starts warm."""
    import hicache_gds.store  # noqa: F401
    from hicache_gds._nixl import nixl_api
    try:
        import torch  # noqa: F401 -- HostBuffer asks torch whether it can pin
    except ImportError:
        pass
    nixl_api()
    if target != STORE:
        why = why_unavailable(target)
        if why:
            raise RuntimeError(why)
