"""How `policy.LoadOrCompute` is wired into SGLang: the functions `plugin.register` hooks onto
its decision points through SGLang's ``HookRegistry`` (``hook(original, self, *args)`` for AROUND,
``hook(result, self, *args)`` for AFTER), and the policy's gauges in SGLang's metrics.

Each hook is fail-soft: an error inside one is logged once and answers as SGLang's own code
would (load, wait, SGLang's host-pool limit), and the policy's name turns into SGLang's default
(``timeout``) wherever the policy cannot run (another backend, a cache it does not hook).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hicache_gds import METRICS, metric_values

from . import cut, ranks, ride, room, split_0523, split_policy, view
from .policy import FALLBACK, POLICY, LoadOrCompute, policy_of, process_policies
from .records import Decided, SplitPlan
from .view import agree, agree_int, once

__all__ = ["after_init", "around_attach", "around_admit", "around_can_terminate", "around_check_progress",
           "around_prefetch_result", "around_rate_limited", "around_prefetch_kvcache", "after_new_prefill_batch",
           "around_forward", "after_cache_unfinished", "after_stash_chunked", "around_add_chunked_req", "hold_or_add",
           "publish_metrics"]

log = logging.getLogger("hicache_gds_sglang.policy")


# -- SGLang's metrics (--enable-metrics): gauges next to its own, refreshed at most once a second ---
_GAUGES: dict[str, Any] = {}
_last_publish = [0.0]


def _gauges() -> dict[str, Any]:
    if not _GAUGES:
        from prometheus_client import Gauge

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            try:
                return Gauge(name, doc, labels, multiprocess_mode="mostrecent")
            except (TypeError, ValueError):  # an older prometheus-client without that mode
                return Gauge(name, doc, labels, multiprocess_mode="livemax")

        _GAUGES.update(
            read=gauge("hicache_gds:read_rate_bytes_per_second", "The L3 store's measured read rate (recent gets)"),
            prefill=gauge("hicache_gds:prefill_tokens_per_second",
                          "Prefill rate of an 8k-token request, fitted on recent prefill batches"),
            breakeven=gauge("hicache_gds:breakeven_prefill_tokens_per_second",
                            "Loading a prefix beats recomputing it when prefill is slower than this"),
            decisions=gauge("hicache_gds:prefetch_decisions", "compute_or_load decisions so far", ("decision",)))
        # The stores' counters per pool, named and described as `hicache_gds.stats.METRICS` defines them.
        _GAUGES.update({f"store:{m.name}": gauge(f"hicache_gds:{m.name}", m.doc, ("pool",)) for m in METRICS.values()})
    return _GAUGES


def publish_metrics(backend: Any) -> None:
    """Called with each `HiCacheGDS.get_stats()` (SGLang asks every scheduler tick when metrics are on)."""
    now = time.monotonic()
    if now - _last_publish[0] < 1.0:
        return
    _last_publish[0] = now
    try:
        st = backend.policy_stats()
        g = _gauges()
        for name, key in (("read", "read_bytes_per_s"), ("prefill", "prefill_tokens_per_s_8k"),
                          ("breakeven", "breakeven_prefill_tokens_per_s")):
            if st.get(key) is not None:
                g[name].set(float(st[key]))
        for decision, n in (st.get("decisions") or {}).items():
            g["decisions"].labels(decision=decision).set(n)
        for pool, pst in backend.stats().items():
            if pool != "policy":
                for m, v in metric_values({**pst.get("local", {}), **pst}):
                    g[f"store:{m.name}"].labels(pool=pool).set(v)
    except Exception as exc:  # noqa: BLE001 -- metrics must never break the scheduler
        once("metrics", "hicache-gds: policy metrics not published (%s: %s)", type(exc).__name__, exc)


# -- hooks (registered by plugin.register through SGLang's HookRegistry) ------------------------
def _settle(cache: Any) -> None:
    """After init or attach: apply the backend's `policy` key, give the cache its policy object,
    and turn our name into SGLang's default where the backend is not ours."""
    try:
        b = view.backend_of(cache)
        if b is not None and b.policy_config.policy:
            view.set_stop_policy(cache, b.policy_config.policy)
        view.attach(cache, LoadOrCompute(cache) if view.attached(cache) is None and supported(cache) else None)
        if view.stop_policy(cache) == POLICY:
            storage = view.storage_on(cache)
            if not supported(cache):
                once(f"unsupported-{type(cache).__name__}", "hicache-gds: the %s policy is not available for %s; "
                      "SGLang's %s policy runs", POLICY, type(cache).__name__, FALLBACK)
                view.set_stop_policy(cache, FALLBACK)
            elif storage and b is None:
                log.info("hicache-gds: the %s policy needs --hicache-storage-backend gds (here: %s); SGLang's %s "
                         "policy runs", POLICY, view.storage_type(cache), FALLBACK)
                view.set_stop_policy(cache, FALLBACK)
            elif b is not None:
                pol = view.attached(cache)
                model = pol.model(b)
                est = model.estimates() if model is not None else {}
                log.info("hicache-gds: prefetch policy %s (read rate %s, prefill %s)", POLICY,
                         est.get("read_source", "unknown"), est.get("prefill_source", "unknown"))
    except Exception as exc:  # noqa: BLE001 -- a plugin must never break SGLang's start
        once("settle", "hicache-gds: the %s policy could not be set up (%s: %s); SGLang's %s policy runs", POLICY,
              type(exc).__name__, exc, FALLBACK)
        if view.stop_policy(cache) == POLICY:
            view.set_stop_policy(cache, FALLBACK)


