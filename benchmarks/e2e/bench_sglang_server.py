"""Time-to-first-token of a running SGLang server, per L3 configuration, on one disk, in one run.

    python benchmarks/e2e/bench_sglang_server.py --dir /var/tmp/e2e-store \
        --configs recompute,hicache,file,nixl,gds --out results/

Each configuration is a fresh ``python -m sglang.launch_server`` (Llama-3-8B geometry,
``--load-format dummy``, ``--skip-tokenizer-init``, token ids over HTTP) on the same ``--dir``:

============  ==========================================================================
recompute     no hierarchical cache: only the GPU radix cache
hicache       HiCache (GPU + pinned host pool), no L3
file          HiCache + ``--hicache-storage-backend file`` (SGLang's HiCacheFile)
nixl          HiCache + ``--hicache-storage-backend nixl`` (SGLang's HiCacheNixl, NIXL POSIX)
gds           HiCache + ``--hicache-storage-backend gds`` (this project, by name)
gds-dynamic   the same backend through SGLang's ``dynamic`` loader
============  ==========================================================================

Workloads (``--mode``):

* ``prefix``: ``--prefixes`` distinct random prompts of ``--prefix-tokens`` tokens, each sent
  once with a short suffix (pass 1: cold prefill), then, after the L3 writes have drained and the
  page cache was dropped, each again with another suffix (pass 2). The prefixes together exceed
  the GPU pool (``--max-total-tokens``) and the host pool (``--hicache-ratio`` x GPU), and pass 2
  visits them in pass 1's order, so under LRU a second visit can only hit in L3 (or recompute).
* ``multiturn``: ``--clients`` conversations of ``--rounds`` turns, served round-robin (as
  SGLang's ``benchmark/hicache/bench_multiturn.py`` does, one request at a time here); each
  turn appends ``--turn-tokens`` new tokens and the previous answer to the history.

Requests are sequential and streamed; TTFT is the time to the first streamed chunk. The server
reports where each prompt's cached tokens came from (``meta_info.cached_tokens_details``: device,
host, storage); those counts are kept with every request. Decoding is greedy; pass 2's tokens
(and their logprobs) are compared with the ``recompute`` configuration's for the same prompts.

Also measured in the same run: the disk's raw O_DIRECT throughput (``hicache-gds-bench``'s raw
baseline), server start and shutdown time, ``POST /flush_cache`` followed by a third visit of a
few prefixes (which must come back from L3), and the server's ``/metrics`` storage lines.
Results: ``results.json`` and ``results.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
MODEL_DIR = os.path.join(HERE, "llama3-8b-shape")
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # Llama-3-8B: layers x (K, V) x KV heads x head_dim x bf16
CONFIGS = ("recompute", "hicache", "file", "nixl", "gds", "gds-dynamic")
STORAGE = ("file", "nixl", "gds", "gds-dynamic")


# -- configurations ---------------------------------------------------------------------------------
def server_command(cfg: str, a: argparse.Namespace, port: int, store_dir: str) -> tuple[list[str], dict[str, str]]:
    """The launch command and environment of one configuration."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--load-format", "dummy",
           "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port), "--page-size", str(a.page_size),
           "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
           "--disable-prefill-cuda-graph", "--disable-decode-cuda-graph",
           "--max-total-tokens", str(a.max_total_tokens), "--chunked-prefill-size", str(a.chunk),
           "--mem-fraction-static", str(a.mem_fraction), "--random-seed", "0", "--enable-metrics",
           "--served-model-name", "e2e-llama3-8b-shape"]
    env = dict(os.environ)
    if cfg == "recompute":
        return cmd, env
    cmd += ["--enable-hierarchical-cache", "--hicache-ratio", str(a.hicache_ratio), "--hicache-mem-layout",
            a.layout, "--hicache-io-backend", "kernel", "--hicache-write-policy", "write_through"]
    if cfg == "hicache":
        return cmd, env
    cmd += ["--hicache-storage-prefetch-policy", a.prefetch_policy]
    if cfg == "file":
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = store_dir
        cmd += ["--hicache-storage-backend", "file"]
    elif cfg == "nixl":
        env["SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"] = store_dir
        env["SGLANG_HICACHE_NIXL_BACKEND_PLUGIN"] = "POSIX"
        cmd += ["--hicache-storage-backend", "nixl"]
    else:
        env["GDS_PATH"] = store_dir
        extra: dict[str, Any] = {"capacity": a.capacity}
        if cfg == "gds":
            cmd += ["--hicache-storage-backend", "gds"]
        else:
            extra.update(backend_name="gds", module_path="hicache_gds_sglang", class_name="HiCacheGDS", interface_v1=1)
            cmd += ["--hicache-storage-backend", "dynamic"]
        cmd += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
    return cmd, env


