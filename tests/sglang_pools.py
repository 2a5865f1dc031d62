"""CPU mimics of SGLang's HiCache host KV pools (0.5.23, and 0.5.17 alike), for tests without CUDA.

SGLang's real host pools (``MHATokenToKVPoolHost`` in ``sglang/srt/mem_cache/pool_host/mha.py``
and ``MLATokenToKVPoolHost`` in ``.../pool_host/mla.py``) import CUDA/JIT kernels at module import
and take device buffer descriptors in their constructors, so they cannot be built on a CPU-only
machine. The classes here copy, in plain Python/torch, exactly the parts that a HiCache storage
backend (HiCacheFile, HiCacheNixl, ours) and the controller's storage paths touch: the
``kv_buffer`` geometry and every accessor on it. Formulas and branch structure are copied from
the 0.5.23 wheel; line numbers below refer to that wheel (``pip download --no-deps
sglang==0.5.23``, unzip, paths relative to ``sglang/srt/mem_cache/``).

What each piece mirrors:

``_HostPoolBase``  (``pool_host/base.py``)
  * class attributes ``dcp_size``/``dcp_rank``/``shared_allocation_domain``/
    ``stores_page_envelope``/``storage_format_tag`` — base.py:162-169
  * sizing: ``page_num = size // page_size + 1`` (one padding page), ``size = page_num *
    page_size`` — base.py:220-229 (the ``host_size``/ratio branch). ``make_host_pool(num_pages=N)``
    asks for ``N * page_size`` tokens, so ``page_num == N + 1`` as in the real pool.
  * ``clear``/``available_size``/``alloc``/``free``/``logical_size``/``logical_page_size`` —
    base.py:502-577 (slot allocator the controller uses)
  * ``get_page_buffer_element_size`` — base.py:418-427
  * ``is_stride_page_aligned`` default (False) — base.py:489-500
  * allocation: ``alloc_mmap`` = anonymous ``MAP_SHARED`` mmap, pre-faulted
    (``MADV_POPULATE_WRITE`` or ``MAP_POPULATE``), wrapped by ``torch.frombuffer`` —
    ``storage/mmap/mmap_allocator.py:82-98, 163-232`` via ``HostTensorAllocator.allocate``
    (``pool_host/common.py:26-37``). The real pool then ``cudaHostRegister``s it
    (``alloc_with_host_register``, common.py:330-350); here ``pin_memory`` is False (the CPU torch
    refuses pinning), which also makes ``get_dummy_flat_data_page`` allocate ordinary memory.

``MHAHostPoolMimic``  (``MHATokenToKVPoolHost``, ``pool_host/mha.py``)
  * attributes ``target_layer_num``/``dtype``/``head_dim``/``v_head_dim``/``head_num``/
    ``layer_num`` — mha.py:203-212; ``element_dim`` — mha.py:242
  * ``get_size_per_token`` — mha.py:290-296; ``get_ksize_per_token`` — mha.py:302-303
  * ``get_hybrid_pool_buffer`` — mha.py:298-300; ``k_buffer``/``v_buffer`` — mha.py:392-398
  * ``init_kv_buffer`` dims, ``token_stride_size``, ``layout_dim`` — mha.py:305-360
    (``page_unified`` is not mirrored)
  * ``k_data_refs``/``v_data_refs`` (per-layer views) — mha.py:264-280
  * ``get_data_page`` — mha.py:713-725; ``get_dummy_flat_data_page`` — mha.py:727-733;
    ``set_from_flat_data_page`` — mha.py:735-767
  * ``get_split_heads_page_buffer_meta`` (``page_head`` only) — mha.py:769-815
  * ``get_page_buffer_meta`` — mha.py:817-877
  * ``is_stride_page_aligned`` — mha.py:879-902
  Only the symmetric pool (``head_dim == v_head_dim``) is mirrored: that is the class
  ``get_mha_host_pool_cls`` (mha.py:1684) picks for every model without MXFP8 scales or
  asymmetric heads; the ``kv_buffer`` dims use ``head_dim`` for V too, as the real code does.

``MLAHostPoolMimic``  (``MLATokenToKVPoolHost``, ``pool_host/mla.py``)
  * attributes ``kv_lora_rank``/``qk_rope_head_dim``/``kv_cache_dim``/``layer_num`` —
    mla.py:128-142; ``_size_per_token = kv_cache_dim * itemsize * layer_num`` — mla.py:192-194
  * ``get_contiguous_buf_infos`` — mla.py:286-299; ``get_size_per_token``/
    ``get_ksize_per_token`` — mla.py:301-305
  * ``init_kv_buffer`` dims, ``token_stride_size``, ``layout_dim`` — mla.py:307-447
    (``page_unified`` and the Ascend ``page_first_kv_split`` are not mirrored)
  * ``data_refs`` — mla.py:266-279
  * ``_storage_page_index`` (DCP) — mla.py:1145-1155; ``get_data_page`` — mla.py:1157-1170;
    ``get_dummy_flat_data_page`` — mla.py:1172-1183; ``set_from_flat_data_page`` —
    mla.py:1185-1211; ``get_page_buffer_meta`` — mla.py:1213-1337 (non-split branch);
    ``is_stride_page_aligned`` — mla.py:1339-1357

SGLang 0.5.17 (the same files in its wheel) computes the same ``kv_buffer`` dims,
``get_page_buffer_meta``, flat-page accessors, sizes and ``is_stride_page_aligned`` for MHA and
MLA in these layouts; tests/test_sglang_pools.py runs whichever release is installed against the
mimic. It differs only where the mimic does not go or is a superset: its constructors take the
device pool and read the geometry off it, MHA has no ``get_hybrid_pool_buffer``, and the MLA
accessors assert ``dcp_size == 1`` where 0.5.23 maps DCP page starts.

Callers these mimics were checked against (what they read off the pool):
  * ``HiCacheNixl`` (``storage/nixl/hicache_nixl.py``): ``layout``, ``kv_buffer``, ``page_size``,
    ``pin_memory``, ``is_stride_page_aligned(4096)`` (:381), ``get_dummy_flat_data_page`` (:397),
    ``get_page_buffer_meta`` (:682), ``get_data_page(i, flat=True)`` (:744),
    ``set_from_flat_data_page`` (:804), ``get_hybrid_pool_buffer`` (sidecars, :422).
  * ``HiCacheFile`` (``hicache_storage.py``): the generic controller path below, plus
    ``registered_pools[...]`` sidecars through the same accessors.
  * ``HiCacheController`` (``managers/cache_controller.py``): ``get_dummy_flat_data_page`` +
    ``set_from_flat_data_page`` (``_generic_page_get``, :1130-1153), ``get_data_page``
    (``_generic_page_set``, :1403-1408), ``storage_format_tag`` (:54-62), ``kv_buffer``/``layout``
    (:565-590), ``alloc``/``free``/``available_size``/``size``/``size_per_token``.
  * the factory's hf3fs branch: ``get_ksize_per_token``/``get_size_per_token``/``dtype``.

Byte-order facts worth knowing (they follow from the copied code, see tests/test_sglang_pools.py):
  * MHA ``page_first``/``page_first_direct``/``page_head`` and every MLA layout:
    ``get_page_buffer_meta`` entries, concatenated, are the bytes of ``get_data_page(flat=True)``
    in the same order.
  * MHA ``layer_first``: the meta entries are ``K_l0, V_l0, K_l1, V_l1, ...`` but the flat page is
    ``K_l0..K_lN, V_l0..V_lN``: same bytes, different order. A backend that writes one form and
    reads the other scrambles K/V layers.
  * ``get_data_page(flat=True)`` returns a *copy* for every MHA layout (K and V are two regions
    ``v_offset`` apart) and for MLA ``layer_first``; only MLA ``page_first``/``page_first_direct``
    flat pages are views into ``kv_buffer``. Writing into a flat page changes the pool only there.
"""

