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
* **late** (0.5.17, after ``Scheduler.get_new_batch_prefill``, one rank): a queued request sent
  to the GPU is given to the disk once its hit loads before the GPU would reach it -- the disk
  stays busy when loads run faster than forecast (`LoadOrCompute.late_admit`);
* **host pool** (``HiCacheController.prefetch_rate_limited``): prefetches may hold up to
  `PolicyConfig.host_fraction` of the host pool (SGLang: half), the rest staying for write-back;
  a load is admitted only where the host pool can keep it (`_host_room`), and a finished load's
  host pages are protected from eviction until its request leaves the waiting queue (0.5.17's
  ``check_prefetch_progress``, released after ``Scheduler.get_new_batch_prefill``;
  `_PROTECT_MAX_S`);
* **split** (`PolicyConfig.split`, 0.5.17, one rank): where computing the head of a hit while the
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
``_all_reduce``), as SGLang's policies agree theirs.

The functions hooked into SGLang are in `policy_hooks`; this module is the policy's state and
decisions. Selected by ``--hicache-storage-prefetch-policy compute_or_load`` (the plugin adds the choice and
makes it the default: with any backend other than ``gds`` it turns into SGLang's default,
``timeout``), by ``"policy": "compute_or_load"`` in the backend's extra config, or at runtime by
``PUT /hicache/storage-backend`` with that policy. SGLang's three policies stay available. Each
hook is fail-soft: an error inside one is logged once and answers as SGLang's would.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import Any, Mapping, NamedTuple

from hicache_gds import ConfigError, CostModel, LoadPace, PrefillModel, parse_size

from . import split as split_mod

__all__ = ["POLICY", "SGLANG_POLICIES", "POLICY_KEYS", "PolicyConfig", "LoadOrCompute", "policy_of", "process_policies"]

log = logging.getLogger("hicache_gds_sglang.policy")

POLICY = "compute_or_load"
SGLANG_POLICIES = ("best_effort", "wait_complete", "timeout")
FALLBACK = "timeout"  # SGLang's default: what our name turns into where the policy cannot run
POLICY_KEYS = ("policy", "policy_read_gbps", "policy_prefill_tokens_per_s", "policy_host_fraction",
               "policy_stop_margin", "policy_split", "policy_split_get")
# Keys of settings measured not to pay in a running server and removed (`benchmarks/RESULTS.md`,
# runs 9-10): passing one is an error naming it, as an unknown key is.
REMOVED_KEYS = {
    "policy_read_slice": "sliced gets lowered a running server's read rate; a stopped load now ends between "
                         "SGLang's batches of pages",
    "policy_partial": "loading part of a hit did not pay (run 9); a hit is loaded whole or recomputed",
    "policy_ready_first": "moving finished loads ahead acted on 1-5 loads per run and did not pay (run 10)",
}
SPLIT_MODES = ("idle", "always", "off")  # `PolicyConfig.split`
_SAVE_EVERY_S = 30.0
_BACKLOG_TTL_S = 0.005  # one scheduler pass: the waiting queue's backlog is summed once per pass
# A load in flight is looked at again only when its kept pages grew (a batch landed: the moment a
# stop keeps the most), or once it runs late against what admission forecast for its reads (the
# rates were wrong). Between those the admission's verdict stands: the scheduler asks thousands of
# times a second, and re-deciding on every small drift of the estimates turned near-ties into
# stops after most of a load was read (a load and a recompute, one after the other).
_LATE_FACTOR = 1.25
_LATE_SLACK_S = 0.1
_REEVAL_S = 0.02  # at most this often per load, late or not
# A finished load becomes ordinary host-pool pages once SGLang inserts it into the radix tree, and
# 0.5.17 inserts it whenever the scheduler reaches the request, schedulable or not. While other
# requests' prefills fill the batches, the pages wait there as evictable host-only leaves, and
# those prefills' write-through evicts them when the host pool is full: on the GPU machine a 32B
# burst read a prefix from disk, then found "0 on host" when the GPU took it and recomputed it.
# So the deepest node a finished load inserted is protected (SGLang's own host_ref_counter, which
# `evict_host` and the write-back drop respect; a protected leaf keeps its ancestors as well, as
# only leaves are evicted) until the request leaves the waiting queue (its load back to the GPU
# then holds the pages), and for at most _PROTECT_MAX_S, so a request that never runs cannot pin
# host memory. The prefills' write-through then finds less room: their host backup is what gives
# way, not a load the GPU is about to use.
_PROTECT_MAX_S = 60.0
SPLIT_HOOKED = [False]  # the join point of a split (``cache_unfinished_req``) is hooked in this process
_MAX_BATCH_S = 600.0  # a prefill batch forecast beyond this is a broken forecast, not a backlog
_LATE_EVERY_S = 0.01  # `LoadOrCompute.late_admit` looks at the waiting queue at most this often


def _positive(value: Any, key: str) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number > 0, got {value!r}") from None
    if not f > 0 or not math.isfinite(f):
        raise ConfigError(f"{key}: expected a number > 0, got {value!r}")
    return f


def _mode(value: Any, key: str, *, true: str) -> str:
    """One of `SPLIT_MODES`; a boolean spelling means `true` or ``off``."""
    v = str(value).strip().lower()
    v = {"false": "off", "0": "off", "no": "off", "true": true, "1": true, "yes": true}.get(v, v)
    if v not in SPLIT_MODES:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(SPLIT_MODES)}")
    return v


def check_removed(extra: Mapping[str, Any] | None) -> None:
    """Raise `ConfigError` naming a removed key (`REMOVED_KEYS`) found in `extra`."""
    for key in sorted(set(extra or {}) & set(REMOVED_KEYS)):
        raise ConfigError(f"{key} was removed ({REMOVED_KEYS[key]}); delete it from the extra config")


