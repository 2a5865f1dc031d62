"""Selection: SGLang's factory (`dynamic` and, after load_plugins, `gds`), argparse, the hooks, config."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

import hicache_gds_sglang
from hicache_gds import ConfigError
from hicache_gds_sglang import HiCacheGDS, plugin
from sgl_helpers import (DYNAMIC, attach, indices, keys, make_pool, needs_dcp, poison, same_pages,
                         storage_config)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dynamic_factory_builds_our_backend(gds_dir):
    sc = storage_config(gds_dir, extra=dict(DYNAMIC))
    backend = StorageBackendFactory.create_backend("dynamic", sc, None)
    try:
        assert type(backend) is HiCacheGDS and backend.mem_pool_host is None
        assert backend.config.gds_path == (os.path.realpath(gds_dir),)
    finally:
        backend.close()


def test_dynamic_command_is_documented():
    cmd = hicache_gds_sglang.dynamic_command()
    assert cmd.startswith("--hicache-storage-backend dynamic --hicache-storage-backend-extra-config '")
    assert json.loads(cmd.split("'")[1]) == DYNAMIC
    readme = open(os.path.join(REPO, "plugins", "sglang", "README.md")).read()
    assert cmd.split(" --hicache-storage-backend-extra-config ")[1] in readme
    assert "--hicache-storage-backend dynamic" in readme and "--hicache-storage-backend gds" in readme


_GDS_SCRIPT = textwrap.dedent("""
    import argparse, sys
    import sglang.srt.plugins as P
    P.load_plugins()
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.managers.cache_controller import HiCacheController
    from hicache_gds_sglang import HiCacheGDS
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--hicache-storage-backend", "gds"])
    assert args.hicache_storage_backend == "gds"
    sc = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                              is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                              model_name="m", extra_config={"gds_path": sys.argv[1], "capacity": "16M"})
    b = StorageBackendFactory.create_backend("gds", sc, None)
    assert type(b) is HiCacheGDS, type(b)
    b.close()
    assert hasattr(HiCacheController.attach_storage_backend, "__wrapped__")
    if hasattr(HiCacheController, "_maybe_register_draft_with_storage"):  # 0.5.17's separate draft pool
        assert hasattr(HiCacheController._maybe_register_draft_with_storage, "__wrapped__")
    class Ctl:
        storage_backend_type = "gds"; enable_storage = True
        _page_get_zero_copy = "zget"; _page_set_zero_copy = "zset"
        page_get_func = "generic"; page_set_func = "generic"
    c = Ctl()
    from hicache_gds_sglang.plugin import _select_zero_copy
    _select_zero_copy(None, c)
    assert (c.page_get_func, c.page_set_func) == ("zget", "zset")
    # other names still reach SGLang's own factory
    try:
        StorageBackendFactory.create_backend("no-such-backend", sc, None)
    except ValueError as e:
        assert "Unknown storage backend" in str(e)
    print("GDS-OK")
