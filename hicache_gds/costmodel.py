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

A part of a hit (its leading pages that land before a GPU backlog reaches the request) can finish
a request as early, but the disk time it takes is not there for a later request's whole load; on
an H200 parts did not pay in bursts, so admission weighs none, all, or a split (below).

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

**Parked split** (``split_park``: the engine can hold a chunked request between two chunks): the
request is held after its head until its whole tail is read, while the GPU runs whatever else
waits, so no tail page is dropped and no late token (the dearest: each attends to all before it)
is computed::

    parked: t_P = max(G + C(k, p), D + L(h - k)) + C(n - h, p + h)

The best ``k`` balances the head's compute against the tail's read: on an H200 with a RAM-backed
device (4 GB/s, 8B shape, chunks of 8192), a 26,624-token hit takes ``max(C(8192), L(18432))``
~0.66 s against its 1.0 s load, where the unparked split's best (0.82 s of head, the rest
computed) loses to the load.

**Cut heads** (``split_cut``: the engine ends the chunk that crosses ``k`` at ``k``, so ``k`` is
any whole number of pages, not only of chunks): the head's last chunk is ``k - j*chunk`` tokens
(`last_chunk`) and ``s_k`` starts it. Whole chunks put the balance point of ``t_P`` on a grid of
8,192 tokens: a 10,240-token hit could only compute 8,192 (``max(C(8192), L(2048))``, the GPU
alone for most of it) or load all; cut at ~5k, the GPU and the disk each take about half
(``open_loop_bound.py``: a burst of 8 at 0.30x recompute with any head, 0.44x with whole chunks).

`breakeven_prefill_rate` says when a tier pays one request at a time: loading an ``n``-token
prefix takes ``n*B/R``, recomputing about ``n/P``, so loading wins when the engine prefills
slower than ``R/B`` tokens per second (and longer prefixes, through ``b``, move it further).

The rates, their seeds and their persistence across restarts (`ReadRate`, `PrefillModel`,
`LoadPace`, `load_state`, `save_state`) live in `hicache_gds.rates`; they are importable from here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .rates import (STATE_FILE, LoadPace, PrefillModel, ReadRate, estimates_state, load_state, save_state,
                    seed_from_state)

__all__ = ["ReadRate", "PrefillModel", "LoadPace", "CostModel", "Decision", "breakeven_prefill_rate", "split_heads",
           "last_chunk", "load_state", "save_state", "STATE_FILE"]


HEAD_CANDIDATES = 64  # cut heads weighed per split, spread over the hit (plus every whole-chunk head)


def last_chunk(k: int, chunk: int) -> int:
    """Tokens in the last chunk of a `k`-token head computed in chunks of `chunk`, where the chunk
    that crosses `k` is cut there (a head of whole chunks ends with a whole one)."""
    return k - (k - 1) // chunk * chunk


