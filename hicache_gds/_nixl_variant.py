"""Which NIXL build a process imports: ``nixl_cu12`` (pip ``nixl-cu12``) or ``nixl_cu13`` (``nixl-cu13``).

The two cannot both be imported in one process (the second fails: ``generic_type: type
"nixl_thread_sync_t" is already registered``), and SGLang's HiCacheNixl imports NIXL as
``from nixl._api import ...`` -- through NIXL's ``nixl`` meta-package, which picks a variant by
the CUDA major version torch was built for. So hicache-gds imports NIXL the way that keeps one
NIXL per process, in this order:

1. a NIXL variant is already imported in this process (SGLang got there first): that one;
2. the ``nixl`` meta-package is installed: ``nixl._api``, whatever variant it picks, so a later
   ``from nixl._api import ...`` finds the same module (when the meta-package fails, e.g. it
   wants nixl-cu12 and only nixl-cu13 is installed, the next rules decide);
3. one variant installed: that one;
4. both, without the meta-package: the one matching torch's CUDA build, else cu13.

Standard library only, so the install scripts run this file before anything is installed:
``python hicache_gds/_nixl_variant.py --extra`` prints the extra (``cu12`` / ``cu13``) that fits
the torch in that environment.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from importlib import metadata

__all__ = ["VARIANTS", "Facts", "Choice", "facts", "choose", "extra_for", "torch_cuda", "version_of"]

VARIANTS = ("cu12", "cu13")
DEFAULT = "cu13"  # what the meta-package and our tests use when no CUDA build says otherwise


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def version_of(dist: str) -> str | None:
    """The installed version of distribution `dist`, None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def torch_cuda() -> str | None:
    """The CUDA version torch was built for ('13.0'), None for a CPU build or no torch.

    Read from an imported torch, else from torch/version.py on disk without importing torch (the
    way NIXL's meta-package reads it)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return getattr(getattr(torch, "version", None), "cuda", None)
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    ns: dict = {}
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            exec(compile(f.read(), "torch/version.py", "exec"), ns)  # noqa: S102 -- torch's own constants
    except Exception:  # noqa: BLE001 -- unreadable: treat as unknown
        return None
    cuda = ns.get("cuda")
    return cuda if isinstance(cuda, str) else None


@dataclass(frozen=True)
class Facts:
    """What decides the choice: what is loaded, installed, and which CUDA torch was built for."""

    loaded: str | None
    """Variant already imported in this process."""
    meta: bool
    """A ``nixl`` package is installed: the meta-package, or a source build under that name."""
    installed: tuple[str, ...]
    """Variants importable here."""
    cuda: str | None
    """torch's CUDA build ('12.8'), None for CPU or no torch."""


@dataclass(frozen=True)
class Choice:
    modules: tuple[str, ...]
    """The ``_api`` modules to try, in order (a later one only if the earlier fails to import)."""
    reason: str
    """Why, in words (for `doctor` and error messages)."""


def facts() -> Facts:
    """The facts of this process and environment."""
    loaded = next((v for v in VARIANTS if f"nixl_{v}" in sys.modules), None)
    # `nixl`: the meta-package (or a source build of NIXL, which installs under that name)
    meta = "nixl" in sys.modules or _spec("nixl")
    return Facts(loaded, meta, tuple(v for v in VARIANTS if _spec(f"nixl_{v}")), torch_cuda())


def _by_cuda(cuda: str | None) -> str:
    major = (cuda or "").split(".")[0]
    return f"cu{major}" if f"cu{major}" in VARIANTS else DEFAULT


def choose(f: Facts) -> Choice:
    """The import order for `f` (module docstring: the rules)."""
    if f.loaded:
        return Choice((f"nixl_{f.loaded}._api",), f"nixl_{f.loaded} is already imported in this process")
    direct = sorted(f.installed, key=lambda v: v != _by_cuda(f.cuda))  # the CUDA match first
    tail = tuple(f"nixl_{v}._api" for v in direct)
    if f.meta:
        return Choice(("nixl._api",) + tail, "the nixl meta-package picks the variant (as SGLang's HiCacheNixl "
                                             "imports it), by torch's CUDA build "
                                             f"({f.cuda or 'none: CPU build or no torch'})")
    if len(f.installed) == 1:
        return Choice(tail, f"nixl-{f.installed[0]} is the only NIXL installed")
    if f.installed:
        return Choice(tail, f"both variants installed, no meta-package: nixl-{direct[0]} matches torch's CUDA "
                            f"build ({f.cuda or 'none'})")
    return Choice((), "no NIXL is installed")


def extra_for(cuda: str | None) -> str:
    """The hicache-gds extra (``cu12`` / ``cu13``) for an environment whose torch is built for `cuda`."""
    return _by_cuda(cuda)


if __name__ == "__main__":
    if sys.argv[1:] == ["--extra"]:
        print(extra_for(torch_cuda()))
    else:
        f = facts()
        print(f"{f}\n{choose(f)}")
