"""Every engine that runs on the CPU machine passes the shipped conformance suite."""

import pytest

from hicache_gds.engines import EngineOptions, create_engine, engine_names, register_engine
from hicache_gds.engines.faulty import Faults, FaultyEngine
from hicache_gds.errors import EngineUnavailable
from hicache_gds.testing import EngineTests


class TestNixlPosixAio(EngineTests):
    engine_name = "nixl-posix"


class TestNixlPosixUring(EngineTests):
    def make_engine(self):
        return create_engine("nixl-posix", EngineOptions(nixl_queue="uring"))


class TestBounce(EngineTests):
    engine_name = "bounce"


class TestFaultyPassThrough(EngineTests):
    def make_engine(self):
        return FaultyEngine(create_engine("bounce", EngineOptions()), Faults())


def test_registry_lists_builtin_engines():
    names = engine_names()
    for n in ("bounce", "nixl-posix", "nixl-gds", "nixl-gds-mt", "kvikio", "cufile", "nixl-ucx"):
        assert n in names


def test_unknown_engine_names_the_known_ones():
    with pytest.raises(ValueError, match="known engines: .*nixl-posix"):
        create_engine("nixl-posx", EngineOptions())


def test_reregistering_a_name_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register_engine("bounce", "somewhere:Else")


def test_gds_on_a_machine_without_gpu_is_unavailable_not_a_hang():
    from hicache_gds.engines.cufile_env import gpu_present
    if gpu_present():
        pytest.skip("a GPU is present")
    for name in ("nixl-gds", "nixl-gds-mt"):
        with pytest.raises(EngineUnavailable, match="GPU"):
            create_engine(name, EngineOptions())


def test_shipped_cufile_json_raises_the_compat_bounce_pool(monkeypatch, tmp_path):
    import json
    import os

    from hicache_gds.engines import cufile_env
    from hicache_gds.engines.cufile_env import cufile_bounce_pool
    monkeypatch.delenv("CUFILE_ENV_PATH_JSON", raising=False)
    # This machine's own /etc/cufile.json must not decide the test: point the system path elsewhere.
    monkeypatch.setattr(cufile_env, "SYSTEM_CUFILE_JSON", str(tmp_path / "no-such-cufile.json"))
    here = os.path.join(os.path.dirname(__file__), "..", "configs", "cufile.json")
    pool = dict((s >> 10, c) for s, c in cufile_bounce_pool(here))
    assert pool == {4: 256, 1024: 256, 16384: 64}
    assert dict((s >> 10, c) for s, c in cufile_bounce_pool("")) == {4: 128, 1024: 64, 16384: 64}  # libcufile's
    system = tmp_path / "cufile.json"
    system.write_text(json.dumps({"properties": {"posix_pool_slab_count": [32, 16, 8]}}) + "  // a comment\n")
    monkeypatch.setattr(cufile_env, "SYSTEM_CUFILE_JSON", str(system))
    assert dict((s >> 10, c) for s, c in cufile_bounce_pool("")) == {4: 32, 1024: 16, 16384: 8}
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", here)  # the environment wins over the system file
    assert dict((s >> 10, c) for s, c in cufile_bounce_pool("")) == {4: 256, 1024: 256, 16384: 64}


def test_bounce_budget_counts_descriptors_per_slab_class():
    import numpy as np
    from hicache_gds.engines.nixl_file import _DescBudget
    b = _DescBudget([(4096, 2), (1 << 20, 3), (16 << 20, 1)])
    need = b.need(np.array([4096, 65536, 1 << 20, 2 << 20], dtype=np.uint64))
    assert need == [1, 2, 1]
    assert b.acquire(need, 0.1) and not b.acquire([0, 2, 0], 0.05)
    b.release(need)
    assert b.acquire([0, 3, 0], 0.1)
    calls = []
    assert not b.acquire([0, 1, 0], 0.05, progress=lambda: calls.append(1))
    assert calls  # waiting polls the requests in flight, whose completion frees buffers
    assert b.acquire([0, 1, 0], 1.0, progress=lambda: b.release([0, 1, 0]))


