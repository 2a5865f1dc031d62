"""`hicache-gds`: the command-line entry point, one subcommand per tool.

    hicache-gds doctor [--json] [--path DIRS]   # can this machine run hicache-gds, and how?
    hicache-gds ls [--json]                     # namespaces under GDS_PATH: pages, bytes, who has it open, idle since
    hicache-gds verify [NS ...] [--json]        # check every page's checksum; drop the bad ones
    hicache-gds clear (NS ... | --all) [--json] # remove namespaces (refuses open ones unless --force)
    hicache-gds serve ...                       # the remote-memory tier server
    hicache-gds bench ...                       # the same as `hicache-gds-bench ...`

Each subcommand lives in its own module, imported only when it runs, so `doctor` works on a
machine where the remote tier's dependencies are missing (and the reverse).
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

__all__ = ["main", "SUBCOMMANDS"]


def _doctor(argv: Sequence[str]) -> int:
    from .tools.doctor import main as doctor_main
    return doctor_main(argv)


def _ls(argv: Sequence[str]) -> int:
    from .tools.admin import ls_main
    return ls_main(argv)


def _verify(argv: Sequence[str]) -> int:
    from .tools.admin import verify_main
    return verify_main(argv)


def _clear(argv: Sequence[str]) -> int:
    from .tools.admin import clear_main
    return clear_main(argv)


def _serve(argv: Sequence[str]) -> int:
    from .remote.server import main as serve_main
    return serve_main(list(argv))


def _bench(argv: Sequence[str]) -> int:
    from .bench.cli import main as bench_main
    return bench_main(list(argv))


SUBCOMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "doctor": (_doctor, "check GPUs, nvidia-fs, cufile.json, NIXL, GDS_PATH; say which engine `auto` picks"),
    "ls": (_ls, "list namespaces under GDS_PATH: identity, pages, bytes, capacity, open by, idle since"),
    "verify": (_verify, "check every page's checksum; report and drop the bad ones (safe while a server writes)"),
    "clear": (_clear, "remove namespaces (one, several or --all); refuses open ones unless --force"),
    "serve": (_serve, "run the remote-memory tier server (--metrics-port: Prometheus metrics)"),
    "bench": (_bench, "fio-style benchmark of the page store (same as hicache-gds-bench)"),
}


def _usage() -> str:
    from . import __version__
    lines = [f"usage: hicache-gds {{{','.join(SUBCOMMANDS)}}} [options]   (hicache-gds {__version__})", ""]
    lines += [f"  {name:<8} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "`hicache-gds SUBCOMMAND --help` describes each one."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; returns its exit status (2 for an unknown subcommand)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        from . import __version__
        print(f"hicache-gds {__version__}")
        return 0
    entry = SUBCOMMANDS.get(args[0])
    if entry is None:
        sys.stderr.write(f"hicache-gds: unknown subcommand {args[0]!r}\n" + _usage())
        return 2
    return entry[0](args[1:])


if __name__ == "__main__":
    sys.exit(main())
