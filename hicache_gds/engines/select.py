"""`auto` and `ENABLE_GDS`: choose an engine from capabilities and say why.

* `ENABLE_GDS=1`: a GPU-direct engine (cuFile, compat mode included) must pass a real VRAM round
  trip on `GDS_PATH`, or opening fails with `GDSUnavailable` naming the reason.
* `ENABLE_GDS=0`: host-memory engines only.
* `auto`: GPU-direct where the client moves VRAM and the probe passes; otherwise NIXL POSIX
  through host memory, and the bounce engine where NIXL cannot load.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from ..config import Config
from ..errors import ConfigError, EngineUnavailable, GDSUnavailable
from . import create_engine, engine_class
from .base import EngineOptions, MemKind, TransferEngine
from .gds_probe import GDSProbe, probe_gds

__all__ = ["Choice", "choose_engine", "probe_once"]

log = logging.getLogger("hicache_gds.engines")
_GDS_ORDER = ("nixl-gds-mt", "nixl-gds")
_HOST_ORDER = ("nixl-posix", "bounce")


@dataclass
class Choice:
    engine: TransferEngine
    reason: str


def choose_engine(cfg: Config, probe_dir: str, mem_kinds: frozenset[MemKind] = frozenset({MemKind.DRAM})) -> Choice:
    """Create the engine `cfg` asks for (or `auto` picks) and explain the choice."""
    opts = EngineOptions.from_config(cfg)
    if cfg.engine != "auto":
        return _named(cfg, opts, probe_dir, mem_kinds)
    wants_vram = MemKind.VRAM in mem_kinds
    notes: list[str] = []
    if cfg.enable_gds == "1" or (cfg.enable_gds == "auto" and wants_vram):
        for name in _GDS_ORDER:
            probe = probe_gds(probe_dir, name)
            if probe.ok:
                eng = create_engine(name, opts)
                mode = "cuFile compat mode (no nvidia-fs)" if probe.compat_mode else "GPUDirect Storage"
                return _done(Choice(eng, f"{name}: ENABLE_GDS={cfg.enable_gds}, probe passed on {probe_dir} "
                                         f"in {mode}"))
            notes.append(f"{name}: {probe.reason}")
        if cfg.enable_gds == "1":
            raise GDSUnavailable("ENABLE_GDS=1 but no GPU-direct engine works on "
                                 f"{probe_dir}: " + "; ".join(notes))
    elif cfg.enable_gds == "auto":
        notes.append("the client moves host memory only, so a host-memory engine serves it directly")
    else:
        notes.append("ENABLE_GDS=0")
    for name in _HOST_ORDER:
        try:
            eng = create_engine(name, opts)
        except EngineUnavailable as exc:
            notes.append(str(exc))
            continue
        if not mem_kinds <= eng.capabilities.mem_kinds:
            missing = ", ".join(k.value for k in mem_kinds - eng.capabilities.mem_kinds)
            notes.append(f"{name} cannot move {missing}")
            eng.close()
            continue
        return _done(Choice(eng, f"{name}: " + "; ".join(notes)))
    raise EngineUnavailable("no engine can serve this store: " + "; ".join(notes))


def _named(cfg: Config, opts: EngineOptions, probe_dir: str, mem_kinds: frozenset[MemKind]) -> Choice:
    cls = engine_class(cfg.engine)
    gpu_direct_class = cls.uses_cufile
    if cfg.enable_gds == "0" and gpu_direct_class:
        raise ConfigError(f"engine: {cfg.engine} moves data through cuFile, but ENABLE_GDS=0 asks for the "
                          f"host path only; use nixl-posix or bounce, or set ENABLE_GDS=auto")
    if cfg.enable_gds == "1" and not gpu_direct_class:
        raise GDSUnavailable(f"ENABLE_GDS=1 but engine {cfg.engine} is not GPU-direct; "
                             f"use nixl-gds, nixl-gds-mt, kvikio or cufile, or engine=auto")
    if cfg.enable_gds == "1":
        probe = probe_gds(probe_dir, cfg.engine)
        if not probe.ok:
            raise GDSUnavailable(f"ENABLE_GDS=1 but {cfg.engine} fails on {probe_dir}: {probe.reason}")
    elif gpu_direct_class:
        # A cuFile engine is loaded into this process only after its probe passed in a subprocess:
        # libcufile can abort the whole process (seen: cufile-python as a process's first cuFile
        # user, "Assertion failure, file index :cufio-plat line :149"), and this process may be
        # the serving engine.
        probe = probe_once(probe_dir, cfg.engine)
        if not probe.ok:
            raise EngineUnavailable(f"{cfg.engine} failed its probe on {probe_dir} and is not loaded here: "
                                    f"{probe.reason}")
    eng = cls(opts)
    if not mem_kinds <= eng.capabilities.mem_kinds:
        eng.close()
        raise EngineUnavailable(f"{cfg.engine} cannot move "
                                f"{', '.join(k.value for k in mem_kinds - eng.capabilities.mem_kinds)} memory here")
    return _done(Choice(eng, f"{cfg.engine}: named in the configuration"))


_probes: dict[tuple[str, int], GDSProbe] = {}
_probes_lock = threading.Lock()


def probe_once(probe_dir: str, engine: str, timeout: float = 60.0) -> GDSProbe:
    """`probe_gds`, once per engine and file system in this process (a probe costs seconds; the
    doctor and `choose_engine` ask for the same ones)."""
    key = (engine, os.stat(probe_dir).st_dev)
    with _probes_lock:
        if key not in _probes:
            _probes[key] = probe_gds(probe_dir, engine, timeout=timeout)
        return _probes[key]


def _done(choice: Choice) -> Choice:
    log.info("hicache-gds engine %s: %s (%s)", choice.engine.name, choice.engine.capabilities.path, choice.reason)
    return choice
