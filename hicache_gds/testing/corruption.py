"""Damage a namespace's files, with the store closed and while it is open, and see what it serves.

Slab damage: flipped bytes in some pages, the slab file truncated, the slab file deleted.
Index damage: random bytes over the SQLite file, the file truncated (to a third, to zero), its WAL
deleted after a kill -9 (committed rows not yet checkpointed) or while open, its -shm deleted.

Each case writes pages whose bytes derive from their keys, damages, then reads everything back
and checks: no wrong bytes ever; damaged pages read as misses and are dropped (no longer
reported present); untouched pages still served; fresh puts and re-puts of damaged pages work;
the index invariants hold; a damaged index is reset with a log line; nothing raises (through
SGLang's `HiCacheGDS`, not even at attach).

    python -m hicache_gds.testing.corruption --gds-path DIR [--target sglang]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

from .cases import Case, capture_logs, guarded
from .clients import Client
from .invariants import index_problems
from .targets import STORE, key

__all__ = ["corruption_cases", "CASES"]

CASES = ("slab-flip", "slab-truncate", "slab-delete", "index-garbage", "index-truncate", "index-empty",
         "wal-delete", "shm-delete")
_NPAGES = 48


def _keys(target: str, tag: str, n: int, start: int = 0) -> list[str]:
    if target != STORE:
        return [key(target, f"{tag}-{i}") for i in range(start, start + n)]
    return [f"{tag}-{i}" for i in range(start, start + n)]


def _open(target: str, d: str, engine: str) -> Client:
    return Client(target, d, slots=256, engine=engine, pages=64, shape=0, identity={"model": "corruption"})


def _places(c: Client, keys: list[str]) -> dict[str, tuple[str, int]]:
    """key -> (slab path, byte offset of its slot)."""
    out = {}
    for k, sk in zip(keys, c.store_keys(keys)):
        e = c.index.peek([sk]).get(sk)
        if e is None:
            continue
        fi, off = c.store.slabs.place(np.array([e.slot]))
        out[k] = (c.store.slabs.paths[int(fi[0])], int(off[0]))
    return out


def _flip(path: str, offset: int, page: int, rng: random.Random) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        for _ in range(3):
            at = offset + rng.randrange(page)
            b = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([b[0] ^ 0xFF]), at)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _garbage(path: str, rng: random.Random) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        for at in range(0, max(size, 4096), 4096):
            f.seek(at)
            f.write(rng.randbytes(4096))
        f.flush()
        os.fsync(f.fileno())


def _crash_writer(target: str, d: str, engine: str, keys: list[str]) -> None:
    """Put `keys` in a child process and kill -9 it: committed index rows stay in the WAL."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "hicache_gds.testing.corruption", "--writer", "--gds-path", d,
                          "--target", target, "--engine", engine, "--keys", json.dumps(keys)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline().strip()
        if line != "DONE":
            raise RuntimeError(f"crash writer failed: {line} {p.stderr.read()[-2000:]}")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()


