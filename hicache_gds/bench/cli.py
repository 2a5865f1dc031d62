"""`hicache-gds-bench`: a fio-style benchmark of KV-page IO through `PageStore`.

    hicache-gds-bench                                   # default: llama3-8b 2 MiB pages x128, 2 GiB,
                                                        # write then cold read, engine auto
    hicache-gds-bench --engine=all                      # the default job on every engine here
    hicache-gds-bench --rw=randread --bs=2m,8m --batch=64,128 --size=2g --directory=/nvme
    hicache-gds-bench benchmarks/jobs/pagestore-vs-raw.fio --output-format=json --plot=bw.png

Options are fio's names (`--rw --bs --size --iodepth --numjobs --runtime --time_based
--ramp_time --direct --verify --randseed --output-format --output --directory`) plus ours
(`--engine=auto|all|a,b --mem=pinned|pageable|vram --batch --model --page-tokens --layout
--drop-caches --raw --fio --plot`). Job files are fio's INI format; command-line options apply
on top of every job in them. `--bs` and `--batch` lists are sweeps. Without a job file the
options apply on top of the default job; giving `--rw` runs that one mode instead of write-then-read.

Exit status: 0, 1 when a job failed (an IO or verify error, or no engine could run), 2 for bad
options. Output goes to stdout (or `--output`); progress bars and skipped engines go to stderr.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Sequence

from ..engines import engine_class, engine_names
from ..errors import EngineUnavailable, HiCacheGDSError
from .jobfile import parse_jobfile, parse_jobfile_text
from .options import JobOptions, OptionError, argv_to_mapping, canonical_name, expand_sweeps
from .plot import plot_results, summary_table
from .report import JobResult, bench_version, render
from .runner import Session

__all__ = ["main", "build_jobs", "split_argv", "DEFAULT_JOB", "run_jobs", "resolve_engines"]

DEFAULT_JOB = """\
; The embedded default job: llama3-8b KV pages (2 MiB, 16 tokens), 128 pages per request,
; write then cold read, the engine `auto` picks, ~2 GiB.
[global]
model=llama3-8b
page-tokens=16
batch=128
size=2g
iodepth=1
engine=auto
drop-caches=1

[write]
rw=write

