#!/usr/bin/env bash
# The faithful Pathfinder-32 runs (dense and butterfly), split over as many device commands as
# they need: each call makes the data if this machine has none (200K hard images), then resumes
# (or starts) both runs side by side until MINUTES have passed, and they stop with a checkpoint.
#   experiments/studies/pathfinder32-recipe/faithful.sh RUNS MINUTES [cnn]
# RUNS (e.g. runs/pf32) holds one folder per run; carry it to the next call. With "cnn" the CNN
# control (cnn_control.py) trains beside them. Exit: 0 when both runs have finished.
set -uo pipefail
runs=$1; minutes=$2; extra=${3:-}
py=${PYTHON:-python3}
data=${DATA:-data/lra}
export PYTHONUNBUFFERED=1
here=$(dirname "$0")
t0=$(date +%s)
mkdir -p "$runs"
if ! ls "$data"/pathfinder32/curv_contour_length_14/metadata/*.npy >/dev/null 2>&1; then
    $py -m sparseflash lra data pathfinder --resolution 32 --difficulty hard --num 200000 --out "$data" \
        --no-progress | tail -n 1
fi
$py -c "
from sparseflash.experiments.lra.data import get_dataset
for s in ('train', 'val', 'test'): get_dataset('pathfinder32', '$data', s, difficulty='hard', workers=16)"
left=$(( minutes * 60 - ($(date +%s) - t0) ))
echo "data ready after $(( $(date +%s) - t0 )) s; training for $left s"
pids=()
for pattern in dense butterfly; do
    $py -m sparseflash lra train --task pathfinder32 --config faithful --data "$data" --attention sparseflash \
        --pattern $pattern --compile --no-progress --resume --time-limit "$(python3 -c "print($left / 60)")" \
        --out "$runs/faithful-$pattern" >> "$runs/faithful-$pattern.log" 2>&1 &
    pids+=($!)
done
if [ "$extra" = cnn ]; then
    $py "$here/cnn_control.py" --data "$data" --epochs 6 --out "$runs/cnn_control.json" > "$runs/cnn_control.log" 2>&1 &
fi
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
wait
for pattern in dense butterfly; do
    echo "--- $pattern: $(tail -n 1 "$runs/faithful-$pattern.log")"
    tail -n 3 "$runs/faithful-$pattern/eval.csv" 2>/dev/null
done
[ "$extra" = cnn ] && tail -n 3 "$runs/cnn_control.log"
exit $rc
