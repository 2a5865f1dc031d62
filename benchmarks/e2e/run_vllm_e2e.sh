#!/usr/bin/env bash
# Run the vLLM server comparison on a GPU machine prepared by gpu_prepare_vllm.sh:
#
#   bash benchmarks/e2e/run_vllm_e2e.sh [CONFIGS] [bench_vllm_server.py options]
#       CONFIGS default recompute,cpu,gds,bounce,gds-cost (also: gds-plain)
#
# Resumable: configurations already measured under $E2E_OUT are kept (--resume), and no new one is
# started after $DEADLINE_S seconds minus one configuration's budget (default 510: a device call
# runs at most 10 minutes), so a comparison longer than one call continues in the next. NIXL comes
# from .gpu/setup.sh when .whl/ was carried (../shared/device/wheels.sh nixl) or from an earlier
# call on the same machine (/tmp/site). Where the device tool's $OUT is set, the results and the
# tails of the server logs are copied there (at most 8 files come back).
set -uo pipefail
cd "$(dirname "$0")/../.."
if ls .whl/*.whl >/dev/null 2>&1 && [ -f .gpu/setup.sh ]; then
  # shellcheck disable=SC1091
  source .gpu/setup.sh
fi
# shellcheck disable=SC1091
[ -f /var/tmp/hgds-vllm/env.sh ] && source /var/tmp/hgds-vllm/env.sh
DIR=${E2E_DIR:-/var/tmp/vllm-e2e-store}
RES=${E2E_OUT:-/var/tmp/vllm-e2e-out}
CONFIGS=${1:-recompute,cpu,gds,bounce,gds-cost}
[ $# -gt 0 ] && shift
python3 benchmarks/e2e/bench_vllm_server.py --dir "$DIR" --out "$RES" --resume --deadline-s "${DEADLINE_S:-510}" \
  --configs "$CONFIGS" "$@"
rc=$?
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
  cp "$RES"/results.json "$RES"/results.md "$OUT"/ 2>/dev/null
  n=0
  for f in "$RES"/server-*.log; do
    [ -f "$f" ] || continue
    [ $n -lt 6 ] || break
    tail -c 3000000 "$f" > "$OUT/$(basename "$f")"
    n=$((n + 1))
  done
fi
exit $rc
