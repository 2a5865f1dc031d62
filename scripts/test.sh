#!/usr/bin/env bash
# The whole test suite on a fresh machine: system services (fio, redis-server), a virtualenv with
# hicache-gds, its plugins and SGLang's real classes, then pytest; then the SGLang plugin's tests
# once more against SGLang 0.5.17 (SKIP_SGLANG_0517=1 skips) and vLLM's in their own virtualenvs, against
# vLLM 0.33 and 0.26 (SKIP_VLLM=1 skips both, SKIP_VLLM_026=1 the second). Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

if [ "$(id -u)" = 0 ] && { ! command -v fio >/dev/null || ! command -v redis-server >/dev/null; }; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio redis-server >/dev/null
fi
# The tests start their own redis-server on a free loopback port; make sure none is left running
# by the package's own service.
if command -v service >/dev/null; then service redis-server stop >/dev/null 2>&1 || true; fi

VENV=${VENV:-.venv-test}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
if [ -x scripts/install-sglang-test-deps.sh ]; then
  bash scripts/install-sglang-test-deps.sh "$PY"
else
  "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
fi
# NIXL's build for the CUDA of the torch installed above (cu12 / cu13: one NIXL per process)
NIXL_EXTRA=$("$PY" hicache_gds/_nixl_variant.py --extra)
"$PY" -m pip install -q -e ".[test,$NIXL_EXTRA]"
[ -f plugins/sglang/pyproject.toml ] && "$PY" -m pip install -q --no-deps -e plugins/sglang
set +e
# vLLM's tests run in their own virtualenv: vLLM pins versions that SGLang's set does not share.
"$PY" -m pytest -q -p no:cacheprovider --ignore=tests/vllm tests "$@"
rc=$?
# The SGLang plugin's tests again against SGLang 0.5.17 (the newest release on torch 2.11): the same
# venv with a pinned 0.5.17 overlay in front of its 0.5.23.
if [ -z "${SKIP_SGLANG_0517:-}" ] && [ -x scripts/install-sglang-test-deps.sh ]; then
  OVERLAY="$VENV/sglang-0.5.17"
  bash scripts/install-sglang-test-deps.sh "$PY" --overlay "$OVERLAY" >/dev/null && \
    PYTHONPATH="$(cd "$OVERLAY" && pwd)" "$PY" -m pytest -q -p no:cacheprovider tests/sglang tests/test_sglang_pools.py "$@"
  rc2=$?
  [ $rc -eq 0 ] && rc=$rc2
fi
if [ -z "${SKIP_VLLM:-}" ]; then
  bash scripts/install-vllm-test-deps.sh python3 .venv-vllm 0.33 >/dev/null && \
    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm "$@"
  rc2=$?
  [ $rc -eq 0 ] && rc=$rc2
  # vLLM 0.26 (the newest release on torch 2.11, the one a GPU machine with torch 2.11 runs): its own
  # venv over the CPU torch 2.13.0.
  if [ -z "${SKIP_VLLM_026:-}" ]; then
    bash scripts/install-vllm-test-deps.sh python3 .venv-vllm026 0.26 >/dev/null && \
      VLLM_TARGET_DEVICE=cpu .venv-vllm026/bin/python -m pytest -q -p no:cacheprovider tests/vllm "$@"
    rc2=$?
    [ $rc -eq 0 ] && rc=$rc2
  fi
fi
set -e
exit $rc
