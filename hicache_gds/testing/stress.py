"""Concurrency: SGLang-like threads plus extra ones on one namespace, and processes sharing GDS_PATH.

`concurrency` runs, for `seconds`, on one `Client` (PageStore or HiCacheGDS):

* SGLang's three storage threads -- backup (put / ``batch_set_v1``), prefetch IO (get /
  ``batch_get_v1``) and prefetch (prefix / ``batch_exists``);
* extra threads: a second writer and reader, a deleter (`PageStore.delete`), a clearer
  (`clear` every couple of seconds), an `exists` poller;
* a watchdog: a thread whose last call is older than `stall_s` is a deadlock (every thread's
  stack is dumped into the result); every second it also checks the index invariants that hold
  mid-flight (no slot handed to two keys, none both used and free);
* every `rest_every` seconds all threads pause and the full invariants are checked at rest
  (pages + free + lost + doomed == slots; the SQLite rows are the in-memory map).

Checks: every hit is byte-exact; no page is lost -- with `evict=False` (capacity above the key
set) a miss of a key whose put was acknowledged before the miss began, and which no delete or
clear could have removed in between, is a lost page.

`two_processes` runs `concurrency` in two processes on one GDS_PATH (two TP ranks: two
namespaces) and checks they never see each other's pages; `same_namespace_shared` shows that a
second opener of one namespace -- another process, or the same process -- shares it.

    python -m hicache_gds.testing.stress --gds-path DIR --seconds 60 [--target sglang] [--rank 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict, deque
from typing import Any, Callable

from .cases import Case
from .clients import Client
from .invariants import index_problems
from .targets import STORE, key

__all__ = ["concurrency", "two_processes", "same_namespace_shared"]

_LANE = 16  # host pages per thread


def _keyset(target: str, n: int) -> list[str]:
    if target != STORE:
        return [key(target, f"stress-{i}") for i in range(n)]
    return [f"stress-{i}" for i in range(n)]


class _History:
    """Acks and removals per key with monotonic times, to tell a lost page from a legal miss."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acks: dict[str, deque] = defaultdict(lambda: deque(maxlen=8))
        self.removals: dict[str, deque] = defaultdict(lambda: deque(maxlen=8))
        self.clears: list[list[float]] = []

    def acked(self, keys: list[str], s: float, e: float) -> None:
        with self.lock:
            for k in keys:
                self.acks[k].append((s, e))

    def removing(self, keys: list[str] | None) -> list[float]:
        """Register a delete of `keys` (None: a clear) *before* it starts; set [1] to its end after."""
        span = [time.monotonic(), float("inf")]
        with self.lock:
            if keys is None:
                self.clears.append(span)
            else:
                for k in keys:
                    self.removals[k].append(span)
        return span

    def describe(self, key: str) -> str:
        with self.lock:
            return (f"acks {[(round(a, 4), round(b, 4)) for a, b in self.acks.get(key, ())]}, removals "
                    f"{[(round(a, 4), round(b, 4)) for a, b in self.removals.get(key, ())]}, last clears "
                    f"{[(round(a, 4), round(b, 4)) for a, b in self.clears[-2:]]}")

    def lost(self, key: str, s: float, e: float) -> bool:
        """Was `key` observed missing during [s, e] although it must have been present?"""
        with self.lock:
            before = [a for a in self.acks.get(key, ()) if a[1] < s]
            if not before:
                return False
            ack_s = before[-1][0]
            for rs, re_ in list(self.removals.get(key, ())) + self.clears:
                if rs < e and re_ > ack_s:
                    return False  # a delete or clear may sit between the put and this miss
            return True