SUPPORTED: set[type] = set()  # the cache classes whose decision points the hook table placed


def supported(cache: Any) -> bool:
    return any(isinstance(cache, c) for c in SUPPORTED)


def after_init(result: Any, cache: Any, *args: Any, **kwargs: Any) -> None:
    _settle(cache)
    return None


def around_attach(original: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
    """Runtime attach: SGLang validates the policy against its own three, so ours is applied here."""
    names = ("storage_backend", "storage_backend_extra_config_json", "served_model_name",
             "hicache_storage_prefetch_policy", "hicache_write_policy")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    wanted = bound.get("hicache_storage_prefetch_policy")
    if wanted == POLICY:
        bound["hicache_storage_prefetch_policy"] = None
    out = original(cache, **bound)
    ok = bool(out[0]) if isinstance(out, tuple) and out else bool(out)
    if ok and wanted == POLICY:
        view.set_stop_policy(cache, POLICY)
        log.info("hicache-gds: set hicache_storage_prefetch_policy to %s", POLICY)
    if ok:
        _settle(cache)
    return out


def around_admit(original: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
    """The cache's ``prefetch_from_storage``: prefetch all of the new tokens, a leading part of
    them (SGLang's own prefetch of a shorter key: it queries, reads and inserts only that part, and
    the request computes the rest), or none."""
    pol = policy_of(cache)
    if pol is None:
        return original(cache, *args, **kwargs)
    tokens = args[2] if len(args) > 2 else kwargs.get("new_input_tokens", ())
    if not pol.seeded and ranks.multi(cache):  # the first admission: on every rank at this step
        pol.seeded = True
        backend = model = None
        try:
            backend = view.backend_of(cache)
            model = pol.model(backend)
        except Exception:  # noqa: BLE001 -- this rank knows no rate; it still takes part
            pass
        said = ranks.seed(cache, model, getattr(backend, "read_device", None))
        log.info("hicache-gds policy: read rate seed agreed across ranks: %s", said or "no rank knows one")
    try:
        request = args[0] if args else kwargs.get("request", kwargs.get("req_id"))
        matched = kwargs.get("matched_prefix_tokens")
        take = pol.admit(cache, request, tokens, None if matched is None else len(matched))
    except Exception as exc:  # noqa: BLE001
        once("admit", "hicache-gds policy: admission failed (%s: %s); loading as SGLang would", type(exc).__name__,
              exc)
        take = len(tokens)
    mine = take
    take = agree_int(cache, int(take), "MIN")
    if ranks.multi(cache):
        if take <= 0:
            _agree_not_loaded(pol, cache, args, kwargs, tokens, mine > 0)
            return None
    elif take <= 0:
        if pol.split_plans:
            _start_tail(pol, cache, args, kwargs, tokens)
        return None
    if take < len(tokens):
        if len(args) > 2:
            args = (*args[:2], tokens[:take], *args[3:])
        else:
            kwargs["new_input_tokens"] = tokens[:take]
    return original(cache, *args, **kwargs)


def _agree_not_loaded(pol: Any, cache: Any, args: tuple, kwargs: dict, tokens: Any, would_load: bool) -> None:
    """Every rank agreed not to load the whole hit (a multi-rank server): split it where every
    rank chose to, at the head and forecast the ranks agree (`ranks.split_plan`), with a tail
    every rank started (`ranks.all_ok`); otherwise it is recomputed, and every rank records it
    so (late admission looks at the requests decided "compute": the same on every rank), or held
    for host room where every rank agrees (`room.agree`; `would_load`: this rank's own answer)."""
    request = args[0] if args else kwargs.get("request", kwargs.get("req_id"))
    rid = view.rid(request)
    hit = len(tokens) // view.page_size(cache) * view.page_size(cache)
    plan = pol.split_plans.pop(rid, None)
    d = pol.decided.get(rid)
    new, held = (d.new, d.held) if d is not None else (hit, 0)
    agreed = ranks.split_plan(cache, plan) if split_policy.may_split(cache) else None
    if agreed is not None:
        head, expect = agreed
        pol.split_plans[rid] = SplitPlan(head, expect, hit)
        pol.decided[rid] = Decided("split", new, held, head)
        ok = ranks.all_ok(cache, _start_tail(pol, cache, args, kwargs, tokens))
        if ok:
            log.info("hicache-gds policy: %s split agreed across ranks: compute %d, load the %d after (this rank "
                     "chose %s)", rid, head, hit - head, "a split at %d" % plan.head if plan is not None else "compute")
            return
        if rid in pol.tails:  # this rank started its tail, another did not: the request is recomputed
            try:
                split_policy.drop_tail(pol, cache, rid)
            except Exception as exc:  # noqa: BLE001 -- its reads run on; the request is recomputed regardless
                once("split-undo", "hicache-gds policy: a split tail not agreed was not cancelled (%s: %s)",
                     type(exc).__name__, exc)
                pol.tails.pop(rid, None)
        log.info("hicache-gds policy: %s split dropped: a rank could not start its tail; the request is recomputed",
                 rid)
    elif plan is not None:
        log.info("hicache-gds policy: %s split not agreed: another rank chose to load or recompute the hit; it is "
                 "recomputed", rid)
    pol.split_plans.pop(rid, None)
    pol.loads.pop(rid, None)
    if would_load:  # this rank logged "load": say what runs (each rank's own forecast, agreed by MIN)
        pol.counts["overruled"] += 1
        log.info("hicache-gds policy: %s not loaded: agreed across ranks (this rank chose to load, another rank's "
                 "forecast or host room did not)", rid)
    pol.decided[rid] = Decided("compute", new, held, hit)
    room.agree(pol, cache, view.backend_of(cache), rid, hit, would_load)


def _start_tail(pol: Any, cache: Any, args: tuple, kwargs: dict, tokens: Any) -> bool:
    """Admission chose a split (agreed by every rank where there are several): prefetch the tail
    of the hit (0.5.17's ``prefetch_from_storage(req_id, last_host_node, new_input_tokens,
    last_hash, prefix_keys)``). False where it did not start (the request is recomputed)."""
    names = ("req_id", "last_host_node", "new_input_tokens", "last_hash", "prefix_keys")
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    rid = view.rid(bound.get("req_id", ""))
    try:
        return bool(pol.start_tail(cache, rid, bound.get("last_host_node"), tokens, bound.get("last_hash"),
                                   bound.get("prefix_keys")))
    except Exception as exc:  # noqa: BLE001 -- the request is recomputed, as admission's fallback
        pol.split_plans.pop(rid, None)
        once("split-start", "hicache-gds policy: a split's tail load could not start (%s: %s); the request is "
              "recomputed", type(exc).__name__, exc)
        return False


def after_cache_unfinished(result: Any, cache: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """0.5.17's ``cache_unfinished_req`` (SGLang cached a chunked request's chunks, before its next
    chunk is formed): a split's tail read so far joins the request's prefix there
    (`LoadOrCompute.join_tail`)."""
    pol = view.attached(cache)
    if pol is None or not pol.tails:
        return None
    try:
        pol.join_tail(cache, req)
    except Exception as exc:  # noqa: BLE001 -- the request computes on; its tail is dropped
        _drop_tail_after(exc, "split-join", "a split's tail could not join its request", pol, cache, req)
    return None


def after_stash_chunked(result: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """0.5.23's ``Scheduler.stash_chunked_request`` (SGLang checkpointed a chunked request's
    chunks into the tree and set where its next chunk starts): the join point of a split there."""
    cache = view.tree_cache(scheduler)
    if cache is not None:
        after_cache_unfinished(None, cache, req)
    return None


def _drop_tail_after(exc: Exception, key: str, what: str, pol: Any, cache: Any, req: Any) -> None:
    """A split step failed: say so once, and drop the request's tail (it computes on)."""
    once(key, "hicache-gds policy: %s (%s: %s); it is computed instead", what, type(exc).__name__, exc)
    try:
        split_policy.drop_tail(pol, cache, view.rid(req))
    except Exception:  # noqa: BLE001
        pass


def around_add_chunked_req(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """0.5.17's ``PrefillAdder.add_chunked_req``: a split request whose tail is still being read
    is held this pass where waiting for it finishes first (returned as SGLang returns a parked
    chunk: still the chunked request, nothing added, and no other request added this pass:
    `view.hold_batch`); otherwise its tail joins and it runs on (`LoadOrCompute.park`)."""
    return hold_or_add(original, adder, req, view.can_hold_batch(adder), *args, **kwargs)


def hold_or_add(original: Any, adder: Any, req: Any, can_hold: bool, *args: Any, **kwargs: Any) -> Any:
    """The hold of `around_add_chunked_req` on any release: `can_hold` says whether this pass can
    be kept from adding any request (0.5.17: `view.can_hold_batch`; 0.5.23: `park_0523.holdable`)."""
    cache = getattr(adder, "tree_cache", None)
    pol = view.attached(cache) if cache is not None else None
    if pol is not None and pol.parked:
        try:
            if pol.park(cache, req, hold=can_hold):
                view.hold_batch(adder)
                return req
        except Exception as exc:  # noqa: BLE001 -- the request computes on; its tail is dropped
            _drop_tail_after(exc, "split-park", "a split request could not be held for its tail", pol, cache, req)
    if pol is not None and cut.CUT_HOOKED[0]:
        try:
            go = ride.can_ride(pol, cache, adder)
        except Exception as exc:  # noqa: BLE001 -- the chunk is SGLang's; finished loads wait for it
            once("ride", "hicache-gds policy: loaded requests cannot ride along a chunk (%s: %s)", type(exc).__name__,
                 exc)
            go = False
        if go:  # finished loads ride along its chunk, or it waits a decode step for their memory
            return ride.around_chunk(pol, cache, adder, req, can_hold,
                                     lambda: cut.capped(original, adder, req, *args, **kwargs))
    return cut.capped(original, adder, req, *args, **kwargs)  # its next chunk ends at its split head, if cut


def around_can_terminate(original: Any, cache: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
    pol = policy_of(cache)
    if pol is None:
        return original(cache, operation, *args, **kwargs)
    done = False
    try:
        done = view.loaded_done(cache, operation)
        stop = pol.stop(cache, operation)
    except Exception as exc:  # noqa: BLE001
        once("stop", "hicache-gds policy: stop decision failed (%s: %s); waiting for the load", type(exc).__name__,
              exc)
        stop = False
    if ranks.multi(cache):
        # A load finished on this rank is no vote to stop the others' (SGLang's wait_complete waits
        # for every rank): it ends when every rank read it, or when a rank's policy stops it or
        # SGLang ended it on one rank (then every rank keeps what all of them read)
        (all_done,), (any_stop,) = ranks.reduce(cache, [int(done)],
                                                [int((stop and not done) or view.is_terminated(operation))])
        stop = bool(any_stop or (all_done and not view.settles_by_ack(cache)))
    else:
        stop = agree(cache, stop or view.is_terminated(operation), "MAX")
    if stop:
        view.cancel_rest(cache, operation)  # the rest of its reads: skipped
    return stop


def around_check_progress(original: Any, cache: Any, req_id: Any, *args: Any, **kwargs: Any) -> Any:
    """0.5.17's ``HiRadixCache.check_prefetch_progress``: a load it finishes (inserts into the
    tree) has its host pages protected until the request leaves the waiting queue
    (`LoadOrCompute.protect`)."""
    pol = policy_of(cache)
    if pol is not None and pol.room_wait and _held(pol, cache, req_id):
        return False
    entry = view.loading_entry(cache, req_id) if pol is not None else None
    done = original(cache, req_id, *args, **kwargs)
    if entry is not None and done:
        _protect_settled(pol, cache, req_id, entry)
    return done


def around_check_progress_0523(original: Any, cache: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    """0.5.23's ``UnifiedRadixCache.check_prefetch_progress``: a request waiting for host room is
    not ready (`room`), as on 0.5.17."""
    pol = policy_of(cache)
    if pol is not None and pol.room_wait and _held(pol, cache, request):
        return False
    return original(cache, request, *args, **kwargs)


def _held(pol: Any, cache: Any, key: Any) -> bool:
    try:
        return room.holds(pol, cache, key)
    except Exception as exc:  # noqa: BLE001 -- not held: computed, as admission said
        once("room", "hicache-gds policy: a request waiting for host room released (%s: %s)", type(exc).__name__, exc)
        pol.room_wait.clear()
        return False


def around_prefetch_result(original: Any, cache: Any, operation: Any, *args: Any, **kwargs: Any) -> Any:
    """0.5.23's ``UnifiedRadixCache._handle_prefetch_result`` (a finished or stopped load inserted
    into the tree, from the acknowledgement drain or ``check_prefetch_progress``): its host pages
    are protected as on 0.5.17."""
    pol = policy_of(cache)
    handle = getattr(operation, "handle", None)
    if handle is not None and split_0523.is_tail(handle):
        split_0523.read_ended(operation)  # its pages join under its request's head (`split_0523`), not here
        return None
    entry = view.loading_entry(cache, handle) if pol is not None and handle is not None else None
    out = original(cache, operation, *args, **kwargs)
    if entry is not None:
        _protect_settled(pol, cache, handle, entry)
    return out


def _protect_settled(pol: Any, cache: Any, key: Any, entry: Any) -> None:
    if view.loading_entry(cache, key) is not None:
        return  # not settled (0.5.23 keeps a staged or retried load)
    try:
        pol.protect(cache, view.rid(key), entry)
    except Exception as exc:  # noqa: BLE001 -- unprotected pages are SGLang's behaviour
        once("protect", "hicache-gds policy: a finished load's host pages not protected (%s: %s)",
             type(exc).__name__, exc)


def after_new_prefill_batch(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """``Scheduler.get_new_batch_prefill``: requests it took from the waiting queue hold their
    loaded pages through their load back now; their host protection ends here. Then a waiting
    request sent to the GPU may be given to the disk (`LoadOrCompute.late_admit`)."""
    pol = view.attached(view.tree_cache(scheduler))
    if pol is None:
        return None
    if pol.protected:
        try:
            pol.release_protected(view.waiting(scheduler))
        except Exception as exc:  # noqa: BLE001
            once("release", "hicache-gds policy: host protection not released (%s: %s)", type(exc).__name__, exc)
    if pol.tails or pol.guards:
        try:
            pol.sweep_tails(scheduler)
        except Exception as exc:  # noqa: BLE001
            once("split-sweep", "hicache-gds policy: split tails not swept (%s: %s)", type(exc).__name__, exc)
    try:
        pol.late_admit(scheduler)
    except Exception as exc:  # noqa: BLE001 -- the request stays with the GPU, as admission decided
        once("late", "hicache-gds policy: late admission failed (%s: %s)", type(exc).__name__, exc)
    return None


def around_rate_limited(original: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
    pol = view.controller_policy(controller)
    cache = pol.cache() if pol is not None else None
    if cache is None or policy_of(cache) is None:
        return original(controller, *args, **kwargs)
    try:
        return pol.rate_limited(controller)
    except Exception as exc:  # noqa: BLE001
        once("rate", "hicache-gds policy: host-pool admission failed (%s); SGLang's limit applies", exc)
        return original(controller, *args, **kwargs)


def around_prefetch_kvcache(original: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """Scheduler._prefetch_kvcache: tells the policy which scheduler it serves and which request
    is being admitted (its tokens and what the cache already holds of them)."""
    pol = view.attached(view.tree_cache(scheduler))
    if pol is None:
        return original(scheduler, req, *args, **kwargs)
    pol.bind(scheduler)
    pol.current_req = req
    try:
        return original(scheduler, req, *args, **kwargs)
    finally:
        pol.current_req = None


def around_forward(original: Any, worker: Any, *args: Any, **kwargs: Any) -> Any:
    """TpModelWorker.forward_batch_generation: time prefill batches for every policy of the process."""
    pols = process_policies()
    batch = args[0] if args else kwargs.get("batch")
    if not pols or batch is None or not view.is_prefill(batch):
        return original(worker, *args, **kwargs)
    tokens = []
    for p in pols:
        try:
            tokens.append((p, p.clock.begin(batch)))
        except Exception as exc:  # noqa: BLE001
            once("forward", "hicache-gds policy: prefill not observed (%s)", exc)
    try:
        return original(worker, *args, **kwargs)
    finally:
        for p, tok in tokens:
            try:
                p.clock.end(tok)
            except Exception as exc:  # noqa: BLE001
                once("forward-end", "hicache-gds policy: prefill not observed (%s)", exc)
