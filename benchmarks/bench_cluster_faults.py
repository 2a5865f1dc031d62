"""The remote tier across network namespaces: real faults, and throughput over veth TCP.

    sudo python benchmarks/bench_cluster_faults.py [--faults kill_server stop_server ...] [--single-redis]
        [--throughput --batch 64 --rounds 5] [--json out.json] [--keep DIR]

Needs root and `ip netns`. Builds nodes n1, n2, n3 (a page server and a client each, UCX over TCP
on the node's veth) and d1, d2, d3 (Redis primary, replica, three Sentinels) as network
namespaces on one bridge (`hicache_gds.testing.netns`), injects each fault in a fresh lab
(`hicache_gds.testing.cluster_faults` says what each does and how recovery is timed), and
prints per fault: pages put and read, misses, pages with wrong bytes, recovery. Everything it
starts is killed and the namespaces deleted when it ends, also on errors.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hicache_gds.testing.cluster_faults import FAULTS, LabConfig, run_fault, run_throughput  # noqa: E402
from hicache_gds.testing.netns import netns_unavailable  # noqa: E402


def fmt(x: object) -> str:
    return "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", nargs="*", default=list(FAULTS), choices=FAULTS)
    ap.add_argument("--single-redis", action="store_true", help="one Redis in d1 instead of primary+replica+Sentinel")
    ap.add_argument("--ttl", type=float, default=5.0, help="page servers' registration TTL (s)")
    ap.add_argument("--io-timeout", type=float, default=2.0)
    ap.add_argument("--hold", type=float, default=3.0, help="seconds between a fault and its restore")
    ap.add_argument("--after", type=float, default=12.0, help="seconds a run lasts after its fault")
    ap.add_argument("--throughput", action="store_true", help="also time put/get over veth TCP and loopback")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--keep", default="", help="keep logs and client rows under this directory")
    args = ap.parse_args(argv)
    why = netns_unavailable()
    if why:
        print(f"bench_cluster_faults: {why}", file=sys.stderr)
        return 2
    cfg = LabConfig(ha=not args.single_redis, ttl=args.ttl, io_timeout=args.io_timeout, hold=args.hold,
                    after=args.after)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out: dict[str, object] = {"started": started, "cores": os.cpu_count(), "python": platform.python_version(),
                              "config": cfg.__dict__, "faults": [], "throughput": {}}
    for f in args.faults:
        work = Path(args.keep) / f if args.keep else None
        t = time.monotonic()
        res = run_fault(f, cfg, work)
        out["faults"].append(res.row())
        print(f"{f}: {json.dumps(res.row())} ({time.monotonic() - t:.0f} s)", flush=True)
    if args.throughput:
        work = Path(args.keep) / "tput" if args.keep else None
        out["throughput"] = run_throughput(args.batch, args.rounds, work=work)
    print(f"\n{started}, {os.cpu_count()} cores, directory: "
          f"{'one Redis' if args.single_redis else 'Redis primary + replica + 3 Sentinels'}, page server TTL "
          f"{cfg.ttl:g} s, io_timeout {cfg.io_timeout:g} s, {cfg.batch} fresh + {cfg.pinned} pinned pages of "
          f"{cfg.page >> 20} MiB per client round, 3 clients\n")
    print("| fault | rounds | pages put / put failed | pages read / misses | wrong pages | restore done (s) "
          "| first get served (s) | first full round (s) | last failed round (s) | cut node rejoins (s) "
          "| pinned acked / promised / lost | notes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out["faults"]:
        notes = list(r["notes"]) + ([f"{r['errors']} exceptions"] if r["errors"] else [])
        print(f"| {r['fault']} | {r['rounds']} | {r['puts']} / {r['put_failed']} | {r['gets']} / {r['misses']} | "
              f"{r['wrong']} | {fmt(r['restored_s'])} | {fmt(r['gets_back_s'])} | {fmt(r['first_full_s'])} | "
              f"{fmt(r['last_fail_s'])} | {fmt(r['rejoin_s'])} | "
              f"{r['pinned_acked']} / {r['pinned_promised']} / {r['promised_lost']} | {'; '.join(notes)} |")
    if out["throughput"]:
        print("\n| path | batch | put GB/s median (min-max) | get GB/s median (min-max) | batches not byte-exact |")
        print("|---|---|---|---|---|")
        for tr, b in out["throughput"].items():
            if "put_gbps" not in b:
                print(f"| {tr} | - | {b} | | |")
                continue
            p, g = sorted(b["put_gbps"]), sorted(b["get_gbps"])
            print(f"| {tr} ({b['path']}) | {b['batch']} x 2 MiB | {p[len(p) // 2]:.2f} ({p[0]:.2f}-{p[-1]:.2f}) | "
                  f"{g[len(g) // 2]:.2f} ({g[0]:.2f}-{g[-1]:.2f}) | {b['bad_batches']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    bad = sum(r["wrong"] + r["promised_lost"] for r in out["faults"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
