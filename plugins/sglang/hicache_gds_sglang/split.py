"""A split hit: the GPU computes a prefix's head while the disk loads its tail (SGLang 0.5.17).

SGLang's prefetch loads the *head* of a prefix found in L3 and the GPU computes what follows, so
a request is served by the disk, then by the GPU, never by both at once. A split runs them side
by side on one request (`hicache_gds.costmodel`, "Split"): admission lets the request go to the
GPU as a recompute, and starts a prefetch of the pages after its first ``head`` tokens (a
`TailLoad`). SGLang computes a long prompt in chunks and caches each chunk in its radix tree when
it forms the next batch (``cache_unfinished_req``); right after that, once the chunks reach the
tail (`join`), the tail's pages read so far are inserted under the request's last node, loaded
back into GPU memory, and appended to the request's prefix, so its next chunk starts after them.

What keeps a wrong byte from being served:

* the tail's keys are SGLang's own hash chain, continued over the head's tokens from the hash the
  request's match ended on (``get_hash_str``): the same keys the whole prefix was stored under;
* only pages the operation counted complete are inserted (SGLang counts a batch of pages after its
  get returned), and only under the node the request's own cached chunks end on, at the position
  they end (pages of the tail the GPU has already computed are freed, not inserted);
* the request's prefix grows only by what SGLang's own ``match_prefix`` and ``init_load_back``
  return for those tokens, the lock moving from the old last node to the new one;
* anything unexpected (a revoked or short tail, a request no longer chunked, a partial page at the
  end of the cached prefix) drops the tail and the request computes on, as it would have anyway.

Host memory follows SGLang's ``check_prefetch_progress``: pages inserted are the tree's, pages not
inserted but complete are freed, pages past the completed count are released through the
controller's release queue (its IO thread may still be writing them) and the rest by that thread.
On a multi-rank server the ranks agree how many of the tail's tokens join (the fewest any rank
has read: `ranks.tail`), so every rank's prefix grows alike; each rank's pages are its own shard.

SGLang 0.5.23 (``UnifiedRadixCache``, whose finished loads settle through acknowledgements): each
function hands its cache to `split_0523`, the same contract on that release's tree core (one rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .records import TailLoad
from .settle import Kept, cancel_reads

__all__ = ["TailLoad", "HeadGuard", "supported", "tail_pages", "start", "join", "cancel", "progress", "guard_head",
           "settle_guard"]

_SUFFIX = "\x00tail"  # an ongoing_prefetch key no request id has


def batch_pages() -> int:
    """Pages SGLang's controller reads in one get of a prefetch (``STORAGE_BATCH_SIZE``): it
    counts a prefetch's pages complete only when such a get returns, so a tail is joined a get
    at a time (on an H200 a 73-page tail read in one get of 0.35 s joined nothing at 0.3 s)."""
    try:
        from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
        return max(1, int(STORAGE_BATCH_SIZE))
    except Exception:  # noqa: BLE001 -- moved or gone: assume its long-standing value
        return 128


def _unified(cache: Any) -> bool:
    from . import view
    return view.settles_by_ack(cache)


def _unified_mod() -> Any:
    from . import split_0523
    return split_0523


def supported(cache: Any) -> bool:
    """The cache has the 0.5.17 parts a split uses (capabilities, not a version check)."""
    if _unified(cache):
        return _unified_mod().supported(cache)
    cc = getattr(cache, "cache_controller", None)
    return (all(callable(getattr(cache, m, None)) for m in ("_insert_helper_host", "init_load_back", "match_prefix",
                                                              "inc_lock_ref", "dec_lock_ref"))
            and isinstance(getattr(cache, "ongoing_prefetch", None), dict)
            and getattr(cache, "root_node", None) is not None
            and all(callable(getattr(cc, m, None)) for m in ("prefetch", "terminate_prefetch", "get_hash_str",
                                                              "append_host_mem_release")))


def tail_pages(page_bytes: int, get_bytes: int, threshold_pages: int) -> int | None:
    """Pages per prefetch operation of a tail read in gets of about `get_bytes` (None: the whole
    tail in one operation). SGLang counts an operation's pages only when a get of up to
    `batch_pages` returns, so a tail read as one operation joins nothing until its first get of
    128 pages (1 GiB for the 8B shape, 0.6 s on an H200's disk) has returned; several small
    operations, read one after another, each count when their own get returns. Each is at least
    SGLang's prefetch threshold, below which its prefetch thread revokes an operation."""
    if get_bytes <= 0 or page_bytes <= 0:
        return None
    return max(1, int(threshold_pages), min(batch_pages(), int(get_bytes) // int(page_bytes)))


def start(cache: Any, rid: str, last_host_node: Any, tokens: Any, last_hash: Any, prefix_keys: Any, *,
          matched: int, head: int, expect: int, pages_per_op: int | None = None, req: Any = None) -> TailLoad | None:
    """Prefetch ``tokens[head:]`` (the request's tokens from position `matched` on, as SGLang's
    ``prefetch_from_storage`` gets them) under the hash chain continued over ``tokens[:head]``, as
    operations of `pages_per_op` pages (the last one takes the remainder; None: one operation).
    None where the tail is shorter than SGLang's prefetch threshold."""
    if _unified(cache):
        return _unified_mod().start(cache, rid, last_host_node, tokens, last_hash, prefix_keys, matched=matched,
                                    head=head, expect=expect, pages_per_op=pages_per_op, req=req)
    from sglang.srt.mem_cache.radix_cache import RadixKey

    ps = int(cache.page_size)
    cc = cache.cache_controller
    if head <= 0 or head % ps:
        raise ValueError(f"a split head must be a positive number of whole pages, got {head}")
    extra = getattr(getattr(last_host_node, "key", None), "extra_key", None)
    # A slice keeps SGLang's token container (0.5.17: ``array('q')``): the tree asserts that the
    # keys it compares are of one type, and a tail inserted with list keys broke the next insert.
    key = RadixKey(tokens[head:], extra_key=extra, is_bigram=bool(getattr(cache, "is_eagle", False)))
    key = key.page_aligned(ps)
    if len(key) < int(getattr(cache, "prefetch_threshold", 0) or 0) or len(key) == 0:
        return None
    pages = len(key) // ps
    hashes = cc.get_hash_str(list(tokens[:head + len(key)]), last_hash, page_size=ps)
    if isinstance(hashes, str):
        hashes = [hashes]
    hp = head // ps
    if len(hashes) != hp + pages:
        raise RuntimeError(f"SGLang's hash chain gave {len(hashes)} hashes for {hp + pages} pages")
    step = pages if not pages_per_op else max(1, int(pages_per_op))
    cuts = list(range(0, pages, step))
    if len(cuts) > 1 and pages - cuts[-1] < step:
        cuts.pop()  # the last operation takes the remainder: none is shorter than the others
    cuts.append(pages)
    root = cache.root_node
    keys = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        sub = key[a * ps:b * ps]
        before = None if prefix_keys is None else list(prefix_keys) + list(hashes[:hp + a])
        op_key = f"{rid}{_SUFFIX}{i}"
        root.protect_host()  # what SGLang's revoke and detach paths release for every ongoing prefetch
        op = cc.prefetch(op_key, sub, hashes[hp + a - 1], before)
        cache.ongoing_prefetch[op_key] = (root, sub, op)
        cc.prefetch_tokens_occupied += len(sub)
        keys.append(op_key)
    return TailLoad(rid, tuple(keys), key, matched + head, matched + head + len(key), expect)


def _settle(cache: Any, t: TailLoad, keep: int) -> tuple[int, Any, list]:
    """End the tail's operations: of the pages complete in token order from the tail's start,
    ``keep`` leading tokens stay the caller's to insert; the other complete pages are freed, the
    rest released as SGLang releases a stopped prefetch. Returns (leading tokens complete, the
    host indices and hashes of those kept)."""
    cc = cache.cache_controller
    backend = getattr(cc, "storage_backend", None)
    ps = int(cache.page_size)
    kept = Kept(keep, ps)
    for op_key in t.keys:
        entry = cache.ongoing_prefetch.pop(op_key, None)
        if entry is None:  # revoked by SGLang (no hit, no host memory): nothing past it joins
            kept.broken()
            continue
        root, key, op = entry
        completed, _ = cc.terminate_prefetch(op)
        hi = getattr(op, "host_indices", None)
        cancel_reads(backend, hi)
        usable = int(completed) // ps * ps
        if hi is None:
            kept.broken()
        else:
            mine = kept.take(hi, op.hash_value, usable, len(key))
            if usable > mine:
                cc.mem_pool_host.free(hi[mine:usable])
            cc.append_host_mem_release(hi[usable:int(completed)])
        root.release_host()
        cc.prefetch_tokens_occupied = max(0, cc.prefetch_tokens_occupied - len(key))
    return kept.result()


def cancel(cache: Any, t: TailLoad) -> None:
    """Drop the tail: stop its reads and free its host memory (nothing is inserted)."""
    if _unified(cache):
        return _unified_mod().cancel(cache, t)
    _settle(cache, t, 0)


def progress(cache: Any, t: TailLoad) -> tuple[int, bool, bool]:
    """(tail tokens read and counted, in order from its start; whether all of them are; whether
    it may still read more: not ended by SGLang, as after a short read or a revoked operation)."""
    if _unified(cache):
        return _unified_mod().progress(cache, t)
    ps = int(cache.page_size)
    done = 0
    for op_key in t.keys:
        entry = cache.ongoing_prefetch.get(op_key)
        if entry is None:
            return done, False, False
        _, key, op = entry
        n = int(op.completed_tokens) // ps * ps if getattr(op, "host_indices", None) is not None else 0
        done += min(n, len(key))
        if n < len(key):
            hv = getattr(op, "hash_value", None) or []
            short = getattr(op, "host_indices", None) is not None and n >= len(hv) * ps  # read all it got
            return done, False, not (op.is_terminated() or short)
    return done, True, False


def reading(cache: Any, t: TailLoad) -> bool:
    """Whether the tail's reads are under way: one of its operations has its L3 hit known and its
    host pages allocated (the disk answered its query; its gets are posted). Before that the
    tail has read nothing, however long it has been queued."""
    for op_key in t.keys:
        entry = cache.ongoing_prefetch.get(op_key)
        if entry is None:
            return False
        owner = entry if _unified(cache) else entry[2]  # 0.5.23 keeps the pages on the entry
        if getattr(owner, "host_indices", None) is not None:
            return True
    return False


@dataclass
class HeadGuard:
    """A split's head under its joined tail, locked until SGLang has backed it up to host.

    Under ``write_through`` SGLang keeps the nodes backed up to host a contiguous prefix from the
    root, and it evicts a device node not backed up only as a leaf with no children at all
    (``_evict_regular`` asserts it). A chunked request's chunks are not backed up until it
    finishes (its hit count is not counted meanwhile), so a tail joined under its head is backed
    up below a node that is not; once the tail left the GPU, evicting that head would stop the
    scheduler (an H200 burst did, with the host pool full when the request finished). The head
    holds a lock until it is backed up: by SGLang when the request finishes, else by
    `settle_guard` (``write_backup``, root first) once its request is done, which evicts host
    pages to make room."""

    node: Any
    req: Any
    root: Any


def guard_head(cache: Any, node: Any, req: Any) -> HeadGuard | None:
    """Lock `node` (the head a tail was joined under) where the cache writes through and some
    node from the root to it is not backed up; None where nothing needs guarding (0.5.23: not
    ported, its write-through backs up a checkpointed chunk at its insert)."""
    if _unified(cache):
        return None
    cc = getattr(cache, "cache_controller", None)
    if getattr(cc, "write_policy", "write_back") == "write_back" or _backed_up(cache, node):
        return None
    cache.inc_lock_ref(node)
    return HeadGuard(node, req, cache.root_node)


def settle_guard(cache: Any, g: HeadGuard, finished: bool) -> bool:
    """True once `g` can go (its lock released): the head is backed up, or the tree it was in is
    gone (a flush). Backs the path up itself once the request is `finished` (its forward ran)."""
    if cache.root_node is not g.root:
        return True  # the tree was reset: its locks went with it
    if not _backed_up(cache, g.node) and finished:
        for n in reversed(_path(cache, g.node)):
            if not n.backuped and int(cache.write_backup(n) or 0) <= 0:
                break  # host memory refused (or a parent not backed up): again after the next batch
    if not _backed_up(cache, g.node):
        return False
    cache.dec_lock_ref(g.node)
    return True


def _path(cache: Any, node: Any) -> list:
    out = []
    while node is not None and node is not cache.root_node:
        out.append(node)
        node = node.parent
    return out


def _backed_up(cache: Any, node: Any) -> bool:
    return all(n.backuped for n in _path(cache, node))


def join(cache: Any, req: Any, t: TailLoad, *, limit: int | None = None) -> int:
    """After SGLang cached the request's chunks (``cache_unfinished_req``): insert the tail's
    pages read so far (at most its first `limit` tokens: on a multi-rank server, what every rank
    read) beyond the cached prefix under its last node, load them back to GPU memory and append
    them to the request's prefix. Ends the tail; returns the tokens the prefix grew by (0: the
    request computes on)."""
    if _unified(cache):
        return _unified_mod().join(cache, req, t, limit=limit)
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    ps = int(cache.page_size)
    cached = len(req.prefix_indices)
    fill = getattr(req, "full_untruncated_fill_ids", None)  # SGLang's own container: the tree's key type
    if fill is None or cached != int(getattr(req, "cache_protected_len", -1)) or cached % ps or \
            not t.start <= cached < t.end:
        cancel(cache, t)
        return 0
    off = cached - t.start  # tail tokens the GPU computed already
    keep = t.tokens if limit is None else max(0, min(int(limit), t.tokens)) // ps * ps
    usable, host_indices, hash_value = _settle(cache, t, keep=keep)  # kept: inserted or freed below
    usable = min(usable, keep)
    cc = cache.cache_controller
    if host_indices is None or usable <= off:
        if host_indices is not None:
            cc.mem_pool_host.free(host_indices)
        return 0
    matched = cache._insert_helper_host(req.last_node, t.key[off:usable], host_indices[off:usable],
                                        hash_value[off // ps:usable // ps])
    # the tokens the GPU computed, and those the tree held already: not inserted, so freed
    waste = host_indices[:off + matched]
    if len(waste):
        cc.mem_pool_host.free(waste)
    upto = cached + (usable - off)
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(fill[:upto], getattr(req, "extra_key", None),
                                                          is_bigram=bool(getattr(cache, "is_eagle", False)))))
    device = m.device_indices
    if len(device) < cached:
        return 0  # the request's own chunks are not where they were: leave it as it is
    loaded, node = cache.init_load_back(InitLoadBackParams(best_match_node=m.last_host_node,
                                                           host_hit_length=m.host_hit_length, req=req))
    if len(loaded) == 0:
        node = m.last_device_node
    prefix = torch.cat([device, loaded.to(device.dtype)]) if len(loaded) else device
    if len(prefix) <= cached:
        return 0
    old = req.last_node
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(old)
    req.prefix_indices = prefix
    req.last_node = node
    req.cache_protected_len = len(prefix)
    return len(prefix) - cached
