"""The page checksum: one definition for host bytes (numpy) and device bytes (torch, Triton).

The GPU side runs here on CPU tensors (torch) and through Triton's interpreter; tests/test_gpu_checksum.py
checks the same values on CUDA memory.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hicache_gds import checksum as C
from hicache_gds.memory import HostBuffer

SIZES = [1, 3, 4, 5, 100, 4095, 4096, 4097, 8192, 3 * 4096 + 2, 65536 + 7, 256 << 10, (2 << 20) + 3]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rand(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("n", SIZES)
def test_numpy_and_torch_agree_on_random_pages(n):
    for seed in range(3):
        b = rand(n, seed * 1000 + n)
        h = C.checksum(b)
        assert h == int(C.torch_checksums(torch.from_numpy(b).view(1, -1))[0])
        assert h != 0 and -(1 << 63) <= h < 1 << 63
        # padded to a longer stored page: the same value whichever side computes it
        assert C.checksum(b, n + 5000) == int(C.torch_checksums(torch.from_numpy(b).view(1, -1), n + 5000)[0])


def test_a_batch_of_pages_in_torch_is_each_page_alone():
    pages = np.stack([rand(10000, s) for s in range(7)])
    got = C.torch_checksums(torch.from_numpy(pages), max_bytes=3 * 10000).tolist()  # several steps
    assert got == [C.checksum(p) for p in pages]


@pytest.mark.parametrize("n", [4096, 10000, (1 << 20) + 12])
def test_segments_anywhere_are_the_page_they_make(n):
    """A page in segments (layer_first pools) sums as their concatenation, on either side."""
    b = rand(n, 7)
    h = C.checksum(b)
    rng = np.random.default_rng(n)
    for cuts in ([], [4096], sorted(rng.integers(1, n, 5).tolist()), list(range(70, n, 70))[:300]):
        edges = [0, *cuts, n]
        segs = [np.ascontiguousarray(b[a:z]) for a, z in zip(edges, edges[1:]) if z > a]
        addrs = np.array([[s.ctypes.data for s in segs]], dtype=np.uint64)
        lens = np.array([[s.size for s in segs]], dtype=np.uint64)
        assert C.host_checksum(zip(addrs[0].tolist(), lens[0].tolist())) == h
        assert C.device_checksums(addrs, lens, n, device=torch.device("cpu"), impl="torch")[0] == h


@pytest.mark.parametrize("order", ["in_order", "shuffled", "repeated", "overlapping", "odd_tail"])
def test_a_batch_summed_in_runs_is_each_page_alone(order):
    """`host_checksums` sums segments that lie end to end (a page_first host pool) as one array:
    the same checksums as page by page, whatever the slots' order, repeats and overlaps."""
    rng = np.random.default_rng(11)
    seg, p = 64 << 10, 12
    buf = HostBuffer(2 * p * seg + 4096)
    buf.numpy()[:] = rng.integers(0, 256, buf.nbytes, dtype=np.uint8)
    idx = {"in_order": list(range(p)), "shuffled": list(rng.permutation(p)), "repeated": [4, 4, 5, 0, 5],
           "overlapping": list(range(p)), "odd_tail": list(range(p))}[order]
    shift = {"overlapping": 4096 * 3, "odd_tail": 0}.get(order, 0)
    tail = 1000 if order == "odd_tail" else 0
    pages = [[(buf.addr + i * seg, seg), (buf.addr + (p + i) * seg - shift, seg - tail)] for i in idx]
    nbytes = 2 * seg + 8192
    got = C.host_checksums(pages, nbytes)
    raw = buf.numpy()
    want = [C.checksum(np.concatenate([raw[a - buf.addr:a - buf.addr + n] for a, n in pg]), nbytes) for pg in pages]
    assert got == want == [C.host_checksum(pg, nbytes) for pg in pages]
    buf.close()


def test_known_values_pin_the_definition():
    """The on-disk format: these values must never change (a change is a new `ondisk.FORMAT`)."""
    assert (int(C.WEIGHTS[0]), int(C.WEIGHTS[1023])) == (0x0BF6D0A2D242406B, 0xF3396051991A5113)
    assert all(int(w) & 1 for w in C.WEIGHTS)
    assert C.checksum(bytes(1)) == -5451962507482445012
    assert C.checksum(bytes(range(256)) * 16) == -7646891391505940399
    assert C.checksum((bytes(range(256)) * 20)[:5000]) == -761047150193538038
    for data in (bytes(1), bytes(range(256)) * 16, (bytes(range(256)) * 20)[:5000]):
        assert C.checksum(data) == _reference(data)


