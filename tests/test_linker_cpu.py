"""GDSLinker and its gather/scatter on CPU: IO planning, the copy kernels against a naive loop, and the
whole linker (offload, layer-wise load, bookkeeping) over a CPU "device" pool and a host engine.

Runs without SGLang (.venv: the linker uses its stand-in base and counter) and with it (.venv-sgl:
SGLang's real ``UnifiedCacheLinker`` / ``LayerWiseLoadCounter``, and SGLang's own linker factory).
"""

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_ROOT, "plugins", "sglang"))

from hicache_gds import ConfigError  # noqa: E402
from hicache_gds_sglang.gather import (DevicePages, SegmentTable, gather_pages, plan_io,  # noqa: E402
                                       scatter_pages, triton_available)
from hicache_gds_sglang.linker import GDSLinker  # noqa: E402

import linker_helpers as lh  # noqa: E402

KiB = 1 << 10


def _mha_table(layers, heads, dim, itemsize, page):
    row = heads * dim * itemsize
    return SegmentTable((row,) * (2 * layers), page, tuple((ly, layers + ly) for ly in range(layers)))


def _mla_table(layers, dim, itemsize, page):
    return SegmentTable((dim * itemsize,) * layers, page, tuple((ly,) for ly in range(layers)))


# -- planning ---------------------------------------------------------------------------------


def test_llama_16_token_pages_gather_in_groups_of_8_layers():
    t = _mha_table(32, 8, 128, 2, 16)  # 32 KiB segments, 2 MiB pages
    plan = plan_io(t, [0] * 64)
    assert plan.mode == "gather" and len(plan.groups) == 4
    g = plan.groups[1]
    assert g.layers == tuple(range(8, 16))
    assert g.runs == ((8 * 32 * KiB, 256 * KiB), ((32 + 8) * 32 * KiB, 256 * KiB))
    assert g.segments == tuple(range(8, 16)) + tuple(range(40, 48))
    assert g.stage_offsets == tuple(i * 32 * KiB for i in range(16)) and g.stage_bytes == 512 * KiB


def test_large_aligned_segments_go_direct_one_layer_at_a_time():
    t = _mha_table(32, 8, 128, 2, 128)  # 256 KiB segments
    plan = plan_io(t, [1 << 30] * 64)
    assert plan.mode == "direct" and len(plan.groups) == 32
    assert plan.groups[3].segments == (3, 35) and plan.groups[3].runs == ((3 * 256 * KiB, 256 * KiB),
                                                                          (35 * 256 * KiB, 256 * KiB))


@pytest.mark.parametrize("why, kwargs", [
    ("misaligned buffer", dict(base_addrs=[512] + [0] * 63)),
    ("descriptor limit", dict(base_addrs=[0] * 64, max_descs=32)),
    ("threshold", dict(base_addrs=[0] * 64, gather_below=512 * KiB)),
])
def test_direct_needs_size_alignment_and_descriptor_room(why, kwargs):
    plan = plan_io(_mha_table(32, 8, 128, 2, 128), kwargs.pop("base_addrs"), **kwargs)
    assert plan.mode == "gather", why


def test_deepseek_mla_groups_allow_a_short_last_group():
    t = _mla_table(61, 576, 2, 64)  # 72 KiB segments
    plan = plan_io(t, [0] * 61)
    assert plan.mode == "gather" and [len(g.layers) for g in plan.groups] == [4] * 15 + [1]
    assert all(o % 4096 == 0 and n % 4096 == 0 for g in plan.groups for o, n in g.runs)
    plan = plan_io(t, [0] * 61, read_run=1 << 20)  # grown towards 1 MiB runs: 15 layers x 72 KiB
    assert [len(g.layers) for g in plan.groups] == [15] * 4 + [1]


