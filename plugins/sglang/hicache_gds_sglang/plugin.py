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
7. 0.5.17's ``HiRadixCache.check_prefetch_progress`` (AROUND: a finished load's host pages are
   protected from eviction once inserted) and ``Scheduler.get_new_batch_prefill`` (AFTER: the
   protection ends when the request leaves the waiting queue, and a waiting request sent to the
   GPU may be given to the disk: the policy's late admission);
8. 0.5.17's ``HiRadixCache.cache_unfinished_req`` (AFTER): a split hit's tail joins the request's
   prefix where its chunks reach it (`split`; ``policy_split``).

9. with ``HICACHE_GDS_TRACE=1`` only: a per-request timeline of the prefetch for any backend
   (`trace`), from the scheduler's queue through each L3 get to the prefill batch.

Caches without those points (0.5.17's hybrid-model caches) keep SGLang's policy: the name turns
into SGLang's default there.

These are SGLang internals (tested against 0.5.17 and 0.5.23). When one of 1-3 is missing
(another SGLang version), nothing is hooked and one log line gives the ``dynamic`` command line,
which needs no hook; when 5 is missing, SGLang's three policies are all there is.
"""

from __future__ import annotations

import json
import logging
import pkgutil
from typing import Any

__all__ = ["register", "BACKEND_NAME", "DYNAMIC_EXTRA_CONFIG", "dynamic_command"]

log = logging.getLogger("hicache_gds_sglang.plugin")

BACKEND_NAME = "gds"
DYNAMIC_EXTRA_CONFIG = {"backend_name": "gds", "module_path": "hicache_gds_sglang", "class_name": "HiCacheGDS",
                        "interface_v1": 1}
_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
_FACTORY_CLASS = "sglang.srt.mem_cache.storage.backend_factory.StorageBackendFactory"
# First that exists wins: 0.5.23 builds backends in `_do_create_backend` (wrapped by `create_backend`).
_FACTORY_METHODS = ("_do_create_backend", "create_backend")
_ATTACH = "sglang.srt.managers.cache_controller.HiCacheController.attach_storage_backend"
_DRAFT = "sglang.srt.managers.cache_controller.HiCacheController._maybe_register_draft_with_storage"
_RATE = "sglang.srt.managers.cache_controller.HiCacheController.prefetch_rate_limited"
# cache class -> (init method, stop method): the policy's decision points in each release
_POLICY_CACHES = {
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache": ("__init__", "can_terminate_prefetch"),  # 0.5.17
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache": ("init_hicache", "_can_terminate_prefetch"),  # 0.5.23
}
# caches whose policy name must be settled (ours turned into SGLang's default) without the policy
_SETTLE_CACHES = {
    "sglang.srt.mem_cache.hi_mamba_radix_cache.HiMambaRadixCache": "__init__",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache": "init_hicache",
}
_OPTIONAL = ("sglang.srt.managers.scheduler.Scheduler._prefetch_kvcache",
             "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation")
# 0.5.17 inserts a finished load into the tree whenever the scheduler reaches its request: the
# policy protects those host pages there until the scheduler takes the request (0.5.23 settles
# loads through acknowledgements into its tree core: not hooked there).
_PROTECT = ("sglang.srt.mem_cache.hiradix_cache.HiRadixCache.check_prefetch_progress",
            "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill")
# The join point of a split (0.5.17): SGLang caches a chunked request's chunks there before it
# forms the next chunk (the tail's pages join the prefix right after).
_JOIN = "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.cache_unfinished_req"
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
            from .policy import POLICY
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


def _factory_target() -> str:
    """The factory method to hook in the installed SGLang; AttributeError when there is none."""
    cls = pkgutil.resolve_name(_FACTORY_CLASS)
    for attr in _FACTORY_METHODS:
        if hasattr(cls, attr):
            return f"{_FACTORY_CLASS}.{attr}"
    raise AttributeError(f"{_FACTORY_CLASS} has none of {', '.join(_FACTORY_METHODS)}")


def register() -> None:
    """Entry point (``sglang.srt.plugins``): hook SGLang so that ``gds`` names this backend.

    Fails soft: if SGLang's internals differ, logs the ``dynamic`` command line and hooks nothing.
    """
    global _registered
    if _registered:
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        factory = _factory_target()
        for target in (_ARGS, factory, _ATTACH):
            obj_path, attr = target.rsplit(".", 1)
            if not hasattr(pkgutil.resolve_name(obj_path), attr):
                raise AttributeError(f"{target} does not exist")
        ctl = pkgutil.resolve_name(_ATTACH.rsplit(".", 1)[0])
        for attr in ("_page_get_zero_copy", "_page_set_zero_copy"):
            if not hasattr(ctl, attr):
                raise AttributeError(f"HiCacheController.{attr} does not exist")
    except Exception as exc:  # noqa: BLE001 -- a plugin must never break SGLang's start
        log.warning("hicache-gds: SGLang's internals differ from 0.5.17-0.5.23 (%s); `--hicache-storage-backend gds` "
                    "is not available. Select the backend with: %s", exc, dynamic_command())
        return
    _register_policy(HookRegistry, HookType)
    from . import trace
    if trace.enabled():
        trace.register(HookRegistry, HookType, _resolve)
    HookRegistry.register(_ARGS, _add_choice, HookType.AFTER)
    HookRegistry.register(factory, _create, HookType.AROUND)
    HookRegistry.register(_ATTACH, _select_zero_copy, HookType.AFTER)
    if hasattr(ctl, _DRAFT.rsplit(".", 1)[1]):  # 0.5.17's separate draft host pool
        HookRegistry.register(_DRAFT, _bind_draft, HookType.AFTER)
    _registered = True


def _resolve(path: str) -> Any:
    """The class or function at `path`, or None where this SGLang has none (or it does not import)."""
    obj_path, attr = path.rsplit(".", 1)
    try:
        return getattr(pkgutil.resolve_name(obj_path), attr, None)
    except Exception:  # noqa: BLE001 -- absent in this release, or its imports fail here
        return None


def _register_policy(registry: Any, hook_type: Any) -> None:
    """Hook the compute_or_load policy's decision points (module docstring, 5-6) where they exist.
    Fails soft: without them nothing is hooked and SGLang's own policies are all there is."""
    global _policy_ready
    from . import policy, policy_hooks as hooks
    full = []
    for path, (init, stop) in _POLICY_CACHES.items():
        cls = _resolve(path)
        if isinstance(cls, type) and all(callable(getattr(cls, m, None))
                                         for m in (init, stop, "prefetch_from_storage", "attach_storage_backend")):
            full.append((path, cls, init, stop))
    if not full or _resolve(_RATE) is None:
        log.info("hicache-gds: this SGLang has none of the prefetch decision points the %s policy hooks; SGLang's "
                 "own prefetch policies run", policy.POLICY)
        return
    for path, cls, init, stop in full:
        hooks._SUPPORTED.add(cls)
        registry.register(f"{path}.{init}", hooks.after_init, hook_type.AFTER)
        registry.register(f"{path}.prefetch_from_storage", hooks.around_admit, hook_type.AROUND)
        registry.register(f"{path}.{stop}", hooks.around_can_terminate, hook_type.AROUND)
        registry.register(f"{path}.attach_storage_backend", hooks.around_attach, hook_type.AROUND)
    for path, init in _SETTLE_CACHES.items():
        if path in {p for p, *_ in full}:
            continue
        cls = _resolve(path)
        if cls is not None and callable(getattr(cls, init, None)):
            registry.register(f"{path}.{init}", hooks.after_init, hook_type.AFTER)
            if callable(getattr(cls, "attach_storage_backend", None)):
                registry.register(f"{path}.attach_storage_backend", hooks.around_attach, hook_type.AROUND)
    registry.register(_RATE, hooks.around_rate_limited, hook_type.AROUND)
    missing = []
    for path, hook in zip(_OPTIONAL, (hooks.around_prefetch_kvcache, hooks.around_forward)):
        if _resolve(path) is None:
            missing.append(path)
        else:
            registry.register(path, hook, hook_type.AROUND)
    if missing:
        log.warning("hicache-gds: %s cannot be hooked here; the %s policy runs on its seeds and the disk queue",
                    ", ".join(missing), policy.POLICY)
    check, batch = (_resolve(p) for p in _PROTECT)
    cache_cls = _resolve(_PROTECT[0].rsplit(".", 1)[0])
    if check is not None and batch is not None and callable(getattr(cache_cls, "_match_prefix_helper", None)):
        registry.register(_PROTECT[0], hooks.around_check_progress, hook_type.AROUND)
        registry.register(_PROTECT[1], hooks.after_new_prefill_batch, hook_type.AFTER)
        if _resolve(_JOIN) is not None:  # a tail is joined there, and swept after each prefill batch
            registry.register(_JOIN, hooks.after_cache_unfinished, hook_type.AFTER)
            policy.SPLIT_HOOKED[0] = True
    if not policy.SPLIT_HOOKED[0]:
        log.info("hicache-gds: this SGLang has no join point for a split hit (%s); policy_split does nothing",
                 ".".join(_JOIN.rsplit(".", 2)[-2:]))
    _policy_ready = True
