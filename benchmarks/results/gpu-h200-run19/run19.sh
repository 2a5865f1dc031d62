#!/usr/bin/env bash
# Run 19 on one H200: MODE = stripe | mla | virtio. T = this call's seconds for the suite.
MODE=${1:?mode}; T=${T:-520}; D=$((T-25))
bash benchmarks/e2e/gpu_prepare.sh 2>&1 | tail -1
source /var/tmp/hgds-e2e/env.sh
nproc; free -g | head -2
case $MODE in
stripe)
  R=/mnt/ram-s
  RAM_ROOT=$R RAM_COUNT=4 RAM_SIZE=27G E2E_OUT=/var/tmp/e2e-S timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    llama3-8b-shape --gds-path $R/dev0,$R/dev1,$R/dev2,$R/dev3 \
    --configs recompute,nixl,gds-wait_complete,gds-compute_or_load --workloads single,burst --single 8 \
    --lengths 10240:26624 --prefixes 8 --reps single=3,burst=1 --capacity 20G --raw-size 1G --deadline $D > /var/tmp/S.log 2>&1
  echo "S rc=$?" >> /var/tmp/S.log; tail -n 5 /var/tmp/S.log
  RAM_ROOT=$R bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-S; L=S.log;;
mla)
  for r in /mnt/ram-s; do RAM_ROOT=$r bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1; done
  RAM_ROOT=/mnt/ram-m RAM_SIZE=24G E2E_OUT=/var/tmp/e2e-M timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    deepseek-v3-shape --layers 6 --weights bf16 --mem-fraction 0.85 --capacity 4G \
    --configs recompute,nixl,gds-compute_or_load --workloads single,burst --single 8 --reps single=2,burst=1 \
    --deadline $D > /var/tmp/M.log 2>&1
  echo "M rc=$?" >> /var/tmp/M.log; tail -n 5 /var/tmp/M.log
  RAM_ROOT=/mnt/ram-m bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-M; L=M.log;;
virtio)
  E2E_OUT=/var/tmp/e2e-V timeout -s TERM $T bash benchmarks/e2e/run_e2e.sh suite llama3-8b-shape \
    --configs recompute,nixl,gds-wait_complete,gds-compute_or_load --workloads single,burst --reps single=3,burst=1 \
    --capacity 22G --deadline $D > /var/tmp/V.log 2>&1
  echo "V rc=$?" >> /var/tmp/V.log; tail -n 5 /var/tmp/V.log
  W=e2e-V; L=V.log;;
esac
pkill -f "[s]glang.launch_server"; sleep 1
tar -cJf $OUT/res-$MODE.tar.xz -C /var/tmp $W $L
find /var/tmp/$W -name 'suite-*.md' -exec cp {} $OUT/ \; ; ls -la $OUT
