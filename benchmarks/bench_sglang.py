"""HiCacheGDS against SGLang's own L3 backends and fio: same host pool, same directory, same bytes, same run.

    sudo .venv-sgl/bin/python benchmarks/bench_sglang.py --dir /mnt/nvme/bench [--rounds 3] [--pages 512]

The pages are Llama-3-8B's: 32 layers x 8 KV heads x 128 x bf16 x 16 tokens = 2 MiB, in a
``page_first`` host pool (tests/sglang_pools.py's CPU mimic of SGLang's MHA pool), moved in
batches of 128 pages (SGLang's STORAGE_BATCH_SIZE). Each backend is driven as SGLang's controller
drives it:

* ``HiCacheGDS`` -- ``batch_set_v1`` / ``batch_get_v1`` (zero-copy, selected by ``interface_v1``);
* ``HiCacheFile`` -- its copy path: ``batch_set(keys, [get_data_page(i)])``, and
  ``batch_get(keys, [get_dummy_flat_data_page()])`` then ``set_from_flat_data_page`` per page;
* ``HiCacheNixl`` -- ``batch_set_v1`` / ``batch_get_v1`` with the NIXL POSIX plugin, O_DIRECT;
* fio -- libaio, O_DIRECT, one 2 MiB page per IO, iodepth 16, the same total bytes.

``--busy`` runs every backend beside a thread spinning in Python (SGLang's scheduler loop is one):
each backend under the thread switch interval its own server would have -- HiCacheGDS the one its
store sets at open (`switch_interval`), the others Python's default -- so the GIL hand-offs of each
read path cost what they cost in a server; ``--same-interval`` puts every backend under the smallest
of them, as in one server process where a store lowered it for all. ``--busy scheduler`` runs that
thread as SGLang's scheduler while requests wait on L3: passes of Python work, each followed by the
plugin's idle hook (`hicache_gds_sglang.idle`), where a HiCacheGDS column waits on its own reads
(add ``gds:policy_idle_wait_ms=0`` for the same column without the wait). ``--profile`` prints a cProfile
of the HiCacheGDS columns' gets in the last round (wall time, GIL waits included), and each round's
line splits a HiCacheGDS get into posting, waiting for IO and exposed checksums (the store's
counters; the rest is the work around the IO); ``--timeline`` prints, for each of those gets, when
each of its requests was posted and completed and how long its checksums ran after the last one.
``--thread-cpu`` adds each get's CPU time per thread of this process (the kernel's per-thread
``schedstat``, in ns; Python threads by name, the rest as ``native``): where a column's CPU goes,
the calling thread against the checksum threads. ``--page-tokens 64`` gives the GPU runs' 8 MiB pages. A column ``gds:stripe=/mnt/a+/mnt/b+...``
stripes hicache-gds's pages over those directories (one per device: its `GDS_PATH`).

Every round writes fresh keys with each backend, drops the page cache (``echo 3 >
/proc/sys/vm/drop_caches`` as root, else ``posix_fadvise(DONTNEED)`` on the files), reads them back
into poisoned slots and checks every byte. Rounds rotate the backend order so drift hits all
columns alike. Prints a markdown table: best GB/s and spread (min-max) of set, of set + ``os.sync()``
(HiCacheFile writes into the page cache; the others write O_DIRECT) and of get, and our ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import contextlib
import cProfile
import pstats
import subprocess
import threading
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests"), HERE]

from hicache_gds.bench.raw import drop_caches  # noqa: E402

PAGE_TOKENS, LAYERS, HEADS, HEAD_DIM = 16, 32, 8, 128


def storage_config(extra):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="bench/llama-3-8b-like", extra_config=extra)


def files_under(root: str) -> list[str]:
    return [os.path.join(d, name) for d, _, names in os.walk(root) for name in names]


class Driver:
    """One backend, driven as SGLang's controller drives it, under the thread switch interval its
    server process would have (`switch_interval`)."""

    def __init__(self, name, backend, pool, zero_copy, switch_interval=None, get_pages=128):
        self.name, self.b, self.pool, self.zero_copy = name, backend, pool, zero_copy
        self.switch_interval = switch_interval
        self.get_pages = get_pages  # pages per get (SGLang's 128; a split's tail reads in smaller ones)

    def _idx(self, pages):
        return torch.cat([torch.arange(p * PAGE_TOKENS, (p + 1) * PAGE_TOKENS) for p in pages])

    def set(self, keys, pages):
        if self.zero_copy:
            return all(self.b.batch_set_v1(keys, self._idx(pages)))
        return self.b.batch_set(keys, [self.pool.get_data_page(p * PAGE_TOKENS) for p in pages])

    def get(self, keys, pages):
        if self.zero_copy:
            return all(self.b.batch_get_v1(keys, self._idx(pages)))
        data = self.b.batch_get(keys, [self.pool.get_dummy_flat_data_page() for _ in keys])
        for d, p in zip(data, pages):
            if d is None:
                return False
            self.pool.set_from_flat_data_page(p * PAGE_TOKENS, d)
        return True


_MADE: list[str] = []  # stripe directories outside the root, removed with it


def make_backends(root, pool, npages, rounds, which):
    out = []
    python_default = sys.getswitchinterval()  # before any store lowers it
    for i, spec in enumerate(w for w in which if w.split(":")[0] == "gds"):
        # "gds" is the default setup; "gds:engine=bounce:nixl_queue=uring" adds a column with those keys
        # (get_pages=N: the column reads in gets of N pages, as a split's tail is read; not a store key)
        from hicache_gds_sglang import HiCacheGDS
        opts = dict(o.split("=", 1) for o in spec.split(":")[1:])
        get_pages = int(opts.pop("get_pages", 128))
        # stripe=/mnt/a+/mnt/b: this column's GDS_PATH is a folder on each (pages striped across them)
        dirs = [os.path.join(x, f"gds{i}") for x in opts.pop("stripe").split("+")] if "stripe" in opts else \
            [os.path.join(root, f"gds{i}")]
        for d in dirs:
            os.makedirs(d, exist_ok=True)
        _MADE.extend(dirs)
        d = ",".join(dirs)
        if len(dirs) > 1:
            opts["stripe"] = f"{len(dirs)} dirs"  # shown in the column's name, not passed on
        sys.setswitchinterval(python_default)
        keys = {k: v for k, v in opts.items() if k != "stripe"}
        b = HiCacheGDS(storage_config({"gds_path": d, "capacity": (rounds + 1) * npages * page_bytes(), **keys}), pool)
        shown = {**opts, **({"get_pages": get_pages} if get_pages != 128 else {})}
        name = "HiCacheGDS" + (f" ({', '.join(f'{k}={v}' for k, v in shown.items())})" if shown else "")
        out.append(Driver(name, b, pool, True, sys.getswitchinterval(), get_pages))
    sys.setswitchinterval(python_default)
    if "file" in which:
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile
        b = HiCacheFile(storage_config({"file_storage_path": os.path.join(root, "file")}))
        b.register_mem_pool_host(pool)
        out.append(Driver("HiCacheFile", b, pool, False, python_default))
    if "nixl" in which:
        # HiCacheNixl imports `nixl._api`; where NIXL's meta-package is missing, hand it the NIXL
        # hicache-gds imported (one NIXL per process: the cu12 and cu13 builds cannot both load).
        from hicache_gds._nixl import nixl_api
        api = nixl_api()
        sys.modules.setdefault("nixl", sys.modules[api.__name__.split(".")[0]])
        sys.modules.setdefault("nixl._api", api)
        os.environ["SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"] = os.path.join(root, "nixl")
        os.environ.setdefault("SGLANG_HICACHE_NIXL_BACKEND_PLUGIN", "POSIX")
        try:
            from sglang.srt.mem_cache.storage.nixl.hicache_nixl import HiCacheNixl
        except ModuleNotFoundError as exc:
            # hicache_nixl imports pool_host only for the HostKVCache type hint; pool_host pulls the
            # quantization stack (compressed_tensors, transformers ...), which a GPU machine without a
            # package index may lack. Stand in for the hint alone; HiCacheNixl's code is unchanged.
            import types
            print(f"note: {exc}; sglang.srt.mem_cache.pool_host stubbed (HostKVCache type hint only)", flush=True)
            for m in [k for k in sys.modules if k.startswith("sglang.srt.mem_cache.pool_host")]:
                del sys.modules[m]
            stub = types.ModuleType("sglang.srt.mem_cache.pool_host")
            stub.HostKVCache = object
            sys.modules["sglang.srt.mem_cache.pool_host"] = stub
            from sglang.srt.mem_cache.storage.nixl.hicache_nixl import HiCacheNixl
        b = HiCacheNixl(storage_config({"l3_cleaner_enabled": False}))
        b.register_mem_pool_host(pool)
        out.append(Driver(f"HiCacheNixl ({os.environ['SGLANG_HICACHE_NIXL_BACKEND_PLUGIN']})", b, pool, True,
                          python_default))
    return out


def phases(d):
    """A HiCacheGDS column's read counters (ns): posting, waiting for IO, exposed checksums."""
    st = getattr(d.b, "stats", None)
    if st is None or not d.name.startswith("HiCacheGDS"):
        return {}
    kv = st().get("kv", {})
    return {k[5:-3]: kv.get(k, 0) for k in ("read_post_ns", "read_wait_ns", "read_verify_ns")}