def test_read_run_grows_64_token_groups_to_1_mib_runs_keeping_four_groups():
    t = _mha_table(32, 8, 128, 2, 64)  # 128 KiB segments, 8 MiB pages
    assert [len(g.layers) for g in plan_io(t, [0] * 64).groups] == [2] * 16  # default: 256 KiB runs
    plan = plan_io(t, [0] * 64, read_run=1 << 20)
    assert plan.mode == "gather" and [len(g.layers) for g in plan.groups] == [8] * 4
    assert plan.groups[0].runs == ((0, 1024 * KiB), (32 * 128 * KiB, 1024 * KiB))
    # never fewer than MIN_GROUPS groups for the sake of longer runs; never below gather_below
    assert len(plan_io(t, [0] * 64, read_run=64 << 20).groups) == 4
    assert [len(g.layers) for g in plan_io(t, [0] * 64, read_run=0).groups] == [2] * 16
    assert all(o % 4096 == 0 and n % 4096 == 0 for g in plan.groups for o, n in g.runs)


def test_unaligned_pages_read_whole_slots():
    t = _mla_table(61, 576, 2, 1)  # 70272-byte pages
    plan = plan_io(t, [0] * 61)
    assert plan.groups == plan.groups[:1] and plan.groups[0].runs == ((0, 73728),)
    assert plan.groups[0].stage_offsets == t.offsets


@pytest.mark.parametrize("seed", range(40))
def test_every_plan_covers_each_layer_once_with_aligned_runs(seed):
    rng = np.random.default_rng(seed)
    layers, page = int(rng.integers(1, 40)), int(rng.choice([1, 2, 16, 64, 128]))
    kind = rng.choice(["mha", "mla"])
    t = _mha_table(layers, int(rng.integers(1, 9)), 128, int(rng.choice([1, 2])), page) if kind == "mha" \
        else _mla_table(layers, 576, int(rng.choice([1, 2])), page)
    plan = plan_io(t, [0] * len(t.row_bytes), gather_below=int(rng.choice([4, 64, 256, 1024])) * KiB)
    assert [ly for g in plan.groups for ly in g.layers] == list(range(layers))
    for g in plan.groups:
        assert sorted(g.segments) == sorted(s for ly in g.layers for s in t.layers[ly])
        assert all(o % 4096 == 0 and n % 4096 == 0 for o, n in g.runs)
        for s, so in zip(g.segments, g.stage_offsets):  # each segment lies inside one run, at its place
            hits, acc = [], 0
            for o, n in g.runs:
                if o <= t.offsets[s] and t.offsets[s] + t.seg_bytes[s] <= o + n:
                    hits.append(acc + t.offsets[s] - o)
                acc += n
            assert hits == [so]


# -- gather / scatter -------------------------------------------------------------------------


def _naive_gather(buffers, starts, page, offsets, segments, width):
    out = np.zeros((len(starts), width), dtype=np.uint8)
    for i, r in enumerate(starts):
        for s, off in zip(segments, offsets):
            raw = buffers[s].reshape(buffers[s].shape[0], -1).view(torch.uint8).numpy()
            for k in range(page):
                row = raw[r + k]
                out[i, off + k * row.size: off + (k + 1) * row.size] = row
    return out


@pytest.mark.parametrize("kind, dtype, page", [("mha", torch.bfloat16, 16), ("mha", torch.float16, 1),
                                               ("mha", torch.float8_e4m3fn, 4), ("mla", torch.bfloat16, 2)])
def test_gather_reference_equals_a_naive_loop_and_scatter_inverts_it(kind, dtype, page):
    pool = lh.make_pool(kind, pages=12, page_size=page, dtype=dtype, layers=3, heads=2, head_dim=64, kv_cache_dim=96)
    lh.fill_random(pool, 1)
    dev = DevicePages(pool, page)
    bufs = pool.buffers()
    starts = torch.tensor([5, 0, 11, 3]) * page
    segments = [len(bufs) - 1, 0, 2]  # any subset, any order
    sizes = [dev.table.seg_bytes[s] for s in segments]
    offsets = list(np.cumsum([0] + sizes[:-1]) + 64)
    width = offsets[-1] + sizes[-1] + 32
    stage = torch.zeros((4, width), dtype=torch.uint8)
    gather_pages(bufs, starts, page, stage, offsets, segments, impl="torch")
    assert np.array_equal(stage.numpy(), _naive_gather(bufs, starts.tolist(), page, offsets, segments, width))
    before = [b.clone() for b in bufs]
    for s in segments:
        bufs[s].view(torch.uint8).zero_()
    scatter_pages(bufs, starts, page, stage, offsets, segments, impl="torch")
    rows = torch.cat([torch.arange(r, r + page) for r in starts.tolist()])
    for s in segments:
        assert torch.equal(bufs[s][rows].view(torch.uint8), before[s][rows].view(torch.uint8))


