"""`HiCacheGDSManager`: the scheduler-side index of stored chunks (lookup, pins, eviction, reset).

How the scheduler and the workers share the store
-------------------------------------------------
A hicache-gds `PageStore` takes an exclusive lock on its namespace (one writer process), and
every rank stores its own shard of a chunk. So the **workers own the stores**: each worker
process opens one PageStore per KV-cache group, in a namespace of its own (engine identity +
rank + group). The **manager never opens a store**; it keeps its own in-memory bookkeeping of
chunks, and is the only authority on what is loadable:

* a chunk is PENDING from `prepare_store` and becomes READY only in `complete_store`, which
  vLLM calls once *every* rank has reported the job;
* a rank whose write failed still reports the job (vLLM asserts success), but first appends the
  keys to its failure log (`sidecar.py`); `complete_store` reads the logs and leaves those chunks
  un-committed, and any rank's copy of them is deleted;
* the manager sizes the cache in chunks, the same number every worker's store is sized to, and
  evicts by its own LRU; evicted and failed keys (and a `clear` after `reset_cache`) travel to
  the workers on the next store job, which applies them before writing. The workers' stores
  therefore never have to evict on their own, and never drop a chunk the manager calls READY;
* loads are pinned from `prepare_load` to `complete_load`, so eviction never races a read.

Nothing is persisted by the manager: at start it rebuilds READY chunks from the workers' own
durable indexes (read-only, on a background thread; a chunk counts only if every rank holds it)
and answers RETRY for unknown keys until that finishes. Stale pages it finds (held by some ranks
only) are dropped through the same piggy-backed path.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Collection, Iterable

from vllm.v1.kv_offload.base import (LookupResult, Medium, OffloadingEvent, OffloadingManager, OffloadKey,
                                     PrepareStoreOutput, ReqContext, RequestOffloadingContext, ScheduleEndContext,
                                     get_offload_group_idx)

from .sidecar import FailureLog, read_store_keys
from .shared import HiCacheLoadSpec, HiCacheStoreSpec, SpecView, store_key

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
        self._drops: list[str] = []
        self._clear = False
        self._events: list[OffloadingEvent] | None = [] if spec.config.enable_kv_cache_events else None
        self._logs = [FailureLog(spec.sidecar.failure_log(spec.config.engine_id, r)) for r in range(self.world_size)]
        self._failed: set[str] = set()
        self.evictions = 0
        self.failed_chunks = 0
        self._warm: threading.Thread | None = None
        self._warm_result: tuple[dict[int, list[str]], set[str], bool] | None = None
        self._warm_cancelled = False
        if warm_start:
            self._warm = threading.Thread(target=self._warm_start, name="hicache-gds-vllm-warm", daemon=True)
            self._warm.start()
        else:
            self._clear = True  # workers may hold pages this manager does not know of

    # -- OffloadingManager --------------------------------------------------------------------
    @property
    def lock(self) -> threading.Lock:
        # docstring inherited
        return self._lock

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # docstring inherited
        self._apply_warm()
        e = self._entries.get(key)
        if e is None:
            return LookupResult.RETRY if self._warm is not None else LookupResult.MISS
        return LookupResult.HIT if e.state is ChunkState.READY else LookupResult.HIT_PENDING

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> HiCacheLoadSpec:
        # docstring inherited
        out = []
        for k in keys:
            e = self._entries[k]
            if e.state is not ChunkState.READY:
                raise KeyError(f"chunk {store_key(k)} is {e.state.value}, not loadable")
            e.pins += 1
            self._entries.move_to_end(k)
            out.append(store_key(k))
        return HiCacheLoadSpec(out)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # docstring inherited
        for k in keys:
            if k in self._entries:
                self._entries.move_to_end(k)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # docstring inherited
        for k in keys:
            e = self._entries.get(k)
            if e is not None and e.pins > 0:
                e.pins -= 1

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        # docstring inherited
        self._apply_warm()
        offered = list(keys)
        new = [k for k in dict.fromkeys(offered) if k not in self._entries]
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
        spec = HiCacheStoreSpec([store_key(k) for k in take], self._drops, self._clear)
        self._drops, self._clear = [], False
        return PrepareStoreOutput(keys_to_store=take, store_spec=spec, evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        # docstring inherited
        self._poll_failures()
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
                self._forget(k)
                self._drops.append(sk)  # other ranks may hold their shard of it
                self.failed_chunks += 1
            self._failed.discard(sk)
        if stored:
            self._event(stored, removed=False)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # docstring inherited
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        # docstring inherited
        if not self._events:
            return ()
        out, self._events = self._events, []
        return out

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # docstring inherited
        self._apply_warm()

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
        self._entries.clear()
        self._used.clear()
        self._drops = []
        self._clear = True
        self._poll_failures()
        self._failed.clear()

    def shutdown(self) -> None:
        # docstring inherited
        self.wait_warm_start()

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
            self._forget(k)
            self._drops.append(store_key(k))
        evicted.extend(victims)
        self.evictions += len(victims)
        return len(victims)

    def _forget(self, k: OffloadKey) -> None:
        e = self._entries.pop(k)
        self._used[e.group] -= 1

    def _poll_failures(self) -> None:
        for fl in self._logs:
            self._failed.update(fl.poll())

    def _event(self, keys: list[OffloadKey], removed: bool) -> None:
        if self._events is not None:
            self._events.append(OffloadingEvent(keys=list(keys), medium=Medium.STORAGE, removed=removed))

    def stats(self) -> dict[str, int]:
        """Chunk counts for logs and tests (call with `lock` held)."""
        self._apply_warm()
        ready = sum(e.state is ChunkState.READY for e in self._entries.values())
        return {"ready": ready, "pending": len(self._entries) - ready, "capacity_per_group": self.capacity,
                "pinned": sum(e.pins > 0 for e in self._entries.values()), "evictions": self.evictions,
                "failed_chunks": self.failed_chunks, "queued_drops": len(self._drops)}

    # -- warm start ----------------------------------------------------------------------------
    def _warm_start(self) -> None:
        """Rebuild READY chunks from the workers' indexes: a chunk every rank holds is loadable."""
        ready: dict[int, list[str]] = {}
        stale: set[str] = set()
        try:
            for pos, g in enumerate(self.spec.config.groups):
                per_rank = []
                for r in range(self.world_size):
                    d = self.spec.sidecar.read_stores(r).get(pos)
                    per_rank.append(read_store_keys(d) if d else [])
                common = set(per_rank[0]).intersection(*per_rank[1:]) if per_rank else set()
                ready[g.group_id] = [k for k in per_rank[0] if k in common][-self.capacity:]
                keep = set(ready[g.group_id])
                stale.update(k for keys in per_rank for k in keys if k not in keep)
        except Exception:  # noqa: BLE001 -- a warm start is an optimisation; never fail the engine
            log.exception("hicache-gds-vllm: warm start failed; starting cold")
            self._warm_result = ({}, set(), True)
            return
        # Handed over by one assignment; the scheduler thread merges it inside its own lock region,
        # so this thread never competes for the lock with a busy step loop.
        self._warm_result = (ready, stale, False)

    def _apply_warm(self) -> None:
        if self._warm_result is None:
            return
        ready, stale, failed = self._warm_result
        self._warm_result = None
        self._warm = None
        if self._warm_cancelled:
            return
        if failed:
            self._clear = True
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
        # A stale key stored again since start is live now: never drop it.
        self._drops.extend(sk for sk in sorted(stale) if OffloadKey(bytes.fromhex(sk)) not in self._entries)
        if n:
            self._event([k for k, e in self._entries.items() if e.state is ChunkState.READY][:n], removed=False)
        if n or stale:
            log.info("hicache-gds-vllm: warm start found %d loadable chunks and %d stale pages", n, len(stale))
