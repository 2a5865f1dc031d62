"""When loading a prefix from the tier beats recomputing it: TTFT against prompt length.

    python benchmarks/plot_breakeven.py                       # benchmarks/breakeven.png, defaults below
    python benchmarks/plot_breakeven.py --read-gbps 1.6,4,12 --kv-bytes-per-token 262144 \
        --prefill-coefficients 0,1.45e-8,0.54 --out /tmp/32b.png
    python benchmarks/plot_breakeven.py --prefill-tokens-per-s 20000   # a flat rate, no attention term

Three curves per read rate, for a revisit of an ``n``-token prefix that is all in the tier, plus a
``--suffix`` of new tokens, one request alone, all of them forecast by the product's own cost
model (`hicache_gds.costmodel.CostModel`, seeded with the rates given):

* **recompute**: ``C(n + s, 0)``;
* **load**: ``L(n) + C(s, n)`` with ``L(h) = h * B / R``;
* **split**: the GPU computes a head of ``k`` tokens while the disk loads the other ``n - k``;
  the suffix starts when both are done: ``min over k of max(C(k, 0), L(n - k)) + C(s, n)``, with
  ``k = n`` meaning recompute and ``k = 0`` load, so it is never above either. This is the ideal
  split (any head, the GPU waiting for the tail); SGLang's own joins at chunk boundaries take
  less of it (``CostModel.split``, benchmarks/RESULTS.md).

``C(n, p) = a*n + b*n*(p + n/2) + c`` is the cost model's prefill formula. The defaults are
measured: ``a, b, c`` least-squares fitted (by `PrefillModel`) on the recompute TTFTs of an H200
serving the Llama-3-8B shape, SGLang 0.5.17 (RESULTS.md, run 14: 16 revisits of 10k-27k tokens;
run 13's 8 give the same ``b`` within 1 %); 128 KiB of KV per token; read rates 1.6 GB/s (the
H200's virtio disk, raw O_DIRECT read 1.46-1.95 GB/s in runs 12-13) and 4.0 GB/s (the RAM-backed
device of run 14, 4.0-4.3 GB/s). Beyond ~27k tokens the fit is an extrapolation.

Needs matplotlib (``pip install 'hicache-gds[plot]'``) for the figure only; `curves` does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hicache_gds.costmodel import CostModel, PrefillModel, ReadRate, breakeven_prefill_rate

__all__ = ["Rates", "Curves", "curves", "measured_points", "plot", "main", "DEFAULT_COEFFICIENTS"]

# (a, b, c) fitted on run 14's recompute TTFTs (H200, Llama-3-8B shape, SGLang 0.5.17):
# PrefillModel().observe([n], [0], ttft) per revisit, then .coefficients(); run 13's 8 revisits
# give b 4.80e-9, c 0.109. `a` came out 0: over 10k-27k tokens the fit cannot tell a per-token
# term from the constant and attention, so below ~8k tokens the recompute curve is a guess.
DEFAULT_COEFFICIENTS = (0.0, 4.8169e-9, 0.12409)
DEFAULT_SOURCE = "H200, Llama-3-8B shape, fit on 16 recompute TTFTs of 10k-27k tokens (RESULTS run 14)"
DEFAULT_KV = 128 << 10
DEFAULT_READ_GBPS = (1.6, 4.0)
DEFAULT_DISK_NAMES = {1.6: "virtio disk", 4.0: "RAM device"}
RUN14 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu-h200-fast-device-run14", "call2",
                     "suite-llama3-8b-shape.json")


@dataclass(frozen=True)
class Rates:
    """The measured inputs: prefill coefficients (a, b, c) and KV bytes per token of one model
    shape, and one or more read rates in GB/s (1e9 bytes/s)."""

    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS
    kv_bytes_per_token: int = DEFAULT_KV
    read_gbps: tuple[float, ...] = DEFAULT_READ_GBPS
    suffix: int = 64
    source: str = DEFAULT_SOURCE

    def model(self, read_gbps: float) -> CostModel:
        """The product's cost model with these rates as its seeds (nothing observed)."""
        pm = PrefillModel()
        pm.seed_coefficients(*self.coefficients, self.source)
        return CostModel(self.kv_bytes_per_token, read=ReadRate(read_gbps * 1e9, "given"), prefill=pm)


