#!/usr/bin/env bash
# From the marker neighbourhoods to whole Path-X images, on a machine of 4 GPUs, in one command:
#   experiments/studies/pathx/curriculum.sh STATE MINUTES
# From a snapshot's root (as campaign.sh). Every run starts from the weights of a neighbourhood run
# (NB_INIT, a path under STATE; default nb-f3/runs/frozen-lr3e-4/checkpoints/best.pt: R = 6, table
# frozen, lr 3e-4, 64.7% held out) with the position table frozen, side by side:
#   GPU 0, 1  wider neighbourhoods, R = 12 and R = 24, lr 3e-4, each schedule sized to this command
#             (neighbourhood_gpus.sh, STEPS=auto; checkpoints kept for the next stage): STATE/nb-cur-r12,
#             STATE/nb-cur-r24
#   GPU 2, 3  whole images: the Path-X fine-tune (campaign.sh, 200 epochs, butterfly, resumable across
#             commands) at lr 3e-4 and 1e-4 (FT_LRS), runs STATE/finetune-frozen-encoder-pos-from-nb-lr<lr>
# Both data sets are drawn at once, half the cores each. With OUT set the whole state goes back once,
# at exit, as OUT/pxstate.tgz.part-* (15 MiB each). Exit: an error code if a part failed, else 75 if
# a fine-tune has steps left, else 0.
# CPU rehearsal (tiny fine-tunes from a tiny pretraining): NUM=40 NB_NUM=40 DEVICE=cpu CONFIG=tiny
#   NUM_CLEAN=20 WORKERS=2 FT_INIT=pretrain/checkpoints/best.pt ... STATE 4
set -uo pipefail
state=$1; minutes=$2
here=$(cd "$(dirname "$0")" && pwd)
nb_init=${NB_INIT:-nb-f3/runs/frozen-lr3e-4/checkpoints/best.pt}
ft_init=${FT_INIT:-$nb_init}
workers=${WORKERS:-$(( $(nproc) / 2 ))}
t0=$(date +%s)
for f in "$nb_init" "$ft_init" pretrain/checkpoints/best.pt; do
    [ -f "$state/$f" ] || { echo "curriculum: $state/$f did not arrive with the carried state" >&2; exit 3; }
done
. "$here/state.sh"
send_state_back "$state"
# the wider neighbourhoods' probe MLPs, if an earlier command computed them (one minute each)
for r in 12 24; do
    mkdir -p "$state/nb-cur-r$r"
    for p in "$state"/nb-*/probe-R$r-n*.json; do
        [ -f "$p" ] && [ "$(dirname "$p")" != "$state/nb-cur-r$r" ] && cp -n "$p" "$state/nb-cur-r$r/"
    done
done
nb_minutes=$(( minutes - 1 ))  # their final test evaluation and report inside the command
init="$state/$nb_init"
OUT= WORKERS=$workers NUM=${NB_NUM:-100000} STEPS=auto FIRST_GPU=0 \
    VARIANTS="cur-r12=--runs pretrained-frozen --init-from $init --lr 3e-4 --radius 12 --keep-checkpoints --tag from-nb-R12;cur-r24=--runs pretrained-frozen --init-from $init --lr 3e-4 --radius 24 --keep-checkpoints --tag from-nb-R24" \
    bash "$here/neighbourhood_gpus.sh" "$state" "$nb_minutes" > "$state/curriculum-nb.log" 2>&1 &
nb=$!
specs=()
for lr in ${FT_LRS:-3e-4 1e-4}; do specs+=("INIT=$ft_init TAG=from-nb-lr$lr FREEZE=encoder.pos SET=train.lr=$lr"); done
OUT= WORKERS=$workers FIRST_GPU=2 bash "$here/variants.sh" "$state" "$minutes" "${specs[@]}" \
    > "$state/curriculum-ft.log" 2>&1 &
ft=$!
wait "$nb"; rc_nb=$?
wait "$ft"; rc_ft=$?
echo "curriculum: neighbourhoods exit $rc_nb, whole images exit $rc_ft ($(( $(date +%s) - t0 )) s)"
tail -n 4 "$state/curriculum-nb.log"; tail -n 4 "$state/curriculum-ft.log"
[ "$rc_nb" -ne 0 ] && [ "$rc_nb" -ne 75 ] && exit "$rc_nb"
exit "$rc_ft"
