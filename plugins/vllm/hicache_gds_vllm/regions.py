"""Region math: which bytes of vLLM's KV cache make up one stored chunk. Pure numpy, no IO, no vLLM.

One *page* of the store is one offload chunk of one KV-cache group on one rank: for every layer
reference of the group (in vLLM's order) the `blocks_per_chunk` GPU-block pages of that layer,
so the bytes on disk are

    page = [ref 0: sub-block 0 .. bpc-1][ref 1: sub-block 0 .. bpc-1] ... [ref R-1: ...]

and segment (r, j) of a page is `ref_page_bytes[r]` bytes at
`ref_base[r] + block_id * ref_stride[r]` (vLLM's LBHNC layout makes every (layer, block) page
one contiguous run).

vLLM hands a transfer the GPU blocks of a group as one run of logical sub-block positions
`skip .. skip + n - 1`, where `skip = block_indices[g] % blocks_per_chunk`: the first chunk may
begin part-way (the partial first chunk of a load, or leading null blocks of a sliding window)
and the last may end early. Positions outside the run still belong to the page's bytes; their
segments point at *scratch* memory, one distinct piece per segment, so a read never writes real
KV there and the store's per-page checksum stays well defined.

Adjacent segments that are contiguous in memory (consecutive block ids of one layer) are merged,
which cuts descriptors by up to `blocks_per_chunk` x; pages are then bucketed by their merged
segment count, since a `hicache_gds.Pages` batch is rectangular.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["GroupGeometry", "ChunkPlan", "plan_group", "coalesce", "scratch_bytes_needed", "chunk_blocks"]


@dataclass(frozen=True)
class GroupGeometry:
    """Where one KV-cache group's layers live: per layer reference, base address, block stride
    and (un-padded) page bytes; `bpc` GPU blocks per stored chunk."""

    ref_base: np.ndarray  # uint64 (R,)
    ref_stride: np.ndarray  # uint64 (R,)
    ref_page: np.ndarray  # uint64 (R,)
    bpc: int

    @classmethod
    def build(cls, bases: Sequence[int], strides: Sequence[int], pages: Sequence[int], bpc: int) -> "GroupGeometry":
        if not (len(bases) == len(strides) == len(pages)) or not bases:
            raise ValueError("a group needs at least one layer, with a base, stride and page size each")
        if bpc < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {bpc}")
        return cls(np.asarray(bases, np.uint64), np.asarray(strides, np.uint64), np.asarray(pages, np.uint64), bpc)

    @property
    def page_bytes(self) -> int:
        """Bytes of one stored chunk (all layers of the group, `bpc` blocks)."""
        return int(self.ref_page.sum()) * self.bpc

    @property
    def segments(self) -> int:
        return len(self.ref_page) * self.bpc


@dataclass(frozen=True)
class ChunkPlan:
    """Segments of C chunks: `addrs`/`lens` are (C, R*bpc) uint64; `real` marks segments that are
    KV memory (False: scratch); `nbytes` counts real bytes only."""

    addrs: np.ndarray
    lens: np.ndarray
    real: np.ndarray
    nbytes: int

    def __len__(self) -> int:
        return int(self.addrs.shape[0])


def chunks_for(n_blocks: int, skip: int, bpc: int) -> int:
    """Chunks touched by `n_blocks` GPU blocks starting at sub-block `skip` of the first chunk."""
    return 0 if n_blocks == 0 else -(-(skip + n_blocks) // bpc)


def chunk_blocks(block_ids: np.ndarray, skip: int, bpc: int) -> list[list[int]]:
    """The GPU block ids each chunk covers, for `block_ids` starting at sub-block `skip` (the
    blocks a failed chunk would have filled)."""
    ids = [int(b) for b in np.asarray(block_ids).ravel().tolist()]
    c = chunks_for(len(ids), skip, bpc)
    return [ids[max(0, i * bpc - skip):max(0, (i + 1) * bpc - skip)] for i in range(c)]


def scratch_bytes_needed(geo: GroupGeometry) -> int:
    """Most scratch one group of one transfer can need: a partial first and a partial last chunk."""
    return 2 * (geo.bpc - 1) * int(geo.ref_page.sum())


def plan_group(geo: GroupGeometry, block_ids: np.ndarray, skip: int, scratch_addr: int,
               scratch_len: int) -> ChunkPlan:
    """Segments of the chunks covered by `block_ids` (one group, logical order) after `skip`.

    Raises ValueError when `skip` is out of range or the scratch area is too small.
    """
    bpc = geo.bpc
    if not 0 <= skip < bpc:
        raise ValueError(f"skip {skip} must be in [0, {bpc})")
    ids = np.asarray(block_ids, dtype=np.uint64).ravel()
    n = len(ids)
    c = chunks_for(n, skip, bpc)
    r = len(geo.ref_page)
    if c == 0:
        empty = np.empty((0, r * bpc), np.uint64)
        return ChunkPlan(empty, empty.copy(), np.empty((0, r * bpc), bool), 0)
    # Logical position of every sub-block slot; the slots skip..skip+n-1 hold real blocks.
    pos = np.arange(c * bpc).reshape(c, bpc)
    real_cb = (pos >= skip) & (pos < skip + n)  # (C, bpc)
    blk = np.zeros((c, bpc), np.uint64)
    blk[real_cb] = ids
    # (C, R, bpc): ref-major inside a page.
    addrs = geo.ref_base[None, :, None] + blk[:, None, :] * geo.ref_stride[None, :, None]
    lens = np.broadcast_to(geo.ref_page[None, :, None], addrs.shape).copy()
    real = np.broadcast_to(real_cb[:, None, :], addrs.shape).copy()
    fake = ~real
    if fake.any():
        need = lens[fake]
        offs = np.cumsum(need) - need
        total = int(need.sum())
        if total > scratch_len:
            raise ValueError(f"scratch of {scratch_len} bytes cannot hold {total} bytes of partial chunks")
        addrs[fake] = np.uint64(scratch_addr) + offs.astype(np.uint64)
    nbytes = int(lens[real].sum())
    return ChunkPlan(addrs.reshape(c, r * bpc), lens.reshape(c, r * bpc), real.reshape(c, r * bpc), nbytes)


def coalesce(addrs: np.ndarray, lens: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Merge memory-contiguous neighbours within each page; bucket pages by merged segment count.

    Returns [(row indices, addrs (k, S'), lens (k, S'))], one entry per distinct S', covering every
    row once. The bytes of a page, read in order, are unchanged.
    """
    p, s = addrs.shape
    if p == 0:
        return []
    joins = np.zeros((p, s), dtype=bool)  # joins[:, j]: segment j continues segment j-1
    if s > 1:
        joins[:, 1:] = addrs[:, 1:] == addrs[:, :-1] + lens[:, :-1]
    counts = s - joins.sum(axis=1)
    out = []
    for k in np.unique(counts):
        rows = np.flatnonzero(counts == k)
        starts = ~joins[rows]  # (m, s): True where a merged segment starts
        flat_starts = np.flatnonzero(starts.ravel())
        a = addrs[rows].ravel()[flat_starts].reshape(len(rows), int(k))
        seg_id = np.cumsum(starts.ravel()) - 1
        sums = np.bincount(seg_id, weights=lens[rows].ravel().astype(np.float64), minlength=len(flat_starts))
        ln = np.rint(sums).astype(np.uint64).reshape(len(rows), int(k))
        out.append((rows, a, ln))
    return out
