"""The scheduler view: the one place the policy reads or writes SGLang's scheduler state.

The policy (`policy`, `backlog`, `host`, `split_policy`) asks questions of SGLang's objects and
tells it actions only through these functions; they know where each release (0.5.17's
``HiRadixCache``, 0.5.23's ``UnifiedRadixCache``) keeps what, and only they touch SGLang objects'
private attributes. The split's radix-tree surgery at its join point is `split`'s (0.5.17's tree,
the one release that has the point).

Questions: a request's id (`rid`) and work (`on_gpu`, `req_work`, `to_prefill`); the cache's
backend (`backend_of`), page size and prefetch threshold (`page_size`, `threshold`); the loads in
flight (`loads`, `loading_rids`, `loaded_done`, `settles_by_ack`); the waiting queue and chunked
request (`waiting`, `chunked`); a prefill batch's shape (`batch_shape`); the host pool
(`host_free`, `host_evictable`, `host_limit`); how many ranks decide (`single_rank`).
Actions: agree a verdict across ranks (`agree`, `agree_int`); prefetch a queued request again
(`prefetch_again`); protect and release host pages (`loading_parts`, `protect_loaded`, `release_node`;
0.5.17 through its tree nodes' ``protect_host``, 0.5.23 through ``inc_host_lock_ref`` /
``dec_host_lock_ref`` on the node SGLang's own ``match_prefix`` returns); attach the policy to a
cache (`attach`, `attached`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, NamedTuple

__all__ = ["Loading", "rid", "on_gpu", "req_work", "to_prefill", "backend_of", "page_size", "threshold", "loads",
           "loading_rids", "loaded_done", "settles_by_ack", "waiting", "chunked", "batch_shape", "host_free",
           "host_evictable", "host_limit", "reads_pending", "gpu_idle", "single_rank", "agree", "agree_int", "prefetch_again",
           "loading_parts", "find_waiting", "protect_loaded", "release_node", "attach", "attached", "once"]

log = logging.getLogger("hicache_gds_sglang.policy")
_ATTR = "_hgds_policy"  # where the policy object hangs on SGLang's cache and controller
_logged: set[str] = set()


def once(tag: str, msg: str, *args: Any) -> None:
    """Log `msg` at WARNING once per process for `tag`."""
    if tag not in _logged:
        _logged.add(tag)
        log.warning(msg, *args)


# -- requests -------------------------------------------------------------------------------------
def rid(x: Any) -> str:
    """The request id of a request, a 0.5.23 request handle, or an id."""
    return str(getattr(x, "rid", x))


def on_gpu(req: Any) -> int:
    """Tokens of a request's prefix held in GPU memory, from its last match."""
    held = getattr(req, "prefix_len", None)  # 0.5.23
    if isinstance(held, int):
        return held
    pi = getattr(req, "prefix_indices", None)  # a tensor: never read by its truth value
    return 0 if pi is None else len(pi)


def host_hit(req: Any) -> int:
    return int(getattr(req, "host_hit_length", 0) or 0)


def req_work(req: Any) -> tuple[int, int]:
    """(tokens left to prefill, tokens already held) of a queued request, from its last match."""
    total = len(getattr(req, "origin_input_ids", None) or ()) + len(getattr(req, "output_ids", None) or ())
    held = on_gpu(req) + host_hit(req)
    return max(0, total - held), held


def to_prefill(req: Any) -> int:
    """Tokens a request would prefill in the batch being formed (its fill ids less what its last
    match holds on GPU and host)."""
    fill = getattr(req, "full_untruncated_fill_ids", None)
    if fill is None:
        return req_work(req)[0]
    return max(0, len(fill) - on_gpu(req) - host_hit(req))


def is_finished(req: Any) -> bool:
    finished = getattr(req, "finished", None)
    return bool(callable(finished) and finished())


