"""Resource faults: EIO, hangs and slow IO (`FaultyEngine`), a full disk (small tmpfs), and SGLang's
own failure injector around our backend (the `sglang` target's harness brings that one).

In every case the pages the fault touches come back False, everything else keeps working, and
service resumes once the fault clears. `FaultyEngine` reaches `HiCacheGDS` through the engine
registry: ``engine: "faulty-nixl-posix"`` (or ``faulty-bounce``) in the extra config builds the
wrapped engine, whose faults `set_faults` changes for every live instance.

    python -m hicache_gds.testing.faults --gds-path DIR [--target sglang]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import time
from typing import Iterator

from ..engines import create_engine, register_engine
from ..engines.base import EngineOptions, Op
from ..engines.faulty import Faults, FaultyEngine
from .cases import Case, guarded
from .clients import Client, expected
from .invariants import index_problems
from .targets import STORE, harness, key

__all__ = ["fault_cases", "set_faults", "FaultyNixlPosix", "FaultyBounce", "small_tmpfs", "fill_filesystem"]

_live: list[FaultyEngine] = []
_current = Faults()


class _Registered(FaultyEngine):
    inner_name = ""

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(create_engine(self.inner_name, options), _current)
        _live.append(self)

    def close(self) -> None:
        super().close()
        if self in _live:
            _live.remove(self)


class FaultyNixlPosix(_Registered):
    """`nixl-posix` wrapped in `FaultyEngine` (faults from `set_faults`)."""
    inner_name = "nixl-posix"


class FaultyBounce(_Registered):
    """`bounce` wrapped in `FaultyEngine` (faults from `set_faults`)."""
    inner_name = "bounce"


register_engine("faulty-nixl-posix", f"{__name__}:FaultyNixlPosix")
register_engine("faulty-bounce", f"{__name__}:FaultyBounce")


def set_faults(faults: Faults | None) -> dict[str, int]:
    """Give every live faulty engine (and the next ones) `faults`; None heals. Returns injections so far."""
    global _current
    _current = faults or Faults()
    total = {"eio": 0, "hang": 0, "delay": 0}
    for e in list(_live):
        e.set(_current)  # the same faults, the same sequence of victims
        for k in total:
            total[k] += e.injected[k]
    return total


def _injected() -> dict[str, int]:
    total = {"eio": 0, "hang": 0, "delay": 0}
    for e in list(_live):
        for k in total:
            total[k] += e.injected[k]
    return total


def _keys(target: str, tag: str, n: int) -> list[str]:
    return [key(target, f"{tag}-{i}") for i in range(n)]


# -- EIO / hang / delay -----------------------------------------------------------------------------

def _engine_case(root: str, target: str, name: str, faults: Faults, *, batches: int = 12, batch: int = 8,
                 io_timeout: float = 0.5) -> Case:
    case = Case("faults", name, target)
    d = os.path.join(root, f"{target}-{name.replace(' ', '-')}")
    os.makedirs(d, exist_ok=True)
    set_faults(None)
    c = Client(target, d, slots=512, engine="faulty-nixl-posix", pages=batch, identity={"model": "faults"},
               config={"io_timeout": io_timeout})
    try:
        base = _keys(target, f"{name}-base", 16)
        with guarded(case, "setup put"):
            case.check(all(c.put(base)), "setup puts failed before any fault")
        keys = _keys(target, f"{name}-k", batches * batch)
        before = _injected()
        set_faults(faults)
        t0 = time.perf_counter()
        if faults.only is not Op.READ:  # write faults: put under the fault
            with guarded(case, "put under fault"):
                res = c.put(keys)
                bad = [k for k, r in zip(keys, res) if not r]
                case.injected = len(bad)
                present = c.exists(bad)
                case.caught = len(bad) - sum(present)
                case.check(not any(present), f"{sum(present)} failed put(s) visible")
                good = [k for k, r in zip(keys, res) if r]
        else:
            set_faults(None)
            with guarded(case, "setup put"):
                case.check(all(c.put(keys)), "setup puts failed")
            set_faults(faults)
            good = []
        with guarded(case, "read under fault"):
            got = c.read(base + (keys if faults.only is Op.READ else good))
            want = [expected(k, c.page) for k in base + (keys if faults.only is Op.READ else good)]
            case.wrong_bytes = sum(1 for g, w in zip(got, want) if g is not None and g != w)
            misses = sum(1 for g in got if g is None)
            if faults.only is Op.READ:
                case.injected = misses
                case.caught = misses
                case.check(all(c.exists(keys)), "a page whose read failed transiently was dropped")
            else:
                case.served_total = len(got)
                case.served_ok = len(got) - misses
        elapsed = time.perf_counter() - t0
        inj = {k: v - before[k] for k, v in _injected().items()}
        set_faults(None)  # the fault clears: service must resume
        with guarded(case, "after heal"):
            ok = c.put(keys)
            v = c.verify(base + keys)
            case.check(all(ok) and v["good"] == len(base) + len(keys),
                       f"after the fault cleared: {sum(ok)}/{len(keys)} puts, {v['good']}/{len(base) + len(keys)} "
                       f"reads good")
        case.check(case.wrong_bytes == 0, f"{case.wrong_bytes} page(s) served wrong bytes")
        st = c.store.stats()
        case.problems.extend(index_problems(c.index))
        requests = sum(inj.values())
        case.check(requests > 0 or faults.delay_s > 0, "no fault was injected")
        vis = ("pages stay present (a failed read is not a drop)" if faults.only is Op.READ
               else f"{case.caught} of them not visible")
        case.outcome = (f"{requests} request(s) faulted ({', '.join(f'{k} {v}' for k, v in inj.items() if v)}); "
                        f"{case.injected} page(s) False, {vis}"
                        + (f"; {case.served_ok}/{case.served_total} other reads good" if case.served_total else "")
                        + f"; {st['timeouts']} timeouts, {st['lost_slots']} slots retired; {elapsed:.1f} s under "
                          f"fault; resumed after heal: {'yes' if case.ok else 'NO'}")
    finally:
        set_faults(None)
        c.close()
    return case


# -- full disk ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def small_tmpfs(path: str, size: str = "8m") -> Iterator[str | None]:
    """A tmpfs of `size` mounted at `path` (root only); None when it cannot be mounted."""
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path], capture_output=True)
    if r.returncode:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def fill_filesystem(path: str) -> str:
    """Write a file named ``filler`` in `path` until the file system is full (ENOSPC, to the last
    block: smaller writes after larger ones fail); returns its path."""
    filler = os.path.join(path, "filler")
    with open(filler, "wb", buffering=0) as f:  # unbuffered: nothing left over for close to fail on
        for size in (1 << 20, 65536, 4096, 512):
            try:
                while True:
                    f.write(b"\xff" * size)
            except OSError:
                pass
    return filler


def _enospc_case(root: str, target: str, what: str) -> Case:
    case = Case("faults", f"ENOSPC ({what})", target)
    with small_tmpfs(os.path.join(root, f"tmpfs-{target}-{what}"), "12m") as mnt:
        if mnt is None:
            case.outcome = "skipped: cannot mount a tmpfs here (needs root)"
            return case
        if what == "open":
            try:
                Client(target, mnt, slots=1024, engine="nixl-posix", pages=8).close()
                case.problems.append("opening 1024 slots on a 12 MiB tmpfs did not fail")
            except OSError as exc:
                case.injected = case.caught = 1
                case.outcome = f"open refused: {type(exc).__name__}: {str(exc)[:160]}"
            except Exception as exc:  # noqa: BLE001
                case.problems.append(f"open failed with {type(exc).__name__} (not a StoreFullError): {exc}")
            return case
        prealloc = what == "index"
        c = Client(target, mnt, slots=96 if prealloc else 160, engine="nixl-posix", pages=8,
                   identity={"model": "enospc"}, config={"preallocate": prealloc})
        try:
            base = _keys(target, f"{what}-base", 8)
            with guarded(case, "setup put"):
                case.check(all(c.put(base)), "setup puts failed")
            filler = fill_filesystem(mnt)
            keys = _keys(target, f"{what}-k", 80)
            with guarded(case, "put on a full disk"):
                res = c.put(keys)
                bad = [k for k, r in zip(keys, res) if not r]
                case.injected = len(bad)
                case.caught = len(bad) - sum(c.exists(bad))
                case.check(case.caught == len(bad), "a failed page is visible")
                good = [k for k, r in zip(keys, res) if r]
                v = c.verify(base + good)
                case.served_total, case.served_ok, case.wrong_bytes = len(base) + len(good), v["good"], v["wrong"]
                case.check(v["good"] == len(base) + len(good), "pages acked before/around the fault are not served")
            os.unlink(filler)  # the fault clears
            with guarded(case, "after space is freed"):
                ok = c.put(keys)
                v = c.verify(keys)
                case.check(all(ok) and v["good"] == len(keys), f"after freeing space: {sum(ok)}/{len(keys)} puts, "
                                                               f"{v['good']} good reads")
            case.problems.extend(index_problems(c.index))
            case.outcome = (f"{case.injected}/{len(keys)} pages False on the full disk (none visible); "
                            f"{case.served_ok}/{case.served_total} earlier pages served; resumed after freeing "
                            f"space: {'yes' if case.ok else 'NO'}")
            if not case.injected:
                case.outcome = ("the full disk never failed a put: " + case.outcome +
                                (" (slabs preallocated; the SQLite WAL reused its own space)" if prealloc else ""))
        finally:
            c.close()
    return case


def fault_cases(root: str, target: str = "store", *, sglang_seconds: float = 5.0) -> list[Case]:
    """Every resource-fault case for `target`."""
    w, r = Op.WRITE, Op.READ
    out = [
        _engine_case(root, target, "EIO on writes (p=0.3)", Faults(eio=0.3, only=w, seed=1)),
        _engine_case(root, target, "EIO on reads (p=0.3)", Faults(eio=0.3, only=r, seed=2)),
        _engine_case(root, target, "hang on writes (p=0.4)", Faults(hang=0.4, only=w, seed=3), batches=8),
        _engine_case(root, target, "hang on reads (p=0.4)", Faults(hang=0.4, only=r, seed=4), batches=8),
        _engine_case(root, target, "slow IO (+50 ms per request)", Faults(delay_s=0.05, seed=5), batches=6),
        _enospc_case(root, target, "slab writes"),
        _enospc_case(root, target, "index"),
        _enospc_case(root, target, "open"),
    ]
    extra = getattr(harness(target), "fault_cases", None) if target != STORE else None
    if extra is not None:  # faults only the adapter can inject (SGLang's own injector)
        out.extend(extra(root, seconds=sglang_seconds))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gds-path", required=True)
    ap.add_argument("--target", default="store", help="store, or a target an adapter registered (sglang)")
    args = ap.parse_args(argv)
    print(json.dumps([c.as_dict() for c in fault_cases(args.gds_path, args.target)], indent=1))


if __name__ == "__main__":
    main()
