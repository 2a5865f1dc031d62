"""The server benchmark's harness (benchmarks/e2e: suite, report, exit paths), dry-run against
`fake_server.py`: what the GPU machine runs, minus SGLang and the GPU. The numbers mean nothing;
the plumbing (runtime switches, flushes, resume, deadline, the servers stopped on every exit
path, the report's tables and targets) is what is tested."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E2E = os.path.join(REPO, "benchmarks", "e2e")
sys.path.insert(0, E2E)

import suite  # noqa: E402
import suite_report  # noqa: E402

SMALL = ["--mode", "suite", "--fake", "--model", os.path.join(E2E, "llama3-8b-shape"), "--lengths", "640:1280",
         "--prefixes", "3", "--single", "2", "--burst", "3", "--rates", "20,40", "--reps", "single=2,burst=1,open=1",
         "--stable-s", "0.5", "--resume"]


def run(tmp_path, *extra: str, timeout: float = 240, wait: bool = True):
    env = dict(os.environ, FAKE_START_S="0.3", FAKE_PREFILL_TOK_S="400000", FAKE_READ_TOK_S="300000",
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "plugins", "sglang"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, os.path.join(E2E, "bench_sglang_server.py"), *SMALL, "--dir", str(tmp_path / "store"),
           "--out", str(tmp_path / "out"), *extra]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def fake_servers(tmp_path) -> list[int]:
    """Fake servers of this test (their command line names its store directory)."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                cmd = open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if "fake_server.py" in cmd and str(tmp_path) in open(f"/proc/{p}/environ", "rb").read().decode(
                    errors="replace"):
                out.append(int(p))
    return out


def test_the_plan_interleaves_configurations_and_repeats():
    a = type("A", (), {"configs": suite.DEFAULT_CONFIGS, "reps": "single=3,burst=2,open=1",
                       "workloads": "single,burst,open", "open_configs": "recompute,gds-compute_or_load",
                       "rates": "0.1,0.2"})()
    cells = suite.plan(a)
    ids = [c["id"] for c in cells]
    assert ids[:5] == [f"single/{c}/0" for c in suite.DEFAULT_CONFIGS.split(",")]
    assert ids[5:9] == [f"burst/{c}/0" for c in suite.DEFAULT_CONFIGS.split(",") if c != "nixl"]  # nixl: single only
    assert sum(c["workload"] == "single" and c["config"] == "nixl" for c in cells) == 3
    assert ids[-4:] == ["open/recompute/0/0.1", "open/gds-compute_or_load/0/0.1", "open/gds-compute_or_load/0/0.2",
                        "open/recompute/0/0.2"]
    # Each repetition starts one configuration later, so no configuration always follows recompute.
    cfgs = suite.DEFAULT_CONFIGS.split(",")
    for r in range(3):
        assert [c["config"] for c in cells if c["id"].startswith("single/") and c["rep"] == r] == cfgs[r:] + cfgs[:r]
    with pytest.raises(SystemExit, match="WORKLOAD=N"):
        suite.parse_reps("single=three")


@pytest.mark.slow
def test_a_dry_run_measures_everything_then_resumes_with_nothing_to_do(tmp_path):
    r = run(tmp_path, "--plot")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.load(open(tmp_path / "out" / "suite-llama3-8b-shape.json"))
    assert len(doc["cells"]) == len(suite.plan(suite_args(doc))) == 10 + 4 + 6
    assert doc["populated"]["gds"]["pages"] >= doc["populated"]["gds"]["expected_pages"]
    rids = [r["rid"] for c in doc["cells"].values() for r in c["results"]]
    assert len(set(rids)) == len(rids) and all(r["rid"].startswith(r["tag"] + "-") for c in doc["cells"].values()
                                                for r in c["results"])  # joins each result to the server log
    single = doc["cells"]["single/gds-wait_complete/1"]
    assert single["stats"]["split"]["storage"] > 0 and single["stats"]["errors"] == 0
    burst = doc["cells"]["burst/recompute/0"]["stats"]
    assert burst["n"] == 3 and burst["makespan_s"] > 0 and burst["split"]["storage"] == 0
    md = open(tmp_path / "out" / "suite-llama3-8b-shape.md").read()
    for head in ("## One at a time", "## Burst", "## Open loop", "## Targets (issue 20)", "greedy tokens = recompute"):
        assert head in md
    assert (tmp_path / "out" / "suite-llama3-8b-shape-ttft-p90.png").stat().st_size > 1000
    assert not fake_servers(tmp_path)
    again = run(tmp_path)
    assert again.returncode == 0 and "0 measurements to go" in again.stdout and "starting" not in again.stdout