# -- the cache and its loads ----------------------------------------------------------------------
def backend_of(cache: Any) -> Any:
    """The cache's storage backend when it serves this policy (``supports_compute_or_load``: the
    read rate, progress and cancel hooks; `HiCacheGDS`), unwrapped from SGLang's failure
    injector; else None."""
    cc = getattr(cache, "cache_controller", None)
    b = getattr(cc, "storage_backend", None) if cc is not None and getattr(cc, "enable_storage", False) else None
    if b is not None and not getattr(b, "supports_compute_or_load", False):
        b = getattr(b, "_backend", None)
    return b if getattr(b, "supports_compute_or_load", False) is True else None


def reads_pending(cache: Any) -> bool:
    """Prefetches are in flight for the cache (their reads may still be running)."""
    return bool(getattr(cache, "ongoing_prefetch", None))


def gpu_idle(scheduler: Any) -> bool:
    """The scheduler has no running (decode) batch: the GPU has nothing of its to do."""
    rb = getattr(scheduler, "running_batch", None)
    return rb is None or bool(rb.is_empty())


def page_size(cache: Any) -> int:
    return max(1, int(getattr(cache, "page_size", 1) or 1))


def threshold(cache: Any) -> int:
    """SGLang's prefetch threshold (tokens): a shorter hit is not prefetched."""
    return int(getattr(cache, "prefetch_threshold", 0) or 0)


class Loading(NamedTuple):
    """One ``ongoing_prefetch`` entry as the policy sees it (0.5.23 keeps a NamedTuple there,
    0.5.17 a tuple): its request id, SGLang's operation, and the tokens of L3 hit it will load (at
    most its key while the storage query has not answered)."""

    rid: str
    op: Any
    hit: int


def _entry_op(entry: Any) -> Any:
    op = getattr(entry, "operation", None)
    return op if op is not None else entry[2]


def _entry_hit(entry: Any, op: Any) -> int:
    hit = int(getattr(op, "storage_hit_count", 0) or 0)
    if hit or getattr(op, "hash_value", None):
        return hit
    key = getattr(entry, "prefetch_key", None)
    return len(key if key is not None else entry[1])


def loads(cache: Any, *, live: bool = True) -> Iterator[Loading]:
    """The loads in flight, in SGLang's order (`live`: not terminated)."""
    for k, entry in list(getattr(cache, "ongoing_prefetch", {}).items()):
        op = _entry_op(entry)
        if op is None or (live and op.is_terminated()):
            continue
        yield Loading(rid(k), op, _entry_hit(entry, op))


def loading_rids(cache: Any) -> set[str]:
    return {rid(k) for k in getattr(cache, "ongoing_prefetch", {})}


def kept(op: Any) -> int:
    """Tokens of a load SGLang counts complete (kept if it stops now)."""
    return int(getattr(op, "completed_tokens", 0) or 0)


def allocated(op: Any) -> bool:
    """The load's host pages are allocated (its L3 hit is known)."""
    return getattr(op, "host_indices", None) is not None


def loaded_done(cache: Any, op: Any) -> bool:
    """Every page of the load's hit is read and counted."""
    hv = getattr(op, "hash_value", None) or []
    return bool(hv) and allocated(op) and kept(op) >= len(hv) * page_size(cache)


def load_ended(backend: Any, op: Any) -> float | None:
    """When the get that read the load's last page returned (the backend's clock), if known."""
    hv = getattr(op, "hash_value", None) or []
    ended = getattr(backend, "get_ended", None)
    return ended(hv[-1]) if hv and ended is not None else None


def op_tokens(cache: Any, op: Any) -> int:
    """Tokens of the load's hit, once known (its hash values)."""
    return len(getattr(op, "hash_value", None) or []) * page_size(cache)


def settles_by_ack(cache: Any) -> bool:
    """0.5.23 settles a finished load through its acknowledgements; 0.5.17 in the stop hook."""
    return hasattr(cache, "_handle_prefetch_result")


# -- the scheduler ------------------------------------------------------------------------------
def waiting(scheduler: Any) -> list:
    return list(getattr(scheduler, "waiting_queue", None) or ()) if scheduler is not None else []


def queue_key(scheduler: Any) -> tuple:
    """What identifies the waiting queue's state for one pass (its object, length, chunked request)."""
    return (id(getattr(scheduler, "waiting_queue", None)), len(waiting(scheduler)), id(chunked(scheduler)))