def stored_pages(cfg: str, store_dir: str) -> int:
    """Pages the configuration's L3 holds now (files for SGLang's backends, index rows for ours)."""
    if cfg in ("file", "nixl"):
        return sum(len(files) for _, _, files in os.walk(store_dir))
    if cfg.startswith("gds"):
        from hicache_gds import read_keys
        from hicache_gds.index import INDEX_FILE
        return sum(len(read_keys(os.path.dirname(p)))
                   for p in glob.glob(os.path.join(store_dir, "**", INDEX_FILE), recursive=True))
    return 0


# -- one server ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``sglang.launch_server`` process group, its log, readiness and shutdown."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: str, port: int) -> None:
        self.port, self.log_path = port, log_path
        self.log = open(log_path, "w")
        self.log.write("$ " + " ".join(cmd) + "\n")
        self.log.flush()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t0
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not ready after {timeout:.0f} s; see {self.log_path}")

    def post(self, path: str, body: dict | None = None, timeout: float = 60.0,
             api_key: str | None = None) -> tuple[int, str]:
        """POST `body` as JSON; `api_key`: the server's --admin-api-key (its admin endpoints,
        /flush_cache among them, answer 401 without it)."""
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        req = urllib.request.Request(self.url(path), data=json.dumps(body or {}).encode(), method="POST",
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def get(self, path: str, timeout: float = 30.0) -> str:
        with urllib.request.urlopen(self.url(path), timeout=timeout) as r:
            return r.read().decode(errors="replace")

    def stop(self, timeout: float = 90.0) -> dict[str, Any]:
        """SIGTERM the server's process group; SIGKILL what is left after `timeout` (a hang)."""
        t = time.monotonic()
        hung = False
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                hung = True
        left = _group_pids(self.proc.pid)
        if left:
            time.sleep(3.0)
            left = _group_pids(self.proc.pid)
        if left or hung:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)
        self.log.close()
        return {"shutdown_s": round(time.monotonic() - t, 2), "hung": hung, "leftover_pids": left,
                "exit_code": self.proc.returncode}


def _group_pids(pgid: int) -> list[int]:
    out = []
    for p in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(p).read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(p.split("/")[2]))
        except (OSError, IndexError, ValueError):
            pass
    return out


