"""Many processes, one namespace: what they share, and what a process that dies leaves behind.

The other process is a real child (`hicache_gds.testing.peer`) holding its own PageStore; page
bytes derive from each key (random-looking, never zeros), destinations are poisoned before reads.
"""

import os
import threading

import pytest

from hicache_gds import PageStore
from hicache_gds.slabs.owners import holders
from hicache_gds.testing.clients import Client
from hicache_gds.testing.invariants import index_problems
from hicache_gds.testing.peer import Peer

P = 64 << 10
SLOTS = 64


def client(d, slots=SLOTS, **kw):
    return Client("store", d, page=P, slots=slots, engine="bounce", pages=64, identity={"model": "peer"}, **kw)


def keys(n, tag="k"):
    return [f"{tag}{i:04d}" for i in range(n)]


def test_pages_published_by_one_process_are_read_byte_exact_by_another(gds_dir):
    with client(gds_dir) as me, Peer(gds_dir, slots=SLOTS) as peer:
        assert peer.ready["namespace"] == me.store.namespace
        assert me.put(keys(20)) == [True] * 20
        # visible at the other's next lookup, and byte-exact there
        assert peer.call("exists", keys=keys(20) + ["absent"]) == [True] * 20 + [False]
        assert peer.call("read", keys=keys(20)) == ["ok"] * 20
        # and the other way round
        assert peer.call("put", keys=keys(10, "p")) == [True] * 10
        assert me.exists(keys(10, "p")) == [True] * 10 and me.prefix(keys(10, "p") + ["x"]) == 10
        assert me.verify(keys(10, "p")) == {"good": 10, "miss": 0, "wrong": 0}
        assert sorted(holders(me.store.dirs[0])) == sorted([os.getpid(), peer.pid])
        assert index_problems(me.index) == []


