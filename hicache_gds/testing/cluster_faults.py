"""The remote tier across network namespaces, with real faults (`netns.NetLab`; root needed).

    from hicache_gds.testing.cluster_faults import LabConfig, run_fault, run_throughput
    res = run_fault("kill_server", LabConfig(), "/tmp/logs")   # -> FaultResult

Topology: nodes n1, n2, n3 each run a page server (`hicache-gds serve --net-devices eth0`, UCX over
TCP on the node's veth) and a client (`cluster_client`); the directory runs in d1, d2, d3 as a Redis
primary (d1), a replica (d2) and three Sentinels (one per d-node), reached through a
``redis+sentinel://`` URL -- or, with ``ha=False``, as one Redis in d1. Everything is started
here and killed, and the namespaces deleted, in `finally` blocks.

Faults (each in a fresh lab; the fault hits node n2 or the directory at `warm` s, the restore
comes `hold` s later, the run ends `after` s after the fault):

    kill_server       SIGKILL n2's page server; restore: start it again (a new epoch)
    stop_server       SIGSTOP n2's page server (a hung server); restore: SIGCONT
    cut_link          n2's veth on the bridge down; restore: up
    kill_primary      SIGKILL the directory's primary (Sentinel fails over); no restore
    restart_directory SIGKILL every directory process; restore: start them all again, empty

Recovery: per client, from the fault to the end of the first round after it in which every fresh
page was put and read back byte-exact (`first_full`), and to the end of the last round before the
restore that was not (`last_fail`: the tier routes around the fault for good from then on). The
client of a node whose link is cut is left out (it cannot reach anything); its `rejoin` after the
restore is reported instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .netns import NetLab, Proc

__all__ = ["LabConfig", "FaultResult", "Lab", "FAULTS", "run_fault", "run_throughput"]

FAULTS = ("kill_server", "stop_server", "cut_link", "kill_primary", "restart_directory")
REDIS = "/usr/bin/redis-server"
REPO = str(Path(__file__).resolve().parents[2])
SERVICE = "hicache"


@dataclass(frozen=True)
class LabConfig:
    page: int = 2 << 20
    pool: str = "96M"  # per page server, explicit: 48 slots of 2 MiB
    batch: int = 8
    pinned: int = 8
    period: float = 0.25
    ttl: float = 5.0  # page servers' registration TTL
    io_timeout: float = 2.0
    redis_timeout: float = 2.0  # the tier's default; above remote_wait_ms (1000), or an acked write times out
    ha: bool = True
    warm: float = 3.0
    hold: float = 3.0
    after: float = 12.0
    after_directory: float = 20.0  # directory faults: Sentinel's failover, then time to show it holds
    ucx_tls: str = "tcp"
    memory: str = "host"  # or "device": the clients' pages pass as GPU memory (`cluster_client --memory`)


@dataclass
class FaultResult:
    fault: str
    ha: bool
    memory: str = "host"
    rounds: int = 0
    puts: int = 0
    put_failed: int = 0
    gets: int = 0
    misses: int = 0
    wrong: int = 0
    errors: int = 0
    gets_back_s: float | None = None
    first_full_s: float | None = None
    last_fail_s: float | None = None
    rejoin_s: float | None = None
    restored_s: float | None = None  # the restore done (server started, directory answering), after the fault
    pinned_acked: int = 0
    pinned_promised: int = 0
    promised_lost: int = 0
    notes: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return asdict(self)


def _env(devices: str, tls: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(UCX_NET_DEVICES=devices, UCX_MODULES="^ib", NIXL_LOG_LEVEL="ERROR")
    env.pop("UCX_TLS", None)
    if tls:
        env["UCX_TLS"] = tls
    return env


def _wait(cond, timeout: float, what: str, every: float = 0.05) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class Lab:
    """Nodes, directory, page servers and clients of one run (see the module docstring)."""

    def __init__(self, cfg: LabConfig, work: Path, nodes: tuple[str, ...] = ("n1", "n2", "n3")) -> None:
        self.cfg, self.work = cfg, work
        work.mkdir(parents=True, exist_ok=True)
        self.nodes = nodes
        self.dnodes = ("d1", "d2", "d3") if cfg.ha else ("d1",)
        self.prefix = "c" + uuid.uuid4().hex[:8]
        self.net = NetLab([*nodes, *self.dnodes], log_dir=work)
        self.servers: dict[str, Proc] = {}
        self.clients: dict[str, Proc] = {}
        self.redis: dict[str, Proc] = {}
        self.sentinels: dict[str, Proc] = {}
        self.stop_file = work / "stop"
        self.secret = work / "cluster-secret"  # signs the lab's page-server records
        fd = os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, uuid.uuid4().hex.encode())
        os.close(fd)
        ip = self.net.ip
        if cfg.ha:
            self.url = "redis+sentinel://" + ",".join(f"{ip[d]}:26379" for d in self.dnodes) + f"/{SERVICE}"
        else:
            self.url = f"redis://{ip['d1']}:6379/0"

    # -- directory -----------------------------------------------------------------------------
    def _cli(self, node: str, port: int, *cmd: str) -> str:
        import subprocess
        r = subprocess.run(["ip", "netns", "exec", self.net.ns(node), "redis-cli", "-h", self.net.ip[node],
                            "-p", str(port), *cmd], capture_output=True, text=True, timeout=5)
        return r.stdout.strip()

    def start_directory(self) -> None:
        ip = self.net.ip
        for d in self.dnodes[:2]:
            extra = ["--replicaof", ip["d1"], "6379"] if d != "d1" else []
            self.redis[d] = self.net.popen(d, [REDIS, "--port", "6379", "--bind", ip[d], "--save", "",
                                               "--appendonly", "no", "--protected-mode", "no",
                                               "--repl-diskless-sync-delay", "0", "--dir",
                                               str(self.work), "--dbfilename", f"dump-{d}.rdb", *extra],
                                           log=f"redis-{d}.log")
        for d in self.redis:
            _wait(lambda d=d: self._cli(d, 6379, "ping") == "PONG", 15, f"redis in {d}")
        if not self.cfg.ha:
            return
        _wait(lambda: "master_link_status:up" in self._cli("d2", 6379, "info", "replication"), 15, "replica sync")
        for d in self.dnodes:
            conf = self.work / f"sentinel-{d}.conf"
            conf.write_text("\n".join([
                "port 26379", f"bind {ip[d]}", "protected-mode no", f"dir {self.work}",
                f"sentinel monitor {SERVICE} {ip['d1']} 6379 2",
                f"sentinel down-after-milliseconds {SERVICE} 1000",
                f"sentinel failover-timeout {SERVICE} 5000",
                f"sentinel parallel-syncs {SERVICE} 1"]) + "\n")
            self.sentinels[d] = self.net.popen(d, [REDIS, str(conf), "--sentinel"], log=f"sentinel-{d}.log")
        for d in self.dnodes:
            _wait(lambda d=d: self._cli(d, 26379, "ping") == "PONG", 15, f"sentinel in {d}")
        _wait(lambda: "num-other-sentinels" in self._cli("d1", 26379, "sentinel", "master", SERVICE)
              and self._sentinels_known() >= 2, 20, "sentinels to find each other")

    def _sentinels_known(self) -> int:
        out = self._cli("d1", 26379, "sentinel", "master", SERVICE).split("\n")
        try:
            return int(out[out.index("num-other-sentinels") + 1])
        except (ValueError, IndexError):
            return 0

    def primary(self) -> str:
        """The d-node Sentinel names as primary now."""
        if not self.cfg.ha:
            return "d1"
        for d in self.dnodes:
            host = self._cli(d, 26379, "sentinel", "get-master-addr-by-name", SERVICE).split("\n")[0]
            for n, a in self.net.ip.items():
                if a == host:
                    return n
        return "d1"

    def kill_directory(self) -> None:
        for p in [*self.sentinels.values(), *self.redis.values()]:
            p.kill()
        self.sentinels.clear()
        self.redis.clear()

    # -- page servers and clients ----------------------------------------------------------------
    def start_server(self, node: str) -> Proc:
        log = f"serve-{node}-{uuid.uuid4().hex[:4]}.log"
        p = self.net.popen(node, [sys.executable, "-c", "import sys; from hicache_gds.remote.server import main; "
                                  "sys.exit(main())", "--redis", self.url, "--size", self.cfg.pool, "--page-bytes",
                                  str(self.cfg.page), "--name", node, "--prefix", self.prefix, "--ttl",
                                  str(self.cfg.ttl), "--net-devices", "eth0", "--cluster-secret-file", str(self.secret),
                                  "--log-level", "WARNING"],
                           env=_env("eth0", self.cfg.ucx_tls), log=log)
        self.servers[node] = p
        _wait(lambda: p.alive() and b"ready" in (self.work / log).read_bytes() or not p.alive(), 90,
              f"page server in {node}")
        if not p.alive():
            raise RuntimeError(f"page server in {node} exited; see {self.work / log}")
        return p

    def start_client(self, node: str, *extra: str) -> Proc:
        out = self.work / f"client-{node}.jsonl"
        p = self.net.popen(node, [sys.executable, "-m", "hicache_gds.testing.cluster_client", "--url", self.url,
                                  "--prefix", self.prefix, "--name", node, "--out", str(out), "--stop-file",
                                  str(self.stop_file), "--page", str(self.cfg.page), "--batch", str(self.cfg.batch),
                                  "--pinned", str(self.cfg.pinned), "--period", str(self.cfg.period),
                                  "--io-timeout", str(self.cfg.io_timeout), "--redis-timeout",
                                  str(self.cfg.redis_timeout), "--seconds", "300", "--secret-file", str(self.secret),
                                  "--memory", self.cfg.memory, *extra],
                           env=_env("eth0", self.cfg.ucx_tls), log=f"client-{node}.log")
        self.clients[node] = p
        return p

    def rows(self, node: str) -> list[dict[str, Any]]:
        path = self.work / f"client-{node}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        self.net.close()


def _recovery(rows: list[dict[str, Any]], t_fault: float,
              t_restore: float) -> tuple[float | None, float | None, float | None]:
    """(first get served, first full round, last failed round before the restore), in s after the fault."""
    after = [r for r in rows if "r" in r and r["t0"] >= t_fault]
    got = next((r["t1"] - t_fault for r in after if r.get("get", 0) + r.get("pget", 0)), None)
    first = next((r["t1"] - t_fault for r in after if r.get("full")), None)
    fails = [r for r in rows if "r" in r and r["t1"] >= t_fault and r["t0"] < t_restore and not r.get("full")]
    return got, first, (fails[-1]["t1"] - t_fault if fails else 0.0)


def run_fault(fault: str, cfg: LabConfig | None = None, work: str | Path | None = None) -> FaultResult:
    """One fault in a fresh lab; everything started is stopped and the namespaces deleted before return."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    cfg = cfg or LabConfig()
    own = work is None
    workp = Path(work or tempfile.mkdtemp(prefix=f"hg-{fault}-"))
    workp.mkdir(parents=True, exist_ok=True)
    res = FaultResult(fault, cfg.ha, cfg.memory)
    lab = None
    try:
        lab = Lab(cfg, workp)
        lab.start_directory()
        for n in lab.nodes:
            lab.start_server(n)
        for n in lab.nodes:
            lab.start_client(n)
        _wait(lambda: all(any(r.get("ready") for r in lab.rows(n)) for n in lab.nodes)
              or not all(p.alive() for p in lab.clients.values()), 120, "clients ready")
        time.sleep(cfg.warm)
        victim = "n2"
        t_fault = time.monotonic()
        if fault == "kill_server":
            lab.servers[victim].kill()
        elif fault == "stop_server":
            lab.servers[victim].signal(signal.SIGSTOP)
        elif fault == "cut_link":
            lab.net.link(victim, up=False)
        elif fault == "kill_primary":
            old = lab.primary()
            lab.redis[old].kill()
        else:
            lab.kill_directory()
        time.sleep(cfg.hold)
        t_restore = time.monotonic()
        if fault == "kill_server":
            lab.start_server(victim)
        elif fault == "stop_server":
            lab.servers[victim].signal(signal.SIGCONT)
        elif fault == "cut_link":
            lab.net.link(victim, up=True)
        elif fault == "restart_directory":
            lab.start_directory()
        else:
            t_restore = t_fault + cfg.after_directory  # nothing comes back: the whole run is "during"
        if fault != "kill_primary":
            res.restored_s = round(time.monotonic() - t_fault, 2)
        after = cfg.after_directory if fault in ("kill_primary", "restart_directory") else cfg.after
        time.sleep(max(0.0, t_fault + after - time.monotonic()))
        lab.stop_file.touch()
        _wait(lambda: all(not p.alive() or any(r.get("final") for r in lab.rows(n))
                          for n, p in lab.clients.items()), 60, "clients' final reads")
        for n in lab.nodes:
            rows = lab.rows(n)
            rounds = [r for r in rows if "r" in r]
            res.rounds += len(rounds)
            for r in rounds:
                res.errors += "err" in r
                res.puts += r.get("put", 0)
                res.put_failed += r.get("putf", 0)
                res.gets += r.get("get", 0) + r.get("pget", 0)
                res.misses += r.get("miss", 0) + r.get("pmiss", 0)
                res.wrong += r.get("wrong", 0) + r.get("pwrong", 0)
            fin = next((r for r in rows if r.get("final")), None)
            if fin is None:
                res.notes.append(f"client {n} wrote no final line")
            else:
                res.wrong += fin["wrong"]
                res.pinned_acked += fin["acked"]
                res.pinned_promised += fin["promised"]
                res.promised_lost += fin["promised_lost"]
            if not lab.clients[n].alive() and lab.clients[n].popen.returncode not in (0, None):
                res.notes.append(f"client {n} exited {lab.clients[n].popen.returncode}")
            if fault == "cut_link" and n == victim:
                back = next((r for r in rounds if r["t0"] >= t_restore and r.get("full")), None)
                res.rejoin_s = None if back is None else round(back["t1"] - t_restore, 2)
                continue
            got, first, last = _recovery(rows, t_fault, t_restore)
            if got is not None:
                res.gets_back_s = round(max(res.gets_back_s or 0.0, got), 2)
            if first is None:
                res.notes.append(f"client {n}: no full round after the fault")
            else:
                res.first_full_s = round(max(res.first_full_s or 0.0, first), 2)
            res.last_fail_s = round(max(res.last_fail_s or 0.0, last), 2)
    finally:
        if lab is not None:
            lab.close()
        if own:
            import shutil
            shutil.rmtree(workp, ignore_errors=True)
    return res