@dataclass(frozen=True)
class PolicyConfig:
    """The policy's settings, from the backend's extra config (``policy*`` keys).

    policy: ``compute_or_load`` or one of SGLang's policies, applied at attach (as the flag would
    be); None leaves the flag's choice. read_gbps / prefill_tokens_per_s: seeds used until the
    server has measured its own (they win over a persisted estimate). host_fraction: share of the
    host pool prefetches may hold. stop_margin: how much sooner stopping must finish before a
    load in flight is stopped.
    split: when a hit may be split, its head computed on the GPU while the disk loads its tail
    (`split`; SGLang 0.5.17 on one rank, elsewhere never), where that finishes the request first:
    ``idle`` (the default: only while no load is on the disk), ``always`` (``true``) or ``off``.
    Measured on an H200 (the same server and run, against ``off``; runs 12-13): one at a time a
    request alone is faster than both its load and its recompute (32B shape: 0.83x the mean TTFT,
    0.66-0.68x the recompute of 21k-25k-token prefixes; 8B: 0.90x), a burst of 8 0.84-0.90x the
    makespan; at the 8B open loop's knee ``always`` made the TTFT p90 0.67x recompute's against
    ``idle``'s 0.76x, but it splits inside bursts too, where whole loads serve better (makespan
    1.10-1.12x ``idle``'s). split_get: bytes per get of a split's tail
    (0: SGLang's own gets of 128 pages): the tail is prefetched as operations of that many bytes
    of pages, each counted when its get returns, so the part of a tail read by the time the
    chunks reach it joins (`split.tail_pages`). Each get returns once its pages are verified, so
    small gets read slower where checksums are slow (a 2-core machine: 128 MiB gets at 0.42-0.51x
    the rate of 1 GiB gets; an H200's 16 cores kept up with the forecast)."""

    policy: str | None = None
    read_gbps: float | None = None
    prefill_tokens_per_s: float | None = None
    host_fraction: float = 0.75
    stop_margin: float = 0.05
    split: str = "idle"
    split_get: int = 128 << 20

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "PolicyConfig":
        extra = extra or {}
        check_removed(extra)
        kw: dict[str, Any] = {}
        if "policy" in extra:
            p = str(extra["policy"]).strip()
            if p not in (POLICY, *SGLANG_POLICIES):
                raise ConfigError(f"policy: {p!r} is not one of {', '.join((POLICY, *SGLANG_POLICIES))}")
            kw["policy"] = p
        if "policy_read_gbps" in extra:
            kw["read_gbps"] = _positive(extra["policy_read_gbps"], "policy_read_gbps")
        if "policy_prefill_tokens_per_s" in extra:
            kw["prefill_tokens_per_s"] = _positive(extra["policy_prefill_tokens_per_s"], "policy_prefill_tokens_per_s")
        if "policy_host_fraction" in extra:
            f = _positive(extra["policy_host_fraction"], "policy_host_fraction")
            if f > 1:
                raise ConfigError(f"policy_host_fraction: expected a fraction in (0, 1], got {f}")
            kw["host_fraction"] = f
        if "policy_stop_margin" in extra:
            try:
                m = float(extra["policy_stop_margin"])
            except (TypeError, ValueError):
                m = -1.0
            if not 0 <= m < 10:
                raise ConfigError(f"policy_stop_margin: expected a number in [0, 10), got {extra['policy_stop_margin']!r}")
            kw["stop_margin"] = m
        if "policy_split" in extra:
            kw["split"] = _mode(extra["policy_split"], "policy_split", true="always")
        if "policy_split_get" in extra:
            kw["split_get"] = parse_size(extra["policy_split_get"], key="policy_split_get")
        return cls(**kw)


# -- what the two releases keep where ---------------------------------------------------------
def _entry_op(entry: Any) -> Any:
    """The PrefetchOperation of an ``ongoing_prefetch`` entry (0.5.23: a NamedTuple; 0.5.17: a tuple)."""
    op = getattr(entry, "operation", None)
    return op if op is not None else entry[2]


def _entry_key_len(entry: Any) -> int:
    key = getattr(entry, "prefetch_key", None)
    return len(key if key is not None else entry[1])


def _entry_hit(entry: Any, op: Any) -> int:
    """Tokens of L3 hit an ``ongoing_prefetch`` entry will load: at most its key while the
    storage query has not answered."""
    hit = int(getattr(op, "storage_hit_count", 0) or 0)
    return hit if hit or getattr(op, "hash_value", None) else _entry_key_len(entry)


def _on_gpu(req: Any) -> int:
    """Tokens of a request's prefix held in GPU memory, from its last match."""
    held = getattr(req, "prefix_len", None)  # 0.5.23
    if isinstance(held, int):
        return held
    pi = getattr(req, "prefix_indices", None)
    return 0 if pi is None else len(pi)


def _req_work(req: Any) -> tuple[int, int]:
    """(tokens left to prefill, tokens already held) of a queued request, from its last match."""
    total = len(getattr(req, "origin_input_ids", None) or ()) + len(getattr(req, "output_ids", None) or ())
    held = _on_gpu(req) + int(getattr(req, "host_hit_length", 0) or 0)
    return max(0, total - held), held


def _to_prefill(req: Any) -> int:
    """Tokens a request would prefill in the batch being formed (its fill ids less what its last
    match holds on GPU and host)."""
    fill = getattr(req, "full_untruncated_fill_ids", None)
    if fill is None:
        return _req_work(req)[0]
    return max(0, len(fill) - _on_gpu(req) - int(getattr(req, "host_hit_length", 0) or 0))