def test_gather_refuses_a_staging_row_too_short():
    pool = lh.make_pool("mha", pages=4, page_size=4)
    with pytest.raises(ValueError, match="overruns"):
        gather_pages(pool.buffers(), torch.tensor([0]), 4, torch.zeros((1, 100), dtype=torch.uint8), [0], [0])


_TRITON_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])
import linker_helpers as lh
from hicache_gds_sglang.gather import DevicePages, gather_pages, scatter_pages
for kind, dtype, page in (("mha", torch.bfloat16, 4), ("mla", torch.float8_e4m3fn, 1), ("mha", torch.float16, 3)):
    pool = lh.make_pool(kind, pages=6, page_size=page, dtype=dtype, layers=2, heads=1, head_dim=8, kv_cache_dim=20)
    lh.fill_random(pool, 3)
    t = DevicePages(pool, page).table
    starts = torch.tensor([4, 1, 5]) * page
    offs = [o + 8 for o in t.offsets]
    a = torch.zeros((3, t.page_bytes + 16), dtype=torch.uint8); b = a.clone()
    gather_pages(pool.buffers(), starts, page, a, offs, impl="torch")
    gather_pages(pool.buffers(), starts, page, b, offs, impl="triton")
    assert torch.equal(a, b), (kind, page)
    for x in pool.buffers(): x.view(torch.uint8).zero_()
    scatter_pages(pool.buffers(), starts, page, b, offs, impl="triton")
    c = torch.zeros_like(a); gather_pages(pool.buffers(), starts, page, c, offs, impl="torch")
    assert torch.equal(a, c), (kind, page)
