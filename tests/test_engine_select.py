"""`auto` and `doctor` go by what engines declare (`Traits`), not by their names: engines installed
through the `hicache_gds.engines` entry-point group at run time -- real engines, built on the bounce
engine, from a distribution on `sys.path` -- are chosen, refused and diagnosed by their traits."""

from __future__ import annotations

import importlib
import sys
import textwrap

import numpy as np
import pytest

from hicache_gds import PageStore, Pages
from hicache_gds import engines as registry_module
from hicache_gds.config import Config
from hicache_gds.engines import engine_names
from hicache_gds.engines.base import MemKind
from hicache_gds.engines.cufile_env import gpu_present
from hicache_gds.engines.select import candidates, choose_engine
from hicache_gds.errors import ConfigError, EngineUnavailable, GDSUnavailable
from hicache_gds.memory import HostBuffer

no_gpu = pytest.mark.skipif(gpu_present(), reason="expects a machine without a GPU (the CPU machine)")
PAGE = 64 << 10

_MODULE = '''
"""Engines of a third-party distribution: the bounce engine under other names and other traits."""
import dataclasses

from hicache_gds.engines.base import MemKind, Traits
from hicache_gds.engines.bounce import BounceEngine


class _Plugin(BounceEngine):
    def __init__(self, options):
        super().__init__(options)
        self._caps = dataclasses.replace(self._caps, mem_kinds=self._caps.mem_kinds & self.traits.mem_kinds,
                                         path=f"{self.name} (plugin): {self._caps.path}")


class HostEngine(_Plugin):
    """Host memory only, preferred to every built-in engine by `auto`."""
    name = "plugin-host"
    traits = Traits(mem_kinds=frozenset({MemKind.DRAM}), auto_rank=50)


class GpuHostEngine(_Plugin):
    """Ranked above plugin-host, but declares it needs a GPU."""
    name = "plugin-gpu-host"
    traits = Traits(mem_kinds=frozenset({MemKind.DRAM}), needs_gpu=True, auto_rank=60)


class GdsEngine(_Plugin):
    """Declares GPU-direct IO through cuFile, ranked above NIXL's."""
    name = "plugin-gds"
    traits = Traits(mem_kinds=frozenset({MemKind.DRAM, MemKind.VRAM}), uses_cufile=True, needs_gpu=True,
                    auto_rank=90)


class NeedsMissingEngine(_Plugin):
    """Declares a module that is not installed."""
    name = "plugin-missing-dep"
    traits = Traits(mem_kinds=frozenset({MemKind.DRAM}), auto_rank=5, requires=("hicache_gds_no_such_module",))
'''

