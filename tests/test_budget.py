"""One disk budget per node: namespaces under a GDS_PATH share the default budget; a new namespace
that finds no room removes the least recently used idle namespaces (whole, logged at INFO), and
`StoreFullError` comes only when open namespaces hold the space. On small tmpfs mounts (root), so
sizes and fullness are exact; other processes hold namespaces open, open new ones at the same
time, and get killed with SIGKILL."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from hicache_gds import PageStore, Pages, StoreFullError
from hicache_gds.slabs.capacity import dir_space
from hicache_gds.cli import main
from hicache_gds.memory import HostBuffer
from hicache_gds.tools.namespaces import find
from hicache_gds.slabs.removal import remove
from hicache_gds.slabs.owners import LOCK_FILE, setup_lock
from hicache_gds.testing.faults import small_tmpfs

MiB = 1 << 20
PAGE = 64 << 10
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def tmpfs(tmp_path):
    """A 64 MiB tmpfs (unmounted afterwards); skips where mounting needs privileges we lack."""
    with small_tmpfs(str(tmp_path / "mnt"), "64m") as mnt:
        if mnt is None:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        yield mnt


def _cfg(root: str, **cfg) -> dict:
    # tmpfs has no O_DIRECT: the bounce engine with buffered IO
    return {"gds_path": root, "engine": "bounce", "direct_io": False, **cfg}


def _open(root: str, name: str, **cfg) -> PageStore:
    return PageStore(PAGE, {"model": name}, config=_cfg(root, **cfg))


def _fill_to(root: str, fill: float) -> None:
    """Write a plain file so that `root`'s file system is `fill` full (not a namespace: never removed)."""
    s = dir_space(root)
    want = int(fill * s.total) - (s.total - s.available)
    with open(os.path.join(root, "other-data"), "ab") as f:
        f.write(os.urandom(want))
    assert abs(dir_space(root).fill - fill) < 0.01


def _below_ceiling(root: str, max_fill: float = 0.9) -> bool:
    """The mount is at most `max_fill` full, not counting the namespaces' small files (index, lock,
    use.json): the ceiling bounds the slab files."""
    small = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(root) for f in fs
                if f not in ("slab.bin", "other-data"))
    s = dir_space(root)
    return s.fill - small / s.total <= max_fill + 1e-6


def _roundtrip(st: PageStore, seed: int, n: int = 4) -> None:
    """Random pages in, back into a poisoned buffer, compared as bytes."""
    buf = HostBuffer(2 * n * PAGE, pinned=False)
    arr = buf.numpy()
    arr[:n * PAGE] = np.random.default_rng(seed).integers(0, 256, n * PAGE, dtype=np.uint8)
    arr[n * PAGE:] = 0xEE
    st.register_memory(buf.addr, buf.nbytes)
    keys = [f"{st.namespace}-{seed}-{i}" for i in range(n)]
    assert st.put(keys, Pages.contiguous(buf.addr, PAGE, range(n))) == [True] * n
    assert st.get(keys, Pages.contiguous(buf.addr, PAGE, range(n, 2 * n))) == [True] * n
    assert bytes(arr[:n * PAGE]) == bytes(arr[n * PAGE:])
    st.deregister_memory(buf.addr)
    buf.close()


def _names(root: str) -> set[str]:
    return {n.name for n in find([root])}


def test_three_namespaces_one_after_another_all_open_and_the_disk_stays_below_max_fill(tmpfs, caplog):
    """The operator's case: a disk 68 % full, three models one after another with no capacity set.
    Each gets the same default size; each new one removes the idle one before it."""
    caplog.set_level(logging.INFO, logger="hicache_gds")
    _fill_to(tmpfs, 0.68)
    sizes, names = [], []
    for i, model in enumerate(("model-a", "model-b", "model-c")):
        caplog.clear()
        with _open(tmpfs, model) as st:
            sizes.append(st.sizing.capacity)
            names.append(st.namespace)
            assert _below_ceiling(tmpfs), dir_space(tmpfs)
            _roundtrip(st, i)
            if i:
                (line,) = [r.getMessage() for r in caplog.records if "removed idle namespace" in r.getMessage()]
                assert names[i - 1] in line and "model=model-" in line and "idle since" in line
                assert "its last use ended closed" in line
                assert f"to make room for new namespace {st.namespace}" in line
                assert "max_fill is 90%" in line
                assert "removed 1 idle namespace(s) to make room" in st.sizing.how
        assert _names(tmpfs) == {names[-1]}
    # the same default ask each time: half of what hicache-gds may use (the 32 % the filler left)
    assert len(set(sizes)) == 1 and abs(sizes[0] - 0.16 * 64 * MiB) <= 2 * PAGE, sizes


