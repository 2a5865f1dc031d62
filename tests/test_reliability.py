"""Reliability, fast subset (the full run: `python benchmarks/reliability.py`, figures in RELIABILITY.md).

kill -9 torture through the PageStore and through SGLang's backend, damage to slab and index files,
resource faults, concurrency with a watchdog, hostile input, fuzz, privacy. SGLang cases run where
SGLang and hicache_gds_sglang import (the .venv-sgl / scripts/test.sh environment) and skip elsewhere.

The cases that found the bugs listed in RELIABILITY.md run here as regression cases: they must pass.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from hicache_gds.testing import targets
from hicache_gds.testing.cases import Case
from hicache_gds.testing.corruption import CASES, corruption_cases

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGL = targets.why_unavailable("sglang")
TARGETS = ["store", pytest.param("sglang", marks=pytest.mark.skipif(bool(SGL), reason=SGL or "-"))]


def judge(case: Case) -> None:
    assert case.ok, f"{case.name}: {case.problems}"


def run_module(module: str, *args: str, timeout: float = 600) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)
    p = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- 1. kill -9 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.slow
def test_kill9_torture(gds_dir, target):
    runs = run_module("hicache_gds.testing.torture", "--gds-path", gds_dir, "--target", target, "--mode",
                      "put,evict,clear", "--rounds", "3", "--max-delay", "0.5", "--aimed", "0.67", "--seed", "7",
                      "--quiet")
    for t in runs:
        assert t["kills"] == 3 and t["acked_pages"] > 0, t
        assert t["acked_lost"] == 0 and t["torn_served"] == 0 and t["cleared_back"] == 0, t["problems"]
        assert t["clear_not_atomic"] == 0 and t["invariant_violations"] == 0 and t["worker_errors"] == 0, t["problems"]
        assert t["max_recovery_s"] < 3
    assert {t["mode"] for t in runs} == {"put", "evict", "clear"}


@pytest.mark.slow
def test_kill9_torture_of_one_namespace_with_three_writers(gds_dir):
    runs = run_module("hicache_gds.testing.torture_mp", "--gds-path", gds_dir, "--writers", "3", "--mode", "put,evict",
                      "--kills", "5", "--max-delay", "0.4", "--seed", "3", "--quiet")
    for t in runs:
        assert t["kills"] == 5 and t["acked_pages"] > 0 and t["acked_shared"] > 0, t
        assert t["acked_lost"] == 0 and t["torn_served"] == 0 and t["two_keys_one_slot"] == 0, t["problems"]
        assert t["leaked_reservations"] == 0 and t["invariant_violations"] == 0 and t["worker_errors"] == 0, t["problems"]
        assert t["live_checks"] >= 1 and t["present_checked"] > 0
    assert [t["mode"] for t in runs] == ["put", "evict"]


@pytest.mark.slow
def test_index_recovery_time_small(gds_dir):
    r = run_module("hicache_gds.testing.torture", "--gds-path", gds_dir, "--recovery-pages", "20000")
    assert r["pages"] == 20000 and r["after_kill_pages"] == 20000 and r["killed"]
    assert r["clean_open_s"] < 3 and r["after_kill_open_s"] < 3 and not r["problems"]


# -- 2. corruption -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("state", ["closed", "open"])
@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
def test_corruption(gds_dir, target, name, state):
    (case,) = corruption_cases(gds_dir, target, names=[name], states=[state])
    assert case.wrong_bytes == 0 and case.exceptions == 0, case.problems
    judge(case)


# -- 3. resource faults --------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.slow
def test_resource_faults(gds_dir, target):
    from hicache_gds.testing.faults import fault_cases
    cases = fault_cases(gds_dir, target, sglang_seconds=2)
    bad = [(c.name, c.problems) for c in cases if not c.ok]
    assert not bad, bad
    assert all(c.wrong_bytes == 0 and c.exceptions == 0 for c in cases)


# -- 4. concurrency ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("evict", [False, True])
@pytest.mark.slow
def test_concurrency_threads(gds_dir, target, evict):
    from hicache_gds.testing.stress import concurrency
    r = concurrency(gds_dir, target, seconds=5, evict=evict, rest_every=2, stall_s=30)
    assert r["ok"], (r["problems"], r["errors"], r["stacks"][:2])
    assert r["put_acked"] > 0 and r["hits"] > 0 and r["rest_checks"] >= 1


@pytest.mark.slow
def test_two_processes_share_gds_path(gds_dir):
    from hicache_gds.testing.stress import two_processes
    r = two_processes(gds_dir, "store", seconds=4)
    assert r["ok"], (r["problems"], [x.get("problems") or x.get("errors") for x in r["ranks"]])
    assert r["ranks"][0]["namespace"] != r["ranks"][1]["namespace"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.slow
def test_second_opener_of_a_namespace_shares_it(gds_dir, target):
    from hicache_gds.testing.stress import same_namespace_shared
    judge(same_namespace_shared(gds_dir, target))


# -- 5. hostile input, fuzz ----------------------------------------------------------------------------------

def _by_name(cases):
    return {c.name: c for c in cases}


@pytest.fixture(scope="module")
def hostile_store_cases(tmp_path_factory):
    from hicache_gds.testing.hostile import hostile_store
    d = tmp_path_factory.mktemp("hostile")
    yield _by_name(hostile_store(str(d)))
    shutil.rmtree(d, ignore_errors=True)  # its stores' slab files


@pytest.mark.parametrize("name", ["keys: wrong types, empty, huge, NUL, not a list",
                                  "keys that look like paths or are odd but legal",
                                  "delete, and get of a damaged page, naming one key twice in a batch",
                                  "key with a lone surrogate (str that is not UTF-8)",
                                  "pages: wrong type, sizes, lengths, regions outside registered buffers",
                                  "region whose end wraps past 2**64",
                                  "constructor: page sizes, config keys and values, environment"])
def test_hostile_store(hostile_store_cases, name):
    judge(hostile_store_cases[name])


@pytest.mark.parametrize("target", TARGETS)
def test_hostile_paths(gds_dir, target):
    from hicache_gds.testing.hostile import hostile_paths
    for case in hostile_paths(gds_dir, target):
        assert case.ok, (case.name, case.problems)


@pytest.fixture(scope="module")
def hostile_sglang_cases(tmp_path_factory):
    if SGL:
        pytest.skip(SGL)
    from hicache_gds.testing.hostile import hostile_sglang
    d = tmp_path_factory.mktemp("hostile-sgl")
    yield _by_name(hostile_sglang(str(d)))
    shutil.rmtree(d, ignore_errors=True)  # its stores' slab files


@pytest.mark.parametrize("name", ["HiCacheGDS data path: bad keys and host indices",
                                  "HiCacheGDS: key with a lone surrogate",
                                  "HiCacheGDS: keys that are not a sequence (None, int), garbage v2 transfers",
                                  "region whose end wraps past 2**64 (from host_indices)",
                                  "HiCacheGDS construction: bad extra config"])
@pytest.mark.slow
def test_hostile_sglang(hostile_sglang_cases, name):
    case = hostile_sglang_cases[name]
    if "construction" not in name and "wraps" not in name:
        assert case.exceptions == 0, case.problems  # SGLang never sees an exception on the data path
    judge(case)


@pytest.mark.parametrize("target", TARGETS)
def test_fuzz_config_and_keys(gds_dir, target):
    from hicache_gds.testing.hostile import fuzz
    case = fuzz(gds_dir, target, examples=60)
    assert case.ok, case.problems


# -- 6. privacy ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_private_modes_including_sqlite_wal_and_shm(gds_dir, target):
    from hicache_gds.testing.hostile import privacy_modes
    judge(privacy_modes(gds_dir, target))


@pytest.mark.parametrize("target", TARGETS)
def test_tenants_are_isolated(gds_dir, target):
    from hicache_gds.testing.hostile import tenant_isolation
    judge(tenant_isolation(gds_dir, target))


@pytest.mark.parametrize("target", TARGETS)
def test_no_keys_or_page_bytes_in_logs(gds_dir, target):
    from hicache_gds.testing.hostile import log_leaks
    judge(log_leaks(gds_dir, target))


# -- 7. integrity under faults -------------------------------------------------------------------------------

@pytest.mark.slow
def test_integrity_families_as_the_full_run_reports_them(gds_dir):
    """Every CPU family of section 7, small (the focused reproductions: tests/test_integrity.py)."""
    from hicache_gds.testing.integrity import integrity_cases
    cases = integrity_cases(gds_dir, quick=True)
    bad = [(c.name, c.problems) for c in cases if not c.ok]
    assert not bad, bad
    names = {c.name.split(" (")[0].split(":")[0] for c in cases}
    assert {"failed puts", "GDS_PATH reordered", "namespace directory removed", "close during IO",
            "write in flight at close", "an idle process after others read"} <= names, names
    assert all(c.wrong_bytes == 0 and c.exceptions == 0 for c in cases)


def test_the_full_run_checks_its_needs_before_any_work(monkeypatch):
    """Without hypothesis the run stops at once naming the `test` extra (it failed after minutes)."""
    import importlib.util
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import reliability
    finally:
        sys.path.remove(os.path.join(REPO, "benchmarks"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hypothesis" else real(name, *a))
    need = reliability.check_needs()
    assert "hypothesis" in need and "hicache-gds[test]" in need
    p = subprocess.run([sys.executable, "-c", "import importlib.util, runpy, sys; real = importlib.util.find_spec; "
                        "importlib.util.find_spec = lambda n, *a: None if n == 'hypothesis' else real(n, *a); "
                        "sys.argv = ['reliability.py', '--quick']; runpy.run_path('benchmarks/reliability.py', "
                        "run_name='__main__')"], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert p.returncode == 1 and "the `test` extra" in p.stderr and "torture" not in p.stderr, p.stderr[-2000:]
