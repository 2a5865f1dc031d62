"""`hicache-gds serve`: a page server -- a DRAM pool that clients read and write one-sided.

    hicache-gds serve --redis redis://127.0.0.1:6379/0 --size 8G --page-bytes 2M [--name NAME]

The server allocates `--size` bytes of host memory cut into slots of `--page-bytes` (rounded up
to 4 KiB), registers it with a NIXL UCX agent, and publishes the agent's metadata and its free
slots in Redis (`scripts.py` has the schema). From then on it is passive: clients move page bytes
with NIXL READ/WRITE straight between their buffers and the pool, and change the directory with
Redis scripts; page bytes never pass through this process's Python code, nor through Redis.

What the server itself does, in a background thread: heartbeat (refresh the TTL of its
registration; if it lapsed -- the server hung, or Redis restarted -- register again with a new
epoch, which turns every older entry into a miss), give back reservations whose writer died, and
evict least-recently-used pages to keep `--low-water` of the slots free, removing their
directory entries in the same script. The main thread polls the UCX worker, which connection
set-up from new clients needs.

UCX listens on the network devices it is given, by `--net-devices` or `UCX_NET_DEVICES` (``lo``:
this machine only; ``mlx5_0:1``: one RDMA port; ``all``: every device); a server given neither does
not start, since its pool would otherwise be open on every interface. Redis defaults to 127.0.0.1. ``--metrics-port`` serves Prometheus
metrics (`metrics.py` lists them) on ``--metrics-addr`` (127.0.0.1 unless told).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Sequence

from ..stats import Counters

__all__ = ["PageServer", "main"]

log = logging.getLogger("hicache_gds.remote.server")


class PageServer:
    """A registered DRAM pool. `start()` publishes it, `serve()` blocks, `stop()` unpublishes."""

    def __init__(self, redis_url: str, size: int, page_bytes: int, *, name: str = "", prefix: str = "hicache",
                 ttl: float = 10.0, heartbeat: float = 0.0, low_water: float = 0.02, redis_timeout: float = 2.0,
                 prefault: bool = True, secret: bytes | None = None, wait_replicas: int = 1,
                 wait_ms: int = 1000) -> None:
        from .._nixl import new_agent
        from ..memory import HostBuffer, align_up
        from .directory import SID_RE, Directory
        from .ucx import tcp_defaults, tcp_segments

        self.slot_bytes = align_up(page_bytes)
        self.nslots = size // self.slot_bytes
        if page_bytes <= 0 or self.nslots < 1:
            raise ValueError(f"--size {size} holds no slot of {self.slot_bytes} bytes")
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        if not SID_RE.match(self.name):
            raise ValueError(f"server name {self.name!r} must be 1-128 characters of [A-Za-z0-9_.:-]")
        self.ttl = ttl
        self.interval = heartbeat or max(ttl / 4, 0.05)
        self.low_water = int(self.nslots * low_water)
        self.dir = Directory(redis_url, prefix, redis_timeout, wait_replicas=wait_replicas, wait_ms=wait_ms,
                             secret=secret)
        self.buf = HostBuffer(self.nslots * self.slot_bytes, pinned=False)
        if prefault:  # fault the pool in now, not under the first client's writes
            self.buf.numpy()[::4096] = 0
        tcp_defaults()  # gets over TCP are sent back from here in copy-out segments (`ucx.TCP_DEFAULTS`)
        self.agent = new_agent("serve", backends=["UCX"], enable_prog_thread=False)
        self.tcp_tx = tcp_segments()[0] or 0  # published: clients check they can take its replies
        self.reg = self.agent.register_memory([(self.buf.addr, self.buf.nbytes, 0, "")], "DRAM")
        self.metadata = self.agent.get_agent_metadata()
        self.epoch = ""
        self.registered = False
        self.last_state: dict[str, int] = {}
        self.last_beat = 0.0  # monotonic time of the last heartbeat Redis answered
        self.counts = Counters(("heartbeats", "heartbeat_failures", "registrations"))
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def _info(self):  # noqa: ANN202
        from .directory import ServerInfo
        return ServerInfo(sid=self.name, epoch=self.epoch, agent=self.agent.name, metadata=self.metadata,
                          base=self.buf.addr, slot_bytes=self.slot_bytes, nslots=self.nslots,
                          host=socket.gethostname(), pid=os.getpid(), tcp_tx=self.tcp_tx)

    def register(self) -> None:
        """Publish the pool under a new epoch (every slot free). One cut short (Redis failed while
        its free list was filled) is made again, with a new epoch, at the next heartbeat."""
        self.registered = False
        self.epoch = uuid.uuid4().hex[:12]
        self.dir.register_server(self._info(), self.ttl)
        self.registered = True
        self.counts.add(registrations=1)
        self.last_state = {"free": self.nslots, "used": 0, "pending": 0, "evictions": 0}
        self.last_beat = time.monotonic()
        log.info("hicache-gds serve %s: registered epoch %s, %d slots of %d bytes", self.name, self.epoch,
                 self.nslots, self.slot_bytes)

    def beat(self) -> None:
        """One heartbeat: refresh, reclaim, evict; register again if the registration was lost."""
        from .directory import DirectoryUnavailable
        try:
            if not self.registered:
                self.register()
                return
            state = self.dir.heartbeat(self.name, self.epoch, self.ttl, self.low_water)
            if state is None:
                log.warning("hicache-gds serve %s: registration lapsed (hung, or redis restarted); "
                            "registering again, older pages are dropped", self.name)
                self.register()
            else:
                self.last_state = state
                self.counts.add(heartbeats=1)
                self.last_beat = time.monotonic()
        except DirectoryUnavailable as exc:
            self.counts.add(heartbeat_failures=1)
            # Keep serving: once Redis answers, the heartbeat tells whether the registration
            # survived (same epoch) or must be made again (new epoch, older pages dropped).
            log.warning("hicache-gds serve %s: %s", self.name, exc)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="hicache-gds-heartbeat", daemon=True)
        self._thread.start()

    def serve(self, poll: float = 0.002) -> None:
        """Block until `stop()`: poll the UCX worker so new clients can connect."""
        while not self._stop.is_set():
            try:
                self.agent.get_new_notifs()
            except Exception as exc:  # noqa: BLE001
                log.debug("hicache-gds serve: progress: %s", exc)
            time.sleep(poll)

    def stop(self) -> None:
        """Unpublish (entries become misses at once) and release the pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.dir.timeout * 2 + 1)
        try:
            if self.epoch:
                self.dir.unregister_server(self.name, self.epoch)
        except Exception as exc:  # noqa: BLE001
            log.warning("hicache-gds serve %s: could not unregister: %s", self.name, exc)
        try:
            self.agent.deregister_memory(self.reg)
        except Exception:  # noqa: BLE001
            pass
        self.dir.close()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hicache-gds serve", description="Serve a DRAM page pool to the remote tier.")
    p.add_argument("--redis", default=os.environ.get("HICACHE_GDS_REMOTE_URL", "") or "redis://127.0.0.1:6379/0",
                   help="Redis URL of the directory, redis:// or rediss:// (TLS) or redis+sentinel://h:p[,h:p]/service (HA), user:password@ for AUTH (default: "
                        "$HICACHE_GDS_REMOTE_URL, else redis://127.0.0.1:6379/0; put a password there, not on the "
                        "command line, which ps shows)")
    p.add_argument("--size", default="1G", help="bytes of DRAM to serve, e.g. 64G (default %(default)s)")
    p.add_argument("--page-bytes", "--slot-bytes", dest="page_bytes", default="2M",
                   help="slot size: the largest page this server holds (default %(default)s)")
    p.add_argument("--name", default="", help="server id, stable across restarts (default host-pid)")
    p.add_argument("--prefix", default="hicache", help="Redis key prefix (default %(default)s)")
    p.add_argument("--ttl", type=float, default=10.0, help="seconds without heartbeat before pages are misses")
    p.add_argument("--heartbeat", type=float, default=0.0, help="seconds between heartbeats (default ttl/4)")
    p.add_argument("--low-water", type=float, default=0.02,
                   help="fraction of slots kept free by LRU eviction (default %(default)s)")
    p.add_argument("--net-devices", default="",
                   help="UCX_NET_DEVICES for this server: lo, a device list such as mlx5_0:1, or all "
                        "(default: the environment's; one of the two is required)")
    p.add_argument("--cluster-secret-file", default="",
                   help="file (mode 0600) with the cluster secret that signs this server's record; default "
                        "$HICACHE_GDS_CLUSTER_SECRET_FILE, else $HICACHE_GDS_CLUSTER_SECRET, else unsigned")
    p.add_argument("--wait-replicas", type=int, default=int(os.environ.get("HICACHE_GDS_REMOTE_WAIT_REPLICAS") or 1),
                   help="replicas that must acknowledge a registration (capped by those attached; 0: off)")
    p.add_argument("--no-prefault", action="store_true", help="do not touch the pool at start")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on this port at /metrics (default: off)")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="address the metrics listen on (default %(default)s)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hicache-gds serve`; returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    if args.net_devices:
        os.environ["UCX_NET_DEVICES"] = args.net_devices
    elif not os.environ.get("UCX_NET_DEVICES"):
        print("hicache-gds serve: name the network devices clients reach this server on: --net-devices lo "
              "(this machine only), a list such as mlx5_0:1,eth0, or all (or set UCX_NET_DEVICES)", file=sys.stderr)
        return 2
    from ..config import parse_size
    from ..errors import HiCacheGDSError
    from .trust import load_secret
    try:
        server = PageServer(args.redis, parse_size(args.size, key="--size"),
                            parse_size(args.page_bytes, key="--page-bytes"), name=args.name, prefix=args.prefix,
                            ttl=args.ttl, heartbeat=args.heartbeat, low_water=args.low_water,
                            prefault=not args.no_prefault, secret=load_secret(args.cluster_secret_file),
                            wait_replicas=args.wait_replicas)
    except (HiCacheGDSError, ValueError, OSError) as exc:
        print(f"hicache-gds serve: {exc}", file=sys.stderr)
        return 2
    httpd = None
    if args.metrics_port:
        from .metrics import start_metrics
        try:
            httpd = start_metrics(server, args.metrics_port, args.metrics_addr)
        except (HiCacheGDSError, OSError) as exc:
            server.stop()
            print(f"hicache-gds serve: metrics on {args.metrics_addr}:{args.metrics_port}: {exc}", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, lambda *_: server._stop.set())
    signal.signal(signal.SIGINT, lambda *_: server._stop.set())
    server.start()
    print(f"hicache-gds serve: {server.name} ready: {server.nslots} slots of {server.slot_bytes} bytes, "
          f"redis {server.dir.url} prefix {args.prefix}, registered={server.registered}"
          + (f", metrics http://{args.metrics_addr}:{args.metrics_port}/metrics" if httpd else ""), flush=True)
    try:
        server.serve()
    finally:
        server.stop()
        if httpd is not None:
            httpd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
