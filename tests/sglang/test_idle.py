"""An idle scheduler pass yields to L3 reads (`hicache_gds_sglang.idle`): the hook
``Scheduler.on_idle`` (AFTER) waits on the real backend's read event, bounded, only while reads
are pending for waiting requests and the GPU has nothing to run; a read that returns wakes it.

The backend is the real `HiCacheGDS` on a mimic host pool (random pages, poisoned destinations,
byte comparison); the scheduler is the part of SGLang's that the hook reads (``tree_cache`` with
its controller and ``ongoing_prefetch``, ``running_batch``).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from hicache_gds import ConfigError
from hicache_gds_sglang import idle, plugin
from hicache_gds_sglang.policy_config import PolicyConfig
from sgl_helpers import attach, indices, keys, make_pool, poison, same_pages, storage_config


class _Batch:
    def __init__(self, n: int) -> None:
        self.n = n

    def is_empty(self) -> bool:
        return self.n == 0


def _scheduler(backend, *, pending: bool = True, running: int = 0):
    cc = SimpleNamespace(storage_backend=backend, enable_storage=True)
    cache = SimpleNamespace(cache_controller=cc, ongoing_prefetch={"r0": object()} if pending else {})
    return SimpleNamespace(tree_cache=cache, running_batch=_Batch(running))


class _Spy:
    """Counts the backend's waits and keeps what each returned."""

    def __init__(self, backend) -> None:
        self.calls: list[tuple[float, bool]] = []
        real = backend.wait_for_reads

        def wait(timeout_s: float) -> bool:
            got = real(timeout_s)
            self.calls.append((timeout_s, got))
            return got
        backend.wait_for_reads = wait


@pytest.fixture
def backend(gds_dir):
    pool = make_pool("mha", "page_first", pages=64)
    b = attach(storage_config(gds_dir, extra={"policy_idle_wait_ms": 2}), pool)
    b.pool = pool
    yield b
    b.close()


def test_an_idle_pass_with_reads_pending_waits_at_most_the_bound(backend):
    spy = _Spy(backend)
    assert backend.idle_wait_s == pytest.approx(0.002)
    idle.after_idle(None, _scheduler(backend))
    assert spy.calls == [(pytest.approx(0.002), False)]  # nothing returned: the bound ended it


@pytest.mark.parametrize("case", ["nothing pending", "gpu busy", "turned off", "another backend"])
def test_no_wait_where_it_cannot_help(gds_dir, backend, case):
    spy = _Spy(backend)
    if case == "nothing pending":
        sched = _scheduler(backend, pending=False)
    elif case == "gpu busy":
        sched = _scheduler(backend, running=3)
    elif case == "turned off":
        backend.idle_wait_s = 0.0
        sched = _scheduler(backend)
    else:  # e.g. HiCacheNixl: no read event, no compute_or_load support
        sched = _scheduler(SimpleNamespace(supports_compute_or_load=False))
    t = time.perf_counter()
    idle.after_idle(None, sched)
    assert spy.calls == [] and time.perf_counter() - t < 0.5


def test_a_get_that_returns_wakes_the_wait_and_reads_the_right_bytes(backend):
    """A get on SGLang's IO thread returns while the scheduler waits: the wait ends on it (long
    before its bound), and the pages read are the ones written."""
    backend.idle_wait_s = 10.0  # a bound no test reaches: only the get can end the wait
    spy = _Spy(backend)
    pool = backend.pool
    ks = keys(16)
    assert backend.batch_set_v1(ks, indices(range(16))) == [True] * 16
    poison(pool, range(32, 48))
    got: list = []
    started = threading.Event()

    def io_thread():
        started.wait(5)
        time.sleep(0.05)  # the scheduler is waiting by now
        got.append(backend.batch_get_v1(ks, indices(range(32, 48))))

    th = threading.Thread(target=io_thread)
    th.start()
    t = time.perf_counter()
    started.set()
    idle.after_idle(None, _scheduler(backend))
    waited = time.perf_counter() - t
    th.join(10)
    assert got == [[True] * 16] and same_pages(pool, list(range(16)), pool, list(range(32, 48)))
    assert spy.calls and spy.calls[0][1] is True and waited < 5.0


def test_an_existence_query_wakes_the_wait(backend):
    backend.idle_wait_s = 10.0
    spy = _Spy(backend)
    th = threading.Timer(0.05, lambda: backend.batch_exists(keys(4)))
    th.start()
    idle.after_idle(None, _scheduler(backend))
    th.join(10)
    assert spy.calls and spy.calls[0][1] is True


def test_a_failing_wait_never_reaches_the_scheduler(backend, caplog):
    def boom(timeout_s):
        raise RuntimeError("event gone")
    backend.wait_for_reads = boom
    idle.after_idle(None, _scheduler(backend))  # does not raise
    assert "not yielded to L3 reads" in caplog.text


@pytest.mark.parametrize("value", [-1, 101, "soon", float("nan")])
def test_a_bad_bound_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match="policy_idle_wait_ms"):
        PolicyConfig.from_extra({"policy_idle_wait_ms": value})


def test_the_bound_is_a_known_key_and_zero_turns_it_off(gds_dir):
    assert PolicyConfig.from_extra({"policy_idle_wait_ms": 0}).idle_wait_ms == 0
    assert PolicyConfig.from_extra({}).idle_wait_ms == 2.0
    b = attach(storage_config(gds_dir, extra={"policy_idle_wait_ms": "0"}), make_pool("mha", "page_first", pages=8))
    try:
        assert b.idle_wait_s == 0.0
    finally:
        b.close()


def test_the_hook_is_in_the_table_for_both_releases():
    h = next(h for h in plugin.HOOKS if h.hook == "idle.after_idle")
    assert h.target.endswith("Scheduler.on_idle") and h.kind == "AFTER" and h.releases == "0.5.17, 0.5.23"
    assert plugin._hook_fn(h.hook) is idle.after_idle
    assert plugin.GROUPS[h.group].fallback
