"""hicache-gds-bench reports: fio's JSON schema (checked against JSON real fio wrote), fio's normal
format, exact percentiles, and reading fio's output."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_gds.bench import report
from hicache_gds.bench.options import parse_argv
from hicache_gds.bench.report import (
    FioOutputError, JobResult, fio_argv, fio_job_summary, num2str, parse_fio_json, render, to_fio_json,
    to_fio_normal,
)
from hicache_gds.bench.stats import _plat_idx  # fio's bucket index, private on purpose
from hicache_gds.bench.stats import (
    DEFAULT_PERCENTILES, LatencyRecorder, LatencySummary, RateRecorder, fio_bucket_value,
    fio_percentiles, latency_distribution, percentile_key,
)

FIO = shutil.which("fio")
needs_fio = pytest.mark.skipif(FIO is None, reason="fio is not on PATH (apt-get install fio)")

# fio keys we leave out on purpose (key paths as `_paths` spells them). Everything else fio
# writes for a plain job must exist in ours with the same JSON type.
INTENTIONALLY_OMITTED = {
    "disk_util[]",            # device counters come from /proc/diskstats; we emit an empty list
    "client_stats",           # fio client/server mode only
}
OMITTED_PREFIXES = tuple(p + "." for p in INTENTIONALLY_OMITTED) + ("disk_util[].",)
# Objects whose keys are data, not schema: compare the type of their values only.
DATA_KEYED = ("job options", "global options", "bins")


def _jtype(v) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict",
            type(None): "null"}[type(v)]


def _paths(obj, prefix: str = "") -> dict[str, str]:
    """{key path: JSON type} of a parsed JSON value; list items collapse into `[]`."""
    out = {prefix: _jtype(obj)} if prefix else {}
    if isinstance(obj, dict):
        data_keyed = prefix.rsplit(".", 1)[-1] in DATA_KEYED
        for k, v in obj.items():
            out.update(_paths(v, f"{prefix}.{'*' if data_keyed else k}" if prefix else k))
    elif isinstance(obj, list):
        for v in obj:
            out.update(_paths(v, prefix + "[]"))
    return out


def _schema_diff(fio_doc, ours) -> list[str]:
    theirs, mine = _paths(fio_doc), _paths(ours)
    problems = []
    for path, t in sorted(theirs.items()):
        if path in INTENTIONALLY_OMITTED or path.startswith(OMITTED_PREFIXES):
            continue
        if path not in mine:
            problems.append(f"missing {path} ({t})")
        elif mine[path] != t:
            problems.append(f"{path}: fio has {t}, we have {mine[path]}")
    return problems


def _synthetic_result(rng, opts=None, ios: int = 4000) -> JobResult:
    opts = opts or parse_argv(["--name=kv", "--rw=randrw", "--model=llama3-8b", "--batch=8"])
    r = JobResult(opts, usr_cpu=float(rng.uniform(0, 50)), sys_cpu=float(rng.uniform(0, 50)),
                  ctx=int(rng.integers(1, 10**5)), minf=int(rng.integers(0, 100)), elapsed_s=3.2,
                  iodepth_counts={1: 2, 4: ios}, submit_counts={8: ios // 8},
                  complete_counts={8: ios // 8}, job_start_ms=1_700_000_000_000)
    for d in (r.read, r.write):
        clat = rng.lognormal(12, 0.6, ios).astype(np.int64) + 1
        slat = rng.integers(200, 20_000, ios)
        d.clat.extend(clat)
        d.slat.extend(slat)
        d.lat.extend(clat + slat)
        d.total_ios, d.io_bytes = ios, ios * opts.block_size
        d.runtime_ns = int(rng.integers(1, 5) * 1e9 + rng.integers(0, 10**6))
        for _ in range(6):
            d.rate.add_sample(d.bw_bytes * rng.uniform(0.8, 1.2), d.iops * rng.uniform(0.8, 1.2))
    r.hicache_gds.update(engine="bounce", path="O_DIRECT + pinned bounce", ratio_to_raw=0.97,
                         baseline={"raw": {"write": {"bw_bytes": 2.4e9}}})
    return r


@pytest.fixture(scope="module")
def fio_run(tmp_path_factory):
    """Real fio, two jobs (write, randrw), json+ and normal output of the same run."""
    if FIO is None:
        pytest.skip("fio is not on PATH (apt-get install fio)")
    d = tmp_path_factory.mktemp("fio")
    job = d / "t.fio"
    job.write_text(f"[global]\nfilename={d / 'f'}\nsize=4m\nbs=64k\ndirect=1\nioengine=psync\n"
                   "[w]\nrw=write\n[rw]\nrw=randrw\n")
    res = subprocess.run([FIO, str(job), "--output-format=json+,normal"], capture_output=True,
                         text=True, timeout=120)
    if res.returncode != 0 and "O_DIRECT" in res.stderr + res.stdout:   # e.g. tmpfs
        pytest.skip(f"fio could not use O_DIRECT here: {res.stderr.strip()[:200]}")
    assert res.returncode == 0, res.stderr
    return parse_fio_json(res.stdout), res.stdout


# --------------------------------------------------------------------------- schema vs real fio

@needs_fio
def test_json_schema_matches_real_fio(fio_run):
    fio_doc, _ = fio_run
    rng = np.random.default_rng()
    ours = json.loads(json.dumps(to_fio_json([_synthetic_result(rng)], {"size": "4m"},
                                             json_plus=True)))
    fio_jobs = fio_doc["jobs"]
    assert {"write", "read"} <= {k for j in fio_jobs for k in ("read", "write")
                                 if j[k]["clat_ns"].get("percentile")}
    top_fio = {k: v for k, v in fio_doc.items() if k != "jobs"}
    assert _schema_diff(top_fio, {k: v for k, v in ours.items() if k != "jobs"}) == []
    for fj in fio_jobs:
        assert _schema_diff(fj, ours["jobs"][0]) == [], fj["jobname"]
    # percentile keys are fio's, in fio's order
    fio_keys = list(fio_jobs[0]["write"]["clat_ns"]["percentile"])
    assert list(ours["jobs"][0]["write"]["clat_ns"]["percentile"]) == fio_keys
    # our additions only in their own block
    assert set(ours["jobs"][0]) - set(_paths(fio_jobs[0])) <= {"hicache_gds", "job_start",
                                                               "latency_target_ns",
                                                               "latency_window_us"}
    assert ours["jobs"][0]["hicache_gds"]["page_bytes"] == 2 << 20


@needs_fio
def test_plain_json_has_no_bins_and_slat_has_no_percentiles(fio_run):
    doc = to_fio_json([_synthetic_result(np.random.default_rng())])
    w = doc["jobs"][0]["write"]
    assert "bins" not in w["clat_ns"] and "percentile" not in w["slat_ns"]
    assert "percentile" not in fio_run[0]["jobs"][0]["write"]["slat_ns"]


@needs_fio
def test_our_bins_use_fios_buckets(fio_run):
    """Every bin value real fio wrote is a bucket value of our histogram port."""
    bins = {int(k) for j in fio_run[0]["jobs"] for d in ("read", "write")
            for k in j[d]["clat_ns"].get("bins", {})}
    assert bins
    vals = np.array(sorted(bins), dtype=np.int64)
    assert [fio_bucket_value(int(i)) for i in _plat_idx(vals)] == list(vals)


@needs_fio
def test_normal_format_matches_real_fio_lines(fio_run):
    """Rebuild fio's own lines from its JSON with our formatters; they must appear verbatim."""
    doc, text = fio_run
    for job in doc["jobs"]:
        for ddir in ("read", "write"):
            d = job[ddir]
            if not d["io_bytes"]:
                continue
            bw = 1000 * d["io_bytes"] // d["runtime"]
            iops = 1000 * d["total_ios"] // d["runtime"]
            line = (f"  {ddir}: IOPS={num2str(iops)}, BW={num2str(bw, pow2=True, unit='B/s')} "
                    f"({num2str(bw, unit='B/s')})({num2str(d['io_bytes'], pow2=True, unit='B')}/"
                    f"{d['runtime']}msec)")
            assert line in text
            c = d["clat_ns"]
            s = LatencySummary(c["min"], c["max"], c["mean"], c["stddev"], c["N"], {})
            assert report._display_lat("clat", s) in text
            pcts = {float(k): v for k, v in c["percentile"].items()}
            assert report._percentile_block("clat", pcts) in text
    assert "\nRun status group 0 (all jobs):\n" in text


