"""hicache-gds-bench options and job files: fio's syntax, our KV-page options, sweeps, errors."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_gds.bench.jobfile import JobFileError, parse_jobfile, parse_jobfile_text
from hicache_gds.bench.options import (
    JobOptions, OptionError, PageGeometry, expand_sweeps, format_size, merge, page_geometry,
    parse_argv, parse_size, parse_time,
)
from hicache_gds.bench.report import fio_argv
from hicache_gds.errors import ConfigError

FIO = shutil.which("fio")
needs_fio = pytest.mark.skipif(FIO is None, reason="fio is not on PATH (apt-get install fio)")


def _err(argv) -> OptionError:
    with pytest.raises(OptionError) as e:
        parse_argv(argv)
    return e.value


# --------------------------------------------------------------------------- values

# fio 3.33 and master with the default kb_base=1024 ("compatibility mode"): SI-looking suffixes are
# powers of 2, IEC spellings powers of 10 -- and `mi` without `b` is still 2**20.
SIZES = {"4096": 4096, "4k": 4096, "4K": 4096, "4kb": 4096, "4kB": 4096, "4KB": 4096,
         "1m": 1 << 20, "1MB": 1 << 20, "1mi": 1 << 20, "1g": 1 << 30, "2t": 2 << 40,
         "4KiB": 4000, "1MiB": 1_000_000, "2KiB": 2000, "0x1000": 4096, "512b": 512, "3k": 3072}


@pytest.mark.parametrize("text,expected", sorted(SIZES.items()))
def test_sizes_follow_fio(text, expected):
    assert parse_size(text) == expected


@needs_fio
@pytest.mark.parametrize("text", ["4k", "4kB", "4KiB", "1MiB", "1mi", "0x1000", "3k", "1KB"])
def test_sizes_agree_with_real_fio(text):
    out = subprocess.run([FIO, "--name=t", "--ioengine=null", f"--size={text}", f"--bs={text}",
                          "--rw=write", "--output-format=json"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert json.loads(out[out.index("{"):])["jobs"][0]["write"]["io_bytes"] == parse_size(text)


def test_kb_base_1000_gives_standard_meanings():
    assert parse_size("4KiB", kb_base=1000) == 4096
    assert parse_size("4k", kb_base=1000) == 4000
    assert parse_argv(["--kb_base=1000", "--bs=2MiB"]).bs == (2 << 20,)


@given(st.integers(min_value=1, max_value=1 << 50))
def test_format_size_round_trips(n):
    assert parse_size(format_size(n)) == n


@pytest.mark.parametrize("bad", ["4x", "1.5m", "0x10k", "k", "", "-4k", "50%"])
def test_bad_sizes_name_the_option(bad):
    e = _err([f"--size={bad}"])
    assert e.option == "size" and str(e).startswith("--size: ")
    assert "50%" not in bad or "percentages" in str(e)


def test_times():
    assert parse_time("30") == 30.0
    assert parse_time("500ms") == 0.5
    assert parse_time("2m") == 120.0
    assert parse_time("1h") == 3600.0
    assert parse_time("250us") == pytest.approx(250e-6)
    e = _err(["--runtime=10x"])
    assert str(e).startswith("--runtime: '10x' is not a duration") and "500ms" in str(e)


def test_bools_and_bare_flags():
    o = parse_argv(["--time_based", "--direct=0", "--drop-caches=yes", "--raw=off"])
    assert (o.time_based, o.direct, o.drop_caches, o.raw) == (True, False, True, False)
    assert parse_argv(["--buffered=1"]).direct is False
    assert parse_argv([]).fio is None and parse_argv(["--fio=0"]).fio is False
    assert str(_err(["--direct=maybe"])) == "--direct: 'maybe' is not a boolean; use 1 or 0"


# --------------------------------------------------------------------------- options

def test_rw_error_message_lists_accepted_values():
    e = _err(["--rw=reed"])
    assert str(e) == "--rw: 'reed' is not one of read, write, randread, randwrite, randrw"
    assert isinstance(e, ValueError) and isinstance(e, ConfigError) and e.option == "rw"


@pytest.mark.parametrize("argv,needle", [
    (["--mem=gpu"], "--mem: 'gpu' is not one of vram, pinned, pageable"),
    (["--layout=flat"], "--layout: 'flat' is not one of page_first, page_first_direct, layer_first"),
    (["--output-format=terse"], "--output-format: 'terse' is not one of normal, json, json+"),
    (["--model=gpt5"], "--model: 'gpt5' is not one of llama3-8b, llama3-70b-tp8, deepseek-v3"),
    (["--rwmixread=101"], "--rwmixread: '101' is not an integer from 0 to 100"),
    (["--iodepth=0"], "--iodepth: '0' is not an integer at least 1"),
    (["--batch=4,0"], "--batch: '0' is not an integer at least 1"),
    (["--engine="], "--engine: '' is not an engine name"),
    (["--verify=sha999"], "--verify: 'sha999' is not one of 0, 1, md5"),
    (["--percentile_list=50:101"], "--percentile_list: '50:101' is not 1 to 20"),
    (["--blocksz=4k"], "unknown option --blocksz (did you mean --blocksize?)"),
    (["--page-tokenz=4"], "unknown option --page-tokenz (did you mean --page-tokens?)"),
    (["job.fio"], "unexpected argument 'job.fio'"),
])
def test_bad_values_have_clear_messages(argv, needle):
    assert needle in str(_err(argv))


def test_defaults_and_fio_spellings():
    o = parse_argv(["--name=x", "--readwrite=randrw", "--rwmixwrite=30", "--blocksize=64k",
                    "--ioengine=nixl-gds", "--size", "4m", "--output-format=json,json+,json",
                    "--iomem=cudamalloc", "--verify=crc32c", "--randseed=0x10"])
    assert (o.rw, o.rwmixread, o.bs, o.engine, o.size) == ("randrw", 70, (65536,), "nixl-gds", 4 << 20)
    assert o.output_format == ("json", "json+") and o.mem == "vram" and o.verify == "xxh3"
    assert o.randseed == 16
    d = JobOptions()
    assert (d.rw, d.bs, d.iodepth, d.direct, d.raw, d.fio, d.page_tokens) == \
        ("read", (4096,), 1, True, True, None, 16)
    assert parse_argv(["--verify=0"]).verify is None and parse_argv(["--verify=1"]).verify == "xxh3"


def test_later_values_win():
    assert parse_argv(["--bs=4k", "--blocksize=8k", "--bs=16k"]).bs == (16384,)
    assert parse_argv(["--rw=write", "--rw=read"]).rw == "read"


def test_fio_passthrough_keeps_known_fio_options():
    o = parse_argv(["--thread", "--group_reporting", "--nrfiles=4"])
    assert dict(o.fio_passthrough) == {"thread": None, "group_reporting": None, "nrfiles": "4"}
    assert "--nrfiles=4" in fio_argv(o) and "--thread" in fio_argv(o)
    assert dict(parse_argv(["--bogus=1"], strict=False).fio_passthrough) == {"bogus": "1"}


def test_direct_construction_is_validated():
    with pytest.raises(OptionError, match="--rw: 'x' is not one of"):
        JobOptions(rw="x")
    with pytest.raises(OptionError, match="--iodepth"):
        JobOptions(iodepth=0)


# --------------------------------------------------------------------------- models and pages

def test_llama3_8b_page_is_2mib():
    g = page_geometry("llama3-8b", 16)
    assert g == PageGeometry(2 << 20, (1 << 20, 1 << 20))
    lf = page_geometry("llama3-8b", 16, "layer_first")
    assert lf.page_bytes == 2 << 20 and lf.segments == (32768,) * 64
    o = parse_argv(["--model=llama3-8b"])
    assert o.bs == (2 << 20,) and o.geometry == g


@pytest.mark.parametrize("model,tokens,layout,page,nseg", [
    ("llama3-70b-tp8", 16, "page_first", 2 * 80 * 1 * 128 * 16 * 2, 2),
    ("llama3-70b-tp8", 64, "layer_first", 2 * 80 * 1 * 128 * 64 * 2, 160),
    ("deepseek-v3", 16, "page_first", 61 * 576 * 16 * 2, 1),
    ("deepseek-v3", 64, "layer_first", 61 * 576 * 64 * 2, 61),
    ("deepseek-v3", 64, "page_first_direct", 61 * 576 * 64 * 2, 1),
])
def test_model_geometries(model, tokens, layout, page, nseg):
    g = page_geometry(model, tokens, layout)
    assert (g.page_bytes, len(g.segments), sum(g.segments)) == (page, nseg, page)
    assert len(set(g.segments)) == 1


def test_geometry_agrees_with_core_layout():
    layout = pytest.importorskip("hicache_gds.layout")
    assert page_geometry("llama3-8b", 64).page_bytes == layout.page_bytes_for(
        "mha", 32, 64, 2, head_num=8, head_dim=128)
    assert page_geometry("deepseek-v3", 64).page_bytes == layout.page_bytes_for(
        "mla", 61, 64, 2, kv_cache_dim=576)


def test_model_and_bs_conflict_and_later_source_wins():
    e = _err(["--model=llama3-8b", "--bs=4k"])
    assert e.option == "bs" and "conflicts with --model=llama3-8b" in str(e) and "2097152" in str(e)
    m = parse_argv(["--model=llama3-8b", "--page-tokens=32"])
    assert merge(m, {"bs": "4k"}).bs == (4096,) and merge(m, {"bs": "4k"}).model is None
    assert merge(parse_argv(["--bs=4k"]), {"model": "deepseek-v3"}).bs == (1124352,)
    assert merge(m, {"--page-tokens": "64"}).bs == (8 << 20,)


# --------------------------------------------------------------------------- sweeps

@settings(max_examples=50)
@given(st.lists(st.integers(1, 1 << 24), min_size=1, max_size=5, unique=True),
       st.lists(st.integers(1, 512), min_size=1, max_size=5, unique=True))
def test_expand_sweeps_is_the_cartesian_product(bss, batches):
    o = parse_argv(["--name=s", "--bs=" + ",".join(map(str, bss)),
                    "--batch=" + ",".join(map(str, batches))])
    jobs = expand_sweeps(o)
    assert [(j.block_size, j.batch_size) for j in jobs] == [(b, n) for b in bss for n in batches]
    assert all(not j.is_sweep and j.rw == o.rw for j in jobs)
    if o.is_sweep:
        assert len({j.name for j in jobs}) == len(jobs)
        with pytest.raises(OptionError, match="expand_sweeps"):
            o.block_size if len(bss) > 1 else o.batch_size
    else:
        assert jobs == [o]


def test_sweep_names_and_fio_options():
    jobs = expand_sweeps(parse_argv(["--name=kv", "--bs=4k,2m", "--batch=1,64"]))
    assert [j.name for j in jobs] == ["kv-bs4k-batch1", "kv-bs4k-batch64", "kv-bs2m-batch1",
                                      "kv-bs2m-batch64"]
    assert jobs[3].fio_options() == {"name": "kv-bs2m-batch64", "bs": "2m", "batch": "64"}


# --------------------------------------------------------------------------- job files

JOBFILE = """\
; a comment
# another comment
[global]
size=4m          ; inline comment, cut like fio
bs=4k
bs=64k
direct
engine=${BENCH_ENGINE}
directory=/tmp/${UNSET_VARIABLE_XYZ}

