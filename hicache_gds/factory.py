"""`open_store`: the one way adapters open a store; which one comes from the configuration.

Above both `hicache_gds.store` and `hicache_gds.remote` (the tiered store composes a `PageStore`),
so that neither imports the other's way up."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .config import Config
from .engines.base import MemKind, TransferEngine
from .store.protocol import Store

__all__ = ["open_store"]


def open_store(page_bytes: int = 0, identity: Mapping[str, Any] | None = None, *,
               config: Config | Mapping[str, Any] | None = None, read_only: bool = False,
               mem_kinds: Iterable[MemKind] = (MemKind.DRAM,), engine: TransferEngine | None = None,
               namespace_dir: str | None = None) -> Store:
    """Open the namespace of (`page_bytes`, `identity`, `config`) as the configuration asks:

    * `read_only`: a `PageReader` (writes nothing; host memory only);
    * ``remote_url`` configured: a `TieredStore` (local NVMe and the page servers' memory);
    * else a `PageStore` (read-write; `mem_kinds` the memory kinds the caller will pass, VRAM
      making ``auto`` prefer GPU-direct engines).

    `namespace_dir` instead joins an existing namespace by its directory for lookups and leases
    only (`JoinedStore`: a scheduler that holds no KV memory). `engine`: use this engine instead of
    choosing one (tests, benchmarks)."""
    if namespace_dir is not None:
        from .store.joined import JoinedStore
        return JoinedStore(namespace_dir, config if isinstance(config, Config) else None)
    if read_only:
        from .store.reader import PageReader
        return PageReader(page_bytes, identity, config=config, engine=engine)
    remote = (config.remote_url if isinstance(config, Config)
              else (config or {}).get("remote_url") or Config.load(config, ignore=_remote_keys()).remote_url)
    if remote:
        from .remote import TieredStore
        return TieredStore(page_bytes, identity, config=config, mem_kinds=mem_kinds, engine=engine)
    from .store.pagestore import PageStore
    return PageStore(page_bytes, identity, config=config, mem_kinds=mem_kinds, engine=engine)


def _remote_keys() -> tuple[str, ...]:
    from .remote.options import REMOTE_KEYS
    from .remote.tiered import TIER_KEYS
    return tuple(REMOTE_KEYS) + tuple(TIER_KEYS)
