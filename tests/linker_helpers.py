"""Device KV pool mimics and a driver for `GDSLinker`, for tests and benchmarks without SGLang.

The pools copy the buffer geometry of SGLang 0.5.23's device pools (``sglang/srt/mem_cache/
memory_pool.py``), which is all the linker reads:

* ``MHATokenToKVPool`` (memory_pool.py:2184, ``_create_buffers_normal`` :2580): per layer one
  zeroed ``(2, ceil_align(size + page_size, page_size), H, D)`` allocation, ``k_buffer[l] =
  fused[0, :rows]`` and ``v_buffer[l] = fused[1, :rows]`` with ``rows = size + page_size`` (the
  padding page absorbs dummy writes); ``kv_cache_layout = "nhd"``; fp8 KV is stored as uint8
  (``KVCache.__init__`` :2030, ``store_dtype``).
* ``MLATokenToKVPool`` (:4754, ``_create_buffers`` :4850): per layer ``(size + page_size, 1,
  kv_cache_dim)``.
* ``get_key_buffer(layer_id)`` waits on ``layer_transfer_counter.wait_until(layer_id -
  start_layer)`` first, as the real pools do (:2852, :4892): that is how a forward consumes a
  layer-wise load.

The driver calls the linker as SGLang's ``UnifiedCacheLinkerWrapper`` does (lookup -> load ->
start_layer_wise_loading -> the forward's per-layer waits -> finish_layer_wise_loading; offload ->
num_completed_offloads / pop_completed_offload).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Sequence

import torch

__all__ = ["MHADevicePool", "MLADevicePool", "make_pool", "make_params", "server_args", "kv_transfer",
           "page_indices", "fill_random", "page_bytes", "run_load", "wait_offloads"]


def _store(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype in (torch.float8_e5m2, torch.float8_e4m3fn) else dtype


class _Counted:
    layer_transfer_counter: Any = None
    start_layer = 0

    def register_layer_transfer_counter(self, counter: Any) -> None:
        self.layer_transfer_counter = counter

    def _wait(self, layer_id: int) -> None:
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(layer_id - self.start_layer)


class MHADevicePool(_Counted):
    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device: str) -> None:
        self.size, self.page_size, self.dtype, self.store_dtype = size, page_size, dtype, _store(dtype)
        self.head_num, self.head_dim, self.v_head_dim, self.layer_num = head_num, head_dim, head_dim, layer_num
        self.kv_cache_layout = "nhd"
        self.k_scale_buffer = self.v_scale_buffer = self.native_k_scale_buffer = None
        self.is_quantized_kv_cache = False
        rows = size + page_size
        padded = -(-rows // page_size) * page_size
        fused = [torch.zeros((2, padded, head_num, head_dim), dtype=self.store_dtype, device=device)
                 for _ in range(layer_num)]
        self.k_buffer = [f[0, :rows] for f in fused]
        self.v_buffer = [f[1, :rows] for f in fused]

    def buffers(self) -> list[torch.Tensor]:
        return [*self.k_buffer, *self.v_buffer]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait(layer_id)
        return self.k_buffer[layer_id - self.start_layer]


class MLADevicePool(_Counted):
    def __init__(self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int,
                 layer_num: int, device: str) -> None:
        self.size, self.page_size, self.dtype, self.store_dtype = size, page_size, dtype, _store(dtype)
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.layer_num, self.use_dsa, self.kv_scale_buffer = layer_num, False, None
        self.kv_buffer = [torch.zeros((size + page_size, 1, self.kv_cache_dim), dtype=self.store_dtype, device=device)
                          for _ in range(layer_num)]

    def buffers(self) -> list[torch.Tensor]:
        return list(self.kv_buffer)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait(layer_id)
        return self.kv_buffer[layer_id - self.start_layer]


def make_pool(kind: str, *, pages: int, page_size: int, dtype: torch.dtype = torch.bfloat16, layers: int = 4,
              heads: int = 2, head_dim: int = 128, kv_cache_dim: int = 576, device: str = "cpu") -> Any:
    """A pool of `pages` usable pages (plus SGLang's padding page)."""
    if kind == "mha":
        return MHADevicePool(pages * page_size, page_size, dtype, heads, head_dim, layers, device)
    rope = 64 if kv_cache_dim > 64 else 0
    return MLADevicePool(pages * page_size, page_size, dtype, kv_cache_dim - rope, rope, layers, device)


def make_params(pool: Any) -> SimpleNamespace:
    """The `CacheInitParams` fields the linker reads."""
    allocator = SimpleNamespace(get_kvcache=lambda: pool)
    return SimpleNamespace(page_size=pool.page_size, token_to_kv_pool_allocator=allocator,
                           pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, tp_cache_group=None,
                           attn_tp_cache_group=None, mtp_draft_device_pools=(), sidecar_draft_device_pools=())


def server_args(model: str = "meta-llama/Test-1B") -> SimpleNamespace:
    return SimpleNamespace(served_model_name=model, model_path=model)


def kv_transfer(keys: Sequence[str], indices: torch.Tensor | None = None) -> Any:
    """SGLang's `PoolTransfer` for the KV pool where SGLang imports, an equivalent otherwise."""
    try:
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
        return PoolTransfer(name=PoolName.KV, keys=list(keys), device_indices=indices)
    except ImportError:
        return SimpleNamespace(name="kv", keys=list(keys), device_indices=indices)


def page_indices(pages: Sequence[int], page_size: int, device: Any = "cpu") -> torch.Tensor:
    """Token slots of whole pages (page p = rows [p*P, (p+1)*P)), as the allocator hands them out."""
    if not len(pages):
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]).to(device)


def fill_random(pool: Any, seed: int) -> None:
    """Random bytes in every buffer (compare as bytes: float views hold NaNs)."""
    for b in pool.buffers():
        raw = b.view(torch.uint8)
        g = torch.Generator(device=raw.device).manual_seed(seed)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g, device=raw.device))
        seed += 1


def page_bytes(pool: Any, page: int) -> torch.Tensor:
    """One page's bytes in stored order (segments concatenated), as a CPU uint8 tensor."""
    p = pool.page_size
    return torch.cat([b[page * p:(page + 1) * p].reshape(-1).view(torch.uint8).cpu() for b in pool.buffers()])


def run_load(linker: Any, pool: Any, rid: str, keys: Sequence[str], pages: Sequence[int],
             on_layer: Any = None) -> bool:
    """load -> start -> the forward's per-layer waits (``on_layer(layer)`` after each) -> finish."""
    if not linker.load(rid, [kv_transfer(keys, page_indices(pages, pool.page_size, pool.buffers()[0].device))]):
        return False
    index = linker.start_layer_wise_loading()
    linker.layer_done_counter.set_consumer(index)
    pool.register_layer_transfer_counter(linker.layer_done_counter)
    try:
        for layer in range(len(pool.k_buffer) if hasattr(pool, "k_buffer") else len(pool.kv_buffer)):
            pool.get_key_buffer(layer)
            if on_layer is not None:
                on_layer(layer)
    finally:
        pool.register_layer_transfer_counter(None)
    return linker.finish_layer_wise_loading(index)


def wait_offloads(linker: Any, n: int, timeout: float = 120.0) -> list[bool]:
    """Results of the next `n` offloads, polled as the scheduler does."""
    deadline = time.monotonic() + timeout
    while linker.num_completed_offloads() < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{linker.num_completed_offloads()} of {n} offloads completed in {timeout} s")
        time.sleep(0.002)
    return [linker.pop_completed_offload() for _ in range(n)]