# --------------------------------------------------------------------------- stats

def _reference_percentile(sorted_vals, p):
    n = len(sorted_vals)
    need = Fraction(repr(p)) * n / 100
    for i, v in enumerate(sorted_vals, 1):
        if i >= need:
            return v


def test_percentiles_on_known_data():
    rec = LatencyRecorder(range(1, 1001))
    p = rec.summary().percentiles
    assert (p[1.0], p[50.0], p[99.0], p[99.9], p[99.99]) == (10, 500, 990, 999, 1000)
    out = rec.to_fio()
    assert list(out["percentile"]) == [percentile_key(x) for x in DEFAULT_PERCENTILES]
    assert out["percentile"]["99.900000"] == 999 and percentile_key(99.95) == "99.950000"
    assert LatencyRecorder([7]).to_fio()["percentile"]["1.000000"] == 7
    assert "percentile" not in LatencyRecorder().to_fio() and LatencyRecorder().to_fio()["N"] == 0


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3000))
def test_stats_match_reference_on_random_data(seed, n):
    rng = np.random.default_rng(seed)
    vals = rng.integers(0, rng.choice([100, 10**4, 10**9]), n)
    rec = LatencyRecorder(capacity=1)
    for chunk in np.array_split(vals, 3):
        rec.extend(chunk)
    rec.add(int(vals[0]))
    vals = np.append(vals, vals[0])
    s = rec.summary()
    assert (s.min, s.max, s.n) == (vals.min(), vals.max(), vals.size)
    assert math.isclose(s.mean, vals.mean()) and math.isclose(
        s.stddev, vals.std(ddof=1) if vals.size > 1 else 0.0, rel_tol=1e-9, abs_tol=1e-9)
    sv = sorted(vals.tolist())
    assert s.percentiles == {p: _reference_percentile(sv, p) for p in DEFAULT_PERCENTILES}
    ours = fio_percentiles(vals, (50.0, 90.0))
    assert ours[50.0] == int(np.percentile(vals, 50, method="inverted_cdf"))


