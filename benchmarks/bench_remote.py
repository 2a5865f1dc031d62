"""Remote tier vs local NVMe vs a memcpy ceiling, in one run.

    python benchmarks/bench_remote.py --dir /work/bench-remote --batches 64 128 --rounds 5

Starts a redis-server (`--save '' --appendonly no`, 127.0.0.1, free port) and `--servers` page
servers as subprocesses, opens a `RemoteTier` on them, a `PageStore` (engine nixl-posix, O_DIRECT,
so reads come from the disk, not the page cache) under `--dir`, and runs interleaved rounds: in
each round every system, in a rotating order, puts `--per-round` batches of fresh keys and reads
them back into poisoned memory (checked byte for byte after timing), then deletes them. The
ceiling is numpy copying the same batch between two host buffers.

Throughput per round is bytes moved / wall time of the round's batches; the table gives the best
round and the spread (min-max) over rounds, and p50/p99 of per-batch latency over all batches.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import hicache_gds._nixl  # noqa: E402,F401 -- UCX_MODULES=^ib before any UCX agent
from hicache_gds.config import parse_size  # noqa: E402
from hicache_gds.layout import Pages  # noqa: E402
from hicache_gds.memory import HostBuffer  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Memcpy:
    """The ceiling: the same bytes copied between host buffers by numpy, no keys, no IO."""

    name = "memcpy (numpy, host->host)"

    def __init__(self, nbytes: int) -> None:
        self.buf = HostBuffer(nbytes, pinned=False)

    def register_memory(self, addr: int, nbytes: int) -> None:
        pass

    def _views(self, pages: Pages) -> list[np.ndarray]:
        from hicache_gds.memory import view
        return [np.frombuffer(view(int(a), int(n)), np.uint8) for a, n in zip(pages.addrs[:, 0], pages.lens[:, 0])]

    def put(self, keys: list[str], pages: Pages) -> list[bool]:
        out = self.buf.numpy()
        for i, v in enumerate(self._views(pages)):
            out[i * v.size:(i + 1) * v.size] = v
        return [True] * len(keys)

    def get(self, keys: list[str], pages: Pages) -> list[bool]:
        src = self.buf.numpy()
        for i, v in enumerate(self._views(pages)):
            v[:] = src[i * v.size:(i + 1) * v.size]
        return [True] * len(keys)

    def delete(self, keys: list[str]) -> list[bool]:
        return [True] * len(keys)


def start_cluster(args: argparse.Namespace, workdir: str) -> tuple[list[subprocess.Popen], str]:
    port = free_port()
    redis = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                              "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    env = dict(os.environ, PYTHONPATH=str(REPO), UCX_MODULES="^ib")
    procs = [redis]
    time.sleep(0.3)
    need = args.per_round * max(args.batches) * args.page
    size = max(need // args.servers * 2, 64 << 20)
    for i in range(args.servers):
        p = subprocess.Popen([sys.executable, "-c", "import sys; from hicache_gds.remote.server import main; "
                              "sys.exit(main())", "--redis", url, "--size", str(size), "--page-bytes", str(args.page),
                              "--name", f"bench{i}", "--prefix", args.prefix, "--log-level", "WARNING",
                              "--net-devices", "lo"],
                             stdout=subprocess.PIPE, env=env)
        procs.append(p)
    for p in procs[1:]:
        line = p.stdout.readline()
        if b"ready" not in line:
            raise RuntimeError(f"page server failed to start: {line!r}")
    return procs, url


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/work/bench-remote", help="local NVMe directory (on a real disk)")
    ap.add_argument("--page", type=lambda s: parse_size(s), default=2 << 20)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=3, help="batches per system per round")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--prefix", default="bench" + uuid.uuid4().hex[:6])
    args = ap.parse_args(argv)

    from hicache_gds.remote import RemoteTier
    from hicache_gds import PageStore

    os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench-remote-")
    procs, url = start_cluster(args, workdir)
    nmax = max(args.batches)
    src = HostBuffer(nmax * args.page, pinned=False)
    dst = HostBuffer(nmax * args.page, pinned=False)
    src.numpy()[:] = np.random.default_rng(0).integers(0, 256, src.nbytes, dtype=np.uint8)
    ident = {"bench": uuid.uuid4().hex}
    systems: dict[str, object] = {}
    try:
        systems["memcpy"] = Memcpy(nmax * args.page)
        systems["local"] = PageStore(args.page, ident, config={
            "gds_path": args.dir, "engine": "nixl-posix", "capacity": str(2 * args.per_round * nmax * args.page)})
        systems["remote"] = RemoteTier(args.page, ident, config={"remote_url": url, "remote_prefix": args.prefix})
        for s in systems.values():
            s.register_memory(src.addr, src.nbytes)
            s.register_memory(dst.addr, dst.nbytes)
        # warm-up: connections, slab files, first faults
        for s in systems.values():
            k = [f"warm-{i}" for i in range(8)]
            s.put(k, Pages.contiguous(src.addr, args.page, range(8)))
            s.get(k, Pages.contiguous(dst.addr, args.page, range(8)))
            s.delete(k)
        res: dict[tuple[str, int, str], dict[str, list[float]]] = {}
        names = list(systems)
        for r in range(args.rounds):
            for batch in args.batches:
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    s = systems[name]
                    pages = Pages.contiguous(src.addr, args.page, range(batch))
                    into = Pages.contiguous(dst.addr, args.page, range(batch))
                    for op in ("put", "get"):
                        res.setdefault((name, batch, op), {"gbps": [], "lat": []})
                    keys_all, t_put, t_get, bad = [], 0.0, 0.0, 0
                    for b in range(args.per_round):
                        keys = [f"r{r}-b{batch}-{b}-{i}" for i in range(batch)]
                        keys_all += keys
                        t0 = time.perf_counter()
                        ok = s.put(keys, pages)
                        t1 = time.perf_counter()
                        dst.numpy()[:batch * args.page] = 0xA5
                        t2 = time.perf_counter()
                        got = s.get(keys, into)
                        t3 = time.perf_counter()
                        if not (all(ok) and all(got)) or not np.array_equal(dst.numpy()[:batch * args.page],
                                                                            src.numpy()[:batch * args.page]):
                            bad += 1
                        res[(name, batch, "put")]["lat"].append(t1 - t0)
                        res[(name, batch, "get")]["lat"].append(t3 - t2)
                        t_put += t1 - t0
                        t_get += t3 - t2
                    nbytes = args.per_round * batch * args.page
                    res[(name, batch, "put")]["gbps"].append(nbytes / t_put / 1e9)
                    res[(name, batch, "get")]["gbps"].append(nbytes / t_get / 1e9)
                    if bad:
                        print(f"WARNING: {name} batch {batch} round {r}: {bad} batch(es) not byte-exact", file=sys.stderr)
                    s.delete(keys_all)
        paths = {"memcpy": "numpy copy, host memory", "local": systems["local"].stats()["path"],
                 "remote": systems["remote"].stats()["path"] + f", {args.servers} server processes"}
        print(f"\n{args.rounds} interleaved rounds x {args.per_round} batches, pages of {args.page >> 20} MiB, "
              f"GB/s = 1e9 B/s; CPU machine ({os.cpu_count()} cores)\n")
        print("| system | path | batch | op | GB/s best | GB/s spread | batch p50 ms | batch p99 ms |")
        print("|---|---|---|---|---|---|---|---|")
        for batch in args.batches:
            for name in names:
                for op in ("put", "get"):
                    d = res[(name, batch, op)]
                    print(f"| {name} | {paths[name]} | {batch} | {op} | {max(d['gbps']):.2f} | "
                          f"{min(d['gbps']):.2f}-{max(d['gbps']):.2f} | {pct(d['lat'], 50) * 1e3:.1f} | "
                          f"{pct(d['lat'], 99) * 1e3:.1f} |")
    finally:
        for name in ("remote", "local"):
            s = systems.get(name)
            if s is not None:
                try:
                    s.clear()
                finally:
                    s.close()
        for d in getattr(systems.get("local"), "dirs", []):
            shutil.rmtree(d, ignore_errors=True)  # this run's namespace: preallocated slab files
        for p in procs[1:]:
            p.terminate()
        for p in procs[1:]:
            p.wait(15)
        procs[0].kill()
        procs[0].wait(5)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
