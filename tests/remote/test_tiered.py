"""TieredStore: local PageStore + RemoteTier, modes local / remote / both, write-through / write-back."""

from __future__ import annotations

import uuid

import pytest

from remote_procs import PAGE, free_port
from remote_helpers import Bufs

from hicache_gds.remote import TieredStore


def make(cluster, tmp_path, **kw) -> TieredStore:  # noqa: ANN001, ANN003
    url = kw.pop("url", cluster["url"])
    cfg = {"gds_path": str(tmp_path / "nvme"), "capacity": "16M", "remote_url": url,
           "remote_prefix": cluster["prefix"], "remote_timeout": 1.0, "io_timeout": 10}
    (tmp_path / "nvme").mkdir(exist_ok=True)
    return TieredStore(PAGE, {"test": uuid.uuid4().hex}, config=cfg, **kw)


def keys_of(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:6]
    return [f"{tag}-{i}" for i in range(n)]


@pytest.mark.parametrize("mode", ["local", "remote", "both"])
def test_modes_round_trip(cluster, tmp_path, mode):
    with make(cluster, tmp_path, mode=mode) as st:
        keys = keys_of(12)
        b = Bufs(st, 12, PAGE)
        assert st.put(keys, b.fill(keys)) == [True] * 12
        assert st.exists(keys) == [True] * 12 and st.prefix(keys + ["absent"]) == 12
        ok = st.get(keys, b.poisoned(12))
        assert ok == [True] * 12
        b.check(keys, ok)
        assert (st.local is not None) == (mode != "remote") and (st.remote is not None) == (mode != "local")
        if mode == "both":
            assert st.local.exists(keys) == [True] * 12 and st.remote.exists(keys) == [True] * 12
        assert st.delete(keys[:3]) == [True] * 3 and st.exists(keys[:3]) == [False] * 3
        st.clear()
        assert st.exists(keys) == [False] * 12


def test_remote_hits_are_promoted_to_local(cluster, tmp_path):
    with make(cluster, tmp_path, mode="both") as st:
        keys = keys_of(8)
        b = Bufs(st, 8, PAGE)
        assert st.remote.put(keys, b.fill(keys)) == [True] * 8  # only in the remote tier
        assert st.local.exists(keys) == [False] * 8
        ok = st.get(keys, b.poisoned(8))
        assert ok == [True] * 8
        b.check(keys, ok)
        assert st.local.exists(keys) == [True] * 8
        assert st.stats()["promoted"] == 8
        st.clear()


def test_write_back_reaches_remote_later(cluster, tmp_path):
    with make(cluster, tmp_path, mode="both", write="back") as st:
        keys = keys_of(40)
        b = Bufs(st, 40, PAGE)
        assert st.put(keys, b.fill(keys)) == [True] * 40
        b.src.numpy()[:] = 0  # the caller may reuse its memory at once
        assert st.flush(30)
        assert st.remote.exists(keys) == [True] * 40
        st.local.delete(keys)
        ok = st.get(keys, b.poisoned(40))  # now served by the remote tier
        assert ok == [True] * 40
        b.check(keys, ok)
        s = st.stats()
        assert s["writeback_done"] == 40 and s["writeback_dropped"] == 0
        st.clear()


def test_dead_remote_leaves_local_working(cluster, tmp_path, caplog):
    with make(cluster, tmp_path, mode="both", url=f"redis://127.0.0.1:{free_port()}/0") as st:
        keys = keys_of(6)
        b = Bufs(st, 6, PAGE)
        assert st.put(keys, b.fill(keys)) == [True] * 6
        st.local.delete(keys[:2])
        ok = st.get(keys, b.poisoned(6))
        assert ok == [False, False] + [True] * 4
        b.check(keys, ok)
        assert st.stats()["remote"]["redis_errors"] >= 1


def test_bad_mode_is_a_config_error(cluster, tmp_path):
    from hicache_gds.errors import ConfigError
    with pytest.raises(ConfigError):
        make(cluster, tmp_path, mode="sideways")