def _reference(data: bytes, nbytes: int | None = None) -> int:
    """The definition written out in plain Python integers, word by word."""
    m = (1 << 64) - 1
    n = len(data) if nbytes is None else nbytes
    buf = bytes(data) + bytes(-len(data) % 4)
    words = [int.from_bytes(buf[i:i + 4], "little") for i in range(0, len(buf), 4)]
    nb = -(-n // 4096)
    h = 0
    for b in range(nb):
        s = sum(w * int(C.WEIGHTS[j]) for j, w in enumerate(words[b * 1024:(b + 1) * 1024])) & m
        h = (h + C._fmix64(s ^ ((b * 0x9E3779B97F4A7C15) & m))) & m
    return C.to_sqlite(C._fmix64(h ^ n))


@pytest.mark.parametrize("n", [1, 7, 4096, 4099, 9000])
def test_numpy_matches_the_definition_written_out(n):
    b = rand(n, n)
    assert C.checksum(b) == _reference(b.tobytes())
    assert C.checksum(b, n + 4096) == _reference(b.tobytes(), n + 4096)


def test_weights_are_splitmix64_of_the_seed():
    x, m = C.SEED, (1 << 64) - 1
    for j in range(4):
        x = (x + 0x9E3779B97F4A7C15) & m
        z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        assert int(C.WEIGHTS[j]) == (z ^ (z >> 31)) | 1


def test_single_bit_flips_always_change_it():
    """Any change inside one word changes its block's sum (odd weights): never missed."""
    n = 3 * 4096 + 100
    b = rand(n, 1)
    h = C.checksum(b)
    rng = np.random.default_rng(2)
    positions = [0, 1, 4095, 4096, 8191, n - 1] + rng.integers(0, n, 300).tolist()
    for pos in positions:
        for bit in (0, 7) if pos in (0, n - 1) else (int(rng.integers(0, 8)),):
            c = b.copy()
            c[pos] ^= 1 << bit
            assert C.checksum(c) != h, (pos, bit)


def test_two_top_bit_flips_in_a_block_are_caught():
    """32-bit words widened to 64 bits: two flips of bit 31 cannot cancel (they would for 64-bit
    words times odd weights)."""
    b = rand(8192, 3)
    h = C.checksum(b)
    for i, j in ((3, 7), (0, 1020), (100, 900)):
        c = b.copy()
        c[4 * i + 3] ^= 0x80
        c[4 * j + 3] ^= 0x80
        assert C.checksum(c) != h


def test_swapped_repeated_and_torn_blocks_change_it():
    b = rand(4 * 4096, 4)
    h = C.checksum(b)
    blocks = b.reshape(4, 4096)
    assert C.checksum(blocks[[1, 0, 2, 3]].ravel()) != h          # two blocks swapped
    assert C.checksum(blocks[[0, 0, 2, 3]].ravel()) != h          # a block repeated
    other = rand(4 * 4096, 5)
    torn = b.copy()
    torn[8192:] = other[8192:]                                     # a torn write: the tail is another page's
    assert C.checksum(torn) != h
    sector = b.copy()
    sector[4096 + 512:4096 + 1024] = 0                             # one 512-byte sector never written
    assert C.checksum(sector) != h
    assert C.checksum(b, 5 * 4096) != h                            # the same bytes as a longer page
    assert C.checksum(np.zeros(4096, np.uint8)) != C.checksum(np.zeros(8192, np.uint8))


def test_the_store_checksums_host_pages_with_xxh3(gds_dir):
    """Host pages are recorded with xxh3 (even); hgc1 is what GPU memory writes (tests/test_pagesum.py)."""
    from hicache_gds import PageStore, Pages, pagesum
    page = 3 * 4096 + 512
    with PageStore(page, {"t": "ck"}, config={"gds_path": gds_dir, "capacity": 8 * 16384, "engine": "bounce"}) as s:
        buf = HostBuffer(4 * page)
        s.register_memory(buf.addr, buf.nbytes)
        data = rand(4 * page, 9)
        buf.numpy()[:] = data
        assert s.put(["a", "b", "c", "d"], Pages.contiguous(buf.addr, page, range(4))) == [True] * 4
        rows = s.index.peek(["a", "b", "c", "d"])
        assert [rows[k].csum for k in "abcd"] == [pagesum.page_sum(data[i * page:(i + 1) * page]) for i in range(4)]
        assert all(pagesum.kind_of(rows[k].csum) == pagesum.XXH3 for k in "abcd")


_TRITON = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np, torch
    from hicache_gds import checksum as C
    rng = np.random.default_rng(0)
    for n in (1, 6, 4096, 5000, 3 * 4096 + 1):
        pages = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(3)]
        want = [C.checksum(p) for p in pages]
        whole = np.array([[p.ctypes.data] for p in pages], dtype=np.uint64)
        lens = np.full((3, 1), n, dtype=np.uint64)
        assert C.device_checksums(whole, lens, n, device=torch.device("cpu"), impl="triton").tolist() == want, n
        # each page cut differently (the per-page segment tables), at odd boundaries
        cut = [sorted(rng.integers(1, n, 2).tolist()) if n > 2 else [0, 0] for _ in pages]
        segs = [[np.ascontiguousarray(p[:c[0]]), np.ascontiguousarray(p[c[0]:c[1]]), np.ascontiguousarray(p[c[1]:])]
                for p, c in zip(pages, cut)]
        addrs = np.array([[s.ctypes.data for s in ss] for ss in segs], dtype=np.uint64)
        slens = np.array([[s.size for s in ss] for ss in segs], dtype=np.uint64)
        assert C.device_checksums(addrs, slens, n, device=torch.device("cpu"), impl="triton").tolist() == want, n
        assert C.device_checksums(whole, lens, n + 4096, device=torch.device("cpu"), impl="triton").tolist() == \\
            [C.checksum(p, n + 4096) for p in pages]
    print("ok")
""")


def test_the_triton_kernel_computes_the_same_in_its_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _TRITON], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
