#!/usr/bin/env bash
# Pathfinder-32 on release-fidelity data, split over as many device commands as it needs.
#   experiments/studies/pathfinder-release/campaign.sh RUNS MINUTES
# On a shared tree, run it from a snapshot of one commit, so edits in progress never reach the device:
#   git archive HEAD sparseflash patterns pyproject.toml experiments/__init__.py experiments/lra experiments/bench \
#     experiments/studies/__init__.py experiments/studies/pathfinder-release | tar x -C .snap; git rev-parse HEAD > .snap/COMMIT
#   (carry .snap and RUNS; cd .snap && DATA=/tmp/pf/rel CLEAN=/tmp/pf/clean bash .../campaign.sh ../RUNS 9)
# Each call makes the data if this machine has none (200K release-fidelity hard images for training,
# 20K clean ones for cross-evaluation; deterministic, so every call makes the same images), then
# resumes (or starts) the stage's runs side by side until MINUTES have passed; they stop with a
# checkpoint. A finished run is cross-evaluated once (best-val weights on the release test split and
# on all 20K clean images). Carry RUNS to the next call. Exit 0 once every run is done.
# The runs, side by side on one GPU: the faithful recipe dense and butterfly (density 0.5) with black
# pixels as padding (as the released pipelines treat them); and the accuracy-vs-density sweep
# (butterfly 1 / 0.5 / 0.25 / 0.125, black as padding), one run after another, with the faithful
# settings on a quarter of the schedule (15,600 steps: the quick variant, lr 1e-3 over 6,240 steps,
# stays at chance on this data). RUNS names = $NAMES (default: all three).
# Seeds (one run per setting cannot bound a seed's variance): a name ending in -sN (dense-bip-s1, butterfly-bip-s2) is that run with train.seed=N;
# "sweep-seeds" is the sweep again with the seeds in $SWEEP_SEEDS (default "1 2"), in RUNS/sweep-seeds.
#   NAMES="dense-bip-s1 butterfly-bip-s1 dense-bip-s2 butterfly-bip-s2" campaign.sh RUNS 9
# A finished run also gets RUNS/weights/<name>/ (`python -m sparseflash.experiments.lra.weights export`:
# its best-on-validation weights in bf16, ~0.3 MB, model.pt and config.json), to carry back and commit
# under experiments/lra/weights/<name>/ (`... weights evaluate` scores every one there again).
set -uo pipefail
runs=$1; minutes=$2
py=${PYTHON:-python3}
rel=${DATA:-data/lra-release}; clean=${CLEAN:-data/lra-clean}
num=${NUM:-200000}; num_clean=${NUM_CLEAN:-20000}; workers=${WORKERS:-16}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
# Run from a snapshot (git archive) the tree has no .git of its own: a COMMIT file beside it names
# what runs, so results do not record the commit of some .git further up.
[ -f COMMIT ] && export SPARSEFLASH_COMMIT=$(cat COMMIT)
t0=$(date +%s)
mkdir -p "$runs"
make() {  # make ROOT FIDELITY NUM
    if ! $py -c "import json,sys; sys.exit(0 if json.load(open('$1/pathfinder32/curv_contour_length_14/generation.json')).get('complete') else 1)" 2>/dev/null; then
        $py -m sparseflash lra data pathfinder --resolution 32 --difficulty hard --num "$3" --out "$1" --fidelity "$2" \
            --workers "$workers" --no-progress --resume 2>&1 | tail -n 1
    fi
    $py -c "
from sparseflash.experiments.lra.data import get_dataset
for s in ('train', 'val', 'test'): get_dataset('pathfinder32', '$1', s, fidelity='$2', workers=$workers)"
}
make "$rel" release "$num"
make "$clean" clean "$num_clean"
echo "data ready after $(( $(date +%s) - t0 )) s"
common=(--task pathfinder32 --config faithful --data "$rel" --attention sparseflash --compile --no-progress --resume)
read -r -a names <<< "${NAMES:-dense-bip butterfly-bip sweep}"
for name in "${names[@]}"; do  # every name known before anything starts
    [[ $name =~ ^(dense-bip|butterfly-bip|dense)(-s[0-9]+)?$|^(sweep|sweep-seeds)$ ]] || { echo "unknown run name $name" >&2; exit 2; }
done
left=$(( minutes * 60 - ($(date +%s) - t0) - 60 ))  # a minute for the cross-evaluations
pids=()
for name in "${names[@]}"; do
    [ -f "$runs/$name/summary.json" ] && grep -q "\"finished\": true" "$runs/$name/summary.json" 2>/dev/null && continue
    lim=$($py -c "print(max($left, 30) / 60)")
    base=$name; seed=0
    if [[ $name =~ ^(.*)-s([0-9]+)$ ]]; then base=${BASH_REMATCH[1]}; seed=${BASH_REMATCH[2]}; fi
    case $base in
        dense-bip) args=(--pattern dense --set model.black_is_padding=True) ;;
        butterfly-bip) args=(--pattern butterfly --set model.black_is_padding=True) ;;
        dense) args=(--pattern dense) ;;
        sweep|sweep-seeds)
               [ -f "$runs/$name/sweep.csv" ] && ! grep -q ",stopped,\|,pending," "$runs/$name/sweep.csv" && continue
               read -r -a seeds <<< "$([ "$name" = sweep ] && echo 0 || echo "${SWEEP_SEEDS:-1 2}")"
               $py -m sparseflash lra sweep --task pathfinder32 --config faithful --data "$rel" --pattern butterfly \
                   --densities 1 0.5 0.25 0.125 --seeds "${seeds[@]}" --set model.black_is_padding=True \
                   --set train.steps=15600 --set train.eval_every=1560 --out "$runs/$name" --time-limit "$lim" --resume \
                   >> "$runs/$name.log" 2>&1 &
               pids+=($!); continue ;;
    esac
    args+=(--set "train.seed=$seed")
    $py -m sparseflash lra train "${common[@]}" "${args[@]}" --time-limit "$lim" --out "$runs/$name" \
        >> "$runs/$name.log" 2>&1 &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for name in "${names[@]}"; do
    [[ $name == sweep* ]] && { tail -n 3 "$runs/$name.log"; continue; }
    echo "--- $name: $(tail -n 1 "$runs/$name.log")"
    tail -n 2 "$runs/$name/eval.csv" 2>/dev/null
    if grep -q "\"finished\": true" "$runs/$name/summary.json" 2>/dev/null && [ ! -f "$runs/$name/crosseval-clean.json" ]; then
        $py -m sparseflash lra evaluate "$runs/$name" --data "$clean" --fidelity clean --split all \
            --out "$runs/$name/crosseval-clean.json" 2>&1 | tail -n 1
        $py -m sparseflash lra evaluate "$runs/$name" --data "$rel" --fidelity release --split test \
            --out "$runs/$name/eval-release-test.json" 2>&1 | tail -n 1
    fi
    if grep -q "\"finished\": true" "$runs/$name/summary.json" 2>/dev/null && [ ! -f "$runs/weights/$name/model.pt" ]; then
        $py -m sparseflash.experiments.lra.weights export "$runs/$name/checkpoints/best.pt" "$runs/weights/$name"
    fi
done
echo "call took $(( $(date +%s) - t0 )) s"
exit $rc