from __future__ import annotations

import math
import mmap
import threading
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "MHAHostPoolMimic",
    "MLAHostPoolMimic",
    "LAYOUTS",
    "MHA_LAYOUTS",
    "MLA_LAYOUTS",
    "alloc_mmap",
    "make_host_pool",
    "fill_random",
    "host_indices_for_pages",
    "page_meta_bytes",
    "page_flat_bytes",
    "meta_ranges",
]

#: Layouts mirrored for both pool kinds (the ones ``--hicache-mem-layout`` offers for MHA/MLA
#: on CUDA, less ``page_unified``).
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
MHA_LAYOUTS = LAYOUTS + ("page_head",)
MLA_LAYOUTS = LAYOUTS

_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x08000)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _mmap_prefaulted(alloc_bytes: int) -> mmap.mmap:
    """``_mmap_prefaulted(-1, n, MAP_SHARED | MAP_ANONYMOUS)`` (mmap_allocator.py:82-98)."""
    flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS
    try:
        mm = mmap.mmap(-1, alloc_bytes, flags=flags, prot=_PROT_RW)
        mm.madvise(_MADV_POPULATE_WRITE)
        return mm
    except (OSError, ValueError):
        return mmap.mmap(-1, alloc_bytes, flags=flags | _MAP_POPULATE, prot=_PROT_RW)


