"""hicache-gds-bench end to end: short runs of every engine this machine has, the baselines, the
default job, option errors, JSON output, --engine=all, sweeps and plots, and --verify catching a
flipped byte."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from hicache_gds.bench import cli
from hicache_gds.bench.jobfile import parse_jobfile
from hicache_gds.bench.options import expand_sweeps, parse_argv
from hicache_gds.bench.plot import series, summary_table
from hicache_gds.bench.raw import drop_caches, scratch_root
from hicache_gds.bench.runner import Session
from hicache_gds.engines.cufile_env import gpu_present

JOBS = Path(__file__).resolve().parent.parent / "benchmarks" / "jobs"
no_gpu = pytest.mark.skipif(gpu_present(), reason="expects a machine without a GPU (the CPU machine)")
HOST_ENGINES = ["nixl-posix", "bounce"]
TINY = ["--bs=64k", "--batch=4", "--size=1m", "--drop-caches=0", "--fio=0"]


def bench(capsys, *argv):
    """Run the CLI in this process: (exit status, stdout, stderr)."""
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def bench_json(capsys, *argv):
    rc, out, err = bench(capsys, *argv, "--output-format=json")
    return rc, json.loads(out), err


# --------------------------------------------------------------------------- engines

@pytest.mark.parametrize("engine", HOST_ENGINES)
def test_write_then_read_on_each_engine(capsys, gds_dir, engine):
    rc, doc, _ = bench_json(capsys, *TINY, f"--engine={engine}", f"--directory={gds_dir}", "--verify=1")
    assert rc == 0
    write, read = doc["jobs"]
    assert (write["jobname"], read["jobname"]) == ("write", "read")
    assert write["write"]["io_bytes"] == read["read"]["io_bytes"] == 1 << 20
    assert write["write"]["total_ios"] == read["read"]["total_ios"] == 4      # 16 pages / batch 4
    for job in (write, read):
        ours = job["hicache_gds"]
        assert ours["engine"] == engine and ours["engine_requested"] == engine and ours["path"]
        assert ours["page_bytes"] == 65536 and ours["batch"] == [4] and job["error"] == 0
        assert ours["ratio_to_raw"] > 0 and ours["baseline"]["raw"]["queue_depth"] == 4
        assert ours["verify"]["pages"] == 16 and ours["verify"]["failed"] == 0
        assert job["usr_cpu"] >= 0 and sum(job["latency_ms"].values()) + sum(job["latency_us"].values()) > 99
    assert read["hicache_gds"]["prefilled"] is False          # it read what the write job left
    assert read["hicache_gds"]["store"]["hits"] == 16
    assert write["write"]["clat_ns"]["N"] == 4 and "99.000000" in write["write"]["clat_ns"]["percentile"]
    assert os.listdir(gds_dir) == []                          # the session removed its files


def test_default_job_shape():
    jobs, cli_opts, _ = cli.build_jobs([])
    assert [j.rw for j in jobs] == ["write", "read"] and not cli_opts
    for j in jobs:
        assert (j.model, j.block_size, j.geometry.segments) == ("llama3-8b", 2 << 20, (1 << 20, 1 << 20))
        assert (j.batch_size, j.size, j.engine, j.drop_caches, j.direct) == (128, 2 << 30, "auto", True, True)
    (one,) = cli.build_jobs(["--rw=randread", "--bs=4k"])[0]
    assert (one.rw, one.bs, one.model, one.batch_size) == ("randread", (4096,), None, 128)
    assert [j.engine for j in cli.build_jobs(["--engine", "all"])[0]] == ["all", "all"]


@no_gpu
def test_engine_all_runs_every_engine_and_says_why_others_were_skipped(capsys, gds_dir):
    rc, doc, err = bench_json(capsys, *TINY, "--engine=all", f"--directory={gds_dir}", "--rw=write")
    assert rc == 0
    engines = {j["hicache_gds"]["engine"]: j for j in doc["jobs"]}
    assert set(HOST_ENGINES) <= set(engines)
    assert engines["bounce"]["jobname"] == "kv[bounce]"
    skipped = {s["engine"]: s["reason"] for s in doc["hicache_gds"]["skipped"]}
    assert "no CUDA GPU" in skipped["nixl-gds"] and "no CUDA GPU" in skipped["nixl-gds-mt"]
    assert "skipping engine nixl-gds: no CUDA GPU" in err
    assert "nixl-ucx" not in engines and "nixl-ucx" not in skipped  # moves pages to page servers, not files
    # one raw baseline per job point, shared by the engines
    assert len({j["hicache_gds"]["baseline"]["raw"]["write"]["bw_bytes"] for j in doc["jobs"]}) == 1


@no_gpu
def test_a_named_engine_that_cannot_run_is_an_error(capsys, gds_dir):
    rc, _, err = bench(capsys, *TINY, "--engine=nixl-gds", f"--directory={gds_dir}")
    assert rc == 1 and "error: nixl-gds: no CUDA GPU is visible" in err


# --------------------------------------------------------------------------- modes and output

@pytest.mark.slow
def test_randrw_numjobs_iodepth_and_normal_output(capsys, gds_dir):
    rc, out, _ = bench(capsys, "--rw=randrw", "--rwmixread=60", "--bs=64k", "--batch=4", "--size=2m",
                       "--iodepth=2", "--numjobs=2", "--verify=1", "--drop-caches=0", "--fio=0",
                       "--engine=bounce", f"--directory={gds_dir}")
    assert rc == 0
    assert "kv: (groupid=0, jobs=2): err= 0" in out and "  read: IOPS=" in out and "  write: IOPS=" in out
    assert "issued rwts: total=" in out and "  baseline     : raw O_DIRECT qd=16:" in out
    assert "hicache_gds  : engine=bounce, path=O_DIRECT pread/pwrite" in out and "vs raw=" in out
    assert "\nRun status group 0 (all jobs):\n" in out and "x raw" in out       # the summary table


@pytest.mark.slow
def test_numjobs_are_processes_sharing_one_namespace(capsys, gds_dir, tmp_path):
    """fio's numjobs: every job is a process with its own PageStore on the one namespace; written
    pages are verified by the runner's process, time-based jobs loop on their own."""
    job = tmp_path / "nj.fio"
    job.write_text("[global]\nbs=64k\nbatch=4\nsize=1m\niodepth=2\nnumjobs=3\nverify=1\nfio=0\n"
                   "drop-caches=0\nengine=bounce\n[w]\nrw=write\n[r]\nrw=read\n"
                   "[tw]\nrw=write\ntime_based=1\nruntime=1\n[tr]\nrw=read\ntime_based=1\nruntime=1\n")
    rc, doc, _ = bench_json(capsys, str(job), f"--directory={gds_dir}")
    assert rc == 0, [(j["jobname"], j["error_text"]) for j in doc["jobs"]]
    assert [j["jobname"] for j in doc["jobs"]] == ["w", "r", "tw", "tr"]
    w, r, tw, tr = doc["jobs"]
    for j in doc["jobs"]:
        assert j["error"] == 0 and j["hicache_gds"]["verify"]["failed"] == 0, j["hicache_gds"]["verify"]
        assert j["hicache_gds"]["threads"] == 6 and j["hicache_gds"]["pages"] == 3 * 16
    # the three processes' counters add up: each wrote (and read) its own 16 pages once
    assert w["hicache_gds"]["store"]["pages_written"] == 48 and w["write"]["total_ios"] == 12
    assert r["hicache_gds"]["store"]["pages_read"] == 48 and r["hicache_gds"]["store"]["misses"] == 0
    assert tw["hicache_gds"]["passes"] >= 1 and tr["hicache_gds"]["store"]["misses"] == 0
    assert tw["hicache_gds"]["verify"]["pages"] > 0 and tr["hicache_gds"]["verify"]["pages"] == 48


