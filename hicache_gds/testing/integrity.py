"""Integrity under faults: the paths kill -9, torn pages and full disks do not reach.

* **failures between reserve and publish** (`failed_put_case`): fdatasync EIO, a NIXL registration
  error in staging, an exception while checksumming, an exception from publish -- in the scenario
  that lost a namespace before: 64 slots, 32 acknowledged pages, 8 failing puts of 8 pages, then 16
  pages from this process and 8 from another must go in, and the acknowledged pages read
  byte-exact;
* **reordered and missing directories** (`directory_order_cases`): pages put under ``a,b`` read
  under ``b,a`` and back, verification on and off; a namespace directory removed, or another
  directory in its place, is refused naming it;
* **close during IO** (`close_during_io_case`, `late_write_case`): threads in get/put on slow
  writes while another closes the store (bounce and NIXL POSIX); a write that never finishes keeps
  its slot out of everyone's reach after close;
* **membership races** (`membership_race_case`, `membership_processes_case`): stores opening and
  closing while others judge who is alive; no live store may be judged dead;
* **an idle process after others read** (`idle_map_case`): its next lookup must not read the
  whole index again;
* **GPU-page corruption** (`gpu_corruption_cases`, GPU machine): pages written from device
  memory, damaged on disk, read into device memory: misses, never wrong bytes; host and device
  pages verify across.

Each returns `Case` records (area "integrity") for benchmarks/reliability.py; tests/test_integrity.py
runs them small. Only public calls plus the one monkeypatched fault each names.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

from ..errors import HiCacheGDSError, TransferError
from .cases import Case, capture_logs, guarded
from .integrity_base import FAULTS, PAGE, _AREA, _dir, _fill, _other_process_put, _read_back, _store
from .integrity_procs import gpu_corruption_cases, idle_map_case, membership_processes_case, membership_race_case
from .invariants import index_problems

__all__ = ["FAULTS", "failed_put_case", "directory_order_cases", "close_during_io_case", "late_write_case",
           "membership_race_case", "membership_processes_case", "idle_map_case", "gpu_corruption_cases",
           "integrity_cases"]

# -- failures between reserve and publish --------------------------------------------------------------

@contextlib.contextmanager
def _inject(fault: str, store: Any) -> Iterator[None]:
    """`fault` on `store` while inside (see `FAULTS`)."""
    from .. import store as store_mod
    undo: list[Callable[[], None]] = []

    def boom(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError(f"injected: {fault}")

    if fault == "fdatasync EIO":
        real = os.fdatasync

        def eio(fd: int) -> None:
            raise OSError(errno.EIO, "injected: fdatasync EIO")
        os.fdatasync = eio  # type: ignore[assignment]
        undo.append(lambda: setattr(os, "fdatasync", real))
    elif fault == "NIXL registration error in staging":
        eng = store.engine

        def refuse(addr: int, nbytes: int, kind: Any = None) -> None:
            raise TransferError(f"{eng.name}: registering {nbytes} bytes of DRAM at {addr:#x} failed: "
                                f"nixlBackendError (injected)")
        eng.register_memory = refuse
        undo.append(lambda: eng.__dict__.pop("register_memory", None))
    elif fault == "exception while checksumming":
        try:  # both checksum kinds (this version: pagesum), the one definition (earlier ones)
            from .. import checksum as ck
            mods = [(ck, ("host_checksum", "host_checksums"))]
            try:
                from .. import pagesum as ps
                mods.append((ps, ("host_sums", "xxh3_of")))
            except ImportError:
                pass
            for mod, names in mods:
                for name in names:
                    undo.append(lambda mod=mod, name=name, real=getattr(mod, name): setattr(mod, name, real))
                    setattr(mod, name, boom)
        except ImportError:
            pass
        if hasattr(store_mod, "_csum"):
            real_cs = store_mod._csum
            store_mod._csum = boom
            undo.append(lambda: setattr(store_mod, "_csum", real_cs))
    elif fault == "exception from publish":
        ix = store.index
        ix.publish = boom
        undo.append(lambda: ix.__dict__.pop("publish", None))
    else:
        raise ValueError(f"unknown fault {fault!r}")
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def failed_put_case(root: str, fault: str, *, engine: str = "nixl-posix") -> Case:
    """The issue's scenario under `fault` (module docstring)."""
    from .. import Pages
    from ..memory import HostBuffer
    case = Case(_AREA, f"failed puts: {fault}")
    d = _dir(root, f"failed-puts-{FAULTS.index(fault)}")
    ident = f"failed-puts-{FAULTS.index(fault)}"
    store = _store(d, ident, 64, engine=engine, sync=fault == "fdatasync EIO")
    # Lanes 0..39 aligned; a second view 64 bytes in, whose pages the store must stage.
    buf = HostBuffer(41 * PAGE)
    misaligned = False
    try:
        store.register_memory(buf.addr, buf.nbytes)
        arr = buf.numpy()
        acked = [f"acked{i}" for i in range(32)]
        _fill(arr, acked, PAGE)
        with guarded(case, "acknowledged puts"):
            case.check(all(store.put(acked, Pages.contiguous(buf.addr, PAGE, range(32)))),
                       "the 32 pages to acknowledge were not all stored")
        ev0 = store.stats()["evictions"]
        raised: dict[str, int] = {}
        misaligned = fault.startswith("NIXL registration")
        with _inject(fault, store):
            for r in range(8):
                ks = [f"fail{r}-{j}" for j in range(8)]
                off = 64 if misaligned else 0
                _fill(arr, ks, PAGE, at=32, offset=off)
                pages = Pages.contiguous(buf.addr + off, PAGE, range(32, 40))
                case.injected += len(ks)
                try:
                    res = store.put(ks, pages)
                except Exception as exc:  # noqa: BLE001 -- an unexpected failure may surface; counted
                    raised[type(exc).__name__] = raised.get(type(exc).__name__, 0) + 1
                    res = [False] * len(ks)
                case.caught += sum(not x for x in res)
                visible = sum(store.exists(ks))
                case.check(not visible, f"round {r}: {visible} page(s) of a failing put visible")
        st = store.stats()
        evicted = st["evictions"] - ev0
        held = st.get("reserved_slots_all", 0)
        ok_here = ok_other = 0
        with guarded(case, "puts after the fault"):
            mine = [f"after{i}" for i in range(16)]
            for a in (0, 8):
                _fill(arr, mine[a:a + 8], PAGE, at=32)
                ok_here += sum(store.put(mine[a:a + 8], Pages.contiguous(buf.addr, PAGE, range(32, 40))))
            case.check(ok_here == 16, f"after the fault this process stored {ok_here} of 16 pages")
        with guarded(case, "another process's puts"):
            ok_other = sum(_other_process_put(d, ident, 64, engine, "other", 8))
            case.check(ok_other == 8, f"after the fault another process stored {ok_other} of 8 pages")
        good, miss, wrong = _read_back(store, acked, HostBuffer(8 * PAGE))
        case.served_total, case.served_ok, case.wrong_bytes = 32, good, wrong
        case.check(wrong == 0, f"{wrong} acknowledged page(s) read back wrong")
        case.check(evicted == 0, f"the failing puts evicted {evicted} acknowledged page(s) with free slots left")
        case.check(good == 32 - evicted, f"{32 - evicted - good} acknowledged page(s) not evicted are missing")
        case.problems.extend(index_problems(store.index))
        case.outcome = (f"8 puts x 8 pages failed ({case.caught}/{case.injected} False"
                        + (f"; raised {', '.join(f'{k} x{v}' for k, v in raised.items())}" if raised else "")
                        + f"); slots still reserved after them {held}; acknowledged pages evicted by them "
                          f"{evicted}; afterwards this process stored {ok_here}/16, another {ok_other}/8; "
                          f"acknowledged pages byte-exact {good}/32, wrong {wrong}")
    finally:
        store.close()
    return case


