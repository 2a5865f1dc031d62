"""Default capacity: one INFO line at open says how large and why; a file system is never taken past
`max_fill` by default; namespaces opened one after another ask for the same size, not for a share of
what the earlier ones left. On small tmpfs mounts (root), so sizes and fullness are exact."""

from __future__ import annotations

import contextlib
import logging
import os

import numpy as np
import pytest

from hicache_gds import PageStore, Pages, StoreFullError
from hicache_gds.slabs.capacity import default_budget, dir_space
from hicache_gds.memory import HostBuffer
from hicache_gds.testing.faults import small_tmpfs

MiB = 1 << 20
PAGE = 64 << 10


@pytest.fixture
def tmpfs(tmp_path):
    """A 64 MiB tmpfs (unmounted afterwards); skips where mounting needs privileges we lack."""
    with small_tmpfs(str(tmp_path / "mnt"), "64m") as mnt:
        if mnt is None:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        yield mnt


def _open(root, name, **cfg) -> PageStore:
    # tmpfs has no O_DIRECT: the bounce engine with buffered IO
    return PageStore(PAGE, {"model": name}, config={"gds_path": root, "engine": "bounce", "direct_io": False, **cfg})


def _below_ceiling(root: str, max_fill: float = 0.9) -> bool:
    """The mount is at most `max_fill` full, not counting the namespaces' small files (index, lock):
    the ceiling bounds the slab files."""
    small = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(root) for f in fs if f != "slab.bin")
    s = dir_space(root)
    return s.fill - small / s.total <= max_fill + 1e-6


def _capacity(st: PageStore) -> int:
    return st.stats()["slots"] * st.slot_bytes


def test_default_is_logged_and_never_past_max_fill_and_the_same_for_a_later_namespace(tmpfs, caplog):
    caplog.set_level(logging.INFO, logger="hicache_gds.store")
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(_open(tmpfs, "a"))
        line = [r.getMessage() for r in caplog.records if "capacity" in r.getMessage()]
        assert len(line) == 1 and a.dirs[0] in line[0] and "default: 0.5 of" in line[0], line
        assert abs(_capacity(a) - 32 * MiB) <= PAGE  # half of an empty 64 MiB
        # A second namespace asks for the same 32 MiB (the first's slab counts as held, not as gone);
        # the fill ceiling grants what keeps the mount at 90 % -- not "half of what is left" (16 MiB).
        caplog.clear()
        b = stack.enter_context(_open(tmpfs, "b"))
        assert 24 * MiB < _capacity(b) <= 26 * MiB
        assert "capped so the file system stays at most 90% full" in caplog.text
        assert "held by 1 other namespace" in caplog.text
        assert _below_ceiling(tmpfs)
        # A third: no room left below the ceiling, and both are open -- refused, naming the ceiling and
        # what holds the space
        with pytest.raises(StoreFullError, match=r"max_fill=0.9.*2 hicache-gds namespace\(s\).*are open.*hicache-gds ls"):
            _open(tmpfs, "c")
        assert _below_ceiling(tmpfs)
        # Data still round-trips in the capped namespace (random pages, poisoned destination)
        buf = HostBuffer(8 * PAGE, pinned=False)
        arr = buf.numpy()
        arr[:4 * PAGE] = np.random.default_rng(3).integers(0, 256, 4 * PAGE, dtype=np.uint8)
        arr[4 * PAGE:] = 0xEE
        b.register_memory(buf.addr, buf.nbytes)
        assert b.put(["k0", "k1", "k2", "k3"], Pages.contiguous(buf.addr, PAGE, range(4))) == [True] * 4
        assert b.get(["k0", "k1", "k2", "k3"], Pages.contiguous(buf.addr, PAGE, range(4, 8))) == [True] * 4
        assert (arr[:4 * PAGE] == arr[4 * PAGE:]).all()
        b.deregister_memory(buf.addr)
        buf.close()
    # Restart: each namespace keeps its size, whatever the disk looks like now
    caplog.clear()
    with _open(tmpfs, "b") as again:
        assert 24 * MiB < _capacity(again) <= 26 * MiB and "kept from the namespace's first open" in caplog.text