""")


def test_gds_name_after_load_plugins(gds_dir):
    """In a fresh process, as SGLang does it: the entry point's hooks make `gds` a backend name."""
    out = subprocess.run([sys.executable, "-c", _GDS_SCRIPT, gds_dir], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "GDS-OK" in out.stdout, out.stderr[-4000:]


def test_argparse_rejects_gds_without_the_plugin():
    script = textwrap.dedent("""
        import argparse
        from sglang.srt.server_args import ServerArgs
        p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)
        try:
            p.parse_args(["--model-path", "m", "--hicache-storage-backend", "gds"])
        except SystemExit:
            print("REJECTED")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "REJECTED" in out.stdout, out.stderr[-3000:]


def test_register_fails_soft_with_the_dynamic_command(monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry
    monkeypatch.setattr(plugin, "_registered", False)
    gone = "sglang.srt.mem_cache.storage.backend_factory.NoSuchFactory"  # neither release's factory method
    monkeypatch.setattr(plugin, "HOOKS", tuple(h._replace(target=f"{gone}.{h.target.rsplit('.', 1)[1]}")
                                              if h.group.startswith("factory") else h for h in plugin.HOOKS))
    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    with caplog.at_level(logging.WARNING, logger="hicache_gds_sglang.plugin"):
        plugin.register()
    assert hicache_gds_sglang.dynamic_command() in caplog.text
    assert {k: list(v) for k, v in HookRegistry._hooks.items()} == before
    assert plugin._registered is False


def test_config_precedence_and_ignored_sglang_keys(gds_dir, monkeypatch, tmp_path):
    other = tmp_path / "env"
    other.mkdir()
    monkeypatch.setenv("GDS_PATH", str(other))
    monkeypatch.setenv("HICACHE_GDS_IO_TIMEOUT", "7")
    monkeypatch.setenv("HICACHE_GDS_VERIFY", "0")
    extra = dict(DYNAMIC, gds_path=gds_dir, verify=True, file_storage_path="/nowhere", prefetch_threshold=256,
                 prefetch_timeout_max=30)  # 0.5.17's hybrid controller passes the last one on
    b = HiCacheGDS(storage_config(gds_dir, extra=extra), {})
    try:
        assert b.config.gds_path == (os.path.realpath(gds_dir),)  # extra config beats env
        assert b.config.verify is True  # extra config beats env
        assert b.config.io_timeout == 7.0  # env beats default
        assert b.config.capacity_fraction == 0.5  # default
    finally:
        b.close()


def test_unknown_extra_key_fails_at_construction(gds_dir):
    with pytest.raises(ConfigError, match="unknown config key 'use_direct_io'"):
        HiCacheGDS(storage_config(gds_dir, extra={"gds_path": gds_dir, "use_direct_io": True}), {})


def test_missing_gds_path_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("GDS_PATH", raising=False)
    with pytest.raises(ConfigError, match="GDS_PATH"):
        HiCacheGDS(storage_config(None, extra=dict(DYNAMIC)), {})


@needs_dcp
def test_dcp_is_refused_at_construction(gds_dir):
    with pytest.raises(ConfigError, match="dcp_size"):
        sc = storage_config(gds_dir, is_mla_model=True, tp_size=2, dcp_size=2, dcp_rank=0, logical_page_size=16)
        HiCacheGDS(sc, {})


needs_draft_pool = pytest.mark.skipif(not hasattr(HiCacheController, "_maybe_register_draft_with_storage"),
                                      reason="this SGLang packs draft KV into the KV host pool: no draft pool to bind")


class _Controller(HiCacheController):
    """SGLang's own controller methods on hand-set state (its __init__ needs device pools)."""

    def __init__(self, backend, pool, draft):  # noqa: D107 -- no super().__init__ on purpose
        self.storage_backend, self.storage_backend_type, self.enable_storage = backend, "gds", True
        self.storage_config, self.page_size, self.mem_pool_host = backend.storage_config, pool.page_size, pool
        self.has_draft, self.mem_pool_host_draft = True, draft
        self.draft_page_get_func = self.draft_page_set_func = None


@needs_draft_pool
def test_draft_pool_is_served_from_its_own_namespace(gds_dir):
    """0.5.17 keeps a draft model's KV in a host pool of its own; the hook binds it (zero-copy, v2)."""
    pool, draft = make_pool("mha", "page_first", seed=1), make_pool("mha", "page_first", seed=2, layer_num=1)
    b = attach(storage_config(gds_dir), pool)
    ctl = _Controller(b, pool, draft)
    try:
        ks = keys(6)
        ctl._maybe_register_draft_with_storage()  # SGLang's choice for "gds": its generic draft path ...
        assert b.batch_set([f"{ks[0]}.draft"], [draft.get_data_page(0)]) is False  # ... which could not store
        plugin._bind_draft(None, ctl)  # what HookRegistry runs after it
        assert (ctl.draft_page_get_func, ctl.draft_page_set_func) == (ctl._draft_page_get_v2, ctl._draft_page_set_v2)
        st = b.stats()
        assert st["draft"]["pool_path"] == "zero-copy" and st["draft"]["namespace"] != st["kv"]["namespace"]
        ctl._draft_page_set(ks, indices(range(6)))
        assert b.batch_exists(ks) == 0 and b.stats()["draft"]["pages_written"] == 6  # never in KV
        poison(draft, range(8, 14))
        ctl._draft_page_get(ks, indices(range(8, 14)))
        assert same_pages(draft, list(range(6)), draft, list(range(8, 14)))
        poison(draft, range(16, 22))  # SGLang's generic draft functions now reach the same pages
        ctl._draft_page_get_generic(ks, indices(range(16, 22)))
        assert same_pages(draft, list(range(6)), draft, list(range(16, 22)))
    finally:
        b.close()


@needs_draft_pool
def test_a_draft_pool_we_cannot_serve_disables_draft_l3_only(gds_dir, caplog):
    pool = make_pool("mha", "page_first", seed=1)
    b = attach(storage_config(gds_dir), pool)
    ctl = _Controller(b, pool, object())  # no flat-page API
    try:
        ctl._maybe_register_draft_with_storage()
        with caplog.at_level(logging.WARNING, logger="hicache_gds_sglang.plugin"):
            plugin._bind_draft(None, ctl)
        assert ctl.draft_page_get_func is None and ctl.draft_page_set_func is None
        assert "draft KV is not stored in L3" in caplog.text and "draft" not in b.stats()
        assert b.batch_set_v1(keys(2), indices(range(2))) == [True] * 2  # the target KV is served as before
    finally:
        b.close()
