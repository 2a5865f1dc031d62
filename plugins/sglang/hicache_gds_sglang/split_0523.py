"""A split hit on SGLang 0.5.23's ``UnifiedRadixCache``: the tail load and its join (`split` is
0.5.17's; this is the same contract on 0.5.23's tree core, node ids and request KV rows).

Tail load: each operation is SGLang's own prefetch (``cache_controller.prefetch``) under a handle
of its own (``<rid>\\x00tail<i>``), in ``ongoing_prefetch`` as SGLang keeps a load: anchored on
the root with a host lock, its host pages allocated by SGLang's hit drain, its pages counted by
SGLang's acknowledgements. SGLang inserts a finished load under its anchor in
``_handle_prefetch_result``; a tail's pages belong under the request's head, which the GPU has not
computed yet, so the plugin's hook there leaves a tail's operation alone (`is_tail`) and it stays
in ``ongoing_prefetch`` until its join or drop takes it out.

Join (after ``Scheduler.stash_chunked_request``: SGLang's ``checkpoint(req, up_to=extend_end)``
inserted the request's chunks and moved its lock to the node they end on, and ``prefix_len`` is
where the next chunk starts): under write-through the head is backed up to host first (SGLang's
own write-through backup; `_head_on_host`), then the tail's pages counted so far, beyond that
prefix, are inserted
under ``req.last_node`` (``tree_core.insert_host``), loaded back to GPU memory through SGLang's
``init_load_back`` (the scheduler's next ``ready_to_load_host_cache`` starts the copy, before the
batch that reads them runs), written into the request's KV row after its prefix, and the
request's prefix, protected length and tree lock move past them.

What keeps a wrong byte from being served is `split`'s: SGLang's own hash chain continued over the
head, only pages SGLang counted complete, inserted only at the request's own checkpointed node and
position, the prefix grown only by what SGLang's ``match_prefix`` / ``init_load_back`` return, and
anything unexpected drops the tail (the request computes on). Host memory: the pages counted
complete when an operation is taken out are the join's (inserted or freed); SGLang's
acknowledgement drain releases the rest (``ack_releases_incomplete_host_indices``), as for any load
it no longer tracks. One rank, the FULL component only (no hybrid, buffer-only or linker cache, no
EAGLE bigram keys).
"""

from __future__ import annotations

from typing import Any

from .records import TailLoad
from .settle import Kept, cancel_reads

__all__ = ["supported", "is_tail", "read_ended", "start", "progress", "cancel", "join"]

_SUFFIX = "\x00tail"


def is_tail(handle: Any) -> bool:
    """The ``ongoing_prefetch`` key is a split tail's operation (not a request's load)."""
    return _SUFFIX in str(getattr(handle, "rid", handle))


def read_ended(operation: Any) -> None:
    """SGLang drained a tail operation's last acknowledgement (its reads ended, whole or short):
    mark it ended (SGLang's own flag), so the join takes what it counted and waits no longer."""
    operation.mark_terminate()


def supported(cache: Any) -> bool:
    """The cache is a 0.5.23 cache a tail can join (capabilities, not a version check), serving
    one rank: the join's head backup (`_head_on_host`) and host insert can succeed on one rank and
    not another, which `ranks.tail`'s agreed length does not cover (the same answer on every rank)."""
    from . import view

    if not view.single_rank(cache):
        return False
    cc = getattr(cache, "cache_controller", None)
    core = getattr(cache, "tree_core", None)
    comps = getattr(cache, "tree_components", None)
    return (all(callable(getattr(cache, m, None)) for m in ("init_load_back", "match_prefix", "lock", "unlock",
                                                              "is_root", "is_backuped",
                                                              "inc_host_lock_ref", "dec_host_lock_ref",
                                                              "path_device_indices", "_apply_cache_actions",
                                                              "root_node_handle", "_execute_and_commit_kv_backup"))
            and all(callable(getattr(core, m, None)) for m in ("insert_host", "build_backup_kv_action"))
            and not getattr(core, "is_eagle", False) and comps is not None and len(tuple(comps)) == 1
            and isinstance(getattr(cache, "ongoing_prefetch", None), dict)
            and getattr(cache, "buffer_pipeline", None) is None and getattr(cache, "linker", None) is None
            and getattr(cache, "req_to_token_pool", None) is not None
            and all(callable(getattr(cc, m, None)) for m in ("prefetch", "terminate_prefetch",
                                                              "append_host_mem_release")))


