"""A split's head cut where it ends (``policy_split_cut``): the chunk that crosses it stops there.

SGLang computes a prompt in chunks of ``--chunked-prefill-size`` tokens, and a split's tail joins
the request where a chunk ends (`split.join`), so without a cut a head is whole chunks: 8,192
tokens of a 10,240-token hit, the GPU alone for most of it, or none. With the cut the head may
end at any page, where the GPU's compute of the head and the disk's read of the tail balance
(`hicache_gds.costmodel.split_heads`; the cost model weighs cut heads where `can_cut`).

The cut is SGLang's own chunk budget: where a request with a split tail is added to a prefill
batch (``PrefillAdder.add_one_req`` for its first chunk, ``add_chunked_req`` for the next ones:
both releases), the adder's ``rem_chunk_tokens`` is lowered to the tokens left to the head's end
for that call, so SGLang truncates the chunk there as it truncates a chunk at its budget, and
the chunk's pages are cached at the join point as any chunk's. Afterwards the budget is what
SGLang leaves after a chunk that fills it (the request is the pass's chunked request, and no
other request may start a chunk in that batch); where nothing was added (no memory, another
gate), the budget is restored as it was. Requests without a split tail, heads that end beyond the
chunk, and passes without a chunk budget are left alone.
"""

from __future__ import annotations

import logging
from typing import Any

from . import ride, view

__all__ = ["CUT_HOOKED", "can_cut", "head_left", "capped", "around_add_one_req"]

log = logging.getLogger("hicache_gds_sglang.policy")

CUT_HOOKED = [False]  # both adder points (``add_one_req``, ``add_chunked_req``) are hooked


def can_cut(backend: Any) -> bool:
    """Split heads may end at any page on this server (`policy_split_cut`, where hooked)."""
    return bool(CUT_HOOKED[0] and getattr(getattr(backend, "policy_config", None), "split_cut", False))


def head_left(pol: Any, req: Any) -> int | None:
    """Tokens of `req`'s split head still to compute before its tail starts, counted from the
    prefix it holds once its host hit is loaded back; None where it has no tail or the head is
    computed."""
    entry = pol.tails.get(view.rid(req))
    if entry is None:
        return None
    left = int(entry.load.start) - (view.on_gpu(req) + view.host_hit(req))
    return left if left > 0 else None


def capped(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """Call SGLang's `original` adder method for `req` with the chunk budget cut at its split
    head's end (module docstring); unchanged where there is nothing to cut."""
    cache = getattr(adder, "tree_cache", None)
    pol = view.attached(cache) if cache is not None else None
    if pol is None or not pol.tails:
        return original(adder, req, *args, **kwargs)
    try:
        rem = adder.rem_chunk_tokens
        left = head_left(pol, req) if can_cut(view.backend_of(cache)) else None
        if left is None or rem is None or left >= rem:
            return original(adder, req, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- the chunk keeps SGLang's size; the split joins at a chunk's end
        view.once("split-cut", "hicache-gds policy: a split head could not be cut (%s: %s); its chunk keeps "
                  "SGLang's size", type(exc).__name__, exc)
        return original(adder, req, *args, **kwargs)
    adder.rem_chunk_tokens = left
    try:
        return original(adder, req, *args, **kwargs)
    finally:
        after = adder.rem_chunk_tokens
        if after is not None and after >= left:
            adder.rem_chunk_tokens = rem  # nothing added: the pass goes on with its budget
        else:
            # the chunk ends at the head: the budget stays spent, as after a chunk that fills it
            pol.counts["split_cut"] += 1
            log.debug("hicache-gds policy: %s split head cut: a chunk of %d tokens ends at its tail", view.rid(req),
                      left - (after or 0))


def around_add_one_req(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """``PrefillAdder.add_one_req`` (both releases): a split request's first chunk ends at its
    head where the head is shorter than the pass's chunk budget (`capped`); in a pass whose
    chunked request left room to finished loads, only they are added (`ride`)."""
    if getattr(adder, ride.SEATS, None) is not None:
        return ride.around_add_one_req(original, adder, req, *args, **kwargs)
    return capped(original, adder, req, *args, **kwargs)
