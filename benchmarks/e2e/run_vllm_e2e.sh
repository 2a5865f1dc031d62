#!/usr/bin/env bash
# Run the vLLM server comparison on a GPU machine prepared by gpu_prepare_vllm.sh.
#
#   bash benchmarks/e2e/run_vllm_e2e.sh                     # the plan below, in one device call (<= 9 min)
#   bash benchmarks/e2e/run_vllm_e2e.sh CONFIGS [options]   # one model, bench_vllm_server.py options
#       CONFIGS: recompute,cpu,gds,bounce,gds-cost,gds-plain
#
# The plan (no CONFIGS): every server start costs 55-96 s, so five fit in DEADLINE_S (530 s for
# everything, the device call's 9 minutes less a margin):
#   1. the 8B shape (128 KiB of KV per token), 4 prefixes x 16k tokens: recompute, gds -- the load
#      path, greedy tokens against recompute; and the raw O_DIRECT read of the disk (2 GiB);
#   2. the 32B shape (256 KiB per token), 3 prefixes x 16k tokens, 2048 GPU blocks (32k tokens):
#      recompute, gds-cost (load or recompute by the model), gds (load everything found);
#   3. if the time is left, the 8B shape's cpu (vLLM's own CPU offloading, 6 GiB: less than the
#      8 GiB working set, so its revisits recompute -- the issue's baseline for NVMe-only revisits)
#      and gds-cost (it should recompute: 33k tokens/s of prefill is 4.2 GB/s of KV, faster than the
#      1.66 GB/s disk). A second call of this script (resumable) runs what the first had no time for.
# No configuration starts unless its budget fits, none runs past the deadline (its error is
# recorded and the run goes on), and each one's results are copied to $OUT/<shape>/ as it ends,
# with the tails of the server logs, so what a killed call leaves still comes back.
#
# E2E_DRY_RUN=1 runs the plan against fake_vllm_server.py (CPU, no model), RAW_SIZE sets the raw
# measurement's bytes (default 2 GiB). Resumable: configurations already measured under $E2E_OUT
# are kept (--resume). NIXL comes from
# .gpu/setup.sh when .whl/ was carried (../shared/device/wheels.sh nixl) or from an earlier call on
# the same machine (/tmp/site).
set -uo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1 && [ -f .gpu/setup.sh ]; then
  # shellcheck disable=SC1091
  source .gpu/setup.sh
fi
# shellcheck disable=SC1091
[ -f /var/tmp/hgds-vllm/env.sh ] && source /var/tmp/hgds-vllm/env.sh
DIR=${E2E_DIR:-/var/tmp/vllm-e2e-store}
RES=${E2E_OUT:-/var/tmp/vllm-e2e-out}
DEADLINE_S=${DEADLINE_S:-530}
RAW_SIZE=${RAW_SIZE:-$((2 << 30))}
E2E=benchmarks/e2e
DRY=()
[ -n "${E2E_DRY_RUN:-}" ] && DRY=(--dry-run --stable-s 0.5)  # fake_vllm_server.py: the plan, checked on CPU

left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }

copy_out() {  # results and server-log tails of one output directory to $OUT/<name>
  local src=$1 name=$2
  [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] || return 0
  mkdir -p "$OUT/$name"
  cp "$src"/results.json "$src"/results.md "$OUT/$name/" 2>/dev/null
  for f in "$src"/server-*.log; do
    [ -f "$f" ] && tail -c 1000000 "$f" > "$OUT/$name/$(basename "$f")"
  done
  return 0
}

bench() {  # name, then bench_vllm_server.py options
  local name=$1; shift
  local budget
  budget=$(left)
  if [ "$budget" -lt 60 ]; then echo "[plan] $name: $budget s left, not started"; return 3; fi
  local mirror=()
  [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] && mirror=(--mirror "$OUT/$name")
  echo "[plan] $name: $budget s left"
  python3 $E2E/bench_vllm_server.py --dir "$DIR" --out "$RES/$name" --resume --deadline-s "$budget" \
    "${mirror[@]}" "${DRY[@]}" "$@"
  local rc=$?
  copy_out "$RES/$name" "$name"
  return $rc
}

if [ $# -gt 0 ]; then  # one model, as asked
  CONFIGS=$1; shift
  bench single --configs "$CONFIGS" "$@"
  exit $?
fi

rc=0
bench 8b --model $E2E/llama3-8b-shape --configs recompute,gds --prefixes 4 --raw-size "$RAW_SIZE" \
  --config-budget-s 110 --workload-timeout-s 60 || rc=$?
bench 32b --model $E2E/llama-32b-shape --configs recompute,gds-cost,gds --prefixes 3 --gpu-blocks 2048 \
  --gpu-mem 0.75 --raw-size 0 --raw-from "$RES/8b/results.json" --config-budget-s 120 --workload-timeout-s 90 \
  --capacity 24G || rc=$?
bench 8b --model $E2E/llama3-8b-shape --configs recompute,gds,cpu,gds-cost --prefixes 4 --raw-size 0 \
  --config-budget-s 100 --workload-timeout-s 60 || rc=$?
echo "[plan] done in $(( $(date +%s) - T0 )) s, status $rc"
exit $rc
