"""`hicache-gds ls | verify | clear`: the operator's view of the namespaces under `GDS_PATH`.

    hicache-gds ls     [--path DIRS] [--json]     # idle namespaces: since when, and how their use ended
    hicache-gds verify [NAMESPACE ...] [--path DIRS] [--no-drop] [--keys] [--json]
    hicache-gds clear  (NAMESPACE ... | --all) [--path DIRS] [--force] [--dry-run] [--json]

`GDS_PATH` (or ``--path``) names the directories, comma-separated, as for the store. A namespace is
named as `ls` prints it (``ns-`` and 20 hex digits) or by a unique prefix of it. All three work next
to running writers (`hicache_gds.tools.namespaces` says how).

Exit status: 0 when all is well; 1 when `verify` found bad pages or `clear` left a namespace in
place (open, or not ours to remove); 2 for bad arguments or an unusable `GDS_PATH`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

from ..slabs.capacity import gib
from ..errors import ConfigError

__all__ = ["ls_main", "verify_main", "clear_main"]

_SHOWN_IDENTITY = ("model", "model_name", "layout", "dtype", "kind", "pool", "tp_rank", "tp_size", "rank", "group",
                   "tenant")


def _parser(prog: str, doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"hicache-gds {prog}", description=doc)
    ap.add_argument("--path", help="directories to look in instead of GDS_PATH (comma-separated)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    return ap


def _roots(path: str | None) -> list[str]:
    from ..config import Config
    cfg = Config.load({"gds_path": path} if path else {})
    if not cfg.gds_path:
        raise ConfigError("GDS_PATH is not set: give the store's directories in GDS_PATH or --path")
    return list(cfg.gds_path)


def _fail(prog: str, exc: Exception) -> int:
    sys.stderr.write(f"hicache-gds {prog}: {exc}\n")
    return 2


def _ago(t: float | None) -> str:
    if not t:
        return "-"
    s = max(0.0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit} ago"
    return f"{s:.0f}s ago"


_ENDED = {"closed": "closed", "without closing": "its last process ended without closing"}


def _who(ns: Any) -> str:
    ident = ns.identity
    shown = [f"{k}={ident[k]}" for k in _SHOWN_IDENTITY if ident.get(k)]
    return ", ".join(shown) or ", ".join(f"{k}={v}" for k, v in list(ident.items())[:3]) or "-"


def ls_main(argv: Sequence[str] | None = None) -> int:
    """`hicache-gds ls`: every namespace, with what it holds and who has it open."""
    ap = _parser("ls", "List the namespaces under GDS_PATH: identity, pages, bytes, capacity, last use, "
                       "the pids that have it open, or since when it is idle (idle namespaces are removed, least "
                       "recently used first, when a new namespace needs their room).")
    args = ap.parse_args(argv)
    from .namespaces import find
    try:
        roots = _roots(args.path)
        found = find(roots)
    except ConfigError as exc:
        return _fail("ls", exc)
    if args.json:
        print(json.dumps({"gds_path": roots, "namespaces": [n.as_dict() for n in found]}, indent=1))
        return 0
    rows = [("NAMESPACE", "PAGES", "BYTES", "CAPACITY", "ON DISK", "LAST USE", "IDLE SINCE", "OPEN BY", "IDENTITY")]
    for n in found:
        idle = "-" if n.open_by else (_ago(n.idle_since) if n.idle_since else "no recorded use") + (
            f" ({_ENDED[n.ended]})" if n.ended else "")
        rows.append((n.name, str(n.pages), gib(n.bytes) if n.pages else "0", gib(n.capacity), gib(n.allocated),
                     _ago(n.last_use), idle, ",".join(map(str, n.open_by)) or "-", _who(n)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    for n in found:
        for p in n.problems:
            print(f"{n.name}: {p}")
    total = sum(n.allocated for n in found)
    idle = [n for n in found if n.idle]
    print(f"{len(found)} namespace(s) under {', '.join(roots)}, {gib(total)} on disk"
          + (f"; {len(idle)} idle ({gib(sum(n.allocated for n in idle))}): removed, least recently used first, "
             f"when a new namespace needs their room" if idle else ""))
    return 0


def verify_main(argv: Sequence[str] | None = None) -> int:
    """`hicache-gds verify`: check every page's checksum; report and drop the bad ones."""
    ap = _parser("verify", "Read every page and check it against its checksum; drop pages that fail (they "
                           "would read as misses anyway). Safe while a server writes the namespace.")
    ap.add_argument("namespaces", nargs="*", help="namespaces to check (default: all)")
    ap.add_argument("--no-drop", action="store_true", help="report bad pages, but leave them in the index")
    ap.add_argument("--keys", action="store_true", help="name the bad pages' keys (prompt-derived; off by default)")
    args = ap.parse_args(argv)
    from .namespaces import find, resolve, verify
    try:
        roots = _roots(args.path)
        found = find(roots)
        want = set(resolve(roots, args.namespaces, found)) if args.namespaces else None
        targets = [n for n in found if want is None or n.name in want]
        reports = [verify(n, drop=not args.no_drop) for n in targets]
    except ConfigError as exc:
        return _fail("verify", exc)
    out = []
    for r in reports:
        d = r.as_dict()
        if not args.keys:
            for b in d["bad"]:
                b.pop("key", None)
        out.append(d)
    if args.json:
        print(json.dumps({"gds_path": roots, "reports": out}, indent=1))
    else:
        for r, d in zip(reports, out):
            verdict = "ok" if not r.bad else f"{len(r.bad)} bad page(s), {r.dropped} dropped"
            print(f"{r.namespace}: {r.checked} pages checked in {r.seconds:.1f} s: {verdict}"
                  + (f"; {r.unverifiable} written from GPU memory without a host checksum" if r.unverifiable else "")
                  + (f"; {r.changed} changed by the writer while checked" if r.changed else "")
                  + (f"; open by pid {','.join(map(str, r.open_by))}, which drops them at its next read of them"
                     if r.bad and r.open_by else ""))
            for b in d["bad"]:
                print(f"  slot {b['slot']}: {b['reason']}" + (f" (key {b['key']})" if "key" in b else ""))
    return 1 if any(r.bad for r in reports) else 0


