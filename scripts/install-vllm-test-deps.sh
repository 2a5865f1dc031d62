#!/usr/bin/env bash
# Install what tests/vllm needs into a venv, for one of the adapter's vLLM releases (import-only: no
# CUDA kernel is used), with hicache-gds and hicache-gds-vllm editable.
#
#   scripts/install-vllm-test-deps.sh <python> [venv-dir] [0.33|0.26]
#       0.33 (default): vLLM 0.33.0 over torch 2.14.1 from local disk       -> .venv-vllm
#       0.26:           vLLM 0.26.0 over the CPU build of torch 2.13.0      -> .venv-vllm026
#
# Then: VLLM_TARGET_DEVICE=cpu <venv>/bin/python -m pytest tests/vllm
#
# Why the steps are split:
#  * torch is installed first, alone, with --no-index from a local wheel directory, so pip can
#    never fetch a (2 GB) CUDA torch from the network;
#  * everything else is installed with --no-deps from one fully pinned list
#    (plugins/vllm/requirements-cpu-test[-0.26].txt): vLLM's own Requires-Dist pulls far more than
#    the offloading modules import, and pins another torch (0.33: 2.14.0; 0.26: 2.11.0, a CUDA
#    build on PyPI). vLLM 0.26's Python imports on the CPU torch 2.13.0; its CUDA extensions are
#    never loaded (tests/vllm/conftest.py selects vLLM's CPU platform).
# Measured on the 2-core CPU machine from an empty venv: 0.33 ~3 min (the CUDA libraries torch
# 2.14.1 imports), 0.26 ~2.5 min (most of it pip resolving the pinned list).
set -euo pipefail

PY=${1:?usage: $0 <python> [venv-dir] [0.33|0.26]}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RELEASE=${3:-0.33}
case $RELEASE in
  0.33) TORCH=2.14.1; TORCH_WHEELS=${TORCH_WHEELS:-/opt/pypi-more/files}; REQ=$ROOT/plugins/vllm/requirements-cpu-test.txt
        VENV=${2:-$ROOT/.venv-vllm} ;;
  0.26) TORCH=2.13.0; TORCH_WHEELS=${TORCH_WHEELS_CPU:-/opt/wheels}; REQ=$ROOT/plugins/vllm/requirements-cpu-test-0.26.txt
        VENV=${2:-$ROOT/.venv-vllm026} ;;
  *) echo "release $RELEASE: 0.33 or 0.26" >&2; exit 2 ;;
esac
T0=$(date +%s)
say() { printf '[install-vllm-test-deps %s %4ss] %s\n' "$RELEASE" "$(( $(date +%s) - T0 ))" "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
    say "creating venv $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
VENV=$(cd "$VENV" && pwd)
VPY=$VENV/bin/python
PIP=("$VPY" -m pip install --disable-pip-version-check --no-input --only-binary ':all:')

if "$VPY" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$TORCH')" 2>/dev/null; then
    say "torch $TORCH already installed"
else
    say "torch==$TORCH from $TORCH_WHEELS (local only)"
    "${PIP[@]}" --no-index --find-links "$TORCH_WHEELS" --no-deps "torch==$TORCH"
fi

if [ -f "$VENV/.pins" ] && cmp -s "$VENV/.pins" "$REQ"; then
    say "pinned dependencies already installed from $REQ"
else
    say "pinned dependencies (--no-deps) from $REQ"
    "${PIP[@]}" --no-deps -r "$REQ"
    cp "$REQ" "$VENV/.pins"
fi

say "hicache-gds and hicache-gds-vllm (editable, --no-deps)"
"$VPY" -m pip install -q --disable-pip-version-check --no-input --no-deps --no-build-isolation \
    -e "$ROOT" -e "$ROOT/plugins/vllm"

say "import check"
(cd "$ROOT/tests/vllm" && VLLM_TARGET_DEVICE=cpu "$VPY" - <<'PY'
import importlib
import conftest  # selects vLLM's CPU platform where the release needs it (0.26)
assert conftest.VLLM_MISSING is None, conftest.VLLM_MISSING
for mod in ("torch", "nixl_cu13", "hicache_gds", "vllm.v1.kv_offload.base", "vllm.v1.kv_offload.factory",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
            "vllm.v1.core.sched.scheduler", "hicache_gds_vllm", "hicache_gds_vllm.connector"):
    importlib.import_module(mod)
import torch, vllm
print(f"ok: torch {torch.__version__}, vllm {vllm.__version__}")
PY
)
say "done in $(( $(date +%s) - T0 )) s"