def _handle(rid: str, i: int) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    return CacheRequestHandle(f"{rid}{_SUFFIX}{i}", 0)


def start(cache: Any, rid: str, last_host_node: Any, tokens: Any, last_hash: Any, prefix_keys: Any, *,
          matched: int, head: int, expect: int, pages_per_op: int | None = None,
          req: Any = None) -> "TailLoad | None":
    """`split.start` on 0.5.23 (the request `req` names the tail's namespace)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_radix_cache import _OngoingPrefetch
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    ps = int(cache.page_size)
    cc = cache.cache_controller
    if head <= 0 or head % ps:
        raise ValueError(f"a split head must be a positive number of whole pages, got {head}")
    extra, salt = getattr(req, "extra_key", None), getattr(req, "cache_salt", None)
    eagle = bool(getattr(cache.tree_core, "is_eagle", False))
    key = RadixKey(tokens[head:], extra_key=extra, is_bigram=eagle, cache_salt=salt).page_aligned(ps)
    if len(key) == 0 or len(key) < int(getattr(cache, "prefetch_threshold", 0) or 0):
        return None
    pages, hp = len(key) // ps, head // ps
    chain = RadixKey(tokens[:head + len(key)], extra_key=extra, is_bigram=eagle, cache_salt=salt)
    hashes = get_storage_hash_str(chain, last_hash, page_size=ps)
    hashes = [hashes] if isinstance(hashes, str) else list(hashes)
    if len(hashes) != hp + pages:
        raise RuntimeError(f"SGLang's hash chain gave {len(hashes)} hashes for {hp + pages} pages")
    step = pages if not pages_per_op else max(1, int(pages_per_op))
    cuts = list(range(0, pages, step))
    if len(cuts) > 1 and pages - cuts[-1] < step:
        cuts.pop()
    cuts.append(pages)
    root = cache.root_node_handle(extra)
    keys = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        sub = key[a * ps:b * ps]
        before = None if prefix_keys is None else list(prefix_keys) + hashes[:hp + a]
        h = _handle(rid, i)
        lock = cache.inc_host_lock_ref(root).to_dec_params()  # released as SGLang releases an anchor
        op = cc.prefetch(h, sub, hashes[hp + a - 1], before)
        op.stats_requested_tokens, op.storage_start = len(sub), matched + head + a * ps
        cache.ongoing_prefetch[h] = _OngoingPrefetch(root, sub, None, op, lock, {})
        cc.prefetch_tokens_occupied += len(sub)
        keys.append(h)
    return TailLoad(rid, tuple(keys), key, matched + head, matched + head + len(key), expect)


def _settle(cache: Any, t: TailLoad, keep: int) -> tuple[int, Any, list]:
    """`split._settle` on 0.5.23: take the tail's operations out of ``ongoing_prefetch``."""
    cc = cache.cache_controller
    backend = getattr(cc, "storage_backend", None)
    ps = int(cache.page_size)
    kept = Kept(keep, ps)
    retries = getattr(cache, "storage_prefetch_retries", None)
    for h in t.keys:
        entry = cache.ongoing_prefetch.pop(h, None)
        if callable(getattr(cache, "discard_storage_prefetch_accounting", None)):
            cache.discard_storage_prefetch_accounting(h)
        if retries is not None and callable(getattr(retries, "cancel", None)):
            retries.cancel(h.rid)
        if entry is None:  # revoked by SGLang (no hit, no host memory): nothing past it joins
            kept.broken()
            continue
        op = entry.operation
        cc.terminate_prefetch(op)
        hi = entry.host_indices if entry.host_indices is not None else getattr(op, "host_indices", None)
        cancel_reads(backend, hi)  # those already posted are released by SGLang's ack drain
        completed = min(int(op.completed_tokens), len(entry.prefetch_key))  # ours; SGLang's drain frees the rest
        usable = completed // ps * ps
        if hi is None:
            kept.broken()
        else:
            mine = kept.take(hi, op.hash_value, usable, len(entry.prefetch_key))
            if completed > mine:
                cc.mem_pool_host.free(hi[mine:completed])
        if entry.anchor_lock_params is not None:
            cache.dec_host_lock_ref(entry.anchor_node_id, entry.anchor_lock_params)
        cc.prefetch_tokens_occupied = max(0, cc.prefetch_tokens_occupied - len(entry.prefetch_key))
    return kept.result()


def cancel(cache: Any, t: TailLoad) -> None:
    _settle(cache, t, 0)


