"""redis-server and page-server subprocesses for the remote-tier tests (used by conftest.py)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import hicache_gds._nixl  # noqa: F401 -- sets UCX_MODULES=^ib before any UCX agent exists in this process

PAGE = 256 << 10  # page size of the shared servers' slots
REPO = str(Path(__file__).resolve().parents[2])
REDIS = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("UCX_MODULES", "^ib")
    env.setdefault("UCX_NET_DEVICES", "lo")
    return env


class RedisProc:
    """A redis-server on 127.0.0.1 that tests may stop and start again on the same port."""

    def __init__(self, tmp: Path, extra: tuple[str, ...] = (), user: str = "", password: str = "") -> None:
        self.port = free_port()
        self.extra, self.auth = extra, {"username": user or None, "password": password or None}
        cred = f"{user}:{password}@" if password else ""
        self.url = f"redis://{cred}127.0.0.1:{self.port}/0"
        self.tmp = tmp
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.tmp), *self.extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_ping(self.port, **self.auth)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def client(self):  # noqa: ANN201
        import redis
        return redis.Redis.from_url(self.url, socket_timeout=2)


class ServerProc:
    """One `hicache-gds serve` subprocess."""

    def __init__(self, url: str, name: str, prefix: str, size: str, page: int, ttl: float,
                 low_water: float = 0.02, log_dir: Path | None = None, extra: tuple[str, ...] = ()) -> None:
        self.args = [sys.executable, "-c", "import sys; from hicache_gds.remote.server import main; sys.exit(main())",
                     "--redis", url, "--size", size, "--page-bytes", str(page), "--name", name,
                     "--prefix", prefix, "--ttl", str(ttl), "--low-water", str(low_water), "--log-level", "WARNING",
                     *extra]
        self.name = name
        self.log = (log_dir or Path("/tmp")) / f"serve-{name}-{uuid.uuid4().hex[:6]}.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout: float = 60) -> None:
        self.logf = open(self.log, "ab")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self.logf, env=child_env())
        deadline = time.monotonic() + timeout
        line = b""
        os.set_blocking(self.proc.stdout.fileno(), False)
        while b"ready" not in line:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"page server {self.name} did not start; see {self.log}")
            line += self.proc.stdout.read() or b""
            time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(15)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.logf.close()


def wait_ping(port: int, timeout: float = 15.0, **auth) -> None:  # noqa: ANN003
    """Until the Redis on `port` answers PING (RuntimeError after `timeout` seconds)."""
    import redis
    r = redis.Redis(port=port, socket_timeout=1, **auth)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if r.ping():
                break
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis on port {port} did not start")
            time.sleep(0.05)
    r.close()