def test_gds_batches_and_the_process_wide_bounce_budget():
    import threading

    import numpy as np
    from hicache_gds.engines.nixl_file import _DescBudget, _gds_batches, _process_budget
    mib = 1 << 20
    # NIXL's GDS plugin splits IOs at 16 MiB and packs up to 128 of them per cuFile batch
    assert _gds_batches(np.array([mib] * 128, dtype=np.uint64), 16 * mib, 128) == 1
    assert _gds_batches(np.array([mib] * 129, dtype=np.uint64), 16 * mib, 128) == 2
    assert _gds_batches(np.array([40 * mib], dtype=np.uint64), 16 * mib, 2) == 2  # 3 parts
    # every engine of a process shares one bounce budget (cuFile has one pool per process)
    pool = [(4096, 3), (mib, 5)]
    a, ia = _process_budget(pool)
    b, ib = _process_budget(list(pool))
    assert a is b and ia is ib
    assert _process_budget([(4096, 3), (mib, 6)])[0] is not a
    # batches: a post waits for a batch to come back rather than failing
    batches = _DescBudget([(1 << 62, 2)])
    assert batches.acquire([2], 0.1)
    threading.Timer(0.05, batches.release, args=([1],)).start()
    assert batches.acquire([1], 2.0) and not batches.acquire([1], 0.02)


def test_split_rows_and_split_batches_cover_every_byte_once():
    import numpy as np

    from hicache_gds.engines.base import Capabilities, split_batches, split_rows
    rng = np.random.default_rng(7)
    lens = rng.integers(1, 5000, size=40).astype(np.uint64)
    addrs = np.cumsum(np.concatenate([[1 << 20], lens[:-1]])).astype(np.uint64)
    offs = addrs + np.uint64(12345)
    a, ln, f, pieces = split_rows(addrs, lens, offs, 1024)
    assert int(ln.max()) <= 1024 and int(pieces.sum()) == len(ln)
    # Pieces are consecutive: memory and file offsets advance together, and lengths add up per row.
    assert np.array_equal(np.cumsum(ln)[:-1] + a[0], a[1:]) and np.array_equal(f - a, np.full(len(a), 12345))
    assert np.array_equal(np.add.reduceat(ln, np.cumsum(pieces) - pieces), lens)
    short = split_rows(addrs, lens, offs, 1 << 20)
    assert short[0] is addrs and short[3].tolist() == [1] * len(lens)
    caps = Capabilities(mem_kinds=frozenset(), max_descs=7, max_request_bytes=6000, max_desc_bytes=1024,
                        alignment=1, direct_io=False, gpu_direct=False, path='test')
    plan = list(split_batches(np.ones(len(ln)), ln, caps))
    assert plan[0][0] == 0 and plan[-1][1] == len(ln) and all(p[1] == q[0] for p, q in zip(plan, plan[1:]))
    assert all(b - a <= 7 and int(ln[a:b].sum()) <= 6000 for a, b, _, _ in plan)


def test_split_batches_lets_an_item_span_requests():
    import numpy as np

    from hicache_gds.engines.base import Capabilities, split_batches
    caps = Capabilities(mem_kinds=frozenset(), max_descs=4, max_request_bytes=10_000, max_desc_bytes=4096,
                        alignment=1, direct_io=False, gpu_direct=False, path='test')
    # items of 2, 9 (too many rows), 3, 1 and 3 rows; the 4th item's one row is too many bytes for
    # the soft limit but within the hard one; the last's rows add up past the hard limit.
    descs = [2, 9, 3, 1, 3]
    row_bytes = np.array([100] * 2 + [500] * 9 + [100] * 3 + [4096] + [4000] * 3)
    item_bytes = np.add.reduceat(row_bytes, np.cumsum([0] + descs[:-1]))
    plan = list(split_batches(descs, item_bytes, caps, 1000, row_bytes=row_bytes))
    # Every row once, in order; within the row count and the hard byte limit.
    assert plan[0].row_start == 0 and plan[-1].row_stop == len(row_bytes)
    assert all(p.row_stop == q.row_start for p, q in zip(plan, plan[1:]))
    assert all(0 < b.row_stop - b.row_start <= 4 and row_bytes[b.row_start:b.row_stop].sum() <= 10_000 for b in plan)
    # The 9-row item: requests of its own, at most 1000 bytes (2 rows) each, consecutive.
    spans = [b for b in plan if (b.start, b.stop) == (1, 2)]
    assert [b.row_stop - b.row_start for b in spans] == [2, 2, 2, 2, 1]
    assert plan.index(spans[0]) + len(spans) - 1 == plan.index(spans[-1])
    # The item of 12000 bytes: cut (each request under the soft limit holds one 4000-byte row).
    assert [(b.start, b.stop, b.row_stop - b.row_start) for b in plan if b.start == 4] == [(4, 5, 1)] * 3
    # Items that fit are never split; a plan without a spanning item is what it always was.
    assert all(b.stop - b.start >= 1 for b in plan)
    whole = list(split_batches([1] * 5, [300] * 5, caps, 1000))
    assert [(b.start, b.stop) for b in whole] == [(0, 3), (3, 5)] and whole[1].row_start == 3
