"""The ``compute_or_load`` policy's settings: the ``policy*`` keys of the backend's extra config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from hicache_gds import SEED_KEYS, ConfigError, parse_bool, parse_size, seed_settings

__all__ = ["POLICY", "SGLANG_POLICIES", "FALLBACK", "POLICY_KEYS", "REMOVED_KEYS", "SPLIT_MODES", "PolicyConfig",
           "check_removed"]

POLICY = "compute_or_load"
SGLANG_POLICIES = ("best_effort", "wait_complete", "timeout")
FALLBACK = "timeout"  # SGLang's default: what our name turns into where the policy cannot run
# The cost model's seeds are the core's keys (`hicache_gds.SEED_KEYS`: read_bytes_per_s,
# prefill_tokens_per_s), as for every adapter; policy_read_gbps and policy_prefill_tokens_per_s are
# their deprecated names here (`hicache_gds.SEED_ALIASES`), still accepted.
POLICY_KEYS = ("policy", *SEED_KEYS, "policy_read_gbps", "policy_prefill_tokens_per_s", "policy_host_fraction",
               "policy_stop_margin", "policy_split", "policy_split_get", "policy_split_park", "policy_split_cut", "policy_idle_wait_ms",
               "policy_room_wait", "policy_ride")
# Keys of settings measured not to pay in a running server and removed (`benchmarks/RESULTS.md`,
# runs 9, 10 and 26): passing one is an error naming it, as an unknown key is.
REMOVED_KEYS = {
    "policy_read_slice": "sliced gets lowered a running server's read rate; a stopped load now ends between "
                         "SGLang's batches of pages",
    "policy_partial": "loading part of a hit did not pay (run 9); a hit is loaded whole or recomputed",
    "policy_ready_first": "moving finished loads ahead acted on 1-5 loads per run and did not pay (run 10)",
    "policy_late_split": "splitting a request late, once the disk ran dry, acted on one request in nine bursts "
                         "and did not pay (run 26)",
}
SPLIT_MODES = ("idle", "always", "off")  # `PolicyConfig.split`


def _positive(value: Any, key: str) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number > 0, got {value!r}") from None
    if not f > 0 or not math.isfinite(f):
        raise ConfigError(f"{key}: expected a number > 0, got {value!r}")
    return f


def _mode(value: Any, key: str, *, true: str) -> str:
    """One of `SPLIT_MODES`; a boolean spelling means `true` or ``off``."""
    v = str(value).strip().lower()
    v = {"false": "off", "0": "off", "no": "off", "true": true, "1": true, "yes": true}.get(v, v)
    if v not in SPLIT_MODES:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(SPLIT_MODES)}")
    return v


def check_removed(extra: Mapping[str, Any] | None) -> None:
    """Raise `ConfigError` naming a removed key (`REMOVED_KEYS`) found in `extra`."""
    for key in sorted(set(extra or {}) & set(REMOVED_KEYS)):
        raise ConfigError(f"{key} was removed ({REMOVED_KEYS[key]}); delete it from the extra config")


@dataclass(frozen=True)
class PolicyConfig:
    """The policy's settings, from the backend's extra config (``policy*`` keys).

    policy: ``compute_or_load`` or one of SGLang's policies, applied at attach (as the flag would
    be); None leaves the flag's choice. read_gbps / prefill_tokens_per_s: seeds used until the
    server has measured its own (they win over a persisted estimate), from the core's keys
    ``read_bytes_per_s`` / ``prefill_tokens_per_s`` (`hicache_gds.seed_settings`; the old
    ``policy_read_gbps`` / ``policy_prefill_tokens_per_s`` still accepted, with a deprecation line). host_fraction: share of the
    host pool prefetches may hold. stop_margin: how much sooner stopping must finish before a
    load in flight is stopped.
    split: when a hit may be split, its head computed on the GPU while the disk loads its tail
    (`split`; SGLang 0.5.17, agreed across ranks; elsewhere never), where that finishes the request first:
    ``idle`` (the default: only while no load is on the disk), ``always`` (``true``) or ``off``.
    Measured on an H200 (the same server and run, against ``off``; runs 12-13): one at a time a
    request alone is faster than both its load and its recompute (32B shape: 0.83x the mean TTFT,
    0.66-0.68x the recompute of 21k-25k-token prefixes; 8B: 0.90x), a burst of 8 0.84-0.90x the
    makespan; at the 8B open loop's knee ``always`` made the TTFT p90 0.67x recompute's against
    ``idle``'s 0.76x, but it splits inside bursts too, where whole loads serve better (makespan
    1.10-1.12x ``idle``'s). split_get: bytes per get of a split's tail
    (0: SGLang's own gets of 128 pages): the tail is prefetched as operations of that many bytes
    of pages, each counted when its get returns, so the part of a tail read by the time the
    chunks reach it joins (`split.tail_pages`). Each get returns once its pages are verified, so
    small gets read slower where checksums are slow (a 2-core machine: 128 MiB gets at 0.42-0.51x
    the rate of 1 GiB gets; an H200's 16 cores kept up with the forecast). split_park: a split
    request may be held after its head until its whole tail is read (the GPU runs whatever else
    waits meanwhile), where that finishes it first (`split_policy.park`; where the scheduler has
    the point to hold it at). split_cut: a split's head may end at any page, SGLang's chunk that
    crosses it cut there (`cut`); off, heads are whole chunks. idle_wait_ms: on a scheduler pass that ran nothing while this
    backend reads for waiting requests, the scheduler waits up to this long for the next read to
    return instead of spinning on the GIL the reads need (`idle`; every prefetch policy; 0: off).
    room_wait: a load turned down only because the host pool is full waits for room, held in the
    waiting queue while loading still finishes first, instead of being recomputed (`room`; agreed
    across ranks). ride: finished loads ride along a chunked request's passes, a pass held for a
    decode step where that gives a waiting load its GPU memory (`ride`; agreed across ranks; off by
    default until it is measured in a running server)."""

    policy: str | None = None
    read_gbps: float | None = None
    prefill_tokens_per_s: float | None = None
    host_fraction: float = 0.75
    stop_margin: float = 0.05
    split: str = "idle"
    split_get: int = 128 << 20
    split_park: bool = True
    split_cut: bool = True
    idle_wait_ms: float = 2.0
    room_wait: bool = True
    ride: bool = False

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "PolicyConfig":
        extra = extra or {}
        check_removed(extra)
        kw: dict[str, Any] = {}
        if "policy" in extra:
            p = str(extra["policy"]).strip()
            if p not in (POLICY, *SGLANG_POLICIES):
                raise ConfigError(f"policy: {p!r} is not one of {', '.join((POLICY, *SGLANG_POLICIES))}")
            kw["policy"] = p
        seeds = seed_settings(extra)
        if "read_bytes_per_s" in seeds:
            kw["read_gbps"] = seeds["read_bytes_per_s"] / 1e9
        if "prefill_tokens_per_s" in seeds:
            kw["prefill_tokens_per_s"] = seeds["prefill_tokens_per_s"]
        if "policy_host_fraction" in extra:
            f = _positive(extra["policy_host_fraction"], "policy_host_fraction")
            if f > 1:
                raise ConfigError(f"policy_host_fraction: expected a fraction in (0, 1], got {f}")
            kw["host_fraction"] = f
        if "policy_stop_margin" in extra:
            try:
                m = float(extra["policy_stop_margin"])
            except (TypeError, ValueError):
                m = -1.0
            if not 0 <= m < 10:
                raise ConfigError(f"policy_stop_margin: expected a number in [0, 10), got {extra['policy_stop_margin']!r}")
            kw["stop_margin"] = m
        if "policy_split" in extra:
            kw["split"] = _mode(extra["policy_split"], "policy_split", true="always")
        if "policy_split_get" in extra:
            kw["split_get"] = parse_size(extra["policy_split_get"], key="policy_split_get")
        if "policy_split_park" in extra:
            kw["split_park"] = parse_bool(extra["policy_split_park"], "policy_split_park")
        if "policy_split_cut" in extra:
            kw["split_cut"] = parse_bool(extra["policy_split_cut"], "policy_split_cut")
        if "policy_room_wait" in extra:
            kw["room_wait"] = parse_bool(extra["policy_room_wait"], "policy_room_wait")
        if "policy_ride" in extra:
            kw["ride"] = parse_bool(extra["policy_ride"], "policy_ride")
        if "policy_idle_wait_ms" in extra:
            try:
                w = float(extra["policy_idle_wait_ms"])
            except (TypeError, ValueError):
                w = -1.0
            if not 0 <= w <= 100:
                raise ConfigError(f"policy_idle_wait_ms: expected milliseconds in [0, 100], got "
                                  f"{extra['policy_idle_wait_ms']!r}")
            kw["idle_wait_ms"] = w
        return cls(**kw)
