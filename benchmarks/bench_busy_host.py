"""A get beside a busy Python thread: what a serving engine's scheduler loop does to the store.

    python benchmarks/bench_busy_host.py --dir /var/tmp/hgds-busy --out /tmp/busy        # ~1 min

SGLang's scheduler (and vLLM's engine core) run a Python loop that is often busy. The store's get is
many short GIL hand-offs: posting requests, polling NIXL POSIX (which advances only when polled),
checksum threads between numpy calls. Each time one of them wants the GIL back from a thread busy
in Python it waits the whole thread switch interval (5 ms unless changed): the convoy effect. The
store lowers the interval on open (`switch_interval`, 0.5 ms by default); this measures why.

Per engine and interval (5 ms, Python's default, against the store's): `PageStore.get` of
``--pages`` pages of ``--page-mib`` MiB in two halves per page (SGLang's ``page_first`` K and V),
O_DIRECT, checksums verified, into registered host memory, with and without a thread spinning in
Python beside it; interleaved repetitions, medians and ranges, and busy / idle per interval.
Writes ``busy_host.json`` and ``busy_host.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hicache_gds import PageStore, Pages  # noqa: E402
from hicache_gds.memory import HostBuffer  # noqa: E402
from hicache_gds.testing import random_bytes  # noqa: E402

MiB = 1 << 20


class Busy:
    """A thread spinning in Python until stopped (what a busy scheduler loop looks like to the GIL)."""

    def __init__(self) -> None:
        self._stop = False
        self._t = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop:
            n += 1

    def __enter__(self) -> "Busy":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._t.join()


class SchedulerLoop(Busy):
    """SGLang's scheduler while requests wait on L3 reads: passes of Python work (`pass_ms` each),
    each followed by the plugin's idle hook (`hicache_gds_sglang.idle.after_idle`), which waits on
    `backend`'s reads where that backend is HiCacheGDS with its idle wait on, and otherwise returns
    at once, so the loop spins as SGLang's does."""

    def __init__(self, backend: object = None, pass_ms: float = 0.3) -> None:
        super().__init__()
        self._backend, self._pass_s = backend, pass_ms / 1e3

    def _spin(self) -> None:
        from types import SimpleNamespace

        from hicache_gds_sglang import idle
        cc = SimpleNamespace(storage_backend=self._backend, enable_storage=True)
        sched = SimpleNamespace(tree_cache=SimpleNamespace(cache_controller=cc, ongoing_prefetch={"waiting": None}),
                                running_batch=None)
        while not self._stop:
            t = time.perf_counter()
            while time.perf_counter() - t < self._pass_s:
                pass
            idle.after_idle(None, sched)


def run_engine(engine: str, root: str, pages: int, page_mib: int, reps: int, intervals: list[float]) -> dict:
    seg = page_mib * MiB // 2
    page = 2 * seg
    d = os.path.join(root, engine)
    os.makedirs(d, exist_ok=True)
    store = PageStore(page, {"bench": "busy_host", "engine": engine},
                      config={"gds_path": [d], "capacity": (pages + 16) * page, "engine": engine,
                              "switch_interval": 0})  # the bench sets the interval itself
    src, dst = HostBuffer(pages * page), HostBuffer(pages * page)
    try:
        for b in (src, dst):
            store.register_memory(b.addr, b.nbytes)
        data = random_bytes(src, 7)

        def layout(base: int) -> Pages:  # page_first: every page's K half in the first half of the pool
            ptrs = np.stack([base + np.arange(pages, dtype=np.uint64) * seg,
                             base + (pages + np.arange(pages, dtype=np.uint64)) * seg], axis=1).ravel()
            return Pages.from_segments(ptrs, [seg], 2)

        keys = [f"p{i}" for i in range(pages)]
        if not all(store.put(keys, layout(src.addr))):
            raise RuntimeError(f"{engine}: put failed")
        rates: dict[str, list[float]] = {}
        for _ in range(reps):
            for iv in intervals:
                for busy in (False, True):
                    sys.setswitchinterval(iv)
                    dst.numpy()[:] = 0xEE
                    out: dict = {}

                    def get() -> None:  # on its own thread, as SGLang's prefetch thread calls it
                        t0 = time.perf_counter()
                        out["ok"] = store.get(keys, layout(dst.addr))
                        out["s"] = time.perf_counter() - t0
                    th = threading.Thread(target=get)
                    if busy:
                        with Busy():
                            th.start()
                            th.join()
                    else:
                        th.start()
                        th.join()
                    if not all(out["ok"]) or dst.numpy().tobytes() != data.tobytes():
                        raise RuntimeError(f"{engine}: a get returned wrong or missing pages")
                    rates.setdefault(f"{iv * 1e3:g}ms/{'busy' if busy else 'idle'}", []).append(
                        pages * page / out["s"] / 1e9)
        st = store.stats()
        return {"engine": st.get("engine"), "path": st.get("path"), "rates_gbs": rates}
    finally:
        store.close()
        src.close()
        dst.close()
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure (removed after)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--engines", default="nixl-posix,bounce")
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--page-mib", type=int, default=8, help="the 8B shape's page at 64 tokens: 8 MiB")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--store-interval", type=float, default=0.0005)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.dir, exist_ok=True)
    before = sys.getswitchinterval()
    intervals = [0.005, a.store_interval]
    doc = {"machine": platform.node(), "cpus": os.cpu_count(), "pages": a.pages, "page_mib": a.page_mib,
           "reps": a.reps, "intervals_s": intervals, "engines": {}}
    try:
        for eng in a.engines.split(","):
            doc["engines"][eng] = run_engine(eng, a.dir, a.pages, a.page_mib, a.reps, intervals)
    finally:
        sys.setswitchinterval(before)
    lines = [f"# get beside a busy Python thread ({a.pages} x {a.page_mib} MiB pages, page_first halves, "
             f"verified, {a.reps} interleaved reps, {os.cpu_count()} CPUs)", "",
             "| engine (ran) | interval | idle GB/s, median (range) | busy GB/s, median (range) | busy / idle |",
             "|---|---|---|---|---:|"]
    for eng, r in doc["engines"].items():
        for iv in intervals:
            idle, busy = r["rates_gbs"][f"{iv * 1e3:g}ms/idle"], r["rates_gbs"][f"{iv * 1e3:g}ms/busy"]
            mi, mb = statistics.median(idle), statistics.median(busy)
            lines.append(f"| {eng} ({r['engine']}, {r['path']}) | {iv * 1e3:g} ms | {mi:.2f} ({min(idle):.2f}-{max(idle):.2f}) "
                         f"| {mb:.2f} ({min(busy):.2f}-{max(busy):.2f}) | {mb / mi:.2f}x |")
    with open(os.path.join(a.out, "busy_host.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(a.out, "busy_host.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
