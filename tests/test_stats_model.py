"""One stats model: every counter is defined once (`hicache_gds.stats.METRICS`), counted only
under a defined name, and read under that name by `stats()`, Prometheus and `hicache-gds ls`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from hicache_gds import METRICS, Counters, Pages, metric_values, open_store
from hicache_gds.memory import HostBuffer
from hicache_gds.stats import STORE_COUNTERS, prometheus_families
from hicache_gds.testing import random_bytes

P = 64 << 10


def test_a_counter_not_defined_is_refused():
    with pytest.raises(KeyError, match="not defined"):
        Counters(("pages_written", "pages_writen"))
    c = Counters(("hits",))
    with pytest.raises(KeyError):
        c.add(hit=1)
    c.add(hits=2)
    assert c.snapshot() == {"hits": 2}


def test_store_stats_report_every_defined_store_and_index_metric_by_its_name(tmp_path):
    with open_store(P, {"t": "stats"}, config={"gds_path": str(tmp_path), "capacity": 16 * P, "engine": "bounce"}) as s:
        src = HostBuffer(4 * P)
        random_bytes(src, 5)
        s.register_memory(src.addr, src.nbytes)
        assert s.put(["a", "b"], Pages.contiguous(src.addr, P, [0, 1])) == [True, True]
        assert s.get(["a", "zz"], Pages.contiguous(src.addr, P, [2, 3])) == [True, False]
        st = s.stats()
        s.deregister_memory(src.addr)
    got = {m.name: v for m, v in metric_values(st)}
    assert set(STORE_COUNTERS) <= set(got)
    assert got["pages_written"] == 2 and got["hits"] == 1 and got["misses"] == 1 and got["pages"] == 2
    assert got["slots"] == 16
    fams = {f.name: f for f in prometheus_families(st, "x_")}
    assert fams["x_pages_written"].type == "counter" and fams["x_pages"].type == "gauge"
    assert fams["x_pages_written"].documentation == METRICS["pages_written"].doc
    assert fams["x_pages_written"].samples[0].value == 2


def test_ls_reports_the_index_metrics_under_their_names(tmp_path):
    with open_store(P, {"t": "ls"}, config={"gds_path": str(tmp_path), "capacity": 8 * P, "engine": "bounce"}) as s:
        src = HostBuffer(P)
        src.numpy()[:] = np.arange(P, dtype=np.uint8) ^ 0x3C
        s.register_memory(src.addr, src.nbytes)
        assert s.put(["k"], Pages.contiguous(src.addr, P, [0])) == [True]
        s.deregister_memory(src.addr)
    r = subprocess.run([sys.executable, "-m", "hicache_gds.cli", "ls", "--path", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    (ns,) = json.loads(r.stdout)["namespaces"]
    assert ns["metrics"] == {"pages": 1, "slots": 8}
    assert set(ns["metrics"]) <= set(METRICS)