def run_throughput(batch: int = 64, rounds: int = 5, page: int = 2 << 20, work: str | Path | None = None,
                   transports: tuple[str, ...] = ("veth-tcp", "lo-tcp", "lo-default")) -> dict[str, dict[str, Any]]:
    """Put and get of `batch` pages per call: a client in n1, page servers in n2 and n3 over veth
    TCP; the same with everything in n1 over loopback (UCX_TLS=tcp, and UCX's own choice)."""
    own = work is None
    workp = Path(work or tempfile.mkdtemp(prefix="hg-tput-"))
    out: dict[str, dict[str, Any]] = {}
    pool = f"{(batch * page * 3 // 2) >> 20}M"
    try:
        for tr in transports:
            cfg = LabConfig(page=page, pool=pool, batch=batch, ha=False, ucx_tls="tcp" if "tcp" in tr else "")
            lab = Lab(cfg, workp / tr, nodes=("n1", "n2", "n3"))
            try:
                lab.start_directory()
                if tr.startswith("veth"):
                    lab.start_server("n2")
                    lab.start_server("n3")
                    client_node = "n1"
                else:  # everything in d1, the directory's node: its own address is local (lo)
                    for i in (2, 3):
                        log = f"serve-lo{i}.log"
                        p = lab.net.popen("d1", [sys.executable, "-c", "import sys; from hicache_gds.remote.server "
                                                 "import main; sys.exit(main())", "--redis", lab.url, "--size", pool,
                                                 "--page-bytes", str(page), "--name", f"lo{i}", "--prefix", lab.prefix,
                                                 "--net-devices", "lo", "--cluster-secret-file", str(lab.secret),
                                                 "--log-level", "WARNING"],
                                          env=_env("lo", cfg.ucx_tls), log=log)
                        _wait(lambda: b"ready" in (lab.work / log).read_bytes() or not p.alive(), 90, "server")
                    client_node = "d1"
                p = lab.net.popen(client_node, [sys.executable, "-m", "hicache_gds.testing.cluster_client", "--url",
                                                lab.url, "--prefix", lab.prefix, "--name", "bench", "--out",
                                                str(lab.work / "bench.jsonl"), "--page", str(page), "--batch",
                                                str(batch), "--pinned", "0", "--io-timeout", "30", "--secret-file",
                                                str(lab.secret), "--bench",
                                                str(rounds)],
                                  env=_env("lo" if client_node == "d1" else "eth0", cfg.ucx_tls), log="bench.log")
                p.popen.wait(300)
                rows = [json.loads(x) for x in (lab.work / "bench.jsonl").read_text().splitlines() if x.strip()]
                out[tr] = rows[-1] if rows else {"error": f"no result; see {lab.work / 'bench.log'}"}
            finally:
                lab.close()
    finally:
        if own:
            import shutil
            shutil.rmtree(workp, ignore_errors=True)
    return out
