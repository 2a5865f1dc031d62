"""The remote tier and Mooncake Store on the same network namespaces, in one run, interleaved.

    sudo python benchmarks/bench_cluster_vs_mooncake.py [--reps 3] [--rounds 5] [--batch 64]
        [--variant before:UCX_TCP_TX_SEG_SIZE=8k ...] [--baseline NAME:DIR ...] [--json out.json]

Needs root, `ip netns`, redis-server, and Mooncake Store in --venv (see bench_cluster_mooncake.py).
Each repetition times, one after the other in fresh labs: the remote tier over veth TCP (client in
n1, page servers in n2 and n3: `cluster_faults.run_throughput`), the tier again under each
`--variant` (NAME:VAR=VALUE[,VAR=VALUE]: environment the lab's processes get, e.g. a UCX setting
as it was before a change), the tier of another checkout under each `--baseline` (NAME:DIR, e.g.
an export of an older commit: its own `run_throughput`, in a subprocess), and Mooncake Store (`bench_cluster_mooncake.py`: master in d1, storage
in n2 and n3, client in n1, protocol tcp). Interleaving puts every system under the same
background load on a shared machine. Prints per system the median and min-max over every timed
batch, and each repetition's medians. Every batch is byte-compared after timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hicache_gds.testing.cluster_faults import run_throughput  # noqa: E402
from hicache_gds.testing.netns import netns_unavailable  # noqa: E402


def tier(batch: int, rounds: int, env: dict[str, str]) -> dict:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the lab's processes inherit this process's environment
    try:
        return run_throughput(batch, rounds, transports=("veth-tcp",))["veth-tcp"]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def baseline(repo: str, batch: int, rounds: int) -> dict:
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
            "from hicache_gds.testing.cluster_faults import run_throughput; "
            "print(json.dumps(run_throughput(int(sys.argv[2]), int(sys.argv[3]), transports=('veth-tcp',))['veth-tcp']))")
    r = subprocess.run([sys.executable, "-c", code, repo, str(batch), str(rounds)], capture_output=True, text=True,
                       timeout=300, cwd=repo)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": (r.stdout + r.stderr)[-500:]}


def mooncake(args: argparse.Namespace) -> dict:
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_cluster_mooncake.py"), "--venv", args.venv,
                        "--stub-dir", args.stub_dir, "--batch", str(args.batch), "--rounds", str(args.rounds)],
                       capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": (r.stdout + r.stderr)[-500:]}


def summary(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):.2f} ({xs[0]:.2f}-{xs[-1]:.2f})" if xs else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--variant", action="append", default=[], help="NAME:VAR=VALUE[,VAR=VALUE]")
    ap.add_argument("--baseline", action="append", default=[], help="NAME:DIR, another checkout of hicache-gds")
    ap.add_argument("--venv", default="/work/venv-mooncake")
    ap.add_argument("--stub-dir", default="/work/venv-mooncake/stub")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    why = netns_unavailable()
    if why:
        print(f"bench_cluster_vs_mooncake: {why}", file=sys.stderr)
        return 2
    systems: dict[str, dict[str, str] | str | None] = {"hicache-gds": {}}
    for v in args.variant:
        name, _, spec = v.partition(":")
        systems[f"hicache-gds {name}"] = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
    for v in args.baseline:
        name, _, repo = v.partition(":")
        systems[f"hicache-gds {name}"] = str(Path(repo).resolve())
    systems["Mooncake Store"] = None
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for rep in range(args.reps):
        for name, env in systems.items():
            if env is None:
                res = mooncake(args)
            elif isinstance(env, str):
                res = baseline(env, args.batch, args.rounds)
            else:
                res = tier(args.batch, args.rounds, env)
            res["load"] = os.getloadavg()[0]
            runs[name].append(res)
            if "put_gbps" in res:
                print(f"rep {rep + 1} {name}: put {summary(res['put_gbps'])} get {summary(res['get_gbps'])} GB/s, "
                      f"bad batches {res['bad_batches']}, load {res['load']:.1f}", flush=True)
            else:
                print(f"rep {rep + 1} {name}: {res}", flush=True)
    print(f"\n{started}, {os.cpu_count()} cores, Python {platform.python_version()}, {args.reps} repetitions x "
          f"{args.rounds} batches of {args.batch} x 2 MiB, interleaved\n")
    print("| system, veth TCP | put GB/s median (min-max) | get GB/s median (min-max) | per-repetition medians put / get "
          "| batches not byte-exact |")
    print("|---|---|---|---|---|")
    for name, rs in runs.items():
        ok = [r for r in rs if "put_gbps" in r]
        puts = [x for r in ok for x in r["put_gbps"]]
        gets = [x for r in ok for x in r["get_gbps"]]
        per = "; ".join(f"{statistics.median(r['put_gbps']):.2f} / {statistics.median(r['get_gbps']):.2f}" for r in ok)
        env = systems[name]
        if isinstance(env, str):
            label = f"{name} ({env})"
        else:
            label = name + (f" ({', '.join(f'{k}={v}' for k, v in env.items())})" if env else "")
        print(f"| {label} | {summary(puts)} | {summary(gets)} | {per} | {sum(r['bad_batches'] for r in ok)} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"started": started, "runs": runs, "variants": systems}, indent=1))
    return 1 if any(r.get("bad_batches") for rs in runs.values() for r in rs) else 0


if __name__ == "__main__":
    sys.exit(main())
