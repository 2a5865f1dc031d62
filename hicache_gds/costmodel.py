"""Compute or load: what an L3 hit costs against recomputing it, and which to do.

Engine-neutral (no SGLang or vLLM import): adapters feed it what they measure and ask it to
decide. Two rates and two queues:

* the store's read rate ``R`` (bytes/s), from the bytes and seconds of its recent gets
  (`ReadRate`), seeded before the first get by a configured or persisted estimate;
* the engine's prefill cost, fitted on the prefill batches it ran (`PrefillModel`)::

      C(n, p) = a*n + b*n*(p + n/2) + c*k

  for ``n`` new tokens after ``p`` cached ones, computed in ``k = ceil(n / chunk)`` batches.
  ``a`` is the per-token cost (weights), ``b`` attention: the i-th new token attends to ``p + i``
  tokens, and the sum over ``i`` is ``n*(p + n/2)`` -- so recomputing is superlinear in length
  and loading pays more for long prefixes. ``c`` is the fixed cost of a batch. A batch of several
  requests costs the sum of their ``a`` and ``b`` terms plus one ``c``; the fit is least squares
  on relative error over the recent batches, with every coefficient kept >= 0;
* ``G``, the GPU backlog: seconds of prefill queued ahead of the request;
* ``D``, the disk backlog: seconds of loads queued ahead of it, ``bytes / R``.

A request has ``n`` tokens to prefill after ``p`` the engine already holds, ``h <= n`` of them
(the leading ones) in L3, ``B`` bytes of KV per token. Loading them costs ``L(h) = h*B / R``.

Admission (`CostModel.decide` with nothing loaded yet), earliest finish over the two queues::

    compute:  t_C = G + C(n, p)
    load:     t_L = max(D + L(h), G) + C(n - h, p + h)
    load  iff t_L < t_C

A request alone (``D = G = 0``) so takes ``min(L(h) + C(n-h, p+h), C(n, p))``: sequential
load-then-compute is concave in the loaded fraction (``d2T/df2 = -b*h^2 < 0``), so all or none
of the hit is the optimum, never a part. In a burst, each request goes to the queue that
finishes it first, so the disk and the GPU work at once on different requests, and the makespan
approaches ``W / (R/B + P)`` tokens for ``W`` tokens at prefill rate ``P``.

Behind a GPU backlog a part pays as well (``part_min`` set): the leading ``k`` tokens of the hit
that the disk reads before the GPU reaches the request, ``D + L(k) <= G / (1 + margin)``, cost the
request nothing to wait for and take ``C(n, p) - C(n - k, p + k) > 0`` off the GPU's queue::

    part:     t_P = G + C(n - k, p + k)      (k page-aligned, k >= part_min)

Over ``k`` in ``[0, h]`` the finish time falls until that ``k`` and is concave past it, so the
best is one of none, ``k`` or all: admission takes the earliest of ``t_C``, ``t_P`` and ``t_L``.
Without it a request the GPU would reach in 2 s whose whole hit takes 3 s to read is recomputed
from its first token while the disk idles. That is earliest finish for the request itself; the
disk time a part takes is not there for a later request's whole load, which takes that request
off the GPU's queue, and on an H200 parts did not pay in bursts (the SGLang policy's
``policy_partial``, off by default, says where they were measured).

Loads run slower under an engine than its gets alone say (the engine's IO thread waits for host
memory between them, its batches leave gaps, other IO shares the disk): `LoadPace` keeps the
median of (how long a finished load took) / (what admission forecast for it), and every load
time above is ``L(h) * pace``, the pace clipped to [0.8, 2] and 1 until three loads finished.

A load in flight (``d`` tokens kept, ``f >= d`` read so far, ``D`` now the time until its last
page lands) is stopped, keeping the ``d`` and recomputing the rest, when::

    G + C(n - d, p + d)  <  (max(D, G) + C(n - h, p + h)) / (1 + margin)

i.e. when the request could start on the GPU before its load ends and the load left takes longer
than the compute the pages left would save. While the GPU is busy with others (``G >= D``),
waiting costs nothing and the load runs on.

**Split** (``split_chunk`` set): the GPU computes the hit's head while the disk loads its tail.
SGLang computes a prefix in chunks of ``chunk`` tokens and inserts each chunk into its tree as it
goes, so the pages read from ``k`` on can join the request at a chunk boundary ``k = j*chunk``
(``0 < k < h``): the request needs only ``C(k, p)`` of the GPU, then the pages the disk read by
then, then computes the rest. An overlapped scheduler forms the batch after the chunk that ends
at ``k`` while that chunk runs, so the disk's deadline is the start of that chunk::

    t_k     = G + C(k, p)                              the head computed
    s_k     = G + C(k - chunk, p)                      when the pages are joined
    f_k     = min(h - k, max(0, s_k - D) * R / B / pace)   tail tokens read by then, counted in
                                               whole gets of ``grain`` tokens until all are read
    split:  t_S = t_k + C(n - k - f_k, p + k + f_k)

Admission takes the earliest of ``t_C``, ``t_L`` and the best ``t_S`` over ``j`` (with
``stop_margin`` to spare). A request alone so takes ``C(k, p)`` and the few tokens after the hit
where its tail is read within ``C(k - chunk, p)``: less than both its load and its recompute
where the disk and the GPU run at similar rates and the hit spans at least two chunks (an H200,
8B shape: 0.76x the recompute of a 19k-token prefix). Pages of the tail that land after ``s_k``
are dropped and computed instead; the GPU never waits for the disk.

`breakeven_prefill_rate` says when a tier pays one request at a time: loading an ``n``-token
prefix takes ``n*B/R``, recomputing about ``n/P``, so loading wins when the engine prefills
slower than ``R/B`` tokens per second (and longer prefixes, through ``b``, move it further).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["ReadRate", "PrefillModel", "LoadPace", "CostModel", "Decision", "breakeven_prefill_rate", "load_state",
           "save_state", "STATE_FILE"]

STATE_FILE = "costmodel.json"
"""File name of the persisted estimates (in an adapter's namespace directory)."""

_PRIOR_WEIGHT = 256 << 20  # a seeded read rate counts as this many bytes of observed gets
_MIN_BATCH_S = 1e-4
_STATE_VERSION = 1


def breakeven_prefill_rate(read_bytes_per_s: float, kv_bytes_per_token: float) -> float:
    """Tokens per second of prefill below which loading a prefix beats recomputing it (one
    request at a time, attention ignored: longer prefixes move it in the tier's favour)."""
    if not 0 < kv_bytes_per_token < math.inf:
        raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token!r}")
    return max(0.0, float(read_bytes_per_s)) / float(kv_bytes_per_token)