def _host_free(cache: Any) -> int | None:
    """Free tokens of the host pool (what a prefetch allocates into once its hit is known; SGLang
    shortens or revokes a prefetch it cannot fit), or None where the release does not say."""
    try:
        return int(cache.cache_controller.mem_pool_host.available_size())
    except Exception:  # noqa: BLE001 -- a diagnostic only
        return None


def _host_evictable(cache: Any) -> int:
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


def _host_room(cache: Any) -> int | None:
    """Host-pool tokens a new load can still get: free, plus host-only pages SGLang may evict
    (`_host_evictable`), less what admitted loads will take once their L3 hit is known (SGLang
    allocates then, and shortens or revokes a load it cannot fit). None where the release does
    not say."""
    free = _host_free(cache)
    if free is None:
        return None
    evictable = _host_evictable(cache)
    pending = 0
    for entry in list(getattr(cache, "ongoing_prefetch", {}).values()):
        op = _entry_op(entry)
        if op is None or op.is_terminated() or getattr(op, "host_indices", None) is not None:
            continue
        pending += _entry_hit(entry, op)
    return free + evictable - pending


def _rid(x: Any) -> str:
    return str(getattr(x, "rid", x))


def _backend(cache: Any) -> Any:
    """The cache's storage backend when it serves this policy (``supports_compute_or_load``: the
    read rate, progress and cancel hooks; `HiCacheGDS`), unwrapped from SGLang's failure
    injector; else None."""
    cc = getattr(cache, "cache_controller", None)
    b = getattr(cc, "storage_backend", None) if cc is not None and getattr(cc, "enable_storage", False) else None
    if b is not None and not getattr(b, "supports_compute_or_load", False):
        b = getattr(b, "_backend", None)
    return b if getattr(b, "supports_compute_or_load", False) is True else None


def policy_of(cache: Any) -> "LoadOrCompute | None":
    """The policy of `cache` when it is the one in force (selected, and the backend is ours)."""
    pol = getattr(cache, "_hgds_policy", None)
    if pol is None or getattr(cache, "prefetch_stop_policy", None) != POLICY:
        return None
    return pol if _backend(cache) is not None else None


def _agree(cache: Any, flag: bool, op_name: str) -> bool:
    """The same verdict on every TP/PP rank (SGLang's ``_all_reduce``: PP0's TP ranks reduce, the
    result travels along PP), as SGLang agrees its own prefetch decisions."""
    return bool(_agree_int(cache, int(flag), op_name))


def _agree_int(cache: Any, value: int, op_name: str) -> int:
    """`value` reduced over every rank by `op_name` (MIN: how many tokens all of them prefetch), as `_agree`."""
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
        _once("agree", "hicache-gds: could not agree a prefetch decision across ranks (%s); deciding locally", exc)
        return value


def _single_rank(cache: Any) -> bool:
    """The cache serves one rank alone (no TP, PP or attention-group peers to agree with)."""
    if int(getattr(cache, "tp_world_size", 1) or 1) > 1 or int(getattr(cache, "pp_size", 1) or 1) > 1:
        return False
    for name in ("attn_cp_group", "attn_tp_group"):
        group = getattr(cache, name, None)
        if group is not None:
            try:
                import torch
                if torch.distributed.get_world_size(group=group) > 1:
                    return False
            except Exception:  # noqa: BLE001 -- unknown: do not act alone
                return False
    return True


_logged: set[str] = set()


def _once(tag: str, msg: str, *args: Any) -> None:
    if tag not in _logged:
        _logged.add(tag)
        log.warning(msg, *args)


# -- the policy --------------------------------------------------------------------------------
class _Launched(NamedTuple):
    """A prefill batch launched on the forward stream: its CUDA events (start, end), per request
    its new tokens, prefix and id, when it was launched, and the seconds forecast for it."""

    start: Any
    end: Any
    news: list[int]
    prefixes: list[int]
    t0: float
    pred: float
    rids: list[str]