def _victims_and_damage(name: str, c: Client | None, d_state: dict[str, Any], rng: random.Random) -> list[str]:
    """Apply slab/index damage `name`; returns the keys whose page bytes were destroyed."""
    places, page, db = d_state["places"], d_state["page"], d_state["db"]
    keys = list(places)
    if name == "slab-flip":
        victims = rng.sample(keys, 6)
        for k in victims:
            _flip(places[k][0], places[k][1], page, rng)
        return victims
    if name == "slab-truncate":
        path = next(iter(places.values()))[0]
        offs = sorted(off for _, off in places.values())
        cut = offs[len(offs) // 2]  # pages at or beyond the middle slot are gone
        os.truncate(path, cut)
        return [k for k, (_, off) in places.items() if off + page > cut]
    if name == "slab-delete":
        os.unlink(next(iter(places.values()))[0])
        return keys if c is None else []  # open: the store still holds the deleted inode
    if name == "index-garbage":
        _garbage(db, rng)
    elif name == "index-truncate":
        os.truncate(db, os.path.getsize(db) // 3)
    elif name == "index-empty":
        os.truncate(db, 0)
    elif name in ("wal-delete", "shm-delete"):
        suffix = "-wal" if name == "wal-delete" else "-shm"
        if os.path.exists(db + suffix):
            os.unlink(db + suffix)
    return []


def _run_case(root: str, target: str, engine: str, name: str, state: str, seed: int) -> Case:
    case = Case("corruption", f"{name} ({state})", target)
    d = os.path.join(root, f"{target}-{name}-{state}")
    os.makedirs(d, exist_ok=True)
    rng = random.Random(seed)
    keys = _keys(target, "page", _NPAGES)
    fresh = _keys(target, "fresh", 8)
    c: Client | None = None
    with capture_logs(logging.WARNING) as logs:
        try:
            if name == "wal-delete" and state == "closed":
                # committed rows only in the WAL: a writer killed -9 before any checkpoint
                _crash_writer(target, d, engine, keys)
                dbs = [os.path.join(d, n, "index.sqlite3") for n in os.listdir(d) if n.startswith("ns-")]
                st = {"places": {}, "page": 0, "db": dbs[0]}
            else:
                c = _open(target, d, engine)
                with guarded(case, "put"):
                    case.check(all(c.put(keys)), "setup put failed")
                st = {"places": _places(c, keys), "page": c.page, "db": c.index.db_path}
                if state == "closed":
                    c.close()
                    c = None
            victims = _victims_and_damage(name, c, st, rng)
            if c is None:
                with guarded(case, "open after damage"):
                    c = _open(target, d, engine)
                if c is None:
                    return case
            elif not name.startswith("slab"):  # open index: keep writing through the damage first
                with guarded(case, "put after damage"):
                    c.put(_keys(target, "during", 8))
            _verify(case, c, keys, victims, fresh, name)
            # a restart after the damage must be clean too
            c.close()
            c = None
            with guarded(case, "reopen"):
                c = _open(target, d, engine)
            if c is not None:
                with guarded(case, "read after reopen"):
                    v = c.verify(keys + fresh)
                    case.wrong_bytes += v["wrong"]
                    case.check(v["wrong"] == 0, f"after reopen {v['wrong']} page(s) served wrong bytes")
                case.problems.extend(index_problems(c.index))
        except Exception as exc:  # noqa: BLE001
            case.exceptions += 1
            case.problems.append(f"{type(exc).__name__}: {exc}")
        finally:
            if c is not None:
                try:
                    c.close()
                except Exception as exc:  # noqa: BLE001
                    case.problems.append(f"close raised {type(exc).__name__}: {exc}")
    text = logs.text()
    if (name.startswith("index") or name == "wal-delete") and state == "closed":
        said = "damaged" in text or "starting the namespace empty" in text
        case.check(said, "the index was damaged or lost but no log line says so")
    case.outcome = _outcome(case, name, state, text)
    return case


def _verify(case: Case, c: Client, keys: list[str], victims: list[str], fresh: list[str], name: str) -> None:
    vset = set(victims)
    case.injected = len(victims) if name.startswith("slab") else len(keys)
    with guarded(case, "exists before read"):
        case.stale_present = sum(c.exists(victims)) if name in ("slab-truncate", "slab-delete") else 0
    with guarded(case, "read after damage"):
        got = c.read(keys)
        for k, g in zip(keys, got):
            want = _expected(k, c.page)
            if g is not None and g != want:
                case.wrong_bytes += 1
            if k in vset:
                case.caught += g is None
            else:
                case.served_total += 1
                case.served_ok += g == want
        if not name.startswith("slab"):
            case.caught = sum(1 for g in got if g is None)
        case.check(case.wrong_bytes == 0, f"{case.wrong_bytes} page(s) served wrong bytes")
        case.check(case.caught == len(victims) or not name.startswith("slab"),
                   f"{len(victims) - case.caught} damaged page(s) served")
        if name.startswith("slab"):
            case.check(case.served_ok == case.served_total,
                       f"{case.served_total - case.served_ok} of {case.served_total} undamaged page(s) not served")
    with guarded(case, "exists after damage"):
        still = [k for k, e in zip(victims, c.exists(victims)) if e]
        case.check(not still, f"{len(still)} damaged page(s) still reported present after a failed read")
    with guarded(case, "fresh put"):
        ok = c.put(fresh)
        v = c.verify(fresh)
        case.check(all(ok) and v["good"] == len(fresh), f"fresh puts after damage: {sum(ok)} acked, "
                                                         f"{v['good']} of {len(fresh)} read back")
    if victims:
        with guarded(case, "re-put damaged"):
            c.put(victims)
            v = c.verify(victims)
            case.check(v["good"] == len(victims), f"{len(victims) - v['good']} damaged page(s) could not be "
                                                  f"written again (still unreadable)")
    case.problems.extend(index_problems(c.index))


def _expected(key: str, n: int) -> bytes:
    from .clients import expected
    return expected(key, n)


def _outcome(case: Case, name: str, state: str, logs: str) -> str:
    bits = []
    if name.startswith("slab"):
        if case.injected:
            bits.append(f"{case.caught}/{case.injected} damaged pages read as misses")
        if case.stale_present:
            bits.append(f"{case.stale_present} of them reported present until read")
        if case.served_total:
            bits.append(f"{case.served_ok}/{case.served_total} untouched served")
    else:
        bits.append(f"{case.caught} of {_NPAGES} pages lost with the index (misses), {_NPAGES - case.caught} still "
                    f"served")
        if "damaged" in logs:
            bits.append("index moved aside and reset (logged)")
        elif "lost" in logs:
            bits.append("index loss logged")
    bits.append(f"wrong bytes {case.wrong_bytes}, exceptions {case.exceptions}")
    return "; ".join(bits)


def corruption_cases(root: str, target: str = "store", engine: str = "nixl-posix", *, states=("closed", "open"),
                     names=CASES, seed: int = 0) -> list[Case]:
    """Run every damage case on a fresh namespace under `root`; returns the case records."""
    return [_run_case(root, target, engine, name, state, seed + i) for i, name in enumerate(names)
            for state in states]


def _writer(args: argparse.Namespace) -> None:
    c = _open(args.target, args.gds_path, args.engine)
    keys = json.loads(args.keys)
    c.index._wdb.execute("PRAGMA wal_autocheckpoint=0")  # nothing leaves the WAL
    c.put(keys)
    print("DONE", flush=True)
    time.sleep(3600)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gds-path", required=True)
    ap.add_argument("--target", choices=["store", "sglang"], default="store")
    ap.add_argument("--engine", default="nixl-posix")
    ap.add_argument("--writer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--keys", default="[]", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.writer:
        _writer(args)
        return
    cases = corruption_cases(args.gds_path, args.target, args.engine)
    print(json.dumps([c.as_dict() for c in cases], indent=1))


if __name__ == "__main__":
    main()
