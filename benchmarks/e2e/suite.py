"""Compute or load, measured: one server per model shape, configurations switched at runtime.

    python benchmarks/e2e/bench_sglang_server.py --mode suite --model benchmarks/e2e/qwen-32b-shape \\
        --dir /var/tmp/e2e-store --out /var/tmp/e2e-out --resume --deadline 510

One ``sglang.launch_server`` with HiCache, ``--hicache-storage-backend gds`` and an admin key. The
L3 is written once (``--prefixes`` prompts of ``--lengths`` tokens), then every configuration is
measured on that server, on the same disk, interleaved and repeated:

====================  =====================================================================
recompute             L3 detached (``DELETE /hicache/storage-backend``): every prefix recomputed
gds-<policy>          gds attached with SGLang's ``wait_complete`` / ``best_effort`` /
                      ``timeout``, or hicache-gds' ``compute_or_load`` (``PUT`` with the policy;
                      same backend: SGLang only updates the policy)
nixl                  SGLang's HiCacheNixl (NIXL POSIX, O_DIRECT, its cleaner off), written once
                      with the ``single`` prompts
gds-<policy>+K=V      a variant: gds with ``K=V`` (JSON value) added to its extra config, e.g.
                      ``gds-wait_complete+verify=false`` (an A/B of one store setting)
====================  =====================================================================

Before each measurement ``/flush_cache`` empties the GPU and host pools (L3 stays) and the page
cache is dropped, so every revisit is served by L3 or recomputed. Workloads (``--workloads``):

* ``single``: ``--single`` of the prompts, one at a time (each prefix once per measurement);
* ``burst``: ``--burst`` prompts sent at once: makespan, mean and p50/p90/p99 TTFT, output tokens/s;
* ``host``: a host-only hit: a new prompt of the first length is computed, then enough shared
  prompts of that length to push it out of the GPU pool (it stays in the host pool), and once
  the L3 has written nothing for ``--quiet-s`` the prompt is revisited (another suffix): the
  TTFT of a request the L3 does not serve, for each configuration (what the plugin costs there);
* ``open``: Poisson arrivals at each of ``--rates`` requests/s (the same arrival times for every
  configuration of a repetition, another draw each repetition): TTFT p50/p90/p99 against rate
  (``--plot`` draws p90); the report sets them against the run's ideal server
  (`open_loop_bound.py`).

Each measurement records where the server says every prompt's cached tokens came from (device,
host, storage) and the greedy tokens (compared with ``recompute``'s). Results go to
``<out>/suite-<shape>.json`` after every measurement; ``--resume`` keeps the measured ones, so a
run longer than one call continues in the next (the L3 on ``--dir`` is kept and checked).
``--deadline`` (seconds) stops starting measurements that would not end in time, stops the server
and exits 3 (``--resume`` to go on). ``--fake`` runs the same harness against `fake_server.py`
(no GPU) to dry-run it. ``--trace`` logs each request's prefetch timeline in the server, for
every backend (``trace_report.py`` turns it into a per-request table).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import json
import math
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2elib import (Result, Server, _jsonable, admin, backed_up_tokens, drop_caches, free_port,  # noqa: E402
                    generate, install_guard, log_facts, machine, metrics_lines, model_info, model_variant, overwrite,
                    pct, raw_disk, stop_leftovers, tokens, versions, wait_writes_quiet)

HERE = os.path.dirname(os.path.abspath(__file__))
KEY = "hicache-gds-suite"
POLICIES = ("wait_complete", "best_effort", "timeout", "compute_or_load")
CONFIGS = ("recompute", *(f"gds-{p}" for p in POLICIES), "nixl")
DEFAULT_CONFIGS = "recompute,gds-wait_complete,gds-best_effort,gds-compute_or_load,nixl"
WORKLOADS = ("single", "burst", "open", "host")
POP_SUFFIX, VISIT_SUFFIX = 2000, 3000  # token seeds: the writing visit's suffix, the measured visits'
HOST_SEED, EVICT_SEED = 50000, 60000  # the host workload's prompts


# -- the plan -------------------------------------------------------------------------------------
def lengths(a: argparse.Namespace) -> list[int]:
    """Prefix lengths (whole pages), evenly from the first to the second of --lengths."""
    lo, hi = (int(x) for x in a.lengths.split(":"))
    raw = np.linspace(lo, hi, a.prefixes) if a.prefixes > 1 else np.array([lo])
    return [int(x) // a.page_size * a.page_size for x in raw]


def single_set(a: argparse.Namespace) -> list[int]:
    """Indices of the prompts sent one at a time (spread over the lengths); HiCacheNixl stores these."""
    k = min(a.single, a.prefixes)
    return sorted({int(round(x)) for x in np.linspace(0, a.prefixes - 1, k)})


def prompt(i: int, n: int, a: argparse.Namespace, suffix_seed: int) -> list[int]:
    hi = min(120000, a.vocab - 1)
    p = np.random.default_rng(1000 + i).integers(1000, hi, size=n).tolist()
    s = np.random.default_rng(suffix_seed + i).integers(1000, hi, size=a.suffix_tokens).tolist()
    return p + s


def split_config(cfg: str) -> tuple[str, dict[str, Any]]:
    """A configuration name and the backend keys of its variant: ``gds-wait_complete+verify=false``
    is gds with SGLang's ``wait_complete`` and ``{"verify": false}`` added to its extra config (an
    A/B of one store setting, interleaved with the rest)."""
    base, *keys = cfg.split("+")
    extra: dict[str, Any] = {}
    for kv in keys:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise SystemExit(f"configuration {cfg!r}: {kv!r} is not KEY=VALUE")
        try:
            extra[k] = json.loads(v)
        except ValueError:
            extra[k] = v
    return base, extra


def parse_reps(spec: str) -> dict[str, int]:
    out = {"single": 3, "burst": 2, "open": 1, "host": 3}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        k, _, v = part.partition("=")
        if k not in out or not v.isdigit():
            raise SystemExit(f"--reps: {part!r} is not WORKLOAD=N (workloads {', '.join(out)})")
        out[k] = int(v)
    return out


def rotated(items: list[str], k: int) -> list[str]:
    """`items` starting at its k-th (mod its length)."""
    k = k % len(items) if items else 0
    return items[k:] + items[:k]


def plan(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every measurement, in the order it runs: repetition by repetition, each workload's
    configurations interleaved (the disk drifts within the hour; neighbours share its state),
    their order rotated by one each repetition (and each rate): a position has a cost of its own
    -- on the GPU VM the configuration measured right after ``recompute`` (which leaves the disk
    idle; the cause is not pinned down) read 5-10 % slower than the same one later in the round."""
    cfgs = [c for c in a.configs.split(",") if c]
    reps = parse_reps(a.reps)
    wl = [w for w in a.workloads.split(",") if w]
    cells = []
    for r in range(max(reps[w] for w in wl) if wl else 0):
        for w in ("single", "burst", "host"):
            if w in wl and r < reps[w]:
                for c in rotated(cfgs, r):
                    if w == "burst" and c == "nixl":
                        continue  # HiCacheNixl holds only the single prompts (disk space)
                    cells.append({"id": f"{w}/{c}/{r}", "workload": w, "config": c, "rep": r})
    if "open" in wl:
        ocfgs = [c for c in a.open_configs.split(",") if c]
        for r in range(reps["open"]):
            for i, rate in enumerate(float(x) for x in a.rates.split(",") if x):
                for c in rotated(ocfgs, r + i):
                    cells.append({"id": f"open/{c}/{r}/{rate:g}", "workload": "open", "config": c, "rep": r,
                                  "rate": rate})
    return cells


