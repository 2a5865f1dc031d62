"""`HiCacheGDSManager`: the scheduler-side index of stored chunks (lookup, pins, eviction, reset).

How the scheduler and the workers share the store
-------------------------------------------------
Every rank stores its own shard of a chunk, so the **workers own the stores**: each worker
process opens one PageStore per KV-cache group, in the namespace of its (engine identity, rank,
group). The engine identity holds the model, dtype, KV layout, block geometry and parallel
layout, not the data-parallel index nor the engine id: every engine of the same model and
layout on the node opens the same namespaces and shares their chunks (a namespace has any
number of writer processes; the core coordinates them). The manager keeps its own bookkeeping of
the chunks this engine stores, and consults the workers' shared indexes for the rest:

* a chunk is PENDING from `prepare_store` and becomes READY only in `complete_store`, which
  vLLM calls once *every* rank has reported the job; a rank whose write failed still reports
  the job (vLLM asserts success) but first appends the keys to its failure log (`sidecar.py`),
  and `complete_store` leaves those chunks un-committed;
* `lookup` answers from the shared indexes whenever the workers' namespaces can be seen (one
  lookups-and-leases store per (rank, group), `open_store(namespace_dir=...)`): a chunk
  is a HIT when every rank's namespace holds it -- whichever engine stored it -- and a READY
  chunk that some rank no longer holds (evicted by the store for another engine's chunks) is
  forgotten and a MISS. Before the workers have opened their stores it answers from its own map;
* `prepare_load` leases the chunk's slots in every rank's namespace (`Store.lease`) until
  `complete_load`: no process evicts a leased slot, so a chunk handed out for loading is never
  evicted by another engine meanwhile. (Between `lookup` and `prepare_load`, within one
  scheduler step, a chunk is not leased yet.) The manager's LRU and capacity bound what it
  stores; the stores evict by their own LRU, shared by every engine, and the manager deletes
  nothing (a chunk it evicts may be another engine's hit). `reset_cache` clears the shared
  namespaces -- for every engine sharing them.

* a load that fails on some rank is recomputed by vLLM (`connector.py`) and must not be tried
  again and again (vLLM reschedules the request and asks `lookup` again). Where pages failed (EIO,
  a checksum mismatch, a timeout, a page gone) that rank's worker logs them (failure log, before
  it reports the job) and drops them from its store; `complete_load` forgets them, so they are
  MISSes until stored again. Where the load failed as a whole -- the engine refused it, which
  says nothing about the pages and would happen again -- the worker logs a fault instead, and
  every present chunk is a MISS while that rank is *held*: `failed_load_backoff_s` (30 s),
  doubling with each fault in a row, after which loads are tried again; the first load of that
  rank that succeeds ends the hold. So a failed load costs its request one retry at most.

Load or recompute: `lookup` answers HIT for a present chunk only where loading the run of chunks
found beats recomputing it, given the disk's and the GPU's queues and the requests waiting behind
it (`on_new_request` counts them; `costmodel.for_the_queue`) (`costmodel.py`: the core's
`hicache_gds.costmodel.CostModel`, the SGLang policy's model). vLLM scans a request's chunks in
prefix order and stops at the first MISS, so a run must be known before it can be judged: the
first scan answers at once where it can (one chunk pays with both queues empty: HIT; not even
the whole request would pay: MISS), else RETRY for the present chunks (vLLM keeps scanning and
asks again next step), and the next scan answers from the run found -- HIT for all of it, or MISS
at its first chunk.

At start a background thread rebuilds READY chunks from the workers' durable indexes (read-only;
a chunk counts only if every rank holds it) and the manager answers RETRY for unknown keys until
that finishes.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Collection, Iterable

from vllm.v1.kv_offload.base import (LookupResult, OffloadingEvent, OffloadingManager, OffloadKey, PrepareStoreOutput,
                                     ReqContext, RequestOffloadingContext, ScheduleEndContext, get_offload_group_idx)

from hicache_gds import COST_STATE_FILE as STATE_FILE
from hicache_gds import ConfigError, load_state, save_state, seed_read_rate, seed_settings

from . import compat
from .costmodel import Advisor, CostModel, cost_model_from
from .sidecar import FAULT, LOAD_OK, FailureLog, read_store_keys
from .shared import HiCacheLoadSpec, HiCacheStoreSpec, SpecView, store_key
from .shared_index import SharedIndex

__all__ = ["HiCacheGDSManager", "ChunkState"]

log = logging.getLogger("hicache_gds_vllm")


class ChunkState(enum.Enum):
    PENDING = "pending"  # prepare_store done, not yet written by every rank
    READY = "ready"  # loadable


@dataclass
class _Entry:
    state: ChunkState
    group: int
    pins: int = 0
    leases: list = field(default_factory=list)  # per load in flight: [(Lease, position), ...] over the ranks


@dataclass
class _Hold:
    """A rank whose loads failed as a whole: how many in a row, and until when none is tried."""
    faults: int = 0
    until: float = 0.0


_MAX_BACKOFF_S = 600.0


def _positive(v: object, name: str) -> float:
    try:
        x = float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        x = float("nan")
    if not x > 0:
        raise ConfigError(f"{name}: expected a positive number of seconds, got {v!r}")
    return x


class HiCacheGDSManager(OffloadingManager):
    """Per-chunk state machine MISS -> PENDING -> READY -> (evicted) MISS, with LRU per group.

    Thread-safety: vLLM holds `lock` around every call. The warm-start thread touches no shared
    state: it hands its result over in one assignment, and the next manager call merges it.
    """

    def __init__(self, spec: SpecView, *, warm_start: bool = True) -> None:
        self.spec = spec
        self.capacity = spec.capacity_chunks  # per group
        self.world_size = spec.config.parallel.world_size
        self._lock = threading.Lock()
        self._entries: OrderedDict[OffloadKey, _Entry] = OrderedDict()  # least recently used first
        self._used: dict[int, int] = {}
        self._clear = False
        # After reset_cache, until the store job that clears the workers' namespaces has completed,
        # the shared indexes still show what the reset dropped: lookups use our own map meanwhile.
        self._clearing: set[OffloadKey] | None = None
        self._events: list[OffloadingEvent] | None = [] if spec.config.enable_kv_cache_events else None
        self._logs = [FailureLog(spec.sidecar.failure_log(spec.config.engine_id, r)) for r in range(self.world_size)]
        self._failed: set[str] = set()
        self.evictions = 0
        self.failed_chunks = 0
        self.vanished = 0  # READY chunks some rank's store no longer held (evicted there)
        self.adopted = 0  # chunks another engine (or an earlier run) stored, found in the shared indexes
        self.shared = SharedIndex(spec)
        self._warm: threading.Thread | None = None
        self._warm_result: tuple[dict[int, list[str]], bool] | None = None
        self._warm_cancelled = False
        # Load or recompute (costmodel.py): the model, and what it is asked with (chunk sizes over
        # every rank, the jobs in flight, the requests' prefill left, per-request scans).
        chunk_bytes = spec.config.worker_kv_bytes_per_block * spec.blocks_per_chunk * self.world_size
        chunk_tokens = {compat.group_id(g, i): g.tokens_per_block * spec.blocks_per_chunk
                        for i, g in enumerate(spec.config.groups)}
        per_token = chunk_bytes / max(1, min(chunk_tokens.values(), default=1))
        model = cost_model_from(spec.config.extra_config, per_token)
        self.advisor = Advisor(model, chunk_bytes, chunk_tokens, max(60.0, 4 * spec.hicache.io_timeout)) \
            if model is not None else None
        self._state_path = os.path.join(spec.sidecar.path, STATE_FILE)
        if model is not None:
            seeds, state = seed_settings(spec.config.extra_config), load_state(self._state_path) or {}
            seeded = model.seed_from_state(state, read=False, prefill="prefill_tokens_per_s" not in seeds)
            if "read_bytes_per_s" not in seeds:  # persisted, else probed now: the core's one way
                seeded.append(seed_read_rate(model.read, state=state, dirs=list(spec.hicache.gds_path),
                                             probe_bytes=spec.hicache.read_probe))
            if seeded:
                log.info("hicache-gds-vllm: load-or-recompute model seeded with %s", ", ".join(seeded))
        self.failed_loads = 0  # chunks whose load failed on some rank
        # Ranks whose loads failed as a whole (FAULT in their failure log), until a load succeeds.
        self.backoff_s = _positive(spec.config.extra_config.get("failed_load_backoff_s", 30.0),
                                   "failed_load_backoff_s")
        self._holds: dict[int, _Hold] = {}
        self.held_misses = 0  # present chunks answered MISS because a rank is held
        if warm_start:
            self._warm = threading.Thread(target=self._warm_start, name="hicache-gds-vllm-warm", daemon=True)
            self._warm.start()

    # -- OffloadingManager --------------------------------------------------------------------
    @property
    def lock(self) -> threading.Lock:
        # docstring inherited
        return self._lock

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # docstring inherited
        found = self._find(key)
        if found is LookupResult.HIT or found is LookupResult.HIT_PENDING:
            if self._holding():
                self.held_misses += 1
                return LookupResult.MISS  # a rank's loads fail as a whole: recompute meanwhile
            return self._judge(found, key, req_context)
        return found

    def _find(self, key: OffloadKey) -> LookupResult:
        """Where the chunk is: HIT (loadable), HIT_PENDING (being stored), MISS, or RETRY (not known yet)."""
        self._apply_warm()
        e = self._entries.get(key)
        if e is not None and (e.state is ChunkState.PENDING or e.pins):
            return LookupResult.HIT_PENDING if e.state is ChunkState.PENDING else LookupResult.HIT
        there = self._shared_has(key)
        if there is None:  # the workers' namespaces cannot be seen yet: our own map decides
            if e is None:
                return LookupResult.RETRY if self._warm is not None else LookupResult.MISS
            return LookupResult.HIT
        if there:
            if e is None:
                self._adopt(key)
            return LookupResult.HIT
        if e is not None:  # READY here, but a rank's store evicted it (for another engine's chunks)
            self._forget(key)
            self.vanished += 1
            self._event([key], removed=True)
        return LookupResult.RETRY if self._warm is not None else LookupResult.MISS

    def _judge(self, found: LookupResult, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """`found` (a present chunk) if loading the run it belongs to beats recomputing it; see the
        module docstring for the two-scan rule."""
        if self.advisor is None:
            return found
        answer = self.advisor.judge(ctx.req_id, get_offload_group_idx(key))
        if answer == "hit":
            return found
        if answer == "miss":
            return LookupResult.MISS  # recomputing is faster: the scan stops here
        return LookupResult.RETRY  # keep scanning: judged on the next step's scan, from the run found

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> HiCacheLoadSpec:
        # docstring inherited
        out = []
        keys = list(keys)
        if self.advisor is not None:
            self.advisor.loading(req_context.req_id)
        self._fly(keys, load=True)
        for k in keys:
            e = self._entries[k]
            if e.state is not ChunkState.READY:
                raise KeyError(f"chunk {store_key(k)} is {e.state.value}, not loadable")
            e.pins += 1
            self._entries.move_to_end(k)
            out.append(store_key(k))
        # Lease the chunks' slots on every rank until complete_load: no engine evicts them meanwhile.
        by_pos: dict[int, list[OffloadKey]] = {}
        for k in keys:
            pos = self.spec.group_pos.get(get_offload_group_idx(k))
            if pos is not None:
                by_pos.setdefault(pos, []).append(k)
        for pos, ks in by_pos.items():
            leases, missing = self.shared.lease([store_key(k) for k in ks], pos)
            for k, held in zip(ks, leases):
                self._entries[k].leases.append(held)
            if missing:
                log.error("hicache-gds-vllm: %d of %d chunks handed out for loading are no longer held by every "
                          "rank (evicted since lookup); their load will fail", missing, len(ks))
        return HiCacheLoadSpec(out)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # docstring inherited
        for k in keys:
            if k in self._entries:
                self._entries.move_to_end(k)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # docstring inherited
        self._land(keys)
        self._poll_failures()
        bad = []
        for k in keys:
            e = self._entries.get(k)
            if e is not None and e.pins > 0:
                e.pins -= 1
                if e.leases:
                    self.shared.release(e.leases.pop(0))
            sk = store_key(k)
            if sk in self._failed:  # a rank could not read it (and dropped it from its store)
                self._failed.discard(sk)
                bad.append(k)
        for k in bad:
            e = self._entries.get(k)
            if e is not None and e.state is ChunkState.READY and not e.pins:
                self._forget(k)
        if bad:
            self.failed_loads += len(bad)
            self._event(bad, removed=True)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        # docstring inherited
        self._apply_warm()
        offered = list(keys)
        new = []
        for k in dict.fromkeys(offered):
            if k in self._entries:
                continue
            if self._shared_has(k):  # another engine stored it: nothing to write
                self._adopt(k)
                continue
            new.append(k)
        protect = set(offered)
        evicted: list[OffloadKey] = []
        take: list[OffloadKey] = []
        for g in dict.fromkeys(get_offload_group_idx(k) for k in new):
            mine = [k for k in new if get_offload_group_idx(k) == g]
            room = self.capacity - self._used.get(g, 0)
            if room < len(mine):
                room += self._evict(g, len(mine) - room, protect, evicted)
            take.extend(mine[:max(0, room)])  # a prefix: the chunks later ones depend on
        if evicted:
            self._event(evicted, removed=True)
        if not take:
            # Nothing to write: keep queued drops for a job that will run. None = no room at all.
            return None if new else PrepareStoreOutput(keys_to_store=[], store_spec=HiCacheStoreSpec([]),
                                                       evicted_keys=evicted)
        for k in take:
            g = get_offload_group_idx(k)
            self._entries[k] = _Entry(ChunkState.PENDING, g)
            self._used[g] = self._used.get(g, 0) + 1
        order = {k: i for i, k in enumerate(offered)}
        take.sort(key=order.__getitem__)  # vLLM's group-then-chunk order
        self._fly(take, load=False)
        spec = HiCacheStoreSpec([store_key(k) for k in take], clear=self._clear)
        if self._clear:
            self._clearing = set(take)  # cleared before these are written: done when they complete
        self._clear = False
        return PrepareStoreOutput(keys_to_store=take, store_spec=spec, evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        # docstring inherited
        self._land(keys)
        self._poll_failures()
        if self._clearing is not None and self._clearing.intersection(keys):
            self._clearing = None  # every rank ran the job that cleared the namespaces first
        stored = []
        for k in keys:
            e = self._entries.get(k)
            if e is None or e.state is not ChunkState.PENDING:
                continue  # dropped by reset_cache meanwhile
            sk = store_key(k)
            if success and sk not in self._failed:
                e.state = ChunkState.READY
                self._entries.move_to_end(k)
                stored.append(k)
            else:
                # Not loadable: lookups need every rank's shard. The shards other ranks wrote stay
                # until their stores evict them (another engine may hold the same chunk whole).
                self._forget(k)
                self.failed_chunks += 1
            self._failed.discard(sk)
        if stored:
            self._event(stored, removed=False)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # docstring inherited
        if self.advisor is not None:  # it waits behind the requests before it (costmodel.for_the_queue)
            self.advisor.note_arrival(req_context.req_id)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        # docstring inherited
        if self.advisor is not None:
            self.advisor.forget(req_context.req_id)

    def take_events(self) -> Iterable[OffloadingEvent]:
        # docstring inherited
        if not self._events:
            return ()
        out, self._events = self._events, []
        return out

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # docstring inherited
        self._apply_warm()
        if self.advisor is not None:
            self.advisor.step += 1

    # -- what HiCacheGDSConnector tells the model (costmodel.py) --------------------------------
    def note_request(self, req_id: str, new: int, prefix: int) -> None:
        """vLLM looks `req_id` up: `new` tokens to compute after the `prefix` its GPU holds."""
        if self.advisor is not None:
            self.advisor.note_request(req_id, new, prefix)

    def note_scheduled(self, news: dict[str, int], prefixes: dict[str, int]) -> None:
        """A step computes `news[r]` tokens of each request `r` after its `prefixes[r]` (the GPU's
        queue goes down)."""
        if self.advisor is not None:
            for req_id, n in news.items():
                self.advisor.note_scheduled(req_id, n, prefixes.get(req_id, 0))

    def observe_step(self, news: list[int], prefixes: list[int], seconds: float) -> None:
        """A step computed `news[i]` tokens after `prefixes[i]` cached ones per request, in `seconds`
        (the prefill cost's samples; `HiCacheGDSConnector` times them)."""
        if self.advisor is not None:
            self.advisor.model.observe_prefill(news, prefixes, seconds)

    @property
    def cost(self) -> CostModel | None:
        """The load-or-recompute model, None when it is off."""
        return self.advisor.model if self.advisor is not None else None

    def has_pending_work(self) -> bool:
        # docstring inherited
        self._apply_warm()
        return self._warm is not None

    def reset_cache(self) -> None:
        # docstring inherited
        self._apply_warm()
        self._warm_cancelled = self._warm is not None  # a rebuild still running is obsolete now
        ready = [k for k, e in self._entries.items() if e.state is ChunkState.READY]
        if ready:
            self._event(ready, removed=True)
        for e in self._entries.values():
            for held in e.leases:
                self.shared.release(held)
        self._entries.clear()
        self._used.clear()
        if self.advisor is not None:
            self.advisor.reset()  # vLLM drops the jobs in flight at a reset: their completions never come
        self._clear = True  # the shared namespaces: every engine sharing them loses their chunks
        self._clearing = set()
        self._poll_failures()
        self._failed.clear()

    def shutdown(self) -> None:
        # docstring inherited
        self.wait_warm_start()
        if self.advisor is not None:  # the next engine of this identity starts from these estimates
            save_state(self._state_path, self.advisor.model.state())
        self.shared.close()  # returns the leases of loads still in flight

    def wait_warm_start(self, timeout: float = 30.0) -> None:
        """Block until the warm start (if any) has been merged. Call without holding `lock`."""
        t = self._warm
        if t is not None:
            t.join(timeout=timeout)
            with self._lock:
                self._apply_warm()

    # -- helpers -------------------------------------------------------------------------------
    def _evict(self, group: int, need: int, protect: set[OffloadKey], evicted: list[OffloadKey]) -> int:
        """Evict up to `need` READY, unpinned chunks of `group`, least recently used first."""
        victims = []
        for k, e in self._entries.items():
            if e.group == group and e.state is ChunkState.READY and e.pins == 0 and k not in protect:
                victims.append(k)
                if len(victims) == need:
                    break
        for k in victims:
            self._forget(k)  # the stores keep it until their own LRU evicts it: it may be another engine's hit
        evicted.extend(victims)
        self.evictions += len(victims)
        return len(victims)

    def _forget(self, k: OffloadKey) -> None:
        e = self._entries.pop(k)
        self._used[e.group] -= 1
        for held in e.leases:
            self.shared.release(held)

    def _shared_has(self, k: OffloadKey) -> bool | None:
        if self._clearing is not None:
            return None
        pos = self.spec.group_pos.get(get_offload_group_idx(k))
        return None if pos is None else self.shared.present(store_key(k), pos)

    def _adopt(self, k: OffloadKey) -> None:
        """Count a chunk the shared indexes hold (stored by another engine or an earlier run) as READY,
        making room in its group by our LRU if needed (nothing is deleted)."""
        g = get_offload_group_idx(k)
        if self._used.get(g, 0) >= self.capacity:
            gone: list[OffloadKey] = []
            self._evict(g, 1, {k}, gone)
            if gone:
                self._event(gone, removed=True)
        self._entries[k] = _Entry(ChunkState.READY, g)
        self._used[g] = self._used.get(g, 0) + 1
        self.adopted += 1
        self._event([k], removed=False)

    def _fly(self, keys: Collection[OffloadKey], load: bool) -> None:
        if keys and self.advisor is not None:
            self.advisor.fly(len(keys), frozenset(keys), load)

    def _land(self, keys: Collection[OffloadKey]) -> None:
        if self.advisor is not None:
            self.advisor.land(frozenset(keys))

    def _poll_failures(self) -> None:
        for rank, fl in enumerate(self._logs):
            for line in fl.poll():
                if not line.startswith("!"):
                    self._failed.add(line)
                elif line.startswith(FAULT):
                    h = self._holds.setdefault(rank, _Hold())
                    h.faults += 1
                    wait = min(self.backoff_s * 2 ** (h.faults - 1), max(self.backoff_s, _MAX_BACKOFF_S))
                    h.until = time.monotonic() + wait
                    log.warning("hicache-gds-vllm: rank %d's load failed as a whole (%s; %d in a row): its chunks "
                                "are recomputed for %.0f s, then a load is tried again", rank,
                                line[len(FAULT):].strip(), h.faults, wait)
                elif line == LOAD_OK and self._holds.pop(rank, None) is not None:
                    log.info("hicache-gds-vllm: rank %d loads again", rank)

    def _holding(self) -> bool:
        """Is some rank held (its last load failed as a whole, and its backoff has not run out)?"""
        if not self._holds:
            return False
        self._poll_failures()
        now = time.monotonic()
        return any(h.until > now for h in self._holds.values())

    def _event(self, keys: list[OffloadKey], removed: bool) -> None:
        if self._events is not None:
            self._events.append(OffloadingEvent(keys=list(keys), medium=compat.STORAGE_MEDIUM, removed=removed))

    def stats(self) -> dict[str, int]:
        """Chunk counts for logs and tests (call with `lock` held)."""
        self._apply_warm()
        adv = self.advisor
        ready = sum(e.state is ChunkState.READY for e in self._entries.values())
        return {"ready": ready, "pending": len(self._entries) - ready, "capacity_per_group": self.capacity,
                "pinned": sum(e.pins > 0 for e in self._entries.values()), "evictions": self.evictions,
                "failed_chunks": self.failed_chunks, "vanished": self.vanished, "adopted": self.adopted,
                "failed_loads": self.failed_loads, "cost_misses": adv.misses if adv else 0,
                "cost_deferrals": adv.deferrals if adv else 0, "inflight_bytes": adv.inflight_bytes if adv else 0,
                "held_ranks": len(self._holds), "held_misses": self.held_misses}

    # -- warm start ----------------------------------------------------------------------------
    def _warm_start(self) -> None:
        """Rebuild READY chunks from the workers' indexes: a chunk every rank holds is loadable.
        Chunks some ranks hold are left alone: another engine may be storing them right now."""
        ready: dict[int, list[str]] = {}
        try:
            for pos, g in enumerate(self.spec.config.groups):
                per_rank = []
                for r in range(self.world_size):
                    d = self.spec.sidecar.read_stores(r, self.spec.config.engine_id).get(pos)
                    per_rank.append(read_store_keys(d) if d else [])
                common = set(per_rank[0]).intersection(*per_rank[1:]) if per_rank else set()
                ready[compat.group_id(g, pos)] = [k for k in per_rank[0] if k in common][-self.capacity:]
        except Exception:  # noqa: BLE001 -- a warm start is an optimisation; never fail the engine
            log.exception("hicache-gds-vllm: warm start failed; starting cold")
            self._warm_result = ({}, True)
            return
        # Handed over by one assignment; the scheduler thread merges it inside its own lock region,
        # so this thread never competes for the lock with a busy step loop.
        self._warm_result = (ready, False)

    def _apply_warm(self) -> None:
        if self._warm_result is None:
            return
        ready, failed = self._warm_result
        self._warm_result = None
        self._warm = None
        if self._warm_cancelled or failed:
            return
        n = 0
        for gid, keys in ready.items():
            for sk in reversed(keys):  # oldest ends up first
                k = OffloadKey(bytes.fromhex(sk))
                if k in self._entries or self._used.get(gid, 0) >= self.capacity:
                    continue
                self._entries[k] = _Entry(ChunkState.READY, gid)
                self._entries.move_to_end(k, last=False)
                self._used[gid] = self._used.get(gid, 0) + 1
                n += 1
        if n:
            self._event([k for k, e in self._entries.items() if e.state is ChunkState.READY][:n], removed=False)
            log.info("hicache-gds-vllm: warm start found %d loadable chunks", n)
