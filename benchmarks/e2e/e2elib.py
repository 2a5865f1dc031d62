"""Pieces the server benchmarks share: one SGLang server process (started, watched, stopped on
every exit path), streamed requests, the numbers kept from them, the disk's raw rate, the model's
KV geometry. Used by `bench_sglang_server.py`, `suite.py` and `check_server_ops.py`.

Servers run in their own session (a benchmark's Ctrl-C must not reach them half-way); so that none
outlives its harness, `Server` starts them with a parent-death signal, `install_guard` stops every
live one on SIGTERM / SIGINT / SIGHUP / exit, and `stop_leftovers` ends the GPU processes a killed
run left behind (``nvidia-smi --query-compute-apps=pid``) before a new server starts.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import json
import mmap
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Callable, Sequence

import numpy as np

from hicache_gds.bench.raw import drop_caches  # noqa: F401 -- the harness's one cache drop (suite, servers)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
_LIVE: "list[Server]" = []
_LIVE_LOCK = threading.Lock()


def _die_with_parent() -> None:
    """In the server's child before exec: SIGKILL it when the harness dies (PR_SET_PDEATHSIG), so a
    harness killed by a timeout does not leave a server holding the GPU's memory."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


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
        self.stopped: dict[str, Any] | None = None
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        with _LIVE_LOCK:
            _LIVE.append(self)

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
        """SIGTERM the server's process group; SIGKILL what is left after `timeout` (a hang). Idempotent."""
        if self.stopped is not None:
            return self.stopped
        with _LIVE_LOCK:
            if self in _LIVE:
                _LIVE.remove(self)
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
        self.stopped = {"shutdown_s": round(time.monotonic() - t, 2), "hung": hung, "leftover_pids": left,
                        "exit_code": self.proc.returncode}
        return self.stopped


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
    t_start: float = 0.0  # perf_counter at send, and at the last chunk (bursts and open loops: makespan)
    t_end: float = 0.0
    rid: str = ""  # the server's request id: joins a result to the server log (the policy's decisions)


def generate(srv: Server, tag: str, ids: list[int], gen: int, timeout: float) -> Result:
    """One streamed, greedy /generate; TTFT is the first chunk's arrival. The request id is the
    tag and a random suffix (unique, as SGLang requires), kept in the result."""
    rid = f"{tag}-{uuid.uuid4().hex[:12]}"
    body = {"input_ids": ids, "rid": rid, "stream": True, "return_logprob": True,
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
        t1 = time.perf_counter()
        return Result(tag, len(ids), float("nan"), t1 - t0, out, [], {}, f"{type(exc).__name__}: {exc}", t0, t1, rid)
    meta = last.get("meta_info", {})
    lps = [float(x[0]) if x and x[0] is not None else float("nan") for x in meta.get("output_token_logprobs") or []]
    lp_ids = [int(x[1]) for x in meta.get("output_token_logprobs") or [] if x and x[1] is not None]
    if len(lp_ids) == gen:
        out = lp_ids  # the authoritative sequence where the server sends it
    cached = dict(meta.get("cached_tokens_details") or {})
    cached["cached_tokens"] = meta.get("cached_tokens", 0)
    t1 = time.perf_counter()
    return Result(tag, len(ids), ttft if ttft is not None else float("nan"), t1 - t0, out, lps,
                  cached, None if ttft is not None else "no chunk received", t0, t1, rid)


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


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1000, 120000, size=n).tolist()


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


def written_sectors(directories: Sequence[str]) -> dict[str, int]:
    """Sectors written so far by the block device under each directory (/sys/dev/block/M:m/stat,
    field 7), by device. The one drain signal that works for slab files, which are preallocated:
    `du` and file sizes do not move when their pages are written."""
    out: dict[str, int] = {}
    for d in directories:
        st = os.stat(d).st_dev
        dev = f"{os.major(st)}:{os.minor(st)}"
        if dev in out:
            continue
        try:
            with open(f"/sys/dev/block/{dev}/stat") as f:
                out[dev] = int(f.read().split()[6])
        except (OSError, IndexError, ValueError):
            out[dev] = -1  # no block device behind it (tmpfs, overlay): nothing to wait for
    return out


def wait_writes_quiet(directories: Sequence[str], quiet_s: float, timeout_s: float = 300.0) -> dict[str, Any]:
    """Wait until no device under `directories` has written a sector for `quiet_s` seconds (the
    store's write-back drained), at most `timeout_s`. Returns how long it waited and what was written."""
    t0 = time.monotonic()
    first = last = written_sectors(directories)
    since = t0
    while quiet_s > 0 and time.monotonic() - t0 < timeout_s:
        time.sleep(0.25)
        now = written_sectors(directories)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    moved = {k: (last[k] - first[k]) * 512 for k in last if first.get(k, -1) >= 0}
    return {"waited_s": round(time.monotonic() - t0, 2), "quiet": time.monotonic() - since >= quiet_s,
            "bytes_written": moved}


