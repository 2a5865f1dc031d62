"""Time-to-first-token of a running vLLM server, per KV-offloading configuration, on one disk, in one run.

    python benchmarks/e2e/bench_vllm_server.py --dir /var/tmp/vllm-e2e-store --out /var/tmp/vllm-e2e-out \
        --configs recompute,cpu,gds,bounce --resume

Each configuration is a fresh ``vllm serve`` (``python -m vllm.entrypoints.openai.api_server``; vLLM 0.26
on the GPU machine) of the Llama-3-8B geometry with ``--load-format dummy`` and ``--skip-tokenizer-init``
(token ids over HTTP: ``/v1/completions`` with a token-id prompt and ``return_token_ids``),
``--enforce-eager``, and ``--num-gpu-blocks-override`` small enough that the working set does not
fit in the GPU:

=========  ===========================================================================================
recompute  no connector: vLLM's GPU prefix cache only
cpu        vLLM's own ``OffloadingConnector`` + ``CPUOffloadingSpec``, ``cpu_bytes_to_use`` smaller
           than the working set
gds        ``HiCacheGDSConnector`` (this project), engine ``nixl-gds-mt``: NIXL GDS_MT moving vLLM's
           VRAM KV to and from NVMe -- cuFile runs in compat mode on the GPU machine (no nvidia-fs);
           ``cost_model: off``: every chunk found is loaded (the load path, measured)
bounce     ``HiCacheGDSConnector``, engine ``bounce`` (pinned host buffers + O_DIRECT), cost model off
gds-cost   ``gds`` with the load-or-recompute model (``cost_model: rate``): a chunk is loaded only
           where that beats recomputing it, by rates measured in the running engine
gds-plain  the spec by name under vLLM's own ``OffloadingConnector`` (no recompute of failed loads)
=========  ===========================================================================================

Workload: ``--prefixes`` random prompts of ``--prefix-tokens`` tokens, each sent once with a short
suffix (pass 1, cold); after the offloaded writes have drained (vLLM's own store-bytes counter has
stopped growing at the bytes of every full chunk) and the page cache was dropped, each again with
another suffix, one at a time (pass 2: revisits); then all of them at once with a third suffix
(pass 3: a burst; makespan from the first send to the last answer). The prefixes exceed the GPU's
KV blocks and the CPU tier, and are revisited in pass 1's order, so under LRU a revisit can only
come from NVMe (or be recomputed). Decoding is greedy (``--gen`` tokens); passes 2 and 3 are
compared token by token with ``recompute``'s.

Also in the same run: the disk's raw O_DIRECT write and cold read throughput (``--raw-size`` bytes
in ``--dir``), and, per configuration, vLLM's own load counters (``vllm:kv_offload_load_bytes`` /
``..._load_time``: the rate at which the connector's worker moved KV into the GPU) against that raw
read. Results: ``results.json`` and ``results.md`` under ``--out``; server logs beside them.

Every configuration runs vLLM 0.26's V1 model runner (``--model-runner v1``:
``VLLM_USE_V2_MODEL_RUNNER=0``), which allocates one cross-layer KV tensor for an offloading
connector and so hands it one region per block (a 2 MiB block of the 8B shape); the V2 runner,
0.26's default for dense models, hands per-layer views (32 regions per block), which the first GPU
run got. ``gds-cost``'s read rate is seeded with the raw O_DIRECT read of the same run until the
engine's own loads are measured (``--no-seed-read``: unseeded).

Operations: every server runs in its own process group, recorded in ``--out``/servers.pids; the
harness stops it on every exit path (return, exception, SIGTERM/SIGINT) and, at start, stops any
left by an earlier run that was killed (and any process on the GPU whose command line names vLLM).
``--resume`` keeps the configurations already measured; ``--deadline-s`` stops starting new ones
when too little time is left, so a run split over several device calls loses nothing, and no
server start, request or drain runs past it; ``--workload-timeout-s`` bounds one configuration's
workload (it records the error, keeps what was measured under ``workload_partial``, and the run
goes on). ``--mirror DIR`` copies the results there after every configuration (the device tool's
``$OUT``: what a killed call leaves still comes back).
``--dry-run`` replaces vLLM with ``fake_vllm_server.py`` (CPU, no model) to check the harness.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from bench_sglang_server import _ratio, _table  # noqa: E402
import e2elib  # noqa: E402
from e2elib import Server, _jsonable, drop_caches, free_port, machine, pct, tokens  # noqa: E402

MODEL_DIR = os.path.join(HERE, "llama3-8b-shape")
CONFIGS = ("recompute", "cpu", "gds", "bounce", "gds-cost", "gds-plain")
OFFLOAD = ("cpu", "gds", "bounce", "gds-cost", "gds-plain")
OURS = ("gds", "bounce", "gds-cost", "gds-plain")
ENGINE = {"gds": "nixl-gds-mt", "bounce": "bounce", "gds-cost": "nixl-gds-mt", "gds-plain": "nixl-gds-mt"}
COST_MODEL = {"gds": "off", "bounce": "off", "gds-cost": "on", "gds-plain": "off"}
PIDS = "servers.pids"


def kv_bytes_per_token(model_dir: str) -> int:
    """KV bytes of one token, all layers (bf16): layers x (K, V) x KV heads x head_dim x 2."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 2


