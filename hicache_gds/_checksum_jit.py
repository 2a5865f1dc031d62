"""The checksum's block sums on the CPU, compiled with Numba: the same numbers as numpy's einsum
(`checksum._block_sums`), about 5x faster per core and without the GIL.

Why. Pages written from GPU memory record hgc1 (`pagesum`): the GPU sums every 4 KiB block in one
kernel launch. When such a page is read into host memory (a host-pool server reading what a
GPU-direct writer stored, the remote tier's GPU pages landing in a host buffer) the CPU verifies it,
and numpy's einsum sums about 4-6 GB/s per core: slower than a fast device reads. The loop below (one
64-bit multiply-add per 32-bit word) compiles to vector code and sums 20+ GB/s per core (2-core CPU
machine: 22 GB/s against numpy's 4). Host-written pages carry xxh3 and never come here.

Compilation takes about a second and happens once per process, in a background thread started by the first
host hgc1 sum: until it is ready (or where Numba is not installed, or it fails to compile) `kernel()` answers
None and the caller sums with numpy, so no request ever waits for the compiler.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

log = logging.getLogger("hicache_gds.checksum")

__all__ = ["kernel", "engine", "wait_ready"]

_LOCK = threading.Lock()
_READY = threading.Event()
_kernel: Callable[..., None] | None = None
_state = "unset"  # unset | compiling | ready | unavailable | off
_why = ""

# HICACHE_GDS_CHECKSUM_JIT=0 keeps numpy (a diagnostic, and how tests reach the fallback).
_ENV = "HICACHE_GDS_CHECKSUM_JIT"


def _compile() -> None:
    global _kernel, _state, _why
    try:
        import numba
        import numpy as np
        from numba import types

        # words and weights may be read-only arrays (a frombuffer view, `checksum.WEIGHTS`) or not:
        # every combination is compiled up front, so a call never compiles
        sigs = [types.void(types.Array(types.uint32, 2, "C", readonly=ro_w), types.Array(types.uint64, 1, "C",
                                                                                          readonly=ro_k),
                           types.Array(types.uint64, 1, "C")) for ro_w in (True, False) for ro_k in (True, False)]

        @numba.njit(sigs, nogil=True, cache=False, error_model="numpy")
        def block_sums(words, weights, out):  # pragma: no cover -- compiled; tested through kernel()
            n = words.shape[1]
            for b in range(words.shape[0]):
                s = np.uint64(0)
                for j in range(n):
                    s += np.uint64(words[b, j]) * weights[j]  # wraps: mod 2**64, as numpy's uint64
                out[b] = s

        _kernel, _state = block_sums, "ready"
    except Exception as exc:  # noqa: BLE001 -- numpy serves; say why once
        _state, _why = "unavailable", f"{type(exc).__name__}: {exc}"
        log.info("hicache-gds: page checksums on numpy (%s)", _why)
    finally:
        _READY.set()


def kernel() -> Callable[..., None] | None:
    """The compiled ``block_sums(words[B, 1024] uint32, weights[1024] uint64, out[B] uint64)``, or
    None while it compiles or where it cannot (the caller then sums with numpy)."""
    global _state
    if _kernel is not None:
        return _kernel
    if _state == "unset":
        with _LOCK:
            if _state == "unset":
                if os.environ.get(_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
                    _state = "off"
                    _READY.set()
                else:
                    _state = "compiling"
                    threading.Thread(target=_compile, name="hicache-gds-checksum-jit", daemon=True).start()
    return _kernel


def wait_ready(timeout: float = 30.0) -> bool:
    """Start the compilation if needed and wait for its outcome (warm-up, tests, benchmarks);
    True when the compiled kernel serves."""
    kernel()
    _READY.wait(timeout)
    return _kernel is not None


def engine() -> str:
    """Which code sums host pages now, for stats and reports: ``numba``, ``numpy`` (with why)."""
    if _kernel is not None:
        return "numba"
    why = {"unset": "not started", "compiling": "numba compiling", "off": f"{_ENV}=0"}.get(_state, _why)
    return f"numpy ({why})"

