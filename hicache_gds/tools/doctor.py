"""`hicache-gds doctor`: can this machine run hicache-gds, and along which path?

Reports GPUs, the driver and the CUDA versions found (the driver's, torch's build), which NIXL
build was imported (nixl-cu12 / nixl-cu13) and why, whether nvidia-fs is loaded, which cufile.json
applies and its compat bounce pool, whether cuFile will run in compat mode on `GDS_PATH`'s file
system, the NIXL plugins that load, O_DIRECT, free space and how full each `GDS_PATH` file system
is, the capacity a new namespace would get there (and which idle namespaces it would remove), the
engine `auto` picks and why, and every registered engine -- built-in or from the entry-point
group -- with its declared traits, whether it is installed and whether it works here; then the
read rate of each `GDS_PATH` directory, measured, and the prefill rate below which loading from it
beats recomputing, for ``--model`` or common shapes (`breakeven`).

How an engine is checked follows from its traits (`engines.base.Traits`), never its name: one
that uses cuFile gets a 1 MiB VRAM round trip in a subprocess (`engines.gds_probe.probe_gds`,
with a timeout), only when a GPU is visible, because cuFile hangs on machines without one; one
that needs a GPU is not built without one; one that moves pages to page servers is listed, not
probed; any other gets a 1 MiB host-memory round trip on `GDS_PATH`, in this process.

Exit status: 1 when a problem would stop the store from opening as configured (`ENABLE_GDS=1`
cannot be honoured, the configured engine cannot run, a `GDS_PATH` directory is unusable, a bad
setting), else 0. Warnings (GDS_PATH unset, compat mode, ...) do not change it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Sequence

__all__ = ["fs_info", "o_direct_ok", "collect", "render_text", "main", "GDS_FILE_SYSTEMS"]

GDS_FILE_SYSTEMS = frozenset(("ext4", "xfs", "lustre", "wekafs", "gpfs", "beegfs", "nfs", "nfs4"))
"""File systems cuFile can drive with P2P DMA when nvidia-fs is loaded; others run in compat mode."""


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def fs_info(path: str) -> dict[str, str]:
    """The mount holding `path`: {"mount", "fstype", "device", "options"} from /proc/mounts."""
    real = os.path.realpath(path)
    best = {"mount": "/", "fstype": "unknown", "device": "unknown", "options": ""}
    try:
        with open("/proc/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    best_len = -1
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        dev, mnt, fstype, opts = _unescape(parts[0]), _unescape(parts[1]), parts[2], parts[3]
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= best_len:     # the last of equal mounts is the visible one
            best, best_len = {"mount": mnt, "fstype": fstype, "device": dev, "options": opts}, len(mnt)
    return best


def o_direct_ok(directory: str) -> tuple[bool, str]:
    """Write and read back 4 KiB with O_DIRECT in `directory`: (works, why not)."""
    try:
        fd, path = tempfile.mkstemp(prefix=".hicache-gds-odirect-", dir=directory)
        os.close(fd)
    except OSError as exc:
        return False, f"cannot create a file: {exc.strerror}"
    buf = mmap.mmap(-1, 4096)
    try:
        buf.write(os.urandom(4096))
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        try:
            if os.pwrite(fd, buf, 0) != 4096:
                return False, "short O_DIRECT write"
            back = mmap.mmap(-1, 4096)
            try:
                if os.preadv(fd, [back], 0) != 4096 or back[:] != buf[:]:
                    return False, "O_DIRECT read-back differs"
            finally:
                back.close()
        finally:
            os.close(fd)
        return True, ""
    except OSError as exc:
        return False, f"O_DIRECT: {exc.strerror or exc}"
    finally:
        buf.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def _gpus() -> dict[str, Any]:
    from ..engines.cufile_env import gpu_present
    out: dict[str, Any] = {"visible": gpu_present(), "devices": [], "driver": None, "source": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=index,name,driver_version,memory.total,pci.bus_id",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            for line in r.stdout.strip().splitlines():
                idx, name, drv, mem, bus = (x.strip() for x in (line.split(",") + [""] * 5)[:5])
                out["devices"].append({"index": idx, "name": name, "memory": mem, "pci": bus})
                out["driver"] = drv
            out["source"] = "nvidia-smi" if r.returncode == 0 else f"nvidia-smi exit {r.returncode}"
            if r.returncode == 0:  # the header names the newest CUDA the driver supports
                head = subprocess.run([smi], capture_output=True, text=True, timeout=20).stdout
                m = re.search(r"CUDA Version:\s*([0-9.]+)", head)
                out["driver_cuda"] = m.group(1) if m else None
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["source"] = f"nvidia-smi failed: {exc}"
    try:
        import torch
        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        if out["visible"] and not out["devices"]:
            out["devices"] = [{"index": str(i), "name": torch.cuda.get_device_name(i)}
                              for i in range(torch.cuda.device_count())]
            out["source"] = "torch"
    except Exception as exc:  # noqa: BLE001 -- torch missing or broken: no GPU use either way
        out["torch"] = f"unavailable ({type(exc).__name__})"
    return out


def _nvidia_fs() -> dict[str, Any]:
    loaded = os.path.exists("/proc/driver/nvidia-fs")
    out: dict[str, Any] = {"loaded": loaded}
    try:
        with open("/proc/driver/nvidia-fs/version") as f:
            out["version"] = f.read().strip()
    except OSError:
        pass
    return out


def _cufile(cfg: Any) -> dict[str, Any]:
    from ..engines.cufile_env import cufile_bounce_pool
    env = os.environ.get("CUFILE_ENV_PATH_JSON", "")
    out: dict[str, Any] = {}
    if env and os.path.isfile(env):
        out.update(file=env, chosen_by="CUFILE_ENV_PATH_JSON")
    elif cfg is not None and cfg.cufile_json and os.path.isfile(cfg.cufile_json):
        out.update(file=cfg.cufile_json, chosen_by="HICACHE_GDS_CUFILE_JSON")
    elif os.path.isfile("/etc/cufile.json"):
        out.update(file="/etc/cufile.json", chosen_by="/etc/cufile.json")
    else:
        out.update(file=None, chosen_by="libcufile's built-in defaults")
    if env and not os.path.isfile(env):
        out["warning"] = f"CUFILE_ENV_PATH_JSON={env} does not exist"
    pool = cufile_bounce_pool(cfg.cufile_json if cfg is not None else "")
    out["bounce_pool"] = [{"slab_bytes": s, "count": c} for s, c in pool]
    out["max_descs_compat"] = min((c for s, c in pool if s > 4096), default=0)
    return out


def _cufile_mode(fs: dict[str, str], nvfs: bool) -> tuple[bool, str]:
    """(compat mode, why) for files on `fs`."""
    if not nvfs:
        return True, "nvidia-fs is not loaded, so cuFile does POSIX IO through its bounce buffers"
    if fs["fstype"] not in GDS_FILE_SYSTEMS:
        return True, f"{fs['fstype']} is not a file system cuFile drives with P2P DMA"
    if fs["fstype"] == "ext4" and "data=journal" in fs["options"]:
        return True, "ext4 with data=journal is not supported by GDS"
    return False, f"nvidia-fs is loaded and {fs['fstype']} on {fs['device']} supports GPUDirect Storage"


def _udev_hint(path: str) -> str:
    """cuFile refuses files on a disk udev has no data for (seen on VMs); name the fix."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    node = f"/run/udev/data/b{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        with open(node) as f:
            if "ID_FS_USAGE=" in f.read():
                return ""
    except OSError:
        pass
    return (f"{node} lacks ID_FS_USAGE: cuFile may refuse to register files here (err 5027); "
            f"write E:ID_FS_USAGE=filesystem, E:ID_FS_TYPE=..., E:DEVTYPE=disk lines to it (test machines)")


def _directory(path: str, gpu: bool, nvfs: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"path": path, "exists": os.path.isdir(path)}
    if not out["exists"]:
        return out
    fs = fs_info(path)
    st = os.statvfs(path)
    ok, why = o_direct_ok(path)
    compat, reason = _cufile_mode(fs, nvfs)
    out.update(fs=fs, writable=os.access(path, os.W_OK | os.X_OK), o_direct=ok, o_direct_error=why,
               free_bytes=st.f_bavail * st.f_frsize, cufile_compat_mode=compat, cufile_mode_reason=reason)
    if gpu:
        out["udev_hint"] = _udev_hint(path)
    return out


def _nixl() -> dict[str, Any]:
    from .._nixl import loadable_plugins, nixl_info
    out: dict[str, Any] = nixl_info()
    out["version"] = out.get("version") or "not installed"
    out["plugins"] = {}
    if not out.get("error"):
        try:
            out["plugins"] = loadable_plugins()
        except Exception as exc:  # noqa: BLE001 -- NIXL broken
            out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _remote(rdma_root: str = "/sys/class/infiniband") -> dict[str, Any]:
    """What the remote tier's UCX would run over here: RDMA devices and the UCX settings in force."""
    try:
        rdma = sorted(os.listdir(rdma_root))
    except OSError:
        rdma = []
    env = {k: os.environ[k] for k in ("UCX_NET_DEVICES", "UCX_TLS", "UCX_MODULES") if os.environ.get(k)}
    ib_off = "^ib" in env.get("UCX_MODULES", "")
    if rdma and not ib_off:
        over = f"RDMA (InfiniBand/RoCE devices {', '.join(rdma)}) where UCX's ib transports reach the peer, else tcp"
    else:
        over = "tcp between hosts, cma/shared memory within one" + (
            " (UCX_MODULES excludes ib)" if ib_off and rdma else " (no RDMA device here)")
    from ..remote.trust import SECRET_FILE_ENV, load_secret
    try:
        trust = (f"page servers must sign their records with the cluster secret "
                 f"({os.environ.get(SECRET_FILE_ENV) or 'from the environment'})" if load_secret() else
                 "no cluster secret: any writer to Redis can inject a page server (set " + SECRET_FILE_ENV + ")")
    except (OSError, ValueError) as exc:
        trust = f"cluster secret unusable: {exc}"
    from ..remote.ucx import tcp_defaults
    seg = {k: v for k, v in os.environ.items() if k in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE")}
    tcp_defaults(seg)  # what the tier's agents would be made with (page servers publish the send size)
    return {"rdma_devices": rdma, "ucx_env": env, "transports": over, "trust": trust,
            "tcp_segments": {"send": seg["UCX_TCP_TX_SEG_SIZE"], "receive": seg["UCX_TCP_RX_SEG_SIZE"]}}


def _capacity(cfg: Any, roots: list[str]) -> dict[str, Any]:
    """The capacity a new namespace would get on `roots`, and what the file systems look like."""
    from ..slabs.capacity import default_budget
    if cfg is None or not roots:
        return {}
    b = default_budget(roots, cfg.capacity_fraction, cfg.max_fill, detail=True)
    out: dict[str, Any] = {
        "configured": cfg.capacity or None, "capacity_fraction": cfg.capacity_fraction, "max_fill": cfg.max_fill,
        "default_per_namespace": b.total, "default_how": b.how,
        "dirs": [{"path": s.root, "fill": round(s.fill, 4), "available": s.available, "total": s.total,
                  "hicache_namespaces": s.namespaces, "hicache_held": s.held, "hicache_idle_namespaces":
                  s.idle_namespaces, "hicache_idle": s.idle, "open_by": list(s.open_by)} for s in b.dirs]}
    if not cfg.capacity and b.per_dir < 4096:
        out["problem"] = str(b.no_room(cfg.max_fill))
    return out


def _major(version: Any) -> int | None:
    m = re.match(r"(\d+)", str(version or ""))
    return int(m.group(1)) if m else None


def _cuda_mismatch(nixl: dict[str, Any], gpu: dict[str, Any]) -> list[str]:
    """Warnings where the NIXL build does not fit torch's CUDA build or the driver: its GDS plugins
    load the CUDA runtime of their own major version."""
    out = []
    built = _major((nixl.get("variant") or "")[2:])
    if built is None:
        return out
    torch_major = _major(gpu.get("torch_cuda"))
    if torch_major is not None and torch_major != built:
        out.append(f"{nixl['version']} is built for CUDA {built} but torch for CUDA {gpu['torch_cuda']}: "
                   f"install hicache-gds[cu{torch_major}] instead (one NIXL build per process)")
    driver = _major(gpu.get("driver_cuda"))
    if driver is not None and driver < built:
        out.append(f"{nixl['version']} needs a driver for CUDA {built}; this driver supports CUDA "
                   f"{gpu['driver_cuda']}: install hicache-gds[cu{driver}] or update the driver")
    return out


def _auto(cfg: Any, probe_root: str, kinds: Sequence[str]) -> dict[str, Any]:
    from ..engines.base import MemKind
    from ..engines.select import choose_engine
    from ..errors import HiCacheGDSError
    tmp = tempfile.mkdtemp(prefix=".hicache-gds-doctor.", dir=probe_root)
    try:
        choice = choose_engine(cfg, tmp, frozenset(MemKind(k) for k in kinds))
        try:
            return {"ok": True, "engine": choice.engine.name, "path": choice.engine.capabilities.path,
                    "reason": choice.reason.replace(tmp, probe_root)}
        finally:
            choice.engine.close()
    except (HiCacheGDSError, ImportError, ValueError) as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}".replace(tmp, probe_root)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def collect(gds_path: str | None = None, probe_timeout: float = 60.0) -> dict[str, Any]:
    """Everything `doctor` reports, as plain JSON types; `problems` non-empty means exit 1."""
    from .. import __version__
    from ..config import Config
    from ..errors import ConfigError
    problems: list[str] = []
    warnings: list[str] = []
    overrides = {"gds_path": gds_path} if gds_path else {}
    try:
        cfg = Config.load(overrides)
    except ConfigError as exc:
        cfg = None
        problems.append(f"configuration: {exc}")
    rep: dict[str, Any] = {"version": __version__, "python": platform.python_version(),
                           "platform": platform.platform()}
    rep["config"] = ({"enable_gds": cfg.enable_gds, "engine": cfg.engine, "gds_path": list(cfg.gds_path),
                      "sources": {k: v for k, v in cfg.sources.items() if v != "default"}} if cfg else None)
    gpu = _gpus()
    rep["gpu"] = gpu
    nvfs = _nvidia_fs()
    rep["nvidia_fs"] = nvfs
    rep["cufile"] = _cufile(cfg)
    if rep["cufile"].get("warning"):
        warnings.append(rep["cufile"]["warning"])
    dirs = list(cfg.gds_path) if cfg else []
    if not dirs:
        warnings.append("GDS_PATH is not set: the store will not open; checked the current directory instead")
    rep["gds_path"] = [_directory(d, gpu["visible"], nvfs["loaded"]) for d in (dirs or [os.getcwd()])]
    for d in rep["gds_path"]:
        if not d["exists"]:
            problems.append(f"GDS_PATH: {d['path']} does not exist")
        elif not d["writable"]:
            problems.append(f"GDS_PATH: {d['path']} is not writable")
        elif not d["o_direct"]:
            (problems if cfg and cfg.direct_io and dirs else warnings).append(
                f"{d['path']}: {d['o_direct_error']} ({d['fs']['fstype']}); set HICACHE_GDS_DIRECT_IO=0 or "
                f"use a real disk")
        if d.get("udev_hint"):
            warnings.append(d["udev_hint"])
    usable = [d["path"] for d in rep["gds_path"] if d.get("writable")]
    rep["capacity"] = _capacity(cfg, usable if dirs else [])
    if rep["capacity"].get("problem"):
        problems.append(rep["capacity"]["problem"])
    probe_root = usable[0] if usable else tempfile.gettempdir()
    rep["nixl"] = _nixl()
    rep["remote"] = _remote()
    from ..engines.diagnose import check_engines
    rep["engines"] = check_engines(cfg, probe_root, gpu["visible"], probe_timeout)
    if rep["nixl"].get("error"):
        warnings.append(f"NIXL: {rep['nixl']['error']}")
    warnings.extend(_cuda_mismatch(rep["nixl"], gpu))
    rep["engine_auto"] = {}
    if cfg is not None:
        for label, kinds in (("host_memory", ("DRAM",)), ("device_memory", ("VRAM",))):
            if label == "device_memory" and not gpu["visible"]:
                continue
            rep["engine_auto"][label] = res = _auto(cfg, probe_root, kinds)
            if not res["ok"]:
                what = ("ENABLE_GDS=1 cannot be honoured" if cfg.enable_gds == "1"
                        else f"engine {cfg.engine} cannot serve {label.replace('_', ' ')}")
                problems.append(f"{what}: {res['error']}")
    if cfg is not None and cfg.enable_gds == "1" and not gpu["visible"] and not any(
            "ENABLE_GDS=1" in p for p in problems):
        problems.append("ENABLE_GDS=1 cannot be honoured: no CUDA GPU is visible")
    if nvfs["loaded"] is False and gpu["visible"]:
        warnings.append("nvidia-fs is not loaded: GPU-direct engines run in cuFile compat mode")
    rep["problems"], rep["warnings"], rep["ok"] = problems, warnings, not problems
    return rep


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KiB"


def _gib(n: int) -> str:
    from ..slabs.capacity import gib
    return gib(n)


def render_text(rep: dict[str, Any]) -> str:
    """The human report of `collect()`."""
    g, out = rep["gpu"], []
    out.append(f"hicache-gds doctor: hicache-gds {rep['version']}, Python {rep['python']}, {rep['platform']}")
    if g["devices"]:
        devs = "; ".join(f"{d['index']}: {d['name']} {d.get('memory', '')}".strip() for d in g["devices"])
        out.append(f"GPU          : {devs} (driver {g['driver'] or '?'}, via {g['source']})")
    else:
        out.append(f"GPU          : none visible (nvidia-smi {'found' if g['source'] else 'not found'}; "
                   f"torch {g.get('torch')}, CUDA {'available' if g['visible'] else 'not available'})")
    nv = rep["nvidia_fs"]
    out.append("nvidia-fs    : " + (f"loaded ({nv.get('version', '?')})" if nv["loaded"]
                                    else "not loaded (/proc/driver/nvidia-fs absent): cuFile runs in compat mode"))
    c = rep["cufile"]
    pool = ", ".join(f"{_size(p['slab_bytes'])} x{p['count']}" for p in c["bounce_pool"])
    out.append(f"cufile.json  : {c['file'] or '(none)'} (chosen by {c['chosen_by']})")
    out.append(f"  bounce pool: {pool}; in compat mode a GDS request keeps <= {c['max_descs_compat']} "
               f"descriptors")
    for d in rep["gds_path"]:
        if not d["exists"]:
            out.append(f"GDS_PATH     : {d['path']}: does not exist")
            continue
        fs = d["fs"]
        out.append(f"GDS_PATH     : {d['path']} ({fs['fstype']} on {fs['device']}, mount {fs['mount']}), "
                   f"{_gib(d['free_bytes'])} free, O_DIRECT {'ok' if d['o_direct'] else d['o_direct_error']}")
        out.append(f"  cuFile     : {'compat mode' if d['cufile_compat_mode'] else 'GPUDirect Storage'}: "
                   f"{d['cufile_mode_reason']}")
    cap = rep.get("capacity") or {}
    if cap:
        for d in cap["dirs"]:
            out.append(f"  space      : {d['path']}: {d['fill']:.0%} full; {d['hicache_namespaces']} hicache-gds "
                       f"namespace(s) hold {_gib(d['hicache_held'])}"
                       + (f", {d['hicache_idle_namespaces']} of them idle ({_gib(d['hicache_idle'])}: removed, least "
                          f"recently used first, when a new namespace needs room)" if d["hicache_idle_namespaces"]
                          else "") + " (`hicache-gds ls`)")
        out.append("capacity     : " + (f"{_gib(cap['configured'])} per namespace (configured)" if cap["configured"]
                                        else f"a new namespace would get {_gib(cap['default_per_namespace'])} "
                                             f"({cap['default_how']})"))
    cuda = [f"driver supports CUDA {g['driver_cuda']}" if g.get("driver_cuda") else "no driver CUDA version",
            f"torch {g.get('torch')} built for " + (f"CUDA {g['torch_cuda']}" if g.get("torch_cuda") else "CPU only")]
    out.append(f"CUDA         : {'; '.join(cuda)}")
    n = rep["nixl"]
    if n.get("module"):
        built = f"CUDA {n['variant'][2:]} build" if n.get("variant") else "a source build"
        out.append(f"NIXL         : {n['version']} ({built}, module {n['module']}); chosen: {n['chosen_by']}")
    else:
        out.append(f"NIXL         : not installed ({n.get('chosen_by', '?')}); the bounce engine serves instead")
    plugins = ", ".join(f"{k} ({', '.join(v) if v else 'does not load'})" for k, v in n["plugins"].items())
    out.append(f"  plugins    : {plugins or '(none)'}")
    r = rep.get("remote") or {}
    if r:
        env = ", ".join(f"{k}={v}" for k, v in r["ucx_env"].items()) or "UCX defaults"
        seg = r.get("tcp_segments") or {}
        out.append(f"remote tier  : NIXL UCX over {r['transports']}; {env}; TCP segments send {seg.get('send')}, "
                   f"receive {seg.get('receive')}")
        out.append(f"  trust      : {r['trust']}")
    out.append("engines      : every registered engine (its traits; how it fared here)")
    for name, e in rep["engines"].items():
        verdict = "" if e["ok"] is None else "works: " if e["ok"] else "no: "
        out.append(f"  {name:<11}: {verdict}{e['reason']}" + (f" [{e['summary']}]" if e.get("summary") else ""))
    cfg = rep["config"]
    if cfg:
        out.append(f"settings     : ENABLE_GDS={cfg['enable_gds']}, engine={cfg['engine']}"
                   + (f" (from {', '.join(f'{k}={v}' for k, v in cfg['sources'].items())})" if cfg["sources"] else ""))
    for label, res in rep["engine_auto"].items():
        head = f"engine {cfg['engine'] if cfg else 'auto'} for {label.replace('_', ' ')}"
        out.append(f"{head}: " + (f"{res['engine']}: {res['path']}\n  why        : {res['reason']}"
                                  if res["ok"] else f"none: {res['error']}"))
    for w in rep["warnings"]:
        out.append(f"warning      : {w}")
    for p in rep["problems"]:
        out.append(f"PROBLEM      : {p}")
    out.append("result       : " + ("OK" if rep["ok"] else f"{len(rep['problems'])} problem(s)"))
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`hicache-gds doctor [--json] [--path DIRS] [--probe-timeout S]`; returns the exit status."""
    ap = argparse.ArgumentParser(prog="hicache-gds doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--path", help="directories to check instead of GDS_PATH (comma-separated)")
    ap.add_argument("--probe-timeout", type=float, default=60.0, help="seconds per GDS probe (default 60)")
    ap.add_argument("--read-probe-mib", type=int, default=256,
                    help="MiB written and read back with O_DIRECT in each GDS_PATH directory to measure its read rate "
                         "(0: skip)")
    ap.add_argument("--model", help="a Hugging Face config.json (or its directory): say when L3 pays for this model")
    ap.add_argument("--kv-bytes-per-token", type=int, help="KV bytes per token (per GPU): say when L3 pays for it")
    args = ap.parse_args(argv)
    rep = collect(args.path, args.probe_timeout)
    text = render_text(rep)
    from .breakeven import render, section
    configured = set((rep.get("config") or {}).get("gds_path") or [])  # never the current directory
    rep["l3_pays"] = section([d["path"] for d in rep["gds_path"] if d.get("writable") and d["path"] in configured],
                             args.read_probe_mib, args.kv_bytes_per_token, args.model)
    head, _, result = text.rstrip("\n").rpartition("\n")  # the verdict stays the last line
    sys.stdout.write(json.dumps(rep, indent=2) + "\n" if args.json
                     else f"{head}\n{render(rep['l3_pays'])}{result}\n")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
