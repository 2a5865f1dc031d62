"""The page checksum: one definition, computed on host bytes (numpy) and on CUDA bytes (Triton or torch).

A page written from GPU memory and read into host memory, or the reverse, verifies the same way,
so a slot mix-up or a torn page is a miss on every path. The definition (format 2, `NAME`):

* the page's bytes (its segments concatenated, then zero-padded to `nbytes` where the stored page
  is longer than its segments) are read as little-endian uint32 words, zero-padded to whole
  4 KiB blocks of 1024 words;
* per block b: ``s_b = sum_j x[b, j] * W[j] mod 2**64``, with ``W`` 1024 fixed odd 64-bit
  constants (splitmix64 from `SEED`);
* ``h = sum_b fmix64(s_b ^ (b * 0x9E3779B97F4A7C15)) mod 2**64`` (fmix64: MurmurHash3's finalizer);
* the checksum is ``fmix64(h ^ nbytes)`` as a signed 64-bit integer (SQLite's), 0 mapped to 1 (0
  means "not recorded").

Why this shape. A block sum is linear, so every 4 KiB block is independent (the GPU sums them all
in parallel, one program each, and a page in segments is summed where its bytes lie, without a
gather); the constants are odd and the words 32-bit, so any change confined to one word (a flipped
bit, a torn sector ending mid-word) always changes its block's sum, and a change spread over a
block collides with probability about 2**-32 (a multilinear hash over 32-bit words); fmix64 of
the sum mixed with the block number makes every block count and its position matter (swapped or
repeated blocks, a slot's stale tail), and the length closes it (a page and its zero-extended
copy differ). It detects corruption and mix-ups, not an adversary.

Cost: compiled with Numba (`_checksum_jit`) the block sums run at 20+ GB/s per core (numpy's einsum,
the fallback while it compiles or without Numba, about 4-6; xxh3 did about 40-60); `PageStore`
hashes on a thread pool, pipelined with the IO, so the disk stays the bound. On the GPU a Triton
kernel sums every block of a request's pages in one launch (the pure-torch version is the fallback
and the CPU reference); `benchmarks/bench_checksum.py` measures both against the IO.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Any, Sequence

import numpy as np

from . import _checksum_jit
from .memory import view

log = logging.getLogger("hicache_gds.checksum")

__all__ = ["NAME", "BLOCK", "WEIGHTS", "checksum", "host_checksum", "host_checksums", "host_engine",
           "torch_checksums", "device_checksums", "tensor_at",
           "to_sqlite", "triton_available", "warm_up"]

NAME = "hgc1"
"""The checksum's name, as recorded with a namespace (`ondisk`)."""
BLOCK = 4096
_WORDS = BLOCK // 4
SEED = 0x6869636163686531  # "hicache1"
_GOLDEN = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1
_C1, _C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53
# Blocks per numpy call (16 MiB of words). Speed is flat from 512 KiB up, and each call is a GIL
# hand-off, which a busy thread in the host process makes cost (`gil.shorten_switch_interval`).
_CHUNK = 4096
_LITTLE = sys.byteorder == "little"  # the compiled kernel reads native uint32 words


def _splitmix64(seed: int, n: int) -> list[int]:
    out, x = [], seed
    for _ in range(n):
        x = (x + _GOLDEN) & _M64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        out.append(z ^ (z >> 31))
    return out


WEIGHTS = np.array([w | 1 for w in _splitmix64(SEED, _WORDS)], dtype=np.uint64)
"""W: the 1024 odd per-word constants."""
WEIGHTS.setflags(write=False)


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * _C1) & _M64
    x ^= x >> 33
    x = (x * _C2) & _M64
    return x ^ (x >> 33)


def to_sqlite(c: int) -> int:
    """An unsigned 64-bit checksum as the nonzero signed integer SQLite stores."""
    return (c - (1 << 64) if c >= 1 << 63 else c) or 1


def _finish(h: int, nbytes: int) -> int:
    return to_sqlite(_fmix64((h ^ nbytes) & _M64))


# -- host (numpy) ----------------------------------------------------------------------------------