def suite_args(doc):
    a = doc["args"]
    return type("A", (), {k: a[k] for k in ("configs", "reps", "workloads", "open_configs", "rates")})()


@pytest.mark.slow
def test_a_deadline_stops_early_and_the_next_call_reuses_the_l3(tmp_path):
    r = run(tmp_path, "--deadline", "8")
    assert r.returncode == 3, r.stdout[-3000:]
    assert "--resume goes on" in r.stdout and not fake_servers(tmp_path)
    r2 = run(tmp_path)
    assert r2.returncode == 0, r2.stdout[-3000:]
    assert "written by an earlier call, reused" in r2.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_server_goes_with_its_harness(tmp_path, sig):
    p = run(tmp_path, wait=False)
    deadline = time.monotonic() + 60
    while not fake_servers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fake_servers(tmp_path), "the server did not start"
    time.sleep(1.0)
    p.send_signal(sig)
    p.wait(30)
    deadline = time.monotonic() + 15
    while fake_servers(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not fake_servers(tmp_path)


def test_the_report_computes_the_issues_targets():
    def cell(w, cfg, rep, ttfts, storage=0, rate=None, outs=None):
        rs = [{"tag": f"p{i}", "ttft_s": t, "prompt_tokens": 1000, "output_ids": (outs or [1, 2]), "error": None,
               "t_start": 0.0, "t_end": t} for i, t in enumerate(ttfts)]
        st = suite.cell_stats([suite.Result(**{**r, "latency_s": r["ttft_s"], "logprobs": [], "cached": {
            "storage": storage, "cached_tokens": storage}}) for r in rs])
        c = {"workload": w, "config": cfg, "rep": rep, "results": rs, "stats": st}
        if rate is not None:
            c["rate"] = rate
        return c

    cells = [cell("single", "recompute", 0, [1.0, 2.0]), cell("single", "gds-wait_complete", 0, [1.5, 2.5], 900),
             cell("single", "gds-compute_or_load", 0, [1.0, 2.05]), cell("single", "nixl", 0, [1.6, 2.6], 900),
             cell("burst", "recompute", 0, [5.0, 10.0]), cell("burst", "gds-wait_complete", 0, [6.0, 9.0], 900),
             cell("burst", "gds-compute_or_load", 0, [3.0, 6.0], 500, outs=[9]),
             cell("open", "recompute", 0, [1.5, 1.5], rate=0.1), cell("open", "recompute", 0, [3.0, 3.0], rate=0.2),
             cell("open", "recompute", 0, [4.0, 4.0], rate=0.3),
             cell("open", "gds-compute_or_load", 0, [1.0, 1.0], rate=0.1),
             cell("open", "gds-compute_or_load", 0, [1.5, 1.5], rate=0.2),
             cell("open", "gds-compute_or_load", 0, [2.0, 2.0], rate=0.3)]
    doc = {"cells": {str(i): c for i, c in enumerate(cells)}, "model": {"kv_bytes_per_token": 256 << 10}}
    rows = suite_report.summarize(doc)["targets"]

    def t(prefix):
        return next(row for row in rows if row["target"].startswith(prefix))

    assert t("one at a time")["value"] == pytest.approx(1.525 / 1.5) and t("one at a time")["met"]
    assert t("burst: makespan")["value"] == pytest.approx(6.0 / 10.0) and t("burst: makespan")["limit"] == 0.65
    assert t("burst: mean TTFT")["value"] == pytest.approx(4.5 / 7.5) and t("burst: mean TTFT")["limit"] == 0.6
    # the knee is where recompute's p90 doubles from its idle (one at a time: p90 of 1.0, 2.0 = 1.9 s)
    # value, not from its lowest rate's (1.5 s, doubled at 0.2 req/s already)
    assert t("open loop at 0.3")["value"] == pytest.approx(0.5) and t("open loop at 0.3")["met"]
    assert "one-at-a-time" in t("open loop at 0.3")["target"]
    no_single = {"cells": {k: c for k, c in doc["cells"].items() if c["workload"] != "single"}, "model": doc["model"]}
    fallback = next(r for r in suite_report.summarize(no_single)["targets"] if r["target"].startswith("open loop"))
    assert fallback["target"].startswith("open loop at 0.2") and "0.1 req/s p90" in fallback["target"]
    assert fallback["value"] == pytest.approx(0.5)
    assert t("revisit from L3")["value"] == pytest.approx(2.0 / 2.1) and t("revisit from L3")["met"]
    assert t("burst: vs the best")["value"] == pytest.approx(6.0 / 9.0)
    assert t("greedy tokens = recompute (gds-compute_or_load)")["met"] is False
    assert t("greedy tokens = recompute (gds-wait_complete)")["met"] is True


def test_a_variant_is_gds_with_its_keys_added_and_measured_beside_the_rest(tmp_path):
    assert suite.split_config("gds-wait_complete+verify=false+max_request_bytes=1073741824") == (
        "gds-wait_complete", {"verify": False, "max_request_bytes": 1 << 30})
    assert suite.split_config("nixl") == ("nixl", {})
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        suite.split_config("gds-wait_complete+verify")
    r = run(tmp_path, "--workloads", "single", "--reps", "single=1", "--trace",
            "--configs", "recompute,gds-wait_complete,gds-wait_complete+verify=false")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.load(open(tmp_path / "out" / "suite-llama3-8b-shape.json"))
    assert "single/gds-wait_complete+verify=false/0" in doc["cells"]
    puts = [json.loads(s["body"]["hicache_storage_backend_extra_config_json"])
            for call in doc["calls"] for s in call.get("switches", []) if s["call"] == "PUT"]
    assert {"verify": False}.items() <= puts[-1].items() and "verify" not in puts[0]


def test_the_trace_report_splits_a_revisit_into_its_stages(tmp_path):
    import trace_report
    t = 100.0
    lines = [("queued", {"t": t, "tokens": 256}), ("query", {"t0": t + 0.01, "t": t + 0.03, "tokens": 256}),
             ("get", {"t0": t + 0.05, "t": t + 0.25, "pages": 2, "landed": 2, "backend": "gds"}),
             ("get", {"t0": t + 0.27, "t": t + 0.47, "pages": 2, "landed": 2, "backend": "gds"}),
             ("transfer", {"t0": t + 0.05, "t": t + 0.47, "landed": 4, "pages": 4}),
             ("ready", {"t": t + 0.50, "tokens": 256}), ("scheduled", {"t": t + 0.52, "prefix": 256, "extend": 64})]
    log = tmp_path / "server.log"
    log.write_text("noise\n" + "".join(f"[x] INFO hicache-gds trace {json.dumps({'ev': ev, 'rid': 'p0-1', **f})}\n"
                                       for ev, f in lines))
    row = trace_report.timeline(trace_report.events([str(log)])["p0-1"], page_bytes=1 << 20)
    for k, v in {"wait": 0.01, "query": 0.02, "start": 0.02, "gets": 0.40, "gaps": 0.02, "ready": 0.03,
                 "sched": 0.02}.items():
        assert row[k] == pytest.approx(v), k
    assert row["n_gets"] == 2 and row["pages"] == 4 and row["GB/s"] == pytest.approx(4 * (1 << 20) / 0.4 / 1e9)


def test_the_forecast_report_sets_each_ranks_gpu_waits_and_load_times_against_their_forecasts(tmp_path, capsys):
    import forecast_report
    pre = "[2026-11-29 17:47:41 TP{}] hicache-gds policy: "
    lines = [  # as a TP=2 server logs them (run 25)
        pre.format(0) + "p6-75 compute (22848 new, 0 held, 22784 in L3; load 1.594 s, compute 1.286 s; GPU backlog "
        "0.582 s, disk backlog 0.309 s; read 1.21 GB/s, prefill 55665 tok/s at 8k; host pool 98368 tokens free; "
        "computing finishes first)",
        pre.format(0) + "p1-31 load (14080 new, 0 held, 14016 in L3; load 1.330 s, compute 1.618 s; GPU backlog "
        "1.282 s, disk backlog 0.309 s; read 1.21 GB/s, prefill 55665 tok/s at 8k; host pool 98368 tokens free; "
        "loading finishes first)",
        pre.format(1) + "p6-75 compute (22848 new, 0 held, 22784 in L3; load 1.9 s, compute 1.286 s; GPU backlog "
        "0.200 s, disk backlog 0.4 s; read 1.04 GB/s, prefill 55671 tok/s at 8k; host pool 98368 tokens free; "
        "computing finishes first)",
        pre.format(0) + "p6-75 left the queue after 0.873 s holding 0 tokens (0 on host) of 22848 new; decided "
        "compute with 22784 in L3",
        pre.format(1) + "p6-75 left the queue after 0.873 s holding 0 tokens (0 on host) of 22848 new; decided "
        "compute with 22784 in L3",
        pre.format(0) + "p1-31 load done: 14016 tokens in 1.165 s (forecast 1.070 s; pace now 1.09; seen 0.339 s "
        "later); host pool 21120 tokens free",
        pre.format(0) + "p1-31 left the queue after 1.502 s holding 14016 tokens (14016 on host) of 14080 new; "
        "decided load with 14016 in L3",
        "[2026-11-29 17:47:41 TP0] Prefill batch, #new-seq: 1, #new-token: 8192",
    ]
    log = tmp_path / "server.log"
    log.write_text("\n".join(lines) + "\n")
    got = forecast_report.ratios(log.read_text().splitlines())
    # rank 0: its compute waited 0.873 s of 0.582 forecast; its load is a disk row only (1.165 of 1.070);
    # rank 1's compute had 0.2 s ahead of it, under --min-ahead
    assert got["TP0"]["gpu"] == [pytest.approx(0.873 / 0.582)]
    assert got["TP0"]["disk"] == [pytest.approx(1.165 / 1.070)]
    assert "TP1" not in got
    assert forecast_report.ratios(log.read_text().splitlines(), min_ahead=0.1)["TP1"]["gpu"] == [
        pytest.approx(0.873 / 0.2)]
    assert forecast_report.main([str(log)]) == 0
    out = capsys.readouterr().out
    assert f"| {log} | TP0 | gpu | 1 | 1.50 | 1.50 | 1.50 |" in out and f"| {log} | TP0 | disk | 1 | 1.09 |" in out
    assert "TP1" not in out


def test_the_forecast_report_sets_out_how_long_finished_loads_waited_on_the_host_and_beside_what(tmp_path, capsys):
    import forecast_report
    pre = "[2026-11-29 23:26:44] hicache-gds policy: "
    batch = "[2026-11-29 23:26:45] Prefill batch, #new-seq: {}, #new-token: 8192, #cached-token: 0, token usage: {}, " \
            "#running-req: {}, #queue-req: 3, #pending-token: 66944, cuda graph: False"
    lines = [  # as run 27's TP=1 burst logged them (p3 waited behind p4's chunks, p0 and p1 decoding)
        pre + "p3-9a76 load of 17216 tokens protected on host until the GPU takes it; host pool 3968 tokens free",
        batch.format(1, "0.87", 2),
        pre + "p5-db75 load of 21888 tokens protected on host until the GPU takes it; host pool 4032 tokens free",
        batch.format(1, "0.61", 1),
        pre + "p3-9a76 host protection of 17216 tokens released after 1.126 s (left the waiting queue)",
        pre + "p5-db75 host protection of 21888 tokens released after 0.006 s (left the waiting queue)",
        pre + "p9-0000 host protection of 100 tokens released after 5.000 s (left the waiting queue)",  # never seen protected
    ]
    log = tmp_path / "server.log"
    log.write_text("\n".join(lines) + "\n")
    got = forecast_report.host_waits(log.read_text().splitlines())
    assert got == {"-": [(1.126, 0.87, 2), (0.006, 0.61, 1)]}  # each the fullest pool and most decoding it saw
    assert forecast_report.main([str(log)]) == 0
    out = capsys.readouterr().out
    assert f"| {log} | - | 2 | 0.566 s | 1.126 s | 1 | 0.87-0.87 | 2-2 |" in out


def test_the_ideal_server_fits_the_prefill_and_bounds_the_open_loop():
    import open_loop_bound as olb
    true = olb.Server(a=2e-5, b=5e-9, c0=0.1, read_Bps=1.5e9, kv_bytes=128 << 10)
    lengths = [12288, 16384, 20480, 24576]
    c0, a, b = olb.fit_prefill([(n, true.c0 + true.compute(n)) for n in lengths])
    assert (c0, a, b) == pytest.approx((0.1, 2e-5, 5e-9), rel=1e-6)
    with pytest.raises(ValueError, match="two prompt lengths"):
        olb.fit_prefill([(12288, 1.0), (12288, 1.1)])
    with pytest.raises(ValueError, match="policy 'lmcache'"):
        olb.simulate([0.0], [1000], "lmcache", true)

    # a request alone takes min(load, compute); the disk takes the second of two at once
    h = 20480
    alone = {p: olb.simulate([0.0], [h], p, true)[0] for p in olb.POLICIES}
    assert alone["recompute"] == pytest.approx(true.c0 + true.compute(h + 64))
    assert alone["per_request"] == pytest.approx(true.c0 + min(true.compute(h + 64), true.load(h) + true.compute(64, h)))
    assert alone["split"] < alone["per_request"]
    # what SGLang can join lies between: a head of whole chunks, the tail joined when its last chunk starts
    assert alone["split"] <= alone["joined"] <= alone["per_request"]
    chunked = olb.Server(a=2e-5, b=5e-9, c0=0.1, read_Bps=1.5e9, kv_bytes=128 << 10, chunk=4096, grain=1024)
    m, f_raw = 4096 * 3, (chunked.compute(4096 * 2)) * 1.5e9 / (128 << 10)  # the best head, here
    f = min(h - m, int(f_raw) // 1024 * 1024)
    joined = olb.simulate([0.0], [h], "joined", chunked)[0]
    assert joined <= chunked.c0 + chunked.compute(m) + chunked.compute(h - m - f + 64, m + f) + 1e-12
    assert joined < olb.simulate([0.0], [h], "per_request", chunked)[0]
    whole = replace(chunked, chunk=h)  # no head of whole chunks leaves a tail: as per request
    assert olb.simulate([0.0], [h], "joined", whole) == olb.simulate([0.0], [h], "per_request", whole)
    fast = olb.Server(a=2e-5, b=5e-9, c0=0.0, read_Bps=20e9, kv_bytes=128 << 10)
    two = olb.simulate([0.0, 0.0], [h, h], "per_request", fast)
    assert max(two) < 2 * fast.compute(h + 64)

    k = olb.knee(true, lengths, count=4000)
    assert k["recompute_p90"] == pytest.approx(2 * k["idle_p90"], rel=0.15)
    assert k["split_ratio"] <= k["joined_ratio"] <= k["per_request_ratio"] < 1.0


@pytest.mark.slow
def test_the_report_sets_the_open_loop_against_the_ideal_server():
    import open_loop_bound as olb

    def cell(w, cfg, rate, ttfts, lens, starts):
        rs = [{"tag": f"p{i}", "ttft_s": t, "prompt_tokens": n + 64, "output_ids": [1], "error": None,
               "t_start": s, "t_end": s + t} for i, (t, n, s) in enumerate(zip(ttfts, lens, starts))]
        st = suite.cell_stats([suite.Result(**{**r, "latency_s": r["ttft_s"], "logprobs": [], "cached": {}}) for r in rs])
        return {"workload": w, "config": cfg, "rep": 0, "results": rs, "stats": st, **({"rate": rate} if rate else {})}

    srv = olb.Server(a=2e-5, b=5e-9, c0=0.1, read_Bps=1.5e9, kv_bytes=128 << 10)
    lens = [12288, 16384, 20480, 24576]
    single = cell("single", "recompute", None, [srv.c0 + srv.compute(n + 64) for n in lens], lens, [0, 5, 10, 15])
    starts = [0.0, 0.4, 0.9, 1.1, 3.0, 3.2]
    arrivals = [lens[i % 4] for i in range(6)]
    cells = [single, cell("open", "recompute", 0.5, [2, 3, 4, 5, 2, 3], arrivals, starts),
             cell("open", "gds-compute_or_load", 0.5, [2, 2, 3, 3, 2, 2], arrivals, starts)]
    doc = {"cells": {str(i): c for i, c in enumerate(cells)}, "lengths": lens, "args": {"suffix_tokens": 64},
           "model": {"kv_bytes_per_token": 128 << 10},
           "raw_disk": {"read": {"rw": "read", "raw_MBps": 1500.0}}}
    s = suite_report.summarize(doc)
    text = "\n".join(suite_report.bound_lines(doc, s))
    assert "recompute's p90 doubles" in text and "1.50 GB/s" in text and "burst" not in text
    row = next(line for line in text.splitlines() if line.startswith("| 0.5 |"))
    assert row.split("|")[2].strip() == f"{3.0 / 4.5:.2f}x"  # the two cells' measured p90s
    # a burst: the measured ratios beside the model's, whichever way they fall
    cells += [cell("burst", "recompute", None, [1.0, 2.0, 3.0, 4.0], lens, [0.0] * 4),
              cell("burst", "gds-compute_or_load", None, [1.0, 1.5, 2.0, 2.0], lens, [0.0] * 4)]
    doc["cells"] = {str(i): c for i, c in enumerate(cells)}
    doc["args"]["burst"] = 4
    s = suite_report.summarize(doc)
    lines = suite_report.bound_lines(doc, s)
    b = olb.burst(srv, lens)
    assert "| burst of 4, against recompute | makespan | mean TTFT |" in lines
    assert f"| ideal: per request | {b['per_request'][0] / b['recompute'][0]:.2f}x | " \
           f"{b['per_request'][1] / b['recompute'][1]:.2f}x |" in lines
    doc.pop("raw_disk")
    assert "Not computed: the run has no raw read rate" in "\n".join(suite_report.bound_lines(doc, s))


def test_an_open_loop_repetition_counts_only_where_every_configuration_measured_it():
    def cell(cfg, rep, ttfts):
        rs = [{"tag": f"p{i}", "ttft_s": t, "prompt_tokens": 1000, "output_ids": [1], "error": None, "t_start": float(i),
               "t_end": i + t} for i, t in enumerate(ttfts)]
        st = suite.cell_stats([suite.Result(**{**r, "latency_s": r["ttft_s"], "logprobs": [], "cached": {}}) for r in rs])
        return {"id": f"open/{cfg}/{rep}/0.5", "workload": "open", "config": cfg, "rep": rep, "rate": 0.5,
                "results": rs, "stats": st}

    # a call cut short measured recompute's repetition 1 (a burstier draw) but not ours
    cells = [cell("recompute", 0, [2.0] * 10), cell("gds-compute_or_load", 0, [1.0] * 10),
             cell("recompute", 1, [9.0] * 10)]
    doc = {"cells": {c["id"]: c for c in cells}, "model": {"kv_bytes_per_token": 128 << 10}}
    s = suite_report.summarize(doc)
    assert s["open_unpaired"] == ["open/recompute/1/0.5"]
    assert s["open"]["recompute"][0.5]["p90"] == pytest.approx(2.0) and s["open"]["recompute"][0.5]["reps"] == 1
    assert "Left out, their repetition not measured for every configuration at that rate: open/recompute/1/0.5" in \
        suite_report.markdown(doc, s)


def test_kv_bytes_per_token_counts_one_latent_per_layer_for_mla():
    from e2elib import model_info
    ds = model_info(os.path.join(E2E, "deepseek-v3-shape"), tp=8)
    assert ds["attention"] == "mla" and ds["layers"] == 61
    # one latent per layer, the same on every rank: one copy in L3
    assert ds["kv_bytes_per_token"] == ds["gpu_kv_bytes_per_token"] == 61 * (512 + 64) * 2 == 70272
    llama = model_info(os.path.join(E2E, "llama3-8b-shape"))
    assert llama["attention"] == "mha" and llama["kv_bytes_per_token"] == llama["gpu_kv_bytes_per_token"] == 128 << 10
    tp2 = model_info(os.path.join(E2E, "llama3-8b-shape"), tp=2)
    assert tp2["kv_bytes_per_token"] == 128 << 10 and tp2["gpu_kv_bytes_per_token"] == 64 << 10  # heads split
    assert model_info(os.path.join(E2E, "llama3-8b-shape"), tp=16)["gpu_kv_bytes_per_token"] == 16 << 10  # replicated


def test_tp_reaches_the_server_command_only_above_one():
    import argparse
    base = dict(fake=False, model="m", page_size=64, max_total_tokens=1000, chunk=512, mem_fraction=0.6, shape="m",
                hicache_ratio=2.0, layout="page_first", capacity="1G", dir="/tmp/none", gds_path="")
    one, _ = suite.server_command(argparse.Namespace(**base, tp=1), 1)
    eight, _ = suite.server_command(argparse.Namespace(**base, tp=8), 1)
    assert "--tp-size" not in one and eight[:len(one)] == one and eight[len(one):] == ["--tp-size", "8"]
    import bench_sglang_server as bss
    cmd, _ = bss.server_command("gds", argparse.Namespace(**base, tp=4, prefetch_policy="wait_complete"), 1, "/tmp/x")
    assert cmd[cmd.index("--tp-size") + 1] == "4"
    cmd, _ = bss.server_command("gds", argparse.Namespace(**base, tp=1, prefetch_policy="wait_complete"), 1, "/tmp/x")
    assert "--tp-size" not in cmd


def test_a_tp8_dry_run_of_the_deepseek_shape_with_fewer_layers(tmp_path):
    r = run(tmp_path, "--model", os.path.join(E2E, "deepseek-v3-shape"), "--tp", "8", "--layers", "4",
            "--weights", "bf16", "--workloads", "single", "--reps", "single=1",
            "--configs", "recompute,gds-wait_complete")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    shape = "deepseek-v3-shape-L4-bf16"
    doc = json.load(open(tmp_path / "out" / f"suite-{shape}.json"))
    assert doc["args"]["tp"] == 8 and doc["args"]["layers"] == 4 and doc["model"]["tp"] == 8
    assert doc["model"]["layers"] == 4 and doc["model"]["kv_bytes_per_token"] == 4 * 576 * 2
    cmd = doc["calls"][0]["command"].split()
    assert cmd[cmd.index("--tp-size") + 1] == "8"
    assert cmd[cmd.index("--model-path") + 1] == str(tmp_path / "out" / "models" / shape)
    cfg = json.load(open(tmp_path / "out" / "models" / shape / "config.json"))
    assert cfg["num_hidden_layers"] == 4 and cfg["first_k_dense_replace"] == 3 and "quantization_config" not in cfg
    assert doc["cells"]["single/gds-wait_complete/0"]["stats"]["split"]["storage"] > 0
    md = open(tmp_path / "out" / f"suite-{shape}.md").read()
    assert "TP=8" in md and "4 layers, mla attention" in md
    fp8 = suite.model_variant(os.path.join(E2E, "deepseek-v3-shape"), str(tmp_path), 0, "fp8")
    assert json.load(open(os.path.join(fp8, "config.json")))["quantization_config"]["weight_block_size"] == [128, 128]
    assert os.path.basename(fp8) == "deepseek-v3-shape-fp8"


def test_the_host_workload_revisits_a_prompt_after_pushing_it_out_of_the_gpu_pool(tmp_path):
    r = run(tmp_path, "--workloads", "host", "--reps", "host=1", "--configs", "recompute,gds-wait_complete",
            "--max-total-tokens", "2560")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.load(open(tmp_path / "out" / "suite-llama3-8b-shape.json"))
    assert sorted(doc["cells"]) == ["host/gds-wait_complete/0", "host/recompute/0"]
    for cell in doc["cells"].values():
        assert [x["tag"] for x in cell["results"]] == ["host"] and cell["stats"]["errors"] == 0
    md = open(tmp_path / "out" / "suite-llama3-8b-shape.md").read()
    assert "## A host-only hit" in md
    s = suite_report.summarize(doc)
    assert s["tokens"]["gds-wait_complete"] == {"compared": 1, "identical": 1}
    assert not fake_servers(tmp_path)


def test_a_store_smaller_than_the_prompts_is_refused_per_writing_rank():
    """hicache-gds' capacity is per writing rank: 11G holds two TP=2 ranks' halves of 8 prompts
    of 10k-26k tokens of the 8B shape (19.4 GB in all), not one TP=1 rank's whole; the error
    names the option, the need and a size that fits. MLA: rank 0 writes a whole latent."""
    a = argparse.Namespace(capacity="11G", configs="recompute,gds-compute_or_load", open_configs="", tp=2,
                           model_info={"attention": "mha", "kv_bytes_per_token": 131072}, lengths="10240:26624",
                           prefixes=8, suffix_tokens=64, page_size=64)
    suite.check_capacity(a)
    a.tp = 1
    with pytest.raises(SystemExit, match=r"--capacity 11G per writing rank is smaller than the 8 prompts' KV each of "
                                         r"1 writing rank\(s\) stores \(147776 tokens, 18\.0 GiB\).*--capacity 20G"):
        suite.check_capacity(a)
    a.capacity = "20G"
    suite.check_capacity(a)
    a.configs = "recompute,nixl"  # no hicache-gds namespace in the run: nothing to size
    a.capacity = "1G"
    suite.check_capacity(a)
    a.configs, a.tp, a.model_info = "gds-wait_complete", 4, {"attention": "mla", "kv_bytes_per_token": 131072}
    with pytest.raises(SystemExit, match=r"each of 1 writing rank"):
        suite.check_capacity(a)


def test_space_check_counts_capacity_per_writing_rank(tmp_path):
    """A TP=2 MHA run writes hicache-gds' capacity once per rank: the check refuses a disk that
    holds one copy but not two, names the problem, and passes MLA (rank 0 writes) on the same disk."""
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    per_rank = f"{int(free * 0.6) >> 20}M"  # one rank's fits, two ranks' do not
    a = argparse.Namespace(dir=str(tmp_path), gds_path="", capacity=per_rank, configs="recompute,gds-wait_complete",
                           open_configs="", raw_size="0", fake=False, tp=2, model_info={"attention": "mha",
                           "kv_bytes_per_token": 131072}, lengths="640:1280", prefixes=3, single=2, suffix_tokens=64, page_size=64)
    with pytest.raises(SystemExit, match=r"x 2 writing rank\(s\).*per rank at TP > 1"):
        suite.check_space(a)
    a.model_info["attention"] = "mla"
    suite.check_space(a)
    a.tp, a.model_info["attention"] = 1, "mha"
    suite.check_space(a)