def test_recorder_merge_bins_and_distribution():
    rng = np.random.default_rng()
    a, b = LatencyRecorder(rng.integers(0, 5000, 100)), LatencyRecorder(rng.integers(0, 10**8, 50))
    m = LatencyRecorder.merged([a, b])
    assert len(m) == 150 and sum(m.bins().values()) == 150
    assert {int(k) for k in LatencyRecorder(range(128)).bins()} == set(range(128))
    with pytest.raises(ValueError):
        a.add(-1)
    ns, us, ms = latency_distribution([LatencyRecorder([1, 3, 999, 1500, 2_500_000, 5 * 10**9])])
    assert ns["2"] == ns["4"] == ns["1000"] == pytest.approx(100 / 6)
    assert us["2"] == pytest.approx(100 / 6) and ms["4"] == ms[">=2000"] == pytest.approx(100 / 6)
    ns, _, _ = latency_distribution([LatencyRecorder([1] + [5000] * 99_999)])
    assert ns["2"] == 0.01                                 # fio's floor for non-empty buckets


def test_rate_recorder_samples_intervals():
    r = RateRecorder(interval_ns=100)
    r.start(0)
    for t in range(10, 1001, 10):
        r.add(t, 1024 * 10)                                  # 10 KiB every 10 ns
    bw = r.bw
    assert bw.samples == 10 and bw.min == bw.max == 10**9 and bw.stddev == 0.0
    assert r.iops.mean == pytest.approx(1e8)


# --------------------------------------------------------------------------- outputs

def test_json_values_and_our_block():
    rng = np.random.default_rng()
    r = _synthetic_result(rng)
    doc = to_fio_json([r], parse_argv(["--size=4m"]), now=1_700_000_000.5)
    assert doc["timestamp"] == 1_700_000_000 and doc["timestamp_ms"] == 1_700_000_000_500
    assert doc["fio version"].startswith("hicache-gds-bench-") and doc["global options"] == {"size": "4m"}
    j = doc["jobs"][0]
    w = j["write"]
    assert w["bw_bytes"] == r.write.io_bytes * 10**9 // r.write.runtime_ns and w["bw"] == w["bw_bytes"] // 1024
    assert w["runtime"] == r.write.runtime_ns // 10**6 and w["io_kbytes"] == r.write.io_bytes >> 10
    assert w["clat_ns"]["N"] == 4000 and w["bw_samples"] == 6
    assert j["iodepth_level"]["4"] > 99.0 and j["iodepth_submit"]["8"] == 100.0
    assert sum(j["latency_us"].values()) + sum(j["latency_ms"].values()) == pytest.approx(100, abs=0.1)
    ours = j["hicache_gds"]
    assert ours["engine"] == "bounce" and ours["segments"] == [1 << 20, 1 << 20]
    assert ours["ratio_to_raw"] == 0.97 and ours["batch"] == [8]
    assert j["job options"] == {"name": "kv", "rw": "randrw", "batch": "8", "model": "llama3-8b"}
    json.dumps(doc, allow_nan=False)


