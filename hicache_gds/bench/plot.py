"""Sweep results as a table and a figure: bandwidth and p99 batch latency against block size.

`summary_table(results)` is the compact table printed after fio's normal output (one row per job,
engine and direction, with the raw and fio baselines of the same run and our ratio to each).
`plot_results(results, path)` draws two panels with matplotlib's Agg backend (no display
needed): bandwidth (GB/s) and p99 completion latency of one batch (ms) against the page size,
one line per engine, direction and batch size, the raw baseline dashed and fio dotted.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from ..errors import HiCacheGDSError
from .options import OptionError
from .report import JobResult, num2str

__all__ = ["summary_table", "plot_results", "series", "PlotError"]


class PlotError(HiCacheGDSError, RuntimeError):
    """The figure cannot be drawn (matplotlib missing, nothing to plot, unwritable file)."""


def _geometry(r: JobResult) -> tuple[int, int] | None:
    try:
        return r.options.geometry.page_bytes, r.options.batch_size
    except OptionError:
        return None


def _mib(bw: Any) -> str:
    return f"{bw / (1 << 20):.0f}" if isinstance(bw, (int, float)) and bw else "-"


def summary_table(results: Sequence[JobResult]) -> str:
    """One line per job and direction: MiB/s, p99 batch latency, baselines, ratios."""
    head = (f"{'job':<30} {'engine':<12} {'dir':<5} {'page':>7} {'batch':>5} {'MiB/s':>7} "
            f"{'p99 ms':>8} {'raw':>7} {'x raw':>6} {'fio':>7} {'x fio':>6}")
    rows = [head, "-" * len(head)]
    for r in results:
        ours = r.hicache_gds
        base = ours.get("baseline") or {}
        geo = _geometry(r)
        page = num2str(geo[0], pow2=True, unit="B") if geo else "?"
        batch = str(geo[1]) if geo else "?"
        for ddir, d in r.directions:
            if not d.total_ios:
                continue
            p99 = d.clat.summary((99.0,)).percentiles.get(99.0, 0) / 1e6
            cells = []
            for name in ("raw", "fio"):
                bw = ((base.get(name) or {}).get(ddir) or {}).get("bw_bytes")
                cells += [_mib(bw), f"{d.bw_bytes / bw:.2f}" if bw else "-"]
            engine = str(ours.get("engine") or r.options.engine)
            rows.append(f"{r.jobname[:30]:<30} {engine[:12]:<12} {ddir:<5} {page:>7} {batch:>5} "
                        f"{_mib(d.bw_bytes):>7} {p99:>8.1f} {cells[0]:>7} {cells[1]:>6} {cells[2]:>7} "
                        f"{cells[3]:>6}")
    return "\n".join(rows) + "\n"


def series(results: Sequence[JobResult]) -> dict[str, list[tuple[int, float, float | None]]]:
    """{label: [(page bytes, GB/s, p99 ms or None)]} sorted by page size; labels are
    `engine dir bN` for our runs and `raw dir bN` / `fio dir bN` for the baselines."""
    out: dict[str, dict[int, tuple[float, float | None]]] = defaultdict(dict)
    for r in results:
        geo = _geometry(r)
        if geo is None:
            continue
        page, batch = geo
        base = r.hicache_gds.get("baseline") or {}
        engine = str(r.hicache_gds.get("engine") or r.options.engine)
        for ddir, d in r.directions:
            if not d.total_ios:
                continue
            p99 = d.clat.summary((99.0,)).percentiles.get(99.0)
            out[f"{engine} {ddir} b{batch}"][page] = (d.bw_bytes / 1e9, p99 / 1e6 if p99 else None)
            for name in ("raw", "fio"):
                b = (base.get(name) or {}).get(ddir) or {}
                if b.get("bw_bytes"):
                    # raw/fio latencies are per page IO, not per batch: bandwidth only
                    out[f"{name} {ddir} b{batch}"].setdefault(page, (b["bw_bytes"] / 1e9, None))
    return {k: sorted((p, bw, lat) for p, (bw, lat) in v.items()) for k, v in out.items()}


def plot_results(results: Sequence[JobResult], path: str, title: str = "hicache-gds-bench") -> str:
    """Draw bandwidth and p99 latency against block size into `path` (PNG); returns `path`."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotError("--plot needs matplotlib: pip install 'hicache-gds[plot]'") from exc
    data = series(results)
    if not data:
        raise PlotError("--plot: no job produced a measurement to plot")
    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(13, 5))
    for label, pts in sorted(data.items()):
        xs = [p for p, _, _ in pts]
        style = "--" if label.startswith("raw ") else ":" if label.startswith("fio ") else "-"
        ax_bw.plot(xs, [bw for _, bw, _ in pts], style, marker="o", label=label)
        lat = [(p, v) for p, _, v in pts if v is not None]
        if lat:
            ax_lat.plot([p for p, _ in lat], [v for _, v in lat], style, marker="o", label=label)
    ticks = sorted({p for pts in data.values() for p, _, _ in pts})
    for ax, ylabel in ((ax_bw, "bandwidth (GB/s)"), (ax_lat, "p99 latency of one batch (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.set_xticklabels([num2str(t, pow2=True, unit="B") for t in ticks])
        ax.set_xlabel("page (block) size")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.set_ylim(bottom=0)
    ax_bw.legend(fontsize="small")
    if ax_lat.lines:
        ax_lat.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise PlotError(f"--plot: cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
    return path
