"""benchmarks/e2e/bench_vllm_server.py, the harness of the GPU run, end to end on CPU against its fake
server: command lines, the workload, the tables, resuming, the deadline, and stopping servers left
by a killed run. (GPU time is scarce: the first real run must not fail in the harness.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.join(os.path.dirname(HERE), "benchmarks", "e2e")
sys.path.insert(0, E2E)
import bench_vllm_server as bench  # noqa: E402

SMALL = ["--dry-run", "--prefixes", "3", "--prefix-tokens", "1024", "--gpu-blocks", "128", "--cpu-gib", "0.25",
         "--stable-s", "0.5", "--gen", "4"]


def run(tmp_path, *extra: str) -> int:
    return bench.main(["--dir", str(tmp_path / "store"), "--out", str(tmp_path / "out"), *SMALL, *extra])


def test_command_lines_of_every_configuration(tmp_path):
    a = bench.parse(["--dir", str(tmp_path), "--configs", ",".join(bench.CONFIGS)])
    assert a.kv_per_token == 32 * 2 * 8 * 128 * 2  # the Llama-3-8B shape: 128 KiB per token
    cmds = {c: bench.server_command(c, a, 8000, str(tmp_path / c)) for c in bench.CONFIGS}
    for cfg, (cmd, env) in cmds.items():
        assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        for flag in ("--load-format", "--skip-tokenizer-init", "--enforce-eager", "--num-gpu-blocks-override",
                     "--enable-prompt-tokens-details"):
            assert flag in cmd, (cfg, flag)
        assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and env["PYTHONHASHSEED"] == "0"
        ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) if "--kv-transfer-config" in cmd else None
        if cfg == "recompute":
            assert ktc is None
        elif cfg == "cpu":
            assert ktc["kv_connector"] == "OffloadingConnector"
            assert ktc["kv_connector_extra_config"]["cpu_bytes_to_use"] == int(a.cpu_gib * 2**30)
        else:
            extra = ktc["kv_connector_extra_config"]
            assert extra["gds_path"] == env["GDS_PATH"] == str(tmp_path / cfg)
            assert extra["engine"] == bench.ENGINE[cfg] and extra["block_size"] == 64
            assert extra["cost_model"] == ("rate" if cfg == "gds-cost" else "off")
            assert env["CUFILE_ENV_PATH_JSON"].endswith("configs/cufile.json")
            if cfg == "gds-plain":
                assert ktc["kv_connector"] == "OffloadingConnector" and extra["spec_module_path"] == "hicache_gds_vllm"
            else:
                assert ktc["kv_connector"] == "HiCacheGDSConnector" and ktc["kv_load_failure_policy"] == "recompute"
    with pytest.raises(SystemExit):
        bench.parse(["--dir", str(tmp_path), "--configs", "recompute,nope"])


def test_dry_run_tables_resume_and_deadline(tmp_path):
    assert run(tmp_path, "--configs", "recompute,cpu", "--raw-size", str(32 << 20)) == 0
    doc = json.load(open(tmp_path / "out" / "results.json"))
    s = doc["summary"]
    assert s["recompute"]["revisit"]["n"] == 3 and s["cpu"]["tokens_revisit"]["identical"] == 3
    assert s["cpu"]["revisit"]["cached_frac"] == 0  # the CPU tier holds less than the working set
    assert doc["raw_disk"]["read_GBps"] > 0
    md = open(tmp_path / "out" / "results.md").read()
    assert "| recompute |" in md and "| cpu |" in md and "compat mode" in md and "DRY RUN" in md
    # resumed: the two kept, gds added; the raw measurement is not repeated
    assert run(tmp_path, "--configs", "recompute,cpu,gds", "--resume", "--raw-size", str(32 << 20)) == 0
    doc2 = json.load(open(tmp_path / "out" / "results.json"))
    assert [r["config"] for r in doc2["records"]] == ["recompute", "cpu", "gds"]
    assert doc2["raw_disk"] == doc["raw_disk"]
    g = doc2["summary"]["gds"]
    assert g["revisit"]["cached_frac"] > 0.9 and g["load_revisit"]["GBps"] > 0 and "vs_raw_read" in g["load_revisit"]
    assert g["tokens_revisit"]["identical"] == 3 and g["tokens_burst"]["identical"] == 3
    # a deadline too close to start another configuration: none starts, the results stay, status 3
    assert run(tmp_path, "--configs", "recompute,cpu,gds,bounce", "--resume", "--raw-size", "0",
               "--deadline-s", "1", "--config-budget-s", "5") == 3
    doc3 = json.load(open(tmp_path / "out" / "results.json"))
    assert doc3["unfinished"] == ["bounce"] and len(doc3["records"]) == 3


def test_leftover_server_of_a_killed_run_is_stopped(tmp_path):
    """A harness killed by the device call's timeout leaves its server (its own session) running; the
    next run stops it before starting its own."""
    out = tmp_path / "out"
    args = [sys.executable, os.path.join(E2E, "bench_vllm_server.py"), "--dir", str(tmp_path / "store"), "--out",
            str(out), "--configs", "recompute", "--raw-size", "0", *SMALL[:-2], "--prefixes", "200"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ((out / bench.PIDS).exists() and (out / bench.PIDS).read_text()):
            time.sleep(0.2)
            assert time.monotonic() < deadline
        pgid = int((out / bench.PIDS).read_text().split()[0])
        time.sleep(1.0)
    finally:
        p.kill()
        p.wait(30)
    os.killpg(pgid, 0)  # still there: the harness died without stopping it
    assert bench.stop_leftovers(str(out)) == [pgid]
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.killpg(pgid, 0)
            time.sleep(0.1)
    assert (out / bench.PIDS).read_text() == ""


def test_sigterm_stops_the_server(tmp_path):
    out = tmp_path / "out"
    args = [sys.executable, os.path.join(E2E, "bench_vllm_server.py"), "--dir", str(tmp_path / "store"), "--out",
            str(out), "--configs", "recompute", "--raw-size", "0", *SMALL[:-2], "--prefixes", "200"]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ((out / bench.PIDS).exists() and (out / bench.PIDS).read_text()):
        time.sleep(0.2)
        assert time.monotonic() < deadline
    pgid = int((out / bench.PIDS).read_text().split()[0])
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.killpg(pgid, 0)
            time.sleep(0.1)
