"""Every path of the ``compute_or_load`` policy on the installed SGLang release: active, or the
fallback that runs instead, read from the plugin's hook table (`plugin.HOOKS`, `plugin.GROUPS`)
against SGLang's real classes.

Run under both releases (the venv's 0.5.23, and 0.5.17 through its overlay); the expected table of
each release is below. ``Scheduler`` and ``TpModelWorker`` import only with a server's packages
(not on a CPU test machine): for their hooks the method is looked up in the module's source.
"""

from __future__ import annotations

import importlib.util
import logging
import re

import pytest

from hicache_gds_sglang import cut, plugin, split_policy

SERVER_ONLY = ("sglang.srt.managers.scheduler.", "sglang.srt.managers.tp_worker.")

EXPECTED = {
    "0.5.17": {"decision": "active", "agreement": "active", "host share": "active", "host protection": "active",
               "late admission": "active", "split": "active", "split hold": "active",
               "split cut": "active"},
    # 0.5.23 inserts a finished load in `_handle_prefetch_result` (host protection through
    # `inc_host_lock_ref`) and has `get_new_batch_prefill` (late admission); a split's tail joins
    # after `stash_chunked_request` (its `checkpoint`), and a split request is held for its tail at
    # `PrefillAdder.add_chunked_req` (`park_0523`)
    "0.5.23": {"decision": "active", "agreement": "active", "host share": "active", "host protection": "active",
               "late admission": "active", "split": "active", "split hold": "active",
               "split cut": "active"},
}


def _release() -> str:
    return "0.5.17" if plugin._resolve("sglang.srt.mem_cache.hiradix_cache.HiRadixCache") is not None else "0.5.23"


def _in_source(target: str) -> bool:
    mod, cls, meth = target.rsplit(".", 2)
    spec = importlib.util.find_spec(mod)
    if spec is None or not spec.origin:
        return False
    text = open(spec.origin, encoding="utf-8").read()
    return f"class {cls}" in text and re.search(rf"\n    def {re.escape(meth)}\(", text) is not None


@pytest.fixture
def present(monkeypatch):
    real = plugin._present
    monkeypatch.setattr(plugin, "_present", lambda h: _in_source(h.target) if h.target.startswith(SERVER_ONLY)
                        else real(h))
    return plugin.present_groups()


def test_each_policy_path_is_active_or_falls_back_as_listed_for_this_release(present):
    release = _release()
    paths = plugin.policy_paths(present)
    assert paths == EXPECTED[release], (release, paths)
    assert f"policy@{release}" in plugin.hooked_groups(present)


def test_every_hook_names_its_target_release_and_a_fallback():
    for h in plugin.HOOKS:
        assert h.kind in ("AFTER", "AROUND") and h.group in plugin.GROUPS, h
        assert set(re.split(r",\s*", h.releases)) <= {"0.5.17", "0.5.23"}, h
        assert callable(plugin._hook_fn(h.hook)), h
    for name, g in plugin.GROUPS.items():
        assert g.fallback or name.startswith("factory@"), name  # a factory's fallback is the other release's
    # each hook whose release is the installed one has its target here (server-only ones in source)
    release = _release()
    for h in plugin.HOOKS:
        if release in h.releases:
            ok = _in_source(h.target) if h.target.startswith(SERVER_ONLY) else plugin._present(h)
            assert ok, (release, h.target)


def test_registration_places_the_table_and_logs_what_falls_back(present, caplog):
    from sglang.srt.plugins.hook_registry import HookType

    registered = []

    class Registry:
        @staticmethod
        def register(target, fn, kind):
            registered.append((target, fn.__name__, kind.name))

    hooked_split, hooked_park, hooked_cut = split_policy.SPLIT_HOOKED[0], split_policy.PARK_HOOKED[0], cut.CUT_HOOKED[0]
    try:
        with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.plugin"):
            plugin._register_policy(Registry, HookType, plugin.hooked_groups(present))
        want = [(h.target, h.hook.rsplit(".", 1)[-1], h.kind) for h in plugin.HOOKS  # the function's name
                if h.group in plugin.hooked_groups(present)
                and not h.group.startswith(("backend", "factory@", "draft", "idle"))]
        assert registered == want
        hooked = plugin.hooked_groups(present)
        assert split_policy.SPLIT_HOOKED[0] is (plugin._split_group(hooked) in hooked)
        assert split_policy.PARK_HOOKED[0] is (plugin._park_group(hooked) in hooked) is True
        assert "policy_split does nothing" not in caplog.text  # split and its hold are on, on either release
        assert "never held for its tail" not in caplog.text
        hold = [t for t, fn, _ in registered if t.endswith("PrefillAdder.add_chunked_req")]
        assert len(hold) == 1  # one release's hold, never both
        cuts = [t for t, fn, _ in registered if t.endswith("PrefillAdder.add_one_req")]
        assert len(cuts) == 1 and cut.CUT_HOOKED[0] is True  # one release's cut
        assert "a split's head is whole chunks" not in caplog.text
    finally:
        split_policy.SPLIT_HOOKED[0], split_policy.PARK_HOOKED[0], cut.CUT_HOOKED[0] = hooked_split, hooked_park, hooked_cut


def test_where_the_adder_cannot_be_hooked_the_hold_falls_back_and_says_so(present, caplog):
    """A release without ``PrefillAdder.add_chunked_req`` (or whose split is not hooked): the
    split runs without its hold, `policy_paths` reports the fallback and registration logs it."""
    from sglang.srt.plugins.hook_registry import HookType

    release = _release()
    group = "park@0.5.23" if release == "0.5.23" else "park"
    without = present - {group}
    paths = plugin.policy_paths(without)
    assert paths["split hold"] == "fallback: " + plugin.GROUPS[group].fallback
    assert paths["split"] == "active"
    # a head's next chunks are cut in the hold's hook: without it the head is whole chunks
    cut_group = "cut@0.5.23" if release == "0.5.23" else "cut"
    assert paths["split cut"] == "fallback: " + plugin.GROUPS[cut_group].fallback
    assert {k: v for k, v in paths.items() if k not in ("split hold", "split cut")} == \
        {k: v for k, v in EXPECTED[release].items() if k not in ("split hold", "split cut")}

    class Registry:
        @staticmethod
        def register(target, fn, kind):
            assert not target.endswith(("PrefillAdder.add_chunked_req", "PrefillAdder.add_one_req")), target

    hooked_split, hooked_park, hooked_cut = split_policy.SPLIT_HOOKED[0], split_policy.PARK_HOOKED[0], cut.CUT_HOOKED[0]
    try:
        with caplog.at_level(logging.INFO, logger="hicache_gds_sglang.plugin"):
            plugin._register_policy(Registry, HookType, plugin.hooked_groups(without))
        assert split_policy.SPLIT_HOOKED[0] is True and split_policy.PARK_HOOKED[0] is False
        assert cut.CUT_HOOKED[0] is False
        assert "PrefillAdder.add_chunked_req cannot be hooked here" in caplog.text
        assert "never held for its tail" in caplog.text
        assert "a split's head is whole chunks" in caplog.text
    finally:
        split_policy.SPLIT_HOOKED[0], split_policy.PARK_HOOKED[0], cut.CUT_HOOKED[0] = hooked_split, hooked_park, hooked_cut
