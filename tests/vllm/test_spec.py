"""The spec loads from vLLM's config, reads hicache-gds settings, and namespaces the engine."""

from __future__ import annotations

import dataclasses

import pytest
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from hicache_gds import ConfigError
from hicache_gds_vllm import HiCacheGDSOffloadingSpec, compat
from hicache_gds_vllm.spec import engine_identity, hicache_config
from hicache_gds_vllm.testing import offloading_config

BASE_EXTRA = {"spec_name": "HiCacheGDSOffloadingSpec", "spec_module_path": "hicache_gds_vllm",
              "blocks_per_chunk": 4, "offload_prompt_only": True}


def make_config(extra: dict, **kw) -> OffloadingConfig:
    """An OffloadingConfig as vLLM builds it for Llama-3-8B (32 layers, 64 KiB pages, 16-token blocks)."""
    return offloading_config(extra, **kw)


def test_factory_loads_spec_from_extra_config(gds_dir):
    spec = OffloadingSpecFactory.create_spec(make_config({**BASE_EXTRA, "gds_path": gds_dir, "capacity": "1G"}))
    assert isinstance(spec, HiCacheGDSOffloadingSpec)
    assert spec.hicache.gds_path == (gds_dir,)
    assert spec.blocks_per_chunk == 4
    assert spec.capacity_chunks == (1 << 30) // (32 * 64 * 1024 * 4)


def test_extra_config_overrides_env_and_accepts_env_spellings(gds_dir, tmp_path):
    env = {"GDS_PATH": str(tmp_path), "ENABLE_GDS": "1", "HICACHE_GDS_VERIFY": "0"}
    cfg = hicache_config({**BASE_EXTRA, "GDS_PATH": gds_dir, "enable_gds": "0", "HICACHE_GDS_IO_THREADS": 4}, env=env)
    assert cfg.gds_path == (gds_dir,) and cfg.sources["gds_path"] == "config"
    assert cfg.enable_gds == "0" and cfg.io_threads == 4
    assert cfg.verify is False and cfg.sources["verify"] == "env"  # not in extra: env applies


def test_unknown_extra_key_is_a_config_error(gds_dir):
    with pytest.raises(ConfigError, match="no_such_key"):
        hicache_config({**BASE_EXTRA, "gds_path": gds_dir, "no_such_key": 1}, env={})


def test_missing_gds_path_fails_at_construction(monkeypatch):
    monkeypatch.delenv("GDS_PATH", raising=False)
    with pytest.raises(ConfigError, match="GDS_PATH"):
        HiCacheGDSOffloadingSpec(make_config(dict(BASE_EXTRA)))


def test_identity_separates_what_changes_the_bytes():
    base = engine_identity(make_config(BASE_EXTRA))
    assert engine_identity(make_config(BASE_EXTRA, rank=0)) == engine_identity(make_config(BASE_EXTRA, rank=0))
    for other in (make_config(BASE_EXTRA, dtype="float16"), make_config(BASE_EXTRA, world_size=2),
                  make_config(BASE_EXTRA, model="other"), make_config({**BASE_EXTRA, "blocks_per_chunk": 2})):
        assert engine_identity(other) != base
    assert base["kv_handoff"] == compat.KV_HANDOFF
    # The scheduler (rank 0) and a worker of rank 3 share the engine identity; ranks differ per store.
    assert engine_identity(make_config(BASE_EXTRA, rank=3, world_size=4)) == \
        engine_identity(make_config(BASE_EXTRA, rank=0, world_size=4))


def test_scheduler_and_workers_agree_on_capacity_from_free_space(gds_dir):
    import os
    # A fraction that gives each of 2 ranks about 8 chunks on whatever disk runs the test: a fixed
    # fraction holds no chunk where free space is small (CI's /tmp has a few GB).
    st = os.statvfs(gds_dir)
    free, chunk = st.f_bavail * st.f_frsize, 32 * 64 * 1024 * BASE_EXTRA["blocks_per_chunk"]
    if free < 32 * chunk:
        pytest.skip(f"{free} bytes free under {gds_dir}: too little for a capacity from free space")
    # max_fill 1: a shared disk may already be fuller than the default ceiling; agreement is tested here
    extra = {**BASE_EXTRA, "gds_path": gds_dir, "capacity_fraction": 16 * chunk / free, "max_fill": 1.0}
    first = HiCacheGDSOffloadingSpec(make_config(extra, world_size=2))
    worker = HiCacheGDSOffloadingSpec(make_config(extra, rank=1, world_size=2))
    assert first.spec_id == worker.spec_id
    assert first.capacity_chunks == worker.capacity_chunks > 0  # recorded once, not re-measured


def test_explicit_capacity_too_small_is_an_error(gds_dir):
    with pytest.raises(ConfigError, match="capacity"):
        HiCacheGDSOffloadingSpec(make_config({**BASE_EXTRA, "gds_path": gds_dir, "capacity": "1M"}))


def test_specs_are_small_and_picklable():
    import pickle

    from hicache_gds_vllm import HiCacheLoadSpec, HiCacheStoreSpec
    s = pickle.loads(pickle.dumps(HiCacheStoreSpec(["ab" * 18], ["cd" * 18], True)))
    assert (s.keys, s.drops, s.clear) == (["ab" * 18], ["cd" * 18], True)
    assert pickle.loads(pickle.dumps(HiCacheLoadSpec(["ef"]))).keys == ["ef"]
    assert dataclasses.is_dataclass(make_config(BASE_EXTRA))
