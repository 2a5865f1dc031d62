"""A stand-in for `vllm serve` that checks bench_vllm_server.py on a CPU machine (``--dry-run``).

It takes the same command line, answers the endpoints the harness uses (``/health``,
``/v1/completions`` streamed with token ids and cached-token usage, ``/metrics`` with vLLM's
offloading counters) and behaves like a server with a small GPU prefix cache and, when a
``--kv-transfer-config`` is given, an offload tier: prompts' full chunks are "stored" (the store
counter grows), a revisit "loads" what the tier holds (the load counters grow) and "computes" the
rest, at made-up rates, so TTFTs differ between configurations. Output tokens are a function of the
prompt, so every configuration agrees with recompute. KV bytes per token come from the model's
config.json. No model, no GPU, no disk.

Faults, for the harness's own failure paths, where a ``--kv-transfer-config`` is given:
``FAKE_VLLM_FAIL=1`` answers every completion with HTTP 500; ``FAKE_VLLM_STALL_AFTER=N`` lets N
completions through and then never answers (as an engine retrying a failed load forever).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PREFILL_TOK_S = 400_000.0
LOAD_BYTES_S = 40e9


def kv_per_token(model_dir: str) -> int:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 2
    except (OSError, ValueError, KeyError):
        return 131072


class State:
    def __init__(self, a: argparse.Namespace, rest: list[str]) -> None:
        self.block = a.block_size
        self.gpu_tokens = a.num_gpu_blocks_override * a.block_size
        ktc = json.loads(a.kv_transfer_config) if a.kv_transfer_config else None
        extra = (ktc or {}).get("kv_connector_extra_config", {})
        self.chunk = int(extra.get("block_size", 4 * a.block_size))
        per_chunk = self.chunk * kv_per_token(a.model)
        self.tier_chunks = (int(extra["cpu_bytes_to_use"]) // per_chunk if "cpu_bytes_to_use" in extra
                            else (1 << 40 if ktc else 0))
        self.gpu: OrderedDict[str, None] = OrderedDict()  # chunk prefix hashes, LRU
        self.tier: OrderedDict[str, None] = OrderedDict()
        self.counters = {"load_bytes": 0.0, "load_time": 0.0, "store_bytes": 0.0, "store_time": 0.0}
        self.mu = threading.Lock()
        self.kv_per_token = kv_per_token(a.model)
        self.fail = bool(ktc) and os.environ.get("FAKE_VLLM_FAIL") == "1"
        stall = os.environ.get("FAKE_VLLM_STALL_AFTER")
        self.stall_after = int(stall) if ktc and stall else None
        self.served = 0

    def keys(self, ids: list[int]) -> list[str]:
        out, h = [], hashlib.sha256()
        for i in range(0, len(ids) - len(ids) % self.chunk, self.chunk):
            h.update(json.dumps(ids[i:i + self.chunk]).encode())
            out.append(h.hexdigest())
        return out

    def serve(self, ids: list[int]) -> tuple[int, float]:
        """Cached tokens and the seconds until the first token."""
        ks = self.keys(ids)
        with self.mu:
            gpu = next((i for i, k in enumerate(ks) if k not in self.gpu), len(ks))
            tier = next((i for i, k in enumerate(ks[gpu:], gpu) if k not in self.tier), len(ks))
            loaded = (tier - gpu) * self.chunk
            seconds = loaded * self.kv_per_token / LOAD_BYTES_S + (len(ids) - tier * self.chunk) / PREFILL_TOK_S
            if loaded:
                self.counters["load_bytes"] += loaded * self.kv_per_token
                self.counters["load_time"] += loaded * self.kv_per_token / LOAD_BYTES_S
            for k in ks:
                self.gpu[k] = None
                self.gpu.move_to_end(k)
                if self.tier_chunks and k not in self.tier:
                    self.counters["store_bytes"] += self.chunk * self.kv_per_token
                    self.counters["store_time"] += self.chunk * self.kv_per_token / LOAD_BYTES_S
                if self.tier_chunks:
                    self.tier[k] = None
                    self.tier.move_to_end(k)
            while len(self.gpu) * self.chunk > self.gpu_tokens:
                self.gpu.popitem(last=False)
            while len(self.tier) > self.tier_chunks:
                self.tier.popitem(last=False)
        return tier * self.chunk, seconds


def handler(state: State):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/metrics":
                lines = [f'vllm:kv_offload_{k}_total{{engine="0"}} {v}' for k, v in state.counters.items()]
                self._send(200, ("\n".join(lines) + "\n").encode(), "text/plain")
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = [int(t) for t in body["prompt"]]
            if state.fail:
                self._send(500, b'{"error": "injected"}')
                return
            with state.mu:
                state.served += 1
                stall = state.stall_after is not None and state.served > state.stall_after
            if stall:
                time.sleep(3600)  # never answers; the server is stopped by the harness
                return
            cached, seconds = state.serve(ids)
            time.sleep(seconds)
            digest = hashlib.sha256(json.dumps(ids).encode()).digest()
            out = [int.from_bytes(digest[i:i + 2], "little") for i in range(0, 2 * body["max_tokens"], 2)]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for t in out:
                self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'token_ids': [t]}]})}\n\n"
                                 .encode())
                self.wfile.flush()
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(out),
                     "prompt_tokens_details": {"cached_tokens": cached}}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
    return H


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", type=int, default=1024)
    p.add_argument("--kv-transfer-config", default=None)
    a, rest = p.parse_known_args()
    time.sleep(0.5)  # "loading the model"
    srv = ThreadingHTTPServer((a.host, a.port), handler(State(a, rest)))
    print(f"fake vllm serve {a.model} on {a.host}:{a.port}; {' '.join(rest)}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
