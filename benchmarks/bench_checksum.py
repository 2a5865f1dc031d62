"""What the page checksum costs: on the GPU against the IO of the same pages, and on the host
against xxh3 (the checksum before format 2).

    python benchmarks/bench_checksum.py --out results/checksum            # GPU machine: about 1-2 min
    python benchmarks/bench_checksum.py --out /tmp/ck --quick             # CPU: host parts and IO only

Per page size (64 KiB .. 8 MiB, a 64 MiB batch each, the batch one request as the store makes it):

* **GPU kernel**: `checksum.device_checksums` of the batch (Triton, one launch; the torch fallback
  for comparison), pages contiguous and in 64 segments (layer_first), median of several runs
  after a warm-up; GB/s and microseconds per page;
* **IO**: `PageStore` put and get of the same pages between VRAM and `GDS_PATH` (engine `auto`:
  NIXL GDS / GDS_MT where the probe passes -- cuFile compat mode without nvidia-fs -- else the
  bounce engine), get with verification on and off alternating; the kernel's time as a share of
  the IO's, and the measured cost of verified gets (on minus off, over off);
* **host**: hgc1 with numpy and compiled with Numba, and xxh3, on the same pages, one thread and the
  store's hashing pool.

Writes ``checksum.json`` and ``checksum.md`` under ``--out``. Without CUDA the GPU parts say why
and the IO runs from host memory (the CPU machine's figures for verified gets).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hicache_gds import MemKind, PageStore, Pages, checksum  # noqa: E402
from hicache_gds.memory import HostBuffer  # noqa: E402

MiB = 1 << 20
SIZES = [64 << 10, 256 << 10, 1 << 20, 2 << 20, 8 << 20]


def _median_s(fn, reps: int) -> tuple[float, float, float]:
    """(median, min, max) seconds of `fn()` over `reps` runs."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts), max(ts)


def host_rates(page: int, batch: int, reps: int) -> dict:
    from hicache_gds import _checksum_jit

    fns = [("numpy", functools.partial(checksum.checksum, compiled=False))]
    if _checksum_jit.wait_ready():
        fns.append(("numba", checksum.checksum))
    try:
        import xxhash
        fns.append(("xxh3", xxhash.xxh3_64_intdigest))
    except ImportError:  # the baselines only
        pass
    data = np.random.default_rng(page).integers(0, 256, page * batch, dtype=np.uint8)
    pages = [data[i * page:(i + 1) * page] for i in range(batch)]
    out = {}
    workers = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        for name, fn in fns:
            med, lo, hi = _median_s(lambda: [fn(p) for p in pages], reps)
            pmed, plo, phi = _median_s(lambda: list(pool.map(fn, pages)), reps)
            out[name] = {"gbps_1_thread": page * batch / med / 1e9, "gbps_pool": page * batch / pmed / 1e9,
                         "pool_threads": workers, "spread_1_thread": [page * batch / hi / 1e9, page * batch / lo / 1e9]}
    return out


