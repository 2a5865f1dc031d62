"""`SharedIndex`: the workers' namespaces as the scheduler's manager sees them (lookups, leases).

Every rank's worker owns its stores (`worker.py`); the manager joins their indexes read-mostly to
answer lookups from what every rank holds, whichever engine stored it, and to lease a chunk's
slots while it is loaded (`manager.py` has the whole story).
"""

from __future__ import annotations

import logging
import time

from hicache_gds import Lease, Store, open_store

from .shared import SpecView

__all__ = ["SharedIndex"]

log = logging.getLogger("hicache_gds_vllm")


class SharedIndex:
    """The workers' namespaces as this scheduler sees them: one store per (rank, group position),
    joined for lookups and leases only (`open_store(namespace_dir=...)`: never a reservation),
    opened once the worker has written where its store is (`sidecar.write_stores`), tried again at
    most once a second until then."""

    RETRY_S = 1.0

    def __init__(self, spec: SpecView) -> None:
        self.spec = spec
        self.world = spec.config.parallel.world_size
        self._ix: dict[tuple[int, int], Store] = {}
        self._next_try: dict[tuple[int, int], float] = {}

    def _index(self, rank: int, pos: int) -> Store | None:
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
            ix = self._ix[(rank, pos)] = open_store(namespace_dir=d)
        except (OSError, ValueError) as exc:  # not created yet, or unreadable: our own map decides
            log.debug("hicache-gds-vllm: rank %d group %d namespace %s not readable yet: %s", rank, pos, d, exc)
            return None
        return ix

    def indexes(self, pos: int) -> list[Store] | None:
        """Every rank's store of group position `pos`, or None while one cannot be seen."""
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
        return all(ix.exists([sk])[0] for ix in ixs)

    def lease(self, sks: list[str], pos: int) -> tuple[list[list[tuple[Lease, int]]], int]:
        """Lease chunks `sks` on every rank: per chunk its (lease, position) holds; and how many
        chunks some rank did not hold (their load will fail)."""
        out: list[list[tuple[Lease, int]]] = [[] for _ in sks]
        ixs = self.indexes(pos)
        if ixs is None:
            return out, 0
        missing: set[int] = set()
        for ix in ixs:
            try:
                lease = ix.lease(sks)
            except OSError as exc:
                log.warning("hicache-gds-vllm: could not lease %d chunks in %s: %s", len(sks), ix.namespace, exc)
                continue
            for i, present in enumerate(lease.present.tolist()):
                if not present:
                    missing.add(i)
                else:
                    out[i].append((lease, i))
        return out, len(missing)

    @staticmethod
    def release(leases: list[tuple[Lease, int]]) -> None:
        for lease, i in leases:
            lease.release([i])

    def close(self) -> None:
        for ix in self._ix.values():
            ix.close()
        self._ix.clear()
