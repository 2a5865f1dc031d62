"""Helpers shared by the remote-tier tests and their client subprocesses."""

from __future__ import annotations

import hashlib

import numpy as np

import hicache_gds._nixl  # noqa: F401 -- UCX_MODULES=^ib first
from hicache_gds.layout import Pages
from hicache_gds.memory import HostBuffer
from hicache_gds.remote import RemoteTier
from hicache_gds.testing.host_as_vram import host_as_vram  # noqa: F401 -- the tests' import point

POISON = 0xA5


def page_data(key: str, page: int, salt: str = "") -> np.ndarray:
    """Deterministic random bytes of one page, from its key (any process can check them)."""
    seed = int.from_bytes(hashlib.blake2b(f"{salt}{key}".encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, page, dtype=np.uint8)


class Bufs:
    """A source and a destination buffer of `n` pages, registered with `store`."""

    def __init__(self, store, n: int, page: int) -> None:  # noqa: ANN001
        self.n, self.page = n, page
        self.src = HostBuffer(n * page, pinned=False)
        self.dst = HostBuffer(n * page, pinned=False)
        store.register_memory(self.src.addr, self.src.nbytes)
        store.register_memory(self.dst.addr, self.dst.nbytes)

    def fill(self, keys: list[str], salt: str = "") -> Pages:
        for i, k in enumerate(keys):
            self.src.numpy()[i * self.page:(i + 1) * self.page] = page_data(k, self.page, salt)
        return Pages.contiguous(self.src.addr, self.page, range(len(keys)))

    def poisoned(self, n: int) -> Pages:
        self.dst.numpy()[:] = POISON
        return Pages.contiguous(self.dst.addr, self.page, range(n))

    def got(self, i: int) -> np.ndarray:
        return self.dst.numpy()[i * self.page:(i + 1) * self.page]

    def round_trip(self, store, keys: list[str]) -> None:  # noqa: ANN001
        """Put `keys`' pages, read them into poisoned slots: every one is put, read and byte-equal."""
        assert store.put(keys, self.fill(keys)) == [True] * len(keys)
        ok = store.get(keys, self.poisoned(len(keys)))
        assert ok == [True] * len(keys)
        self.check(keys, ok)

    def check(self, keys: list[str], ok: list[bool], salt: str = "") -> None:
        """Pages read (True) equal their data byte for byte; pages missed (False) are untouched poison."""
        for i, (k, hit) in enumerate(zip(keys, ok)):
            if hit:
                assert np.array_equal(self.got(i), page_data(k, self.page, salt)), f"page {k} differs"


def tier(url: str, prefix: str, page: int, ident: str, **opts) -> RemoteTier:  # noqa: ANN003
    return RemoteTier(page, {"test": ident}, config={"remote_url": url, "remote_prefix": prefix, "io_timeout": 10,
                                                     "remote_timeout": 1.0, **opts})


def device_paths(t: RemoteTier, device: str) -> RemoteTier:
    """Make tier `t` take its device-page paths on `device`: "cpu" with host memory standing in
    (`host_as_vram`), "cuda" on a real GPU. Skips where torch, a GPU or UCX's CUDA support is missing."""
    import pytest
    torch = pytest.importorskip("torch")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if device == "cpu":
        host_as_vram(t)
    elif "VRAM" not in t.stats()["mem_kinds"]:
        pytest.skip("this UCX build has no CUDA support")
    return t


class DeviceBufs(Bufs):
    """`Bufs` in device memory: torch tensors on `device` (a CUDA GPU, or cpu under `host_as_vram`),
    registered with the tier as VRAM, pages passed as VRAM."""

    def __init__(self, store, n: int, page: int, device: str = "cpu") -> None:  # noqa: ANN001
        import torch

        from hicache_gds.engines.base import MemKind
        self.n, self.page, self.kind = n, page, MemKind.VRAM
        self.torch, self.device = torch, torch.device(device)
        self.src_t = torch.empty(n * page, dtype=torch.uint8, device=self.device)
        self.dst_t = torch.empty(n * page, dtype=torch.uint8, device=self.device)
        for b in (self.src_t, self.dst_t):
            store.register_memory(b.data_ptr(), b.numel(), MemKind.VRAM)

    @property
    def dst_range(self) -> range:
        return range(self.dst_t.data_ptr(), self.dst_t.data_ptr() + self.dst_t.numel())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def fill(self, keys: list[str], salt: str = "") -> Pages:
        data = np.concatenate([page_data(k, self.page, salt) for k in keys])
        self.src_t[:data.size].copy_(self.torch.from_numpy(data))  # on the current stream: put waits for it
        return Pages.contiguous(self.src_t.data_ptr(), self.page, range(len(keys)), self.kind)

    def poisoned(self, n: int) -> Pages:
        self.dst_t.fill_(POISON)
        self._sync()
        return Pages.contiguous(self.dst_t.data_ptr(), self.page, range(n), self.kind)

    def dst_bytes(self) -> np.ndarray:
        self._sync()
        return self.dst_t.cpu().numpy()

    def got(self, i: int) -> np.ndarray:
        return self.dst_bytes()[i * self.page:(i + 1) * self.page]
