"""A link cut and restored: the connection that carried a request left to finish is replaced.

Over TCP, a request posted while a node's link is down leaves its connection in retransmission
back-off: once the link is back, nothing moves on that connection until its next retry, as long
after the cut as the cut lasted. Every request queued behind it timed out too, so a server that
answered again stayed set aside for 2, 4, 8 ... s, and its acknowledged pages were misses
(`test_cluster_netns.py::test_fault[cut_link]` lost promised pinned pages that way, with batches
waited for one request after another and with all of them in flight at once alike). Here that
connection is modelled by its peer id: requests on it never complete, a new connection works.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import numpy as np
import pytest

from hicache_gds.engines.base import MemKind, Op, Transfer
from hicache_gds.errors import TransferTimeout
from hicache_gds.remote.directory import Directory
from remote_helpers import Bufs, tier
from remote_procs import PAGE


class _Stalled(Transfer):
    def _poll(self) -> bool:
        return False


def test_a_server_back_from_a_cut_link_serves_its_acknowledged_pages_after_one_hold(cluster):
    io_timeout = 0.5
    t = tier(cluster["url"], cluster["prefix"], PAGE, uuid.uuid4().hex, io_timeout=io_timeout)
    try:
        keys = [f"ack-{i}" for i in range(24)]
        b = Bufs(t, 24, PAGE)
        assert t.put(keys, b.fill(keys)) == [True] * 24  # acknowledged
        sids = [e.split("|")[0] for e in Directory(t.opts.url, t.opts.prefix).lookup(t.namespace, keys)]
        cut_sid = sids[0]
        on_cut = [s == cut_sid for s in sids]
        assert 0 < sum(on_cut) < 24
        link = {"up": False}
        stalled: set[int] = set()  # connections that carried a request while the link was down
        real = t.engine.submit

        def submit(op, kind, mem, rem):  # noqa: ANN001, ANN202
            pid = int(rem[0, 0])
            if pid in stalled or (not link["up"] and pid == t._peers[cut_sid].peer_id):
                stalled.add(pid)
                return _Stalled("nixl-ucx", op, int(mem[:, 1].sum()), "a connection in TCP back-off")
            return real(op, kind, mem, rem)

        t.engine.submit = submit
        t0 = time.monotonic()
        ok = t.get(keys, b.poisoned(24))  # the link is down: its server's pages miss, every other page is served
        assert ok == [not c for c in on_cut] and time.monotonic() - t0 < io_timeout + 1.0
        b.check(keys, ok)
        assert t._peers[cut_sid].strikes == 1
        link["up"] = True
        # after one hold the server is tried again on a new connection: every acknowledged page is
        # served, byte-exact, with no second timeout
        time.sleep(io_timeout + 0.05)
        t0 = time.monotonic()
        ok = t.get(keys, b.poisoned(24))
        assert ok == [True] * 24 and time.monotonic() - t0 < io_timeout, (ok, time.monotonic() - t0)
        b.check(keys, ok)
        assert t._peers[cut_sid].strikes == 0 and t.stats()["timeouts"] == 1
        assert t._peers[cut_sid].peer_id not in stalled
        more = [f"new-{i}" for i in range(24)]  # and new keys land on it again
        assert t.put(more, b.fill(more)) == [True] * 24
        assert cut_sid in {e.split("|")[0] for e in Directory(t.opts.url, t.opts.prefix).lookup(t.namespace, more)}
        ok = t.get(more, b.poisoned(24))
        assert ok == [True] * 24
        b.check(more, ok)
        assert t.exists(keys) == [True] * 24  # nothing acknowledged was dropped on the way
    finally:
        t.close()


def test_a_request_in_flight_when_its_peer_is_reconnected_is_a_timeout_and_may_still_land(monkeypatch):
    """NIXL does not cancel what the old connection carries when its agent is removed: the
    request's bytes land later. So its poll says `TransferTimeout` (memory and slot stay held),
    never a failure that would hand the slot back while a WRITE can still land in it."""
    from hicache_gds.memory import HostBuffer
    from hicache_gds.remote.ucx import NixlUcxEngine

    monkeypatch.setenv("UCX_TLS", "tcp")  # the page server's worker answers a READ: it stalls until polled
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    a, b = NixlUcxEngine(), NixlUcxEngine()
    src, dst = HostBuffer(2 * PAGE, pinned=False), HostBuffer(2 * PAGE, pinned=False)
    stop = threading.Event()

    def serve() -> None:  # what a page server's progress thread does
        while not stop.wait(5e-4):
            b.agent.get_new_notifs()

    th = threading.Thread(target=serve)
    try:
        src.numpy()[:] = np.frombuffer(os.urandom(2 * PAGE), dtype=np.uint8)
        dst.numpy()[:] = 0xA5
        b.register_memory(src.addr, src.nbytes)
        a.register_memory(dst.addr, dst.nbytes)
        md = b.agent.get_agent_metadata()

        def read(pid: int, i: int) -> Transfer:
            return a.submit(Op.READ, MemKind.DRAM, np.array([[dst.addr + i * PAGE, PAGE]], dtype=np.uint64),
                            np.array([[pid, src.addr + i * PAGE]], dtype=np.uint64))

        pid = a.add_peer(md)
        old = read(pid, 0)
        for _ in range(200):
            assert not old.done()  # posted; the server's worker is not polled yet
        a.remove_peer(pid)  # what the tier does to reconnect
        pid = a.add_peer(md)
        th.start()
        new = read(pid, 1)
        new.wait(10)
        assert np.array_equal(dst.numpy()[PAGE:], src.numpy()[PAGE:])
        with pytest.raises(TransferTimeout, match="reconnected"):
            for _ in range(100_000):
                old.done()
        deadline = time.monotonic() + 10
        while not np.array_equal(dst.numpy()[:PAGE], src.numpy()[:PAGE]) and time.monotonic() < deadline:
            read(pid, 1).wait(10)  # polling the worker: the old connection delivers too
        assert np.array_equal(dst.numpy()[:PAGE], src.numpy()[:PAGE]), "the old request's bytes landed after all"
    finally:
        stop.set()
        if th.is_alive():
            th.join(10)
        a.close()
        b.close()
