"""How far a disk tier can take an open loop's TTFT p90 (and a burst), on a model of one server
measured by a suite run.

Issue 20 asks, at the arrival rate where recompute's TTFT p90 doubles from its idle value, for a
p90 at most 0.6x recompute's. Whether any policy can get there depends on the disk and the GPU of
the run, so this module replays the run's own arrivals (and, for the knee, a long Poisson stream)
through an ideal model of one server measured by the same run:

* the GPU prefills one request at a time (chunked prefill runs one long prompt's chunks back to
  back), the earliest-arrived ready request first; ``n`` new tokens after ``p`` cached cost
  ``a*n + b*n*(p + n/2)`` seconds (the cost model's formula, `hicache_gds.costmodel`), fitted on
  the run's recompute TTFTs one at a time, whose constant part ``c0`` (HTTP, tokenizing) is added
  to every TTFT and occupies no GPU;
* the disk reads one load at a time at the run's raw O_DIRECT read rate (a server reads slower:
  the bound stays optimistic), ``h`` tokens in ``h*B/R``; GPU memory is unlimited, a load back
  to the GPU and a queue reorder are free.

Its ratios are a yardstick, not a strict bound: the model's recompute is ideal as well, and a real
server's recompute also loses time the model does not see (GPU memory shared by long prompts,
chunk scheduling), so a measured ratio can come out below the model's (32B bursts on an H200 did).
What it does tell is how far each kind of policy can go on this disk and GPU, and whether a
measured ratio is near its policy's limit or far from it.

Policies, each decided at arrival with exact backlogs (no forecast error):

* ``recompute``: every prompt computed;
* ``per_request``: each request loaded or computed, whichever finishes it first behind the two
  queues (`compute_or_load`'s admission with perfect estimates). Loading more than that (a bias
  toward the disk) raised the p90 in this model at every bias tried, so this is the best of its
  kind here;
* ``split``: the GPU computes a request's head while the disk loads the rest of its prefix at
  once, the head chosen per request for the earliest finish. SGLang has no way to do this today
  (its prefetch loads a prefix's head and the GPU computes the tail, one after the other); it is
  here to say what such a mode would be worth;
* ``joined``: what SGLang 0.5.17 lets a split do (the plugin's ``policy_split``), with the
  choices of ``per_request`` besides: the head is whole chunks (``--chunk``), the tail pages join
  when the head's *last* chunk starts (the overlapped scheduler forms the next batch while a chunk
  runs), counted a get (``--grain`` tokens) at a time, and the GPU computes whatever of the tail
  had not been counted by then. The best any per-request policy can do inside that engine.

    python benchmarks/e2e/open_loop_bound.py <out>/suite-<shape>.json [--rates 0.3,0.5,0.7]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

POLICIES = ("recompute", "per_request", "split", "joined")
TARGET = 0.6


@dataclass(frozen=True)
class Server:
    """The ideal server: prefill cost ``c0 + a*n + b*n*(p + n/2)`` (``c0`` latency only), the
    disk's read rate (bytes/s), KV bytes per token, tokens computed after a loaded prefix."""

    a: float
    b: float
    c0: float
    read_Bps: float
    kv_bytes: float
    tail: int = 64
    chunk: int = 8192  # the engine's chunked prefill (``joined``)
    grain: int = 64  # tokens a get reads before any of them count (``joined``)

    def compute(self, n: int, p: int = 0) -> float:
        return self.a * n + self.b * n * (p + n / 2)

    def load(self, h: int) -> float:
        return h * self.kv_bytes / self.read_Bps


