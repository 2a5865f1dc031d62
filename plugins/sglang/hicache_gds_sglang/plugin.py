"""The ``sglang.srt.plugins`` entry point: makes ``--hicache-storage-backend gds`` work.

SGLang hard-codes backend names in three places; `register()` hooks each through SGLang's
`HookRegistry` (applied by ``sglang.srt.plugins.load_plugins()``, which every SGLang process
calls early):

1. ``ServerArgs.add_cli_args`` (AFTER): add ``gds`` to the argparse choices of
   ``--hicache-storage-backend``;
2. ``StorageBackendFactory._do_create_backend`` (AROUND; 0.5.17-0.5.22 have no such split, so
   ``create_backend`` there): build ``HiCacheGDS(storage_config, mem_pool_host)`` for ``gds``;
   every other name goes to SGLang unchanged. Hooking the inner method where it exists keeps
   SGLang's wrappers (its failure injector) around our backend as around its own;
3. ``HiCacheController.attach_storage_backend`` (AFTER): select the zero-copy page functions
   (``batch_get_v1`` / ``batch_set_v1``) for ``gds``, as SGLang does for its own zero-copy names.

One more, only where SGLang has it (0.5.17, which keeps a speculative-decoding draft model's KV
in a host pool of its own; 0.5.23 packs draft layers into the KV pool and has nothing to hook):

4. ``HiCacheController._maybe_register_draft_with_storage`` (AFTER): bind the draft host pool
   to its own namespace (``register_mem_host_pool_v2(pool, "draft")``) and move draft pages
   through the v2 calls, as SGLang does for mooncake. Without it SGLang's generic draft path
   would send draft pages of the wrong size to the KV namespace, and no draft page would ever
   be stored.

And the ``compute_or_load`` prefetch policy (`policy`), where the installed SGLang has its
decision points (0.5.17's ``HiRadixCache``, 0.5.23's ``UnifiedRadixCache``):

5. the cache's ``prefetch_from_storage`` (AROUND: load or recompute), its
   ``can_terminate_prefetch`` / ``_can_terminate_prefetch`` (AROUND: wait or stop a load in
   flight), its ``attach_storage_backend`` (AROUND: SGLang validates the policy name against its
   own three) and its ``__init__`` / ``init_hicache`` (AFTER: set the policy up);
   ``HiCacheController.prefetch_rate_limited`` (AROUND: the host-pool share of prefetches);
   ``--hicache-storage-prefetch-policy`` gets the choice, and it becomes the default;
6. where they import: ``Scheduler._prefetch_kvcache`` (the waiting queue, the request admitted)
   and ``TpModelWorker.forward_batch_generation`` (prefill batches timed). Without them the
   policy runs on its seeds and the disk queue alone, and says so once;
7. where the cache inserts a finished load into its tree -- 0.5.17's
   ``HiRadixCache.check_prefetch_progress``, 0.5.23's ``UnifiedRadixCache._handle_prefetch_result``
   (AROUND: its host pages are protected from eviction once inserted) -- and
   ``Scheduler.get_new_batch_prefill`` (AFTER: the protection ends when the request leaves the
   waiting queue, and a waiting request sent to the GPU may be given to the disk: the policy's
   late admission); both releases. 0.5.17's same ``check_prefetch_progress`` hook and 0.5.23's
   ``UnifiedRadixCache.check_prefetch_progress`` (AROUND) hold a request whose load the host pool
   had no room for until it has (`room`; ``policy_room_wait``);
8. where a chunked request's chunks are cached before its next chunk is formed -- 0.5.17's
   ``HiRadixCache.cache_unfinished_req``, 0.5.23's ``Scheduler.stash_chunked_request`` (its
   ``checkpoint(req, up_to=...)``) (AFTER): a split hit's tail joins the request's prefix there
   (`split`, `split_0523`; ``policy_split``); 0.5.17's ``PrefillAdder.add_chunked_req`` (AROUND):
   a split request held for its tail (``policy_split_park``); 0.5.23's ``PrefillAdder.add_chunked_req``
   (AROUND): the same hold, under 0.5.23's conditions (`park_0523`); ``PrefillAdder.add_one_req``
   (AROUND; both releases) and the same ``add_chunked_req`` hooks: a split's head may end at any
   page, the chunk that crosses it cut there (`cut`; ``policy_split_cut``); finished loads ride
   along a chunked request's pass, or the pass waits a decode step for their GPU memory (`ride`;
   ``policy_ride``, off by default).

9. ``Scheduler.on_idle`` (AFTER; both releases, every prefetch policy): a pass that ran nothing
   while this backend reads for waiting requests waits for the next get to return, a bounded
   time (`idle`; ``policy_idle_wait_ms``), instead of spinning on the GIL the reads need.

10. with ``HICACHE_GDS_TRACE=1`` only: a per-request timeline of the prefetch for any backend
   (`trace`), from the scheduler's queue through each L3 get to the prefill batch.

Caches without those points (0.5.17's hybrid-model caches) keep SGLang's policy: the name turns
into SGLang's default there.

These are SGLang internals (tested against 0.5.17 and 0.5.23). Every point is one entry of the
declarative table `HOOKS` (its target class and method, the release(s) that have it, the hook and
its kind, and its group); `GROUPS` says when a group goes in and what runs where it does not (its
fallback, logged once), and `policy_paths` lists the policy's paths as active or falling back on
the installed release. When one of 1-3 is missing (another SGLang version), nothing is hooked and
one log line gives the ``dynamic`` command line, which needs no hook; when 5 is missing, SGLang's
three policies are all there is.
"""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
from typing import Any, Callable, NamedTuple

