"""Pages of a layer-first device KV pool: IO planning, and gather / scatter through GPU staging.

SGLang's device pools keep one buffer per layer (MHA: ``k_buffer[l]``, ``v_buffer[l]`` of shape
``(rows, H, D)``; MLA: ``kv_buffer[l]`` of ``(rows, 1, kv_cache_dim)``), a row per token. A page of
``P`` tokens starting at row ``r`` is therefore one *segment* per buffer -- rows ``[r, r+P)``,
contiguous -- and its stored bytes are the segments concatenated in buffer order
(``SegmentTable``): MHA ``K_l0 .. K_lL-1, V_l0 .. V_lL-1``; MLA ``l0 .. lL-1``. That is the byte
order of the HiCache host pool's flat ``layer_first`` page, so both write the same page format.

A segment is small (Llama-3-8B, 16-token pages: 32 KiB), and O_DIRECT / cuFile need 4 KiB-aligned
offsets and lengths. `plan_io` therefore picks per pool geometry:

* ``direct`` -- every segment is at least `GATHER_BELOW` bytes and aligned: IO goes straight
  between device segments and the file, one descriptor per segment, one layer at a time;
* ``gather`` -- otherwise: pages move whole (writes) or in *layer groups* (reads: the fewest
  consecutive layers whose file ranges reach `GATHER_BELOW`) through a contiguous staging buffer;
  `gather_pages` / `scatter_pages` copy between the pool and that buffer with one Triton kernel
  launch (a pure-torch reference runs on CPU and is the tests' oracle).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from hicache_gds import ConfigError

__all__ = ["GATHER_BELOW", "READ_RUN", "MIN_GROUPS", "ALIGN", "SegmentTable", "LayerGroup", "IOPlan", "DevicePages", "page_layout_identity",
           "plan_io", "gather_pages", "scatter_pages", "triton_available", "choose_impl"]

log = logging.getLogger("hicache_gds_sglang.gather")
ALIGN = 4096
# Segments smaller than this are gathered. Where it comes from: on the H200 machine (FACTS.md;
# gpu-h200-core-vram.md in benchmarks/results/components/raw.tar.xz) NIXL GDS in cuFile compat
# mode kept up with the disk for 256 KiB .. 8 MiB descriptors and cuFile's compat bounce pool
# holds 64 buffers of up to 1 MiB, so descriptors below ~256 KiB cost per-IO overhead and
# bounce-pool slots without adding bandwidth. benchmarks/bench_linker.py --gather-below
# measures the crossover on a machine; override per deployment with the linker's "gather_below" key.
GATHER_BELOW = 256 << 10
# Read groups may grow towards runs of READ_RUN bytes while MIN_GROUPS groups remain (the linker's
# "read_run" key). Larger runs use more of each cuFile compat bounce buffer (1 MiB slabs for
# 4 KiB < n <= 1 MiB), but on the H100 VM (gpu-h100-linker-sweep.md in
# benchmarks/results/components/raw.tar.xz) 1 MiB runs measured no better than 256 KiB ones,
# so the default keeps the finest groups that reach GATHER_BELOW.
READ_RUN = GATHER_BELOW
MIN_GROUPS = 4


def _align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class SegmentTable:
    """Geometry of one page: segment ``s`` is ``row_bytes[s] * page_size`` bytes of buffer ``s``.

    ``layers[l]`` lists the segments holding layer ``l`` (MHA: ``(l, L + l)``; MLA: ``(l,)``).
    """

    row_bytes: tuple[int, ...]
    page_size: int
    layers: tuple[tuple[int, ...], ...]

    @property
    def seg_bytes(self) -> tuple[int, ...]:
        return tuple(r * self.page_size for r in self.row_bytes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each segment inside the stored page."""
        out, pos = [], 0
        for n in self.seg_bytes:
            out.append(pos)
            pos += n
        return tuple(out)

    @property
    def page_bytes(self) -> int:
        return sum(self.seg_bytes)


@dataclass(frozen=True)
class LayerGroup:
    """Layers that land together on a read, and the page byte ranges that carry them.

    ``runs`` are ``(page offset, io bytes)``, each aligned for O_DIRECT (a run that ends the page
    may read into the slot's padding). In staging a page's runs sit back to back
    (``stage_bytes`` per page) and segment ``segments[j]`` starts at ``stage_offsets[j]``.
    """

    layers: tuple[int, ...]
    segments: tuple[int, ...]
    runs: tuple[tuple[int, int], ...]
    stage_offsets: tuple[int, ...]

    @property
    def stage_bytes(self) -> int:
        return sum(n for _, n in self.runs)


