"""Job options of `hicache-gds-bench`: one frozen `JobOptions` per job, parsed like fio.

Option names follow fio wherever the concept is the same (`rw`, `bs`, `size`, `iodepth`,
`numjobs`, `runtime`, `time_based`, `ramp_time`, `direct`, `verify`, `output-format`, ...); the
KV-page options (`engine`, `mem`, `batch`, `model`, `page-tokens`, `layout`, ...) are ours.

Value syntax is fio's, including its surprises (fio 3.33 and fio master agree):

* Sizes use `kb_base=1024` by default, fio's "compatibility mode": `4k` = `4kb` = `4kB` = 4096
  and `1m` = `1mb` = `1MB` = 2**20, while the IEC spellings mean powers of ten: `1KiB` = 1000,
  `1MiB` = 10**6. (`1mi`, without the `b`, is 2**20: fio matches `mib` as a prefix.) Set
  `kb_base=1000` to get the standard meanings (`k` = 1000, `KiB` = 1024).
* Times are integers with an optional unit; seconds by default (`500ms`, `2m`, `1h`).
* Later values win: a key given twice takes the last value, CLI options override the job file.

Deliberate differences: `bs` and `batch` accept a comma-separated list meaning a *sweep* (fio's
`bs=r,w` per-direction block sizes are not supported); a bare boolean flag (`direct`) means 1
(fio 3.33 rejects a bare `direct`); `direct` defaults to 1 because page-cache hits make storage
numbers meaningless.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from ..config import parse_bool
from ..config import parse_size as _parse_size
from ..errors import ConfigError
from .stats import DEFAULT_PERCENTILES

__all__ = [
    "OptionError", "JobOptions", "PageGeometry", "ModelPreset", "MODEL_PRESETS", "RW_MODES",
    "MEM_KINDS", "LAYOUTS", "OUTPUT_FORMATS", "page_geometry", "expand_sweeps", "parse_argv",
    "argv_to_mapping", "canonical_name", "layer", "merge", "parse_size", "parse_time",
    "format_size",
]

RW_MODES = ("read", "write", "randread", "randwrite", "randrw")
MEM_KINDS = ("vram", "pinned", "pageable")
LAYOUTS = ("page_first", "page_first_direct", "layer_first")
OUTPUT_FORMATS = ("normal", "json", "json+")


class OptionError(ConfigError):
    """An option name or value is not accepted.

    The message names the option as typed on the command line (`--rw`) and the accepted values;
    `option` holds the canonical name (the normalised key for an unknown option; None for errors
    not tied to one option).
    """

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option                # canonical option name, or None


# --------------------------------------------------------------------------- models and pages

@dataclass(frozen=True)
class ModelPreset:
    """KV-cache shape of one model (per tensor-parallel rank)."""

    layers: int
    itemsize: int
    kind: str                 # "mha" (K and V per layer) or "mla" (one latent vector per layer)
    kv_heads: int = 0
    head_dim: int = 0
    kv_cache_dim: int = 0


MODEL_PRESETS: Mapping[str, ModelPreset] = MappingProxyType({
    "llama3-8b": ModelPreset(layers=32, itemsize=2, kind="mha", kv_heads=8, head_dim=128),
    "llama3-70b-tp8": ModelPreset(layers=80, itemsize=2, kind="mha", kv_heads=1, head_dim=128),
    "deepseek-v3": ModelPreset(layers=61, itemsize=2, kind="mla", kv_cache_dim=576),
})


@dataclass(frozen=True)
class PageGeometry:
    """One KV page: `page_bytes` in total, stored as `segments` (byte lengths, in page order).

    page_first: MHA has 2 segments (K for all layers, then V), MLA 1; layer_first: one segment per
    layer and per K/V. The segment sizes always sum to `page_bytes`.
    """

    page_bytes: int
    segments: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.segments or min(self.segments) <= 0 or sum(self.segments) != self.page_bytes:
            raise OptionError(f"page segments {self.segments} must be positive and add up to "
                              f"page_bytes={self.page_bytes}")


def page_geometry(model: str, page_tokens: int, layout: str = "page_first") -> PageGeometry:
    """The page size and segment shape of `model` with `page_tokens` tokens per page."""
    preset = MODEL_PRESETS.get(model)
    if preset is None:
        raise OptionError(f"--model: {model!r} is not one of {', '.join(MODEL_PRESETS)}", "model")
    mha = preset.kind == "mha"
    per_token = preset.kv_heads * preset.head_dim if mha else preset.kv_cache_dim
    layer_seg = per_token * page_tokens * preset.itemsize        # one layer's K, V or latent
    kv = 2 if mha else 1
    segments = ((layer_seg,) * (kv * preset.layers) if layout == "layer_first"
                else (layer_seg * preset.layers,) * kv)
    return PageGeometry(sum(segments), segments)


# --------------------------------------------------------------------------- value parsers

_INT_RE = re.compile(r"^\s*(?:(0[xX][0-9a-fA-F]+)|(\d+))\s*([A-Za-z%]*)\s*$")
_TIME_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6,
               "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_VERIFY_NAMES = tuple("""md5 crc64 crc32c crc32c-intel crc32 crc16 crc7 sha1 sha256 sha512
    sha3-224 sha3-256 sha3-384 sha3-512 xxhash xxh3 meta pattern""".split())
_ENGINES_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+:-]*(,[A-Za-z0-9][A-Za-z0-9_.+:-]*)*")  # a,b,...
_FIO_IOMEM = {**dict.fromkeys(("malloc", "shm", "shmhuge", "mmap", "mmaphuge", "mmapshared"),
                              "pageable"), "cudamalloc": "vram"}


def _opt(name: str) -> str:
    return "--" + _DISPLAY.get(name, name)


def parse_size(text: Any, *, option: str = "size", kb_base: int = 1024) -> int:
    """A byte count with fio's suffix rules (see the module docstring; `hicache_gds.config.parse_size`
    under `kb_base`); ints pass through."""
    try:
        return _parse_size(text, key=_opt(option), kb_base=kb_base)
    except ConfigError as exc:
        raise OptionError(str(exc), option) from None


def parse_time(text: Any, *, option: str = "runtime") -> float:
    """A duration in seconds: an integer with an optional us/ms/s/m/h/d unit (seconds default)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text >= 0:
        return float(text)
    m = _INT_RE.match(text) if isinstance(text, str) else None
    unit = m.group(3).lower() if m and m.group(2) else None
    if unit not in _TIME_UNITS:
        raise OptionError(f"{_opt(option)}: {text!r} is not a duration (an integer with an optional "
                          f"unit us, ms, s, m, h or d, e.g. 30, 500ms, 2m)", option)
    return int(m.group(2)) * _TIME_UNITS[unit]


