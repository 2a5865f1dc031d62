"""kill -9 torture of one namespace written by several processes at once.

    python -m hicache_gds.testing.torture_mp --gds-path DIR --writers 3 --kills 200 [--mode put|evict]

`--writers` processes (forked from this one after the heavy imports) open the same namespace and
loop: put a batch of pages -- half of the keys their own, half drawn from a small pool every
writer puts, so the same key is often put by several processes at once -- and read back a few
pages they saw acknowledged (leases in flight). Page bytes derive from each key
(`crash.page_bytes_of`), so whoever stored a key, any copy read back can be checked.

The parent kills one writer at a time with SIGKILL after a random delay and starts a new one in
its place, so kills land in puts, reads, evictions and reclaims of the others' dead; after each
kill a checker process joins the namespace while the survivors keep writing. Every few kills
(an *epoch*) it kills every writer left, and a checker opens the namespace as its first opener
(the full recovery path), checks, and clears it for the next epoch. Checks:

* **lost**: every page a writer acknowledged is present and byte-exact (``put`` mode, whose
  capacity holds every page of an epoch; ``evict`` mode evicts, so only the next rules apply);
* **torn or wrong**: every page the index names reads back byte-exact (a page evicted between the
  listing and the read is a miss, never wrong bytes);
* **two keys in one slot, slot accounting** (`invariants.index_problems`, in one read
  transaction: it holds whatever the survivors do);
* **leaked reservations**: no reservation or lease of a dead writer is left once a process has
  joined (live checks) or reopened (epoch ends) the namespace.

Prints one JSON line with the totals.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .clients import Client, expected
from .forking import _fork, _Lines, _preload, fork_call

__all__ = ["MPPlan", "run_mp_torture"]


@dataclass
class MPPlan:
    writers: int = 3
    kills: int = 20
    mode: str = "put"
    batch: int = 16
    page: int = 16 << 10
    shared_keys: int = 256
    """Size of the pool of keys every writer puts (the rest of a batch is the writer's own)."""
    epoch: tuple[int, int] = (3, 8)
    """Kills per epoch (random in this range, the last one killing every writer left)."""
    max_delay: float = 0.6
    engine: str = "nixl-posix"
    seed: int = 0

    def slots(self) -> int:
        # put: every page of the longest epoch fits (about 40 batches a second per writer here);
        # evict: a few batches per writer, so puts evict, and reserve while others hold slots.
        return 48 * self.writers * self.batch // 2 if self.mode == "evict" else 65536


@dataclass
class MPTotals:
    mode: str
    writers: int
    kills: int = 0
    epochs: int = 0
    live_checks: int = 0
    kills_mid_put: int = 0
    kills_mid_read: int = 0
    acked_pages: int = 0
    acked_shared: int = 0
    required_pages: int = 0
    acked_lost: int = 0
    present_checked: int = 0
    torn_served: int = 0
    two_keys_one_slot: int = 0
    invariant_violations: int = 0
    leaked_reservations: int = 0
    reclaimed_slots: int = 0
    worker_errors: int = 0
    recovery_s: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        v = d.pop("recovery_s")
        d["max_recovery_s"] = max(v) if v else 0.0
        d["p50_recovery_s"] = statistics.median(v) if v else 0.0
        d["problems"] = d["problems"][:20]
        d["ok"] = not (self.acked_lost or self.torn_served or self.two_keys_one_slot or self.invariant_violations
                       or self.leaked_reservations or self.worker_errors)
        return d


def _client(gds_path: str, plan: MPPlan, pages: int = 64) -> Client:
    return Client("store", gds_path, page=plan.page, slots=plan.slots(), engine=plan.engine, pages=pages,
                  identity={"model": "torture-mp"}, config={"preallocate": False})


def _writer(w: int, gds_path: str, plan: MPPlan, tag: str, seed: int) -> None:
    def emit(s: str) -> None:
        os.write(w, s.encode())

    rng = random.Random(seed)
    c = _client(gds_path, plan, plan.batch)
    emit("READY\n")
    acked: list[str] = []
    i = 0
    while True:
        half = plan.batch // 2
        keys = [f"s{rng.randrange(plan.shared_keys)}" for _ in range(half)]
        keys = list(dict.fromkeys(keys)) + [f"{tag}-{i + j}" for j in range(plan.batch - len(set(keys)))]
        emit("T\n")
        res = c.put(keys)
        got = [k for k, r in zip(keys, res) if r]
        if got:
            emit("".join(f"A {k}\n" for k in got))
            acked += got
        i += plan.batch
        if acked and rng.random() < 0.5:
            pick = rng.sample(acked[-256:], min(4, len(acked)))
            emit("R\n")
            for k, g in zip(pick, c.read(pick)):
                if g is not None and g != expected(k, plan.page):
                    emit(f"W {k}\n")  # wrong bytes served to a writer
            emit("D\n")


def _check(gds_path: str, plan: MPPlan, acked: list[str], must: bool, first: bool) -> dict[str, Any]:
    """Join (survivors alive) or reopen (none alive) the namespace and check it; clear it after a reopen."""
    from .invariants import index_problems
    t0 = time.perf_counter()
    c = _client(gds_path, plan)
    open_s = time.perf_counter() - t0
    try:
        problems: list[str] = []
        st = c.store.stats()
        lost = [k for k, p in zip(acked, c.exists(acked)) if not p] if must else []
        if lost:
            problems.append(f"{len(lost)} acknowledged page(s) lost, e.g. {lost[0]}")
        present = c.index.keys()
        torn = 0
        for a in range(0, len(present), 64):
            chunk = present[a:a + 64]
            for k, got in zip(chunk, c.read(chunk)):
                if got is not None and got != expected(k, plan.page):
                    torn += 1
                    problems.append(f"page {k} served wrong bytes")
                elif got is None and (first or must):
                    torn += 1  # nothing evicts or deletes here: a present page must read back
                    problems.append(f"page {k} reported present but unreadable")
        inv = index_problems(c.index, at_rest=True, check_db=first)
        two = sum(1 for p in inv if "two keys" in p or "twice" in p)
        leaked = sum(1 for p in inv if "leaked" in p)
        problems += inv
        if first:
            st2 = c.store.stats()
            if st2["reserved_slots_all"] or st2["leased_slots_all"] or st2["doomed_slots"]:
                leaked += 1
                problems.append(f"after recovery: {st2['reserved_slots_all']} reserved, {st2['leased_slots_all']} "
                                f"leased, {st2['doomed_slots']} doomed slot(s) left")
            c.clear()
        return {"lost": len(lost), "present": len(present), "torn": torn, "two": two, "leaked": leaked,
                "invariants": len(inv), "reclaimed": st["reclaimed_slots"], "open_s": open_s,
                "recovery_s": float(c.index.recovery_s), "problems": problems[:10]}
    finally:
        c.close()


class _W:
    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self.lines, self.last = pid, _Lines(fd), ""


def run_mp_torture(gds_path: str, plan: MPPlan, log: Any = None) -> dict[str, Any]:
    """Run the plan; returns the totals (`MPTotals.summary`)."""
    if plan.mode not in ("put", "evict"):
        raise ValueError("mode must be put or evict")
    _preload("store")
    rng = random.Random(plan.seed)
    tot = MPTotals(plan.mode, plan.writers)
    acked: dict[str, None] = {}
    nstarted = 0

    def start() -> _W:
        nonlocal nstarted
        nstarted += 1
        pid, fd = _fork(_writer, gds_path, plan, f"w{nstarted}", plan.seed * 100003 + nstarted)
        w = _W(pid, fd)
        first = w.lines.next(180.0)
        if first != "READY":
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise RuntimeError(f"writer did not start: {' '.join([first or ''] + w.lines.rest())[-2000:]}")
        return w

    def absorb(w: _W, lines: list[str]) -> None:
        for ln in lines:
            kind, _, arg = ln.partition(" ")
            if kind == "A":
                acked[arg] = None
                tot.acked_pages += 1
                tot.acked_shared += arg.startswith("s")
            elif kind == "W":
                tot.torn_served += 1
                tot.problems.append(f"a writer was served wrong bytes for {arg}")
            elif kind == "ERR":
                tot.worker_errors += 1
                tot.problems.append(f"writer failed: {arg[:500]}")
            if kind in ("T", "R", "D", "A"):
                w.last = kind

    def drain(ws: list[_W], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            ready, _, _ = select.select([w.lines.fd for w in ws if not w.lines.eof], [], [], left)
            for w in ws:
                if w.lines.fd in ready:
                    b = os.read(w.lines.fd, 1 << 16)
                    if not b:
                        w.lines.eof = True
                    w.lines.buf += b
                    *done, w.lines.buf = w.lines.buf.split(b"\n")
                    absorb(w, [x.decode(errors="replace") for x in done])

    def kill(w: _W) -> None:
        try:
            os.kill(w.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(w.pid, 0)
        absorb(w, w.lines.rest())
        tot.kills += 1
        tot.kills_mid_put += w.last == "T"
        tot.kills_mid_read += w.last == "R"

    def account(res: dict[str, Any]) -> None:
        tot.acked_lost += res["lost"]
        tot.torn_served += res["torn"]
        tot.two_keys_one_slot += res["two"]
        tot.leaked_reservations += res["leaked"]
        tot.invariant_violations += res["invariants"]
        tot.present_checked += res["present"]
        tot.reclaimed_slots += res["reclaimed"]
        tot.problems.extend(res["problems"])

    must = plan.mode == "put"
    ws: list[_W] = []
    while tot.kills < plan.kills:
        tot.epochs += 1
        acked.clear()
        ws = [start() for _ in range(plan.writers)]
        n = rng.randint(*plan.epoch)
        for _ in range(n - 1):
            if tot.kills >= plan.kills - len(ws):
                break
            drain(ws, rng.uniform(0.05, plan.max_delay))
            victim = ws.pop(rng.randrange(len(ws)))
            kill(victim)
            drain(ws, 0.0)
            keys = list(acked)
            res = fork_call(_check, gds_path, plan, keys, must, False, timeout=600)
            tot.live_checks += 1
            tot.required_pages += len(keys) if must else 0
            account(res)
            ws.append(start())
        drain(ws, rng.uniform(0.05, plan.max_delay))
        for w in ws:
            kill(w)
        ws = []
        keys = list(acked)
        res = fork_call(_check, gds_path, plan, keys, must, True, timeout=600)
        tot.required_pages += len(keys) if must else 0
        tot.recovery_s.append(res["recovery_s"])
        account(res)
        if log is not None:
            log(f"mp/{plan.mode}: {tot.kills}/{plan.kills} kills, {tot.acked_pages} acked, {tot.acked_lost} lost, "
                f"{tot.torn_served} torn, {tot.leaked_reservations} leaked")
    return tot.summary()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gds-path", required=True)
    ap.add_argument("--writers", type=int, default=3)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--mode", default="put", help="put or evict, or both comma-separated")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-delay", type=float, default=0.6)
    ap.add_argument("--engine", default="nixl-posix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    say = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    out = [run_mp_torture(args.gds_path, MPPlan(writers=args.writers, kills=args.kills, mode=m, batch=args.batch,
                                                 max_delay=args.max_delay, engine=args.engine, seed=args.seed), say)
           for m in args.mode.split(",")]
    print(json.dumps(out[0] if len(out) == 1 else out))


if __name__ == "__main__":
    main()