# -- the server -----------------------------------------------------------------------------------
def gds_extra(a: argparse.Namespace) -> dict[str, Any]:
    return {"capacity": a.capacity}


def nixl_extra() -> dict[str, Any]:
    # The cleaner counts fullness as 1 - avail/total: on a disk that is ~75 % "full" before anything
    # is written (the GPU machine's), it would delete HiCacheNixl's pages mid-run.
    return {"l3_cleaner_enabled": False}


def server_command(a: argparse.Namespace, port: int) -> tuple[list[str], dict[str, str]]:
    launcher = [sys.executable, os.path.join(HERE, "fake_server.py")] if a.fake else \
        [sys.executable, "-m", "sglang.launch_server"]
    cmd = launcher + [
        "--model-path", a.model, "--load-format", "dummy", "--skip-tokenizer-init", "--host", "127.0.0.1",
        "--port", str(port), "--page-size", str(a.page_size), "--attention-backend", "triton",
        "--sampling-backend", "pytorch", "--grammar-backend", "none", "--disable-prefill-cuda-graph",
        "--disable-decode-cuda-graph", "--max-total-tokens", str(a.max_total_tokens), "--chunked-prefill-size",
        str(a.chunk), "--mem-fraction-static", str(a.mem_fraction), "--random-seed", "0", "--enable-metrics",
        "--served-model-name", f"e2e-{a.shape}", "--admin-api-key", KEY,
        "--enable-hierarchical-cache", "--hicache-ratio", str(a.hicache_ratio), "--hicache-mem-layout", a.layout,
        "--hicache-io-backend", "kernel", "--hicache-write-policy", "write_through",
        "--hicache-storage-backend", "gds", "--hicache-storage-prefetch-policy", "wait_complete",
        "--hicache-storage-backend-extra-config", json.dumps(gds_extra(a))]
    cmd += tp_args(a) + list(getattr(a, "server_arg", None) or [])
    env = dict(os.environ)
    env["GDS_PATH"] = ",".join(gds_dirs(a))
    env["SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"] = os.path.join(a.dir, "nixl")
    for d in (*gds_dirs(a), env["SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"]):
        os.makedirs(d, mode=0o700, exist_ok=True)  # the server opens its backend at start: GDS_PATH must exist
    env["SGLANG_HICACHE_NIXL_BACKEND_PLUGIN"] = "POSIX"
    if getattr(a, "trace", False):  # the prefetch timeline of every backend (trace_report.py reads it)
        env["HICACHE_GDS_TRACE"] = "1"
    return cmd, env


