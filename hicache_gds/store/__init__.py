"""The store: pages under keys in a namespace's slab files, behind one protocol.

* `protocol`: `Store`, the protocol every store implements, and `Lease`;
* `pagestore`: `PageStore`, read-write; `reader`: `PageReader`, read-only; `joined`:
  `JoinedStore`, lookups and leases only (the tiered store is `hicache_gds.remote.TieredStore`;
  `hicache_gds.factory.open_store` opens the one the configuration asks for);
* `namespace`: opening a namespace (where it lives, its size, its lock, its index);
* `mover`: `PageMover`, moving pages between memory and slots (the request path, checksums);
  `posting`: posting requests within the engine's limits, and the read window; `hashing`: the
  host threads that checksum pages;
* `staging`: host buffers for pages the engine cannot take as they are.
"""

from .joined import JoinedStore
from .mover import MAX_KEY_BYTES
from .pagestore import PageStore
from .protocol import Lease, Store
from .reader import PageReader

__all__ = ["JoinedStore", "Lease", "MAX_KEY_BYTES", "PageReader", "PageStore", "Store"]
