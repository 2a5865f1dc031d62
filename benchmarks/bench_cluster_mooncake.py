"""Mooncake Store on the same network namespaces as bench_cluster_faults.py: put/get throughput.

    sudo python benchmarks/bench_cluster_mooncake.py --venv /work/venv-mooncake --stub-dir DIR \
        [--batch 64 --rounds 5]

Needs a venv with `mooncake-transfer-engine` and `nvidia-cuda-runtime-cu12`, and a stub
`libcuda.so.1` in --stub-dir (recipe: shared/reference/mooncake-on-cpu.md). The master (with its
HTTP metadata server) runs in d1, storage nodes lending DRAM in n2 and n3, a client lending none in
n1, protocol tcp over the nodes' veths -- the remote tier's layout in bench_cluster_faults.py.
Every batch read back is byte-compared after timing. Everything started is killed and the
namespaces deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def worker(args: argparse.Namespace) -> int:
    import numpy as np
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    seg = args.segment if args.role == "storage" else 0
    rc = s.setup(args.ip, f"http://{args.master}:8080/metadata", seg, 16 << 20, "tcp", "", f"{args.master}:50051")
    if rc != 0:
        print(f"setup failed: {rc}", flush=True)
        return 1
    if args.role == "storage":
        print("ready", flush=True)
        while True:
            time.sleep(1)
    page, b = args.page, args.batch
    src = np.frombuffer(os.urandom(b * page), dtype=np.uint8).copy()
    dst = np.zeros(b * page, dtype=np.uint8)
    assert s.register_buffer(src.ctypes.data, src.nbytes) == 0 and s.register_buffer(dst.ctypes.data, dst.nbytes) == 0
    ptr_s = [src.ctypes.data + i * page for i in range(b)]
    ptr_d = [dst.ctypes.data + i * page for i in range(b)]
    sizes = [page] * b
    puts, gets, bad = [], [], 0
    for r in range(args.rounds + 1):  # round 0 warms up
        keys = [f"mc-{r}-{i}" for i in range(b)]
        t0 = time.perf_counter()
        pr = s.batch_put_from(keys, ptr_s, sizes)
        t1 = time.perf_counter()
        dst[:] = 0xA5
        t2 = time.perf_counter()
        gr = s.batch_get_into(keys, ptr_d, sizes)
        t3 = time.perf_counter()
        ok = all(x == 0 for x in pr) and all(x == page for x in gr) and np.array_equal(src, dst)
        s.batch_remove(keys, True)
        if r:
            bad += not ok
            puts.append(b * page / (t1 - t0) / 1e9)
            gets.append(b * page / (t3 - t2) / 1e9)
    print(json.dumps({"bench": True, "batch": b, "rounds": args.rounds, "put_gbps": puts, "get_gbps": gets,
                      "bad_batches": bad, "path": "Mooncake Store 0.3.13.post1, transfer engine tcp"}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default="/work/venv-mooncake")
    ap.add_argument("--stub-dir", default="/work/venv-mooncake/stub")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--page", type=int, default=2 << 20)
    ap.add_argument("--role", default="", choices=["", "storage", "client"])
    ap.add_argument("--ip", default="")
    ap.add_argument("--master", default="")
    ap.add_argument("--segment", type=int, default=512 << 20)
    ap.add_argument("--keep", default="")
    args = ap.parse_args(argv)
    if args.role:
        return worker(args)
    import tempfile
    from hicache_gds.testing.netns import NetLab, netns_unavailable
    why = netns_unavailable()
    if why:
        print(why, file=sys.stderr)
        return 2
    py = f"{args.venv}/bin/python"
    sp = next(Path(args.venv, "lib").glob("python3*/site-packages"))
    env = dict(os.environ, LD_LIBRARY_PATH=f"{args.stub_dir}:{sp}/nvidia/cuda_runtime/lib", PYTHONPATH="")
    work = Path(args.keep or tempfile.mkdtemp(prefix="hg-mc-"))
    work.mkdir(parents=True, exist_ok=True)
    with NetLab(["n1", "n2", "n3", "d1"], log_dir=work) as lab:
        m = lab.ip["d1"]
        lab.popen("d1", [f"{sp}/mooncake/mooncake_master", f"--rpc_address={m}", "--rpc_port=50051",
                         "--enable_http_metadata_server=true", f"--http_metadata_server_host={m}",
                         "--http_metadata_server_port=8080", f"--metrics_host={m}", "--metrics_port=9003"],
                  env=env, log="master.log")
        time.sleep(2)
        for n in ("n2", "n3"):
            lab.popen(n, [py, __file__, "--role", "storage", "--ip", lab.ip[n], "--master", m,
                          "--segment", str(args.batch * args.page)], env=env, log=f"storage-{n}.log")
        deadline = time.monotonic() + 60
        while not all(b"ready" in (work / f"storage-{n}.log").read_bytes() for n in ("n2", "n3")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Mooncake storage nodes did not start; see {work}")
            time.sleep(0.2)
        out = work / "client.out"
        with open(out, "wb") as f:
            c = lab.popen("n1", [py, __file__, "--role", "client", "--ip", lab.ip["n1"], "--master", m, "--batch",
                                 str(args.batch), "--rounds", str(args.rounds), "--page", str(args.page)],
                          env=env, log="client.log", stdout=f)
            c.popen.wait(300)
        lines = [x for x in out.read_text().splitlines() if x.startswith("{")]
        print(lines[-1] if lines else f"no result; see {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