# -- requests -----------------------------------------------------------------------------------
@dataclass
class Result:
    tag: str
    prompt_tokens: int
    ttft_s: float
    latency_s: float
    output_ids: list[int]
    logprobs: list[float]
    cached: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def generate(srv: Server, tag: str, ids: list[int], gen: int, timeout: float) -> Result:
    """One streamed, greedy /generate; TTFT is the first chunk's arrival."""
    body = {"input_ids": ids, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": gen, "temperature": 0.0, "ignore_eos": True}}
    req = urllib.request.Request(srv.url("/generate"), data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    out: list[int] = []
    last: dict[str, Any] = {}
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if ttft is None:
                    ttft = time.perf_counter() - t0
                ids_now = chunk.get("output_ids") or []
                # cumulative (default) or incremental (--incremental-streaming-output) chunks
                out = list(ids_now) if ids_now[:len(out)] == out and len(ids_now) >= len(out) else out + list(ids_now)
                last = chunk
    except Exception as exc:  # noqa: BLE001 -- recorded with the result, the run goes on
        return Result(tag, len(ids), float("nan"), time.perf_counter() - t0, out, [], {}, f"{type(exc).__name__}: {exc}")
    meta = last.get("meta_info", {})
    lps = [float(x[0]) if x and x[0] is not None else float("nan") for x in meta.get("output_token_logprobs") or []]
    lp_ids = [int(x[1]) for x in meta.get("output_token_logprobs") or [] if x and x[1] is not None]
    if len(lp_ids) == gen:
        out = lp_ids  # the authoritative sequence where the server sends it
    cached = dict(meta.get("cached_tokens_details") or {})
    cached["cached_tokens"] = meta.get("cached_tokens", 0)
    return Result(tag, len(ids), ttft if ttft is not None else float("nan"), time.perf_counter() - t0, out, lps,
                  cached, None if ttft is not None else "no chunk received")


def backed_up_tokens(srv: "Server") -> int | None:
    """SGLang's own count of tokens its controller has written to L3 (``/metrics``), or None."""
    try:
        text = srv.get("/metrics")
    except Exception:  # noqa: BLE001
        return None
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("sglang:backuped_tokens_total")]
    return int(sum(vals)) if vals else None


def wait_stored(srv: "Server", counter: Callable[[], int], expect_tokens: int, stable_s: float,
                timeout: float) -> dict[str, Any]:
    """Wait until the L3 writes of what was sent have drained: SGLang's backed-up token count has
    reached `expect_tokens` (the full pages of every prompt so far) and the backend's page count has
    not changed for `stable_s`; at most `timeout`."""
    t0 = time.monotonic()
    last, since = counter(), time.monotonic()
    backed = backed_up_tokens(srv)
    while time.monotonic() - t0 < timeout:
        time.sleep(0.5)
        now = counter()
        if now != last:
            last, since = now, time.monotonic()
        backed = backed_up_tokens(srv)
        if (backed is None or backed >= expect_tokens) and time.monotonic() - since >= stable_s:
            break
    return {"stored_pages": last, "backed_up_tokens": backed, "expected_tokens": expect_tokens,
            "drain_wait_s": round(time.monotonic() - t0, 1), "drained": backed is None or backed >= expect_tokens}


def drop_caches() -> str:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError as exc:
        return f"not dropped ({exc.strerror})"


# -- workloads ----------------------------------------------------------------------------------
def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1000, 120000, size=n).tolist()


