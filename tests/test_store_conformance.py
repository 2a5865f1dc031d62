"""`StoreTests` (the conformance suite shipped in `hicache_gds.testing`) against the stores that
`open_store` opens: read-write (`PageStore`) and read-only (`PageReader`); the tiered store runs it
in tests/remote/test_tiered_conformance.py."""

from __future__ import annotations

from hicache_gds import PageReader, PageStore, open_store
from hicache_gds.testing import StoreTests

IDENT = {"model": "conformance"}


def _cfg(gds_dir: str) -> dict:
    return {"gds_path": gds_dir, "capacity": 48 * (64 << 10), "engine": "bounce"}


class TestPageStore(StoreTests):
    def open_store(self, gds_dir):
        s = open_store(self.page_bytes, IDENT, config=_cfg(gds_dir))
        assert type(s) is PageStore
        return s


class TestPageReader(StoreTests):
    read_only = True

    def open_store(self, gds_dir):
        s = open_store(self.page_bytes, IDENT, config=_cfg(gds_dir), read_only=True)
        assert type(s) is PageReader
        return s

    def open_writer(self, gds_dir):
        return open_store(self.page_bytes, IDENT, config=_cfg(gds_dir))