def gpu_kernel(page: int, batch: int, reps: int) -> dict:
    import torch
    dev = torch.device("cuda")
    buf = torch.randint(0, 256, (page * batch,), dtype=torch.uint8, device=dev)
    base = buf.data_ptr()
    whole = (np.uint64(base) + np.arange(batch, dtype=np.uint64) * np.uint64(page)).reshape(-1, 1)
    lens = np.full_like(whole, page)
    nseg = 64 if page % (64 * 4) == 0 else 1
    seg = page // nseg
    # layer_first: segment k of page i at k * batch * seg + i * seg (one "layer" region per segment)
    segs = (np.uint64(base) + (np.arange(nseg, dtype=np.uint64)[None, :] * np.uint64(batch)
                               + np.arange(batch, dtype=np.uint64)[:, None]) * np.uint64(seg))
    slens = np.full_like(segs, seg)
    out = {"pages": batch, "segments": nseg}
    want = checksum.device_checksums(whole, lens, page, impl="torch")
    for name, a, ln, impl in (("triton", whole, lens, "triton"), ("triton_segments", segs, slens, "triton"),
                              ("torch", whole, lens, "torch")):
        if impl == "triton" and not checksum.triton_available():
            out[name] = {"skipped": f"triton: {checksum._triton_state.get('why', 'unavailable')}"}
            continue
        got = checksum.device_checksums(a, ln, page, impl=impl)  # warm-up (compiles)
        if name != "triton_segments":
            assert np.array_equal(got, want), f"{name} disagrees with torch"
        med, lo, hi = _median_s(lambda: checksum.device_checksums(a, ln, page, impl=impl), reps)
        out[name] = {"s": med, "gbps": page * batch / med / 1e9, "us_per_page": med / batch * 1e6,
                     "spread_s": [lo, hi]}
    host = np.frombuffer(buf.cpu().numpy().tobytes(), dtype=np.uint8)
    out["equals_host"] = bool(all(int(want[i]) == checksum.checksum(host[i * page:(i + 1) * page])
                                  for i in range(0, batch, max(1, batch // 8))))
    del buf
    torch.cuda.empty_cache()
    return out


def io_times(root: str, page: int, batch: int, reps: int, vram: bool, engine: str) -> dict:
    d = tempfile.mkdtemp(prefix=f"ck-{page}-", dir=root)
    kind = MemKind.VRAM if vram else MemKind.DRAM
    try:
        with PageStore(page, {"bench": "checksum"}, config={"gds_path": d, "capacity": 2 * page * batch + 8 * MiB,
                                                            "engine": engine}, mem_kinds=(kind,)) as s:
            if vram:
                import torch
                src = torch.randint(0, 256, (page * batch,), dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                s.register_tensor(src)
                s.register_tensor(dst)
                sa, da = src.data_ptr(), dst.data_ptr()
            else:
                hs, hd = HostBuffer(page * batch), HostBuffer(page * batch)
                hs.numpy()[:] = np.random.default_rng(1).integers(0, 256, hs.nbytes, dtype=np.uint8)
                s.register_memory(hs.addr, hs.nbytes)
                s.register_memory(hd.addr, hd.nbytes)
                sa, da = hs.addr, hd.addr
            keys = [f"p{i}" for i in range(batch)]
            src_p = Pages.contiguous(sa, page, range(batch), kind)
            dst_p = Pages.contiguous(da, page, range(batch), kind)
            t0 = time.perf_counter()
            assert all(s.put(keys, src_p))
            put_s = time.perf_counter() - t0
            on, off = [], []
            verify_on, verify_off = s.config.replace(verify=True), s.config.replace(verify=False)
            for _ in range(reps):
                for cfg, acc in ((verify_on, on), (verify_off, off)):
                    s.config = cfg
                    t0 = time.perf_counter()
                    assert all(s.get(keys, dst_p))
                    acc.append(time.perf_counter() - t0)
            st = s.stats()
            if vram:
                import torch
                torch.cuda.synchronize()
                assert torch.equal(src, dst)
            else:
                assert np.array_equal(hs.numpy(), hd.numpy())
            mon, moff = statistics.median(on), statistics.median(off)
            return {"engine": st["engine"], "path": st["path"], "put_s": put_s, "get_verify_s": mon,
                    "get_noverify_s": moff, "get_verify_cost": (mon - moff) / moff,
                    "get_gbps_noverify": page * batch / moff / 1e9, "get_spread_on_s": [min(on), max(on)],
                    "get_spread_off_s": [min(off), max(off)]}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def render(R: dict) -> str:
    L = ["# Page checksum cost\n",
         f"{R['host']}; {R['gpu'] or 'no CUDA GPU'}; GDS_PATH {R['gds_path']}; batch {R['batch_bytes'] >> 20} MiB per "
         f"size; {R['reps']} runs each (median; spreads in the JSON). " + R["note"] + "\n",
         "| page | GPU kernel (Triton) GB/s, us/page | 64 segments GB/s | torch GB/s | get from disk GB/s "
         "(engine) | kernel / get IO | verified get cost (on-off)/off | put s | host numpy 1 thr / pool GB/s | "
         "host Numba 1 thr / pool GB/s | host xxh3 1 thr / pool GB/s |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in R["sizes"]:
        g, io, h = r.get("gpu", {}), r["io"], r["host"]

        def gb(x: dict, k: str = "gbps") -> str:
            return f"{x[k]:.1f}" if k in x else x.get("skipped", "-")[:40]
        tri = g.get("triton", {})
        share = (f"{tri['s'] / io['get_noverify_s']:.1%}" if "s" in tri and io.get("get_noverify_s") else "-")
        L.append(f"| {r['page'] >> 10} KiB | {gb(tri)}" + (f", {tri['us_per_page']:.1f}" if "us_per_page" in tri else "")
                 + f" | {gb(g.get('triton_segments', {}))} | {gb(g.get('torch', {}))} | "
                 f"{io['get_gbps_noverify']:.2f} ({io['engine']}) | {share} | {io['get_verify_cost']:+.1%} | "
                 f"{io['put_s']:.3f} | {h['numpy']['gbps_1_thread']:.1f} / {h['numpy']['gbps_pool']:.1f} | "
                 + (f"{h['numba']['gbps_1_thread']:.1f} / {h['numba']['gbps_pool']:.1f} | " if "numba" in h
                    else "(no Numba) | ")
                 + (f"{h['xxh3']['gbps_1_thread']:.1f} / {h['xxh3']['gbps_pool']:.1f} |" if "xxh3" in h
                    else "(no xxhash) |"))
    L.append("")
    L.append(f"IO path: {R['sizes'][0]['io']['path']}. Command: `{R['command']}`.")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for checksum.json and checksum.md")
    ap.add_argument("--gds-path", help="scratch directory on the disk under test (default: a new one in /var/tmp)")
    ap.add_argument("--batch-mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--sizes", default=",".join(str(s >> 10) for s in SIZES), help="page sizes in KiB")
    ap.add_argument("--quick", action="store_true", help="two sizes, three runs (a dry run)")
    args = ap.parse_args(argv)
    sizes = [int(x) << 10 for x in args.sizes.split(",")]
    reps = args.reps
    if args.quick:
        sizes, reps = [s for s in sizes if s in (64 << 10, 2 << 20)] or sizes[:2], 3
    os.makedirs(args.out, exist_ok=True)
    root = args.gds_path or tempfile.mkdtemp(prefix="hicache-gds-ck-", dir="/var/tmp")
    os.makedirs(root, exist_ok=True)
    try:
        import torch
        cuda = torch.cuda.is_available()
        gpu = torch.cuda.get_device_name(0) if cuda else ""
    except ImportError:
        cuda, gpu = False, ""
    R = {"host": f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}", "gpu": gpu,
         "gds_path": root, "batch_bytes": args.batch_mib * MiB, "reps": reps, "sizes": [],
         "command": " ".join(["python", "benchmarks/bench_checksum.py"] + (argv if argv is not None else sys.argv[1:])),
         "note": ("Without nvidia-fs cuFile runs in compat mode (POSIX underneath): say so, not GDS." if cuda else
                  "No CUDA GPU: GPU columns are empty; IO from host memory.")}
    t_all = time.monotonic()
    engine = args.engine
    try:
        for page in sizes:
            batch = max(1, args.batch_mib * MiB // page)
            r = {"page": page, "batch": batch}
            print(f"[{time.monotonic() - t_all:5.1f} s] {page >> 10} KiB x {batch}", file=sys.stderr, flush=True)
            r["host"] = host_rates(page, min(batch, max(1, (16 * MiB) // page)), reps)
            if cuda:
                r["gpu"] = gpu_kernel(page, batch, reps)
            r["io"] = io_times(root, page, batch, reps, cuda, engine)
            engine = r["io"]["engine"]  # `auto` chose once (its GPU probe runs once, not per size)
            R["sizes"].append(r)
    finally:
        R["wall_s"] = time.monotonic() - t_all
        if not args.gds_path:
            shutil.rmtree(root, ignore_errors=True)
        with open(os.path.join(args.out, "checksum.json"), "w") as f:
            json.dump(R, f, indent=1)
    with open(os.path.join(args.out, "checksum.md"), "w") as f:
        f.write(render(R))
    print(render(R))


if __name__ == "__main__":
    main()