_ENTRY_POINTS = """\
[hicache_gds.engines]
plugin-host = hicache_gds_plugin_engines:HostEngine
plugin-gpu-host = hicache_gds_plugin_engines:GpuHostEngine
plugin-gds = hicache_gds_plugin_engines:GdsEngine
plugin-missing-dep = hicache_gds_plugin_engines:NeedsMissingEngine
plugin-broken = hicache_gds_no_such_module:Engine
"""
PLUGINS = ("plugin-host", "plugin-gpu-host", "plugin-gds", "plugin-missing-dep", "plugin-broken")


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A distribution installed on `sys.path` whose entry points register five engines; the
    registry scans the group again, and forgets them afterwards."""
    site = tmp_path / "site"
    dist = site / "hicache_gds_plugin_engines-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hicache-gds-plugin-engines\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(_ENTRY_POINTS)
    (site / "hicache_gds_plugin_engines.py").write_text(textwrap.dedent(_MODULE))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setattr(registry_module, "_loaded_eps", False)
    yield
    for name in PLUGINS:
        registry_module._known.pop(name, None)
    sys.modules.pop("hicache_gds_plugin_engines", None)


def _cfg(gds: str, **kw) -> Config:
    return Config.load({"gds_path": gds, **kw})


def test_entry_point_engines_are_registered(plugins):
    names = engine_names()
    assert set(PLUGINS) <= set(names)
    ranked = [c.name for c in candidates()]
    # by declared rank: cuFile and GPU-needing engines are candidates too (skipped later where they cannot run)
    assert ranked[:3] == ["plugin-gds", "plugin-gpu-host", "plugin-host"] and ranked.index("nixl-gds-mt") == 3
    assert "nixl-ucx" not in ranked and "kvikio" not in ranked  # remote; named only


@no_gpu
def test_auto_chooses_a_plugin_engine_for_host_memory_by_its_rank(plugins, gds_dir):
    choice = choose_engine(_cfg(gds_dir), gds_dir, frozenset({MemKind.DRAM}))
    try:
        assert choice.engine.name == "plugin-host"
        assert "the client moves host memory only" in choice.reason
        assert "plugin-gpu-host needs a CUDA GPU and none is visible" in choice.reason
        assert "plugin-broken" in choice.reason and "cannot be imported" in choice.reason
    finally:
        choice.engine.close()
    # A store opened with engine auto moves its pages through it: random pages, poisoned destination
    with PageStore(PAGE, {"model": "plugin"}, config={"gds_path": gds_dir, "capacity": 16 * PAGE}) as st:
        st_info = st.stats()
        assert st_info["engine"] == "plugin-host" and st_info["path"].startswith("plugin-host (plugin)")
        buf = HostBuffer(8 * PAGE, pinned=False)
        arr = buf.numpy()
        arr[:4 * PAGE] = np.random.default_rng(5).integers(0, 256, 4 * PAGE, dtype=np.uint8)
        arr[4 * PAGE:] = 0xEE
        st.register_memory(buf.addr, buf.nbytes)
        keys = [f"k{i}" for i in range(4)]
        assert st.put(keys, Pages.contiguous(buf.addr, PAGE, range(4))) == [True] * 4
        assert st.get(keys, Pages.contiguous(buf.addr, PAGE, range(4, 8))) == [True] * 4
        assert bytes(arr[:4 * PAGE]) == bytes(arr[4 * PAGE:])
        st.deregister_memory(buf.addr)
        buf.close()


@no_gpu
def test_auto_refuses_plugin_engines_by_their_declared_traits(plugins, gds_dir):
    # VRAM: plugin-host declares DRAM only and is refused without being built; plugin-gds (cuFile,
    # ranked first) is probed -- no GPU here -- before NIXL's GDS engines.
    with pytest.raises(EngineUnavailable) as e:
        choose_engine(_cfg(gds_dir), gds_dir, frozenset({MemKind.VRAM}))
    msg = str(e.value)
    assert "plugin-gds: no CUDA GPU is visible" in msg and "plugin-host cannot move VRAM" in msg
    assert msg.index("plugin-gds") < msg.index("nixl-gds-mt")
    # ENABLE_GDS=1: only cuFile engines are candidates, plugin-gds among them
    with pytest.raises(GDSUnavailable, match="plugin-gds: no CUDA GPU is visible"):
        choose_engine(_cfg(gds_dir, enable_gds="1"), gds_dir)
    # Named: ENABLE_GDS=0 refuses a cuFile plugin, and the message offers the host engines, plugins included
    with pytest.raises(ConfigError, match=r"plugin-gds moves data through cuFile.*use .*plugin-host"):
        choose_engine(_cfg(gds_dir, engine="plugin-gds", enable_gds="0"), gds_dir)
    with pytest.raises(GDSUnavailable, match=r"plugin-host is not GPU-direct; use .*plugin-gds"):
        choose_engine(_cfg(gds_dir, engine="plugin-host", enable_gds="1"), gds_dir)
    # The remote tier's engine is never a store's
    with pytest.raises(ConfigError, match="nixl-ucx moves pages to page servers' memory"):
        choose_engine(_cfg(gds_dir, engine="nixl-ucx"), gds_dir)


@no_gpu
def test_doctor_lists_and_probes_plugin_engines_by_their_traits(plugins, gds_dir, monkeypatch):
    from hicache_gds.tools.doctor import collect, render_text
    monkeypatch.setenv("HICACHE_GDS_CAPACITY", "64M")  # sized: the default depends on how full the disk is
    rep = collect(gds_dir)
    eng = rep["engines"]
    assert set(PLUGINS) <= set(eng)
    host = eng["plugin-host"]
    assert host["ok"] is True and "1 MiB host-memory round trip byte-exact (plugin-host (plugin)" in host["reason"]
    assert host["traits"] == {"mem_kinds": ["DRAM"], "uses_cufile": False, "needs_gpu": False, "remote": False,
                              "auto_rank": 50, "requires": []}
    assert eng["plugin-gds"]["ok"] is False and "no CUDA GPU" in eng["plugin-gds"]["reason"]
    assert eng["plugin-gpu-host"]["ok"] is False and "no CUDA GPU" in eng["plugin-gpu-host"]["reason"]
    assert eng["plugin-missing-dep"]["installed"] is False and "not installed" in eng["plugin-missing-dep"]["reason"]
    assert eng["plugin-broken"]["installed"] is False and "cannot be imported" in eng["plugin-broken"]["reason"]
    assert eng["nixl-ucx"]["ok"] is None and "page servers" in eng["nixl-ucx"]["reason"]
    assert rep["engine_auto"]["host_memory"]["engine"] == "plugin-host" and rep["ok"], rep["problems"]
    text = render_text(rep)
    assert "  plugin-host: works: 1 MiB host-memory round trip byte-exact" in text
    assert "[DRAM, auto rank 50]" in text and "[DRAM+VRAM, cuFile, needs a GPU, auto rank 90]" in text
    assert "engine auto for host memory: plugin-host: plugin-host (plugin)" in text


def test_a_failing_plugin_engine_is_reported_not_raised(plugins, gds_dir, monkeypatch):
    """A plugin whose IO fails is 'no' with the reason in doctor, and doctor still answers."""
    from hicache_gds.engines.diagnose import check_engines
    import hicache_gds_plugin_engines as mod  # noqa: F401 -- the plugin's module, importable via the fixture

    def broken_open(self, path):
        raise OSError(5, "Input/output error", path)

    monkeypatch.setattr(mod.HostEngine, "open_file", broken_open)
    out = check_engines(None, gds_dir, gpu=False, timeout=5)
    assert out["plugin-host"]["ok"] is False and "Input/output error" in out["plugin-host"]["reason"]
    assert out["bounce"]["ok"] is True
