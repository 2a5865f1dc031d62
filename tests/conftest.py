import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def gds_dir(tmp_path, monkeypatch):
    """A directory on a real (O_DIRECT-capable) file system for GDS_PATH. The disk it is on is
    shared and may already be fuller than the default `max_fill` (90 %), which would make each
    new namespace weigh removing the test's idle ones: the ceiling is 1 here (this process and the
    ones it starts), and is tested on tmpfs mounts sized for it (`test_budget`, `test_capacity`)."""
    monkeypatch.setenv("HICACHE_GDS_MAX_FILL", "1")
    d = tmp_path / "gds"
    d.mkdir()
    return str(d)


@pytest.fixture(autouse=True)
def _no_slabs_left(request):
    """Slab files are the bulk of a test's bytes (preallocated): remove those under the test's
    tmp_path even when it fails, so a failing run keeps the small files worth reading (index,
    logs, namespace.json) and not gigabytes. (pytest removes a passing test's whole tmp_path.)"""
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if tmp is None:
        return
    for d, _dirs, files in os.walk(tmp):
        for f in files:
            if f == "slab.bin":
                try:
                    os.unlink(os.path.join(d, f))
                except OSError:
                    pass


# The remote tier's tests run page servers and clients on this machine only: UCX on loopback, set
# for this process and every server it starts (outside tests a page server must be told its devices).
os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("HICACHE_GDS_") or k in ("ENABLE_GDS", "GDS_PATH"):
            monkeypatch.delenv(k, raising=False)
    # An adapter's read-rate probe at open writes and reads 256 MiB by default: 8 MiB per backend
    # here (hundreds of backends are opened), the same code path.
    monkeypatch.setenv("HICACHE_GDS_READ_PROBE", "8M")
