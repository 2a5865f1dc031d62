"""benchmarks/reliability.py --quick, end to end (a few minutes): the script RELIABILITY.md is made
by runs, writes its report, and every case it judges passes. Without this the script rotted once
unnoticed (a name left behind by a clean-up stopped it at its corruption step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# the whole reliability script: ~4.5 min on 2 cores (scripts/test.sh --quick leaves it out)
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_reliability_quick_runs_to_its_report(tmp_path):
    out, raw = tmp_path / "RELIABILITY.md", tmp_path / "rel.json"
    p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "reliability.py"), "--quick",
                        "--gds-path", str(tmp_path / "scratch"), "--out", str(out), "--json", str(raw)],
                       capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-4000:]
    doc = json.loads(raw.read_text())
    bad = [(c["area"], c["name"], c["problems"]) for c in doc["cases"] + doc["integrity"] if not c["ok"]]
    assert not bad, bad
    assert all(r["ok"] and not r["lost"] and not r["wrong"] for r in doc["concurrency"])
    assert all(r["ok"] and not r["acked_lost"] and not r["torn_served"] for r in doc["torture"])
    assert out.read_text().startswith("# Reliability") and "QUICK run" in out.read_text()
    # a --gds-path scratch is the caller's to keep (the suite's fixture removes its slab files)
