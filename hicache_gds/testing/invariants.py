"""Index invariants, checked by the reliability runs after restarts, faults and concurrent load.

Read from the shared database in one read transaction (`hicache_gds.index` says what each table
means), so they hold whatever other processes are doing:

* no slot is handed to two keys, and every slot below ``top`` is exactly one of: published
  (``pages``), free, reserved by a writer (``held``), or dropped while read (``doomed``) -- so
  pages + free + held + doomed == top <= slots, all in range;
* every leased slot holds a page or is doomed;
* no reservation or lease belongs to a process that is gone (a leaked reservation), once the
  index has looked for dead owners (`Index.reclaim`);
* at rest (no call in flight in this process): this process holds no reservation but those of
  timed-out writes, no lease and no pin, and its map of the pages is the database's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["index_problems"]


def index_problems(index: Any, *, at_rest: bool = True, check_db: bool = True) -> list[str]:
    """Violations of the invariants of an open `hicache_gds.index.Index` ([] when none).

    `at_rest`: no call is in flight in this process. `check_db`: also compare this process's
    map with the database (at rest only)."""
    problems: list[str] = []
    if not index.wait_loaded(600):  # a background load: check the map once it is in place
        return [f"the index map did not load: {index.keymap.load_error}"]
    with index._rlock:
        db = index._rdb
        if db is None:  # closed meanwhile (a watchdog's last look): nothing left to check
            return []
        db.execute("BEGIN")
        try:
            top, seq = db.execute("SELECT top, seq FROM clock").fetchone()
            tables = {t: [s for (s,) in db.execute(f"SELECT slot FROM {t}")] for t in ("pages", "free", "held", "doomed")}
            leases = db.execute("SELECT slot, owner FROM leases").fetchall()
            held = db.execute("SELECT slot, owner, lost FROM held").fetchall()
            rows = dict(db.execute("SELECT key, slot FROM pages")) if check_db else None
        finally:
            db.execute("COMMIT")
        index.keymap.dv = None  # make the next sync look again, rather than trust this connection's state
    n = index.nslots
    if top > n:
        problems.append(f"top {top} beyond the {n} slots")
    every = [s for t in tables.values() for s in t]
    named = set(every)
    if len(named) != len(every):
        for t, ss in tables.items():
            if len(set(ss)) != len(ss):
                problems.append(f"{len(ss) - len(set(ss))} slot(s) twice in {t}")
        names = list(tables)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                both = set(tables[a]) & set(tables[b])
                if both:
                    problems.append(f"{len(both)} slot(s) both {a} and {b} (e.g. {min(both)})")
    bad = [s for s in named if not 0 <= s < min(top, n)]
    if bad:
        problems.append(f"{len(bad)} slot(s) out of range 0..{min(top, n) - 1} (e.g. {bad[0]})")
    if len(named) != min(top, n):
        problems.append(f"slot accounting: pages {len(tables['pages'])} + free {len(tables['free'])} + held "
                        f"{len(tables['held'])} + doomed {len(tables['doomed'])} != {min(top, n)} slots in use")
    live_slots = set(tables["pages"]) | set(tables["doomed"])
    stray = [s for s, _ in leases if s not in live_slots]
    if stray:
        problems.append(f"{len(stray)} lease(s) on slots holding no page (e.g. {stray[0]})")
    member = index.member
    owners = {o for _, o in leases} | {o for _, o, _ in held}
    dead = [o for o in owners if o != index.owner and (member is None or not member.alive(o))]
    if dead:
        leaked = sum(1 for _, o, _ in held if o in dead) + sum(1 for _, o in leases if o in dead)
        problems.append(f"{leaked} reservation(s) or lease(s) leaked by {len(dead)} process(es) that are gone")
    if at_rest:
        with index._wlock:
            pins = dict(index._pins)
        mine_held = [s for s, o, lost in held if o == index.owner and not lost]
        mine_leases = [s for s, o in leases if o == index.owner]
        if pins:
            problems.append(f"{len(pins)} slot(s) still pinned at rest")
        if mine_held:
            problems.append(f"{len(mine_held)} slot(s) still reserved by this process at rest")
        if mine_leases:
            problems.append(f"{len(mine_leases)} lease(s) of this process at rest")
        if rows is not None:
            if len(set(rows.values())) != len(rows):
                problems.append("the database names one slot for two keys")
            with index._rlock:
                mem = rows
                if index.keymap.ready:
                    index.keymap.sync(db)
                    if index.keymap.seq == seq:  # else another process wrote meanwhile: nothing to compare
                        mem = {k: e.slot for k, e in index.keymap.map.items()}
            if rows != mem:
                only_db = len(rows.keys() - mem.keys())
                only_mem = len(mem.keys() - rows.keys())
                moved = sum(1 for k in rows.keys() & mem.keys() if rows[k] != mem[k])
                problems.append(f"database and memory disagree: {only_db} row(s) only on disk, {only_mem} only in "
                                f"memory, {moved} on other slots")
    return problems