__all__ = ["register", "BACKEND_NAME", "DYNAMIC_EXTRA_CONFIG", "dynamic_command", "Hook", "Group", "HOOKS", "GROUPS",
           "present_groups", "hooked_groups", "policy_paths"]

log = logging.getLogger("hicache_gds_sglang.plugin")

BACKEND_NAME = "gds"
DYNAMIC_EXTRA_CONFIG = {"backend_name": "gds", "module_path": "hicache_gds_sglang", "class_name": "HiCacheGDS",
                        "interface_v1": 1}
_CC = "sglang.srt.managers.cache_controller.HiCacheController"
_HIRADIX = "sglang.srt.mem_cache.hiradix_cache.HiRadixCache"  # 0.5.17's cache of dense models
_UNIFIED = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"  # 0.5.23's every HiCache stack
_MAMBA = "sglang.srt.mem_cache.hi_mamba_radix_cache.HiMambaRadixCache"
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_FACTORY_CLASS = "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory"
_POLICY_GROUPS = ("policy@0.5.17", "policy@0.5.23")


class Hook(NamedTuple):
    """One hook: its `target` (``module.Class.method``), SGLang's hook `kind` (``AFTER``:
    ``hook(result, self, *args)``; ``AROUND``: ``hook(original, self, *args)``), the `hook`
    function (a name in `policy_hooks`, or ``plugin.<name>`` here), the `releases` whose classes
    have the target, and its `group`: a group's hooks go in together or not at all (`Group`).
    `needs`: other attributes the target's class must have for the hook to work."""

    target: str
    kind: str
    hook: str
    releases: str
    group: str
    needs: tuple[str, ...] = ()


class Group(NamedTuple):
    """When a group of `HOOKS` goes in, and what runs where it does not. A group is *present*
    where each of its targets (and `needs`) exists in the installed SGLang; it is hooked where it
    is present, every group in `requires` is present, at least one of `requires_any` (if any) is,
    and none of `unless` is. `fallback`: what runs instead (logged at `level` where it applies)."""

    requires: tuple[str, ...] = ()
    requires_any: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    fallback: str = ""
    level: int = logging.INFO