def clear_main(argv: Sequence[str] | None = None) -> int:
    """`hicache-gds clear`: remove namespaces (their slab files and index)."""
    ap = _parser("clear", "Remove namespaces under GDS_PATH: their slab files and index go, and a later open "
                          "starts them empty. An open namespace is refused unless --force.")
    ap.add_argument("namespaces", nargs="*", help="namespaces to remove (as `hicache-gds ls` names them)")
    ap.add_argument("--all", action="store_true", help="every namespace under GDS_PATH")
    ap.add_argument("--force", action="store_true",
                    help="remove open namespaces too (their writer keeps writing into deleted files until it exits)")
    ap.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    args = ap.parse_args(argv)
    if bool(args.namespaces) == bool(args.all):
        return _fail("clear", ConfigError("name the namespaces to remove, or give --all (not both)"))
    from .namespaces import find, resolve
    from ..slabs.removal import RemoveReport, remove
    try:
        roots = _roots(args.path)
        found = {n.name: n for n in find(roots)}
        names = sorted(found) if args.all else resolve(roots, args.namespaces, list(found.values()))
        if args.dry_run:
            reports = []
            for name in names:
                held = found[name].open_by  # find's answer: the procs/ locks in its first directory
                reports.append(RemoveReport(name, False, 0, found[name].allocated, held,
                                            "dry run" + (f"; open by pid {','.join(map(str, held))}" if held else "")))
        else:
            reports = [remove(roots, name, force=args.force) for name in names]
    except ConfigError as exc:
        return _fail("clear", exc)
    if args.json:
        print(json.dumps({"gds_path": roots, "reports": [r.as_dict() for r in reports]}, indent=1))
    else:
        for r in reports:
            if r.removed:
                print(f"{r.namespace}: removed ({r.files} files, {gib(r.freed)})"
                      + (f"; was open by pid {','.join(map(str, r.open_by))}" if r.open_by else ""))
            else:
                print(f"{r.namespace}: not removed: {r.reason}" if r.reason != "dry run" or r.open_by
                      else f"{r.namespace}: would remove {gib(r.freed)}")
        if not reports:
            print(f"no namespaces under {', '.join(roots)}")
    return 0 if args.dry_run or all(r.removed for r in reports) else 1
