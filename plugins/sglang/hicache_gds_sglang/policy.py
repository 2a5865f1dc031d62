"""``compute_or_load``: SGLang's L3 prefetch decided by cost, not by a fixed rule.

SGLang decides whether a request's L3 hit is loaded with a fixed policy (`best_effort` stops a
prefetch when the request is scheduled, `wait_complete` waits for all of it, `timeout` for a
length-based deadline) and admits prefetches only while they occupy under half the host pool.
None of them knows how fast the disk reads or the GPU prefills. This policy asks
`hicache_gds.costmodel.CostModel` (its docstring has the formula) at SGLang's own decision points:

* **admission** (the cache's ``prefetch_from_storage``): load the hit, or recompute it, whichever
  finishes the request first given the disk's queue of loads and the GPU's queue of prefills.
  A request alone so takes min(load, recompute); a burst splits between the disk and the GPU;
* **in flight** (0.5.17's ``can_terminate_prefetch``, 0.5.23's ``_can_terminate_prefetch``,
  asked each time the scheduler reaches a waiting request): stop the load and recompute the rest
  (keeping what was loaded) when the request could start on the GPU before its load ends and the
  load left takes longer than the compute the pages left would save; else wait;
* **late** (after ``Scheduler.get_new_batch_prefill``, both releases): a queued request sent
  to the GPU is given to the disk once its hit loads before the GPU would reach it -- the disk
  stays busy when loads run faster than forecast (`LoadOrCompute.late_admit`);
* **host pool** (``HiCacheController.prefetch_rate_limited``): prefetches may hold up to
  `PolicyConfig.host_fraction` of the host pool (SGLang: half), the rest staying for write-back;
  a load is admitted only where the host pool can keep it (`host.host_room`), and a finished load's
  host pages are protected from eviction until its request leaves the waiting queue (where SGLang
  inserts it: 0.5.17's ``check_prefetch_progress``, 0.5.23's ``_handle_prefetch_result``; released
  after ``Scheduler.get_new_batch_prefill``; `host.PROTECT_MAX_S`);
* **split** (`PolicyConfig.split`, 0.5.17): where computing the head of a hit while the
  disk loads its tail finishes first (`CostModel.split`), the request goes to the GPU as a
  recompute and the tail is prefetched on its own; when the request's chunks reach it, the pages
  read by then join its prefix (`split.join`, after ``cache_unfinished_req``) and its next chunk
  starts after them;
* **the log** says, per request: the decision and its estimates, when its load finished, and
  what it held when it left the waiting queue (a load whose pages were evicted before the GPU
  took the request shows there as "0 on host").

Measured in the running server: the store's read rate (`HiCacheGDS.read_rate`, from its gets);
the prefill cost, from the prefill batches the scheduler runs (``TpModelWorker.
forward_batch_generation``, timed with CUDA events on the forward stream, no synchronisation);
the GPU backlog, from the scheduler's waiting queue and chunked request (``Scheduler.
_prefetch_kvcache`` binds the scheduler); the disk backlog, from the prefetches in flight and the
backend's progress within a get. Decisions are agreed across TP/PP ranks (SGLang's own
``_all_reduce``), as SGLang's policies agree theirs: split, its hold and late admission too
(`ranks`: each rank votes from its own observations, at a step every rank reaches).

Where the parts live: this module holds the policy's state (named records, `records`) and its
decisions (admission, in flight, late); the settings are `policy_config`'s; prefill timing
`prefill`'s; the backlogs `backlog`'s; the host pool's accounting and protection `host`'s; the
split `split_policy`'s (and `split`'s, which moves its pages); everything read from or done to
SGLang's objects goes through the scheduler view (`view`). The functions hooked into SGLang are
in `policy_hooks`, and the hook table that places them is `plugin.HOOKS`. Selected by ``--hicache-storage-prefetch-policy compute_or_load`` (the plugin adds the choice and
makes it the default: with any backend other than ``gds`` it turns into SGLang's default,
``timeout``), by ``"policy": "compute_or_load"`` in the backend's extra config, or at runtime by
``PUT /hicache/storage-backend`` with that policy. SGLang's three policies stay available. Each
hook is fail-soft: an error inside one is logged once and answers as SGLang's would.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections import Counter
from dataclasses import replace
from typing import Any

from hicache_gds import CostModel, LoadPace, PrefillModel

from . import backlog, host, ranks, room, split_policy, view
from .policy_config import FALLBACK, POLICY, POLICY_KEYS, SGLANG_POLICIES, PolicyConfig  # noqa: F401
from .prefill import PrefillClock
from .records import Backlog, Decided, DiskSlot, LoadWatch, Protected, Queued, RoomWait, SplitPlan, Tail  # noqa: F401

__all__ = ["POLICY", "SGLANG_POLICIES", "FALLBACK", "POLICY_KEYS", "PolicyConfig", "LoadOrCompute", "policy_of",
           "process_policies", "admission_verdict"]

log = logging.getLogger("hicache_gds_sglang.policy")

SAVE_EVERY_S = 30.0
# A load in flight is looked at again only when its kept pages grew (a batch landed: the moment a
# stop keeps the most), or once it runs late against what admission forecast for its reads (the
# rates were wrong). Between those the admission's verdict stands: the scheduler asks thousands of
# times a second, and re-deciding on every small drift of the estimates turned near-ties into
# stops after most of a load was read (a load and a recompute, one after the other).
LATE_FACTOR = 1.25
LATE_SLACK_S = 0.1
REEVAL_S = 0.02  # at most this often per load, late or not
LATE_EVERY_S = 0.01  # `LoadOrCompute.late_admit` looks at the waiting queue at most this often


def policy_of(cache: Any) -> "LoadOrCompute | None":
    """The policy of `cache` when it is the one in force (selected, and the backend is ours)."""
    pol = view.attached(cache)
    if pol is None or view.stop_policy(cache) != POLICY:
        return None
    return pol if view.backend_of(cache) is not None else None


def admission_verdict(dec: Any, room: int | None, hit: int, full: tuple[int, int] | None = None) -> Any:
    """The cost model's admission decision `dec`, vetoed where the host pool cannot keep the hit
    (pure): SGLang would shorten or revoke such a load once the hit is known, so the disk would
    read what the host pool cannot keep and the request be recomputed after waiting for it; or
    where prefetches already hold their share of it (`full`: `host.share_full`), as SGLang would
    then not start the load at all."""
    if dec.load and room is not None and hit > room:
        return replace(dec, action="compute", reason=f"the host pool has room for {max(0, room)} tokens",
                       tokens=None)
    if dec.load and full is not None:
        return replace(dec, action="compute", tokens=None,
                       reason=f"prefetches hold {full[0]} tokens, their share of the host pool is {full[1]}")
    return dec


class LoadOrCompute:
    """The policy state of one radix cache (one per scheduler process): the prefill model (kept
    across backend re-attaches), the scheduler it serves, the decisions taken and why."""

    def __init__(self, cache: Any) -> None:
        self._cache = weakref.ref(cache)
        self.clock = PrefillClock(PrefillModel(chunk=None))
        self.pace = LoadPace()  # kept across backend re-attaches, as the prefill model is
        self.cost_model: CostModel | None = None
        self._model_backend: Any = None
        self._scheduler: Any = None
        self.current_req: Any = None
        self.decided: dict[str, Decided] = {}
        self.loads: dict[str, LoadWatch] = {}
        self.queued: dict[str, Queued] = {}  # decided requests seen in the waiting queue
        self.protected: dict[str, Protected] = {}
        self.room_wait: dict[str, RoomWait] = {}  # loads turned down for host room, held for it (`room`)
        self.late: set[str] = set()  # rids `late_admit` gave the disk
        self.split_plans: dict[str, SplitPlan] = {}  # until the tail starts
        self.tails: dict[str, Tail] = {}
        self.parked: dict[str, float] = {}  # split requests held for their tails: until when (`split_policy.park`)
        self.ride_yields: dict[str, int] = {}  # passes held for a finished load's GPU memory, by rid (`ride`)
        self.park_checked: dict[str, float] = {}  # and when each was last looked at
        self.guards: list = []  # heads of joined tails locked until backed up (`split.HeadGuard`)
        self.backlog: Backlog | None = None
        self.late_look = 0.0
        self.seeded = False  # the ranks agreed the read rate's seed (`ranks.seed`, a multi-rank server)
        self.counts: Counter[str] = Counter()
        self.last: dict[str, Any] = {}
        self._last_save = time.monotonic()
        _register_process_policy(self)

    # -- wiring ----------------------------------------------------------------------------------
    @property
    def prefill(self) -> PrefillModel:
        return self.clock.model

    @prefill.setter
    def prefill(self, model: PrefillModel) -> None:
        self.clock.model = model

    def cache(self) -> Any:
        return self._cache()

    def bind(self, scheduler: Any) -> None:
        if self._scheduler is None or self._scheduler() is not scheduler:
            self._scheduler = weakref.ref(scheduler)
            chunk = view.chunk_size(scheduler)
            if chunk:
                self.prefill.chunk = chunk

    def scheduler(self) -> Any:
        return None if self._scheduler is None else self._scheduler()

    def model(self, backend: Any) -> CostModel | None:
        """The cost model over `backend`'s read rate (rebuilt when the backend changes)."""
        if backend is None:
            return None
        if self.cost_model is None or self._model_backend is not backend:
            bpt = backend.kv_bytes_per_token()
            if not bpt:
                return None
            cfg = backend.policy_config
            self.cost_model = CostModel(bpt, read=backend.read_rate, prefill=self.prefill, pace=self.pace,
                                        stop_margin=cfg.stop_margin)
            self._model_backend = backend
            self._seed(backend)
        return self.cost_model

    def _seed(self, backend: Any) -> None:
        """Seed the prefill model before it has measured anything: configured, else persisted."""
        cfg = backend.policy_config
        coef, _ = self.prefill.coefficients()
        if self.prefill.batches:
            return
        if cfg.prefill_tokens_per_s:
            self.prefill.seed_rate(cfg.prefill_tokens_per_s, "configured (policy_prefill_tokens_per_s)")
        elif coef is None:
            st = backend.cost_state()
            if st and self.cost_model is not None:
                seeded = self.cost_model.seed_from_state(st, read=False)
                if seeded:
                    log.info("hicache-gds policy: seeded %s", ", ".join(seeded))

    def maybe_save(self, backend: Any) -> None:
        now = time.monotonic()
        if self.cost_model is None or now - self._last_save < SAVE_EVERY_S:
            return
        self._last_save = now
        backend.save_cost_state(self.cost_model.state())

    # -- what the other parts measure ------------------------------------------------------------
    def poll(self) -> None:
        self.clock.poll()

    def gpu_backlog(self, cache: Any, model: CostModel) -> tuple[dict[str, float], float]:
        return backlog.gpu_backlog(self, cache, model)

    def disk_backlog(self, cache: Any, model: CostModel, backend: Any) -> tuple[dict[str, DiskSlot], float]:
        return backlog.disk_backlog(cache, model, backend)

    # -- decisions ---------------------------------------------------------------------------------
    def admit(self, cache: Any, request: Any, new_input_tokens: Any, held_hint: int | None) -> int:
        """Admission: how many of `new_input_tokens` to prefetch (load): all of them, or 0 to
        recompute (or split, `start_tail`)."""
        every = len(new_input_tokens)
        backend = view.backend_of(cache)
        model = self.model(backend)
        if model is None:
            return every
        self.poll()
        ps = view.page_size(cache)
        hit = every // ps * ps
        if hit < view.threshold(cache):
            return every  # SGLang declines it anyway
        rid = view.rid(request)
        req = self.current_req if self.current_req is not None and view.rid(self.current_req) == rid else None
        if req is not None:
            new, held = view.req_work(req)
            new = max(new, hit)
        else:
            new, held = hit, int(held_hint or 0)
        ahead, g = self.gpu_backlog(cache, model)
        g = ahead.get(rid, g)  # a late admission (`late_admit`) is already queued: only what is ahead of it
        _, d = self.disk_backlog(cache, model, backend)
        weigh = req is not None and rid not in self.tails and (backend.policy_config.split == "always" or d <= 0)
        dec = model.decide(new, held, hit, gpu_backlog=g, disk_backlog=d, page=ps,
                           **split_policy.split_args(self, cache, backend, model, weigh))
        if dec.action == "split":
            self.room_wait.pop(rid, None)  # a held request prefetched (`room.take`) may split: no longer held
            self.decided[rid] = Decided("split", new, held, int(dec.tokens or 0))
            self.split_plans[rid] = SplitPlan(int(dec.tokens or 0), int(dec.tail or 0), hit)
            self.counts["split"] += 1
            self.last = {"rid": rid, "action": "split", "t_load": dec.t_load, "t_compute": dec.t_compute, "new": new,
                         "held": held, "hit": hit, "head": dec.tokens, "tail": dec.tail, "gpu_backlog": g,
                         "disk_backlog": d, "reason": dec.reason, "host_free": view.host_free(cache)}
            log.info("hicache-gds policy: %s split: compute %d, load the %d after (%d new, %d held, %d in L3; split "
                     "%.3f s, compute %.3f s; GPU backlog %.3f s, disk backlog %.3f s; read %.2f GB/s, prefill %.0f tok/s "
                     "at 8k; %s)", rid, dec.tokens, hit - int(dec.tokens or 0), new, held, hit, dec.t_load,
                     dec.t_compute, g, d, (model.read.rate or 0) / 1e9, model.prefill.tokens_per_s(8192) or 0,
                     dec.reason)
            self.maybe_save(backend)
            return 0
        take = hit
        verdict = admission_verdict(dec, host.host_room(cache), take,
                                    host.share_full(cache, backend.policy_config.host_fraction))
        room.after_admission(self, cache, backend, rid, dec, verdict, take, g)
        dec = verdict
        self.decided[rid] = Decided(dec.action, new, held, take)
        if dec.load:
            io = model.predict_load(take * model.bytes_per_token, d)
            self.loads[rid] = LoadWatch(time.monotonic(), math.inf if io is None else io, 0.0, 0.0, model.pace.factor)
        self.counts[dec.action] += 1
        host_free = view.host_free(cache)
        self.last = {"rid": rid, "action": dec.action, "t_load": dec.t_load,
                     "t_compute": dec.t_compute, "new": new, "held": held, "hit": hit, "load": take if dec.load else 0,
                     "gpu_backlog": g, "disk_backlog": d, "reason": dec.reason, "host_free": host_free}
        # One line per admitted request (INFO): what was decided and on which estimates, so a
        # server's log says why each prefix was loaded or recomputed (and, with the host pool's
        # free tokens, whether a load could get the host memory it is read into).
        log.info("hicache-gds policy: %s %s (%d new, %d held, %d in L3; load %.3f s, compute %.3f s; GPU backlog "
                 "%.3f s, disk backlog %.3f s; read %.2f GB/s, prefill %.0f tok/s at 8k; host pool %s tokens free; %s)",
                 rid, dec.action, new, held, hit, dec.t_load, dec.t_compute, g, d,
                 (model.read.rate or 0) / 1e9, model.prefill.tokens_per_s(8192) or 0,
                 "?" if host_free is None else host_free, dec.reason)
        self.maybe_save(backend)
        return every if dec.load else 0

    def stop(self, cache: Any, operation: Any) -> bool:
        """In flight: True to stop the load now (and recompute what it has not loaded)."""
        backend = view.backend_of(cache)
        model = self.model(backend)
        rid = view.op_rid(operation)
        if view.loaded_done(cache, operation):
            w = self.loads.pop(rid, None)  # once: 0.5.23 asks again until the load is acknowledged
            if w is not None:
                now = time.monotonic()
                end = view.load_ended(backend, operation)  # when its last get returned, if known
                end = now if end is None or not w.since <= end <= now else end
                took = end - w.since
                self.pace.observe(w.io_s, took, w.pace)
                host_free = view.host_free(cache)
                log.info("hicache-gds policy: %s load done: %d tokens in %.3f s (forecast %.3f s; pace now %.2f; seen "
                         "%.3f s later); host pool %s tokens free", rid, view.kept(operation), took, w.io_s,
                         self.pace.factor, now - end, "?" if host_free is None else host_free)
            # 0.5.23 settles a finished load through its acknowledgements (as for wait_complete);
            # 0.5.17 finishes it here, and its pages are then protected (`protect`).
            return not view.settles_by_ack(cache)
        if view.is_terminated(operation):
            # SGLang ended it (a get returned fewer pages than asked, an abort): it keeps what it read
            w = self.loads.pop(rid, None)
            if w is not None:
                self.counts["short"] += 1
                log.info("hicache-gds policy: %s load ended by SGLang after %d of %d tokens in %.3f s (a short read or "
                         "an abort); the rest is recomputed", rid, view.kept(operation),
                         view.op_tokens(cache, operation), time.monotonic() - w.since)
            return True
        if model is None:
            return False
        w = self.loads.get(rid)
        now = time.monotonic()
        if w is not None:
            # SGLang asks every scheduler pass, and its scheduler spins while the GPU idles; a
            # check walks every load in flight in the interpreter the reading threads share. One
            # per pass was what this policy added to a load alone, whose gets read at 0.8-0.95x
            # wait_complete's in the same run (GPU machine, RAM-backed device)
            if now - w.last_check < REEVAL_S:
                return False
            w.last_check = now
        self.poll()
        disk, _ = self.disk_backlog(cache, model, backend)
        if rid not in disk:
            return False
        t_disk, hit, kept, fetched = disk[rid]  # a DiskSlot
        if not self._look_again(rid, kept):
            return False
        ahead, _ = self.gpu_backlog(cache, model)
        d = self.decided.get(rid)
        new, held = (d.new, d.held) if d is not None else (hit, 0)
        dec = model.decide(max(new, hit), held, hit, kept=kept, fetched=fetched, in_flight=True,
                           gpu_backlog=ahead.get(rid, 0.0), disk_backlog=t_disk - (model.predict_load(
                               max(0, hit - fetched) * model.bytes_per_token) or 0.0))
        if dec.action == "stop":
            self.counts["stop"] += 1
            self.decided[rid] = Decided("compute", max(new, hit) - kept, held + kept, 0)
            self.last = {"rid": rid, "action": "stop", "t_load": dec.t_load, "t_compute": dec.t_compute,
                         "kept": kept, "fetched": fetched, "hit": hit, "reason": dec.reason}
            self.loads.pop(rid, None)
            log.info("hicache-gds policy: %s stop after %d of %d tokens (load left %.3f s, compute %.3f s; %s)", rid,
                     kept, hit, dec.t_load, dec.t_compute, dec.reason)
        return dec.action == "stop"

    def late_admit(self, scheduler: Any) -> str | None:
        """Give the disk a queued request admission sent to the GPU, once the disk can read its hit
        before the GPU would reach it (returns its rid, or None).

        Admission splits a burst between the disk and the GPU on forecasts; when the loads run
        faster than forecast, the disk falls idle while requests it could have served wait for the
        GPU (a 32B burst on the GPU machine loaded 3 of 8 prefixes in a rep whose read rate the
        pace overestimated). Here, after each prefill batch is formed, the first waiting request
        decided "compute" whose hit loads, behind the disk's queue, with `stop_margin` to spare
        before the GPU work ahead of it ends, is prefetched through SGLang's own path
        (``Scheduler._prefetch_kvcache``: it matches the request again and asks admission, which
        decides with the request's place in the queue). Loading it then costs the request nothing
        and takes its hit off the GPU's queue for every request behind it; a load that runs late
        is stopped as any other. One request per pass, each at most once, at most every
        `LATE_EVERY_S` (one rank alone; with peers, at every batch that leaves such a request
        waiting: the ranks' clocks differ). On a multi-rank server the candidates are the same on
        every rank (the waiting queue and the agreed decisions), each rank votes on each from its
        own rates, and the first request every rank votes for is given to the disk on every rank
        (`ranks.first_all`), at the same step."""
        cache = view.tree_cache(scheduler)
        now = time.monotonic()
        if cache is None or policy_of(cache) is None:
            return None
        multi = ranks.multi(cache)
        if not multi and now - self.late_look < LATE_EVERY_S:
            return None
        self.late_look = now
        if not any(d.action == "compute" for d in self.decided.values()):
            return None
        backend = view.backend_of(cache)
        model = self.model(backend)
        if model is None:
            return None
        if self.room_wait:  # the same on every rank (`room.agree`)
            got = room.take(self, cache, scheduler)
            if got is not None:
                return got  # a held request got host room (`room`): one prefetch per pass
        if multi:  # forget the requests that left the queue now, at this step on every rank (not by a timer)
            self.backlog = None
            self.gpu_backlog(cache, model)
        loading = view.loading_rids(cache)
        threshold = view.threshold(cache)
        cands = []
        for req in view.waiting(scheduler):
            rid = view.rid(req)
            dec = self.decided.get(rid)
            if dec is None or dec.action != "compute" or rid in self.late or rid in loading or rid in self.room_wait:
                continue
            if dec.hit >= max(threshold, 1):
                cands.append((req, rid, dec.hit))
        if not cands:
            return None
        ahead, _ = self.gpu_backlog(cache, model)
        _, d = self.disk_backlog(cache, model, backend)
        votes = []
        for req, rid, hit in cands:
            t_io = model.predict_load(hit * model.bytes_per_token, d)
            g = ahead.get(rid, 0.0)
            ok = t_io is not None and t_io * (1.0 + model.stop_margin) < g
            votes.append((t_io, g, ok))
            if ok and not multi:
                break
        pick = ranks.first_all(cache, [rid for _, rid, _ in cands], [v[2] for v in votes]) if multi else \
            next((i for i, v in enumerate(votes) if v[2]), None)
        if pick is not None:
            req, rid, hit = cands[pick]
            t_io, g, _ = votes[pick]
            self.late.add(rid)
            self.counts["late"] += 1
            log.info("hicache-gds policy: %s late load: its %d tokens in L3 load in %.3f s (disk backlog %.3f s), the "
                     "GPU reaches it in %.3f s", rid, hit, t_io, d, g)
            view.prefetch_again(scheduler, req)
            return rid
        return None

    def _look_again(self, rid: str, kept: int) -> bool:
        """Whether the load of `rid` is re-decided now (see `LATE_FACTOR`): its kept pages grew
        since the last look, or it runs late against admission's forecast; never more often than
        `REEVAL_S`. A load admitted before this policy ran is looked at every `REEVAL_S`."""
        now = time.monotonic()
        w = self.loads.get(rid)
        if w is None:
            w = self.loads[rid] = LoadWatch(now)  # forecast unknown: always "late"
        if now - w.last_look < REEVAL_S:
            return False
        late = now - w.since > w.io_s * LATE_FACTOR + LATE_SLACK_S
        if kept <= w.seen and not late:
            return False
        w.seen, w.last_look = float(kept), now
        return True

    # -- host pool and split (`host`, `split_policy`) --------------------------------------------
    def protect(self, cache: Any, rid: str, entry: Any) -> None:
        host.protect(self, cache, rid, entry)

    def release_protected(self, waiting: Any) -> None:
        host.release_protected(self, waiting)

    def rate_limited(self, controller: Any) -> bool:
        cfg = getattr(self._model_backend, "policy_config", None) or PolicyConfig()
        return host.rate_limited(controller, cfg.host_fraction)

    def start_tail(self, cache: Any, rid: str, last_host_node: Any, tokens: Any, last_hash: Any,
                   prefix_keys: Any) -> bool:
        return split_policy.start_tail(self, cache, rid, last_host_node, tokens, last_hash, prefix_keys)

    def join_tail(self, cache: Any, req: Any) -> int:
        return split_policy.join_tail(self, cache, req)

    def park(self, cache: Any, req: Any, *, hold: bool = True) -> bool:
        return split_policy.park(self, cache, req, hold=hold)

    def sweep_tails(self, scheduler: Any) -> None:
        split_policy.sweep_tails(self, scheduler)

    def serves(self, backend: Any) -> bool:
        cache = self._cache()
        return cache is not None and view.backend_of(cache) is backend

    def stats(self) -> dict[str, Any]:
        cache = self._cache()
        backend = view.backend_of(cache) if cache is not None else None
        model = self.model(backend) if backend is not None else None
        out: dict[str, Any] = {"policy": POLICY, "active": cache is not None and policy_of(cache) is not None,
                               "decisions": dict(self.counts), "last": dict(self.last)}
        if model is not None:
            out.update(model.estimates())
        else:
            out.update(self.prefill.snapshot())
        out["prefill_gaps"] = self.clock.gaps()
        return out


_PROCESS: list[weakref.ref] = []


def _register_process_policy(p: LoadOrCompute) -> None:
    _PROCESS[:] = [r for r in _PROCESS if r() is not None] + [weakref.ref(p)]


def process_policies() -> list[LoadOrCompute]:
    return [p for p in (r() for r in _PROCESS) if p is not None]