def alloc_mmap(dims: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Page-aligned host tensor from an anonymous shared mmap, like SGLang's ``alloc_mmap``
    without hugepages (mmap_allocator.py:163-232). The tensor keeps the mapping alive."""
    numel = math.prod(dims)
    itemsize = torch.empty([], dtype=dtype).element_size()
    n_bytes = numel * itemsize
    alloc_bytes = max(1, math.ceil(n_bytes / mmap.PAGESIZE)) * mmap.PAGESIZE
    mm = _mmap_prefaulted(alloc_bytes)
    try:
        t = torch.frombuffer(mm, dtype=dtype, count=numel)
    except (TypeError, RuntimeError):
        # dtypes torch.frombuffer refuses (none seen on torch 2.13/2.14): view the bytes.
        t = torch.frombuffer(mm, dtype=torch.uint8, count=n_bytes).view(dtype)
    return t.reshape(tuple(dims))


class _HostPoolBase:
    """The parts of ``HostKVCache`` (pool_host/base.py:162) that storage code touches."""

    dcp_size = 1
    dcp_rank = 0
    shared_allocation_domain = None
    stores_page_envelope = False
    storage_format_tag: Optional[str] = None

    def _init_base(
        self,
        *,
        dtype: torch.dtype,
        size_per_token: int,
        page_size: int,
        layout: str,
        num_pages: int,
        dcp_size: int = 1,
        dcp_rank: int = 0,
        pool_label: str = "kv",
    ) -> None:
        # base.py:171-236 with host_size == 0 and device tokens * ratio == num_pages * page_size.
        self.pool_label = pool_label
        self.dcp_size = dcp_size
        self.dcp_rank = dcp_rank
        assert page_size % dcp_size == 0
        self.page_size = page_size // dcp_size
        self.layout = layout
        self.pin_memory = False  # real pools: True + cudaHostRegister
        self.device = "cpu"
        self.allocator = None
        self.can_use_write_back_jit = False
        self.dtype = dtype
        self.size_per_token = size_per_token
        self.device_capacity_tokens = num_pages * self.page_size
        size = num_pages * self.page_size
        self.page_num = size // self.page_size + 1  # the padding page
        self.size = self.page_num * self.page_size
        self.start_layer = 0
        self.end_layer = self.layer_num - 1
        self.kv_buffer = self.init_kv_buffer()
        self.fd = None
        self.lock = threading.RLock()
        self.clear()

    # --- slot allocator (base.py:502-577) -------------------------------------------------------
    def clear(self) -> None:
        with self.lock:
            self.mem_state = torch.zeros((self.logical_size,), dtype=torch.uint8)
            self.free_slots = torch.arange(self.logical_size, dtype=torch.int64)
            self.release_slots = []
            self.num_release_slots = 0
            self.slot_used = torch.zeros(self.logical_size, dtype=torch.bool)

    def available_size(self) -> int:
        return len(self.free_slots) + self.num_release_slots

    def _merge_release_slots(self) -> None:
        if self.num_release_slots == 0:
            return
        if len(self.free_slots) == 0 and len(self.release_slots) == 1:
            self.free_slots = self.release_slots[0]
        else:
            self.free_slots = torch.cat([self.free_slots, *self.release_slots])
        self.release_slots = []
        self.num_release_slots = 0

    @property
    def logical_size(self) -> int:
        return self.size * self.dcp_size

    @property
    def logical_page_size(self) -> int:
        return self.page_size * self.dcp_size

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        with self.lock:
            assert need_size % self.logical_page_size == 0, (
                "The requested size should be a multiple of the page size."
            )
            if need_size > self.available_size():
                return None
            if need_size > len(self.free_slots):
                self._merge_release_slots()
            select_index = self.free_slots[:need_size]
            self.free_slots = self.free_slots[need_size:]
            assert not self.slot_used[select_index].any(), "Double-alloc detected"
            self.slot_used[select_index] = True
            return select_index

    def free(self, indices: torch.Tensor) -> int:
        with self.lock:
            indices_cpu = indices.cpu()
            if indices_cpu.numel() == 0:
                return 0
            assert self.slot_used[indices_cpu].all(), "Double-free detected"
            self.slot_used[indices_cpu] = False
            self.release_slots.append(indices_cpu)
            self.num_release_slots += len(indices_cpu)
            return len(indices)

    # --- generic helpers (base.py) --------------------------------------------------------------
    def get_page_buffer_element_size(self, split_factor: int = 1) -> Optional[int]:
        indices = torch.zeros(self.page_size, dtype=torch.int64)
        meta = (
            self.get_split_heads_page_buffer_meta(indices, split_factor)
            if split_factor != 1
            else self.get_page_buffer_meta(indices)
        )
        sizes = meta[1] if meta else None
        return int(sizes[0]) if sizes else None

    def prepare_transfer_indices(self, host_indices, device_indices, io_backend):
        return host_indices, device_indices

    def destroy(self) -> None:
        self.kv_buffer = None

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all meta entries (not a real-pool attribute)."""
        return self.size_per_token * self.page_size

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layout={self.layout!r}, layer_num={self.layer_num}, "
            f"page_size={self.page_size}, page_num={self.page_num}, dtype={self.dtype}, "
            f"page_bytes={self.page_bytes})"
        )


