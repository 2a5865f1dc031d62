"""The remote tier across network namespaces, with real faults (root and `ip netns` needed).

Three nodes (page server + client each, UCX over TCP on veth) and a directory of Redis primary,
replica and three Sentinels, each in its own namespace on one bridge; every fault runs in a
fresh lab that `run_fault` tears down in a `finally` block (processes killed, namespaces deleted).
Checked: no page with wrong bytes, no pinned page lost while the server it was put on kept its
registration, no exception out of the tier, and the recovery bounds below.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from hicache_gds.testing.netns import NetLab, netns_unavailable

WHY = netns_unavailable()
pytestmark = [pytest.mark.skipif(bool(WHY), reason=WHY or "ok"),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")]

IO_TIMEOUT, TTL = 2.0, 5.0
# Seconds from the fault: gets served again (`gets_back_s`) and the last round that was not served
# in full (`last_fail_s`, puts and gets of fresh pages). A dead page server: within 5 s, the
# target; a hung or cut-off one: its first timeout plus a round. A directory failover: gets within
# 15 s (the target), puts too (what they reserve within a lease of the failover is marked and
# served only once its checksum verifies, `scripts.py`). A restarted directory (down `hold` = 3 s):
# full service within 10 s of the fault.
BOUNDS = {"kill_server": (5.0, 5.0), "stop_server": (IO_TIMEOUT + 3.0, IO_TIMEOUT + 3.0),
          "cut_link": (IO_TIMEOUT + 3.0, IO_TIMEOUT + 3.0), "kill_primary": (15.0, 15.0),
          "restart_directory": (10.0, 10.0)}

def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_lab_builds_and_leaves_nothing_behind(tmp_path):
    before = _namespaces()
    with NetLab(["a", "b"], log_dir=tmp_path) as lab:
        assert {lab.ns("a"), lab.ns("b"), lab.hub} <= _namespaces()
        p = lab.popen("a", ["sleep", "30"])
        r = subprocess.run(["ip", "netns", "exec", lab.ns("b"), "ip", "-o", "addr", "show", "eth0"],
                           capture_output=True, text=True)
        assert lab.ip["b"] in r.stdout
        lab.link("a", up=False)
        lab.link("a", up=True)
    assert not p.alive()
    assert _namespaces() - before == set()


def test_lab_cleans_up_when_the_body_fails(tmp_path):
    before = _namespaces()
    with pytest.raises(RuntimeError, match="boom"):
        with NetLab(["a"], log_dir=tmp_path) as lab:
            lab.popen("a", ["sleep", "30"])
            raise RuntimeError("boom")
    assert _namespaces() - before == set()


# Every fault with host pages, and again with the clients' pages passed as GPU memory (host memory
# standing in): gets of device pages go through device staging, checked by the device checksum, and
# a READ that lands late (a hung server resumed, a link restored) must not reach the caller's pages.
CASES = [(f, m) for m in ("host", "device") for f in BOUNDS]


@pytest.mark.slow
@pytest.mark.parametrize("fault,memory", CASES)
def test_fault(fault, memory, tmp_path):
    pytest.importorskip("redis", reason="the redis client is not installed")
    if memory == "device":
        pytest.importorskip("torch", reason="the device checksum runs through torch")
    from hicache_gds.testing.cluster_faults import LabConfig, run_fault
    before = _namespaces()
    cfg = LabConfig(ttl=TTL, io_timeout=IO_TIMEOUT, hold=3.0, after=10.0, after_directory=20.0, memory=memory)
    res = run_fault(fault, cfg, tmp_path)
    assert _namespaces() - before == set(), "namespaces left behind"
    print(res.row())
    assert res.wrong == 0, res.row()
    assert res.errors == 0, res.row()
    assert res.rounds > 0 and res.puts > 0 and res.gets > 0, res.row()
    # acknowledged pages survive where the tier promises it: their server kept its registration
    assert res.promised_lost == 0, res.row()
    gets_bound, full_bound = BOUNDS[fault]
    assert res.gets_back_s is not None and res.gets_back_s <= gets_bound, res.row()
    assert res.first_full_s is not None and res.first_full_s <= full_bound, res.row()
    if fault != "restart_directory":  # its rounds before the restore fail by construction
        assert res.last_fail_s <= full_bound, res.row()
    if fault == "cut_link":
        assert res.rejoin_s is not None and res.rejoin_s <= TTL + 5.0, res.row()
