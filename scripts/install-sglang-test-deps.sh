#!/usr/bin/env bash
# Install, into one venv, what CPU tests need to use SGLang 0.5.23's real HiCache classes
# (HiCacheStorage/HiCacheFile/HiCacheNixl, StorageBackendFactory, ServerArgs, plugins/HookRegistry,
# HiCacheController, StorageMetrics) next to hicache_gds's own runtime and test deps; with
# --overlay, SGLang 0.5.17's in a directory of their own over that venv.
#
#   scripts/install-sglang-test-deps.sh .venv-sgl/bin/python
#   scripts/install-sglang-test-deps.sh .venv-sgl/bin/python --overlay .venv-sgl/sglang-0.5.17
#
# $1 is the venv's python; a missing venv is created first (with $BASE_PYTHON, default python3,
# which must be CPython 3.11: the pins below are cp311 wheels). Then, e.g.:
#   .venv-sgl/bin/python -m pytest tests/test_sglang_pools.py
#
# --overlay DIR (once the venv is built): SGLang 0.5.17 -- the newest release that runs on torch
# 2.11 -- and the modules its imports need beyond the venv's, pinned, into DIR; nothing else is
# touched. `PYTHONPATH=DIR` puts it in front of the venv's 0.5.23:
#   PYTHONPATH=.venv-sgl/sglang-0.5.17 .venv-sgl/bin/python -m pytest tests/sglang tests/test_sglang_pools.py
# A DIR installed from the same pins is kept as it is.
#
# How:
#  * torch 2.14.1 + torchvision 0.29.1 come first, alone, with --no-index from the local wheel
#    directory ($TORCH_WHEELS), so pip can never fetch a CUDA torch from the network. (A CPU torch
#    is not enough: sglang imports torchvision directly, and PyPI's torchvision only loads beside
#    torch 2.14.1, a CUDA build that runs on the CPU.)
#  * everything else is one fully pinned list installed with --no-deps: sglang itself (its
#    Requires-Dist pull flashinfer, sgl-kernel, ... which a CPU test never imports), the modules
#    its storage/controller/server_args/radix-cache imports need, hicache_gds's deps, and their closure.
#    Where sglang 0.5.23 pins a version (transformers, tokenizers, apache-tvm-ffi,
#    compressed-tensors, sentencepiece) that pin is used.
#  * `nixl==1.5.1` is NIXL's meta package: SGLang's HiCacheNixl does `from nixl._api import ...`;
#    the meta package maps `nixl` to nixl_cu13 (torch.version.cuda == "13.0"). It is --no-deps
#    because it otherwise also pulls nixl-cu12, which cannot be imported beside nixl-cu13.
# Measured on the 2-core CPU machine: ~5-7 min from an empty venv, ~6.2 GB venv (torch 1.2 GB,
# triton 0.9 GB, nvidia-* 3.2 GB: torch 2.14.1 does not import without its CUDA libraries).
set -euo pipefail