class MHAHostPoolMimic(_HostPoolBase):
    """``MHATokenToKVPoolHost`` (mha.py:135) for ``head_dim == v_head_dim``."""

    def __init__(
        self,
        *,
        layout: str,
        layer_num: int,
        head_num: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        num_pages: int,
        pool_label: str = "kv",
    ):
        if layout not in MHA_LAYOUTS:
            raise ValueError(f"Unsupported layout: {layout}")
        self.target_layer_num = layer_num
        self.dtype = dtype
        self.head_dim = head_dim
        self.v_head_dim = head_dim
        self.head_num = head_num
        self.layer_num = layer_num
        self.head_group_num = 1
        self.page_size = page_size
        self._init_base(
            dtype=dtype,
            size_per_token=self.get_size_per_token(),
            page_size=page_size,
            layout=layout,
            num_pages=num_pages,
            pool_label=pool_label,
        )
        # _initialize_transfer_views (mha.py:241-288), host side only
        self.element_dim = self.head_num * self.head_dim

    def _data_refs(self, buf: torch.Tensor) -> List[torch.Tensor]:
        # mha.py:264-280. Built lazily here: for page_head the real code takes the else branch,
        # whose ``buf[i]`` are *page* views, and that raises when page_num < layer_num (the tiny
        # pools tests build); no L3 path reads these refs.
        if self.layout in ("page_first", "page_first_direct"):
            t = buf.transpose(0, 1)
            return [t[i] for i in range(self.layer_num)]
        return [buf[i] for i in range(self.layer_num)]

    @property
    def k_data_refs(self) -> List[torch.Tensor]:
        return self._data_refs(self.k_buffer)

    @property
    def v_data_refs(self) -> List[torch.Tensor]:
        return self._data_refs(self.v_buffer)

    @property
    def host_kv_data_refs(self) -> List[torch.Tensor]:
        return self.k_data_refs + self.v_data_refs

    # mha.py:290-303
    def get_size_per_token(self) -> int:
        return (
            (self.head_dim + self.v_head_dim)
            * self.head_num
            * self.layer_num
            * self.dtype.itemsize
        )

    def get_hybrid_pool_buffer(self) -> List[torch.Tensor]:
        return [self.k_buffer, self.v_buffer]

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token() // 2

    # mha.py:305-360
    def init_kv_buffer(self) -> torch.Tensor:
        if self.layout == "layer_first":
            dims = (2, self.layer_num, self.size, self.head_num, self.head_dim)
        elif self.layout == "page_first":
            dims = (2, self.size, self.layer_num, self.head_num, self.head_dim)
        elif self.layout == "page_first_direct":
            dims = (2, self.page_num, self.layer_num, self.page_size, self.head_num, self.head_dim)
        elif self.layout == "page_head":
            dims = (2, self.page_num, self.head_num, self.page_size, self.layer_num, self.head_dim)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self.token_stride_size = self.head_num * self.head_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        return alloc_mmap(dims, self.dtype)

    # mha.py:392-398
    @property
    def k_buffer(self) -> torch.Tensor:
        return self.kv_buffer[0]

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.kv_buffer[1]

    # mha.py:713-725
    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :, :]
        elif self.layout in ["page_first_direct", "page_head"]:
            real_index = index // self.page_size
            data_page = self.kv_buffer[:, real_index : real_index + 1, :, :, :, :]
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        if flat:
            data_page = data_page.flatten()
        return data_page

    # mha.py:727-733
    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            (2, self.layer_num, self.page_size, self.head_num, self.head_dim),
            dtype=self.dtype,
            device=self.device,
            pin_memory=self.pin_memory,
        ).flatten()

    # mha.py:735-767
    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "layer_first":
            self.kv_buffer[:, :, index : index + self.page_size, :, :] = data_page.reshape(
                2, self.layer_num, self.page_size, self.head_num, self.head_dim
            )
        elif self.layout == "page_first":
            self.kv_buffer[:, index : index + self.page_size, :, :, :] = data_page.reshape(
                2, self.page_size, self.layer_num, self.head_num, self.head_dim
            )
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            self.kv_buffer[:, real_index : real_index + 1, :, :, :, :] = data_page.reshape(
                2, 1, self.layer_num, self.page_size, self.head_num, self.head_dim
            )
        elif self.layout == "page_head":
            real_index = index // self.page_size
            self.kv_buffer[:, real_index : real_index + 1, :, :, :, :] = data_page.reshape(
                2, 1, self.head_num, self.page_size, self.layer_num, self.head_dim
            )
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")

    # mha.py:769-815
    def get_split_heads_page_buffer_meta(self, indices: torch.Tensor, split_factor: int):
        assert self.layout == "page_head"
        assert len(indices) % self.page_size == 0
        assert self.head_num % split_factor == 0
        ptr_list = []
        kv_buffer_data_ptr = self.kv_buffer.data_ptr()
        indices = indices.tolist()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * self.dtype.itemsize
        for index in range(0, len(indices), self.page_size):
            for head_id in range(0, self.head_num, self.head_num // split_factor):
                k_ptr = (
                    kv_buffer_data_ptr
                    + indices[index] * self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize
                    + head_id * self.page_size * self.layer_num * self.head_dim * self.dtype.itemsize
                )
                v_ptr = k_ptr + v_offset
                ptr_list.append(k_ptr)
                ptr_list.append(v_ptr)
        element_size = (
            self.layer_num * self.dtype.itemsize * self.page_size * self.head_num * self.head_dim
            // split_factor
        )
        return ptr_list, [element_size] * len(ptr_list)

    # mha.py:817-877
    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        ptr_list = []
        kv_buffer_data_ptr = self.kv_buffer.data_ptr()
        indices = indices.tolist()
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * self.dtype.itemsize
        if self.layout == "layer_first":
            for index in range(0, len(indices), self.page_size):
                for layer_id in range(self.layer_num):
                    k_ptr = (
                        kv_buffer_data_ptr
                        + indices[index] * self.head_num * self.head_dim * self.dtype.itemsize
                        + layer_id * self.size * self.head_num * self.head_dim * self.dtype.itemsize
                    )
                    v_ptr = k_ptr + v_offset
                    ptr_list.append(k_ptr)
                    ptr_list.append(v_ptr)
            element_size = self.dtype.itemsize * self.page_size * self.head_num * self.head_dim
            element_size_list = [element_size] * len(ptr_list)
        elif self.layout in ["page_first", "page_first_direct", "page_head"]:
            for index in range(0, len(indices), self.page_size):
                k_ptr = (
                    kv_buffer_data_ptr
                    + indices[index] * self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize
                )
                v_ptr = k_ptr + v_offset
                ptr_list.append(k_ptr)
                ptr_list.append(v_ptr)
            element_size = (
                self.layer_num * self.dtype.itemsize * self.page_size * self.head_num * self.head_dim
            )
            element_size_list = [element_size] * len(ptr_list)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return ptr_list, element_size_list

    # mha.py:879-902
    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        if self.layout not in ("page_first", "page_first_direct", "page_head"):
            return False
        stride = self.page_size * self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize
        base_aligned = self.kv_buffer.data_ptr() % page_size_bytes == 0
        return base_aligned and stride % page_size_bytes == 0


class MLAHostPoolMimic(_HostPoolBase):
    """``MLATokenToKVPoolHost`` (mla.py:92), non-dummy, no draft layers, no Ascend split."""

    def __init__(
        self,
        *,
        layout: str,
        layer_num: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        num_pages: int,
        dcp_size: int = 1,
        dcp_rank: int = 0,
        pool_label: str = "kv",
    ):
        if layout not in MLA_LAYOUTS:
            raise ValueError(f"Unsupported layout: {layout}")
        self.override_kv_cache_dim = None
        self.dtype = dtype
        self.layout = layout
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.dsa_kv_cache_store_fp8 = False
        self.target_layer_num = layer_num
        self.layer_num = layer_num
        self._is_dummy = False
        self._size_per_token = self.kv_cache_dim * self.dtype.itemsize * self.layer_num
        self._init_base(
            dtype=dtype,
            size_per_token=self.get_size_per_token(),
            page_size=page_size,
            layout=layout,
            num_pages=num_pages,
            dcp_size=dcp_size,
            dcp_rank=dcp_rank,
            pool_label=pool_label,
        )

    @property
    def data_refs(self) -> List[torch.Tensor]:
        # _initialize_transfer_views (mla.py:266-279). Built lazily here: for page_first_direct
        # the real else branch takes ``kv_buffer[i]`` = *page* views, which raises when
        # page_num < layer_num (tiny test pools); get_contiguous_buf_infos reads them.
        if self.layout == "page_first":
            transposed = self.kv_buffer.transpose(0, 1)
            return [transposed[i] for i in range(self.layer_num)]
        return [self.kv_buffer[i] for i in range(self.layer_num)]

    @property
    def data_ptrs(self) -> torch.Tensor:
        # the per-layer pointer table both releases build next to data_refs (0.5.17's
        # get_contiguous_buf_infos reads it); on the host here, as uint64
        return torch.tensor([t.data_ptr() for t in self.data_refs], dtype=torch.uint64)

    # mla.py:286-299
    def get_contiguous_buf_infos(self):
        data_ptrs = [tensor.data_ptr() for tensor in self.data_refs]
        data_lens = [self.kv_buffer[i].nbytes for i in range(self.layer_num)]
        item_lens = [self.token_stride_size * self.page_size] * self.layer_num
        return data_ptrs, data_lens, item_lens

    # mla.py:301-305
    def get_size_per_token(self) -> int:
        return self._size_per_token

    def get_ksize_per_token(self) -> int:
        return self.get_size_per_token()

    # mla.py:307-447
    def init_kv_buffer(self) -> torch.Tensor:
        if self.layout == "layer_first":
            dims = (self.layer_num, self.size, 1, self.kv_cache_dim)
        elif self.layout == "page_first":
            dims = (self.size, self.layer_num, 1, self.kv_cache_dim)
        elif self.layout == "page_first_direct":
            dims = (self.page_num, self.layer_num, self.page_size, 1, self.kv_cache_dim)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        self.token_stride_size = self.kv_cache_dim * self.dtype.itemsize
        self.layout_dim = self.token_stride_size * self.layer_num
        return alloc_mmap(dims, self.dtype)

    # mla.py:1145-1155
    def _storage_page_index(self, index: int) -> int:
        if self.dcp_size == 1:
            return index
        index = int(index)
        if index < 0 or index % self.logical_page_size != 0:
            raise ValueError("DCP L3 page start must be a nonnegative logical page boundary.")
        if index + self.logical_page_size > self.logical_size:
            raise IndexError("DCP L3 page is outside the host pool.")
        return index // self.dcp_size

    # mla.py:1157-1170
    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        index = self._storage_page_index(index)
        if self.layout == "layer_first":
            data_page = self.kv_buffer[:, index : index + self.page_size, :, :]
        elif self.layout == "page_first":
            data_page = self.kv_buffer[index : index + self.page_size, :, :, :]
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            data_page = self.kv_buffer[real_index : real_index + 1, :, :, :, :]
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        if flat:
            data_page = data_page.flatten()
        return data_page

    # mla.py:1172-1183
    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            (self.layer_num, self.page_size, 1, self.kv_cache_dim),
            dtype=self.dtype,
            device=self.device,
            pin_memory=self.pin_memory,
        ).flatten()

    # mla.py:1185-1211
    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        index = self._storage_page_index(index)
        if self.layout == "layer_first":
            self.kv_buffer[:, index : index + self.page_size, :, :] = data_page.reshape(
                self.layer_num, self.page_size, 1, self.kv_cache_dim
            )
        elif self.layout == "page_first":
            self.kv_buffer[index : index + self.page_size, :, :, :] = data_page.reshape(
                self.page_size, self.layer_num, 1, self.kv_cache_dim
            )
        elif self.layout == "page_first_direct":
            real_index = index // self.page_size
            self.kv_buffer[real_index : real_index + 1, :, :, :, :] = data_page.reshape(
                1, self.layer_num, self.page_size, 1, self.kv_cache_dim
            )
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")

    # mla.py:1213-1337 (the non-page_first_kv_split part)
    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.logical_page_size == 0
        ptr_list = []
        kv_buffer_data_ptr = self.kv_buffer.data_ptr()
        indices = indices.tolist()
        page_starts = [self._storage_page_index(index) for index in indices[:: self.logical_page_size]]
        if self.layout == "layer_first":
            for index in page_starts:
                for layer_id in range(self.layer_num):
                    k_ptr = (
                        kv_buffer_data_ptr
                        + index * self.kv_cache_dim * self.dtype.itemsize
                        + layer_id * self.size * self.kv_cache_dim * self.dtype.itemsize
                    )
                    ptr_list.append(k_ptr)
            element_size = self.dtype.itemsize * self.page_size * self.kv_cache_dim
            element_size_list = [element_size] * len(ptr_list)
        elif self.layout in ["page_first", "page_first_direct"]:
            for index in page_starts:
                k_ptr = kv_buffer_data_ptr + index * self.layer_num * self.kv_cache_dim * self.dtype.itemsize
                ptr_list.append(k_ptr)
            element_size = self.layer_num * self.dtype.itemsize * self.page_size * self.kv_cache_dim
            element_size_list = [element_size] * len(ptr_list)
        else:
            raise ValueError(f"Unsupported layout: {self.layout}")
        return ptr_list, element_size_list

    # mla.py:1339-1357
    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        if self.layout not in ("page_first", "page_first_direct"):
            return False
        stride = self.page_size * self.layer_num * self.kv_cache_dim * self.dtype.itemsize
        base_aligned = self.kv_buffer.data_ptr() % page_size_bytes == 0
        return base_aligned and stride % page_size_bytes == 0