def run_prefix(srv: Server, cfg: str, a: argparse.Namespace, store_dir: str) -> dict[str, Any]:
    prefixes = [tokens(1000 + i, a.prefix_tokens) for i in range(a.prefixes)]
    res: dict[str, Any] = {"pass1": [], "pass2": [], "pass3": []}
    for i, p in enumerate(prefixes):
        res["pass1"].append(generate(srv, f"p{i}", p + tokens(2000 + i, a.suffix_tokens), a.gen, a.req_timeout))
    if cfg in STORAGE:
        sent = [2 * a.chunk + 64] + [a.prefix_tokens + a.suffix_tokens] * a.prefixes  # the warmup, then pass 1
        expect = sum(n // a.page_size * a.page_size for n in sent)
        res["drain"] = wait_stored(srv, lambda: stored_pages(cfg, store_dir), expect, a.stable_s, a.drain_timeout)
    res["page_cache"] = drop_caches()
    for i, p in enumerate(prefixes):
        res["pass2"].append(generate(srv, f"p{i}", p + tokens(3000 + i, a.suffix_tokens), a.gen, a.req_timeout))
    # a running server's /flush_cache empties GPU and host caches: the third visit must come from L3
    t = time.monotonic()
    code, text = srv.post("/flush_cache", timeout=120)
    res["flush"] = {"status": code, "body": text[:200], "seconds": round(time.monotonic() - t, 2)}
    time.sleep(1.0)
    for i in range(min(a.revisit_after_flush, a.prefixes)):
        res["pass3"].append(generate(srv, f"p{i}", prefixes[i] + tokens(3000 + i, a.suffix_tokens), a.gen,
                                     a.req_timeout))
    return res


def run_multiturn(srv: Server, cfg: str, a: argparse.Namespace, store_dir: str) -> dict[str, Any]:
    hist = [tokens(5000 + c, a.turn_tokens) for c in range(a.clients)]
    rounds: list[list[Result]] = []
    for r in range(a.rounds):
        this = []
        for c in range(a.clients):
            prompt = hist[c] if r == 0 else hist[c] + tokens(6000 + 100 * c + r, a.turn_tokens)
            out = generate(srv, f"c{c}r{r}", prompt, a.answer_tokens, a.req_timeout)
            hist[c] = prompt + (out.output_ids or tokens(7000 + 100 * c + r, a.answer_tokens))
            this.append(out)
        rounds.append(this)
    return {"rounds": rounds}


# -- summary ------------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ttft_stats(rs: list[Result], new_tokens: Callable[[Result], int]) -> dict[str, Any]:
    t = [r.ttft_s for r in rs if r.error is None]
    storage = sum(int(r.cached.get("storage", 0) or 0) for r in rs)
    host = sum(int(r.cached.get("host", 0) or 0) for r in rs)
    device = sum(int(r.cached.get("device", 0) or 0) for r in rs)
    prompt = sum(r.prompt_tokens for r in rs)
    return {"n": len(rs), "errors": sum(r.error is not None for r in rs),
            "p50": pct(t, 50), "p90": pct(t, 90), "p99": pct(t, 99), "mean": statistics.fmean(t) if t else float("nan"),
            "prefill_tok_s": sum(new_tokens(r) for r in rs if r.error is None) / max(sum(t), 1e-9),
            "prompt_tokens": prompt, "cached_device": device, "cached_host": host, "cached_storage": storage,
            "storage_hit_frac": storage / max(prompt, 1)}


def compare(rs: list[Result], ref: list[Result]) -> dict[str, Any]:
    """Greedy tokens of `rs` against the reference run's, prompt by prompt."""
    same = sum(a.output_ids == b.output_ids and bool(a.output_ids) for a, b in zip(rs, ref))
    diffs = [abs(x - y) for a, b in zip(rs, ref) for x, y in zip(a.logprobs, b.logprobs) if x == x and y == y]
    first_div = [next((k for k, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), None)
                 for a, b in zip(rs, ref)]
    return {"prompts": len(ref), "identical": same, "max_abs_logprob_diff": max(diffs) if diffs else None,
            "first_divergence": [d for d in first_div if d is not None][:8]}


def raw_disk(directory: str, size: str) -> dict[str, Any]:
    """The disk's raw O_DIRECT write and cold read throughput (hicache-gds-bench's raw baseline)."""
    d = os.path.join(directory, "rawbench")
    os.makedirs(d, exist_ok=True)
    cmd = [sys.executable, "-c", "from hicache_gds.bench.cli import main; main()", f"--directory={d}",
           f"--size={size}", "--engine=nixl-posix", "--output-format=json", "--drop_caches=1"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        doc = json.loads(out.stdout[out.stdout.index("{"):])
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        shutil.rmtree(d, ignore_errors=True)
    res = {}
    for job in doc.get("jobs", []):
        ours = job.get("hicache_gds", {})
        rw = "write" if job.get("write", {}).get("io_bytes") else "read"
        raw = ours.get("baseline", {}).get("raw", {})
        res[job.get("jobname", rw)] = {"rw": rw, "nixl_posix_MBps": job.get(rw, {}).get("bw_bytes", 0) / 1e6,
                                       "raw_MBps": raw.get(rw, {}).get("bw_bytes", 0) / 1e6,
                                       "raw_path": raw.get("path"), "ratio_to_raw": ours.get("ratio_to_raw")}
    return res


def metrics_lines(srv: Server) -> list[str]:
    try:
        text = srv.get("/metrics")
    except Exception as exc:  # noqa: BLE001
        return [f"# /metrics failed: {exc}"]
    return [line for line in text.splitlines() if ("hicache" in line or "storage" in line or "cache_hit" in line)
            and not line.startswith("#")][:80]


def log_facts(path: str) -> dict[str, Any]:
    """What the server log says about the L3 backend: engine/path lines, warnings, tracebacks."""
    facts: dict[str, list[str]] = {"backend": [], "warnings": [], "errors": []}
    with open(path, errors="replace") as f:
        for line in f:
            s = line.rstrip()[:400]
            if "hicache-gds" in s or "HiCacheNixl" in s or "HiCacheFile" in s or "storage backend" in s.lower():
                facts["backend"].append(s)
            if "Traceback" in s or " ERROR " in s or "Error:" in s:
                facts["errors"].append(s)
            elif "WARNING" in s and ("hicache" in s.lower() or "storage" in s.lower()):
                facts["warnings"].append(s)
    return {k: v[:30] for k, v in facts.items()}


def run_config(cfg: str, a: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    store_dir = os.path.join(a.dir, cfg)
    shutil.rmtree(store_dir, ignore_errors=True)
    os.makedirs(store_dir, mode=0o700)
    port = free_port()
    cmd, env = server_command(cfg, a, port, store_dir)
    log_path = os.path.join(out_dir, f"server-{cfg}.log")
    print(f"[{cfg}] starting: {' '.join(cmd[2:])}", flush=True)
    srv = Server(cmd, env, log_path, port)
    rec: dict[str, Any] = {"config": cfg, "command": " ".join(cmd[1:]),
                           "env": {k: env[k] for k in env if k.startswith(("GDS_PATH", "ENABLE_GDS", "HICACHE_GDS_",
                                                                           "SGLANG_HICACHE"))}}
    try:
        rec["start_s"] = round(srv.wait_ready(a.start_timeout), 1)
        warm = generate(srv, "warmup", tokens(1, 2 * a.chunk + 64), a.gen, a.req_timeout)  # compiles the kernels
        rec["warmup_error"] = warm.error
        t = time.monotonic()
        rec["workload"] = (run_prefix if a.mode == "prefix" else run_multiturn)(srv, cfg, a, store_dir)
        rec["workload_s"] = round(time.monotonic() - t, 1)
        rec["metrics"] = metrics_lines(srv)
    except Exception as exc:  # noqa: BLE001 -- one broken configuration must not lose the others
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        rec["stop"] = srv.stop()
        rec["log"] = log_facts(log_path)
        if cfg in STORAGE:
            rec["store_bytes_on_disk"] = _du(store_dir)
        if not a.keep:
            shutil.rmtree(store_dir, ignore_errors=True)
    print(f"[{cfg}] done: start {rec.get('start_s')} s, workload {rec.get('workload_s')} s, "
          f"stop {rec['stop']}, error {rec.get('error')}", flush=True)
    return rec


def _du(path: str) -> int:
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)


def summarize(records: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    by = {r["config"]: r for r in records}
    summary: dict[str, Any] = {}
    if a.mode == "prefix":
        ref = by.get("recompute", {}).get("workload", {}).get("pass2")
        for cfg, r in by.items():
            w = r.get("workload")
            if not w:
                summary[cfg] = {"error": r.get("error")}
                continue
            s = {"cold": ttft_stats(w["pass1"], lambda x: x.prompt_tokens),
                 "revisit": ttft_stats(w["pass2"], lambda x: x.prompt_tokens - int(x.cached.get("cached_tokens", 0))),
                 "after_flush": ttft_stats(w["pass3"], lambda x: x.prompt_tokens - int(x.cached.get("cached_tokens", 0)))
                 if w["pass3"] else None,
                 "flush": w.get("flush"), "drain": w.get("drain")}
            if ref and cfg != "recompute":
                s["tokens_vs_recompute"] = compare(w["pass2"], ref)
            summary[cfg] = s
        base = summary.get("recompute", {}).get("revisit", {}).get("p50")
        for cfg, s in summary.items():
            if base and "revisit" in s:
                s["revisit_p50_vs_recompute"] = s["revisit"]["p50"] / base
    else:
        for cfg, r in by.items():
            w = r.get("workload")
            if not w:
                summary[cfg] = {"error": r.get("error")}
                continue
            summary[cfg] = {f"round{i}": ttft_stats(rs, lambda x: x.prompt_tokens - int(x.cached.get("cached_tokens", 0)))
                            for i, rs in enumerate(w["rounds"])}
            later = [x for rs in w["rounds"][1:] for x in rs]
            summary[cfg]["later_rounds"] = ttft_stats(later, lambda x: x.prompt_tokens - int(x.cached.get("cached_tokens", 0)))
        base = summary.get("recompute", {}).get("later_rounds", {}).get("p50")
        for cfg, s in summary.items():
            if base and "later_rounds" in s:
                s["later_p50_vs_recompute"] = s["later_rounds"]["p50"] / base
    return summary


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"  # None: no recompute baseline in this run


def _table(header: list[str], summary: dict[str, Any], needs: str,
           row: Callable[[str, dict[str, Any]], list[str]]) -> list[str]:
    """A markdown table: one `row` per configuration whose summary has `needs`, else its error."""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cfg, s in summary.items():
        cells = row(cfg, s) if needs in s else [cfg, f"error: {s.get('error')}"] + [""] * (len(header) - 2)
        out.append("| " + " | ".join(cells) + " |")
    return out


def markdown(doc: dict[str, Any]) -> str:
    a, summary = doc["args"], doc["summary"]
    lines = [f"# SGLang server TTFT ({a['mode']}), {doc['machine']}", "",
             f"sglang {doc['versions'].get('sglang')}, torch {doc['versions'].get('torch')}, "
             f"model {os.path.basename(a['model'])} (dummy weights), page {a['page_size']} tokens, "
             f"GPU pool {a['max_total_tokens']} tokens, host pool x{a['hicache_ratio']}, layout {a['layout']}, "
             f"prefetch {a['prefetch_policy']}", ""]
    raw = doc.get("raw_disk", {})
    if raw and "error" not in raw:
        parts = []
        for j in raw.values():
            parts.append(f"{j['rw']} raw O_DIRECT {j['raw_MBps']:.0f} MB/s, PageStore on NIXL POSIX "
                         f"{j['nixl_posix_MBps']:.0f} MB/s")
        lines += ["Disk (same run): " + "; ".join(parts), ""]
    if a["mode"] == "prefix":
        def row(cfg: str, s: dict[str, Any]) -> list[str]:
            c, rv, tv, fl = s["cold"], s["revisit"], s.get("tokens_vs_recompute"), s.get("after_flush")
            return [cfg, f"{c['p50']:.3f} s", f"{rv['p50']:.3f} / {rv['p90']:.3f} / {rv['p99']:.3f} s",
                    _ratio(s.get("revisit_p50_vs_recompute")), f"{rv['storage_hit_frac']:.0%}",
                    f"{tv['identical']}/{tv['prompts']}" if tv else "-",
                    f"{fl['p50']:.3f} s ({fl['storage_hit_frac']:.0%})" if fl else "-"]
        lines += [f"{a['prefixes']} prefixes x {a['prefix_tokens']} tokens (+{a['suffix_tokens']}), "
                  f"{a['gen']} generated tokens, sequential requests", ""]
        lines += _table(["config", "cold TTFT p50", "revisit TTFT p50 / p90 / p99", "revisit vs recompute",
                         "revisit cached from storage", "tokens = recompute", "after /flush_cache p50 (storage)"],
                        summary, "revisit", row)
    else:
        def row(cfg: str, s: dict[str, Any]) -> list[str]:
            lr = s["later_rounds"]
            rounds = sorted((k for k in s if k.startswith("round") and k[5:].isdigit()), key=lambda k: int(k[5:]))
            return [cfg, f"{s['round0']['p50']:.3f} s", f"{lr['p50']:.3f} / {lr['p90']:.3f} / {lr['p99']:.3f} s",
                    _ratio(s.get("later_p50_vs_recompute")), f"{lr['storage_hit_frac']:.0%}",
                    " / ".join(f"{s[k]['p50']:.3f} s ({s[k]['storage_hit_frac']:.0%})" for k in rounds)]
        lines += [f"{a['clients']} clients x {a['rounds']} rounds, {a['turn_tokens']} new tokens per turn, "
                  f"{a['answer_tokens']} answer tokens", ""]
        lines += _table(["config", "round-1 TTFT p50", "later rounds p50 / p90 / p99", "later vs recompute",
                         "from storage", "p50 per round (storage share)"], summary, "later_rounds", row)
    lines += ["", "Server start / shutdown (s): " + ", ".join(
        f"{r['config']} {r.get('start_s')}/{r['stop']['shutdown_s']}{' HUNG' if r['stop']['hung'] else ''}"
        f"{' leftover ' + str(r['stop']['leftover_pids']) if r['stop']['leftover_pids'] else ''}"
        for r in doc["records"])]
    return "\n".join(lines) + "\n"


def _jsonable(o: Any) -> Any:
    if isinstance(o, Result):
        return asdict(o)
    if isinstance(o, dict):
        return {k: _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, float) and o != o:
        return None
    return o


def _revive(rec: dict[str, Any]) -> dict[str, Any]:
    """A record read back from results JSON, its requests as `Result`s again."""
    def res(x: Any) -> Any:
        if isinstance(x, list):
            return [res(v) for v in x]
        if isinstance(x, dict) and "ttft_s" in x:
            return Result(**{**x, "ttft_s": x["ttft_s"] if x["ttft_s"] is not None else float("nan")})
        return x
    w = rec.get("workload")
    if w:
        rec["workload"] = {k: res(v) for k, v in w.items()}
    return rec


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for p in ("sglang", "sglang-kernel", "torch", "nixl-cu13", "hicache-gds", "hicache-gds-sglang", "transformers"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "not installed"
    return out


def machine() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        gpu = "no GPU"
    return f"{gpu}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="the disk under test: every configuration's L3 goes below it")
    p.add_argument("--configs", default="recompute,hicache,file,nixl,gds")
    p.add_argument("--mode", choices=("prefix", "multiturn"), default="prefix")
    p.add_argument("--out", default="e2e-results")
    p.add_argument("--model", default=MODEL_DIR)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--layout", default="page_first")
    p.add_argument("--max-total-tokens", type=int, default=49152, help="GPU KV pool (tokens)")
    p.add_argument("--hicache-ratio", type=float, default=2.0, help="host pool = ratio x GPU pool")
    p.add_argument("--mem-fraction", type=float, default=0.6)
    p.add_argument("--chunk", type=int, default=8192, help="--chunked-prefill-size")
    p.add_argument("--prefetch-policy", default="wait_complete")
    p.add_argument("--capacity", default="40G", help="hicache-gds namespace capacity")
    p.add_argument("--prefixes", type=int, default=12)
    p.add_argument("--prefix-tokens", type=int, default=16384)
    p.add_argument("--suffix-tokens", type=int, default=64)
    p.add_argument("--gen", type=int, default=8, help="greedy tokens generated per request")
    p.add_argument("--revisit-after-flush", type=int, default=3)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=4096)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--stable-s", type=float, default=3.0,
                   help="after SGLang counts every page backed up, the L3's page count must not change this long")
    p.add_argument("--drain-timeout", type=float, default=300.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--req-timeout", type=float, default=300.0)
    p.add_argument("--raw-size", default="4G", help="bytes for the raw disk measurement; 0 skips it")
    p.add_argument("--keep", action="store_true", help="keep each configuration's L3 files")
    p.add_argument("--resume", action="store_true",
                   help="keep the configurations already in --out's results (split a long run over several calls)")
    a = p.parse_args(argv)
    cfgs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in cfgs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; choose from {', '.join(CONFIGS)}")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.dir, exist_ok=True)
    doc: dict[str, Any] = {"args": vars(a), "machine": machine(), "versions": versions(), "records": []}
    done_path = os.path.join(a.out, f"results-{a.mode}.json")
    if a.resume and os.path.exists(done_path):
        old = json.load(open(done_path))
        doc["records"] = [_revive(r) for r in old.get("records", []) if "error" not in r and r["config"] in cfgs]
        if "raw_disk" in old:
            doc["raw_disk"] = old["raw_disk"]
        cfgs = [c for c in cfgs if c not in {r["config"] for r in doc["records"]}]
        print(f"resuming: kept {[r['config'] for r in doc['records']]}, running {cfgs}", flush=True)
    if a.raw_size not in ("0", "") and "raw_disk" not in doc:
        doc["raw_disk"] = raw_disk(a.dir, a.raw_size)
        print("raw disk:", json.dumps(doc["raw_disk"]), flush=True)
    for cfg in cfgs:
        doc["records"].append(run_config(cfg, a, a.out))
        doc["summary"] = summarize(doc["records"], a)
        with open(os.path.join(a.out, f"results-{a.mode}.json"), "w") as f:
            json.dump(_jsonable(doc), f, indent=1)
        with open(os.path.join(a.out, f"results-{a.mode}.md"), "w") as f:
            f.write(markdown(_jsonable(doc)))
    print(open(os.path.join(a.out, f"results-{a.mode}.md")).read())
    return 0 if all("error" not in r for r in doc["records"]) else 1


if __name__ == "__main__":
    sys.exit(main())
