"""How long a `PageStore` takes to open and close, for the node budget's bookkeeping (sizing new
namespaces one at a time, recording each close, telling idle namespaces apart).

Three cases, each an open and a close (bounce engine, so engine start-up is small):

* ``new-configured``: a new namespace with a configured capacity (1 MiB) in a directory on a real
  disk (`--dir`, O_DIRECT): the common case, where one statvfs says there is room;
* ``reopen``: one of those opened again (its size kept);
* ``new-default``: a new namespace sized by the default rule on a 1 GiB tmpfs (root) beside
  `--crowd` idle namespaces, so every open lists them (``capacity_fraction`` 0.005: never short of
  room, so nothing is removed and any version of the code does the same work; each is removed,
  untimed, after its close).

``--compare OLD NEW`` starts one worker process per source tree (`PYTHONPATH`), each with its own
directories, and asks them in turn (old, new, new, old, ...) for `--batch` opens of one case at a
time, `--rounds` times over, so both see the same machine load; it prints each case's median open
time per tree and the median and spread of the per-batch new/old ratios. Compare ratios within a
run, not absolute times across runs (a shared 2-core machine is noisy).

    python benchmarks/bench_open.py --compare /tmp/base-tree /work/wt-seam --rounds 20 --batch 10
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
CASES = ("new-configured", "reopen", "new-default")


class Worker:
    """Runs in a process whose `PYTHONPATH` is one source tree; answers "CASE N" lines with N
    open+close times (seconds) as a JSON list."""

    def __init__(self, disk_dir: str, crowd: int) -> None:
        from hicache_gds import PageStore
        self.PageStore = PageStore
        self.disk = tempfile.mkdtemp(prefix="bench-open-", dir=disk_dir)
        self.mnt = tempfile.mkdtemp(prefix="bench-open-tmpfs-")
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g,mode=0755", "tmpfs", self.mnt],
                          capture_output=True).returncode:
            raise SystemExit("new-default needs a tmpfs (root)")
        self.tmpfs_cfg = {"gds_path": self.mnt, "engine": "bounce", "direct_io": False}
        for i in range(crowd):
            PageStore(PAGE, {"model": f"idle{i}"}, config={**self.tmpfs_cfg, "capacity": 4 * PAGE}).close()
        self.disk_cfg = {"gds_path": self.disk, "capacity": 16 * PAGE, "engine": "bounce"}
        self.made = 0
        self.reopened = 0
        self.defaults = 0

    def run(self, case: str, n: int) -> list[float]:
        out = []
        for _ in range(n):
            if case == "new-configured":
                ident, cfg = {"model": f"m{self.made}"}, self.disk_cfg
                self.made += 1
            elif case == "reopen":
                ident, cfg = {"model": f"m{self.reopened % max(1, self.made)}"}, self.disk_cfg
                self.reopened += 1
            else:
                ident, cfg = {"model": f"d{self.defaults}"}, {**self.tmpfs_cfg, "capacity_fraction": 0.005}
                self.defaults += 1
            t = time.perf_counter()
            st = self.PageStore(PAGE, ident, config=cfg)
            st.close()
            out.append(time.perf_counter() - t)
            if case == "new-default":
                for d in st.dirs:
                    shutil.rmtree(d)
        return out

    def close(self) -> None:
        shutil.rmtree(self.disk, ignore_errors=True)
        subprocess.run(["umount", "-l", self.mnt], capture_output=True)
        os.rmdir(self.mnt)


def _serve(disk_dir: str, crowd: int) -> None:
    w = Worker(disk_dir, crowd)
    try:
        print("ready", flush=True)
        for line in sys.stdin:
            case, n = line.split()
            print(json.dumps(w.run(case, int(n))), flush=True)
    finally:
        w.close()


def compare(old: str, new: str, rounds: int, batch: int, crowd: int, disk_dir: str) -> dict:
    procs = {}
    for label, tree in (("old", old), ("new", new)):
        procs[label] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", "--crowd", str(crowd),
                                         "--dir", disk_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=dict(os.environ, PYTHONPATH=tree))
        if procs[label].stdout.readline().strip() != "ready":
            raise SystemExit(f"the {label} worker did not start")

    def ask(label: str, case: str) -> list[float]:
        p = procs[label]
        p.stdin.write(f"{case} {batch}\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    times = {c: {"old": [], "new": []} for c in CASES}
    ratios = {c: [] for c in CASES}
    try:
        for c in CASES:  # warm both up (imports, first-open costs) before anything is timed
            ask("old", c), ask("new", c)
        for r in range(rounds):
            for c in CASES:
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                got = {label: ask(label, c) for label in order}
                for label in order:
                    times[c][label] += got[label]
                ratios[c].append(statistics.median(got["new"]) / statistics.median(got["old"]))
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait(120)
    out = {"rounds": rounds, "batch": batch, "crowd": crowd, "cases": {}}
    for c in CASES:
        rs = sorted(ratios[c])
        q = statistics.quantiles(rs, n=4) if len(rs) >= 2 else [rs[0]] * 3
        out["cases"][c] = {"old_median_ms": 1e3 * statistics.median(times[c]["old"]),
                           "new_median_ms": 1e3 * statistics.median(times[c]["new"]),
                           "ratio_median": statistics.median(rs), "ratio_q1": q[0], "ratio_q3": q[2],
                           "ratios": rs}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", nargs=2, metavar=("OLD_TREE", "NEW_TREE"))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--batch", type=int, default=10, help="opens per case per worker per round")
    ap.add_argument("--crowd", type=int, default=200, help="idle namespaces beside the new-default opens")
    ap.add_argument("--dir", default="/var/tmp", help="a directory on a real disk (O_DIRECT)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        _serve(a.dir, a.crowd)
        return
    if not a.compare:
        ap.error("--compare OLD_TREE NEW_TREE")
    rep = compare(*a.compare, a.rounds, a.batch, a.crowd, a.dir)
    for c, r in rep["cases"].items():
        print(f"{c:15s} old {r['old_median_ms']:6.2f} ms, new {r['new_median_ms']:6.2f} ms; new/old per batch: "
              f"median {r['ratio_median']:.2f} (quartiles {r['ratio_q1']:.2f}-{r['ratio_q3']:.2f})")
    print(json.dumps(rep))


if __name__ == "__main__":
    main()