def tp_args(a: argparse.Namespace) -> list[str]:
    """``--tp-size N`` where ``--tp`` asks for more than one GPU (TP=1: the command as before).

    What is sized per GPU stays as given: ``--max-total-tokens`` counts tokens, and every rank's
    pool holds all of them (its share of the KV heads, or for MLA the whole latent);
    ``--mem-fraction-static`` is each GPU's fraction. The host pool and the L3 are per rank too:
    with MHA each rank stores its heads' share of a page, with MLA rank 0 alone writes and every
    rank reads (hicache-gds' MLA split)."""
    return ["--tp-size", str(a.tp)] if getattr(a, "tp", 1) > 1 else []


def l3_writers(a: argparse.Namespace) -> int:
    """How many ranks write their own copy of a page's share to each L3: every TP rank with MHA
    (its KV heads' share, in its own namespace), rank 0 alone with MLA (every rank holds the same
    latent). hicache-gds' ``capacity`` is per namespace, so per writing rank."""
    return 1 if a.model_info.get("attention") == "mla" else max(1, getattr(a, "tp", 1))


def runs_gds(a: argparse.Namespace) -> bool:
    """Whether any configuration of the run (single, burst or open loop) writes a hicache-gds namespace."""
    return any(split_config(c)[0].startswith("gds") for c in (a.configs + "," + a.open_configs).split(",") if c)


