#!/usr/bin/env bash
# Self-pretraining (SPT, Amos et al. 2024), then the classifier from it, on Pathfinder-32 (issue 20),
# split over as many device commands as it needs:
#   experiments/studies/pathfinder32-recipe/spt.sh RUNS MINUTES [SPT_STEPS [FT_STEPS]]
# Each call makes the data if DATA has none (200K hard images), then works through two stages in
# order until MINUTES (may be fractional) have passed since it started:
#   spt  `--config faithful --objective denoise --compile`: masked-token prediction on the training
#        images, a schedule of SPT_STEPS steps (default 20000; faithful's warm-up and linear decay);
#   ft   `--config faithful --compile` (the published classifier recipe, FT_STEPS steps if given,
#        else its 62,400), initialised from RUNS/spt/checkpoints/best.pt (lowest val masked loss).
# A stage resumes from its last.pt (RUNS/<stage>/) and stops before the deadline with a checkpoint;
# RUNS/<stage>.done marks a finished stage, which is not run again. Carry RUNS to the next call.
# Prints a table of both stages at the end. Exit: 0 when both are done, 75 when the time ran out
# (call again), else the status of the stage that failed.
# Environment: PYTHON (python3), DATA (data/lra), NUM (images to generate, 200000), PATTERN (dense;
# a block pattern for both stages, e.g. butterfly), COMPILE (1; 0: eager), MIN_LEFT (90: seconds a
# stage needs to be started), ARGS / SPT_ARGS / FT_ARGS (more `sparseflash lra train` options for
# both / one stage, e.g. ARGS="--device cpu --set model.d_model=32" for a dry run on the CPU).
set -uo pipefail
runs=$1; minutes=$2; spt_steps=${3:-20000}; ft_steps=${4:-}
py=${PYTHON:-python3}
data=${DATA:-data/lra}
export PYTHONUNBUFFERED=1
t0=$(date +%s)
budget=$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 }')
mkdir -p "$runs"
if ! ls "$data"/pathfinder32/curv_contour_length_14/metadata/*.npy >/dev/null 2>&1; then
    $py -m sparseflash lra data pathfinder --resolution 32 --difficulty hard --num "${NUM:-200000}" --out "$data" \
        --no-progress | tail -n 1
fi
$py -c "
from sparseflash.experiments.lra.data import get_dataset
for s in ('train', 'val', 'test'): get_dataset('pathfinder32', '$data', s, difficulty='hard', workers=16)" || exit 1
echo "data ready after $(( $(date +%s) - t0 )) s"
compile=--compile; [ "${COMPILE:-1}" = 0 ] && compile=

stage() {  # stage NAME [train options...]: run or resume one stage within what is left of the budget
    local name=$1; shift
    [ -e "$runs/$name.done" ] && return 0
    local left=$(( budget - ($(date +%s) - t0) ))
    if [ "$left" -lt "${MIN_LEFT:-90}" ]; then
        echo "--- $name: $left s left, not started; call again"
        return 75
    fi
    # shellcheck disable=SC2086
    $py -m sparseflash lra train --task pathfinder32 --config faithful --data "$data" --attention sparseflash \
        --pattern "${PATTERN:-dense}" $compile --no-progress --resume \
        --time-limit "$(awk -v s="$left" 'BEGIN { print s / 60 }')" --out "$runs/$name" "$@" \
        >> "$runs/$name.log" 2>&1
    local rc=$?
    [ "$rc" = 0 ] && touch "$runs/$name.done"
    echo "--- $name: exit $rc after $(( $(date +%s) - t0 )) s: $(tail -n 1 "$runs/$name.log")"
    return "$rc"
}

# shellcheck disable=SC2086
stage spt --objective denoise --set "train.steps=$spt_steps" ${ARGS:-} ${SPT_ARGS:-}
rc=$?
if [ "$rc" = 0 ]; then
    # shellcheck disable=SC2086
    stage ft --init-from "$runs/spt/checkpoints/best.pt" ${ft_steps:+--set "train.steps=$ft_steps"} \
        ${ARGS:-} ${FT_ARGS:-}
    rc=$?
fi

$py - "$runs" <<'PY'
import json, sys
from pathlib import Path

runs = Path(sys.argv[1])
print("loss and acc: of the masked tokens for SPT, of the labels for the classifier; test with the best-val weights")
print(f"{'stage':5} {'objective':9} {'steps':>13} {'state':9} {'best val: loss, acc (step)':>30} {'test: loss, acc':>18}")
for name in ("spt", "ft"):
    f = runs / name / "summary.json"
    if not f.exists():
        print(f"{name:5} {'-':9} {'-':>13} {'not run':9}")
        continue
    s = json.loads(f.read_text())
    b, t = s.get("best_val") or {}, s.get("test_best")
    state = "done" if (runs / f"{name}.done").exists() else (s.get("stopped_by") or "stopped")
    best = f"{b['loss']:.4f} {b['acc']:.4f} ({b['step']})" if b.get("step") is not None else "-"
    test = f"{t['loss']:.4f} {t['acc']:.4f}" if t else "-"
    print(f"{name:5} {s.get('objective', 'classify'):9} {s['steps']:>6}/{s['schedule_steps']:<6} {state:9} "
          f"{best:>30} {test:>18}")
PY
exit "$rc"
