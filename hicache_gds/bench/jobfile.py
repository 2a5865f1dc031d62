"""fio-style INI job files for `hicache-gds-bench`.

The rules are fio's (`init.c: __parse_jobs_ini`, `parse.c`), so a job file means the same here
and to fio:

* `[name]` starts a job; a section whose name starts with `global` holds defaults for the jobs
  *after* it (a later `[global]` changes only later jobs). Jobs run in file order.
* A line whose first non-blank character is `;` or `#` is a comment; so is anything after a `;`
  or `#` inside an option line (fio cuts there too).
* `key=value` (blanks around `=` allowed) or a bare `key` (a flag: `time_based`, `direct`).
  A key given twice takes the last value; a job's own options override inherited ones.
* `${VAR}` is replaced by the environment variable (empty when unset), and fio's keywords
  `$pagesize`, `$mb_memory` and `$ncpus` by this machine's values, before the line is parsed.
* `include other.fio` inside a section reads options (no sections) from another file, relative
  to the including file when not found as given.
* A job's name is its section name unless a `name=` option (in the job or a `[global]`) says
  otherwise.

We differ in one place: a bare boolean flag such as `direct` means 1 (fio 3.33 rejects it).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from .options import JobOptions, OptionError, canonical_name, layer

__all__ = ["JobFileError", "JobSection", "parse_jobfile", "parse_jobfile_text", "read_sections",
           "expand_env"]

_ENV_RE = re.compile(r"\$\{([^}]+)\}")
_MAX_INCLUDE_DEPTH = 16


class JobFileError(OptionError):
    """A job file is malformed or one of its options is bad; the message starts `file:line:`."""

    def __init__(self, message: str, path: str, line: int | None, option: str | None = None) -> None:
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {message}", option)
        self.path = path
        self.line = line


@dataclass
class JobSection:
    """One `[section]` as read: its name, raw options in file order, and each option's line."""

    name: str
    start_line: int
    options: dict[str, str | None] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)

    @property
    def is_global(self) -> bool:
        return self.name.startswith("global")      # fio: strncmp(name, "global", 6)


def _keywords() -> dict[str, str]:
    page = os.sysconf("SC_PAGESIZE") if hasattr(os, "sysconf") else 4096
    try:
        mb = os.sysconf("SC_PHYS_PAGES") * page // (1024 * 1024)
    except (ValueError, OSError, AttributeError):
        mb = 0
    return {"$pagesize": str(page), "$mb_memory": str(mb), "$ncpus": str(os.cpu_count() or 1)}


def expand_env(text: str, env: Mapping[str, str] | None = None) -> str:
    """fio's substitutions: `${VAR}` from `env` (default `os.environ`; unset -> empty), then
    the keywords `$pagesize`, `$mb_memory`, `$ncpus`."""
    env = os.environ if env is None else env
    text = _ENV_RE.sub(lambda m: env.get(m.group(1), ""), text)
    if "$" in text:
        for word, value in _keywords().items():
            text = text.replace(word, value)
    return text


def _strip(line: str) -> str:
    """fio's strip_blank_front + strip_blank_end: trim, and cut at the first `;` or `#`."""
    cut = min((i for i in (line.find(";"), line.find("#")) if i >= 0), default=len(line))
    return line[:cut].strip()


def read_sections(text: str, *, source: str = "<string>", base_dir: str | os.PathLike | None = None,
                  env: Mapping[str, str] | None = None) -> list[JobSection]:
    """The sections of a job file, raw (strings, env expanded), in file order."""
    sections: list[JobSection] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        p = _strip(line)
        if not p:
            continue
        if p.startswith("["):
            if not p.endswith("]") or len(p) < 3:
                raise JobFileError(f"malformed section header {line.strip()!r}", source, lineno)
            sections.append(JobSection(p[1:-1].strip(), lineno))
            continue
        if not sections:
            raise JobFileError(f"option {p!r} outside of a [] job section", source, lineno)
        if p == "include" or p.startswith(("include ", "include\t")):
            _include(sections[-1], p[len("include"):].strip(), source, lineno, base_dir, env, 0)
        else:
            _add_option(sections[-1], p, line, lineno, source, env)
    return sections


