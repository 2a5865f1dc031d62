#!/usr/bin/env bash
# Run 22 on one H200: MODE = mla | mla2 | mla3. T = this call's seconds for the suite.
#   fast:   the default (cut heads, both hold fixes) against `policy_split=always` in a burst, one RAM device
#   virtio: the default against whole-chunk heads on the slow disk, with both hold fixes
#   mla:    the DeepSeek-V3 shape (6 layers, bf16) on one RAM device: bursts with and without the host-room wait
#   mla2:   the same shape's burst, 3 reps against recompute (admission heeding the prefetches' host share)
#   mla3:   the same shape one at a time against HiCacheNixl and recompute, and gds's burst once more
MODE=${1:?mode}; T=${T:-540}; D=$((T-25))
bash benchmarks/e2e/gpu_prepare.sh 2>&1 | tail -1
source /var/tmp/hgds-e2e/env.sh
nproc; free -g | head -2
case $MODE in
fast)
  R=/mnt/ram-f
  RAM_ROOT=$R RAM_SIZE=48G E2E_OUT=/var/tmp/e2e-G timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    llama3-8b-shape --configs recompute,nixl,gds-compute_or_load,gds-compute_or_load+policy_split=always \
    --workloads single,burst --single 8 --lengths 10240:26624 --prefixes 8 --reps single=3,burst=2 \
    --capacity 21G --raw-size 1G --deadline $D > /var/tmp/F.log 2>&1
  echo "F rc=$?" >> /var/tmp/F.log; tail -n 5 /var/tmp/F.log
  RAM_ROOT=$R bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-G; L=F.log;;
mla)
  RAM_ROOT=/mnt/ram-m RAM_SIZE=24G E2E_OUT=/var/tmp/e2e-M timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    deepseek-v3-shape --layers 6 --weights bf16 --mem-fraction 0.85 --capacity 4G \
    --configs gds-compute_or_load,gds-compute_or_load+policy_room_wait=false,recompute --workloads burst --reps burst=2 \
    --deadline $D > /var/tmp/M.log 2>&1
  echo "M rc=$?" >> /var/tmp/M.log; tail -n 5 /var/tmp/M.log
  RAM_ROOT=/mnt/ram-m bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-M; L=M.log;;
mla2)
  RAM_ROOT=/mnt/ram-m RAM_SIZE=24G E2E_OUT=/var/tmp/e2e-N timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    deepseek-v3-shape --layers 6 --weights bf16 --mem-fraction 0.85 --capacity 4G \
    --configs gds-compute_or_load,recompute --workloads burst --reps burst=3 \
    --deadline $D > /var/tmp/N.log 2>&1
  echo "N rc=$?" >> /var/tmp/N.log; tail -n 5 /var/tmp/N.log
  RAM_ROOT=/mnt/ram-m bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-N; L=N.log;;
mla3)
  RAM_ROOT=/mnt/ram-m RAM_SIZE=24G E2E_OUT=/var/tmp/e2e-P timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    deepseek-v3-shape --layers 6 --weights bf16 --mem-fraction 0.85 --capacity 4G \
    --configs gds-compute_or_load,nixl,recompute --workloads single,burst --single 8 --reps single=2,burst=1 \
    --deadline $D > /var/tmp/P.log 2>&1
  echo "P rc=$?" >> /var/tmp/P.log; tail -n 5 /var/tmp/P.log
  RAM_ROOT=/mnt/ram-m bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-P; L=P.log;;
virtio)
  E2E_OUT=/var/tmp/e2e-V timeout -s TERM $T bash benchmarks/e2e/run_e2e.sh suite llama3-8b-shape \
    --configs recompute,nixl,gds-compute_or_load,gds-compute_or_load+policy_split_cut=false --workloads single,burst \
    --reps single=3,burst=2 --capacity 22G --deadline $D > /var/tmp/V.log 2>&1
  echo "V rc=$?" >> /var/tmp/V.log; tail -n 5 /var/tmp/V.log
  W=e2e-V; L=V.log;;
esac
pkill -f "[s]glang.launch_server"; sleep 1
tar -cJf $OUT/res-$MODE.tar.xz -C /var/tmp $W $L
find /var/tmp/$W -name 'suite-*.md' -exec cp {} $OUT/ \; ; find /var/tmp/$W -name 'suite-*.json' -exec cp {} $OUT/ \; ; ls -la $OUT