[read]
rw=read
"""

_BOOL = frozenset(("time_based", "direct", "drop_caches", "raw", "fio", "buffered"))
_PATHLIKE = frozenset(("output", "plot", "directory", "filename"))


def _moves_remote(name: str) -> bool:
    """Engine `name` declares it moves pages to page servers, not files (`Traits.remote`)."""
    try:
        return engine_class(name).traits.remote
    except (EngineUnavailable, TypeError):
        return False  # the run says why it cannot be used


def resolve_engines(spec: str) -> tuple[list[str], bool]:
    """Engine names of `--engine` (`all`, `a,b` or one name) and whether it named several."""
    if spec == "all":
        return [n for n in engine_names() if not _moves_remote(n)], True
    names = [n.strip() for n in spec.split(",") if n.strip()]
    return names, len(names) > 1


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str], dict[str, Any]]:
    """(job files, option tokens as `--key[=value]`, our own flags) from the command line.

    `--key value` pairs like fio's; a bare token that names an existing file after an option
    that takes no path is a job file, not that option's value.
    """
    files: list[str] = []
    opts: list[str] = []
    ours: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok in ("-h", "--help"):
            ours["help"] = True
        elif tok == "--version":
            ours["version"] = True
        elif tok.startswith("--section"):
            val = tok.partition("=")[2] if "=" in tok else (argv[i] if i < len(argv) else "")
            i += 0 if "=" in tok else 1
            ours.setdefault("sections", []).append(val)
        elif tok.startswith("--") and len(tok) > 2:
            key = canonical_name(tok[2:].partition("=")[0])
            if "=" not in tok and key not in _BOOL and i < len(argv) and not argv[i].startswith("--") \
                    and (key in _PATHLIKE or not os.path.isfile(argv[i])):
                tok, i = f"{tok}={argv[i]}", i + 1
            opts.append(tok)
        elif tok.startswith("-") and tok != "-":
            raise OptionError(f"unknown option {tok!r}: options look like --key=value")
        else:
            files.append(tok)
    return files, opts, ours


def build_jobs(argv: Sequence[str]) -> tuple[list[JobOptions], dict[str, Any], dict[str, Any]]:
    """The jobs a command line asks for, the command-line options, and our own flags."""
    files, tokens, ours = split_argv(argv)
    cli = argv_to_mapping(tokens)
    jobs: list[JobOptions] = []
    for f in files:
        jobs += parse_jobfile(f, overrides=cli, sections=ours.get("sections"))
    if not files:
        if any(canonical_name(k) == "rw" for k in cli):
            head = DEFAULT_JOB.split("[write]")[0]
            jobs = parse_jobfile_text(head + "[kv]\n", source="<default job>", overrides=cli)
        else:
            jobs = parse_jobfile_text(DEFAULT_JOB, source="<default job>", overrides=cli)
    return jobs, cli, ours


class _Bar:
    """A tqdm bar on stderr, safe to update from the IO threads."""

    _lock = threading.Lock()

    def __init__(self, label: str, total: int | None) -> None:
        from tqdm import tqdm
        self._bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024,
                         file=sys.stderr, leave=False, dynamic_ncols=True)

    def update(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)

    def close(self) -> None:
        with self._lock:
            self._bar.close()


def run_jobs(jobs: Sequence[JobOptions], *, progress: bool = False, log=None,
             fio: str | None = None) -> tuple[list[JobResult], dict[str, Any]]:
    """Run every sweep point of `jobs` on its engines; (results, run-wide facts for the report)."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    results: list[JobResult] = []
    t0 = time.time()
    with Session(bars=_Bar if progress else None, log=log, fio=fio) as session:
        dirs: list[str] = []
        for job in jobs:
            for point in expand_sweeps(job):
                names, multi = resolve_engines(point.engine)
                results += session.run(point, names, strict=not multi)
                dirs += [d for d in session.directories(point) if d not in dirs]
        extra = {"directories": dirs, "directories_removed": True,
                 "page_cache": sorted(session.cache_methods) or None, "skipped": session.skipped,
                 "wall_s": round(time.time() - t0, 3)}
    for i, r in enumerate(results):
        r.groupid = i
    return results, extra


def _usage() -> str:
    return (__doc__ or "").split("\n\n", 1)[1] if __doc__ else ""


def _main(argv: Sequence[str]) -> int:
    if "-h" in argv or "--help" in argv:
        sys.stdout.write("usage: hicache-gds-bench [JOBFILE...] [--option=value...]\n\n" + _usage())
        return 0
    if "--version" in argv:
        print(f"hicache-gds-bench {bench_version()}")
        return 0
    jobs, cli, _ = build_jobs(argv)
    first = jobs[0]
    fmts = first.output_format
    to_stdout = first.output is None
    progress = sys.stderr.isatty() and not (to_stdout and set(fmts) & {"json", "json+"})
    results, extra = run_jobs(jobs, progress=progress)
    if not results:
        print("hicache-gds-bench: no job ran (every engine was skipped)", file=sys.stderr)
        return 1
    text = render(results, fmts, global_options=cli, extra=extra)
    if "normal" in fmts:
        text += "\n" + summary_table(results)
        text += (f"\nhicache-gds-bench: ran in {', '.join(extra['directories'])} (removed); page cache: "
                 f"{', '.join(extra['page_cache'] or ['not dropped'])}\n")
        for engine, reason in dict.fromkeys((s["engine"], s["reason"]) for s in extra["skipped"]):
            text += f"hicache-gds-bench: skipped engine {engine}: {reason}\n"
    if to_stdout:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        with open(first.output, "w") as f:
            f.write(text)
    if first.plot:
        plot_results(results, first.plot)
    return 1 if any(r.error for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `hicache-gds-bench`; returns the exit status (see the module docstring)."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except OptionError as exc:
        print(f"hicache-gds-bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hicache-gds-bench: interrupted", file=sys.stderr)
        return 130
    except (HiCacheGDSError, OSError) as exc:
        print(f"hicache-gds-bench: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