# -- configurations ---------------------------------------------------------------------------------
def server_command(cfg: str, a: argparse.Namespace, port: int, store_dir: str) -> tuple[list[str], dict[str, str]]:
    """The launch command and environment of one configuration."""
    env = dict(os.environ)
    env.update(VLLM_USE_FLASHINFER_SAMPLER="0", PYTHONHASHSEED="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    if a.model_runner != "default":  # every configuration on the same runner (v1: cross-layer KV for offloading)
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if a.model_runner == "v2" else "0"
    if a.dry_run:
        cmd = [sys.executable, os.path.join(HERE, "fake_vllm_server.py")]
    else:  # the OpenAI server module `vllm serve` runs (no console script in the bundle)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", a.model, "--load-format", "dummy", "--skip-tokenizer-init", "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "e2e", "--dtype", "bfloat16", "--block-size", str(a.block_size),
            "--enforce-eager", "--seed", "0", "--gpu-memory-utilization", str(a.gpu_mem),
            "--num-gpu-blocks-override", str(a.gpu_blocks), "--max-model-len", str(a.max_model_len),
            "--max-num-batched-tokens", str(a.batched_tokens), "--max-num-seqs", str(a.max_seqs),
            "--enable-prompt-tokens-details", "--attention-backend", a.attention_backend]
    chunk_tokens = a.block_size * a.blocks_per_chunk
    if cfg == "recompute":
        return cmd, env
    if cfg == "cpu":
        ktc: dict[str, Any] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"cpu_bytes_to_use": int(a.cpu_gib * 2**30),
                                                             "block_size": chunk_tokens}}
    else:
        env.update(GDS_PATH=store_dir, CUFILE_ENV_PATH_JSON=os.path.join(REPO, "configs", "cufile.json"))
        extra: dict[str, Any] = {"gds_path": store_dir, "capacity": a.capacity, "block_size": chunk_tokens,
                                 "engine": ENGINE[cfg], "cost_model": a.cost_model or COST_MODEL[cfg]}
        if extra["cost_model"] != "off" and a.seed_read_GBps:  # until the engine's own loads are measured
            extra["read_bytes_per_s"] = round(a.seed_read_GBps * 1e9)
        if cfg == "gds-plain":  # the spec by name under vLLM's own connector (no recompute on failure)
            extra.update(spec_name="HiCacheGDSOffloadingSpec", spec_module_path="hicache_gds_vllm")
            ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
        else:
            ktc = {"kv_connector": "HiCacheGDSConnector", "kv_connector_module_path": "hicache_gds_vllm.connector",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    cmd += ["--kv-transfer-config", json.dumps(ktc)]
    return cmd, env


# -- leftovers ------------------------------------------------------------------------------------------
def stop_leftovers(out_dir: str) -> list[int]:
    """Stop servers an earlier run left (killed by a device-call timeout, say): the process groups it
    recorded, and processes on the GPU whose command line names vLLM. Returns what was signalled."""
    hit: list[int] = []
    path = os.path.join(out_dir, PIDS)
    pgids: set[int] = set()
    if os.path.exists(path):
        pgids |= {int(x) for x in open(path).read().split() if x.strip().isdigit()}
    try:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        for pid in (int(x) for x in q.stdout.split() if x.strip().isdigit()):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
            except OSError:
                continue
            if b"vllm" in cmdline or b"fake_vllm_server" in cmdline:
                try:
                    pgids.add(os.getpgid(pid))
                except ProcessLookupError:
                    pass
    except (OSError, subprocess.SubprocessError):
        pass
    pgids.discard(os.getpgid(0))
    for pg in pgids:
        try:
            os.killpg(pg, signal.SIGKILL)
            hit.append(pg)
        except (ProcessLookupError, PermissionError):
            pass
    if hit:
        time.sleep(3.0)  # let the GPU memory go
    with open(path, "w"):
        pass
    return hit


def _record_pgid(out_dir: str, pgid: int) -> None:
    with open(os.path.join(out_dir, PIDS), "a") as f:
        f.write(f"{pgid}\n")


# -- requests ---------------------------------------------------------------------------------------------
@dataclass
class Result:
    tag: str
    prompt_tokens: int
    t_send: float
    ttft_s: float
    latency_s: float
    output_ids: list[int]
    cached_tokens: int = 0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def complete(srv: Server, tag: str, ids: list[int], gen: int, timeout: float) -> Result:
    """One streamed, greedy /v1/completions with a token-id prompt; TTFT is the first token's arrival."""
    body = {"model": "e2e", "prompt": ids, "max_tokens": gen, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    req = urllib.request.Request(srv.url("/v1/completions"), data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t_send = time.time()
    t0 = time.perf_counter()
    ttft = None
    out: list[int] = []
    cached = 0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for ch in chunk.get("choices") or []:
                    got = ch.get("token_ids") or []
                    if got and ttft is None:
                        ttft = time.perf_counter() - t0
                    out.extend(int(t) for t in got)
                usage = chunk.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    cached = int(details["cached_tokens"])
    except Exception as exc:  # noqa: BLE001 -- recorded with the result, the run goes on
        return Result(tag, len(ids), t_send, float("nan"), time.perf_counter() - t0, out, cached,
                      f"{type(exc).__name__}: {exc}")
    return Result(tag, len(ids), t_send, ttft if ttft is not None else float("nan"), time.perf_counter() - t0, out,
                  cached, None if ttft is not None else "no token received")


def metric(srv: Server, name: str) -> float | None:
    """Sum of a Prometheus metric's samples (all label sets), None when the server has none."""
    try:
        text = srv.get("/metrics")
    except Exception:  # noqa: BLE001
        return None
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name) and (line[len(name)] in " {")]
    return sum(vals) if vals else None


def offload_counters(srv: Server) -> dict[str, float | None]:
    return {k: metric(srv, f"vllm:kv_offload_{k}_total") for k in ("load_bytes", "load_time", "store_bytes",
                                                                   "store_time")}


def wait_stored(srv: Server, expect_bytes: int, stable_s: float, timeout: float) -> dict[str, Any]:
    """Wait until vLLM's store-bytes counter has reached `expect_bytes` (every full chunk sent so far)
    and has not moved for `stable_s`; at most `timeout`."""
    t0 = time.monotonic()
    last = offload_counters(srv)["store_bytes"] or 0.0
    since = time.monotonic()
    while time.monotonic() - t0 < timeout:
        time.sleep(0.5)
        now = offload_counters(srv)["store_bytes"] or 0.0
        if now != last:
            last, since = now, time.monotonic()
        if last >= expect_bytes and time.monotonic() - since >= stable_s:
            break
    return {"store_bytes": last, "expected_bytes": expect_bytes, "drain_wait_s": round(time.monotonic() - t0, 1),
            "drained": last >= expect_bytes}


class WorkloadTimeout(TimeoutError):
    """A configuration's workload ran past its time (`--workload-timeout-s`, or the run's deadline)."""


def run_workload(srv: Server, cfg: str, a: argparse.Namespace, res: dict[str, Any], deadline: float) -> None:
    """The three passes, into `res` as they go (a workload cut short keeps what it measured); no
    request, drain or pass runs past `deadline` (time.monotonic())."""
    def left(what: str) -> float:
        t = deadline - time.monotonic()
        if t <= 1.0:
            raise WorkloadTimeout(f"workload deadline reached before {what}")
        return min(a.req_timeout, t)

    prefixes = [tokens(1000 + i, a.prefix_tokens) for i in range(a.prefixes)]
    chunk_tokens = a.block_size * a.blocks_per_chunk
    res.update(pass1=[], pass2=[], pass3=[])
    for i, p in enumerate(prefixes):
        res["pass1"].append(complete(srv, f"p{i}", p + tokens(2000 + i, a.suffix_tokens), a.gen, left("pass 1")))
    if cfg in OFFLOAD:
        sent = [a.warmup_tokens] + [a.prefix_tokens + a.suffix_tokens] * a.prefixes
        expect = sum(n // chunk_tokens for n in sent) * chunk_tokens * a.kv_per_token
        res["drain"] = wait_stored(srv, expect, a.stable_s, min(a.drain_timeout, left("the drain")))
    res["page_cache"] = drop_caches()
    c0 = offload_counters(srv)
    for i, p in enumerate(prefixes):
        res["pass2"].append(complete(srv, f"p{i}", p + tokens(3000 + i, a.suffix_tokens), a.gen, left("pass 2")))
    c1 = offload_counters(srv)
    t = time.perf_counter()
    limit = left("pass 3")
    with ThreadPoolExecutor(max_workers=len(prefixes)) as pool:
        futs = [pool.submit(complete, srv, f"p{i}", p + tokens(4000 + i, a.suffix_tokens), a.gen, limit)
                for i, p in enumerate(prefixes)]
        res["pass3"] = [f.result() for f in futs]
    res["burst_makespan_s"] = time.perf_counter() - t
    c2 = offload_counters(srv)
    res["counters"] = {"before_pass2": c0, "after_pass2": c1, "after_pass3": c2}
    for r in res["pass2"] + res["pass3"]:
        if r.error and time.monotonic() >= deadline - 1.0:
            raise WorkloadTimeout(f"workload deadline reached during the passes ({r.tag}: {r.error})")


# -- raw disk -------------------------------------------------------------------------------------------------
def raw_odirect(directory: str, size: int, threads: int = 8, piece: int = 8 << 20) -> dict[str, Any]:
    """The disk's raw O_DIRECT write and cold read throughput: `size` bytes in `piece`-sized requests
    from `threads` threads, one file in `directory` (deleted after)."""
    from hicache_gds.memory import HostBuffer
    path = os.path.join(directory, "raw-odirect.bin")
    n = max(1, size // piece)
    buf = HostBuffer(piece * threads)
    mv = memoryview(buf.numpy())
    mv[:] = os.urandom(len(mv))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        os.posix_fallocate(fd, 0, n * piece)

        def one(write: bool, i: int, slot: int) -> None:
            m = mv[slot * piece:(slot + 1) * piece]
            done = 0
            while done < piece:
                k = (os.pwritev if write else os.preadv)(fd, [m[done:]], i * piece + done)
                if k <= 0:
                    raise OSError(f"short {'write' if write else 'read'} at piece {i}")
                done += k

        def run(write: bool) -> float:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: one(write, i, i % threads), range(n)))
            if write:
                os.fdatasync(fd)
            return time.perf_counter() - t0

        w = run(True)
        cache = drop_caches()
        r = run(False)
        return {"bytes": n * piece, "piece_bytes": piece, "threads": threads, "write_GBps": n * piece / w / 1e9,
                "read_GBps": n * piece / r / 1e9, "page_cache": cache}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


# -- one configuration ------------------------------------------------------------------------------------------
_current: list[Server] = []


def _stop_current(*_: Any) -> None:
    for srv in list(_current):
        try:
            srv.stop(timeout=30)
        except Exception:  # noqa: BLE001
            pass
        _current.remove(srv)


def _on_signal(signum: int, _frame: Any) -> None:
    _stop_current()
    raise SystemExit(128 + signum)


def log_facts(path: str) -> dict[str, list[str]]:
    """What the server log says about the connector: engine lines, warnings, tracebacks."""
    return e2elib.log_facts(path, "connector", ("hicache-gds", "OffloadingConnector", "CPUOffloadingSpec"),
                            ("offload",), ("hicache", "offload"), limit=40)


def run_config(cfg: str, a: argparse.Namespace, hard_deadline: float = float("inf")) -> dict[str, Any]:
    """One configuration: a fresh server, the workload (bounded by `--workload-timeout-s` and by
    `hard_deadline`, time.monotonic(): a broken configuration records its error and the run goes
    on), the server stopped on every path."""
    store_dir = os.path.join(a.dir, cfg)
    shutil.rmtree(store_dir, ignore_errors=True)
    os.makedirs(store_dir, mode=0o700)
    port = free_port()
    cmd, env = server_command(cfg, a, port, store_dir)
    log_path = os.path.join(a.out, f"server-{cfg}.log")
    print(f"[{cfg}] starting: {' '.join(cmd[1:])}", flush=True)
    rec: dict[str, Any] = {"config": cfg, "command": " ".join(cmd[1:]),
                           "env": {k: env[k] for k in env if k.startswith(("GDS_PATH", "ENABLE_GDS", "HICACHE_GDS_",
                                                                           "VLLM_", "CUFILE_", "PYTHONHASHSEED"))}}
    srv = Server(cmd, env, log_path, port)
    _current.append(srv)
    _record_pgid(a.out, srv.proc.pid)
    res: dict[str, Any] = {}
    try:
        rec["start_s"] = round(srv.wait_ready(max(10.0, min(a.start_timeout, hard_deadline - time.monotonic()))), 1)
        warm = complete(srv, "warmup", tokens(1, a.warmup_tokens), a.gen, a.req_timeout)
        rec["warmup_error"] = warm.error
        t = time.monotonic()
        run_workload(srv, cfg, a, res, min(t + a.workload_timeout_s, hard_deadline))
        rec["workload"] = res
        rec["workload_s"] = round(time.monotonic() - t, 1)
    except Exception as exc:  # noqa: BLE001 -- one broken configuration must not lose the others
        rec["error"] = f"{type(exc).__name__}: {exc}"
        if res:
            rec["workload_partial"] = res
    finally:
        rec["stop"] = srv.stop()
        if srv in _current:
            _current.remove(srv)
        rec["log"] = log_facts(log_path)
        if cfg in OURS:
            rec["store_bytes_on_disk"] = sum(os.stat(os.path.join(d, f)).st_blocks * 512
                                             for d, _, fs in os.walk(store_dir) for f in fs)
        if not a.keep:
            shutil.rmtree(store_dir, ignore_errors=True)
    print(f"[{cfg}] done: start {rec.get('start_s')} s, workload {rec.get('workload_s')} s, stop {rec['stop']}, "
          f"error {rec.get('error')}", flush=True)
    return rec


# -- summary -------------------------------------------------------------------------------------------------------
def stats(rs: list[Result]) -> dict[str, Any]:
    t = [r.ttft_s for r in rs if r.error is None]
    prompt = sum(r.prompt_tokens for r in rs)
    return {"n": len(rs), "errors": sum(r.error is not None for r in rs), "p50": pct(t, 50), "p90": pct(t, 90),
            "p99": pct(t, 99), "cached_tokens": sum(r.cached_tokens for r in rs),
            "cached_frac": sum(r.cached_tokens for r in rs) / max(prompt, 1)}


def compare(rs: list[Result], ref: list[Result]) -> dict[str, Any]:
    same = sum(x.output_ids == y.output_ids and bool(x.output_ids) for x, y in zip(rs, ref))
    return {"prompts": len(ref), "identical": same,
            "differ": [x.tag for x, y in zip(rs, ref) if x.output_ids != y.output_ids][:8]}


def load_rate(c: dict[str, Any], a: str, b: str) -> dict[str, Any] | None:
    """The connector's load rate between two counter snapshots. A counter vLLM has not exported
    yet (Prometheus shows it from its first increment) counts as 0 when the later snapshot has it."""
    x, y = c.get(a) or {}, c.get(b) or {}
    if y.get("load_bytes") is None:
        return None
    nb = y["load_bytes"] - (x.get("load_bytes") or 0)
    nt = (y.get("load_time") or 0) - (x.get("load_time") or 0)
    return {"bytes": nb, "seconds": nt, "GBps": nb / nt / 1e9 if nt > 0 else None}


def summarize(records: list[dict[str, Any]], raw: dict[str, Any]) -> dict[str, Any]:
    by = {r["config"]: r for r in records}
    ref = by.get("recompute", {}).get("workload")
    out: dict[str, Any] = {}
    for cfg, r in by.items():
        w = r.get("workload")
        if not w:
            out[cfg] = {"error": r.get("error")}
            continue
        s: dict[str, Any] = {"cold": stats(w["pass1"]), "revisit": stats(w["pass2"]), "burst": stats(w["pass3"]),
                             "burst_makespan_s": w["burst_makespan_s"], "drain": w.get("drain")}
        s["load_revisit"] = load_rate(w["counters"], "before_pass2", "after_pass2")
        s["load_burst"] = load_rate(w["counters"], "after_pass2", "after_pass3")
        rr = raw.get("read_GBps")
        for k in ("load_revisit", "load_burst"):
            if s[k] and s[k]["GBps"] and rr:
                s[k]["vs_raw_read"] = s[k]["GBps"] / rr
        if ref and cfg != "recompute":
            s["tokens_revisit"] = compare(w["pass2"], ref["pass2"])
            s["tokens_burst"] = compare(w["pass3"], ref["pass3"])
        out[cfg] = s
    base = out.get("recompute", {})
    for cfg, s in out.items():
        bp = base.get("revisit", {}).get("p50")
        if "revisit" in s and bp is not None and bp == bp and bp > 0 and s["revisit"]["p50"] == s["revisit"]["p50"]:
            s["revisit_p50_vs_recompute"] = s["revisit"]["p50"] / bp
            if base.get("burst_makespan_s"):
                s["makespan_vs_recompute"] = s["burst_makespan_s"] / base["burst_makespan_s"]
    return out


def markdown(doc: dict[str, Any]) -> str:
    a, summary, raw = doc["args"], doc["summary"], doc.get("raw_disk", {})
    lines = [f"# vLLM server TTFT, {doc['machine']}", "",
             f"vllm {doc['versions'].get('vllm')}, torch {doc['versions'].get('torch')}, "
             f"nixl-cu13 {doc['versions'].get('nixl-cu13')}; model {os.path.basename(a['model'])} (dummy weights), "
             f"{a['gpu_blocks']} GPU blocks of {a['block_size']} tokens, chunks of {a['blocks_per_chunk']} blocks, "
             f"CPU tier {a['cpu_gib']} GiB, attention {a['attention_backend']}, --enforce-eager, "
             f"model runner {a.get('model_runner', 'default')}" +
             ("; DRY RUN (fake server)" if a.get("dry_run") else ""), "",
             "gds = NIXL GDS_MT on vLLM's VRAM KV; on this machine cuFile runs in compat mode (no nvidia-fs): "
             "POSIX IO through cuFile's bounce buffers, not GPU-direct DMA.", ""]
    if raw and "error" not in raw:
        lines += [f"Disk (same run): raw O_DIRECT write {raw['write_GBps']:.2f} GB/s, cold read "
                  f"{raw['read_GBps']:.2f} GB/s ({raw['bytes'] >> 20} MiB, {raw['threads']} threads x "
                  f"{raw['piece_bytes'] >> 20} MiB)", ""]
    ws = a["prefixes"] * (a["prefix_tokens"] + a["suffix_tokens"]) * doc["kv_per_token"]
    lines += [f"{a['prefixes']} prefixes x {a['prefix_tokens']} tokens (+{a['suffix_tokens']}), {a['gen']} greedy "
              f"tokens; working set {ws / 2**30:.1f} GiB of KV; pass 2 one at a time, pass 3 all at once", ""]

    def f3(x: float | None) -> str:
        return "-" if x is None or x != x else f"{x:.3f}"

    def pc(x: float | None) -> str:
        return "-" if x is None or x != x else f"{x:.0%}"

    def row(cfg: str, s: dict[str, Any]) -> list[str]:
        rv, bu = s["revisit"], s["burst"]
        lr, lb = s.get("load_revisit") or {}, s.get("load_burst") or {}
        tv, tb = s.get("tokens_revisit"), s.get("tokens_burst")
        load = "-"
        if lr.get("GBps"):
            load = f"{lr['GBps']:.2f}" + (f" ({lr['vs_raw_read']:.2f}x raw)" if lr.get("vs_raw_read") else "")
        ms = s.get("burst_makespan_s")
        return [cfg, f3(s["cold"]["p50"]), f"{f3(rv['p50'])} / {f3(rv['p90'])} / {f3(rv['p99'])}",
                _ratio(s.get("revisit_p50_vs_recompute")), pc(rv.get("cached_frac")),
                f"{f3(ms)} s ({_ratio(s.get('makespan_vs_recompute'))})",
                f"{f3(bu['p50'])} / {f3(bu['p90'])} / {f3(bu['p99'])}", pc(bu.get("cached_frac")), load,
                f"{tv['identical']}/{tv['prompts']}, {tb['identical']}/{tb['prompts']}" if tv and tb else "-"]
    lines += _table(["config", "cold TTFT p50 (s)", "revisit TTFT p50 / p90 / p99 (s)", "revisit vs recompute",
                     "revisit cached", "burst makespan", "burst TTFT p50 / p90 / p99 (s)", "burst cached",
                     "engine load GB/s (revisits)", "tokens = recompute (revisit, burst)"], summary, "revisit", row)
    lines += ["", "Server start / shutdown (s): " + ", ".join(
        f"{r['config']} {r.get('start_s')}/{r['stop']['shutdown_s']}{' HUNG' if r['stop']['hung'] else ''}"
        f"{' leftover ' + str(r['stop']['leftover_pids']) if r['stop']['leftover_pids'] else ''}"
        for r in doc["records"])]
    for r in doc["records"]:
        ours = [x for x in r.get("log", {}).get("connector", []) if "hicache-gds-vllm rank" in x]
        if ours:
            lines.append(f"{r['config']}: {ours[0][-300:]}")
    return "\n".join(lines) + "\n"


def _revive(rec: dict[str, Any]) -> dict[str, Any]:
    return e2elib._revive(rec, Result, keys=lambda k: k.startswith("pass"))


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for p in ("vllm", "torch", "nixl-cu13", "hicache-gds", "hicache-gds-vllm", "transformers"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "not installed"
    return out


def space(a: argparse.Namespace) -> dict[str, int]:
    """Free bytes where the run puts things: the disk under test, and /dev/shm (vLLM's CPU tier is a
    shared mapping there)."""
    out = {}
    for name, path in (("dir_free", a.dir), ("dev_shm_free", "/dev/shm")):
        try:
            out[name] = shutil.disk_usage(path).free
        except OSError:
            pass
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="the disk under test: every configuration's store goes below it")
    p.add_argument("--out", default="/var/tmp/vllm-e2e-out")
    p.add_argument("--configs", default="recompute,cpu,gds,bounce,gds-cost")
    p.add_argument("--model", default=MODEL_DIR)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks-per-chunk", type=int, default=4, help="GPU blocks per offloaded chunk (cpu and ours)")
    p.add_argument("--gpu-blocks", type=int, default=3072, help="--num-gpu-blocks-override")
    p.add_argument("--gpu-mem", type=float, default=0.6, help="--gpu-memory-utilization")
    p.add_argument("--cpu-gib", type=float, default=6.0, help="the cpu configuration's cpu_bytes_to_use")
    p.add_argument("--capacity", default="40G", help="hicache-gds capacity per rank")
    p.add_argument("--cost-model", default=None,
                   help="hicache-gds-vllm cost_model for every configuration of ours (default: off, rate for gds-cost)")
    p.add_argument("--attention-backend", default="FLASH_ATTN")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--batched-tokens", type=int, default=8192, help="--max-num-batched-tokens")
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=16384)
    p.add_argument("--suffix-tokens", type=int, default=64)
    p.add_argument("--warmup-tokens", type=int, default=2048)
    p.add_argument("--gen", type=int, default=8)
    p.add_argument("--stable-s", type=float, default=3.0)
    p.add_argument("--drain-timeout", type=float, default=180.0)
    p.add_argument("--start-timeout", type=float, default=420.0)
    p.add_argument("--req-timeout", type=float, default=300.0)
    p.add_argument("--raw-size", type=int, default=4 << 30, help="bytes of the raw O_DIRECT measurement; 0 skips")
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="start no configuration later than this many seconds minus --config-budget-s (0: no limit)")
    p.add_argument("--config-budget-s", type=float, default=170.0, help="time one configuration is expected to take")
    p.add_argument("--workload-timeout-s", type=float, default=240.0,
                   help="most seconds one configuration's workload may take (then its error is recorded, and on)")
    p.add_argument("--model-runner", choices=("v1", "v2", "default"), default="v1",
                   help="VLLM_USE_V2_MODEL_RUNNER for every configuration: vLLM 0.26's V1 runner hands an "
                        "offloading connector one cross-layer KV tensor, its V2 runner (the default for dense "
                        "models) per-layer views")
    p.add_argument("--raw-from", default="", help="take the raw disk measurement from this results.json")
    p.add_argument("--no-seed-read", dest="seed_read", action="store_false",
                   help="do not seed the load-or-recompute model's read rate with the raw O_DIRECT read")
    p.add_argument("--mirror", default="", help="also copy results.json / results.md here after each configuration")
    p.add_argument("--keep", action="store_true", help="keep each configuration's stored files")
    p.add_argument("--resume", action="store_true", help="keep the configurations already in --out's results")
    p.add_argument("--dry-run", action="store_true", help="fake_vllm_server.py instead of vLLM (CPU, no model)")
    a = p.parse_args(argv)
    a.configs_list = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in a.configs_list if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; choose from {', '.join(CONFIGS)}")
    a.kv_per_token = kv_bytes_per_token(a.model)
    a.seed_read_GBps = None  # the raw read rate, once measured (main)
    return a


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    a = parse(argv)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.dir, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    left = stop_leftovers(a.out)
    if left:
        print(f"stopped leftover server process groups {left}", flush=True)
    doc: dict[str, Any] = {"args": {}, "machine": machine(), "versions": versions(), "records": [],
                           "kv_per_token": a.kv_per_token, "space": space(a)}
    if "cpu" in a.configs_list and doc["space"].get("dev_shm_free", 1 << 62) < a.cpu_gib * 2**30 * 1.1:
        print(f"WARNING: /dev/shm has {doc['space']['dev_shm_free'] >> 20} MiB free; vLLM's CPU tier maps "
              f"{a.cpu_gib} GiB there", flush=True)
    path = os.path.join(a.out, "results.json")
    cfgs = list(a.configs_list)
    if a.resume and os.path.exists(path):
        old = json.load(open(path))
        doc["records"] = [_revive(r) for r in old.get("records", []) if "error" not in r and r["config"] in cfgs]
        if "raw_disk" in old and "error" not in old["raw_disk"]:
            doc["raw_disk"] = old["raw_disk"]
        cfgs = [c for c in cfgs if c not in {r["config"] for r in doc["records"]}]
        print(f"resuming: kept {[r['config'] for r in doc['records']]}, running {cfgs}", flush=True)
    if a.raw_from and "raw_disk" not in doc:
        try:
            got = json.load(open(a.raw_from)).get("raw_disk")
            if got and "error" not in got:
                doc["raw_disk"] = {**got, "from": a.raw_from}
        except (OSError, ValueError) as exc:
            print(f"--raw-from {a.raw_from}: {exc}", flush=True)
    if a.raw_size and "raw_disk" not in doc:
        doc["raw_disk"] = raw_odirect(a.dir, a.raw_size)
        print("raw disk:", json.dumps(doc["raw_disk"]), flush=True)
    a.seed_read_GBps = (doc.get("raw_disk") or {}).get("read_GBps") if a.seed_read else None
    doc["args"] = {k: v for k, v in vars(a).items() if k != "configs_list"}

    def save() -> None:
        doc["summary"] = summarize(doc["records"], doc.get("raw_disk", {}))
        with open(path + ".tmp", "w") as f:
            json.dump(_jsonable(doc), f, indent=1)
        os.replace(path + ".tmp", path)
        with open(os.path.join(a.out, "results.md"), "w") as f:
            f.write(markdown(_jsonable(doc)))
        if a.mirror:
            os.makedirs(a.mirror, exist_ok=True)
            for name in ("results.json", "results.md"):
                shutil.copyfile(os.path.join(a.out, name), os.path.join(a.mirror, name))

    try:
        for cfg in cfgs:
            if a.deadline_s and time.monotonic() - t_start + a.config_budget_s > a.deadline_s:
                print(f"deadline: not starting {cfg} ({time.monotonic() - t_start:.0f} s used of "
                      f"{a.deadline_s:.0f}); run again with --resume", flush=True)
                doc["unfinished"] = cfgs[cfgs.index(cfg):]
                break
            hard = t_start + a.deadline_s - 15.0 if a.deadline_s else float("inf")  # 15 s: stop the server
            doc["records"].append(run_config(cfg, a, hard))
            save()
        else:
            doc.pop("unfinished", None)
        save()
    finally:
        _stop_current()
    print(open(os.path.join(a.out, "results.md")).read())
    if doc.get("unfinished"):
        return 3
    return 0 if all("error" not in r for r in doc["records"]) else 1


if __name__ == "__main__":
    sys.exit(main())
