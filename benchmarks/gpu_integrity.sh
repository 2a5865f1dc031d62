#!/usr/bin/env bash
# The GPU machine's part of the integrity work (issue 19), in two bounded parts of under 9 minutes
# each; every result lands under $OUT (default ./gpu-integrity-out). Run from the project root with
# the nixl and cufile wheels carried (../shared/device/wheels.sh all -> .whl/, .gpu/):
#
#   source .gpu/setup.sh && bash benchmarks/gpu_integrity.sh 1   # checksum cost, GPU-page corruption, checksum tests
#   source .gpu/setup.sh && bash benchmarks/gpu_integrity.sh 2   # cufile/kvikio engines, doctor, the linker (-m gpu)
#
# Part 1 (about 3-5 min): benchmarks/bench_checksum.py -> checksum.json / checksum.md (the GPU
# kernel per page size against the IO of the same pages; verified gets on and off; numpy and
# xxh3 on the host); the GPU-page family of the reliability run -> integrity_gpu.json; pytest -m
# gpu tests/test_gpu_checksum.py tests/test_gpu.py -> part1.log, part1.xml.
# Part 2 (about 4-7 min): pytest -m gpu tests/test_gpu_engines.py tests/test_doctor.py
# tests/test_gpu_linker.py -> part2.log, part2.xml (the cufile engine with cufile-python carried,
# the mended 300-descriptor test, every linker load now verified on the GPU).
# Each step has its own timeout, so a hang costs that step only; rerunning a part redoes it.
set -uo pipefail
part=${1:?usage: gpu_integrity.sh 1|2}
OUT=${OUT:-$PWD/gpu-integrity-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run() {  # run SECONDS NAME CMD...: bounded, logged, never stopping the next step
  local t=$1 name=$2; shift 2
  echo "== $name ($(date +%T), at most ${t}s)" | tee -a "$OUT/steps.txt"
  timeout "$t" "$@"
  echo "== $name: rc $? ($(date +%T))" | tee -a "$OUT/steps.txt"
}
case $part in
  1)
    run 170 bench_checksum python3 benchmarks/bench_checksum.py --out "$OUT" 2>&1 | tee "$OUT/bench_checksum.log"
    run 90 integrity_gpu sh -c "python3 -m hicache_gds.testing.integrity --gpu-only > '$OUT/integrity_gpu.json'"
    run 240 part1 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --junitxml="$OUT/part1.xml" \
        tests/test_gpu_checksum.py tests/test_gpu.py 2>&1 | tee "$OUT/part1.log"
    ;;
  2)
    run 510 part2 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --junitxml="$OUT/part2.xml" \
        tests/test_gpu_engines.py tests/test_doctor.py tests/test_gpu_linker.py 2>&1 | tee "$OUT/part2.log"
    ;;
  *) echo "usage: $0 1|2" >&2; exit 2 ;;
esac