def chunked(scheduler: Any) -> Any:
    return getattr(scheduler, "chunked_req", None)


def chunk_size(scheduler: Any) -> int | None:
    chunk = getattr(scheduler, "chunked_prefill_size", None)
    return chunk if isinstance(chunk, int) and chunk > 0 else None


def tree_cache(obj: Any) -> Any:
    return getattr(obj, "tree_cache", None)


def prefetch_again(scheduler: Any, req: Any) -> None:
    """Prefetch a queued request through SGLang's own path (it matches again and asks admission)."""
    scheduler._prefetch_kvcache(req)


def batch_shape(batch: Any) -> tuple[list[int], list[int], list[str]] | None:
    """(new tokens, prefix tokens, request ids) per request of a prefill batch, or None."""
    news = [int(x) for x in (getattr(batch, "extend_lens", None) or [])]
    prefixes = [int(x) for x in (getattr(batch, "prefix_lens", None) or [])]
    if not news or len(news) != len(prefixes):
        return None
    reqs = list(getattr(batch, "reqs", None) or ())
    return news, prefixes, [rid(r) for r in reqs] if len(reqs) == len(news) else []


def is_prefill(batch: Any) -> bool:
    fm = getattr(batch, "forward_mode", None)
    try:
        return bool(fm is not None and fm.is_extend() and not (getattr(fm, "is_mixed", None) and fm.is_mixed()))
    except Exception:  # noqa: BLE001
        return False


# -- the host pool ------------------------------------------------------------------------------
def host_free(cache: Any) -> int | None:
    """Free tokens of the host pool (what a prefetch allocates into once its hit is known; SGLang
    shortens or revokes a prefetch it cannot fit), or None where the release does not say."""
    try:
        return int(cache.cache_controller.mem_pool_host.available_size())
    except Exception:  # noqa: BLE001 -- a diagnostic only
        return None


def host_evictable(cache: Any) -> int:
    """Host-only tokens SGLang's ``evict_host`` can free: each evictable leaf and, as it does, the
    ancestors that become leaves once their children are gone (a prefix cached in chunks is a chain
    of nodes, and only its deepest is a leaf: counting leaves alone left an H200 server's host pool
    looking full and its 24k-token revisits recomputed, where SGLang's own policy loaded them)."""
    root = getattr(cache, "root_node", None)
    counted: set[int] = set()
    total = 0
    todo = list(getattr(cache, "evictable_host_leaves", ()) or ())
    while todo:
        node = todo.pop()
        hv = getattr(node, "host_value", None)
        if id(node) in counted or node is root or hv is None or not getattr(node, "evicted", False) \
                or getattr(node, "host_ref_counter", 0):
            continue
        counted.add(id(node))
        total += len(hv)
        parent = getattr(node, "parent", None)
        kids = getattr(parent, "children", None)
        if parent is not None and parent is not root and isinstance(kids, dict) and \
                all(id(c) in counted for c in kids.values()):
            todo.append(parent)
    return total


def host_limit(controller: Any, fraction: float) -> tuple[int, int]:
    """(tokens prefetches hold now, tokens they may hold: SGLang's limit or `fraction` of the host
    pool, whichever is larger)."""
    host = controller.mem_pool_host
    size = int(getattr(host, "logical_size", 0) or getattr(host, "size", 0))
    limit = max(int(getattr(controller, "prefetch_capacity_limit", 0) or 0), int(fraction * size))
    return int(controller.prefetch_tokens_occupied), limit


def buffer_only(controller: Any) -> bool:
    return getattr(controller, "host_memory_mode", "") == "buffer_only"


class HostLock(NamedTuple):
    """0.5.23's host lock on a tree node: the cache, the node's id, and the receipt SGLang's
    ``dec_host_lock_ref`` asks back."""

    cache: Any
    node: Any
    params: Any


def loading_parts(entry: Any) -> tuple[Any, Any, Any]:
    """(the node a load hangs under, its radix key, its operation) of an ``ongoing_prefetch``
    entry (0.5.17: a tuple; 0.5.23: ``_OngoingPrefetch``)."""
    if hasattr(entry, "anchor_node_id"):
        return entry.anchor_node_id, entry.prefetch_key, entry.operation
    return entry[0], entry[1], entry[2]