def format_size(n: int) -> str:
    """fio's short spelling of a byte count (`65536` -> `64k`), exact under kb_base=1024."""
    for suffix, p in (("p", 5), ("t", 4), ("g", 3), ("m", 2), ("k", 1)):
        if n and n % (1024 ** p) == 0:
            return f"{n // 1024 ** p}{suffix}"
    return str(n)


def _bool(v: Any, name: str) -> bool:
    if v is None:
        return True                        # a bare flag means 1
    try:
        return parse_bool(v, _opt(name))
    except ConfigError:
        raise OptionError(f"{_opt(name)}: {v!r} is not a boolean; use 1 or 0", name) from None


def _int(v: Any, name: str, lo: int = 0, hi: int | None = None) -> int:
    t = str(v).strip().lower()
    try:
        n = v if isinstance(v, int) and not isinstance(v, bool) else int(t, 16 if t[:2] == "0x" else 10)
    except ValueError:
        n = None
    if n is None or n < lo or (hi is not None and n > hi):
        rng = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
        raise OptionError(f"{_opt(name)}: {v!r} is not an integer {rng}", name)
    return n


def _choice(v: Any, name: str, accepted: Sequence[str]) -> str:
    s = str(v).strip().lower() if v is not None else ""
    if s not in accepted:
        raise OptionError(f"{_opt(name)}: {v!r} is not one of {', '.join(accepted)}", name)
    return s


def _items(v: Any) -> list[Any]:
    if isinstance(v, str):
        return [x for x in v.split(",") if x.strip()]
    return list(v) if isinstance(v, (list, tuple)) else [v]


_INTS = {"rwmixread": (0, 100), "iodepth": (1, None), "numjobs": (1, None),
         "page_tokens": (1, None), "kb_base": (1, None)}


