"""Load or recompute, for vLLM's lookup: the core's `hicache_gds.costmodel.CostModel`, the same
model the SGLang policy asks (its docstring has the formula), fed and asked by the manager.

vLLM asks the manager about one chunk at a time, in prefix order, and stops at the first MISS. The
manager answers HIT only where loading the run of chunks found finishes before recomputing it
would (`CostModel.decide`), given

* the request: ``new`` tokens to prefill after the ``prefix`` the GPU holds (`HiCacheGDSConnector`
  notes both when vLLM looks the request up; without it, the run found is taken as the whole
  request);
* the disk's queue: the bytes of this engine's loads and stores in flight, in seconds at the read
  rate (``disk_backlog``);
* the GPU's queue: the prefill tokens of requests looked up before this one and not computed yet,
  in seconds of prefill (``gpu_backlog``): while the GPU is busy with them a load costs nothing.

The rates are measured in the running engine: the read rate from this engine's loads (bytes and
service time, `ReadRate`), the prefill cost from its steps (per request new tokens and cached
prefix, and the step's wall time, `PrefillModel`; `HiCacheGDSConnector` times them). Before a
first measurement, the core's seed keys `read_bytes_per_s` / `prefill_tokens_per_s` seed them (the
SGLang adapter's too; `load_bytes_per_s`, the old name, is still accepted); else what an earlier
run measured and persisted; else the read rate is probed at start (`read_probe` bytes of O_DIRECT
reads per directory, `hicache_gds.seed_read_rate`, as the SGLang adapter does); with no read rate at
all, the model answers "load" (the adapter's behaviour without a model). `cost_model`: "on" (default; "rate" is
the same), "off" (every chunk found is a hit), or "package.module:Class", a `CostModel` subclass
built as ``Class(extra_config, bytes_per_token)``.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

from hicache_gds import SEED_ALIASES, SEED_KEYS, ConfigError, CostModel, Decision, PrefillModel, ReadRate, seed_settings

__all__ = ["KEYS", "CostModel", "Decision", "cost_model_from", "RunJudge", "Advisor", "best_run", "for_the_queue"]

log = logging.getLogger("hicache_gds_vllm")

# Extra-config keys this module reads (the spec ignores them when building hicache-gds' Config).
# The seeds are the core's keys (`hicache_gds.SEED_KEYS`: read_bytes_per_s, prefill_tokens_per_s), one
# set for every adapter; load_bytes_per_s is read_bytes_per_s's deprecated name here, still accepted.
KEYS = ("cost_model", *SEED_KEYS, *SEED_ALIASES)


def cost_model_from(extra: Mapping[str, Any], bytes_per_token: float, chunk: int | None = None) -> CostModel | None:
    """The cost model `kv_connector_extra_config` asks for (module docstring). `bytes_per_token`:
    KV bytes of one token over every rank; `chunk`: the engine's most tokens per step."""
    name = str(extra.get("cost_model", "on"))
    if name == "off":
        return None
    if name in ("on", "rate"):
        seeds = seed_settings(extra)
        read = ReadRate(seeds.get("read_bytes_per_s"), "configured read_bytes_per_s")
        prefill = PrefillModel(seeds.get("prefill_tokens_per_s"), "configured prefill_tokens_per_s", chunk=chunk)
        return CostModel(bytes_per_token, read=read, prefill=prefill)
    mod, _, cls = name.partition(":")
    if not mod or not cls:
        raise ConfigError(f"cost_model: {name!r} is not 'on', 'off' or 'package.module:Class'")
    model = getattr(importlib.import_module(mod), cls)(extra, bytes_per_token)
    if not isinstance(model, CostModel):
        raise ConfigError(f"cost_model: {name} is not a hicache_gds.costmodel.CostModel")
    return model


