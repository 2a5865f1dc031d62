"""Can GPU-direct IO run here? Answered without ever hanging the caller.

cuFile's driver open spins forever on machines where libcufile loads but no GPU driver is
present, so nothing in this process touches cuFile until a GPU is seen, and the end-to-end probe
(register VRAM, write and read back 1 MiB through NIXL GDS) runs in a subprocess with a timeout.

Run as a module for the probe itself: `python -m hicache_gds.engines.gds_probe DIR ENGINE`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from .cufile_env import gds_compat_mode, gpu_present, libcufile_loadable

__all__ = ["GDSProbe", "probe_gds"]


@dataclass(frozen=True)
class GDSProbe:
    ok: bool
    engine: str
    compat_mode: bool
    reason: str


def probe_gds(directory: str, engine: str = "nixl-gds", timeout: float = 60.0) -> GDSProbe:
    """Write and read back 1 MiB of VRAM through `engine` in a subprocess; never hangs past `timeout`."""
    compat = gds_compat_mode()
    if not gpu_present():
        return GDSProbe(False, engine, compat, "no CUDA GPU is visible")
    if not libcufile_loadable():
        return GDSProbe(False, engine, compat, "libcufile.so.0 is not installed")
    try:
        out = subprocess.run([sys.executable, "-m", "hicache_gds.engines.gds_probe", directory, engine], capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return GDSProbe(False, engine, compat, f"the cuFile probe did not finish in {timeout:.0f} s")
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            d = json.loads(line)
            return GDSProbe(bool(d["ok"]), engine, compat, d["reason"])
    tail = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
    return GDSProbe(False, engine, compat, f"probe exited {out.returncode}: {tail[0][:200]}")


def _probe_main(directory: str, engine_name: str) -> dict:
    import torch

    from . import create_engine
    from .base import EngineOptions, MemKind, Op
    import numpy as np

    n = 1 << 20
    fd, path = tempfile.mkstemp(prefix=".gds-probe-", dir=directory)
    try:
        os.ftruncate(fd, n)
        os.close(fd)
        eng = create_engine(engine_name, EngineOptions())
        try:
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
            dst = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
            for t in (src, dst):
                eng.register_memory(t.data_ptr(), n, MemKind.VRAM)
            fid = eng.open_file(path)
            for op, buf in ((Op.WRITE, src), (Op.READ, dst)):
                mem = np.array([[buf.data_ptr(), n]], dtype=np.uint64)
                eng.submit(op, MemKind.VRAM, mem, np.array([[fid, 0]], dtype=np.uint64)).wait(20.0)
            torch.cuda.synchronize()
            same = bool(torch.equal(src, dst))
            return {"ok": same, "reason": "1 MiB VRAM round trip byte-exact" if same else "data mismatch"}
        finally:
            eng.close()
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "reason": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


if __name__ == "__main__":
    print(json.dumps(_probe_main(sys.argv[1], sys.argv[2])), flush=True)
