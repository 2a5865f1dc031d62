"""How far the ``compute_or_load`` policy's forecasts were from what the server then did, from its log.

    python benchmarks/e2e/forecast_report.py SERVER_LOG [SERVER_LOG ...] [--min-ahead 0.3]

Two rows per log and rank (``TPn`` in SGLang's log prefix; one row set where there is none):

* ``gpu`` -- each request admission decided "compute" with at least ``--min-ahead`` seconds of
  prefill forecast ahead of it (the ``GPU backlog`` of its decision line), against the time it
  then waited in the waiting queue (its ``left the queue after`` line): above 1, the GPU queue
  drained slower than forecast, and admission gave the GPU more than its share (a load's wait is
  its read as much as the GPU: not counted);
* ``disk`` -- each load's read time against its forecast (``load done: ... in T s (forecast F s``).

Each row: how many, and the median, lowest and highest of the ratios seen / forecast. The policy
learns the disk's ratio as it goes (``pace``); the GPU's it does not, which is what this shows.

A second table: per log and rank, how long finished loads waited on the host for the GPU to take
their requests (``protected`` to ``released``: host room the next loads cannot use, and a first
token waiting), how many waited ``--long`` seconds or more, and for those the fullest GPU pool
(SGLang's ``token usage``) and the most requests decoding (``#running-req``) in the prefill
batches formed meanwhile: a pool near full while requests decode is what ``policy_ride``'s
decode-step wait gives back; a load that waits beside a pool with room, what its ride does.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys

_RANK = re.compile(r"\bTP(\d+)\]")
_DECIDED = re.compile(r"hicache-gds policy: (\S+) compute \(\d+ new.*?GPU backlog ([\d.]+) s")
_LEFT = re.compile(r"hicache-gds policy: (\S+) left the queue after ([\d.]+) s")
_DONE = re.compile(r"hicache-gds policy: (\S+) load done: \d+ tokens in ([\d.]+) s \(forecast ([\d.]+) s")
_PROTECTED = re.compile(r"hicache-gds policy: (\S+) load of \d+ tokens protected on host")
_RELEASED = re.compile(r"hicache-gds policy: (\S+) host protection of \d+ tokens released after ([\d.]+) s")
_BATCH = re.compile(r"Prefill batch, .*token usage: ([\d.]+), #running-req: (\d+)")


def ratios(lines, min_ahead: float = 0.3) -> dict[str, dict[str, list[float]]]:
    """{rank: {"gpu": [...], "disk": [...]}} of seen / forecast, from a server log's lines."""
    out: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: {"gpu": [], "disk": []})
    ahead: dict[tuple[str, str], float] = {}
    for line in lines:
        if "hicache-gds policy: " not in line:
            continue
        m = _RANK.search(line)
        rank = f"TP{m.group(1)}" if m else "-"
        if (m := _DECIDED.search(line)) is not None:
            ahead[(rank, m.group(1))] = float(m.group(2))
        elif (m := _LEFT.search(line)) is not None:
            g = ahead.pop((rank, m.group(1)), None)
            if g is not None and g >= min_ahead:
                out[rank]["gpu"].append(float(m.group(2)) / g)
        elif (m := _DONE.search(line)) is not None and float(m.group(3)) > 0:
            out[rank]["disk"].append(float(m.group(2)) / float(m.group(3)))
    return dict(out)


def host_waits(lines) -> dict[str, list[tuple[float, float | None, int | None]]]:
    """{rank: [(seconds a finished load waited on the host, the fullest GPU pool and the most
    requests decoding in the prefill batches formed meanwhile, None where none was), ...]}."""
    out: dict[str, list[tuple[float, float | None, int | None]]] = collections.defaultdict(list)
    waiting: dict[tuple[str, str], list] = {}  # (rank, rid) -> [fullest pool, most decoding]
    for line in lines:
        m = _RANK.search(line)
        rank = f"TP{m.group(1)}" if m else "-"
        if (m := _BATCH.search(line)) is not None:
            for (r, _), seen in waiting.items():
                if r == rank:
                    seen[0] = max(seen[0] or 0.0, float(m.group(1)))
                    seen[1] = max(seen[1] or 0, int(m.group(2)))
        elif (m := _PROTECTED.search(line)) is not None:
            waiting[(rank, m.group(1))] = [None, None]
        elif (m := _RELEASED.search(line)) is not None and (rank, m.group(1)) in waiting:
            pool, running = waiting.pop((rank, m.group(1)))
            out[rank].append((float(m.group(2)), pool, running))
    return dict(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="server logs (the suite's server-*.log)")
    p.add_argument("--min-ahead", type=float, default=0.3,
                   help="seconds of GPU work forecast ahead of a request for it to count (default 0.3)")
    p.add_argument("--long", type=float, default=0.3,
                   help="a finished load's wait on the host counted as long from here (seconds, default 0.3)")
    a = p.parse_args(argv)
    print("| log | rank | queue | n | seen / forecast, median | lowest | highest |")
    print("|---|---|---|---|---|---|---|")
    for path in a.logs:
        with open(path, errors="replace") as f:
            got = ratios(f, a.min_ahead)
        for rank, rows in sorted(got.items()):
            for what in ("gpu", "disk"):
                r = rows[what]
                if r:
                    print(f"| {path} | {rank} | {what} | {len(r)} | {statistics.median(r):.2f} | {min(r):.2f} | "
                          f"{max(r):.2f} |")
    print()
    print(f"| log | rank | finished loads | waited on the host, median | longest | waited >= {a.long:g} s | "
          "their fullest GPU pool | their most requests decoding |")
    print("|---|---|---|---|---|---|---|---|")
    for path in a.logs:
        with open(path, errors="replace") as f:
            got = host_waits(f)
        for rank, w in sorted(got.items()):
            slow = [x for x in w if x[0] >= a.long]
            pools = [x[1] for x in slow if x[1] is not None]
            runs = [x[2] for x in slow if x[2] is not None]
            print(f"| {path} | {rank} | {len(w)} | {statistics.median(x[0] for x in w):.3f} s | "
                  f"{max(x[0] for x in w):.3f} s | {len(slow)} | "
                  f"{f'{min(pools):.2f}-{max(pools):.2f}' if pools else '-'} | "
                  f"{f'{min(runs)}-{max(runs)}' if runs else '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
