"""The slab files and the namespaces on disk, below the index and the store.

* `slabset`: `SlabSet`, a namespace's preallocated slab files (one per `GDS_PATH` directory);
* `ondisk`: the on-disk format (slot placement, the recorded directory order);
* `owners`: which processes have a namespace open (`Membership`, `setup_lock`);
* `capacity`: sizing a namespace within the node's one disk budget, evicting idle namespaces;
* `namespaces`: the namespaces under `GDS_PATH` as their files describe them (page counts and
  `hicache-gds verify`, which read the index above, are `hicache_gds.tools.namespaces`);
* `removal`: removing a namespace whole.
"""

from .slabset import META_FILE, SlabSet, prepare_root, private_dir

__all__ = ["META_FILE", "SlabSet", "prepare_root", "private_dir"]
