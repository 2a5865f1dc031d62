"""Opening a namespace for writing: where it lives, its size, its lock and its index.

Opens of one namespace take turns (`owners.setup_lock`): the first opener of a namespace no other
process has open sizes it (`capacity.size_namespace`) and recovers it (`index.recovery`); later
ones join it as it is. Which directory is which is recorded with the namespace (`ondisk`): a
reordered GDS_PATH maps slots as they were written; a missing directory is refused before anything
is created.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .. import pagesum
from ..slabs import ondisk
from ..slabs.capacity import Sizing, size_namespace
from ..config import Config
from ..engines.base import MemKind, TransferEngine
from ..engines.select import choose_engine
from ..errors import ConfigError, StoreFullError
from ..index import INDEX_FILE, Index
from ..layout import namespace_location
from ..slabs.owners import Membership, setup_lock
from ..slabs.slabset import META_FILE, SlabSet, prepare_root, private_dir

__all__ = ["Namespace", "checked_config", "namespace_created", "open_namespace"]

log = logging.getLogger("hicache_gds.store")


def recorded_dirs(dirs: Sequence[str]) -> list[str] | None:
    """The directory order a format-1 namespace's namespace.json names (where it has one)."""
    for d in dirs:
        try:
            fd = os.open(os.path.join(d, META_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            with os.fdopen(fd) as f:
                got = json.load(f).get("dirs")
        except (OSError, ValueError, AttributeError):
            return None
        return got if isinstance(got, list) and all(isinstance(x, str) for x in got) else None
    return None


def checked_config(page_bytes: int, config: Config | Mapping[str, Any] | None) -> Config:
    """The `Config` a `PageStore` or `PageReader` opens with; `ConfigError` for a bad page size or no GDS_PATH."""
    cfg = config if isinstance(config, Config) else Config.load(config)
    if not isinstance(page_bytes, int) or page_bytes <= 0:
        raise ConfigError(f"page_bytes must be a positive integer, got {page_bytes!r}")
    if not cfg.gds_path:
        raise ConfigError("GDS_PATH is not set: give one directory, or comma-separated directories "
                          "(one per NVMe drive), in the GDS_PATH environment variable or the gds_path key")
    return cfg


def refuse_link(exc: OSError) -> ConfigError | None:
    """A symlink planted where the store keeps a file (O_NOFOLLOW gives ELOOP): a clear refusal."""
    if exc.errno != errno.ELOOP:
        return None
    return ConfigError(f"GDS_PATH: {exc.filename} is a symbolic link; the store never follows links "
                       f"inside its namespace (remove it)")



def namespace_created(page_bytes: int, identity: Mapping[str, Any] | None, config: Config) -> bool:
    """Whether a store has already created the namespace of (`page_bytes`, `identity`, `config`):
    it then keeps the size chosen when it was created, whatever capacity is configured now."""
    loc = namespace_location(page_bytes, identity, config)
    return os.path.exists(os.path.join(loc.dirs[0], SlabSet.FILE_NAME))


@dataclass
class Namespace:
    """A namespace opened for writing (`open_namespace`); the caller closes `index`, `member`
    and, when it chose it, `engine`."""

    identity: dict[str, Any]
    namespace: str
    slot_bytes: int
    dirs: list[str]
    member: Membership
    engine: TransferEngine
    engine_reason: str
    sizing: Sizing
    slabs: SlabSet
    index: Index


def open_namespace(cfg: Config, page_bytes: int, identity: Mapping[str, Any] | None,
                   mem_kinds: Iterable[MemKind], engine: TransferEngine | None) -> Namespace:
    """Create or join the namespace of (`page_bytes`, `identity`, `cfg`), choose the engine (unless
    given), size and recover it when no other process has it open, and open its index. On failure
    everything opened here is closed again (an engine given by the caller is left open)."""
    roots = [prepare_root(p) for p in cfg.gds_path]
    loc = namespace_location(page_bytes, identity, cfg)
    member: Membership | None = None
    index: Index | None = None
    chosen: TransferEngine | None = None
    try:
        ondisk.stripe_order([os.path.join(r, loc.namespace) for r in roots], partial="none")
        given = [private_dir(r, loc.namespace) for r in roots]
        dirs, note = ondisk.ensure_stripe(given, setup_lock, prefer=recorded_dirs(given))
        if note:
            log.info("hicache-gds store %s: %s", loc.namespace, note)
        with setup_lock(dirs):
            member = Membership(dirs[0])
            others = member.others()
            # The engine first: one that cannot run here must not cost a full fallocate.
            if engine is None:
                choice = choose_engine(cfg, dirs[0], frozenset(MemKind(k) for k in mem_kinds))
                chosen = engine = choice.engine
                reason = choice.reason
            else:
                reason = f"{engine.name}: given by the caller"
            if not others:
                _write_meta(dirs, loc.identity, loc.slot_bytes)
            slab0 = os.path.join(dirs[0], SlabSet.FILE_NAME)
            had_slots = os.path.exists(slab0) and os.path.getsize(slab0) > 0  # before sizing creates it
            sizing = (_new_size(cfg, dirs, loc.slot_bytes) if not others
                      else _joined_size(cfg, dirs, loc.slot_bytes, loc.namespace, len(others)))
            nslots = sizing.nslots
            gone = _short_slabs(dirs, loc.slot_bytes, nslots) if not others else []  # before SlabSet extends them
            slabs = SlabSet(dirs, loc.slot_bytes, nslots, cfg.preallocate, create=not others)
            index = Index(os.path.join(dirs[0], INDEX_FILE), nslots, ondisk.index_meta(loc),
                          existing=had_slots, gone=gone, member=member, first=not others)
        return Namespace(loc.identity, loc.namespace, loc.slot_bytes, dirs, member, engine, reason, sizing, slabs,
                         index)
    except BaseException as exc:
        if chosen is not None:
            chosen.close()
        if index is not None:
            index.close()
        if member is not None:
            member.close()
        link = refuse_link(exc) if isinstance(exc, OSError) else None
        if link is not None:
            raise link from exc
        raise


def _write_meta(dirs: Sequence[str], identity: Mapping[str, Any], slot_bytes: int) -> None:
    """Publish the namespace's description (atomically). One that already says the same is left
    as it is: a reopen then writes nothing, so a namespace on a full file system still opens."""
    path = os.path.join(dirs[0], META_FILE)
    meta = {"identity": identity, "slot_bytes": slot_bytes, "dirs": list(dirs),
            ondisk.FORMAT_KEY: ondisk.FORMAT, "checksum": pagesum.NAME}
    try:
        with open(path) as f:
            if json.load(f) == json.loads(json.dumps(meta)):
                return
    except (OSError, ValueError):
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(meta, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFullError(exc.errno, f"no room for the namespace's description in {dirs[0]}: "
                                 "the file system is full") from exc
        raise


def _new_size(cfg: Config, dirs: Sequence[str], slot_bytes: int) -> Sizing:
    """Slots of this namespace and how they were chosen (`capacity.size_namespace` has the rule)."""
    sizing = size_namespace(cfg, dirs, slot_bytes)
    if sizing.nslots < 1:
        raise ConfigError(f"capacity: {cfg.capacity} bytes hold no page of {slot_bytes} bytes; "
                          f"raise HICACHE_GDS_CAPACITY")
    return sizing


def _joined_size(cfg: Config, dirs: Sequence[str], slot_bytes: int, namespace: str, others: int) -> Sizing:
    """The size of a namespace other processes have open: kept as it is (a different
    configured capacity is logged, not applied: the others address its slots)."""
    sizes = []
    for p in (os.path.join(d, SlabSet.FILE_NAME) for d in dirs):
        try:
            sizes.append(os.lstat(p).st_size)
        except FileNotFoundError:
            sizes.append(0)
    nslots = sum(s // slot_bytes for s in sizes)
    want = SlabSet(dirs, slot_bytes, nslots, create=False).file_bytes
    if nslots < 1 or sizes != want:
        raise ConfigError(f"namespace {dirs[0]} is open in {others} other process(es) but its slab files "
                          f"have sizes {sizes}, not those of one namespace; close those processes first")
    if cfg.capacity and cfg.capacity // slot_bytes != nslots:
        log.warning("hicache-gds: namespace %s is open in %d other process(es) with %d slots; capacity %d "
                    "(%d slots) is not applied while they have it open", namespace, others, nslots,
                    cfg.capacity, cfg.capacity // slot_bytes)
    return Sizing(nslots, slot_bytes, f"as sized by its first opener (open in {others} other process(es))")


def _short_slabs(dirs: Sequence[str], slot_bytes: int, nslots: int) -> list[tuple[int, int]]:
    """Slots past the end of a slab file truncated or deleted while the store was closed, as
    (first slot, step) for `Index`: their pages are gone, so their rows are dropped at open
    rather than reported present until a read fails."""
    want = SlabSet(dirs, slot_bytes, nslots, create=False)  # the sizes, nothing touched
    nd = len(dirs)
    out = []
    for i, (path, full) in enumerate(zip(want.paths, want.file_bytes)):
        try:
            size = os.lstat(path).st_size
        except FileNotFoundError:
            size = 0
        if size < full:
            out.append((size // slot_bytes * nd + i, nd))
    return out
