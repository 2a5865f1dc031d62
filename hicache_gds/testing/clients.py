"""One interface over the two ways pages reach the store, for the reliability runs.

`Client("store", ...)` puts and gets through `PageStore` from a host buffer; `Client("sglang", ...)`
builds `HiCacheGDS` on a mimic SGLang host pool through SGLang's `StorageBackendFactory` and uses
``batch_set_v1`` / ``batch_get_v1`` / ``batch_exists`` / ``clear`` as SGLang's controller does.
Page bytes always derive from the key (`crash.page_bytes_of`), so any page read back can be
checked without remembering what was written.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .crash import page_bytes_of

__all__ = ["Client", "expected"]


def expected(key: str, nbytes: int) -> bytes:
    return page_bytes_of(key, nbytes).tobytes()


class Client:
    """put / read / exists / prefix / clear / close by keys, through `target` ("store" or "sglang").

    pages: host pages available to one call (batches are cut to it).
    shape: index into `sglang_harness.POOL_SHAPES` (sglang target).
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
        if target == "store":
            from hicache_gds import PageStore
            from hicache_gds.memory import HostBuffer
            self.page = page
            self.store = PageStore(page, dict(identity or {"model": "reliability"}),
                                   config={"gds_path": gds_path, "capacity": slots * page, **extra},
                                   engine=engine_obj)
            self.buf = HostBuffer(pages * page)
            self.store.register_memory(self.buf.addr, self.buf.nbytes)
            self.backend = self.raw = None
        elif target == "sglang":
            from hicache_gds.memory import align_up

            from . import sglang_harness as h
            sh = h.POOL_SHAPES[shape % len(h.POOL_SHAPES)]
            self.pool = h.pool_for_shape(sh, pages)
            self.page = h.flat_page_nbytes(self.pool)
            kw = dict(sglang or {})
            kw.setdefault("is_mla_model", sh[0] == "mla")
            sc = h.storage_config(gds_path, capacity=slots * align_up(self.page), extra=extra, **kw)
            self.backend = h.attach(sc, self.pool)
            self.raw = h.inner(self.backend)
            self.binding = self.raw._bindings["kv"]
            self.store = self.binding.store
        else:
            raise ValueError(f"target must be 'store' or 'sglang', got {target!r}")

    @property
    def index(self) -> Any:
        return self.store.index

    def store_keys(self, keys: Sequence[str]) -> list[str]:
        return self.binding.skeys(list(keys)) if self.backend is not None else list(keys)

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
        if self.backend is None:
            from hicache_gds import Pages
            arr = self.buf.numpy()
            for j, blob in enumerate(blobs):
                arr[(at + j) * self.page:(at + j + 1) * self.page] = blob
            return self.store.put(keys, Pages.contiguous(self.buf.addr, self.page, range(at, at + len(keys))))
        from . import sglang_harness as h
        for j, blob in enumerate(blobs):
            h.set_page(self.pool, at + j, blob)
        return self.backend.batch_set_v1(keys, h.host_indices(self.pool, range(at, at + len(keys))))

    def read(self, keys: Sequence[str], *, at: int = 0) -> list[bytes | None]:
        """Page bytes per key; None for a miss or a failed read."""
        out: list[bytes | None] = []
        keys = list(keys)
        step = self.pages - at
        for a in range(0, len(keys), step):
            out.extend(self._read(keys[a:a + step], at))
        return out

    def _read(self, keys: list[str], at: int) -> list[bytes | None]:
        if self.backend is None:
            from hicache_gds import Pages
            arr = self.buf.numpy()
            arr[at * self.page:(at + len(keys)) * self.page] = 0xEE
            res = self.store.get(keys, Pages.contiguous(self.buf.addr, self.page, range(at, at + len(keys))))
            return [arr[(at + j) * self.page:(at + j + 1) * self.page].tobytes() if ok else None
                    for j, ok in enumerate(res)]
        from . import sglang_harness as h
        poison = np.full(self.page, 0xEE, dtype=np.uint8)
        for j in range(len(keys)):
            h.set_page(self.pool, at + j, poison)
        res = self.backend.batch_get_v1(keys, h.host_indices(self.pool, range(at, at + len(keys))))
        return [h.page_bytes(self.pool, at + j) if ok else None for j, ok in enumerate(res)]

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
        if self.backend is None:
            return self.store.exists(list(keys))
        return [bool(self.backend.exists(k)) for k in keys]

    def prefix(self, keys: Sequence[str]) -> int:
        if self.backend is None:
            return self.store.prefix(list(keys))
        return self.backend.batch_exists(list(keys))

    def clear(self) -> bool:
        if self.backend is None:
            self.store.clear()
            return True
        return bool(self.backend.clear())

    def close(self) -> None:
        (self.backend if self.backend is not None else self.store).close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
