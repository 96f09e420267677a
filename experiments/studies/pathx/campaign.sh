#!/usr/bin/env bash
# Path-X with the FlashAttention recipe on release-fidelity data, in stages, over as many device
# commands (and machine leases) as it needs:
#   experiments/studies/pathx/campaign.sh STATE MINUTES
# Stages, in order (each resumes where the last command stopped):
#   data64    200K Pathfinder-64 hard images, release fidelity (deterministic: every machine makes the same)
#   pretrain  the faithful Pathfinder-64 config, black pixels as padding, butterfly, to its end
#   data128   200K Path-X hard images, release fidelity; 20K clean ones for cross-evaluation
#   finetune  Path-X from pretrain's best weights (position grid upsampled 2x2), 200 epochs, butterfly
# STATE holds the runs (logs, checkpoints: last.pt to resume, best.pt) and is carried from one call to
# the next; the data live on the machine only (DATA, default /tmp/pathx-data) and are made again on a
# fresh one (--resume finishes an interrupted generation byte-identically). Run from a snapshot of one
# commit (see ../pathfinder-release/campaign.sh) with a COMMIT file beside it.
# Exit 0 once every stage is done, 75 when the time is up. Each finished run (pretrain, the fine-tune)
# leaves its best-on-val weights in bf16 in STATE/weights/<run>/ (lra/weights.py export), to commit
# under experiments/lra/weights/.
set -uo pipefail
state=$1; minutes=$2
py=${PYTHON:-python3}
data=${DATA:-/tmp/pathx-data}; workers=${WORKERS:-16}; pattern=${PATTERN:-butterfly}
# CONFIG / NUM / NUM_CLEAN shrink the campaign for a CPU rehearsal (CONFIG=tiny NUM=400 NUM_CLEAN=100);
# GRAPHS=1 trains with --cuda-graphs (one captured step per width); LOADER_WORKERS (6) the loader's processes
config=${CONFIG:-faithful}; num=${NUM:-200000}; num_clean=${NUM_CLEAN:-20000}
graphs=(); [ "${GRAPHS:-0}" = 1 ] && graphs=(--cuda-graphs)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
[ -f COMMIT ] && export SPARSEFLASH_COMMIT=$(cat COMMIT)
t0=$(date +%s)
# On the device: REQUIRE=STAGE refuses to start unless STAGE's run came with the carried state (a
# missing carry would otherwise redo hours), and with OUT set the state goes back at exit as
# pxstate.tgz.part-* of at most 15 MiB each (a returned file over 16 MiB is dropped); unpack them
# here with `cat FILES_AT/pxstate.tgz.part-* | tar xzf - -C REPO`.
done_run() { grep -q "\"finished\": true" "$1/summary.json" 2>/dev/null; }
if [ -n "${REQUIRE:-}" ] && ! done_run "$state/$REQUIRE"; then
    echo "campaign: $state/${REQUIRE} did not arrive with the carried state; stopping before any work" >&2
    exit 3
fi
if [ -n "${INIT:-}" ]; then  # the fine-tune's starting weights (below)
    [ -n "${TAG:-}" ] || { echo "campaign: INIT needs TAG, the suffix that names the run" >&2; exit 2; }
    [ -f "$state/$INIT" ] || { echo "campaign: INIT $state/$INIT did not arrive with the carried state" >&2; exit 3; }
fi
. "$(dirname "$0")/state.sh"
send_state_back "$state"
mkdir -p "$state"
left() { echo $(( minutes * 60 - ($(date +%s) - t0) )); }
log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - t0 ))s] $*" | tee -a "$state/campaign.log"; }

