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
import stat
import subprocess
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError, HiCacheGDSError
from .cases import Case, capture_logs, snapshot_tree, tree_changes
from .clients import Client
from .invariants import index_problems
from .targets import harness, key

__all__ = ["hostile_store", "hostile_sglang", "hostile_paths", "fuzz", "privacy_modes", "tenant_isolation",
           "log_leaks"]

_CLEAR = (TypeError, ValueError, OSError)  # ConfigError, RegionError subclass ValueError; store errors OSError
SURROGATE = "\udcff"


def _expect_error(case: Case, what: str, fn: Callable[[], Any], errors: tuple = _CLEAR) -> None:
    case.injected += 1
    try:
        out = fn()
    except errors as exc:
        if not str(exc):
            case.problems.append(f"{what}: {type(exc).__name__} without a message")
        else:
            case.caught += 1
        return
    except Exception as exc:  # noqa: BLE001
        case.exceptions += 1
        case.problems.append(f"{what}: {type(exc).__name__} is not a clear error: {exc}")
        return
    case.problems.append(f"{what}: accepted (returned {str(out)[:80]})")


def _still_works(case: Case, c: Client, tag: str) -> None:
    ks = [f"{tag}-ok-{i}" for i in range(4)] if c.backend is None else _sgl_keys(f"{tag}-ok", 4)
    try:
        ok = c.put(ks)
        v = c.verify(ks)
        case.check(all(ok) and v["good"] == 4, f"after {tag}: the store no longer works ({sum(ok)}/4 puts, "
                                               f"{v['good']}/4 reads)")
    except Exception as exc:  # noqa: BLE001
        case.problems.append(f"after {tag}: the store raises {type(exc).__name__}: {exc}")


def _sgl_keys(tag: str, n: int) -> list[str]:
    return [key("sglang", f"{tag}-{i}") for i in range(n)]


class _Parent:
    """GDS_PATH inside a parent that also holds 'outside' files symlinks point at."""

    def __init__(self, root: str, name: str) -> None:
        self.parent = os.path.join(root, name)
        self.gds = os.path.join(self.parent, "gds")
        self.outside = os.path.join(self.parent, "outside")
        os.makedirs(self.gds, exist_ok=True)
        os.makedirs(self.outside, exist_ok=True)
        open(os.path.join(self.parent, "a-file"), "w").close()  # for "GDS_PATH is a file"
        for n in ("victim-slab", "victim-db", "victim-wal", "victim-lock", "victim-json"):
            with open(os.path.join(self.outside, n), "wb") as f:
                f.write(b"precious bytes that must not change\n")
            os.chmod(os.path.join(self.outside, n), 0o644)
        self.before = snapshot_tree(self.parent)

    def outside_changes(self) -> list[str]:
        return tree_changes(self.before, snapshot_tree(self.parent), [self.gds])

    def check_outside(self, cases: list[Case]) -> list[Case]:
        """Fail every case if anything outside GDS_PATH changed; returns `cases`."""
        changed = self.outside_changes()
        for case in cases:
            case.check(not changed, f"changed outside GDS_PATH: {changed[:3]}")
        return cases


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


# -- fuzz -----------------------------------------------------------------------------------------------------

