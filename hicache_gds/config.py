"""Settings: one frozen `Config`, read from a dict (adapters), the environment, then defaults.

Precedence is dict key > environment variable > default. `ENABLE_GDS` and `GDS_PATH` keep their
bare names; every other setting is `HICACHE_GDS_<KEY>` in the environment and `<key>` (lower
case) in a dict. An unknown key or a bad value raises one `ConfigError` naming the key and what it
accepts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .errors import ConfigError

__all__ = ["Config", "parse_size", "parse_bool", "ENV_PREFIX", "describe_keys"]

ENV_PREFIX = "HICACHE_GDS_"
# Variables of the same prefix that an adapter reads, not the store: known, so not typos here.
# Read elsewhere: the SGLang plugin's prefetch timeline (trace.py); the remote tier's cluster secret
# itself (remote/trust.py: a secret is no config value, shown by `doctor` and kept in `sources`);
# the process-wide switch of the compiled checksum kernel (_checksum_jit.py: a diagnostic)
ADAPTER_ENV = frozenset({ENV_PREFIX + "TRACE", ENV_PREFIX + "CLUSTER_SECRET", ENV_PREFIX + "CHECKSUM_JIT"})

_SIZE_RE = re.compile(r"^\s*(?:(0[xX][0-9a-fA-F]+)|(\d+(?:\.\d+)?))\s*([A-Za-z%]*)\s*$")
_SETTING_UNIT_RE = re.compile(r"([kmgtp]?)(i?b?)")
_POW = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(value: Any, *, key: str = "size", kb_base: int | None = None) -> int:
    """Parse a byte count: an int >= 0 passes; a string is a number and an optional unit.
    `ConfigError`, naming `key`, for anything else.

    kb_base None (settings): a decimal number, fractions allowed, and an optional k/m/g/t/p, each a
    power of 1024 however it is spelled after (``512M``, ``64GiB``, ``4kb``, ``1.5g``).

    kb_base 1024 or 1000 (fio's rules, for `hicache-gds-bench`): an integer (or a hex one, without
    a unit); ``k``, ``kb`` and ``ki`` are powers of `kb_base` and the IEC ``kib`` one of the other
    base, as fio reads them (with 1024, its default, ``1KiB`` = 1000); no fractions or percentages.
    """
    fio = kb_base is not None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if not fio:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a byte count such as 64G, got {value!r}")
        if isinstance(value, int):
            raise ConfigError(f"{key}: a byte count cannot be negative, got {value}")
        m = _SIZE_RE.match(str(value))
        u = _SETTING_UNIT_RE.fullmatch(m.group(3).lower()) if m and m.group(2) else None
        if not u:
            raise ConfigError(f"{key}: expected a byte count such as 4096, 512M or 64G, got {value!r}")
        return int(float(m.group(2)) * (1 << 10 * _POW.get(u.group(1), 0)))
    m = _SIZE_RE.match(value) if isinstance(value, str) else None
    if m and m.group(2) and "." in m.group(2):
        m = None  # fio takes whole numbers only
    suffix = m.group(3).lower() if m else ""
    if m and m.group(1) and not suffix:
        return int(m.group(1), 16)         # fio ignores a suffix on hex numbers; we refuse it
    if m and suffix == "%":
        raise ConfigError(f"{key}: percentages ({value!r}) are not supported; give bytes")
    pow_, rest = _POW.get(suffix[:1], 0), suffix[1:]
    mult = (1 if suffix in ("", "b") else kb_base ** pow_ if pow_ and rest in ("", "b", "i")
            else (1000 if kb_base == 1024 else 1024) ** pow_ if pow_ and rest == "ib" else None)
    if not (m and m.group(2)) or mult is None:
        raise ConfigError(f"{key}: {value!r} is not a size (an integer with an optional k/m/g/t/p suffix, "
                          f"e.g. 4k, 2m, 1g)")
    return int(m.group(2)) * mult


def parse_bool(value: Any, key: str) -> bool:
    """A boolean: a bool, or 1/0, true/false, yes/no, on/off in any case; `ConfigError` naming
    `key` for anything else."""
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}: {value!r} is not a boolean; use one of 1, 0, true, false, yes, no")


def _choice(*accepted: str) -> Callable[[Any, str], str]:
    def parse(value: Any, key: str) -> str:
        s = str(value).strip().lower()
        if s == "true":
            s = "1"
        elif s == "false":
            s = "0"
        if s not in accepted:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(accepted)}")
        return s
    return parse


def _paths(value: Any, key: str) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    out = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"{key}: expected directory paths, got {item!r}")
        item = item.strip()
        if not item:
            continue
        if "\x00" in item:
            raise ConfigError(f"{key}: a path contains a NUL byte")
        out.append(os.path.abspath(os.path.expanduser(item)))
    if len(set(out)) != len(out):
        raise ConfigError(f"{key}: a directory is listed twice: {', '.join(out)}")
    return tuple(out)


def _positive_float(value: Any, key: str) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number of seconds > 0, got {value!r}") from None
    if not f > 0 or f != f or f == float("inf"):
        raise ConfigError(f"{key}: expected a number of seconds > 0, got {value!r}")
    return f


def _seconds_or_zero(value: Any, key: str) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number of seconds >= 0, got {value!r}") from None
    if not 0 <= f < 1:
        raise ConfigError(f"{key}: expected a number of seconds in [0, 1), got {value!r}")
    return f


def _nonneg_float(value: Any, key: str) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a number >= 0, got {value!r}") from None
    if not 0 <= f < math.inf:
        raise ConfigError(f"{key}: expected a finite number >= 0, got {value!r}")
    return f


def _fraction(value: Any, key: str) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected a fraction in (0, 1], got {value!r}") from None
    if not 0 < f <= 1:
        raise ConfigError(f"{key}: expected a fraction in (0, 1], got {value!r}")
    return f


def _int_at_least(lo: int) -> Callable[[Any, str], int]:
    def parse(value: Any, key: str) -> int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer >= {lo}, got {value!r}")
        try:
            i = int(str(value).strip())
        except ValueError:
            raise ConfigError(f"{key}: expected an integer >= {lo}, got {value!r}") from None
        if i < lo:
            raise ConfigError(f"{key}: expected an integer >= {lo}, got {i}")
        return i
    return parse


def _size(value: Any, key: str) -> int:
    return parse_size(value, key=key)


def _text(value: Any, key: str) -> str:
    s = str(value)
    if "\x00" in s or len(s) > 256:
        raise ConfigError(f"{key}: expected a short text without NUL bytes")
    return s


def _engine(value: Any, key: str) -> str:
    s = str(value).strip().lower()
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.\-]{0,63}", s):
        raise ConfigError(f"{key}: {value!r} is not an engine name (see `hicache-gds doctor` for the list)")
    return s


# name -> (env var, parser, default, help). Field order is the order `describe_keys` prints.
_SPEC: dict[str, tuple[str, Callable[[Any, str], Any], Any, str]] = {
    "enable_gds": ("ENABLE_GDS", _choice("auto", "1", "0"), "auto",
                   "1: GPU-direct engines or fail at open; 0: host path only; auto: GDS where cuFile accepts the path"),
    "gds_path": ("GDS_PATH", _paths, (), "directory, or comma-separated directories (one per NVMe), pages striped"),
    "engine": (ENV_PREFIX + "ENGINE", _engine, "auto", "transfer engine name, or auto"),
    "capacity": (ENV_PREFIX + "CAPACITY", _size, 0,
                 "bytes of page slots per namespace (0: the default rule, see capacity_fraction and max_fill)"),
    "capacity_fraction": (ENV_PREFIX + "CAPACITY_FRACTION", _fraction, 0.5,
                          "capacity 0: this share of the space available plus what hicache-gds namespaces hold"),
    "max_fill": (ENV_PREFIX + "MAX_FILL", _fraction, 0.9,
                 "capacity 0: never take a file system fuller than this (1 - available/total)"),
    "evict": (ENV_PREFIX + "EVICT", parse_bool, True,
              "evict least recently used pages when full (off: a put into a full store fails)"),
    "preallocate": (ENV_PREFIX + "PREALLOCATE", parse_bool, True, "fallocate slab files at open, so a full disk fails early"),
    "verify": (ENV_PREFIX + "VERIFY", parse_bool, True, "check each page read (host or GPU) against its checksum; a mismatch is a miss"),
    "direct_io": (ENV_PREFIX + "DIRECT_IO", parse_bool, True, "open slab files with O_DIRECT"),
    "sync": (ENV_PREFIX + "SYNC", parse_bool, False, "fdatasync before a page is published (power-loss durability)"),
    "io_timeout": (ENV_PREFIX + "IO_TIMEOUT", _positive_float, 60.0, "seconds one batch may take before it fails"),
    "switch_interval": (ENV_PREFIX + "SWITCH_INTERVAL", _seconds_or_zero, 0.0005,
                        "a store's open lowers this process's Python thread switch interval to this, for "
                        "good (a serving engine's busy thread otherwise holds the GIL 5 ms each time the IO "
                        "and checksum threads wait for it); 0 leaves it alone"),
    "io_threads": (ENV_PREFIX + "IO_THREADS", _int_at_least(1), 16, "IO threads of the bounce engine (its queue depth)"),
    "checksum_threads": (ENV_PREFIX + "CHECKSUM_THREADS", _int_at_least(0), 0,
                         "threads one batch's host-page checksums are cut across (0, and at most: min(8, "
                         "cores), the hashing pool's size); fewer leave a serving engine's threads more of "
                         "the cores and the GIL"),
    "nixl_queue": (ENV_PREFIX + "NIXL_QUEUE", _choice("uring", "aio", "posix_aio"), "aio",
                   "NIXL POSIX queue: Linux AIO, io_uring or POSIX AIO"),
    "max_request_bytes": (ENV_PREFIX + "MAX_REQUEST_BYTES", _size, 0, "split requests above this size (0: engine's limit)"),
    "read_probe": (ENV_PREFIX + "READ_PROBE", _size, 256 << 20,
                   "bytes an engine adapter reads (O_DIRECT) from each directory at open when no read rate is "
                   "known yet, so its first load-or-compute decisions have one (0: none)"),
    "namespace": (ENV_PREFIX + "NAMESPACE", _text, "", "tenant tag mixed into the namespace; tenants never share pages"),
    "cufile_json": (ENV_PREFIX + "CUFILE_JSON", _text, "", "cufile.json to use when CUFILE_ENV_PATH_JSON is unset"),
    "remote_url": (ENV_PREFIX + "REMOTE_URL", _text, "",
                   "Redis URL of the remote tier's directory, e.g. redis://127.0.0.1:6379/0 (empty: no remote tier)"),
    "remote_prefix": (ENV_PREFIX + "REMOTE_PREFIX", _text, "hicache",
                      "Redis key prefix of the remote tier; deployments sharing a Redis use distinct ones"),
    "remote_timeout": (ENV_PREFIX + "REMOTE_TIMEOUT", _positive_float, 2.0,
                       "seconds one Redis call may take; slower counts as a miss"),
    "remote_lease": (ENV_PREFIX + "REMOTE_LEASE", _nonneg_float, 0.0,
                     "seconds a reserved remote slot stays reserved for a writer that never publishes "
                     "(0: 2 x io_timeout + 10)"),
    "remote_wait_replicas": (ENV_PREFIX + "REMOTE_WAIT_REPLICAS", _int_at_least(0), 1,
                             "directory replicas that must acknowledge a write (capped by those attached; 0: off)"),
    "remote_wait_ms": (ENV_PREFIX + "REMOTE_WAIT_MS", _int_at_least(1), 1000,
                       "milliseconds a directory write waits for its replicas' acknowledgement"),
    "cluster_secret_file": (ENV_PREFIX + "CLUSTER_SECRET_FILE", _text, "",
                            "file (mode 0600) with the remote tier's cluster secret: page server records are "
                            "signed with it and clients trust only signed ones (empty: unsigned, trusted)"),
    "tier_mode": (ENV_PREFIX + "TIER_MODE", _choice("local", "remote", "both"), "both",
                  "TieredStore: NVMe only, remote only, or both"),
    "tier_write": (ENV_PREFIX + "TIER_WRITE", _choice("through", "back"), "through",
                   "TieredStore: remote copy during put, or later from NVMe"),
}


@dataclass(frozen=True)
class Config:
    """Validated settings. Build with `Config.load(overrides)`; fields are documented in `_SPEC`."""

    enable_gds: str = "auto"
    gds_path: tuple[str, ...] = ()
    engine: str = "auto"
    capacity: int = 0
    capacity_fraction: float = 0.5
    max_fill: float = 0.9
    evict: bool = True
    preallocate: bool = True
    verify: bool = True
    direct_io: bool = True
    sync: bool = False
    io_timeout: float = 60.0
    switch_interval: float = 0.0005
    io_threads: int = 16
    checksum_threads: int = 0
    read_probe: int = 256 << 20
    nixl_queue: str = "aio"
    max_request_bytes: int = 0
    namespace: str = ""
    cufile_json: str = ""
    remote_url: str = ""
    remote_prefix: str = "hicache"
    remote_timeout: float = 2.0
    remote_lease: float = 0.0
    remote_wait_replicas: int = 1
    remote_wait_ms: int = 1000
    cluster_secret_file: str = ""
    tier_mode: str = "both"
    tier_write: str = "through"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None,
             ignore: tuple[str, ...] = ()) -> "Config":
        """Read settings from `overrides` (dict keys win), then `env` (default `os.environ`), then defaults.

        Keys listed in `ignore` are skipped in `overrides` (adapters pass their engine's own keys).
        Unknown dict keys and unknown `HICACHE_GDS_*` variables raise `ConfigError`.
        """
        env = os.environ if env is None else env
        overrides = dict(overrides or {})
        for k in ignore:
            overrides.pop(k, None)
        unknown = sorted(k for k in overrides if k not in _SPEC)
        if unknown:
            raise ConfigError(f"unknown config key {unknown[0]!r}; accepted keys: {', '.join(_SPEC)}")
        env_names = {spec[0] for spec in _SPEC.values()} | ADAPTER_ENV
        stray = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in env_names)
        if stray:
            raise ConfigError(f"unknown environment variable {stray[0]}; accepted: "
                              + ", ".join(s[0] for s in _SPEC.values()))
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, (env_name, parse, default, _help) in _SPEC.items():
            if name in overrides:
                values[name] = parse(overrides[name], name)
                sources[name] = "config"
            elif env_name in env and env[env_name] != "":
                values[name] = parse(env[env_name], env_name)
                sources[name] = "env"
            else:
                values[name] = default
                sources[name] = "default"
        return cls(**values, sources=sources)

    def replace(self, *, source: str = "", **changes: Any) -> "Config":
        """A copy with `changes` validated like dict overrides; `source` (say, an adapter and its
        rule) is recorded in `sources` for each changed key, so logs can say where a value came from."""
        parsed = {k: _SPEC[k][1](v, k) if k in _SPEC else v for k, v in changes.items()}
        if source:
            parsed["sources"] = {**self.sources, **{k: source for k in changes}}
        return dataclasses.replace(self, **parsed)


def describe_keys() -> list[tuple[str, str, Any, str]]:
    """(key, environment variable, default, help) for every setting, for docs and `doctor`."""
    return [(k, s[0], s[2], s[3]) for k, s in _SPEC.items()]
