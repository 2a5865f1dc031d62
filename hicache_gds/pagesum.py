"""Which checksum a stored page carries, and computing either kind where the page lies.

On-disk format 3 (`slabs.ondisk`) records one of two checksums per page, told apart by the
recorded value's lowest bit:

* **even: `XXH3`** -- XXH3-64 (the ``xxhash`` library) of the page's bytes (its segments in
  order, zero-padded to the stored page's length), lowest bit cleared; 0 is recorded as 2 (0 means
  "not recorded"). Pages written from **host memory** carry it.
* **odd: `HGC1`** -- `hicache_gds.checksum` (a block-parallel sum the GPU computes for a whole
  batch in one kernel launch), lowest bit set. Pages written from **GPU memory** carry it.

Why two. A host page's checksum runs on the CPU beside the IO: xxh3 hashes 25-30 GB/s a core with
the GIL released, hgc1's numpy sums 4.6 GB/s (2-core CPU machine, 2 MiB pages). On a fast device
with few cores hgc1 was most of a get's cost (a RAM-backed ext4 read at 0.6x HiCacheNixl's rate
with it, see benchmarks/results/gpu-h200-fast-device-run14/NOTES.md). On the GPU, hgc1 is one
kernel over every 4 KiB block, while xxh3 is sequential within its input. So each side writes the kind it computes fastest.

A reader verifies the kind the page records, wherever the page landed: host pages of either kind
on the host (hgc1 compiled with Numba, `_checksum_jit`, numpy until then); device pages of hgc1 on their GPU; device pages of xxh3 by
copying them to host memory first (one copy over PCIe, then xxh3): correct, and rare (a page
written by a host-pool server and read by a GPU-direct one). 63 bits remain of either checksum:
it detects corruption and slot mix-ups, not an adversary.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from . import checksum
from .memory import view

__all__ = ["XXH3", "HGC1", "kind_of", "kinds_of", "tag", "xxh3_of", "host_sums", "device_sums", "page_sum",
           "NAME"]

XXH3, HGC1 = "xxh3", "hgc1"
NAME = "xxh3|hgc1 (lowest bit)"
"""What a format-3 namespace records as its checksum (`namespace.json`)."""
_ZEROS = bytes(1 << 20)


def kind_of(recorded: int) -> str:
    """The kind a recorded (nonzero) checksum is of."""
    return HGC1 if int(recorded) & 1 else XXH3


def kinds_of(recorded: np.ndarray) -> np.ndarray:
    """True per recorded checksum of kind hgc1 (odd), False for xxh3."""
    return (np.asarray(recorded, dtype=np.int64) & 1).astype(bool)


def tag(kind: str, value: int) -> int:
    """A raw checksum (xxh3's unsigned 64 bits, or hgc1's signed value) as format 3 records it."""
    if kind == XXH3:
        v = checksum.to_sqlite(int(value) & ~1 & ((1 << 64) - 1))
        return v if v != 1 else 2  # to_sqlite maps 0 to 1; keep xxh3 values even
    if kind == HGC1:
        return int(value) | 1
    raise ValueError(f"unknown checksum kind {kind!r} (known: {XXH3}, {HGC1})")


def xxh3_of(segments: Sequence[tuple[int, int]], nbytes: int) -> int:
    """The (tagged) xxh3 checksum of a host page given as (address, length) segments, zero-padded to `nbytes`."""
    segs = [(int(a), int(n)) for a, n in segments]
    total = sum(n for _, n in segs)
    if nbytes < total:
        raise ValueError(f"nbytes {nbytes} is shorter than the {total} bytes of the segments")
    if len(segs) == 1 and total == nbytes:
        return tag(XXH3, xxhash.xxh3_64_intdigest(view(*segs[0])))
    h = xxhash.xxh3_64()
    for a, n in segs:
        if n:
            h.update(view(a, n))
    pad = nbytes - total
    while pad:
        step = min(pad, len(_ZEROS))
        h.update(_ZEROS[:step] if step < len(_ZEROS) else _ZEROS)
        pad -= step
    return tag(XXH3, h.intdigest())


def page_sum(data: Any, nbytes: int | None = None, kind: str = XXH3) -> int:
    """The (tagged) checksum of a bytes-like page of `kind` (`nbytes`: the stored length; the rest zeros)."""
    u8 = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else \
        np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    n = int(u8.size) if nbytes is None else int(nbytes)
    if kind == HGC1:
        return tag(HGC1, checksum.checksum(u8, n))
    if kind != XXH3:
        raise ValueError(f"unknown checksum kind {kind!r} (known: {XXH3}, {HGC1})")
    if n < u8.size:
        raise ValueError(f"nbytes {n} is shorter than the {u8.size} bytes given")
    if n == u8.size:
        return tag(XXH3, xxhash.xxh3_64_intdigest(u8))
    return xxh3_of([(u8.ctypes.data, u8.size)], n)


def host_sums(pages: Sequence[Sequence[tuple[int, int]]], nbytes: int, hgc1: Sequence[bool] | None = None) -> list[int]:
    """Tagged checksums of host pages (their (address, length) segments): xxh3 unless `hgc1[j]`."""
    if hgc1 is None or not any(hgc1):
        return [xxh3_of(p, nbytes) for p in pages]
    out = [0] * len(pages)
    odd = [j for j in range(len(pages)) if hgc1[j]]
    for j, c in zip(odd, checksum.host_checksums([pages[j] for j in odd], nbytes)):
        out[j] = tag(HGC1, c)
    for j in range(len(pages)):
        if not hgc1[j]:
            out[j] = xxh3_of(pages[j], nbytes)
    return out


def device_sums(addrs: np.ndarray, lens: np.ndarray, nbytes: int, hgc1: np.ndarray | None,
                hgc1_fn: Callable[[np.ndarray, np.ndarray, int], Any]) -> np.ndarray:
    """Tagged checksums of device pages ((P, S) address and length arrays): hgc1 with `hgc1_fn`
    (the GPU kernel, `checksum.device_checksums`) where `hgc1` says (all, when None); xxh3 of the
    others after a copy to host memory."""
    p = addrs.shape[0]
    out = np.zeros(p, dtype=np.int64)
    odd = np.ones(p, dtype=bool) if hgc1 is None else np.asarray(hgc1, dtype=bool)
    if odd.any():
        sel = np.flatnonzero(odd)
        got = np.asarray(hgc1_fn(addrs[sel], lens[sel], nbytes), dtype=np.int64)
        out[sel] = got | np.int64(1)
    for j in np.flatnonzero(~odd).tolist():
        out[j] = _device_xxh3(addrs[j], lens[j], nbytes)
    return out


def _device_xxh3(addrs: np.ndarray, lens: np.ndarray, nbytes: int) -> int:
    """xxh3 of one device page: its segments copied to host memory, then hashed."""
    import torch
    if not torch.cuda.is_available():  # no device memory to copy: host memory standing in for it (tests)
        return xxh3_of(list(zip(addrs.tolist(), lens.tolist())), nbytes)
    dev = checksum.device_of(int(addrs[0]))
    h = xxhash.xxh3_64()
    total = 0
    for a, n in zip(addrs.tolist(), lens.tolist()):
        if n:
            h.update(checksum.tensor_at(int(a), int(n), dev).cpu().numpy())
            total += int(n)
    if nbytes > total:
        h.update(bytes(nbytes - total))
    return tag(XXH3, h.intdigest())