class ReadRate:
    """Bytes per second of the store's recent gets (a window of the last `window` gets, weighted
    by bytes), blended with a seed worth `prior_weight` bytes until real gets outweigh it.
    Thread-safe: gets are observed on an engine's IO thread, read on its scheduler thread."""

    def __init__(self, prior: float | None = None, source: str = "", *, window: int = 32,
                 prior_weight: int = _PRIOR_WEIGHT) -> None:
        self._lock = threading.Lock()
        self._obs: deque[tuple[float, float]] = deque(maxlen=window)
        self._prior: float | None = None
        self._prior_source = ""
        self._prior_weight = float(prior_weight)
        self.total_bytes = 0
        self.total_gets = 0
        if prior:
            self.seed(prior, source or "configured")

    def seed(self, bytes_per_s: float, source: str) -> None:
        """Set the estimate used before (and blended with) measured gets; `source` says where it came from."""
        if not bytes_per_s or not math.isfinite(bytes_per_s) or bytes_per_s <= 0:
            raise ValueError(f"a read rate must be a positive number of bytes/s, got {bytes_per_s!r}")
        with self._lock:
            self._prior, self._prior_source = float(bytes_per_s), source

    def observe(self, nbytes: int, seconds: float) -> None:
        """One get: `nbytes` read in `seconds` (gets of nothing are ignored)."""
        if nbytes <= 0 or not seconds > 0:
            return
        with self._lock:
            self._obs.append((float(nbytes), float(seconds)))
            self.total_bytes += int(nbytes)
            self.total_gets += 1

    @property
    def rate(self) -> float | None:
        """Bytes/s, or None when there is neither a seed nor a measured get."""
        with self._lock:
            b = sum(x for x, _ in self._obs)
            s = sum(t for _, t in self._obs)
            if self._prior is not None:
                w = max(0.0, self._prior_weight - b)  # the seed fades as real gets pile up
                b, s = b + w, s + w / self._prior
            return b / s if s > 0 else None

    @property
    def source(self) -> str:
        with self._lock:
            measured = sum(x for x, _ in self._obs)
            if measured and (self._prior is None or measured >= self._prior_weight):
                return f"measured ({len(self._obs)} recent gets, {measured / 1e9:.2f} GB)"
            if measured:
                return f"measured ({len(self._obs)} gets) blended with {self._prior_source}"
            return self._prior_source if self._prior is not None else "unknown"

    def snapshot(self) -> dict[str, Any]:
        r = self.rate
        return {"read_bytes_per_s": r, "read_gbps": None if r is None else r / 1e9, "read_source": self.source,
                "gets_observed": self.total_gets, "bytes_observed": self.total_bytes}