def concurrency(root: str, target: str = "store", *, seconds: float = 10.0, nkeys: int = 384, evict: bool = False,
                extra_threads: bool = True, stall_s: float = 60.0, rest_every: float = 5.0, rank: int = 0,
                salt: str = "", seed: int = 0) -> dict[str, Any]:
    """Hammer one namespace from several threads for `seconds`; returns the figures."""
    threads_spec: list[tuple[str, Callable[..., None]]] = []
    slots = nkeys // 3 if evict else nkeys * 2
    ident = {"model": "stress", "rank": rank}
    c = Client(target, root, slots=slots, engine="nixl-posix", pages=_LANE * 8, identity=ident,
               config={"io_timeout": 20}, sglang={"tp_rank": rank, "tp_size": max(2, rank + 1)}, salt=salt)
    keys = _keyset(target, nkeys)
    hist = _History()
    counts: dict[str, int] = defaultdict(int)
    problems: list[str] = []
    stop, pause = threading.Event(), threading.Event()
    paused = threading.Semaphore(0)
    resume = threading.Event()
    beats: dict[str, float] = {}
    rngs: dict[str, random.Random] = {}

    def note(p: str) -> None:
        if len(problems) < 50:
            problems.append(p)

    def batch(name: str, n: int = _LANE) -> list[str]:
        r = rngs[name]
        if r.random() < 0.5:  # a prefix-like run, as SGLang's page chains are
            a = r.randrange(0, nkeys - n)
            return keys[a:a + n]
        return r.sample(keys, n)

    def put(name: str, lane: int) -> None:
        ks = batch(name)
        s = time.monotonic()
        res = c.put(ks, at=lane * _LANE)
        e = time.monotonic()
        hist.acked([k for k, r in zip(ks, res) if r], s, e)
        counts["put_pages"] += len(ks)
        counts["put_acked"] += sum(res)

    def get(name: str, lane: int) -> None:
        ks = batch(name)
        s = time.monotonic()
        got = c.read(ks, at=lane * _LANE)
        e = time.monotonic()
        counts["get_pages"] += len(ks)
        for k, g in zip(ks, got):
            if g is None:
                if not evict and hist.lost(k, s, e):
                    counts["lost"] += 1
                    note(f"page {k} missing during [{s:.4f}, {e:.4f}] although acknowledged and never deleted or "
                         f"cleared: {hist.describe(k)}")
            elif g != c.expected(k):
                counts["wrong"] += 1
                note(f"page {k} served wrong bytes")
            else:
                counts["hits"] += 1

    def prefix(name: str, lane: int) -> None:
        ks = batch(name)
        s = time.monotonic()
        n = c.prefix(ks)
        e = time.monotonic()
        counts["prefix_calls"] += 1
        if not 0 <= n <= len(ks):
            note(f"prefix returned {n} for {len(ks)} keys")
        elif n < len(ks) and not evict and hist.lost(ks[n], s, e):
            counts["lost"] += 1
            note(f"page {ks[n]} reported absent during [{s:.4f}, {e:.4f}] although acknowledged and never deleted "
                 f"or cleared: {hist.describe(ks[n])}")
        time.sleep(0.001)  # SGLang's prefetch thread polls per request, it does not spin

    def exists(name: str, lane: int) -> None:
        ks = batch(name)
        res = c.exists(ks) if target == "store" else c.store.exists(c.store_keys(ks))
        counts["exists_calls"] += 1
        if len(res) != len(ks):
            note("exists returned the wrong number of results")
        time.sleep(0.001)

    def delete(name: str, lane: int) -> None:
        ks = batch(name, 4)
        span = hist.removing(ks)
        c.store.delete(c.store_keys(ks))
        span[1] = time.monotonic()
        counts["deleted_pages"] += len(ks)
        time.sleep(0.02)

    def clear(name: str, lane: int) -> None:
        time.sleep(rngs[name].uniform(1.0, 3.0))
        if stop.is_set():
            return
        span = hist.removing(None)
        c.clear()
        span[1] = time.monotonic()
        counts["clears"] += 1

    threads_spec = [("backup", put), ("prefetch-io", get), ("prefetch", prefix)]
    if extra_threads:
        threads_spec += [("writer-2", put), ("reader-2", get), ("deleter", delete), ("clearer", clear),
                         ("exists", exists)]
    errors: list[str] = []

    def loop(name: str, fn: Callable[..., None], lane: int) -> None:
        rngs[name] = random.Random(f"{seed}-{name}")
        try:
            while not stop.is_set():
                if pause.is_set():
                    paused.release()
                    resume.wait()
                    continue
                fn(name, lane)
                beats[name] = time.monotonic()
                counts["ops"] += 1
        except Exception:  # noqa: BLE001
            errors.append(f"{name}: {traceback.format_exc()[-1500:]}")
            stop.set()
        finally:
            beats[name] = float("inf")

    stacks: list[str] = []

    def watchdog() -> None:
        while not stop.is_set():
            time.sleep(1.0)
            now = time.monotonic()
            stalled = [n for n, b in beats.items() if now - b > stall_s and not pause.is_set()]
            if stalled:
                frames = sys._current_frames()
                for t in threading.enumerate():
                    f = frames.get(t.ident)
                    if f is not None:
                        stacks.append(f"--- {t.name}\n" + "".join(traceback.format_stack(f)))
                note(f"deadlock: {', '.join(stalled)} made no call for {stall_s:.0f} s")
                counts["deadlocks"] += 1
                stop.set()
                return
            if not pause.is_set():
                for p in index_problems(c.index, at_rest=False, check_db=False):
                    counts["invariant_violations"] += 1
                    note(f"mid-flight: {p}")
            counts["watchdog_checks"] += 1

    workers = []
    t0 = time.monotonic()
    for i, (name, fn) in enumerate(threads_spec):
        beats[name] = time.monotonic()
        workers.append(threading.Thread(target=loop, args=(name, fn, i % 8), name=name, daemon=True))
    dog = threading.Thread(target=watchdog, name="watchdog", daemon=True)
    for t in workers:
        t.start()
    dog.start()
    try:
        while not stop.is_set() and time.monotonic() - t0 < seconds:
            stop.wait(min(rest_every, max(0.0, seconds - (time.monotonic() - t0))))
            if stop.is_set() or time.monotonic() - t0 >= seconds:
                break
            # pause everyone and check the invariants at rest
            resume.clear()
            pause.set()
            got = sum(paused.acquire(timeout=stall_s) for _ in workers)
            if got < len(workers):
                note(f"deadlock: only {got} of {len(workers)} threads reached the rest point in {stall_s:.0f} s")
                counts["deadlocks"] += 1
                stop.set()
            else:
                for p in index_problems(c.index):
                    counts["invariant_violations"] += 1
                    note(f"at rest: {p}")
                counts["rest_checks"] += 1
            pause.clear()
            resume.set()
    finally:
        stop.set()
        resume.set()
        for t in workers:
            t.join(stall_s)
        hung = [t.name for t in workers if t.is_alive()]
        if hung:
            counts["deadlocks"] += 1
            note(f"deadlock: {', '.join(hung)} did not stop")
    elapsed = time.monotonic() - t0
    if not hung:
        for p in index_problems(c.index):
            counts["invariant_violations"] += 1
            note(f"at the end: {p}")
        # every page whose last event was an acknowledged put is there, byte-exact
        if not evict:
            with hist.lock:
                last_clear = max((sp[1] for sp in hist.clears), default=-1.0)
                must = [k for k in keys if hist.acks.get(k) and hist.acks[k][-1][0] > last_clear
                        and not any(r[1] > hist.acks[k][-1][0] for r in hist.removals.get(k, ()))]
            v = c.verify(must)
            counts["final_checked"] = len(must)
            counts["lost"] += v["miss"]
            counts["wrong"] += v["wrong"]
            if v["miss"] or v["wrong"]:
                note(f"at the end: {v['miss']} acknowledged page(s) missing, {v['wrong']} wrong")
        st = c.store.stats()
        counts.update({f"store_{k}": st[k] for k in ("checksum_mismatches", "get_failed", "put_failed", "timeouts",
                                                     "evictions", "lost_slots")})
        c.close()
    out = {"target": target, "seconds": round(elapsed, 1), "threads": [n for n, _ in threads_spec], "evict": evict,
           "rank": rank, "namespace": c.store.namespace, **counts, "errors": errors[:5], "problems": problems[:20],
           "stacks": stacks[:12]}
    for k in ("lost", "wrong", "deadlocks", "invariant_violations"):
        out.setdefault(k, 0)
    out["ok"] = not (out["lost"] or out["wrong"] or out["deadlocks"] or out["invariant_violations"] or errors)
    return out


