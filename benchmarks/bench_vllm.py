"""Store/load throughput of vLLM-shaped KV chunks through the hicache-gds vLLM worker, against raw
O_DIRECT on the same directory in the same run.

    .venv-vllm/bin/python benchmarks/bench_vllm.py --dir /work/bench-gds [--rounds 5] [--chunks 128]
    (.venv-vllm026/bin/python for vLLM 0.26: the same worker, the same numbers)

Shape (Llama-3-8B): 32 layers, 8 KV heads x 128, bf16, 16-token blocks -> one (layer, block) page
is 64 KiB, laid out as vLLM's LBHNC (one allocation, a view per layer); 4 blocks per chunk ->
one stored chunk is 8 MiB in 32 layer regions (blocks of a chunk are consecutive here, so each
layer is one 256 KiB region). The KV tensors are host memory on this machine (DRAM path); on a
GPU machine they would be VRAM.

Each round runs, interleaved: raw write, worker store, (drop page cache), raw read, worker load.
Stores use fresh keys every round; loads read the chunks stored in that round back into other
blocks; the first round's load is checked byte-exact. Prints a markdown table: best GB/s over
rounds, median, and spread ((max - min) / best).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.v1.kv_offload.base import (CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor,  # noqa: E402
                                     GPULoadStoreSpec, make_offload_key)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402

from hicache_gds.bench.raw import DROPPED_ALL, drop_caches  # noqa: E402
from hicache_gds.memory import HostBuffer  # noqa: E402
from hicache_gds_vllm import HiCacheGDSOffloadingSpec, HiCacheLoadSpec, HiCacheStoreSpec  # noqa: E402
from hicache_gds_vllm.spec import store_key  # noqa: E402
from hicache_gds_vllm.testing import offloading_config  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK, BPC = 32, 8, 128, 16, 4
PAGE = BLOCK * HEADS * 2 * HEAD_DIM * 2  # K+V, bf16: 64 KiB
CHUNK = LAYERS * BPC * PAGE  # 8 MiB


def make_config(gds_path: str, capacity: int, verify: bool) -> OffloadingConfig:
    """Llama-3-8B's offloading config, for whichever vLLM (0.26 or 0.33) is installed."""
    extra = {"spec_name": "HiCacheGDSOffloadingSpec", "spec_module_path": "hicache_gds_vllm",
             "blocks_per_chunk": BPC, "gds_path": gds_path, "capacity": capacity, "verify": verify}
    return offloading_config(extra, layers=LAYERS, tokens_per_block=BLOCK, bytes_per_block=LAYERS * PAGE,
                             engine_id="bench")