def make_host_pool(
    kind: str,
    layout: str,
    layer_num: int,
    head_num: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    num_pages: int,
    *,
    kv_lora_rank: Optional[int] = None,
    qk_rope_head_dim: Optional[int] = None,
    fill: bool = False,
    seed: int = 0,
):
    """Build a host pool mimic.

    kind: ``"mha"`` or ``"mla"``. ``num_pages`` usable pages are asked for; like the real pool the
    buffer holds one more (the padding page), so ``pool.page_num == num_pages + 1``.
    For MLA, ``head_num`` is ignored (MLA rows are ``(1, kv_cache_dim)``) and ``head_dim`` is
    ``kv_cache_dim``; it is split as ``kv_lora_rank + qk_rope_head_dim`` (default: rope 64 when
    ``head_dim > 64``, as DeepSeek's 512 + 64 = 576), which only matters for the attributes.
    ``fill=True`` fills the buffer with random non-zero bytes (see :func:`fill_random`).
    """
    if kind == "mha":
        pool = MHAHostPoolMimic(
            layout=layout,
            layer_num=layer_num,
            head_num=head_num,
            head_dim=head_dim,
            page_size=page_size,
            dtype=dtype,
            num_pages=num_pages,
        )
    elif kind == "mla":
        if qk_rope_head_dim is None:
            if kv_lora_rank is not None:
                qk_rope_head_dim = head_dim - kv_lora_rank
            else:
                qk_rope_head_dim = 64 if head_dim > 64 else 0
        if kv_lora_rank is None:
            kv_lora_rank = head_dim - qk_rope_head_dim
        if kv_lora_rank + qk_rope_head_dim != head_dim:
            raise ValueError("kv_lora_rank + qk_rope_head_dim must equal head_dim (kv_cache_dim)")
        pool = MLAHostPoolMimic(
            layout=layout,
            layer_num=layer_num,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            page_size=page_size,
            dtype=dtype,
            num_pages=num_pages,
        )
    else:
        raise ValueError(f"kind must be 'mha' or 'mla', got {kind!r}")
    if fill:
        fill_random(pool, seed=seed)
    return pool