class LoadOrCompute:
    """The policy state of one radix cache (one per scheduler process): the prefill model (kept
    across backend re-attaches), the scheduler it serves, the decisions taken and why."""

    def __init__(self, cache: Any) -> None:
        self._cache = weakref.ref(cache)
        self.prefill = PrefillModel(chunk=None)
        self.pace = LoadPace()  # kept across backend re-attaches, as the prefill model is
        self._model: CostModel | None = None
        self._model_backend: Any = None
        self._scheduler: Any = None
        self.current_req: Any = None
        self._decided: dict[str, tuple[str, int, int, int]] = {}  # rid -> (action, new, held, hit); "split": the head, not the hit
        self._loads: dict[str, list[float]] = {}  # rid -> [admitted at, forecast IO s, kept seen, last look, pace]
        self._pending: deque[_Launched] = deque(maxlen=256)  # prefill batches not yet seen finished
        self._gpu_until = -math.inf  # forecast end of the last prefill batch launched (`_in_flight_prefill`)
        self._warm = False  # the first prefill batch seen finished (kernel compilation) was left out of the fit
        self._queued: dict[str, list[Any]] = {}  # rid -> [request, first seen, last seen] in the waiting queue
        self._protected: dict[str, tuple[Any, float, int]] = {}  # rid -> (protected node, since, tokens)
        self._late: set[str] = set()  # rids `late_admit` gave the disk
        self._split_plan: dict[str, tuple[int, int, int]] = {}  # rid -> (head, tail forecast read, hit), until started
        self._tails: dict[str, tuple[split_mod.TailLoad, Any]] = {}  # rid -> (its tail in flight, its request)
        self._late_look = 0.0
        self._lock = threading.Lock()
        self._backlog: tuple[tuple, dict[str, float], float] | None = None
        self.counts: Counter[str] = Counter()
        self.last: dict[str, Any] = {}
        self._last_save = time.monotonic()
        _register_process_policy(self)

    # -- wiring ----------------------------------------------------------------------------------
    def bind(self, scheduler: Any) -> None:
        if self._scheduler is None or self._scheduler() is not scheduler:
            self._scheduler = weakref.ref(scheduler)
            chunk = getattr(scheduler, "chunked_prefill_size", None)
            if isinstance(chunk, int) and chunk > 0:
                self.prefill.chunk = chunk

    def scheduler(self) -> Any:
        return None if self._scheduler is None else self._scheduler()

    def model(self, backend: Any) -> CostModel | None:
        """The cost model over `backend`'s read rate (rebuilt when the backend changes)."""
        if backend is None:
            return None
        if self._model is None or self._model_backend is not backend:
            bpt = backend.kv_bytes_per_token()
            if not bpt:
                return None
            cfg = backend.policy_config
            self._model = CostModel(bpt, read=backend.read_rate, prefill=self.prefill, pace=self.pace,
                                    stop_margin=cfg.stop_margin)
            self._model_backend = backend
            self._seed(backend)
        return self._model

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
            if st and self._model is not None:
                seeded = self._model.seed_from_state(st, read=False)
                if seeded:
                    log.info("hicache-gds policy: seeded %s", ", ".join(seeded))

    def maybe_save(self, backend: Any) -> None:
        now = time.monotonic()
        if self._model is None or now - self._last_save < _SAVE_EVERY_S:
            return
        self._last_save = now
        backend.save_cost_state(self._model.state())

    # -- prefill observations (TpModelWorker.forward_batch_generation) ---------------------------
    def prefill_begin(self, batch: Any) -> Any:
        news = [int(x) for x in (getattr(batch, "extend_lens", None) or [])]
        prefixes = [int(x) for x in (getattr(batch, "prefix_lens", None) or [])]
        if not news or len(news) != len(prefixes):
            return None
        self.poll()
        reqs = list(getattr(batch, "reqs", None) or ())
        rids = [_rid(r) for r in reqs] if len(reqs) == len(news) else []
        start = _event()
        return _Launched(start, None, news, prefixes, time.perf_counter(), 0.0, rids)

    def prefill_end(self, token: Any) -> None:
        if token is None:
            return
        end = _event()
        with self._lock:
            pred = self.prefill.predict_batch(token.news, token.prefixes) or 0.0
            if not 0.0 <= pred < _MAX_BATCH_S:
                _once("batch-forecast", "hicache-gds policy: a prefill batch forecast at %.3g s (new %s, prefixes %s, "
                      "coefficients %s); counted as 0", pred, token.news[:8], token.prefixes[:8],
                      self.prefill.coefficients()[0])
                pred = 0.0
            self._pending.append(token._replace(end=end, pred=pred))
            # The GPU is busy no longer than every batch not yet seen finished takes from this
            # launch: without this bound an over-forecast carried forward into every later batch
            # (on an H200 the backlog read 2.6e6 s for 40 % of an open loop's admissions).
            self._gpu_until = min(max(self._gpu_until, token.t0) + pred,
                                  token.t0 + sum(b.pred for b in self._pending))

    def poll(self) -> None:
        """Feed finished prefill batches to the model (non-blocking: CUDA events are queried)."""
        with self._lock:
            while self._pending:
                b = self._pending[0]
                secs = _elapsed(b.start, b.end, b.t0)
                if secs is None:
                    break
                self._pending.popleft()
                if not self._warm:
                    # A server's first prefill batch compiles kernels: its seconds are no prefill
                    # cost. Fed to the fit, it and a second 64-token batch gave `b` alone (0.055 s
                    # per unit of attention sum) on an H200: 1.8e6 s forecast for 8192 tokens.
                    self._warm = True
                    continue
                self.prefill.observe(b.news, b.prefixes, secs)

    def _in_flight_prefill(self, now: float) -> float:
        """Seconds until the GPU finishes the prefill batches launched and not yet seen finished.

        Batches run one after another on the forward stream, each from its launch or the forecast
        end of the one launched before it, whichever is later (`_gpu_until`, kept across batches
        already finished). Counted from each batch's own launch, the backlog missed most of a long
        prompt in progress: SGLang's overlapped scheduler launches a chunk while the GPU still
        runs the one before and admits new requests once that one ends, so the chunk then starting
        looked mostly done. On the GPU machine a third of the requests arriving behind another's
        prefill saw a GPU backlog of 0 s."""
        with self._lock:
            left = max(0.0, self._gpu_until - now) if self._pending else 0.0
            if left > _MAX_BATCH_S:
                _once("backlog-forecast", "hicache-gds policy: the GPU's launched prefill batches forecast %.3g s "
                      "from now (%d pending, %.3g s forecast for them); counted as 0", left, len(self._pending),
                      sum(b.pred for b in self._pending))
                left = 0.0
            return left

    def _launched_through(self, rid: str) -> int:
        """How far into request `rid` the prefill batches launched and not yet seen finished reach
        (its prefix plus new tokens in the furthest; 0 if none holds it)."""
        with self._lock:
            return max((p + n for b in self._pending for r, n, p in zip(b.rids, b.news, b.prefixes) if r == rid),
                       default=0)

    # -- backlogs ----------------------------------------------------------------------------------
    def _compute(self, model: CostModel, rid: str, req: Any) -> float:
        d = self._decided.get(rid)
        if d is not None:
            action, new, held, hit = d
            if action in ("load", "wait"):
                return model.predict_compute(new - hit, held + hit) or 0.0
            if action == "split":
                t = self._tails.get(rid)
                got = min(t[0].expect, t[0].tokens) if t is not None else 0
                return (model.predict_compute(hit, held) or 0.0) + (
                    model.predict_compute(new - hit - got, held + hit + got) or 0.0)
            return model.predict_compute(new, held) or 0.0
        new, held = _req_work(req)
        return model.predict_compute(new, held) or 0.0

    def gpu_backlog(self, cache: Any, model: CostModel) -> tuple[dict[str, float], float]:
        """Seconds of prefill ahead of each queued request (by rid), and of the whole queue."""
        sched = self.scheduler()
        now = time.monotonic()
        if sched is None:
            return {}, self._in_flight_prefill(time.perf_counter())
        queue = list(getattr(sched, "waiting_queue", None) or [])
        chunked = getattr(sched, "chunked_req", None)
        key = (id(getattr(sched, "waiting_queue", None)), len(queue), id(chunked))
        cached = self._backlog
        if cached is not None and cached[0] == key and now - cached[2] < _BACKLOG_TTL_S:
            return cached[1], cached[1].get("", 0.0)
        acc = self._in_flight_prefill(time.perf_counter())
        if chunked is not None:
            new, held = _req_work(chunked)
            # its chunks on the GPU are counted above (SGLang may not have cached them yet)
            through = self._launched_through(_rid(chunked))
            if through > held:
                new, held = max(0, new - (through - held)), through
            acc += model.predict_compute(new, held) or 0.0
        ahead: dict[str, float] = {}
        live = set()
        for req in queue:
            rid = _rid(req)
            live.add(rid)
            ahead[rid] = acc
            acc += self._compute(model, rid, req)
            if rid in self._decided:
                q = self._queued.get(rid)
                if q is None:
                    self._queued[rid] = [req, now, now]
                else:
                    q[2] = now
        ahead[""] = acc
        loading = self._loading_rids(cache)
        for rid in [r for r in self._decided if r not in live and r not in loading]:
            self._left_queue(rid)
            del self._decided[rid]
            self._late.discard(rid)
        for rid in [r for r in self._loads if r not in loading]:
            w = self._loads.pop(rid)
            self.counts["unseen"] += 1
            log.info("hicache-gds policy: %s load left SGLang's prefetches after %.3f s unseen by the policy (revoked "
                     "for want of host memory or of hits, or settled without asking); host pool %s tokens free", rid,
                     now - w[0], _host_free(cache))
        self._backlog = (key, ahead, now)
        return ahead, acc

    def _left_queue(self, rid: str) -> None:
        """A decided request left the waiting queue (scheduled, or aborted): one INFO line with
        what it held then against what was decided, so a log shows a load whose pages did not
        survive until the GPU took the request (evicted from the host pool, revoked)."""
        queued = self._queued.pop(rid, None)
        if queued is None:
            return
        req, since, last = queued
        action, new, held, hit = self._decided[rid]
        pi = getattr(req, "prefix_indices", None)
        on_gpu = getattr(req, "prefix_len", None)
        on_gpu = on_gpu if isinstance(on_gpu, int) else (0 if pi is None else len(pi))
        log.info("hicache-gds policy: %s left the queue after %.3f s holding %d tokens (%d on host) of %d new; "
                 "decided %s with %d in L3", rid, last - since, on_gpu, int(getattr(req, "host_hit_length", 0) or 0),
                 new, action, hit)

    @staticmethod
    def _loading_rids(cache: Any) -> set[str]:
        return {_rid(k) for k in getattr(cache, "ongoing_prefetch", {})}

    def disk_backlog(self, cache: Any, model: CostModel, backend: Any) -> tuple[dict[str, tuple[float, int, int, int]], float]:
        """Per loading request (by rid): (seconds until its last page lands, hit, kept, fetched)
        -- loads run one after another, in order -- and the seconds of the whole disk queue."""
        out: dict[str, tuple[float, int, int, int]] = {}
        acc = 0.0
        ps = max(1, int(getattr(cache, "page_size", 1) or 1))
        for k, entry in list(getattr(cache, "ongoing_prefetch", {}).items()):
            op = _entry_op(entry)
            if op is None or op.is_terminated():
                continue
            hit = _entry_hit(entry, op)
            kept = int(getattr(op, "completed_tokens", 0) or 0)
            fetched = kept + backend.read_progress(getattr(op, "host_indices", None)) * ps
            rem = max(0, hit - fetched)
            acc += model.predict_load(rem * model.bytes_per_token) or 0.0
            out[_rid(k)] = (acc, hit, kept, fetched)
        return out, acc

    # -- decisions ---------------------------------------------------------------------------------
    def admit(self, cache: Any, request: Any, new_input_tokens: Any, held_hint: int | None) -> int:
        """Admission: how many of `new_input_tokens` to prefetch (load): all of them, or 0 to
        recompute (or split, `start_tail`)."""
        every = len(new_input_tokens)
        backend = _backend(cache)
        model = self.model(backend)
        if model is None:
            return every
        self.poll()
        ps = max(1, int(getattr(cache, "page_size", 1) or 1))
        hit = every // ps * ps
        threshold = int(getattr(cache, "prefetch_threshold", 0) or 0)
        if hit < threshold:
            return every  # SGLang declines it anyway
        rid = _rid(request)
        req = self.current_req if self.current_req is not None and _rid(self.current_req) == rid else None
        if req is not None:
            new, held = _req_work(req)
            new = max(new, hit)
        else:
            new, held = hit, int(held_hint or 0)
        ahead, g = self.gpu_backlog(cache, model)
        g = ahead.get(rid, g)  # a late admission (`late_admit`) is already queued: only what is ahead of it
        _, d = self.disk_backlog(cache, model, backend)
        split = backend.policy_config.split
        chunk = self.prefill.chunk if req is not None and rid not in self._tails and \
            (split == "always" or d <= 0) and self.can_split(cache, backend) else None
        dec = model.decide(new, held, hit, gpu_backlog=g, disk_backlog=d, page=ps,
                           split_chunk=chunk,
                           split_grain=(self._tail_pages(cache, backend, model) or split_mod.batch_pages()) * ps
                           if chunk else None)
        if dec.action == "split":
            self._decided[rid] = ("split", new, held, int(dec.tokens or 0))
            self._split_plan[rid] = (int(dec.tokens or 0), int(dec.tail or 0), hit)
            self.counts["split"] += 1
            self.last = {"rid": rid, "action": "split", "t_load": dec.t_load, "t_compute": dec.t_compute, "new": new,
                         "held": held, "hit": hit, "head": dec.tokens, "tail": dec.tail, "gpu_backlog": g,
                         "disk_backlog": d, "reason": dec.reason, "host_free": _host_free(cache)}
            log.info("hicache-gds policy: %s split: compute %d, load the %d after (%d new, %d held, %d in L3; split "
                     "%.3f s, compute %.3f s; GPU backlog %.3f s, disk backlog %.3f s; read %.2f GB/s, prefill %.0f tok/s "
                     "at 8k; %s)", rid, dec.tokens, hit - int(dec.tokens or 0), new, held, hit, dec.t_load,
                     dec.t_compute, g, d, (model.read.rate or 0) / 1e9, model.prefill.tokens_per_s(8192) or 0,
                     dec.reason)
            self.maybe_save(backend)
            return 0
        take = hit
        room = _host_room(cache)
        if dec.load and room is not None and take > room:
            # SGLang would shorten or revoke it once the hit is known: the disk reads what the
            # host pool cannot keep, and the request is recomputed after waiting for it.
            dec = replace(dec, action="compute", reason=f"the host pool has room for {max(0, room)} tokens",
                          tokens=None)
        self._decided[rid] = (dec.action, new, held, take)
        if dec.load:
            io = model.predict_load(take * model.bytes_per_token, d)
            self._loads[rid] = [time.monotonic(), math.inf if io is None else io, 0.0, 0.0, model.pace.factor]
        self.counts[dec.action] += 1
        host_free = _host_free(cache)
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
        backend = _backend(cache)
        model = self.model(backend)
        hv = getattr(operation, "hash_value", None) or []
        ps = max(1, int(getattr(cache, "page_size", 1) or 1))
        done = bool(hv) and getattr(operation, "host_indices", None) is not None and \
            int(operation.completed_tokens) >= len(hv) * ps
        rid = _rid(getattr(operation, "request_id", ""))
        if done:
            w = self._loads.pop(rid, None)  # once: 0.5.23 asks again until the load is acknowledged
            if w is not None:
                took = time.monotonic() - w[0]
                self.pace.observe(w[1], took, w[4])
                host_free = _host_free(cache)
                log.info("hicache-gds policy: %s load done: %d tokens in %.3f s (forecast %.3f s; pace now %.2f); host "
                         "pool %s tokens free", rid, int(operation.completed_tokens), took, w[1], self.pace.factor,
                         "?" if host_free is None else host_free)
            # 0.5.23 settles a finished load through its acknowledgements (as for wait_complete);
            # 0.5.17 finishes it here, and its pages are then protected (`protect`).
            return not hasattr(cache, "_handle_prefetch_result")
        if operation.is_terminated():
            # SGLang ended it (a get returned fewer pages than asked, an abort): it keeps what it read
            w = self._loads.pop(rid, None)
            if w is not None:
                self.counts["short"] += 1
                log.info("hicache-gds policy: %s load ended by SGLang after %d of %d tokens in %.3f s (a short read or "
                         "an abort); the rest is recomputed", rid, int(getattr(operation, "completed_tokens", 0) or 0),
                         len(hv) * ps, time.monotonic() - w[0])
            return True
        if model is None:
            return False
        self.poll()
        disk, _ = self.disk_backlog(cache, model, backend)
        if rid not in disk:
            return False
        t_disk, hit, kept, fetched = disk[rid]
        if not self._look_again(rid, kept):
            return False
        ahead, _ = self.gpu_backlog(cache, model)
        d = self._decided.get(rid)
        new, held = (d[1], d[2]) if d is not None else (hit, 0)
        dec = model.decide(max(new, hit), held, hit, kept=kept, fetched=fetched, in_flight=True,
                           gpu_backlog=ahead.get(rid, 0.0), disk_backlog=t_disk - (model.predict_load(
                               max(0, hit - fetched) * model.bytes_per_token) or 0.0))
        if dec.action == "stop":
            self.counts["stop"] += 1
            self._decided[rid] = ("compute", max(new, hit) - kept, held + kept, 0)
            self.last = {"rid": rid, "action": "stop", "t_load": dec.t_load, "t_compute": dec.t_compute,
                         "kept": kept, "fetched": fetched, "hit": hit, "reason": dec.reason}
            self._loads.pop(rid, None)
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
        `_LATE_EVERY_S`; one rank only (the trigger is timed locally, and the ranks' collectives
        must agree)."""
        cache = getattr(scheduler, "tree_cache", None)
        now = time.monotonic()
        if cache is None or now - self._late_look < _LATE_EVERY_S or policy_of(cache) is None:
            return None
        self._late_look = now
        if not any(d[0] == "compute" for d in self._decided.values()):
            return None
        backend = _backend(cache)
        model = self.model(backend)
        if model is None or not _single_rank(cache):
            return None
        ahead, _ = self.gpu_backlog(cache, model)
        _, d = self.disk_backlog(cache, model, backend)
        loading = self._loading_rids(cache)
        threshold = int(getattr(cache, "prefetch_threshold", 0) or 0)
        for req in list(getattr(scheduler, "waiting_queue", None) or ()):
            rid = _rid(req)
            dec = self._decided.get(rid)
            if dec is None or dec[0] != "compute" or rid in self._late or rid in loading:
                continue
            hit = dec[3]
            if hit < max(threshold, 1):
                continue
            t_io = model.predict_load(hit * model.bytes_per_token, d)
            g = ahead.get(rid, 0.0)
            if t_io is None or t_io * (1.0 + model.stop_margin) >= g:
                continue
            self._late.add(rid)
            self.counts["late"] += 1
            log.info("hicache-gds policy: %s late load: its %d tokens in L3 load in %.3f s (disk backlog %.3f s), the "
                     "GPU reaches it in %.3f s", rid, hit, t_io, d, g)
            scheduler._prefetch_kvcache(req)
            return rid
        return None

    def protect(self, cache: Any, rid: str, entry: Any) -> None:
        """0.5.17 just inserted the finished load of `rid` (its ``ongoing_prefetch`` `entry`: the
        node it hangs under, its key, its operation) into the tree: protect the deepest node it
        reached until the request leaves the waiting queue (`_PROTECT_MAX_S`)."""
        last_host_node, key, op = entry
        ps = max(1, int(getattr(cache, "page_size", 1) or 1))
        usable = int(getattr(op, "completed_tokens", 0) or 0) // ps * ps
        if getattr(op, "host_indices", None) is None or usable <= 0 or rid in self._protected:
            return
        _, node = cache._match_prefix_helper(last_host_node, key[:usable])
        if node is last_host_node or getattr(node, "host_value", None) is None:
            return  # nothing of it is in the tree (dropped, or all of it was there already)
        node.protect_host()
        self._protected[rid] = (node, time.monotonic(), usable)
        self.counts["protect"] += 1
        log.info("hicache-gds policy: %s load of %d tokens protected on host until the GPU takes it; host pool %s "
                 "tokens free", rid, usable, _host_free(cache))

    def release_protected(self, waiting: Any) -> None:
        """Release the protection of every loaded request no longer in `waiting` (the scheduler's
        waiting queue: scheduled, whose load back holds the pages now, or aborted), or protected
        for longer than `_PROTECT_MAX_S`."""
        if not self._protected:
            return
        now = time.monotonic()
        queued = {_rid(r) for r in (waiting or ())}
        for rid, (node, since, tokens) in list(self._protected.items()):
            late = now - since > _PROTECT_MAX_S
            if rid in queued and not late:
                continue
            del self._protected[rid]
            if getattr(node, "host_ref_counter", 0) > 0:  # a tree reset may have dropped the node's state
                node.release_host()
            log.info("hicache-gds policy: %s host protection of %d tokens released after %.3f s (%s)", rid, tokens,
                     now - since, "still waiting: held too long" if late else "left the waiting queue")

    def _look_again(self, rid: str, kept: int) -> bool:
        """Whether the load of `rid` is re-decided now (see `_LATE_FACTOR`): its kept pages grew
        since the last look, or it runs late against admission's forecast; never more often than
        `_REEVAL_S`. A load admitted before this policy ran is looked at every `_REEVAL_S`."""
        now = time.monotonic()
        w = self._loads.get(rid)
        if w is None:
            w = self._loads[rid] = [now, 0.0, -1.0, 0.0, math.nan]  # forecast unknown: always "late"
        t0, io_s, seen, last, _ = w
        if now - last < _REEVAL_S:
            return False
        late = now - t0 > io_s * _LATE_FACTOR + _LATE_SLACK_S
        if kept <= seen and not late:
            return False
        w[2], w[3] = float(kept), now
        return True

    # -- split: the head computed while the tail loads (`split`) ------------------------------------
    def can_split(self, cache: Any, backend: Any) -> bool:
        """Splits are on, this SGLang has what they use, and the cache serves one rank."""
        return bool(backend.policy_config.split != "off" and SPLIT_HOOKED[0] and self.prefill.chunk
                    and split_mod.supported(cache) and _single_rank(cache))

    @staticmethod
    def _tail_pages(cache: Any, backend: Any, model: CostModel) -> int | None:
        """Pages per operation (and get) of a split's tail (`split.tail_pages`; None: the tail is
        one operation, read in SGLang's own gets)."""
        ps = max(1, int(getattr(cache, "page_size", 1) or 1))
        threshold = -(-int(getattr(cache, "prefetch_threshold", 0) or 0) // ps)
        return split_mod.tail_pages(int(model.bytes_per_token * ps), backend.policy_config.split_get, threshold)

    def start_tail(self, cache: Any, rid: str, last_host_node: Any, tokens: Any, last_hash: Any,
                   prefix_keys: Any) -> bool:
        """Admission chose a split for `rid`: prefetch the tail of its hit. False (and the request
        is a plain recompute) where the tail cannot be started."""
        plan = self._split_plan.pop(rid, None)
        req = self.current_req if self.current_req is not None and _rid(self.current_req) == rid else None
        if plan is None or req is None or rid in self._tails:
            return False
        head, expect, hit = plan
        matched = _on_gpu(req) + int(getattr(req, "host_hit_length", 0) or 0)
        backend, model = _backend(cache), self._model
        per_op = None if backend is None or model is None else self._tail_pages(cache, backend, model)
        tail = split_mod.start(cache, rid, last_host_node, tokens, last_hash, prefix_keys, matched=matched,
                               head=head, expect=expect, pages_per_op=per_op)
        if tail is None:
            d = self._decided.get(rid)
            if d is not None:
                self._decided[rid] = ("compute", d[1], d[2], hit)
            return False
        self._tails[rid] = (tail, req)  # until it joins or is swept: the request may leave meanwhile
        return True

    def join_tail(self, cache: Any, req: Any) -> int:
        """SGLang cached the chunks of `req`: once they reach its tail, join the pages read (or wait
        one more chunk, where the disk reads the rest before the GPU computes it and that finishes
        first). Returns the tokens joined."""
        rid = _rid(req)
        entry = self._tails.get(rid)
        if entry is None:
            return 0
        tail = entry[0]
        pi = getattr(req, "prefix_indices", None)  # a tensor: never read by its truth value
        cached = 0 if pi is None else len(pi)
        if cached < tail.start:
            return 0
        read, complete, alive = split_mod.progress(cache, tail)
        if alive and not complete and self._wait_for_tail(req, tail, cached, read):
            return 0
        grown = split_mod.join(cache, req, tail)  # where it raises, the hook drops the tail (`cancel`)
        del self._tails[rid]
        if grown > 0:
            self.counts["split_joined"] += 1
            self.counts["split_tokens"] += grown
            if isinstance(getattr(req, "cached_tokens_storage", None), int):
                req.cached_tokens_storage += grown  # SGLang splits its cached tokens by source at the first chunk
        else:
            self.counts["split_dropped"] += 1
        log.info("hicache-gds policy: %s split joined %d of its %d tail tokens at %d (%d read, forecast %d; %.3f s "
                 "after admission; %d prefetch operations)", rid, grown, tail.tokens, cached, read, tail.expect,
                 time.monotonic() - tail.since, len(tail.keys))
        return grown

    def _wait_for_tail(self, req: Any, tail: "split_mod.TailLoad", cached: int, read: int) -> bool:
        """Whether to compute one more chunk before joining: the disk reads the rest of the tail
        before the GPU computes that chunk, and that finishes the request first."""
        chunk = self.prefill.chunk
        model = self._model
        if not chunk or model is None or cached + chunk >= tail.end:
            return False
        n = sum(_req_work(req))  # the request's tokens: left to prefill and held
        frontier = max(cached, tail.start + read)
        io_left = model.predict_load((tail.end - tail.start - read) * model.bytes_per_token)
        c_chunk = model.predict_compute(chunk, cached)
        now = model.predict_compute(n - frontier, frontier)
        later = model.predict_compute(n - tail.end, tail.end)
        if None in (io_left, c_chunk, now, later):
            return False
        return io_left <= c_chunk and c_chunk + later < now

    def sweep_tails(self, scheduler: Any) -> None:
        """Drop the tails of requests no longer waiting or being chunked (finished, aborted, or
        prefilled past them without a join)."""
        if not self._tails:
            return
        cache = getattr(scheduler, "tree_cache", None)
        chunked = getattr(scheduler, "chunked_req", None)
        waiting = {id(r) for r in (getattr(scheduler, "waiting_queue", None) or ())}
        for rid, (tail, req) in list(self._tails.items()):
            if req is chunked or id(req) in waiting:
                finished = getattr(req, "finished", None)
                if not (callable(finished) and finished()):
                    continue
            del self._tails[rid]
            if cache is not None:
                split_mod.cancel(cache, tail)
            self.counts["split_dropped"] += 1
            log.info("hicache-gds policy: %s split tail of %d tokens dropped: the request left before its chunks "
                     "reached it", rid, tail.tokens)

    def rate_limited(self, controller: Any) -> bool:
        host = controller.mem_pool_host
        size = int(getattr(host, "logical_size", 0) or getattr(host, "size", 0))
        cfg = getattr(self._model_backend, "policy_config", None) or PolicyConfig()
        limit = max(int(getattr(controller, "prefetch_capacity_limit", 0) or 0), int(cfg.host_fraction * size))
        return int(controller.prefetch_tokens_occupied) >= limit

    def serves(self, backend: Any) -> bool:
        cache = self._cache()
        return cache is not None and _backend(cache) is backend

    def stats(self) -> dict[str, Any]:
        cache = self._cache()
        backend = _backend(cache) if cache is not None else None
        model = self.model(backend) if backend is not None else None
        out: dict[str, Any] = {"policy": POLICY, "active": cache is not None and policy_of(cache) is not None,
                               "decisions": dict(self.counts), "last": dict(self.last)}
        if model is not None:
            out.update(model.estimates())
        else:
            out.update(self.prefill.snapshot())
        return out


# -- CUDA events (wall clock where there is no GPU) --------------------------------------------
def _event() -> Any:
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
    except Exception:  # noqa: BLE001
        pass
    return time.perf_counter()


def _elapsed(start: Any, end: Any, t0: float) -> float | None:
    """Seconds between two `_event`s, or None while the GPU has not reached the second."""
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    try:
        if not end.query():
            return None
        return start.elapsed_time(end) / 1000.0
    except Exception:  # noqa: BLE001 -- a broken event: drop the sample
        return math.nan


_PROCESS: list[weakref.ref] = []


def _register_process_policy(p: LoadOrCompute) -> None:
    _PROCESS[:] = [r for r in _PROCESS if r() is not None] + [weakref.ref(p)]


def process_policies() -> list[LoadOrCompute]:
    return [p for p in (r() for r in _PROCESS) if p is not None]