class Raw:
    """Thread-pool O_DIRECT pwrite/pread of `n` chunk-sized pieces of one aligned buffer."""

    def __init__(self, path: str, buf: HostBuffer, n: int, threads: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.posix_fallocate(self.fd, 0, n * CHUNK)
        self.mv = memoryview(buf.numpy())
        self.n = n
        self.pool = ThreadPoolExecutor(threads)

    def _one(self, write: bool, i: int) -> None:
        mv = self.mv[i * CHUNK:(i + 1) * CHUNK]
        done = 0
        while done < CHUNK:
            k = (os.pwritev if write else os.preadv)(self.fd, [mv[done:]], i * CHUNK + done)
            if k <= 0:
                raise OSError(f"short {'write' if write else 'read'} at chunk {i}")
            done += k

    def run(self, write: bool) -> float:
        t0 = time.perf_counter()
        list(self.pool.map(lambda i: self._one(write, i), range(self.n)))
        if write:
            os.fdatasync(self.fd)
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="directory on the disk under test (not tmpfs)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=128, help="chunks per round (8 MiB each)")
    ap.add_argument("--chunks-per-job", type=int, default=16, help="chunks per vLLM store/load job")
    ap.add_argument("--threads", type=int, default=16, help="raw O_DIRECT threads")
    ap.add_argument("--verify", type=int, default=1, help="checksum pages on load (hicache default: 1)")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    n = args.chunks
    nblocks = 2 * n * BPC  # room to store from the first half and load into the second
    # One page-aligned allocation in LBHNC order: layer l, block b at (l * nblocks + b) * PAGE.
    kv_buf = HostBuffer(LAYERS * nblocks * PAGE)
    kv = torch.frombuffer(kv_buf.numpy(), dtype=torch.uint8).view(LAYERS, nblocks, PAGE)
    kv[:, : n * BPC] = torch.randint(0, 256, (LAYERS, n * BPC, PAGE), dtype=torch.uint8)
    tensors = [CanonicalKVCacheTensor(kv[i].view(torch.int8), PAGE) for i in range(LAYERS)]
    refs = [[CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]]
    spec = HiCacheGDSOffloadingSpec(make_config(args.dir, (args.rounds + 1) * n * CHUNK, bool(args.verify)))
    worker = spec.get_worker(CanonicalKVCaches(tensors, refs))
    raw_buf = HostBuffer(n * CHUNK)
    raw_buf.numpy()[:] = np.random.default_rng(0).integers(0, 256, n * CHUNK, dtype=np.uint8)
    raw = Raw(os.path.join(args.dir, "raw-odirect.bin"), raw_buf, n, args.threads)
    src_blocks = list(range(n * BPC))
    dst_blocks = list(range(n * BPC, 2 * n * BPC))
    per_job = args.chunks_per_job
    results: dict[str, list[float]] = {k: [] for k in ("raw write", "raw read", "worker store", "worker load")}
    cold = True
    job = 0

    def run_jobs(store: bool, keys: list[str]) -> float:
        nonlocal job
        t0 = time.perf_counter()
        for j in range(0, n, per_job):
            ks = keys[j:j + per_job]
            blocks = (src_blocks if store else dst_blocks)[j * BPC:(j + len(ks)) * BPC]
            gpu = GPULoadStoreSpec(blocks, [len(blocks)], [0])
            if store:
                worker.submit_store(job, gpu, HiCacheStoreSpec(ks))
            else:
                worker.submit_load(job, HiCacheLoadSpec(ks), gpu)
            job += 1
        worker.drain()
        dt = time.perf_counter() - t0
        results_ = worker.get_finished()
        moved = sum(r.transfer_size or 0 for r in results_)
        if not all(r.success for r in results_) or moved != len(keys) * CHUNK:
            raise SystemExit(f"{'store' if store else 'load'}: {moved} of {len(keys) * CHUNK} bytes moved")
        return dt

    for rnd in range(args.rounds):
        keys = [store_key(make_offload_key(f"round{rnd}-chunk{i}".encode().ljust(32, b"."), 0)) for i in range(n)]
        results["raw write"].append(n * CHUNK / raw.run(True) / 1e9)
        results["worker store"].append(n * CHUNK / run_jobs(True, keys) / 1e9)
        kv[:, n * BPC:].fill_(0xA5)  # poison the destinations
        cold = drop_caches() == DROPPED_ALL and cold  # nothing else names the store's files here
        results["raw read"].append(n * CHUNK / raw.run(False) / 1e9)
        results["worker load"].append(n * CHUNK / run_jobs(False, keys) / 1e9)
        if rnd == 0 and not torch.equal(kv[:, n * BPC:], kv[:, : n * BPC]):
            raise SystemExit("loaded bytes differ from stored bytes")
        print(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in results.items()) + " GB/s", file=sys.stderr)
    st = worker.stores[0].stats()
    worker.shutdown()
    os.close(raw.fd)
    print(f"\n{n} chunks x {CHUNK >> 20} MiB per round ({n * CHUNK / 2**30:.1f} GiB), {args.rounds} rounds, "
          f"{per_job} chunks per job; reads {'cold (page cache dropped)' if cold else 'possibly cached'}; "
          f"engine: {st.get('path', st.get('engine'))}; verify={bool(args.verify)}; dir {args.dir}\n")
    print("| path | op | best GB/s | median GB/s | spread |")
    print("|---|---|---:|---:|---:|")
    for k, v in results.items():
        path, op = k.split(" ")
        best = max(v)
        print(f"| {'raw O_DIRECT, ' + str(args.threads) + ' threads' if path == 'raw' else 'hicache-gds vLLM worker'} "
              f"| {op} | {best:.2f} | {statistics.median(v):.2f} | {(best - min(v)) / best:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
