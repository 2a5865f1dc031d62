"""SQLite (WAL) against LMDB as the shared, multi-process index of one namespace.

    python benchmarks/bench_index_store.py [--rows 1000000] [--procs 1,2,4] [--seconds 3]

Both stores hold the same rows (key of 64 hex digits plus an SGLang-like suffix -> slot, nbytes,
checksum, LRU clock) in a scratch directory, and run the paths the page store needs:

* lookup: 1,000 keys (half present), one read transaction: SQLite one statement by primary key
  (`json_each`), LMDB `Cursor.getmulti`;
* put: one write transaction reserving 128 free slots for the caller, one publishing them (rows
  in, reservations out, the LRU clock's index kept);
* get: one write transaction leasing 128 slots for reading (and touching their LRU clock), one
  returning the leases;
* the same put + get loop in 1, 2 and 4 processes at once on one store (aggregate transactions
  per second and the 99th percentile of one transaction's latency);
* ``--real-index``: the product's own `hicache_gds.index.Index` in 1 and 4 processes on one
  namespace, each looping as a writer does -- reserve 64 slots, `--io-ms` of "IO" (a sleep),
  publish them, lease and return 8 -- to show the share of a process's time spent in the index
  when several write at once (needs hicache_gds importable; LMDB not needed).

SQLite: journal_mode=WAL, synchronous=NORMAL, BEGIN IMMEDIATE for writers. LMDB: one environment,
sync and metasync off (a kill -9 loses nothing either way: both write into the page cache), one
map of 4 GiB. Prints one JSON line per store; `RESULTS.md` holds the numbers of a run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import sqlite3
import statistics
import struct
import tempfile
import time

BATCH = 128
LOOKUP = 1000
SUFFIX = "_meta-llama-Llama-3.1-8B_0_1"


def key(i: int) -> str:
    return f"{i:064x}{SUFFIX}"


# -- SQLite -------------------------------------------------------------------------------------------

SQL_SCHEMA = """
CREATE TABLE IF NOT EXISTS pages (key TEXT PRIMARY KEY, slot INTEGER NOT NULL UNIQUE, nbytes INTEGER NOT NULL,
                                  csum INTEGER NOT NULL, atime INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS pages_atime ON pages(atime);
CREATE TABLE IF NOT EXISTS free (slot INTEGER PRIMARY KEY);
CREATE TABLE IF NOT EXISTS reserved (slot INTEGER PRIMARY KEY, owner TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (slot INTEGER NOT NULL, owner TEXT NOT NULL, n INTEGER NOT NULL,
                                   PRIMARY KEY (slot, owner)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS clock (id INTEGER PRIMARY KEY CHECK (id = 0), t INTEGER NOT NULL);
"""
LOOKUP_SQL = ("SELECT json_group_array(json_array(key, slot, nbytes, csum)) FROM pages "
              "WHERE key IN (SELECT value FROM json_each(?))")


class Sql:
    name = "sqlite"

    def __init__(self, d: str, create: bool = False, rows: int = 0) -> None:
        self.db = sqlite3.connect(os.path.join(d, "index.sqlite3"), isolation_level=None, timeout=60)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.owner = f"{os.getpid()}"
        if create:
            self.db.executescript(SQL_SCHEMA)
            self.db.execute("BEGIN")
            self.db.executemany("INSERT INTO pages VALUES (?, ?, 65536, ?, ?)",
                                ((key(i), i, i * 7 + 1, i) for i in range(rows)))
            self.db.executemany("INSERT INTO free VALUES (?)", ((s,) for s in range(rows, rows * 2)))
            self.db.execute("INSERT INTO clock VALUES (0, ?)", (rows,))
            self.db.execute("COMMIT")
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def lookup(self, keys: list[str]) -> int:
        (js,) = self.db.execute(LOOKUP_SQL, (json.dumps(keys),)).fetchone()
        return len(json.loads(js))

    def put(self, keys: list[str]) -> None:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        slots = [s for (s,) in db.execute("SELECT slot FROM free LIMIT ?", (len(keys),))]
        db.executemany("DELETE FROM free WHERE slot = ?", ((s,) for s in slots))
        db.executemany("INSERT INTO reserved VALUES (?, ?)", ((s, self.owner) for s in slots))
        db.execute("COMMIT")
        db.execute("BEGIN IMMEDIATE")
        (t,) = db.execute("UPDATE clock SET t = t + ? RETURNING t", (len(slots),)).fetchone()
        db.executemany("INSERT OR IGNORE INTO pages VALUES (?, ?, 65536, 1, ?)",
                       ((k, s, t - i) for i, (k, s) in enumerate(zip(keys, slots))))
        db.executemany("DELETE FROM reserved WHERE slot = ?", ((s,) for s in slots))
        db.execute("COMMIT")
        # keep the table size steady: give the slots back as the eviction of the oldest would
        db.execute("BEGIN IMMEDIATE")
        gone = db.execute("SELECT key, slot FROM pages ORDER BY atime LIMIT ?", (len(slots),)).fetchall()
        db.executemany("DELETE FROM pages WHERE key = ?", ((k,) for k, _ in gone))
        db.executemany("INSERT INTO free VALUES (?)", ((s,) for _, s in gone))
        db.execute("COMMIT")

    def get(self, keys: list[str]) -> None:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        (js,) = db.execute(LOOKUP_SQL, (json.dumps(keys),)).fetchone()
        hits = json.loads(js)
        (t,) = db.execute("UPDATE clock SET t = t + ? RETURNING t", (len(hits),)).fetchone()
        db.executemany("UPDATE pages SET atime = ? WHERE key = ?", ((t - i, h[0]) for i, h in enumerate(hits)))
        db.executemany("INSERT INTO leases VALUES (?, ?, 1) ON CONFLICT DO UPDATE SET n = n + 1",
                       ((h[1], self.owner) for h in hits))
        db.execute("COMMIT")
        db.execute("BEGIN IMMEDIATE")
        db.executemany("DELETE FROM leases WHERE slot = ? AND owner = ?", ((h[1], self.owner) for h in hits))
        db.execute("COMMIT")

    def close(self) -> None:
        self.db.close()


# -- LMDB ---------------------------------------------------------------------------------------------

_ENT = struct.Struct("<qqqq")  # slot, nbytes, csum, atime
_U64 = struct.Struct(">Q")  # big-endian: byte order is numeric order


class Lmdb:
    name = "lmdb"

    def __init__(self, d: str, create: bool = False, rows: int = 0) -> None:
        import lmdb
        self.env = lmdb.open(os.path.join(d, "index.lmdb"), map_size=4 << 30, max_dbs=8, sync=False,
                             metasync=False, readahead=False, lock=True, max_readers=512)
        self.pages = self.env.open_db(b"pages")
        self.lru = self.env.open_db(b"lru")  # atime -> key
        self.free = self.env.open_db(b"free")
        self.reserved = self.env.open_db(b"reserved")
        self.leases = self.env.open_db(b"leases")
        self.meta = self.env.open_db(b"meta")
        self.owner = str(os.getpid()).encode()
        if create:
            with self.env.begin(write=True) as txn:
                for i in range(rows):
                    k = key(i).encode()
                    txn.put(k, _ENT.pack(i, 65536, i * 7 + 1, i), db=self.pages)
                    txn.put(_U64.pack(i), k, db=self.lru)
                for s in range(rows, rows * 2):
                    txn.put(_U64.pack(s), b"", db=self.free)
                txn.put(b"clock", _U64.pack(rows), db=self.meta)

    def lookup(self, keys: list[str]) -> int:
        with self.env.begin(db=self.pages, buffers=True) as txn:
            found = txn.cursor().getmulti([k.encode() for k in keys])
            return sum(1 for _ in found)

    def _tick(self, txn, n: int) -> int:
        t = _U64.unpack(txn.get(b"clock", db=self.meta))[0] + n
        txn.put(b"clock", _U64.pack(t), db=self.meta)
        return t

    def put(self, keys: list[str]) -> None:
        with self.env.begin(write=True) as txn:
            cur = txn.cursor(db=self.free)
            slots = []
            if cur.first():
                while len(slots) < len(keys):
                    slots.append(cur.key())
                    if not cur.delete():
                        break
            for s in slots:
                txn.put(s, self.owner, db=self.reserved)
        with self.env.begin(write=True) as txn:
            t = self._tick(txn, len(slots))
            for i, (k, s) in enumerate(zip(keys, slots)):
                kb = k.encode()
                if txn.put(kb, _ENT.pack(_U64.unpack(s)[0], 65536, 1, t - i), db=self.pages, overwrite=False):
                    txn.put(_U64.pack(t - i), kb, db=self.lru)
                txn.delete(s, db=self.reserved)
        with self.env.begin(write=True) as txn:
            cur = txn.cursor(db=self.lru)
            n = 0
            if cur.first():
                while n < len(slots):
                    kb = cur.value()
                    ent = _ENT.unpack(txn.get(kb, db=self.pages))
                    txn.delete(kb, db=self.pages)
                    txn.put(_U64.pack(ent[0]), b"", db=self.free)
                    n += 1
                    if not cur.delete():
                        break

    def get(self, keys: list[str]) -> None:
        with self.env.begin(write=True) as txn:
            hits = [(bytes(k), _ENT.unpack(v)) for k, v in txn.cursor(db=self.pages).getmulti(
                [k.encode() for k in keys])]
            t = self._tick(txn, len(hits))
            for i, (kb, (slot, nb, cs, at)) in enumerate(hits):
                txn.delete(_U64.pack(at), db=self.lru)
                txn.put(_U64.pack(t - i), kb, db=self.lru)
                txn.put(kb, _ENT.pack(slot, nb, cs, t - i), db=self.pages)
                lk = _U64.pack(slot) + self.owner
                n = txn.get(lk, db=self.leases)
                txn.put(lk, _U64.pack((_U64.unpack(n)[0] if n else 0) + 1), db=self.leases)
        with self.env.begin(write=True) as txn:
            for _, (slot, *_r) in hits:
                txn.delete(_U64.pack(slot) + self.owner, db=self.leases)

    def close(self) -> None:
        self.env.close()


# -- runs ---------------------------------------------------------------------------------------------

def _lat(fn, reps: int) -> dict:
    t = []
    for _ in range(reps):
        a = time.perf_counter()
        fn()
        t.append(time.perf_counter() - a)
    t.sort()
    return {"p50_us": round(statistics.median(t) * 1e6, 1), "p99_us": round(t[int(len(t) * 0.99) - 1] * 1e6, 1)}


def single(cls, d: str, rows: int) -> dict:
    s = cls(d)
    rng = random.Random(1)
    out = {}
    fresh = iter(range(10 * rows, 20 * rows, BATCH))

    def lk():
        keys = [key(rng.randrange(rows)) if j % 2 else key(rows * 3 + rng.randrange(rows)) for j in range(LOOKUP)]
        s.lookup(keys)

    out["lookup_1k"] = _lat(lk, 300)

    def put():
        a = next(fresh)
        s.put([key(i) for i in range(a, a + BATCH)])

    out["put_128 (reserve + publish + evict)"] = _lat(put, 100)

    def get():
        a = rng.randrange(rows // 2, rows - BATCH)
        s.get([key(i) for i in range(a, a + BATCH)])

    out["get_128 (lease + touch, unlease)"] = _lat(get, 100)
    s.close()
    return out


def _loop(cls_name: str, d: str, rows: int, seconds: float, seed: int, q) -> None:
    cls = {"sqlite": Sql, "lmdb": Lmdb}[cls_name]
    s = cls(d)
    rng = random.Random(seed)
    lat, n = [], 0
    base = (100 + seed) * rows
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        a = time.perf_counter()
        s.put([key(base + n * BATCH + j) for j in range(BATCH)])
        b = time.perf_counter()
        r = rng.randrange(0, rows - BATCH)
        s.get([key(i) for i in range(r, r + BATCH)])
        c = time.perf_counter()
        lat += [b - a, c - b]
        n += 1
    s.close()
    q.put((n, lat))


def multi(cls, d: str, rows: int, procs: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_loop, args=(cls.name, d, rows, seconds, i, q)) for i in range(procs)]
    for p in ps:
        p.start()
    res = [q.get(timeout=seconds + 120) for _ in ps]
    for p in ps:
        p.join()
    lat = sorted(x for _, ls in res for x in ls)
    ops = sum(n for n, _ in res)
    return {"procs": procs, "put+get_per_s": round(ops / seconds, 1),
            "p50_ms": round(statistics.median(lat) * 1e3, 2), "p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1e3, 2)}


def _real_loop(d: str, c: int, seconds: float, io_ms: float, q) -> None:
    from hicache_gds.index import Index
    from hicache_gds.slabs.owners import Membership
    m = Membership(d)
    ix = Index(os.path.join(d, "index.sqlite3"), 1 << 20, {"bench": "index"}, member=m, first=False)
    lat, n, t_end = [], 0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        keys = [f"{c}-{n}-{i}" for i in range(64)]
        a = time.perf_counter()
        slots = ix.reserve(64)
        b = time.perf_counter()
        time.sleep(io_ms / 1e3)
        c0 = time.perf_counter()
        ix.publish([(k, s, 1 << 21, 1) for k, s in zip(keys, slots)])
        e = ix.lookup_pin(keys[:8])
        ix.unpin([x.slot for x in e if x is not None])
        lat += [b - a, time.perf_counter() - c0]
        n += 1
    ix.close()
    m.close()
    q.put((n, lat))


def real_index(root: str, procs: int, seconds: float, io_ms: float) -> dict:
    from hicache_gds.index import Index
    from hicache_gds.slabs.owners import Membership
    d = os.path.join(root, f"real-{procs}")
    os.mkdir(d)
    m = Membership(d)
    Index(os.path.join(d, "index.sqlite3"), 1 << 20, {"bench": "index"}, member=m).close()
    m.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_real_loop, args=(d, c, seconds, io_ms, q)) for c in range(procs)]
    for p in ps:
        p.start()
    res = [q.get(timeout=seconds + 120) for _ in ps]
    for p in ps:
        p.join()
    lat = sorted(x for _, ls in res for x in ls)
    return {"store": "hicache_gds.index (SQLite)", "procs": procs, "io_ms": io_ms,
            "batches_per_s_per_proc": round(sum(n for n, _ in res) / procs / seconds, 1),
            "txn_p50_ms": round(statistics.median(lat) * 1e3, 2), "txn_p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1e3, 2),
            "index_share_of_time": round(sum(lat) / procs / seconds, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one under /var/tmp)")
    ap.add_argument("--stores", default="sqlite,lmdb")
    ap.add_argument("--real-index", action="store_true", help="the product's Index instead (see above)")
    ap.add_argument("--io-ms", type=float, default=40.0)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="hicache-gds-index-bench-", dir=args.dir or "/var/tmp")
    try:
        if args.real_index:
            for p in args.procs.split(","):
                print(json.dumps(real_index(root, int(p), args.seconds, args.io_ms)), flush=True)
            return
        for name in args.stores.split(","):
            cls = {"sqlite": Sql, "lmdb": Lmdb}[name]
            d = os.path.join(root, name)
            os.mkdir(d)
            t0 = time.perf_counter()
            cls(d, create=True, rows=args.rows).close()
            out = {"store": name, "rows": args.rows, "build_s": round(time.perf_counter() - t0, 1)}
            out.update(single(cls, d, args.rows))
            out["concurrent"] = [multi(cls, d, args.rows, int(p), args.seconds) for p in args.procs.split(",")]
            print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
