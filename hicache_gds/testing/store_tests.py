"""`StoreTests`: what every `Store` must do, as a pytest class to subclass (zarr's `StoreTests`
is the model).

    class TestMyStore(StoreTests):
        def open_store(self, gds_dir):            # the store under test, sized explicitly
            return open_store(PAGE, {"t": "x"}, config={"gds_path": gds_dir, "capacity": "8M",
                                                      "engine": "bounce"})

A read-only store also overrides `open_writer` (a store that writes the namespace it reads)
and sets ``read_only = True``. Data is random, destinations are poisoned before reads,
comparisons are on bytes; the lease is checked by moving the leased pages' bytes through
`Lease.post` and by the checksums it reports.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest

from ..engines.base import MemKind, Op
from ..errors import ReadOnlyError, RegionError, StoreClosedError
from ..layout import Pages
from ..memory import HostBuffer
from ..store.protocol import Lease, Store
from .engine_tests import random_bytes

__all__ = ["StoreTests"]

POISON = 0xA5


class StoreTests:
    """The conformance suite (module docstring). `page_bytes` and `n_pages` size the batches."""

    page_bytes = 64 << 10
    n_pages = 16
    read_only = False
    wait_s = 60.0  # the bound on waiting for a transfer posted through a lease

    # -- hooks -------------------------------------------------------------------------------------
    def open_store(self, gds_dir: str) -> Store:
        raise NotImplementedError("subclasses open the store under test")

    def open_writer(self, gds_dir: str) -> Store:
        """A store that writes what the store under test reads (itself, for a read-write store)."""
        raise NotImplementedError("read-only stores name their writer")

    # -- fixtures ----------------------------------------------------------------------------------
    @pytest.fixture
    def gds_dir(self, tmp_path):
        d = tmp_path / "gds"
        d.mkdir()
        return str(d)

    @pytest.fixture
    def store(self, gds_dir):
        s = self.open_store(gds_dir)
        yield s
        s.close()

    @pytest.fixture
    def writer(self, store, gds_dir):
        if not self.read_only:
            yield store
            return
        w = self.open_writer(gds_dir)
        yield w
        w.close()

    @pytest.fixture
    def bufs(self, store, writer):
        """(src, dst): random source pages, and a destination of as many pages, registered with both."""
        n, p = self.n_pages, self.page_bytes
        src, dst = HostBuffer(n * p), HostBuffer(n * p)
        random_bytes(src, int(uuid.uuid4().int % 1000))
        for s in {id(store): store, id(writer): writer}.values():
            s.register_memory(src.addr, src.nbytes)
            s.register_memory(dst.addr, dst.nbytes)
        yield src, dst
        for s in {id(store): store, id(writer): writer}.values():
            try:
                s.deregister_memory(src.addr)
                s.deregister_memory(dst.addr)
            except (StoreClosedError, ValueError):
                pass

    # -- helpers -----------------------------------------------------------------------------------
    def keys(self, n: int | None = None) -> list[str]:
        tag = uuid.uuid4().hex[:8]
        return [f"{tag}-{i}" for i in range(self.n_pages if n is None else n)]

    def pages(self, buf: HostBuffer, idx) -> Pages:
        return Pages.contiguous(buf.addr, self.page_bytes, list(idx))

    def page(self, buf: HostBuffer, i: int) -> bytes:
        return buf.numpy()[i * self.page_bytes:(i + 1) * self.page_bytes].tobytes()

    def fill(self, writer: Store, src: HostBuffer, keys: list[str]) -> None:
        assert writer.put(keys, self.pages(src, range(len(keys)))) == [True] * len(keys)

    # -- the contract ------------------------------------------------------------------------------
    def test_is_a_store(self, store):
        assert isinstance(store, Store)
        assert store.page_bytes == self.page_bytes and store.slot_bytes >= store.page_bytes
        assert store.slot_bytes % 4096 == 0 and store.namespace and store.read_only is self.read_only
        st = store.stats()
        assert isinstance(st, dict) and st.get("namespace") == store.namespace

    def test_roundtrip_is_byte_exact_per_page_in_order(self, store, writer, bufs):
        src, dst = bufs
        keys = self.keys()
        self.fill(writer, src, keys)
        order = list(reversed(range(len(keys))))  # a batch in another order than written
        dst.numpy()[:] = POISON
        assert store.get([keys[i] for i in order], self.pages(dst, range(len(keys)))) == [True] * len(keys)
        for j, i in enumerate(order):
            assert self.page(dst, j) == self.page(src, i), f"page {i} read back wrong"

    def test_a_miss_is_false_not_an_exception(self, store, writer, bufs):
        src, dst = bufs
        keys = self.keys(4)
        self.fill(writer, src, keys[:2])
        asked = [keys[0], keys[2], keys[1], keys[3]]
        assert store.exists(asked) == [True, False, True, False]
        assert store.prefix(keys) == 2 and store.prefix(keys[2:]) == 0 and store.prefix([]) == 0
        dst.numpy()[:] = POISON
        assert store.get(asked, self.pages(dst, range(4))) == [True, False, True, False]
        assert self.page(dst, 0) == self.page(src, 0) and self.page(dst, 2) == self.page(src, 1)

    def test_bad_input_is_a_typed_error(self, store, bufs):
        src, _ = bufs
        with pytest.raises(TypeError):
            store.exists("not-a-list")
        with pytest.raises((TypeError, ValueError)):
            store.exists([b"bytes"])
        with pytest.raises(ValueError):
            store.exists([""])
        with pytest.raises(ValueError):
            store.get(self.keys(2), self.pages(src, [0]))  # two keys, one page
        with pytest.raises(RegionError):
            store.get(self.keys(1), Pages.contiguous(src.addr, self.page_bytes // 2, [0]))

    def test_writes_keep_the_first_copy_or_are_refused(self, store, writer, bufs):
        src, dst = bufs
        keys = self.keys(2)
        if self.read_only:
            for call in (lambda: store.put(keys, self.pages(src, [0, 1])), lambda: store.delete(keys), store.clear):
                with pytest.raises(ReadOnlyError):
                    call()
            return
        assert store.put(keys, self.pages(src, [0, 1])) == [True, True]
        assert store.put(keys, self.pages(src, [2, 3])) == [True, True]  # present: not rewritten
        dst.numpy()[:] = POISON
        assert store.get(keys, self.pages(dst, [0, 1])) == [True, True]
        assert self.page(dst, 0) == self.page(src, 0) and self.page(dst, 1) == self.page(src, 1)

    def test_delete_and_clear(self, store, bufs):
        if self.read_only:
            pytest.skip("a read-only store refuses them (test_writes_keep_the_first_copy_or_are_refused)")
        src, _ = bufs
        keys = self.keys(4)
        self.fill(store, src, keys)
        assert store.delete([keys[0], "absent-key"]) == [True, False]
        assert store.exists(keys) == [False, True, True, True]
        assert store.clear() >= 3
        assert store.exists(keys) == [False] * 4 and store.prefix(keys) == 0

    def test_lease_names_where_present_pages_live(self, store, writer, bufs):
        src, dst = bufs
        keys = self.keys(6)
        self.fill(writer, src, keys[:4])
        asked = [keys[3], keys[4], keys[0], keys[1], keys[5], keys[2]]
        with store.lease(asked) as lease:
            assert isinstance(lease, Lease) and len(lease) == len(asked)
            assert lease.present.tolist() == [True, False, True, True, False, True] and lease.missing == 2
            hit = np.flatnonzero(lease.present)
            src_i = [int(asked[j].rsplit("-", 1)[1]) for j in hit]
            want = store.page_checksums(self.pages(src, src_i))
            assert np.array_equal(lease.checksums[hit], want), "lease checksums are not the pages' checksums"
            assert (lease.nbytes[hit] == self.page_bytes).all()
            # Move the leased pages' bytes through the lease, as a GPU-direct path does.
            dst.numpy()[:] = POISON
            mem = np.stack([np.uint64(dst.addr) + np.arange(len(hit), dtype=np.uint64) * np.uint64(self.page_bytes),
                            np.full(len(hit), self.page_bytes, dtype=np.uint64)], axis=1)
            fil = np.stack([lease.file_ids[hit], lease.offsets[hit]], axis=1).astype(np.uint64)
            deadline = time.monotonic() + self.wait_s
            for t in lease.post(Op.READ, MemKind.DRAM, mem, fil):
                try:
                    t.wait(max(0.0, deadline - time.monotonic()))
                finally:
                    t.release()
            for j, i in enumerate(src_i):
                assert self.page(dst, j) == self.page(src, i), f"leased page {i} read through the lease wrong"
        lease.release()  # idempotent after the context

    def test_a_leased_page_survives_eviction_pressure(self, store, writer, bufs):
        if not getattr(store, "dirs", None) or self.read_only:
            pytest.skip("only a store that leases its own slots protects them")
        src, dst = bufs
        keys = self.keys(2)
        self.fill(writer, src, keys)
        with store.lease(keys[:1]) as lease:
            assert lease.protected
            n = int(store.stats().get("slots", 0) or store.stats().get("local", {}).get("slots", 0))
            more = [f"fill-{uuid.uuid4().hex[:6]}-{i}" for i in range(n + 4)]
            for a in range(0, len(more), self.n_pages):  # the namespace's whole capacity, and more
                batch = more[a:a + self.n_pages]
                writer.put(batch, self.pages(src, range(len(batch))))
            assert store.exists(keys[:1]) == [True], "a leased page was evicted"
        dst.numpy()[:] = POISON
        assert store.get(keys[:1], self.pages(dst, [0])) == [True] and self.page(dst, 0) == self.page(src, 0)

    def test_concurrent_calls_are_byte_exact(self, store, writer, bufs):
        src, _ = bufs
        keys = self.keys()
        self.fill(writer, src, keys)
        errors: list[BaseException] = []

        def reader(t: int) -> None:
            buf = HostBuffer(self.n_pages * self.page_bytes)
            try:
                store.register_memory(buf.addr, buf.nbytes)
                for r in range(4):
                    idx = np.random.default_rng(t * 10 + r).permutation(len(keys))[:self.n_pages // 2].tolist()
                    buf.numpy()[:] = POISON
                    ok = store.get([keys[i] for i in idx], self.pages(buf, range(len(idx))))
                    assert ok == [True] * len(idx), ok
                    for j, i in enumerate(idx):
                        assert self.page(buf, j) == self.page(src, i)
                store.deregister_memory(buf.addr)
            except BaseException as exc:  # noqa: BLE001 -- reported by the test
                errors.append(exc)
            finally:
                buf.close()

        threads = [threading.Thread(target=reader, args=(t,)) for t in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a reader hung"
        assert not errors, errors[0]

    def test_stats_count_what_was_done(self, store, writer, bufs):
        src, dst = bufs
        keys = self.keys(3)
        self.fill(writer, src, keys)
        store.get(keys + ["absent"], self.pages(dst, range(4)))
        st: dict[str, Any] = store.stats()
        flat = {**st.get("local", {}), **st}
        assert flat.get("pages_read", 0) + flat.get("hits", 0) >= 3, st

    def test_closed_store_refuses_calls_and_closes_once(self, gds_dir):
        s = self.open_store(gds_dir)
        s.close()
        s.close()
        with pytest.raises((StoreClosedError, ValueError)):
            s.exists(self.keys(1))
