"""Sweep results as a table and a figure: bandwidth and p99 batch latency against block size.

`summary_table(results)` is the compact table printed after fio's normal output (one row per job,
engine and direction, with the raw and fio baselines of the same run and our ratio to each).
`plot_results(results, path)` draws, with matplotlib's Agg backend (no display needed), per
direction: bandwidth (GB/s) and p99 completion latency of one batch (ms) against the page size,
one line per engine and batch size, with the raw and fio baselines' bandwidth beside them.
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


def series(results: Sequence[JobResult]) -> dict[tuple[str, str, int], list[tuple[int, float, float | None]]]:
    """{(who, direction, batch): [(page bytes, GB/s, p99 ms or None)]} sorted by page size; `who`
    is the engine for our runs, `raw` or `fio` for the baselines (bandwidth only: their
    latencies are per page IO, not per batch)."""
    out: dict[tuple[str, str, int], dict[int, tuple[float, float | None]]] = defaultdict(dict)
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
            out[(engine, ddir, batch)][page] = (d.bw_bytes / 1e9, p99 / 1e6 if p99 else None)
            for name in ("raw", "fio"):
                b = (base.get(name) or {}).get(ddir) or {}
                if b.get("bw_bytes"):
                    out[(name, ddir, batch)].setdefault(page, (b["bw_bytes"] / 1e9, None))
    return {k: sorted((p, bw, lat) for p, (bw, lat) in v.items()) for k, v in out.items()}


def plot_results(results: Sequence[JobResult], path: str, title: str = "hicache-gds-bench") -> str:
    """Draw bandwidth and p99 latency against block size into `path` (PNG); returns `path`.

    One row per direction; a colour per engine (raw black, fio grey), a line style per batch.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotError("--plot needs matplotlib: pip install 'hicache-gds[plot]'") from exc
    data = series(results)
    if not data:
        raise PlotError("--plot: no job produced a measurement to plot")
    dirs = [d for d in ("write", "read") if any(k[1] == d for k in data)]
    engines = sorted({k[0] for k in data} - {"raw", "fio"})
    colour = {e: plt.get_cmap("tab10")(i % 10) for i, e in enumerate(engines)}
    colour.update(raw="black", fio="grey")
    style = {b: ("-", "--", "-.", ":")[i % 4] for i, b in enumerate(sorted({k[2] for k in data}, reverse=True))}
    ticks = sorted({p for pts in data.values() for p, _, _ in pts})
    fig, axes = plt.subplots(len(dirs), 2, figsize=(13, 4.2 * len(dirs)), squeeze=False)
    for row, ddir in zip(axes, dirs):
        ax_bw, ax_lat = row
        for (who, d, batch), pts in sorted(data.items()):
            if d != ddir:
                continue
            kw = {"color": colour[who], "linestyle": style[batch], "marker": "o" if who in engines else "x",
                  "label": f"{who} batch {batch}"}
            ax_bw.plot([p for p, _, _ in pts], [bw for _, bw, _ in pts], **kw)
            lat = [(p, v) for p, _, v in pts if v is not None]
            if lat:
                ax_lat.plot([p for p, _ in lat], [v for _, v in lat], **kw)
        for ax, ylabel in ((ax_bw, f"{ddir} bandwidth (GB/s)"), (ax_lat, f"{ddir}: p99 latency of one batch (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks)
            ax.set_xticklabels([num2str(t, pow2=True, unit="B") for t in ticks])
            ax.set_xlabel("page (block) size")
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize="small", loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise PlotError(f"--plot: cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
    return path
