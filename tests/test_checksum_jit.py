"""hgc1's host block sums compiled with Numba (`hicache_gds._checksum_jit`): the same numbers as
numpy's, read-only or writable inputs, while it compiles and where it cannot."""

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from hicache_gds import _checksum_jit as J
from hicache_gds import checksum as C
from hicache_gds import pagesum

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [1, 4095, 4096, 4097, 3 * 4096 + 2, (2 << 20) + 3, 8 << 20]

pytestmark = pytest.mark.skipif(not J.wait_ready(120), reason=f"no compiled kernel: {J.engine()}")


def _numpy_sums(u8):
    return C._block_sums(u8, compiled=False)


@pytest.mark.parametrize("n", SIZES)
def test_compiled_sums_equal_numpy_on_random_pages(n):
    assert J.engine() == "numba"
    for seed in range(2):
        u8 = np.random.default_rng(seed * 7919 + n).integers(0, 256, n, dtype=np.uint8)
        want = _numpy_sums(u8)
        assert np.array_equal(C._block_sums(u8), want)
        ro = u8.copy()
        ro.setflags(write=False)  # a frombuffer view of a read-only mapping
        assert np.array_equal(C._block_sums(ro), want)
        assert C.checksum(u8) == C.checksum(u8, compiled=False)


def test_known_values_hold_compiled():
    """The on-disk definition's pinned values (tests/test_checksum.py) through the compiled kernel."""
    assert J.kernel() is not None
    assert C.checksum(bytes(range(256)) * 16) == -7646891391505940399
    assert C.checksum((bytes(range(256)) * 20)[:5000]) == -761047150193538038
    big = (bytes(range(256)) * 16) * 300  # 300 whole blocks: all of them summed by the kernel
    assert C.checksum(big) == C.checksum(np.frombuffer(big, dtype=np.uint8).copy())


def test_hgc1_pages_verify_on_the_host_with_it():
    """A GPU-written page (hgc1, odd) read into host memory: `pagesum.host_sums` verifies the same value."""
    rng = np.random.default_rng(5)
    page = 3 * 4096 + 512
    bufs = [rng.integers(0, 256, page, dtype=np.uint8) for _ in range(4)]
    tags = [pagesum.tag(pagesum.HGC1, C.checksum(b)) for b in bufs]
    segs = [[(b.ctypes.data, b.size)] for b in bufs]
    odd = [True] * len(bufs)
    assert pagesum.host_sums(segs, page, odd) == tags
    bufs[2][100] ^= 1  # one flipped bit is a mismatch
    assert pagesum.host_sums(segs, page, odd)[2] != tags[2]


def test_threads_sum_at_once_and_agree():
    u8 = np.random.default_rng(3).integers(0, 256, 4 << 20, dtype=np.uint8)
    want = _numpy_sums(u8)
    out, errs = [], []

    def run():
        try:
            for _ in range(5):
                out.append(np.array_equal(C._block_sums(u8), want))
        except Exception as exc:  # noqa: BLE001
            errs.append(exc)

    ts = [threading.Thread(target=run) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errs and out == [True] * 20


_CHILD = textwrap.dedent("""
    import sys, numpy as np
    {block}
    from hicache_gds import checksum as C, _checksum_jit as J
    u8 = np.frombuffer(bytes(range(256)) * 16 * 40, dtype=np.uint8)
    first = C.checksum(u8)           # before any compilation: numpy
    ready = J.wait_ready(120)
    print(ready, J.engine(), first == C.checksum(u8), C.checksum(bytes(range(256)) * 16))
""")


@pytest.mark.parametrize("how", ["env", "no-numba"])
def test_numpy_serves_where_the_kernel_cannot(how):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    block = ""
    if how == "env":
        env["HICACHE_GDS_CHECKSUM_JIT"] = "0"
    else:
        block = "sys.modules['numba'] = None  # as if Numba were not installed"
    r = subprocess.run([sys.executable, "-c", _CHILD.format(block=block)], env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    ready, *engine, same, known = r.stdout.split()
    assert ready == "False" and same == "True" and int(known) == -7646891391505940399
    assert " ".join(engine).startswith("numpy (")
    assert ("HICACHE_GDS_CHECKSUM_JIT=0" if how == "env" else "ModuleNotFoundError") in " ".join(engine)


def test_store_stats_name_the_checksum_engine(gds_dir):
    from hicache_gds import PageStore
    with PageStore(8192, {"t": "jit"}, config={"gds_path": gds_dir, "capacity": 16 * 8192, "engine": "bounce"}) as s:
        assert s.stats()["checksum_engine"] in ("numba",) or s.stats()["checksum_engine"].startswith("numpy (")
