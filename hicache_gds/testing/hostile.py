"""Hostile and bad input at every entry point, fuzzing, and privacy (modes, tenants, logs).

Every case must end in a clear error (`TypeError` / `ValueError` / `ConfigError` / `RegionError` /
`OSError` subclass with a message) from the `PageStore`, or a False / 0 / None from SGLang's
`HiCacheGDS`, which must never raise on its data path; afterwards the store still works, and
nothing outside GDS_PATH changed (the parent directory tree is snapshotted before and after).

    python -m hicache_gds.testing.hostile --gds-path DIR [--target sglang] [--fuzz 300]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError, HiCacheGDSError
from .cases import Case, capture_logs, snapshot_tree, tree_changes
from .clients import Client
from .invariants import index_problems
from .targets import harness
from .hostile_base import _CLEAR, SURROGATE, _expect_error, _Parent, _sgl_keys, _still_works
from .privacy import fuzz, log_leaks, privacy_modes, tenant_isolation

__all__ = ["hostile_store", "hostile_sglang", "hostile_paths", "fuzz", "privacy_modes", "tenant_isolation",
           "log_leaks"]

# -- PageStore entry points -------------------------------------------------------------------------------

def hostile_store(root: str) -> list[Case]:
    from hicache_gds import Pages, PageStore
    from hicache_gds.memory import HostBuffer
    par = _Parent(root, "hostile-store")
    out = []
    c = Client("store", par.gds, slots=64, pages=8, identity={"model": "hostile"})
    P = c.page
    pages1 = Pages.contiguous(c.buf.addr, P, [0])

    keys_case = Case("hostile", "keys: wrong types, empty, huge, NUL, not a list", "store")
    for what, keys in [("str instead of a list", "abc"), ("bytes", b"abc"), ("int", 5), ("None", None),
                       ("dict", {"a": 1}), ("set", {"a"}), ("generator", (k for k in ["a"])),
                       ("list of int", [1]), ("list of bytes", [b"x"]), ("list of None", [None]),
                       ("empty key", [""]), ("NUL in key", ["a\x00b"]), ("5000-character key", ["x" * 5000])]:
        for op in ("exists", "prefix", "delete", "put", "get"):
            if op in ("put", "get"):
                fn = (lambda op=op, keys=keys: getattr(c.store, op)(keys, pages1))
            else:
                fn = (lambda op=op, keys=keys: getattr(c.store, op)(keys))
            _expect_error(keys_case, f"{op}({what})", fn)
    _still_works(keys_case, c, "bad keys")
    keys_case.outcome = f"{keys_case.caught}/{keys_case.injected} calls refused with TypeError/ValueError"
    out.append(keys_case)

    odd = Case("hostile", "keys that look like paths or are odd but legal", "store")
    legal = ["../../../etc/passwd", "/abs/../../x", "a/b/c", "..", ".", "~root", "$(rm -rf /)", "k" * 1024,
             "ключ-键-🔑", "with\nnewline", "' OR 1=1 --", "%s%n%x"]
    try:
        odd.injected = len(legal)
        ok = c.put(legal)
        v = c.verify(legal)
        odd.caught = v["good"]
        odd.check(all(ok) and v["good"] == len(legal), f"{v['good']}/{len(legal)} odd keys round-tripped")
        odd.check(c.store.delete(legal) == [True] * len(legal), "odd keys could not be deleted")
    except Exception as exc:  # noqa: BLE001
        odd.problems.append(f"{type(exc).__name__}: {exc}")
    odd.outcome = f"{odd.caught}/{odd.injected} stored and read back as plain keys (never paths)"
    out.append(odd)

    dup = Case("hostile", "delete, and get of a damaged page, naming one key twice in a batch", "store")
    dup.injected = 2
    try:
        c.put(["d1", "d2", "d3"])
        r = c.store.delete(["d1", "d1", "d2"])
        dup.caught += 1
        dup.check(r == [True, True, True] or r == [True, False, True], f"delete returned {r}")
    except Exception as exc:  # noqa: BLE001
        dup.exceptions += 1
        dup.problems.append(f"delete(['d1', 'd1', 'd2']) raised {type(exc).__name__}: {exc}")
    try:
        e = c.index.peek(["d3"])["d3"]
        fi, off = c.store.slabs.place(np.array([e.slot]))
        fd = os.open(c.store.slabs.paths[int(fi[0])], os.O_RDWR)
        os.pwrite(fd, b"\x00" * 64, int(off[0]) + 8)
        os.close(fd)
        r = c.store.get(["d3", "d3"], Pages.contiguous(c.buf.addr, P, [0, 1]))
        dup.caught += 1
        dup.check(r == [False, False], f"get returned {r}")
    except Exception as exc:  # noqa: BLE001
        dup.exceptions += 1
        dup.problems.append(f"get(['d3', 'd3']) of a damaged page raised {type(exc).__name__}: {exc}")
    dup.problems.extend(f"then: {p}" for p in index_problems(c.index))
    dup.outcome = "answered per key" if dup.ok else "; ".join(dup.problems)[:300]
    out.append(dup)

    sur = Case("hostile", "key with a lone surrogate (str that is not UTF-8)", "store")
    sur.injected = 1
    c2 = Client("store", par.gds, slots=64, pages=8, identity={"model": "hostile-surrogate"})
    try:
        res = c2.store.put(["fine", "bad" + SURROGATE], Pages.contiguous(c2.buf.addr, P, [0, 1]))
        sur.problems.append(f"accepted: {res}")
    except ValueError as exc:
        sur.caught = 1
        sur.outcome = f"put raised {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001
        sur.exceptions += 1
        sur.problems.append(f"put raised {type(exc).__name__} (not a clear ValueError): {str(exc)[:100]}")
    st = c2.store.stats()
    sur.check(st["pages"] + st["free_slots"] + st["lost_slots"] == st["slots"],
              f"slots leaked: pages {st['pages']} + free {st['free_slots']} != slots {st['slots']}")
    _still_works(sur, c2, "a surrogate key")
    c2.close()
    if not sur.outcome:
        sur.outcome = "; ".join(sur.problems)[:300]
    out.append(sur)

    regions = Case("hostile", "pages: wrong type, sizes, lengths, regions outside registered buffers", "store")
    other = HostBuffer(2 * P)
    cases_r = [
        ("list instead of Pages", lambda: c.store.put(["a"], [c.buf.addr])),
        ("2 keys, 1 page", lambda: c.store.put(["a", "b"], pages1)),
        ("1 key, 2 pages", lambda: c.store.get(["a"], Pages.contiguous(c.buf.addr, P, [0, 1]))),
        ("page of the wrong size", lambda: c.store.put(["a"], Pages.contiguous(c.buf.addr, 4096, [0]))),
        ("past the end of the buffer", lambda: c.store.put(["a"], Pages.contiguous(c.buf.addr, P, [8]))),
        ("unregistered buffer", lambda: c.store.get(["a"], Pages.contiguous(other.addr, P, [0]))),
        ("address 0", lambda: c.store.put(["a"], Pages.contiguous(0, P, [0]))),
        ("negative page index", lambda: c.store.put(["a"], Pages.contiguous(c.buf.addr, P, [-1]))),
        ("segments straddling two buffers", lambda: c.store.put(["a"], Pages(
            np.array([[c.buf.addr + 8 * P - 4096, other.addr]], np.uint64), np.array([[P // 2, P // 2]], np.uint64)))),
        ("register address 0", lambda: c.store.register_memory(0, 4096)),
        ("register negative size", lambda: c.store.register_memory(other.addr, -1)),
    ]
    for what, fn in cases_r:
        _expect_error(regions, what, fn, _CLEAR + (OverflowError,))
    _still_works(regions, c, "bad regions")
    regions.outcome = f"{regions.caught}/{regions.injected} refused (RegionError / ValueError / TypeError)"
    out.append(regions)
    c.close()
    out.append(wrapping_region(par.gds, "store"))

    cfg = Case("hostile", "constructor: page sizes, config keys and values, environment", "store")
    base = {"gds_path": par.gds, "capacity": 64 * P}
    for what, kw in [("page_bytes 0", dict(page_bytes=0)), ("page_bytes -1", dict(page_bytes=-1)),
                     ("page_bytes float", dict(page_bytes=4096.0)), ("page_bytes str", dict(page_bytes="4096")),
                     ("unknown key", dict(config={**base, "capacty": 1})),
                     ("bad capacity", dict(config={**base, "capacity": "lots"})),
                     ("capacity smaller than a page", dict(config={**base, "capacity": 100})),
                     ("engine with a path", dict(config={**base, "engine": "../../bin/sh"})),
                     ("unknown engine", dict(config={**base, "engine": "nope"})),
                     ("io_timeout nan", dict(config={**base, "io_timeout": "nan"})),
                     ("GDS_PATH with NUL", dict(config={**base, "gds_path": "/tmp/a\x00b"})),
                     ("namespace of 10k chars", dict(config={**base, "namespace": "n" * 10000}))]:
        def make(kw=kw) -> Any:
            s = PageStore(kw.get("page_bytes", P), {"model": "hostile"}, config=kw.get("config", base))
            s.close()
        _expect_error(cfg, what, make)
    os.environ["HICACHE_GDS_CAPACTY"] = "1"
    try:
        _expect_error(cfg, "unknown HICACHE_GDS_ variable", lambda: PageStore(P, config=base).close())
    finally:
        del os.environ["HICACHE_GDS_CAPACTY"]
    cfg.outcome = f"{cfg.caught}/{cfg.injected} refused with a message naming the problem"
    out.append(cfg)
    return par.check_outside(out)


def hostile_paths(root: str, target: str = "store") -> list[Case]:
    """GDS_PATH that is a file, not writable, or whose namespace holds symlinks planted to files outside."""
    par = _Parent(root, f"hostile-paths-{target}")
    out = []

    def opener(gds: str) -> Callable[[], Any]:
        return lambda: Client(target, gds, slots=64, pages=8, identity={"model": "paths"}).close()

    bad = Case("hostile", "GDS_PATH: missing, a file, not writable", target)
    f = os.path.join(par.parent, "a-file")
    _expect_error(bad, "missing", opener(os.path.join(par.parent, "missing")), (ConfigError,))
    _expect_error(bad, "a file", opener(f), (ConfigError,))
    ro = os.path.join(par.parent, "ro")
    os.makedirs(ro, exist_ok=True)
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", ro], capture_output=True)
        if r.returncode == 0:
            try:
                _expect_error(bad, "read-only", opener(ro), (ConfigError,))
            finally:
                subprocess.run(["umount", "-l", ro], capture_output=True)
    else:
        os.chmod(ro, 0o500)
        _expect_error(bad, "not writable", opener(ro), (ConfigError,))
    bad.outcome = f"{bad.caught}/{bad.injected} refused with ConfigError naming GDS_PATH"
    out.append(bad)

    # A namespace whose files were replaced by symlinks to files outside GDS_PATH.
    c = Client(target, par.gds, slots=64, pages=8, identity={"model": "paths"})
    ns_dir = os.path.dirname(c.index.db_path)
    c.close()
    for planted, victim in [("slab.bin", "victim-slab"), ("index.sqlite3", "victim-db"),
                            ("index.sqlite3-wal", "victim-wal"), ("lock", "victim-lock"),
                            ("namespace.json", "victim-json"), ("<namespace dir>", "")]:
        case = Case("hostile", f"symlink planted: {planted}", target)
        case.injected = 1
        before = snapshot_tree(par.parent)
        if planted == "<namespace dir>":
            os.rename(ns_dir, ns_dir + ".real")
            os.symlink(ns_dir + ".real", ns_dir)
        else:
            p = os.path.join(ns_dir, planted)
            if os.path.lexists(p):
                os.rename(p, p + ".real")
            os.symlink(os.path.join(par.outside, victim), p)
        try:
            with capture_logs(logging.WARNING) as logs:
                cc = Client(target, par.gds, slots=64, pages=8, identity={"model": "paths"})
                try:
                    ks = [f"p-{i}" for i in range(4)] if target == "store" else _sgl_keys("p", 4)
                    cc.put(ks)
                    cc.read(ks)
                finally:
                    cc.close()
            case.outcome = ("SQLite refused it: the index was moved aside as damaged, namespace reset (logged)"
                            if "damaged" in logs.text() else "replaced atomically; opened and used")
            case.caught = 1  # handled safely: nothing outside changed (checked below)
        except (ConfigError, OSError) as exc:
            case.caught = 1
            case.outcome = f"refused: {type(exc).__name__}: {str(exc)[:120]}"
            if not isinstance(exc, HiCacheGDSError):
                case.outcome += " (a raw OSError, not a ConfigError)"
        except Exception as exc:  # noqa: BLE001
            case.exceptions = 1
            case.problems.append(f"{type(exc).__name__}: {exc}")
        changed = tree_changes(before, snapshot_tree(par.parent), [ns_dir, ns_dir + ".real"])
        changed = [p for p in changed if not p.startswith(par.gds)]
        case.check(not changed, f"files outside GDS_PATH changed: {changed[:3]}")
        # undo the plant
        if planted == "<namespace dir>":
            os.unlink(ns_dir)
            os.rename(ns_dir + ".real", ns_dir)
        else:
            p = os.path.join(ns_dir, planted)
            if os.path.islink(p):
                os.unlink(p)
            if os.path.lexists(p + ".real"):
                os.rename(p + ".real", p)
        out.append(case)
    return out


_WRAP_STORE = """
import numpy as np
from hicache_gds import Pages
from hicache_gds.testing.clients import Client
c = Client("store", GDS, slots=16, pages=2, identity={"model": "wrap"})
try:
    r = c.store.put(["a"], Pages(np.array([[2**64 - 4096]], np.uint64), np.array([[c.page]], np.uint64)))
    print("ACCEPTED", r)