def find_waiting(scheduler: Any, request_id: str) -> Any:
    """The queued request of `request_id` (None where it is not waiting)."""
    return next((r for r in waiting(scheduler) if rid(r) == request_id), None)


def protect_loaded(cache: Any, last_host_node: Any, key: Any, usable: int, req: Any = None) -> Any:
    """Protect from host eviction the deepest node a finished load inserted (under
    `last_host_node`, its first `usable` tokens of `key`); returns what `release_node` takes, or
    None where nothing of it is in the tree (dropped, or all of it was there already).

    0.5.17: the node under `last_host_node` (``_match_prefix_helper``), its ``protect_host``.
    0.5.23 (node ids, a tree core that may be Rust): SGLang's ``match_prefix`` over the queued
    request's tokens up to the load's end (`req`, which is needed there), then
    ``inc_host_lock_ref`` on the node it ends on, as SGLang's own load back holds host pages."""
    if callable(getattr(cache, "_match_prefix_helper", None)):
        _, node = cache._match_prefix_helper(last_host_node, key[:usable])
        if node is last_host_node or getattr(node, "host_value", None) is None:
            return None
        node.protect_host()
        return node
    fill = getattr(req, "full_untruncated_fill_ids", None) if req is not None else None
    if fill is None or not callable(getattr(cache, "inc_host_lock_ref", None)):
        return None
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    end = int(getattr(req, "storage_prefetch_last_match_len", 0) or 0) + int(usable)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(fill[:end], getattr(req, "extra_key", None))))
    node = getattr(m, "last_host_node", None)
    if node is None or node == last_host_node or cache.is_root(node):
        return None
    return HostLock(cache, node, cache.inc_host_lock_ref(node).to_dec_params())


def release_node(node: Any) -> None:
    """End a protection `protect_loaded` placed."""
    if isinstance(node, HostLock):
        try:
            node.cache.dec_host_lock_ref(node.node, node.params)
        except Exception as exc:  # noqa: BLE001 -- a tree reset dropped the node: nothing is held
            once("release-node", "hicache-gds: a host lock was gone when released (%s: %s)", type(exc).__name__, exc)
        return
    if getattr(node, "host_ref_counter", 0) > 0:  # a tree reset may have dropped the node's state
        node.release_host()


def can_protect(cache_cls: Any) -> bool:
    """The cache class inserts finished loads where the policy can find and lock them."""
    return callable(getattr(cache_cls, "_match_prefix_helper", None)) or \
        callable(getattr(cache_cls, "inc_host_lock_ref", None))


# -- ranks ----------------------------------------------------------------------------------------
def attention_group_sizes(cache: Any) -> list[int | None]:
    """The sizes of the cache's attention CP and TP groups where it has them (None: unknown)."""
    sizes: list[int | None] = []
    for name in ("attn_cp_group", "attn_tp_group"):
        group = getattr(cache, name, None)
        if group is not None:
            try:
                import torch
                sizes.append(int(torch.distributed.get_world_size(group=group)))
            except Exception:  # noqa: BLE001 -- the caller decides what an unknown size means
                sizes.append(None)
    return sizes


def single_rank(cache: Any) -> bool:
    """The cache serves one rank alone (no TP, PP or attention-group peers to agree with)."""
    if int(getattr(cache, "tp_world_size", 1) or 1) > 1 or int(getattr(cache, "pp_size", 1) or 1) > 1:
        return False
    # an unknown group size: do not act alone
    return all(n is not None and n <= 1 for n in attention_group_sizes(cache))


def agree(cache: Any, flag: bool, op_name: str) -> bool:
    """The same verdict on every TP/PP rank (SGLang's ``_all_reduce``: PP0's TP ranks reduce, the
    result travels along PP), as SGLang agrees its own prefetch decisions."""
    return bool(agree_int(cache, int(flag), op_name))


