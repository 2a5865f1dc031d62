import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def gds_dir(tmp_path):
    """A directory on a real (O_DIRECT-capable) file system for GDS_PATH."""
    d = tmp_path / "gds"
    d.mkdir()
    return str(d)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("HICACHE_GDS_") or k in ("ENABLE_GDS", "GDS_PATH"):
            monkeypatch.delenv(k, raising=False)
