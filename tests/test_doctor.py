"""`hicache-gds doctor` and the `hicache-gds` dispatcher: exit codes, JSON, the facts it reads."""

from __future__ import annotations

import json
import os

import pytest

from hicache_gds import cli
from hicache_gds.tools.doctor import _cufile_mode, collect, fs_info, main, o_direct_ok, render_text
from hicache_gds.engines.cufile_env import gpu_present

no_gpu = pytest.mark.skipif(gpu_present(), reason="expects a machine without a GPU (the CPU machine)")


def doctor(capsys, *argv):
    rc = cli.main(["doctor", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@no_gpu
def test_default_environment_is_ok(capsys):
    rc, out, _ = doctor(capsys)
    assert rc == 0 and out.rstrip().endswith("result       : OK")
    assert "GPU          : none visible" in out and "nvidia-fs    : not loaded" in out
    assert "engine auto for host memory: nixl-posix: NIXL POSIX" in out
    assert "nixl-gds   : no: not probed: no CUDA GPU is visible" in out
    assert "warning      : GDS_PATH is not set" in out and "O_DIRECT ok" in out


@no_gpu
def test_enable_gds_1_without_a_gpu_fails_and_says_why(capsys, monkeypatch, gds_dir):
    monkeypatch.setenv("ENABLE_GDS", "1")
    monkeypatch.setenv("GDS_PATH", gds_dir)
    monkeypatch.setenv("HICACHE_GDS_CAPACITY", "64M")  # sized: the default depends on how full the disk is
    rc, out, _ = doctor(capsys)
    assert rc == 1
    (problem,) = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert "ENABLE_GDS=1 cannot be honoured" in problem and "no CUDA GPU" in problem
    assert gds_dir in problem and ".hicache-gds-doctor" not in problem
    assert os.listdir(gds_dir) == []                       # the probe directory is gone


@no_gpu
def test_json_report(capsys, monkeypatch, gds_dir):
    monkeypatch.setenv("GDS_PATH", gds_dir)
    monkeypatch.setenv("HICACHE_GDS_CAPACITY", "64M")  # sized: the default depends on how full the disk is
    monkeypatch.delenv("HICACHE_GDS_READ_PROBE")  # set for the adapters' tests (conftest): here only what this test sets
    monkeypatch.delenv("HICACHE_GDS_MAX_FILL")  # set with gds_dir (conftest)
    rc, out, _ = doctor(capsys, "--json")
    rep = json.loads(out)
    assert rc == 0 and rep["ok"] is True and rep["problems"] == []
    assert rep["gpu"]["visible"] is False and rep["nvidia_fs"]["loaded"] is False
    (d,) = rep["gds_path"]
    assert d["path"] == gds_dir and d["o_direct"] is True and d["free_bytes"] > 0
    assert d["cufile_compat_mode"] is True and "nvidia-fs" in d["cufile_mode_reason"]
    assert rep["nixl"]["plugins"]["POSIX"] and rep["engines"]["nixl-gds"]["ok"] is False
    assert rep["engines"]["nixl-posix"]["ok"] is True and rep["engines"]["bounce"]["ok"] is True
    assert rep["engine_auto"]["host_memory"]["engine"] == "nixl-posix"
    assert rep["cufile"]["chosen_by"] in ("libcufile's built-in defaults", "/etc/cufile.json")
    assert rep["config"]["sources"] == {"gds_path": "env", "capacity": "env"}
    assert rep["capacity"]["configured"] == 64 << 20 and rep["capacity"]["dirs"][0]["path"] == gds_dir
    monkeypatch.setenv("ENABLE_GDS", "1")
    rc, out, _ = doctor(capsys, "--json")
    assert rc == 1 and json.loads(out)["ok"] is False


def test_bad_gds_path_and_bad_settings_fail(capsys, monkeypatch, tmp_path):
    rc, out, _ = doctor(capsys, "--path", str(tmp_path / "missing"))
    assert rc == 1 and "does not exist" in out
    monkeypatch.setenv("HICACHE_GDS_ENGINE", "bounce")
    monkeypatch.setenv("HICACHE_GDS_IO_THREADS", "zero")
    rc, out, _ = doctor(capsys)
    assert rc == 1 and "configuration: HICACHE_GDS_IO_THREADS" in out


def test_named_engine_and_enable_gds_0(capsys, monkeypatch):
    monkeypatch.setenv("HICACHE_GDS_ENGINE", "bounce")
    monkeypatch.setenv("ENABLE_GDS", "0")
    rep = collect()
    assert rep["ok"] and rep["engine_auto"]["host_memory"]["engine"] == "bounce"
    assert "named in the configuration" in rep["engine_auto"]["host_memory"]["reason"]
    monkeypatch.setenv("HICACHE_GDS_ENGINE", "nixl-gds")
    rep = collect()
    assert not rep["ok"] and "ENABLE_GDS=0" in rep["problems"][0]


def test_cufile_json_selection_and_bounce_pool(monkeypatch, tmp_path):
    cj = tmp_path / "cufile.json"
    cj.write_text('{ // comment\n "properties": {"posix_pool_slab_size_kb": [4, 1024, 16384],\n'
                  ' "posix_pool_slab_count": [256, 256, 64]}}\n')
    monkeypatch.setenv("HICACHE_GDS_CUFILE_JSON", str(cj))
    rep = collect()
    assert rep["cufile"]["file"] == str(cj) and rep["cufile"]["chosen_by"] == "HICACHE_GDS_CUFILE_JSON"
    assert rep["cufile"]["bounce_pool"][1] == {"slab_bytes": 1 << 20, "count": 256}
    assert rep["cufile"]["max_descs_compat"] == 64
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(tmp_path / "nope.json"))
    rep = collect()
    assert rep["cufile"]["chosen_by"] == "HICACHE_GDS_CUFILE_JSON"
    assert any("CUFILE_ENV_PATH_JSON" in w for w in rep["warnings"])
    monkeypatch.setenv("CUFILE_ENV_PATH_JSON", str(cj))
    assert collect()["cufile"]["chosen_by"] == "CUFILE_ENV_PATH_JSON"
    assert "bounce pool: 4 KiB x256, 1 MiB x256, 16 MiB x64" in render_text(collect())


def test_file_system_facts(tmp_path):
    info = fs_info(str(tmp_path))
    assert info["fstype"] and info["mount"] and str(tmp_path).startswith(info["mount"])
    assert fs_info("/proc/self")["fstype"] == "proc"
    assert o_direct_ok(str(tmp_path)) == (True, "")
    ok, why = o_direct_ok(str(tmp_path / "missing"))
    assert not ok and "cannot create a file" in why
    fs = {"fstype": "xfs", "device": "/dev/nvme0n1", "options": "rw", "mount": "/"}
    assert _cufile_mode(fs, nvfs=True)[0] is False
    assert _cufile_mode({**fs, "fstype": "tmpfs"}, nvfs=True)[0] is True
    assert _cufile_mode({**fs, "fstype": "ext4", "options": "rw,data=journal"}, nvfs=True)[0] is True
    assert "nvidia-fs is not loaded" in _cufile_mode(fs, nvfs=False)[1]


def test_dispatcher(capsys, monkeypatch):
    assert cli.main([]) == 2 and "usage: hicache-gds" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0 and "doctor" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2 and "unknown subcommand 'frobnicate'" in capsys.readouterr().err
    seen = []
    import hicache_gds.remote.server as server
    monkeypatch.setattr(server, "main", lambda argv: seen.append(list(argv)) or 7)
    assert cli.main(["serve", "--port", "1"]) == 7 and seen == [["--port", "1"]]
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--json" in capsys.readouterr().out
    assert cli.main(["bench", "--rw=reed"]) == 2


@pytest.mark.gpu
def test_doctor_on_the_gpu_machine(capsys, monkeypatch, gds_dir):
    monkeypatch.setenv("GDS_PATH", gds_dir)
    rc, out, _ = doctor(capsys, "--json")
    rep = json.loads(out)
    assert rc == 0 and rep["gpu"]["visible"] and rep["gpu"]["devices"]
    assert rep["engines"]["nixl-gds"]["ok"], rep["engines"]
    dev = rep["engine_auto"]["device_memory"]
    assert dev["ok"] and dev["engine"] in ("nixl-gds-mt", "nixl-gds") and "probe passed" in dev["reason"]
    cf = rep["engines"]["cufile"]  # libcufile loaded before cufile-python once aborted it
    assert cf["ok"] or not cf["installed"], cf
    monkeypatch.setenv("ENABLE_GDS", "1")
    rc, out, _ = doctor(capsys)
    assert rc == 0 and "result       : OK" in out


def test_gpu_file_engines_beside_nixl(capsys, monkeypatch, gds_dir):
    """kvikio and cufile-python get a line each, as every registered engine does: not installed
    (with the extra to install), not probed without a GPU, or the probe's answer."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "kvikio" else real(n, *a))
    monkeypatch.setenv("GDS_PATH", gds_dir)
    rc, out, _ = doctor(capsys, "--json")
    eng = json.loads(out)["engines"]
    assert {"kvikio", "cufile"} <= set(eng) and not eng["kvikio"]["installed"]
    assert "pip install 'hicache-gds[kvikio]'" in eng["kvikio"]["reason"]
    if eng["cufile"]["installed"] and not eng["cufile"]["ok"]:
        assert eng["cufile"]["reason"]
    rc, out, _ = doctor(capsys)
    assert "  kvikio     : no: not installed" in out and "  cufile     : " in out


def test_doctor_says_what_the_remote_tier_runs_over(tmp_path, monkeypatch, capsys):
    """The remote tier's line: RDMA where this machine has devices and UCX may use them, else tcp."""
    from hicache_gds.tools.doctor import _remote
    monkeypatch.setenv("UCX_MODULES", "^ib")
    assert _remote(str(tmp_path / "absent"))["transports"].endswith("(no RDMA device here)")
    (tmp_path / "ib" / "mlx5_0").mkdir(parents=True)
    r = _remote(str(tmp_path / "ib"))
    assert r["rdma_devices"] == ["mlx5_0"] and "UCX_MODULES excludes ib" in r["transports"]
    monkeypatch.delenv("UCX_MODULES")
    assert _remote(str(tmp_path / "ib"))["transports"].startswith("RDMA (InfiniBand/RoCE devices mlx5_0)")
    monkeypatch.delenv("HICACHE_GDS_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("HICACHE_GDS_CLUSTER_SECRET_FILE", raising=False)
    assert "any writer to Redis can inject a page server" in _remote(str(tmp_path))["trust"]
    monkeypatch.setenv("HICACHE_GDS_CLUSTER_SECRET", "x")
    assert "sign their records" in _remote(str(tmp_path))["trust"]
    monkeypatch.delenv("HICACHE_GDS_CLUSTER_SECRET")
    # the TCP segments the tier's agents would be made with, without setting them here
    monkeypatch.delenv("UCX_TCP_TX_SEG_SIZE", raising=False)
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "256k")
    assert _remote(str(tmp_path))["tcp_segments"] == {"send": "262144", "receive": "256k"}
    assert "UCX_TCP_TX_SEG_SIZE" not in os.environ
    monkeypatch.delenv("UCX_TCP_RX_SEG_SIZE")
    from hicache_gds import cli
    assert cli.main(["doctor"]) in (0, 1)
    out = capsys.readouterr().out
    assert "remote tier  : NIXL UCX over" in out and "TCP segments send 1m, receive 1m" in out
    assert "trust      : no cluster secret: any writer to Redis can inject a page server" in out