_POLICY = ("backend", "rate")
# Every SGLang point the plugin hooks, in registration order (module docstring, 1-8).
HOOKS: tuple[Hook, ...] = (
    Hook("sglang.srt.server_args.ServerArgs.add_cli_args", "AFTER", "plugin._add_choice", "0.5.17, 0.5.23", "backend"),
    Hook(f"{_FACTORY_CLASS}._do_create_backend", "AROUND", "plugin._create", "0.5.23", "factory@0.5.23"),
    Hook(f"{_FACTORY_CLASS}.create_backend", "AROUND", "plugin._create", "0.5.17", "factory@0.5.17"),
    Hook(f"{_CC}.attach_storage_backend", "AFTER", "plugin._select_zero_copy", "0.5.17, 0.5.23", "backend",
         ("_page_get_zero_copy", "_page_set_zero_copy")),
    Hook(f"{_CC}._maybe_register_draft_with_storage", "AFTER", "plugin._bind_draft", "0.5.17", "draft"),
    Hook(f"{_CC}.prefetch_rate_limited", "AROUND", "around_rate_limited", "0.5.17, 0.5.23", "rate"),
    Hook(f"{_HIRADIX}.__init__", "AFTER", "after_init", "0.5.17", "policy@0.5.17"),
    Hook(f"{_HIRADIX}.prefetch_from_storage", "AROUND", "around_admit", "0.5.17", "policy@0.5.17"),
    Hook(f"{_HIRADIX}.can_terminate_prefetch", "AROUND", "around_can_terminate", "0.5.17", "policy@0.5.17"),
    Hook(f"{_HIRADIX}.attach_storage_backend", "AROUND", "around_attach", "0.5.17", "policy@0.5.17"),
    Hook(f"{_UNIFIED}.init_hicache", "AFTER", "after_init", "0.5.23", "policy@0.5.23"),
    Hook(f"{_UNIFIED}.prefetch_from_storage", "AROUND", "around_admit", "0.5.23", "policy@0.5.23"),
    Hook(f"{_UNIFIED}._can_terminate_prefetch", "AROUND", "around_can_terminate", "0.5.23", "policy@0.5.23"),
    Hook(f"{_UNIFIED}.attach_storage_backend", "AROUND", "around_attach", "0.5.23", "policy@0.5.23"),
    # caches whose policy name is settled (ours turned into SGLang's default) without the policy
    Hook(f"{_MAMBA}.__init__", "AFTER", "after_init", "0.5.17", "settle@mamba"),
    Hook(f"{_MAMBA}.attach_storage_backend", "AROUND", "around_attach", "0.5.17", "settle@mamba"),
    Hook(f"{_UNIFIED}.init_hicache", "AFTER", "after_init", "0.5.23", "settle@unified"),
    Hook(f"{_UNIFIED}.attach_storage_backend", "AROUND", "around_attach", "0.5.23", "settle@unified"),
    Hook(f"{_SCHED}._prefetch_kvcache", "AROUND", "around_prefetch_kvcache", "0.5.17, 0.5.23", "admitted"),
    Hook("sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation", "AROUND", "around_forward",
         "0.5.17, 0.5.23", "timing"),
    # 0.5.17 inserts a finished load into the tree whenever the scheduler reaches its request,
    # 0.5.23 as soon as its acknowledgement is drained (each scheduler pass): the policy protects
    # those host pages there until the scheduler takes the request, and after each prefill batch
    # is formed it may give a waiting request to the disk (late admission).
    Hook(f"{_HIRADIX}.check_prefetch_progress", "AROUND", "around_check_progress", "0.5.17", "protect",
         ("_match_prefix_helper",)),
    Hook(f"{_SCHED}.get_new_batch_prefill", "AFTER", "after_new_prefill_batch", "0.5.17", "protect"),
    Hook(f"{_UNIFIED}._handle_prefetch_result", "AROUND", "around_prefetch_result", "0.5.23", "protect@0.5.23",
         ("inc_host_lock_ref", "dec_host_lock_ref", "match_prefix", "is_root")),
    Hook(f"{_SCHED}.get_new_batch_prefill", "AFTER", "after_new_prefill_batch", "0.5.23", "protect@0.5.23"),
    # A load turned down for host room waits for it (`room`): 0.5.17's hold is in the protect
    # group's check_prefetch_progress hook above; 0.5.23's is its own.
    Hook(f"{_UNIFIED}.check_prefetch_progress", "AROUND", "around_check_progress_0523", "0.5.23", "room@0.5.23"),
    # The join point of a split (0.5.17): SGLang caches a chunked request's chunks there before it
    # forms the next chunk (the tail's pages join the prefix right after).
    Hook(f"{_HIRADIX}.cache_unfinished_req", "AFTER", "after_cache_unfinished", "0.5.17", "split"),
    # Where a split request is held until its tail is read: SGLang adds the chunked request's next
    # chunk there, and returns a chunk it parks without adding it (0.5.17 parks for hybrid SWA).
    Hook("sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req", "AROUND", "around_add_chunked_req",
         "0.5.17", "park"),
    # 0.5.23's hold: the same adder method (``_get_new_batch_prefill_raw`` calls it for the chunked
    # request first), with 0.5.23's own conditions (`park_0523`)
    Hook("sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req", "AROUND",
         "park_0523.around_add_chunked_req", "0.5.23", "park@0.5.23"),
    # 0.5.23's join point: the scheduler checkpoints a chunked request's chunks into the tree
    # (``checkpoint(req, up_to=extend_end)``) and sets where its next chunk starts, then forms it.
    Hook(f"{_SCHED}.stash_chunked_request", "AFTER", "after_stash_chunked", "0.5.23", "split@0.5.23"),
    # Where a split request's first chunk is formed: it ends at the split's head (`cut`; its next
    # chunks are cut inside the hold's hook on add_chunked_req)
    Hook("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", "AROUND", "cut.around_add_one_req",
         "0.5.17", "cut"),
    Hook("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", "AROUND", "cut.around_add_one_req",
         "0.5.23", "cut@0.5.23"),
    # A scheduler pass that ran nothing while requests wait on L3 reads: the scheduler waits for
    # the next get to return (bounded) instead of spinning on the GIL the reads need (`idle`).
    Hook(f"{_SCHED}.on_idle", "AFTER", "idle.after_idle", "0.5.17, 0.5.23", "idle"),
)
# Both releases' split hold falls back alike
_NO_HOLD = ("a split request is never held for its tail: what is read when its chunks reach it joins, the rest "
            "is computed (no PrefillAdder.add_chunked_req to hold it at)")
