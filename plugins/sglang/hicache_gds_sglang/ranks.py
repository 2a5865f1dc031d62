"""Decisions agreed across a multi-rank server's ranks (TP, PP, attention groups).

Every rank of a TP/PP server runs its own scheduler over its own shard of the KV cache and its
own store, and must take the same scheduling decision at the same scheduler step: a request one
rank loads and another recomputes, or a split tail joined at different lengths, gives the ranks
different batches and the next collective of the model hangs. Each rank decides from what it
observes (its read rate, its reads' progress, its clock), and the ranks then agree through
SGLang's own ``_all_reduce`` on the cache (`view.agree_int`), as SGLang agrees its own prefetch
decisions. The rule that keeps the collectives matched: an agreement is reached only on a path
every rank reaches at the same step, decided by state the ranks share (the waiting queue, the
agreed decisions, the configuration); what differs between ranks (a rate, a read's progress, a
timer, an error) only ever goes *into* an agreement as a vote, never gates one.

Agreed here (and where each is used):

* `seed`: at a policy's first admission (``policy_hooks.around_admit``), the read rate its cost
  model starts from: the slowest of the rates the ranks were seeded with (configured, persisted
  in each rank's namespace, or probed by each rank), so a fresh server's ranks start alike; a
  rank's probe read the device alone, so where every rank's store is on one device it counts
  divided by the ranks that read it at once;
* `split_plan`: after admission's agreed "not a load" (``policy_hooks.around_admit``): whether the
  hit is split (every rank chose to), its head (the longest any rank chose: the tail every rank
  can read) and the tail tokens forecast read by the join (the fewest);
* `all_ok`: whether every rank started its tail (a rank that failed drops it, the others cancel
  theirs: the request is recomputed everywhere);
* `tail`: at a join point or a held request's check (`split_policy.join_tail`, `park`): the tail
  tokens every rank has read (the fewest), whether every rank's tail is still alive and complete,
  and the verdict (join now, wait one chunk, hold: the most cautious vote wins, so a rank whose
  tail read failed or whose hold ran out makes every rank join what all of them read);
* a load in flight (``policy_hooks.around_can_terminate``, through `reduce`): stopped where any
  rank's policy stops it (or SGLang ended it on one rank), ended where every rank read it whole;
* `first_all`: late admission (`policy.LoadOrCompute.late_admit`): the first waiting request
  whose hit every rank can load before its GPU reaches it;
* `ride`: each pass a chunked request takes its next chunk with ``policy_ride`` on (`ride`):
  whether the pass waits a decode step (every rank would, for the same request) and the seats
  finished loads get beside the chunk (each the fewest tokens any rank gives it).
"""

from __future__ import annotations

import hashlib
import socket
from typing import Any, Sequence

from . import view

__all__ = ["multi", "reduce", "readers", "seed", "split_plan", "all_ok", "tail", "first_all", "ride", "JOIN", "WAIT",
           "HOLD"]

JOIN, WAIT, HOLD = 0, 1, 2  # a tail's verdicts, most cautious first (the agreed one is the minimum)


def multi(cache: Any) -> bool:
    """The cache has peers whose decisions must match (the same answer on every rank: from the
    server's configuration)."""
    return not view.single_rank(cache)


