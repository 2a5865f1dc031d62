"""SGLang's backend over the remote tier, unchanged: `remote_url` in the extra config is all it takes."""

import os
import sys
import uuid

import pytest

try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    import torch
    import hicache_gds_sglang  # noqa: F401
except Exception as exc:  # noqa: BLE001
    pytest.skip(f"SGLang or hicache-gds-sglang is not importable ({type(exc).__name__})", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sglang"))
import sgl_helpers as h  # noqa: E402


@pytest.mark.parametrize("mode", ["remote", "both"])
def test_hicache_gds_through_the_remote_tier(cluster, gds_dir, mode):
    pool = h.make_pool("mha", "page_first", pages=32, seed=11)
    extra = {"remote_url": cluster["url"], "remote_prefix": cluster["prefix"], "tier_mode": mode,
             "namespace": uuid.uuid4().hex}
    b = h.attach(h.storage_config(gds_dir, extra=extra), pool)
    try:
        ks = h.keys(8, tag=mode)
        assert b.batch_set_v1(ks, h.indices(range(8))) == [True] * 8
        assert b.batch_exists(ks) == 8
        h.poison(pool, range(8, 16))
        assert b.batch_get_v1(ks, h.indices(range(8, 16))) == [True] * 8
        assert h.same_pages(pool, list(range(8)), pool, list(range(8, 16)))
        st = b._bindings["kv"].store.stats()
        assert st["engine"] == "tiered" and st["mode"] == mode and "remote" in st
        assert ("local" in st) == (mode == "both")  # "remote": the pages live only in the servers' DRAM
    finally:
        b.close()
