"""Shared pieces of the integrity cases (`integrity`, `integrity_procs`): stores of a few slots,
pages whose bytes name their key, and a put from another process."""


from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

from .crash import page_bytes_of

__all__: list[str] = []

PAGE = 64 << 10
FAULTS = ("fdatasync EIO", "NIXL registration error in staging", "exception while checksumming",
          "exception from publish")
_AREA = "integrity"


def _dir(root: str, name: str) -> str:
    d = os.path.join(root, name.replace(" ", "-").replace("/", "-"))
    os.makedirs(d, exist_ok=True)
    return d


def _fill(arr: np.ndarray, keys: list[str], page: int, at: int = 0, offset: int = 0, salt: str = "") -> None:
    for j, k in enumerate(keys):
        a = offset + (at + j) * page
        arr[a:a + page] = page_bytes_of(salt + k, page)


def _store(d: str, ident: str, slots: int, **cfg: Any) -> Any:
    from .. import PageStore
    engine = cfg.pop("engine_obj", None)
    config = {"gds_path": d, "capacity": slots * PAGE, **cfg}
    if engine is None:
        config.setdefault("engine", "nixl-posix")
    return PageStore(PAGE, {"model": ident}, config=config, engine=engine)


def _read_back(store: Any, keys: list[str], buf: Any, salt: str = "") -> tuple[int, int, int]:
    """(byte-exact, misses, wrong) for `keys` read into `buf` (poisoned first)."""
    from .. import Pages
    good = miss = wrong = 0
    store.register_memory(buf.addr, buf.nbytes)
    arr = buf.numpy()
    n = buf.nbytes // PAGE
    for a in range(0, len(keys), n):
        chunk = keys[a:a + n]
        arr[:len(chunk) * PAGE] = 0xEE
        for j, ok in enumerate(store.get(chunk, Pages.contiguous(buf.addr, PAGE, range(len(chunk))))):
            if not ok:
                miss += 1
            elif np.array_equal(arr[j * PAGE:(j + 1) * PAGE], page_bytes_of(salt + chunk[j], PAGE)):
                good += 1
            else:
                wrong += 1
    return good, miss, wrong


_OTHER = """
import json, sys
from hicache_gds import PageStore, Pages
from hicache_gds.memory import HostBuffer
from hicache_gds.testing.crash import page_bytes_of
d, ident, slots, engine, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
page = 64 << 10
with PageStore(page, {"model": ident}, config={"gds_path": d, "capacity": slots * page, "engine": engine}) as s:
    buf = HostBuffer(n * page)
    s.register_memory(buf.addr, buf.nbytes)
    keys = [f"{tag}{i}" for i in range(n)]
    arr = buf.numpy()
    for i, k in enumerate(keys):
        arr[i * page:(i + 1) * page] = page_bytes_of(k, page)
    print(json.dumps(s.put(keys, Pages.contiguous(buf.addr, page, range(n)))))
"""


def _other_process_put(d: str, ident: str, slots: int, engine: str, tag: str, n: int) -> list[bool]:
    p = subprocess.run([sys.executable, "-c", _OTHER, d, ident, str(slots), engine, tag, str(n)],
                       capture_output=True, text=True, timeout=300)
    if p.returncode:
        raise RuntimeError(f"the other process failed (rc {p.returncode}): {p.stderr[-1500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


