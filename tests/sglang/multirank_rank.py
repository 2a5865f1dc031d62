"""One rank of a multi-rank server for `test_multirank` (run as a process: ``python multirank_rank.py
SCENARIO RANK WORLD PORT DIR``).

Each rank is `test_split.World` -- SGLang 0.5.17's real ``HiRadixCache`` and controller paths over
its own hicache-gds store, holding its own shard of the prompt's KV (its own random bytes) -- in a
gloo group standing in for SGLang's TP group, reduced through SGLang's own ``_all_reduce``. The
scenario gives each rank its own observations (read rate, how much of its tail it read, a read
that fails, a hold limit that passes, its GPU backlog) and prints, as its last line, a JSON list
of what it decided at each step, with whether every page its request's prefix points at holds
the true bytes of that page of its shard.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch.distributed as dist  # noqa: E402

import sglang.srt.managers.cache_controller as cc_mod  # noqa: E402
import sglang.srt.mem_cache.hicache_storage as hs_mod  # noqa: E402

import test_split as T  # noqa: E402
from hicache_gds_sglang import policy_hooks as hooks  # noqa: E402
from hicache_gds_sglang import split_policy  # noqa: E402
from hicache_gds_sglang import room  # noqa: E402

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def world(rank: int, n: int, base: str, *, read_ratio: float, measured: bool = False):
    """`test_split.World` for this rank: its own store and shard, SGLang's TP fields on its cache
    (set before the policy settles on it, as SGLang's constructor sets them). `measured`: its
    read rate is one its own gets measured (a server that ran a while: the ranks' rates differ,
    and the seed agreement has nothing to do), not a seed."""
    pool = T.make_pool
    T.make_pool = lambda *a, **k: pool(*a, **{**k, "seed": 100 + rank})  # this rank's shard: its own bytes
    settle = hooks._settle

    def tp_settle(cache):
        cache.tp_world_size, cache.tp_group, cache.pp_rank, cache.pp_size, cache.pp_group = \
            n, dist.group.WORLD, 0, 1, None
        cache.attn_cp_group = cache.attn_tp_group = None
        settle(cache)

    hooks._settle = tp_settle
    d = os.path.join(base, f"rank{rank}")
    os.makedirs(d, exist_ok=True)
    try:
        w = T.World(d, read_ratio=read_ratio)
    finally:
        hooks._settle, T.make_pool = settle, pool
    if measured:
        rate = w.b.read_rate.rate
        w.b.read_rate.observe(1 << 40, (1 << 40) / rate)
    return w


def prefix_ok(w, req) -> bool:
    try:
        w.check_prefix(req)
        return True
    except AssertionError:
        return False


def admitted(w, log: list):
    req = w.admitted()
    d = w.pol.decided["r1"]
    t = w.pol.tails.get("r1")
    log.append(["admit", d.action, d.hit, None if t is None else [t.load.start, t.load.end]])
    return req


def chunks(w, req, log: list, upto) -> None:
    for end in upto:
        if end > len(req.prefix_indices):  # (a tail joined up to it: nothing left to compute)
            w.compute_chunk(req, end)
        log.append(["chunk", end, len(req.prefix_indices), "r1" in w.pol.tails, "r1" in w.pol.parked,
                    prefix_ok(w, req)])


# -- scenarios: (rank, world) -> each rank's own observations -----------------------------------------
RATIOS = [1.0, 1.3, 2.0, 1.6]  # each rank's read rate against its prefill: heads 512, 768, 768, 768 alone


@scenario
def split_join(w_of, rank, n, log):
    """Each rank proposes its own head and reads its own share of its tail (rank 1's read fails
    after one get); all join what every rank read, at the agreed head."""
    w = w_of(RATIOS[rank], measured=True)
    req = admitted(w, log)
    w.read_tail(gets=None if rank != 1 else 1)
    chunks(w, req, log, [T.CHUNK, 2 * T.CHUNK, 3 * T.CHUNK])
    w.load_done()
    chunks(w, req, log, [T.PAGES * T.PS])
    w.release(req)
    return w


@scenario
def split_slow_rank(w_of, rank, n, log):
    """The last rank has read nothing of its tail when the chunks reach it (its disk is slow):
    every rank takes the same verdict, and joins only what every rank read."""
    w = w_of(1.0)
    req = admitted(w, log)
    if rank != n - 1:
        w.read_tail()
    chunks(w, req, log, [T.CHUNK, 2 * T.CHUNK])
    log.append(["tails", sorted(w.pol.tails), sorted(w.pol.parked)])
    if "r1" in w.pol.tails:  # the ranks waited a chunk: the slow rank's reads land meanwhile
        if rank == n - 1:
            w.read_tail()
        chunks(w, req, log, [3 * T.CHUNK])
    w.load_done()
    chunks(w, req, log, [T.PAGES * T.PS])
    w.release(req)
    return w


@scenario
def mixed_verdicts(w_of, rank, n, log):
    """Rank 0 would load the whole hit, the others split or compute: no rank loads or splits."""
    w = w_of([0.5, 1.0, 3.0, 1.3][rank], measured=True)
    req = admitted(w, log)
    # rank 0 logged "load", then that it was overruled; no other rank was
    log.append(["overruled where it chose to load", w.pol.counts["overruled"] == int(rank == 0)])
    log.append(["ops", sorted(w.cache.ongoing_prefetch), w.cache.cache_controller.prefetch_queue.qsize()])
    chunks(w, req, log, [T.CHUNK, T.PAGES * T.PS])
    w.release(req)
    return w


@scenario
def fresh_seed(w_of, rank, n, log):
    """A fresh server: each rank's read rate is only a seed, and each rank's differs (probed or
    persisted per rank); at the first admission every rank takes the slowest, then decides alike
    without needing to be overruled."""
    w = w_of(RATIOS[rank])
    w.pol.seeded = False
    req = admitted(w, log)
    log.append(["rate", round(w.pol.cost_model.read.rate), w.pol.counts["split"]])
    w.read_tail()
    chunks(w, req, log, [T.CHUNK, 2 * T.CHUNK, 3 * T.CHUNK, T.PAGES * T.PS])
    w.release(req)
    return w


def _held(w, rank, log):
    split_policy.PARK_HOOKED[0] = True
    req = w.admitted()
    rounds = []
    req.init_next_round_input = lambda *a, **k: rounds.append(len(req.prefix_indices))
    t = w.pol.tails["r1"].load
    log.append(["admit", w.pol.decided["r1"].action, [t.start, t.end], len(t.keys)])
    ctl = w.cache.cache_controller
    op = ctl.prefetch_queue.get_nowait()
    assert w.query(op)
    got = len(op.hash_value) if rank == 0 else 2  # rank 0 read its whole tail, the others 2 of its 8 pages
    ctl._page_get_zero_copy(op, op.hash_value[:got], op.host_indices[:got * T.PS])
    w.b.read_rate.seed(100e9, "test: a disk far faster than the GPU")
    chunks(w, req, log, [T.CHUNK, 2 * T.CHUNK])  # the chunks reach the tail: held there
    return req, op, rounds


def _pass(w, req, log):
    adder = T._Adder(w.cache)
    held = hooks.around_add_chunked_req(adder.add, adder, req) is req
    log.append(["pass", held, len(req.prefix_indices), "r1" in w.pol.tails, prefix_ok(w, req)])
    return held


def _end(w, req, op, log):
    w.cache.cache_controller.append_host_mem_release(op.host_indices[op.completed_tokens:])
    w.load_done()
    chunks(w, req, log, [T.PAGES * T.PS])
    w.release(req)


@scenario
def hold_until_all_read(w_of, rank, n, log):
    """The request is held on every rank while any rank reads; it joins the whole tail once
    every rank has read it (rank 0 read its tail first)."""
    w = w_of(1.0)
    req, op, rounds = _held(w, rank, log)
    _pass(w, req, log)
    _pass(w, req, log)
    if rank != 0:
        w.cache.cache_controller._page_get_zero_copy(op, op.hash_value[2:], op.host_indices[2 * T.PS:])
    _pass(w, req, log)
    log.append(["rounds", rounds])
    _end(w, req, op, log)
    return w


@scenario
def hold_read_fails(w_of, rank, n, log):
    """One rank's tail read fails while the request is held: every rank ends the hold at the
    same pass and joins what every rank read."""
    w = w_of(1.0)
    req, op, rounds = _held(w, rank, log)
    _pass(w, req, log)
    if rank == n - 1:  # its next get fails: SGLang ends the operation
        ctl = w.cache.cache_controller
        real = w.b.batch_get_v1
        w.b.batch_get_v1 = lambda ks, hi, *a: [False] * len(ks)
        try:
            ctl._page_get_zero_copy(op, op.hash_value[2:], op.host_indices[2 * T.PS:])
            op.mark_terminate()  # as the controller's `_page_transfer` does after a short get
        finally:
            w.b.batch_get_v1 = real
    _pass(w, req, log)
    _end(w, req, op, log)
    return w


@scenario
def hold_limit_passes(w_of, rank, n, log):
    """One rank's hold limit passes (its clock): every rank ends the hold at the same pass."""
    w = w_of(1.0)
    req, op, rounds = _held(w, rank, log)
    _pass(w, req, log)
    if rank == 1:
        w.pol.parked["r1"] = 0.0
    _pass(w, req, log)
    _end(w, req, op, log)
    return w


@scenario
def late_admission(w_of, rank, n, log):
    """A request admission sent to the GPU waits; each rank sees its own GPU backlog ahead of it.
    It goes to the disk only at the step every rank's disk can read it before its GPU reaches it,
    and then on every rank."""
    w = w_of(6.0)
    req = admitted(w, log)
    w.sched.waiting_queue = [req]
    w.sched._prefetch_kvcache = w.admit  # SGLang's own path matches it again and asks admission
    backlog = {"g": 0.0}
    w.pol.gpu_backlog = lambda cache, model: ({"r1": backlog["g"]}, backlog["g"])
    for step, ahead in enumerate([[0.0] * n, [100.0] * (n - 1) + [0.0], [100.0] * n, [100.0] * n]):
        backlog["g"] = ahead[rank]
        got = w.pol.late_admit(w.sched)
        d = w.pol.decided["r1"]
        log.append(["late", step, got, d.action, sorted(w.cache.ongoing_prefetch)])
    for k in list(w.cache.ongoing_prefetch):  # revoke it (the controller's thread would load it)
        w.cache._revoke_pending_prefetch(k)
    w.sched.waiting_queue = []
    chunks(w, req, log, [T.PAGES * T.PS])
    w.release(req)
    return w


@scenario
def load_done_later(w_of, rank, n, log):
    """A load every rank admitted: rank 0 reads all of it first, the others half. Finished on
    one rank is no reason to stop the others' reads: every rank waits, then ends it at the pass
    every rank has read it, and inserts the whole hit."""
    w = w_of(0.5)  # loading is twice as fast as computing: admitted whole
    req = w.request()
    w.admit(req)
    ctl = w.cache.cache_controller
    op = ctl.prefetch_queue.get_nowait()
    assert w.query(op)
    half = len(op.hash_value) // 2
    got = len(op.hash_value) if rank == 0 else half
    ctl._page_get_zero_copy(op, op.hash_value[:got], op.host_indices[:got * T.PS])

    def ask():
        return hooks.around_can_terminate(T.HiRadixCache.can_terminate_prefetch, w.cache, op)

    w.cache.prefetch_loaded_tokens_by_reqid, w.cache.enable_storage_metrics = {}, False  # as SGLang constructs it
    log.append(["admit", w.pol.decided["r1"].action, ask()])
    if rank != 0:
        ctl._page_get_zero_copy(op, op.hash_value[half:], op.host_indices[half * T.PS:])
    log.append(["done", ask(), w.cache.check_prefetch_progress("r1")])
    m = w.cache.match_prefix(T.MatchPrefixParams(key=T.RadixKey(w.tokens[:T.PAGES * T.PS])))
    log.append(["inserted", int(m.host_hit_length)])


def _tp_cache(rank, n, d, ratio=None, **extra):
    """`test_policy`'s harness on the release installed (0.5.17's HiRadixCache or 0.5.23's
    UnifiedRadixCache) over this rank's own store in `d`, SGLang's TP fields on its cache.
    `ratio`: the read rate configured, at which loading takes `ratio` x computing."""
    import test_policy as P
    hooks.SUPPORTED.add(P.CACHE)  # as test_policy's fixture (and plugin.register) does
    if ratio is not None:
        extra["policy_read_gbps"] = P.gbps_for(ratio)
    os.makedirs(d, exist_ok=True)
    b, _ = P.open_backend(d, **extra)
    made_backends.append(b)
    cache, _, pol = P.make_cache(b, queue_reqs=[P.req("q0", 60000)])
    cache.tp_world_size, cache.tp_group, cache.pp_rank, cache.pp_size, cache.pp_group = \
        n, dist.group.WORLD, 0, 1, None
    cache.attn_cp_group = cache.attn_tp_group = None
    return P, b, cache, pol


@scenario
def late_any_release(w_of, rank, n, log):
    """Late admission on the release installed (`_tp_cache`): a request sent to the GPU behind
    10 s of prefill waits; the disk turns fast on rank 0 first (its own gets), then on every
    rank. It goes to the disk at that second step, on every rank."""
    P, b, cache, pol = _tp_cache(rank, n, os.path.join(BASE[0], f"late-rank{rank}"),
                                 ratio=8.0)  # loading takes 8x computing
    sched, calls, r1 = cache._test_scheduler, [], P.req("r1", 18000)
    pol.current_req = r1
    P.admit(cache, "r1", 18000 - 64, calls)
    pol.current_req = None
    sched.waiting_queue.append(r1)
    log.append(["admit", pol.decided["r1"].action, list(calls)])
    sched.tree_cache = cache
    sched._prefetch_kvcache = lambda r: hooks.around_prefetch_kvcache(
        lambda s, q: P.admit(cache, q.rid, 18000 - 64, calls), sched, r)
    for step, fast in enumerate([[False] * n, [True] + [False] * (n - 1), [True] * n, [True] * n]):
        if fast[rank]:
            b.read_rate.seed(P.gbps_for(0.5) * 1e9, "test: this rank's gets run faster")
        got = pol.late_admit(sched)
        log.append(["late", step, got, pol.decided["r1"].action, list(calls)])


@scenario
def room_any_release(w_of, rank, n, log):
    """A load turned down for host room on rank 0 only (the others have room and would load): held
    on every rank. Room comes back on rank 0 first but not on the last rank (a shared step where
    not every rank has room: still held), then on every rank, for one of the two: the first is
    prefetched on every rank at that step. The second, held the same way: the ranks that had room
    defer to rank 0's deadline (theirs passes at once), so it is held on every rank until rank 0's
    passes too, then released to the GPU on every rank."""
    P, b, cache, pol = _tp_cache(rank, n, os.path.join(BASE[0], f"room-rank{rank}"), ratio=0.1)
    room.HOOKED[0] = True
    sched, calls = cache._test_scheduler, []
    free = [12288 if rank == 0 else 40000]
    cache.cache_controller.mem_pool_host.available_size = lambda: free[0]
    P.in_flight(cache, b, "ahead", 8192, kept=0)  # a load in flight gives room back
    sched.waiting_queue = [P.req("ahead", 8192 + 64)]
    sched.tree_cache = cache
    sched._prefetch_kvcache = lambda r: hooks.around_prefetch_kvcache(
        lambda s, q: P.admit(cache, q.rid, 18000 - 64, calls), sched, r)

    def check(rid):  # the release's check_prefetch_progress hook, SGLang answering "ready"
        if P.V23:
            return hooks.around_check_progress_0523(lambda *a, **kw: True, cache, P.handle(rid))
        return hooks.around_check_progress(lambda *a, **kw: True, cache, rid)

    for rid in ("m", "n"):
        r = P.req(rid, 18000)
        pol.current_req = r
        P.admit(cache, rid, 18000 - 64, calls)
        pol.current_req = None
        sched.waiting_queue.append(r)
        log.append(["admit", rid, pol.decided[rid].action, rid in pol.room_wait, list(calls)])
    log.append(["check", check("m"), check("n")])
    for step, has_room in enumerate([[True] + [False] * (n - 1), [True] * n]):
        free[0] = 30000 if has_room[rank] else 12288  # room for one of the two
        got = pol.late_admit(sched)
        log.append(["take", step, got, "m" in pol.room_wait, list(calls)])
    log.append(["deadline", check("n"), "n" in pol.room_wait])  # rank 0's has not passed
    pol.room_wait["n"] = pol.room_wait["n"]._replace(until=0.0)
    log.append(["deadline", check("n"), "n" in pol.room_wait, pol.counts["room_timeout"]])


@scenario
def ride_any_release(w_of, rank, n, log):
    """Finished loads ride along a chunked request's pass (`ride`, ``policy_ride`` on) on the release
    installed, each rank's plan a vote. Pass 0: p3's load finished on rank 0 only: no seat on any
    rank. Pass 1: finished on every rank: p3 rides on every rank, beside a chunk shortened alike.
    Pass 2: rank 0 alone lacks GPU memory for it (and would wait a decode step): no wait and no
    seat anywhere. Pass 3: every rank lacks it: every rank waits a decode step."""
    import dataclasses

    import test_ride as R
    from hicache_gds_sglang import cut
    from hicache_gds_sglang.records import Decided, Protected

    P, b, cache, pol = _tp_cache(rank, n, os.path.join(BASE[0], f"ride-rank{rank}"), ratio=0.1)
    b.policy_config = dataclasses.replace(b.policy_config, ride=True)
    saved, cut.CUT_HOOKED[0] = cut.CUT_HOOKED[0], True  # as plugin.register sets it where both adder points are hooked
    sched = cache._test_scheduler
    sched.tree_cache = cache
    p3 = R._req("p3", 64, prompt=17280)
    sched.waiting_queue = [R._req("x", 20000), p3]
    pol.decided["p3"] = Decided("load", 17280, 0, 17216)
    ending = [R._req("e", 0, prompt=22000, max_new=8, out=3)]
    for step, (done, short) in enumerate([([True] + [False] * (n - 1), [False] * n), ([True] * n, [False] * n),
                                          ([True] * n, [True] + [False] * (n - 1)), ([True] * n, [True] * n)]):
        if done[rank]:
            pol.protected["p3"] = Protected(None, 0.0, 17216)
        chunked, p3.extend = R._req("c", 50000), None
        adder = R.Adder(cache, room=R.CHUNK + (10000 if short[rank] else 10 ** 6), running=ending)
        out = R._pass(types.SimpleNamespace(sched=sched), adder, chunked)
        log.append(["pass", step, out is chunked, chunked.extend, [r.rid for r in adder.can_run_list],
                    adder.prefill_max_requests])
    pol.protected.pop("p3", None)
    cut.CUT_HOOKED[0] = saved


class _Removed:
    """Removes a directory when closed (after the backends over it: `made_backends`' order)."""

    def __init__(self, d):
        self.d = d

    def close(self):
        shutil.rmtree(self.d, ignore_errors=True)


def _seed_dir(rank, name, elsewhere=False):
    """(this rank's store directory, whether it is where asked): under the test's, or
    (`elsewhere`) on another filesystem, tmpfs, where there is one (else under the test's)."""
    other = "/dev/shm"
    if elsewhere and os.path.isdir(other) and os.access(other, os.W_OK) and \
            os.stat(other).st_dev != os.stat(BASE[0]).st_dev:
        return tempfile.mkdtemp(prefix=f"hgds-{name}-rank{rank}-", dir=other), True
    return os.path.join(BASE[0], f"{name}-rank{rank}"), not elsewhere


def _first_admission(P, b, cache, pol, log):
    """The first admission, where the ranks agree the read rate seed: logs the rate agreed,
    whether it is still a probe's, and what the policy's log line says of it."""
    lines: list = []
    h = logging.Handler(logging.INFO)
    h.emit = lambda record: lines.append(record.getMessage())
    logger = hooks.log
    level = logger.level
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    try:
        pol.seeded = False
        pol.current_req = P.req("r1", 18000)
        P.admit(cache, "r1", 18000 - 64, [])
    finally:
        pol.current_req = None
        logger.removeHandler(h)
        logger.setLevel(level)
    said = [m for m in lines if "read rate seed agreed across ranks" in m]
    line = said[0] if len(said) == 1 else f"{len(said)} seed lines"
    n = dist.get_world_size()
    log.append(["agreed", round(b.read_rate.rate), b.read_rate.seed_alone,
                f"shared by {n} ranks on one device" in line, "not divided" in line])


def _probed(rank, n, log, name, elsewhere=False):
    d, placed = _seed_dir(rank, name, elsewhere)
    P, b, cache, pol = _tp_cache(rank, n, d, read_probe="8M")  # no rate configured: each rank probes alone
    made_backends.append(_Removed(d))  # (closed after the backend)
    if not placed:
        b.read_device = (1 << 40) + rank  # no other filesystem: each rank's store said to be on a device of its own
    log.append(["probe", round(b.read_rate.rate), b.read_rate.seed_alone, b.read_device])
    _first_admission(P, b, cache, pol, log)


@scenario
def seed_probed_one_device(w_of, rank, n, log):
    """Every rank's store on one device, each rank's seed its probe, read alone: the ranks start
    from the slowest probe divided by the ranks (serving, they read the device at once)."""
    _probed(rank, n, log, "probed-one")


@scenario
def seed_probed_two_devices(w_of, rank, n, log):
    """The odd ranks' stores on another device: each probe is what its rank reads, the slowest kept."""
    _probed(rank, n, log, "probed-two", elsewhere=rank % 2 == 1)


@scenario
def seed_configured(w_of, rank, n, log):
    """A configured read rate (here a different one per rank) on one device: the slowest, whole."""
    P, b, cache, pol = _tp_cache(rank, n, os.path.join(BASE[0], f"configured-rank{rank}"),
                                 ratio=RATIOS[rank], read_probe="8M")
    log.append(["configured", round(b.read_rate.rate), b.read_rate.seed_alone, b.read_device])
    _first_admission(P, b, cache, pol, log)


BASE: list = [""]
made_backends: list = []


def main() -> None:
    """Run the scenarios named (comma-separated) one after another, each on fresh worlds, and
    print {scenario: its log, or the error it ended with}."""
    names, rank, n, port, base = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=float(os.environ.get("MULTIRANK_TIMEOUT_S", "60"))))
    cc_mod.STORAGE_BATCH_SIZE = hs_mod.STORAGE_BATCH_SIZE = T.BATCH
    if T.HiRadixCache is not None:  # 0.5.17
        hooks.SUPPORTED.add(T.HiRadixCache)
    out: dict = {}
    BASE[0] = base
    for name in names:
        T.backend_mod._RATES.clear()
        T.view._logged.clear()
        split_policy.SPLIT_HOOKED[0], split_policy.PARK_HOOKED[0] = True, False
        log: list = []
        made: list = []

        def w_of(ratio, measured=False):
            made.append(world(rank, n, os.path.join(base, name), read_ratio=ratio, measured=measured))
            return made[-1]

        try:
            SCENARIOS[name](w_of, rank, n, log)
            out[name] = log
        except Exception as exc:  # noqa: BLE001 -- reported to the test, which fails on it
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "log": log}
        finally:
            for w in made + made_backends:
                w.close()
            made_backends.clear()
        dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