def _parse_value(name: str, v: Any, kb_base: int) -> Any:
    """Turn one raw value (a string from argv/job file, or a Python value) into its field type."""
    if name in ("bs", "batch"):
        items = [x.strip() if isinstance(x, str) else x for x in _items(v)]
        if not items:
            raise OptionError(f"{_opt(name)}: needs a value", name)
        if name == "bs":
            return tuple(parse_size(x, option="bs", kb_base=kb_base) for x in items)
        return tuple(_int(x, "batch", 1) for x in items)
    if name == "size":
        return None if v is None else parse_size(v, option="size", kb_base=kb_base)
    if name in ("runtime", "ramp_time"):
        return parse_time(v, option=name)
    if name in _INTS:
        return _int(v, name, *_INTS[name])
    if name == "randseed":
        return None if v in (None, "") else _int(v, name, 0)
    if name in ("time_based", "direct", "drop_caches", "raw"):
        return _bool(v, name)
    if name == "fio":
        return None if isinstance(v, str) and v.strip().lower() == "auto" else _bool(v, name)
    if name == "verify":                   # fio's checksum names are accepted; we always use xxh3
        s = "1" if v is None or v is True else "0" if v is False else str(v).strip().lower()
        if s in ("0", "false", "no", "off", "none", "null", ""):
            return None
        if s in ("1", "true", "yes", "on") or s in _VERIFY_NAMES:
            return "xxh3"
        raise OptionError(f"{_opt(name)}: {v!r} is not one of 0, 1, {', '.join(_VERIFY_NAMES)}", name)
    if name == "output_format":
        return tuple(dict.fromkeys(_choice(x, name, OUTPUT_FORMATS) for x in _items(v))) or ("normal",)
    if name == "percentile_list":
        try:
            ps = [float(x) for x in (v if isinstance(v, (list, tuple)) else str(v).split(":"))]
        except ValueError:
            ps = []
        if not ps or len(ps) > 20 or not all(0.0 < p <= 100.0 for p in ps):
            raise OptionError(f"{_opt(name)}: {v!r} is not 1 to 20 colon-separated percentiles in "
                              f"(0, 100], e.g. 50:99:99.9", name)
        return tuple(sorted(set(ps)))
    s = None if v is None else str(v).strip()
    if name == "mem":
        return _FIO_IOMEM.get((s or "").lower(), (s or "").lower())
    if name == "model":
        return None if (s or "none").lower() == "none" else s.lower()
    if name in ("rw", "layout"):
        return None if s is None else s.lower()
    if name in ("directory", "filename", "output", "plot"):
        return None if v in (None, "") else str(v)
    return s


# --------------------------------------------------------------------------- JobOptions