def _add_option(sec: JobSection, p: str, line: str, lineno: int, source: str,
                env: Mapping[str, str] | None, at: int | None = None) -> None:
    """Record `key[=value]`; `at` is the line errors should point to (an include's line)."""
    key, eq, value = expand_env(p, env).partition("=")
    key = key.strip()
    if not key:
        raise JobFileError(f"option line {line.strip()!r} has no name", source, lineno)
    sec.options.pop(key, None)             # re-insert: the last occurrence decides the order
    sec.options[key] = value.strip() if eq else None
    sec.lines[canonical_name(key)] = at or lineno


def _include(sec: JobSection, name: str, source: str, lineno: int,
             base_dir: str | os.PathLike | None, env: Mapping[str, str] | None, depth: int) -> None:
    """Read the options of an included file into `sec` (fio allows no sections there)."""
    if not name:
        raise JobFileError("include needs a file name", source, lineno)
    if depth >= _MAX_INCLUDE_DEPTH:
        raise JobFileError(f"includes nested deeper than {_MAX_INCLUDE_DEPTH}", source, lineno)
    path = Path(name)
    if not path.exists() and base_dir is not None:
        path = Path(base_dir) / name
    try:
        text = path.read_text()
    except OSError as e:
        raise JobFileError(f"cannot read include file {name!r}: {e.strerror}", source, lineno) from e
    for ln, raw in enumerate(text.splitlines(), 1):
        p = _strip(raw)
        if not p:
            continue
        if p.startswith("["):
            raise JobFileError("no new sections in included files", str(path), ln)
        if p == "include" or p.startswith(("include ", "include\t")):
            _include(sec, p[len("include"):].strip(), str(path), ln, path.parent, env, depth + 1)
        else:
            _add_option(sec, p, raw, ln, str(path), env, at=lineno)


def parse_jobfile_text(text: str, *, source: str = "<string>",
                       base_dir: str | os.PathLike | None = None,
                       overrides: Mapping[str, Any] | None = None,
                       sections: Sequence[str] | None = None,
                       env: Mapping[str, str] | None = None) -> list[JobOptions]:
    """The jobs of a job file's text, in order, each with its `[global]` defaults applied.

    `overrides` (e.g. command-line options) apply on top of every job. `sections` keeps only the
    named job sections (fio's `--section`); `[global]` sections always apply. Raises
    `JobFileError` (an `OptionError`) naming the file, line and option.
    """
    defaults: dict[str, Any] = {}
    jobs: list[JobOptions] = []
    global_lines: dict[str, int] = {}
    for sec in read_sections(text, source=source, base_dir=base_dir, env=env):
        try:
            if sec.is_global:
                defaults = layer(defaults, sec.options)
                global_lines.update(sec.lines)
                continue
            if sections is not None and sec.name not in sections:
                continue
            raw = layer(defaults, sec.options)
            raw.setdefault("name", sec.name)
            if overrides:
                raw = layer(raw, overrides)
            jobs.append(JobOptions.from_mapping(raw))
        except JobFileError:
            raise
        except OptionError as e:
            line = sec.lines.get(e.option or "", global_lines.get(e.option or "", sec.start_line))
            raise JobFileError(f"[{sec.name}] {e}", source, line, e.option) from e
    if not jobs:
        wanted = f" named {', '.join(sections)}" if sections is not None else ""
        raise JobFileError(f"no job sections{wanted}", source, None)
    return jobs


def parse_jobfile(path: str | os.PathLike, *, overrides: Mapping[str, Any] | None = None,
                  sections: Sequence[str] | None = None,
                  env: Mapping[str, str] | None = None) -> list[JobOptions]:
    """Read and parse the job file at `path` (see `parse_jobfile_text`)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise JobFileError(f"cannot read job file: {e.strerror}", str(p), None) from e
    return parse_jobfile_text(text, source=str(p), base_dir=p.parent, overrides=overrides,
                              sections=sections, env=env)
