"""Checks that tests/sglang_pools.py mirrors SGLang's host KV pools (0.5.23 and 0.5.17).

Three kinds of checks, none needs CUDA:
  * self-consistency of the byte geometry (meta pointers vs flat pages vs kv_buffer strides);
  * the values in shared/reference/sglang-contract.md (shapes, is_stride_page_aligned examples);
  * where sglang 0.5.23 or 0.5.17 is installed (the venv made by
    scripts/install-sglang-test-deps.sh, with or without its 0.5.17 overlay): the *real* methods,
    compiled from the installed pool_host/mha.py and mla.py source text (the modules themselves
    are never imported: they load CUDA kernels), run on the mimic objects and must give the same
    results as the mimic's own methods; and round trips through the real HiCacheFile and
    HiCacheNixl backends. The docstring's line numbers are 0.5.23's and checked only there.
"""

from __future__ import annotations

import __future__
import ast
import collections
import importlib.util
import itertools
import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import sglang_pools as sp
from sglang_pools import fill_random, host_indices_for_pages, make_host_pool, page_flat_bytes, page_meta_bytes

# small geometries: (kind, layer_num, head_num, head_dim, page_size)
SMALL = {"mha": (3, 2, 16, 4), "mla": (3, 1, 24, 4)}
CASES = [("mha", lo) for lo in sp.MHA_LAYOUTS] + [("mla", lo) for lo in sp.MLA_LAYOUTS]
DTYPES = [torch.bfloat16, torch.float16, torch.uint8, torch.float32]


def small_pool(kind, layout, dtype=torch.bfloat16, num_pages=5, seed=0):
    L, H, D, ps = SMALL[kind]
    return make_host_pool(kind, layout, L, H, D, ps, dtype, num_pages, fill=True, seed=seed)


def expected_entries_per_page(pool):
    if isinstance(pool, sp.MHAHostPoolMimic):
        return 2 * pool.layer_num if pool.layout == "layer_first" else 2
    return pool.layer_num if pool.layout == "layer_first" else 1


# ---------------------------------------------------------------------------------------------
# geometry and attributes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,layout", CASES)
def test_kv_buffer_shape_dtype_alignment(kind, layout):
    L, H, D, ps = SMALL[kind]
    pool = make_host_pool(kind, layout, L, H, D, ps, torch.bfloat16, num_pages=5)
    assert pool.page_num == 6, "one padding page, as base.py:228"
    assert pool.size == pool.page_num * ps
    size, pn = pool.size, pool.page_num
    shapes = {
        ("mha", "layer_first"): (2, L, size, H, D),
        ("mha", "page_first"): (2, size, L, H, D),
        ("mha", "page_first_direct"): (2, pn, L, ps, H, D),
        ("mha", "page_head"): (2, pn, H, ps, L, D),
        ("mla", "layer_first"): (L, size, 1, D),
        ("mla", "page_first"): (size, L, 1, D),
        ("mla", "page_first_direct"): (pn, L, ps, 1, D),
    }
    assert tuple(pool.kv_buffer.shape) == shapes[(kind, layout)]
    assert pool.kv_buffer.dtype == torch.bfloat16
    assert pool.kv_buffer.is_contiguous()
    assert pool.kv_buffer.data_ptr() % 4096 == 0
    assert pool.layout == layout and pool.page_size == ps and pool.layer_num == L
    assert pool.dtype == torch.bfloat16 and pool.device == "cpu" and pool.pin_memory is False
    assert pool.storage_format_tag is None and pool.dcp_size == 1
    assert pool.logical_size == pool.size and pool.logical_page_size == ps
    assert pool.kv_buffer.numel() * pool.kv_buffer.element_size() == pool.size * pool.get_size_per_token()
    if kind == "mha":
        assert (pool.head_num, pool.head_dim, pool.v_head_dim) == (H, D, D)
        assert pool.get_size_per_token() == 2 * H * D * L * 2
        assert pool.get_ksize_per_token() == pool.get_size_per_token() // 2
        k, v = pool.get_hybrid_pool_buffer()
        assert k.data_ptr() == pool.kv_buffer.data_ptr()
        assert v.data_ptr() - k.data_ptr() == pool.kv_buffer.nbytes // 2
        assert pool.token_stride_size == H * D * 2 and pool.layout_dim == H * D * 2 * L
        assert len(pool.k_data_refs) == len(pool.v_data_refs) == L
    else:
        assert pool.kv_cache_dim == D == pool.kv_lora_rank + pool.qk_rope_head_dim
        assert pool.get_size_per_token() == pool.get_ksize_per_token() == D * 2 * L
        ptrs, lens, items = pool.get_contiguous_buf_infos()
        assert len(ptrs) == len(lens) == len(items) == L
        assert pool.token_stride_size == D * 2 and pool.layout_dim == D * 2 * L


