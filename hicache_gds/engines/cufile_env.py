"""What this machine offers cuFile, found without ever calling into cuFile.

Facts the engines, the GDS probe and `doctor` share: is a CUDA GPU visible, which libcufile would
load, does cuFile run in compat mode (no nvidia-fs), and how large its compat-mode bounce pool
is. Nothing here opens the cuFile driver: on machines where libcufile loads but no GPU driver is
present, the driver open spins forever (`gds_probe` does the end-to-end check, in a subprocess).

This module imports no engine, so engines and the probe both depend on it and not on each other.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
from functools import lru_cache

from ..errors import EngineUnavailable

__all__ = ["gpu_present", "libcufile_loadable", "require_gpu_for_cufile", "gds_compat_mode", "cufile_bounce_pool"]


@lru_cache(maxsize=1)
def gpu_present() -> bool:
    """A CUDA device is visible (checked through torch, without loading cuFile)."""
    try:
        import torch
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001 -- any torch failure means no usable GPU
        return False


@lru_cache(maxsize=1)
def libcufile_loadable() -> str:
    """The libcufile that would load, or '' if none (looked up without calling into it)."""
    candidates = ["libcufile.so.0", "libcufile.so"]
    try:  # nvidia-cufile wheels put it under site-packages/nvidia/cu13/lib
        import nvidia  # type: ignore
        for base in nvidia.__path__:
            for sub in ("cu13/lib", "cufile/lib", "cu12/lib"):
                p = os.path.join(base, sub, "libcufile.so.0")
                if os.path.exists(p):
                    candidates.append(p)
    except ImportError:
        pass
    for name in candidates:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            return name
        except OSError:
            continue
    return ""


def require_gpu_for_cufile(engine: str) -> None:
    """Raise `EngineUnavailable` unless a GPU and libcufile are both present."""
    if not gpu_present():
        raise EngineUnavailable(f"{engine}: no CUDA GPU is visible, and cuFile hangs without one")
    if not libcufile_loadable():
        raise EngineUnavailable(f"{engine}: libcufile.so.0 is not installed (pip install nvidia-cufile)")
    # cuFile's driver open asserts (cufio-plat) in a process with no CUDA context yet.
    import torch
    torch.empty(1, device="cuda")


def gds_compat_mode() -> bool:
    """True when cuFile has no nvidia-fs driver and will run in compat mode (POSIX underneath)."""
    return not os.path.exists("/proc/driver/nvidia-fs/devcount")


def _strip_json_comments(text: str) -> str:
    # cufile.json allows // comments; drop them outside strings.
    return re.sub(r'("(?:\\.|[^"\\])*")|//[^\n]*', lambda m: m.group(1) or "", text)


SYSTEM_CUFILE_JSON = "/etc/cufile.json"
"""Where libcufile reads its settings when `CUFILE_ENV_PATH_JSON` names none."""
LIBCUFILE_POOL = ((4, 128), (1024, 64), (16384, 64))
"""libcufile's own compat-mode bounce pool: (slab KiB, buffers), when no cufile.json says otherwise."""


def cufile_bounce_pool(cufile_json: str = "") -> list[tuple[int, int]]:
    """(slab bytes, buffer count) of cuFile's compat-mode POSIX bounce pool, smallest slab first.

    Read from `CUFILE_ENV_PATH_JSON`, then `cufile_json`, then `SYSTEM_CUFILE_JSON`; libcufile's
    defaults (`LIBCUFILE_POOL`) when none says otherwise.
    """
    sizes_kb, counts = [s for s, _ in LIBCUFILE_POOL], [c for _, c in LIBCUFILE_POOL]
    for path in (os.environ.get("CUFILE_ENV_PATH_JSON", ""), cufile_json, SYSTEM_CUFILE_JSON):
        if path and os.path.isfile(path):
            try:
                with open(path) as f:
                    props = json.loads(_strip_json_comments(f.read())).get("properties", {})
                sizes_kb = [int(x) for x in props.get("posix_pool_slab_size_kb", sizes_kb)]
                counts = [int(x) for x in props.get("posix_pool_slab_count", counts)]
            except (OSError, ValueError, TypeError):
                pass
            break
    return sorted(zip((s << 10 for s in sizes_kb), counts))
