"""A replicated directory for tests: a Redis primary, its replica and Sentinel(s), all on loopback.

`SentinelSet(tmp)` starts them with short failover timings (down-after 1 s, failover-timeout
3 s), so that a SIGKILLed primary is replaced within a few seconds. `url` is the sentinel form the
tier accepts (``redis+sentinel://127.0.0.1:p1[,...]/svc``). Optional `requirepass`/ACL user: the
data nodes then require AUTH (Sentinels do not), and `url` carries the credentials.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from remote_procs import REDIS, free_port, wait_ping as _wait_ping

SERVICE = "hicache"


class SentinelSet:
    def __init__(self, tmp: Path, sentinels: int = 1, user: str = "", password: str = "",
                 down_after_ms: int = 1000, failover_ms: int = 3000) -> None:
        self.tmp = Path(tmp)
        self.user, self.password = user, password
        self.procs: dict[int, subprocess.Popen] = {}
        self.ports = [free_port(), free_port()]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        auth = []
        if password:
            auth = ["--masterauth", password, "--requirepass", password] if not user else [
                "--masteruser", user, "--masterauth", password,
                "--user", user, "on", f">{password}", "~*", "&*", "+@all"]
        self.auth_args = auth
        for i, port in enumerate(self.ports):
            extra = ["--replicaof", "127.0.0.1", str(self.ports[0])] if i else []
            self._start_data(port, extra)
        for port in self.sentinel_ports:
            conf = self.tmp / f"sentinel-{port}.conf"
            lines = [f"port {port}", "bind 127.0.0.1", f"dir {self.tmp}",
                     f"sentinel monitor {SERVICE} 127.0.0.1 {self.ports[0]} 1",
                     f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}",
                     f"sentinel failover-timeout {SERVICE} {failover_ms}",
                     f"sentinel parallel-syncs {SERVICE} 1"]
            if password:
                if user:
                    lines.append(f"sentinel auth-user {SERVICE} {user}")
                lines.append(f"sentinel auth-pass {SERVICE} {password}")
            conf.write_text("\n".join(lines) + "\n")
            self.procs[port] = subprocess.Popen([REDIS, str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL)
            _wait_ping(port)
        self.wait_replica_synced()
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        cred = f"{user}:{password}@" if password else ""
        self.url = f"redis+sentinel://{cred}{hosts}/{SERVICE}"

    def _auth(self) -> dict:
        return {"username": self.user or None, "password": self.password or None}

    def _start_data(self, port: int, extra: list[str]) -> None:
        self.procs[port] = subprocess.Popen(
            [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.tmp), "--dbfilename", f"dump-{port}.rdb", *self.auth_args, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_ping(port, **self._auth())

    def client(self, port: int):  # noqa: ANN201
        import redis
        return redis.Redis(port=port, socket_timeout=2, **self._auth())

    def primary_port(self) -> int:
        import redis
        s = redis.Redis(port=self.sentinel_ports[0], socket_timeout=2)
        host, port = s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        s.close()
        return int(port)

    def wait_replica_synced(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.client(self.primary_port()).info("replication")
            if info.get("connected_slaves", 0) >= 1 and info.get("slave0", {}).get("state") == "online":
                return
            time.sleep(0.05)
        raise RuntimeError("the replica did not sync")

    def kill_primary(self) -> int:
        """SIGKILL the primary; returns its port."""
        port = self.primary_port()
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait(10)
        return port

    def wait_failover(self, old: int, timeout: float = 30.0) -> int:
        """Wait until the sentinels name a new primary that answers as one; its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                port = self.primary_port()
                if port != old and self.client(port).execute_command("ROLE")[0] == b"master":
                    return port
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.1)
        raise RuntimeError("no failover within the timeout")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