def thread_cpu_ms() -> dict[str, float]:
    """CPU time so far of each thread of this process, in ms, summed by name (Python threads by
    their names, numbered pool threads as one; threads Python did not start as ``native``)."""
    names = {t.native_id: t.name.rstrip("0123456789").rstrip("_") for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        name = names.get(int(tid), "native")
        out[name] = out.get(name, 0.0) + ns / 1e6
    return out


def page_bytes():
    return 2 * LAYERS * PAGE_TOKENS * HEADS * HEAD_DIM * 2


def fio(root, rw, nbytes, tag):
    argv = ["fio", f"--name={tag}", f"--directory={root}", f"--filename=fio-{tag}.dat", f"--size={nbytes}",
            "--bs=2M", f"--rw={rw}", "--ioengine=libaio", "--direct=1", "--iodepth=16", "--output-format=json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    if job.get("error") or side.get("io_bytes", 0) < nbytes:  # e.g. a full device: never report a 0 GB/s round
        raise SystemExit(f"fio {rw} of {nbytes} bytes in {root} failed (error {job.get('error')}, "
                         f"{side.get('io_bytes', 0)} bytes moved): {out.stderr.strip()[-300:]}")
    return side["bw_bytes"] / 1e9


@contextlib.contextmanager
def request_timeline(out: list):
    """While active, append one record per store read (`PageMover._run`) to `out`: the pages, when
    each request was posted and when the wait for it returned (ms from the read's start), and when
    the read returned, its checksums done. Waits return in request order, so a request that had
    finished earlier shows as a wait returning right after the previous one; no extra polling (NIXL
    POSIX advances only when polled, so that would change what is measured). For the benchmark's
    single calling thread."""
    from hicache_gds.engines import base
    from hicache_gds.store import mover
    run, wait, cur = mover.PageMover._run, base.Transfer.wait, {}

    def ms() -> float:
        return round((time.perf_counter_ns() - cur["t0"]) / 1e6, 1)

    def timed_wait(self, timeout=None):
        got = wait(self, timeout)
        if "t0" in cur:
            cur["waits"].append(ms())
        return got

    def timed_run(self, prep, slots, expect):
        cur.update(t0=time.perf_counter_ns(), waits=[])
        try:
            return run(self, prep, slots, expect)
        finally:
            if prep.op is base.Op.READ:
                out.append({"pages": len(slots), "waits_ms": cur["waits"], "end_ms": ms(),
                            "posted_ms": [round((t.started - cur["t0"]) / 1e6, 1) for _, t in prep.transfers
                                          if t is not None]})
            cur.clear()

    mover.PageMover._run, base.Transfer.wait = timed_run, timed_wait
    try:
        yield out
    finally:
        mover.PageMover._run, base.Transfer.wait = run, wait


def main() -> None:
    global PAGE_TOKENS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/work/bench-sglang", help="on the disk to measure (not tmpfs)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pages", type=int, default=512, help="pages per backend per round (batches of 128)")
    ap.add_argument("--backends", default="gds,file,nixl,fio",
                    help="any of gds,file,nixl,fio,raw; gds:key=value:... adds a HiCacheGDS column with those keys "
                         "(gds:get_pages=16: its gets of 16 pages, as a split's tail is read)")
    ap.add_argument("--busy", nargs="?", const="spin", choices=("spin", "scheduler"),
                    help="a thread busy in Python beside every backend's calls: `spin` (the default) spins; "
                         "`scheduler` runs passes of 0.3 ms of Python, each followed by the plugin's idle hook, "
                         "as SGLang's scheduler does while requests wait on L3 (HiCacheGDS columns wait on their "
                         "reads there unless policy_idle_wait_ms=0; the other backends' loops spin)")
    ap.add_argument("--profile", action="store_true", help="cProfile the HiCacheGDS columns' gets in the last round")
    ap.add_argument("--timeline", action="store_true",
                    help="print when each request of the HiCacheGDS columns' reads completed, last round")
    ap.add_argument("--same-interval", action="store_true",
                    help="every backend under the smallest switch interval of them (as in one server process, "
                         "where a store lowers it for all)")
    ap.add_argument("--thread-cpu", action="store_true", help="each get's CPU time per thread (schedstat)")
    ap.add_argument("--page-tokens", type=int, default=PAGE_TOKENS, help="tokens per page (16: 2 MiB pages; 64: 8 MiB)")
    ap.add_argument("--json", help="write the raw numbers here")
    ap.add_argument("--report", metavar="JSON", help="only print the tables of an earlier --json file")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            j = json.load(f)
        report(j["results"], j["pages"], j["page_bytes"], j["rounds"], j["cold"])
        return
    PAGE_TOKENS = args.page_tokens
    from bench_busy_host import Busy, SchedulerLoop

    def busy(d):
        if args.busy == "scheduler":
            return SchedulerLoop(d.b)
        return Busy() if args.busy else contextlib.nullcontext()
    which = list(dict.fromkeys(args.backends.split(",")))
    import sglang_pools
    root = os.path.abspath(args.dir)
    if os.path.exists(root):
        shutil.rmtree(root)
    os.makedirs(root)
    n = args.pages
    pool = sglang_pools.make_host_pool("mha", "page_first", layer_num=LAYERS, head_num=HEADS, head_dim=HEAD_DIM,
                                       page_size=PAGE_TOKENS, dtype=torch.bfloat16, num_pages=2 * n, fill=True)
    kv = pool.kv_buffer.view(torch.uint8)
    if torch.cuda.is_available():  # as SGLang's own pool (alloc_with_host_register): pinned
        rc = torch.cuda.cudart().cudaHostRegister(kv.data_ptr(), kv.numel(), 0)
        pool.pin_memory = rc == 0
        print(f"host pool: cudaHostRegister {'done' if rc == 0 else f'failed ({rc})'}, as SGLang registers its own",
              flush=True)
    pbytes = page_bytes()
    src, dst = list(range(n)), list(range(n, 2 * n))
    drivers = make_backends(root, pool, n, args.rounds, which)
    if args.same_interval and drivers:
        least = min(d.switch_interval or sys.getswitchinterval() for d in drivers)
        for d in drivers:
            d.switch_interval = least
    results = {d.name: {"set": [], "set+sync": [], "get": []} for d in drivers}
    if "fio" in which:
        results["fio (libaio, O_DIRECT, QD16)"] = {"set": [], "set+sync": [], "get": []}
    raw = None
    if "raw" in which:  # the disk's limit where fio is not installed: O_DIRECT pwrite/pread, QD16
        from bench_core import Raw
        from hicache_gds.memory import HostBuffer
        raw, raw_buf = Raw(root, n * pbytes, 16), HostBuffer(n * pbytes)
        raw_buf.numpy()[:] = np.random.default_rng(0).integers(0, 256, n * pbytes, dtype=np.uint8)
        results["raw O_DIRECT (2 MiB IOs, QD16)"] = {"set": [], "set+sync": [], "get": []}
    how = ""
    for r in range(args.rounds):
        order = drivers[r % len(drivers):] + drivers[:r % len(drivers)] if drivers else []
        for d in order:
            keys = [f"{r:02x}{d.name[:8]}{i:x}".encode().hex()[:64].rjust(64, "0") for i in range(n)]
            if d.switch_interval:
                sys.setswitchinterval(d.switch_interval)
            t0 = time.perf_counter()
            with busy(d):
                ok = all(d.set(keys[i:i + 128], src[i:i + 128]) for i in range(0, n, 128))
            t_set = time.perf_counter() - t0
            os.sync()  # HiCacheFile's pages are still in the page cache when its calls return
            t_sync = time.perf_counter() - t0
            how = drop_caches(files_under(root))
            kv[:, n * PAGE_TOKENS:2 * n * PAGE_TOKENS].fill_(0xA5)
            before = phases(d)
            last_gds = r == args.rounds - 1 and d.name.startswith("HiCacheGDS")
            prof = cProfile.Profile() if args.profile and last_gds else None
            timeline = request_timeline([]) if args.timeline and last_gds else contextlib.nullcontext()
            tc0 = thread_cpu_ms() if args.thread_cpu else {}
            t0, c0 = time.perf_counter(), time.process_time()
            with busy(d), timeline as reads:
                if prof is not None:
                    prof.enable()
                g = d.get_pages
                ok = ok and all(d.get(keys[i:i + g], dst[i:i + g]) for i in range(0, n, g))
                if prof is not None:
                    prof.disable()
            t_get, cpu_get = time.perf_counter() - t0, time.process_time() - c0
            results[d.name].setdefault("get_cpu_ms", []).append(cpu_get * 1e3)  # this process's threads
            if args.thread_cpu:
                per = {k: round(v - tc0.get(k, 0.0), 1) for k, v in thread_cpu_ms().items()}
                per = {k: v for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if v >= 0.1}
                results[d.name].setdefault("get_thread_cpu_ms", []).append(per)
                print(f"get CPU per thread of {d.name}, round {r}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in per.items()))
            for rd in reads or ():
                print(f"timeline of {d.name}: {rd['pages']} pages in {len(rd['posted_ms'])} requests, posted at "
                      f"{rd['posted_ms']} ms; waits returned at {rd['waits_ms']} ms; done at {rd['end_ms']} ms "
                      f"({rd['end_ms'] - max(rd['waits_ms'], default=0):.1f} ms after the last wait)")
            if reads:
                results[d.name]["timeline"] = reads
            if prof is not None:
                print(f"profile of {d.name}'s gets, round {r} (wall time per function, GIL waits included):")
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
            split = {k: (v - before[k]) / 1e6 for k, v in phases(d).items()}
            same = torch.equal(kv[:, :n * PAGE_TOKENS], kv[:, n * PAGE_TOKENS:2 * n * PAGE_TOKENS])
            if not (ok and same):
                raise SystemExit(f"{d.name}: round {r} failed (calls ok={ok}, bytes equal={same})")
            results[d.name]["set"].append(n * pbytes / t_set / 1e9)
            results[d.name]["set+sync"].append(n * pbytes / t_sync / 1e9)
            results[d.name]["get"].append(n * pbytes / t_get / 1e9)
            print(f"round {r} {d.name}: set {results[d.name]['set'][-1]:.2f} GB/s (with sync "
                  f"{results[d.name]['set+sync'][-1]:.2f}), get {results[d.name]['get'][-1]:.2f} GB/s (cold: {how}), "
                  f"bytes checked, get CPU {cpu_get * 1e3:.0f} ms" + ("; get ms: " + ", ".join(f"{k} {v:.0f}" for k, v in split.items()) + 
                                      f" of {t_get * 1e3:.0f}" if split else ""), flush=True)
            if split:
                results[d.name].setdefault("get_phases_ms", []).append(dict(split, total=t_get * 1e3))
        if raw is not None:
            name = "raw O_DIRECT (2 MiB IOs, QD16)"
            results[name]["set"].append(raw.run(True, raw_buf, pbytes, n))
            results[name]["set+sync"].append(results[name]["set"][-1])
            drop_caches(files_under(root))
            results[name]["get"].append(raw.run(False, raw_buf, pbytes, n))
            print(f"round {r} raw: set {results[name]['set'][-1]:.2f} GB/s, get {results[name]['get'][-1]:.2f} GB/s",
                  flush=True)
        if "fio" in which:
            name = "fio (libaio, O_DIRECT, QD16)"
            results[name]["set"].append(fio(root, "write", n * pbytes, f"r{r}"))
            results[name]["set+sync"].append(results[name]["set"][-1])
            drop_caches(files_under(root))
            results[name]["get"].append(fio(root, "read", n * pbytes, f"r{r}"))
            os.unlink(os.path.join(root, f"fio-r{r}.dat"))
            print(f"round {r} fio: set {results[name]['set'][-1]:.2f} GB/s, get {results[name]['get'][-1]:.2f} GB/s",
                  flush=True)
    for d in drivers:
        if hasattr(d.b, "close"):
            d.b.close()
    if raw is not None:
        raw.close()
    if args.busy:
        print(f"\nbusy ({args.busy}): a thread busy in Python beside every call; " + (
            f"every backend under a {drivers[0].switch_interval * 1e3:g} ms switch interval" if args.same_interval
            and drivers else "HiCacheGDS under its store's switch interval, the others under Python's default"))
    report(results, n, pbytes, args.rounds, how)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pages": n, "page_bytes": pbytes, "rounds": args.rounds, "cold": how, "busy": args.busy,
                       "results": results}, f, indent=1)
    shutil.rmtree(root, ignore_errors=True)
    for d in _MADE:
        shutil.rmtree(d, ignore_errors=True)


def report(results, n, page_bytes, rounds, how):
    ops = ("set", "set+sync", "get")
    ours = results.get("HiCacheGDS")
    print(f"\n{n} pages x {page_bytes >> 20} MiB per backend per round, batches of 128, {rounds} rounds, "
          f"reads cold ({how}); GB/s = 1e9 B/s: best (min-max), median\n")
    print("| backend | set | set + sync | get |")
    print("|---|---|---|---|")
    for name, r in results.items():
        cells = [f"{max(r[op]):.2f} ({min(r[op]):.2f}-{max(r[op]):.2f}), {statistics.median(r[op]):.2f}"
                 if r[op] else "-" for op in ops]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if not ours:
        return
    print("\n| HiCacheGDS / this (best / median) | set | set + sync | get |")
    print("|---|---|---|---|")
    for name, r in results.items():
        if name == "HiCacheGDS":
            continue
        cells = [f"{max(ours[op]) / max(r[op]):.2f}x / {statistics.median(ours[op]) / statistics.median(r[op]):.2f}x"
                 if r[op] else "-" for op in ops]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