def check_space(a: argparse.Namespace) -> None:
    """Refuse to start when the disks cannot hold what the run writes: hicache-gds' capacity per
    writing rank (its slabs are preallocated), HiCacheNixl's pages and the raw-disk probe. A full
    disk fails HiCacheNixl's writes and then every reattach of hicache-gds (its index cannot grow),
    which the measurements would otherwise report as slow reads or misses."""
    from hicache_gds.config import parse_size

    kv = a.model_info["kv_bytes_per_token"]
    need: dict[int, list] = {}  # st_dev -> [bytes needed, a directory on it]

    def want(d: str, n: int) -> None:
        os.makedirs(d, exist_ok=True)
        dev = os.stat(d).st_dev
        used = 0
        for root, _dirs, files in os.walk(d):  # what an earlier call left (a reused L3) is already there
            for f in files:
                try:
                    used += os.stat(os.path.join(root, f)).st_blocks * 512
                except OSError:
                    pass
        need.setdefault(dev, [0, d])[0] += max(0, n - used)

    cap = parse_size(a.capacity, key="--capacity") * l3_writers(a)
    dirs = gds_dirs(a)
    if runs_gds(a):
        for d in dirs:
            want(d, cap // len(dirs))
    if any(split_config(c)[0] == "nixl" for c in a.configs.split(",") if c):
        want(os.path.join(a.dir, "nixl"), sum(lengths(a)[i] + a.suffix_tokens for i in single_set(a)) * kv)
    if a.raw_size not in ("0", "") and not a.fake:
        want(a.dir, parse_size(a.raw_size, key="--raw-size"))
    for dev, (n, d) in need.items():
        st = os.statvfs(d)
        free = st.f_bavail * st.f_frsize
        if n > free:
            raise SystemExit(
                f"[suite] {d}: the run needs {n / 2**30:.1f} GiB more there, the disk has {free / 2**30:.1f} GiB free "
                f"(hicache-gds --capacity {a.capacity} x {l3_writers(a)} writing rank(s), HiCacheNixl's pages, the "
                f"raw-disk probe): lower --capacity (it is per rank at TP > 1 with MHA) or give the run more room")


def check_capacity(a: argparse.Namespace) -> None:
    """Refuse to start when hicache-gds' namespace cannot hold the run's prompts: each writing
    rank stores its share of every prompt's pages (MHA: 1/TP of a token's KV, MLA: rank 0 all of
    it), and a namespace smaller than that evicts pages between SGLang's existence query and its
    get, so revisits end short or are revoked and the run measures an undersized store, not the
    policy (a TP=1 call given a TP=2 call's per-rank capacity did: 0.71x recompute against 0.46x)."""
    from hicache_gds.config import parse_size

    if not runs_gds(a):
        return
    writers = l3_writers(a)
    ps = a.page_size
    tokens = sum(-(-(n + a.suffix_tokens) // ps) * ps for n in lengths(a))
    need = tokens * a.model_info["kv_bytes_per_token"] // writers
    cap = parse_size(a.capacity, key="--capacity")
    if cap < need:
        raise SystemExit(
            f"[suite] --capacity {a.capacity} per writing rank is smaller than the {a.prefixes} prompts' KV each of "
            f"{writers} writing rank(s) stores ({tokens} tokens, {need / 2**30:.1f} GiB): hicache-gds would evict "
            f"pages the run revisits; give --capacity {-(-need // 2**30) + 1}G or more (it is per rank at TP > 1 "
            f"with MHA), or fewer or shorter prompts")


def gds_dirs(a: argparse.Namespace) -> list[str]:
    """hicache-gds' directories (its GDS_PATH): ``--gds-path``'s, else ``<dir>/gds``."""
    given = [d for d in (getattr(a, "gds_path", "") or "").split(",") if d]
    return [os.path.join(d, "gds") for d in given] if given else [os.path.join(a.dir, "gds")]


def l3_dirs(a: argparse.Namespace) -> list[str]:
    """Every directory an L3 of this run writes to (the devices whose writes must drain)."""
    return [*gds_dirs(a), os.path.join(a.dir, "nixl")]


def stored_pages(a: argparse.Namespace, backend: str) -> int:
    d = os.path.join(a.dir, backend)
    if backend == "nixl":  # a file per page, or per K and per V (HiCacheNixl's zero-copy MHA pages)
        names = [f for _, _, files in os.walk(d) for f in files]
        ks = sum(f.endswith("_k") for f in names)
        return ks if ks else len(names)
    if a.fake:
        try:
            return len(json.load(open(os.path.join(d, "fake-l3.json"))))
        except (OSError, ValueError):
            return 0
    from hicache_gds import read_keys
    from hicache_gds.index import INDEX_FILE
    return sum(len(read_keys(os.path.dirname(p))) for g in gds_dirs(a)
               for p in glob.glob(os.path.join(g, "**", INDEX_FILE), recursive=True))


class Switch:
    """What the server has attached, and the runtime calls that change it."""

    def __init__(self, srv: Server, a: argparse.Namespace) -> None:
        self.srv, self.a = srv, a
        self.backend: str | None = "gds"  # as started
        self.policy = "wait_complete"
        self.variant: dict[str, Any] = {}
        self.log: list[dict[str, Any]] = []

    def _call(self, method: str, body: dict | None = None) -> None:
        t = time.monotonic()
        for attempt in range(30):  # the server answers 400 while requests are still finishing
            code, text = admin(self.srv, method, "/hicache/storage-backend", KEY, body)
            if code == 200:
                self.log.append({"call": method, "body": body, "s": round(time.monotonic() - t, 2)})
                return
            time.sleep(1.0)
        raise RuntimeError(f"{method} /hicache/storage-backend {json.dumps(body)}: {code} {text[:300]}")

    def to(self, cfg: str) -> None:
        base, variant = split_config(cfg)
        want, policy = ("gds", base[4:]) if base.startswith("gds-") else ("nixl", "wait_complete") \
            if base == "nixl" else (None, None)
        if self.backend is not None and (self.backend != want or self.variant != variant):
            self._call("DELETE")
            self.backend = None
        if want is None:
            return
        if self.backend == want and self.policy == policy:
            return
        extra = {**(gds_extra(self.a) if want == "gds" else nixl_extra()), **variant}
        self._call("PUT", {"hicache_storage_backend": want, "hicache_storage_prefetch_policy": policy,
                           "hicache_storage_backend_extra_config_json": json.dumps(extra)})
        self.backend, self.policy, self.variant = want, policy, variant

    def flush(self) -> None:
        for _ in range(60):
            code, text = admin(self.srv, "POST", "/flush_cache", KEY, {})
            if code == 200:
                return
            time.sleep(1.0)
        raise RuntimeError(f"/flush_cache: {code} {text[:200]}")


# -- workloads -------------------------------------------------------------------------------------
def send_all(srv: Server, items: list[tuple[str, list[int], float]], a: argparse.Namespace) -> list[Result]:
    """Send each (tag, ids, delay) `delay` seconds after a common start; results in `items` order."""
    start = threading.Barrier(len(items) + 1) if items else None
    t0 = [0.0]

    def one(tag: str, ids: list[int], delay: float) -> Result:
        start.wait()
        wait = t0[0] + delay - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return generate(srv, tag, ids, a.gen, a.req_timeout)

    with cf.ThreadPoolExecutor(max_workers=max(1, len(items))) as ex:
        futs = [ex.submit(one, *it) for it in items]
        t0[0] = time.perf_counter()
        start.wait()
        return [f.result() for f in futs]


def run_workload(srv: Server, cell: dict[str, Any], a: argparse.Namespace, lens: list[int]) -> list[Result]:
    w = cell["workload"]
    if w == "single":
        return [generate(srv, f"p{i}", prompt(i, lens[i], a, VISIT_SUFFIX), a.gen, a.req_timeout)
                for i in single_set(a)]
    if w == "burst":
        n = min(a.burst, len(lens))
        return send_all(srv, [(f"p{i}", prompt(i, lens[i], a, VISIT_SUFFIX), 0.0) for i in range(n)], a)
    if w == "host":
        return host_hit(srv, cell, a, lens)
    rate = cell["rate"]
    n = a.open_requests or len(lens)
    arrivals = open_arrivals(rate, n, int(cell.get("rep", 0)))
    return send_all(srv, [(f"p{i % len(lens)}", prompt(i % len(lens), lens[i % len(lens)], a, VISIT_SUFFIX),
                           float(t)) for i, t in enumerate(arrivals)], a)


def host_hit(srv: Server, cell: dict[str, Any], a: argparse.Namespace, lens: list[int]) -> list[Result]:
    """The ``host`` workload: the revisit of a prompt that only the host pool holds (its result
    alone; the visits before it raise where they fail)."""
    n = lens[0]
    seed = HOST_SEED  # the same prompt everywhere (its tokens compared with recompute's): an L3 that
    # holds it from an earlier measurement serves at most its first visit; the host pool, its revisit
    hi = min(120000, a.vocab - 1)
    head = np.random.default_rng(seed).integers(1000, hi, size=n).tolist()
    sfx = [np.random.default_rng(seed + k).integers(1000, hi, size=a.suffix_tokens).tolist() for k in (1, 2)]
    # the evictors: the measured prompts first (already in the L3s: a new prompt per evictor filled
    # gds's namespace past its capacity on the GPU machine, and the next measurements missed), new
    # ones only where those do not fill the GPU pool
    evictors, total = [], 0
    for i in range(len(lens)):
        if total >= a.max_total_tokens + n:
            break
        evictors.append(prompt(i, lens[i], a, VISIT_SUFFIX))
        total += lens[i]
    j = 0
    while total < a.max_total_tokens + n:
        evictors.append(prompt(EVICT_SEED + j, n, a, VISIT_SUFFIX))
        total, j = total + n, j + 1
    for tag, ids in [("host-first", head + sfx[0])] + [(f"evict{j}", e) for j, e in enumerate(evictors)]:
        r = generate(srv, tag, ids, a.gen, a.req_timeout)
        if r.error is not None:
            raise RuntimeError(f"host workload: {tag}: {r.error}")
    if not a.fake:
        wait_writes_quiet(l3_dirs(a), a.quiet_s, timeout_s=60.0)
    return [generate(srv, "host", head + sfx[1], a.gen, a.req_timeout)]


def open_arrivals(rate: float, n: int, rep: int) -> list[float]:
    """Send times (s from the first) of an open loop's `n` Poisson arrivals at `rate`: the same for
    every configuration of a repetition, another draw for each repetition (p90 over a few
    repetitions of one 16-arrival draw is that draw's; repetition 0 keeps the first draw)."""
    gaps = np.random.default_rng(int(rate * 1000) + 7 + 7919 * rep).exponential(1.0 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps)[:-1]]).tolist()


def cell_stats(rs: list[Result]) -> dict[str, Any]:
    ok = [r for r in rs if r.error is None]
    t = [r.ttft_s for r in ok]
    split = {k: sum(int(r.cached.get(k, 0) or 0) for r in rs) for k in ("device", "host", "storage")}
    prompt_tokens = sum(r.prompt_tokens for r in rs)
    split["computed"] = prompt_tokens - sum(int(r.cached.get("cached_tokens", 0) or 0) for r in rs)
    makespan = (max(r.t_end for r in rs) - min(r.t_start for r in rs)) if rs else float("nan")
    gen = sum(len(r.output_ids) for r in ok)
    return {"n": len(rs), "errors": len(rs) - len(ok), "mean": statistics.fmean(t) if t else float("nan"),
            "p50": pct(t, 50), "p90": pct(t, 90), "p99": pct(t, 99), "makespan_s": makespan,
            "output_tok_s": gen / makespan if makespan and makespan == makespan else float("nan"),
            "prompt_tokens": prompt_tokens, "split": split,
            "storage_frac": split["storage"] / max(prompt_tokens, 1),
            "per_prompt": {r.tag: r.ttft_s for r in rs}}


# -- one run ---------------------------------------------------------------------------------------
class Suite:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.t_start = time.monotonic()
        self.path = os.path.join(a.out, f"suite-{a.shape}.json")
        self.lens = lengths(a)
        self.doc: dict[str, Any] = {"cells": {}, "populated": {}, "calls": []}
        if a.resume and os.path.exists(self.path):
            self.doc = json.load(open(self.path))
            self.doc.setdefault("calls", [])
        self.doc.update(args=vars(a), model=a.model_info, lengths=self.lens, single=single_set(a),
                        machine=machine(), versions=versions())
        self.call: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cells": []}
        self.doc["calls"].append(self.call)
        self.srv: Server | None = None

    def left(self) -> float:
        return self.a.deadline - (time.monotonic() - self.t_start) if self.a.deadline else math.inf

    def save(self) -> None:
        os.makedirs(self.a.out, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(_jsonable(self.doc), f, indent=1)
        os.replace(tmp, self.path)
        from suite_report import write_report
        write_report(self.doc, self.a.out, self.a.shape, plot=self.a.plot)

    def estimate(self, cell: dict[str, Any]) -> float:
        """Seconds a measurement is expected to take: its workload's earlier ones, else a guess."""
        same = [c["wall_s"] for c in self.doc["cells"].values()
                if c.get("workload") == cell["workload"] and c.get("config") == cell["config"] and "wall_s" in c]
        if same:
            return max(same)
        others = [c["wall_s"] for c in self.doc["cells"].values() if c.get("workload") == cell["workload"]
                  and "wall_s" in c]
        if others:
            return 1.5 * max(others)
        if cell["workload"] == "open":
            return (self.a.open_requests or len(self.lens)) / cell["rate"] + 30.0
        return 60.0

    def start(self) -> None:
        stop_leftovers()
        port = free_port()
        cmd, env = server_command(self.a, port)
        log_path = os.path.join(self.a.out, f"server-suite-{self.a.shape}-{len(self.doc['calls'])}.log")
        print(f"[suite] starting: {' '.join(cmd[2:])}", flush=True)
        self.srv = Server(cmd, env, log_path, port)
        self.call["start_s"] = round(self.srv.wait_ready(self.a.start_timeout), 1)
        self.call["command"] = " ".join(cmd[1:])
        self.switch = Switch(self.srv, self.a)
        self.switch.to("recompute")  # the warmup (kernels compile) stays out of the L3: disk space
        warm = generate(self.srv, "warmup", tokens(1, 2 * self.a.chunk + 64), self.a.gen, self.a.req_timeout)
        self.call["warmup_error"] = warm.error
        print(f"[suite] ready in {self.call['start_s']} s", flush=True)

    def populate(self, backend: str) -> None:
        """Write the prompts to one L3 once (kept across calls: checked by its page count)."""
        idx = list(range(len(self.lens))) if backend == "gds" else single_set(self.a)
        copy = sum((self.lens[i] + self.a.suffix_tokens) // self.a.page_size for i in idx)
        want = copy * l3_writers(self.a)  # every writing rank stores its own share of each page, counted as a page
        have = stored_pages(self.a, backend)
        marker = os.path.join(self.a.dir, f"populated-{backend}.json")
        spec = {"shape": self.a.shape, "lengths": self.lens, "prompts": idx, "suffix_tokens": self.a.suffix_tokens,
                "page_size": self.a.page_size, "capacity": self.a.capacity if backend == "gds" else None}
        try:
            done = json.load(open(marker))
        except (OSError, ValueError):
            done = None
        if done and done.get("spec") == spec and have >= done.get("min_pages", want):
            print(f"[suite] {backend}: L3 already holds {have} pages (written by an earlier call, reused)", flush=True)
            self.doc["populated"].setdefault(backend, dict(done, reused=True))
            return
        t = time.monotonic()
        self.switch.to("gds-wait_complete" if backend == "gds" else "nixl")
        self.switch.flush()
        before = backed_up_tokens(self.srv) or 0
        rs = [generate(self.srv, f"w{i}", prompt(i, self.lens[i], self.a, POP_SUFFIX), self.a.gen, self.a.req_timeout)
              for i in idx]
        expect = before + copy * self.a.page_size  # SGLang counts tokens backed up, not copies
        last, since, t_wait = -1, time.monotonic(), time.monotonic()
        while time.monotonic() - t_wait < self.a.drain_timeout:
            now = stored_pages(self.a, backend)
            if now != last:
                last, since = now, time.monotonic()
            backed = backed_up_tokens(self.srv)
            # drained: SGLang counts the pages backed up (or the L3 holds them all), and the L3's
            # page count has stopped moving
            if (backed is None or backed >= expect or now >= want) and time.monotonic() - since >= self.a.stable_s:
                break
            time.sleep(0.5)
        pages = stored_pages(self.a, backend)
        quiet = {} if self.a.fake else wait_writes_quiet(l3_dirs(self.a), self.a.quiet_s)
        self.doc["populated"][backend] = {"prompts": idx, "pages": pages, "expected_pages": want, "write_quiet": quiet,
                                          "min_pages": min(pages, want), "errors": [r.error for r in rs if r.error],
                                          "seconds": round(time.monotonic() - t, 1),
                                          "backed_up_tokens": backed_up_tokens(self.srv)}
        print(f"[suite] {backend}: wrote {pages} pages (expected {want}) in {time.monotonic() - t:.0f} s", flush=True)
        if not self.doc["populated"][backend]["errors"]:
            with open(marker, "w") as f:
                json.dump(dict(self.doc["populated"][backend], spec=spec), f)
        self.save()

    def measure(self, cell: dict[str, Any]) -> dict[str, Any]:
        t = time.monotonic()
        self.switch.to(cell["config"])
        self.switch.flush()
        # the write-back of the cell before has drained (a device busy writing reads slower)
        quiet = {} if self.a.fake else wait_writes_quiet(l3_dirs(self.a), self.a.quiet_s, timeout_s=60.0)
        page_cache = drop_caches()
        time.sleep(0.5)
        t_run = time.monotonic()
        rs = run_workload(self.srv, cell, self.a, self.lens)
        rec = dict(cell, results=rs, stats=cell_stats(rs), page_cache=page_cache, write_quiet=quiet,
                   switch_s=round(t_run - t, 2), wall_s=round(time.monotonic() - t, 1),
                   at=time.strftime("%H:%M:%S"))
        if cell["config"].startswith("gds"):
            rec["metrics"] = [m for m in metrics_lines(self.srv) if "hicache_gds" in m or "prefetch" in m][:80]
        return rec

    def run(self) -> int:
        install_guard()
        a = self.a
        if a.raw_size not in ("0", "") and "raw_disk" not in self.doc and not a.fake:
            self.doc["raw_disk"] = raw_disk(a.dir, a.raw_size)
            print("[suite] raw disk:", json.dumps(self.doc["raw_disk"]), flush=True)
            read = next((j.get("raw_MBps") for j in self.doc["raw_disk"].values()
                         if isinstance(j, dict) and j.get("rw") == "read"), None)
            if read:
                kv = a.model_info["kv_bytes_per_token"]
                print(f"[suite] L3 pays one request at a time when the GPU prefills {a.shape} slower than "
                      f"{read * 1e6 / kv:,.0f} tokens/s ({read:.0f} MB/s / {kv >> 10} KiB per token)", flush=True)
        todo = [c for c in plan(a) if c["id"] not in self.doc["cells"]]
        print(f"[suite] {len(todo)} measurements to go ({len(self.doc['cells'])} kept)", flush=True)
        rc = 0
        try:
            if todo:
                self.start()
                self.populate("gds")
                if any(c["config"] == "nixl" for c in todo):
                    self.populate("nixl")
                if a.overwrite_gib and not a.fake:
                    self.call["overwrite"] = overwrite(a.dir, a.overwrite_gib)
                    print(f"[suite] overwrote the disk's recent writes: {json.dumps(self.call['overwrite'])}",
                          flush=True)
            for cell in todo:
                need = self.estimate(cell) + 30.0  # + stopping the server
                if need > self.left():
                    print(f"[suite] {cell['id']} needs ~{need:.0f} s, {self.left():.0f} s left: stopping here "
                          f"(--resume goes on)", flush=True)
                    rc = 3
                    break
                try:
                    rec = self.measure(cell)
                except Exception as exc:  # noqa: BLE001 -- record it, go on with the others
                    rec = dict(cell, error=f"{type(exc).__name__}: {exc}")
                    if self.srv is not None and self.srv.proc.poll() is not None:
                        self.doc["cells"][cell["id"] + "#failed"] = rec
                        raise RuntimeError(f"the server died during {cell['id']}") from exc
                s = rec.get("stats", {})
                print(f"[suite] {cell['id']}: {rec.get('error') or ''} mean TTFT {s.get('mean', float('nan')):.3f} s, "
                      f"makespan {s.get('makespan_s', float('nan')):.2f} s, storage "
                      f"{s.get('storage_frac', 0):.0%} (wall {rec.get('wall_s')} s)", flush=True)
                if "error" not in rec:
                    self.doc["cells"][cell["id"]] = rec
                    self.call["cells"].append(cell["id"])
                else:
                    self.call.setdefault("errors", []).append(rec)
                self.save()
        except Exception as exc:  # noqa: BLE001
            self.call["error"] = f"{type(exc).__name__}: {exc}"
            print(f"[suite] error: {self.call['error']}", flush=True)
            rc = 1
        finally:
            if self.srv is not None:
                self.call["switches"] = self.switch.log if hasattr(self, "switch") else []
                self.call["stop"] = self.srv.stop()
                self.call["log"] = log_facts(self.srv.log_path)
            self.call["seconds"] = round(time.monotonic() - self.t_start, 1)
            self.save()
        left = [c for c in plan(a) if c["id"] not in self.doc["cells"]]
        print(f"[suite] done in {self.call['seconds']} s; {len(left)} measurement(s) left", flush=True)
        return rc if rc else (3 if left else 0)


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("suite (one server, configurations switched at runtime)")
    g.add_argument("--workloads", default="single,burst,open", help=f"of {', '.join(WORKLOADS)}")
    g.add_argument("--lengths", default="12288:24576", help="FIRST:LAST prefix tokens of the --prefixes prompts")
    g.add_argument("--single", type=int, default=3, help="prompts sent one at a time (spread over the lengths)")
    g.add_argument("--burst", type=int, default=8, help="prompts sent at once")
    g.add_argument("--rates", default="0.1,0.2,0.3", help="open loop: requests/s")
    g.add_argument("--open-requests", type=int, default=0, help="open loop: requests per rate (0: --prefixes)")
    g.add_argument("--open-configs", default="recompute,gds-wait_complete,gds-compute_or_load")
    g.add_argument("--reps", default="single=3,burst=2,open=1", help="repetitions per workload")
    g.add_argument("--deadline", type=float, default=0.0, help="seconds this call may take (0: no limit)")
    g.add_argument("--plot", action="store_true", help="draw TTFT p90 against rate (matplotlib: the plot extra)")
    g.add_argument("--fake", action="store_true", help="run against fake_server.py (dry run, no GPU)")
    g.add_argument("--overwrite-gib", type=float, default=0.0,
                   help="after writing the L3s, write (and delete) this many GiB on the same disk, so a virtual "
                        "disk's host cache holds neither backend's pages (disk_recency.sh measures the effect)")
    g.add_argument("--gds-path", default="",
                   help="comma-separated directories for hicache-gds' L3 (one per device: pages striped across "
                        "them; each gets a gds/ folder); default <dir>/gds")
    g.add_argument("--quiet-s", type=float, default=2.0,
                   help="before each measurement and after writing the L3s, wait until the L3 devices have "
                        "written nothing for this long (their sectors written, /sys/dev/block; 0: no wait)")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size: the server gets --tp-size N (N GPUs); recorded in the report")
    g.add_argument("--layers", type=int, default=0,
                   help="run the model's shape with this many layers: a copy of its config.json under "
                        "<out>/models/ (num_hidden_layers=N), named <shape>-L<N> in the report and result files")
    g.add_argument("--weights", default="", choices=("", "bf16", "fp8"),
                   help="weights' dtype in that copy: fp8 adds DeepSeek-V3's block-FP8 quantization_config, "
                        "bf16 drops any (default: the config's own)")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for sglang.launch_server, as given (repeat it; use --server-arg=--flag), "
                        "e.g. --server-arg=--enforce-disable-flashinfer-allreduce-fusion: at TP=4 with the DeepSeek "
                        "shape, that workspace's set-up took 4 of a 7.6-minute start")
    g.add_argument("--trace", action="store_true",
                   help="log each request's prefetch timeline in the server (HICACHE_GDS_TRACE=1; trace_report.py)")


def main(a: argparse.Namespace) -> int:
    if a.tp < 1:
        raise SystemExit(f"--tp {a.tp}: must be at least 1")
    a.model = model_variant(a.model, a.out, a.layers, a.weights)
    a.model_info = model_info(a.model, a.tp)
    a.shape = a.model_info["name"]
    a.vocab = a.model_info["vocab_size"]
    if a.configs == "recompute,hicache,file,nixl,gds":  # bench_sglang_server's default: the suite's instead
        a.configs = DEFAULT_CONFIGS
    bad = [c for c in (a.configs + "," + a.open_configs).split(",") if c and split_config(c)[0] not in CONFIGS]
    if bad:
        raise SystemExit(f"suite configurations: unknown {bad}; choose from {', '.join(CONFIGS)}")
    if a.mode in WORKLOADS:
        a.workloads = a.mode
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.dir, exist_ok=True)
    kv = a.model_info["kv_bytes_per_token"]
    print(f"[suite] {a.shape} ({a.model_info['attention']}, {a.model_info['layers']} layers, TP={a.tp}): {kv} bytes "
          f"of KV per token in L3 ({kv / 1024:.0f} KiB); L3 of {a.prefixes} prompts "
          f"{lengths(a)[0]}-{lengths(a)[-1]} tokens = {sum(lengths(a)) * kv / 1e9:.1f} GB (gds), "
          f"{sum(lengths(a)[i] for i in single_set(a)) * kv / 1e9:.1f} GB (nixl)", flush=True)
    check_capacity(a)
    if not a.fake:  # the fake server preallocates nothing
        check_space(a)
    return Suite(a).run()