def test_time_based_ramp_and_layer_first_pages(capsys, gds_dir):
    rc, doc, _ = bench_json(capsys, "--model=llama3-8b", "--page-tokens=16", "--layout=layer_first",
                            "--batch=2", "--size=8m", "--rw=randwrite", "--time_based", "--runtime=1",
                            "--ramp_time=200ms", "--raw=0", "--fio=0", "--mem=pageable", "--verify=1",
                            "--engine=nixl-posix", f"--directory={gds_dir}")
    (job,) = doc["jobs"]
    ours = job["hicache_gds"]
    assert rc == 0 and job["error"] == 0 and len(ours["segments"]) == 64
    assert ours["passes"] > 1 and ours["store"]["staged_pages"] > 0      # 32 KiB segments are gathered
    assert 800 <= job["write"]["runtime"] <= 1500 and ours["ratio_to_raw"] is None
    assert ours["verify"]["failed"] == 0 and ours["verify"]["pages"] > 0


def test_sweep_plot_and_table(capsys, gds_dir, tmp_path):
    pytest.importorskip("matplotlib")  # --plot needs the [plot] extra
    png = tmp_path / "bw.png"
    rc, doc, _ = bench_json(capsys, "--bs=64k,128k", "--batch=2,4", "--size=512k", "--rw=write", "--fio=0",
                            "--engine=bounce", f"--directory={gds_dir}", f"--plot={png}")
    assert rc == 0 and len(doc["jobs"]) == 4
    assert [j["jobname"] for j in doc["jobs"]][:2] == ["kv-bs64k-batch2", "kv-bs64k-batch4"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not on PATH")
def test_fio_reference_and_ratios(capsys, gds_dir):
    rc, doc, _ = bench_json(capsys, "--bs=128k", "--batch=8", "--size=2m", "--rw=read", "--drop-caches=0",
                            "--engine=nixl-posix", f"--directory={gds_dir}")
    ours = doc["jobs"][0]["hicache_gds"]
    fio = ours["baseline"]["fio"]
    assert rc == 0 and fio["error"] == 0 and fio["ioengine"] == "libaio" and fio["iodepth"] == 8
    assert fio["read"]["io_bytes"] == 2 << 20 and fio["bs"] == 128 << 10
    assert ours["ratio_to_fio"] > 0 and ours["ratios"]["read_vs_raw"] > 0 and ours["prefilled"] is True


# --------------------------------------------------------------------------- verify

def _flip_a_byte(store, keys):
    entry = store.index.lookup_pin([keys[3]])[0]
    store.index.unpin([entry.slot])
    off = (entry.slot // len(store.dirs)) * store.slot_bytes + 1000
    fd = os.open(store.slabs.paths[entry.slot % len(store.dirs)], os.O_RDWR)
    try:
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ 0x40]), off)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("store_checksums", [True, False])
def test_verify_reports_a_flipped_byte(gds_dir, monkeypatch, store_checksums):
    if not store_checksums:
        monkeypatch.setenv("HICACHE_GDS_VERIFY", "0")     # the store returns the bad bytes: we compare
    opts = parse_argv([*TINY, "--rw=write", "--verify=1", f"--directory={gds_dir}"])
    with Session() as s:
        (r,) = s.run(opts, ["nixl-posix"], strict=True, before_verify=_flip_a_byte)
    v = r.hicache_gds["verify"]
    assert r.error == 84 and v["failed"] == 1 and v["pages"] == 16
    assert (v["unreadable"], v["mismatched"]) == ((1, 0) if store_checksums else (0, 1))
    assert "verify: 1 of 16 page(s) bad" in r.error_text and v["bad_keys"] == ["c0.g0.3"]
    from hicache_gds.bench.report import to_fio_normal
    assert "err=84 (verify: 1 of 16 page(s) bad" in to_fio_normal([r])