USAGE="usage: $0 <venv-python> [--overlay DIR]   e.g. $0 .venv-sgl/bin/python"
PY=${1:?$USAGE}
OVERLAY=
if [ $# -gt 1 ]; then
    [ $# -eq 3 ] && [ "$2" = --overlay ] && [ -n "$3" ] || { echo "$USAGE" >&2; exit 2; }
    OVERLAY=$3
fi
TORCH_WHEELS=${TORCH_WHEELS:-/opt/pypi-more/files}
T0=$(date +%s)
say() { printf '[install-sglang-test-deps %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

# --overlay: SGLang 0.5.17 over the venv. Its own pins where it has them (transformers 5.12.1, which
# takes tokenizers <= 0.23.0; openai 2.6.1); the rest are what its server_args and function-call
# parsers import that the venv lacks (openai's distro, jiter, sniffio; partial-json-parser,
# xgrammar, einops). Measured on the 2-core CPU machine: ~50 s from empty (30 s pip, the rest the
# import check), 0.4 GB; nothing to do when DIR is current.
OVERLAY_PINS='sglang==0.5.17
transformers==5.12.1
tokenizers==0.22.2
openai==2.6.1
distro==1.9.0
jiter==0.19.0
sniffio==1.3.1
partial-json-parser==0.2.1.1.post7
xgrammar==0.2.1
einops==0.8.1'

install_overlay() {
    if [ -f "$OVERLAY/.pins" ] && [ "$(cat "$OVERLAY/.pins")" = "$OVERLAY_PINS" ]; then
        say "SGLang 0.5.17 overlay already in $OVERLAY (checked when it was installed)"
        return
    fi
    say "SGLang 0.5.17 overlay into $OVERLAY (--no-deps)"
    local tmp="$OVERLAY.tmp.$$"
    rm -rf "$tmp" "$tmp.txt"
    printf '%s\n' "$OVERLAY_PINS" >"$tmp.txt"
    "$PY" -m pip install --disable-pip-version-check --no-input --only-binary ':all:' -q --no-deps \
        --target "$tmp" -r "$tmp.txt"
    rm -f "$tmp.txt"
    say "import check (PYTHONPATH=$tmp)"
    (cd / && PYTHONPATH="$tmp" "$PY" - <<'EOF'
import argparse, importlib.metadata, warnings
warnings.filterwarnings("ignore")
import sglang
assert sglang.__version__ == "0.5.17", sglang.__version__
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig, PoolTransferResult
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(["--model-path", "x", "--enable-hierarchical-cache", "--hicache-storage-backend", "file"])
assert args.enable_hierarchical_cache and args.hicache_storage_backend == "file"
import sglang.srt.plugins
sglang.srt.plugins.load_plugins()
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.storage.nixl.hicache_nixl import HiCacheNixl
from sglang.srt.observability.metrics_collector import StorageMetrics
from sglang.srt.mem_cache.hiradix_cache import HiRadixCache
print(f"ok: sglang {sglang.__version__} over the venv (torch {importlib.metadata.version('torch')})")
EOF
    )
    printf '%s' "$OVERLAY_PINS" >"$tmp/.pins"  # last: a DIR with .pins passed the check above
    rm -rf "$OVERLAY"
    mv "$tmp" "$OVERLAY"
    say "done in $(( $(date +%s) - T0 )) s; overlay size: $(du -sh "$OVERLAY" | cut -f1)"
}

if [ -n "$OVERLAY" ]; then
    [ -x "$PY" ] || { echo "$PY: no venv python; build the venv first (without --overlay)" >&2; exit 1; }
    PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
    OVERLAY=$(mkdir -p "$(dirname "$OVERLAY")" && cd "$(dirname "$OVERLAY")" && pwd)/$(basename "$OVERLAY")
    install_overlay
    exit 0
fi

if [ ! -x "$PY" ]; then
    VENV=$(dirname "$(dirname "$PY")")
    say "creating venv $VENV with ${BASE_PYTHON:-python3}"
    "${BASE_PYTHON:-python3}" -m venv "$VENV"
fi
# absolute, but not symlink-resolved (bin/python links out of the venv)
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"need CPython 3.11, got {sys.version}"'
PIP=("$PY" -m pip install --disable-pip-version-check --no-input --only-binary ':all:')

if "$PY" -c 'import importlib.metadata as m, sys; sys.exit(not (m.version("torch") == "2.14.1" and m.version("torchvision") == "0.29.1"))' 2>/dev/null; then
    say "torch 2.14.1 + torchvision 0.29.1 already installed"
else
    for w in torch-2.14.1-cp311 torchvision-0.29.1-cp311; do
        ls "$TORCH_WHEELS"/$w-*.whl >/dev/null 2>&1 || {
            echo "no $w wheel in $TORCH_WHEELS (set TORCH_WHEELS); refusing to download a CUDA torch" >&2
            exit 1
        }
    done
    say "torch==2.14.1 torchvision==0.29.1 from $TORCH_WHEELS (local only)"
    "${PIP[@]}" --no-index --find-links "$TORCH_WHEELS" --no-deps torch==2.14.1 torchvision==0.29.1
fi

REQ=$(mktemp --suffix=.txt)
trap 'rm -f "$REQ"' EXIT
cat >"$REQ" <<'EOF'
# --- SGLang itself (Requires-Dist not installed) ---
sglang==0.5.23
# --- what sglang.srt.mem_cache.hicache_storage / storage.backend_factory / server_args / plugins import ---
orjson==3.13.0
psutil==7.2.2
pybase64==1.5.1
requests==2.34.2
starlette==1.10.0
msgspec==0.22.0
pydantic==2.14.3
pyzmq==27.3.0
tqdm==4.70.1
ipython==9.18.1
aiohttp==3.14.5
# --- ... and in addition managers.cache_controller / observability.metrics_collector (pins from sglang's metadata) ---
apache-tvm-ffi==0.1.11
transformers==5.19.0
tokenizers==0.23.2
dill==0.4.1
sentencepiece==0.2.1
compressed-tensors==0.18.0
gguf==0.19.0
# --- ... and sglang.srt.mem_cache.unified_radix_cache (the prefetch policy's decision points; pins from sglang's metadata) ---
openai==2.8.0
distro==1.9.0
jiter==0.19.0
sniffio==1.3.1
partial-json-parser==0.2.1.1.post7
einops==0.8.1
# --- hicache_gds: runtime + tests; nixl meta for SGLang's HiCacheNixl ---
nixl-cu13==1.5.1
nixl==1.5.1
xxhash==4.1.0
numpy==2.4.6
pytest==9.2.0
hypothesis==6.170.15
# page servers' metrics (hicache-gds serve --metrics-port) and SGLang's StorageMetricsCollector
prometheus-client==0.26.0
# --- torch 2.14.1's own dependencies ---
cuda-bindings==13.5.0
cuda-pathfinder==1.9.0
cuda-toolkit==13.0.3.0
filelock==4.2.11
fsspec==2026.9.0
jinja2==3.1.6
markupsafe==3.0.4
mpmath==1.3.0
networkx==3.6.1
nvidia-cublas==13.1.1.3
nvidia-cuda-cupti==13.0.85
nvidia-cuda-nvrtc==13.0.88
nvidia-cuda-runtime==13.0.96
nvidia-cudnn-cu13==9.24.0.43
nvidia-cufft==12.0.0.61
nvidia-cufile==1.15.1.6
nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66
nvidia-cusparse==12.6.3.3
nvidia-cusparselt-cu13==0.8.1
nvidia-nccl-cu13==2.30.7
nvidia-nvjitlink==13.5.37
nvidia-nvshmem-cu13==3.4.5
nvidia-nvtx==13.0.85
setuptools==84.2.1
sympy==1.14.0
triton==3.8.0
typing-extensions==4.16.0
pillow==13.0.0
# --- the rest of the closure (dependencies of the packages above) ---
aiohappyeyeballs==2.7.1
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
asttokens==3.0.2
attrs==26.1.0
certifi==2026.10.18
charset-normalizer==3.5.2
click==8.5.1
executing==2.3.0
frozenlist==1.8.0
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpx==0.28.1
huggingface-hub==1.33.0
idna==3.20
iniconfig==2.3.1
ipython-pygments-lexers==1.1.1
jedi==0.20.1
loguru==0.7.3
markdown-it-py==4.3.0
matplotlib-inline==0.2.2
mdurl==0.1.2
multidict==7.2.1
packaging==26.3
parso==0.8.7
pexpect==4.9.0
pluggy==1.7.0
prompt-toolkit==3.0.53
propcache==0.5.4
ptyprocess==0.7.0
pure-eval==0.2.4
pydantic-core==2.50.4
pygments==2.21.0
pyyaml==6.0.3
regex==2026.11.15
rich==15.0.0
safetensors==0.8.0
shellingham==1.5.4
sortedcontainers==2.4.0
stack-data==0.6.3
traitlets==5.16.1
typer==0.29.2
typing-inspection==0.4.5
urllib3==2.8.0
wcwidth==0.9.4
yarl==1.25.1
EOF
say "pinned packages (--no-deps)"
"${PIP[@]}" --no-deps -r "$REQ"

say "import check"
(cd / && "$PY" - <<'PY'
import argparse, importlib, warnings
warnings.filterwarnings("ignore")
import sglang.srt.mem_cache.hicache_storage as hs
for name in ("HiCacheStorage", "HiCacheFile", "HiCacheStorageConfig", "HiCacheStorageFailureInjector"):
    getattr(hs, name)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(["--model-path", "x", "--enable-hierarchical-cache", "--hicache-storage-backend", "file"])
assert args.enable_hierarchical_cache and args.hicache_storage_backend == "file"
import sglang.srt.plugins
sglang.srt.plugins.load_plugins()
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector
import prometheus_client
import nixl, nixl._api, nixl_cu13, xxhash, numpy, pytest, hypothesis, torch, sglang
assert nixl._api.__name__.startswith("nixl_cu13"), nixl._api.__name__
print(f"ok: sglang {sglang.__version__}, torch {torch.__version__} (cuda build {torch.version.cuda}, "
      f"cuda available: {torch.cuda.is_available()}), nixl -> {nixl._api.__name__}")
PY
)
say "done in $(( $(date +%s) - T0 )) s; venv size: $(du -sh "$("$PY" -c 'import sys; print(sys.prefix)')" | cut -f1)"
