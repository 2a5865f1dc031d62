"""The rates the cost model (`hicache_gds.costmodel`) decides with, and how they outlive a process.

* `ReadRate`: the store's read rate ``R`` (bytes/s), from the bytes and seconds of its recent
  gets, seeded before the first get by a configured or persisted estimate;
* `PrefillModel`: the engine's prefill cost ``C(n, p) = a*n + b*n*(p + n/2) + c*k``, fitted on the
  prefill batches it ran (the formula and what each term means: `hicache_gds.costmodel`);
* `LoadPace`: how much longer loads take in the engine than ``R`` forecasts.

Persistence: `estimates_state` is what `save_state` writes (atomically) to `STATE_FILE` in an
adapter's namespace directory, `load_state` reads it back, and `seed_from_state` seeds a fresh
`ReadRate` and `PrefillModel` from it -- measured estimates only, never a seed seeded again.
Thread-safe throughout: rates are observed on an engine's IO thread and read on its scheduler's.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import threading
import time
from collections import deque
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = ["ReadRate", "PrefillModel", "LoadPace", "STATE_FILE", "estimates_state", "seed_from_state", "seed_read_rate",
           "SEED_KEYS", "SEED_ALIASES", "seed_settings",
           "load_state", "save_state"]

STATE_FILE = "costmodel.json"
"""File name of the persisted estimates (in an adapter's namespace directory)."""

_PRIOR_WEIGHT = 256 << 20  # a seeded read rate counts as this many bytes of observed gets
_MIN_BATCH_S = 1e-4
_STATE_VERSION = 1

_log = logging.getLogger("hicache_gds.rates")


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
        self._prior_alone = False
        self._prior_weight = float(prior_weight)
        self.total_bytes = 0
        self.total_gets = 0
        if prior:
            self.seed(prior, source or "configured")

    def seed(self, bytes_per_s: float, source: str, *, alone: bool = False) -> None:
        """Set the estimate used before (and blended with) measured gets; `source` says where it
        came from. `alone`: it was measured by this reader alone (a probe at open), so it
        over-states what each of several readers of the same device gets while they read at once
        (a configured rate, or one learnt from gets and persisted, is not)."""
        if not bytes_per_s or not math.isfinite(bytes_per_s) or bytes_per_s <= 0:
            raise ValueError(f"a read rate must be a positive number of bytes/s, got {bytes_per_s!r}")
        with self._lock:
            self._prior, self._prior_source, self._prior_alone = float(bytes_per_s), source, bool(alone)

    @property
    def seed_alone(self) -> bool:
        """The seed was measured by this reader alone (`seed`'s `alone`)."""
        with self._lock:
            return self._prior is not None and self._prior_alone

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


# -- persistence -----------------------------------------------------------------------------------

def estimates_state(read: ReadRate, prefill: PrefillModel, bytes_per_token: float) -> dict[str, Any]:
    """What `save_state` writes: the current estimates, when and from what."""
    coef, source = prefill.coefficients()
    return {"version": _STATE_VERSION, "saved_at": time.time(), "kv_bytes_per_token": bytes_per_token,
            "read_bytes_per_s": read.rate, "read_source": read.source,
            "prefill_coefficients": None if coef is None else list(coef), "prefill_source": source,
            "prefill_chunk": prefill.chunk}


def seed_from_state(st: Mapping[str, Any], read: ReadRate | None, prefill: PrefillModel | None) -> list[str]:
    """Seed `read` and `prefill` (None: leave it) from a persisted `estimates_state`, where it
    holds measured values of this version; returns what was seeded (for the log)."""
    done: list[str] = []
    try:
        if int(st.get("version", 0)) != _STATE_VERSION:
            return done
        age = max(0.0, time.time() - float(st.get("saved_at", 0)))
        when = f"persisted {age / 3600:.1f} h ago" if age >= 3600 else f"persisted {age:.0f} s ago"
        r = st.get("read_bytes_per_s")
        if read is not None and r and float(r) > 0 and str(st.get("read_source", "")).startswith("measured"):
            read.seed(float(r), when)
            done.append(f"read rate {float(r) / 1e9:.2f} GB/s ({when})")
        c = st.get("prefill_coefficients")
        if prefill is not None and c and len(c) == 3 and str(st.get("prefill_source", "")).startswith("measured"):
            prefill.seed_coefficients(float(c[0]), float(c[1]), float(c[2]), when)
            chunk = st.get("prefill_chunk")
            if prefill.chunk is None and isinstance(chunk, int) and chunk > 0:
                prefill.chunk = chunk
            done.append(f"prefill coefficients ({when})")
    except (TypeError, ValueError):
        return done
    return done


# The cost model's seeds in an adapter's extra config, one set of keys for every adapter: the
# store's read rate (bytes/s) and the engine's prefill rate (tokens/s of an 8k-token request).
SEED_KEYS = ("read_bytes_per_s", "prefill_tokens_per_s")
# Earlier per-adapter names, still accepted (a deprecation line is logged): name -> (key, factor).
SEED_ALIASES: dict[str, tuple[str, float]] = {
    "policy_read_gbps": ("read_bytes_per_s", 1e9),  # SGLang adapter, GB/s
    "load_bytes_per_s": ("read_bytes_per_s", 1.0),  # vLLM adapter
    "policy_prefill_tokens_per_s": ("prefill_tokens_per_s", 1.0),  # SGLang adapter
}


_DEPRECATED_SEEN: set[str] = set()


def seed_settings(extra: Mapping[str, Any] | None) -> dict[str, float]:
    """The seeds `extra` gives, by `SEED_KEYS` (absent keys left out). An old name of
    `SEED_ALIASES` counts as its key, converted, with one deprecation line logged (once per name
    and process); a key given under two names with different values, or a value that is not a
    positive number, is a `ConfigError` naming it."""
    from .errors import ConfigError

    extra = extra or {}
    out: dict[str, float] = {}
    given: dict[str, str] = {}
    for name in (*SEED_KEYS, *SEED_ALIASES):
        v = extra.get(name)
        if v is None or v == "":
            continue
        key, factor = (name, 1.0) if name in SEED_KEYS else SEED_ALIASES[name]
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = float("nan")
        if not x > 0:
            raise ConfigError(f"{name}: expected a positive number, got {v!r}")
        x *= factor
        if key in out and not math.isclose(out[key], x, rel_tol=1e-9):
            raise ConfigError(f"{name} and {given[key]} give {key} twice, differently ({x:g} vs {out[key]:g}); "
                              f"keep {key}")
        if name not in SEED_KEYS and name not in _DEPRECATED_SEEN:  # once per name and process
            _DEPRECATED_SEEN.add(name)
            _log.warning("hicache-gds: extra-config key %s is deprecated; use %s (%s)", name, key,
                         "bytes/s" if key == "read_bytes_per_s" else "tokens/s")
        out.setdefault(key, x)
        given.setdefault(key, name)
    return out


def seed_read_rate(read: ReadRate, *, configured: float | None = None, key: str = "",
                   state: Mapping[str, Any] | None = None, dirs: Sequence[str] = (), probe_bytes: int = 0) -> str:
    """Seed `read` before its first measurement, one way for every adapter: `configured` bytes/s
    (given by the adapter's setting `key`), else a rate an earlier run measured and persisted
    (`state`, from `load_state`), else an O_DIRECT read of `probe_bytes` from each of `dirs` now
    (`hicache_gds.probe`; 0: none), so that a fresh store's first decisions weigh a load against
    a real rate rather than loading blind. Returns what was done, in words, for the log."""
    if configured:
        read.seed(float(configured), f"configured ({key})" if key else "configured")
        return f"read rate {float(configured) / 1e9:.2f} GB/s, configured ({key})"
    seeded = seed_from_state(state or {}, read, None)
    if seeded:
        return seeded[0]
    if not probe_bytes:
        return "no read rate known before the first get (read_probe is 0)"
    from .probe import probe_read_rate
    got, why = probe_read_rate(dirs, nbytes=probe_bytes)
    if got is None:
        return f"no read rate known before the first get ({why})"
    read.seed(got.bytes_per_s, got.source, alone=True)  # this process alone read the device
    return f"read rate {got.bytes_per_s / 1e9:.2f} GB/s, {got.source}, in {got.seconds:.2f} s"


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
