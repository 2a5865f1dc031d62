"""The Triton kernel of `checksum`: the block sums s_b of every 4 KiB block of a request's pages, one
program per block, one launch per request. The rest of the definition (the fold over blocks and
the final mix) is a few element-wise torch ops on the block sums (`checksum._t_finish`).

Each program reads its block where the bytes lie: the segments that overlap the block (their
range per block comes from the host, `checksum._segment_tables`) are loaded under a mask, so a
page in many segments (layer_first pools) is summed without being gathered first. Bytes past a
page's last segment read as zeros. Words are 32-bit little-endian; integer products and sums
wrap mod 2**64 (int64 arithmetic).

Importing this module raises where Triton cannot run (`checksum.triton_available` asks).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    raise ImportError("no CUDA device for Triton (set TRITON_INTERPRET=1 to run it on the host)")

__all__ = ["block_sums"]


@triton.jit
def _block_sums(lo_ptr, hi_ptr, seg_addr, seg_start, seg_len, w_ptr, out_ptr, S, NB, ALIGNED: tl.constexpr):
    g = tl.program_id(0)
    p = (g // NB).to(tl.int64)
    block0 = (g % NB).to(tl.int64) * 4096
    lo = tl.load(lo_ptr + g)
    hi = tl.load(hi_ptr + g)
    j = tl.arange(0, 1024)
    w = tl.load(w_ptr + j)
    if ALIGNED:  # every segment whole words at aligned addresses: one 32-bit load per word
        pos = block0 + j.to(tl.int64) * 4
        words = tl.zeros((1024,), dtype=tl.int64)
        for s in range(lo, hi):
            k = p * S + s
            a = tl.load(seg_addr + k).to(tl.pointer_type(tl.uint32))
            rel = pos - tl.load(seg_start + k)
            m = (rel >= 0) & (rel < tl.load(seg_len + k))
            v = tl.load(a + rel // 4, mask=m, other=0)
            words += v.to(tl.int64) & 0xFFFFFFFF
    else:  # any byte boundary: a (1024, 4) tile of bytes, assembled into words
        pos = block0 + j.to(tl.int64)[:, None] * 4 + tl.arange(0, 4).to(tl.int64)[None, :]
        acc = tl.zeros((1024, 4), dtype=tl.int64)
        for s in range(lo, hi):
            k = p * S + s
            a = tl.load(seg_addr + k).to(tl.pointer_type(tl.uint8))
            rel = pos - tl.load(seg_start + k)
            m = (rel >= 0) & (rel < tl.load(seg_len + k))
            v = tl.load(a + rel, mask=m, other=0)
            acc += v.to(tl.int64) & 0xFF
        shift = (tl.arange(0, 4) * 8).to(tl.int64)
        words = tl.sum(acc << shift[None, :], axis=1)
    tl.store(out_ptr + g, tl.sum(words * w, axis=0))


def block_sums(lo: Any, hi: Any, seg_addr: Any, seg_start: Any, seg_len: Any, pages: int, segments: int,
               nblocks: int, weights: Any, aligned: bool) -> Any:
    """s_b (int64, pages x nblocks, page-major) on the tensors' device, queued on the current stream."""
    out = torch.empty(pages * nblocks, dtype=torch.int64, device=weights.device)
    _block_sums[(pages * nblocks,)](lo, hi, seg_addr, seg_start, seg_len, weights, out, segments, nblocks,
                                    ALIGNED=bool(aligned))
    return out
