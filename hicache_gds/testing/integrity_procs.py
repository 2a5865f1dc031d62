"""Integrity cases about processes and device memory: membership races, an idle process after
others read, and GPU-page corruption (`integrity` runs them with the rest)."""


from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from .cases import Case, guarded
from .integrity_base import PAGE, _AREA, _dir, _fill, _store

__all__ = ["membership_race_case", "membership_processes_case", "idle_map_case", "gpu_corruption_cases"]

# -- membership ------------------------------------------------------------------------------------------------

class _SlowFlock:
    """`fcntl` for `owners`, whose exclusive locks taken in one thread wait first: the window
    between creating a membership file and locking it, made wide."""

    def __init__(self, real: Any, slow: threading.Thread, wait_s: float) -> None:
        self._real, self._slow, self._wait = real, slow, wait_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def flock(self, fd: int, op: int) -> None:
        if threading.current_thread() is self._slow and op & self._real.LOCK_EX:
            time.sleep(self._wait)
        self._real.flock(fd, op)


def membership_race_case(root: str, *, opens: int = 20, wait_s: float = 0.02) -> Case:
    """One thread opens and closes memberships of a namespace, each lock taken `wait_s` late; another
    judges who is alive (`others`, as reclaim does) all along. A live membership judged dead loses
    its file (and its reservations would be reclaimed)."""
    from ..slabs import owners
    case = Case(_AREA, "membership created while another process judges it")
    d = _dir(root, "membership")
    judge = owners.Membership(d)
    stop = threading.Event()
    judged = [0]

    def judging() -> None:
        while not stop.is_set():
            judge.others()
            judged[0] += 1

    opener = threading.current_thread()
    real = owners.fcntl
    owners.fcntl = _SlowFlock(real, opener, wait_s)  # type: ignore[assignment]
    t = threading.Thread(target=judging, daemon=True)
    t.start()
    dead = 0
    try:
        for _ in range(opens):
            m = owners.Membership(d)
            time.sleep(wait_s)
            if not os.path.exists(m.path) or m.token not in judge.others():
                dead += 1
            m.close()
    finally:
        owners.fcntl = real  # type: ignore[assignment]
        stop.set()
        t.join(10)
        judge.close()
    case.injected, case.caught = opens, opens - dead
    case.check(dead == 0, f"{dead} of {opens} live memberships judged dead (their file removed)")
    case.outcome = (f"{opens} opens with the lock taken {wait_s * 1000:.0f} ms after the file appears, "
                    f"{judged[0]} judgements meanwhile: live ones judged dead {dead}")
    return case


_MEMBER_LOOP = """
import json, os, sys, time
from hicache_gds import PageStore, Pages
from hicache_gds.memory import HostBuffer
d, seconds, tag = sys.argv[1], float(sys.argv[2]), sys.argv[3]
page = 64 << 10
buf = HostBuffer(page)
opens = dead = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    s = PageStore(page, {"model": "members"}, config={"gds_path": d, "capacity": 64 * page, "engine": "bounce",
                                                      "direct_io": False})
    s.register_memory(buf.addr, buf.nbytes)
    opens += 1
    s.put([f"{tag}-{opens}"], Pages.contiguous(buf.addr, page, [0]))  # a reserve: reclaims dead owners
    s.index.reclaim()
    if not os.path.exists(s._member.path):
        dead += 1
    s.close()
print(json.dumps({"opens": opens, "dead": dead}))
"""