@pytest.mark.slow
def test_racing_jobs_report_evicted_pages_and_still_catch_wrong_bytes(gds_dir):
    """numjobs that loop on their own evict one another's pages (LRU): a job whose last pass ended
    first may lose part of it before the verify. Pages gone are reported as evicted (as many as
    the store evicted during the run), while a page that is there with a wrong byte still fails."""
    opts = parse_argv(["--bs=64k", "--size=1m", "--batch=4", "--iodepth=2", "--numjobs=2", "--rw=write",
                       "--time_based", "--runtime=1", "--verify=1", "--fio=0", "--raw=0", "--drop-caches=0",
                       "--engine=bounce", f"--directory={gds_dir}"])

    def evict_three_and_flip_one(store, keys):
        there = [k for k, p in zip(keys, store.exists(keys)) if p]   # the loops may have evicted some
        assert store.delete(there[:3]) == [True] * 3    # what another job's later writes would do
        _flip_a_byte(store, there[3:])

    with Session() as s:
        (r,) = s.run(opts, ["bounce"], strict=True, before_verify=evict_three_and_flip_one)
    v = r.hicache_gds["verify"]
    assert r.hicache_gds["store"]["evictions"] >= 3           # the loops evicted: a race was possible
    assert v["evicted"] >= 3 and v["failed"] == 1 and 0 < v["pages"] <= 2 * 16 - 3 and r.error == 84


# --------------------------------------------------------------------------- errors and places