def split_heads(hit: int, chunk: int, page: int, *, cut: bool = False) -> list[int]:
    """The heads a split of a `hit`-token L3 hit may compute before its tail joins: whole chunks
    (SGLang joins a tail where a chunk ends), or with `cut` any whole pages short of the hit (the
    engine ends the chunk that crosses the head there), at most `HEAD_CANDIDATES` of those spread
    evenly, besides the whole-chunk heads."""
    whole = list(range(chunk, hit, chunk))
    if not cut:
        return whole
    pages = (hit - 1) // page  # heads of 1..pages pages leave a tail of at least a page
    step = max(1, -(-pages // HEAD_CANDIDATES))
    return sorted(set(range(page * step, pages * page + 1, page * step)) | set(whole))


def breakeven_prefill_rate(read_bytes_per_s: float, kv_bytes_per_token: float) -> float:
    """Tokens per second of prefill below which loading a prefix beats recomputing it (one
    request at a time, attention ignored: longer prefixes move it in the tier's favour)."""
    if not 0 < kv_bytes_per_token < math.inf:
        raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token!r}")
    return max(0.0, float(read_bytes_per_s)) / float(kv_bytes_per_token)




@dataclass(frozen=True)
class Decision:
    """What `CostModel.decide` chose and the two finish times it compared (seconds from now)."""

    action: str  # "load" | "compute" | "split" (admission), "wait" | "stop" (in flight)
    t_load: float
    t_compute: float
    reason: str
    tokens: int | None = None  # split: the head computed first (None otherwise)
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
               smooth: bool = False, page: int = 1,
               split_chunk: int | None = None, split_grain: int | None = None,
               split_park: bool = False, split_cut: bool = False) -> Decision:
        """Load or compute (admission), wait or stop (a load in flight); see the module docstring.

        new: tokens to prefill after `prefix`; hit: the leading ones in L3 (<= new); kept: tokens
        of the hit already loaded and kept if stopped now; fetched: read so far (>= kept, for the
        time left); gpu_backlog: seconds of prefill ahead on the GPU; disk_backlog: seconds of
        loads ahead of this one on the disk; smooth: batches counted fractionally
        (`PrefillModel.predict`), for judging a few tokens at the margin; page: tokens per page
        (a split's tail is whole pages); split_chunk: at admission, weigh
        computing a head in chunks of this many tokens while the disk loads the rest
        (`split`; None: never), whose tail is counted read in gets of split_grain tokens;
        split_park: the request may be held after its head until its tail is read (`split`);
        split_cut: the head may end at any page, the engine cutting its chunk there (`split`).
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
            best = min(t_load, t_compute)
            sp = self.split(new, prefix, hit, chunk=split_chunk, gpu_backlog=gpu_backlog,
                            disk_backlog=disk_backlog, page=page, grain=split_grain,
                            park=split_park, cut=split_cut) if split_chunk else None
            if sp is not None and sp[1] * (1.0 + self.stop_margin) < best:
                head, t_split, got = sp
                how = "then waiting for them" if split_park and got == hit - head else "finishes first"
                return Decision("split", t_split, t_compute, f"computing {head} tokens while the disk reads "
                                f"{got} of the {hit - head} after them {how} (load {t_load:.3f} s)",
                                tokens=head, tail=got)
            if t_load < t_compute:
                return Decision("load", t_load, t_compute, "loading finishes first")
            return Decision("compute", t_load, t_compute, "computing finishes first")
        if t_compute * (1.0 + self.stop_margin) < t_load:
            return Decision("stop", t_load, t_compute, "the load left takes longer than the compute it saves")
        return Decision("wait", t_load, t_compute,
                        "the GPU is busy until then" if gpu_backlog >= t_load_io else "loading still finishes first")

    def split(self, new: int, prefix: int, hit: int, *, chunk: int, gpu_backlog: float = 0.0,
              disk_backlog: float = 0.0, page: int = 1, grain: int | None = None,
              park: bool = False, cut: bool = False) -> tuple[int, float, int] | None:
        """The best head for a split (module docstring): ``(k, t_S, f_k)`` -- the tokens the GPU
        computes first (whole chunks, or with `cut` any whole pages), the forecast finish, and
        the tail tokens forecast to be read when they are joined -- or None where no head leaves
        a tail to read or the rates are unknown. grain: tokens an engine's get reads before any
        of them count (SGLang counts a prefetch's pages a batch of gets at a time; None: page by
        page). park: a head may also wait for its whole tail (``t_P``), whichever finishes
        first. cut: the engine ends the chunk that crosses the head at the head (`split_heads`)."""
        r = self.read.rate
        chunk = int(chunk)
        page = max(1, int(page))
        hit = max(0, min(int(hit), int(new)))
        if r is None or chunk <= 0 or hit <= (page if cut else chunk):
            return None
        per_token_s = self.bytes_per_token * self.pace.factor / r
        heads = split_heads(hit, chunk, page, cut=cut)
        best: tuple[int, float, int] | None = None
        for k in heads:
            t_k = self.predict_compute(k, prefix)
            s_k = self.predict_compute(k - last_chunk(k, chunk), prefix)
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
        if park:
            after = self.predict_compute(new - hit, prefix + hit)
            for k in heads:
                t_k = self.predict_compute(k, prefix)
                tail = (hit - k) // page * page
                if t_k is None or after is None or tail <= 0:
                    continue
                t = max(gpu_backlog + t_k, disk_backlog + tail * per_token_s) + after
                if best is None or t < best[1]:
                    best = (k, t, tail)
        return best

    def estimates(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kv_bytes_per_token": self.bytes_per_token}
        out.update(self.read.snapshot())
        out.update(self.pace.snapshot())
        out.update(self.prefill.snapshot())
        r = self.read.rate
        out["breakeven_prefill_tokens_per_s"] = None if r is None else breakeven_prefill_rate(r, self.bytes_per_token)
        return out

    # -- persistence (`hicache_gds.rates`) -----------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What `save_state` writes: the current estimates, when and from what."""
        return estimates_state(self.read, self.prefill, self.bytes_per_token)

    def seed_from_state(self, st: Mapping[str, Any], *, read: bool = True, prefill: bool = True) -> list[str]:
        """Seed the rates from a persisted `state()`; returns what was seeded (for the log)."""
        return seed_from_state(st, self.read if read else None, self.prefill if prefill else None)
