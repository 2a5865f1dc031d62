"""Known bugs the reliability runs demonstrate, each with the case that shows it and the fix proposed.

A case tagged with a bug id xfails in the tests while the bug reproduces and passes once the fix is
in; RELIABILITY.md says which. The fixes landed in commit a95dda0, B6's structural part later.
"""

from __future__ import annotations

__all__ = ["BUGS", "BUG_CASES", "CORRUPTION_KNOWN"]

BUGS: dict[str, dict[str, str]] = {
    "B1": {
        "title": "a key that is a str but not UTF-8 (lone surrogate) breaks put",
        "where": "store.py _check_keys; index.py Index._txn; store.py put",
        "seen": "put raises UnicodeEncodeError from inside SQLite after the page IO; its reserved slots leak; the "
                "SQLite transaction stays open, so the next put's publish fails (its pages False) before a ROLLBACK "
                "clears it. Through HiCacheGDS: False, but the next batch_set_v1 fails too.",
        "fix": "_check_keys refuses a key that does not encode as UTF-8 (ValueError naming the key's index), before "
               "any slot is reserved; Index._txn rolls back on any exception, not only sqlite3.Error.",
    },
    "B2": {
        "title": "a region whose end wraps past 2**64 passes the region check (SIGSEGV)",
        "where": "engines/base.py TransferEngine.check_regions",
        "seen": "addr + nbytes is computed in uint64 and wraps, so an address just below 2**64 counts as inside the "
                "highest registered buffer; the store then hashes/copies it and the process dies with SIGSEGV. "
                "Reachable from SGLang: host_indices that point a page there (MLA page_first_direct), through "
                "batch_set_v1 / batch_get_v1.",
        "fix": "check `addr <= end and nbytes <= end - addr` (no addition), and refuse nbytes == 0.",
    },
    "B3": {
        "title": "with nixl-posix, one failed read fails every page of its request",
        "where": "store.py _io (requests without a per-descriptor result)",
        "seen": "a slab file truncated under an open store: the pages past the new end cannot be read, and every "
                "other page batched with them (up to 64 MiB per request) reads False too, on every get.",
        "fix": "when a multi-page READ request fails and the engine gives no per-descriptor mask, re-read its pages "
               "one request per page (bounded) so a bad page cannot take its neighbours down.",
    },
    "B4": {
        "title": "a page whose read fails (not its checksum) is never dropped",
        "where": "store.py get",
        "seen": "the page stays present in exists/prefix, SGLang keeps prefetching it and failing, and put never "
                "rewrites it (present keys are skipped): a sticky miss until restart.",
        "fix": "on a failed (not timed-out) read, stat the slab file: if the slot lies past its end, re-extend the "
               "file (zeros) and drop the page like a checksum failure; a plain EIO keeps the page (transient).",
    },
    "B5": {
        "title": "an index lost as a whole (0-byte file, or its WAL deleted before any checkpoint) empties the "
                 "namespace silently",
        "where": "index.py Index._open",
        "seen": "SQLite sees a new database; every page is gone (safe: misses), but no log line says the index was "
                "lost, unlike a corrupt file.",
        "fix": "PageStore tells Index whether the slab file already held slots; a database without our settings "
               "rows in that case logs a warning ('index ... was lost ...; starting the namespace empty').",
    },
    "B6": {
        "title": "index recovery at 1M pages is over 3 s on the 2-core CI machine (7-14 s before the quick fix, "
                 "about 4 s after)",
        "where": "index.py Index._load",
        "seen": "Index._load reads every row into Python at open: before the fix a SELECT with ORDER BY atime (a temp "
                "B-tree sort), then 1M Entry objects into an OrderedDict with the cyclic GC running (6.5 s CPU).",
        "fix": "quick (in the patch): no ORDER BY (argsort atime with numpy), tuple.__new__ for Entry, gc disabled "
               "during the load, free list with numpy -- Index open at 1M rows 7.6 s -> 4.4 s wall (6.5 -> 4.1 s CPU), "
               "still over 3 s. Structural (done later): the map loads in a background thread (rows read in rowid "
               "chunks as group_concat text, the map built in chunks) while lookups are answered from SQLite's "
               "primary key and writes wait for it -- lookups served 10-110 ms after open at 1M rows (clean and "
               "after kill -9), the map in place 3.4-3.9 s after open on the loaded 2-core machine.",
    },
    "B7": {
        "title": "a batch that names one key twice makes delete (and a get that drops a damaged page) raise KeyError",
        "where": "index.py Index.drop",
        "seen": "drop deletes the rows, then `del self._map[k]` fails on the second copy: KeyError out of "
                "PageStore.delete / get, and keys after it stay in memory but not on disk.",
        "fix": "deduplicate in drop (`gone = {k: self._map[k] for k in keys if k in self._map}`).",
    },
    "P1": {
        "title": "HiCacheGDS raises into SGLang for keys without a length (None, an int) and for malformed v2 "
                 "transfers",
        "where": "plugins/sglang/hicache_gds_sglang/backend.py HiCacheGDS._io and _batch_v2",
        "seen": "`n = len(keys)` and `t.keys` / `t.name` are evaluated before the try that turns errors into False: "
                "TypeError / AttributeError escape batch_set_v1, batch_get_v1, batch_get_v2, batch_set_v2.",
        "fix": "move them inside the try (answer [] / {} for a batch without a length).",
    },
}

# corruption case name -> bug id (nixl-posix, the default engine)
# Empty since the fixes for B3, B4 and B5 landed; the cases must now pass outright.
CORRUPTION_KNOWN: dict[str, str] = {}

# bug id -> names of the cases that showed it (they pass once it is fixed)
BUG_CASES: dict[str, list[str]] = {
    'B1': ['key with a lone surrogate (str that is not UTF-8)', 'HiCacheGDS: key with a lone surrogate'],
    'B2': ['region whose end wraps past 2**64', 'region whose end wraps past 2**64 (from host_indices)'],
    'B3': ['slab-truncate (open)'],
    'B4': ['slab-truncate (open)'],
    'B5': ['index-empty (closed)', 'wal-delete (closed)'],
    'B6': [],
    'B7': ['delete, and get of a damaged page, naming one key twice in a batch'],
    'P1': ['HiCacheGDS: keys that are not a sequence (None, int), garbage v2 transfers'],
}
