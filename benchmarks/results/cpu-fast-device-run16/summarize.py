"""Paired ratios of this run's bench_sglang.py JSON files (one round per file; `base` = main before the
change, `fast` = branch fast-get; each file has HiCacheNixl, fio and raw of the same invocation).

    python summarize.py sglang-ramext4     # or sglang-disk
"""
import glob
import json
import os
import statistics as S
import sys

here = os.path.dirname(os.path.abspath(__file__))
for v in ("base", "fast"):
    rows = []
    for f in sorted(glob.glob(os.path.join(here, f"{sys.argv[1]}-{v}-*.json"))):
        r = json.load(open(f))["results"]
        g, n = r["HiCacheGDS"], r["HiCacheNixl (POSIX)"]
        fio, raw = r["fio (libaio, O_DIRECT, QD16)"], r["raw O_DIRECT (2 MiB IOs, QD16)"]
        rows.append({"get / HiCacheNixl": g["get"][0] / n["get"][0], "get / fio": g["get"][0] / fio["get"][0],
                     "get / raw": g["get"][0] / raw["get"][0], "set / HiCacheNixl": g["set"][0] / n["set"][0],
                     "gds get GB/s": g["get"][0], "HiCacheNixl get GB/s": n["get"][0], "fio get GB/s": fio["get"][0],
                     "gds get CPU ms": g["get_cpu_ms"][0], "HiCacheNixl get CPU ms": n["get_cpu_ms"][0]})
    print(f"{v}: {len(rows)} runs")
    for k in rows[0]:
        vals = [x[k] for x in rows]
        print(f"  {k}: median {S.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f}) {[round(x, 2) for x in vals]}")