except Exception as e:  # noqa: BLE001
    print("REFUSED", type(e).__name__, e)
"""

_WRAP_SGLANG = """
import torch
from hicache_gds.testing.clients import Client
c = Client("sglang", GDS, slots=16, pages=4, shape=2, identity={"model": "wrap"})  # MLA page_first_direct
pool = c.pool
stride = pool.layer_num * pool.kv_cache_dim * pool.dtype.itemsize      # bytes per host index
base = pool.kv_buffer.data_ptr()
page = c.page
idx = -(-(2**64 - page + 1 - base) // stride)                          # base + idx*stride + page wraps past 2**64
r = c.backend.batch_set_v1([("ab" * 32)], torch.arange(idx, idx + pool.page_size, dtype=torch.int64))
print("ANSWERED", r)
r = c.backend.batch_get_v1([("ab" * 32)], torch.arange(idx, idx + pool.page_size, dtype=torch.int64))
print("ANSWERED", r)
"""


def wrapping_region(gds: str, target: str) -> Case:
    """A region whose end wraps past 2**64 (PageStore), or host indices that make one (HiCacheGDS)."""
    import sys
    case = Case("hostile", "region whose end wraps past 2**64" + (" (from host_indices)" if target == "sglang" else ""),
                target)
    case.injected = 1
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [repo, os.environ.get("PYTHONPATH", "")] if p))
    code = f"GDS = {os.path.join(gds, 'wrap-' + target)!r}\nimport os\nos.makedirs(GDS, exist_ok=True)\n" + (
        _WRAP_STORE if target == "store" else _WRAP_SGLANG)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    out = p.stdout.strip()
    if p.returncode < 0:
        case.exceptions = 1
        case.problems.append(f"the process died with signal {-p.returncode}"
                             f"{' (SIGSEGV)' if p.returncode == -11 else ''} after: {out[-200:]!r}")
        case.outcome = f"process killed by signal {-p.returncode}: the region check wraps and lets the address through"
    elif "REFUSED" in out or out.count("ANSWERED [False]") == 2:
        case.caught = 1
        case.outcome = out.splitlines()[-1][:200]
    else:
        case.problems.append(f"rc {p.returncode}: {out[-300:]} {p.stderr[-500:]}")
        case.outcome = "; ".join(case.problems)[:200]
    return case


# -- HiCacheGDS entry points -------------------------------------------------------------------------------

def hostile_sglang(root: str) -> list[Case]:
    import torch

    h = harness("sglang")
    par = _Parent(root, "hostile-sglang")
    c = Client("sglang", par.gds, slots=64, pages=16, identity={"model": "hostile"})
    b = c.backend
    pool = c.pool
    n_tokens = pool.kv_buffer.shape[1] if pool.layout == "page_first" else pool.size
    ks = _sgl_keys("h", 4)
    good_idx = h.host_indices(pool, range(4))
    out = []

    calls = Case("hostile", "HiCacheGDS data path: bad keys and host indices", "sglang")
    bad_keys = ["abc", [1, 2], [None], [b"x"], [""], ["a\x00b"], ["x" * 5000], ["ok", 3]]
    bad_indices = [None, [0, 1, 2, 3], good_idx[:-1], good_idx + n_tokens, -good_idx - 1,
                   torch.full_like(good_idx, 2**40), torch.empty(0, dtype=torch.int64), "0:64"]

    def call(what: str, fn: Callable[[], Any], ok: Callable[[Any], bool], case: Case | None = None) -> None:
        case = case or calls
        case.injected += 1
        try:
            r = fn()
        except Exception as exc:  # noqa: BLE001
            case.exceptions += 1
            case.problems.append(f"{what} raised {type(exc).__name__}: {exc}")
            return
        if ok(r):
            case.caught += 1
        else:
            case.problems.append(f"{what} returned {str(r)[:80]}")

    def falses(n: int) -> Callable[[Any], bool]:
        return lambda r: isinstance(r, list) and (n < 0 or len(r) == n) and not any(r)

    for i, k in enumerate(bad_keys):
        n = len(k) if isinstance(k, list) else -1
        call(f"batch_set_v1(keys #{i})", lambda k=k: b.batch_set_v1(k, good_idx), falses(n))
        call(f"batch_get_v1(keys #{i})", lambda k=k: b.batch_get_v1(k, good_idx), falses(n))
        call(f"batch_exists(keys #{i})", lambda k=k: b.batch_exists(k), lambda r: r == 0)
        call(f"exists(key #{i})", lambda k=k: b.exists(k), lambda r: r is False)
        call(f"get(key #{i})", lambda k=k: b.get(k), lambda r: r is None)
    for i, idx in enumerate(bad_indices):
        call(f"batch_set_v1(indices #{i})", lambda idx=idx: b.batch_set_v1(ks, idx), falses(4))
        call(f"batch_get_v1(indices #{i})", lambda idx=idx: b.batch_get_v1(ks, idx), falses(4))
    call("batch_set(values of the wrong size)", lambda: b.batch_set(ks, [torch.zeros(3)] * 4), lambda r: r is False)
    call("batch_set(4 keys, 2 values)", lambda: b.batch_set(ks, [torch.zeros(3)] * 2), lambda r: r is False)
    call("batch_get(targets of the wrong size)", lambda: b.batch_get(ks, [torch.zeros(3)] * 4),
         lambda r: r == [None] * 4)
    # indices SGLang never passes but that still name real pages: any per-page answer will do
    for what, idx in [("float indices", good_idx.float()), ("2-D indices", good_idx.view(4, -1))]:
        call(f"batch_set_v1({what})", lambda idx=idx: b.batch_set_v1(ks, idx), lambda r: isinstance(r, list))
    _still_works(calls, c, "bad SGLang calls")
    calls.outcome = f"{calls.caught}/{calls.injected} calls answered False / 0 / None; exceptions {calls.exceptions}"
    out.append(calls)
    out.append(wrapping_region(par.gds, "sglang"))

    unsized = Case("hostile", "HiCacheGDS: keys that are not a sequence (None, int), garbage v2 transfers", "sglang",)
    for k in (None, 5):
        call(f"batch_set_v1({k!r})", lambda k=k: b.batch_set_v1(k, good_idx), lambda r: r == [], unsized)
        call(f"batch_get_v1({k!r})", lambda k=k: b.batch_get_v1(k, good_idx), lambda r: r == [], unsized)
        call(f"batch_exists({k!r})", lambda k=k: b.batch_exists(k), lambda r: r == 0, unsized)
    call("batch_get_v2([object()])", lambda: b.batch_get_v2([object()]), lambda r: r == {}, unsized)
    call("batch_set_v2([object()])", lambda: b.batch_set_v2([object()]), lambda r: r == {}, unsized)
    unsized.outcome = f"{unsized.caught}/{unsized.injected} answered; {unsized.exceptions} raised into SGLang"
    out.append(unsized)

    sur = Case("hostile", "HiCacheGDS: key with a lone surrogate", "sglang")
    sur.injected = 1
    try:
        r = b.batch_set_v1(["bad" + SURROGATE], h.host_indices(pool, [0]))
        sur.caught = int(r == [False])
    except Exception as exc:  # noqa: BLE001
        sur.exceptions = 1
        sur.problems.append(f"raised {type(exc).__name__}: {exc}")
    _still_works(sur, c, "a surrogate key")
    sur.outcome = "False, and the namespace keeps working" if sur.ok else "; ".join(sur.problems)[:300]
    out.append(sur)
    c.close()

    cfg = Case("hostile", "HiCacheGDS construction: bad extra config", "sglang")
    for what, extra in [("unknown key", {"capacty": "1G"}), ("bad capacity", {"capacity": "lots"}),
                        ("bad enable_gds", {"enable_gds": "sometimes"}), ("gds_path a file", None)]:
        if extra is None:
            extra = {"gds_path": os.path.join(par.parent, "a-file")}
        sc = h.storage_config(par.gds, extra=extra)
        _expect_error(cfg, what, lambda sc=sc: h.attach(sc, h.make_pool(pages=4)).close(), (ConfigError,))
    cfg.outcome = f"{cfg.caught}/{cfg.injected} refused at construction with ConfigError naming the key"
    out.append(cfg)
    return par.check_outside(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gds-path", required=True)
    ap.add_argument("--target", choices=["store", "sglang"], default="store")
    ap.add_argument("--fuzz", type=int, default=200)
    args = ap.parse_args(argv)
    cases = (hostile_store(args.gds_path) if args.target == "store" else hostile_sglang(args.gds_path))
    cases += hostile_paths(args.gds_path, args.target)
    cases += [fuzz(args.gds_path, args.target, args.fuzz), privacy_modes(args.gds_path, args.target),
              tenant_isolation(args.gds_path, args.target), log_leaks(args.gds_path, args.target)]
    print(json.dumps([c.as_dict() for c in cases], indent=1))


if __name__ == "__main__":
    main()