@pytest.mark.parametrize("argv,rc,needle", [
    (["--rw=reed"], 2, "--rw: 'reed' is not one of read, write"),
    (["--engine=warp", "--bs=64k", "--size=1m"], 2, "--engine: unknown engine 'warp'"),
    (["--bs=64k", "--size=1k"], 2, "--size: 1024 bytes hold no page of 65536 bytes"),
    (["--bs=64k", "--size=1m", "--time_based"], 2, "--time_based needs --runtime"),
    (["no-such-job.fio"], 2, "no-such-job.fio: cannot read job file"),
    (["-x"], 2, "unknown option '-x'"),
    (["--directory=/nonexistent-dir", "--bs=64k", "--size=1m"], 2, "/nonexistent-dir is not a directory"),
])
def test_option_errors(capsys, argv, rc, needle):
    code, out, err = bench(capsys, *argv)
    assert code == rc and needle in err and not out


def test_help_version_and_argv_splitting(capsys, tmp_path):
    assert bench(capsys, "--help")[0] == 0
    job = tmp_path / "j.fio"
    job.write_text("[a]\nrw=write\n")
    files, opts, _ = cli.split_argv(["--engine", "all", "--verify", str(job), "--time_based", "--output", "o"])
    assert files == [str(job)] and opts == ["--engine=all", "--verify", "--time_based", "--output=o"]


def test_gds_path_and_scratch_directory(capsys, gds_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("GDS_PATH", gds_dir)
    rc, doc, _ = bench_json(capsys, *TINY, "--rw=write", "--engine=bounce", "--raw=0")
    assert rc == 0 and doc["hicache_gds"]["directories"][0].startswith(os.path.realpath(gds_dir) + "/")
    assert os.listdir(gds_dir) == []
    monkeypatch.setenv("TMPDIR", "/proc")                     # not writable: skipped
    monkeypatch.chdir(tmp_path)
    assert scratch_root() == os.path.realpath(tmp_path)


def test_drop_caches_without_root_uses_fadvise(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x" * 8192)
    assert drop_caches([str(f), str(tmp_path / "missing")], use_proc=False) == \
        "posix_fadvise(DONTNEED) on 1 file(s)"


def test_job_files_in_the_repository_parse():
    jobs = parse_jobfile(JOBS / "pagestore-vs-raw.fio")
    points = [p for j in jobs for p in expand_sweeps(j)]
    assert len(points) == 8 and {p.engine for p in points} == {"nixl-posix,bounce"}
    assert {(p.block_size, p.batch_size) for p in points} == {(b << 20, n) for b in (2, 8) for n in (64, 128)}
    assert [j.rw for j in jobs] == ["write", "read"] and all(j.drop_caches for j in jobs)
    eng = parse_jobfile(JOBS / "engines.fio")
    assert {j.engine for j in eng} == {"all"} and {j.mem for j in eng} == {"vram", "pinned"}


def test_series_and_table_on_results(gds_dir):
    opts = parse_argv([*TINY, "--rw=write", f"--directory={gds_dir}"])
    with Session() as s:
        results = s.run(opts, ["bounce"], strict=True)
    assert "bounce" in summary_table(results)
    data = series(results)
    assert set(data) == {("bounce", "write", 4), ("raw", "write", 4)}
    assert data[("bounce", "write", 4)][0][0] == 65536


@pytest.mark.gpu
def test_vram_pages_on_every_engine(capsys, gds_dir):
    """GPU machine: device pages through every engine that moves VRAM, verified byte for byte."""
    rc, doc, _ = bench_json(capsys, "--engine=all", "--mem=vram", "--bs=1m", "--batch=16", "--size=32m",
                            "--verify=1", "--drop-caches=0", f"--directory={gds_dir}")
    assert rc == 0
    ran = {j["hicache_gds"]["engine"] for j in doc["jobs"]}
    assert {"nixl-gds", "nixl-gds-mt", "bounce"} <= ran
    assert all(j["error"] == 0 and j["hicache_gds"]["verify"]["failed"] == 0 for j in doc["jobs"])
    skipped = {s["engine"]: s["reason"] for s in doc["hicache_gds"]["skipped"]}
    assert "VRAM" in skipped["nixl-posix"]
    gds = [j for j in doc["jobs"] if j["hicache_gds"]["engine"] == "nixl-gds"][0]["hicache_gds"]
    assert gds["gpu_direct"] and ("compat mode" in gds["path"] or "GPUDirect" in gds["path"])