# -- processes ------------------------------------------------------------------------------------------

def _cmd(root: str, target: str, seconds: float, rank: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "hicache_gds.testing.stress", "--gds-path", root, "--target", target,
            "--seconds", str(seconds), "--rank", str(rank), *extra]


def _env() -> dict[str, str]:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [repo, os.environ.get("PYTHONPATH", "")] if p))


def two_processes(root: str, target: str = "store", *, seconds: float = 10.0) -> dict[str, Any]:
    """Two processes (TP ranks 0 and 1: two namespaces) hammer one GDS_PATH at once; then isolation."""
    procs = [subprocess.Popen(_cmd(root, target, seconds, r, ["--salt", f"rank{r}-"]), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=_env()) for r in (0, 1)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=seconds + 600)
        line = out.strip().splitlines()[-1] if out.strip() else ""
        try:
            results.append(json.loads(line))
        except ValueError:
            results.append({"ok": False, "errors": [f"rc {p.returncode}: {err[-1500:]}"]})
    out: dict[str, Any] = {"ranks": results, "target": target}
    # isolation: each rank's namespace holds only its own bytes, and the namespaces differ
    problems = []
    if all(r.get("namespace") for r in results) and results[0]["namespace"] == results[1]["namespace"]:
        problems.append("the two ranks shared one namespace")
    for r in (0, 1):
        c = Client(target, root, slots=384 * 2, engine="nixl-posix", pages=64, identity={"model": "stress", "rank": r},
                   sglang={"tp_rank": r, "tp_size": 2}, salt=f"rank{r}-")
        try:
            keys = _keyset(target, 384)
            present = [k for k, e in zip(keys, c.exists(keys)) if e]
            v = c.verify(present)
            if v["wrong"]:
                problems.append(f"rank {r}: {v['wrong']} page(s) with another rank's (or wrong) bytes")
            out[f"rank{r}_pages_checked"] = len(present)
            problems.extend(f"rank {r}: {p}" for p in index_problems(c.index))
        finally:
            c.close()
    out["problems"] = problems
    out["ok"] = not problems and all(r.get("ok") for r in results)
    return out