def test_store_full_only_when_open_namespaces_hold_the_space(tmpfs):
    # One namespace held open by another process, one by this one: a third finds no room, and the
    # error names the open ones; both keep their pages.
    code = textwrap.dedent(f"""
        import sys
        from hicache_gds import PageStore
        st = PageStore({PAGE}, {{"model": "other-process"}},
                       config={{"gds_path": {tmpfs!r}, "engine": "bounce", "direct_io": False}})
        print(st.namespace, flush=True)
        sys.stdin.read()
        st.close()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO))
    try:
        theirs = p.stdout.readline().strip()
        with _open(tmpfs, "this-process") as mine:
            _roundtrip(mine, 1)
            with pytest.raises(StoreFullError, match=rf"hold .* there and are open \(pid .*{p.pid}.*\), so none "
                                                     rf"can be removed"):
                _open(tmpfs, "third")
            assert {theirs, mine.namespace} <= _names(tmpfs) and _below_ceiling(tmpfs)
            _roundtrip(mine, 2)
        # Now this one is idle: the third takes its room, the other process's stays
        with _open(tmpfs, "third") as third:
            assert mine.namespace not in _names(tmpfs) and theirs in _names(tmpfs)
            _roundtrip(third, 3)
    finally:
        p.stdin.close()
        p.wait(60)


def test_least_recently_used_idle_namespaces_go_first(tmpfs, caplog):
    caplog.set_level(logging.INFO, logger="hicache_gds.capacity")
    names = {}
    for model in ("x", "y", "z"):  # 3 x 16 MiB = 75 % of the mount, closed in this order
        with _open(tmpfs, model, capacity="16M") as st:
            _roundtrip(st, ord(model))
            names[model] = st.namespace
        time.sleep(0.05)
    with _open(tmpfs, "y", capacity="16M"):  # y is used again: x, then z, are now the oldest
        pass
    with _open(tmpfs, "w", capacity="16M"):  # 16 MiB more would be 100 %: one namespace must go, x
        assert _names(tmpfs) >= {names["y"], names["z"]} and names["x"] not in _names(tmpfs)
    with _open(tmpfs, "v", capacity="16M"):  # the next oldest idle one is z (w was used after it)
        assert names["z"] not in _names(tmpfs) and {names["y"]} <= _names(tmpfs)
    removed = [r.getMessage().split()[4] for r in caplog.records if "removed idle namespace" in r.getMessage()]
    assert removed == [names["x"], names["z"]], removed
    assert _below_ceiling(tmpfs)


def test_a_disk_filled_past_max_fill_by_other_data_removes_no_idle_namespace_for_nothing(tmpfs, caplog):
    """The disk is 92 % full with data that is not ours: removing the small idle namespaces cannot
    bring it under max_fill, so none is removed; their pages stay readable, and the log says why."""
    caplog.set_level(logging.INFO, logger="hicache_gds")
    _fill_to(tmpfs, 0.92)
    names, data = [], []
    for i, model in enumerate(("kept-a", "kept-b")):
        with _open(tmpfs, model, capacity="1M") as st:
            names.append(st.namespace)
            _roundtrip(st, 40 + i)
    caplog.clear()
    with _open(tmpfs, "new", capacity="1M") as st:
        assert "removed" not in st.sizing.how
        _roundtrip(st, 42)
    assert set(names) <= _names(tmpfs)
    assert not [r for r in caplog.records if "removed idle namespace" in r.getMessage()]
    (line,) = [r.getMessage() for r in caplog.records if "no idle namespace removed" in r.getMessage()]
    assert "needs" in line and "max_fill 90%" in line and "2 idle namespace(s) there hold" in line, line
    # What the idle namespaces acknowledged is still there, byte for byte
    for i, model in enumerate(("kept-a", "kept-b")):
        with _open(tmpfs, model, capacity="1M") as st:
            assert st.namespace == names[i]
            rng = np.random.default_rng(40 + i)
            want = rng.integers(0, 256, 4 * PAGE, dtype=np.uint8)
            buf = HostBuffer(4 * PAGE, pinned=False)
            buf.numpy()[:] = 0xEE
            st.register_memory(buf.addr, buf.nbytes)
            keys = [f"{st.namespace}-{40 + i}-{j}" for j in range(4)]
            assert st.get(keys, Pages.contiguous(buf.addr, PAGE, range(4))) == [True] * 4
            assert bytes(buf.numpy()) == bytes(want)
            st.deregister_memory(buf.addr)
            buf.close()


@pytest.mark.slow
def test_last_use_is_recorded_durably_and_ls_shows_idle_namespaces_and_since_when(tmpfs, capsys):
    # A closed namespace, an open one, and one whose process was killed with SIGKILL after a write.
    with _open(tmpfs, "closed", capacity="4M") as st:
        _roundtrip(st, 1)
        closed_ns = st.namespace
    t_closed = time.time()
    code = textwrap.dedent(f"""
        import time
        import numpy as np
        from hicache_gds import PageStore, Pages
        from hicache_gds.memory import HostBuffer
        st = PageStore({PAGE}, {{"model": "killed"}},
                       config={{"gds_path": {tmpfs!r}, "capacity": "4M", "engine": "bounce", "direct_io": False}})
        buf = HostBuffer({PAGE}, pinned=False)
        buf.numpy()[:] = np.random.default_rng(7).integers(0, 256, {PAGE}, dtype=np.uint8)
        st.register_memory(buf.addr, buf.nbytes)
        time.sleep(1.0)
        assert st.put(["k"], Pages.contiguous(buf.addr, {PAGE}, [0])) == [True]
        print(st.namespace, time.time(), flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO))
    try:
        killed_ns, t_write = p.stdout.readline().split()
        t_write = float(t_write)
        time.sleep(1.0)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    with _open(tmpfs, "open", capacity="4M") as live:
        rc = main(["ls", "--path", tmpfs, "--json"])
        by = {n["name"]: n for n in json.loads(capsys.readouterr().out)["namespaces"]}
        assert rc == 0
        c, k, o = by[closed_ns], by[killed_ns], by[live.namespace]
        assert c["idle"] and c["ended"] == "closed" and c["closed"] >= c["opened"]
        assert c["idle_since"] == c["last_use"] and c["idle_since"] <= t_closed and c["idle_since_iso"]
        # killed: no close recorded; idle since its last write (the index), not since the kill
        assert k["idle"] and k["ended"] == "without closing" and k["closed"] is None and k["opened"]
        assert k["opened"] + 0.9 < k["idle_since"] and abs(k["idle_since"] - t_write) < 0.5, (k, t_write)
        assert not o["idle"] and o["idle_since"] is None and o["open_by"] == [os.getpid()] and not o["ended"]
        assert main(["ls", "--path", tmpfs]) == 0
        text = capsys.readouterr().out
        assert "IDLE SINCE" in text and "(closed)" in text and "(its last process ended without closing)" in text
        assert "2 idle (" in text and "least recently used first" in text


