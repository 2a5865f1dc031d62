"""`TieredStore`: a local `PageStore` (NVMe) and a `RemoteTier` (page servers' DRAM) behind one API.

    store = TieredStore(page_bytes, identity, config={"gds_path": "/nvme", "remote_url": "redis://..."},
                        mode="both", write="through")
    store.register_memory(addr, nbytes); store.put(keys, pages); store.get(keys, pages); ...

Modes: "local" (NVMe only), "remote" (remote only), "both". With "both":

- put, write="through": the page goes to both tiers in the same call (the two writes overlap: the
  remote one runs in a helper thread; both only read the caller's memory). True per page stored in
  at least one tier.
- put, write="back": the call returns after the local write; a background thread later copies
  each locally stored page to the remote tier (reading it back from NVMe into its own buffer, so
  the caller's memory is free at once, host or device). Pages the local write refused go to the
  remote tier in the call. `flush()` waits for the queue; a full queue drops (counted).
- get: local first; local misses are read from the remote tier, and remote hits are written back
  to local NVMe (`promote`, on by default) while the caller's memory still holds them.

Adapters use it exactly like `PageStore`. The tiered store owns (and closes) both stores.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Mapping, Sequence

import numpy as np

from .. import pagesum
from ..config import Config
from ..engines.base import MemKind, TransferEngine
from ..layout import Pages
from ..memory import HostBuffer, align_up
from ..stats import Counters
from ..store.pagestore import PageStore
from ..store.protocol import Lease, Store
from .options import REMOTE_KEYS, RemoteOptions
from .tier import RemoteTier

__all__ = ["TieredStore", "TIER_KEYS"]

log = logging.getLogger("hicache_gds.remote")
TIER_KEYS = {"tier_mode": ("local", "remote", "both"), "tier_write": ("through", "back")}
_WB_BATCH = 32


def _setting(key: str, given: str | None, cfg: Config, over: Mapping[str, Any], default: str) -> str:
    val = given if given is not None else over.get(key, getattr(cfg, key, "")) or default
    if val not in TIER_KEYS[key]:
        from ..errors import ConfigError
        raise ConfigError(f"{key}: {val!r} is not one of {', '.join(TIER_KEYS[key])}")
    return str(val)


class TieredStore(Store):
    """The tiered `Store`: local NVMe (a `PageStore`) and the page servers' memory (`RemoteTier`).

    Parameters
    ----------
    page_bytes, identity, config:
        As for `PageStore`; `config` may also hold the remote keys (`REMOTE_KEYS`) and
        `tier_mode` / `tier_write`.
    mode, write:
        Override `tier_mode` ("local" | "remote" | "both", default "both") and `tier_write`
        ("through" | "back", default "through").
    promote:
        Write remote hits to local NVMe during `get` (mode "both").
    local, remote:
        Stores to use instead of opening them from `config` (tests, benchmarks).
    mem_kinds, engine:
        As for `PageStore` (the local tier's).
    writeback_pages:
        Most pages queued for write-back; more are dropped from the remote copy (counted).
    """

    def __init__(self, page_bytes: int, identity: Mapping[str, Any] | None = None, *,
                 config: Config | Mapping[str, Any] | None = None, mode: str | None = None, write: str | None = None,
                 promote: bool = True, local: PageStore | None = None, remote: RemoteTier | None = None,
                 writeback_pages: int = 4096, mem_kinds: Sequence[MemKind] = (MemKind.DRAM,),
                 engine: TransferEngine | None = None) -> None:
        over: Mapping[str, Any] = {} if isinstance(config, Config) else dict(config or {})
        cfg = config if isinstance(config, Config) else Config.load(over, ignore=tuple(REMOTE_KEYS) + tuple(TIER_KEYS))
        self.mode = _setting("tier_mode", mode, cfg, over, "both")
        self.write = _setting("tier_write", write, cfg, over, "through")
        self.page_bytes = page_bytes
        self.config = cfg
        self.namespace = ""
        self.promote = promote and self.mode == "both"
        self.local: PageStore | None = None
        self.remote: RemoteTier | None = None
        try:
            if self.mode in ("local", "both"):
                self.local = local or PageStore(page_bytes, identity, config=cfg, mem_kinds=mem_kinds, engine=engine)
            if self.mode in ("remote", "both"):
                self.remote = remote or RemoteTier(page_bytes, identity, config=cfg,
                                                   options=RemoteOptions.from_config(cfg, over))
        except BaseException:
            self.close()
            raise
        self.namespace = str((self.local or self.remote).stats().get("namespace", ""))  # type: ignore[union-attr]
        self.slot_bytes = self.local.slot_bytes if self.local is not None else align_up(page_bytes)
        self.dirs = list(self.local.dirs) if self.local is not None else []
        self._counts = Counters(("promoted", "writeback_queued", "writeback_done", "writeback_dropped",
                                 "writeback_failed"))
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="hicache-gds-tier") if self.mode == "both" else None
        self._wb_q: queue.Queue[str] = queue.Queue(maxsize=writeback_pages)
        self._wb_thread: threading.Thread | None = None
        self._wb_stop = threading.Event()
        self._wb_pending = 0  # queued or being written; flush() waits for 0
        self._wb_cv = threading.Condition()
        self._closed = False
        if self.mode == "both" and self.write == "back":
            self._wb_buf = HostBuffer(_WB_BATCH * page_bytes)
            self.local.register_memory(self._wb_buf.addr, self._wb_buf.nbytes)  # type: ignore[union-attr]
            self.remote.register_memory(self._wb_buf.addr, self._wb_buf.nbytes)  # type: ignore[union-attr]
            self._wb_thread = threading.Thread(target=self._writeback_loop, name="hicache-gds-writeback", daemon=True)
            self._wb_thread.start()

    def _remote_budget(self) -> float:
        o = self.remote.opts  # type: ignore[union-attr]
        return o.io_timeout + 8 * o.redis_timeout + 5.0

    def _count(self, **kw: int) -> None:
        self._counts.add(**kw)

    # -- API -------------------------------------------------------------------------------------
    def register_memory(self, addr: int, nbytes: int, kind: MemKind = MemKind.DRAM) -> None:
        for s in (self.local, self.remote):
            if s is not None:
                s.register_memory(addr, nbytes, kind)

    def register_tensor(self, tensor: Any) -> None:
        self.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                             MemKind.VRAM if tensor.is_cuda else MemKind.DRAM)

    def deregister_memory(self, addr: int) -> None:
        # docstring inherited
        for s in (self.local, self.remote):
            if s is not None and hasattr(s, "deregister_memory"):
                s.deregister_memory(addr)

    @property
    def capabilities(self) -> Any:
        """The local tier's engine's (None without a local tier)."""
        return self.local.capabilities if self.local is not None else None

    def page_checksums(self, pages: Pages, like: Any = None) -> Any:
        # docstring inherited
        if self.local is None:
            segs = [list(zip(pages.addrs[j].tolist(), pages.lens[j].tolist())) for j in range(len(pages))]
            odd = None if like is None else pagesum.kinds_of(like).tolist()
            return np.array(pagesum.host_sums(segs, self.page_bytes, odd), dtype=np.int64)
        return self.local.page_checksums(pages, like)

    def lease(self, keys: Sequence[str]) -> Lease:
        """The local tier's lease (GPU-direct reads come from NVMe); pages only in the remote tier
        are absent from it (read them with `get`)."""
        if self.local is None:
            n = len(keys)
            z = np.zeros(n, dtype=np.uint64)
            return Lease(list(keys), np.zeros(n, dtype=bool), z, z.copy(), np.zeros(n, dtype=np.int64),
                         np.zeros(n, dtype=np.int64), slots=np.zeros(n, dtype=np.int64),
                         post=lambda *a: [], unpin=None, drop=None, protected=True)
        return self.local.lease(keys)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: present in either tier."""
        found = self.local.exists(keys) if self.local is not None else [False] * len(keys)
        miss = [i for i, f in enumerate(found) if not f]
        if self.remote is not None and miss:
            for i, f in zip(miss, self.remote.exists([keys[i] for i in miss])):
                found[i] = f
        return found

    def prefix(self, keys: Sequence[str]) -> int:
        found = self.exists(keys)
        return found.index(False) if False in found else len(found)

    def put(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Write pages; True per page stored in at least one tier (the local one, for write-back)."""
        if self.local is None:
            return self.remote.put(keys, pages)  # type: ignore[union-attr]
        if self.remote is None:
            return self.local.put(keys, pages)
        if self.write == "through":
            fut = self._helper.submit(self.remote.put, keys, pages)  # type: ignore[union-attr]
            loc = self.local.put(keys, pages)
            try:
                rem = fut.result(timeout=self._remote_budget())
            except FutureTimeout:  # the remote tier bounds its own waits; this is a last guard
                log.warning("hicache-gds tiered: remote put of %d page(s) overran its budget", len(keys))
                rem = [False] * len(keys)
            return [a or b for a, b in zip(loc, rem)]
        loc = self.local.put(keys, pages)
        refused = [i for i, ok in enumerate(loc) if not ok]
        skip = set(refused)
        if refused:
            for i, ok in zip(refused, self.remote.put([keys[i] for i in refused], pages.select(refused))):
                loc[i] = ok
        for i, k in enumerate(keys):
            if i not in skip:
                with self._wb_cv:
                    try:
                        self._wb_q.put_nowait(k)
                        self._wb_pending += 1
                    except queue.Full:
                        self._count(writeback_dropped=1)
                        continue
                self._count(writeback_queued=1)
        return loc

    def get(self, keys: Sequence[str], pages: Pages) -> list[bool]:
        """Read pages: local first, then remote for the misses (promoted to local NVMe)."""
        if self.local is None:
            return self.remote.get(keys, pages)  # type: ignore[union-attr]
        got = self.local.get(keys, pages)
        if self.remote is None:
            return got
        miss = [i for i, ok in enumerate(got) if not ok]
        if not miss:
            return got
        sub = pages.select(miss)
        rem = self.remote.get([keys[i] for i in miss], sub)
        hit = [j for j, ok in enumerate(rem) if ok]
        for j in hit:
            got[miss[j]] = True
        if self.promote and hit:
            self.local.put([keys[miss[j]] for j in hit], sub.select(hit))
            self._count(promoted=len(hit))
        return got

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove pages from both tiers; True per key that was present in either."""
        out = [False] * len(keys)
        for s in (self.local, self.remote):
            if s is not None:
                out = [a or b for a, b in zip(out, s.delete(keys))]
        return out

    def clear(self) -> int:
        """Remove every page of the namespace from both tiers; pages removed (held in both: counted twice)."""
        return sum(s.clear() for s in (self.local, self.remote) if s is not None)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until the write-back queue is empty; False on timeout."""
        with self._wb_cv:
            return self._wb_cv.wait_for(lambda: self._wb_pending == 0, timeout)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self._counts.snapshot()
        names = [s.engine.name for s in (self.local, self.remote) if s is not None]
        ns = (self.local or self.remote).stats().get("namespace", "")  # type: ignore[union-attr]
        out.update(engine="tiered", mode=self.mode, write=self.write, promote=self.promote,
                   path=" + ".join(names), page_bytes=self.page_bytes, namespace=ns,
                   writeback_pending=self._wb_q.qsize())
        if self.local is not None:
            out["local"] = self.local.stats()
        if self.remote is not None:
            out["remote"] = self.remote.stats()
        return out

    # -- write-back ------------------------------------------------------------------------------
    def _writeback_loop(self) -> None:
        while not self._wb_stop.is_set():
            try:
                keys = [self._wb_q.get(timeout=0.1)]
            except queue.Empty:
                continue
            while len(keys) < _WB_BATCH:
                try:
                    keys.append(self._wb_q.get_nowait())
                except queue.Empty:
                    break
            try:
                self._writeback(list(dict.fromkeys(keys)))
            except Exception as exc:  # noqa: BLE001 -- never kill the thread; the remote copy is best effort
                log.warning("hicache-gds tiered: write-back of %d page(s) failed: %s", len(keys), exc)
                self._count(writeback_failed=len(keys))
            with self._wb_cv:
                self._wb_pending -= len(keys)
                self._wb_cv.notify_all()

    def _writeback(self, keys: list[str]) -> None:
        todo = [k for k, f in zip(keys, self.remote.exists(keys)) if not f]  # type: ignore[union-attr]
        if not todo:
            self._count(writeback_done=len(keys))
            return
        pages = Pages.contiguous(self._wb_buf.addr, self.page_bytes, range(len(todo)))
        have = self.local.get(todo, pages)  # type: ignore[union-attr]
        idx = [i for i, ok in enumerate(have) if ok]
        ok = self.remote.put([todo[i] for i in idx], pages.select(idx)) if idx else []  # type: ignore[union-attr]
        self._count(writeback_done=len(keys) - len(todo) + sum(ok), writeback_failed=len(todo) - sum(ok))

    def close(self) -> None:
        """Finish queued write-backs (bounded wait), then close both stores. Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if getattr(self, "_wb_thread", None) is not None:
            self.flush(timeout=30.0)
            self._wb_stop.set()
            self._wb_thread.join(timeout=5.0)
        if getattr(self, "_helper", None) is not None:
            self._helper.shutdown(wait=True)
        for s in (self.remote, self.local):
            if s is not None:
                s.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