def test_normal_output_lines():
    rng = np.random.default_rng()
    r = _synthetic_result(rng)
    text = to_fio_normal([r], now=0)
    assert re.search(r"^kv: \(groupid=0, jobs=1\): err= 0: pid=\d+: .+ 19\d\d$", text, re.M)
    assert re.search(r"^  write: IOPS=[\d.]+k?, BW=[\d.]+[KMG]iB/s \([\d.]+[kMG]B/s\)"
                     r"\([\d.]+[KMG]iB/\d+msec\)$", text, re.M)
    for needle in ("    clat (usec): min=", "    slat (", "     lat (usec)",
                   "    clat percentiles (usec):\n     |  1.00th=[", "| 99.99th=[",
                   "   bw (  MiB/s): min=", "   iops        : min=", "  cpu          : usr=",
                   "  IO depths    : 1=0.1%, 2=0.0%, 4=100.0%, 8=0.0%",
                   "     issued rwts: total=4000,4000,0,0 short=0,0,0,0 dropped=0,0,0,0",
                   "  hicache_gds  : engine=bounce, path=O_DIRECT + pinned bounce, "
                   "page=2048KiB x2 seg, batch=8, vs raw=0.97x",
                   "\nRun status group 0 (all jobs):\n   READ: bw=", "\n  WRITE: bw="):
        assert needle in text, needle
    assert "lat (usec)   : " in text


def test_num2str_matches_fio_examples():
    # from fio's documentation and real fio runs
    assert num2str(57118) == "57.1k" and num2str(3625) == "3625"
    assert num2str(9037212, 6) == "9037.2k"
    assert num2str(1900544, pow2=True, unit="B") == "1856KiB"
    assert num2str(467_664_896, pow2=True, unit="B") == "446MiB"
    assert num2str(238_000_000, unit="B/s") == "238MB/s"
    assert num2str(638_000, unit="B/s") == "638kB/s"


def test_render_orders_like_fio_and_parses_back():
    r = _synthetic_result(np.random.default_rng())
    text = render([r], ("normal", "json"))
    doc = parse_fio_json("fio: some warning\n" + text)
    assert doc["jobs"][0]["jobname"] == "kv" and text.index("{") < text.index("Run status group")


def test_parse_fio_json_tolerates_noise_and_fails_clearly():
    doc = {"fio version": "fio-3.33", "jobs": [{"jobname": "x", "error": 0,
                                               "write": {"io_bytes": 4096, "bw_bytes": 10,
                                                         "clat_ns": {"percentile": {"99.000000": 5}}}}]}
    noisy = "fio: this platform lacks ...\nnote: {not json}\n" + json.dumps(doc, indent=1) + "\nDisk stats\n"
    assert parse_fio_json(noisy) == doc
    assert fio_job_summary(doc["jobs"][0])["write"]["clat_p99_ns"] == 5
    with pytest.raises(FioOutputError, match="no fio JSON document.*fio: bad option"):
        parse_fio_json("fio: bad option\n")
    with pytest.raises(ValueError):
        parse_fio_json("")


@needs_fio
def test_fio_argv_runs_real_fio(tmp_path):
    opts = parse_argv(["--name=ref", "--rw=randrw", "--rwmixread=70", "--bs=64k", "--size=1m",
                       f"--filename={tmp_path / 'f'}", "--thread", "--randseed=7", "--direct=0",
                       "--runtime=2s"])
    out = subprocess.run([FIO, *fio_argv(opts)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    s = fio_job_summary(parse_fio_json(out.stdout)["jobs"][0])
    assert s["jobname"] == "ref" and s["error"] == 0
    assert s["read"]["io_bytes"] + s["write"]["io_bytes"] == 1 << 20