# -- directory order ---------------------------------------------------------------------------------------

def directory_order_cases(root: str, *, engine: str = "nixl-posix") -> list[Case]:
    """Pages put under a,b, read under b,a (new bytes put for half of them there) and back under a,b,
    verification off and on; a removed namespace directory and a replaced one are refused."""
    from .. import ConfigError, Pages
    from ..memory import HostBuffer
    out = []
    for verify in (False, True):
        case = Case(_AREA, f"GDS_PATH reordered (verify {'on' if verify else 'off'})")
        a, b = _dir(root, f"order-{verify}-a"), _dir(root, f"order-{verify}-b")
        ks = [f"k{i}" for i in range(8)]
        buf = HostBuffer(8 * PAGE)
        arr = buf.numpy()
        present = good = good2 = 0
        with guarded(case, "put under a,b"):
            with _store(f"{a},{b}", "order", 16, engine=engine, verify=verify) as s:
                s.register_memory(buf.addr, buf.nbytes)
                _fill(arr, ks, PAGE)
                case.check(all(s.put(ks, Pages.contiguous(buf.addr, PAGE, range(8)))), "puts under a,b failed")
        with guarded(case, "under b,a"), capture_logs() as logs:
            with _store(f"{b},{a}", "order", 16, engine=engine, verify=verify) as s:
                s.register_memory(buf.addr, buf.nbytes)
                present = sum(s.exists(ks))
                good, miss, wrong = _read_back(s, ks, buf)
                case.injected = len(ks)
                case.served_total, case.served_ok, case.wrong_bytes = len(ks), good, wrong
                # New bytes for k0..k3: present keys are not rewritten, so nothing changes.
                _fill(arr, ks[:4], PAGE, salt="new-")
                s.put(ks[:4], Pages.contiguous(buf.addr, PAGE, range(4)))
            case.check(present == 8 and good == 8,
                       f"under b,a: {present}/8 present, {good} byte-exact, {miss} misses, {wrong} wrong")
            said = any("recorded" in r.getMessage() for r in logs.records)
            case.check(said, "no log line says the recorded order is used")
        with guarded(case, "back under a,b"):
            with _store(f"{a},{b}", "order", 16, engine=engine, verify=verify) as s:
                s.register_memory(buf.addr, buf.nbytes)
                good2, miss2, wrong2 = _read_back(s, ks, buf)
            case.wrong_bytes += wrong2
            case.check(good2 == 8, f"back under a,b: {good2}/8 byte-exact, {miss2} misses, {wrong2} wrong")
        case.caught = case.served_ok
        case.outcome = (f"8 pages put under a,b; under b,a {present}/8 present and {good}/8 byte-exact (the recorded "
                        f"order used, logged); back under a,b {good2}/8 byte-exact; wrong bytes {case.wrong_bytes}")
        out.append(case)
    for what in ("removed", "replaced"):
        case = Case(_AREA, f"namespace directory {what}")
        a, b, c = (_dir(root, f"gone-{what}-{x}") for x in "abc")
        with guarded(case, "put under a,b"):
            with _store(f"{a},{b}", "gone", 16, engine=engine) as s:
                ns = s.namespace
                buf = HostBuffer(4 * PAGE)
                s.register_memory(buf.addr, buf.nbytes)
                _fill(buf.numpy(), ["g0", "g1", "g2", "g3"], PAGE)
                case.check(all(s.put(["g0", "g1", "g2", "g3"], Pages.contiguous(buf.addr, PAGE, range(4)))), "puts")
        path = f"{a},{b}"
        missing = os.path.join(b, ns)
        if what == "removed":
            for f in os.listdir(missing):
                p = os.path.join(missing, f)
                if os.path.isdir(p):
                    for g in os.listdir(p):
                        os.unlink(os.path.join(p, g))
                    os.rmdir(p)
                else:
                    os.unlink(p)
            os.rmdir(missing)
        else:
            path, missing = f"{a},{c}", os.path.join(c, ns)
        case.injected = 1
        try:
            with _store(path, "gone", 16, engine=engine) as s:
                case.problems.append(f"opened with {missing} {what}: {sum(s.exists(['g0', 'g1', 'g2', 'g3']))}/4 "
                                     f"pages reported present")
                case.outcome = "opened (not refused)"
        except ConfigError as exc:
            named = missing in str(exc)
            case.caught = int(named)
            case.check(named, f"refused, but the error does not name {missing}: {exc}")
            case.outcome = f"refused: {str(exc)[:220]}"
        except Exception as exc:  # noqa: BLE001
            case.problems.append(f"failed with {type(exc).__name__} (not a ConfigError): {exc}")
        out.append(case)
    return out


