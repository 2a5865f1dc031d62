#!/usr/bin/env bash
# Run the server comparison on a GPU machine prepared by gpu_prepare.sh (or any machine where
# `sglang`, `hicache-gds` and `hicache-gds-sglang` are installed):
#
#   bash benchmarks/e2e/run_e2e.sh [prefix|multiturn|ops|all] [CONFIGS]    # default: all
#   bash benchmarks/e2e/run_e2e.sh suite MODEL [ARGS...]                   # e.g. suite llama-32b-shape --capacity 42G
#   bash benchmarks/e2e/run_e2e.sh clean MODEL                              # remove that shape's L3 ($E2E_DIR/MODEL)
#   bash benchmarks/e2e/run_e2e.sh busy                                     # no server, ~3 min: see below
#
# prefix     bench_sglang_server.py, 16k-token prefix revisits (CONFIGS default recompute,hicache,file,nixl,gds)
# multiturn  bench_sglang_server.py --mode multiturn (CONFIGS default recompute,nixl,gds)
# ops        check_server_ops.py: restart, runtime detach/attach, /flush_cache, a second server, shutdown
# busy       the store's get beside a thread busy in Python, as a scheduler loop is: bench_busy_host.py
#            (the store alone, 5 ms vs the store's switch interval) and bench_sglang.py --busy
#            (HiCacheGDS against HiCacheNixl with SGLang's classes, 8 MiB page_first pages); results
#            under $E2E_OUT/busy
# suite      bench_sglang_server.py --mode suite: one server for MODEL (a directory of benchmarks/e2e),
#            configurations switched at runtime; its L3 under $E2E_DIR/MODEL, kept between calls
#            (--resume), results $E2E_OUT/suite-MODEL.{json,md,-ttft-p90.png}; ARGS go to the harness
#            (--deadline, --rates, --capacity, ...). Exit 3: measurements left, call it again.
#
# Resumable: configurations already measured under $E2E_OUT are kept (--resume), so a run longer
# than one call continues where it stopped. E2E_DIR is the disk under test (default
# /var/tmp/e2e-store), E2E_OUT the results (default /var/tmp/e2e-out).
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -f /var/tmp/hgds-e2e/env.sh ] && source /var/tmp/hgds-e2e/env.sh
DIR=${E2E_DIR:-/var/tmp/e2e-store}
OUT=${E2E_OUT:-/var/tmp/e2e-out}
what=${1:-all}
rc=0
if [ "$what" = suite ]; then
  model=${2:?usage: run_e2e.sh suite MODEL [ARGS...]}
  shift 2
  python3 benchmarks/e2e/bench_sglang_server.py --mode suite --model "benchmarks/e2e/$model" --dir "$DIR/$model" \
    --out "$OUT" --resume --plot "$@"
  exit $?
fi
if [ "$what" = busy ]; then
  mkdir -p "$OUT/busy"
  python3 benchmarks/bench_busy_host.py --dir "$DIR/busy-host" --out "$OUT/busy" || rc=1
  python3 benchmarks/bench_sglang.py --dir "$DIR/busy-sglang" --rounds 4 --pages 128 --page-tokens 64 \
    --backends gds,nixl,raw --busy --json "$OUT/busy/sglang-busy.json" > "$OUT/busy/sglang-busy.md" 2>&1 || rc=1
  tail -12 "$OUT/busy/sglang-busy.md"
  rm -rf "${DIR:?}/busy-host" "${DIR:?}/busy-sglang"
  exit $rc
fi
if [ "$what" = clean ]; then
  model=${2:?usage: run_e2e.sh clean MODEL}
  rm -rf "${DIR:?}/$model"
  df -h "$DIR" | tail -1
  exit 0
fi
if [ "$what" = prefix ] || [ "$what" = all ]; then
  python3 benchmarks/e2e/bench_sglang_server.py --dir "$DIR" --out "$OUT" --resume \
    --configs "${2:-recompute,hicache,file,nixl,gds}" || rc=1
fi
if [ "$what" = multiturn ] || [ "$what" = all ]; then
  python3 benchmarks/e2e/bench_sglang_server.py --dir "$DIR" --out "$OUT" --resume --mode multiturn \
    --clients 16 --rounds 3 --configs "${2:-recompute,nixl,gds}" --raw-size 0 || rc=1
fi
if [ "$what" = ops ] || [ "$what" = all ]; then
  python3 benchmarks/e2e/check_server_ops.py --dir "$DIR/ops" --out "$OUT/ops" || rc=1
fi
exit $rc
