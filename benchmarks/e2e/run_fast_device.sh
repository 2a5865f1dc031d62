#!/usr/bin/env bash
# The compute-or-load suite on a fast device: a RAM-backed ext4 (benchmarks/ramdev.sh) in place of
# the disk, the device's raw O_DIRECT read measured in the same run, every measurement started once
# the device has written nothing for --quiet-s (its written sectors; `du` cannot tell for slabs).
#
#   sudo bash benchmarks/e2e/run_fast_device.sh MODEL [suite args...]     # e.g. llama3-8b-shape
#   sudo bash benchmarks/e2e/run_fast_device.sh down                      # remove the devices
#
# RAM_SIZE (per device, default 36G) and RAM_COUNT (default 1) size the devices, made once and kept
# while the machine lives (a chained call resumes on them); RAM_ROOT (default /mnt/hicache-ram).
# The suite's L3s go to RAM_ROOT/dev0/e2e; with RAM_COUNT > 1 and `--gds-path` naming several
# devices (RAM_ROOT/dev0,RAM_ROOT/dev1,...), hicache-gds stripes its pages across them.
# Results: $E2E_OUT/fast (default /var/tmp/e2e-out/fast).
set -uo pipefail
cd "$(dirname "$0")/../.."
[ -f /var/tmp/hgds-e2e/env.sh ] && source /var/tmp/hgds-e2e/env.sh
ROOT=${RAM_ROOT:-/mnt/hicache-ram}
OUT=${E2E_OUT:-/var/tmp/e2e-out}/fast
model=${1:?usage: run_fast_device.sh MODEL [suite args...] | down}
shift
if [ "$model" = down ]; then
  bash benchmarks/ramdev.sh down --root "$ROOT"
  exit $?
fi
if ! mountpoint -q "$ROOT/dev0" 2>/dev/null; then
  bash benchmarks/ramdev.sh up --size "${RAM_SIZE:-36G}" --count "${RAM_COUNT:-1}" --root "$ROOT" || exit 1
fi
mkdir -p "$OUT"
bash benchmarks/ramdev.sh status --root "$ROOT" | tee -a "$OUT/devices.txt"
python3 benchmarks/e2e/bench_sglang_server.py --mode suite --model "benchmarks/e2e/$model" --dir "$ROOT/dev0/e2e" \
  --out "$OUT" --resume "$@"
rc=$?
bash benchmarks/ramdev.sh status --root "$ROOT" | tee -a "$OUT/devices.txt"
exit $rc
