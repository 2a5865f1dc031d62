"""SGLang host pools as PageStore pages: which pools we serve, and how a page's bytes are laid out.

A stored page is always the bytes of ``pool.get_data_page(i, flat=True)`` -- what SGLang's copy
path (and HiCacheFile) writes. The zero-copy path builds the same bytes from
``get_page_buffer_meta``'s segments, reordered where the two differ:

==========  ==================  =========================  ===========================  ===========
kind        layout              flat page                  meta segments per page       page order
==========  ==================  =========================  ===========================  ===========
MHA         layer_first         (2, L, P, H, D)            K_l0 V_l0 K_l1 V_l1 ... (2L)  layer_major
MHA         page_first          (2, P, L, H, D)            K V (2)                      token_major
MHA         page_first_direct   (2, 1, L, P, H, D)         K V (2)                      layer_major
MHA         page_head           (2, 1, H, P, L, D)         K V (2)                      head_major
MLA         layer_first         (L, P, 1, D)               l0 l1 ... (L)                layer_major
MLA         page_first          (P, L, 1, D)               one                          token_major
MLA         page_first_direct   (1, L, P, 1, D)            one                          layer_major
==========  ==================  =========================  ===========================  ===========

MHA layer_first is the one reorder (all K segments, then all V). The namespace identity carries
the page order, not the layout name, so ``layer_first`` and ``page_first_direct`` hosts share
pages.

A pool gets the zero-copy path only when this is *proven* at attach, from addresses alone: the
elements of ``get_data_page(i, flat=False)`` (a view of ``kv_buffer``), in flatten order, must
be exactly the bytes of the reordered meta segments, for the first pages; and its page methods
must all come from one class (a subclass overriding one of them is not trusted). Any other pool
with SGLang's flat-page API (``get_data_page`` / ``get_dummy_flat_data_page`` /
``set_from_flat_data_page``) is served through that API and a staging copy; a pool with neither
is refused with a message naming it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from hicache_gds import ConfigError, HostBuffer, Pages, align_up, view

__all__ = ["PoolGeometry", "describe_pool", "PoolBinding"]

log = logging.getLogger("hicache_gds_sglang")

_FLAT_API = ("get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page")
_PAGE_ORDER = {"layer_first": "layer_major", "page_first": "token_major", "page_first_direct": "layer_major",
               "page_head": "head_major"}
_STAGE_BYTES = 64 << 20  # copy-path chunk: bounds staging memory per call


@dataclass(frozen=True)
class PoolGeometry:
    """How one pool's pages look. `segments == 0` means the copy path (flat-page API)."""

    kind: str
    layout: str
    page_size: int
    page_bytes: int
    segments: int
    perm: tuple[int, ...] | None
    flat_dtype: torch.dtype
    identity: dict[str, Any] = field(default_factory=dict)

    @property
    def zero_copy(self) -> bool:
        return self.segments > 0


def _definer(cls: type, attr: str) -> type | None:
    return next((c for c in cls.__mro__ if attr in c.__dict__), None)


def _kind(pool: Any) -> str | None:
    """'mha' / 'mla' from the pool's geometry attributes, when its page methods come from one class."""
    cls = type(pool)
    owners = {_definer(cls, m) for m in ("get_page_buffer_meta", *_FLAT_API)}
    if len(owners) != 1 or None in owners:
        return None  # a subclass changed some page methods: their bytes may not agree any more
    if hasattr(pool, "kv_cache_dim"):
        return "mla"
    if hasattr(pool, "head_num") and hasattr(pool, "head_dim"):
        return "mha"
    return None