# -- close during IO ---------------------------------------------------------------------------------------

def close_during_io_case(root: str, engine: str, *, threads: int = 4, delay_s: float = 0.4,
                         io_timeout: float = 10.0) -> Case:
    """Threads in get/put (each request slowed by `delay_s`) while another thread closes the store: every
    call either completes or fails with a `HiCacheGDSError`; afterwards every acknowledged page
    reads byte-exact and the index holds no reservation of the closed store."""
    from .. import Pages
    from ..engines import EngineOptions, Op, create_engine
    from ..engines.faulty import Faults, FaultyEngine
    from ..memory import HostBuffer
    case = Case(_AREA, f"close during IO ({engine})")
    d = _dir(root, f"close-{engine}")
    faulty = FaultyEngine(create_engine(engine, EngineOptions()), Faults())
    store = _store(d, "close", 256, engine_obj=faulty, io_timeout=io_timeout)
    bufs = [HostBuffer(4 * PAGE) for _ in range(threads)]
    for bf in bufs:
        store.register_memory(bf.addr, bf.nbytes)
    base = [f"base{i}" for i in range(8)]
    _fill(bufs[0].numpy(), base[:4], PAGE)
    _fill(bufs[1].numpy(), base[4:], PAGE)
    store.put(base[:4], Pages.contiguous(bufs[0].addr, PAGE, range(4)))
    store.put(base[4:], Pages.contiguous(bufs[1].addr, PAGE, range(4)))
    faulty.faults = Faults(delay_s=delay_s)
    stop = threading.Event()
    acked: list[str] = []
    errors: dict[str, int] = {}
    calls = [0]
    busy = [0]
    lock = threading.Lock()

    def worker(w: int) -> None:
        bf = bufs[w]
        i = 0
        while not stop.is_set():
            with lock:
                busy[0] += 1
            try:
                if w % 2 == 0:
                    ks = [f"w{w}-{i}-{j}" for j in range(4)]
                    _fill(bf.numpy(), ks, PAGE)
                    res = store.put(ks, Pages.contiguous(bf.addr, PAGE, range(4)))
                    with lock:
                        acked.extend(k for k, ok in zip(ks, res) if ok)
                else:
                    store.get(base[:4], Pages.contiguous(bf.addr, PAGE, range(4)))
            except BaseException as exc:  # noqa: BLE001 -- judged below
                name = type(exc).__module__.split(".")[0] + "." + type(exc).__name__
                typed = isinstance(exc, HiCacheGDSError)
                tag = ("" if typed else "RAW ") + name
                with lock:
                    errors[tag] = errors.get(tag, 0) + 1
                return  # refused (the store is closing) or failed: this thread is done
            finally:
                with lock:
                    busy[0] -= 1
            with lock:
                calls[0] += 1
            i += 1

    ts = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(threads)]
    for t in ts:
        t.start()
    time.sleep(2.5 * delay_s)  # mid-way through the third round of calls
    with lock:
        in_flight = busy[0]
    t0 = time.monotonic()
    try:
        store.close()
    except Exception as exc:  # noqa: BLE001
        case.problems.append(f"close raised {type(exc).__name__}: {exc}")
    close_s = time.monotonic() - t0
    stop.set()
    for t in ts:
        t.join(io_timeout + 30)
    case.check(not any(t.is_alive() for t in ts), "a thread is still in a call after close")
    raw = {k: v for k, v in errors.items() if k.startswith("RAW ")}
    case.injected = sum(errors.values())
    case.caught = case.injected - sum(raw.values())
    case.exceptions = sum(raw.values())
    case.check(not raw, f"raw exceptions out of calls during close: {raw}")
    case.check(close_s < io_timeout + 5, f"close took {close_s:.1f} s")
    with guarded(case, "reopen"):
        with _store(d, "close", 256, engine="bounce") as s2:
            good, miss, wrong = _read_back(s2, acked + base, HostBuffer(8 * PAGE))
            case.served_total, case.served_ok, case.wrong_bytes = len(acked) + len(base), good, wrong
            case.check(good == len(acked) + len(base), f"after reopen {good}/{len(acked) + len(base)} acknowledged "
                                                       f"pages byte-exact, {miss} missing, {wrong} wrong")
            case.problems.extend(index_problems(s2.index))
    case.check(in_flight > 0, "no call was in flight when close began (the case shows nothing)")
    case.outcome = (f"{calls[0]} calls by {threads} threads, each request +{delay_s * 1000:.0f} ms; {in_flight} in "
                    f"flight when close began, which returned after {close_s:.2f} s; calls refused after it: "
                    f"{', '.join(f'{k} x{v}' for k, v in errors.items()) or 'none'}; acknowledged pages byte-exact "
                    f"after reopen {case.served_ok}/{case.served_total}")
    return case


