#!/usr/bin/env bash
# Run 28: run 27's calls (MODE = ct1 | ct2 | ct32, T, REPS as there) measuring recompute, the default and the
# default with policy_ride=true (finished loads ride along a chunked request's passes, a pass waits a decode step for
# their GPU memory: `ride`), interleaved, bursts of 8, 3 repetitions. CONFIGS overrides the configurations.
export CONFIGS=${CONFIGS:-recompute,gds-compute_or_load,gds-compute_or_load+policy_ride=true}
bash benchmarks/results/gpu-h200-run27/run27.sh "$@"
grep -rh "rides along\|waits a decode step" /var/tmp/e2e-* 2>/dev/null | tail -n 12
