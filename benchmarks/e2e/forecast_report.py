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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="server logs (the suite's server-*.log)")
    p.add_argument("--min-ahead", type=float, default=0.3,
                   help="seconds of GPU work forecast ahead of a request for it to count (default 0.3)")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
