#!/usr/bin/env bash
# Path-X fine-tune variants side by side (on one GPU, or one per GPU of a machine with several), each resuming where the last command stopped:
#   experiments/studies/pathx/variants.sh STATE MINUTES SPEC [SPEC ...]
# A SPEC is one variant's settings for campaign.sh, e.g. "FREEZE=encoder.pos" or
# "AUGMENT=dihedral FREEZE=encoder.pos" ("" is the faithful run). The trimmed, CUDA-graphed step
# leaves the GPU idle part of the time (the host feeds it), so two runs on one GPU cost less than
# two in turn; each one's step_ms in its train.csv says how much.
# The data are made once first (campaign.sh with ONLY=data); each variant then gets
# LOADER_WORKERS (default: the cores / number of variants, at most 16) and writes STATE/<run>.log as
# campaign.sh does. On a machine with several GPUs variant i runs on GPU i mod their number.
# REQUIRE and OUT behave as in campaign.sh: the state goes back once, at exit, in 15 MiB parts.
set -uo pipefail
state=$1; minutes=$2; shift 2
[ $# -ge 1 ] || { echo "variants.sh: give at least one SPEC" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
t0=$(date +%s)
. "$here/state.sh"
send_state_back "$state"
OUT= ONLY=data bash "$here/campaign.sh" "$state" "$minutes" || exit $?
left=$(( minutes * 60 - ($(date +%s) - t0) ))
mins=$(python3 -c "print(max(0, $left // 60))")
[ "$mins" -ge 2 ] || { echo "variants.sh: no time left after the data" >&2; exit 75; }
cores=$(nproc); per=$(( cores / $# )); workers=${LOADER_WORKERS:-$(( per > 16 ? 16 : per ))}
# several GPUs: variant i on GPU i mod (number of GPUs); one GPU: all of them on it
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
pids=(); i=0
for spec in "$@"; do
    dev=(); [ "$gpus" -ge 2 ] && dev=(CUDA_VISIBLE_DEVICES=$(( i % gpus )))
    # the variant's settings and nothing inherited: AUGMENT / FREEZE / SET / TAG / INIT unset unless the SPEC sets them
    env -u AUGMENT -u FREEZE -u SET -u TAG -u INIT -u ONLY OUT= REQUIRE= LOADER_WORKERS="$workers" "${dev[@]}" $spec \
        bash "$here/campaign.sh" "$state" "$mins" &
    pids+=($!); i=$(( i + 1 ))
done
# exit as campaign.sh does: an error code if any variant failed, else 75 if any has time left to run, else 0
wait_runs "${pids[@]}"