@pytest.mark.slow
def test_the_same_keys_put_by_several_processes_at_once_are_stored_once(gds_dir):
    ks = keys(48)
    peers = [Peer(gds_dir, slots=3 * 48) for _ in range(3)]  # room for every copy in flight
    try:
        out = {}

        def put(i, p):
            out[i] = p.call("put", keys=ks)

        ts = [threading.Thread(target=put, args=(i, p)) for i, p in enumerate(peers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert all(out[i] == [True] * len(ks) for i in range(3)), out
        with client(gds_dir, slots=3 * 48) as me:
            st = me.store.stats()
            assert st["pages"] == len(ks) and st["free_slots"] == 3 * 48 - len(ks)  # one copy each, no slot lost
            assert me.verify(ks) == {"good": len(ks), "miss": 0, "wrong": 0}
            assert index_problems(me.index) == []
    finally:
        for p in peers:
            p.close()


def test_reservations_of_a_killed_process_are_reclaimed(gds_dir):
    with client(gds_dir) as me:
        peer = Peer(gds_dir, slots=SLOTS)
        held = peer.call("reserve", n=40)
        assert len(held) == 40
        assert me.store.stats()["reserved_slots_all"] == 40
        peer.kill()
        # the survivor needs those slots: it finds their owner gone and takes them back
        assert me.put(keys(SLOTS)) == [True] * SLOTS
        st = me.store.stats()
        assert st["reserved_slots_all"] == 0 and st["reclaimed_slots"] == 40 and st["evictions"] == 0
        assert me.verify(keys(SLOTS))["good"] == SLOTS
        assert index_problems(me.index) == []


def test_a_put_right_after_open_reclaims_what_a_process_killed_since_held(gds_dir, monkeypatch):
    """Puts short of slots look for dead owners at most every `_RECLAIM_EVERY_S`; the look a
    store takes at open does not count, so a process killed just after (here: however long the
    limit) never leaves its reservations to eviction or to failed puts."""
    from hicache_gds.index import index as index_mod
    monkeypatch.setattr(index_mod, "_RECLAIM_EVERY_S", 3600.0)
    with client(gds_dir) as me:
        peer = Peer(gds_dir, slots=SLOTS)
        assert len(peer.call("reserve", n=40)) == 40
        peer.kill()
        assert me.put(keys(SLOTS)) == [True] * SLOTS
        st = me.store.stats()
        assert st["reclaimed_slots"] == 40 and st["evictions"] == 0 and st["reserved_slots_all"] == 0
        assert me.verify(keys(SLOTS))["good"] == SLOTS


def test_a_restart_after_kill9_frees_everything_the_dead_held(gds_dir):
    peer = Peer(gds_dir, slots=SLOTS)
    assert peer.call("put", keys=keys(8)) == [True] * 8
    peer.call("pin", keys=keys(4))
    peer.call("reserve", n=16)
    peer.kill()
    with client(gds_dir) as me:  # first opener of a namespace nobody has open: recovers it
        st = me.store.stats()
        assert st["pages"] == 8 and st["reserved_slots_all"] == 0 and st["leased_slots_all"] == 0
        assert st["free_slots"] == SLOTS - 8
        assert me.verify(keys(8))["good"] == 8
        assert index_problems(me.index) == []


def test_a_page_another_process_reads_is_never_evicted_and_its_slot_never_reused(gds_dir):
    with client(gds_dir) as me, Peer(gds_dir, slots=SLOTS) as peer:
        assert me.put(keys(8, "old")) == [True] * 8
        slots = peer.call("pin", keys=keys(2, "old"))  # a read in flight in the other process
        # fill the namespace twice over: everything else is evicted, the leased pages stay
        for r in range(2):
            assert all(me.put(keys(SLOTS - 2, f"new{r}-")))
        assert me.exists(keys(8, "old")) == [True] * 2 + [False] * 6
        assert peer.call("read", keys=keys(2, "old")) == ["ok", "ok"]
        # a leased page deleted by another process: gone at once, its slot not reused until the lease ends
        assert me.store.delete(keys(2, "old")) == [True, True]
        assert me.store.stats()["doomed_slots"] == 2
        assert me.put(keys(SLOTS, "new2-")) == [True] * (SLOTS - 2) + [False] * 2  # 2 slots are still being read
        assert not set(slots) & {e.slot for e in me.index.peek(keys(SLOTS, "new2-")).values()}
        peer.call("unpin")
        st = me.store.stats()
        assert st["doomed_slots"] == 0 and st["leased_slots_all"] == 0
        assert index_problems(me.index) == []


def test_one_lru_for_the_namespace_touched_by_every_process(gds_dir):
    with client(gds_dir, slots=16) as me, Peer(gds_dir, slots=16) as peer:
        assert me.put(keys(16)) == [True] * 16
        assert peer.call("read", keys=keys(4)) == ["ok"] * 4  # the other process's reads count
        assert me.put(keys(4, "n")) == [True] * 4
        assert me.exists(keys(16)) == [True] * 4 + [False] * 4 + [True] * 8


def test_clear_and_delete_in_one_process_are_seen_by_the_others(gds_dir):
    with client(gds_dir) as me, Peer(gds_dir, slots=SLOTS) as peer:
        assert peer.call("put", keys=keys(12)) == [True] * 12
        assert me.exists(keys(12)) == [True] * 12
        assert peer.call("delete", keys=keys(2)) == [True, True]
        assert me.exists(keys(3)) == [False, False, True]
        assert peer.call("clear") == 10
        assert me.exists(keys(12)) == [False] * 12 and len(me.index) == 0
        assert me.put(keys(4)) == [True] * 4 and peer.call("exists", keys=keys(4)) == [True] * 4
        assert index_problems(me.index) == []


def test_a_second_opener_keeps_the_size_the_namespace_has_while_it_is_open(gds_dir, caplog):
    with client(gds_dir) as me:
        other = client(gds_dir, slots=SLOTS * 2)  # same namespace (capacity is not in its identity)
        try:
            assert other.store.stats()["slots"] == SLOTS
            assert "not applied while they have it open" in caplog.text
        finally:
            other.close()
        assert me.put(keys(4)) == [True] * 4
    with client(gds_dir, slots=SLOTS * 2) as alone:  # nobody else has it open: resized
        assert alone.store.stats()["slots"] == SLOTS * 2 and alone.exists(keys(4)) == [True] * 4


def test_two_stores_of_one_namespace_in_one_process(gds_dir):
    a, b = client(gds_dir), client(gds_dir)
    try:
        assert a.put(keys(6)) == [True] * 6
        assert b.verify(keys(6)) == {"good": 6, "miss": 0, "wrong": 0}
        assert holders(a.store.dirs[0]) == [os.getpid(), os.getpid()]
    finally:
        a.close()
        b.close()
    assert holders(a.store.dirs[0]) == []


def test_holders_of_a_namespace_that_does_not_exist(gds_dir):
    assert holders(os.path.join(gds_dir, "ns-none")) == []


@pytest.mark.parametrize("bad", ["symlink", "file"])
def test_a_planted_procs_entry_is_refused(gds_dir, tmp_path, bad):
    with client(gds_dir) as me:
        d = me.store.dirs[0]
    procs = os.path.join(d, "procs")
    os.rmdir(procs)
    outside = tmp_path / "outside"
    outside.mkdir()
    if bad == "symlink":
        os.symlink(str(outside), procs)
    else:
        open(procs, "w").close()
    from hicache_gds import ConfigError
    with pytest.raises(ConfigError, match="procs"):
        PageStore(P, {"model": "peer"}, config={"gds_path": gds_dir, "capacity": SLOTS * P, "engine": "bounce"})
    assert os.listdir(outside) == []  # nothing written through the link
