"""Holding a split request for its tail on SGLang 0.5.23 (`split_policy.park` is the decision;
0.5.17's hook is `policy_hooks.around_add_chunked_req`).

The hook point is the same method as on 0.5.17, ``PrefillAdder.add_chunked_req``, which 0.5.23's
``Scheduler._get_new_batch_prefill_raw`` calls for the scheduler's chunked request before it
looks at the waiting queue (``self.chunked_req = adder.add_chunked_req(self.chunked_req)``). A
held pass returns the request as SGLang's own parked chunk does (``add_chunked_req`` returns it
unadded where the memory budget has no room for a chunk), so it stays the chunked request, and
the pass's request cap goes to 0 (``prefill_max_requests``: ``add_one_req`` answers ``OTHER``),
so no waiting request is added either: the pass forms no batch, and 0.5.23 then neither counts a
chunk in flight for the request (``inflight_middle_chunks``, raised only where a batch is formed)
nor reserves a chunk's memory, and the scheduler runs what decodes. What 0.5.23 does around it,
and why a held pass leaves it consistent:

* the next pass stashes the chunked request only where its last round computed something
  (``extend_end > prefix_len``, SGLang's test for its own parked chunk): a request is held only
  after SGLang checkpointed its last chunk (``stash_chunked_request`` sets ``prefix_len`` to
  ``extend_end``), so a held pass has nothing to stash, and the hold is never started where a
  chunk is not checkpointed (`holdable`);
* when the hold ends, the tail joins inside the hook, before SGLang's own ``add_chunked_req``
  sizes the next chunk from the grown ``prefix_len``, and the batch the pass forms starts the
  tail's load back (``ready_to_load_host_cache``) before it runs;
* the prefill delayer, where one is on, is told this pass prefilled nothing (its ``finalize``
  negotiates for a pass ``add_chunked_req`` did not reach);
* an aborted or retracted request leaves ``chunked_req``: the tail and the hold are dropped after
  the next ``get_new_batch_prefill`` (`split_policy.sweep_tails`).

A dLLM adder (``dllm_config``) sizes its chunks in blocks and is never held.
"""

from __future__ import annotations

from typing import Any

from . import policy_hooks, view

__all__ = ["holdable", "around_add_chunked_req"]


def holdable(adder: Any, req: Any) -> bool:
    """This 0.5.23 prefill pass can be held for `req`: the adder caps the requests a pass adds,
    it is not a dLLM adder, and the request's last chunk is checkpointed (a held pass computes
    nothing, so SGLang stashes nothing after it)."""
    if not view.can_hold_batch(adder) or getattr(adder, "dllm_config", None) is not None:
        return False
    end, prefix = getattr(req, "extend_end", None), getattr(req, "prefix_len", None)
    return isinstance(prefix, int) and (end is None or end <= prefix)


def around_add_chunked_req(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """0.5.23's ``PrefillAdder.add_chunked_req``: a split request whose tail is still being read
    is held this pass where waiting for it finishes first (module docstring); otherwise its tail
    joins with what is read and SGLang adds its next chunk."""
    return policy_hooks.hold_or_add(original, adder, req, holdable(adder, req), *args, **kwargs)