class LoadPace:
    """How much longer loads take in the engine than the read rate forecasts: the median of the
    last `window` (actual / forecast) ratios of finished loads, within `bounds`, 1.0 until
    `min_loads` have finished. Thread-safe."""

    def __init__(self, *, window: int = 16, min_loads: int = 3, bounds: tuple[float, float] = (0.8, 2.0)) -> None:
        self._lock = threading.Lock()
        self._ratios: deque[float] = deque(maxlen=window)
        self._min = int(min_loads)
        self._bounds = bounds
        # kept current by `observe` (a few per burst): every load time predicted reads it
        self._factor = 1.0

    def observe(self, forecast_s: float, actual_s: float, pace_used: float = 1.0) -> None:
        """A load admission forecast at `forecast_s` (with `pace_used` applied) took `actual_s`."""
        base = forecast_s / pace_used if pace_used > 0 else math.nan
        if not (base > 0 and actual_s > 0 and math.isfinite(base) and math.isfinite(actual_s)):
            return
        with self._lock:
            self._ratios.append(actual_s / base)
            if len(self._ratios) >= self._min:
                lo, hi = self._bounds
                self._factor = min(hi, max(lo, float(np.median(np.fromiter(self._ratios, dtype=float)))))

    @property
    def factor(self) -> float:
        return self._factor

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            n = len(self._ratios)
        return {"load_pace": self.factor, "loads_paced": n}