def same_namespace_shared(root: str, target: str = "store") -> Case:
    """A second opener of one namespace shares it: another process, and this process twice. Each
    reads what the other wrote, byte-exact, and the namespace's holders are both listed."""
    from hicache_gds.slabs.owners import holders
    case = Case("concurrency", "second opener of one namespace", target)
    ident = {"model": "stress", "rank": 0}
    sgl = {"tp_rank": 0, "tp_size": 2}
    holder = subprocess.Popen(_cmd(root, target, 0, 0, ["--hold"]), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env())
    try:
        line = holder.stdout.readline().strip()
        if not line.startswith("HOLDING"):
            holder.send_signal(signal.SIGKILL)
            _, err = holder.communicate()
            case.problems.append(f"holder did not start: {line!r} {err[-800:]}")
            return case
        pid = int(line.split()[1])
        held = _keyset(target, 16)  # the holder put these before saying HOLDING
        for who in ("another process", "this process, twice"):
            first = None
            if who == "this process, twice":
                holder.send_signal(signal.SIGKILL)
                holder.wait()
                first = Client(target, root, slots=768, identity=ident, sglang=sgl)
                first.put(held)
                pid = os.getpid()
            try:
                second = Client(target, root, slots=768, identity=ident, sglang=sgl)
            except Exception as exc:  # noqa: BLE001
                case.problems.append(f"{who}: the second opener was refused: {type(exc).__name__}: {exc}")
                continue
            try:
                case.injected += 1
                v = second.verify(held)
                mine = _keyset(target, 24)[16:]
                ok = second.put(mine)
                pids = holders(second.store.dirs[0])
                shared = v == {"good": len(held), "miss": 0, "wrong": 0} and all(ok)
                if first is not None:
                    v2 = first.verify(mine)
                    shared = shared and v2["good"] == len(mine)
                case.check(shared, f"{who}: pages not shared both ways ({v})")
                case.check(pid in pids and os.getpid() in pids, f"{who}: holders {pids} do not name {pid} and us")
                case.caught += shared
                case.outcome += f"{who}: shared ({v['good']}/{len(held)} of its pages read byte-exact, holders {len(pids)}); "
            finally:
                second.close()
                if first is not None:
                    first.close()
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
    return case


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gds-path", required=True)
    ap.add_argument("--target", choices=["store", "sglang"], default="store")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--salt", default="")
    ap.add_argument("--evict", action="store_true")
    ap.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hold:
        c = Client(args.target, args.gds_path, slots=768, identity={"model": "stress", "rank": args.rank},
                   sglang={"tp_rank": args.rank, "tp_size": 2})
        c.put(_keyset(args.target, 16))
        print(f"HOLDING {os.getpid()}", flush=True)
        time.sleep(3600)
        c.close()
        return
    print(json.dumps(concurrency(args.gds_path, args.target, seconds=args.seconds, rank=args.rank, salt=args.salt,
                                 evict=args.evict)))


if __name__ == "__main__":
    main()