def _merge(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """(start, length) runs with adjacent ones joined: a canonical form of a byte address sequence."""
    ends = starts + lens
    cut = np.ones(len(starts), dtype=bool)
    cut[1:] = starts[1:] != ends[:-1]
    first = np.flatnonzero(cut)
    last = np.append(first[1:], len(starts)) - 1
    return np.stack([starts[first], ends[last] - starts[first]], axis=1)


def _view_runs(t: torch.Tensor) -> np.ndarray:
    """The bytes `t.flatten()` visits, in order, as merged (address, length) runs."""
    it, shape, stride = t.element_size(), list(t.shape), list(t.stride())
    run, k = it, t.dim()
    while k > 0 and (shape[k - 1] == 1 or stride[k - 1] * it == run):  # fold contiguous inner dims
        run *= shape[k - 1]
        k -= 1
    starts = np.full((1,) * max(k, 1), t.data_ptr(), dtype=np.int64)
    for d in range(k):
        view_shape = [1] * k
        view_shape[d] = shape[d]
        starts = starts + (np.arange(shape[d], dtype=np.int64) * (stride[d] * it)).reshape(view_shape)
    starts = starts.ravel()
    return _merge(starts, np.full(len(starts), run, dtype=np.int64))


def _same_bytes(pool: Any, page: int, perm: tuple[int, ...] | None) -> bool:
    """Proof, from addresses alone (no data read or written), that the flat page of `page` is
    its meta segments in `perm` order: what makes the copy and zero-copy paths byte-identical."""
    view_ = pool.get_data_page(page * pool.page_size, flat=False)
    if not isinstance(view_, torch.Tensor) or view_.numel() == 0:
        return False
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page * pool.page_size, (page + 1) * pool.page_size))
    order = list(perm) if perm is not None else list(range(len(ptrs)))
    segs = _merge(np.asarray([int(ptrs[i]) for i in order], dtype=np.int64),
                  np.asarray([int(sizes[i]) for i in order], dtype=np.int64))
    got = _view_runs(view_)
    return got.shape == segs.shape and bool(np.array_equal(got, segs))


def describe_pool(pool: Any, name: str) -> PoolGeometry:
    """Geometry of `pool`, or `ConfigError` saying why hicache-gds cannot serve it."""
    cls = type(pool).__name__
    layout = str(getattr(pool, "layout", "") or "")
    page_size = int(getattr(pool, "page_size", 1) or 1)
    missing = [m for m in _FLAT_API if not callable(getattr(pool, m, None))]
    if missing:
        raise ConfigError(f"hicache-gds cannot serve host pool {name!r} ({cls}, layout {layout or '?'}): it has "
                          f"no {', '.join(missing)}; use --hicache-storage-backend file for this model")
    kind = _kind(pool)
    kv = getattr(pool, "kv_buffer", None)
    if kind and layout in _PAGE_ORDER and isinstance(kv, torch.Tensor) and not kv.is_cuda \
            and not (kind == "mla" and layout == "page_head"):
        geo = _zero_copy_geometry(pool, kind, layout, page_size)
        pages = max(1, min(2, int(getattr(pool, "page_num", 2))))
        if geo is not None and all(_same_bytes(pool, p, geo.perm) for p in range(pages)):
            return geo
        log.warning("hicache-gds: %s (%s, %s): get_page_buffer_meta and get_data_page disagree on the page's "
                    "bytes; serving pool %r through the copy path", type(pool).__name__, kind, layout, name)
    if name == "kv" and not isinstance(kv, torch.Tensor):
        raise ConfigError(f"hicache-gds cannot serve the KV host pool {cls}: it has no materialized kv_buffer "
                          f"(logical pools such as DeepSeek-V4's are not supported yet)")
    dummy = pool.get_dummy_flat_data_page()
    nbytes = dummy.numel() * dummy.element_size()
    if nbytes <= 0:
        raise ConfigError(f"hicache-gds cannot serve host pool {name!r} ({cls}): its pages are empty")
    ident = {"kind": "flat", "class": cls, "page_order": f"flat:{layout}", "dtype": str(dummy.dtype),
             "page_size": page_size, "flat_numel": dummy.numel()}
    return PoolGeometry("flat", layout, page_size, nbytes, 0, None, dummy.dtype, ident)


