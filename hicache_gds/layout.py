"""Page regions and namespaces: pure functions, no IO (`namespace_location` resolves paths).

A batch of pages is `Pages`: P pages of S segments each, as (P, S) arrays of addresses and
lengths. A page's bytes on disk are its segments concatenated in order. SGLang's
`get_page_buffer_meta` output (flat pointer and size lists) and plain contiguous buffers both
convert here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import numpy as np

from .engines.base import MemKind
from .errors import RegionError
from .memory import align_up

if TYPE_CHECKING:
    from .config import Config

__all__ = ["NamespaceLocation", "Pages", "namespace_id", "namespace_location", "page_bytes_for", "NAMESPACE_RE"]

NAMESPACE_RE = re.compile(r"ns-[0-9a-f]{20}")
"""Directory names of namespaces (`namespace_id`)."""


@dataclass(frozen=True)
class Pages:
    """Where P pages live in memory: `addrs` and `lens` are uint64 arrays of shape (P, S)."""

    addrs: np.ndarray
    lens: np.ndarray
    kind: MemKind = MemKind.DRAM

    def __post_init__(self) -> None:
        if self.addrs.ndim != 2 or self.addrs.shape != self.lens.shape:
            raise RegionError(f"pages need (P, S) address and length arrays, got {self.addrs.shape} "
                              f"and {self.lens.shape}")

    def __len__(self) -> int:
        return int(self.addrs.shape[0])

    @property
    def page_nbytes(self) -> np.ndarray:
        return self.lens.sum(axis=1)

    def select(self, idx: Sequence[int] | np.ndarray) -> "Pages":
        idx = np.asarray(idx, dtype=np.int64)
        return Pages(self.addrs[idx], self.lens[idx], self.kind)

    @classmethod
    def contiguous(cls, base: int, page_bytes: int, indices: Sequence[int] | np.ndarray,
                   kind: MemKind = MemKind.DRAM) -> "Pages":
        """Page i is the `page_bytes` at `base + indices[i] * page_bytes`."""
        idx = np.asarray(indices, dtype=np.uint64).reshape(-1, 1)
        addrs = np.uint64(base) + idx * np.uint64(page_bytes)
        return cls(addrs, np.full_like(addrs, page_bytes), MemKind(kind))

    @classmethod
    def from_segments(cls, ptrs: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray,
                      segments_per_page: int, kind: MemKind = MemKind.DRAM) -> "Pages":
        """From flat per-segment lists in page order (SGLang's `get_page_buffer_meta`)."""
        p = np.asarray(ptrs, dtype=np.uint64)
        s = np.asarray(sizes, dtype=np.uint64)
        if s.size == 1 and p.size > 1:
            s = np.full_like(p, s.item())
        if p.size != s.size or segments_per_page <= 0 or p.size % segments_per_page:
            raise RegionError(f"{p.size} pointers and {s.size} sizes do not make whole pages of "
                              f"{segments_per_page} segments")
        return cls(p.reshape(-1, segments_per_page), s.reshape(-1, segments_per_page), MemKind(kind))

    @classmethod
    def from_tensors(cls, tensors: Sequence[Any]) -> "Pages":
        """One page per contiguous torch tensor (all on one device kind)."""
        if not tensors:
            return cls(np.empty((0, 1), np.uint64), np.empty((0, 1), np.uint64))
        kinds = {MemKind.VRAM if t.is_cuda else MemKind.DRAM for t in tensors}
        if len(kinds) != 1:
            raise RegionError("pages in one batch must all be host or all be device memory")
        for t in tensors:
            if not t.is_contiguous():
                raise RegionError("page tensors must be contiguous")
        addrs = np.array([[t.data_ptr()] for t in tensors], dtype=np.uint64)
        lens = np.array([[t.numel() * t.element_size()] for t in tensors], dtype=np.uint64)
        return cls(addrs, lens, kinds.pop())


def page_bytes_for(kind: str, layer_num: int, page_size: int, itemsize: int, *, head_num: int = 0,
                   head_dim: int = 0, kv_cache_dim: int = 0) -> int:
    """Bytes of one KV page: MHA stores K and V, MLA one latent vector per token and layer."""
    if kind == "mha":
        return 2 * layer_num * page_size * head_num * head_dim * itemsize
    if kind == "mla":
        return layer_num * page_size * kv_cache_dim * itemsize
    raise ValueError(f"kind must be 'mha' or 'mla', got {kind!r}")


def namespace_id(identity: Mapping[str, Any]) -> str:
    """A stable directory name for everything that makes stored bytes meaningful.

    Model, dtype, host layout, page geometry, rank and tenant all go in: two namespaces never
    share slots, so a layout change can never serve bytes in the wrong order.
    """
    canon = json.dumps({str(k): str(v) for k, v in identity.items()}, sort_keys=True, separators=(",", ":"))
    return "ns-" + hashlib.blake2b(canon.encode(), digest_size=10).hexdigest()


class NamespaceLocation(NamedTuple):
    """Where one namespace lives; see `namespace_location`."""

    identity: dict[str, str]
    """The caller's identity plus page size, tenant and directory count: what the name hashes."""
    namespace: str
    dirs: list[str]
    """One directory per `GDS_PATH` entry (real paths); the index lives in the first."""
    slot_bytes: int
    """`page_bytes` rounded up to 4 KiB: the stride of slots in the slab files."""


def namespace_location(page_bytes: int, identity: Mapping[str, Any] | None, config: Config) -> NamespaceLocation:
    """The namespace `PageStore(page_bytes, identity, config=config)` opens, computed without creating
    or checking anything -- the one rule writers (`PageStore`) and readers (`PageReader`) share."""
    roots = [os.path.realpath(p) for p in config.gds_path]
    ident = {str(k): str(v) for k, v in (identity or {}).items()}
    ident.update(page_bytes=str(page_bytes), tenant=config.namespace, ndirs=str(len(roots)))
    name = namespace_id(ident)
    return NamespaceLocation(ident, name, [os.path.join(r, name) for r in roots], align_up(page_bytes))
