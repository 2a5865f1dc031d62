#!/usr/bin/env bash
# Run 24 on one H200: MODE = fast | virtio. T = this call's seconds for the suite.
#   fast:   8B shape, one RAM device: the default (loads paced by their last get's end, holds for host room and
#           for the prefetch share) in a burst and one at a time, against recompute, HiCacheNixl and wait_complete
#   virtio: the same default on the slow disk against recompute and HiCacheNixl
MODE=${1:?mode}; T=${T:-520}; D=$((T-25))
bash benchmarks/e2e/gpu_prepare.sh 2>&1 | tail -1
source /var/tmp/hgds-e2e/env.sh
nproc; free -g | head -2
case $MODE in
fast)
  R=/mnt/ram-f
  RAM_ROOT=$R RAM_SIZE=48G E2E_OUT=/var/tmp/e2e-G timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    llama3-8b-shape --configs recompute,gds-compute_or_load,nixl,gds-wait_complete \
    --workloads single,burst --single 8 --lengths 10240:26624 --prefixes 8 --reps single=2,burst=3 \
    --capacity 21G --raw-size 1G --deadline $D > /var/tmp/F.log 2>&1
  echo "F rc=$?" >> /var/tmp/F.log; tail -n 5 /var/tmp/F.log
  RAM_ROOT=$R bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-G; L=F.log;;
virtio)
  E2E_OUT=/var/tmp/e2e-V timeout -s TERM $T bash benchmarks/e2e/run_e2e.sh suite llama3-8b-shape \
    --configs recompute,nixl,gds-compute_or_load --workloads single,burst \
    --reps single=3,burst=2 --capacity 22G --deadline $D > /var/tmp/V.log 2>&1
  echo "V rc=$?" >> /var/tmp/V.log; tail -n 5 /var/tmp/V.log
  W=e2e-V; L=V.log;;
esac
pkill -f "[s]glang.launch_server"; sleep 1
tar -cJf $OUT/res-$MODE.tar.xz -C /var/tmp $W $L
find /var/tmp/$W -name 'suite-*.md' -exec cp {} $OUT/ \; ; find /var/tmp/$W -name 'suite-*.json' -exec cp {} $OUT/ \; ; ls -la $OUT