def _zero_copy_geometry(pool: Any, kind: str, layout: str, page_size: int) -> PoolGeometry | None:
    """The segment geometry an MHA / MLA pool of `layout` must have; None when its meta differs."""
    L = int(pool.layer_num)
    itemsize = pool.dtype.itemsize
    if kind == "mha":
        token = int(pool.head_num) * int(pool.head_dim) * itemsize
        geo = {"head_num": int(pool.head_num), "head_dim": int(pool.head_dim)}
        segs, seg_bytes = (2 * L, page_size * token) if layout == "layer_first" else (2, L * page_size * token)
        perm = tuple(range(0, 2 * L, 2)) + tuple(range(1, 2 * L, 2)) if layout == "layer_first" else None
    else:
        token = int(pool.kv_cache_dim) * itemsize
        geo = {"kv_cache_dim": int(pool.kv_cache_dim)}
        segs, seg_bytes = (L, page_size * token) if layout == "layer_first" else (1, L * page_size * token)
        perm = None
    page_bytes = segs * seg_bytes
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
    dummy = pool.get_dummy_flat_data_page()
    got = dummy.numel() * dummy.element_size()
    if len(ptrs) != segs or any(int(s) != seg_bytes for s in sizes) or got != page_bytes:
        return None
    ident = {"kind": kind, "page_order": _PAGE_ORDER[layout], "dtype": str(pool.dtype), "layer_num": L,
             "page_size": page_size,
             **geo}
    return PoolGeometry(kind, layout, page_size, page_bytes, segs, perm, dummy.dtype, ident)


