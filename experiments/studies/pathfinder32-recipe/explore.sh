#!/usr/bin/env bash
# Pathfinder-32 recipe exploration on one GPU (one device command, ~10 min):
#   experiments/studies/pathfinder32-recipe/explore.sh OUT SECONDS VARIANT [VARIANT ...]
# Generates 200K Pathfinder-32 images per difficulty in DIFFICULTIES (default hard; if DATA has none), builds the loader cache, then trains
# the VARIANTs side by side (one process each) until SECONDS after the script started (then SIGINT),
# and packs their logs into OUT.tgz (no checkpoints unless KEEP_CKPT=1).
# A VARIANT is NAME=ARGS, ARGS being `sparseflash lra train` options separated by '+', e.g.
#   lr1e-4=--config+faithful    lr1e-3=--config+faithful+--set+train.lr=1e-3
set -uo pipefail
out=$1; deadline=$(( $(date +%s) + $2 )); shift 2
py=${PYTHON:-python3}
data=${DATA:-data/lra}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
t0=$(date +%s)
# DIFFICULTIES: which Pathfinder-32 difficulties to make (default hard; e.g. "hard easy")
declare -A folder=([easy]=curv_baseline [medium]=curv_contour_length_9 [hard]=curv_contour_length_14)
for diff in ${DIFFICULTIES:-hard}; do
    if ! ls "$data"/pathfinder32/"${folder[$diff]}"/metadata/*.npy >/dev/null 2>&1; then
        $py -m sparseflash lra data pathfinder --resolution 32 --difficulty "$diff" --num 200000 --out "$data" \
            --workers "$(nproc)" --no-progress | tail -n 1
    fi
done
echo "data ready: $(( $(date +%s) - t0 )) s"
$py - "$data" ${DIFFICULTIES:-hard} <<'PY'
import sys, time
from sparseflash.experiments.lra.data import get_dataset
t = time.time()
for diff in sys.argv[2:]:
    for s in ("train", "val", "test"):
        ds = get_dataset("pathfinder32", sys.argv[1], s, difficulty=diff, workers=16)
        print(diff, s, len(ds), end="; ")
print(f"cache {time.time() - t:.0f} s")
PY
pids=()
for v in "$@"; do
    name=${v%%=*}; args=${v#*=}; args=${args//+/ }
    # shellcheck disable=SC2086
    $py -m sparseflash lra train --task pathfinder32 --data "$data" --out "$out/$name" --no-progress \
        --max-steps "${MAX_STEPS:-62400}" $args > "$out/$name.log" 2>&1 &
    pids+=($!)
done
while [ "$(date +%s)" -lt "$deadline" ] && kill -0 "${pids[0]}" 2>/dev/null; do sleep 5; done
for p in "${pids[@]}"; do kill -INT "$p" 2>/dev/null; done
sleep 5
for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
[ "${KEEP_CKPT:-0}" = 1 ] || find "$out" -name '*.pt' -delete
for v in "$@"; do
    name=${v%%=*}
    echo "--- $name: $(tail -n 1 "$out/$name/train.csv" 2>/dev/null | cut -d, -f1-7)"
    tail -n 4 "$out/$name/eval.csv" 2>/dev/null
    grep -iE "error|Traceback" "$out/$name.log" | head -3
done
tar czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
