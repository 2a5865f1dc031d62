"""The policy's state as named records: what was decided per request, and what it watches.

Decisions are values (`Decided`, `SplitPlan`); what a load, a queued request, a protected load
or a split's tail carries while the policy watches it is one record each, keyed by request id
in `policy.LoadOrCompute`'s tables.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Decided", "LoadWatch", "Queued", "Protected", "RoomWait", "SplitPlan", "Tail", "DiskSlot", "Backlog",
           "TailLoad"]


class Decided(NamedTuple):
    """A request's decision: ``load``, ``wait`` (a load kept in flight), ``compute`` or ``split``,
    with the request's tokens to prefill (`new`) and held (`held`) when decided, and the tokens
    of its hit loaded (`hit`; for ``split``: the head computed)."""

    action: str
    new: int
    held: int
    hit: int

    @property
    def loads(self) -> bool:
        return self.action in ("load", "wait")


@dataclass
class LoadWatch:
    """A load admitted: when, the seconds forecast for its reads, the kept tokens seen at the last
    look and when that was, the load pace when admitted (NaN: admitted before this policy), and
    when its progress was last checked (a check that finds nothing new is no look)."""

    since: float
    io_s: float = 0.0
    seen: float = -1.0
    last_look: float = 0.0
    pace: float = math.nan
    last_check: float = 0.0


@dataclass
class Queued:
    """A decided request in the waiting queue: it, and when it was first and last seen there."""

    req: Any
    first: float
    last: float


class Protected(NamedTuple):
    """A finished load's host pages protected from eviction: the node, since when, its tokens."""

    node: Any
    since: float
    tokens: int


class RoomWait(NamedTuple):
    """A request held until the host pool has room for its load (`room`): until when at most,
    the tokens its hit needs, and since when."""

    until: float
    hit: int
    since: float


class SplitPlan(NamedTuple):
    """A split decided at admission, until its tail starts: head tokens computed, tail tokens
    forecast read by the join, and the hit."""

    head: int
    expect: int
    hit: int


class Tail(NamedTuple):
    """A split's tail in flight (`split.TailLoad`) and its request (it may leave meanwhile)."""

    load: Any
    req: Any


class DiskSlot(NamedTuple):
    """A load on the disk's queue: seconds until its last page lands (loads run one after
    another), its hit, tokens kept and tokens fetched so far."""

    ready_s: float
    hit: int
    kept: int
    fetched: int


class Backlog(NamedTuple):
    """The GPU backlog of one scheduler pass: the queue it was summed for, the seconds of prefill
    ahead of each queued request (by rid; "" : the whole queue), and when."""

    key: tuple
    ahead: dict
    at: float


@dataclass
class TailLoad:
    """The tail of one request's hit in flight: tokens ``[start, end)`` of the request (absolute
    positions), read by prefetch operations, one after another, under ``keys`` in
    ``cache.ongoing_prefetch`` (in token order); ``key`` is the tail's radix key."""

    rid: str
    keys: tuple[str, ...]
    key: Any
    start: int
    end: int
    expect: int  # tail tokens admission forecast to be read when they are joined
    since: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> int:
        return self.end - self.start