complete() {  # complete ROOT RES FIDELITY
    $py -c "import json,sys; sys.exit(0 if json.load(open('$1/pathfinder$2/curv_contour_length_14/generation.json')).get('complete') else 1)" 2>/dev/null
}
make() {  # make ROOT RES FIDELITY NUM TASK: generate (resumable) within the time left, then the loader cache
    if ! complete "$1" "$2" "$3"; then
        log "data $2 px $3: generating ($4 images, $workers workers)"
        timeout $(( $(left) - 20 )) $py -m sparseflash lra data pathfinder --resolution "$2" --difficulty hard --num "$4" \
            --out "$1" --fidelity "$3" --workers "$workers" --no-progress --resume 2>&1 | tail -n 1 | tee -a "$state/campaign.log"
        complete "$1" "$2" "$3" || { log "data $2 px $3: not complete yet"; return 75; }
    fi
    $py -c "
from sparseflash.experiments.lra.data import get_dataset
for s in ('train', 'val', 'test'): get_dataset('$5', '$1', s, fidelity='$3', workers=$workers)" || return 1
    log "data $2 px $3: ready"
}
train() {  # train NAME TASK ARGS...: run until done or the time left
    local name=$1 task=$2; shift 2
    done_run "$state/$name" && return 0
    local lim=$(( $(left) - 30 ))
    [ "$lim" -lt 60 ] && return 75
    log "$name: training (limit $lim s)"
    $py -m sparseflash lra train --task "$task" --config "$config" --data "$data/$task" --attention sparseflash \
        --pattern "$pattern" --set model.black_is_padding=True --num-workers "${LOADER_WORKERS:-6}" --no-progress --resume "${graphs[@]}" \
        --time-limit "$($py -c "print($lim / 60)")" --out "$state/$name" "$@" >> "$state/$name.log" 2>&1
    local rc=$?
    log "$name: exit $rc; $(tail -n 1 "$state/$name/eval.csv" 2>/dev/null)"
    done_run "$state/$name" && return 0
    return $(( rc == 0 ? 75 : rc ))
}

export_weights() {  # export_weights NAME: a finished run's best-on-val weights in bf16, once, to STATE/weights/NAME
    [ -f "$state/weights/$1/model.pt" ] && return 0
    $py -m sparseflash.experiments.lra.weights export "$state/$1/checkpoints/best.pt" "$state/weights/$1" 2>&1 \
        | tail -n 1 | tee -a "$state/campaign.log"
}

# a fresh machine skips the Pathfinder-64 data once pretraining is done (the fine-tune needs only its weights)
if ! done_run "$state/pretrain"; then
    make "$data/pathfinder64" 64 release "$num" pathfinder64 || exit $?
    train pretrain pathfinder64 || exit $?
fi
export_weights pretrain  # the Path-64 pretraining's weights, kept (issue 68: it had no record)
make "$data/pathx" 128 release "$num" pathx || exit $?
# ONLY=data stops here with exit 0, the data ready (a call that runs GPU tests beside the generation;
# variants.sh, before its fine-tunes start side by side)
[ "${ONLY:-}" = data ] && { log "ONLY=data: stopping with the data ready"; exit 0; }
# Variants of the fine-tune, each its own run beside the faithful one (which memorises its 160K
# images; see README.md): AUGMENT=dihedral (finetune-dihedral) draws a random flip / quarter turn
# per example; FREEZE=encoder.pos (finetune-frozen-encoder-pos) keeps the pretrained, upsampled
# position table fixed (92% of the model's parameters); both together: finetune-dihedral-frozen-...;
# SET / TAG (below) any other setting
ft=finetune; extra=()
[ -n "${AUGMENT:-}" ] && { ft=$ft-$AUGMENT; extra+=(--set "model.augment=$AUGMENT"); }
[ -n "${FREEZE:-}" ] && { ft=$ft-frozen-${FREEZE//./-}; extra+=(--set "train.freeze=['$FREEZE']"); }
# SET: other settings ("train.lr=3e-4", several separated by ';'), for a run named ...-TAG
if [ -n "${SET:-}" ]; then
    [ -n "${TAG:-}" ] || { echo "campaign: SET needs TAG, the suffix that names the run" >&2; exit 2; }
    IFS=';' read -ra sets <<< "$SET"
    for x in "${sets[@]}"; do extra+=(--set "$x"); done
fi
# INIT: the fine-tune's starting weights, a path under STATE (default pretrain's best, its 64x64
# position grid upsampled 2x2), e.g. a marker-neighbourhood run's best.pt (neighbourhood.md: a
# curriculum from the markers' surroundings to whole images); needs TAG
init=${INIT:-pretrain/checkpoints/best.pt}  # checked before any work, above
[ -n "${TAG:-}" ] && ft=$ft-$TAG
train "$ft" pathx --init-from "$state/$init" "${extra[@]}" || exit $?
export_weights "$ft"
if [ ! -f "$state/$ft/crosseval-clean.json" ]; then
    # variants.sh may finish two runs at once: one generation of the clean data at a time
    mkdir -p "$data"; exec {lock}>"$data/.clean.lock"; flock "$lock"
    make "$data/pathx-clean" 128 clean "$num_clean" pathx || exit $?
    flock -u "$lock"
    $py -m sparseflash lra evaluate "$state/$ft" --data "$data/pathx-clean" --fidelity clean --split all \
        --out "$state/$ft/crosseval-clean.json" 2>&1 | tail -n 1 | tee -a "$state/campaign.log"
fi
log "all stages done"