def fuzz(root: str, target: str = "store", examples: int = 200, *, surrogates: bool = False) -> Case:
    """Hypothesis fuzz of config parsing and of keys (and host indices) at the data path."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from ..config import Config, describe_keys
    case = Case("fuzz", f"config and key fuzz{' (with lone surrogates)' if surrogates else ''}", target)
    cfg_set = settings(max_examples=examples, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))
    n = {"config": 0, "keys": 0}
    names = [k for k, *_ in describe_keys()]
    values = st.one_of(st.text(max_size=30), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.booleans(),
                       st.none(), st.lists(st.text(max_size=6), max_size=3), st.binary(max_size=8))

    @cfg_set
    @given(st.dictionaries(st.one_of(st.sampled_from(names), st.text(max_size=12)), values, max_size=5),
           st.dictionaries(st.one_of(st.sampled_from(["HICACHE_GDS_" + k.upper() for k in names]),
                                     st.text(max_size=12).map(lambda s: "HICACHE_GDS_" + s)),
                           st.text(max_size=20), max_size=3))
    def fuzz_config(overrides: dict, env: dict) -> None:
        n["config"] += 1
        try:
            Config.load(overrides, env=env)
        except ConfigError:
            pass

    alphabet = st.characters(codec=None) if surrogates else st.characters(blacklist_categories=("Cs",))
    key = st.one_of(st.text(alphabet=alphabet, max_size=40), st.text(alphabet=alphabet, min_size=1000, max_size=1100),
                    st.binary(max_size=8), st.integers(), st.none())
    fd = os.path.join(root, f"fuzz-{target}{'-sur' if surrogates else ''}")
    os.makedirs(fd, exist_ok=True)
    c = Client(target, fd, slots=128, pages=8, identity={"model": "fuzz"})

    if target == "store":
        from hicache_gds import Pages

        @cfg_set
        @given(st.one_of(st.lists(key, max_size=8, unique=True), key))
        def fuzz_keys(keys: Any) -> None:
            n["keys"] += 1
            try:
                c.store.exists(keys)
            except (TypeError, ValueError):
                return
            m = len(keys)
            res = c.store.put(keys, Pages.contiguous(c.buf.addr, c.page, range(m)))
            assert len(res) == m and c.store.exists(keys) == res
            assert c.store.get(keys, Pages.contiguous(c.buf.addr, c.page, range(m))) == res
            c.store.delete(keys)
    else:
        h = harness(target)
        b = c.backend
        ntok = c.pool.size

        sized = st.one_of(st.lists(key, max_size=8, unique=True), st.text(max_size=8))  # unsized keys: P1

        @cfg_set
        @given(sized, st.one_of(st.none(), st.lists(st.integers(-2 * ntok, 2 * ntok), max_size=64)))
        def fuzz_keys(keys: Any, idx: Any) -> None:
            import torch
            n["keys"] += 1
            hi = torch.tensor(idx, dtype=torch.int64) if idx is not None else None
            m = len(keys) if isinstance(keys, list) else None
            for r in (b.batch_set_v1(keys, hi), b.batch_get_v1(keys, hi)):
                assert isinstance(r, list) and (m is None or len(r) == m)
            assert isinstance(b.batch_exists(keys), int)
            if isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys):
                res = b.batch_set_v1(keys, h.host_indices(c.pool, range(len(keys))))
                assert len(res) == len(keys)

    for fn in (fuzz_config, fuzz_keys):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            case.problems.append(f"{fn.__name__}: {type(exc).__name__}: {str(exc)[:400]}")
    _still_works(case, c, "fuzzing")
    c.close()
    case.injected = n["config"] + n["keys"]
    case.caught = case.injected if case.ok else 0
    case.outcome = f"{n['config']} config cases, {n['keys']} key cases" + ("" if case.ok else "; FAILED")
    return case


# -- privacy --------------------------------------------------------------------------------------------------

def privacy_modes(root: str, target: str = "store") -> Case:
    """Under umask 000: namespace dirs 0700, every file 0600 (SQLite -wal/-shm and moved-aside index too)."""
    case = Case("privacy", "modes: dirs 0700, files 0600, under umask 000", target)
    d = os.path.join(root, f"modes-{target}")
    os.makedirs(d, exist_ok=True)
    old = os.umask(0)
    seen: dict[str, int] = {}

    def walk(when: str) -> None:
        for r, dirs, files in os.walk(d):
            for n in dirs:
                p = os.path.join(r, n)
                m = stat.S_IMODE(os.lstat(p).st_mode)
                seen[f"{when}:{os.path.relpath(p, d)}"] = m
                case.check(m == 0o700, f"{when}: dir {os.path.relpath(p, d)} has mode {m:o}")
            for n in files:
                p = os.path.join(r, n)
                m = stat.S_IMODE(os.lstat(p).st_mode)
                seen[f"{when}:{os.path.relpath(p, d)}"] = m
                case.check(m == 0o600, f"{when}: file {os.path.relpath(p, d)} has mode {m:o}")
    try:
        c = Client(target, d, slots=64, pages=8, identity={"model": "modes"})
        ks = [f"m-{i}" for i in range(8)] if target == "store" else _sgl_keys("m", 8)
        c.put(ks)
        c.read(ks)
        db = c.index.db_path
        case.check(os.path.exists(db + "-wal") and os.path.exists(db + "-shm"), "no -wal/-shm while open")
        walk("open")
        c.close()
        with open(db, "r+b") as f:  # damage it: the next open moves it aside (with -wal/-shm)
            f.write(os.urandom(8192))
        c = Client(target, d, slots=64, pages=8, identity={"model": "modes"})
        c.put(ks)
        walk("reopened after damage")
        c.close()
        walk("closed")
    finally:
        os.umask(old)
    names = sorted({k.split(":", 1)[1] for k in seen})
    case.injected = len(seen)
    case.caught = sum(1 for k, m in seen.items() if m in (0o600, 0o700))
    case.outcome = f"{case.caught}/{len(seen)} checks right: " + ", ".join(
        n.split("/")[-1] for n in names if "/" in n)[:400]
    return case


def tenant_isolation(root: str, target: str = "store") -> Case:
    """Tenants (HICACHE_GDS_NAMESPACE, env or config) never see each other's pages."""
    case = Case("privacy", "tenant isolation (HICACHE_GDS_NAMESPACE)", target)
    d = os.path.join(root, f"tenants-{target}")
    os.makedirs(d, exist_ok=True)
    ks = [f"t-{i}" for i in range(8)] if target == "store" else _sgl_keys("t", 8)
    a = Client(target, d, slots=64, pages=8, identity={"model": "tenants"}, config={"namespace": "tenant-a"},
               salt="A")
    os.environ["HICACHE_GDS_NAMESPACE"] = "tenant-b"
    try:
        b = Client(target, d, slots=64, pages=8, identity={"model": "tenants"}, salt="B")
    finally:
        del os.environ["HICACHE_GDS_NAMESPACE"]
    none = Client(target, d, slots=64, pages=8, identity={"model": "tenants"}, salt="N")
    try:
        case.injected = 3
        case.check(all(a.put(ks)), "tenant a could not write")
        case.check(not any(b.exists(ks)) and not any(none.exists(ks)), "another tenant sees tenant a's pages")
        case.check(all(g is None for g in b.read(ks)), "another tenant reads tenant a's pages")
        case.check(all(b.put(ks)), "tenant b could not write the same keys")
        case.check(a.verify(ks)["good"] == 8 and b.verify(ks)["good"] == 8, "a tenant's pages were overwritten")
        b.clear()
        case.check(a.verify(ks)["good"] == 8, "tenant b's clear removed tenant a's pages")
        dirs = {os.path.dirname(x.index.db_path) for x in (a, b, none)}
        case.check(len(dirs) == 3, "tenants share a namespace directory")
        case.caught = 3 if case.ok else 0
        case.outcome = "3 tenants (config, env, none): separate namespaces, same keys never shared, clear is per tenant"
    finally:
        for x in (a, b, none):
            x.close()
    return case


