"""How long a `PageStore` takes to open and close, for the node budget's bookkeeping (sizing new
namespaces one at a time, recording each open and close, scanning the namespaces of a directory).

Three cases, each opened and closed `--n` times (bounce engine, so engine start-up is small):

* ``new-configured``: new namespaces with a configured capacity (1 MiB) on a real disk directory
  (`--dir`, O_DIRECT) -- the common case: one statvfs decides there is room;
* ``reopen``: the same namespaces opened again (kept size);
* ``new-default``: new namespaces sized by the default rule on a 1 GiB tmpfs (root) that already
  holds `--crowd` idle namespaces, so every open scans them (``capacity_fraction`` 0.005, so none
  is ever short of room and nothing is removed: the same work for any version of the code).

``--compare OLD NEW --rounds R`` runs the cases in subprocesses with `PYTHONPATH` set to each
source tree in turn (OLD, NEW, OLD, NEW, ...), and prints medians and the NEW/OLD ratio of each
case's median per round. One machine, one run: compare ratios, not absolute times.

    python benchmarks/bench_open.py --compare /tmp/base /work/wt-seam --rounds 3 --dir /var/tmp
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PAGE = 64 << 10


def _mount(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path],
                          capture_output=True).returncode == 0


def run_cases(n: int, crowd: int, disk_dir: str) -> dict:
    from hicache_gds import PageStore
    out: dict = {}
    d = tempfile.mkdtemp(prefix="bench-open-", dir=disk_dir)
    try:
        cfg = {"gds_path": d, "capacity": 16 * PAGE, "engine": "bounce"}
        times = []
        for i in range(n):
            t = time.perf_counter()
            PageStore(PAGE, {"model": f"m{i}"}, config=cfg).close()
            times.append(time.perf_counter() - t)
        out["new-configured"] = times
        times = []
        for i in range(n):
            t = time.perf_counter()
            PageStore(PAGE, {"model": f"m{i}"}, config=cfg).close()
            times.append(time.perf_counter() - t)
        out["reopen"] = times
    finally:
        shutil.rmtree(d, ignore_errors=True)
    mnt = tempfile.mkdtemp(prefix="bench-open-tmpfs-")
    if _mount(mnt, "1g"):
        try:
            cfg = {"gds_path": mnt, "engine": "bounce", "direct_io": False}
            for i in range(crowd):
                PageStore(PAGE, {"model": f"idle{i}"}, config={**cfg, "capacity": 4 * PAGE}).close()
            times = []
            for i in range(n):
                t = time.perf_counter()
                PageStore(PAGE, {"model": f"d{i}"}, config={**cfg, "capacity_fraction": 0.005}).close()
                times.append(time.perf_counter() - t)
            out["new-default"] = times
        finally:
            subprocess.run(["umount", "-l", mnt], capture_output=True)
            os.rmdir(mnt)
    return out


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": 1e3 * statistics.median(xs), "p90_ms": 1e3 * xs[int(0.9 * (len(xs) - 1))], "n": len(xs)}


def compare(old: str, new: str, rounds: int, n: int, crowd: int, disk_dir: str) -> dict:
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for _ in range(rounds):
        for label, tree in (("old", old), ("new", new)):
            env = dict(os.environ, PYTHONPATH=tree)
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--n", str(n), "--crowd", str(crowd),
                                "--dir", disk_dir], capture_output=True, text=True, env=env, timeout=1800)
            if p.returncode:
                raise SystemExit(f"{label} run failed: {p.stderr[-2000:]}")
            runs[label].append(json.loads(p.stdout.strip().splitlines()[-1]))
    report: dict = {"rounds": rounds, "n": n, "crowd": crowd, "cases": {}}
    for case in runs["new"][0]:
        olds = [_stats(r[case])["median_ms"] for r in runs["old"]]
        news = [_stats(r[case])["median_ms"] for r in runs["new"]]
        ratios = [b / a for a, b in zip(olds, news)]
        report["cases"][case] = {"old_median_ms": olds, "new_median_ms": news, "ratio_new_old": ratios,
                                 "old_p90_ms": [_stats(r[case])["p90_ms"] for r in runs["old"]],
                                 "new_p90_ms": [_stats(r[case])["p90_ms"] for r in runs["new"]]}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100, help="opens per case")
    ap.add_argument("--crowd", type=int, default=200, help="idle namespaces beside the new-default opens")
    ap.add_argument("--dir", default="/var/tmp", help="a directory on a real disk (O_DIRECT)")
    ap.add_argument("--compare", nargs=2, metavar=("OLD_TREE", "NEW_TREE"))
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.compare:
        rep = compare(*a.compare, a.rounds, a.n, a.crowd, a.dir)
        for case, c in rep["cases"].items():
            print(f"{case:15s} old median {statistics.median(c['old_median_ms']):7.2f} ms, new "
                  f"{statistics.median(c['new_median_ms']):7.2f} ms; new/old per round "
                  + ", ".join(f"{r:.2f}" for r in c["ratio_new_old"]))
        print(json.dumps(rep))
    else:
        print(json.dumps(run_cases(a.n, a.crowd, a.dir)))


if __name__ == "__main__":
    main()
