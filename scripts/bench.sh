#!/usr/bin/env bash
# The main job: create a virtualenv, install hicache-gds, run the fio-style benchmark on its
# embedded default job (auto engine; a temporary GDS_PATH unless GDS_PATH is set).
# Usage: bash scripts/bench.sh [hicache-gds-bench options...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
# Install the CPU build of torch from local disk first, so pip never pulls a multi-GB CUDA build.
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
# NIXL's build for that torch's CUDA (cu12 / cu13; a CPU torch gets cu13, which runs POSIX on CPU)
"$PY" -m pip install -q -e ".[$("$PY" hicache_gds/_nixl_variant.py --extra)]"
exec "$VENV/bin/hicache-gds-bench" "$@"
