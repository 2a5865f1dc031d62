"""A second process on a namespace, driven line by line: for tests of what processes share.

    peer = Peer(gds_path, page=65536, slots=64)      # starts `python -m hicache_gds.testing.peer`
    peer.call("put", keys=["a", "b"])                  # -> [True, True]  (bytes derive from each key)
    peer.call("read", keys=["a"])                      # -> ["ok"] / ["miss"] / ["wrong"]
    peer.call("pin", keys=["a"]); peer.call("unpin")   # hold a lease, as a read in flight does
    peer.kill()                                        # SIGKILL

The child opens a `PageStore` (``Client("store", ...)``: page bytes derived from the key, so any
page read back is checked without remembering it) and answers one JSON line per command. Every
wait on it has a timeout.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

__all__ = ["Peer"]


class Peer:
    """A child process holding one store of a namespace (see the module docstring)."""

    def __init__(self, gds_path: str, *, page: int = 64 << 10, slots: int = 64, identity: dict | None = None,
                 engine: str = "bounce", config: dict | None = None, timeout: float = 120.0) -> None:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [repo, os.environ.get("PYTHONPATH", "")] if p))
        spec = {"gds_path": gds_path, "page": page, "slots": slots, "identity": identity or {"model": "peer"},
                "engine": engine, "config": config or {}}
        self.p = subprocess.Popen([sys.executable, "-m", "hicache_gds.testing.peer", json.dumps(spec)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.timeout = timeout
        self.ready = self._line(timeout)
        self.pid = self.p.pid

    def _line(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        buf = b""
        fd = self.p.stdout.fileno()
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                raise TimeoutError(f"peer {self.p.pid} did not answer in {timeout} s")
            b = os.read(fd, 1 << 20)
            if not b:
                err = self.p.stderr.read().decode(errors="replace")[-3000:]
                raise RuntimeError(f"peer {self.p.pid} exited: {err}")
            buf += b
        out = json.loads(buf)
        if isinstance(out, dict) and "error" in out:
            raise RuntimeError(f"peer {self.p.pid}: {out['error']}")
        return out

    def call(self, op: str, **kw: Any) -> Any:
        self.p.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.p.stdin.flush()
        return self._line(self.timeout)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
        self.p.wait(30)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.call("close")
            except (RuntimeError, TimeoutError, BrokenPipeError):
                pass
            self.p.stdin.close()
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(spec: dict) -> None:
    from .clients import Client
    c = Client("store", spec["gds_path"], page=spec["page"], slots=spec["slots"], engine=spec["engine"],
               pages=64, identity=spec["identity"], config=spec["config"])
    pinned: list[int] = []
    out = sys.stdout

    def say(obj: Any) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"pid": os.getpid(), "namespace": c.store.namespace, "dir": c.store.dirs[0],
         "slots": c.store.stats()["slots"]})
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op, keys = cmd["op"], cmd.get("keys", [])
            if op == "put":
                say(c.put(keys))
            elif op == "read":
                say(["miss" if g is None else "ok" if g == c.expected(k) else "wrong" for k, g in zip(keys, c.read(keys))])
            elif op == "exists":
                say(c.exists(keys))
            elif op == "pin":
                ents = c.store.index.lookup_pin(keys)
                pinned += [e.slot for e in ents if e is not None]
                say([None if e is None else e.slot for e in ents])
            elif op == "unpin":
                c.store.index.unpin(pinned)
                pinned = []
                say(True)
            elif op == "reserve":
                say(c.store.index.reserve(cmd["n"]))
            elif op == "delete":
                say(c.store.delete(keys))
            elif op == "clear":
                say(c.store.clear())
            elif op == "stats":
                say(c.store.stats())
            elif op == "close":
                c.close()
                say(True)
                return
            else:
                say({"error": f"unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001 -- reported to the parent, which raises it
            say({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
