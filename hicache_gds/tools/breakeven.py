"""When an L3 tier pays: the read rate of `GDS_PATH`, measured, against a model's prefill rate.

Loading an ``n``-token prefix from a tier reading ``R`` bytes/s takes ``n * B / R`` for ``B`` bytes
of KV per token; recomputing it takes about ``n / P`` at prefill rate ``P``. So one request at a
time, the tier pays when the engine prefills slower than ``R / B`` tokens per second (longer
prompts favour the tier: attention makes prefill superlinear; under load the disk and the GPU
serve different requests at once and their rates add: `hicache_gds.costmodel`). `hicache-gds
doctor` prints both (``--model`` / ``--kv-bytes-per-token``, ``--read-probe-mib``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from ..costmodel import breakeven_prefill_rate
from ..probe import probe_dir

__all__ = ["kv_bytes_per_token", "section", "render"]

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
_COMMON = (("8B-class (Llama-3-8B: 128 KiB)", 128 << 10), ("32B-class (64 layers, 8 KV heads: 256 KiB)", 256 << 10),
           ("70B-class (Llama-3-70B: 320 KiB)", 320 << 10))


def kv_bytes_per_token(model: str) -> tuple[str, int]:
    """(name, KV bytes per token on one GPU) from a Hugging Face config.json (or its directory):
    layers x (K, V) x KV heads x head dim x dtype bytes; for MLA (a config with ``kv_lora_rank``:
    DeepSeek-V2/V3) layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, one latent per layer
    rather than per head. `ValueError` naming what is missing."""
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    try:
        with open(path) as f:
            c = json.load(f)
        nbytes = _DTYPE_BYTES.get(str(c.get("torch_dtype", "bfloat16")), 2)
        if c.get("kv_lora_rank") is not None:
            kv = int(c["num_hidden_layers"]) * (int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim", 0))) * nbytes
        else:
            heads = int(c["num_attention_heads"])
            head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
            kv = int(c["num_hidden_layers"]) * 2 * int(c.get("num_key_value_heads", heads)) * head_dim * nbytes
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--model {model}: not a readable Hugging Face config.json ({type(exc).__name__}: {exc})") \
            from exc
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return name, kv


def section(dirs: Sequence[str], probe_mib: int = 256, kv: int | None = None,
            model: str | None = None) -> dict[str, Any]:
    """The read rate of each directory and, per model (or common shapes), the prefill rate below
    which loading from it beats recomputing."""
    out: dict[str, Any] = {"probes": [], "models": []}
    if model:
        try:
            name, kv_model = kv_bytes_per_token(model)
            out["models"].append({"model": name, "kv_bytes_per_token": kv_model})
        except ValueError as exc:
            out["error"] = str(exc)
    if kv:
        out["models"].append({"model": "given", "kv_bytes_per_token": int(kv)})
    if not out["models"]:
        out["models"] = [{"model": m, "kv_bytes_per_token": b} for m, b in _COMMON]
    if probe_mib > 0:
        out["probes"] = [probe_dir(d, probe_mib << 20) for d in dirs]
    rates = [p["read_bytes_per_s"] for p in out["probes"] if "read_bytes_per_s" in p]
    total = sum(rates)  # pages are striped over the directories
    for m in out["models"]:
        m["breakeven_prefill_tokens_per_s"] = breakeven_prefill_rate(total, m["kv_bytes_per_token"]) if total else None
    out["read_bytes_per_s"] = total or None
    return out


def render(sec: dict[str, Any]) -> str:
    lines = []
    for p in sec.get("probes", []):
        if "error" in p:
            lines.append(f"read rate    : {p['path']}: not measured ({p['error']})")
        else:
            lines.append(f"read rate    : {p['path']}: {p['read_bytes_per_s'] / 1e9:.2f} GB/s O_DIRECT read, "
                         f"{p['write_bytes_per_s'] / 1e9:.2f} GB/s write ({p['threads']} x {p['chunk'] >> 20} MiB "
                         f"in flight, {p['bytes'] >> 20} MiB)")
    if sec.get("error"):
        lines.append(f"L3 pays      : {sec['error']}")
    if sec.get("read_bytes_per_s"):
        for m in sec["models"]:
            lines.append(f"L3 pays      : {m['model']} ({m['kv_bytes_per_token'] >> 10} KiB of KV per token): when the "
                         f"engine prefills slower than {m['breakeven_prefill_tokens_per_s']:,.0f} tokens/s, one request "
                         "at a time (longer prompts and a busy GPU favour L3; the compute_or_load policy decides per "
                         "request)")
    elif sec.get("probes") == [] and sec["models"]:
        lines.append("L3 pays      : read rate not measured (--read-probe-mib 0)")
    return "\n".join(lines) + ("\n" if lines else "")