def reduce(cache: Any, mins: Sequence[int], maxs: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """`mins` reduced by MIN and `maxs` by MAX over every rank, in one collective (SGLang's
    ``_all_reduce``: PP0's TP ranks reduce, the result travels along PP). Where no collective
    can run, the local values. Every rank must call it at the same step with as many values."""
    values = [int(v) for v in mins] + [-int(v) for v in maxs]
    try:
        import torch
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
                getattr(cache, "_all_reduce", None) is None:
            out = values
        else:
            t = torch.tensor(values, dtype=torch.int64)
            cache._all_reduce(t, torch.distributed.ReduceOp.MIN)
            out = [int(x) for x in t.tolist()]
    except Exception as exc:  # noqa: BLE001 -- never break the scheduler: keep the local values
        view.once("agree", "hicache-gds: could not agree a prefetch decision across ranks (%s); deciding locally", exc)
        out = values
    n = len(mins)
    return out[:n], [-x for x in out[n:]]


def readers(cache: Any) -> int:
    """How many ranks `reduce` combines (SGLang's attention CP and TP groups, else its TP group):
    the ranks that read at once, each its own shard (with MLA, each the one namespace)."""
    n = 1
    for size in view.attention_group_sizes(cache):
        n *= max(1, size or 1)  # unknown: count none (no seed is divided by it)
    return n if n > 1 else max(1, int(getattr(cache, "tp_world_size", 1) or 1))


def _host() -> int:
    return int.from_bytes(hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest(), "little")


def seed(cache: Any, model: Any, device: int | None = None) -> str | None:
    """Seed every rank's read rate (`model`: this rank's `CostModel`, or None) with the slowest
    rate any rank starts from; returns what was seeded, for the log (None: no rank knows one).

    A seed a rank measured alone (`ReadRate.seed_alone`: its probe at open) over-states its rate
    while every rank reads: where every rank's store is on one device (`device`: the st_dev of
    this rank's first store directory, the same on every rank, on one host), such a seed counts
    as its share, divided by the `readers` (a configured or persisted seed counts whole: it was
    set or learnt for the rank as it serves). Ranks on different devices keep the slowest seed."""
    read = getattr(model, "read", None)
    rate = read.rate if read is not None and not read.total_gets else None
    known = round(rate) if rate and rate > 0 else 0
    n = readers(cache)
    alone = bool(known) and read.seed_alone
    share = max(1, round(known / n)) if alone else known
    dev = device % (1 << 62) if device is not None else -1
    host = _host()
    (low, low_share, dev_lo, host_lo), (high, any_alone, dev_hi, host_hi) = reduce(
        cache, [known or 2 ** 62, share or 2 ** 62, dev, host], [known, int(alone), dev, host])
    if not high or read is None:
        return None
    mine = f"this rank's seed: {known / 1e9:.2f} GB/s{', probed alone' if alone else ''}"
    if any_alone and n > 1 and dev_lo >= 0 and dev_lo == dev_hi and host_lo == host_hi and low_share < low:
        read.seed(float(low_share), f"agreed across ranks (a rank's probe, shared by {n} ranks on one device)")
        return (f"read rate {low_share / 1e9:.2f} GB/s, a rank's probe ({low_share * n / 1e9:.2f} GB/s alone) divided "
                f"by {n}: shared by {n} ranks on one device ({mine})")
    read.seed(float(low), "agreed across ranks (the slowest rank's seed)")
    why = " (not divided: the ranks' stores are not on one device)" if any_alone and n > 1 and low_share < low else ""
    return f"read rate {low / 1e9:.2f} GB/s ({mine}){why}"


def split_plan(cache: Any, plan: Any) -> tuple[int, int] | None:
    """(head, expected tail tokens) of the split every rank takes, or None where some rank does
    not split. `plan`: this rank's `records.SplitPlan`, or None."""
    has = plan is not None and plan.head > 0
    (ok, expect), (head,) = reduce(cache, [int(has), int(plan.expect) if has else 0],
                                   [int(plan.head) if has else 0])
    return (head, expect) if ok and head > 0 else None


def all_ok(cache: Any, ok: bool) -> bool:
    """Whether `ok` holds on every rank."""
    return bool(reduce(cache, [int(bool(ok))])[0][0])


def tail(cache: Any, read: int, complete: bool, alive: bool, verdict: int) -> tuple[int, bool, bool, int]:
    """(tail tokens every rank read, every rank's tail complete, every rank's tail alive, the
    agreed verdict: `JOIN`, `WAIT` or `HOLD`)."""
    (r, c, a, v), _ = reduce(cache, [int(read), int(bool(complete)), int(bool(alive)), int(verdict)])
    return r, bool(c), bool(a), v


VOTES = 8  # candidates one agreement looks at (the first of the waiting queue's)


def first_all(cache: Any, names: Sequence[str], votes: Sequence[bool]) -> int | None:
    """The first of the candidates `names` every rank voted for, or None. The ranks' candidate
    lists are the same by construction (the waiting queue, the agreed decisions); they are
    checked (their count and a digest, in the same collective) and nothing is picked where they
    differ, so a rank's stale view can cost a late admission, never a mismatched collective."""
    n = min(len(names), VOTES)
    digest = _digest(names[:n])
    padded = [int(bool(v)) for v in votes[:n]] + [0] * (VOTES - n)
    mins, maxs = reduce(cache, [n, digest, *padded], [n, digest])
    if mins[:2] != maxs:
        view.once("late-differ", "hicache-gds policy: ranks saw different waiting requests to give the disk; no "
                  "late admission at that step")
        return None
    return next((i for i, v in enumerate(mins[2:2 + n]) if v), None)


def _digest(names: Sequence[str]) -> int:
    return int.from_bytes(hashlib.blake2b("\0".join(names).encode(), digest_size=7).digest(), "little")


def ride(cache: Any, names: Sequence[str], hold_at: int | None, seats: Sequence[int]) -> tuple[int | None, list[int]]:
    """(the position among `names` of the request every rank waits a decode step for, or None;
    per position the seat every rank gives it: the fewest tokens, 0 where a rank gives none).
    `names`: the first `VOTES` waiting requests (the same on every rank, checked as in
    `first_all`: where they differ, neither); `hold_at`, `seats`: this rank's plan."""
    n = min(len(names), VOTES)
    padded = [int(v) for v in seats[:n]] + [0] * (VOTES - n)
    at = -1 if hold_at is None or hold_at >= n else int(hold_at)
    digest = _digest(names[:n])
    mins, maxs = reduce(cache, [n, digest, at, *padded], [n, digest, at])
    if mins[:2] != maxs[:2]:
        view.once("ride-differ", "hicache-gds policy: ranks saw different waiting requests beside a chunk; no ride "
                  "at that step")
        return None, [0] * n
    agreed = mins[2] if mins[2] >= 0 and mins[2] == maxs[2] else None
    return agreed, ([0] * n if agreed is not None else mins[3:3 + n])
