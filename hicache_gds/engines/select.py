"""`auto` and `ENABLE_GDS`: choose an engine by what engines declare (`Traits`), and say why.

Every registered engine (built-in or from the entry-point group) is a candidate; none is named here.

* `ENABLE_GDS=1`: an engine that moves VRAM through cuFile (`Traits.uses_cufile`) must pass a real
  VRAM round trip on `GDS_PATH` (`probe_gds`, in a subprocess), or opening fails with
  `GDSUnavailable` naming each candidate's reason.
* `ENABLE_GDS=0`: engines that do not use cuFile only.
* `auto`: a cuFile engine where the client moves VRAM and its probe passes; otherwise the best
  engine that moves the client's memory kinds without cuFile.

Among candidates, a higher `Traits.auto_rank` goes first (ties by name); rank 0 is used only when
named. Engines that move bytes to page servers (`Traits.remote`) never serve a store's files, and
engines that need a GPU are skipped where none is visible.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from ..config import Config
from ..errors import ConfigError, EngineUnavailable, GDSUnavailable
from . import engine_class, engine_names
from .base import EngineOptions, MemKind, TransferEngine
from .cufile_env import gpu_present
from .gds_probe import GDSProbe, probe_gds

__all__ = ["Choice", "choose_engine", "probe_once", "candidates"]

log = logging.getLogger("hicache_gds.engines")


@dataclass
class Choice:
    engine: TransferEngine
    reason: str


def candidates(notes: list[str] | None = None) -> list[type[TransferEngine]]:
    """Engine classes `auto` may choose (auto_rank > 0, not remote), best first; an engine that
    cannot be imported is left out, with why in `notes`."""
    out = []
    for name in engine_names():
        try:
            cls = engine_class(name)
        except (EngineUnavailable, TypeError) as exc:
            if notes is not None:
                notes.append(str(exc))
            continue
        if cls.traits.auto_rank > 0 and not cls.traits.remote:
            out.append((name, cls))
    out.sort(key=lambda nc: (-nc[1].traits.auto_rank, nc[0]))
    return [cls for _, cls in out]


def _names(pred) -> str:  # noqa: ANN001 -- a predicate over Traits
    """The registered engines whose traits satisfy `pred`, for error messages."""
    out = []
    for name in engine_names():
        try:
            if pred(engine_class(name).traits):
                out.append(name)
        except (EngineUnavailable, TypeError):
            continue
    return ", ".join(out) or "(none registered)"


def choose_engine(cfg: Config, probe_dir: str, mem_kinds: frozenset[MemKind] = frozenset({MemKind.DRAM})) -> Choice:
    """Create the engine `cfg` asks for (or `auto` picks) and explain the choice."""
    opts = EngineOptions.from_config(cfg)
    if cfg.engine != "auto":
        return _named(cfg, opts, probe_dir, mem_kinds)
    wants_vram = MemKind.VRAM in mem_kinds
    notes: list[str] = []
    ranked = candidates(notes)
    if cfg.enable_gds == "1" or (cfg.enable_gds == "auto" and wants_vram):
        for cls in ranked:
            t = cls.traits
            if not t.uses_cufile:
                continue
            if not mem_kinds <= t.mem_kinds:
                notes.append(f"{cls.name} cannot move {_kinds(mem_kinds - t.mem_kinds)}")
                continue
            probe = probe_gds(probe_dir, cls.name)
            if probe.ok:
                eng = cls(opts)
                mode = "cuFile compat mode (no nvidia-fs)" if probe.compat_mode else "GPUDirect Storage"
                return _done(Choice(eng, f"{cls.name}: ENABLE_GDS={cfg.enable_gds}, probe passed on {probe_dir} "
                                         f"in {mode}"))
            notes.append(f"{cls.name}: {probe.reason}")
        if cfg.enable_gds == "1":
            raise GDSUnavailable("ENABLE_GDS=1 but no GPU-direct engine works on "
                                 f"{probe_dir}: " + ("; ".join(notes) or "no cuFile engine is registered for auto"))
    elif cfg.enable_gds == "auto":
        notes.append("the client moves host memory only, so a host-memory engine serves it directly")
    else:
        notes.append("ENABLE_GDS=0")
    for cls in ranked:
        t = cls.traits
        if t.uses_cufile:
            continue
        if not mem_kinds <= t.mem_kinds:
            notes.append(f"{cls.name} cannot move {_kinds(mem_kinds - t.mem_kinds)}")
            continue
        if t.needs_gpu and not gpu_present():  # asked only then: it imports torch
            notes.append(f"{cls.name} needs a CUDA GPU and none is visible")
            continue
        try:
            eng = cls(opts)
        except EngineUnavailable as exc:
            notes.append(str(exc))
            continue
        if not mem_kinds <= eng.capabilities.mem_kinds:
            notes.append(f"{cls.name} cannot move {_kinds(mem_kinds - eng.capabilities.mem_kinds)}")
            eng.close()
            continue
        return _done(Choice(eng, f"{cls.name}: " + "; ".join(notes)))
    raise EngineUnavailable("no engine can serve this store: " + "; ".join(notes))


def _kinds(kinds: frozenset[MemKind]) -> str:
    return ", ".join(sorted(k.value for k in kinds))


def _named(cfg: Config, opts: EngineOptions, probe_dir: str, mem_kinds: frozenset[MemKind]) -> Choice:
    cls = engine_class(cfg.engine)
    t = cls.traits
    if t.remote:
        raise ConfigError(f"engine: {cfg.engine} moves pages to page servers' memory, not to files; name a "
                          f"file engine ({_names(lambda x: not x.remote)}) or auto, and reach page servers "
                          f"through remote_url")
    if cfg.enable_gds == "0" and t.uses_cufile:
        raise ConfigError(f"engine: {cfg.engine} moves data through cuFile, but ENABLE_GDS=0 asks for the "
                          f"host path only; use {_names(lambda x: not x.uses_cufile and not x.remote)}, or set "
                          f"ENABLE_GDS=auto")
    if cfg.enable_gds == "1" and not t.uses_cufile:
        raise GDSUnavailable(f"ENABLE_GDS=1 but engine {cfg.engine} is not GPU-direct; "
                             f"use {_names(lambda x: x.uses_cufile)}, or engine=auto")
    if cfg.enable_gds == "1":
        probe = probe_gds(probe_dir, cfg.engine)
        if not probe.ok:
            raise GDSUnavailable(f"ENABLE_GDS=1 but {cfg.engine} fails on {probe_dir}: {probe.reason}")
    elif t.uses_cufile:
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
        raise EngineUnavailable(f"{cfg.engine} cannot move {_kinds(mem_kinds - eng.capabilities.mem_kinds)} "
                                f"memory here")
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
