#!/usr/bin/env bash
# Two suites at once on separate GPUs and separate disks: V = TP1 on GPU0 on the virtio disk,
# B = TP2 on GPUs 1,2 on a RAM device (gds capacity is per rank: 11G each).
bash benchmarks/e2e/gpu_prepare.sh 2>&1 | tail -1
source /var/tmp/hgds-e2e/env.sh
T=${T:-400}; D=$((T-30))
( CUDA_VISIBLE_DEVICES=0 E2E_OUT=/var/tmp/e2e-V timeout -s TERM $T bash benchmarks/e2e/run_e2e.sh suite llama3-8b-shape \
  --configs recompute,gds-wait_complete,gds-compute_or_load --workloads single,burst --reps single=3,burst=1 --capacity 22G \
  --deadline $D > /var/tmp/V.log 2>&1; echo "V rc=$?" >> /var/tmp/V.log ) &
( CUDA_VISIBLE_DEVICES=1,2 RAM_ROOT=/mnt/ram-b RAM_SIZE=56G E2E_OUT=/var/tmp/e2e-B timeout -s TERM $T \
  bash benchmarks/e2e/run_fast_device.sh llama3-8b-shape --tp 2 --configs recompute,nixl,gds-compute_or_load \
  --workloads single,burst --single 8 --lengths 10240:26624 --prefixes 8 --reps single=2,burst=1 --capacity 11G \
  --deadline $D > /var/tmp/B.log 2>&1; echo "B rc=$?" >> /var/tmp/B.log ) &
wait
pkill -f "[s]glang.launch_server"
tail -n 4 /var/tmp/V.log /var/tmp/B.log
tar -cJf $OUT/res.tar.xz -C /var/tmp e2e-V e2e-B V.log B.log; cp /var/tmp/e2e-V/suite-*.md /var/tmp/e2e-B/fast/suite-*.md $OUT/ 2>/dev/null; ls -la $OUT
