"""A get's READ that lands after its batch's deadline never reaches the caller's memory.

A READ still running at `io_timeout` is reported a miss and left to finish, and neither the
timeout nor dropping the peer's agent stops what the connection still carries. Here such a READ
is modelled by holding the real NIXL request back (never polled, so never posted) until the get
has returned, then letting it run to completion: its bytes land wherever the get pointed it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid

import numpy as np
import pytest

from hicache_gds.engines.base import Op, Transfer
from hicache_gds.errors import TransferError, TransferTimeout
from hicache_gds.remote import batch as batch_mod
from hicache_gds.remote import tier as tier_mod
from hicache_gds.remote.batch import LateRequest
from remote_helpers import POISON, Bufs, DeviceBufs, device_paths, host_as_vram, page_data, tier
from remote_procs import PAGE


class _HeldBack(Transfer):
    """The real request, not polled (so not posted, and its bytes not moved) until `gate` is set."""

    def __init__(self, real, gate: threading.Event) -> None:  # noqa: ANN001
        super().__init__(real.engine, real.op, real.nbytes, real.what)
        self.real, self.gate = real, gate

    def _poll(self) -> bool:
        return self.gate.is_set() and self.real.done()


HELD: list[_HeldBack] = []  # every request held back, to drive to completion once the gate opens


def _land_all() -> None:
    """Run every held-back request to completion (the gate open): their bytes land now."""
    deadline = time.monotonic() + 10
    while HELD and time.monotonic() < deadline:
        HELD[:] = [r for r in HELD if not _finished(r)]
        time.sleep(0.005)
    assert not HELD, "held-back READs did not complete"


def _finished(r: _HeldBack) -> bool:
    try:
        return r.done()
    except TransferError:
        return True


def _hold_reads_back(t, gate: threading.Event, dests: list, peer: int | None = None):  # noqa: ANN001, ANN201
    """Hold back the READs submitted from now on (from `peer` alone where given; their local
    addresses into `dests`); returns the engine's own submit, to put back."""
    real = t.engine.submit

    def submit(op, kind, mem, rem):  # noqa: ANN001, ANN202
        r = real(op, kind, mem, rem)
        if op is Op.READ and not gate.is_set() and peer in (None, int(rem[0, 0])):
            dests.extend(int(a) for a in mem[:, 0])
            HELD.append(_HeldBack(r, gate))
            return HELD[-1]
        return r

    t.engine.submit = submit
    return real


@contextlib.contextmanager
def _late_tier(cluster, io_timeout: float):  # noqa: ANN001, ANN202
    """A tier whose servers stay in use on the same connections after a timeout (no set-aside, no
    reconnect: those are `test_reconnect.py`'s), so READs held back can still complete on them; and
    the gate that holds them. On exit the gate opens, the held READs are forgotten, the tier closes."""
    t = tier(cluster["url"], cluster["prefix"], PAGE, uuid.uuid4().hex, io_timeout=io_timeout)
    t._peer_timed_out = lambda sid: None
    gate = threading.Event()
    try:
        yield t, gate
    finally:
        gate.set()
        HELD.clear()
        t.close()