class PrefillModel:
    """Seconds to prefill `n` new tokens after `p` cached ones, fitted on recent batches (see the
    module docstring for the formula). Before any batch, a seed rate (tokens/s) or seeded
    coefficients answer; with neither, `predict` returns None."""

    def __init__(self, prior_tokens_per_s: float | None = None, source: str = "", *, window: int = 128,
                 chunk: int | None = None) -> None:
        self._lock = threading.Lock()
        self._rows: deque[tuple[float, float, float]] = deque(maxlen=window)  # (N, S, seconds)
        self._coef: tuple[float, float, float] | None = None
        self._seed: tuple[float, float, float] | None = None
        self._seed_source = ""
        self._dirty = False
        self.chunk = chunk
        self.batches = 0
        if prior_tokens_per_s:
            self.seed_rate(prior_tokens_per_s, source or "configured")

    def seed_rate(self, tokens_per_s: float, source: str) -> None:
        if not tokens_per_s or not math.isfinite(tokens_per_s) or tokens_per_s <= 0:
            raise ValueError(f"a prefill rate must be a positive number of tokens/s, got {tokens_per_s!r}")
        self.seed_coefficients(1.0 / tokens_per_s, 0.0, 0.0, source)

    def seed_coefficients(self, a: float, b: float, c: float, source: str) -> None:
        if min(a, b, c) < 0 or not all(math.isfinite(x) for x in (a, b, c)) or a + b <= 0:
            raise ValueError(f"prefill coefficients must be finite, >= 0, and a or b > 0: {(a, b, c)!r}")
        with self._lock:
            self._seed, self._seed_source = (float(a), float(b), float(c)), source

    @staticmethod
    def _features(news: Sequence[int], prefixes: Sequence[int]) -> tuple[float, float]:
        n = np.asarray(news, dtype=np.float64)
        p = np.asarray(prefixes, dtype=np.float64)
        return float(n.sum()), float((n * (p + n / 2)).sum())

    def observe(self, news: Sequence[int], prefixes: Sequence[int], seconds: float) -> None:
        """One prefill batch: per request its new tokens and cached prefix, and the batch's seconds."""
        if len(news) != len(prefixes):
            raise ValueError(f"{len(news)} new-token counts but {len(prefixes)} prefixes")
        if not news or not seconds > _MIN_BATCH_S or not math.isfinite(seconds):
            return
        N, S = self._features(news, prefixes)
        if N <= 0:
            return
        with self._lock:
            self._rows.append((N, S, float(seconds)))
            self.batches += 1
            self._dirty = True

    def _fit(self) -> tuple[float, float, float] | None:
        """Least squares on relative error, coefficients >= 0 (the best feasible subset of a, b, c)."""
        rows = np.asarray(self._rows, dtype=np.float64)
        if not len(rows):
            return None
        t = rows[:, 2]
        X = np.stack([rows[:, 0], rows[:, 1], np.ones(len(rows))], axis=1) / t[:, None]
        y = np.ones(len(rows))
        best, best_err = None, math.inf
        for k in (3, 2, 1):
            for cols in itertools.combinations(range(3), k):
                if len(rows) < k or (cols == (2,)):
                    continue  # a constant alone predicts nothing about size
                A = X[:, cols]
                coef, _res, rank, _sv = np.linalg.lstsq(A, y, rcond=None)
                if rank < k or (coef < 0).any() or not np.isfinite(coef).all():
                    continue
                err = float(((A @ coef - y) ** 2).sum())
                if err < best_err - 1e-12:
                    full = [0.0, 0.0, 0.0]
                    for j, v in zip(cols, coef):
                        full[j] = float(v)
                    best, best_err = tuple(full), err
        return best  # type: ignore[return-value]

    def coefficients(self) -> tuple[tuple[float, float, float] | None, str]:
        """(a, b, c) in use and where they came from."""
        with self._lock:
            if self._dirty:
                self._coef = self._fit()
                self._dirty = False
            if self._coef is not None:
                return self._coef, f"measured ({len(self._rows)} recent prefill batches)"
            return self._seed, (self._seed_source if self._seed is not None else "unknown")

    def predict(self, new: int, prefix: int = 0, *, smooth: bool = False) -> float | None:
        """Seconds to prefill `new` tokens after `prefix` cached ones; None when nothing is known yet.

        smooth: count batches as ``new / chunk`` instead of ``ceil(new / chunk)``. A difference of
        two predictions over a few tokens is then the marginal cost of those tokens; with the
        ceiling it jumps by a whole batch wherever they cross a chunk boundary (64 tokens of a
        16,448-token prompt, 2 chunks of 8,192 and 64 over, "saved" a third batch)."""
        if not self.chunk:
            k = 1.0
        else:
            k = new / self.chunk if smooth else math.ceil(new / self.chunk)
        return self._cost(new, new * (prefix + new / 2), k)

    def predict_batch(self, news: Sequence[int], prefixes: Sequence[int]) -> float | None:
        """Seconds of one prefill batch: per request its new tokens and cached prefix (the sum of
        their ``a`` and ``b`` terms plus one ``c``); None when nothing is known yet."""
        if len(news) != len(prefixes):
            raise ValueError(f"{len(news)} new-token counts but {len(prefixes)} prefixes")
        return self._cost(*(self._features(news, prefixes) if len(news) else (0.0, 0.0)), 1.0)

    def _cost(self, n: float, s: float, batches: float) -> float | None:
        """``a*n + b*s + c*batches`` for `n` new tokens whose attention sum is `s` (0 for no tokens;
        None when nothing is known yet)."""
        if n <= 0:
            return 0.0
        coef, _ = self.coefficients()
        if coef is None:
            return None
        a, b, c = coef
        return a * n + b * s + c * batches

    def tokens_per_s(self, new: int = 8192, prefix: int = 0) -> float | None:
        """Prefill rate at a request of `new` tokens (attention makes it fall with length)."""
        t = self.predict(new, prefix)
        return None if not t else new / t

    def snapshot(self) -> dict[str, Any]:
        coef, source = self.coefficients()
        return {"prefill_coefficients": None if coef is None else dict(zip(("a", "b", "c"), coef)),
                "prefill_source": source, "prefill_tokens_per_s_8k": self.tokens_per_s(8192),
                "prefill_tokens_per_s_32k": self.tokens_per_s(32768), "prefill_batches_observed": self.batches}


