"""Load or recompute: does reading a prefix's chunks from disk beat computing them again?

vLLM asks the manager about one chunk at a time, in prefix order, and stops at the first MISS.
The manager answers HIT only where loading the run of chunks it has found finishes before
recomputing them would, given the IO already queued (`manager.py` does the asking; this module
holds the arithmetic):

    load(k)    = latency + (queued + k * chunk_bytes) / read_rate
    compute(k) = k * chunk_tokens / prefill_rate

`breakeven_chunks` is the smallest k with load(k) <= compute(k): 1 when the disk is idle and
loading a chunk is cheaper than computing it; more when a queue must be waited out first; None
when a chunk reads slower than it computes (then nothing is worth loading). Rates that are not
known yet (no load measured, no prefill rate given or measured) count as "loading wins", the
adapter's behaviour without a model.

`CostModel` is the seam: anything with these four methods can answer (the core's cost model for
SGLang, once it exists, can be pointed at with the extra-config key
``cost_model: "package.module:Class"``). `RateModel` is the minimal one: an exponentially
weighted read rate measured from this engine's own loads, and a prefill rate measured from its
steps (through `HiCacheGDSConnector`) or given (`prefill_tokens_per_s`).
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Mapping, Protocol, runtime_checkable

from hicache_gds import ConfigError

__all__ = ["CostModel", "RateModel", "breakeven_chunks", "cost_model_from"]

# Extra-config keys this module reads (the spec ignores them when building hicache-gds' Config).
KEYS = ("cost_model", "prefill_tokens_per_s", "load_bytes_per_s", "load_latency_s")


@runtime_checkable
class CostModel(Protocol):
    """What the manager asks. Seconds are predictions; None means "not known yet"."""

    def load_seconds(self, nbytes: int, queued_bytes: int) -> float | None:
        """Time until `nbytes` are read, behind `queued_bytes` of IO already queued."""

    def compute_seconds(self, tokens: int) -> float | None:
        """Time to prefill `tokens` tokens."""

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """A load of `nbytes` took `seconds` of service (queueing excluded)."""

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """An engine step computed `tokens` prompt tokens in `seconds`."""


class RateModel:
    """Rates as exponentially weighted means of what was observed (`alpha` per sample), starting
    from the given values (None: unknown until the first observation)."""

    def __init__(self, *, read_bytes_per_s: float | None = None, prefill_tokens_per_s: float | None = None,
                 latency_s: float = 0.0, alpha: float = 0.3, fixed_prefill: bool = False) -> None:
        self.read_rate = read_bytes_per_s
        self.prefill_rate = prefill_tokens_per_s
        self.latency_s = latency_s
        self.alpha = alpha
        self.fixed_prefill = fixed_prefill  # a configured prefill rate is not overridden by measurements
        self.loads = 0
        self.prefills = 0

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def load_seconds(self, nbytes: int, queued_bytes: int) -> float | None:
        if not self.read_rate:
            return None
        return self.latency_s + (queued_bytes + nbytes) / self.read_rate

    def compute_seconds(self, tokens: int) -> float | None:
        if not self.prefill_rate:
            return None
        return tokens / self.prefill_rate

    def observe_load(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.read_rate = self._mix(self.read_rate, nbytes / seconds)
            self.loads += 1

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0 and not self.fixed_prefill:
            self.prefill_rate = self._mix(self.prefill_rate, tokens / seconds)
            self.prefills += 1

    def __repr__(self) -> str:
        rr = f"{self.read_rate / 1e9:.2f} GB/s" if self.read_rate else "unknown"
        pr = f"{self.prefill_rate:.0f} tok/s" if self.prefill_rate else "unknown"
        return f"RateModel(read {rr} from {self.loads} loads, prefill {pr} from {self.prefills} steps)"


def breakeven_chunks(model: CostModel, chunk_tokens: int, chunk_bytes: int, queued_bytes: int,
                     limit: int = 1 << 20) -> int | None:
    """Fewest chunks whose load finishes no later than their recompute; None: never (a chunk reads
    slower than it computes). 1 where a rate is unknown."""
    one_load = model.load_seconds(chunk_bytes, 0)
    one_compute = model.compute_seconds(chunk_tokens)
    if one_load is None or one_compute is None:
        return 1
    fixed = model.load_seconds(0, queued_bytes)  # latency + the queue, paid once
    per_load = one_load - model.load_seconds(0, 0)
    gain = one_compute - per_load  # what each further chunk saves
    if gain <= 0:
        return None
    return max(1, min(limit, math.ceil(fixed / gain - 1e-12)))


def cost_model_from(extra: Mapping[str, Any]) -> CostModel | None:
    """The cost model `kv_connector_extra_config` asks for: `cost_model` "rate" (default),
    "off" (every present chunk is a hit), or "package.module:Class" (built with the extra config)."""
    name = str(extra.get("cost_model", "rate"))
    if name == "off":
        return None
    if name == "rate":
        given = extra.get("prefill_tokens_per_s")
        return RateModel(read_bytes_per_s=_num(extra.get("load_bytes_per_s")), prefill_tokens_per_s=_num(given),
                         latency_s=_num(extra.get("load_latency_s")) or 0.0, fixed_prefill=given is not None)
    mod, _, cls = name.partition(":")
    if not mod or not cls:
        raise ConfigError(f"cost_model: {name!r} is not 'rate', 'off' or 'package.module:Class'")
    model = getattr(importlib.import_module(mod), cls)(extra)
    if not isinstance(model, CostModel):
        raise ConfigError(f"cost_model: {name} lacks load_seconds / compute_seconds / observe_load / observe_prefill")
    return model


def _num(v: Any) -> float | None:
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        x = float("nan")
    if not x > 0:
        raise ConfigError(f"cost model: expected a positive number, got {v!r}")
    return x
