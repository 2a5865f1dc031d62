"""benchmarks/plot_breakeven.py: the README's break-even chart, drawn from the cost model's curves."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

from hicache_gds.costmodel import breakeven_prefill_rate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pb():
    spec = importlib.util.spec_from_file_location("plot_breakeven", os.path.join(REPO, "benchmarks", "plot_breakeven.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_split_is_never_slower_than_recompute_or_load(pb):
    c = pb.curves(pb.Rates(), range(1024, 32769, 1024))
    assert c.load.shape == c.split.shape == (2, 32)
    best = np.minimum(c.recompute[None, :], c.load)
    assert (c.split <= best + 1e-12).all()
    # with the default rates a split pays on long prompts at both read rates, with a head to compute
    assert (c.split[:, -1] < 0.9 * best[:, -1]).all() and (c.split_head[:, -1] > 0).all()
    assert (c.load[1] < c.load[0]).all()  # the faster disk loads sooner
    assert (np.diff(c.recompute) > 0).all() and (np.diff(c.load, axis=1) > 0).all()


@pytest.mark.parametrize("gbps", [1.6, 4.0])
def test_a_flat_prefill_rate_crosses_where_the_breakeven_rule_says(pb, gbps):
    kv = 128 << 10
    p = 20000.0
    rates = pb.Rates((1.0 / p, 0.0, 0.0), kv, (gbps,), 64, "flat")
    c = pb.curves(rates, range(1024, 16385, 1024))
    load_pays = p < breakeven_prefill_rate(gbps * 1e9, kv)
    assert ((c.load[0] < c.recompute) == load_pays).all()
    # a flat rate has no attention term: load and recompute are straight lines through the suffix
    assert c.recompute == pytest.approx((c.lengths + 64) / p)
    assert c.load[0] == pytest.approx(c.lengths * kv / (gbps * 1e9) + 64 / p)


def test_the_script_writes_its_png(pb, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "be.png"
    c = pb.main(["--out", str(out), "--step", "2048", "--max-tokens", "16384"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert len(c.lengths) == 8 and (c.split <= np.minimum(c.recompute, c.load) + 1e-12).all()
    text = capsys.readouterr().out
    assert "1.6 GB/s:" in text and f"wrote {out}" in text
    out2 = tmp_path / "32b.png"
    pb.main(["--out", str(out2), "--model", os.path.join(REPO, "benchmarks", "e2e", "llama-32b-shape"),
             "--prefill-tokens-per-s", "6000", "--read-gbps", "1.6", "--max-tokens", "4096"])
    assert out2.stat().st_size > 10_000
