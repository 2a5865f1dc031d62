"""hicache-gds for SGLang: the HiCache L3 storage backend `HiCacheGDS` and the plugin that names it `gds`.

Select it with ``--hicache-storage-backend gds`` (after ``pip install hicache-gds-sglang``) or,
without the plugin's hooks, with ``--hicache-storage-backend dynamic
--hicache-storage-backend-extra-config
'{"backend_name":"gds","module_path":"hicache_gds_sglang","class_name":"HiCacheGDS","interface_v1":1}'``.

`HiCacheGDS` is imported on first use, so the entry point (`register`) stays cheap in SGLang's
processes that never build a backend.
"""

from typing import Any

from .plugin import dynamic_command, register

__version__ = "0.1.0"

__all__ = ["HiCacheGDS", "GDSLinker", "register", "dynamic_command", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "HiCacheGDS":
        from .backend import HiCacheGDS
        return HiCacheGDS
    if name == "GDSLinker":
        from .linker import GDSLinker
        return GDSLinker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