def fill_random(pool, seed: int = 0, pages: Optional[Iterable[int]] = None) -> None:
    """Fill the pool (or only the given page numbers) with random bytes in 1..255.

    Bytes are drawn through a uint8 view, so float dtypes get arbitrary bit patterns (NaNs
    included); compare pages as bytes, never as floats. Zero is excluded so that a page a backend
    failed to write or read back (zeros from a fresh file or ``get_dummy_flat_data_page``) can
    never pass for data.
    """
    g = torch.Generator().manual_seed(seed)
    if pages is None:
        raw = pool.kv_buffer.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(1, 256, raw.shape, dtype=torch.uint8, generator=g))
        return
    for p in pages:
        idx = host_indices_for_pages(pool, [p])
        ptrs, sizes = pool.get_page_buffer_meta(idx)
        for ptr, size in zip(ptrs, sizes):
            view = _byte_view(pool, ptr, size)
            view.copy_(torch.randint(1, 256, (size,), dtype=torch.uint8, generator=g))


def host_indices_for_pages(pool, pages: Sequence[int]) -> torch.Tensor:
    """The controller's ``host_indices`` for whole pages: ``page_size`` token slots per page,
    page *i* starting at ``pages[i] * page_size`` (the form ``batch_get_v1``/``batch_set_v1``
    get)."""
    ps = pool.logical_page_size
    if len(pages) == 0:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64) for p in pages])


