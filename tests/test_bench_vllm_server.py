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
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # the V1 runner: cross-layer KV for the offloading connectors
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
            assert extra["cost_model"] == ("on" if cfg == "gds-cost" else "off")
            assert "read_bytes_per_s" not in extra  # no raw read measured yet: nothing to seed with
            assert env["CUFILE_ENV_PATH_JSON"].endswith("configs/cufile.json")
            if cfg == "gds-plain":
                assert ktc["kv_connector"] == "OffloadingConnector" and extra["spec_module_path"] == "hicache_gds_vllm"
            else:
                assert ktc["kv_connector"] == "HiCacheGDSConnector" and ktc["kv_load_failure_policy"] == "recompute"
    with pytest.raises(SystemExit):
        bench.parse(["--dir", str(tmp_path), "--configs", "recompute,nope"])
    big = bench.parse(["--dir", str(tmp_path), "--model", os.path.join(E2E, "llama-32b-shape"), "--model-runner", "v2"])
    assert big.kv_per_token == 64 * 2 * 8 * 128 * 2  # the 32B shape: 256 KiB per token
    big.seed_read_GBps = 1.66
    cmd, env = bench.server_command("gds-cost", big, 8000, str(tmp_path / "g"))
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    extra = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["read_bytes_per_s"] == 1_660_000_000  # gds-cost starts from the raw read of the same run


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_configuration_that_stalls_is_bounded_and_the_run_goes_on(tmp_path, monkeypatch):
    """A server whose requests stop being answered (the first GPU run: a load retried for minutes)
    costs its workload's timeout, records the error with what it measured, and the next
    configuration runs; results are mirrored after each configuration."""
    monkeypatch.setenv("FAKE_VLLM_STALL_AFTER", "4")  # the warmup and pass 1, then nothing (offloading only)
    t0 = time.monotonic()
    rc = run(tmp_path, "--configs", "gds,recompute", "--raw-size", "0", "--workload-timeout-s", "8",
             "--mirror", str(tmp_path / "mirror"))
    assert rc == 1 and time.monotonic() - t0 < 60
    doc = json.load(open(tmp_path / "mirror" / "results.json"))
    gds, rec = doc["records"]
    assert "WorkloadTimeout" in gds["error"] and len(gds["workload_partial"]["pass1"]) == 3
    assert "error" not in rec and doc["summary"]["recompute"]["revisit"]["n"] == 3
    md = open(tmp_path / "mirror" / "results.md").read()
    assert "| gds | error: WorkloadTimeout" in md and "| recompute |" in md


@pytest.mark.slow
def test_a_configuration_whose_requests_all_fail_prints_dashes(tmp_path, monkeypatch):
    """Every request of a configuration failing leaves no TTFT: the table prints "-" (the first GPU
    run's harness crashed formatting None)."""
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")  # offloading configurations only
    assert run(tmp_path, "--configs", "recompute,gds", "--raw-size", "0", "--drain-timeout", "3") == 0
    doc = json.load(open(tmp_path / "out" / "results.json"))
    g = doc["summary"]["gds"]
    assert g["revisit"]["errors"] == 3 and g["revisit"]["p50"] is None
    md = open(tmp_path / "out" / "results.md").read()
    row = next(line for line in md.splitlines() if line.startswith("| gds |"))
    assert "- / - / -" in row and "None" not in row


@pytest.mark.slow
def test_the_default_gpu_plan_dry_run(tmp_path):
    """run_vllm_e2e.sh without arguments -- the one device call of the plan: the 8B shape's recompute
    and gds, the 32B shape's recompute, gds-cost and gds, then the 8B shape's cpu (vLLM's own CPU
    offloading, the baseline for revisits only NVMe can serve) and gds-cost -- against the fake
    server: every configuration measured, results per shape mirrored to $OUT."""
    out = tmp_path / "OUT"
    out.mkdir()
    env = {**os.environ, "E2E_DRY_RUN": "1", "RAW_SIZE": str(32 << 20), "DEADLINE_S": "300",
           "E2E_DIR": str(tmp_path / "store"), "E2E_OUT": str(tmp_path / "res"), "OUT": str(out),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONPATH": os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(["bash", os.path.join(E2E, "run_vllm_e2e.sh")], env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for shape, cfgs, kv in (("8b", ["recompute", "gds", "cpu", "gds-cost"], 128 << 10),
                            ("32b", ["recompute", "gds-cost", "gds"], 256 << 10)):
        doc = json.load(open(out / shape / "results.json"))
        assert [r["config"] for r in doc["records"]] == cfgs and doc["kv_per_token"] == kv
        assert all("error" not in r for r in doc["records"]) and doc["raw_disk"]["read_GBps"] > 0
        assert all(r["env"]["VLLM_USE_V2_MODEL_RUNNER"] == "0" for r in doc["records"])
        assert doc["summary"]["gds"]["tokens_revisit"]["identical"] == doc["args"]["prefixes"]
        assert (out / shape / "server-gds.log").exists()


def test_load_rate_counts_a_counter_not_yet_exported_as_zero():
    # vLLM exports kv_offload_load_* from their first increment: before the first load they are absent
    before = {"load_bytes": None, "load_time": None, "store_bytes": 9e9, "store_time": 6.0}
    after = {"load_bytes": 8 << 30, "load_time": 5.0, "store_bytes": 9e9, "store_time": 6.0}
    later = {"load_bytes": 16 << 30, "load_time": 9.0}
    c = {"b": before, "a": after, "l": later}
    r = bench.load_rate(c, "b", "a")
    assert r is not None and r["bytes"] == 8 << 30 and r["seconds"] == 5.0 and r["GBps"] == (8 << 30) / 5.0 / 1e9
    assert bench.load_rate(c, "a", "l")["GBps"] == (8 << 30) / 4.0 / 1e9
    assert bench.load_rate({"b": before, "a": before}, "b", "a") is None  # no load at all: no rate
