"""VRAM against DRAM gets of the remote tier on one machine (loopback UCX): 64 x 2 MiB, 6 reps."""
import statistics, tempfile, time, uuid
from pathlib import Path
import numpy as np, torch
from remote_procs import RedisProc, ServerProc
from remote_helpers import Bufs, DeviceBufs, tier
PAGE, N = 2 << 20, 64
tmp = Path(tempfile.mkdtemp())
r = RedisProc(tmp)
servers = [ServerProc(r.url, f"s{i}", "bench", "512M", PAGE, ttl=5.0, log_dir=tmp) for i in range(2)]
try:
    t = tier(r.url, "bench", PAGE, uuid.uuid4().hex)
    print("tier mem kinds", t.stats()["mem_kinds"], "path", t.stats().get("path"))
    keys = [f"k{i}" for i in range(N)]
    hb, db = Bufs(t, N, PAGE), DeviceBufs(t, N, PAGE, "cuda")
    assert t.put(keys, hb.fill(keys)) == [True] * N
    rates = {"DRAM": [], "VRAM": []}
    for rep in range(6):
        for kind, b in (("DRAM", hb), ("VRAM", db)):
            pages = b.poisoned(N)
            t0 = time.perf_counter(); ok = t.get(keys, pages); dt = time.perf_counter() - t0
            assert ok == [True] * N; b.check(keys, ok)
            rates[kind].append(N * PAGE / dt / 1e9)
    for k, v in rates.items():
        print(k, "get GB/s median %.2f (%.2f-%.2f)" % (statistics.median(v), min(v), max(v)))
    print("staged", t.stats()["staged_pages"]); t.clear(); t.close()
finally:
    for s in servers: s.stop()
    r.stop()
