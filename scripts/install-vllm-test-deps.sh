#!/usr/bin/env bash
# Install what tests/vllm needs into a venv: vLLM 0.33.0 (import-only, no CUDA kernels used),
# torch 2.14.1 from local disk, hicache-gds and hicache-gds-vllm editable.
#
#   scripts/install-vllm-test-deps.sh <python> [venv-dir]     # venv-dir defaults to .venv-vllm
#
# Then: VLLM_TARGET_DEVICE=cpu <venv>/bin/python -m pytest tests/vllm
#
# Why the steps are split:
#  * torch is installed first, alone, with --no-index from the local wheel directory, so pip can
#    never fetch a (2 GB) CUDA torch from the network;
#  * everything else is installed with --no-deps from one fully pinned list
#    (plugins/vllm/requirements-cpu-test.txt): vLLM's own Requires-Dist pulls far more than the
#    offloading modules import, and pins torch==2.14.0.
set -euo pipefail

PY=${1:?usage: $0 <python> [venv-dir]}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${2:-$ROOT/.venv-vllm}
TORCH_WHEELS=${TORCH_WHEELS:-/opt/pypi-more/files}
REQ=$ROOT/plugins/vllm/requirements-cpu-test.txt
T0=$(date +%s)
say() { printf '[install-vllm-test-deps %4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
    say "creating venv $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
PIP=("$VPY" -m pip install --disable-pip-version-check --no-input --only-binary ':all:')

if "$VPY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("torch") != "2.14.1")' 2>/dev/null; then
    say "torch 2.14.1 already installed"
else
    say "torch==2.14.1 from $TORCH_WHEELS (local only)"
    "${PIP[@]}" --no-index --find-links "$TORCH_WHEELS" --no-deps torch==2.14.1
fi

say "pinned dependencies (--no-deps) from $REQ"
"${PIP[@]}" --no-deps -r "$REQ"

say "hicache-gds and hicache-gds-vllm (editable, --no-deps)"
"$VPY" -m pip install --disable-pip-version-check --no-input --no-deps --no-build-isolation \
    -e "$ROOT" -e "$ROOT/plugins/vllm"

say "import check"
VLLM_TARGET_DEVICE=cpu "$VPY" - <<'PY'
import importlib
for mod in ("torch", "nixl_cu13", "hicache_gds", "vllm.v1.kv_offload.base", "vllm.v1.kv_offload.factory",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
            "vllm.v1.core.sched.scheduler", "hicache_gds_vllm"):
    importlib.import_module(mod)
import torch, vllm
print(f"ok: torch {torch.__version__}, vllm {vllm.__version__}")
PY
say "done in $(( $(date +%s) - T0 )) s"