def progress(cache: Any, t: TailLoad) -> tuple[int, bool, bool]:
    """`split.progress` on 0.5.23 (a tail's operation SGLang has finished stays in place)."""
    ps = int(cache.page_size)
    done = 0
    for h in t.keys:
        entry = cache.ongoing_prefetch.get(h)
        if entry is None:
            return done, False, False
        op, key = entry.operation, entry.prefetch_key
        n = int(op.completed_tokens) // ps * ps if entry.host_indices is not None else 0
        done += min(n, len(key))
        if n < len(key):
            hv = getattr(op, "hash_value", None) or []
            short = entry.host_indices is not None and n >= len(hv) * ps
            return done, False, not (op.is_terminated() or short)
    return done, True, False


def join(cache: Any, req: Any, t: TailLoad, *, limit: int | None = None) -> int:
    """`split.join` on 0.5.23, after ``stash_chunked_request`` (module docstring); at most the
    tail's first `limit` tokens join."""
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    ps = int(cache.page_size)
    kv = getattr(req, "kv", None)
    cached = int(getattr(req, "prefix_len", -1))
    fill = getattr(req, "full_untruncated_fill_ids", None)
    if fill is None or kv is None or not getattr(kv, "holds_kv", False) or cached != int(kv.cache_protected_len) \
            or cached % ps or not t.start <= cached < t.end or getattr(req, "skip_radix_cache_insert", False):
        cancel(cache, t)
        return 0
    off = cached - t.start
    keep = t.tokens if limit is None else max(0, min(int(limit), t.tokens)) // ps * ps
    usable, hi, hv = _settle(cache, t, keep=keep)
    usable = min(usable, keep)
    cc = cache.cache_controller
    if hi is None or usable <= off or not _head_on_host(cache, req.last_node):
        if hi is not None:
            cc.mem_pool_host.free(hi)
        return 0
    anchor = req.last_node
    res = cache.tree_core.insert_host(anchor, t.key[off:usable], hi[off:usable], hv[off // ps:usable // ps])
    cache._apply_cache_actions(res.cache_actions)
    if res.host_insert_dropped:
        cc.mem_pool_host.free(hi)
        return 0
    waste = hi[:off + int(res.prefix_len)]  # computed by the GPU, or in the tree already: not inserted
    if len(waste):
        cc.mem_pool_host.free(waste)
    upto = cached + (usable - off)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(fill[:upto], req.extra_key,
                                                          cache_salt=getattr(req, "cache_salt", None))))
    if m.device_prefix_len < cached or m.last_device_node != anchor or m.host_hit_length <= 0:
        return 0  # the request's own chunks are not where they were: it computes on
    got = cache.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                  host_hit_length=m.host_hit_length, req=req))
    loaded, node = (0, anchor) if got is None else got
    if loaded <= 0 or node == anchor:
        return 0
    path = cache.path_device_indices(node)
    new = cached + int(loaded)
    if len(path) != new:
        raise RuntimeError(f"the joined prefix is {len(path)} tokens on the GPU, expected {new}")
    cache.req_to_token_pool.write((kv.req_pool_idx, slice(cached, new)), path[cached:new].to(torch_int(cache)))
    lock = cache.lock(node)
    cache.unlock(req.lock)
    req.lock, req.last_node = lock, node
    kv.cache_protected_len = new
    kv.kv_allocated_len = max(int(getattr(kv, "kv_allocated_len", 0) or 0), new)
    kv.kv_committed_len = max(int(getattr(kv, "kv_committed_len", 0) or 0), new)
    req.prefix_len = new
    return new - cached


def _head_on_host(cache: Any, node: Any) -> bool:
    """The head a tail joins under is backed up to host, or made so. Under write-through 0.5.23
    drops a host insert under a node not backed up (its host tree stays a prefix from the root:
    0.5.17's `split.HeadGuard` reason), and a chunked request's chunks are backed up only when it
    finishes; so the head's path is backed up here through SGLang's own write-through backup
    (``BackupKV`` of the node and its ancestors, root first; tracked and locked until its ack).
    False where the host pool refuses it."""
    if cache.is_root(node) or cache.is_backuped(node) or getattr(cache.tree_core, "is_write_back", False):
        return True
    cache._execute_and_commit_kv_backup(cache.tree_core.build_backup_kv_action(node))
    return bool(cache.is_backuped(node))


def torch_int(cache: Any) -> Any:
    """The dtype of the request-to-token table."""
    return cache.req_to_token_pool.req_to_token.dtype