@dataclass(frozen=True)
class JobOptions:
    """Everything one benchmark job needs, validated. Build with `from_mapping` / `parse_argv`.

    `bs` and `batch` are tuples: more than one value is a sweep, which `expand_sweeps` turns into
    one job per (bs, batch) point; `block_size` and `batch_size` read a single point. When `model`
    is set, `bs` is the model's page size. `runtime`/`ramp_time` are seconds (0 = no limit);
    `size` is bytes per job (None: the runner's `DEFAULT_SIZE`, 1 GiB); `fio` None means "run fio if installed".
    """

    name: str = "job"
    rw: str = "read"
    rwmixread: int = 50
    bs: tuple[int, ...] = (4096,)
    size: int | None = None
    iodepth: int = 1
    numjobs: int = 1
    runtime: float = 0.0
    time_based: bool = False
    ramp_time: float = 0.0
    directory: str | None = None
    filename: str | None = None
    direct: bool = True
    randseed: int | None = None
    verify: str | None = None
    output_format: tuple[str, ...] = ("normal",)
    output: str | None = None
    percentile_list: tuple[float, ...] = DEFAULT_PERCENTILES
    kb_base: int = 1024
    engine: str = "auto"
    mem: str = "pinned"
    batch: tuple[int, ...] = (1,)
    model: str | None = None
    page_tokens: int = 16
    layout: str = "page_first"
    drop_caches: bool = False
    plot: str | None = None
    raw: bool = True
    fio: bool | None = None
    fio_passthrough: tuple[tuple[str, str | None], ...] = ()

    def __post_init__(self) -> None:
        _choice(self.rw, "rw", RW_MODES)
        _choice(self.mem, "mem", MEM_KINDS)
        _choice(self.layout, "layout", LAYOUTS)
        for name, lo, hi in (("rwmixread", 0, 100), ("iodepth", 1, None), ("numjobs", 1, None),
                             ("page_tokens", 1, None)):
            _int(getattr(self, name), name, lo, hi)
        _choice(str(self.kb_base), "kb_base", ("1000", "1024"))
        if not self.name:
            raise OptionError("--name: a job needs a non-empty name", "name")
        if not _ENGINES_RE.fullmatch(self.engine or ""):
            raise OptionError(f"--engine: {self.engine!r} is not an engine name (e.g. auto, all, bounce, a,b)", "engine")
        for f in ("bs", "batch"):
            vals = getattr(self, f)
            if not vals or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in vals):
                raise OptionError(f"{_opt(f)}: {vals!r} must be one or more positive integers", f)
        page = self.model and page_geometry(self.model, self.page_tokens, self.layout).page_bytes
        if page and self.bs != (page,):
            bs = ",".join(map(str, self.bs))
            raise OptionError(f"--bs: {bs} conflicts with --model={self.model}, whose "
                              f"{self.page_tokens}-token page is {page} bytes; give one", "bs")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], *, strict: bool = True) -> "JobOptions":
        """Build from `{option: value}`; values may be strings (fio syntax) or Python values.

        Keys may be spelled `--page-tokens`, `page-tokens` or `page_tokens`; `None` is a bare flag.
        Unknown keys raise `OptionError` (with a suggestion) unless `strict` is False, in which
        case they are kept in `fio_passthrough`; fio options we do not model are always kept there.
        """
        raw = _canonical(mapping, strict=strict)
        kb_base = _int(raw.get("kb_base", 1024), "kb_base", 1)
        values = {k: _parse_value(k, v, kb_base) for k, v in raw.items() if k != "fio_passthrough"}
        values["fio_passthrough"] = tuple(raw.get("fio_passthrough", {}).items())
        if values.get("model") and "bs" not in raw:
            values["bs"] = (page_geometry(values["model"], values.get("page_tokens", 16),
                                          values.get("layout", "page_first")).page_bytes,)
        return cls(**values)

    @property
    def is_sweep(self) -> bool:
        return len(self.bs) > 1 or len(self.batch) > 1

    def _single(self, name: str) -> int:
        vals = getattr(self, name)
        if len(vals) != 1:
            raise OptionError(f"{_opt(name)}: {len(vals)} values form a sweep; call "
                              f"expand_sweeps() first", name)
        return vals[0]

    @property
    def block_size(self) -> int:
        """The single `bs` of this job (OptionError for a sweep: call `expand_sweeps` first)."""
        return self._single("bs")

    @property
    def batch_size(self) -> int:
        """The single `batch` (pages per request) of this job."""
        return self._single("batch")

    @property
    def geometry(self) -> PageGeometry:
        """The page shape: the model's, or one segment of `bs` bytes without a model."""
        if self.model is not None:
            return page_geometry(self.model, self.page_tokens, self.layout)
        return PageGeometry(self.block_size, (self.block_size,))

    def fio_options(self) -> dict[str, str]:
        """The options that differ from the defaults, as fio's `"job options"` strings."""
        out: dict[str, str] = {}
        for key, v in self.to_mapping().items():
            if key == "fio_passthrough":
                continue
            if key in ("bs", "size"):
                vals = v if isinstance(v, tuple) else (v,)
                v = ",".join(format_size(x) if self.kb_base == 1024 else str(x) for x in vals)
            elif key == "percentile_list":
                v = ":".join(f"{p:g}" for p in v)
            elif isinstance(v, tuple):
                v = ",".join(map(str, v))
            elif isinstance(v, (bool, float)):
                v = str(int(v)) if isinstance(v, bool) else f"{v:g}"
            out[_DISPLAY.get(key, key)] = str(v)
        out.update((k, "" if v is None else v) for k, v in self.fio_passthrough)
        return out

    def to_mapping(self) -> dict[str, Any]:
        """The non-default fields (Python values), which `from_mapping` accepts back unchanged."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if getattr(self, f.name) != f.default}
        if "fio_passthrough" in out:
            out["fio_passthrough"] = dict(self.fio_passthrough)
        if self.model is not None:
            out.pop("bs", None)            # derived from the model
        return out


# --------------------------------------------------------------------------- names and merging

_DISPLAY = {"page_tokens": "page-tokens", "drop_caches": "drop-caches",
            "output_format": "output-format"}
_FIELDS = frozenset(f.name for f in dataclasses.fields(JobOptions)) - {"fio_passthrough"}
_ALIASES = {"blocksize": "bs", "readwrite": "rw", "ioengine": "engine", "iomem": "mem",
            "mem_layout": "layout", "pages_per_request": "batch"}
# fio options we accept in job files but do not model: kept for the reference fio run.
_FIO_KNOWN = frozenset("""thread group_reporting nrfiles filesize io_size offset norandommap
    randrepeat invalidate fsync_on_close end_fsync stonewall new_group description iodepth_batch
    iodepth_batch_submit iodepth_batch_complete_min iodepth_batch_complete_max startdelay loops
    clat_percentiles lat_percentiles write_bw_log write_lat_log write_iops_log log_avg_msec
    cpus_allowed random_distribution gpu_dev_ids cuda_io unlink refill_buffers""".split())


def _norm(key: Any) -> str:
    k = str(key).strip().lstrip("-").lower().replace("-", "_")
    return _ALIASES.get(k, k)


def canonical_name(key: str) -> str:
    """The field name an option key refers to (`--page-tokens` -> `page_tokens`, `ioengine` ->
    `engine`); unknown keys come back normalised but otherwise unchanged."""
    return {"rwmixwrite": "rwmixread", "buffered": "direct"}.get(_norm(key), _norm(key))


def _canonical(mapping: Mapping[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """Normalise keys to field names (aliases resolved, later keys win); fio extras set aside."""
    out: dict[str, Any] = {}
    extra: dict[str, Any] = dict(mapping.get("fio_passthrough") or {})
    for key, v in mapping.items():
        k = _norm(key)
        if k == "rwmixwrite":
            k, v = "rwmixread", 100 - _int(v, "rwmixwrite", 0, 100)
        elif k == "buffered":
            k, v = "direct", not _bool(v, "buffered")
        if k in _FIELDS:
            out.pop(k, None)               # re-insert: insertion order is "last given"
            out[k] = v
        elif k in _FIO_KNOWN or not strict:
            extra[k] = None if v is None else str(v)
        elif k != "fio_passthrough":
            near = difflib.get_close_matches(k, sorted(_FIELDS | set(_ALIASES)), n=1)
            hint = f" (did you mean --{_DISPLAY.get(near[0], near[0])}?)" if near else ""
            raise OptionError(f"unknown option --{str(key).lstrip('-')}{hint}", k)
    return {**out, **({"fio_passthrough": extra} if extra else {})}


def layer(base: Mapping[str, Any], override: Mapping[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """`override` on top of `base` (raw mappings): later wins, and `model`/`bs` displace each other.

    A job that sets `bs` drops an inherited `model`, and one that sets `model` drops an inherited
    `bs`: the later source decides the block size. Both in one source are a conflict.
    """
    b, o = _canonical(base, strict=strict), _canonical(override, strict=strict)
    if "bs" in o and "model" not in o:
        b.pop("model", None)
    if "model" in o and "bs" not in o:
        b.pop("bs", None)
    extra = {**b.pop("fio_passthrough", {}), **o.pop("fio_passthrough", {})}
    return {**b, **o, **({"fio_passthrough": extra} if extra else {})}


def merge(opts: JobOptions, overrides: Mapping[str, Any]) -> JobOptions:
    """`opts` with `overrides` (raw values, e.g. from the command line) applied, revalidated."""
    return JobOptions.from_mapping(layer(opts.to_mapping(), overrides))


_BOOL_FIELDS = frozenset(("time_based", "direct", "drop_caches", "raw", "fio", "buffered"))


def argv_to_mapping(argv: Sequence[str]) -> dict[str, str | None]:
    """`--key=value`, `--key value` and bare `--flag` tokens to a raw mapping (later wins).
    Positional arguments (job files) are refused; the CLI separates them first."""
    out: dict[str, str | None] = {}
    tokens = list(argv)
    while tokens:
        tok = tokens.pop(0)
        if not tok.startswith("--") or tok == "--":
            raise OptionError(f"unexpected argument {tok!r}: options look like --key=value", None)
        key, eq, val = tok[2:].partition("=")
        if not eq and _norm(key) not in _BOOL_FIELDS and tokens and not tokens[0].startswith("--"):
            val, eq = tokens.pop(0), "="
        out.pop(key, None)
        out[key] = val if eq else None
    return out


def parse_argv(argv: Sequence[str], *, strict: bool = True) -> JobOptions:
    """`JobOptions` from command-line tokens such as `["--rw=randread", "--bs=4k,64k"]`."""
    return JobOptions.from_mapping(argv_to_mapping(argv), strict=strict)


def expand_sweeps(opts: JobOptions) -> list[JobOptions]:
    """One job per point of `bs` x `batch` (bs-major), each named `<name>-bs<bs>-batch<n>`;
    a job that is not a sweep comes back unchanged as the only element."""
    if not opts.is_sweep:
        return [opts]
    return [dataclasses.replace(opts, name=f"{opts.name}-bs{format_size(bs)}-batch{n}", bs=(bs,),
                                batch=(n,)) for bs, n in itertools.product(opts.bs, opts.batch)]
