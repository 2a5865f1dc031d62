"""Keys and namespaces: HiCacheFile's suffixes exactly; identities that separate what must differ."""

import itertools

import pytest
from sglang.srt.mem_cache.hicache_storage import HiCacheFile

from hicache_gds_sglang.naming import SGLANG_KEYS, KeyScheme, namespace_identity
from sgl_helpers import storage_config

TOPOLOGIES = [dict(tp_rank=t, tp_size=ts, pp_rank=p, pp_size=ps, attn_cp_rank=c, attn_cp_size=cs)
              for (t, ts), (p, ps), (c, cs) in itertools.product([(0, 1), (3, 4)], [(0, 1), (1, 2)], [(0, 1), (1, 2)])]


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("topo", TOPOLOGIES)
def test_suffixes_are_hicache_files(tmp_path, mla, topo):
    sc = storage_config(None, extra={"file_storage_path": str(tmp_path)}, is_mla_model=mla, **topo)
    ref = HiCacheFile(sc)
    ours = KeyScheme.from_storage_config(sc)
    assert (ours.config_suffix, ours.tp_config_suffix) == (ref.config_suffix, ref.tp_config_suffix)
    key = "ab" * 32
    assert ours.key(key) == ref._get_suffixed_key(key)
    assert ours.key(key, "mamba") == ref._get_component_key(key, "mamba")
    assert ours.key(key, "swa") == ref._get_component_key(key, "swa")
    assert ours.keys([key], "swa") == [ours.key(key, "swa")]


def test_dcp_suffix_is_hicache_files(tmp_path):
    sc = storage_config(None, extra={"file_storage_path": str(tmp_path)}, is_mla_model=True, tp_rank=1, tp_size=4,
                        dcp_size=2, dcp_rank=1, logical_page_size=64)
    ref, ours = HiCacheFile(sc), KeyScheme.from_storage_config(sc)
    assert (ours.config_suffix, ours.tp_config_suffix) == (ref.config_suffix, ref.tp_config_suffix)


def test_identities_separate_ranks_except_mla_tp_and_dp_and_include_the_geometry():
    geo = {"kind": "mha", "page_order": "token_major", "dtype": "torch.bfloat16", "page_size": 16}

    def ident(mla=False, pool="kv", g=None, **kw):
        sc = storage_config(None, is_mla_model=mla, **kw)
        return namespace_identity(KeyScheme.from_storage_config(sc), sc, pool, g or geo)

    assert ident(tp_rank=0, tp_size=2) != ident(tp_rank=1, tp_size=2)
    assert ident(True, tp_rank=0, tp_size=2) == ident(True, tp_rank=1, tp_size=2)  # MLA: one shared copy
    assert ident(True, "mamba", tp_rank=0, tp_size=2) != ident(True, "mamba", tp_rank=1, tp_size=2)
    assert ident(pp_rank=0, pp_size=2) != ident(pp_rank=1, pp_size=2)
    assert ident(dp_rank=0) == ident(dp_rank=1)  # DP replicas share one namespace
    assert ident() != ident(pool="swa")
    assert ident() != ident(g=dict(geo, page_order="layer_major"))
    assert ident() != ident(g=dict(geo, dtype="torch.float8_e4m3fn"))
    assert ident() != ident(model_name="other/model")


def test_sglang_keys_cover_what_the_controller_and_loader_pass():
    for k in ("backend_name", "module_path", "class_name", "interface_v1", "file_storage_path",
              "prefetch_threshold", "hicache_storage_pass_prefix_keys", "tp_lcm_size"):
        assert k in SGLANG_KEYS