@dataclass(frozen=True)
class Curves:
    """TTFT in seconds per prompt length (`lengths`, the prefix in the tier); `load`, `split`
    and `split_head` (the head the best split computes) have one row per read rate."""

    lengths: np.ndarray
    recompute: np.ndarray
    load: np.ndarray
    split: np.ndarray
    split_head: np.ndarray
    read_gbps: tuple[float, ...]


def curves(rates: Rates, lengths: Sequence[int], step: int = 64) -> Curves:
    """The three TTFT curves (module docstring) at each length; split heads are tried every
    `step` tokens (a page of 64 by default)."""
    lengths = np.asarray(sorted(int(n) for n in lengths), dtype=np.int64)
    s = int(rates.suffix)
    B = float(rates.kv_bytes_per_token)
    cm0 = rates.model(rates.read_gbps[0])
    rec = np.array([cm0.predict_compute(int(n) + s, 0) for n in lengths])
    load = np.empty((len(rates.read_gbps), len(lengths)))
    split = np.empty_like(load)
    head = np.zeros(load.shape, dtype=np.int64)
    for i, gbps in enumerate(rates.read_gbps):
        cm = rates.model(gbps)
        for j, n in enumerate(lengths):
            n = int(n)
            after = cm.predict_compute(s, n)  # the suffix, attending to the whole prefix
            load[i, j] = cm.predict_load(n * B) + after
            best, best_k = min((rec[j], n), (load[i, j], 0))
            for k in range(step, n, step):
                t = max(cm.predict_compute(k, 0), cm.predict_load((n - k) * B)) + after
                if t < best:
                    best, best_k = t, k
            split[i, j], head[i, j] = best, best_k
    return Curves(lengths, rec, load, split, head, tuple(rates.read_gbps))


def _disk(gbps: float) -> str:
    name = DEFAULT_DISK_NAMES.get(gbps)
    return f"{gbps:g} GB/s" + (f" ({name})" if name else "")


def _formula(a: float, b: float, c: float) -> str:
    terms = [t for v, t in ((a, f"{a:.3g}n"), (b, f"{b:.3g}n(p+n/2)"), (c, f"{c:.3g}")) if v]
    return " + ".join(terms) or "0"


def measured_points(path: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]], float | None]:
    """(recompute, load) (prompt tokens, TTFT s) of one at a time revisits in a suite's JSON
    (`benchmarks/e2e/suite.py`: configurations `recompute` and `gds-wait_complete`, which loads
    every hit), and the raw O_DIRECT read rate of that run in GB/s."""
    with open(path) as f:
        d = json.load(f)
    rec, load = [], []
    for key, cell in d.get("cells", {}).items():
        parts = key.split("/")
        if parts[0] != "single" or parts[1] not in ("recompute", "gds-wait_complete"):
            continue
        for r in cell.get("results", []):
            if r.get("error") is None and r.get("ttft_s"):
                (rec if parts[1] == "recompute" else load).append((int(r["prompt_tokens"]), float(r["ttft_s"])))
    raw = ((d.get("raw_disk") or {}).get("read") or {}).get("raw_MBps")
    return rec, load, (raw / 1e3 if raw else None)


