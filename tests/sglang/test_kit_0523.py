"""SGLang 0.5.23's own storage test kit with hicache-gds in place of ``file`` (`kit_0523.py`, in a
subprocess: ``load_plugins()`` hooks SGLang's classes for the whole process).

What runs there, on CPU with the kit's real ``UnifiedRadixCache`` stacks: a prefix the kit backs
up to L3 through ``gds`` is prefetched into the host tier under the ``compute_or_load`` policy,
byte for byte; a finished load's host pages survive SGLang's host eviction until the scheduler
takes the request (host protection through ``inc_host_lock_ref``), then are SGLang's again; a
queued request admission sent to the GPU is prefetched after a prefill batch is formed, once its
hit loads before the GPU reaches it (late admission), and loads. A split hit's tail
(`kit_split_0523.py`) joins a real request where its chunks reach it, and a split request is held
for its tail in SGLang's own ``PrefillAdder`` (`kit_park_0523.py`), whose chunk ends at the split's
head (`kit_cut_0523.py`); a finished load rides along a chunked request's pass there (`kit_ride_0523.py`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import pytest

KIT = os.path.join(os.path.dirname(__file__), "kit_0523.py")
SPLIT_KIT = os.path.join(os.path.dirname(__file__), "kit_split_0523.py")
HOLD_KIT = os.path.join(os.path.dirname(__file__), "kit_park_0523.py")
CUT_KIT = os.path.join(os.path.dirname(__file__), "kit_cut_0523.py")
RIDE_KIT = os.path.join(os.path.dirname(__file__), "kit_ride_0523.py")


def _run_kit(path: str, names: tuple[str, ...]) -> None:
    """Run one kit script in a subprocess (skipped where this SGLang has no storage kit) and check
    it passed and printed ``KIT-OK <name>`` for each of `names`."""
    try:
        kit = importlib.util.find_spec("sglang.test.kits.unified_radix_cache")
    except ImportError:  # its parent package is missing too
        kit = None
    if kit is None:
        pytest.skip("this SGLang has no unified_radix_cache storage kit (0.5.17)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=480, env=env)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-6000:]
    for name in names:
        assert f"KIT-OK {name}" in said, said[-6000:]


def test_sglangs_storage_kit_runs_with_gds_in_place_of_file():
    _run_kit(KIT, ("round-trip", "protect", "late"))


def test_a_split_hits_tail_joins_on_sglang_0523s_real_cache():
    """`kit_split_0523.py`: a split's tail loads as SGLang's own prefetches and joins a real
    request's KV row after SGLang's ``checkpoint``, byte for byte against the producer's KV over a
    poisoned GPU pool; a read failing midway joins only what was read (the rest computed); a read
    still stalled when the chunk reaches the tail joins nothing and gives back its host pages."""
    _run_kit(SPLIT_KIT, ("split-join", "split-overlap", "split-fault", "split-timeout"))


def test_a_split_request_is_held_for_its_tail_in_sglang_0523s_real_adder():
    """`kit_park_0523.py`: after its head's chunk is checkpointed, a split request whose tail still
    reads is held by SGLang's real ``PrefillAdder`` (returned unadded, and no waiting request added:
    no batch is formed), then joins its whole tail once read, byte for byte over a poisoned GPU
    pool; a hold past its limit joins what is read and the head computes on; a tail failing while
    held joins what was read; a request aborted while held frees its tail, its hold and its host
    pages."""
    _run_kit(HOLD_KIT, ("hold-join", "hold-limit", "hold-fault", "hold-abort"))


def test_a_split_head_is_cut_where_it_ends_in_sglang_0523s_real_adder():
    """`kit_cut_0523.py`: a split head shorter than the pass's chunk budget ends SGLang's first
    chunk (real ``add_one_req``; the budget stays spent), a head past the first chunk ends the next
    one (real ``add_chunked_req``), and the tail joins there byte for byte over a poisoned GPU pool;
    with ``policy_split_cut`` off the chunk keeps SGLang's size."""
    _run_kit(CUT_KIT, ("cut-first", "cut-next", "cut-off"))


def test_a_finished_load_rides_along_a_chunked_requests_pass_in_sglang_0523s_real_adder():
    """`kit_ride_0523.py`: with ``policy_ride`` on, a chunked request's next chunk gives back the
    seats of two finished loads; a request decided compute ahead of them is skipped, the load with
    a page left is added whole beside the chunk, the one with more left than its seat is refused by
    SGLang's own rule, and no second chunked request starts."""
    _run_kit(RIDE_KIT, ("ride",))


def test_a_0523_pass_is_held_only_where_the_adder_caps_requests_and_the_last_chunk_is_checkpointed():
    from hicache_gds_sglang import park_0523

    def req(prefix, end):
        return types.SimpleNamespace(prefix_len=prefix, extend_end=end)

    adder = types.SimpleNamespace(prefill_max_requests=None, dllm_config=None)
    assert park_0523.holdable(adder, req(8, 8)) and park_0523.holdable(adder, req(8, None))
    assert not park_0523.holdable(adder, req(8, 16))  # a chunk not checkpointed: SGLang would stash it
    assert not park_0523.holdable(types.SimpleNamespace(dllm_config=None), req(8, 8))  # no request cap
    assert not park_0523.holdable(types.SimpleNamespace(prefill_max_requests=None, dllm_config=object()), req(8, 8))
