#!/usr/bin/env bash
# From the marker neighbourhoods to whole Path-X images, a curriculum of growing radii, on a machine
# of 4 GPUs (one variant per GPU), resumable across commands:
#   experiments/studies/pathx/curriculum.sh STATE MINUTES
# From a snapshot's root (as campaign.sh). Every variant starts from the weights of a neighbourhood
# run (NB_INIT, a path under STATE; default nb-f3/runs/frozen-lr3e-4/checkpoints/best.pt: R = 6,
# table frozen, lr 3e-4, 64.7% held out; unchanged, it scores 56% at R = 12 and chance from R = 24
# on, results/neighbourhood/zero_shot/) and keeps the position table frozen. neighbourhood.py
# --radius-stages: one run a stage on the same 100K images (80K / 10K / 10K), each from the previous
# stage's best weights, the last on whole images (the real Path-X input):
#   fine         R 8 10 12 14 16 20 24 32 48 full, lr 3e-4, STAGE_MINUTES (default 1) a stage
#   fine-lr1e-4  the same at lr 1e-4
#   coarse       R 9 12 16 24 32 48 full, lr 3e-4, 1.5 x STAGE_MINUTES a stage
#   direct       whole images at once, lr 3e-4, 30,000 steps resumed across commands (the control)
# Only the newest stage of a variant keeps its weights (best.pt; last.pt while it can resume), so
# the state stays small enough to carry (~5-10 MB a variant).
# A chain that finishes exports its last stage's best weights in bf16 to STATE/weights/<tag>-<k>-full/
# (neighbourhood_gpus.sh, neighbourhood.py --export-weights), to commit under experiments/lra/weights/.
# Each variant's runs go to STATE/nb-cur-<variant>/runs/<variant>-<k>-<radius>/ (checkpoints kept);
# a later command skips the stages done and continues. With OUT set the state goes back at exit
# (neighbourhood_gpus.sh). CPU rehearsal: NUM=40 DEVICE=cpu WORKERS=2 STAGE_MINUTES=0.3 ... STATE 4
set -uo pipefail
state=$1; minutes=$2
here=$(cd "$(dirname "$0")" && pwd)
nb_init=${NB_INIT:-nb-f3/runs/frozen-lr3e-4/checkpoints/best.pt}
[ -f "$state/$nb_init" ] || { echo "curriculum: $state/$nb_init did not arrive with the carried state" >&2; exit 3; }
sm=${STAGE_MINUTES:-1}
sm_coarse=$(python3 -c "print(1.5 * $sm)")
init="$state/$nb_init"
common="--runs pretrained-frozen --init-from $init --no-probe"
fine="8 10 12 14 16 20 24 32 48 full"
STEPS=auto VARIANTS="cur-fine=$common --lr 3e-4 --radius-stages $fine --stage-minutes $sm --tag fine;\
cur-fine-lr1e-4=$common --lr 1e-4 --radius-stages $fine --stage-minutes $sm --tag fine-lr1e-4;\
cur-coarse=$common --lr 3e-4 --radius-stages 9 12 16 24 32 48 full --stage-minutes $sm_coarse --tag coarse;\
cur-direct=$common --lr 3e-4 --radius-stages full --steps ${DIRECT_STEPS:-30000} --resume --tag direct" \
    exec bash "$here/neighbourhood_gpus.sh" "$state" "$minutes"
