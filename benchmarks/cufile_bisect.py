"""Where does cufile-python abort libcufile? One fresh process per variant, one step at a time.

    python benchmarks/cufile_bisect.py /path/on/the/disk [--out bisect.json]

On the project's H100/H200 VMs (cuFile compat mode), the ``cufile`` engine's probe process died in
libcufile's assertion ``cufio-plat:149`` while a standalone script doing "the same" worked. Each
variant below is a different order of the same steps, run in its own ``python -c`` with a
timeout; the step a variant dies in, with its exit status and the tail of cufile.log, is what is
reported. Steps:

  ctx     a CUDA context (torch.empty on the GPU)
  dlopen  ctypes.CDLL("libcufile.so.0", RTLD_GLOBAL) -- what ``libcufile_loadable()`` does
  import  ``load_cufile()`` (cufile-python through the libcufile.so symlink)
  json    CUFILE_ENV_PATH_JSON=configs/cufile.json set in the process
  driver  cufile.CuFileDriver() (cuFileDriverOpen)
  io      CuFile(path, "r+", use_direct_io=True).open(), 1 MiB write and read back, compared
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STEPS = {
    "ctx": "import torch; torch.empty(1, device='cuda')",
    "dlopen": "import ctypes, os; from hicache_gds.engines.cufile_engine import _libcufile_path; "
              "ctypes.CDLL(_libcufile_path() or 'libcufile.so.0', mode=ctypes.RTLD_GLOBAL)",
    "import": "from hicache_gds.engines.cufile_engine import load_cufile; cufile = load_cufile()",
    "json": f"import os; os.environ['CUFILE_ENV_PATH_JSON'] = {os.path.join(REPO, 'configs', 'cufile.json')!r}",
    "driver": "drv = cufile.CuFileDriver()",
    "io": ("import ctypes, torch\n"
           "n = 1 << 20\n"
           "src = torch.randint(0, 256, (n,), dtype=torch.uint8, device='cuda'); dst = torch.full((n,), 7, "
           "dtype=torch.uint8, device='cuda')\n"
           "f = cufile.CuFile(PATH, 'r+', use_direct_io=True); f.open()\n"
           "w = f.write(ctypes.c_void_p(src.data_ptr()), n, file_offset=0, dev_offset=0)\n"
           "r = f.read(ctypes.c_void_p(dst.data_ptr()), n, file_offset=0, dev_offset=0)\n"
           "torch.cuda.synchronize(); assert (w, r) == (n, n), (w, r); assert torch.equal(src, dst)\n"),
}

VARIANTS = {
    "ctx,import,driver,io": "what a standalone script does",
    "dlopen,ctx,import,driver,io": "libcufile loaded (RTLD_GLOBAL) before the CUDA context: the probe's order",
    "ctx,dlopen,import,driver,io": "libcufile loaded after the CUDA context",
    "import,ctx,driver,io": "cufile-python imported before the CUDA context",
    "ctx,import,json,driver,io": "with configs/cufile.json",
    "dlopen,ctx,import,json,driver,io": "probe's order with configs/cufile.json",
}


def run_variant(steps: list[str], path: str, timeout: float) -> dict:
    code = ["import sys", f"PATH = {path!r}"]
    for s in steps:
        code.append(f"print('STEP {s}', flush=True)")
        code.append(STEPS[s])
    code.append("print('STEP done', flush=True)")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUFILE_ENV_PATH_JSON", None)
    with tempfile.TemporaryDirectory() as logdir:
        env["CUFILE_LOGFILE_PATH"] = os.path.join(logdir, "cufile.log")
        try:
            out = subprocess.run([sys.executable, "-c", "\n".join(code)], capture_output=True, text=True,
                                 timeout=timeout, env=env, cwd=logdir)
            rc, stdout, stderr = out.returncode, out.stdout, out.stderr
        except subprocess.TimeoutExpired as exc:
            rc, stdout, stderr = "timeout", (exc.stdout or b"").decode(), (exc.stderr or b"").decode()
        logs = [os.path.join(logdir, f) for f in os.listdir(logdir) if f.startswith("cufile")]
        log_tail = open(logs[0], errors="replace").read().splitlines()[-6:] if logs else []
    reached = [line.split()[1] for line in stdout.splitlines() if line.startswith("STEP ")]
    return {"rc": rc, "last_step": reached[-1] if reached else None, "ok": bool(reached) and reached[-1] == "done",
            "stderr_tail": stderr.strip().splitlines()[-4:], "cufile_log_tail": log_tail}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory")
    p.add_argument("--out", default="cufile-bisect.json")
    p.add_argument("--timeout", type=float, default=90.0)
    a = p.parse_args()
    fd, path = tempfile.mkstemp(prefix=".cufile-bisect-", dir=a.directory)
    os.ftruncate(fd, 1 << 20)
    os.close(fd)
    res = {}
    try:
        for v, why in VARIANTS.items():
            r = run_variant(v.split(","), path, a.timeout)
            res[v] = {"why": why, **r}
            print(f"{'OK  ' if r['ok'] else 'DIED'} {v:38s} rc={r['rc']} last={r['last_step']} "
                  f"{' | '.join(r['stderr_tail'][-2:])[:300]}", flush=True)
    finally:
        os.unlink(path)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