def agree_int(cache: Any, value: int, op_name: str) -> int:
    """`value` reduced over every rank by `op_name` (MIN: how many tokens all of them prefetch), as `agree`."""
    try:
        import torch
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return value
        reduce = getattr(cache, "_all_reduce", None)
        if reduce is None:
            return value
        t = torch.tensor([int(value)], dtype=torch.int)
        reduce(t, getattr(torch.distributed.ReduceOp, op_name))
        return int(t.item())
    except Exception as exc:  # noqa: BLE001 -- never break the scheduler: keep the local verdict
        once("agree", "hicache-gds: could not agree a prefetch decision across ranks (%s); deciding locally", exc)
        return value


# -- the policy on SGLang's objects ---------------------------------------------------------------
def attached(obj: Any) -> Any:
    """The policy object attached to a cache or controller (or None)."""
    return getattr(obj, _ATTR, None) if obj is not None else None


def attach(cache: Any, pol: Any) -> None:
    """Attach `pol` to `cache` and its controller (where the controller hooks find it)."""
    if pol is not None:
        setattr(cache, _ATTR, pol)
    cc = getattr(cache, "cache_controller", None)
    if cc is not None and attached(cache) is not None:
        setattr(cc, _ATTR, attached(cache))


def stop_policy(cache: Any) -> Any:
    return getattr(cache, "prefetch_stop_policy", None)


def set_stop_policy(cache: Any, name: str) -> None:
    cache.prefetch_stop_policy = name


def storage_on(cache: Any) -> bool:
    cc = getattr(cache, "cache_controller", None)
    return cc is not None and bool(getattr(cc, "enable_storage", False))


def storage_type(cache: Any) -> str:
    return getattr(getattr(cache, "cache_controller", None), "storage_backend_type", "?")


# -- the split's request --------------------------------------------------------------------------
def cached_prefix(req: Any) -> int:
    """Tokens of a chunked request's prefix SGLang has cached (``prefix_indices``; 0.5.23: ``prefix_len``)."""
    return on_gpu(req)


def can_hold_batch(adder: Any) -> bool:
    """This prefill pass can be kept from adding any request (`hold_batch`)."""
    return hasattr(adder, "prefill_max_requests")


def hold_batch(adder: Any) -> None:
    """Keep a prefill pass from adding any request (a chunked request is held this pass): SGLang
    counts a chunk in flight for its chunked request whenever the pass forms a batch, held or
    not, and a count the batch never settles would take the request's last chunk for a middle
    one."""
    adder.prefill_max_requests = 0


def refresh_next_round(req: Any) -> None:
    """Form a chunked request's next round again (its prefix grew after SGLang formed it)."""
    req.init_next_round_input()


def count_storage_tokens(req: Any, n: int) -> None:
    """Count `n` joined tokens as read from storage (SGLang splits a request's cached tokens by
    source at its first chunk)."""
    if isinstance(getattr(req, "cached_tokens_storage", None), int):
        req.cached_tokens_storage += n


def loading_entry(cache: Any, key: Any) -> Any:
    """The raw ``ongoing_prefetch`` entry under `key` (None once SGLang settled it)."""
    return getattr(cache, "ongoing_prefetch", {}).get(key)


def cancel_rest(cache: Any, operation: Any) -> None:
    """A load stopped before all its pages were counted: its backend skips the rest of its reads."""
    if kept_short(cache, operation):
        b = backend_of(cache)
        if b is not None:
            b.cancel_read(getattr(operation, "host_indices", None))


def kept_short(cache: Any, operation: Any) -> bool:
    return kept(operation) < op_tokens(cache, operation)


def is_terminated(operation: Any) -> bool:
    return bool(operation.is_terminated())


def controller_policy(controller: Any) -> Any:
    """The policy attached to a controller, when its cache's policy is in force and SGLang's own
    limit is not the only one that can apply (a ``buffer_only`` host pool)."""
    if buffer_only(controller):
        return None
    return attached(controller)


def op_rid(op: Any) -> str:
    """The request id of a prefetch operation."""
    return rid(getattr(op, "request_id", ""))


def host_indices(op: Any) -> Any:
    """A load's host slots (None until its L3 hit is known)."""
    return getattr(op, "host_indices", None)
