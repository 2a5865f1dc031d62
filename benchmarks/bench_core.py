"""PageStore put/get throughput against the raw O_DIRECT bandwidth of the same directory, same run.

    python benchmarks/bench_core.py --dir /mnt/nvme/bench [--engines nixl-posix,bounce] [--mem dram|vram]

Cases: 2 MiB and 8 MiB pages, batches of 64 and 128. Each round runs, per case, raw write ->
store write -> raw read -> store read (reads after dropping the page cache), and rounds are
interleaved so drift hits every column alike. Prints a markdown table: best and median GB/s of
each, the store/raw ratio of the medians, and the spread (max/min) of the store column.
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
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hicache_gds import MemKind, PageStore, Pages  # noqa: E402
from hicache_gds.bench.raw import drop_caches  # noqa: E402
from hicache_gds.memory import HostBuffer, view  # noqa: E402


class Raw:
    """Plain O_DIRECT pwrite/pread, one page per IO, `qd` IOs in flight, on a file in the same directory."""

    def __init__(self, directory: str, nbytes: int, qd: int) -> None:
        self.path = os.path.join(directory, "raw.bin")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
        os.close(fd)
        self.fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
        self.pool = ThreadPoolExecutor(qd)

    def run(self, write: bool, buf: HostBuffer, page: int, n: int) -> float:
        def one(i: int) -> None:
            mv = view(buf.addr + i * page, page)
            k = os.pwritev(self.fd, [mv], i * page) if write else os.preadv(self.fd, [mv], i * page)
            assert k == page
        t = time.perf_counter()
        list(self.pool.map(one, range(n)))
        return n * page / (time.perf_counter() - t) / 1e9

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)
        os.unlink(self.path)


def store_run(store: PageStore, write: bool, pages_of, keys: list[str], batch: int, depth: int) -> float:
    """Batches of `batch` pages, `depth` batches in flight (SGLang runs get and set on separate threads)."""
    chunks = [(a, min(a + batch, len(keys))) for a in range(0, len(keys), batch)]

    def one(ab):
        a, b = ab
        res = (store.put if write else store.get)(keys[a:b], pages_of(a, b))
        assert all(res), f"{'put' if write else 'get'} failed for {b - a - sum(res)} pages"
    t = time.perf_counter()
    with ThreadPoolExecutor(depth) as ex:
        list(ex.map(one, chunks))
    return len(keys) * store.page_bytes / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir under .)")
    ap.add_argument("--engines", default="nixl-posix,bounce")
    ap.add_argument("--mem", choices=["dram", "vram"], default="dram")
    ap.add_argument("--total", default="1024", help="MiB per case")
    ap.add_argument("--pages", default="2,8", help="page sizes in MiB")
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depth", type=int, default=1, help="batches in flight")
    ap.add_argument("--qd", type=int, default=16, help="raw baseline queue depth")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="hicache-gds-bench-", dir=".")
    os.makedirs(base, exist_ok=True)
    total = int(args.total) << 20
    engines = args.engines.split(",")
    kind = MemKind.VRAM if args.mem == "vram" else MemKind.DRAM
    rows = []
    results: dict = {}
    for page_mib in [int(x) for x in args.pages.split(",")]:
        page = page_mib << 20
        n = total // page
        src, dst = HostBuffer(n * page), HostBuffer(n * page)
        src.numpy()[:] = np.random.default_rng(page).integers(0, 256, n * page, dtype=np.uint8)
        if kind is MemKind.VRAM:
            import torch
            vsrc = torch.from_numpy(src.numpy()).cuda()
            vdst = torch.empty_like(vsrc)
            s_addr, d_addr = vsrc.data_ptr(), vdst.data_ptr()
        else:
            s_addr, d_addr = src.addr, dst.addr
        raw = Raw(base, n * page, args.qd)
        stores = {}
        for e in engines:
            d = os.path.join(base, e)
            os.makedirs(d, exist_ok=True)
            st = PageStore(page, {"bench": e, "page": page}, config={"gds_path": d, "engine": e,
                                                                      "capacity": (n + 8) * page},
                           mem_kinds=(kind,))
            st.register_memory(s_addr, n * page, kind)
            st.register_memory(d_addr, n * page, kind)
            stores[e] = st
        for batch in [int(x) for x in args.batches.split(",")]:
            case = f"{page_mib} MiB x {batch}"
            r = results.setdefault(case, {"raw_w": [], "raw_r": []})
            for rnd in range(args.rounds):
                r["raw_w"].append(raw.run(True, src, page, n))
                for e, st in stores.items():
                    st.clear()
                    keys = [f"r{rnd}-b{batch}-{i}" for i in range(n)]
                    r.setdefault(f"{e}_w", []).append(
                        store_run(st, True, lambda a, b: Pages.contiguous(s_addr, page, range(a, b), kind),
                                  keys, batch, args.depth))
                drop_caches([raw.path] + [st.slabs.paths[0] for st in stores.values()])
                r["raw_r"].append(raw.run(False, dst, page, n))
                for e, st in stores.items():
                    keys = [f"r{rnd}-b{batch}-{i}" for i in range(n)]
                    r.setdefault(f"{e}_r", []).append(
                        store_run(st, False, lambda a, b: Pages.contiguous(d_addr, page, range(a, b), kind),
                                  keys, batch, args.depth))
                    if kind is MemKind.DRAM:
                        assert np.array_equal(src.numpy(), dst.numpy()), "read back wrong bytes"
                    else:
                        assert torch.equal(vsrc, vdst), "read back wrong bytes"
            for e, st in stores.items():
                for d, name in (("w", "put"), ("r", "get")):
                    s_, rw = r[f"{e}_{d}"], r[f"raw_{d}"]
                    rows.append((case, e, name, max(s_), statistics.median(s_), max(rw), statistics.median(rw),
                                 statistics.median(s_) / statistics.median(rw), max(s_) / min(s_),
                                 st.stats()["path"]))
        raw.close()
        for st in stores.values():
            st.close()
    print(f"\nmachine: {platform.node()} {os.cpu_count()} cores; dir {base}; mem {args.mem}; "
          f"{args.rounds} rounds; depth {args.depth}; raw QD {args.qd}\n")
    print("| case | engine | op | store best | store median | raw best | raw median | store/raw (median) "
          "| store spread (max/min) | path |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c, e, op, sb, sm, rb, rm, ratio, spread, path in rows:
        print(f"| {c} | {e} | {op} | {sb:.2f} | {sm:.2f} | {rb:.2f} | {rm:.2f} | {ratio:.2f} | {spread:.2f} | {path} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "raw": results}, f, indent=1)


if __name__ == "__main__":
    main()
