"""Nodes as Linux network namespaces on one bridge, and the processes a multi-node test runs in them.

    with NetLab(["n1", "n2", "n3", "d1", "d2", "d3"]) as lab:   # root and `ip netns` needed
        p = lab.popen("n1", [sys.executable, "-c", "..."], log="n1.log")
        lab.link("n2", up=False)     # cut n2's cable (its veth peer on the bridge goes down)
        lab.link("n2", up=True)

Each node is a namespace ``<tag>-<node>`` with ``lo`` and one veth ``eth0`` holding
``10.77.0.<k>/24``; the other end of every veth sits on bridge ``br0`` in a hub namespace
``<tag>-hub``. Nothing is routed out of the namespaces: traffic stays between the lab's nodes.
`close()` (also on `__exit__`) kills every process the lab started, resumes stopped ones first,
and deletes the namespaces, which removes the veths and the bridge.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["NetLab", "netns_unavailable", "Proc"]

SUBNET = "10.77.0"


def netns_unavailable() -> str:
    """Why a lab cannot be built here ("" when it can): root, iproute2 and namespace support."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    name = "hgprobe" + uuid.uuid4().hex[:6]
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ""


class Proc:
    """A process started in a node; `pid` is the process itself (`ip netns exec` execs it)."""

    def __init__(self, node: str, popen: subprocess.Popen, log: Path | None) -> None:
        self.node, self.popen, self.log = node, popen, log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL (after SIGCONT, so a stopped process dies too) and reap."""
        if self.alive():
            self.popen.send_signal(signal.SIGCONT)
            self.popen.send_signal(signal.SIGKILL)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout`."""
        if self.alive():
            self.popen.send_signal(signal.SIGCONT)
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


class NetLab:
    """Namespaces ``nodes`` joined by veth pairs to one bridge (see the module docstring)."""

    def __init__(self, nodes: Sequence[str], tag: str = "", log_dir: str | Path | None = None) -> None:
        if len(set(nodes)) != len(nodes) or not nodes or len(nodes) > 200:
            raise ValueError(f"nodes must be 1-200 distinct names, got {list(nodes)!r}")
        self.tag = tag or "hg" + uuid.uuid4().hex[:6]
        self.nodes = list(nodes)
        self.hub = f"{self.tag}-hub"
        self.ip = {n: f"{SUBNET}.{k + 1}" for k, n in enumerate(self.nodes)}
        self._port = {n: f"{self.tag}p{k}" for k, n in enumerate(self.nodes)}  # hub-side veth names (<= 15)
        self.log_dir = Path(log_dir) if log_dir else None
        self.procs: list[Proc] = []
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def _build(self) -> None:
        _ip("netns", "add", self.hub)
        self._made.append(self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for node in self.nodes:
            ns = self.ns(node)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", self._port[node],
                "netns", self.hub)
            _ip("-n", self.hub, "link", "set", self._port[node], "master", "br0")
            _ip("-n", self.hub, "link", "set", self._port[node], "up")
            _ip("-n", ns, "addr", "add", f"{self.ip[node]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # every port of the bridge forwarding (no STP: at once)
            r = _ip("-n", self.hub, "-o", "link", "show", "master", "br0", check=False)
            if r.stdout.count("state UP") == len(self.nodes):
                return
            time.sleep(0.05)
        raise RuntimeError(f"the lab's bridge in {self.hub} did not bring its {len(self.nodes)} ports up")

    def popen(self, node: str, argv: Sequence[str], env: Mapping[str, str] | None = None, log: str = "",
              stdout: int | None = None) -> Proc:
        """Start `argv` in `node`'s namespace; stderr (and stdout unless given) go to `log` under log_dir."""
        path = None
        out = err = subprocess.DEVNULL
        if log and self.log_dir is not None:
            path = self.log_dir / log
            err = open(path, "ab")  # noqa: SIM115 -- the child owns it; closed below once it is started
            out = err
        try:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns(node), *argv], env=dict(env or os.environ),
                                 stdout=out if stdout is None else stdout, stderr=err)
        finally:
            if path is not None:
                err.close()
        proc = Proc(node, p, path)
        self.procs.append(proc)
        return proc

    def link(self, node: str, up: bool) -> None:
        """Cut (`up=False`) or restore `node`'s link: its veth end on the bridge goes down / up."""
        _ip("-n", self.hub, "link", "set", self._port[node], "up" if up else "down")

    def close(self) -> None:
        """Kill every process started here, then delete the namespaces. Idempotent."""
        for p in self.procs:
            p.signal(signal.SIGCONT)
        for p in self.procs:
            p.kill()
        self.procs.clear()
        for ns in reversed(self._made):
            # a process not started through popen() could still hold the namespace: kill it too
            r = _ip("netns", "pids", ns, check=False)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> "NetLab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
