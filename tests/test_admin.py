"""`hicache-gds ls`, `verify` and `clear`, on real namespaces written through `PageStore`.

Random page data; damage is done to the slab files the way a disk would (bytes changed in place);
a writer in another process works while `verify` runs; `clear` is given symbolic links and odd names
and must never remove or follow anything outside GDS_PATH.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hicache_gds import PageStore, Pages
from hicache_gds.cli import main
from hicache_gds.memory import HostBuffer
from hicache_gds.slabs.namespaces import open_by
from hicache_gds.tools.namespaces import find

PAGE = 64 << 10
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _store(gds: str, model: str, slots: int = 64, **cfg) -> PageStore:
    return PageStore(PAGE, {"model": model, "layout": "page_first"},
                     config={"gds_path": gds, "capacity": slots * PAGE, "engine": "bounce", **cfg})


def _fill(st: PageStore, keys: list[str], seed: int) -> np.ndarray:
    """Put random pages under `keys`; returns their bytes (one row per key)."""
    data = np.random.default_rng(seed).integers(0, 256, (len(keys), PAGE), dtype=np.uint8)
    buf = HostBuffer(len(keys) * PAGE, pinned=False)
    buf.numpy()[:] = data.ravel()
    st.register_memory(buf.addr, buf.nbytes)
    assert st.put(keys, Pages.contiguous(buf.addr, PAGE, range(len(keys)))) == [True] * len(keys)
    st.deregister_memory(buf.addr)
    buf.close()
    return data


def _read(st: PageStore, keys: list[str]) -> tuple[list[bool], np.ndarray]:
    buf = HostBuffer(len(keys) * PAGE, pinned=False)
    buf.numpy()[:] = 0xEE  # poison
    st.register_memory(buf.addr, buf.nbytes)
    ok = st.get(keys, Pages.contiguous(buf.addr, PAGE, range(len(keys))))
    out = buf.numpy().reshape(len(keys), PAGE).copy()
    st.deregister_memory(buf.addr)
    buf.close()
    return ok, out


def _cli(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(list(argv) + ["--json"])
    return rc, json.loads(capsys.readouterr().out)


def _tree(root: str) -> dict[str, tuple[int, int]]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            out[os.path.relpath(os.path.join(d, f), root)] = (st.st_size, st.st_mtime_ns)
    return out


def _slot(st: PageStore, key: str) -> int:
    (e,) = st.index.lookup_pin([key])
    st.index.unpin([e.slot])
    return e.slot


def _corrupt(st: PageStore, key: str) -> int:
    """Change bytes of `key`'s slot in place (as a failing disk would); returns the slot."""
    slot = _slot(st, key)
    fidx, off = st.slabs.place(np.array([slot]))
    fd = os.open(st.slabs.paths[int(fidx[0])], os.O_RDWR)
    try:
        os.pwrite(fd, b"\x00\x01\x02\x03" * 16, int(off[0]) + 1000)
    finally:
        os.close(fd)
    return slot


# -- ls --------------------------------------------------------------------------------------------

def test_ls_lists_identity_pages_bytes_capacity_last_use_and_the_open_writer(gds_dir, capsys):
    closed = _store(gds_dir, "closed", slots=32)
    _fill(closed, [f"c{i}" for i in range(5)], 1)
    closed.close()
    live = _store(gds_dir, "live", slots=16)
    try:
        _fill(live, [f"l{i}" for i in range(3)], 2)
        # The live store's own threads may touch its WAL and shared-memory index meanwhile: those
        # two files are compared by name only; everything else must be left exactly as it was.
        def quiet(tree: dict) -> dict:
            own = tuple(os.path.relpath(d, gds_dir) for d in live.dirs)
            return {k: (None if k.startswith(own) and k.endswith(("-wal", "-shm")) else v) for k, v in tree.items()}
        before = _tree(gds_dir)
        rc, out = _cli(capsys, "ls", "--path", gds_dir)
        assert rc == 0 and quiet(_tree(gds_dir)) == quiet(before)  # reading changed nothing (no new -wal/-shm)
        by = {n["identity"]["model"]: n for n in out["namespaces"]}
        assert by["closed"]["pages"] == 5 and by["closed"]["bytes"] == 5 * PAGE
        assert by["closed"]["capacity"] == 32 * PAGE and by["closed"]["slots"] == 32
        assert by["closed"]["open_by"] == [] and by["closed"]["last_use"] and by["closed"]["last_use_iso"]
        assert by["closed"]["idle"] and by["closed"]["idle_since"] == by["closed"]["last_use"]
        assert by["closed"]["ended"] == "closed" and by["closed"]["closed"] >= by["closed"]["opened"]
        assert by["live"]["pages"] == 3 and by["live"]["open_by"] == [os.getpid()]
        assert not by["live"]["idle"] and by["live"]["idle_since"] is None
        assert by["live"]["name"] == live.namespace and by["live"]["dirs"] == live.dirs
        assert main(["ls", "--path", gds_dir]) == 0
        text = capsys.readouterr().out
        assert live.namespace in text and str(os.getpid()) in text and "model=closed" in text
    finally:
        live.close()
    assert open_by(live.dirs[0]) == []


