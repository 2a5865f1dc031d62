#!/usr/bin/env bash
# The whole test suite on a fresh machine: system services (fio, redis-server), a virtualenv with
# hicache-gds, its plugins and SGLang's real classes, then pytest; then the SGLang plugin's tests
# once more against SGLang 0.5.17 (SKIP_SGLANG_0517=1 skips) and vLLM's in their own virtualenvs, against
# vLLM 0.33 and 0.26 (SKIP_VLLM=1 skips both, SKIP_VLLM_026=1 the second). Usage: bash scripts/test.sh [pytest args]
#
# --quick (anywhere among the arguments; never passed on to pytest): the contributor's run, under
# five minutes on 2 cores from a warm virtualenv (4 min 44 s on the 2-core VM beside other work,
# load average 1.7-4.5, where the same pytest without --quick took 17.5 min): the core's and the
# SGLang plugin's tests against the venv's SGLang (0.5.23) without the tests marked `slow`; no
# SGLang 0.5.17 run, no vLLM venvs; the install steps skipped where the venv already has what they
# install. It prints what it left out.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

QUICK=
for a in "$@"; do
  shift
  if [ "$a" = --quick ]; then QUICK=1; else set -- "$@" "$a"; fi
done

if [ "$(id -u)" = 0 ] && { ! command -v fio >/dev/null || ! command -v redis-server >/dev/null; }; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio redis-server >/dev/null
fi
# The tests start their own redis-server on a free loopback port; make sure none is left running
# by the package's own service.
if command -v service >/dev/null; then service redis-server stop >/dev/null 2>&1 || true; fi

VENV=${VENV:-.venv-test}
# Disk: the three venvs take ~16 GB together (torch 2.14.1 imports only beside its 3.2 GB of CUDA
# libraries, in two of them). A CI run (CI=true) or PRUNE_VENVS=1 removes each venv once its tests
# are done and keeps no pip cache, so the run never holds more than one venv (~7.5 GB at most): a
# CI machine's free disk varies, and one run ran out of it installing the third venv.
case "${PRUNE_VENVS:-${CI:-}}" in 1|true|yes) PRUNE=1 ;; *) PRUNE= ;; esac
[ -n "$PRUNE" ] && export PIP_NO_CACHE_DIR=1
disk() { echo "test.sh: $1: $(df -h --output=avail . | tail -1 | tr -d ' ') free on $(df --output=target . | tail -1)"; }
prune() { if [ -n "$PRUNE" ]; then rm -rf "$1"; disk "removed $1"; fi; }
disk "start"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
# --quick: the venv already has what the steps below install when SGLang's pinned set is there
# (judged by its distributions' versions: importing them takes longer) and hicache-gds and its
# SGLang plugin import from this checkout.
quick_venv_ready() {
  "$PY" - "$PWD" 2>/dev/null <<'PY'
import importlib.metadata as m, importlib.util as u, os, sys
assert m.version("sglang") == "0.5.23" and m.version("torch") == "2.14.1"
for dist in ("pytest", "hypothesis", "matplotlib", "redis", "prometheus-client", "nixl", "hicache-gds",
             "hicache-gds-sglang"):
    m.version(dist)
for mod in ("hicache_gds", "hicache_gds_sglang"):
    assert os.path.realpath(u.find_spec(mod).origin).startswith(os.path.realpath(sys.argv[1]) + os.sep)
PY
}
if [ -n "$QUICK" ] && quick_venv_ready; then
  echo "test.sh --quick: $VENV has SGLang 0.5.23's test set and this checkout: install steps skipped"
else
  if [ -x scripts/install-sglang-test-deps.sh ]; then
    bash scripts/install-sglang-test-deps.sh "$PY"
  else
    "$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
  fi
  # NIXL's build for the CUDA of the torch installed above (cu12 / cu13: one NIXL per process)
  NIXL_EXTRA=$("$PY" hicache_gds/_nixl_variant.py --extra)
  "$PY" -m pip install -q -e ".[test,$NIXL_EXTRA]"
  [ -f plugins/sglang/pyproject.toml ] && "$PY" -m pip install -q --no-deps -e plugins/sglang
fi
set +e
if [ -n "$QUICK" ]; then
  # The whole run's first pytest without the tests marked `slow` (pyproject.toml: each takes tens
  # of seconds to minutes on 2 cores). A -m among the arguments replaces this one.
  T0=$(date +%s)
  "$PY" -m pytest -q -p no:cacheprovider --ignore=tests/vllm -m "not gpu and not slow" tests "$@"
  rc=$?
  cat <<EOF

test.sh --quick: pytest took $(( $(date +%s) - T0 )) s. Left out (bash scripts/test.sh runs all of it):
  - the tests marked slow ($PY -m pytest -m slow --ignore=tests/vllm tests), in:
$(grep -rlE --include='*.py' 'mark\.slow' tests | grep -v '^tests/vllm/' | sort | sed 's/^/      /')
  - the SGLang plugin's tests against SGLang 0.5.17 (the venv's overlay, $VENV/sglang-0.5.17)
  - vLLM's tests in their own venvs: .venv-vllm (vLLM 0.33), .venv-vllm026 (vLLM 0.26)
EOF
  exit $rc
fi
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
prune "$VENV"
if [ -z "${SKIP_VLLM:-}" ]; then
  bash scripts/install-vllm-test-deps.sh python3 .venv-vllm 0.33 >/dev/null && \
    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm "$@"
  rc2=$?
  [ $rc -eq 0 ] && rc=$rc2
  prune .venv-vllm
  # vLLM 0.26 (the newest release on torch 2.11, the one a GPU machine with torch 2.11 runs): its own
  # venv over the CPU torch 2.13.0.
  if [ -z "${SKIP_VLLM_026:-}" ]; then
    bash scripts/install-vllm-test-deps.sh python3 .venv-vllm026 0.26 >/dev/null && \
      VLLM_TARGET_DEVICE=cpu .venv-vllm026/bin/python -m pytest -q -p no:cacheprovider tests/vllm "$@"
    rc2=$?
    [ $rc -eq 0 ] && rc=$rc2
    prune .venv-vllm026
  fi
fi
set -e
exit $rc
