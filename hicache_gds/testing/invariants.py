"""Index invariants, checked by the reliability runs after restarts, faults and concurrent load.

* no slot is handed to two keys (in memory and in the SQLite rows);
* every slot is exactly one of: holding a page, free, lost (timed-out write), or doomed (dropped
  while pinned, freed on unpin) -- so pages + free + lost + doomed == slots;
* the SQLite rows are the in-memory map (same keys, same slots), all slots in range.
"""

from __future__ import annotations

from typing import Any

__all__ = ["index_problems"]


def index_problems(index: Any, *, at_rest: bool = True, check_db: bool = True) -> list[str]:
    """Violations of the invariants of an open `hicache_gds.index.Index` ([] when none).

    `at_rest`: no call is in flight (nothing pinned, no slot reserved by a put in progress), so
    the slot accounting must add up exactly.
    """
    problems: list[str] = []
    if not index.wait_loaded(600):  # a background load: check the map once it is in place
        return [f"the index map did not load: {index._load_error}"]
    with index._lock:
        used = [e.slot for e in index._map.values()]
        free = list(index._free)
        lost = set(index._lost)
        doomed = set(index._doomed)
        pins = dict(index._pins)
        rows = index._db.execute("SELECT key, slot FROM pages").fetchall() if check_db else None
    n = index.nslots
    used_set, free_set = set(used), set(free)
    if len(used_set) != len(used):
        problems.append(f"{len(used) - len(used_set)} slot(s) handed to two keys")
    if len(free_set) != len(free):
        problems.append(f"{len(free) - len(free_set)} slot(s) on the free list twice")
    for a, b, what in ((used_set, free_set, "used and free"), (used_set, lost, "used and lost"),
                       (free_set, lost, "free and lost"), (free_set, doomed, "free and doomed"),
                       (used_set, doomed, "used and doomed")):
        both = a & b
        if both:
            problems.append(f"{len(both)} slot(s) both {what} (e.g. {min(both)})")
    bad = [s for s in used_set | free_set | lost | doomed if not 0 <= s < n]
    if bad:
        problems.append(f"{len(bad)} slot(s) out of range 0..{n - 1} (e.g. {bad[0]})")
    if at_rest:
        if pins:
            problems.append(f"{len(pins)} slot(s) still pinned at rest")
        total = len(used_set | free_set | lost | doomed)
        if total != n or len(used) + len(free) + len(lost) + len(doomed) != n:
            problems.append(f"slot accounting: pages {len(used)} + free {len(free)} + lost {len(lost)} + "
                            f"doomed {len(doomed)} != slots {n}")
    if rows is not None:
        db = dict(rows)
        slots_db = [s for _, s in rows]
        if len(set(slots_db)) != len(slots_db):
            problems.append("the database names one slot for two keys")
        with index._lock:
            mem = {k: e.slot for k, e in index._map.items()}
        if at_rest and db != mem:
            only_db = len(db.keys() - mem.keys())
            only_mem = len(mem.keys() - db.keys())
            moved = sum(1 for k in db.keys() & mem.keys() if db[k] != mem[k])
            problems.append(f"database and memory disagree: {only_db} row(s) only on disk, {only_mem} only in "
                            f"memory, {moved} on other slots")
    return problems