@dataclass(frozen=True)
class Decision:
    """What `CostModel.decide` chose and the two finish times it compared (seconds from now)."""

    action: str  # "load" | "compute" | "split" (admission), "wait" | "stop" (in flight)
    t_load: float
    t_compute: float
    reason: str
    tokens: int | None = None  # load: the hit's leading `tokens` only (a part; None: all of it); split: the head
    tail: int | None = None  # split: the tokens after the head forecast to be read when they are joined

    @property
    def load(self) -> bool:
        return self.action in ("load", "wait")


class CostModel:
    """The two rates, the formula, and the decisions (module docstring). `bytes_per_token` is the
    KV one token takes in the store (per rank); `stop_margin` the hysteresis of the stop rule."""

    def __init__(self, bytes_per_token: float, *, read: ReadRate | None = None, prefill: PrefillModel | None = None,
                 pace: LoadPace | None = None, stop_margin: float = 0.05) -> None:
        if not 0 < bytes_per_token < math.inf:
            raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token!r}")
        self.bytes_per_token = float(bytes_per_token)
        self.read = read if read is not None else ReadRate()
        self.prefill = prefill if prefill is not None else PrefillModel()
        self.pace = pace if pace is not None else LoadPace()
        self.stop_margin = float(stop_margin)

    # -- the engine-neutral API ---------------------------------------------------------------
    def observe_load(self, nbytes: int, seconds: float) -> None:
        self.read.observe(nbytes, seconds)

    def observe_prefill(self, new: int | Sequence[int], prefix: int | Sequence[int], seconds: float) -> None:
        news = [new] if isinstance(new, (int, np.integer)) else list(new)
        prefixes = [prefix] if isinstance(prefix, (int, np.integer)) else list(prefix)
        self.prefill.observe(news, prefixes, seconds)

    def predict_load(self, nbytes: float, backlog: float = 0.0) -> float | None:
        """Seconds until `nbytes` more are read after `backlog` seconds of loads queued ahead (at
        the read rate, times the engine's `LoadPace`)."""
        r = self.read.rate
        return None if r is None else backlog + max(0.0, nbytes) / r * self.pace.factor

    def predict_compute(self, new: int, prefix: int = 0, *, smooth: bool = False) -> float | None:
        return self.prefill.predict(new, prefix, smooth=smooth)

    def decide(self, new: int, prefix: int, hit: int, *, kept: int = 0, fetched: int | None = None,
               in_flight: bool = False, gpu_backlog: float = 0.0, disk_backlog: float = 0.0,
               smooth: bool = False, page: int = 1, part_min: int | None = None,
               split_chunk: int | None = None, split_grain: int | None = None) -> Decision:
        """Load or compute (admission), wait or stop (a load in flight); see the module docstring.

        new: tokens to prefill after `prefix`; hit: the leading ones in L3 (<= new); kept: tokens
        of the hit already loaded and kept if stopped now; fetched: read so far (>= kept, for the
        time left); gpu_backlog: seconds of prefill ahead on the GPU; disk_backlog: seconds of
        loads ahead of this one on the disk; smooth: batches counted fractionally
        (`PrefillModel.predict`), for judging a few tokens at the margin; part_min: at admission,
        weigh loading a part of at least this many tokens (multiples of `page`) that lands before
        the GPU reaches the request (None: all or nothing); split_chunk: at admission, weigh
        computing a head of whole chunks of this many tokens while the disk loads the rest
        (`split`; None: never), whose tail is counted read in gets of split_grain tokens.
        Unknown rates: load (the engine's own behaviour)."""
        hit = max(0, min(int(hit), int(new)))
        kept = max(0, min(int(kept), hit))
        fetched = kept if fetched is None else max(kept, min(int(fetched), hit))
        t_load_io = self.predict_load((hit - fetched) * self.bytes_per_token, disk_backlog)
        c_tail = self.predict_compute(new - hit, prefix + hit, smooth=smooth)
        c_rest = self.predict_compute(new - kept, prefix + kept, smooth=smooth)
        if t_load_io is None or c_tail is None or c_rest is None:
            what = "read rate" if t_load_io is None else "prefill cost"
            return Decision("wait" if in_flight else "load", math.nan, math.nan, f"no {what} estimate yet: load")
        t_load = max(t_load_io, gpu_backlog) + c_tail
        t_compute = gpu_backlog + c_rest
        if not in_flight:
            k = self._part(hit, page, gpu_backlog, disk_backlog) if part_min is not None and hit else 0
            if 0 < k < hit and k >= max(1, part_min):
                c_part = self.predict_compute(new - k, prefix + k, smooth=smooth)
                t_part = gpu_backlog + (c_part if c_part is not None else c_rest)
                if t_part < t_compute and t_part <= t_load:
                    return Decision("load", t_part, t_compute, f"{k} of the {hit} tokens in L3 land before the GPU "
                                    f"reaches the request (all of them: {t_load:.3f} s)", tokens=k)
            best = min(t_load, t_compute)
            sp = self.split(new, prefix, hit, chunk=split_chunk, gpu_backlog=gpu_backlog,
                            disk_backlog=disk_backlog, page=page, grain=split_grain) if split_chunk else None
            if sp is not None and sp[1] * (1.0 + self.stop_margin) < best:
                head, t_split, got = sp
                return Decision("split", t_split, t_compute, f"computing {head} tokens while the disk reads "
                                f"{got} of the {hit - head} after them finishes first (load {t_load:.3f} s)",
                                tokens=head, tail=got)
            if t_load < t_compute:
                return Decision("load", t_load, t_compute, "loading finishes first")
            return Decision("compute", t_load, t_compute, "computing finishes first")
        if t_compute * (1.0 + self.stop_margin) < t_load:
            return Decision("stop", t_load, t_compute, "the load left takes longer than the compute it saves")
        return Decision("wait", t_load, t_compute,
                        "the GPU is busy until then" if gpu_backlog >= t_load_io else "loading still finishes first")

    def split(self, new: int, prefix: int, hit: int, *, chunk: int, gpu_backlog: float = 0.0,
              disk_backlog: float = 0.0, page: int = 1, grain: int | None = None) -> tuple[int, float, int] | None:
        """The best head for a split (module docstring): ``(k, t_S, f_k)`` -- the tokens the GPU
        computes first (whole chunks), the forecast finish, and the tail tokens forecast to be
        read when they are joined -- or None where no head of whole chunks leaves a tail to read
        or the rates are unknown. grain: tokens an engine's get reads before any of them count
        (SGLang counts a prefetch's pages a batch of gets at a time; None: page by page)."""
        r = self.read.rate
        chunk = int(chunk)
        page = max(1, int(page))
        hit = max(0, min(int(hit), int(new)))
        if r is None or chunk <= 0 or hit <= chunk:
            return None
        per_token_s = self.bytes_per_token * self.pace.factor / r
        best: tuple[int, float, int] | None = None
        for k in range(chunk, hit, chunk):
            t_k = self.predict_compute(k, prefix)
            s_k = self.predict_compute(k - chunk, prefix)
            if t_k is None or s_k is None:
                return None
            f = int(max(0.0, gpu_backlog + s_k - disk_backlog) / per_token_s) // page * page
            if f < hit - k and grain:
                f = f // grain * grain  # the get in flight counts nothing until it returns
            f = min(hit - k, f)
            if f <= 0:
                continue
            rest = self.predict_compute(new - k - f, prefix + k + f)
            if rest is None:
                return None
            t = gpu_backlog + t_k + rest
            if best is None or t < best[1]:
                best = (k, t, f)
        return best

    def _part(self, hit: int, page: int, gpu_backlog: float, disk_backlog: float) -> int:
        """Leading tokens of a hit (whole pages) the disk reads, behind its backlog, with
        `stop_margin` to spare before the GPU reaches the request."""
        r = self.read.rate
        spare = gpu_backlog / (1.0 + self.stop_margin) - disk_backlog
        if r is None or spare <= 0:
            return 0
        k = int(spare * r / (self.bytes_per_token * self.pace.factor))
        page = max(1, int(page))
        return min(int(hit), k // page * page)

    def estimates(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kv_bytes_per_token": self.bytes_per_token}
        out.update(self.read.snapshot())
        out.update(self.pace.snapshot())
        out.update(self.prefill.snapshot())
        r = self.read.rate
        out["breakeven_prefill_tokens_per_s"] = None if r is None else breakeven_prefill_rate(r, self.bytes_per_token)
        return out

    # -- persistence ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What `save_state` writes: the current estimates, when and from what."""
        coef, source = self.prefill.coefficients()
        return {"version": _STATE_VERSION, "saved_at": time.time(), "kv_bytes_per_token": self.bytes_per_token,
                "read_bytes_per_s": self.read.rate, "read_source": self.read.source,
                "prefill_coefficients": None if coef is None else list(coef), "prefill_source": source,
                "prefill_chunk": self.prefill.chunk}

    def seed_from_state(self, st: Mapping[str, Any], *, read: bool = True, prefill: bool = True) -> list[str]:
        """Seed the rates from a persisted `state()`; returns what was seeded (for the log)."""
        done = []
        try:
            if int(st.get("version", 0)) != _STATE_VERSION:
                return done
            age = max(0.0, time.time() - float(st.get("saved_at", 0)))
            when = f"persisted {age / 3600:.1f} h ago" if age >= 3600 else f"persisted {age:.0f} s ago"
            r = st.get("read_bytes_per_s")
            if read and r and float(r) > 0 and str(st.get("read_source", "")).startswith("measured"):
                self.read.seed(float(r), when)
                done.append(f"read rate {float(r) / 1e9:.2f} GB/s ({when})")
            c = st.get("prefill_coefficients")
            if prefill and c and len(c) == 3 and str(st.get("prefill_source", "")).startswith("measured"):
                self.prefill.seed_coefficients(float(c[0]), float(c[1]), float(c[2]), when)
                chunk = st.get("prefill_chunk")
                if self.prefill.chunk is None and isinstance(chunk, int) and chunk > 0:
                    self.prefill.chunk = chunk
                done.append(f"prefill coefficients ({when})")
        except (TypeError, ValueError):
            return done
        return done


def load_state(path: str) -> dict[str, Any] | None:
    """The persisted estimates at `path`, or None (missing or unreadable: start from the seeds)."""
    try:
        with open(path) as f:
            st = json.load(f)
        return st if isinstance(st, dict) else None
    except (OSError, ValueError):
        return None


def save_state(path: str, state: Mapping[str, Any]) -> bool:
    """Write `state` to `path` atomically (tmp + rename); False (nothing raised) when it cannot."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(dict(state), f, indent=1)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
