#!/usr/bin/env bash
# Run 28: MODE = ct1 | ct2 | ct32. T = this call's seconds for the suite. Resumable: a second call with the same
# MODE continues where the first stopped (run_e2e.sh / run_fast_device.sh --resume).
# Each measures recompute, the default and the default with policy_ride=true (finished loads ride along a chunked
# request's passes, a pass waits a decode step for their GPU memory: `ride`), interleaved, bursts of 8, 3 repetitions:
#   ct1:  8B shape, TP=1 (GPU 0), one RAM device (CAP: the store, 21G)
#   ct2:  8B shape, TP=2, one RAM device
#   ct32: 32B shape, TP=1, virtio disk
# CONFIGS and REPS override the configurations and repetitions.
MODE=${1:?mode}; T=${T:-520}; D=$((T-25))
bash benchmarks/e2e/gpu_prepare.sh 2>&1 | tail -1
source /var/tmp/hgds-e2e/env.sh
nproc; free -g | head -2; nvidia-smi -L
LS=${CONFIGS:-recompute,gds-compute_or_load,gds-compute_or_load+policy_ride=true}
case $MODE in
ct32)
  CUDA_VISIBLE_DEVICES=0 E2E_OUT=/var/tmp/e2e-ct32 timeout -s TERM $T bash benchmarks/e2e/run_e2e.sh suite llama-32b-shape \
    --capacity 41G --workloads burst --configs $LS --reps burst=${REPS:-3} --deadline $D >> /var/tmp/CT32.log 2>&1
  echo "CT32 rc=$?" >> /var/tmp/CT32.log; tail -n 8 /var/tmp/CT32.log
  W=e2e-ct32; L=CT32.log;;
ct2)
  R=/mnt/ram-f
  RAM_ROOT=$R RAM_SIZE=48G E2E_OUT=/var/tmp/e2e-CT2 timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    llama3-8b-shape --tp 2 --configs $LS --workloads burst --lengths 10240:26624 --prefixes 8 --reps burst=${REPS:-3} \
    --capacity 11G --raw-size 1G --deadline $D >> /var/tmp/CT2.log 2>&1
  echo "CT2 rc=$?" >> /var/tmp/CT2.log; tail -n 8 /var/tmp/CT2.log
  RAM_ROOT=$R bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-CT2; L=CT2.log;;
ct1)
  R=/mnt/ram-f; N=CT1
  CUDA_VISIBLE_DEVICES=0 RAM_ROOT=$R RAM_SIZE=48G E2E_OUT=/var/tmp/e2e-$N timeout -s TERM $T bash benchmarks/e2e/run_fast_device.sh \
    llama3-8b-shape --configs $LS --workloads burst --lengths 10240:26624 --prefixes 8 --reps burst=${REPS:-3} \
    --capacity ${CAP:-21G} --raw-size 1G --deadline $D >> /var/tmp/$N.log 2>&1
  echo "$N rc=$?" >> /var/tmp/$N.log; tail -n 8 /var/tmp/$N.log
  RAM_ROOT=$R bash benchmarks/e2e/run_fast_device.sh down 2>&1 | tail -1
  W=e2e-$N; L=$N.log;;
esac
pkill -f "[s]glang.launch_server"; sleep 1
grep -rh "rides along\|waits a decode step" /var/tmp/$W 2>/dev/null | tail -n 12
tar -cJf $OUT/res-$MODE.tar.xz -C /var/tmp $W $L
find /var/tmp/$W -name 'suite-*.md' -exec cp {} $OUT/ \; ; find /var/tmp/$W -name 'suite-*.json' -exec cp {} $OUT/ \; ; ls -la $OUT
