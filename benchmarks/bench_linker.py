"""GDSLinker on the GPU machine: device pool <-> NVMe, against raw O_DIRECT of the same disk and the
pinned-host (bounce) path, in the same run.

    source .gpu/setup.sh && python3 benchmarks/bench_linker.py --dir /var/tmp/hb/linker

Pages are Llama-3-8B-like (32 layers, 8 KV heads x 128, bf16, layer-first device pool): 16 tokens
= 2 MiB and 64 tokens = 8 MiB, ~1 GiB per case. Each round, per case: raw O_DIRECT write -> each
linker's offloads -> drop caches -> raw read -> each linker's loads; rounds interleave so drift hits
every column alike, and every load is checked byte for byte.

* offload: ``--batch`` pages per ``offload()`` (one radix node), all queued, then polled as the
  scheduler does. GB/s = bytes / (first call -> last result); latency = the linker's service time
  per offload (its ``offload_p50/p99_ms``).
* load: one forward batch at a time, ``--batch`` pages each: ``load`` -> ``start_layer_wise_loading``
  -> ``finish_layer_wise_loading``; latency = that whole call sequence per batch.
* raw: bench_core's `Raw` -- one O_DIRECT pwrite/pread per page, ``--qd`` in flight, host memory.

Engines: ``auto`` (what a deployment gets: GDS where the VRAM probe passes -- cuFile compat mode on
the VM) and ``bounce`` (pinned host staging, CUDA copies overlapped with O_DIRECT IO); add
``kvikio`` / ``cufile`` with --engines. An engine may carry linker keys to compare settings in one
run: ``--engines auto,auto:depth=3:read_run=1M:staging_bytes=256M``. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(_ROOT, d) for d in ("benchmarks", "tests", os.path.join("plugins", "sglang"), "")]

import linker_helpers as lh  # noqa: E402
from bench_core import Raw  # noqa: E402
from hicache_gds.bench.raw import drop_caches  # noqa: E402
from hicache_gds.memory import HostBuffer  # noqa: E402
from hicache_gds_sglang.linker import GDSLinker  # noqa: E402


def keys_for(tag: str, n: int) -> list[str]:
    return [f"{tag}-{i:058x}"[:64] for i in range(n)]


def _dev(pool) -> torch.device:
    return pool.buffers()[0].device


def offload_all(lk: GDSLinker, pool, keys: list[str], pages: list[int], batch: int) -> float:
    t0 = time.perf_counter()
    for a in range(0, len(keys), batch):
        idx = lh.page_indices(pages[a:a + batch], pool.page_size, _dev(pool))
        assert lk.offload([lh.kv_transfer(keys[a:a + batch], idx)])
    res = lh.wait_offloads(lk, -(-len(keys) // batch), timeout=300)
    dt = time.perf_counter() - t0
    assert all(res), f"{res.count(False)} offloads failed"
    return dt


def load_all(lk: GDSLinker, pool, keys: list[str], pages: list[int], batch: int, lat: list[float]) -> float:
    t0 = time.perf_counter()
    for a in range(0, len(keys), batch):
        t = time.perf_counter()
        idx = lh.page_indices(pages[a:a + batch], pool.page_size, _dev(pool))
        assert lk.load(f"r{a}", [lh.kv_transfer(keys[a:a + batch], idx)])
        assert lk.finish_layer_wise_loading(lk.start_layer_wise_loading()), "a load failed"
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - t0


def check(pool, src: list[int], dst: list[int]) -> None:
    rs, rd = lh.page_indices(src, pool.page_size, _dev(pool)), lh.page_indices(dst, pool.page_size, _dev(pool))
    for b in pool.buffers():
        assert torch.equal(b[rs].view(torch.uint8), b[rd].view(torch.uint8)), "loaded bytes differ"


def pct(xs: list[float], q: float) -> float:
    v = sorted(xs)
    return v[min(len(v) - 1, int(len(v) * q))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir under .)")
    ap.add_argument("--engines", default="auto,bounce", help="engine[:key=value...] per column, comma-separated")
    ap.add_argument("--tokens", default="16,64", help="tokens per page (Llama-3-8B: 16 -> 2 MiB, 64 -> 8 MiB)")
    ap.add_argument("--total", type=int, default=1024, help="MiB per case")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="pages per offload / per load batch")
    ap.add_argument("--qd", type=int, default=16, help="raw baseline queue depth")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gather-below", default="", help="linker gather_below override (bytes), e.g. to force direct IO")
    ap.add_argument("--staging", default="128M", help="linker staging_bytes")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only checks the script (host engines)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="hicache-gds-linker-bench-", dir=".")
    os.makedirs(base, exist_ok=True)
    engines = [e for e in args.engines.split(",") if e]
    rows, raw_json, resolved = [], {}, {}
    t_start = time.perf_counter()
    for tokens in [int(x) for x in args.tokens.split(",")]:
        page = 2 * args.layers * tokens * args.heads * args.head_dim * 2
        n = max(1, (args.total << 20) // page)
        case = f"{tokens} tok = {page / (1 << 20):g} MiB x {n}"
        pool = lh.make_pool("mha", pages=2 * n + 1, page_size=tokens, layers=args.layers, heads=args.heads,
                            head_dim=args.head_dim, device=args.device)
        lh.fill_random(pool, tokens)
        src, dst = list(range(n)), list(range(n, 2 * n))
        hsrc, hdst = HostBuffer(n * page), HostBuffer(n * page)
        chunk = np.random.default_rng(tokens).integers(0, 256, 1 << 20, dtype=np.uint8)
        hsrc.numpy()[:] = np.resize(chunk, n * page)
        raw = Raw(base, n * page, args.qd)
        linkers = {}
        for i, e in enumerate(engines):
            name, *opts = e.split(":")
            d = os.path.join(base, f"{i}-{name}-{tokens}")
            os.makedirs(d, exist_ok=True)
            extra = {"gds_path": d, "engine": resolved.get(name, name), "capacity": (n + 16) * page,
                     "io_timeout": 120, "staging_bytes": args.staging}
            if args.gather_below:
                extra["gather_below"] = args.gather_below
            extra.update(o.split("=", 1) for o in opts)
            linkers[e] = GDSLinker(lh.server_args("bench/llama-3-8b"), lh.make_params(pool), extra_config=extra)
            resolved[name] = linkers[e].stats()["engine"]  # later cases skip auto's probe: same choice
        r: dict = {"raw_w": [], "raw_r": []}
        for rnd in range(args.rounds):
            keys = keys_for(f"r{rnd}", n)
            r["raw_w"].append(raw.run(True, hsrc, page, n))
            for e, lk in linkers.items():
                lk.store.clear()
                r.setdefault(f"{e}_w", []).append(n * page / offload_all(lk, pool, keys, src, args.batch) / 1e9)
            drop_caches([raw.path] + [p for lk in linkers.values() for p in lk.store.slabs.paths])
            r["raw_r"].append(raw.run(False, hdst, page, n))
            for e, lk in linkers.items():
                for b in pool.buffers():
                    b.view(torch.uint8)[lh.page_indices(dst, tokens, args.device)] = 0
                lat = r.setdefault(f"{e}_lat", [])
                r.setdefault(f"{e}_r", []).append(n * page / load_all(lk, pool, keys, dst, args.batch, lat) / 1e9)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                check(pool, src, dst)
        for e, lk in linkers.items():
            st = lk.stats()
            for op, name in (("w", "device->NVMe"), ("r", "NVMe->device")):
                got, rawm = r[f"{e}_{op}"], statistics.median(r[f"raw_{op}"])
                p50, p99 = ((st.get("offload_p50_ms", 0.0), st.get("offload_p99_ms", 0.0)) if op == "w"
                            else (pct(r[f"{e}_lat"], 0.5), pct(r[f"{e}_lat"], 0.99)))
                rows.append((case, e, name, max(got), statistics.median(got), p50, p99, rawm,
                             statistics.median(got) / rawm,
                             f"{st['mode']}, {len(lk.plan.groups)} group(s), depth {lk.depth}",
                             st["path"]))
            lk.close()
        raw.close()
        raw_json[case] = r
        del pool
        if args.device == "cuda":
            torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "no GPU"
    print(f"\nmachine: {platform.node()}, {gpu}; dir {base}; {args.rounds} rounds; "
          f"{args.batch} pages per batch; raw QD {args.qd}; {time.perf_counter() - t_start:.0f} s\n")
    print("| case | engine | op | GB/s best | GB/s median | batch p50 ms | batch p99 ms | raw O_DIRECT median | "
          "vs raw | linker IO | path |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c, e, op, best, med, p50, p99, rawm, ratio, mode, path in rows:
        print(f"| {c} | {e} | {op} | {best:.2f} | {med:.2f} | {p50:.1f} | {p99:.1f} | {rawm:.2f} | {ratio:.2f} | "
              f"{mode} | {path} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "raw": raw_json}, f, indent=1)


if __name__ == "__main__":
    main()