def overwrite(directory: str, gib: float) -> dict[str, Any]:
    """Write `gib` GiB of random data to a file in `directory` (O_DIRECT, fsynced) and delete it.

    A virtual disk whose host caches recent writes (the GPU VM's: the newest 4 GiB of a 28 GiB
    write read 1.3x faster than older data, after the guest dropped its caches) serves the L3
    written last partly from the host's memory; written after both backends' pages, this leaves
    neither of them there, so both read from the device."""
    path = os.path.join(directory, "overwrite.bin")
    chunk = 64 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
    buf.write(np.random.default_rng(7).integers(0, 256, chunk, dtype=np.uint8).tobytes())
    t = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        for i in range(int(gib * (1 << 30)) // chunk):
            os.pwrite(fd, buf, i * chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()
    secs = time.monotonic() - t
    return {"gib": gib, "seconds": round(secs, 1), "GBps": round(gib * (1 << 30) / secs / 1e9, 2)}


def metrics_lines(srv: Server) -> list[str]:
    try:
        text = srv.get("/metrics")
    except Exception as exc:  # noqa: BLE001
        return [f"# /metrics failed: {exc}"]
    return [line for line in text.splitlines() if ("hicache" in line or "storage" in line or "cache_hit" in line)
            and not line.startswith("#")][:80]


def log_facts(path: str, key: str = "backend", marks: Sequence[str] = ("hicache-gds", "HiCacheNixl", "HiCacheFile"),
              lower_marks: Sequence[str] = ("storage backend",), warn_words: Sequence[str] = ("hicache", "storage"),
              limit: int = 30) -> dict[str, Any]:
    """What the server log says about the L3 backend (or, with other marks, a connector): under
    `key` the lines holding one of `marks` (or, lower-cased, of `lower_marks`), warnings naming
    one of `warn_words`, tracebacks and errors; at most `limit` lines of each."""
    facts: dict[str, list[str]] = {key: [], "warnings": [], "errors": []}
    with open(path, errors="replace") as f:
        for line in f:
            s = line.rstrip()[:400]
            low = s.lower()
            if any(m in s for m in marks) or any(m in low for m in lower_marks):
                facts[key].append(s)
            if "Traceback" in s or " ERROR " in s or "Error:" in s:
                facts["errors"].append(s)
            elif "WARNING" in s and any(w in low for w in warn_words):
                facts["warnings"].append(s)
    return {k: v[:limit] for k, v in facts.items()}


def _jsonable(o: Any) -> Any:
    """`o` as JSON can hold it: results (any dataclass) as dicts, NaN as null."""
    if is_dataclass(o) and not isinstance(o, type):
        return asdict(o)
    if isinstance(o, dict):
        return {k: _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, float) and o != o:
        return None
    return o


def _revive(rec: dict[str, Any], result: type = Result, keys: Any = None) -> dict[str, Any]:
    """A record read back from results JSON, its requests as `result`s again (in the workload's
    entries whose key `keys` accepts; all when None)."""
    def res(x: Any) -> Any:
        if isinstance(x, list):
            return [res(v) for v in x]
        if isinstance(x, dict) and "ttft_s" in x:
            return result(**{**x, "ttft_s": x["ttft_s"] if x["ttft_s"] is not None else float("nan")})
        return x
    w = rec.get("workload")
    if w:
        rec["workload"] = {k: res(v) if keys is None or keys(k) else v for k, v in w.items()}
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



# -- every exit path stops the servers ------------------------------------------------------------
def stop_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for s in live:
        try:
            s.stop(timeout=20.0)
        except Exception as exc:  # noqa: BLE001
            print(f"[guard] stopping {s.log_path}: {exc}", file=sys.stderr, flush=True)


def install_guard() -> None:
    """Stop every live server at exit and on SIGTERM / SIGINT / SIGHUP (then exit 128+signal)."""
    atexit.register(stop_all)

    def on_signal(signum: int, _frame: Any) -> None:
        print(f"[guard] signal {signum}: stopping {len(_LIVE)} server(s)", file=sys.stderr, flush=True)
        stop_all()
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)


def gpu_pids() -> list[int]:
    """Processes holding this run's GPUs (nvidia-smi), [] where there is none. With
    CUDA_VISIBLE_DEVICES set (indices or UUIDs), only processes on those GPUs count, so servers on
    the other GPUs of a multi-GPU machine (another run, started beside this one) are left alone."""
    def query(what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]
    try:
        apps = query("compute-apps=pid,gpu_uuid")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        if visible:
            want = {v.strip() for v in visible.split(",") if v.strip()}
            uuids = {u for i, u in query("gpu=index,uuid") if i in want or u in want}
            apps = [a for a in apps if len(a) > 1 and a[1] in uuids]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    return [int(a[0]) for a in apps if a and a[0].isdigit()]


def stop_leftovers(wait_s: float = 60.0) -> list[int]:
    """End the GPU processes a killed run left behind (a server keeps ~120 GB of GPU memory, and
    the next one dies at start with -9): SIGTERM, then SIGKILL after 10 s; wait until none holds
    the GPU. Returns the pids found."""
    me = os.getpid()
    pids = [p for p in gpu_pids() if p != me]
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        alive = []
        for p in pids:
            try:
                os.kill(p, sig)
                alive.append(p)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if os.path.exists(f"/proc/{p}")]
            time.sleep(0.5)
        if not alive:
            break
    deadline = time.monotonic() + wait_s
    while gpu_pids() and time.monotonic() < deadline:
        time.sleep(1.0)
    if pids:
        print(f"[leftovers] stopped {pids}; GPU now held by {gpu_pids()}", flush=True)
    return pids


