#!/usr/bin/env bash
# Run 24, last call on one H200: the 32B shape on the virtio disk, one repetition, default against recompute,
# results written straight under $OUT (the session's device time ends with this call).
bash benchmarks/e2e/gpu_prepare.sh 2>&1 | tail -1
source /var/tmp/hgds-e2e/env.sh
E2E_OUT=$OUT/e2e32 timeout -s TERM ${T:-300} bash benchmarks/e2e/run_e2e.sh suite llama-32b-shape --capacity 41G \
  --workloads single,burst --configs recompute,gds-compute_or_load --reps single=1,burst=1 --deadline ${D:-280} \
  > $OUT/S.log 2>&1
echo "S rc=$?" >> $OUT/S.log; tail -n 6 $OUT/S.log
pkill -f "[s]glang.launch_server"; sleep 1