def plot(c: Curves, rates: Rates, path: str, points: str | None = None) -> str:
    """Draw `c` into `path` (PNG, matplotlib's Agg backend), with a suite's measured TTFTs from
    `points` (`measured_points`) as dots; returns `path`."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("plot_breakeven.py needs matplotlib: pip install 'hicache-gds[plot]'") from exc
    a, b, cc = rates.coefficients
    x = c.lengths / 1024
    fig, ax = plt.subplots(figsize=(8.4, 6.0))
    ax.plot(x, c.recompute, color="black", lw=2, label="recompute")
    for i, gbps in enumerate(c.read_gbps):
        col = plt.get_cmap("tab10")(i)
        ax.plot(x, c.load[i], color=col, ls="--", label=f"load at {_disk(gbps)}")
        ax.plot(x, c.split[i], color=col, lw=2, label=f"split at {_disk(gbps)}")
    if points:
        rec, load, raw = measured_points(points)
        ax.scatter([n / 1024 for n, _ in rec], [t for _, t in rec], color="black", s=14, zorder=3,
                   label="recompute, measured")
        if load:
            ax.scatter([n / 1024 for n, _ in load], [t for _, t in load], facecolor="none", s=22, zorder=3,
                       color=plt.get_cmap("tab10")(int(np.argmin([abs(g - (raw or 0)) for g in c.read_gbps]))),
                       label=f"load, measured ({raw:.1f} GB/s raw read)" if raw else "load, measured")
    ax.set_xlabel("prompt length, all in the tier (K tokens)")
    ax.set_ylabel("time to first token, one request alone (s)")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    p20 = 20480 / (rates.model(1.0).predict_compute(20480, 0) or 1.0)
    be = ", ".join(f"{breakeven_prefill_rate(g * 1e9, rates.kv_bytes_per_token) / 1e3:.1f}k tokens/s at {g:g} GB/s"
                   for g in c.read_gbps)
    ax.set_title(f"Compute or load: {rates.kv_bytes_per_token >> 10} KiB of KV per token, "
                 f"prefill {p20 / 1e3:.1f}k tokens/s at 20k", fontsize="medium")
    dots = ""
    if points:
        dots = "; dots: run 14's revisits" if os.path.abspath(points) == RUN14 else \
            f"; dots: {os.path.join(*os.path.abspath(points).split(os.sep)[-3:])}"
    fig.text(0.01, 0.01, f"prefill C(n,p) = {_formula(a, b, cc)} s for n new tokens after p\n({rates.source}); "
             f"{rates.suffix} new tokens after the prefix{dots}.\nOne request alone, loading pays below a "
             f"prefill rate of R/B = {be}.\nCurves: hicache_gds/costmodel.py through "
             "benchmarks/plot_breakeven.py", fontsize="x-small", va="bottom")
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from exc


def main(argv: Sequence[str] | None = None) -> Curves:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "breakeven.png"))
    ap.add_argument("--read-gbps", type=_floats, default=DEFAULT_READ_GBPS, help="disk read rates, GB/s (1e9)")
    ap.add_argument("--kv-bytes-per-token", type=int, default=None, help=f"default {DEFAULT_KV}")
    ap.add_argument("--model", help="a Hugging Face config.json (or its directory): KV bytes per token from it")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--prefill-coefficients", type=_floats, help="a,b,c of C(n,p) in seconds (the default: "
                   f"{','.join(f'{v:g}' for v in DEFAULT_COEFFICIENTS)})")
    g.add_argument("--prefill-tokens-per-s", type=float, help="a flat prefill rate (a = 1/rate, b = c = 0)")
    ap.add_argument("--suffix", type=int, default=64, help="new tokens after the prefix (default 64)")
    ap.add_argument("--points", default=None, help="a suite's JSON whose one-at-a-time TTFTs to draw as dots "
                    "(recompute and gds-wait_complete; default: RESULTS run 14's where the other options are theirs)")
    ap.add_argument("--no-points", action="store_true", help="no measured dots")
    ap.add_argument("--max-tokens", type=int, default=32768, help="longest prompt plotted (default 32768)")
    ap.add_argument("--step", type=int, default=512, help="prompt lengths every this many tokens (default 512)")
    args = ap.parse_args(argv)
    kv = args.kv_bytes_per_token
    if args.model:
        from hicache_gds.tools.breakeven import kv_bytes_per_token
        kv = kv_bytes_per_token(args.model)[1]
    coef, source = DEFAULT_COEFFICIENTS, DEFAULT_SOURCE
    if args.prefill_coefficients:
        if len(args.prefill_coefficients) != 3:
            ap.error("--prefill-coefficients takes three numbers: a,b,c")
        coef, source = args.prefill_coefficients, "given"
    elif args.prefill_tokens_per_s:
        coef, source = (1.0 / args.prefill_tokens_per_s, 0.0, 0.0), f"{args.prefill_tokens_per_s:g} tokens/s given"
    rates = Rates(coef, int(kv or DEFAULT_KV), tuple(args.read_gbps), args.suffix, source)
    c = curves(rates, range(args.step, args.max_tokens + 1, args.step))
    points = args.points
    if points is None and rates == Rates(read_gbps=rates.read_gbps) and os.path.exists(RUN14):
        points = RUN14  # the run the default rates come from: its dots belong on their curves
    plot(c, rates, args.out, None if args.no_points else points)
    for i, gbps in enumerate(c.read_gbps):
        wins = c.lengths[c.load[i] < c.recompute]
        print(f"{gbps:g} GB/s: load beats recompute from {wins[0] if len(wins) else 'no'} tokens; split at "
              f"{c.lengths[-1]} tokens {c.split[i, -1]:.3f} s against recompute {c.recompute[-1]:.3f} s, "
              f"load {c.load[i, -1]:.3f} s")
    print(f"wrote {args.out}")
    return c


if __name__ == "__main__":
    sys.exit(main() and 0)
