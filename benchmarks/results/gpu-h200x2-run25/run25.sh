#!/usr/bin/env bash
# Run 25 on two H200s: MODE = virtio2 | fast2 | b32. T = this call's seconds for the suite.
#   virtio2: 8B shape at TP=2 on the virtio disk: the default against recompute and HiCacheNixl
#   fast2:   8B shape at TP=2 on one RAM device: the same three
#   b32:     32B shape at TP=1 on the virtio disk: the default against recompute (the table's 32B cells)
#   b32b:    the same with the table's 8 prompts one at a time and two bursts (a later call)
MODE=${1:?mode}; T=${T:-520}; D=$((T-25))
bash benchmarks/e2e/gpu_prepare.sh 2>&1 | tail -1
source /var/tmp/hgds-e2e/env.sh
nproc; free -g | head -2; nvidia-smi -L
case $MODE in
virtio2)
  E2E_OUT=/var/tmp/e2e-V2 timeout -s TERM $T bash benchmarks/e2e/run_e2e.sh suite llama3-8b-shape --tp 2 \
    --configs recompute,nixl,gds-compute_or_load --workloads single,burst \
    --reps single=3,burst=2 --capacity 11G --deadline $D > /var/tmp/V2.log 2>&1
  echo "V2 rc=$?" >> /var/tmp/V2.log; tail -n 5 /var/tmp/V2.log
  W=e2e-V2; L=V2.log;;
fast2)
  R=/mnt/ram-f
  RAM_ROOT=$R RAM_SIZE=48G E2E_OUT=/var/tmp/e2e-F2 timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    llama3-8b-shape --tp 2 --configs recompute,gds-compute_or_load,nixl \
    --workloads single,burst --single 8 --lengths 10240:26624 --prefixes 8 --reps single=3,burst=3 \
    --capacity 11G --raw-size 1G --deadline $D > /var/tmp/F2.log 2>&1
  echo "F2 rc=$?" >> /var/tmp/F2.log; tail -n 5 /var/tmp/F2.log
  RAM_ROOT=$R bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-F2; L=F2.log;;
b32)
  CUDA_VISIBLE_DEVICES=0 E2E_OUT=/var/tmp/e2e-32 timeout -s TERM $T bash benchmarks/e2e/run_e2e.sh suite llama-32b-shape \
    --capacity 41G --workloads single,burst --configs recompute,gds-compute_or_load --reps single=1,burst=1 \
    --deadline $D > /var/tmp/S.log 2>&1
  echo "S rc=$?" >> /var/tmp/S.log; tail -n 6 /var/tmp/S.log
  W=e2e-32; L=S.log;;
b32b)
  CUDA_VISIBLE_DEVICES=0 E2E_OUT=/var/tmp/e2e-32b timeout -s TERM $T bash benchmarks/e2e/run_e2e.sh suite llama-32b-shape \
    --capacity 41G --workloads single,burst --single 8 --configs recompute,gds-compute_or_load --reps single=1,burst=2 \
    --deadline $D > /var/tmp/S2.log 2>&1
  echo "S2 rc=$?" >> /var/tmp/S2.log; tail -n 8 /var/tmp/S2.log
  W=e2e-32b; L=S2.log;;
esac
pkill -f "[s]glang.launch_server"; sleep 1
tar -cJf $OUT/res-$MODE.tar.xz -C /var/tmp $W $L
find /var/tmp/$W -name 'suite-*.md' -exec cp {} $OUT/ \; ; find /var/tmp/$W -name 'suite-*.json' -exec cp {} $OUT/ \; ; ls -la $OUT
