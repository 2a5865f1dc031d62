"""What a running SGLang server does with hicache-gds beyond serving: restart, runtime detach and
attach (by name and through ``dynamic``), ``/flush_cache``, a second server on the same
``GDS_PATH``, shutdown. Every check is an HTTP request to real servers; each prompt is sent again
exactly as first sent, so its greedy tokens must equal the first answer wherever its prefix comes
back from L3.

    python benchmarks/e2e/check_server_ops.py --dir /var/tmp/e2e-ops --out ops-results

Prints a table of checks (expected, observed, pass) and writes ``ops.json`` / ``ops.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_sglang_server import (MODEL_DIR, Server, backed_up_tokens, free_port, generate,  # noqa: E402
                                 log_facts, server_command, stored_pages, tokens)
from e2elib import install_guard, stop_leftovers  # noqa: E402

KEY = "hicache-gds-ops-check"


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, name: str, expected: str, observed: Any, ok: bool) -> None:
        self.rows.append({"check": name, "expected": expected, "observed": observed, "pass": bool(ok)})
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {observed}", flush=True)


def start(a: argparse.Namespace, store: str, out: str, tag: str) -> Server:
    port = free_port()
    cmd, env = server_command("gds", a, port, store)
    cmd += ["--admin-api-key", KEY]
    srv = Server(cmd, env, os.path.join(out, f"server-{tag}.log"), port)
    srv.wait_ready(a.start_timeout)
    return srv


def admin(srv: Server, method: str, body: dict | None = None) -> tuple[int, str]:
    import urllib.error
    import urllib.request
    req = urllib.request.Request(srv.url("/hicache/storage-backend"), method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode(errors="replace").strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace").strip()


def revisit(srv: Server, prompt: list[int], first: list[int], a: argparse.Namespace) -> dict[str, Any]:
    """Flush GPU and host caches, send `prompt` again: where did its prefix come from, same tokens?"""
    code, _ = srv.post("/flush_cache", timeout=120, api_key=KEY)  # an admin endpoint under --admin-api-key
    time.sleep(0.5)
    r = generate(srv, "revisit", prompt, a.gen, a.req_timeout)
    return {"flush": code, "storage_tokens": int(r.cached.get("storage", 0) or 0), "ttft_s": round(r.ttft_s, 3),
            "same_tokens": r.output_ids == first and bool(first), "error": r.error}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", default="ops-results")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--gen", type=int, default=8)
    p.add_argument("--capacity", default="8G")
    p.add_argument("--mem-fraction", type=float, default=0.35, help="two servers share the GPU")
    p.add_argument("--max-total-tokens", type=int, default=24576)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--req-timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    install_guard()  # the servers stop on every exit path
    stop_leftovers()
    # the fields server_command() reads, as bench_sglang_server's defaults
    a.model, a.page_size, a.chunk, a.hicache_ratio, a.layout = MODEL_DIR, 64, 8192, 2.0, "page_first"
    a.prefetch_policy = "wait_complete"
    os.makedirs(a.out, exist_ok=True)
    store = os.path.join(a.dir, "gds")
    shutil.rmtree(store, ignore_errors=True)
    os.makedirs(store, mode=0o700)
    prompts = [tokens(9000 + i, a.prompt_tokens) for i in range(a.prompts)]
    expect_tokens = sum(len(x) // 64 * 64 for x in prompts)
    ck = Checks()
    servers: list[Server] = []
    try:
        s1 = start(a, store, a.out, "first")
        servers.append(s1)
        first = [generate(s1, f"q{i}", x, a.gen, a.req_timeout) for i, x in enumerate(prompts)]
        answers = [r.output_ids for r in first]
        ck.add("first server answers", "no errors", [r.error for r in first], all(r.error is None for r in first))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120 and (backed_up_tokens(s1) or 0) < expect_tokens:
            time.sleep(0.5)
        ck.add("pages written to L3", f">= {len(prompts) * (a.prompt_tokens // 64)} pages",
               stored_pages("gds", store), stored_pages("gds", store) >= len(prompts) * (a.prompt_tokens // 64))

        r = revisit(s1, prompts[0], answers[0], a)
        ck.add("/flush_cache, then the prefix comes back from L3", "all prefix tokens from storage, same tokens", r,
               r["flush"] == 200 and r["storage_tokens"] >= a.prompt_tokens - 64 and r["same_tokens"])

        code, text = admin(s1, "DELETE")
        ck.add("runtime detach", "200", (code, text), code == 200)
        r = revisit(s1, prompts[1], answers[1], a)
        ck.add("detached: no L3", "0 storage tokens, same tokens", r, r["storage_tokens"] == 0 and r["same_tokens"])

        code, text = admin(s1, "PUT", {"hicache_storage_backend": "gds", "hicache_storage_prefetch_policy": "wait_complete",
                                       "hicache_storage_backend_extra_config_json": json.dumps({"capacity": a.capacity})})
        ck.add("runtime attach by name (gds)", "200", (code, text), code == 200)
        r = revisit(s1, prompts[1], answers[1], a)
        ck.add("re-attached: pages written before the detach are hits", "storage tokens, same tokens", r,
               r["storage_tokens"] >= a.prompt_tokens - 64 and r["same_tokens"])

        code, text = admin(s1, "DELETE")
        dyn = {"backend_name": "gds", "module_path": "hicache_gds_sglang", "class_name": "HiCacheGDS", "interface_v1": 1,
               "capacity": a.capacity}
        code2, text2 = admin(s1, "PUT", {"hicache_storage_backend": "dynamic", "hicache_storage_prefetch_policy":
                                         "wait_complete", "hicache_storage_backend_extra_config_json": json.dumps(dyn)})
        ck.add("runtime detach + attach through `dynamic`", "200, 200", (code, code2, text2), code == 200 and code2 == 200)
        r = revisit(s1, prompts[2], answers[2], a)
        ck.add("dynamic: pages are hits", "storage tokens, same tokens", r,
               r["storage_tokens"] >= a.prompt_tokens - 64 and r["same_tokens"])

        # a second server of the same model on the same GDS_PATH, while the first one runs
        try:
            s2 = start(a, store, a.out, "second")
            servers.append(s2)
            r = generate(s2, "q3", prompts[3], a.gen, a.req_timeout)
            storage = int(r.cached.get("storage", 0) or 0)
            ck.add("second server, same GDS_PATH, while the first runs: starts and reads the first's pages",
                   "storage tokens, same tokens", {"storage_tokens": storage, "same_tokens": r.output_ids == answers[3],
                                                   "error": r.error},
                   r.error is None and storage >= a.prompt_tokens - 64 and r.output_ids == answers[3])
            facts = log_facts(os.path.join(a.out, "server-second.log"))["backend"]
            ck.add("second server says what it does with the namespace", "a hicache-gds line", facts[-3:], bool(facts))
        except Exception as exc:  # noqa: BLE001
            ck.add("second server, same GDS_PATH, while the first runs: starts", "starts", f"{type(exc).__name__}: {exc}",
                   False)

        stops = {}
        for s in servers:
            stops[os.path.basename(s.log_path)] = s.stop()
        servers.clear()
        ck.add("shutdown", "no hang, no processes left", stops,
               all(not v["hung"] and not v["leftover_pids"] for v in stops.values()))

        s3 = start(a, store, a.out, "restarted")
        servers.append(s3)
        rs = [generate(s3, f"q{i}", x, a.gen, a.req_timeout) for i, x in enumerate(prompts)]
        got = [int(r.cached.get("storage", 0) or 0) for r in rs]
        ck.add("restarted server: every prompt's prefix from L3, same tokens", "storage tokens for all, same tokens",
               {"storage_tokens": got, "same": [r.output_ids == ans for r, ans in zip(rs, answers)]},
               all(g >= a.prompt_tokens - 64 for g in got) and all(r.output_ids == ans for r, ans in zip(rs, answers)))
    except Exception as exc:  # noqa: BLE001
        ck.add("run", "completes", f"{type(exc).__name__}: {exc}", False)
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(store, ignore_errors=True)
    doc = {"args": vars(a), "checks": ck.rows}
    with open(os.path.join(a.out, "ops.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    lines = ["| check | expected | observed | |", "|---|---|---|---|"]
    for row in ck.rows:
        obs = json.dumps(row["observed"], default=str)
        lines.append(f"| {row['check']} | {row['expected']} | {obs[:300]} | {'pass' if row['pass'] else 'FAIL'} |")
    with open(os.path.join(a.out, "ops.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["pass"] for r in ck.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