def test_open_by_sees_another_process_and_not_a_killed_one(gds_dir):
    code = textwrap.dedent(f"""
        import sys, time
        from hicache_gds import PageStore
        st = PageStore({PAGE}, {{"model": "child", "layout": "page_first"}},
                       config={{"gds_path": {gds_dir!r}, "capacity": {16 * PAGE}, "engine": "bounce"}})
        print(st.dirs[0], flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO))
    try:
        ns_dir = p.stdout.readline().strip()
        assert open_by(ns_dir) == [p.pid]
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert open_by(ns_dir) == []  # the lock file still names the pid; nobody holds it


def test_ls_with_no_gds_path_is_a_clear_error(capsys):
    assert main(["ls"]) == 2
    assert "GDS_PATH is not set" in capsys.readouterr().err


# -- verify ----------------------------------------------------------------------------------------

def test_verify_finds_and_drops_damaged_pages_and_keeps_the_rest(gds_dir, capsys):
    keys = [f"v{i}" for i in range(24)]
    st = _store(gds_dir, "verify", slots=32, gds_path=f"{gds_dir}")
    data = _fill(st, keys, 3)
    slots = {_corrupt(st, k) for k in (keys[2], keys[11], keys[20])}
    st.close()
    rc, out = _cli(capsys, "verify", "--path", gds_dir)
    (rep,) = out["reports"]
    assert rc == 1 and rep["checked"] == 24 and rep["ok"] == 21 and rep["dropped"] == 3
    assert {b["slot"] for b in rep["bad"]} == slots and all("key" not in b for b in rep["bad"])
    assert all(b["reason"] == "checksum mismatch" for b in rep["bad"])
    st = _store(gds_dir, "verify", slots=32)
    try:
        assert st.exists(keys) == [k not in (keys[2], keys[11], keys[20]) for k in keys]
        ok, got = _read(st, keys)
        for i, k in enumerate(keys):
            assert ok[i] == (i not in (2, 11, 20))
            if ok[i]:
                assert (got[i] == data[i]).all()
    finally:
        st.close()
    rc, out = _cli(capsys, "verify", "--path", gds_dir, "--keys")
    assert rc == 0 and out["reports"][0]["bad"] == [] and out["reports"][0]["checked"] == 21


def test_verify_drops_pages_the_way_open_stores_see(gds_dir, capsys):
    """verify's drops go through the index's own removal: a store that has the namespace open
    stops listing the pages at its next lookup, and their slots return to the free list (no slot
    left in no table)."""
    from hicache_gds.testing.invariants import index_problems
    keys = [f"o{i}" for i in range(12)]
    st = _store(gds_dir, "verify-open", slots=16)
    try:
        _fill(st, keys, 6)
        assert st.exists(keys) == [True] * 12
        _corrupt(st, keys[3])
        _corrupt(st, keys[8])
        rc, out = _cli(capsys, "verify", "--path", gds_dir)
        assert rc == 1 and out["reports"][0]["dropped"] == 2
        assert st.exists(keys) == [k not in (keys[3], keys[8]) for k in keys]
        assert index_problems(st.index) == []
    finally:
        st.close()


def test_verify_no_drop_reports_only_and_names_keys_when_asked(gds_dir, capsys):
    st = _store(gds_dir, "nodrop")
    _fill(st, ["a", "b", "c"], 4)
    _corrupt(st, "b")
    st.close()
    before = _tree(gds_dir)
    rc, out = _cli(capsys, "verify", "--path", gds_dir, "--no-drop", "--keys")
    assert rc == 1 and out["reports"][0]["bad"][0]["key"] == "b" and out["reports"][0]["dropped"] == 0
    assert _tree(gds_dir) == before


def test_verify_striped_namespace_places_slots_like_the_writer(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    gds = f"{a},{b}"
    st = _store(gds, "striped", slots=16)
    keys = [f"s{i}" for i in range(10)]
    _fill(st, keys, 5)
    bad = [k for k in keys if _slot(st, k) % 2 == 1][:2]  # in the second directory
    for k in bad:
        _corrupt(st, k)
    st.close()
    rc, out = _cli(capsys, "verify", "--path", gds, "--keys")
    assert rc == 1 and sorted(x["key"] for x in out["reports"][0]["bad"]) == sorted(bad)
    # Given only the first directory, verify still finds both (namespace.json records them, in order)
    rc, out = _cli(capsys, "verify", "--path", str(a))
    assert rc == 0 and out["reports"][0]["checked"] == 8
    # With the second directory gone, it refuses rather than misplace slots (good pages would look bad)
    os.rename(b / st.namespace, b / "moved")
    rc = main(["verify", "--path", str(a)])
    assert rc == 2 and "cannot be verified" in capsys.readouterr().err


_WRITER = textwrap.dedent("""
    import json, sys
    import numpy as np
    from hicache_gds import PageStore, Pages
    from hicache_gds.memory import HostBuffer
    PAGE, gds, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    st = PageStore(PAGE, {"model": "busy", "layout": "page_first"},
                   config={"gds_path": gds, "capacity": 24 * PAGE, "engine": "bounce"})
    buf = HostBuffer(8 * PAGE, pinned=False)
    st.register_memory(buf.addr, buf.nbytes)
    print(st.dirs[0], flush=True)
    sys.stdin.readline()
    rng = np.random.default_rng(9)
    for r in range(rounds):   # 8 new pages a round into 24 slots: the writer evicts and reuses slots
        keys = [f"r{r}-{i}" for i in range(8)]
        for i, k in enumerate(keys):   # a page's bytes derive from its key: the reader can check them
            buf.numpy()[i * PAGE:(i + 1) * PAGE] = np.random.default_rng(abs(hash(k)) % 2**32).integers(
                0, 256, PAGE, dtype=np.uint8)
        assert st.put(keys, Pages.contiguous(buf.addr, PAGE, range(8))) == [True] * 8
    st.close()
    print("done", flush=True)
""")


@pytest.mark.slow
def test_verify_while_another_process_writes_and_evicts_reports_nothing_false(gds_dir):
    # PYTHONHASHSEED fixed: the writer derives page bytes from hash(key)
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONHASHSEED="0")
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(PAGE), gds_dir, "300"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    from hicache_gds.tools.namespaces import verify
    reports = []
    try:
        ns_dir = p.stdout.readline().strip()
        p.stdin.write("go\n")
        p.stdin.flush()
        while p.poll() is None or not reports:
            (ns,) = [n for n in find([gds_dir]) if n.dirs[0] == ns_dir]
            reports.append(verify(ns))
    finally:
        out = p.communicate(timeout=300)[0]
    assert p.returncode == 0 and "done" in out
    assert all(r.bad == [] and r.dropped == 0 for r in reports), [r.bad for r in reports if r.bad]
    assert sum(r.checked for r in reports) > 0
    # and afterwards every page the writer left is there and intact
    (ns,) = [n for n in find([gds_dir]) if n.dirs[0] == ns_dir]
    final = verify(ns)
    assert final.checked == 24 and final.ok == 24


def test_verify_next_to_a_live_writer_drops_a_damaged_page_and_the_writer_misses_it(gds_dir, capsys):
    st = _store(gds_dir, "live-verify")
    try:
        data = _fill(st, ["x", "y", "z"], 6)
        _corrupt(st, "y")
        rc, out = _cli(capsys, "verify", "--path", gds_dir)
        assert rc == 1 and out["reports"][0]["dropped"] == 1 and out["reports"][0]["open_by"] == [os.getpid()]
        ok, got = _read(st, ["x", "y", "z"])
        assert ok == [True, False, True] and (got[0] == data[0]).all() and (got[2] == data[2]).all()
        assert st.exists(["y"]) == [False]  # the writer dropped it too, at that read
        _fill(st, ["y"], 7)  # and can store it again
        assert _read(st, ["y"])[0] == [True]
    finally:
        st.close()


# -- clear -----------------------------------------------------------------------------------------

def test_clear_refuses_an_open_namespace_unless_forced(gds_dir, capsys):
    st = _store(gds_dir, "open")
    try:
        _fill(st, ["a"], 8)
        rc, out = _cli(capsys, "clear", "--path", gds_dir, st.namespace)
        assert rc == 1 and not out["reports"][0]["removed"] and "open by pid" in out["reports"][0]["reason"]
        assert os.path.isdir(st.dirs[0]) and st.exists(["a"]) == [True]
        rc, out = _cli(capsys, "clear", "--path", gds_dir, "--force", st.namespace[:8])
        assert rc == 0 and out["reports"][0]["removed"] and out["reports"][0]["freed"] >= 64 * PAGE
        assert not os.path.exists(st.dirs[0])
    finally:
        st.close()  # the writer closes its deleted files without error
    assert os.listdir(gds_dir) == []


def test_clear_one_or_all_dry_run_and_bad_names(gds_dir, capsys):
    names = []
    for m in ("one", "two", "three"):
        st = _store(gds_dir, m, slots=8)
        _fill(st, ["k"], 9)
        names.append(st.namespace)
        st.close()
    before = _tree(gds_dir)
    rc, out = _cli(capsys, "clear", "--path", gds_dir, "--all", "--dry-run")
    assert rc == 0 and len(out["reports"]) == 3 and _tree(gds_dir) == before
    rc, out = _cli(capsys, "clear", "--path", gds_dir, names[1])
    assert rc == 0 and out["reports"][0]["files"] >= 3
    assert sorted(os.listdir(gds_dir)) == sorted([names[0], names[2]])
    for bad in ("../etc", "ns-../../x", "ns-", "ns-zz", names[1], "slab.bin", "/tmp"):
        assert main(["clear", "--path", gds_dir, bad]) == 2, bad
        err = capsys.readouterr().err
        assert "namespace" in err, err
    assert main(["clear", "--path", gds_dir]) == 2 and "--all" in capsys.readouterr().err
    rc, out = _cli(capsys, "clear", "--path", gds_dir, "--all")
    assert rc == 0 and len(out["reports"]) == 2 and os.listdir(gds_dir) == []


def test_clear_never_follows_or_removes_anything_outside(tmp_path, capsys):
    gds, outside = tmp_path / "gds", tmp_path / "outside"
    gds.mkdir()
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep me")
    (outside / "slab.bin").write_bytes(b"not ours")
    victim = outside / "ns-0123456789abcdef0123"
    victim.mkdir()
    (victim / "slab.bin").write_bytes(b"not ours either")
    st = _store(str(gds), "linked", slots=8)
    _fill(st, ["k"], 10)
    ns = st.dirs[0]
    st.close()
    # a link inside the namespace to a file outside, and a namespace-shaped link to a directory outside
    os.symlink(outside / "precious", os.path.join(ns, "extra-link"))
    os.symlink(victim, gds / "ns-0123456789abcdef0123")
    before = _tree(str(outside))
    # a link is not a namespace: not listed, not resolvable by name ...
    assert main(["clear", "--path", str(gds), "ns-0123456789abcdef0123"]) == 2
    assert "no namespace" in capsys.readouterr().err
    rc, out = _cli(capsys, "clear", "--path", str(gds), "--all")
    assert rc == 0 and [r["namespace"] for r in out["reports"]] == [os.path.basename(ns)]
    assert not os.path.exists(ns) and os.path.islink(gds / "ns-0123456789abcdef0123")
    # ... and removing it by name directly refuses through the descriptor it opens without following
    from hicache_gds.slabs.removal import remove
    rep = remove([str(gds)], "ns-0123456789abcdef0123", force=True)
    assert not rep.removed and "symbolic link" in rep.reason
    assert _tree(str(outside)) == before and (outside / "precious").read_bytes() == b"keep me"


def test_clear_leaves_a_namespace_holding_a_directory(gds_dir, capsys):
    st = _store(gds_dir, "odd", slots=8)
    ns = st.dirs[0]
    st.close()
    os.mkdir(os.path.join(ns, "sub"))
    rc, out = _cli(capsys, "clear", "--path", gds_dir, os.path.basename(ns))
    assert rc == 1 and "holds a directory" in out["reports"][0]["reason"]
    assert os.path.exists(os.path.join(ns, "slab.bin"))


def test_console_script_runs(gds_dir):
    p = subprocess.run([sys.executable, "-m", "hicache_gds.cli", "ls", "--json", "--path", gds_dir],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO), timeout=120)
    assert p.returncode == 0 and json.loads(p.stdout)["namespaces"] == []
