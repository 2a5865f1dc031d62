"""`SharedIndex`: the workers' namespaces as the scheduler's manager sees them (lookups, leases).

Every rank's worker owns its stores (`worker.py`); the manager joins their indexes read-mostly to
answer lookups from what every rank holds, whichever engine stored it, and to lease a chunk's
slots while it is loaded (`manager.py` has the whole story).
"""

from __future__ import annotations

import logging
import os
import time

from hicache_gds.index import INDEX_FILE, Index
from hicache_gds.owners import Membership

from .shared import SpecView

__all__ = ["SharedIndex"]

log = logging.getLogger("hicache_gds_vllm")


class SharedIndex:
    """The workers' namespaces as this scheduler sees them: one `Index` per (rank, group position),
    joined read-mostly (lookups, leases; never a reservation), opened once the worker has written
    where its store is (`sidecar.write_stores`), tried again at most once a second until then."""

    RETRY_S = 1.0

    def __init__(self, spec: SpecView) -> None:
        self.spec = spec
        self.world = spec.config.parallel.world_size
        self._ix: dict[tuple[int, int], Index] = {}
        self._members: dict[str, Membership] = {}
        self._next_try: dict[tuple[int, int], float] = {}

    def _index(self, rank: int, pos: int) -> Index | None:
        ix = self._ix.get((rank, pos))
        if ix is not None:
            return ix
        now = time.monotonic()
        if now < self._next_try.get((rank, pos), 0.0):
            return None
        self._next_try[(rank, pos)] = now + self.RETRY_S
        d = self.spec.sidecar.read_stores(rank, self.spec.config.engine_id).get(pos)
        if not d:
            return None
        try:
            member = self._members.get(d) or Membership(d)
            self._members[d] = member
            ix = self._ix[(rank, pos)] = Index.join(os.path.join(d, INDEX_FILE), member)
        except (OSError, ValueError) as exc:  # not created yet, or unreadable: our own map decides
            log.debug("hicache-gds-vllm: rank %d group %d namespace %s not readable yet: %s", rank, pos, d, exc)
            return None
        return ix

    def indexes(self, pos: int) -> list[Index] | None:
        """Every rank's index of group position `pos`, or None while one cannot be seen."""
        out = []
        for r in range(self.world):
            ix = self._index(r, pos)
            if ix is None:
                return None
            out.append(ix)
        return out

    def present(self, sk: str, pos: int) -> bool | None:
        """Does every rank hold chunk `sk`? None: the workers' namespaces cannot be seen."""
        ixs = self.indexes(pos)
        if ixs is None:
            return None
        return all(ix.contains([sk])[0] for ix in ixs)

    def lease(self, sks: list[str], pos: int) -> tuple[list[list[tuple[Index, int]]], int]:
        """Lease chunks `sks` on every rank: per chunk its (index, slot) leases; and how many
        chunks some rank did not hold (their load will fail)."""
        out: list[list[tuple[Index, int]]] = [[] for _ in sks]
        ixs = self.indexes(pos)
        if ixs is None:
            return out, 0
        missing: set[int] = set()
        for ix in ixs:
            try:
                ents = ix.lookup_pin(sks)
            except OSError as exc:
                log.warning("hicache-gds-vllm: could not lease %d chunks in %s: %s", len(sks), ix.db_path, exc)
                continue
            for i, e in enumerate(ents):
                if e is None:
                    missing.add(i)
                else:
                    out[i].append((ix, e.slot))
        return out, len(missing)

    @staticmethod
    def release(leases: list[tuple[Index, int]]) -> None:
        for ix, slot in leases:
            ix.unpin([slot])

    def close(self) -> None:
        for ix in self._ix.values():
            ix.close()
        for m in self._members.values():
            m.close()
        self._ix.clear()
        self._members.clear()