def test_a_read_landing_after_the_timeout_leaves_the_callers_memory_untouched(cluster):
    io_timeout = 0.3
    dests: list = []
    with _late_tier(cluster, io_timeout) as (t, gate):
        keys = [f"late-{i}" for i in range(12)]
        b = Bufs(t, 12, PAGE)
        assert t.put(keys, b.fill(keys)) == [True] * 12
        real_submit = _hold_reads_back(t, gate, dests)
        t0 = time.monotonic()
        assert t.get(keys, b.poisoned(12)) == [False] * 12  # every READ still running at the deadline
        assert time.monotonic() - t0 < io_timeout + 10  # returned at the deadline, not when they finish
        caller = range(b.dst.addr, b.dst.addr + b.dst.nbytes)
        assert dests and not any(a in caller for a in dests)  # the READs were pointed at the tier's staging
        held = t._stagings.host.held_bytes()
        assert held >= 12 * PAGE and t.stats()["timeouts"] >= 1

        # while they may still land, their staging is lent to no one: a get of other pages now
        # uses other memory, and is served byte-exact
        more = [f"late-more-{i}" for i in range(12)]
        b2 = Bufs(t, 12, PAGE)
        assert t.put(more, b2.fill(more)) == [True] * 12
        lent = []
        acquire = t._stagings.host.acquire
        t._stagings.host.acquire = lambda n: lent.append(acquire(n)) or lent[-1]
        held_addrs = {buf.addr for buf, _ in t._stagings.host.held}
        t.engine.submit = real_submit  # new READs are not held back; the first ones stay held
        assert t.get(more, b2.poisoned(12)) == [True] * 12
        b2.check(more, [True] * 12)
        assert lent and all(buf.addr not in held_addrs for buf in lent)
        assert t._stagings.host.held_bytes() == held  # still held: the first READs have not finished

        # now the first READs land: in the staging, not in the caller's poisoned pages
        gate.set()
        _land_all()
        assert np.all(b.dst.numpy() == POISON)
        assert t.get(keys, b.poisoned(12)) == [True] * 12  # and the staging was handed back
        b.check(keys, [True] * 12)
        assert t._stagings.host.held_bytes() == 0
        for i, k in enumerate(keys):
            assert np.array_equal(b.got(i), page_data(k, PAGE))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_late_read_of_device_pages_lands_in_staging_on_their_device_not_in_the_callers_pages(cluster, device):
    """Device pages are read into staging on their own device: READs held back past the deadline
    and then run to completion land there (held, lent to no one meanwhile), never in the caller's
    poisoned device pages; once they finished, the staging is lent again and a get is byte-exact.
    On the CPU machine host memory stands in for the device (`host_as_vram`)."""
    dests: list = []
    with _late_tier(cluster, 0.3) as (t, gate):
        device_paths(t, device)
        keys = [f"dlate-{i}" for i in range(12)]
        b = DeviceBufs(t, 12, PAGE, device)
        assert t.put(keys, b.fill(keys)) == [True] * 12
        real_submit = _hold_reads_back(t, gate, dests)
        assert t.get(keys, b.poisoned(12)) == [False] * 12
        (stg,) = t._stagings.devices.values()
        held = [(buf.addr, buf.addr + buf.nbytes) for buf, _ in stg.held]
        assert stg.held_bytes() >= 12 * PAGE and t._stagings.host.held_bytes() == 0
        assert dests and all(any(lo <= a < hi for lo, hi in held) for a in dests)
        assert not any(a in b.dst_range for a in dests)

        gate.set()
        _land_all()
        assert np.all(b.dst_bytes() == POISON)  # the late bytes landed in the staging only
        t.engine.submit = real_submit
        ok = t.get(keys, b.poisoned(12))
        assert ok == [True] * 12
        b.check(keys, ok)
        assert stg.held_bytes() == 0


def test_a_batch_with_one_server_late_serves_the_others_and_leaves_the_late_pages_untouched(cluster):
    """Each request's pages reach the caller as it completes; a server whose READs run past the
    deadline leaves its pages poisoned, during the get and after its READs land."""
    from hicache_gds.remote.directory import Directory

    dests: list = []
    with _late_tier(cluster, 0.3) as (t, gate):
        keys = [f"half-{i}" for i in range(24)]
        b = Bufs(t, 24, PAGE)
        assert t.put(keys, b.fill(keys)) == [True] * 24
        sids = [e.split("|")[0] for e in Directory(t.opts.url, t.opts.prefix).lookup(t.namespace, keys)]
        late_sid = sids[0]
        on_late = [s == late_sid for s in sids]
        assert 0 < sum(on_late) < 24
        _hold_reads_back(t, gate, dests, peer=t._peers[late_sid].peer_id)
        ok = t.get(keys, b.poisoned(24))
        assert ok == [not x for x in on_late]
        b.check(keys, ok)
        gate.set()
        _land_all()
        for i, late in enumerate(on_late):
            if late:
                assert np.all(b.got(i) == POISON), f"page {keys[i]} was written after the get returned"


