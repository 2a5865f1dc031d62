"""Is each registered engine usable here? Checked as its declared traits say, never by its name.

`check_engines` (what `hicache-gds doctor` lists) takes every engine in the registry, built-in or
from the entry-point group, and reports its traits, whether it is installed (`Traits.requires`,
looked up without importing) and whether it works here:

* one that uses cuFile gets a 1 MiB VRAM round trip in a subprocess with a timeout
  (`select.probe_once`), only where a GPU is visible, because cuFile hangs on machines without one;
* one that needs a GPU is not built without one;
* one that moves pages to page servers' memory is listed, not probed;
* any other gets a 1 MiB host-memory round trip through a new instance on the given directory, in
  this process, with random bytes read back into a poisoned buffer and compared.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Sequence

import numpy as np

from ..errors import EngineUnavailable
from ..memory import HostBuffer
from . import engine_class, engine_names, registry
from .base import EngineOptions, MemKind, Op
from .select import probe_once

__all__ = ["check_engines"]


def _installed(modules: Sequence[str]) -> bool:
    """One of `modules` can be found (looked up, not imported: importing kvikio maps libcufile)."""
    import importlib.util
    for m in modules:
        try:
            if importlib.util.find_spec(m) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return not modules


def _host_round_trip(cls: Any, opts: Any, directory: str) -> tuple[bool, str]:
    """Write 1 MiB of random host memory through a new `cls` engine into a file in `directory`,
    read it back into a poisoned buffer and compare the bytes: (ok, what happened)."""
    n = 1 << 20
    fd, path = tempfile.mkstemp(prefix=".hicache-gds-doctor-", dir=directory)
    os.ftruncate(fd, n)
    os.close(fd)
    src, dst = HostBuffer(n, pinned=False), HostBuffer(n, pinned=False)
    try:
        src.numpy()[:] = np.random.default_rng().integers(0, 256, n, dtype=np.uint8)
        dst.numpy()[:] = 0xEE
        eng = cls(opts)
        try:
            for b in (src, dst):
                eng.register_memory(b.addr, n, MemKind.DRAM)
            fid = eng.open_file(path)
            try:
                for op, b in ((Op.WRITE, src), (Op.READ, dst)):
                    with eng.submit(op, MemKind.DRAM, np.array([[b.addr, n]], dtype=np.uint64),
                                    np.array([[fid, 0]], dtype=np.uint64)) as t:
                        t.wait(20.0)
            finally:
                eng.close_file(fid)
            path_words = eng.capabilities.path
        finally:
            eng.close()
        if not np.array_equal(src.numpy(), dst.numpy()):
            return False, "1 MiB host-memory round trip: the bytes read back differ"
        return True, f"1 MiB host-memory round trip byte-exact ({path_words})"
    except Exception as exc:  # noqa: BLE001 -- any engine's failure is reported, not raised
        return False, f"{type(exc).__name__}: {exc}"[:300]
    finally:
        src.close()
        dst.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def check_engines(cfg: Any, probe_dir: str, gpu: bool, timeout: float = 60.0) -> dict[str, Any]:
    """Every registered engine: its declared traits, whether it is installed, whether it works here
    (checked as its traits say: module docstring). `cfg`: the `Config` whose engine options the
    host round trips use (None: the defaults)."""
    opts = EngineOptions.from_config(cfg) if cfg is not None else EngineOptions()
    out: dict[str, Any] = {}
    for name in engine_names():
        hint = registry.get(name, ("", ""))[1]
        try:
            cls = engine_class(name)
        except (EngineUnavailable, TypeError) as exc:
            out[name] = {"installed": False, "traits": None, "ok": False, "reason": str(exc)}
            continue
        t = cls.traits
        entry: dict[str, Any] = {"installed": True, "traits": {
            "mem_kinds": sorted(k.value for k in t.mem_kinds), "uses_cufile": t.uses_cufile,
            "needs_gpu": t.needs_gpu, "remote": t.remote, "auto_rank": t.auto_rank, "requires": list(t.requires)},
            "summary": t.describe()}
        if not _installed(t.requires):
            entry.update(installed=False, ok=False, reason="not installed" + (f" ({hint})" if hint else ""))
        elif t.remote:
            entry.update(ok=None, reason="not probed: it moves pages to page servers' memory (the remote tier, "
                                         "`hicache-gds serve`), not to files")
        elif (t.needs_gpu or t.uses_cufile) and not gpu:
            entry.update(ok=False, reason="not probed: no CUDA GPU is visible")
        elif t.uses_cufile:
            p = probe_once(probe_dir, name, timeout=timeout)
            entry.update(ok=p.ok, compat_mode=p.compat_mode, reason=p.reason)
        else:
            ok, why = _host_round_trip(cls, opts, probe_dir)
            entry.update(ok=ok, reason=why)
        out[name] = entry
    return out