class PoolBinding:
    """One host pool bound to one page namespace (a `PageStore`, or the MLA reader).

    `put`/`get` take SGLang's ``host_indices`` (page *i* starts at ``host_indices[i*page_size]``);
    `put_tensors`/`get_tensors` take flat page tensors (SGLang's copy path). Results are per page.
    Exceptions propagate: the backend turns them into False and a log line.
    """

    def __init__(self, name: str, pool: Any, geometry: PoolGeometry, store: Any, scheme: Any) -> None:
        self.name = name
        self.pool = pool
        self.geo = geometry
        self.store = store
        self.scheme = scheme
        self.read_only = False  # set by the backend for MLA readers: writes are the writer rank's
        self._regions: list[tuple[int, int]] = []
        kv = getattr(pool, "kv_buffer", None)
        if isinstance(kv, torch.Tensor) and not kv.is_cuda and kv.numel():
            nbytes = kv.numel() * kv.element_size()
            store.register_memory(kv.data_ptr(), nbytes)  # once: zero-copy descriptors point into it
            self._regions.append((kv.data_ptr(), kv.data_ptr() + nbytes))
        self._perm = np.asarray(geometry.perm, dtype=np.int64) if geometry.perm else None
        self._slot = align_up(geometry.page_bytes)
        self._chunk = max(1, _STAGE_BYTES // self._slot)
        self._free: list[HostBuffer] = []
        self._lock = threading.Lock()

    # -- keys ------------------------------------------------------------------------------------
    def skeys(self, keys: Sequence[str]) -> list[str]:
        return self.scheme.keys(list(keys), self.name)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self.store.exists(self.skeys(keys))

    def prefix(self, keys: Sequence[str]) -> int:
        return self.store.prefix(self.skeys(keys))

    # -- host-pool slots -------------------------------------------------------------------------
    def check_indices(self, keys: Sequence[str], host_indices: Any) -> bool:
        return host_indices is not None and int(host_indices.numel()) == len(keys) * self.geo.page_size

    def _starts(self, host_indices: Any, n: int) -> list[int]:
        return host_indices.reshape(-1)[:: self.geo.page_size][:n].tolist()

    def pages(self, host_indices: Any) -> Pages:
        """Zero-copy pages for `host_indices`, segments in flat-page order."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        pages = Pages.from_segments(ptrs, sizes, self.geo.segments)
        if self._perm is not None:
            pages = Pages(pages.addrs[:, self._perm], pages.lens[:, self._perm], pages.kind)
        return pages

    def put(self, keys: Sequence[str], host_indices: Any) -> list[bool]:
        if self.geo.zero_copy:
            return self.store.put(self.skeys(keys), self.pages(host_indices))
        starts = self._starts(host_indices, len(keys))
        return self.put_tensors(keys, [self.pool.get_data_page(i, flat=True) for i in starts])

    def get(self, keys: Sequence[str], host_indices: Any) -> list[bool]:
        if self.geo.zero_copy:
            return self.store.get(self.skeys(keys), self.pages(host_indices))
        starts = self._starts(host_indices, len(keys))
        return self._get_staged(keys, None, starts)

    # -- flat page tensors (copy path) -------------------------------------------------------------
    def _inside(self, t: torch.Tensor) -> bool:
        a, n = t.data_ptr(), t.numel() * t.element_size()
        return t.is_contiguous() and any(lo <= a and a + n <= hi for lo, hi in self._regions)

    def _acquire(self) -> HostBuffer:
        with self._lock:
            if self._free:
                return self._free.pop()
        buf = HostBuffer(self._chunk * self._slot)
        self.store.register_memory(buf.addr, buf.nbytes)
        return buf

    def _release(self, buf: HostBuffer) -> None:
        with self._lock:
            self._free.append(buf)

    def _check_tensor(self, t: Any) -> bool:
        return (isinstance(t, torch.Tensor) and not t.is_cuda
                and t.numel() * t.element_size() == self.geo.page_bytes)

    def put_tensors(self, keys: Sequence[str], tensors: Sequence[Any]) -> list[bool]:
        """Write flat pages from tensors (any CPU memory); a tensor of the wrong size is a False."""
        out = [False] * len(keys)
        ok = [i for i, t in enumerate(tensors) if self._check_tensor(t)]
        for c in range(0, len(ok), self._chunk):
            idx = ok[c:c + self._chunk]
            buf = self._acquire()
            try:
                addrs = np.empty((len(idx), 1), dtype=np.uint64)
                for j, i in enumerate(idx):
                    t = tensors[i]
                    if self._inside(t):
                        addrs[j, 0] = t.data_ptr()
                    else:
                        addrs[j, 0] = buf.addr + j * self._slot
                        tc = t.contiguous()  # keep the copy alive through the memmove
                        ctypes.memmove(int(addrs[j, 0]), tc.data_ptr(), self.geo.page_bytes)
                lens = np.full_like(addrs, self.geo.page_bytes)
                res = self.store.put(self.skeys([keys[i] for i in idx]), Pages(addrs, lens))
            finally:
                self._release(buf)
            for i, r in zip(idx, res):
                out[i] = r
        return out

    def get_tensors(self, keys: Sequence[str], tensors: Sequence[Any]) -> list[bool]:
        """Read flat pages into tensors; a missing page or a wrong-size tensor is a False."""
        return self._get_staged(keys, tensors, None)

    def _get_staged(self, keys: Sequence[str], tensors: Sequence[Any] | None, starts: list[int] | None) -> list[bool]:
        out = [False] * len(keys)
        ok = list(range(len(keys))) if tensors is None else [i for i, t in enumerate(tensors) if self._check_tensor(t)]
        for c in range(0, len(ok), self._chunk):
            idx = ok[c:c + self._chunk]
            buf = self._acquire()
            try:
                addrs = np.empty((len(idx), 1), dtype=np.uint64)
                for j, i in enumerate(idx):
                    t = tensors[i] if tensors is not None else None
                    addrs[j, 0] = t.data_ptr() if t is not None and self._inside(t) else buf.addr + j * self._slot
                lens = np.full_like(addrs, self.geo.page_bytes)
                res = self.store.get(self.skeys([keys[i] for i in idx]), Pages(addrs, lens))
                for j, i in enumerate(idx):
                    if not res[j]:
                        continue
                    src = int(addrs[j, 0])
                    if tensors is None:
                        page = torch.frombuffer(view(src, self.geo.page_bytes), dtype=torch.uint8)
                        self.pool.set_from_flat_data_page(starts[i], page.view(self.geo.flat_dtype))
                    elif src != tensors[i].data_ptr():
                        self._copy_out(tensors[i], src)
                    out[i] = True
            finally:
                self._release(buf)
        return out

    def _copy_out(self, t: torch.Tensor, src: int) -> None:
        if t.is_contiguous():
            ctypes.memmove(t.data_ptr(), src, self.geo.page_bytes)
        else:
            src_t = torch.frombuffer(view(src, self.geo.page_bytes), dtype=torch.uint8).view(t.dtype)
            t.copy_(src_t.reshape(t.shape))

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        self.store.close()  # deregisters the staging buffers with the engine before they are unmapped
        for b in free:
            b.close()
