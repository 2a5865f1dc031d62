"""Where each revisit's time to first token went: the server's prefetch timeline
(``HICACHE_GDS_TRACE=1``, `hicache_gds_sglang.trace`) joined with the suite's results.

    python benchmarks/e2e/trace_report.py SUITE_JSON SERVER_LOG [SERVER_LOG ...] [--workload single]

One row per request that loaded from L3, grouped by configuration, with medians per configuration
and prompt. Columns (seconds unless said):

* ``wait`` -- queued until the backend's hit query began (the prefetch thread's queue);
* ``query`` -- the hit query (the backend's ``batch_exists`` calls);
* ``start`` -- query end until the IO thread's first get (host memory allocated, the op handed over);
* ``gets`` / ``GB/s`` -- time inside the page gets, and the bytes they landed over it;
* ``gaps`` -- between the gets of one request (the IO thread's own work between batches);
* ``ready`` -- the last get until the scheduler took the loaded pages;
* ``sched`` -- until the request was in a prefill batch;
* ``rest`` -- until its first token reached the client (load back to the GPU, the prefill of
  the rest, the response);
* ``ttft`` -- as the client measured it (the client and the server read the same monotonic clock).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys

MARK = "hicache-gds trace "


def events(paths: list[str]) -> dict[str, list[dict]]:
    by_rid: dict[str, list[dict]] = collections.defaultdict(list)
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                i = line.find(MARK)
                if i < 0:
                    continue
                try:
                    rec = json.loads(line[i + len(MARK):].strip())
                except ValueError:
                    continue
                by_rid[rec["rid"]].append(rec)
    return by_rid


def timeline(evs: list[dict], page_bytes: int) -> dict | None:
    first = {}
    for e in sorted(evs, key=lambda e: e.get("t0", e["t"])):
        first.setdefault(e["ev"], e)
    gets = sorted((e for e in evs if e["ev"] == "get"), key=lambda e: e["t0"])
    if "queued" not in first or not gets:
        return None
    q = first.get("query")
    inside = sum(g["t"] - g["t0"] for g in gets)
    landed = sum(g.get("landed", g["pages"]) for g in gets)
    row = {"wait": (q["t0"] if q else gets[0]["t0"]) - first["queued"]["t"],
           "query": (q["t"] - q["t0"]) if q else None,
           "start": gets[0]["t0"] - (q["t"] if q else first["queued"]["t"]),
           "gets": inside, "n_gets": len(gets), "GB/s": landed * page_bytes / inside / 1e9 if inside > 0 else None,
           "gaps": sum(b["t0"] - a["t"] for a, b in zip(gets, gets[1:])), "backend": gets[0].get("backend", "?"),
           "pages": landed}
    last = gets[-1]["t"]
    if "ready" in first:
        row["ready"] = first["ready"]["t"] - last
        last = first["ready"]["t"]
    if "scheduled" in first:
        row["sched"] = first["scheduled"]["t"] - last
        row["t_sched"] = first["scheduled"]["t"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite_json")
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--workload", default="single")
    a = ap.parse_args()
    doc = json.load(open(a.suite_json))
    page_bytes = int(doc["model"]["kv_bytes_per_token"]) * int(doc["args"]["page_size"])
    by_rid = events(a.logs)
    if not by_rid:
        print(f"no trace lines in {', '.join(a.logs)} (was the server started with HICACHE_GDS_TRACE=1?)")
        return 1
    cols = ("wait", "query", "start", "gets", "GB/s", "gaps", "ready", "sched", "rest", "ttft")
    per: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    print(f"| cell | prompt | pages | gets | {' | '.join(cols)} |")
    print("|---|---|---:|---:|" + "---:|" * len(cols))
    for cid, cell in doc["cells"].items():
        if cell.get("workload") != a.workload:
            continue
        for r in cell.get("results", []):
            row = timeline(by_rid.get(r.get("rid", ""), []), page_bytes)
            if row is None:
                continue
            row["ttft"] = r["ttft_s"]
            if "t_sched" in row:
                row["rest"] = r["t_start"] + r["ttft_s"] - row["t_sched"]
            per[(cell["config"], r["tag"])].append(row)
            vals = " | ".join("-" if row.get(c) is None else f"{row[c]:.3f}" if c != "GB/s" else f"{row[c]:.2f}"
                              for c in cols)
            print(f"| {cid} | {r['tag']} | {row['pages']} | {row['n_gets']} | {vals} |")
    print(f"\nMedians per configuration and prompt:\n\n| config | prompt | n | {' | '.join(cols)} |")
    print("|---|---|---:|" + "---:|" * len(cols))
    for (config, tag), rows in sorted(per.items()):
        meds = []
        for c in cols:
            v = [r[c] for r in rows if r.get(c) is not None]
            meds.append("-" if not v else f"{statistics.median(v):.3f}" if c != "GB/s" else
                        f"{statistics.median(v):.2f}")
        print(f"| {config} | {tag} | {len(rows)} | {' | '.join(meds)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