print("ok")
"""


@pytest.mark.skipif(not triton_available(), reason="triton is not installed in this venv (.venv-sgl has it)")
def test_triton_kernel_matches_the_reference_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, os.path.join(_ROOT, "plugins", "sglang"),
                          os.path.dirname(__file__)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


# -- the linker over a CPU pool ---------------------------------------------------------------


def _linker(pool, gds_dir, **extra):
    cfg = {"gds_path": gds_dir, "capacity": "32M", **extra}
    return GDSLinker(lh.server_args(), lh.make_params(pool), components=None, extra_config=cfg)


def _keys(n, tag="k"):
    return [f"{tag}{i:063x}"[:64] for i in range(n)]


@pytest.mark.parametrize("kind, dtype, page, extra", [
    ("mha", torch.bfloat16, 16, {}), ("mha", torch.float8_e4m3fn, 1, {}), ("mla", torch.bfloat16, 16, {}),
    ("mla", torch.float16, 1, {}), ("mha", torch.bfloat16, 16, {"gather_below": 4096}),
    ("mha", torch.float16, 4, {"engine": "bounce"}), ("mha", torch.bfloat16, 16, {"staging_bytes": "40K"}),
    ("mla", torch.bfloat16, 16, {"staging_bytes": "40K", "gather_below": 4096})])
def test_offload_then_layer_wise_load_is_byte_exact(gds_dir, kind, dtype, page, extra):
    pool = lh.make_pool(kind, pages=40, page_size=page, dtype=dtype)
    lh.fill_random(pool, 7)
    src, dst = [3, 9, 1, 20, 7, 15], [30, 31, 25, 26, 38, 33]
    keys = _keys(len(src))
    with_lk = _linker(pool, gds_dir, **extra)
    try:
        assert with_lk.offload([lh.kv_transfer(keys, lh.page_indices(src, page))])
        assert lh.wait_offloads(with_lk, 1) == [True]
        assert with_lk.lookup("r", [lh.kv_transfer(keys + _keys(2, "z"))]) == list(range(1, 7))
        order = []
        assert lh.run_load(with_lk, pool, "r", keys, dst, on_layer=order.append)
        for s, d in zip(src, dst):
            assert torch.equal(lh.page_bytes(pool, s), lh.page_bytes(pool, d))
        st = with_lk.stats()
        assert st["load_pages"] == 6 and st["offload_pages"] == 6 and st["path"] and st["mode"] in ("direct", "gather")
    finally:
        with_lk.close()


def test_layers_complete_in_order_and_one_group_at_a_time(gds_dir):
    pool = lh.make_pool("mha", pages=24, page_size=16, layers=8, heads=2, head_dim=128)  # 8 KiB segments
    lh.fill_random(pool, 2)
    lk = _linker(pool, gds_dir, gather_below=16 * 1024)  # groups of 2 layers
    try:
        assert [g.layers for g in lk.plan.groups] == [(0, 1), (2, 3), (4, 5), (6, 7)]
        done = []
        real = lk.layer_done_counter.complete
        lk.layer_done_counter.complete = lambda i, layer: (done.append(layer), real(i, layer))
        keys = _keys(10)
        lk.offload([lh.kv_transfer(keys, lh.page_indices(range(10), 16))])
        assert lh.wait_offloads(lk, 1) == [True]
        assert lh.run_load(lk, pool, "r", keys, range(12, 22))
        assert done == list(range(8))
    finally:
        lk.close()


def test_a_page_evicted_after_lookup_fails_the_batch_and_never_hangs(gds_dir):
    pool = lh.make_pool("mha", pages=16, page_size=4)
    lk = _linker(pool, gds_dir)
    try:
        keys = _keys(4)
        lk.offload([lh.kv_transfer(keys, lh.page_indices(range(4), 4))])
        assert lh.wait_offloads(lk, 1) == [True]
        lk.store.delete(lk.scheme.keys(keys[2:3]))
        t0 = time.monotonic()
        assert not lh.run_load(lk, pool, "r", keys, range(8, 12))
        assert time.monotonic() - t0 < 10 and lk.stats()["load_failures"] == 1
        assert lk.store.index.stats()["pinned_slots"] == 0
    finally:
        lk.close()


def test_bookkeeping_queue_cancel_results_reset(gds_dir):
    pool = lh.make_pool("mla", pages=16, page_size=4)
    lk = _linker(pool, gds_dir)
    try:
        keys = _keys(3)
        idx = lh.page_indices([0, 1, 2], 4)
        assert not lk.load("a", [lh.kv_transfer(keys, idx[:-1])])  # not whole pages
        assert not lk.load("a", [lh.kv_transfer([], idx)]) and not lk.load("a", [])
        assert lk.load("a", [lh.kv_transfer(keys, idx)])
        with pytest.raises(RuntimeError, match="already queued"):
            lk.load("a", [lh.kv_transfer(keys, idx)])
        assert lk.cancel_queued_load("a") and not lk.cancel_queued_load("a")
        assert lk.start_layer_wise_loading() == -1
        assert not lk.offload([lh.kv_transfer(keys)])  # no device indices
        for i in range(3):  # results come back one per accepted offload, in order
            assert lk.offload([lh.kv_transfer(keys[i:i + 1], idx[4 * i:4 * i + 4])])
        assert lk.offload([lh.kv_transfer(keys, lh.page_indices([5], 4))])  # 3 keys, 1 page: fails
        assert lh.wait_offloads(lk, 4) == [True, True, True, False]
        assert lk.offload([lh.kv_transfer(keys, idx)])  # all present: nothing rewritten
        assert lh.wait_offloads(lk, 1) == [True] and lk.stats()["offload_pages"] == 3
        lk.offload([lh.kv_transfer(_keys(1, "n"), idx[:4])])
        lk.reset()
        assert lk.num_completed_offloads() == 0
    finally:
        lk.close()
        lk.close()


def test_two_loads_in_one_batch_and_concurrent_offloads(gds_dir):
    pool = lh.make_pool("mha", pages=64, page_size=4)
    lh.fill_random(pool, 5)
    lk = _linker(pool, gds_dir)
    try:
        a, b = _keys(8, "a"), _keys(8, "b")
        lk.offload([lh.kv_transfer(a, lh.page_indices(range(8), 4))])
        lk.offload([lh.kv_transfer(b, lh.page_indices(range(8, 16), 4))])
        assert lh.wait_offloads(lk, 2) == [True, True]
        busy = threading.Thread(target=lambda: [lk.offload([lh.kv_transfer(_keys(4, f"c{j}"),
                                                                          lh.page_indices(range(16, 20), 4))])
                                                for j in range(10)])
        busy.start()
        idx_a, idx_b = lh.page_indices(range(32, 40), 4), lh.page_indices(range(48, 56), 4)
        assert lk.load("ra", [lh.kv_transfer(a, idx_a)]) and lk.load("rb", [lh.kv_transfer(b, idx_b)])
        i = lk.start_layer_wise_loading()
        assert lk.finish_layer_wise_loading(i)
        busy.join()
        assert all(lh.wait_offloads(lk, 10))
        for s, d in zip(range(16), list(range(32, 40)) + list(range(48, 56))):
            assert torch.equal(lh.page_bytes(pool, s), lh.page_bytes(pool, d))
    finally:
        lk.close()


@pytest.mark.parametrize("change, match", [
    (lambda p: setattr(p, "kv_cache_layout", "hnd"), "NHD"),
    (lambda p: setattr(p, "k_scale_buffer", [torch.zeros(1)]), "quantized"),
])
def test_unsupported_pools_are_refused_with_the_reason(gds_dir, change, match):
    pool = lh.make_pool("mha", pages=4, page_size=4)
    change(pool)
    with pytest.raises(ConfigError, match=match):
        _linker(pool, gds_dir)


def test_unsupported_components_and_draft_pools_are_refused(gds_dir):
    pool = lh.make_pool("mha", pages=4, page_size=4)
    with pytest.raises(ConfigError, match="SWA"):
        GDSLinker(lh.server_args(), lh.make_params(pool), components={"FULL", "SWA"},
                  extra_config={"gds_path": gds_dir})
    params = lh.make_params(pool)
    params.mtp_draft_device_pools = (object(),)
    with pytest.raises(ConfigError, match="draft"):
        GDSLinker(lh.server_args(), params, extra_config={"gds_path": gds_dir})
    with pytest.raises(ConfigError, match="unknown config key"):
        _linker(pool, gds_dir, nonsense=1)


def test_unaligned_pages_get_a_padded_namespace_of_their_own(gds_dir):
    pool = lh.make_pool("mla", pages=8, page_size=1, layers=3)  # 3456-byte pages
    lk = _linker(pool, gds_dir)
    try:
        assert lk.store_page_bytes == 4096 and lk.store.identity["padded"] == "1"
        lh.fill_random(pool, 4)
        keys = _keys(3)
        lk.offload([lh.kv_transfer(keys, lh.page_indices([0, 1, 2], 1))])
        assert lh.wait_offloads(lk, 1) == [True]
        assert lh.run_load(lk, pool, "r", keys, [5, 6, 7])
        assert all(torch.equal(lh.page_bytes(pool, s), lh.page_bytes(pool, s + 5)) for s in range(3))
    finally:
        lk.close()


# -- the same pages as HiCacheGDS, and SGLang's own loader --------------------------------------


def _host_binding(kind, layout, gds_dir, page_size, layers, dtype):
    """HiCacheGDS's binding of a host pool mimic, opened as its backend does (`HiCacheGDS._bind`)."""
    from types import SimpleNamespace

    import sglang_pools
    from hicache_gds import PageStore
    from hicache_gds_sglang.naming import KeyScheme, load_config, namespace_identity
    from hicache_gds_sglang.pools import PoolBinding, describe_pool
    host = sglang_pools.make_host_pool(kind, layout, layers, 2, 128 if kind == "mha" else 576, page_size, dtype, 16,
                                       fill=True, seed=9)
    sc = SimpleNamespace(model_name=lh.server_args().served_model_name, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                         attn_cp_rank=0, attn_cp_size=1, is_mla_model=kind == "mla", dcp_size=1)
    scheme = KeyScheme.from_storage_config(sc)
    geo = describe_pool(host, "kv")
    store = PageStore(geo.page_bytes, namespace_identity(scheme, "kv", geo.identity),
                      config=load_config({"gds_path": gds_dir, "capacity": "32M"}))
    return host, PoolBinding("kv", host, geo, store, scheme)


