"""`StoreTests` against the tiered store, opened by `open_store` because ``remote_url`` is
configured: local NVMe and three real page servers behind a real redis-server."""

from __future__ import annotations

import pytest
from remote_procs import PAGE

from hicache_gds import TieredStore, open_store
from hicache_gds.testing import StoreTests


class TestTieredStore(StoreTests):
    page_bytes = PAGE
    n_pages = 8

    @pytest.fixture(autouse=True)
    def _cluster(self, cluster):
        self.cluster = cluster

    def open_store(self, gds_dir):
        cfg = {"gds_path": gds_dir, "capacity": 24 * PAGE, "engine": "bounce", "remote_url": self.cluster["url"],
               "remote_prefix": self.cluster["prefix"], "remote_timeout": 1.0, "io_timeout": 10}
        s = open_store(PAGE, {"conformance": gds_dir}, config=cfg)
        assert type(s) is TieredStore
        return s
