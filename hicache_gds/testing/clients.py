"""One interface over the two ways pages reach the store, for the reliability runs.

`Client("store", ...)` puts and gets through `PageStore` from a host buffer; any other target is an
adapter's harness found by name (`targets`): `Client("sglang", ...)` builds `HiCacheGDS` on a mimic
SGLang host pool through SGLang's `StorageBackendFactory` and uses ``batch_set_v1`` /
``batch_get_v1`` / ``batch_exists`` / ``clear`` as SGLang's controller does.
Page bytes always derive from the key (`crash.page_bytes_of`), so any page read back can be
checked without remembering what was written.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .crash import page_bytes_of
from .targets import STORE, harness

__all__ = ["Client", "expected"]


def expected(key: str, nbytes: int) -> bytes:
    return page_bytes_of(key, nbytes).tobytes()


class Client:
    """put / read / exists / prefix / clear / close by keys, through `target` ("store", or an
    adapter's target such as "sglang").

    pages: host pages available to one call (batches are cut to it).
    shape: which of the adapter's pool shapes (the sglang harness's `POOL_SHAPES`).
    sglang: options of the adapter's storage config (SGLang: tp_rank, tp_size, ...).
    """

    def __init__(self, target: str, gds_path: str, *, page: int = 64 << 10, slots: int = 1024,
                 engine: str = "nixl-posix", pages: int = 64, shape: int = 0, identity: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None, sglang: Mapping[str, Any] | None = None,
                 engine_obj: Any = None, salt: str = "") -> None:
        self.target = target
        self.pages = pages
        self.salt = salt
        extra = dict(config or {})
        if engine_obj is None:
            extra.setdefault("engine", engine)
        self.adapter: Any = None
        if target == STORE:
            from hicache_gds import PageStore
            from hicache_gds.memory import HostBuffer
            self.page = page
            self.store = PageStore(page, dict(identity or {"model": "reliability"}),
                                   config={"gds_path": gds_path, "capacity": slots * page, **extra},
                                   engine=engine_obj)
            self.buf = HostBuffer(pages * page)
            self.store.register_memory(self.buf.addr, self.buf.nbytes)
            self.backend = self.raw = None
        else:
            self.adapter = a = harness(target).open_client(gds_path, slots=slots, pages=pages, shape=shape,
                                                           identity=identity, extra=extra, options=sglang)
            self.page, self.store, self.backend = a.page, a.store, a.backend
            self.pool, self.raw, self.binding = (getattr(a, n, None) for n in ("pool", "raw", "binding"))

    @property
    def index(self) -> Any:
        return self.store.index

    def store_keys(self, keys: Sequence[str]) -> list[str]:
        return self.adapter.store_keys(keys) if self.adapter is not None else list(keys)

    # -- data path ---------------------------------------------------------------------------
    def expected(self, key: str) -> bytes:
        """The bytes page `key` must have (derived from the key and this client's salt)."""
        return expected(self.salt + key, self.page)

    def put(self, keys: Sequence[str], data: Sequence[bytes] | None = None, *, at: int = 0) -> list[bool]:
        """Write pages whose bytes derive from their keys (or `data`); per-page results.

        `at`: first host page to use (threads sharing one client use disjoint lanes)."""
        out: list[bool] = []
        keys = list(keys)
        step = self.pages - at
        for a in range(0, len(keys), step):
            chunk = keys[a:a + step]
            blobs = [page_bytes_of(self.salt + k, self.page) if data is None
                     else np.frombuffer(data[a + j], dtype=np.uint8) for j, k in enumerate(chunk)]
            out.extend(self._put(chunk, blobs, at))
        return out

    def _put(self, keys: list[str], blobs: list[np.ndarray], at: int) -> list[bool]:
        if self.adapter is not None:
            return self.adapter.put(keys, blobs, at)
        from hicache_gds import Pages
        arr = self.buf.numpy()
        for j, blob in enumerate(blobs):
            arr[(at + j) * self.page:(at + j + 1) * self.page] = blob
        return self.store.put(keys, Pages.contiguous(self.buf.addr, self.page, range(at, at + len(keys))))

    def read(self, keys: Sequence[str], *, at: int = 0) -> list[bytes | None]:
        """Page bytes per key; None for a miss or a failed read."""
        out: list[bytes | None] = []
        keys = list(keys)
        step = self.pages - at
        for a in range(0, len(keys), step):
            out.extend(self._read(keys[a:a + step], at))
        return out

    def _read(self, keys: list[str], at: int) -> list[bytes | None]:
        if self.adapter is not None:
            return self.adapter.read(keys, at)
        from hicache_gds import Pages
        arr = self.buf.numpy()
        arr[at * self.page:(at + len(keys)) * self.page] = 0xEE
        res = self.store.get(keys, Pages.contiguous(self.buf.addr, self.page, range(at, at + len(keys))))
        return [arr[(at + j) * self.page:(at + j + 1) * self.page].tobytes() if ok else None
                for j, ok in enumerate(res)]

    def verify(self, keys: Sequence[str]) -> dict[str, int]:
        """Read `keys`: how many came back byte-exact, missed, or came back wrong."""
        good = miss = wrong = 0
        for k, got in zip(keys, self.read(keys)):
            if got is None:
                miss += 1
            elif got == self.expected(k):
                good += 1
            else:
                wrong += 1
        return {"good": good, "miss": miss, "wrong": wrong}

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if self.adapter is not None:
            return self.adapter.exists(keys)
        return self.store.exists(list(keys))

    def prefix(self, keys: Sequence[str]) -> int:
        if self.adapter is not None:
            return self.adapter.prefix(keys)
        return self.store.prefix(list(keys))

    def clear(self) -> bool:
        if self.adapter is not None:
            return self.adapter.clear()
        self.store.clear()
        return True

    def close(self) -> None:
        (self.adapter if self.adapter is not None else self.store).close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
