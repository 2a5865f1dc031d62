"""Prefill timing: the prefill batches the scheduler launches, timed on the forward stream.

`PrefillClock` records each prefill batch's shape and CUDA events at launch (``TpModelWorker.
forward_batch_generation``, no synchronisation), feeds the batches seen finished to the
`PrefillModel`'s fit, and says how long the GPU stays busy with those launched and not yet seen
finished (`in_flight`) and how far they reach into a request (`launched_through`).

The fit sees each batch's time on the GPU, not the stream's time between batches: decode steps
and the GPU idle while the scheduler prepares the next batch. The clock measures that too, from
the same events (the end of one prefill batch to the start of the next, where under `GAP_MAX_S`:
longer is a server without work) and logs it every `GAP_WINDOW` batches (`gaps`), with what the
fit had forecast for those batches at their launch, so a forecast that runs optimistic can be
told from a model that does.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from typing import Any, NamedTuple

from hicache_gds import PrefillModel

from . import view
from .view import once

__all__ = ["Launched", "PrefillClock", "MAX_BATCH_S", "GAP_MAX_S", "GAP_WINDOW"]

log = logging.getLogger("hicache_gds_sglang.policy")
MAX_BATCH_S = 600.0  # a prefill batch forecast beyond this is a broken forecast, not a backlog
GAP_MAX_S = 1.0  # stream time between two prefill batches beyond this: no work, not a gap
GAP_WINDOW = 64  # prefill batches per log line of their GPU time and the gaps between them


class Launched(NamedTuple):
    """A prefill batch launched on the forward stream: its CUDA events (start, end), per request
    its new tokens, prefix and id, when it was launched, and the seconds forecast for it."""

    start: Any
    end: Any
    news: list[int]
    prefixes: list[int]
    t0: float
    pred: float
    rids: list[str]


def _event() -> Any:
    """A CUDA event recorded now (wall clock where there is no GPU)."""
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
    except Exception:  # noqa: BLE001
        pass
    return time.perf_counter()


def _elapsed(start: Any, end: Any) -> float | None:
    """Seconds between two `_event`s, or None while the GPU has not reached the second."""
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    try:
        if not end.query():
            return None
        return start.elapsed_time(end) / 1000.0
    except Exception:  # noqa: BLE001 -- a broken event: drop the sample
        return math.nan


class PrefillClock:
    """The prefill batches of one scheduler: launched, pending, and fed to `model` once finished."""

    def __init__(self, model: PrefillModel) -> None:
        self.model = model
        self.pending: deque[Launched] = deque(maxlen=256)  # prefill batches not yet seen finished
        self.gpu_until = -math.inf  # forecast end of the last prefill batch launched (`in_flight`)
        self._warm = False  # the first prefill batch seen finished (kernel compilation) was left out of the fit
        self._lock = threading.Lock()
        self._prev_end: Any = None  # the end event of the last batch seen finished
        self._window: list[tuple[float, float | None, float]] = []  # (GPU s, gap before it or None, forecast s)
        self.last_gaps: dict[str, float] = {}  # the last window's figures (`gaps`)

    def begin(self, batch: Any) -> Launched | None:
        shape = view.batch_shape(batch)
        if shape is None:
            return None
        self.poll()
        news, prefixes, rids = shape
        return Launched(_event(), None, news, prefixes, time.perf_counter(), 0.0, rids)

    def end(self, token: Launched | None) -> None:
        if token is None:
            return
        end = _event()
        with self._lock:
            pred = self.model.predict_batch(token.news, token.prefixes) or 0.0
            if not 0.0 <= pred < MAX_BATCH_S:
                once("batch-forecast", "hicache-gds policy: a prefill batch forecast at %.3g s (new %s, prefixes %s, "
                     "coefficients %s); counted as 0", pred, token.news[:8], token.prefixes[:8],
                     self.model.coefficients()[0])
                pred = 0.0
            self.pending.append(token._replace(end=end, pred=pred))
            # The GPU is busy no longer than every batch not yet seen finished takes from this
            # launch: without this bound an over-forecast carried forward into every later batch
            # (on an H200 the backlog read 2.6e6 s for 40 % of an open loop's admissions).
            self.gpu_until = min(max(self.gpu_until, token.t0) + pred,
                                 token.t0 + sum(b.pred for b in self.pending))

    def poll(self) -> None:
        """Feed finished prefill batches to the model (non-blocking: CUDA events are queried)."""
        with self._lock:
            while self.pending:
                b = self.pending[0]
                secs = _elapsed(b.start, b.end)
                if secs is None:
                    break
                self.pending.popleft()
                gap = _elapsed(self._prev_end, b.start) if self._prev_end is not None else None
                self._prev_end = b.end
                if gap is not None and not 0.0 <= gap < GAP_MAX_S:
                    gap = None
                if not self._warm:
                    # A server's first prefill batch compiles kernels: its seconds are no prefill
                    # cost. Fed to the fit, it and a second 64-token batch gave `b` alone (0.055 s
                    # per unit of attention sum) on an H200: 1.8e6 s forecast for 8192 tokens.
                    self._warm = True
                    continue
                self.model.observe(b.news, b.prefixes, secs)
                self._window.append((secs, gap, b.pred))
                if len(self._window) >= GAP_WINDOW:
                    self.last_gaps = self._gap_figures()
                    self._window = []
                    g = self.last_gaps
                    log.info("hicache-gds policy: prefill clock: %d prefill batches ran %.3f s on the GPU (forecast "
                             "at launch %.3f s; per batch ran/forecast median %.2f); between them the stream spent "
                             "%.3f s elsewhere (decode steps, idle; %d gaps, median %.1f ms, largest %.1f ms)",
                             g["batches"], g["gpu_s"], g["forecast_s"], g["ran_over_forecast"], g["gap_s"], g["gaps"],
                             g["gap_median_ms"], g["gap_max_ms"])

    def _gap_figures(self) -> dict[str, float]:
        gaps = [g for _, g, _ in self._window if g is not None]  # NaN (a broken event) is None already
        ran = [(s, f) for s, _, f in self._window if not math.isnan(s)]
        ratios = [s / f for s, f in ran if f > 0]
        return {"batches": len(self._window), "gpu_s": sum(s for s, _ in ran),
                "forecast_s": sum(f for _, f in ran),
                "ran_over_forecast": statistics.median(ratios) if ratios else math.nan,
                "gaps": len(gaps), "gap_s": sum(gaps),
                "gap_median_ms": statistics.median(gaps) * 1e3 if gaps else 0.0,
                "gap_max_ms": max(gaps, default=0.0) * 1e3}

    def gaps(self) -> dict[str, float]:
        """The GPU time of the last `GAP_WINDOW` prefill batches seen finished, what the fit had
        forecast for them at launch (in all, and the median of each batch's ratio), and the
        stream's time between them (decode steps, idle), as last logged; empty before a window is
        complete."""
        with self._lock:
            return dict(self.last_gaps)

    def in_flight(self, now: float) -> float:
        """Seconds until the GPU finishes the prefill batches launched and not yet seen finished.

        Batches run one after another on the forward stream, each from its launch or the forecast
        end of the one launched before it, whichever is later (`gpu_until`, kept across batches
        already finished). Counted from each batch's own launch, the backlog missed most of a long
        prompt in progress: SGLang's overlapped scheduler launches a chunk while the GPU still
        runs the one before and admits new requests once that one ends, so the chunk then starting
        looked mostly done. On the GPU machine a third of the requests arriving behind another's
        prefill saw a GPU backlog of 0 s."""
        with self._lock:
            left = max(0.0, self.gpu_until - now) if self.pending else 0.0
            if left > MAX_BATCH_S:
                once("backlog-forecast", "hicache-gds policy: the GPU's launched prefill batches forecast %.3g s "
                     "from now (%d pending, %.3g s forecast for them); counted as 0", left, len(self.pending),
                     sum(b.pred for b in self.pending))
                left = 0.0
            return left

    def launched_through(self, rid: str) -> int:
        """How far into request `rid` the prefill batches launched and not yet seen finished reach
        (its prefix plus new tokens in the furthest; 0 if none holds it)."""
        with self._lock:
            return max((p + n for b in self.pending for r, n, p in zip(b.rids, b.news, b.prefixes) if r == rid),
                       default=0)