@dataclass
class RunJudge:
    """One request's present chunks in one scheduler step, and the answer for them.

    vLLM scans a request's chunks in prefix order and stops at the first MISS, so a run must be
    found before it can be judged. On a first scan: HIT at once where the first chunk already pays
    with both queues empty (the compute a run saves per token grows with the run, its load per
    token does not: a longer run pays too -- judged with batches counted fractionally, as the
    argument needs: with whole batches, one chunk over a batch boundary "saves" a batch, and an
    8B-shape server loaded 16k-token prefixes at 2.4x their recompute); MISS where no run of the
    remaining tokens would pay (`best_run`); else RETRY for every present chunk (vLLM keeps
    scanning, and asks again next step), and the next scan answers from the run found: HIT for the
    best part of it (`best_run`: all of it, or what loads while the GPU is busy with the requests
    ahead), then MISS after it, or MISS at its first chunk. A HIT judged on a run answers for that
    run only (`cap`): the scan may find more chunks than the run judged, and loading them was
    never weighed (a burst's request, judged on 4 chunks, loaded 257). A scan our MISS cut short
    found no run: the next one judges by the run found before it, if any, else as a first scan
    (`found`); so does a request whose GPU prefix changed since (`prefix`)."""

    step: int
    seen: int | None = None  # chunks the previous step's scan found; None: a first scan
    run: int = 0  # present chunks found in this step's scan
    answer: str = ""  # "hit", "miss" or "defer", once decided for this scan
    decision: Decision | None = None
    cap: int | None = None  # a HIT covers this many chunks of the scan; None: all it finds
    prefix: int | None = None  # the GPU prefix the scan was judged with

    def found(self) -> int | None:
        """The run this scan found, for the next step's scan: None where unknown (a first scan
        cut short by our MISS: vLLM stopped at it, however many chunks follow)."""
        if self.answer == "miss" or (self.answer == "hit" and self.cap is not None and self.run > self.cap):
            return self.seen if self.seen is None else max(self.seen, self.run)
        return self.run

    def judge(self, model: CostModel, *, new: int, prefix: int, chunk_tokens: int, gpu_backlog: float,
              disk_backlog: float, behind: int = 0, previous: str = "") -> str:
        """"hit", "miss" or "defer" for the chunk just found (the `run`-th of this scan); `behind`:
        requests waiting behind this one for the GPU (`for_the_queue`); `previous`: the answer of
        this request's last scan, kept near a tie (`sticky`)."""
        if self.answer:
            if self.answer == "hit" and self.cap is not None and self.run > self.cap:
                return "miss"  # past the run judged: vLLM stops here and computes the rest
            return self.answer
        self.prefix = prefix
        kw = {"gpu_backlog": gpu_backlog, "disk_backlog": disk_backlog}
        if self.seen is not None:
            hit, d = best_run(model, new, prefix, min(self.seen * chunk_tokens, new), chunk_tokens, **kw)
            d = for_the_queue(d, behind, gpu_backlog)
            self.decision = sticky(d, previous, _tie(model, hit, prefix))
            self.answer = "hit" if self.decision.load else "miss"
            self.cap = max(1, hit // chunk_tokens)
            return self.answer
        first = min(chunk_tokens, new)
        one = sticky(model.decide(new, prefix, first, smooth=True, **kw), previous,
                     _tie(model, first, prefix, smooth=True))
        if one.load and disk_backlog <= 0.0 and gpu_backlog <= 0.0:
            self.decision, self.answer = one, "hit"
            return self.answer
        hit, best = best_run(model, new, prefix, new, chunk_tokens, **kw)
        best = for_the_queue(best, behind, gpu_backlog)
        self.decision = best = sticky(best, previous, _tie(model, hit, prefix))
        self.answer = "defer" if best.load else "miss"
        return self.answer


def _tie(model: CostModel, hit: int, prefix: int, *, smooth: bool = False) -> float:
    """Seconds within which a waiting request keeps its last answer (`sticky`): the model's
    `stop_margin` of the compute the `hit` tokens would save."""
    return model.stop_margin * (model.predict_compute(hit, prefix, smooth=smooth) or 0.0)


def best_run(model: CostModel, new: int, prefix: int, hit: int, chunk_tokens: int, *, gpu_backlog: float,
             disk_backlog: float) -> tuple[int, Decision]:
    """The leading part of a `hit`-token run worth loading, and its decision: all of it, or the
    chunks that land while the GPU is still busy with the requests ahead (``gpu_backlog``, behind
    the disk's own queue), whichever finishes the request sooner. Alone, all or none of a run is
    the optimum (`hicache_gds.costmodel`); behind a GPU queue, loading what hides behind it costs
    nothing, and a disk slower than the GPU makes every chunk past that a loss."""
    kw = {"gpu_backlog": gpu_backlog, "disk_backlog": disk_backlog}
    best = (hit, model.decide(new, prefix, hit, **kw))
    rate = model.read.rate
    if rate and gpu_backlog > disk_backlog and chunk_tokens > 0:
        per_token = model.bytes_per_token * model.pace.factor / rate
        hidden = int((gpu_backlog - disk_backlog) / per_token) // chunk_tokens * chunk_tokens
        if 0 < hidden < hit:
            d = model.decide(new, prefix, hidden, **kw)
            if d.t_load < best[1].t_load:
                best = (hidden, d)
    return best


def sticky(d: Decision, previous: str, margin_s: float) -> Decision:
    """`d`, or the answer a waiting request got at its last scan ("hit": load, "miss": compute)
    where `d` beats that answer by no more than `margin_s` seconds (the caller's: the model's
    `stop_margin` of the compute the run would save, so a short run is judged on its own scale).

    A request that waits is looked up again every step, on estimates that move a little with
    every batch; near a tie (1.947 s against 1.949 s) the answer alternated between load and
    recompute from one step to the next."""
    if math.isnan(d.t_load) or math.isnan(d.t_compute):
        return d
    if previous == "hit" and not d.load and d.t_load - d.t_compute <= margin_s:
        return Decision("load", d.t_load, d.t_compute, f"load kept: computing is not {margin_s:.3f} s sooner")
    if previous == "miss" and d.load and d.t_compute - d.t_load <= margin_s:
        return Decision("compute", d.t_load, d.t_compute, f"recompute kept: loading is not {margin_s:.3f} s sooner")
    return d


def for_the_queue(d: Decision, behind: int, gpu_backlog: float) -> Decision:
    """`d` ("compute" where this request alone finishes sooner by computing), turned into "load"
    where `behind` requests wait for the GPU and loading delays this one by less than it frees the
    GPU for them: each of them starts the request's compute time sooner, so the mean TTFT of the
    queue falls where ``t_load - t_compute < behind * (t_compute - gpu_backlog)``.

    vLLM looks a waiting request up only when a step's token budget has room, so the GPU's queue
    *ahead* of a request is nearly empty at its lookup; the queue behind it is what a burst
    loses when every request is recomputed (a 32B burst: 0.99x recompute, where the disk and the
    GPU at once would take about 0.6x)."""
    if d.load or behind <= 0 or math.isnan(d.t_load) or math.isnan(d.t_compute):
        return d
    alone = max(0.0, d.t_compute - gpu_backlog)
    freed = behind * alone
    if d.t_load - d.t_compute < freed:
        return Decision("load", d.t_load, d.t_compute,
                        f"{behind} request(s) wait behind: loading frees {alone:.3f} s of GPU for each "
                        f"(costs this one {d.t_load - d.t_compute:.3f} s)")
    return d


@dataclass
class _Flight:
    """Bytes of a job this engine has in flight, and since when (loads: for the read rate)."""
    nbytes: int
    t0: float
    load: bool


class Advisor:
    """What the manager keeps for the model, and asks it: this engine's jobs in flight (the disk's
    queue; a finished load is a read-rate sample), the prefill each request looked up still needs
    (the GPU's queue, in lookup order), and each request's scan of this step (`RunJudge`).

    `chunk_bytes`: one chunk over every rank; `chunk_tokens`: tokens of a chunk per vLLM group id;
    `flight_ttl`: a job older than this is taken as gone (its request aborted mid-flight, say)."""

    def __init__(self, model: CostModel, chunk_bytes: int, chunk_tokens: Mapping[int, int], flight_ttl: float) -> None:
        self.model = model
        self.chunk_bytes = chunk_bytes
        self.chunk_tokens = dict(chunk_tokens)
        self.flight_ttl = flight_ttl
        self._flights: dict[frozenset, _Flight] = {}
        self.inflight_bytes = 0
        self._last_done = 0.0
        self._requests: dict[str, tuple[int, int]] = {}  # req id -> (new tokens, GPU prefix) at lookup
        self._prefill_left: dict[str, int] = {}  # req id -> prompt tokens not computed yet, in lookup order
        self._scans: dict[str, RunJudge] = {}
        self._said: dict[str, tuple[str, str]] = {}  # req id -> the decision last logged
        self._arrived: dict[str, None] = {}  # req ids vLLM added and has not looked up yet, in order
        self.step = 0
        self.misses = 0  # requests answered MISS because recomputing was faster
        self.deferrals = 0  # first scans deferred to judge the run found
        self.last: Decision | None = None

    # -- the request and the queues --------------------------------------------------------
    def note_arrival(self, req_id: str) -> None:
        """vLLM added `req_id` (it waits until a step has room to look it up)."""
        self._arrived[req_id] = None

    def note_request(self, req_id: str, new: int, prefix: int) -> None:
        """vLLM looks `req_id` up: `new` tokens to compute after the `prefix` the GPU holds."""
        self._arrived.pop(req_id, None)
        self._requests[req_id] = (max(0, int(new)), max(0, int(prefix)))
        self._prefill_left.setdefault(req_id, max(0, int(new)))

    def note_scheduled(self, req_id: str, tokens: int, prefix: int) -> None:
        """A step computes `tokens` of `req_id` after the `prefix` it had (loaded ones included)."""
        if req_id not in self._prefill_left:
            return
        new, noted = self._requests.get(req_id, (0, 0))
        left = new + noted - int(prefix) - int(tokens)
        if left > 0:
            self._prefill_left[req_id] = left
        else:
            del self._prefill_left[req_id]

    def forget(self, req_id: str) -> None:
        self._arrived.pop(req_id, None)
        self._said.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._prefill_left.pop(req_id, None)
        self._scans.pop(req_id, None)

    def gpu_backlog(self, req_id: str) -> float:
        """Seconds of prefill the requests looked up before `req_id` still need."""
        ahead = 0
        for r, left in self._prefill_left.items():
            if r == req_id:
                break
            ahead += left
        return (self.model.predict_compute(ahead) or 0.0) if ahead else 0.0

    def behind(self, req_id: str) -> int:
        """Requests waiting for the GPU behind `req_id`: looked up after it and not yet computed,
        and added but not looked up yet."""
        after, seen = 0, False
        for r in self._prefill_left:
            if seen:
                after += 1
            seen = seen or r == req_id
        return after + sum(1 for r in self._arrived if r != req_id)

    def disk_backlog(self) -> float:
        return (self.model.predict_load(self.inflight_bytes) or 0.0) if self.inflight_bytes else 0.0

    def fly(self, nchunks: int, keys: frozenset, load: bool) -> None:
        now = time.monotonic()
        for k in [k for k, f in self._flights.items() if now - f.t0 > self.flight_ttl]:
            self.inflight_bytes -= self._flights.pop(k).nbytes
        f = _Flight(nchunks * self.chunk_bytes, now, load)
        old = self._flights.pop(keys, None)
        self.inflight_bytes += f.nbytes - (old.nbytes if old is not None else 0)
        self._flights[keys] = f

    def land(self, keys: frozenset) -> None:
        """A job finished: its bytes leave the queue; a load's service time (from when the IO before
        it was done, or from its start) is a read-rate sample."""
        f = self._flights.pop(keys, None)
        if f is None:
            return
        self.inflight_bytes -= f.nbytes
        now = time.monotonic()
        if f.load:
            self.model.observe_load(f.nbytes, now - max(f.t0, self._last_done))
        self._last_done = now

    def reset(self) -> None:
        """vLLM dropped every job in flight (a cache reset): their completions never come."""
        self._flights.clear()
        self.inflight_bytes = 0
        self._scans.clear()

    # -- the question ------------------------------------------------------------------------
    def judge(self, req_id: str, group: int) -> str:
        """"hit", "miss" or "defer" for the next present chunk of `req_id`'s scan (`RunJudge`)."""
        s = self._scans.get(req_id)
        if s is None or s.step != self.step:  # the first lookup of this request in this step
            gpu_prefix = self._requests.get(req_id, (0, 0))[1]  # a run found beside another GPU prefix is stale
            s = self._scans[req_id] = RunJudge(self.step, s.found() if s is not None and s.prefix == gpu_prefix
                                               else None)
        s.run += 1
        ct = self.chunk_tokens.get(group, 1)
        # Without the connector's note the request's length is unknown: the run found is taken as
        # the whole request (the chunk a first scan can judge alone does not depend on it).
        new, prefix = self._requests.get(req_id, (s.seen * ct if s.seen is not None else 1 << 20, 0))
        first = not s.answer
        answer = s.judge(self.model, new=max(new, ct), prefix=prefix, chunk_tokens=ct,
                         gpu_backlog=self.gpu_backlog(req_id), disk_backlog=self.disk_backlog(),
                         behind=self.behind(req_id), previous=self._said.get(req_id, ("", ""))[0])
        if first:
            self.last = s.decision
            if answer == "miss":
                self.misses += 1
            elif answer == "defer":
                self.deferrals += 1
            d = s.decision
            said = (answer, d.action if d is not None else "")
            if self._said.get(req_id) != said:  # a waiting request is looked up every step: say changes only
                self._said[req_id] = said
                log.info("hicache-gds-vllm cost: %s %s at chunk %d of the run (%d new tokens, GPU prefix %d; load %s s, "
                         "compute %s s; GPU backlog %.3f s, disk backlog %.3f s)%s", req_id,
                         {"hit": "load", "miss": "recompute", "defer": "defer"}[answer], s.run, new, prefix,
                         f"{d.t_load:.3f}" if d is not None else "-", f"{d.t_compute:.3f}" if d is not None else "-",
                         self.gpu_backlog(req_id), self.disk_backlog(), f": {d.reason}" if d is not None else "")
        return answer

    def loading(self, req_id: str) -> None:
        """The request's chunks are being loaded: its next scan starts afresh."""
        self._scans.pop(req_id, None)
