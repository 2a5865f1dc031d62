"""Import NIXL once, the way this environment allows, and name what was imported.

Which build (nixl-cu12 / nixl-cu13, directly or through the ``nixl`` meta-package) is decided by
`_nixl_variant.choose`, so that hicache-gds and SGLang's HiCacheNixl always share one NIXL in a
process (the two variants cannot both be imported). `nixl_info()` says what was chosen and why.
"""

from __future__ import annotations

import os
import threading
import uuid
from types import ModuleType
from typing import Any

from . import _nixl_variant
from .errors import EngineUnavailable

__all__ = ["nixl_api", "nixl_info", "new_agent", "loadable_plugins", "env_defaults", "INSTALL_HINT"]

INSTALL_HINT = ("pip install 'hicache-gds[cu13]' (CUDA 13) or 'hicache-gds[cu12]' (CUDA 12), "
                "or NIXL's meta-package: pip install nixl")


def env_defaults(rdma_root: str = "/sys/class/infiniband") -> dict[str, str]:
    """The environment this module sets where unset, before NIXL loads.

    UCX's InfiniBand module makes every process that created a UCX backend crash at exit (rc 139,
    in a bundled libnl during _dl_fini) on machines without RDMA devices; there it has nothing to
    drive, so it is left out. Where `rdma_root` lists a device it stays: the process may share UCX
    with HiCacheNixl or NIXL-based PD disaggregation, whose RDMA must not be turned off for it."""
    env = {"NIXL_LOG_LEVEL": "ERROR"}
    try:
        has_rdma = bool(os.listdir(rdma_root))
    except OSError:
        has_rdma = False
    if not has_rdma:
        env["UCX_MODULES"] = "^ib"
    return env


for _k, _v in env_defaults().items():
    os.environ.setdefault(_k, _v)

_api: ModuleType | None = None
_info: dict[str, Any] = {}
_lock = threading.Lock()


def _dist_version(module: str) -> str:
    """'nixl-cu13 1.5.1' for module 'nixl_cu13._api' (the distribution that installed it)."""
    top = module.split(".")[0]
    dist = top.replace("_", "-")
    v = _nixl_variant.version_of(dist)
    return f"{dist} {v}" if v else f"{dist} (version unknown)"


def nixl_api() -> ModuleType:
    """The `_api` module of the NIXL this process uses; `EngineUnavailable` when none imports."""
    global _api
    with _lock:
        if _api is None:
            facts = _nixl_variant.facts()
            choice = _nixl_variant.choose(facts)
            errors = []
            for name in choice.modules:
                try:
                    api = __import__(name, fromlist=["nixl_agent"])
                except ImportError as exc:
                    errors.append(f"{name}: {exc}")
                    continue
                _api = api
                break
            _info.clear()
            _info.update(installed=list(facts.installed), meta_package=_nixl_variant.version_of("nixl"), torch_cuda=facts.cuda,
                         chosen_by=choice.reason, errors=errors)
            if _api is None:
                _info.update(module=None, variant=None, version=None)
                raise EngineUnavailable(f"NIXL cannot be imported ({choice.reason}"
                                        + (f"; {'; '.join(errors)}" if errors else "") + f"): {INSTALL_HINT}")
            real = _api.__name__  # the meta-package's nixl._api is the variant's own module
            top = real.split(".")[0]
            _info.update(module=top, variant=top[len("nixl_"):] if top.startswith("nixl_") else None,
                         version=_dist_version(real))
        return _api


def nixl_info() -> dict[str, Any]:
    """What `nixl_api` imported and why, as plain JSON types (imports NIXL if not done yet).

    Keys: module ('nixl_cu13'), variant ('cu13'), version ('nixl-cu13 1.5.1'), installed
    (variants importable here), meta_package (its version or None), torch_cuda (torch's CUDA
    build), chosen_by (the rule, in words), errors (imports tried and failed), and error (why
    none imported, when none did)."""
    try:
        nixl_api()
    except EngineUnavailable as exc:
        return dict(_info, error=str(exc))
    return dict(_info)


def new_agent(role: str, backends: list[str] | None = None, **config: Any) -> Any:
    """A NIXL agent with a unique name, safe to share between threads (NIXL_THREAD_SYNC_RW)."""
    api = nixl_api()
    cfg = api.nixl_agent_config(backends=backends or [], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
                                **config)
    return api.nixl_agent(f"hicache-gds-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}", cfg)


def loadable_plugins() -> dict[str, list[str]]:
    """Plugins NIXL finds, with the memory kinds each supports ([] when it cannot load here)."""
    agent = new_agent("probe", enable_prog_thread=False)
    out = {}
    for plugin in agent.get_plugin_list():
        if plugin in ("GDS", "GDS_MT"):
            continue  # probing them can hang where libcufile loads without a GPU; see gds probe
        try:
            out[plugin] = list(agent.get_plugin_mem_types(plugin))
        except Exception:  # noqa: BLE001 -- NIXL raises plain Exception subclasses
            out[plugin] = []
    return out