@pytest.mark.slow
def test_two_processes_opening_new_namespaces_at_once_remove_only_idle_ones(tmpfs):
    """Two processes open new namespaces at the same moment on a mount where idle namespaces hold
    the room they need: each opens, each removes an idle namespace (never the other's, just
    opened), the mount stays below max_fill, and each reads back its own pages afterwards."""
    idle = []
    for model in ("idle-1", "idle-2"):  # 2 x 20 MiB idle: 62 % of the mount
        with _open(tmpfs, model, capacity="20M") as st:
            _roundtrip(st, 9)
            idle.append(st.namespace)
    go = os.path.join(os.path.dirname(tmpfs), "go")
    code = textwrap.dedent(f"""
        import os, sys, time
        import numpy as np
        from hicache_gds import PageStore, Pages
        from hicache_gds.memory import HostBuffer
        while not os.path.exists({go!r}):
            time.sleep(0.001)
        st = PageStore({PAGE}, {{"model": sys.argv[1]}},
                       config={{"gds_path": {tmpfs!r}, "capacity": "20M", "engine": "bounce", "direct_io": False}})
        n = 8
        buf = HostBuffer(2 * n * {PAGE}, pinned=False)
        a = buf.numpy()
        a[:n * {PAGE}] = np.random.default_rng(int(sys.argv[2])).integers(0, 256, n * {PAGE}, dtype=np.uint8)
        st.register_memory(buf.addr, buf.nbytes)
        keys = [f"k{{i}}" for i in range(n)]
        assert st.put(keys, Pages.contiguous(buf.addr, {PAGE}, range(n))) == [True] * n
        print(st.namespace, flush=True)
        sys.stdin.readline()  # both have opened: read back after the other's open
        a[n * {PAGE}:] = 0xEE
        ok = st.get(keys, Pages.contiguous(buf.addr, {PAGE}, range(n, 2 * n)))
        same = bytes(a[:n * {PAGE}]) == bytes(a[n * {PAGE}:])
        print(all(ok) and same and os.path.exists(os.path.join(st.dirs[0], "slab.bin")), flush=True)
        st.close()
    """)
    env = dict(os.environ, PYTHONPATH=REPO)
    ps = [subprocess.Popen([sys.executable, "-c", code, f"new-{i}", str(i)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, env=env) for i in range(2)]
    try:
        time.sleep(1.5)  # both started and polling
        open(go, "w").close()
        mine = [p.stdout.readline().strip() for p in ps]
        assert all(m.startswith("ns-") for m in mine), mine
        now = _names(tmpfs)
        assert set(mine) <= now and not set(idle) & now, (mine, idle, now)
        assert _below_ceiling(tmpfs), dir_space(tmpfs)
        for p in ps:
            p.stdin.write("\n")
            p.stdin.flush()
        assert [p.stdout.readline().strip() for p in ps] == ["True", "True"]
    finally:
        for p in ps:
            p.stdin.close()
            p.wait(60)
    assert all(p.returncode == 0 for p in ps)


def test_an_open_that_waited_while_its_namespace_was_removed_starts_it_empty(tmp_path):
    """A namespace removed (by clear or eviction, both holding its setup lock) while a store
    waited to open it: the store creates its directories again and opens it empty."""
    gds = str(tmp_path / "gds")
    os.mkdir(gds)
    cfg = {"gds_path": gds, "capacity": 16 * PAGE, "engine": "bounce"}
    with PageStore(PAGE, {"model": "m"}, config=cfg) as st:
        _roundtrip(st, 4)
        ns_dir = st.dirs[0]
    fd = os.open(os.path.join(ns_dir, LOCK_FILE), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what remove() holds while it removes
    got: dict = {}

    def opener() -> None:
        try:
            got["store"] = PageStore(PAGE, {"model": "m"}, config=cfg)
        except BaseException as exc:  # noqa: BLE001
            got["error"] = exc

    t = threading.Thread(target=opener)
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # waiting on the lock
    from hicache_gds.slabs.removal import RemoveReport, _remove_dirs
    rep = _remove_dirs([gds], os.path.basename(ns_dir), RemoveReport(os.path.basename(ns_dir)))
    assert rep.removed and not os.path.exists(ns_dir)
    os.close(fd)
    t.join(30)
    assert "error" not in got, got.get("error")
    with got["store"] as again:
        assert again.exists([f"{again.namespace}-4-0"]) == [False]  # started empty
        _roundtrip(again, 5)


def test_clear_refuses_a_namespace_a_store_is_opening(gds_dir, capsys):
    with PageStore(PAGE, {"model": "m"}, config={"gds_path": gds_dir, "capacity": 16 * PAGE, "engine": "bounce"}) as st:
        ns_dir = st.dirs[0]
    with setup_lock(ns_dir):  # as a store does while it opens
        rep = remove([gds_dir], os.path.basename(ns_dir))
        assert not rep.removed and "a store is opening it now" in rep.reason
    assert remove([gds_dir], os.path.basename(ns_dir)).removed


def test_striped_namespaces_are_removed_whole(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hicache_gds.capacity")
    with small_tmpfs(str(tmp_path / "a"), "32m") as a, small_tmpfs(str(tmp_path / "b"), "32m") as b:
        if a is None or b is None:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        path = f"{a},{b}"
        with contextlib.ExitStack() as stack:
            old = stack.enter_context(_open(path, "old"))
            _roundtrip(old, 1)
            old_dirs = list(old.dirs)
        with _open(path, "new") as new:  # needs the room old holds in both directories
            assert not any(os.path.exists(d) for d in old_dirs)
            assert new.sizing.capacity == old.sizing.capacity
            _roundtrip(new, 2)
        assert _below_ceiling(a) and _below_ceiling(b)