def test_staging_held_past_its_cap_makes_gets_misses_at_once(cluster, monkeypatch):
    dests: list = []
    with _late_tier(cluster, 0.2) as (t, gate):
        keys = [f"cap-{i}" for i in range(4)]
        b = Bufs(t, 4, PAGE)
        assert t.put(keys, b.fill(keys)) == [True] * 4
        _hold_reads_back(t, gate, dests)
        assert t.get(keys, b.poisoned(4)) == [False] * 4
        monkeypatch.setattr(tier_mod, "MAX_HELD_STAGING", 0)
        before, posted = t.stats(), len(dests)
        assert t.get(keys, b.poisoned(4)) == [False] * 4
        assert len(dests) == posted  # nothing posted: no READ, no wait
        assert np.all(b.dst.numpy() == POISON)
        assert t.stats()["get_failed"] - before["get_failed"] == 4


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_get_that_cannot_have_staging_is_misses_not_an_exception(cluster, device, caplog):
    """Staging that cannot be had (GPU memory exhausted, a registration refused) makes the get's
    pages misses with a warning naming why; nothing is posted and nothing reaches the caller."""
    if device is not None:
        pytest.importorskip("torch")
    with _late_tier(cluster, 2.0) as (t, gate):
        gate.set()
        if device is not None:
            host_as_vram(t)
        keys = [f"nostage-{i}" for i in range(6)]
        b = DeviceBufs(t, 6, PAGE, device) if device else Bufs(t, 6, PAGE)
        assert t.put(keys, b.fill(keys)) == [True] * 6
        pages = b.poisoned(6)
        stg = t._stagings.for_pages(pages)

        def refuse(nbytes: int):  # noqa: ANN202
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.50 MiB")

        stg.acquire = refuse
        posted: list = []
        real_submit = _hold_reads_back(t, threading.Event(), posted)  # records any READ posted
        before = t.stats()
        assert t.get(keys, pages) == [False] * 6
        assert posted == []
        assert t.stats()["get_failed"] - before["get_failed"] == 6
        assert any("no " in r.getMessage() and "staging" in r.getMessage() and "out of memory" in r.getMessage()
                   for r in caplog.records)
        got = b.dst_bytes() if device else b.dst.numpy()
        assert np.all(got[:6 * PAGE] == POISON)
        del stg.acquire  # the class's own again
        t.engine.submit = real_submit
        ok = t.get(keys, b.poisoned(6))
        assert ok == [True] * 6
        b.check(keys, ok)


class _Fake:
    def __init__(self, outcomes: list) -> None:
        self.outcomes = outcomes

    def done(self) -> bool:
        o = self.outcomes.pop(0) if self.outcomes else True
        if isinstance(o, BaseException):
            raise o
        return o


def test_a_request_whose_fate_is_unknown_keeps_its_memory_for_the_hold(monkeypatch):
    """A request NIXL no longer knows (its peer's agent replaced while it ran: `TransferTimeout`)
    may still move bytes: finished only `hold_s` later. A completed or failed one is finished."""
    assert LateRequest(_Fake([False, True])).done() is False
    assert LateRequest(_Fake([True])).done() is True
    assert LateRequest(_Fake([TransferError("failed")])).done() is True
    clock = [100.0]
    monkeypatch.setattr(batch_mod.time, "monotonic", lambda: clock[0])
    r = LateRequest(_Fake([TransferTimeout("reconnected while in flight")]), hold_s=30.0)
    assert r.done() is False
    clock[0] += 29.0
    assert r.done() is False
    clock[0] += 2.0
    assert r.done() is True


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