_WHOLE = "a split's head is whole chunks (no PrefillAdder.add_one_req to cut its chunk at, or no hold)"
GROUPS: dict[str, Group] = {
    "backend": Group(requires=("backend",), requires_any=("factory@0.5.23", "factory@0.5.17"), level=logging.WARNING,
                     fallback="`--hicache-storage-backend gds` is not available; select the backend with the "
                              "`dynamic` command line (`dynamic_command`)"),
    "factory@0.5.23": Group(requires=("backend",)),
    "factory@0.5.17": Group(requires=("backend",), unless=("factory@0.5.23",)),
    "draft": Group(requires=("backend",), fallback="no separate draft host pool (0.5.23 packs draft layers into "
                                                   "the KV pool): nothing to bind"),
    "rate": Group(requires=_POLICY, requires_any=_POLICY_GROUPS,
                  fallback="SGLang's own prefetch policies run (no decision points here)"),
    "policy@0.5.17": Group(requires=_POLICY, fallback="not this release's cache"),
    "policy@0.5.23": Group(requires=_POLICY, fallback="not this release's cache"),
    "settle@mamba": Group(requires=_POLICY, requires_any=_POLICY_GROUPS, fallback="no such cache here"),
    "settle@unified": Group(requires=_POLICY, requires_any=_POLICY_GROUPS, unless=("policy@0.5.23",),
                            fallback="the policy runs on this cache"),
    "admitted": Group(requires=_POLICY, requires_any=_POLICY_GROUPS, level=logging.WARNING,
                      fallback="the policy runs on its seeds and the disk queue (no scheduler bound)"),
    "timing": Group(requires=_POLICY, requires_any=_POLICY_GROUPS, level=logging.WARNING,
                    fallback="the policy runs on its seeds and the disk queue (prefill batches not timed)"),
    "protect": Group(requires=(*_POLICY, "policy@0.5.17"),
                     fallback="a finished load's host pages are SGLang's to evict; no late admission"),
    "protect@0.5.23": Group(requires=(*_POLICY, "policy@0.5.23"),
                            fallback="a finished load's host pages are SGLang's to evict; no late admission"),
    "room@0.5.23": Group(requires=(*_POLICY, "protect@0.5.23", "policy@0.5.23"),
                         fallback="a load the host pool has no room for is recomputed (nothing to hold it at)"),
    "split": Group(requires=(*_POLICY, "protect"), requires_any=_POLICY_GROUPS,
                   fallback="policy_split does nothing (no join point for a split hit here)"),
    # a tail's finished operation must not be inserted by SGLang under its anchor: protect@0.5.23's
    # hook on _handle_prefetch_result leaves it to the join
    "split@0.5.23": Group(requires=(*_POLICY, "protect@0.5.23", "policy@0.5.23"),
                          fallback="policy_split does nothing (no join point for a split hit here)"),
    "idle": Group(requires=("backend",), fallback="an idle scheduler pass spins while requests wait on L3 reads"),
    "park": Group(requires=(*_POLICY, "split", "policy@0.5.17"), fallback=_NO_HOLD),
    "park@0.5.23": Group(requires=(*_POLICY, "split@0.5.23", "policy@0.5.23"), fallback=_NO_HOLD),
    # `requires` is read against the groups present: the chain below the hold is named whole
    "cut": Group(requires=(*_POLICY, "protect", "split", "park", "policy@0.5.17"), fallback=_WHOLE),
    "cut@0.5.23": Group(requires=(*_POLICY, "protect@0.5.23", "split@0.5.23", "park@0.5.23", "policy@0.5.23"),
                        fallback=_WHOLE),
}
# Back-compatible names of single points (tests and `trace` resolve them)
_JOIN = f"{_HIRADIX}.cache_unfinished_req"
_PROTECT = (f"{_HIRADIX}.check_prefetch_progress", f"{_SCHED}.get_new_batch_prefill")
_registered = False
_policy_ready = False