# -- the model's shape ------------------------------------------------------------------------------
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "fp8": 1}


def model_info(model_dir: str, tp: int = 1) -> dict[str, Any]:
    """The shape and KV bytes per token from the model's config.json, at tensor-parallel size `tp`.

    ``kv_bytes_per_token`` is what one token's KV takes in L3, all ranks together: what the disk
    writes and reads per token. MHA/GQA: layers x (K, V) x KV heads x head dim x dtype bytes, the
    heads split over the ranks, each rank storing its share. MLA (DeepSeek-V2/V3: a config with
    ``kv_lora_rank``): layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes -- one latent per
    layer, not per head, and every rank holds the same latent, so one copy goes to L3 (one writer
    rank, hicache-gds' MLA split). ``gpu_kv_bytes_per_token`` is what one GPU's KV pool holds per
    token: the MHA share (KV heads / tp, at least one head), or the whole latent for MLA.
    """
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    layers = int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads", heads))
    head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    dtype = str(c.get("torch_dtype", "bfloat16"))
    nbytes = _DTYPE_BYTES.get(dtype, 2)
    mla = c.get("kv_lora_rank") is not None
    if mla:
        per_layer = int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim", 0))
        kv = gpu_kv = layers * per_layer * nbytes
    else:
        kv = layers * 2 * kv_heads * head_dim * nbytes
        gpu_kv = layers * 2 * max(1, kv_heads // tp) * head_dim * nbytes  # fewer KV heads than ranks: replicated
    return {"name": os.path.basename(os.path.normpath(model_dir)), "layers": layers, "heads": heads,
            "kv_heads": kv_heads, "head_dim": head_dim, "hidden": int(c["hidden_size"]),
            "intermediate": int(c.get("intermediate_size", 0)), "dtype": dtype, "kv_bytes_per_token": kv,
            "attention": "mla" if mla else "mha", "tp": tp, "gpu_kv_bytes_per_token": gpu_kv,
            "quantization": (c.get("quantization_config") or {}).get("quant_method"),
            "vocab_size": int(c.get("vocab_size", 32000))}


# DeepSeek-V3's published checkpoint quantization (block-wise FP8 e4m3, 128x128 scales): with
# dummy weights SGLang allocates FP8 weights directly, which is what lets 61 layers fit 8 GPUs.
FP8_BLOCK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def model_variant(model_dir: str, out_dir: str, layers: int = 0, weights: str = "") -> str:
    """`model_dir` as is, or a copy of its config.json under ``out_dir/models/`` with
    ``num_hidden_layers`` = `layers` (0: unchanged) and, for `weights` ``"fp8"``, the block-FP8
    ``quantization_config`` (``"bf16"``: none). The copy's directory name says what changed
    (``deepseek-v3-shape-L24-bf16``), so reports and result files name it. Returns its directory."""
    if not layers and not weights:
        return model_dir
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    name = os.path.basename(os.path.normpath(model_dir))
    if layers:
        if layers < 1:
            raise SystemExit(f"--layers {layers}: must be at least 1")
        c["num_hidden_layers"] = layers
        # DeepSeek's first dense layers: keep the count valid when fewer layers remain
        if "first_k_dense_replace" in c:
            c["first_k_dense_replace"] = min(int(c["first_k_dense_replace"]), layers)
        name += f"-L{layers}"
    if weights == "fp8":
        c["quantization_config"] = dict(FP8_BLOCK)
        name += "-fp8"
    elif weights == "bf16":
        c.pop("quantization_config", None)
        name += "-bf16"
    elif weights:
        raise SystemExit(f"--weights {weights!r}: choose fp8 or bf16")
    d = os.path.join(os.path.abspath(out_dir), "models", name)
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(c, f, indent=2)
    os.replace(tmp, os.path.join(d, "config.json"))
    for extra in os.listdir(model_dir):  # tokenizer and generation files travel with the config
        if extra != "config.json" and os.path.isfile(os.path.join(model_dir, extra)):
            shutil.copyfile(os.path.join(model_dir, extra), os.path.join(d, extra))
    return d


def admin(srv: "Server", method: str, path: str, key: str, body: dict | None = None,
          timeout: float = 180.0) -> tuple[int, str]:
    """An admin request (`--admin-api-key`): GET / PUT / DELETE / POST of JSON."""
    req = urllib.request.Request(srv.url(path), method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace").strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace").strip()
    except (urllib.error.URLError, OSError) as e:
        return 0, f"{type(e).__name__}: {e}"