@pytest.mark.parametrize("kind, layout", [("mha", "layer_first"), ("mha", "page_first_direct"),
                                          ("mla", "layer_first"), ("mla", "page_first_direct")])
def test_pages_are_shared_with_the_hicache_backend_both_ways(gds_dir, kind, layout):
    import sglang_pools
    page, layers = 16, 4
    host, binding = _host_binding(kind, layout, gds_dir, page, layers, torch.bfloat16)
    keys = _keys(5)
    try:
        assert all(binding.put(keys[:3], sglang_pools.host_indices_for_pages(host, [1, 4, 7])))
        ns = binding.store.stats()["namespace"]
    finally:
        binding.store.close()
    pool = lh.make_pool(kind, pages=16, page_size=page, layers=layers, heads=2, head_dim=128, kv_cache_dim=576)
    lh.fill_random(pool, 1)
    lk = _linker(pool, gds_dir)
    try:
        assert lk.stats()["namespace"] == ns
        assert lh.run_load(lk, pool, "r", keys[:3], [2, 3, 5])
        for h, d in zip([1, 4, 7], [2, 3, 5]):
            assert sglang_pools.page_flat_bytes(host, h) == lh.page_bytes(pool, d).numpy().tobytes()
        lk.offload([lh.kv_transfer(keys[3:], lh.page_indices([8, 9], page))])
        assert lh.wait_offloads(lk, 1) == [True]
    finally:
        lk.close()
    host2, binding = _host_binding(kind, layout, gds_dir, page, layers, torch.bfloat16)
    try:
        assert binding.get(keys[3:], sglang_pools.host_indices_for_pages(host2, [10, 11])) == [True, True]
        for d, h in zip([8, 9], [10, 11]):
            assert sglang_pools.page_flat_bytes(host2, h) == lh.page_bytes(pool, d).numpy().tobytes()
    finally:
        binding.store.close()


def _sglang():
    try:
        from sglang.srt.mem_cache.unified_cache import linker_factory, unified_cache_linker
        return linker_factory, unified_cache_linker
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"SGLang is not importable here ({type(exc).__name__}); run in .venv-sgl")


@pytest.mark.parametrize("module", ["hicache_gds_sglang.linker", "hicache_gds_sglang"])
def test_sglangs_dynamic_loader_builds_the_linker(gds_dir, module):
    factory, base = _sglang()
    import importlib
    if not hasattr(importlib.import_module(module), "GDSLinker"):
        pytest.skip(f"{module} does not export GDSLinker yet (see plugins/sglang/LINKER.md)")
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    pool = lh.make_pool("mha", pages=8, page_size=4)
    lk = factory.create_unified_cache_linker(
        lh.server_args(), lh.make_params(pool), backend="dynamic", components={ComponentType.FULL},
        config={"linker": "GDSLinker", "linker_module_path": module,
                "linker_extra_config": {"gds_path": gds_dir, "capacity": "16M"}})
    try:
        assert isinstance(lk, base.UnifiedCacheLinker)
        assert isinstance(lk.layer_done_counter, base.LayerWiseLoadCounter)
        assert set(lk.pools) == {"kv"}
    finally:
        lk.close()
