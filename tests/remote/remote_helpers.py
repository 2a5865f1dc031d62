"""Helpers shared by the remote-tier tests and their client subprocesses."""

from __future__ import annotations

import hashlib

import numpy as np

import hicache_gds._nixl  # noqa: F401 -- UCX_MODULES=^ib first
from hicache_gds.layout import Pages
from hicache_gds.memory import HostBuffer
from hicache_gds.remote import RemoteTier

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
