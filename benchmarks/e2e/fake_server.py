"""A stand-in for ``python -m sglang.launch_server`` that answers the HTTP calls the server
benchmarks make, so their harness (start, runtime switches, flushes, streamed requests, resume,
exit paths) can be dry-run on a machine without a GPU: ``suite.py --fake``.

Its numbers mean nothing about SGLang or the disk. It models one GPU (FIFO prefill at
``FAKE_PREFILL_TOK_S``) and one disk (FIFO loads at ``FAKE_READ_TOK_S``); an L3 per backend kept
in files under ``GDS_PATH`` / ``SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR`` (so a restarted fake
sees what an earlier one wrote); SGLang's policies roughly (wait_complete and timeout load the
whole hit, best_effort loads only while the GPU is busy, compute_or_load takes the earlier finish
over the two queues), write-through of every computed page to the attached L3, greedy tokens that
depend only on the prompt, and the admin key on admin endpoints.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PREFILL = float(os.environ.get("FAKE_PREFILL_TOK_S", "200000"))
READ = float(os.environ.get("FAKE_READ_TOK_S", "150000"))


class L3:
    def __init__(self, path: str, files: bool) -> None:
        self.path, self.files = path, files
        os.makedirs(path, exist_ok=True)
        self.pages: set[str] = set()
        if files:
            self.pages = {f for f in os.listdir(path)}
        else:
            try:
                self.pages = set(json.load(open(os.path.join(path, "fake-l3.json"))))
            except (OSError, ValueError):
                pass
        self.lock = threading.Lock()

    def add(self, hashes: list[str]) -> None:
        with self.lock:
            new = [h for h in hashes if h not in self.pages]
            self.pages.update(new)
            if self.files:
                for h in new:
                    open(os.path.join(self.path, h), "w").close()
            else:
                tmp = os.path.join(self.path, "fake-l3.json.tmp")
                json.dump(sorted(self.pages), open(tmp, "w"))
                os.replace(tmp, os.path.join(self.path, "fake-l3.json"))

    def prefix(self, hashes: list[str]) -> int:
        n = 0
        for h in hashes:
            if h not in self.pages:
                break
            n += 1
        return n


class Fake:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.key = a.admin_api_key
        self.backend = a.hicache_storage_backend
        self.policy = a.hicache_storage_prefetch_policy
        self.l3 = {"gds": L3(os.environ.get("GDS_PATH", "/tmp/fake-gds"), files=False),
                   "nixl": L3(os.environ.get("SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR", "/tmp/fake-nixl"), files=True)}
        self.device: set[str] = set()
        self.lock = threading.Lock()
        self.gpu_free_at = 0.0
        self.disk_free_at = 0.0
        self.backed = 0
        self.active = 0

    def hashes(self, ids: list[int]) -> list[str]:
        ps, out, h = self.a.page_size, [], hashlib.sha1()
        for i in range(len(ids) // ps):
            h.update(json.dumps(ids[i * ps:(i + 1) * ps]).encode())
            out.append(h.copy().hexdigest())
        return out

    def serve(self, ids: list[int], gen: int) -> tuple[float, dict[str, Any], list[int]]:
        """Reserve the GPU and disk time of one request; return when its first token is ready."""
        now = time.monotonic()
        pages = self.hashes(ids[:-1])  # the last token is always computed, as in SGLang
        stored = self.hashes(ids)  # what write-through stores: every full page of the prompt
        ps = self.a.page_size
        with self.lock:
            dev = 0
            while dev < len(pages) and pages[dev] in self.device:
                dev += 1
            l3 = self.l3.get(self.backend) if self.backend else None
            hit = l3.prefix(pages[dev:]) if l3 is not None else 0
            n = len(ids) - dev * ps
            compute_all = n / PREFILL
            gpu_start = max(now, self.gpu_free_at)
            load_done = max(now, self.disk_free_at) + hit * ps / READ
            load = hit > 0 and {
                "wait_complete": True, "timeout": True, "best_effort": self.gpu_free_at > now,
                "compute_or_load": max(load_done, gpu_start) + (n - hit * ps) / PREFILL < gpu_start + compute_all,
            }.get(self.policy, True)
            if load:
                self.disk_free_at = load_done
                start = max(load_done, self.gpu_free_at)
                done = start + (n - hit * ps) / PREFILL
            else:
                hit = 0
                done = gpu_start + compute_all
            self.gpu_free_at = done
            self.device.update(stored)
            if l3 is not None:
                l3.add(stored)
                self.backed += len(stored) * ps
        details = {"device": dev * ps, "host": 0, "storage": hit * ps,
                   "storage_backend": {"gds": "HiCacheGDS", "nixl": "HiCacheNixl"}.get(self.backend)}
        digest = int(hashlib.sha1(json.dumps(ids).encode()).hexdigest(), 16)
        out = [(digest >> (8 * k)) % 30000 + 1000 for k in range(gen)]
        return done, details, out


def handler(fake: Fake) -> type:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, text: str = "", ctype: str = "text/plain") -> None:
            body = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _admin(self) -> bool:
            if self.headers.get("Authorization") != f"Bearer {fake.key}":
                self._send(401, "unauthorized")
                return False
            return True

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}") if n else {}

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, "ok")
            elif self.path == "/metrics":
                self._send(200, f"sglang:backuped_tokens_total{{x=\"0\"}} {fake.backed}\n"
                                f"hicache_gds:read_rate_bytes_per_second {READ}\n")
            elif self.path == "/hicache/storage-backend" and self._admin():
                self._send(200, json.dumps({"hicache_storage_backend": fake.backend,
                                            "hicache_storage_prefetch_policy": fake.policy}), "application/json")

        def do_DELETE(self) -> None:
            if self.path == "/hicache/storage-backend" and self._admin():
                if fake.active:
                    return self._send(400, "Reject detach: scheduler is not idle.")
                fake.backend = None
                self._send(200, "HiCache storage backend detached.")

        def do_PUT(self) -> None:
            if self.path == "/hicache/storage-backend" and self._admin():
                b = self._body()
                want = b.get("hicache_storage_backend")
                if fake.backend not in (None, want):
                    return self._send(400, f"already enabled with backend '{fake.backend}'")
                fake.backend = want
                fake.policy = b.get("hicache_storage_prefetch_policy") or fake.policy
                self._send(200, "HiCache storage backend attached.")

        def do_POST(self) -> None:
            if self.path == "/flush_cache":
                if self._admin():
                    with fake.lock:
                        fake.device.clear()
                    self._send(200, "Cache flushed.")
                return
            if self.path != "/generate":
                return self._send(404)
            b = self._body()
            ids = b["input_ids"]
            gen = int(b.get("sampling_params", {}).get("max_new_tokens", 8))
            with fake.lock:
                fake.active += 1
            try:
                done, details, out = fake.serve(ids, gen)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                time.sleep(max(0.0, done - time.monotonic()))
                for k in range(1, gen + 1):
                    chunk: dict[str, Any] = {"output_ids": out[:k]}
                    if k == gen:
                        chunk["meta_info"] = {"cached_tokens": details["device"] + details["storage"],
                                              "cached_tokens_details": details,
                                              "output_token_logprobs": [[-0.5, t, None] for t in out]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.001)
                self.wfile.write(b"data: [DONE]\n\n")
            finally:
                with fake.lock:
                    fake.active -= 1

    return H


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--admin-api-key", default="")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--hicache-storage-backend", default=None)
    p.add_argument("--hicache-storage-prefetch-policy", default="timeout")
    a, _unknown = p.parse_known_args(argv)
    gds_path = os.environ.get("GDS_PATH")
    if a.hicache_storage_backend == "gds" and gds_path and not os.path.isdir(gds_path):
        # as the real backend refuses at start (and SGLang then exits)
        print(f"GDS_PATH: {gds_path} does not exist; create it (one directory per NVMe drive)", file=sys.stderr)
        return 1
    time.sleep(float(os.environ.get("FAKE_START_S", "1.0")))
    srv = ThreadingHTTPServer((a.host, a.port), handler(Fake(a)))
    srv.daemon_threads = True
    print(f"fake server on {a.host}:{a.port}", flush=True)
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