def test_namespaces_one_after_another_ask_alike_and_stop_at_the_ceiling(tmpfs):
    # Several default namespaces one after another: the mount ends at most max_fill full, and the
    # ones that fit get equal asks (only the last one is capped).
    sizes = []
    with contextlib.ExitStack() as stack:
        for i in range(6):
            try:
                sizes.append(_capacity(stack.enter_context(_open(tmpfs, f"n{i}", capacity_fraction=0.2))))
            except StoreFullError:
                break
        below = _below_ceiling(tmpfs)
    assert below
    assert len(sizes) >= 4 and len(set(sizes[:-1])) == 1 and sizes[-1] <= sizes[0], sizes


def test_configured_capacity_and_its_source_are_logged(tmpfs, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="hicache_gds.store")
    with _open(tmpfs, "cfg", capacity="4M") as st:
        assert _capacity(st) == 4 * MiB
    assert "configured (capacity=4194304 from the config's capacity key)" in caplog.text
    caplog.clear()
    monkeypatch.setenv("HICACHE_GDS_CAPACITY", "2M")
    with _open(tmpfs, "env") as st:
        assert _capacity(st) == 2 * MiB
    assert "from HICACHE_GDS_CAPACITY" in caplog.text


def test_max_fill_is_a_setting(tmpfs):
    with _open(tmpfs, "half", max_fill=0.25) as st:  # 0.5 of 64 MiB asked, a quarter of the mount granted
        assert 15 * MiB < _capacity(st) <= 16 * MiB
    with pytest.raises(ValueError, match="max_fill"):
        _open(tmpfs, "bad", max_fill=1.5)


def test_striped_directories_get_the_smaller_ones_share(tmp_path):
    with small_tmpfs(str(tmp_path / "big"), "64m") as big, small_tmpfs(str(tmp_path / "small"), "16m") as small:
        if big is None or small is None:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        b = default_budget([big, small], 0.5, 0.9)
        assert b.per_dir == 8 * MiB and b.total == 16 * MiB and f"in {small}" in b.how, b
        with PageStore(PAGE, {"model": "striped"}, config={"gds_path": f"{big},{small}", "engine": "bounce",
                                                           "direct_io": False}) as st:
            assert _capacity(st) == 16 * MiB
            assert [os.path.getsize(os.path.join(d, "slab.bin")) for d in st.dirs] == [8 * MiB, 8 * MiB]


def test_doctor_shows_what_a_namespace_would_get(tmpfs):
    from hicache_gds.tools.doctor import collect, render_text
    with _open(tmpfs, "first"):
        rep = collect(tmpfs)
        want = default_budget([tmpfs], 0.5, 0.9).total  # while open: closing checkpoints the index's WAL
    cap = rep["capacity"]
    assert cap["configured"] is None and cap["max_fill"] == 0.9
    assert cap["dirs"][0]["hicache_namespaces"] == 1 and cap["dirs"][0]["hicache_held"] >= 32 * MiB
    assert abs(cap["default_per_namespace"] - want) <= PAGE
    text = render_text(rep)
    assert "a new namespace would get 25." in text and "1 hicache-gds namespace(s) hold 32." in text, text
    # "first" is idle now: the next namespace removes it and gets the same default share
    with _open(tmpfs, "second") as second:
        assert abs(_capacity(second) - 32 * MiB) <= PAGE and dir_space(tmpfs).namespaces == 1
        with _open(tmpfs, "third"):  # capped: "second" is open, nothing idle to remove
            rep = collect(tmpfs)
    # ... so with both open no room is left below the ceiling: a problem (the store would not open)
    assert not rep["ok"] and any("max_fill" in p and "are open" in p for p in rep["problems"]), rep["problems"]
    # Both closed: doctor says a new namespace would get its share by removing idle ones
    rep = collect(tmpfs)
    assert rep["ok"], rep["problems"]
    (d,) = rep["capacity"]["dirs"]
    assert d["hicache_idle_namespaces"] == 2 and d["hicache_idle"] >= 56 * MiB and d["open_by"] == []
    assert "room made by removing idle namespaces" in rep["capacity"]["default_how"]
    assert abs(rep["capacity"]["default_per_namespace"] - 32 * MiB) <= PAGE
    assert "2 of them idle (" in render_text(rep)