def late_write_case(root: str, engine: str = "bounce", *, io_timeout: float = 0.3) -> Case:
    """A write that never finishes (a hung request): its put is False, and after close its slots stay
    reserved by the closed store, which still counts as alive, so another store never reuses them."""
    from .. import Pages
    from ..engines import EngineOptions, Op, create_engine
    from ..engines.faulty import Faults, FaultyEngine
    from ..memory import HostBuffer
    case = Case(_AREA, f"write in flight at close ({engine})")
    d = _dir(root, f"late-{engine}")
    faulty = FaultyEngine(create_engine(engine, EngineOptions()), Faults(hang=1.0, only=Op.WRITE))
    store = _store(d, "late", 32, engine_obj=faulty, io_timeout=io_timeout)
    buf = HostBuffer(32 * PAGE)
    store.register_memory(buf.addr, buf.nbytes)
    ks = [f"late{i}" for i in range(8)]
    _fill(buf.numpy(), ks, PAGE)
    res = store.put(ks, Pages.contiguous(buf.addr, PAGE, range(8)))
    case.injected = len(ks)
    case.caught = sum(not r for r in res)
    case.check(not any(res), "a put whose write hung returned True")
    store.close()
    s2 = _store(d, "late", 32, engine="bounce")
    try:
        db = s2.index._rdb
        hung = [s for s, lost in db.execute("SELECT slot, lost FROM held").fetchall()]
        s2.register_memory(buf.addr, buf.nbytes)
        more = [f"more{i}" for i in range(32)]
        _fill(buf.numpy(), more, PAGE)
        ok = sum(s2.put(more, Pages.contiguous(buf.addr, PAGE, range(32))))
        used = {s for (s,) in db.execute("SELECT slot FROM pages").fetchall()}
        reused = sorted(set(hung) & used)
        case.check(len(hung) == 8, f"{len(hung)} slot(s) still reserved after close, not the 8 whose write hung")
        case.check(not reused, f"slots {reused} of writes still in flight were given to new pages")
        case.check(ok == 32 - len(hung), f"{ok} of 32 new pages stored with {len(hung)} slots held")
        case.problems.extend(p for p in index_problems(s2.index) if "leaked" not in p)
        case.outcome = (f"8 pages whose write hung: False; after close {len(hung)} slot(s) stay reserved by the "
                        f"closed store (alive until this process exits); another store filled the rest with {ok} "
                        f"pages, reusing {len(reused)} of them")
    finally:
        s2.close()
    return case


def integrity_cases(root: str, *, quick: bool = False, engines: tuple[str, ...] = ("bounce", "nixl-posix")) -> list[Case]:
    """Every family (module docstring), sized for the full run or `quick`."""
    out = [failed_put_case(root, f) for f in FAULTS]
    out += directory_order_cases(root)
    out += [close_during_io_case(root, e) for e in engines]
    out.append(late_write_case(root))
    out.append(membership_race_case(root, opens=10 if quick else 100))
    out.append(membership_processes_case(root, seconds=2 if quick else 30))
    out.append(idle_map_case(root))
    out += gpu_corruption_cases(root)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gds-path", help="scratch directory (default: a new one under /var/tmp)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpu-only", action="store_true", help="only the GPU-page family")
    args = ap.parse_args(argv)
    root = args.gds_path or tempfile.mkdtemp(prefix="hicache-gds-integrity-", dir="/var/tmp")
    cases = gpu_corruption_cases(root) if args.gpu_only else integrity_cases(root, quick=args.quick)
    print(json.dumps([c.as_dict() for c in cases], indent=1))


if __name__ == "__main__":
    main()
