"""A remote-tier client for multi-node fault runs: puts and gets random pages, byte-compares each.

    python -m hicache_gds.testing.cluster_client --url URL --prefix P --name c1 --out c1.jsonl \
        --stop-file STOP [--page 2M --batch 8 --pinned 8 --period 0.25 --io-timeout 2]

First it puts `--pinned` pages (kept for the whole run, never deleted) and writes a ``ready`` line
with the server and epoch each was published on. Then, every `--period` s, one round: put
`--batch` pages of fresh random bytes under fresh keys, read them back into poisoned memory, read
the pinned pages, compare every page read with what was put, delete the fresh keys. One JSON line
per round (times are `time.monotonic()`, shared by every process of the machine whatever its
namespace). When `--stop-file` exists it reads the pinned pages once more and writes a ``final``
line: pinned pages missing although the server they were put on still holds the same
registration (epoch) are acknowledged pages lost where the tier promises to keep them.

``--memory device`` passes every page as GPU memory, so the tier takes its device-page paths
(staging on the device, copies out per request, the device checksum); host memory stands in for
the GPU (`host_as_vram`), as the lab runs on machines without one.

``--bench N`` instead times N rounds of one batch of `--batch` pages put then got (byte-compared
after timing) and writes one ``bench`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

__all__ = ["main"]


def _page_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(n), dtype=np.uint8)


class Client:
    def __init__(self, args: argparse.Namespace) -> None:
        from ..engines.base import MemKind
        from ..layout import Pages
        from ..memory import HostBuffer
        from ..remote import RemoteTier

        self.a = args
        self.page = args.page
        self.Pages = Pages
        config = {"remote_url": args.url, "remote_prefix": args.prefix, "io_timeout": args.io_timeout,
                  "remote_timeout": args.redis_timeout}
        if args.secret_file:
            config["cluster_secret_file"] = args.secret_file
        self.tier = RemoteTier(self.page, {"cluster": args.prefix}, config=config)
        self.kind = MemKind.VRAM if args.memory == "device" else MemKind.DRAM
        if self.kind is MemKind.VRAM:
            from .host_as_vram import host_as_vram
            host_as_vram(self.tier)
        n = max(args.batch, args.pinned, 1)
        self.src = HostBuffer(n * self.page, pinned=False)
        self.pin = HostBuffer(max(args.pinned, 1) * self.page, pinned=False)
        self.dst = HostBuffer(n * self.page, pinned=False)
        for b in (self.src, self.pin, self.dst):
            self.tier.register_memory(b.addr, b.nbytes, self.kind)
        self.rng = np.random.default_rng(args.seed)
        self.pinned = [f"{args.name}-pin-{i}" for i in range(args.pinned)]
        self.where: dict[str, tuple[str, str]] = {}  # pinned key -> (sid, epoch) it was published on
        self.out = open(args.out, "a", buffering=1)  # noqa: SIM115 -- one line per round, closed in main

    def pages(self, buf: object, idx: object) -> object:
        return self.Pages.contiguous(buf.addr, self.page, idx, self.kind)  # type: ignore[attr-defined]

    def emit(self, **row: object) -> None:
        self.out.write(json.dumps(row) + "\n")

    def _compare(self, keys: list[str], ok: list[bool], expect: np.ndarray) -> tuple[int, int, int]:
        """(hits byte-exact, misses, pages with wrong bytes) of a get into `dst`."""
        got = self.dst.numpy()
        good = miss = wrong = 0
        for i, hit in enumerate(ok):
            if not hit:
                miss += 1
                continue
            a = got[i * self.page:(i + 1) * self.page]
            b = expect[i * self.page:(i + 1) * self.page]
            if np.array_equal(a, b):
                good += 1
            else:
                wrong += 1
                self.emit(event="wrong", key=keys[i], differing=int(np.count_nonzero(a != b)), t=time.monotonic())
        return good, miss, wrong

    def put_pinned(self, timeout: float = 60.0) -> None:
        n = len(self.pinned)
        if not n:
            self.emit(ready=True, pinned=0, t=time.monotonic())
            return
        self.pin.numpy()[:] = _page_bytes(self.rng, n * self.page)
        acked = [False] * n
        deadline = time.monotonic() + timeout
        while not all(acked) and time.monotonic() < deadline:
            todo = [i for i in range(n) if not acked[i]]
            pages = self.pages(self.pin, todo)
            for i, ok in zip(todo, self.tier.put([self.pinned[i] for i in todo], pages)):
                acked[i] = ok
            if not all(acked):
                time.sleep(0.2)
        for k, e in zip(self.pinned, self.tier.dir.lookup(self.tier.namespace, self.pinned)):
            if e:
                sid, epoch = e.split("|")[:2]
                self.where[k] = (sid, epoch)
        self.emit(ready=True, pinned=len(self.where), t=time.monotonic())

    def read_pinned(self) -> tuple[int, int, int, list[bool]]:
        n = len(self.pinned)
        if not n:
            return 0, 0, 0, []
        self.dst.numpy()[:n * self.page] = 0xA5
        ok = self.tier.get(self.pinned, self.pages(self.dst, range(n)))
        good, miss, wrong = self._compare(self.pinned, ok, self.pin.numpy())
        return good, miss, wrong, ok

    def round(self, r: int) -> None:
        t0 = time.monotonic()
        b = self.a.batch
        keys = [f"{self.a.name}-r{r}-{i}" for i in range(b)]
        self.src.numpy()[:b * self.page] = _page_bytes(self.rng, b * self.page)
        row: dict[str, object] = {"r": r, "t0": t0}
        try:
            put = self.tier.put(keys, self.pages(self.src, range(b)))
            self.dst.numpy()[:b * self.page] = 0xA5
            got = self.tier.get(keys, self.pages(self.dst, range(b)))
            good, miss, wrong = self._compare(keys, got, self.src.numpy())
            pgood, pmiss, pwrong, _ = self.read_pinned()
            self.tier.delete(keys)
            row.update(put=sum(put), putf=b - sum(put), get=good, miss=miss, wrong=wrong,
                       pget=pgood, pmiss=pmiss, pwrong=pwrong, full=bool(all(put) and good == b))
        except Exception as exc:  # noqa: BLE001 -- the tier promises misses, never exceptions: count them
            row.update(err=f"{type(exc).__name__}: {exc}"[:300], full=False)
        row["t1"] = time.monotonic()
        self.emit(**row)

    def final(self) -> None:
        pgood, pmiss, pwrong, ok = self.read_pinned()
        try:
            live = {s.sid: s.epoch for s in self.tier.dir.servers()}
        except Exception:  # noqa: BLE001
            live = {}
        promised = [k for k in self.pinned if k in self.where and live.get(self.where[k][0]) == self.where[k][1]]
        lost = [k for k, hit in zip(self.pinned, ok) if not hit and k in promised]
        self.emit(final=True, pinned=len(self.pinned), acked=len(self.where), hit=pgood, miss=pmiss, wrong=pwrong,
                  promised=len(promised), promised_lost=len(lost), t=time.monotonic())

    def bench(self, rounds: int) -> None:
        b = self.a.batch
        self.src.numpy()[:b * self.page] = _page_bytes(self.rng, b * self.page)
        src = self.pages(self.src, range(b))
        into = self.pages(self.dst, range(b))
        warm = [f"{self.a.name}-warm-{i}" for i in range(b)]
        self.tier.put(warm, src), self.tier.get(warm, into), self.tier.delete(warm)
        puts, gets, bad = [], [], 0
        for r in range(rounds):
            keys = [f"{self.a.name}-b{r}-{i}" for i in range(b)]
            t0 = time.perf_counter()
            ok = self.tier.put(keys, src)
            t1 = time.perf_counter()
            self.dst.numpy()[:b * self.page] = 0xA5
            t2 = time.perf_counter()
            got = self.tier.get(keys, into)
            t3 = time.perf_counter()
            if not (all(ok) and all(got)) or not np.array_equal(self.dst.numpy()[:b * self.page],
                                                                self.src.numpy()[:b * self.page]):
                bad += 1
            self.tier.delete(keys)
            puts.append(t1 - t0)
            gets.append(t3 - t2)
        nbytes = b * self.page
        self.emit(bench=True, batch=b, rounds=rounds, put_gbps=[nbytes / x / 1e9 for x in puts],
                  get_gbps=[nbytes / x / 1e9 for x in gets], bad_batches=bad, path=self.tier.stats().get("path", ""))

    def close(self) -> None:
        try:
            self.tier.close()
        finally:
            self.out.close()


def main(argv: list[str] | None = None) -> int:
    from ..config import parse_size
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-file", default="")
    ap.add_argument("--page", type=lambda s: parse_size(s, key="--page"), default=2 << 20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pinned", type=int, default=8)
    ap.add_argument("--period", type=float, default=0.25)
    ap.add_argument("--io-timeout", type=float, default=2.0)
    ap.add_argument("--redis-timeout", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=600.0, help="stop after this long whatever happens")
    ap.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    ap.add_argument("--secret-file", default="", help="cluster secret file that page servers' records are signed with")
    ap.add_argument("--memory", choices=("host", "device"), default="host",
                    help="pages in host memory, or passed as GPU memory (host memory standing in)")
    ap.add_argument("--bench", type=int, default=0, help="time this many put+get rounds instead")
    args = ap.parse_args(argv)
    c = Client(args)
    try:
        if args.bench:
            c.bench(args.bench)
            return 0
        c.put_pinned()
        end = time.monotonic() + args.seconds
        r = 0
        while time.monotonic() < end and not (args.stop_file and os.path.exists(args.stop_file)):
            t = time.monotonic()
            c.round(r)
            r += 1
            time.sleep(max(0.0, args.period - (time.monotonic() - t)))
        c.final()
    finally:
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
