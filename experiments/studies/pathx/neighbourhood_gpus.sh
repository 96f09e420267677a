#!/usr/bin/env bash
# The marker-neighbourhood runs at full length, one variant per GPU, resumable across commands:
#   experiments/studies/pathx/neighbourhood_gpus.sh STATE MINUTES
# From a snapshot's root (as campaign.sh). Draws NUM (default 100000) images once into CACHE
# (default /tmp/nb-cache; a fresh machine draws them again, the same images; RESOLUTION=256: Path-256
# images), then trains the four
# variants side by side for the minutes left, each its own process on GPU i mod (number of GPUs),
# each with its own results folder STATE/nb-<variant>/ (neighbourhood.py --resume: exit 75 until
# its STEPS (default 50000) are done; STEPS=auto sizes each schedule to the minutes left instead):
#   frozen   the faithful model from Pathfinder-64 pretraining (STATE/pretrain), position table frozen
#   scratch  the faithful model from scratch
#   conv     from scratch with model.conv_stem=2 (each token first sees its 5x5 surroundings)
#   conv-sincos  the same with fixed 2-D sin-cos positions instead of the learned table
# With OUT set the state goes back at exit as OUT/pxstate.tgz.part-* (15 MiB each), as campaign.sh's.
# Each run that finishes (a --radius-stages chain: its last stage) leaves its best-on-val weights in bf16
# in STATE/weights/<run name>/ (neighbourhood.py --export-weights; WEIGHTS=DIR elsewhere, WEIGHTS=none
# not at all): copy those folders to experiments/lra/weights/ to commit them.
# CPU rehearsal: NUM=40 STEPS=3 DEVICE=cpu WORKERS=2 ... STATE 3
set -uo pipefail
state=$1; minutes=$2
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
num=${NUM:-100000}; steps=${STEPS:-50000}; cache=${CACHE:-/tmp/nb-cache}; device=${DEVICE:-cuda}
res=${RESOLUTION:-128}  # 256: Path-256 images (neighbourhood.py --resolution)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
[ -f COMMIT ] && export SPARSEFLASH_COMMIT=$(cat COMMIT)
t0=$(date +%s)
. "$here/state.sh"
send_state_back "$state"
[ -f "$state/pretrain/checkpoints/best.pt" ] || { echo "neighbourhood_gpus: $state/pretrain/checkpoints/best.pt did not arrive" >&2; exit 3; }
$py "$here/neighbourhood.py" --num "$num" --resolution "$res" --workers "${WORKERS:-16}" --cache "$cache" --generate-only --no-progress || exit $?
graphs=${GRAPHS:-0}
if [ "$graphs" = 1 ]; then
    # a graphed run must not cost the command: 40 graphed steps on these images first (~30-60 s, its
    # own process); if they fail, this command's runs step eagerly
    check=$(mktemp -d)
    if ! timeout 150 $py "$here/neighbourhood.py" --num "$num" --resolution "$res" --cache "$cache" --device "$device" \
            --no-progress --runs pretrained-frozen --init-from "$state/pretrain/checkpoints/best.pt" --pattern butterfly \
            --steps 40 --eval-every 1000 --no-probe --cuda-graphs --out "$check" --tag graphs-check > "$check.log" 2>&1; then
        echo "neighbourhood_gpus: the CUDA-graph check failed (last lines below); these runs step eagerly (GRAPHS=0)" >&2
        tail -n 5 "$check.log" >&2
        graphs=0
    fi
    rm -rf "$check"
fi
left=$(( minutes * 60 - ($(date +%s) - t0) - 30 ))
[ "$left" -ge 120 ] || { echo "neighbourhood_gpus: no time left after the data" >&2; exit 75; }
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
common=(--num "$num" --resolution "$res" --cache "$cache" --device "$device" --no-progress --minutes "$($py -c "print($left / 60)")")
# GRAPHS=1: training steps replayed from CUDA graphs (the eager step of these short packed sequences is
# host-bound: 11 ms at 128 px, 16-19 ms at 256; the graphed Path-X fine-tune took 4.3 ms), after a
# 40-step graphed check above (calls 29-31 of calls.md: 4.4-6.4 ms a step at 256 px); STEPS=auto times graphed steps.
[ "$graphs" = 1 ] && common+=(--cuda-graphs)
# STEPS=auto: each run sizes its schedule to the minutes left (one command, finished with its test score)
[ "$steps" = auto ] || common+=(--steps "$steps" --resume)
weights=${WEIGHTS:-$state/weights}
[ "$weights" = none ] || common+=(--export-weights "$weights")
declare -A extra=(
    [frozen]="--runs pretrained-frozen --init-from $state/pretrain/checkpoints/best.pt"
    [scratch]="--runs scratch"
    [conv]="--runs scratch --set model.conv_stem=2 --tag conv-stem2"
    [conv-sincos]="--runs scratch --set model.conv_stem=2 model.pos_emb=grid_sincos --tag conv-stem2-sincos"
)
names=(frozen scratch conv conv-sincos)
# VARIANTS="name=options;name=options...": other runs instead (PRETRAIN in options stands for the
# pretrained weights), e.g. "frozen-lr3e-4=--runs pretrained-frozen --init-from PRETRAIN --lr 3e-4"
if [ -n "${VARIANTS:-}" ]; then
    names=()
    IFS=';' read -ra specs <<< "$VARIANTS"
    for spec in "${specs[@]}"; do
        n=${spec%%=*}; names+=("$n"); extra[$n]=${spec#*=}; extra[$n]=${extra[$n]//PRETRAIN/$state/pretrain/checkpoints/best.pt}
    done
fi
pids=(); i=0
for v in "${names[@]}"; do
    dev=(); [ "$gpus" -ge 2 ] && dev=(env CUDA_VISIBLE_DEVICES=$(( i % gpus )))
    mkdir -p "$state/nb-$v"
    # --minutes count from each process's start; past them (+30 s) SIGTERM makes a run checkpoint and stop
    # shellcheck disable=SC2086
    "${dev[@]}" timeout -s TERM -k 30 $(( left + 30 )) $py "$here/neighbourhood.py" "${common[@]}" --out "$state/nb-$v" ${extra[$v]} \
        > "$state/nb-$v.log" 2>&1 &
    pids+=($!); i=$(( i + 1 ))
done
wait_runs "${pids[@]}"; rc=$?
for v in "${names[@]}"; do echo "== $v"; tail -n 3 "$state/nb-$v.log"; done
exit $rc