def test_mla_default_split_is_deepseek():
    pool = make_host_pool("mla", "page_first", 2, 128, 576, 4, torch.bfloat16, 1)
    assert (pool.kv_lora_rank, pool.qk_rope_head_dim, pool.kv_cache_dim) == (512, 64, 576)


@pytest.mark.parametrize("kind,layout", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_meta_covers_flat_page_bytes(kind, layout, dtype):
    """get_page_buffer_meta entries, concatenated, are the bytes of get_data_page(flat=True) of the
    same page, in the same order -- except MHA layer_first, which lists K_l, V_l per layer while the
    flat page is all K layers then all V layers (same bytes, different order)."""
    pool = small_pool(kind, layout, dtype)
    page_bytes = pool.get_size_per_token() * pool.page_size
    for page in range(pool.page_num):
        ptrs, sizes = pool.get_page_buffer_meta(host_indices_for_pages(pool, [page]))
        assert len(ptrs) == len(sizes) == expected_entries_per_page(pool)
        assert sum(sizes) == page_bytes
        flat = pool.get_data_page(page * pool.page_size, flat=True)
        assert flat.dtype == dtype and flat.dim() == 1
        assert flat.numel() * flat.element_size() == page_bytes
        meta = page_meta_bytes(pool, page)
        if kind == "mha" and layout == "layer_first":
            L = pool.layer_num
            chunk = len(meta) // (2 * L)
            f = page_flat_bytes(pool, page)
            # flat (2, L, chunk) -> meta (L, 2, chunk)
            reordered = b"".join(f[(kv * L + l) * chunk : (kv * L + l + 1) * chunk] for l in range(L) for kv in (0, 1))
            assert meta == reordered
            assert meta != f
        else:
            assert meta == page_flat_bytes(pool, page)


@pytest.mark.parametrize("kind,layout", CASES)
def test_meta_pointers_match_tensor_indexing(kind, layout):
    """The pointer arithmetic copied from SGLang agrees with torch indexing into kv_buffer."""
    pool = small_pool(kind, layout)
    kv, ps, L = pool.kv_buffer, pool.page_size, pool.layer_num
    pages = [4, 0, 2]
    ptrs, sizes = pool.get_page_buffer_meta(host_indices_for_pages(pool, pages))
    want = []
    for p in pages:
        t = p * ps
        if kind == "mha":
            if layout == "layer_first":
                for l in range(L):
                    want += [kv[0, l, t].data_ptr(), kv[1, l, t].data_ptr()]
            elif layout == "page_first":
                want += [kv[0, t].data_ptr(), kv[1, t].data_ptr()]
            else:  # page_first_direct, page_head
                want += [kv[0, p].data_ptr(), kv[1, p].data_ptr()]
        else:
            if layout == "layer_first":
                want += [kv[l, t].data_ptr() for l in range(L)]
            elif layout == "page_first":
                want += [kv[t].data_ptr()]
            else:
                want += [kv[p].data_ptr()]
    assert ptrs == want
    assert len(set(sizes)) == 1


@pytest.mark.parametrize("kind,layout", CASES)
def test_meta_ranges_tile_the_buffer(kind, layout):
    """Over all page_num pages the meta entries are disjoint and cover kv_buffer exactly."""
    pool = small_pool(kind, layout)
    ranges = sorted(sp.meta_ranges(pool, list(range(pool.page_num))))
    pos = 0
    for off, size in ranges:
        assert off == pos
        pos += size
    assert pos == pool.kv_buffer.nbytes


@pytest.mark.parametrize("kind,layout", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=str)
def test_flat_page_round_trip(kind, layout, dtype):
    pool = small_pool(kind, layout, dtype, seed=3)
    before = {p: page_meta_bytes(pool, p) for p in range(pool.page_num)}
    ps = pool.page_size
    page = pool.get_data_page(1 * ps, flat=True).clone()
    pool.set_from_flat_data_page(3 * ps, page)
    for p in range(pool.page_num):
        assert page_meta_bytes(pool, p) == (before[1] if p == 3 else before[p])
    # the generic prefetch path: a dummy page filled by a "backend", then copied into the pool
    dummy = pool.get_dummy_flat_data_page()
    assert dummy.shape == page.shape and dummy.dtype == dtype
    assert not dummy.view(torch.uint8).any()
    dummy.copy_(pool.get_data_page(0, flat=True))
    pool.set_from_flat_data_page(4 * ps, dummy)
    assert page_meta_bytes(pool, 4) == before[0]
    # host_indices entries are 0-d tensors in the controller: those must work as indices too
    idx = host_indices_for_pages(pool, [2])
    assert torch.equal(pool.get_data_page(idx[0], flat=True).view(torch.uint8),
                       pool.get_data_page(2 * ps, flat=True).view(torch.uint8))


@pytest.mark.parametrize("kind,layout", CASES)
def test_flat_page_is_view_only_for_mla_page_first(kind, layout):
    pool = small_pool(kind, layout)
    flat = pool.get_data_page(pool.page_size, flat=True)
    base, end = pool.kv_buffer.data_ptr(), pool.kv_buffer.data_ptr() + pool.kv_buffer.nbytes
    is_view = base <= flat.data_ptr() < end
    assert is_view == (kind == "mla" and layout in ("page_first", "page_first_direct"))


def test_split_heads_meta_page_head():
    pool = make_host_pool("mha", "page_head", 2, 4, 8, 4, torch.bfloat16, 3, fill=True)
    idx = host_indices_for_pages(pool, [1, 2])
    ptrs, sizes = pool.get_split_heads_page_buffer_meta(idx, 2)
    full_ptrs, full_sizes = pool.get_page_buffer_meta(idx)
    assert len(ptrs) == 2 * len(full_ptrs) and sizes[0] * 2 == full_sizes[0]
    assert ptrs[0] == full_ptrs[0] and ptrs[1] == full_ptrs[1]
    assert pool.get_page_buffer_element_size(2) == sizes[0]
    assert pool.get_page_buffer_element_size() == full_sizes[0]


def test_fill_random_nonzero_and_seeded():
    a = small_pool("mha", "page_first", seed=1)
    b = small_pool("mha", "page_first", seed=1)
    c = small_pool("mha", "page_first", seed=2)
    raw = a.kv_buffer.view(-1).view(torch.uint8)
    assert int(raw.min()) >= 1
    assert torch.equal(raw, b.kv_buffer.view(-1).view(torch.uint8))
    assert not torch.equal(raw, c.kv_buffer.view(-1).view(torch.uint8))
    before = page_meta_bytes(a, 0)
    fill_random(a, seed=9, pages=[2])
    assert page_meta_bytes(a, 0) == before and page_meta_bytes(a, 2) != page_meta_bytes(b, 2)


def test_slot_allocator():
    pool = small_pool("mla", "page_first")
    ps = pool.page_size
    assert pool.available_size() == pool.size
    got = pool.alloc(2 * ps)
    assert got.tolist() == list(range(2 * ps))
    assert pool.alloc(pool.size) is None
    assert pool.free(got) == 2 * ps
    assert pool.available_size() == pool.size
    with pytest.raises(AssertionError):
        pool.alloc(ps + 1)


def test_host_indices_for_pages():
    pool = small_pool("mha", "page_first")
    idx = host_indices_for_pages(pool, [3, 1])
    ps = pool.page_size
    assert idx.dtype == torch.int64 and idx.tolist() == list(range(3 * ps, 4 * ps)) + list(range(ps, 2 * ps))
    assert host_indices_for_pages(pool, []).numel() == 0


# ---------------------------------------------------------------------------------------------
# is_stride_page_aligned against the contract doc (section 2.2)
# ---------------------------------------------------------------------------------------------

LLAMA3_8B = dict(kind="mha", layer_num=32, head_num=8, head_dim=128)  # TP1: 8 KV heads
DEEPSEEK = dict(kind="mla", layer_num=61, head_num=1, head_dim=576)  # 512 latent + 64 rope


@pytest.mark.parametrize(
    "geo,page_size,dtype,layout,stride,aligned",
    [
        # "Llama-3-8B bf16, page 64: K stride 4 MiB"
        (LLAMA3_8B, 64, torch.bfloat16, "page_first", 4 << 20, True),
        (LLAMA3_8B, 64, torch.bfloat16, "page_first_direct", 4 << 20, True),
        (LLAMA3_8B, 64, torch.bfloat16, "page_head", 4 << 20, True),
        (LLAMA3_8B, 64, torch.bfloat16, "layer_first", 4 << 20, False),  # never for layer_first
        # page 1: 32*8*128*2 = 64 KiB, still aligned (the doc's "page_size=1 is usually not"
        # holds for MLA, not for this MHA geometry)
        (LLAMA3_8B, 1, torch.bfloat16, "page_first", 64 << 10, True),
        # "DeepSeek MLA (576*2 B*61 layers*64) = 4 497 408 B" = 1098 * 4096
        (DEEPSEEK, 64, torch.bfloat16, "page_first", 4_497_408, True),
        (DEEPSEEK, 64, torch.bfloat16, "page_first_direct", 4_497_408, True),
        (DEEPSEEK, 64, torch.uint8, "page_first", 2_248_704, True),  # fp8 KV stored as uint8
        (DEEPSEEK, 64, torch.bfloat16, "layer_first", 4_497_408, False),
        (DEEPSEEK, 1, torch.bfloat16, "page_first", 70_272, False),  # 70272 % 4096 != 0
        (DEEPSEEK, 16, torch.bfloat16, "page_first", 1_124_352, False),  # = 274.5 * 4096
        (DEEPSEEK, 32, torch.bfloat16, "page_first", 2_248_704, True),
    ],
)
def test_is_stride_page_aligned_contract_examples(geo, page_size, dtype, layout, stride, aligned):
    pool = make_host_pool(page_size=page_size, dtype=dtype, layout=layout, num_pages=1, **geo)
    ptrs, sizes = pool.get_page_buffer_meta(host_indices_for_pages(pool, [0, 1]))
    if layout != "layer_first":
        per_page = 2 if geo["kind"] == "mha" else 1
        assert ptrs[per_page] - ptrs[0] == stride == sizes[0]
    assert pool.is_stride_page_aligned() is aligned
    assert pool.is_stride_page_aligned(4096) is aligned


# ---------------------------------------------------------------------------------------------
# against the real source (needs sglang 0.5.23 or 0.5.17 installed; the modules are NOT imported)
# ---------------------------------------------------------------------------------------------


CHECKED_RELEASES = ("0.5.17", "0.5.23")


def _installed_sglang():
    """(version, srt/mem_cache directory) of the installed SGLang; skips unless it is a checked release."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang not installed (use the venv from scripts/install-sglang-test-deps.sh)")
    from importlib import metadata as importlib_metadata

    try:
        version = importlib_metadata.version("sglang")
    except importlib_metadata.PackageNotFoundError:  # e.g. a namespace dir named sglang on sys.path
        pytest.skip("sglang not installed (use the venv from scripts/install-sglang-test-deps.sh)")
    if version not in CHECKED_RELEASES:
        pytest.skip(f"sglang {version} is installed; these checks read {' and '.join(CHECKED_RELEASES)}'s source")
    return version, Path(list(spec.submodule_search_locations)[0]) / "srt" / "mem_cache"


def _sglang_mem_cache_dir():
    version, path = _installed_sglang()
    if version != "0.5.23":
        pytest.skip(f"sglang {version} is installed; the mimic's docstring cites 0.5.23's line numbers")
    return path


# Methods only one release has: 0.5.23's get_hybrid_pool_buffer and DCP page index; in 0.5.17 the
# MLA accessors assert dcp_size == 1 instead (no DCP storage there).
ONLY_IN = {"get_hybrid_pool_buffer": "0.5.23", "_storage_page_index": "0.5.23"}
MHA_METHODS = [
    "get_size_per_token", "get_ksize_per_token", "get_hybrid_pool_buffer", "init_kv_buffer",
    "get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page",
    "get_split_heads_page_buffer_meta", "get_page_buffer_meta", "is_stride_page_aligned",
]
MLA_METHODS = [
    "get_contiguous_buf_infos", "get_size_per_token", "get_ksize_per_token", "init_kv_buffer",
    "_storage_page_index", "get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page",
    "get_page_buffer_meta", "is_stride_page_aligned",
]
def _real_methods(path: Path, class_name: str, names):
    """Compile the named methods of ``class_name`` from the wheel's source text, unbound."""
    tree = ast.parse(path.read_text(), filename=str(path))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    defs = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    missing = [n for n in names if n not in defs]
    assert not missing, f"{class_name} in {path.name} lost methods {missing}"
    for d in defs.values():
        d.decorator_list = []
    mod = ast.Module(body=[defs[n] for n in names], type_ignores=[])
    code = compile(mod, str(path), "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    calls = []

    def fake_alloc(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        calls.append(dict(dims=tuple(dims), dtype=dtype, granularity=registration_granularity_bytes))
        return torch.empty(0)

    ns = {
        "torch": torch,
        "logger": logging.getLogger("real-sglang-source"),
        "ALLOC_MEMORY_FUNCS": collections.defaultdict(lambda: fake_alloc),
        "_is_npu": False,
    }
    exec(code, ns)
    return {n: ns[n] for n in names}, calls


def _installed_methods(kind):
    version, path = _installed_sglang()
    names = [n for n in (MHA_METHODS if kind == "mha" else MLA_METHODS) if ONLY_IN.get(n, version) == version]
    cls = "MHATokenToKVPoolHost" if kind == "mha" else "MLATokenToKVPoolHost"
    return _real_methods(path / "pool_host" / f"{kind}.py", cls, names)


@pytest.fixture(scope="module")
def real_mha():
    return _installed_methods("mha")


@pytest.fixture(scope="module")
def real_mla():
    return _installed_methods("mla")


def _as_0_5_17(pool):
    """0.5.17's host pools read their geometry off the device pool (``self.device_pool``) and its
    layer-sharding helper; give the mimic an unsharded stand-in with the same geometry."""
    L, dtype = pool.layer_num, pool.dtype
    if isinstance(pool, sp.MHAHostPoolMimic):
        pool.device_pool = SimpleNamespace(head_num=pool.head_num, head_dim=pool.head_dim, layer_num=L, device="cpu",
                                           store_dtype=dtype)
    else:
        pool.device_pool = SimpleNamespace(kv_lora_rank=pool.kv_lora_rank, qk_rope_head_dim=pool.qk_rope_head_dim,
                                           layer_num=L, device="cpu", store_dtype=dtype)
        pool._effective_host_layer_num = lambda device_pool=None: L


def _same_tensor_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@pytest.mark.parametrize("kind,layout", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=str)
def test_real_source_methods_agree(kind, layout, dtype, request):
    (real, calls) = request.getfixturevalue("real_mha" if kind == "mha" else "real_mla")
    pool = small_pool(kind, layout, dtype, seed=5)
    twin = small_pool(kind, layout, dtype, seed=5)
    ps = pool.page_size
    if "get_hybrid_pool_buffer" not in real and "_storage_page_index" not in real:  # 0.5.17
        _as_0_5_17(pool)

    assert real["get_size_per_token"](pool) == pool.get_size_per_token()
    assert real["get_ksize_per_token"](pool) == pool.get_ksize_per_token()
    for pages in ([0], [1, 4, 2], list(range(pool.page_num))):
        idx = host_indices_for_pages(pool, pages)
        assert real["get_page_buffer_meta"](pool, idx) == pool.get_page_buffer_meta(idx)
    for ab in (1, 512, 4096, 8192):
        assert real["is_stride_page_aligned"](pool, ab) == pool.is_stride_page_aligned(ab)
    for i in range(pool.page_num):
        for flat in (True, False):
            assert _same_tensor_bytes(real["get_data_page"](pool, i * ps, flat), pool.get_data_page(i * ps, flat))
    assert _same_tensor_bytes(real["get_dummy_flat_data_page"](pool), pool.get_dummy_flat_data_page())
    src = pool.get_data_page(2 * ps, flat=True).clone()
    real["set_from_flat_data_page"](pool, 0, src)
    twin.set_from_flat_data_page(0, src)
    assert torch.equal(pool.kv_buffer.view(-1).view(torch.uint8), twin.kv_buffer.view(-1).view(torch.uint8))

    # init_kv_buffer: same dims, and the registration granularity SGLang would use
    calls.clear()
    pool._transfer_device = torch.device("cpu")
    saved = (pool.token_stride_size, pool.layout_dim)
    real["init_kv_buffer"](pool)
    assert calls[-1]["dims"] == tuple(pool.kv_buffer.shape)
    assert calls[-1]["dtype"] == dtype
    assert (pool.token_stride_size, pool.layout_dim) == saved

    if kind == "mha":
        if "get_hybrid_pool_buffer" in real:
            assert [t.data_ptr() for t in real["get_hybrid_pool_buffer"](pool)] == [
                t.data_ptr() for t in pool.get_hybrid_pool_buffer()
            ]
        if layout == "page_head":
            idx = host_indices_for_pages(pool, [1, 3])
            assert real["get_split_heads_page_buffer_meta"](pool, idx, 2) == pool.get_split_heads_page_buffer_meta(idx, 2)
    else:
        assert real["get_contiguous_buf_infos"](pool) == pool.get_contiguous_buf_infos()
        if "_storage_page_index" in real:
            assert real["_storage_page_index"](pool, 3 * ps) == pool._storage_page_index(3 * ps)


def test_docstring_line_references_point_at_the_named_code():
    """The module docstring cites ``name`` — file.py:START-END; the name must be in that range."""
    mem_cache = _sglang_mem_cache_dir()
    files = {
        "mha": mem_cache / "pool_host" / "mha.py",
        "mla": mem_cache / "pool_host" / "mla.py",
        "base": mem_cache / "pool_host" / "base.py",
        "common": mem_cache / "pool_host" / "common.py",
        "hicache_nixl": mem_cache / "storage" / "nixl" / "hicache_nixl.py",
        "cache_controller": mem_cache.parent / "managers" / "cache_controller.py",
    }
    cites = re.findall(r"``(\w+)``(?:\s*\([^)]*\))?\s*—\s*(\w+)\.py:(\d+)(?:-(\d+))?", sp.__doc__)
    assert len(cites) >= 20
    for name, fname, start, end in cites:
        lines = files[fname].read_text().splitlines()
        lo, hi = int(start), int(end or start)
        assert name in "\n".join(lines[lo - 1 : hi]), f"{name} not at {fname}.py:{start}-{end}"


# ---------------------------------------------------------------------------------------------
# through SGLang's real storage backends
# ---------------------------------------------------------------------------------------------


def _storage_config(kind, layout, extra):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=(kind == "mla"), enable_storage_metrics=False,
        is_page_first_layout=(layout == "page_first"), model_name="test/model", extra_config=extra,
    )


KEYS = [f"{i:064x}" for i in range(1, 5)]


@pytest.mark.parametrize("kind,layout", [c for c in CASES if c[1] != "page_head"])
def test_hicache_file_generic_path_round_trip(kind, layout, tmp_path, monkeypatch):
    """The controller's generic page path (_generic_page_set / _generic_page_get) with HiCacheFile."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    src, dst = small_pool(kind, layout, seed=11), small_pool(kind, layout, seed=12)
    # 0.5.23 takes the directory from the injected extra-config key, 0.5.17 only from the argument
    backend = HiCacheFile(_storage_config(kind, layout, {"file_storage_path": str(tmp_path)}), str(tmp_path))
    backend.register_mem_pool_host(src)
    ps = src.page_size
    pages, dpages = [1, 2, 4, 0], [3, 0, 1, 4]
    assert backend.batch_set(KEYS, [src.get_data_page(p * ps) for p in pages])
    assert backend.batch_exists(KEYS + ["f" * 64]) == len(KEYS)
    got = backend.batch_get(KEYS, [dst.get_dummy_flat_data_page() for _ in KEYS])
    for data, q in zip(got, dpages):
        dst.set_from_flat_data_page(q * ps, data)
    for p, q in zip(pages, dpages):
        assert page_flat_bytes(src, p) == page_flat_bytes(dst, q)


@pytest.mark.parametrize("kind,layout", [c for c in CASES if c[1] != "page_head"])
@pytest.mark.parametrize("direct_io", [True, False], ids=["odirect", "buffered"])
def test_hicache_nixl_v1_round_trip(kind, layout, direct_io, tmp_path, monkeypatch):
    """HiCacheNixl (POSIX plugin) batch_set_v1 / batch_get_v1 against the mimic pools: zero-copy
    for page_first*, bounce buffers for layer_first."""
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    pytest.importorskip("nixl", reason="HiCacheNixl imports `nixl` (the nixl==1.5.1 meta package)")
    monkeypatch.setenv("SGLANG_HICACHE_NIXL_BACKEND_PLUGIN", "POSIX")
    monkeypatch.setenv("SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR", str(tmp_path))
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = {"l3_cleaner_enabled": False, "use_direct_io": direct_io}
    src, dst = small_pool(kind, layout, seed=21), small_pool(kind, layout, seed=22)
    if direct_io:  # O_DIRECT needs 4 KiB-aligned pages: use a page big enough
        geo = dict(layer_num=4, head_num=8, head_dim=128) if kind == "mha" else dict(layer_num=4, head_num=1, head_dim=512)
        src = make_host_pool(kind, layout, page_size=16, dtype=torch.bfloat16, num_pages=5, fill=True, seed=21, **geo)
        dst = make_host_pool(kind, layout, page_size=16, dtype=torch.bfloat16, num_pages=5, fill=True, seed=22, **geo)
    writer = StorageBackendFactory.create_backend("nixl", _storage_config(kind, layout, dict(extra)), src)
    try:
        writer.register_mem_pool_host(src)
        assert writer.is_zero_copy == (layout != "layer_first")
        pages, dpages = [1, 2, 4, 0], [3, 0, 1, 4]
        assert writer.batch_set_v1(KEYS, host_indices_for_pages(src, pages)) == [True] * 4
        assert writer.batch_exists(KEYS + ["f" * 64]) == len(KEYS)
    finally:
        writer.close()
    reader = StorageBackendFactory.create_backend("nixl", _storage_config(kind, layout, dict(extra)), dst)
    try:
        reader.register_mem_pool_host(dst)
        untouched = page_flat_bytes(dst, 2)
        assert reader.batch_get_v1(KEYS, host_indices_for_pages(dst, dpages)) == [True] * 4
        for p, q in zip(pages, dpages):
            assert page_flat_bytes(src, p) == page_flat_bytes(dst, q)
        assert page_flat_bytes(dst, 2) == untouched
    finally:
        reader.close()
