"""Time-to-first-token of a running SGLang server, per L3 configuration, on one disk, in one run.

    python benchmarks/e2e/bench_sglang_server.py --dir /var/tmp/e2e-store \
        --configs recompute,hicache,file,nixl,gds --out results/
    python benchmarks/e2e/bench_sglang_server.py --mode suite --model benchmarks/e2e/qwen-32b-shape \
        --dir /var/tmp/e2e-store --out /var/tmp/e2e-out --resume --deadline 510 --plot

``--mode suite`` (and ``single``, ``burst``, ``open``, each one of its workloads) runs one server
and switches configurations at runtime -- recompute, gds with each SGLang policy and with
``compute_or_load``, HiCacheNixl -- with revisits one at a time, bursts of revisits sent at once and
open-loop Poisson arrivals over a sweep of rates; `suite.py` describes it. The modes below start a
fresh server per configuration.

Each configuration is a fresh ``python -m sglang.launch_server`` (``--model``'s geometry, Llama-3-8B by default,
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
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2elib import (Result, Server, _jsonable, _revive, backed_up_tokens, compare, drop_caches,  # noqa: E402,F401
                    free_port, generate, install_guard, log_facts, machine, metrics_lines, model_info, model_variant,
                    raw_disk, stop_leftovers, tokens, ttft_stats, versions, wait_stored)
import suite  # noqa: E402 -- its options (--tp, --layers) are this script's too

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_DIR = os.path.join(HERE, "llama3-8b-shape")
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
           "--served-model-name", f"e2e-{os.path.basename(os.path.normpath(a.model))}"]
    cmd += suite.tp_args(a)
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


# -- requests -----------------------------------------------------------------------------------


# -- workloads ----------------------------------------------------------------------------------


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
             f"model {os.path.basename(a['model'])} (dummy weights), TP={a.get('tp', 1)}, "
             f"page {a['page_size']} tokens, "
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="the disk under test: every configuration's L3 goes below it")
    p.add_argument("--configs", default="recompute,hicache,file,nixl,gds")
    p.add_argument("--mode", choices=("prefix", "multiturn", "suite", "single", "burst", "open"), default="prefix")
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
    p.add_argument("--prefixes", type=int, default=None, help="prompts (prefix mode: 12; suite: 8)")
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
    p.add_argument("--raw-size", default=None, help="bytes for the raw disk measurement; 0 skips it "
                   "(default 4G; suite 2G)")
    p.add_argument("--keep", action="store_true", help="keep each configuration's L3 files")
    p.add_argument("--resume", action="store_true",
                   help="keep the configurations already in --out's results (split a long run over several calls)")
    suite.add_args(p)
    a = p.parse_args(argv)
    if a.mode in ("suite", "single", "burst", "open"):
        a.prefixes = a.prefixes or 8
        a.raw_size = "2G" if a.raw_size is None else a.raw_size
        return suite.main(a)
    a.prefixes = a.prefixes or 12
    a.raw_size = "4G" if a.raw_size is None else a.raw_size
    if a.tp < 1:
        p.error(f"--tp {a.tp}: must be at least 1")
    a.model = model_variant(a.model, a.out, a.layers, a.weights)
    a.model_info = model_info(a.model, a.tp)
    install_guard()
    stop_leftovers()
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