def membership_processes_case(root: str, *, processes: int = 3, seconds: float = 5.0) -> Case:
    """`processes` processes open, write (reclaiming dead owners), check and close stores of one
    namespace in a loop for `seconds`: no live store may lose its membership file."""
    case = Case(_AREA, f"{processes} processes opening and closing one namespace")
    d = _dir(root, "members")
    env = dict(os.environ)
    ps = [subprocess.Popen([sys.executable, "-c", _MEMBER_LOOP, d, str(seconds), f"p{i}"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env) for i in range(processes)]
    opens = dead = 0
    for p in ps:
        out, err = p.communicate(timeout=seconds + 300)
        if p.returncode:
            case.problems.append(f"a process failed (rc {p.returncode}): {err[-800:]}")
            continue
        r = json.loads(out.strip().splitlines()[-1])
        opens += r["opens"]
        dead += r["dead"]
    case.injected, case.caught = opens, opens - dead
    case.check(dead == 0, f"{dead} of {opens} live stores judged dead")
    case.outcome = f"{opens} opens over {seconds:.0f} s by {processes} processes; live stores judged dead: {dead}"
    return case


# -- an idle process after others read ---------------------------------------------------------------------

def idle_map_case(root: str, *, reads: int = 4500) -> Case:
    """Store B reads (leases) `reads` times; idle store A then looks up once. A must catch up from
    what changed (nothing), not read its whole map again."""
    from .. import Pages
    from ..memory import HostBuffer
    case = Case(_AREA, "an idle process after others read")
    d = _dir(root, "idle")
    a = _store(d, "idle", 64, engine="bounce")
    b = _store(d, "idle", 64, engine="bounce")
    try:
        buf = HostBuffer(16 * PAGE)
        b.register_memory(buf.addr, buf.nbytes)
        ks = [f"i{i}" for i in range(16)]
        _fill(buf.numpy(), ks, PAGE)
        case.check(all(b.put(ks, Pages.contiguous(buf.addr, PAGE, range(16)))), "puts failed")
        case.check(all(a.exists(ks)), "the idle store does not see the pages")
        reloads = [0]
        real = a.index.keymap._read

        def counting(*args: Any, **kw: Any) -> Any:
            reloads[0] += 1
            return real(*args, **kw)
        a.index.keymap._read = counting
        for i in range(reads):
            e = b.index.lookup_pin([ks[i % 16]])
            b.index.unpin([e[0].slot])
        case.check(all(a.exists(ks)), "the idle store lost the pages")
        case.injected = reads
        case.check(reloads[0] == 0, f"the idle store read its whole map again {reloads[0]} time(s)")
        case.outcome = (f"{reads} reads by another store; the idle store's next lookup read the whole map "
                        f"{reloads[0]} time(s)")
    finally:
        a.close()
        b.close()
    return case


# -- GPU pages -----------------------------------------------------------------------------------------------

def gpu_corruption_cases(root: str, *, engine: str = "auto", page: int = 256 << 10, n: int = 16) -> list[Case]:
    """(GPU) Pages put from device memory, 4 damaged on disk, read into device memory: misses,
    dropped, the rest byte-exact; pages put from host memory read into device memory and back."""
    case = Case(_AREA, "device pages damaged on disk")
    try:
        import torch
        if not torch.cuda.is_available():
            raise ImportError("no CUDA GPU")
    except ImportError as exc:
        case.outcome = f"skipped: {exc}"
        return [case]
    from .. import MemKind, PageStore, Pages
    from ..memory import HostBuffer
    d = _dir(root, "gpu-corruption")
    g = torch.Generator(device="cuda").manual_seed(5)
    src = torch.randint(0, 256, (n * page,), dtype=torch.uint8, device="cuda", generator=g)
    dst = torch.full_like(src, 0xEE)
    host = HostBuffer(n * page)
    with PageStore(page, {"model": "gpu-corruption"}, config={"gds_path": d, "capacity": 4 * n * page,
                                                              "engine": engine}, mem_kinds=(MemKind.VRAM,)) as s:
        s.register_tensor(src)
        s.register_tensor(dst)
        s.register_memory(host.addr, host.nbytes)
        ks = [f"v{i}" for i in range(n)]
        with guarded(case, "device put"):
            case.check(all(s.put(ks, Pages.contiguous(src.data_ptr(), page, range(n), MemKind.VRAM))), "VRAM puts")
        rows = s.index.peek(ks)
        case.check(all(rows[k].csum for k in ks), "a device page was stored without a checksum")
        bad = ks[::4]
        for k in bad:
            fi, off = s.slabs.place(np.array([rows[k].slot]))
            fd = os.open(s.slabs.paths[int(fi[0])], os.O_WRONLY)
            try:
                os.pwrite(fd, b"\x5a" * 512, int(off[0]) + page // 2)
            finally:
                os.close(fd)
        case.injected = len(bad)
        with guarded(case, "device get"):
            res = s.get(ks, Pages.contiguous(dst.data_ptr(), page, range(n), MemKind.VRAM))
            torch.cuda.synchronize()
            for i, (k, ok) in enumerate(zip(ks, res)):
                same = torch.equal(src[i * page:(i + 1) * page], dst[i * page:(i + 1) * page])
                if k in bad:
                    case.caught += int(not ok)
                    case.check(not ok, f"damaged page {k} read as a hit")
                else:
                    case.served_total += 1
                    case.served_ok += int(ok and same)
                    case.wrong_bytes += int(ok and not same)
            case.check(not any(s.exists(bad)), "damaged pages still present after the read")
        with guarded(case, "host <-> device"):
            hk = [f"h{i}" for i in range(n)]
            hb = host.numpy()
            hb[:] = np.random.default_rng(9).integers(0, 256, hb.size, dtype=np.uint8)
            case.check(all(s.put(hk, Pages.contiguous(host.addr, page, range(n)))), "host puts")
            dst.fill_(0xEE)
            got = s.get(hk, Pages.contiguous(dst.data_ptr(), page, range(n), MemKind.VRAM))
            torch.cuda.synchronize()
            case.check(all(got) and np.array_equal(dst.cpu().numpy(), hb), "host pages read into VRAM: "
                                                                              f"{sum(got)}/{n}, bytes equal: "
                                                                              f"{np.array_equal(dst.cpu().numpy(), hb)}")
            hb[:] = 0xEE
            got = s.get(ks[1:4], Pages.contiguous(host.addr, page, range(3)))
            case.check(all(got) and np.array_equal(hb[:3 * page], src[page:4 * page].cpu().numpy()),
                       f"device pages read into host memory: {sum(got)}/3")
        st = s.stats()
        case.outcome = (f"{n} pages put from VRAM ({st['engine']}: {st['path']}), {len(bad)} damaged on disk: "
                        f"{case.caught}/{len(bad)} read as misses and dropped, {case.served_ok}/{case.served_total} "
                        f"others byte-exact, wrong {case.wrong_bytes}; host pages into VRAM and VRAM pages into "
                        f"host memory verified")
    return [case]


