"""Crash-consistency torture: a writer process is killed with SIGKILL at random points.

    python -m hicache_gds.testing.crash --gds-path DIR --rounds 200

Each round starts a writer (`--worker`) that puts batches of pages whose bytes derive from their
keys, and prints every key once `put` has returned True for it. The parent kills it with SIGKILL
after a random delay, reopens the store and checks:

* every acknowledged page is present and byte-exact (unless evicted: capacity allows it in
  `--evict` runs, where only the next rule applies);
* every page reported present is byte-exact (no torn page is ever served).

Prints one JSON line per run with the figures (kills, acked pages lost, torn pages served,
recovery time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import zlib

import numpy as np

__all__ = ["page_bytes_of", "run_rounds"]


def page_bytes_of(key: str, nbytes: int) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(key.encode())).integers(0, 256, nbytes, dtype=np.uint8)


def _open(gds_path: str, page: int, capacity: int, engine: str):
    from hicache_gds import PageStore
    return PageStore(page, {"model": "crash-test"}, config={"gds_path": gds_path, "capacity": capacity,
                                                            "engine": engine})


def _worker(args: argparse.Namespace) -> None:
    from hicache_gds import Pages
    from hicache_gds.memory import HostBuffer
    store = _open(args.gds_path, args.page, args.capacity, args.engine)
    batch = args.batch
    buf = HostBuffer(batch * args.page)
    store.register_memory(buf.addr, buf.nbytes)
    arr = buf.numpy()
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    i = args.start
    mode = args.mode
    while True:
        keys = [f"r{args.round}-p{i + j}" for j in range(batch)]
        for j, k in enumerate(keys):
            arr[j * args.page:(j + 1) * args.page] = page_bytes_of(k, args.page)
        res = store.put(keys, Pages.contiguous(buf.addr, args.page, range(batch)))
        acked = [k for k, r in zip(keys, res) if r]
        if acked:
            sys.stdout.write("\n".join(acked) + "\n")
            sys.stdout.flush()
        i += batch
        if mode == "clear" and (i // batch) % 4 == 0:
            store.clear()
            sys.stdout.write("CLEARED\n")
            sys.stdout.flush()


def _check(gds_path: str, page: int, capacity: int, engine: str, acked: set[str], evict: bool) -> dict:
    from hicache_gds import Pages
    from hicache_gds.memory import HostBuffer
    t0 = time.perf_counter()
    store = _open(gds_path, page, capacity, engine)
    open_s = time.perf_counter() - t0
    try:
        keys = store.index.keys()  # every key the index reports present
        lost = [k for k in acked if k not in store.index] if not evict else []
        torn = 0
        buf = HostBuffer(64 * page)
        store.register_memory(buf.addr, buf.nbytes)
        for a in range(0, len(keys), 64):
            chunk = keys[a:a + 64]
            buf.numpy()[:] = 0xEE
            res = store.get(chunk, Pages.contiguous(buf.addr, page, range(len(chunk))))
            for j, (k, ok) in enumerate(zip(chunk, res)):
                if ok and not np.array_equal(buf.numpy()[j * page:(j + 1) * page], page_bytes_of(k, page)):
                    torn += 1
                if not ok:
                    torn += 1  # present but unreadable counts against us too
        # Start the next round empty: its keys are new, so re-reading these would prove nothing new.
        store.clear()
        return {"present": len(keys), "acked": len(acked), "acked_lost": len(lost), "torn_served": torn,
                "recovery_s": store.index.recovery_s, "open_s": open_s}
    finally:
        store.close()


def _first_ack(p: subprocess.Popen, timeout: float) -> str:
    """The worker's first acknowledged key (its first line after READY), waited for at most `timeout` s."""
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    if not ready:
        p.kill()
        raise RuntimeError(f"crash worker acknowledged nothing in {timeout:.0f} s")
    return p.stdout.readline()


def run_rounds(gds_path: str, rounds: int, *, page: int = 64 << 10, capacity: int = 512 << 20,
               engine: str = "nixl-posix", batch: int = 16, mode: str = "put", seed: int = 0,
               max_delay: float = 1.5, after_first_ack: bool = False) -> dict:
    """Run `rounds` kill -9 rounds; returns the totals. `after_first_ack`: the kill's delay starts
    once the worker acknowledged its first batch, so every round has pages that must survive."""
    rng = random.Random(seed)
    totals = {"kills": 0, "acked_pages": 0, "acked_lost": 0, "torn_served": 0, "max_recovery_s": 0.0,
              "rounds": rounds, "mode": mode, "engine": engine, "rounds_with_acks": 0, "present_checked": 0}
    evict = mode in ("evict", "clear")
    for r in range(rounds):
        cmd = [sys.executable, "-m", "hicache_gds.testing.crash", "--worker", "--gds-path", gds_path, "--page", str(page),
               "--capacity", str(capacity), "--engine", engine, "--batch", str(batch), "--round", str(r),
               "--mode", mode]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready = p.stdout.readline()  # the store is open: kill somewhere in the put loop
        if ready.strip() != "READY":
            p.kill()
            raise RuntimeError(f"crash worker did not start: {ready!r}")
        first = _first_ack(p, 60.0) if after_first_ack else ""
        time.sleep(rng.uniform(0.05, max_delay))
        os.kill(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        out = first + out
        totals["kills"] += 1
        lines = out.splitlines()
        totals["rounds_with_acks"] += any(k and k not in ("CLEARED", "READY") for k in lines)
        if "CLEARED" in lines:  # only keys acked after the last clear must survive
            lines = lines[len(lines) - 1 - lines[::-1].index("CLEARED") + 1:]
        acked = {k for k in lines if k and k not in ("CLEARED", "READY")}
        res = _check(gds_path, page, capacity, engine, acked, evict)
        totals["acked_pages"] += res["acked"]
        totals["present_checked"] += res["present"]
        totals["acked_lost"] += res["acked_lost"]
        totals["torn_served"] += res["torn_served"]
        totals["max_recovery_s"] = max(totals["max_recovery_s"], res["recovery_s"])
    return totals


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gds-path", required=True)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--page", type=int, default=64 << 10)
    ap.add_argument("--capacity", type=int, default=512 << 20)
    ap.add_argument("--engine", default="nixl-posix")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mode", choices=["put", "evict", "clear"], default="put")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    print(json.dumps(run_rounds(args.gds_path, args.rounds, page=args.page, capacity=args.capacity,
                                engine=args.engine, batch=args.batch, mode=args.mode, seed=args.seed)))


if __name__ == "__main__":
    main()
