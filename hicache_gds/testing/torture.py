"""kill -9 torture at scale, through the PageStore and through SGLang's backend (`HiCacheGDS`).

    python -m hicache_gds.testing.torture --gds-path DIR --target store --mode put --rounds 100
    python -m hicache_gds.testing.torture --gds-path DIR --target sglang --mode evict,clear --rounds 50
    python -m hicache_gds.testing.torture --gds-path DIR --recovery-pages 1000000

Extends `hicache_gds.testing.crash` (same page bytes, derived from each key, and the same rules)
in three ways:

* **targets**: ``store`` puts through `PageStore.put`; ``sglang`` builds `HiCacheGDS` with a
  mimic SGLang host pool through SGLang's own `StorageBackendFactory` and writes with
  ``batch_set_v1`` (zero-copy from the pool's slots), cycling MHA page_first / MHA layer_first /
  MLA page_first_direct pools over the rounds;
* **aimed kills**: besides kills after a random delay, ``--aimed`` of the rounds are killed within
  a few milliseconds of the worker announcing an eviction-time put (``evict``) or a clear
  (``clear``), so kills land inside eviction and inside clear, not only between them;
* **stricter checks** after every restart (`_check`): every acknowledged page present and
  byte-exact -- in ``evict`` runs the most recent (slots - batch) acknowledged pages, since the
  in-flight put may evict at most one batch; in ``clear`` runs the pages acknowledged since the
  last completed clear, no cleared page back, and a clear cut by the kill all-or-nothing; every
  page the index reports present read back byte-exact (a torn or unknown page counts against
  us); the index invariants (`invariants.index_problems`); the index recovery and open time.

Workers and checkers are forked from this process after the heavy imports (SGLang takes ~10 s to
import on the 2-core CI machine), so a round costs a store open, not an interpreter start. This
process itself never opens a store: run the torture in its own interpreter (the CLI), not inside
a test process that holds NIXL agents.

`recovery_at_scale` builds an index of N entries (1M by default) by publishing rows in big
batches into a real namespace, then times `PageStore` opens: clean, and after a kill -9 that
left the WAL un-checkpointed. Per open: ``open_s`` (the whole constructor), ``recovery_s`` (index
open until lookups are served, `Index.recovery_s`), ``loaded_s`` (until the in-memory map is in
place and writes proceed, `Index.loaded_s`) and ``lookup_s`` (one `exists` right after the open,
answered from SQLite while the map loads).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .clients import Client, expected
from .forking import _fork, _Lines, _preload, _read_until_eof, fork_call
from .targets import STORE, key

__all__ = ["Plan", "run_torture", "recovery_at_scale", "fork_call"]

TARGETS = ("store", "sglang")
MODES = ("put", "evict", "clear")


@dataclass
class Plan:
    """One torture run: `rounds` kill -9 rounds of `mode` through `target`."""

    target: str = "store"
    mode: str = "put"
    rounds: int = 10
    batch: int = 16
    page: int = 64 << 10
    """Page bytes (store target; the SGLang target's pages come from the pool shape)."""
    capacity_pages: int = 0
    """Slots per namespace; 0: 8192 (put/clear: no eviction), 48 for evict runs."""
    max_delay: float = 1.0
    aimed: float = 0.5
    """Share of evict/clear rounds killed right at an eviction-time put or a clear."""
    engine: str = "nixl-posix"
    clear_every: int = 8
    seed: int = 0

    def slots(self) -> int:
        return self.capacity_pages or (48 if self.mode == "evict" else 8192)


@dataclass
class Totals:
    target: str
    mode: str
    engine: str
    rounds: int = 0
    kills: int = 0
    aimed_kills: int = 0
    kills_mid_put: int = 0
    """The worker's last word was "T" (a put had started and not returned)."""
    kills_mid_evicting_put: int = 0
    """... and that put had to evict (the namespace was full)."""
    kills_mid_clear: int = 0
    """The worker's last word was "C" (a clear had started and not returned)."""
    acked_pages: int = 0
    required_pages: int = 0
    acked_lost: int = 0
    torn_served: int = 0
    present_checked: int = 0
    cleared_back: int = 0
    clear_not_atomic: int = 0
    invariant_violations: int = 0
    worker_errors: int = 0
    recovery_s: list[float] = field(default_factory=list)
    open_s: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("recovery_s", "open_s"):
            v = d.pop(k)
            d[f"max_{k}"] = max(v) if v else 0.0
            d[f"p50_{k}"] = statistics.median(v) if v else 0.0
        d["problems"] = d["problems"][:20]
        d["ok"] = not (self.acked_lost or self.torn_served or self.cleared_back or self.clear_not_atomic
                       or self.invariant_violations or self.worker_errors)
        return d


# -- targets ---------------------------------------------------------------------------------------

def _key(plan: Plan, rnd: int, i: int) -> str:
    if plan.target != STORE:
        return key(plan.target, f"torture-r{rnd}-p{i}")
    return f"r{rnd}-p{i}"


def _client(gds_path: str, plan: Plan, rnd: int, pages: int) -> Client:
    return Client(plan.target, gds_path, page=plan.page, slots=plan.slots(), engine=plan.engine, pages=pages,
                  shape=rnd, identity={"model": "torture"})


def _worker(w: int, gds_path: str, plan: Plan, rnd: int) -> None:
    def emit(s: str) -> None:
        os.write(w, s.encode())

    t = _client(gds_path, plan, rnd, plan.batch)
    emit("READY\n")
    i = n = 0
    while True:
        if plan.mode == "clear" and n % plan.clear_every == plan.clear_every - 1:
            emit("C\n")
            t.clear()
            emit("D\n")
        keys = [_key(plan, rnd, i + j) for j in range(plan.batch)]
        emit(f"T {i}\n")
        res = t.put(keys)
        acked = [k for k, r in zip(keys, res) if r]
        if acked:
            emit("".join(f"A {k}\n" for k in acked))
        i += plan.batch
        n += 1


# -- check after restart -----------------------------------------------------------------------------

def _check(gds_path: str, plan: Plan, rnd: int, events: list[tuple[str, str]]) -> dict[str, Any]:
    from .invariants import index_problems
    t0 = time.perf_counter()
    t = _client(gds_path, plan, rnd, 64)
    open_s = time.perf_counter() - t0
    try:
        attempted: list[str] = []
        acked: list[str] = []
        for kind, arg in events:
            if kind == "T":
                attempted.extend(_key(plan, rnd, int(arg) + j) for j in range(plan.batch))
            elif kind == "A":
                acked.append(arg)
        by_store_key = dict(zip(t.store_keys(attempted), attempted))
        t.index.wait_loaded()
        present_store = t.index.keys()
        phantom = [k for k in present_store if k not in by_store_key]
        present = [by_store_key[k] for k in present_store if k in by_store_key]
        present_set = set(present)
        problems: list[str] = []
        if phantom:
            problems.append(f"round {rnd}: {len(phantom)} page(s) present that no worker put")

        # What must be present, and what must not be.
        cleared_back = not_atomic = 0
        marks = [i for i, (k, _) in enumerate(events) if k in ("C", "D")]
        acked_pos = [(i, a) for i, (k, a) in enumerate(events) if k == "A"]
        if plan.mode == "clear" and marks:
            last = marks[-1]
            if events[last][0] == "D":  # the last clear finished: only later pages must be there
                required = [a for i, a in acked_pos if i > last]
                gone = [a for i, a in acked_pos if i < last]
                cleared_back = sum(1 for a in gone if a in present_set)
            else:  # killed inside a clear: it happened entirely or not at all
                prev_d = marks[-2] if len(marks) > 1 else -1
                cut = [a for i, a in acked_pos if prev_d < i < last]
                gone = [a for i, a in acked_pos if i < prev_d]
                cleared_back = sum(1 for a in gone if a in present_set)
                n_there = sum(1 for a in cut if a in present_set)
                if n_there not in (0, len(cut)):
                    not_atomic = 1
                    problems.append(f"round {rnd}: clear cut by the kill left {n_there} of {len(cut)} pages")
                required = []
            if cleared_back:
                problems.append(f"round {rnd}: {cleared_back} cleared page(s) came back")
        elif plan.mode == "evict":
            keep = max(0, t.index.nslots - plan.batch)
            required = acked[len(acked) - keep:] if keep else []
        else:
            required = acked
        lost = [k for k in required if k not in present_set]
        if lost:
            problems.append(f"round {rnd}: {len(lost)} acknowledged page(s) lost, e.g. {lost[0]}")

        torn = len(phantom)
        for a in range(0, len(present), 64):
            chunk = present[a:a + 64]
            for k, got in zip(chunk, t.read(chunk)):
                if got is None or got != expected(k, t.page):
                    torn += 1
                    problems.append(f"round {rnd}: page {k} reported present but "
                                    f"{'unreadable' if got is None else 'served wrong bytes'}")
        inv = index_problems(t.index)
        problems.extend(f"round {rnd}: {p}" for p in inv)
        t.clear()  # the next round starts empty: its keys are new
        return {"acked": len(acked), "required": len(required), "lost": len(lost), "torn": torn,
                "present": len(present_store), "cleared_back": cleared_back, "not_atomic": not_atomic,
                "invariants": len(inv), "recovery_s": float(t.index.recovery_s), "open_s": open_s,
                "problems": problems}
    finally:
        t.close()


def run_torture(gds_path: str, plan: Plan, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the plan's kill -9 rounds; returns the totals (`Totals.summary`)."""
    if plan.target not in TARGETS or plan.mode not in MODES:
        raise ValueError(f"target must be one of {TARGETS} and mode one of {MODES}")
    _preload(plan.target)
    rng = random.Random(plan.seed)
    tot = Totals(plan.target, plan.mode, plan.engine)
    full_after = plan.slots() // plan.batch + 1  # first put that must evict
    for rnd in range(plan.rounds):
        pid, fd = _fork(_worker, gds_path, plan, rnd)
        lines = _Lines(fd)
        first = lines.next(180.0)
        if first != "READY":
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            rest = [first or ""] + lines.rest()
            raise RuntimeError(f"torture worker did not start: {' '.join(rest)[-2000:]}")
        aimed = plan.mode in ("evict", "clear") and rng.random() < plan.aimed
        events: list[tuple[str, str]] = []
        died = None
        if aimed:
            # Kill within 0-3 ms (clear: 0-0.5 ms) of the k-th eviction-time put (evict) or clear (clear) starting.
            k = rng.randint(1, 4)
            seen = 0
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                ln = lines.next(deadline - time.monotonic())
                if ln is None:
                    died = "exited before the aimed kill"
                    break
                kind, _, arg = ln.partition(" ")
                events.append((kind, arg))
                if kind == "ERR":
                    died = arg
                    break
                hit = (kind == "C") if plan.mode == "clear" else (kind == "T" and int(arg) // plan.batch >= full_after)
                if hit:
                    seen += 1
                    if seen == k:
                        # a clear is one SQLite transaction of a few ms: aim inside it
                        time.sleep(rng.uniform(0, 0.0005 if plan.mode == "clear" else 0.003))
                        break
            tot.aimed_kills += 1
        else:
            deadline = time.monotonic() + rng.uniform(0.05, plan.max_delay)
            while True:
                ln = lines.next(max(0.0, deadline - time.monotonic()))
                if ln is None:
                    if lines.eof:
                        died = "exited before the kill"
                    break
                kind, _, arg = ln.partition(" ")
                events.append((kind, arg))
                if kind == "ERR":
                    died = arg
                    break
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        for ln in lines.rest():
            kind, _, arg = ln.partition(" ")
            events.append((kind, arg))
            if kind == "ERR":
                died = arg
        tot.rounds += 1
        tot.kills += 1
        last = next((e for e in reversed(events) if e[0] in ("T", "A", "C", "D")), ("", ""))
        if last[0] == "T":
            tot.kills_mid_put += 1
            if int(last[1]) // plan.batch >= full_after and plan.mode == "evict":
                tot.kills_mid_evicting_put += 1
        elif last[0] == "C":
            tot.kills_mid_clear += 1
        if died:
            tot.worker_errors += 1
            tot.problems.append(f"round {rnd}: worker failed: {died[:500]}")
        res = fork_call(_check, gds_path, plan, rnd, events, timeout=600)
        tot.acked_pages += res["acked"]
        tot.required_pages += res["required"]
        tot.acked_lost += res["lost"]
        tot.torn_served += res["torn"]
        tot.present_checked += res["present"]
        tot.cleared_back += res["cleared_back"]
        tot.clear_not_atomic += res["not_atomic"]
        tot.invariant_violations += res["invariants"]
        tot.recovery_s.append(res["recovery_s"])
        tot.open_s.append(res["open_s"])
        tot.problems.extend(res["problems"])
        if log is not None and (rnd + 1) % 10 == 0:
            log(f"{plan.target}/{plan.mode}: {rnd + 1}/{plan.rounds} rounds, {tot.acked_pages} acked, "
                f"{tot.acked_lost} lost, {tot.torn_served} torn")
    return tot.summary()


# -- recovery at scale -----------------------------------------------------------------------------

_SCALE_SUFFIX = "_meta-llama-Llama-3.1-8B_0_1"


def _scale_key(i: int) -> str:
    return f"{i:064x}{_SCALE_SUFFIX}"


def _build_index(gds_path: str, n: int, page: int, batch: int) -> dict[str, Any]:
    from hicache_gds import PageStore
    t0 = time.perf_counter()
    with PageStore(page, {"model": "recovery-scale"},
                   config={"gds_path": gds_path, "capacity": n * page, "preallocate": False,
                           "engine": "bounce"}) as s:
        idx = s.index
        slots = idx.reserve(n)
        if len(slots) != n:
            raise RuntimeError(f"reserved {len(slots)} of {n} slots")
        for a in range(0, n, batch):
            items = [(_scale_key(i), slots[i], page, 1 + i) for i in range(a, min(n, a + batch))]
            idx.publish(items)
        pages = len(idx)
    return {"build_s": time.perf_counter() - t0, "pages": pages}


def _open_timed(gds_path: str, n: int, page: int, kill_after_publish: int) -> dict[str, Any]:
    from hicache_gds import PageStore

    from .invariants import index_problems
    t0 = time.perf_counter()
    s = PageStore(page, {"model": "recovery-scale"},
                  config={"gds_path": gds_path, "capacity": n * page, "preallocate": False, "engine": "bounce"})
    open_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    seen = s.exists([_scale_key(0), "absent"])  # served at once, from SQLite while the map loads
    lookup_s = time.perf_counter() - t1
    while_loading = s.index.loaded_s is None
    if not s.index.wait_loaded(600):
        raise RuntimeError("the index map did not load")
    out = {"open_s": open_s, "recovery_s": s.index.recovery_s, "loaded_s": s.index.loaded_s, "lookup_s": lookup_s,
           "lookup_while_loading": while_loading, "pages": len(s.index),
           "problems": [] if seen == [True, False] else [f"lookup right after open answered {seen}"]}
    if kill_after_publish:
        # Rewrite the newest rows (drop + publish again) and die without a checkpoint: the next open
        # replays a WAL of `kill_after_publish` fresh rows on top of the n-row database.
        idx = s.index
        idx._wdb.execute("PRAGMA wal_autocheckpoint=0")  # leave every row in the WAL
        victims = [k for (k,) in idx._rdb.execute("SELECT key FROM pages ORDER BY atime DESC LIMIT ?",
                                                   (kill_after_publish,))]
        idx.drop(victims)
        slots = idx.reserve(len(victims))
        idx.publish([(k, sl, page, 7) for k, sl in zip(victims, slots)])
        os.kill(os.getpid(), signal.SIGKILL)
    out["problems"] += index_problems(s.index, check_db=False)
    s.close()
    return out


def recovery_at_scale(gds_path: str, n: int = 1_000_000, page: int = 4096, batch: int = 100_000,
                      repeats: int = 3) -> dict[str, Any]:
    """Build an index of `n` pages, then time opens: clean (`repeats` of them, medians) and after a kill -9."""
    _preload("store")
    built = fork_call(_build_index, gds_path, n, page, batch, timeout=1800)
    clean = [fork_call(_open_timed, gds_path, n, page, 0, timeout=600) for _ in range(repeats)]
    # kill -9 with a WAL holding fresh rows; the child dies, so run it by hand.
    pid, fd = _fork(lambda w: _open_timed(gds_path, n, page, 50_000))
    _read_until_eof(fd, 600)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    after = fork_call(_open_timed, gds_path, n, page, 0, timeout=600)
    out: dict[str, Any] = {"pages": built["pages"], "build_s": built["build_s"]}
    for k in ("open_s", "recovery_s", "loaded_s", "lookup_s"):
        out[f"clean_{k}"] = statistics.median(r[k] for r in clean)
    for k in ("open_s", "recovery_s", "loaded_s", "lookup_s"):
        out[f"clean_{k}_all"] = [r[k] for r in clean]
    for k in ("open_s", "recovery_s", "loaded_s", "lookup_s", "pages"):
        out[f"after_kill_{k}"] = after[k]
    out["lookups_while_loading"] = sum(r["lookup_while_loading"] for r in clean + [after])
    out["killed"] = killed
    out["problems"] = [p for r in clean + [after] for p in r["problems"]]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gds-path", required=True)
    ap.add_argument("--target", choices=TARGETS, default="store")
    ap.add_argument("--mode", default="put", help="put, evict or clear, or several comma-separated")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--page", type=int, default=64 << 10)
    ap.add_argument("--capacity-pages", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=1.0)
    ap.add_argument("--aimed", type=float, default=0.5)
    ap.add_argument("--engine", default="nixl-posix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recovery-pages", type=int, default=0, help="measure index recovery at this many pages instead")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.recovery_pages:
        print(json.dumps(recovery_at_scale(args.gds_path, args.recovery_pages)))
        return
    say = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    out = []
    for mode in args.mode.split(","):  # several modes: one interpreter start (SGLang takes ~10 s to import)
        plan = Plan(target=args.target, mode=mode, rounds=args.rounds, batch=args.batch, page=args.page,
                    capacity_pages=args.capacity_pages, max_delay=args.max_delay, aimed=args.aimed,
                    engine=args.engine, seed=args.seed)
        out.append(run_torture(args.gds_path, plan, say))
    print(json.dumps(out[0] if len(out) == 1 else out))


if __name__ == "__main__":
    main()
