"""The key -> slot index of a namespace, shared by every process that has it open (SQLite, WAL).

* `schema`: the tables, what each means, and the statements every transaction is built from;
* `index`: `Index`, the transactions a store runs (reserve, publish, lease, drop, clear, reclaim);
* `keymap`: `KeyMap`, this process's map of the published pages, kept in step with the database;
* `recovery`: opening the database and repairing it (crash, resize, short slab files, damage);
* `reader`: `IndexReader`, the read-only side for `PageReader` and tools.

Crash safety lives here and in the store's write order, nowhere else:

* a page is published (row committed) only after its bytes are on disk, and only into a slot its
  publisher holds (``held``), so no slot ever names two keys;
* a slot is reused only after the row that pointed at it is deleted and committed, and no lease
  names it;
* what a process holds is tagged with its owner token (`owners.Membership`): when that process
  is gone, however it died, the survivors reclaim its reservations and leases
  (`Index.reclaim`), and the first process to open a namespace nobody has open reclaims all
  (`recovery`).

So after a kill -9 the database names only pages whose bytes were completely written, and every
page whose `put` returned True is there. WAL with synchronous=NORMAL survives process crashes;
`sync=True` in the store adds fdatasync of the data for power loss.

Open is quick at any size: an index of `Index.BACKGROUND_ROWS` rows or more loads its map in a
background thread, and until it is in place lookups are answered from SQLite by primary key.
Writes never wait for it: they run in the database. `recovery_s` is open until lookups are
served; `loaded_s` is open until the map is in place.
"""

from .index import Index
from .reader import IndexReader, read_keys
from .schema import INDEX_FILE, SCHEMA, Entry, remove_pages, select_entries

__all__ = ["Entry", "Index", "IndexReader", "INDEX_FILE", "SCHEMA", "read_keys", "remove_pages", "select_entries"]