def dynamic_command() -> str:
    """The flags that select this backend without the plugin's hooks."""
    return ("--hicache-storage-backend dynamic --hicache-storage-backend-extra-config "
            f"'{json.dumps(DYNAMIC_EXTRA_CONFIG, separators=(',', ':'))}'")


def _append(action: Any, name: str) -> None:
    if action.choices is not None and name not in action.choices:
        if isinstance(action.choices, list):
            action.choices.append(name)
        else:
            action.choices = [*action.choices, name]


def _add_choice(result: Any, *args: Any, **kwargs: Any) -> None:
    parser = args[0] if args else kwargs.get("parser")
    found = False
    for action in getattr(parser, "_actions", []):
        if action.dest == "hicache_storage_backend":
            _append(action, BACKEND_NAME)
            found = True
        elif action.dest == "hicache_storage_prefetch_policy" and _policy_ready:
            from .policy_config import POLICY
            _append(action, POLICY)
            action.default = POLICY  # with any backend but gds it turns into SGLang's default (policy_hooks._settle)
            action.help = (f"{action.help or ''} {POLICY} (hicache-gds, the default): load an L3 hit or recompute "
                           "it, whichever finishes first (needs --hicache-storage-backend gds; with others "
                           "SGLang's timeout runs).").strip()
    if not found:
        log.warning("hicache-gds: no --hicache-storage-backend option found; select the backend with %s",
                    dynamic_command())
    return None


def _create(original: Any, cls: Any, backend_name: str | None = None, storage_config: Any = None,
            mem_pool_host: Any = None, **kwargs: Any) -> Any:
    if backend_name == BACKEND_NAME and BACKEND_NAME not in getattr(cls, "_registry", {}):
        from .backend import HiCacheGDS
        log.info("Creating storage backend 'gds' (hicache_gds_sglang.HiCacheGDS)")
        return HiCacheGDS(storage_config, mem_pool_host)
    return original(cls, backend_name, storage_config, mem_pool_host, **kwargs)