@dataclass(frozen=True)
class IOPlan:
    mode: str  # "direct" or "gather"
    groups: tuple[LayerGroup, ...]
    reason: str


def _group(table: SegmentTable, layers: Sequence[int], align: int, merge: bool) -> LayerGroup | None:
    """The group of `layers`, or None when one of its ranges cannot be aligned."""
    offs, sizes, page = table.offsets, table.seg_bytes, table.page_bytes
    segs = sorted({s for ly in layers for s in table.layers[ly]}, key=lambda s: offs[s])
    spans: list[list[int]] = []  # [start, end] in page bytes
    for s in segs:
        if merge and spans and spans[-1][1] == offs[s]:
            spans[-1][1] += sizes[s]
        else:
            spans.append([offs[s], offs[s] + sizes[s]])
    runs, stage_of, pos = [], {}, 0
    for start, end in spans:
        io = _align_up(end - start, align) if end == page else end - start
        if start % align or io % align:
            return None
        runs.append((start, io))
        for s in segs:
            if start <= offs[s] < end:
                stage_of[s] = pos + offs[s] - start
        pos += io
    return LayerGroup(tuple(layers), tuple(segs), tuple(runs), tuple(stage_of[s] for s in segs))


def plan_io(table: SegmentTable, base_addrs: Sequence[int], *, gather_below: int = GATHER_BELOW,
            align: int = ALIGN, max_descs: int = 1 << 16, read_run: int = READ_RUN,
            min_groups: int = MIN_GROUPS) -> IOPlan:
    """Direct per-segment IO, or gather through staging in layer groups sized for the engine.

    `base_addrs` are the buffers' first-row addresses (direct IO needs them aligned too);
    `max_descs` is the engine's descriptor limit per request (a direct write puts a whole page,
    all its segments, in one request). Read groups are the fewest layers whose file runs reach
    `gather_below`, grown towards runs of `read_run` bytes while at least `min_groups` groups
    remain (layer-wise loading keeps something to overlap).
    """
    nl = len(table.layers)
    sizes = table.seg_bytes
    small = min(sizes) < gather_below
    misaligned = any(n % align for n in sizes) or any(o % align for o in table.offsets) or \
        any(int(a) % align for a in base_addrs)
    if not small and not misaligned and len(sizes) <= max_descs:
        groups = tuple(_group(table, [ly], align, merge=False) for ly in range(nl))
        if all(g is not None for g in groups):
            why = f"segments of {min(sizes)} B >= {gather_below} B, aligned"
            return IOPlan("direct", groups, why)  # type: ignore[arg-type]
    why = (f"segments of {min(sizes)} B < {gather_below} B" if small else
           f"segments or buffers not {align}-byte aligned" if misaligned else
           f"{len(sizes)} segments per page exceed the engine's {max_descs} descriptors per request")

    def grouped(size: int) -> tuple[list[LayerGroup], int] | None:
        groups = [_group(table, range(a, min(a + size, nl)), align, merge=True) for a in range(0, nl, size)]
        if any(g is None for g in groups):
            return None
        full = groups[:-1] if len(groups) > 1 and nl % size else groups  # a short last group may be smaller
        return groups, min(n for g in full for _, n in g.runs)  # type: ignore[union-attr]

    best: tuple[int, list[LayerGroup]] | None = None
    cap = nl
    for size in range(1, nl + 1):
        if size > cap:
            break
        got = grouped(size)
        if got is None:
            continue
        groups, shortest = got
        if best is None:
            if size < nl and shortest < gather_below:
                continue
            cap = max(size, nl // max(min_groups, 1))  # the smallest groups that work, grown up to here
        best = size, groups
        if shortest >= read_run:
            break
    if best is not None:
        return IOPlan("gather", tuple(best[1]), f"{why}; reads in groups of {best[0]} layer(s)")
    whole = LayerGroup(tuple(range(nl)), tuple(range(len(sizes))), ((0, _align_up(table.page_bytes, align)),),
                       table.offsets)
    return IOPlan("gather", (whole,), f"{why}; reads whole slots (layer ranges cannot be aligned)")


# -- the device pool ---------------------------------------------------------------------------


def page_layout_identity(kind: str, *, dtype: Any, layer_num: int, page_size: int, head_num: int = 0,
                         head_dim: int = 0, v_head_dim: int | None = None, kv_cache_dim: int = 0) -> dict[str, Any]:
    """Geometry half of a KV namespace identity for pages in ``layer_major`` byte order.

    Equal, key for key, to ``pools.describe_pool(host_pool).identity`` of HiCacheGDS for a host
    pool of the same model in ``layer_first`` or ``page_first_direct`` layout; with the same
    `naming.namespace_identity` around it, the linker and the backend open the same namespace.
    """
    ident: dict[str, Any] = {"kind": kind, "page_order": "layer_major", "dtype": str(dtype), "layer_num": layer_num,
                             "page_size": page_size}
    if kind == "mha":
        ident.update(head_num=head_num, head_dim=head_dim)
        if v_head_dim not in (None, head_dim):
            ident["v_head_dim"] = v_head_dim  # the host side serves no such pool zero-copy: never shared
    else:
        ident["kv_cache_dim"] = kv_cache_dim
    return ident


class DevicePages:
    """A plain MHA / MLA device KV pool as page segments over its per-layer buffers."""

    def __init__(self, pool: Any, page_size: int) -> None:
        cls = type(pool).__name__
        if getattr(pool, "k_buffer", None) is not None and getattr(pool, "v_buffer", None) is not None:
            refuse = [n for n in ("k_scale_buffer", "native_k_scale_buffer") if getattr(pool, n, None) is not None]
            if refuse or getattr(pool, "is_quantized_kv_cache", False):
                raise ConfigError(f"GDSLinker: {cls} is a scaled (quantized) KV cache; not supported yet")
            if getattr(pool, "kv_cache_layout", "nhd") != "nhd":
                raise ConfigError(f"GDSLinker: {cls} uses the {pool.kv_cache_layout!r} KV layout; "
                                  "only NHD is supported")
            self.kind, nl = "mha", len(pool.k_buffer)
            self.buffers = [*pool.k_buffer, *pool.v_buffer]
            layers = tuple((ly, nl + ly) for ly in range(nl))
        elif getattr(pool, "kv_buffer", None) is not None and hasattr(pool, "kv_cache_dim"):
            if getattr(pool, "use_dsa", False) or getattr(pool, "kv_scale_buffer", None) is not None:
                raise ConfigError(f"GDSLinker: {cls} carries DSA indexer or scale buffers; not supported yet")
            self.kind, nl = "mla", len(pool.kv_buffer)
            self.buffers = list(pool.kv_buffer)
            layers = tuple((ly,) for ly in range(nl))
        else:
            raise ConfigError(f"GDSLinker serves plain MHA and MLA device pools; {cls} is neither")
        b0 = self.buffers[0]
        self.device = b0.device
        for b in self.buffers:
            if b.device != self.device or not b.is_contiguous() or b.shape[0] < page_size:
                raise ConfigError(f"GDSLinker: {cls} buffers must be contiguous, on one device, a row per token")
        self.rows = min(b.shape[0] for b in self.buffers)
        self.num_layers = nl
        self.page_size = page_size
        rb = tuple(b[0].numel() * b.element_size() for b in self.buffers)
        self.table = SegmentTable(rb, page_size, layers)
        self.bases = [b.data_ptr() for b in self.buffers]
        dtype = getattr(pool, "store_dtype", b0.dtype)
        if self.kind == "mha":
            head_dim = int(pool.head_dim)
            self.geometry = page_layout_identity("mha", dtype=dtype, layer_num=nl, page_size=page_size,
                                                 head_num=rb[0] // (head_dim * b0.element_size()), head_dim=head_dim,
                                                 v_head_dim=int(getattr(pool, "v_head_dim", head_dim)))
        else:
            self.geometry = page_layout_identity("mla", dtype=dtype, layer_num=nl, page_size=page_size,
                                                 kv_cache_dim=int(pool.kv_cache_dim))

    def starts(self, indices: torch.Tensor) -> torch.Tensor:
        """First token row of each page (CPU int64); pages must be aligned, contiguous, in range."""
        t = indices.detach().to("cpu", torch.int64).reshape(-1)
        p = self.page_size
        if t.numel() % p:
            raise ValueError(f"{t.numel()} device indices are not whole pages of {p}")
        pages = t.view(-1, p)
        s = pages[:, 0]
        if s.numel() and (bool((s % p).any()) or not torch.equal(pages, s[:, None] + torch.arange(p))
                          or int(s.min()) < 0 or int(s.max()) + p > self.rows):
            raise ValueError("device pages must be page-aligned, contiguous token ranges inside the pool")
        return s

    def seg_addrs(self, starts: torch.Tensor, segments: tuple[int, ...]) -> np.ndarray:
        """(pages, len(segments)) device addresses of those segments."""
        s = starts.numpy().astype(np.uint64).reshape(-1, 1)
        rb = np.array([self.table.row_bytes[j] for j in segments], dtype=np.uint64)
        return np.array([self.bases[j] for j in segments], dtype=np.uint64) + s * rb


# -- copies ------------------------------------------------------------------------------------


def _rows_u8(t: torch.Tensor) -> torch.Tensor:
    """`t` as (rows, row_bytes) uint8, without copying (rows must be contiguous)."""
    if not t.is_contiguous():
        raise ValueError(f"pool buffer of shape {tuple(t.shape)} is not contiguous")
    return t.reshape(t.shape[0], -1).view(torch.uint8)


def _check(buffers: Sequence[torch.Tensor], starts: torch.Tensor, stage: torch.Tensor,
           offsets: Sequence[int], segments: Sequence[int], page_size: int) -> None:
    if stage.dtype != torch.uint8 or stage.dim() != 2 or not stage.is_contiguous():
        raise ValueError("staging must be a contiguous 2-D uint8 tensor (pages x bytes)")
    if len(offsets) != len(segments) or stage.shape[0] < starts.numel():
        raise ValueError(f"{len(segments)} segments, {len(offsets)} offsets, {starts.numel()} pages, "
                         f"staging of {stage.shape[0]} rows")
    for s, off in zip(segments, offsets):
        row = buffers[s][0].numel() * buffers[s].element_size()
        if off < 0 or off + row * page_size > stage.shape[1]:
            raise ValueError(f"segment {s} at staging offset {off} overruns a {stage.shape[1]}-byte row")


def _reference(buffers: Sequence[torch.Tensor], starts: torch.Tensor, page_size: int, stage: torch.Tensor,
               offsets: Sequence[int], segments: Sequence[int], to_stage: bool) -> None:
    n = starts.numel()
    if n == 0:
        return
    dev = buffers[0].device
    rows = (starts.to(dev, torch.int64).view(-1, 1) + torch.arange(page_size, device=dev)).view(-1)
    for s, off in zip(segments, offsets):
        b = _rows_u8(buffers[s])
        nb = b.shape[1] * page_size
        if to_stage:
            stage[:n, off:off + nb] = b.index_select(0, rows).view(n, nb)
        else:
            b.index_copy_(0, rows, stage[:n, off:off + nb].reshape(n * page_size, b.shape[1]))


_kernel: Any = None


def triton_available() -> bool:
    """Triton imports (CUDA kernels need a GPU; TRITON_INTERPRET=1 runs them on CPU)."""
    try:
        import triton  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 -- a broken triton install is "unavailable"
        return False


def _get_kernel() -> Any:
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def copy_segments(bases, row_units, starts, stage_base, stage_stride, stage_offs, nseg, page_size,
                      TO_STAGE: tl.constexpr, UNIT: tl.constexpr, BLOCK: tl.constexpr):
        # program (page i, segment j) x block b copies BLOCK units of that segment.
        pid = tl.program_id(0)
        i = pid // nseg
        j = pid % nseg
        ru = tl.load(row_units + j).to(tl.int64)
        pool_addr = tl.load(bases + j).to(tl.int64) + tl.load(starts + i).to(tl.int64) * ru * UNIT
        stage_addr = stage_base + i.to(tl.int64) * stage_stride + tl.load(stage_offs + j).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < ru * page_size
        if UNIT == 8:
            p = pool_addr.to(tl.pointer_type(tl.int64))
            q = stage_addr.to(tl.pointer_type(tl.int64))
        elif UNIT == 4:
            p = pool_addr.to(tl.pointer_type(tl.int32))
            q = stage_addr.to(tl.pointer_type(tl.int32))
        elif UNIT == 2:
            p = pool_addr.to(tl.pointer_type(tl.int16))
            q = stage_addr.to(tl.pointer_type(tl.int16))
        else:
            p = pool_addr.to(tl.pointer_type(tl.int8))
            q = stage_addr.to(tl.pointer_type(tl.int8))
        if TO_STAGE:
            tl.store(q + offs, tl.load(p + offs, mask=mask), mask=mask)
        else:
            tl.store(p + offs, tl.load(q + offs, mask=mask), mask=mask)

    _kernel = copy_segments
    return _kernel


def _triton(buffers: Sequence[torch.Tensor], starts: torch.Tensor, page_size: int, stage: torch.Tensor,
            offsets: Sequence[int], segments: Sequence[int], to_stage: bool) -> None:
    n = starts.numel()
    if n == 0 or not segments:
        return
    dev = stage.device
    rb = [_rows_u8(buffers[s]).shape[1] for s in segments]
    bases = [buffers[s].data_ptr() for s in segments]
    unit = 8
    for v in (*rb, *bases, *offsets, stage.data_ptr(), stage.stride(0)):
        unit = math.gcd(unit, int(v))
    block = 1024
    k = _get_kernel()
    grid = (n * len(segments), max(1, math.ceil(max(rb) * page_size / unit / block)))
    as_t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)  # noqa: E731
    k[grid](as_t(bases), as_t([r // unit for r in rb]), starts.to(dev, torch.int64).contiguous(),
            stage.data_ptr(), stage.stride(0), as_t(list(offsets)), len(segments), page_size,
            TO_STAGE=to_stage, UNIT=unit, BLOCK=block)


def _run(to_stage: bool, buffers: Sequence[torch.Tensor], starts: torch.Tensor, page_size: int,
         stage: torch.Tensor, offsets: Sequence[int], segments: Sequence[int] | None, impl: str) -> None:
    segments = list(range(len(buffers))) if segments is None else list(segments)
    _check(buffers, starts, stage, offsets, segments, page_size)
    if impl == "auto":
        impl = "triton" if stage.is_cuda and triton_available() else "torch"
    if impl == "triton":
        _triton(buffers, starts, page_size, stage, offsets, segments, to_stage)
    elif impl == "torch":
        _reference(buffers, starts, page_size, stage, offsets, segments, to_stage)
    else:
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")


def gather_pages(buffers: Sequence[torch.Tensor], starts: torch.Tensor, page_size: int, dst: torch.Tensor,
                 dst_offsets: Sequence[int], segments: Sequence[int] | None = None, *, impl: str = "auto") -> None:
    """Copy pages out of the pool: ``dst[i, dst_offsets[j]:][:seg]`` = segment ``segments[j]`` of page i.

    Page i is rows ``[starts[i], starts[i] + page_size)`` of every buffer (``starts``: first token
    row per page). ``dst`` is a contiguous ``(pages, row_bytes)`` uint8 tensor on the pool's device.
    Runs on the current stream; ``impl`` is ``auto`` (Triton on CUDA, torch elsewhere), ``triton``
    or ``torch`` (the reference).
    """
    _run(True, buffers, starts, page_size, dst, dst_offsets, segments, impl)


def scatter_pages(buffers: Sequence[torch.Tensor], starts: torch.Tensor, page_size: int, src: torch.Tensor,
                  src_offsets: Sequence[int], segments: Sequence[int] | None = None, *, impl: str = "auto") -> None:
    """The inverse of `gather_pages`: copy staged segments back into the pool's rows."""
    _run(False, buffers, starts, page_size, src, src_offsets, segments, impl)


def choose_impl(buffers: Sequence[torch.Tensor], page_size: int,
                shapes: Sequence[tuple[int, Sequence[int], Sequence[int] | None]]) -> str:
    """"triton" if the kernel compiles and agrees with the reference, else "torch" (with a warning).

    Run once at start: it compiles the kernel for each ``(row width, offsets, segments)`` a caller
    will use, gathering page 0 -- SGLang's padding page, which only absorbs dummy writes -- and
    scattering the same bytes back.
    """
    zero = torch.zeros(1, dtype=torch.int64)
    try:
        for width, offsets, segments in shapes:
            want = torch.zeros((1, width), dtype=torch.uint8, device=buffers[0].device)
            got = want.clone()
            gather_pages(buffers, zero, page_size, want, offsets, segments, impl="torch")
            gather_pages(buffers, zero, page_size, got, offsets, segments, impl="triton")
            scatter_pages(buffers, zero, page_size, got, offsets, segments, impl="triton")
            if got.is_cuda:
                torch.cuda.synchronize(got.device)
            if not torch.equal(want, got):
                raise RuntimeError("the Triton gather differs from the torch reference")
        return "triton"
    except Exception as exc:  # noqa: BLE001 -- any Triton problem: torch ops are correct, just slower
        log.warning("hicache-gds: Triton page copies unavailable (%s: %s); using torch ops", type(exc).__name__, exc)
        return "torch"