def fit_prefill(points: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """(c0, a, b) of ``ttft = c0 + a*n + b*n*n/2`` by least squares over (prompt tokens, TTFT) one at
    a time, every coefficient kept >= 0 (a negative one is dropped and the rest refitted)."""
    pts = [(float(n), float(t)) for n, t in points if n > 0 and t == t and t > 0]
    if len({n for n, _ in pts}) < 2:
        raise ValueError("fitting the prefill cost needs TTFTs one at a time of at least two prompt lengths")
    n = np.array([p[0] for p in pts])
    y = np.array([p[1] for p in pts])
    cols = {"c0": np.ones_like(n), "a": n, "b": n * n / 2}
    keep = list(cols)
    while True:
        x, *_ = np.linalg.lstsq(np.stack([cols[k] for k in keep], axis=1), y, rcond=None)
        coef = dict(zip(keep, x))
        neg = [k for k in keep if coef[k] < 0]
        if not neg or len(keep) == 1:
            break
        keep.remove(min(neg, key=lambda k: coef[k]))
    coef = {k: max(0.0, float(coef.get(k, 0.0))) for k in cols}
    return coef["c0"], coef["a"], coef["b"]


def simulate(arrivals: Sequence[float], tokens: Sequence[int], policy: str, srv: Server) -> list[float]:
    """TTFT of each arrival (prompt of `tokens[i]` tokens, all of its prefix in L3) under `policy`."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    n = len(arrivals)
    order = sorted(range(n), key=lambda i: arrivals[i])
    ttft = [math.nan] * n
    jobs: list[tuple[float, int, float]] = []  # (ready at, arrival rank, GPU seconds) -- heap by ready
    queued_s = 0.0  # GPU seconds committed and not started
    after: dict[int, tuple[float, int]] = {}  # split: rank -> (load end, tokens) until its head is computed
    gpu_t = disk_t = 0.0
    k = 0
    while k < n or jobs:
        start = max(gpu_t, jobs[0][0]) if jobs else math.inf
        if k < n and arrivals[order[k]] <= start:
            i = order[k]
            t, h = float(arrivals[order[k]]), int(tokens[i])
            g = max(0.0, gpu_t - t) + queued_s
            d = max(0.0, disk_t - t)
            tail = srv.compute(srv.tail, h)
            t_c = g + srv.compute(h + srv.tail)
            best, head = t_c, None
            read_to = None  # joined: (GPU seconds, tail tokens the disk reads); the rest of the tail is computed
            if policy in ("per_request", "joined"):
                t_l = max(d + srv.load(h), g) + tail
                if t_l < t_c:
                    best, head = t_l, 0
            if policy == "joined":
                per_tok = srv.kv_bytes / srv.read_Bps
                for m in range(srv.chunk, h, srv.chunk):
                    raw = max(0.0, g + srv.compute(m - srv.chunk) - d) / per_tok
                    f = min(h - m, int(raw) // srv.grain * srv.grain)
                    if f <= 0:
                        continue
                    secs = srv.compute(m) + srv.compute(h - m - f + srv.tail, m + f)
                    if g + secs < best:
                        best, head = g + secs, m
                        read_to = (secs, min(h - m, -(-int(raw) // srv.grain) * srv.grain))
            elif policy == "split":
                for m in range(0, h + 1, 256):
                    t_s = max(g + srv.compute(m), d + srv.load(h - m)) + tail
                    if t_s < best:
                        best, head = t_s, m
            if read_to is not None:  # one GPU job, its tail joined; the disk reads to the end of its get
                secs, reads = read_to
                disk_t = t + d + srv.load(reads)
                heapq.heappush(jobs, (t, k, secs))
                queued_s += secs
            elif head is None:
                heapq.heappush(jobs, (t, k, srv.compute(h + srv.tail)))
                queued_s += srv.compute(h + srv.tail)
            else:
                disk_t = t + d + srv.load(h - head)
                if head:
                    after[k] = (disk_t, h)
                    heapq.heappush(jobs, (t, k, srv.compute(head)))
                    queued_s += srv.compute(head)
                else:
                    heapq.heappush(jobs, (disk_t, k, tail))
                    queued_s += tail
            k += 1
            continue
        ready = [j for j in jobs if j[0] <= start]
        job = min(ready, key=lambda j: j[1])
        jobs.remove(job)
        heapq.heapify(jobs)
        _, rank, secs = job
        queued_s -= secs
        gpu_t = start + secs
        if rank in after:  # a split's head is done: its tail runs once the load has landed too
            load_end, h = after.pop(rank)
            tail = srv.compute(srv.tail, h)
            heapq.heappush(jobs, (max(gpu_t, load_end), rank, tail))
            queued_s += tail
        else:
            i = order[rank]
            ttft[i] = gpu_t - float(arrivals[i]) + srv.c0
    return ttft


def p90(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return float(np.percentile(xs, 90)) if xs else math.nan


def poisson(rate: float, lengths: Sequence[int], count: int, seed: int = 1) -> tuple[list[float], list[int]]:
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    return np.cumsum(gaps).tolist(), [int(lengths[i % len(lengths)]) for i in range(count)]


def steady(srv: Server, lengths: Sequence[int], rates: Sequence[float], count: int = 20000) -> list[dict[str, Any]]:
    """Each policy's TTFT p90 on a long Poisson stream at each rate, against recompute's idle p90."""
    idle = p90([srv.c0 + srv.compute(x + srv.tail) for x in lengths])
    rows = []
    for r in rates:
        arr, toks = poisson(r, lengths, count)
        ps = {p: p90(simulate(arr, toks, p, srv)) for p in POLICIES}
        rows.append({"rate": r, "idle_p90": idle, **{f"{p}_p90": v for p, v in ps.items()}})
    return rows


def knee(srv: Server, lengths: Sequence[int], lo: float = 0.02, count: int = 20000) -> dict[str, Any]:
    """The rate where recompute's p90 is twice its idle p90 (bisection on the long stream), and each
    policy's p90 there against recompute's."""
    idle = p90([srv.c0 + srv.compute(x + srv.tail) for x in lengths])
    cap = 1.0 / float(np.mean([srv.compute(x + srv.tail) for x in lengths]))  # recompute saturates here
    a, b = lo, cap
    for _ in range(30):
        m = (a + b) / 2
        arr, toks = poisson(m, lengths, count)
        if p90(simulate(arr, toks, "recompute", srv)) >= 2 * idle:
            b = m
        else:
            a = m
    arr, toks = poisson(b, lengths, count)
    ps = {p: p90(simulate(arr, toks, p, srv)) for p in POLICIES}
    return {"rate": b, "idle_p90": idle, **{f"{p}_p90": v for p, v in ps.items()},
            **{f"{p}_ratio": ps[p] / ps["recompute"] for p in POLICIES[1:]}}


def burst(srv: Server, lengths: Sequence[int]) -> dict[str, tuple[float, float]]:
    """Each policy's (last TTFT, mean TTFT) when every prompt of `lengths` arrives at once (the
    suite's burst; the last TTFT stands for the makespan, whose decode is a few tokens)."""
    out = {}
    for p in POLICIES:
        t = simulate([0.0] * len(lengths), list(lengths), p, srv)
        out[p] = (max(t), float(np.mean(t)))
    return out


def from_run(doc: dict[str, Any]) -> tuple[Server, list[int]]:
    """The ideal server of a suite run: the prefill fit on recompute's TTFTs one at a time, the raw
    O_DIRECT read rate, the model's KV bytes per token; and the run's prompt lengths."""
    cells = [c for c in (doc.get("cells") or {}).values() if "results" in c]
    pts = [(r["prompt_tokens"], r["ttft_s"]) for c in cells if c["config"] == "recompute" and c["workload"] == "single"
           for r in c["results"] if r.get("error") is None and r.get("ttft_s")]
    c0, a, b = fit_prefill(pts)
    raw = doc.get("raw_disk") or {}
    read = next((j.get("raw_MBps") for j in raw.values() if isinstance(j, dict) and j.get("rw") == "read"), None)
    kv = (doc.get("model") or {}).get("kv_bytes_per_token")
    if not read or not kv:
        raise ValueError("the run has no raw read rate or KV bytes per token")
    args = doc.get("args") or {}
    suffix = int(args.get("suffix_tokens") or 64)
    lengths = [int(x) for x in doc.get("lengths") or []]
    page = int(args.get("page_size") or 64)
    try:  # the plugin's tail gets (``policy_split_get``'s default), else page by page
        from hicache_gds_sglang.policy import PolicyConfig
        from hicache_gds_sglang.split import batch_pages, tail_pages
        # 256: SGLang's default prefetch threshold, below which its prefetch thread revokes an operation
        grain = page * (tail_pages(int(kv) * page, PolicyConfig().split_get, -(-256 // page)) or batch_pages())
    except ImportError:
        grain = page
    return Server(a=a, b=b, c0=c0, read_Bps=float(read) * 1e6, kv_bytes=float(kv), tail=suffix,
                  chunk=int(args.get("chunk") or 8192), grain=grain), lengths


def pair_open_reps(cells: Sequence[dict[str, Any]]) -> tuple[dict[float, set], list[str]]:
    """The open-loop repetitions that count, by rate, and the ids of the cells left out (sorted);
    `cells`: the run's cells that have results. How the report pools repetitions (`suite_report`)
    and what `replay` skips."""
    # An open-loop repetition counts only where every configuration run at its rate measured it:
    # each repetition is its own draw of arrivals, and p90s pooled over different draws differ by
    # the draws (a call cut short leaves one configuration's repetition without the other's).
    reps: dict[tuple, set] = defaultdict(set)
    for c in cells:
        if c["workload"] == "open":
            reps[(c["rate"], c["config"])].add(c["rep"])
    paired: dict[float, set] = {}
    for (rate, _), rs in reps.items():
        paired[rate] = paired[rate] & rs if rate in paired else set(rs)
    unpaired = sorted(c.get("id", "?") for c in cells if c["workload"] == "open" and c["rep"] not in paired[c["rate"]])
    return paired, unpaired


def replay(doc: dict[str, Any], srv: Server, skip: set[str] = frozenset()) -> dict[float, dict[str, float]]:
    """Each policy's p90 on the open-loop arrivals the run sent (recompute's cells: their request
    start times and prompt lengths), pooled over repetitions as the report pools them (`skip`:
    ids of the cells it leaves out)."""
    out: dict[float, dict[str, list[float]]] = {}
    for cid, c in (doc.get("cells") or {}).items():
        if c.get("workload") != "open" or c.get("config") != "recompute" or "results" not in c or \
                c.get("id", cid) in skip:
            continue
        rs = [r for r in c["results"] if r.get("t_start") is not None]
        if not rs:
            continue
        t0 = min(r["t_start"] for r in rs)
        arr = [r["t_start"] - t0 for r in rs]
        toks = [int(r["prompt_tokens"]) - srv.tail for r in rs]
        acc = out.setdefault(float(c["rate"]), {p: [] for p in POLICIES})
        for p in POLICIES:
            acc[p] += simulate(arr, toks, p, srv)
    return {r: {p: p90(v) for p, v in acc.items()} for r, acc in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suite_json")
    ap.add_argument("--rates", default="", help="also the long stream's p90 at these rates (req/s)")
    ap.add_argument("--read-gbps", type=float, default=None,
                    help="the disk's read rate instead of the run's raw O_DIRECT one (e.g. what the server's loads "
                         "took: the policy's \"load done\" log lines)")
    ap.add_argument("--chunk", type=int, default=None, help="the engine's chunked prefill in tokens (``joined``; "
                    "default: the run's, else 8192)")
    ap.add_argument("--grain", type=int, default=None, help="tokens a get of a tail reads before any count "
                    "(``joined``; default: the plugin's tail gets of about 128 MiB)")
    a = ap.parse_args(argv)
    with open(a.suite_json) as f:
        doc = json.load(f)
    srv, lengths = from_run(doc)
    if a.read_gbps:
        srv = replace(srv, read_Bps=a.read_gbps * 1e9)
    if a.chunk:
        srv = replace(srv, chunk=a.chunk)
    if a.grain:
        srv = replace(srv, grain=a.grain)
    print(f"ideal server: prefill {srv.a:.3g}*n + {srv.b:.3g}*n*(p+n/2) s (+{srv.c0:.3f} s latency), "
          f"disk {srv.read_Bps / 1e9:.2f} GB/s ({srv.read_Bps / srv.kv_bytes:.0f} tokens/s); joined: chunk "
          f"{srv.chunk}, tail gets of {srv.grain} tokens")
    k = knee(srv, lengths)
    print(f"knee (recompute p90 = 2x its idle {k['idle_p90']:.2f} s): {k['rate']:.3f} req/s; p90 there: recompute "
          f"{k['recompute_p90']:.2f} s, per request {k['per_request_ratio']:.2f}x, joined {k['joined_ratio']:.2f}x, "
          f"split {k['split_ratio']:.2f}x "
          f"(target {TARGET}x)")
    for row in steady(srv, lengths, [float(x) for x in a.rates.split(",") if x]):
        print(f"{row['rate']:g} req/s: recompute p90 {row['recompute_p90']:.2f} s ({row['recompute_p90'] / row['idle_p90']:.1f}x "
              f"idle), per request {row['per_request_p90'] / row['recompute_p90']:.2f}x, joined "
              f"{row['joined_p90'] / row['recompute_p90']:.2f}x, split {row['split_p90'] / row['recompute_p90']:.2f}x")
    b = burst(srv, lengths[:int((doc.get("args") or {}).get("burst") or len(lengths))])
    print(f"a burst of {len(lengths)}: last / mean TTFT against recompute's, per request "
          f"{b['per_request'][0] / b['recompute'][0]:.2f}x / {b['per_request'][1] / b['recompute'][1]:.2f}x, joined "
          f"{b['joined'][0] / b['recompute'][0]:.2f}x / {b['joined'][1] / b['recompute'][1]:.2f}x, split "
          f"{b['split'][0] / b['recompute'][0]:.2f}x / {b['split'][1] / b['recompute'][1]:.2f}x")
    measured = [c for c in (doc.get("cells") or {}).values() if "results" in c]
    for rate, ps in sorted(replay(doc, srv, skip=set(pair_open_reps(measured)[1])).items()):
        print(f"the run's arrivals at {rate:g} req/s: recompute p90 {ps['recompute']:.2f} s, per request "
              f"{ps['per_request'] / ps['recompute']:.2f}x, joined {ps['joined'] / ps['recompute']:.2f}x, split "
              f"{ps['split'] / ps['recompute']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