[first]
rw=write
time_based
runtime=2

[second]
rw = randread
bs=${BS}
name=renamed

[global]
iodepth=8

[third]
model=llama3-8b
batch=4,8
"""


def test_jobfile_global_inheritance_env_and_flags():
    env = {"BENCH_ENGINE": "bounce", "BS": "16k"}
    first, second, third = parse_jobfile_text(JOBFILE, env=env)
    assert (first.name, first.rw, first.bs, first.size) == ("first", "write", (65536,), 4 << 20)
    assert first.time_based and first.runtime == 2.0 and first.direct and first.engine == "bounce"
    assert first.directory == "/tmp/" and first.iodepth == 1
    assert (second.name, second.rw, second.bs) == ("renamed", "randread", (16384,))
    assert second.iodepth == 1                          # a later [global] only affects later jobs
    assert third.iodepth == 8 and third.bs == (2 << 20,) and third.batch == (4, 8)


def test_jobfile_overrides_sections_and_include(tmp_path):
    (tmp_path / "common.inc").write_text("rw=randwrite\niodepth=$ncpus\n")
    f = tmp_path / "kv.fio"
    f.write_text("[global]\nbs=8k\n[a]\ninclude common.inc\n[b]\nrw=read\n")
    a, b = parse_jobfile(f, overrides={"--engine": "null", "iodepth": "2"})
    assert (a.rw, a.bs, a.engine, a.iodepth) == ("randwrite", (8192,), "null", 2)
    assert (b.rw, b.engine) == ("read", "null")
    (only_b,) = parse_jobfile(f, sections=["b"])
    assert only_b.name == "b"


@pytest.mark.parametrize("text,needle", [
    ("bs=4k\n[a]\n", "<string>:1: option 'bs=4k' outside of a [] job section"),
    ("[a]\nrw=reed\n", "<string>:2: [a] --rw: 'reed' is not one of read, write"),
    ("[global]\nbs=4x\n[a]\nrw=read\n", "<string>:2: [a] --bs: '4x' is not a size"),
    ("[a\nrw=read\n", "<string>:1: malformed section header '[a'"),
    ("[a]\nrw=read\n\nblocksz=4k\n", "<string>:4: [a] unknown option --blocksz (did you mean"),
    ("[global]\nbs=4k\n", "<string>: no job sections"),
    ("[a]\ninclude nope.inc\n", "<string>:2: cannot read include file 'nope.inc'"),
])
def test_jobfile_errors_name_file_and_line(text, needle):
    with pytest.raises(JobFileError) as e:
        parse_jobfile_text(text, env={})
    assert needle in str(e.value)
    assert isinstance(e.value, OptionError)


@needs_fio
def test_jobfile_means_what_fio_means(tmp_path):
    """The same job file through real fio (null engine): each job's block size and direction."""
    text = ("[global]\nioengine=null\nsize=256k\nbs=4k\nbs=${BSZ}   ; last one wins\n"
            "# comment\n[w]\nrw=write\n[r]\nrw=randread\nbs=8KiB\n[global]\nbs=2k\n[late]\n"
            "rw=write\n")
    f = tmp_path / "t.fio"
    f.write_text(text)
    out = subprocess.run([FIO, str(f), "--output-format=json"], capture_output=True, text=True,
                         env={"BSZ": "16k", "PATH": "/usr/bin:/bin"}, timeout=60, check=True).stdout
    fio_jobs = json.loads(out[out.index("{"):])["jobs"]
    ours = parse_jobfile(f, env={"BSZ": "16k"})
    assert [j["jobname"] for j in fio_jobs] == [o.name for o in ours]
    for fj, o in zip(fio_jobs, ours):
        ddir = "read" if "read" in o.rw else "write"
        assert fj[ddir]["io_bytes"] // fj[ddir]["total_ios"] == o.block_size
        assert fj[ddir]["io_bytes"] == o.size // o.block_size * o.block_size   # 8KiB = 8000