def _block_sums(u8: np.ndarray, compiled: bool = True) -> np.ndarray:
    """s_b of every 4 KiB block of a contiguous uint8 array (its tail zero-padded); `compiled`:
    with the Numba kernel where it is ready (False: numpy, for comparisons)."""
    n = int(u8.size)
    nfull = n // BLOCK
    out = np.empty(-(-n // BLOCK), dtype=np.uint64)
    if nfull:
        words = u8[:nfull * BLOCK].view("<u4").reshape(nfull, _WORDS)
        fast = _checksum_jit.kernel() if _LITTLE and compiled else None
        if fast is not None:  # compiled (Numba): ~5x numpy's rate, GIL released for the whole call
            fast(words, WEIGHTS, out[:nfull])
        else:
            # einsum widens the words as it goes (no uint64 copy of the page) and releases the GIL;
            # uint64 sums wrap: mod 2**64. In steps that stay in cache.
            for a in range(0, nfull, _CHUNK):
                z = min(a + _CHUNK, nfull)
                np.einsum("ij,j->i", words[a:z], WEIGHTS, out=out[a:z], dtype=np.uint64, casting="safe")
    if n % BLOCK:
        tail = np.zeros(BLOCK, dtype=np.uint8)
        tail[:n % BLOCK] = u8[nfull * BLOCK:]
        out[-1] = np.add.reduce(np.multiply(tail.view("<u4"), WEIGHTS, dtype=np.uint64))
    return out


def host_engine() -> str:
    """What sums host pages in this process: ``numba``, or ``numpy (why)``."""
    return _checksum_jit.engine()


def _np_fmix64(x: np.ndarray) -> np.ndarray:
    """fmix64 of a uint64 array, in place (numpy arrays wrap silently)."""
    x ^= x >> np.uint64(33)
    x *= np.uint64(_C1)
    x ^= x >> np.uint64(33)
    x *= np.uint64(_C2)
    x ^= x >> np.uint64(33)
    return x


def _fold(sums: np.ndarray) -> int:
    """h: the sum over blocks of fmix64(s_b ^ b * golden), mod 2**64."""
    x = _np_fmix64(sums ^ (np.arange(len(sums), dtype=np.uint64) * np.uint64(_GOLDEN)))
    return int(np.add.reduce(x, dtype=np.uint64)) if len(x) else 0


def _finish_all(sums: np.ndarray, nbytes: int) -> list[int]:
    """Checksums of pages from their (P, NB) block sums: the fold and the final mix of every page
    in a few array operations (per page they cost more than the block sums of a small page)."""
    x = _np_fmix64(sums ^ (np.arange(sums.shape[1], dtype=np.uint64) * np.uint64(_GOLDEN)))
    h = np.add.reduce(x, axis=1, dtype=np.uint64) ^ np.uint64(nbytes)
    c = _np_fmix64(h).view(np.int64)
    c[c == 0] = 1
    return c.tolist()


def checksum(data: Any, nbytes: int | None = None, *, compiled: bool = True) -> int:
    """The checksum of a bytes-like page (`nbytes`: the stored page's length, >= len(data); the
    rest is zeros). `compiled`: as `_block_sums` (False: numpy's sums, for comparisons)."""
    u8 = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    n = int(u8.size) if nbytes is None else nbytes
    if n < u8.size:
        raise ValueError(f"nbytes {n} is shorter than the {u8.size} bytes given")
    sums = _block_sums(u8, compiled)
    return _finish(_fold(_pad_blocks(sums, n)), n)


def _pad_blocks(sums: np.ndarray, nbytes: int) -> np.ndarray:
    nb = -(-nbytes // BLOCK)
    if nb > len(sums):  # whole zero blocks past the data: their sums are 0, but they count
        sums = np.concatenate([sums, np.zeros(nb - len(sums), dtype=np.uint64)])
    return sums


def host_checksum(segments: Sequence[tuple[int, int]], nbytes: int | None = None) -> int:
    """The checksum of a page in host memory given as (address, length) segments, in order."""
    segs = [(int(a), int(n)) for a, n in segments]
    n = sum(ln for _, ln in segs) if nbytes is None else nbytes
    return _finish(_fold(_host_block_sums(segs, n)), n)


def host_checksums(pages: Sequence[Sequence[tuple[int, int]]], nbytes: int) -> list[int]:
    """Checksums of several host pages of `nbytes` each (their segments, in order): the block sums
    of segments that lie end to end in memory in one numpy call (`_runs_block_sums`), else page by
    page; the rest for all of them at once."""
    if not pages:
        return []
    segs = [[(int(a), int(ln)) for a, ln in p] for p in pages]
    if all(ln % BLOCK == 0 for p in segs for _, ln in p) and all(sum(ln for _, ln in p) <= nbytes for p in segs):
        return _finish_all(_runs_block_sums(segs, nbytes), nbytes)
    sums = np.stack([_host_block_sums(p, nbytes) for p in segs])
    return _finish_all(sums, nbytes)


def _runs_block_sums(pages: list[list[tuple[int, int]]], nbytes: int) -> np.ndarray:
    """(P, NB) block sums of pages whose segments are whole blocks. A host pool keeps consecutive
    slots end to end (SGLang's ``page_first`` K halves, then V halves): such segments are summed
    as one array, so a batch costs a few numpy calls -- GIL hand-offs, which a busy thread in the
    host process makes expensive -- instead of one or more per page."""
    nb = -(-nbytes // BLOCK)
    out = np.zeros((len(pages), nb), dtype=np.uint64)
    flat = sorted((a, ln, p, sum(x for _, x in pages[p][:i]) // BLOCK)
                  for p in range(len(pages)) for i, (a, ln) in enumerate(pages[p]) if ln)
    i = 0
    while i < len(flat):
        j, end = i + 1, flat[i][0] + flat[i][1]
        while j < len(flat) and flat[j][0] == end:  # the next segment starts where this run ends
            end += flat[j][1]
            j += 1
        start = flat[i][0]
        sums = _block_sums(np.frombuffer(view(start, end - start), dtype=np.uint8))
        for a, ln, p, at in flat[i:j]:
            k = (a - start) // BLOCK
            out[p, at:at + ln // BLOCK] = sums[k:k + ln // BLOCK]
        i = j
    return out


def _host_block_sums(segs: list[tuple[int, int]], n: int) -> np.ndarray:
    """s_b of every block of a page of `n` bytes whose first bytes are `segs` (the rest zeros)."""
    total = sum(ln for _, ln in segs)
    if n < total:
        raise ValueError(f"nbytes {n} is shorter than the {total} bytes of the segments")
    if len(segs) == 1:
        sums = _block_sums(np.frombuffer(view(*segs[0]), dtype=np.uint8))
    elif all(ln % BLOCK == 0 for _, ln in segs[:-1]):  # blocks never straddle segments: sum in place
        sums = np.concatenate([_block_sums(np.frombuffer(view(a, ln), dtype=np.uint8)) for a, ln in segs if ln])
    else:  # small or odd segments (the store stages such pages, so rare here): one contiguous copy
        buf = np.empty(total, dtype=np.uint8)
        pos = 0
        for a, ln in segs:
            buf[pos:pos + ln] = np.frombuffer(view(a, ln), dtype=np.uint8)
            pos += ln
        sums = _block_sums(buf)
    return _pad_blocks(sums, n)


# -- torch (any device): the reference on tensors, and the GPU fallback ----------------------------------

def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_S_C1, _S_C2, _S_GOLDEN = _signed(_C1), _signed(_C2), _signed(_GOLDEN)
_weights_by_device: dict[Any, Any] = {}
_weights_lock = threading.Lock()


def _weights(device: Any) -> Any:
    import torch
    key = str(device)
    with _weights_lock:
        w = _weights_by_device.get(key)
        if w is None:
            w = torch.from_numpy(WEIGHTS.view(np.int64).copy()).to(device)
            _weights_by_device[key] = w
        return w


def _t_fmix64(x: Any) -> Any:
    """fmix64 on int64 tensors: products wrap; ``>>`` is arithmetic, so mask it to a logical shift."""
    lo31 = (1 << 31) - 1
    x = x ^ ((x >> 33) & lo31)
    x = x * _S_C1
    x = x ^ ((x >> 33) & lo31)
    x = x * _S_C2
    return x ^ ((x >> 33) & lo31)


def _t_finish(block_sums: Any, nbytes: int) -> Any:
    """(P, NB) int64 block sums -> (P,) int64 checksums (on their device)."""
    import torch
    nb = block_sums.shape[1]
    b = torch.arange(nb, dtype=torch.int64, device=block_sums.device) * _S_GOLDEN
    h = _t_fmix64(block_sums ^ b).sum(dim=1)
    c = _t_fmix64(h ^ nbytes)
    return torch.where(c == 0, torch.ones_like(c), c)


def torch_checksums(pages: Any, nbytes: int | None = None, *, max_bytes: int = 256 << 20) -> Any:
    """Checksums of the rows of a (P, L) uint8 tensor, on its device: an int64 tensor (P,).

    Pure torch (int64 products and sums wrap like uint64 ones), in steps of at most `max_bytes` of
    pages (the widened words take twice that)."""
    import torch
    if pages.dtype != torch.uint8 or pages.dim() != 2:
        raise ValueError(f"pages must be a (P, L) uint8 tensor, got {tuple(pages.shape)} {pages.dtype}")
    p, ln = pages.shape
    n = ln if nbytes is None else nbytes
    if n < ln:
        raise ValueError(f"nbytes {n} is shorter than the {ln} bytes of each page")
    nb = -(-n // BLOCK)
    w = _weights(pages.device)
    out = torch.empty(p, dtype=torch.int64, device=pages.device)
    step = max(1, max_bytes // max(nb * BLOCK, 1))
    for a in range(0, p, step):
        rows = pages[a:a + step]
        padded = torch.zeros((rows.shape[0], nb * BLOCK), dtype=torch.uint8, device=pages.device)
        padded[:, :ln] = rows
        words = padded.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        sums = (words.view(rows.shape[0], nb, _WORDS) * w).sum(dim=2)
        out[a:a + step] = _t_finish(sums, n)
    return out


# -- device pages (CUDA; host memory in tests) ---------------------------------------------------------

class _Cai:
    """A raw CUDA pointer as an object torch wraps without a copy (``__cuda_array_interface__``)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3,
                                         "strides": None}


def tensor_at(addr: int, nbytes: int, device: Any) -> Any:
    """A uint8 tensor over `nbytes` at `addr` on `device` (CUDA memory, or host memory for cpu)."""
    import torch
    if device.type == "cuda":
        return torch.as_tensor(_Cai(addr, nbytes), device=device)
    return torch.frombuffer(view(addr, nbytes), dtype=torch.uint8)


def device_of(addr: int) -> Any:
    """The CUDA device that holds `addr` (torch asks the driver; the current device if it cannot)."""
    import torch
    try:
        return torch.as_tensor(_Cai(addr, 1)).device
    except Exception:  # noqa: BLE001 -- e.g. memory the driver does not describe
        return torch.device("cuda", torch.cuda.current_device())


_triton_state: dict[str, Any] = {}
_triton_lock = threading.Lock()


def triton_available() -> bool:
    """Triton imports and can compile for this machine's GPU (or `TRITON_INTERPRET=1` runs it on the host)."""
    with _triton_lock:
        if "ok" not in _triton_state:
            try:
                from . import _checksum_triton  # noqa: F401
                _triton_state["ok"] = True
            except Exception as exc:  # noqa: BLE001 -- no triton, or one that cannot build here
                _triton_state["ok"] = False
                _triton_state["why"] = f"{type(exc).__name__}: {exc}"
        return bool(_triton_state["ok"])


def _segment_tables(addrs: np.ndarray, lens: np.ndarray, nbytes: int) -> tuple[np.ndarray, ...]:
    """Per block of every page (P pages of NB blocks, block-major within a page): the first and the
    end segment that overlap it; per segment its address, start in the page and length (int64)."""
    p, s = addrs.shape
    nb = -(-nbytes // BLOCK)
    lens64 = lens.astype(np.int64)
    ends = np.cumsum(lens64, axis=1)
    starts = ends - lens64
    edges = np.arange(nb + 1, dtype=np.int64) * BLOCK
    if p and (lens64 == lens64[0]).all():  # the usual batch: every page cut the same way
        lo = np.searchsorted(ends[0], edges[:-1], side="right")
        hi = np.searchsorted(starts[0], edges[1:], side="left")
        lo, hi = np.broadcast_to(lo, (p, nb)), np.broadcast_to(hi, (p, nb))
    else:
        lo = np.stack([np.searchsorted(ends[i], edges[:-1], side="right") for i in range(p)]) if p else \
            np.zeros((0, nb), np.int64)
        hi = np.stack([np.searchsorted(starts[i], edges[1:], side="left") for i in range(p)]) if p else \
            np.zeros((0, nb), np.int64)
    return (np.ascontiguousarray(lo, dtype=np.int32).ravel(), np.ascontiguousarray(hi, dtype=np.int32).ravel(),
            addrs.astype(np.uint64).view(np.int64).ravel(), starts.ravel(), lens64.ravel())


def _aligned4(addrs: np.ndarray, lens: np.ndarray) -> bool:
    """Every segment starts at a 4-byte aligned address and page offset, and is whole words long."""
    return not bool(((addrs % np.uint64(4)) | (lens % np.uint64(4))).any())


def device_checksums(addrs: np.ndarray, lens: np.ndarray, nbytes: int, *, device: Any = None, stream: Any = None,
                     impl: str = "auto") -> np.ndarray:
    """Checksums (int64 numpy array) of P pages of device memory given as (P, S) address and length
    arrays (uint64), each page `nbytes` long (>= its segments; the rest counts as zeros).

    The bytes are read on `stream` (default: this thread's own stream of the device, so nothing
    else is waited for), after the work already queued on it; the call returns once the result is
    on the host. `impl`: "triton" (every block of every page in one launch), "torch" (a gather per
    page, then `torch_checksums`), or "auto" (Triton where it runs, else torch). `device`: the
    pages' CUDA device (default: asked of the driver), or ``torch.device("cpu")`` for pages in
    host memory (tests, and Triton's interpreter)."""
    import torch
    addrs = np.asarray(addrs, dtype=np.uint64)
    lens = np.asarray(lens, dtype=np.uint64)
    p = addrs.shape[0]
    if p == 0:
        return np.zeros(0, dtype=np.int64)
    if int(lens.sum(axis=1).max()) > nbytes:
        raise ValueError(f"pages of {int(lens.sum(axis=1).max())} bytes exceed nbytes {nbytes}")
    dev = torch.device(device) if device is not None else device_of(int(addrs[0, 0]))
    auto = impl == "auto"
    if auto:
        impl = "triton" if triton_available() else "torch"
    ctx = (torch.cuda.stream(stream if stream is not None else _own_stream(dev)) if dev.type == "cuda"
           else contextlib.nullcontext())
    with ctx:
        if impl == "triton":
            try:
                out = _triton_checksums(addrs, lens, nbytes, dev)
            except Exception as exc:  # noqa: BLE001 -- a kernel that cannot build or run here: torch does it
                if not auto:
                    raise
                _disable_triton(exc)
                impl = "torch"
        if impl == "torch":
            rows = torch.empty((p, int(lens.sum(axis=1).max())), dtype=torch.uint8, device=dev)
            for i in range(p):
                pos = 0
                for a, ln in zip(addrs[i].tolist(), lens[i].tolist()):
                    if ln:
                        rows[i, pos:pos + ln] = tensor_at(a, ln, dev)
                        pos += ln
                if pos < rows.shape[1]:
                    rows[i, pos:] = 0
            out = torch_checksums(rows, nbytes)
        elif impl != "triton":
            raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
        return out.cpu().numpy()  # waits for the stream's work (a copy to pageable memory is synchronous)


def _triton_checksums(addrs: np.ndarray, lens: np.ndarray, nbytes: int, dev: Any) -> Any:
    import torch
    from ._checksum_triton import block_sums
    p = addrs.shape[0]
    lo, hi, sa, ss, sl = _segment_tables(addrs, lens, nbytes)
    t = [torch.from_numpy(x).to(dev) for x in (lo, hi, sa, ss, sl)]
    nb = -(-nbytes // BLOCK)
    sums = block_sums(*t, p, addrs.shape[1], nb, _weights(dev), _aligned4(addrs, lens))
    return _t_finish(sums.view(p, nb), nbytes)


def _disable_triton(exc: BaseException) -> None:
    with _triton_lock:
        if _triton_state.get("ok") is not False:
            log.warning("hicache-gds: the Triton checksum kernel cannot run here (%s: %s); checksumming device "
                        "pages with torch", type(exc).__name__, exc)
        _triton_state["ok"] = False
        _triton_state["why"] = f"{type(exc).__name__}: {exc}"


_tls = threading.local()


def _own_stream(device: Any) -> Any:
    """This thread's own CUDA stream on `device` (non-blocking: it waits for nothing it is not told to)."""
    import torch
    streams = getattr(_tls, "streams", None)
    if streams is None:
        streams = _tls.streams = {}
    s = streams.get(device.index)
    if s is None:
        s = streams[device.index] = torch.cuda.Stream(device)
    return s


def wait_for_current_stream(device: Any) -> None:
    """Block until the work queued so far on this thread's current stream of `device` is done
    (what wrote the pages a caller hands to `put`)."""
    import torch
    torch.cuda.current_stream(device).synchronize()


_warm: set[str] = set()


def warm_up(device: Any) -> None:
    """Compile the Triton kernel for `device` now (both variants), not in the first request; once
    per device and process."""
    import torch
    if str(device) in _warm or not triton_available():
        return
    buf = torch.randint(0, 256, (2 * BLOCK,), dtype=torch.uint8, device=device)
    a = np.array([[buf.data_ptr()]], dtype=np.uint64)
    try:
        for n in (BLOCK, BLOCK - 1):  # both variants, checked against the host's value once
            got = device_checksums(a, np.array([[n]], dtype=np.uint64), BLOCK, device=buf.device, impl="triton")
            if int(got[0]) != checksum(buf[:n].cpu().numpy(), BLOCK):
                raise RuntimeError("the kernel's checksum differs from the host's")
    except Exception as exc:  # noqa: BLE001 -- never fail a store's setup for it: torch computes the same
        _disable_triton(exc)
    _warm.add(str(device))