def _select_zero_copy(result: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    if getattr(controller, "storage_backend_type", None) == BACKEND_NAME and getattr(controller, "enable_storage",
                                                                                     False):
        controller.page_get_func = controller._page_get_zero_copy
        controller.page_set_func = controller._page_set_zero_copy
    return None


def _bind_draft(result: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    """After SGLang picked its draft L3 functions: serve the draft host pool from its own namespace."""
    if not (getattr(controller, "has_draft", False) and getattr(controller, "enable_storage", False)):
        return None
    from .backend import HiCacheGDS
    backend = getattr(controller, "storage_backend", None)
    if not isinstance(backend, HiCacheGDS):
        return None
    try:
        from sglang.srt.mem_cache.hicache_storage import PoolName
        backend.register_mem_host_pool_v2(controller.mem_pool_host_draft, PoolName.DRAFT)
        get_v2, set_v2 = controller._draft_page_get_v2, controller._draft_page_set_v2
    except Exception as exc:  # noqa: BLE001 -- draft L3 is best effort in SGLang too: disable, never fail
        log.warning("hicache-gds: draft KV is not stored in L3 (%s: %s); speculative decoding runs on without it",
                    type(exc).__name__, exc)
        controller.draft_page_get_func = controller.draft_page_set_func = None
        return None
    controller.draft_page_get_func, controller.draft_page_set_func = get_v2, set_v2
    return None


def _present(hook: Hook) -> bool:
    cls_path, attr = hook.target.rsplit(".", 1)
    cls = _resolve(cls_path)
    return cls is not None and callable(getattr(cls, attr, None)) and all(hasattr(cls, n) for n in hook.needs)


def present_groups(hooks: tuple[Hook, ...] | None = None) -> set[str]:
    """The groups of `hooks` (`HOOKS`) whose every target (and need) exists in the installed SGLang."""
    groups: dict[str, bool] = {}
    for h in HOOKS if hooks is None else hooks:
        groups[h.group] = groups.get(h.group, True) and _present(h)
    return {g for g, ok in groups.items() if ok}


def hooked_groups(present: set[str]) -> set[str]:
    """The groups `register` hooks, given those present (`Group`'s rule)."""
    out = set()
    for name, g in GROUPS.items():
        if name in present and all(r in present for r in g.requires) and \
                (not g.requires_any or any(r in present for r in g.requires_any)) and \
                not any(u in present for u in g.unless):
            out.add(name)
    return out


def _hook_fn(name: str) -> Callable:
    if name.startswith("plugin."):
        return globals()[name.split(".", 1)[1]]
    if "." in name:  # ``module.function`` of this package
        module, fn = name.split(".", 1)
        return getattr(importlib.import_module(f"{__package__}.{module}"), fn)
    from . import policy_hooks
    return getattr(policy_hooks, name)


def policy_paths(present: set[str] | None = None) -> dict[str, str]:
    """Each path of the compute_or_load policy in the installed SGLang: ``active`` or
    ``fallback: <what runs instead>`` (the admission decision, agreement across ranks, host-pool
    share, host protection, late admission, split, holding a split request for its tail)."""
    present = present_groups() if present is None else present
    hooked = hooked_groups(present)
    policy_on = any(g in hooked for g in _POLICY_GROUPS)
    off = "fallback: " + GROUPS["rate"].fallback

    def path(on: bool, group: str) -> str:
        return "active" if policy_on and on else (off if not policy_on else "fallback: " + GROUPS[group].fallback)

    caches = [_resolve(h.target.rsplit(".", 1)[0]) for h in HOOKS if h.group in hooked and h.group in _POLICY_GROUPS]
    reduces = bool(caches) and all(callable(getattr(c, "_all_reduce", None)) for c in caches)
    protect = _protect_group(hooked)
    return {
        "decision": path(True, "rate"),
        "agreement": "active" if policy_on and reduces else (off if not policy_on else
                                                             "fallback: each rank decides alone"),
        "host share": path("rate" in hooked, "rate"),
        "host protection": path(protect in hooked, protect),
        "late admission": path(protect in hooked, protect),
        "split": path(_split_group(hooked) in hooked, _split_group(hooked)),
        "split hold": path(_park_group(hooked) in hooked, _park_group(hooked)),
        "split cut": path(_cut_group(hooked) in hooked, _cut_group(hooked)),
    }


def _split_group(hooked: set[str]) -> str:
    """The split group (join point) of the release whose cache the policy hooked."""
    return "split@0.5.23" if "policy@0.5.23" in hooked else "split"


def _park_group(hooked: set[str]) -> str:
    """The split-hold group of the release whose cache the policy hooked."""
    return "park@0.5.23" if "policy@0.5.23" in hooked else "park"


def _cut_group(hooked: set[str]) -> str:
    """The group that cuts a split's head on the release whose cache the policy hooked."""
    return "cut@0.5.23" if "policy@0.5.23" in hooked else "cut"


def _protect_group(hooked: set[str]) -> str:
    """The host-protection group of the release whose cache the policy hooked."""
    return "protect@0.5.23" if "policy@0.5.23" in hooked else "protect"


def register() -> None:
    """Entry point (``sglang.srt.plugins``): hook SGLang so that ``gds`` names this backend, and
    place the policy's hooks (`HOOKS`, where each group's rule says).

    Fails soft: if SGLang's internals differ, logs the ``dynamic`` command line and hooks nothing.
    """
    global _registered
    if _registered:
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        hooked = hooked_groups(present_groups())
        if "backend" not in hooked:
            missing = [h.target for h in HOOKS if h.group in ("backend", "factory@0.5.23", "factory@0.5.17")
                       and not _present(h)]
            raise AttributeError(f"missing: {', '.join(missing)}")
    except Exception as exc:  # noqa: BLE001 -- a plugin must never break SGLang's start
        log.warning("hicache-gds: SGLang's internals differ from 0.5.17-0.5.23 (%s); `--hicache-storage-backend gds` "
                    "is not available. Select the backend with: %s", exc, dynamic_command())
        return
    _register_policy(HookRegistry, HookType, hooked)
    from . import trace
    if trace.enabled():
        trace.register(HookRegistry, HookType, _resolve)
    _place(HookRegistry, HookType, hooked, ("backend", "factory@0.5.23", "factory@0.5.17", "draft", "idle"))
    _registered = True


def _place(registry: Any, hook_type: Any, hooked: set[str], groups: tuple[str, ...]) -> None:
    """Register the hooks of `groups` that are in `hooked`, in `HOOKS`' order."""
    for h in HOOKS:
        if h.group in groups and h.group in hooked:
            registry.register(h.target, _hook_fn(h.hook), getattr(hook_type, h.kind))


def _resolve(path: str) -> Any:
    """The class or function at `path`, or None where this SGLang has none (or it does not import)."""
    obj_path, attr = path.rsplit(".", 1)
    try:
        return getattr(pkgutil.resolve_name(obj_path), attr, None)
    except Exception:  # noqa: BLE001 -- absent in this release, or its imports fail here
        return None


def _register_policy(registry: Any, hook_type: Any, hooked: set[str] | None = None) -> None:
    """Hook the compute_or_load policy's decision points (`HOOKS`' policy groups) where they
    exist, and log once what falls back. Fails soft: without them nothing is hooked and SGLang's
    own policies are all there is."""
    global _policy_ready
    from . import cut, policy_hooks, room, split_policy
    from .policy_config import POLICY
    hooked = hooked_groups(present_groups()) if hooked is None else hooked
    if "rate" not in hooked:
        log.info("hicache-gds: this SGLang has none of the prefetch decision points the %s policy hooks; SGLang's "
                 "own prefetch policies run", POLICY)
        return
    groups = (*_POLICY_GROUPS, "settle@mamba", "settle@unified", "rate", "admitted", "timing", "protect",
              "protect@0.5.23", "room@0.5.23", "split", "split@0.5.23", "park", "park@0.5.23", "cut", "cut@0.5.23")
    for h in HOOKS:
        if h.group in _POLICY_GROUPS and h.group in hooked:
            policy_hooks.SUPPORTED.add(_resolve(h.target.rsplit(".", 1)[0]))
    _place(registry, hook_type, hooked, groups)
    split_policy.SPLIT_HOOKED[0] = _split_group(hooked) in hooked
    split_policy.PARK_HOOKED[0] = _park_group(hooked) in hooked
    cut.CUT_HOOKED[0] = _cut_group(hooked) in hooked
    room.HOOKED[0] = "protect" in hooked or "room@0.5.23" in hooked
    for name in ("admitted", "timing", _protect_group(hooked), _split_group(hooked), _park_group(hooked),
                 _cut_group(hooked)):
        if name not in hooked:
            g = GROUPS[name]
            targets = ", ".join(".".join(h.target.rsplit(".", 2)[-2:]) for h in HOOKS if h.group == name)
            log.log(g.level, "hicache-gds: %s cannot be hooked here; %s", targets, g.fallback)
    _policy_ready = True
