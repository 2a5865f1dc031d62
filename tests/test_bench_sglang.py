"""`benchmarks/bench_sglang.py`'s request timeline (`--timeline`), on SGLang's own host pool: every
read of the last round gets a record, one wait per posted request, in order, and the bytes still
check (the timeline wraps the store's read path; it must not change what it returns); a column
may read in gets of fewer pages (``get_pages``, a split's tail). ``--thread-cpu`` splits each
get's CPU by thread: the caller and the checksum threads, adding up to no more than the process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# a timeline over SGLang's classes: ~25 s on 2 cores (scripts/test.sh --quick leaves it out)
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_timeline_records_every_request_of_each_read(tmp_path):
    pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "plugins", "sglang"),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_sglang.py"), "--dir",
                           str(tmp_path / "bench"), "--rounds", "2", "--pages", "256", "--page-tokens", "16",
                           "--backends", "gds,gds:get_pages=32", "--timeline", "--thread-cpu", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())["results"]["HiCacheGDS"]
    reads = res["timeline"]
    assert [r["pages"] for r in reads] == [128, 128]  # the last round's two gets, nothing of the first
    for r in reads:
        assert len(r["posted_ms"]) >= 2 and len(r["waits_ms"]) == len(r["posted_ms"])
        assert r["posted_ms"] == sorted(r["posted_ms"]) and r["waits_ms"] == sorted(r["waits_ms"])
        assert r["waits_ms"][0] >= r["posted_ms"][0] and r["end_ms"] >= r["waits_ms"][-1]
    assert proc.stdout.count("timeline of HiCacheGDS: 128 pages") == 2
    assert len(res["get"]) == 2 and not os.path.exists(tmp_path / "bench")  # bytes checked; nothing left behind
    # a column reading in smaller gets (a split's tail): 8 gets of 32 pages, the bytes checked as well
    small = json.loads(out.read_text())["results"]["HiCacheGDS (get_pages=32)"]
    assert [r["pages"] for r in small["timeline"]] == [32] * 8 and len(small["get"]) == 2
    # where each get's CPU went: the calling thread and the threads that checksum its pages
    for col in (res, small):
        per, total = col["get_thread_cpu_ms"], col["get_cpu_ms"]
        assert len(per) == len(total) == 2
        for threads, cpu in zip(per, total):
            assert threads["MainThread"] > 0 and threads["hicache-gds-verify"] > 0, threads
            assert sum(threads.values()) <= 1.2 * cpu + 5, (threads, cpu)
    assert proc.stdout.count("get CPU per thread of HiCacheGDS") == 4