def _byte_view(pool, ptr: int, size: int) -> torch.Tensor:
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    off = ptr - pool.kv_buffer.data_ptr()
    if off < 0 or off + size > raw.numel():
        raise ValueError(f"pointer range [{ptr:#x}, +{size}) is outside kv_buffer")
    return raw[off : off + size]


def page_meta_bytes(pool, page: int) -> bytes:
    """The bytes of one page as ``get_page_buffer_meta`` lists them (entries concatenated)."""
    ptrs, sizes = pool.get_page_buffer_meta(host_indices_for_pages(pool, [page]))
    return b"".join(_byte_view(pool, p, s).numpy().tobytes() for p, s in zip(ptrs, sizes))


def page_flat_bytes(pool, page: int) -> bytes:
    """The bytes of ``get_data_page(page * page_size, flat=True)``."""
    t = pool.get_data_page(page * pool.logical_page_size, flat=True)
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def meta_ranges(pool, pages: Sequence[int]) -> List[Tuple[int, int]]:
    """``(offset_in_kv_buffer, size)`` per meta entry, for assertions."""
    ptrs, sizes = pool.get_page_buffer_meta(host_indices_for_pages(pool, pages))
    base = pool.kv_buffer.data_ptr()
    return [(p - base, s) for p, s in zip(ptrs, sizes)]
