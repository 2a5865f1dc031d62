"""When L3 pays (`hicache_gds.tools.breakeven`): the measured read rate of GDS_PATH, a model's KV per token,
and `hicache-gds doctor`'s section on it."""

from __future__ import annotations

import json
import os

import pytest

from hicache_gds import cli
from hicache_gds.probe import probe_dir as probe_read_rate
from hicache_gds.tools.breakeven import kv_bytes_per_token, render, section

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_probe_reads_back_with_o_direct_and_leaves_nothing(gds_dir):
    p = probe_read_rate(gds_dir, 16 << 20, chunk=4 << 20, threads=2)
    assert p["bytes"] == 16 << 20 and p["read_bytes_per_s"] > 0 and p["write_bytes_per_s"] > 0
    assert os.listdir(gds_dir) == []


def test_probe_of_a_directory_it_cannot_write_says_why(tmp_path):
    assert "error" in probe_read_rate(str(tmp_path / "missing"), 1 << 20)


@pytest.mark.parametrize("shape,kv", [("llama3-8b-shape", 128 << 10), ("llama-32b-shape", 256 << 10),
                                      ("deepseek-v3-shape", 61 * (512 + 64) * 2)])  # MLA: one latent per layer
def test_kv_bytes_per_token_from_the_benchmark_shapes(shape, kv):
    d = os.path.join(REPO, "benchmarks", "e2e", shape)
    assert kv_bytes_per_token(d) == (shape, kv)
    assert kv_bytes_per_token(os.path.join(d, "config.json"))[1] == kv


def test_a_config_without_the_geometry_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(ValueError, match="num_attention_heads"):
        kv_bytes_per_token(str(tmp_path))


def test_section_gives_the_breakeven_prefill_rate(gds_dir):
    sec = section([gds_dir], 8, kv=256 << 10)
    r = sec["read_bytes_per_s"]
    assert r > 0 and sec["models"][0]["breakeven_prefill_tokens_per_s"] == pytest.approx(r / (256 << 10))
    text = render(sec)
    assert "GB/s O_DIRECT read" in text and "256 KiB of KV per token" in text and "tokens/s" in text
    common = section([gds_dir], 0)
    assert len(common["models"]) == 3 and "not measured" in render(common)


def test_doctor_prints_when_l3_pays(capsys, monkeypatch, gds_dir):
    monkeypatch.setenv("GDS_PATH", gds_dir)
    model = os.path.join(REPO, "benchmarks", "e2e", "llama-32b-shape")
    cli.main(["doctor", "--read-probe-mib", "8", "--model", model])
    out = capsys.readouterr().out
    assert "read rate    : " + gds_dir in out and "L3 pays      : llama-32b-shape (256 KiB" in out
    cli.main(["doctor", "--json", "--read-probe-mib", "8", "--kv-bytes-per-token", "131072"])
    rep = json.loads(capsys.readouterr().out)
    assert rep["l3_pays"]["models"][0]["kv_bytes_per_token"] == 131072
    assert rep["l3_pays"]["read_bytes_per_s"] > 0 and os.listdir(gds_dir) == []
