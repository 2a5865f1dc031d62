"""Fuzzing and privacy: random and hostile keys and regions, file modes, tenant isolation, and
what the logs may say (`hostile` runs them with the entry-point cases)."""

from __future__ import annotations

import logging
import os
import stat
from typing import Any

import numpy as np

from ..errors import ConfigError
from .cases import Case, capture_logs
from .clients import Client
from .targets import harness, key
from .hostile_base import _sgl_keys, _still_works

__all__ = ["fuzz", "privacy_modes", "tenant_isolation", "log_leaks"]

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


