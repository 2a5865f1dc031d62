#!/usr/bin/env bash
# Run 26: MODE = ls32 | fast2ls | fast1ls | fix1. T = this call's seconds for the suite. Resumable: a second call
# with the same MODE continues where the first stopped (run_e2e.sh --resume).
#   ls32:    32B shape, TP=1, virtio disk, bursts of 8: recompute, the default, the default with the late split
#   fast2ls: 8B shape, TP=2, one RAM device, bursts of 8: the same three
#   fast1ls: 8B shape, TP=1 (GPU 0), one RAM device, bursts of 8: the same three (CAP: the store, 21G;
#            the first call ran with 11G, too small for the 8 prompts' 19.4 GB at TP=1)
#   fix1:    fast1ls's bursts, recompute and the default, after the chunked split's backlog fix
MODE=${1:?mode}; T=${T:-520}; D=$((T-25))
bash benchmarks/e2e/gpu_prepare.sh 2>&1 | tail -1
source /var/tmp/hgds-e2e/env.sh
nproc; free -g | head -2; nvidia-smi -L
LS=recompute,gds-compute_or_load,gds-compute_or_load+policy_late_split=true
case $MODE in
ls32)
  CUDA_VISIBLE_DEVICES=0 E2E_OUT=/var/tmp/e2e-ls32 timeout -s TERM $T bash benchmarks/e2e/run_e2e.sh suite llama-32b-shape \
    --capacity 41G --workloads burst --configs $LS --reps burst=3 --deadline $D >> /var/tmp/LS32.log 2>&1
  echo "LS32 rc=$?" >> /var/tmp/LS32.log; tail -n 8 /var/tmp/LS32.log
  W=e2e-ls32; L=LS32.log;;
fast2ls)
  R=/mnt/ram-f
  RAM_ROOT=$R RAM_SIZE=48G E2E_OUT=/var/tmp/e2e-F2L timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    llama3-8b-shape --tp 2 --configs $LS --workloads burst --lengths 10240:26624 --prefixes 8 --reps burst=3 \
    --capacity 11G --raw-size 1G --deadline $D >> /var/tmp/F2L.log 2>&1
  echo "F2L rc=$?" >> /var/tmp/F2L.log; tail -n 8 /var/tmp/F2L.log
  RAM_ROOT=$R bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-F2L; L=F2L.log;;
fast1ls|fix1)
  R=/mnt/ram-f; N=F1L; C=$LS
  [ $MODE = fix1 ] && { N=X1; C=recompute,gds-compute_or_load; }
  CUDA_VISIBLE_DEVICES=0 RAM_ROOT=$R RAM_SIZE=48G E2E_OUT=/var/tmp/e2e-$N timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    llama3-8b-shape --configs $C --workloads burst --lengths 10240:26624 --prefixes 8 --reps burst=3 \
    --capacity ${CAP:-21G} --raw-size 1G --deadline $D >> /var/tmp/$N.log 2>&1
  echo "$N rc=$?" >> /var/tmp/$N.log; tail -n 8 /var/tmp/$N.log
  RAM_ROOT=$R bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-$N; L=$N.log;;
esac
pkill -f "[s]glang.launch_server"; sleep 1
grep -rh "its tail, split" /var/tmp/$W 2>/dev/null | tail -n 20
tar -cJf $OUT/res-$MODE.tar.xz -C /var/tmp $W $L
find /var/tmp/$W -name 'suite-*.md' -exec cp {} $OUT/ \; ; find /var/tmp/$W -name 'suite-*.json' -exec cp {} $OUT/ \; ; ls -la $OUT
