"""Split, its hold and late admission on a multi-rank server (TP=2 and TP=4): every rank takes
the same decision at the same step although each observes its own rates, reads and clock.

Each rank is a process (`multirank_rank`) running the plugin's policy on SGLang 0.5.17's real
``HiRadixCache`` and controller over its own hicache-gds store and its own shard of random KV,
the ranks joined by a gloo group in SGLang's TP fields, so the agreements go through SGLang's
own ``_all_reduce``. The ranks are given different observations -- read rates that make each
propose its own split (or a load, or a recompute), a tail read that fails on one rank, a rank
whose reads land a chunk later, a hold limit that passes on one rank, GPU backlogs that differ --
and the tests check that the decision logs are identical across ranks, step by step, that every
page a request's prefix points at holds the true bytes of that rank's page (destinations
poisoned beforehand), and that no collective is left waiting (the gloo group's timeout and the
processes' own bound a hang).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

try:
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache  # noqa: F401 -- 0.5.17
except ImportError:
    HiRadixCache = None

needs_0517 = pytest.mark.skipif(HiRadixCache is None, reason="SGLang 0.5.17's HiRadixCache (split's release)")

HERE = os.path.dirname(os.path.abspath(__file__))
SPLIT = ("load_done_later", "fresh_seed", "split_join", "split_slow_rank", "mixed_verdicts", "hold_until_all_read", "hold_read_fails",
         "hold_limit_passes", "late_admission")
SEEDS = ("seed_probed_one_device", "seed_probed_two_devices", "seed_configured")
SCENARIOS = ("late_any_release", "room_any_release", "ride_any_release", *SEEDS, *(SPLIT if HiRadixCache is not None else ()))
PAGES, PS, CHUNK = 16, 64, 256  # test_split's prompt
BPT, A = 1024, 1 / 6000  # its KV bytes per token and prefill seconds per token
RATIOS = [1.0, 1.3, 2.0, 1.6]  # multirank_rank's: each rank's read time against its prefill time


def _run(n: int, base: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1", MULTIRANK_TIMEOUT_S="60")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multirank_rank.py"), ",".join(SCENARIOS), str(r),
                               str(n), port, base], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(n)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120 + 60 * n)
            assert p.returncode == 0, err[-4000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["tp2", "tp4"])
def ranks(request, tmp_path_factory):
    return _run(request.param, str(tmp_path_factory.mktemp(f"tp{request.param}")))


def _same(ranks, name) -> list:
    logs = [r[name] for r in ranks]
    for i, log in enumerate(logs):
        assert not (isinstance(log, dict) and "error" in log), f"rank {i}: {log}"
    assert all(log == logs[0] for log in logs), "ranks decided differently:\n" + "\n".join(map(json.dumps, logs))
    return logs[0]


@needs_0517
def test_a_split_is_taken_at_the_longest_head_any_rank_chose_and_joins_what_every_rank_read(ranks):
    log = _same(ranks, "split_join")
    assert log[0] == ["admit", "split", 768, [768, 1024]]  # rank 0 alone splits at 512
    # the chunks reach the tail at 768: rank 1 read 2 of its 4 pages (its next get failed), so 2 join
    assert log[1:4] == [["chunk", 256, 256, True, False, True], ["chunk", 512, 512, True, False, True],
                        ["chunk", 768, 768 + 2 * PS, False, False, True]]
    assert log[4] == ["chunk", 1024, 1024, False, False, True]


@needs_0517
def test_a_rank_whose_reads_land_later_gets_the_same_verdict_on_every_rank(ranks):
    log = _same(ranks, "split_slow_rank")
    assert log[0][:2] == ["admit", "split"]
    assert all(e[-1] for e in log if e[0] == "chunk")  # every page byte-exact, throughout
    assert log[-1][:3] == ["chunk", 1024, 1024]


@needs_0517
def test_a_split_or_load_some_ranks_chose_is_a_recompute_on_every_rank(ranks):
    log = _same(ranks, "mixed_verdicts")
    assert log[0] == ["admit", "compute", 1024, None]
    assert log[1] == ["overruled where it chose to load", True]
    assert log[2] == ["ops", [], 0]  # nothing prefetched on any rank
    assert log[-1] == ["chunk", 1024, 1024, False, False, True]


@needs_0517
def test_a_held_request_waits_for_every_ranks_tail_then_joins_it_whole(ranks):
    log = _same(ranks, "hold_until_all_read")
    assert log[0] == ["admit", "split", [512, 1024], 1]
    assert log[2] == ["chunk", 512, 512, True, True, True]  # held: parked on every rank
    assert log[3:6] == [["pass", True, 512, True, True], ["pass", True, 512, True, True],
                        ["pass", False, 1024, False, True]]  # held until the last rank read its tail
    assert log[6] == ["rounds", [1024]]


@needs_0517
def test_a_tail_read_failing_on_one_rank_ends_the_hold_on_every_rank(ranks):
    log = _same(ranks, "hold_read_fails")
    assert log[3:5] == [["pass", True, 512, True, True], ["pass", False, 512 + 2 * PS, False, True]]
    assert log[-1] == ["chunk", 1024, 1024, False, False, True]


@needs_0517
def test_a_hold_limit_passing_on_one_rank_ends_the_hold_on_every_rank(ranks):
    log = _same(ranks, "hold_limit_passes")
    assert log[3:5] == [["pass", True, 512, True, True], ["pass", False, 512 + 2 * PS, False, True]]
    assert log[-1] == ["chunk", 1024, 1024, False, False, True]


@needs_0517
def test_late_admission_gives_the_disk_a_request_only_when_every_rank_can_read_it_in_time(ranks):
    log = _same(ranks, "late_admission")
    assert log[0] == ["admit", "compute", 1024, None]
    late = [e for e in log if e[0] == "late"]
    assert [e[2] for e in late] == [None, None, "r1", None]  # one rank's GPU reaches it first at step 1
    assert late[2][3] == "load" and late[2][4] == ["r1"]  # admitted again, loaded on every rank
    assert log[-1] == ["chunk", 1024, 1024, False, False, True]


@needs_0517
def test_a_fresh_servers_ranks_start_from_one_read_rate_the_slowest_seed(ranks):
    log = _same(ranks, "fresh_seed")
    slowest = BPT / (A * max(RATIOS[:len(ranks)])) / 1e9 * 1e9
    assert log[1][0] == "rate" and abs(log[1][1] - slowest) <= 1 and log[1][2] == 1  # each split alone, one rate
    assert log[0] == ["admit", "split", 768, [768, 1024]]
    assert log[-1] == ["chunk", 1024, 1024, False, False, True]


def test_late_admission_on_either_release_waits_until_every_ranks_disk_is_in_time(ranks):
    log = _same(ranks, "late_any_release")
    assert log[0] == ["admit", "compute", []]
    assert [e[2] for e in log[1:]] == [None, None, "r1", None]  # once, at the step every rank is fast
    assert log[3][3:] == ["load", ["r1"]] and log[4][4] == ["r1"]  # admitted again: loaded on every rank


def test_a_load_held_for_host_room_is_held_prefetched_and_released_on_every_rank_at_once(ranks):
    log = _same(ranks, "room_any_release")
    # rank 0 turned both down for room, the others would have loaded them: held on every rank
    assert log[0] == ["admit", "m", "compute", True, []] and log[1] == ["admit", "n", "compute", True, []]
    assert log[2] == ["check", False, False]  # the scheduler skips both, on every rank
    assert log[3] == ["take", 0, None, True, []]  # room on rank 0 only: still held
    assert log[4] == ["take", 1, "m", False, ["m"]]  # room on every rank: prefetched on every rank
    assert log[5] == ["deadline", False, True]  # the others defer to rank 0's deadline: held
    assert log[6] == ["deadline", True, False, 1]  # every rank's: released to the GPU on every rank


@needs_0517
def test_a_load_finished_on_one_rank_waits_for_the_others_then_ends_on_every_rank(ranks):
    log = _same(ranks, "load_done_later")
    assert log[0] == ["admit", "load", False]  # rank 0 has it all, the others half: every rank waits
    assert log[1] == ["done", True, True]  # then every rank ends it at the same pass
    assert log[2] == ["inserted", PAGES * PS]  # with the whole hit (SGLang keeps what every rank read)


def _seeds(ranks, name) -> tuple[list, list]:
    """(each rank's own seed: [how, bytes/s, probed alone, st_dev], the agreement every rank logged:
    [bytes/s, still a lone probe's, divided: "shared by N ranks on one device", "not divided"])."""
    logs = [r[name] for r in ranks]
    for i, log in enumerate(logs):
        assert not (isinstance(log, dict) and "error" in log), f"rank {i}: {log}"
    agreed = [log[1] for log in logs]
    assert all(a == agreed[0] for a in agreed), "ranks agreed differently:\n" + "\n".join(map(json.dumps, logs))
    assert agreed[0][0] == "agreed"
    return [log[0] for log in logs], agreed[0][1:]


def test_ranks_probing_one_device_alone_start_from_the_slowest_probe_shared_by_every_rank(ranks):
    own, agreed = _seeds(ranks, "seed_probed_one_device")
    n = len(ranks)
    assert all(o[0] == "probe" and o[2] is True for o in own) and len({o[3] for o in own}) == 1
    assert abs(agreed[0] - min(o[1] for o in own) / n) <= 1  # serving, the ranks read the device at once
    assert agreed[1:] == [False, True, False]  # no longer a lone probe's; the log says why it divided


def test_ranks_probing_different_devices_keep_the_slowest_probe_whole(ranks):
    own, agreed = _seeds(ranks, "seed_probed_two_devices")
    assert all(o[0] == "probe" and o[2] is True for o in own) and len({o[3] for o in own}) == 2
    assert abs(agreed[0] - min(o[1] for o in own)) <= 1
    assert agreed[1:] == [False, False, True]


def test_ranks_with_a_configured_rate_keep_the_slowest_whole_on_one_device(ranks):
    own, agreed = _seeds(ranks, "seed_configured")
    slowest = BPT / (A * max(RATIOS[:len(ranks)]))
    assert all(o[0] == "configured" and o[2] is False for o in own) and len({o[3] for o in own}) == 1
    assert abs(agreed[0] - slowest) <= 1 and agreed[1:] == [False, False, False]


def test_finished_loads_ride_along_a_chunk_and_a_pass_waits_a_decode_step_only_where_every_rank_would(ranks):
    log = _same(ranks, "ride_any_release")
    whole, seat = 32 * PS, 2 * PS  # the chunk budget of test_ride's adder; p3's seat: its last page and one more
    assert log[0] == ["pass", 0, True, whole, ["c"], None]  # finished on rank 0 only: no seat
    assert log[1] == ["pass", 1, True, whole - seat, ["c", "p3"], None]  # rides on every rank
    assert log[2] == ["pass", 2, True, whole, ["c"], None]  # rank 0 alone short of memory: neither
    assert log[3] == ["pass", 3, True, None, [], 0]  # every rank short: every rank waits a decode step