def log_leaks(root: str, target: str = "store") -> Case:
    """Run puts, gets, misses, checksum failures, IO faults and an index reset with distinctive keys and page
    bytes; no key and no page bytes may appear in any log line at INFO or above (DEBUG reported)."""
    from ..engines.faulty import Faults
    from . import faults as F
    case = Case("privacy", "no keys or page bytes in logs", target)
    d = os.path.join(root, f"logs-{target}")
    os.makedirs(d, exist_ok=True)
    if target == "store":
        ks = [f"SECRET-KEY-{i:04d}-ZQX" for i in range(24)]
        needles = ks + ["SECRET-KEY", "ZQX"]
    else:
        ks = _sgl_keys("secret", 24)
        needles = ks + [k[:16] for k in ks] + [k[-16:] for k in ks]
    blob = (b"PAGE-SECRET-BYTES-" * 4096)
    with capture_logs(logging.DEBUG) as logs:
        c = Client(target, d, slots=64, pages=24, identity={"model": "logs"}, engine="faulty-nixl-posix",
                   config={"io_timeout": 0.5})
        data = [blob[:c.page]] * len(ks)
        c.put(ks, data)
        c.read(ks + [k + "x" for k in ks[:2]])
        # a checksum failure
        sk0 = c.store_keys(ks[:1])[0]
        e = c.index.peek([sk0])[sk0]
        fi, off = c.store.slabs.place(np.array([e.slot]))
        fd = os.open(c.store.slabs.paths[int(fi[0])], os.O_RDWR)
        os.pwrite(fd, b"\x00" * 16, int(off[0]) + 100)
        os.close(fd)
        c.read(ks[:4])
        F.set_faults(Faults(eio=1.0, seed=1))
        c.put(ks[:2], data[:2])
        c.store.delete(c.store_keys(ks[4:6]))
        c.put(ks[4:6], data[:2])
        c.read(ks[6:8])
        F.set_faults(Faults(hang=1.0, seed=1))
        c.read(ks[8:10])
        F.set_faults(None)
        c.clear()
        c.close()
        with open(c.index.db_path, "r+b") as f:
            f.write(os.urandom(8192))
        Client(target, d, slots=64, pages=24, identity={"model": "logs"}).close()
    info = logs.text(logging.INFO)
    debug = logs.text(logging.DEBUG)
    hay_bytes = "PAGE-SECRET"
    leaked = [n for n in needles if n in info] + ([hay_bytes] if hay_bytes in info else [])
    leaked_debug = [n for n in needles if n in debug and n not in info] + (
        [hay_bytes] if hay_bytes in debug and hay_bytes not in info else [])
    case.injected = len(logs.records)
    case.caught = len(logs.records) - sum(1 for r in logs.records if any(n in logs.format(r) for n in needles))
    case.check(not leaked, f"keys or page bytes in INFO+ logs: {leaked[:3]}")
    case.check("WARNING" in info or "ERROR" in info, "the run produced no warnings at all (faults not exercised?)")
    case.outcome = (f"{len(logs.records)} log records ({sum(r.levelno >= logging.WARNING for r in logs.records)} "
                    f"warnings/errors) with distinctive keys and page bytes: {len(leaked)} leaks at INFO+"
                    + (f", {len(leaked_debug)} at DEBUG only" if leaked_debug else ", none at DEBUG"))
    return case


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
