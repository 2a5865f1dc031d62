"""Keys and namespaces: HiCacheFile's suffixes exactly; identities that separate what must differ."""

import itertools

import pytest
from sglang.srt.mem_cache.hicache_storage import HiCacheFile

from hicache_gds_sglang.naming import SGLANG_KEYS, KeyScheme, namespace_identity
from sgl_helpers import dp_group, needs_dcp, storage_config

TOPOLOGIES = [dict(tp_rank=t, tp_size=ts, pp_rank=p, pp_size=ps, attn_cp_rank=c, attn_cp_size=cs)
              for (t, ts), (p, ps), (c, cs) in itertools.product([(0, 1), (3, 4)], [(0, 1), (1, 2)], [(0, 1), (1, 2)])]


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("topo", TOPOLOGIES)
def test_suffixes_are_hicache_files(tmp_path, mla, topo):
    sc = storage_config(None, extra={"file_storage_path": str(tmp_path)}, is_mla_model=mla, **topo)
    ref = HiCacheFile(sc, str(tmp_path))
    ours = KeyScheme.from_storage_config(sc)
    key = "ab" * 32
    assert ours.config_suffix == ref.config_suffix
    assert ours.key(key) == ref._get_suffixed_key(key)
    assert ours.key(key, "swa") == ref._get_component_key(key, "swa")
    assert ours.keys([key], "swa") == [ours.key(key, "swa")]
    if hasattr(ref, "tp_config_suffix") or not mla:  # 0.5.23; 0.5.17 MHA: one suffix for everything
        assert ours.tp_config_suffix == getattr(ref, "tp_config_suffix", ref.config_suffix)
        assert ours.key(key, "mamba") == ref._get_component_key(key, "mamba")
    else:
        # 0.5.17's HiCacheFile keys MLA Mamba state without the TP rank, though every TP rank writes
        # its own shard of it; ours keeps the rank (0.5.23's rule): the suffix of this rank's MHA keys.
        assert ref._get_component_key(key, "mamba") == f"{key}.mamba{ref.config_suffix}"
        mha_ref = HiCacheFile(storage_config(None, is_mla_model=False, **topo), str(tmp_path))
        assert ours.tp_config_suffix == mha_ref.config_suffix != ours.config_suffix
        assert ours.key(key, "mamba") == f"{key}.mamba{ours.tp_config_suffix}"


@needs_dcp
def test_dcp_suffix_is_hicache_files(tmp_path):
    sc = storage_config(None, extra={"file_storage_path": str(tmp_path)}, is_mla_model=True, tp_rank=1, tp_size=4,
                        dcp_size=2, dcp_rank=1, logical_page_size=64)
    ref, ours = HiCacheFile(sc, str(tmp_path)), KeyScheme.from_storage_config(sc)
    assert (ours.config_suffix, ours.tp_config_suffix) == (ref.config_suffix, ref.tp_config_suffix)


def test_identities_separate_ranks_except_mla_tp_and_dp_and_include_the_geometry(monkeypatch):
    geo = {"kind": "mha", "page_order": "token_major", "dtype": "torch.bfloat16", "page_size": 16}

    def ident(mla=False, pool="kv", g=None, dp=None, **kw):
        if dp is not None:
            kw.update(dp_group(monkeypatch, dp))
        sc = storage_config(None, is_mla_model=mla, **kw)
        return namespace_identity(KeyScheme.from_storage_config(sc), pool, g or geo)

    assert ident(tp_rank=0, tp_size=2) != ident(tp_rank=1, tp_size=2)
    assert ident(True, tp_rank=0, tp_size=2) == ident(True, tp_rank=1, tp_size=2)  # MLA: one shared copy
    assert ident(True, "mamba", tp_rank=0, tp_size=2) != ident(True, "mamba", tp_rank=1, tp_size=2)
    assert ident(pp_rank=0, pp_size=2) != ident(pp_rank=1, pp_size=2)
    assert ident(dp=0) == ident(dp=1)  # DP replicas share one namespace (0.5.17: DP rank from SGLang's state)
    assert ident(True, dp=0) == ident(True, dp=1)
    assert ident() != ident(pool="swa")
    assert ident() != ident(g=dict(geo, page_order="layer_major"))
    assert ident() != ident(g=dict(geo, dtype="torch.float8_e4m3fn"))
    assert ident() != ident(model_name="other/model")


def test_sglang_keys_cover_what_the_controller_and_loader_pass():
    for k in ("backend_name", "module_path", "class_name", "interface_v1", "file_storage_path",
              "prefetch_threshold", "hicache_storage_pass_prefix_keys", "tp_lcm_size", "prefetch_timeout_max"):
        assert k in SGLANG_KEYS
