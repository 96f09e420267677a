#!/usr/bin/env bash
# The first device call on a machine with several GPUs (4 here), from a snapshot's root:
#   experiments/studies/pathx/multi_gpu_call.sh STATE MINUTES SPEC [SPEC ...]
# 1. side by side: the Path-X data (campaign.sh ONLY=data, WORKERS cores), the Hopper kernels'
#    exact-mask tests and bench on GPU 0 (gpu_session.sh exact, at most EXACT_S seconds), and the
#    graphed data-parallel test on GPUs 2 and 3 (NCCL);
# 2. dp_scaling.sh on every GPU (STEPS steps per run, on the data of step 1);
# 3. variants.sh with the SPECs (one per GPU) for the minutes left.
# What steps 1-2 measure and log goes back as OUT/results.tgz (one file: a call returns at most 8, and
# the state's parts need 4); the state goes back as variants.sh sends it.
set -uo pipefail
state=$1; minutes=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
out=${OUT:?set OUT}
t0=$(date +%s)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
[ -f COMMIT ] && export SPARSEFLASH_COMMIT=$(cat COMMIT)
w=${WORK:-/tmp/multi-gpu-call}; rm -rf "$w"; mkdir -p "$w/logs"
stamp() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi -L | tee "$w/logs/gpus.txt"

stamp "1. data, exact-mask tests and bench (GPU 0), data-parallel test (GPUs 2, 3)"
( CUDA_VISIBLE_DEVICES=0 timeout "${EXACT_S:-360}" bash "$root/experiments/gpu_session.sh" "$w" exact \
    > "$w/logs/exact.log" 2>&1; echo "exact: exit $?" >> "$w/logs/exact.log" ) &
( CUDA_VISIBLE_DEVICES=2,3 timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short \
    tests/test_lra_train.py -k graphed_data_parallel > "$w/logs/dp_test.log" 2>&1
  echo "dp test: exit $?" >> "$w/logs/dp_test.log" ) &
OUT= ONLY=data bash "$here/campaign.sh" "$state" "$minutes" > "$w/logs/data.log" 2>&1 \
    || { stamp "data failed"; tail -n 20 "$w/logs/data.log"; wait; exit 1; }
stamp "data ready"
wait
tail -n 3 "$w/logs/exact.log" "$w/logs/dp_test.log"

stamp "2. data-parallel scaling"
DATA=${DATA:-/tmp/pathx-data} STEPS=${STEPS:-2000} LOADER_WORKERS=${DP_LOADER_WORKERS:-8} \
    bash "$here/dp_scaling.sh" "$w/dp" 2>&1 | tee "$w/logs/dp_scaling.log"
tar czf "$out/results.tgz" -C "$(dirname "$w")" --exclude='*.pt' "$(basename "$w")" || true

left=$(( minutes * 60 - ($(date +%s) - t0) ))
mins=$(( left / 60 ))
stamp "3. variants for $mins minutes"
[ "$mins" -ge 2 ] || { echo "no time left for the variants (under 2 minutes)"; exit 75; }
bash "$here/variants.sh" "$state" "$mins" "$@"
