#!/usr/bin/env bash
# Path-256 from the Path-X curriculum's whole-image weights, on a machine of 4 GPUs (one variant per
# GPU), resumable across commands:
#   experiments/studies/pathx/curriculum256.sh STATE MINUTES
# From a snapshot's root (as campaign.sh). The recipe's Path-256 starts from Path-X weights with the
# position grid upsampled 2x2 (configs.py: path256 from pathx); here those are the Path-X curriculum's
# last weights (BFLY_INIT: butterfly, 57.2% on whole Path-X images; DENSE_INIT: dense lr 3e-4,
# 59.6%; paths under STATE), table frozen. neighbourhood.py --resolution 256 --radius-stages on NUM
# (default 100000) hard release 256 px images (80K / 10K / 10K; 6.5 GB in memory per process):
#   bfly-stages   R 8 12 16 24 32 48 64 96, then whole images, butterfly, lr 3e-4, STAGE_MINUTES (default 1) a stage
#   bfly-coarse   R 12 24 48 96, then whole images, butterfly, lr 3e-4, 1.5 x STAGE_MINUTES a stage
#   bfly-direct   whole images at once, butterfly, lr 1e-4, DIRECT_STEPS (default 20000), resumed across commands
#   dense-stages  as bfly-stages from the dense weights, dense attention
# Only the newest stage of a chain keeps its weights, so the state stays small enough to carry.
# Runs go to STATE/nb-p256-<variant>/runs/; with OUT set the state goes back at exit
# (neighbourhood_gpus.sh). CPU rehearsal: NUM=40 DEVICE=cpu WORKERS=2 STAGE_MINUTES=0.3 ... STATE 4
set -uo pipefail
state=$1; minutes=$2
here=$(cd "$(dirname "$0")" && pwd)
bfly=${BFLY_INIT:-nb-cont-bfly/runs/cont-bfly-1-full/checkpoints/best.pt}
dense=${DENSE_INIT:-nb-cont-lr3e-4/runs/cont-lr3e-4-1-full/checkpoints/best.pt}
for w in "$bfly" "$dense"; do
    [ -f "$state/$w" ] || { echo "curriculum256: $state/$w did not arrive with the carried state" >&2; exit 3; }
done
sm=${STAGE_MINUTES:-1}
sm_coarse=$(python3 -c "print(1.5 * $sm)")
stages="8 12 16 24 32 48 64 96 full"
common="--runs pretrained-frozen --no-probe --lr 3e-4"
RESOLUTION=256 STEPS=auto VARIANTS="p256-bfly-stages=$common --init-from $state/$bfly --pattern butterfly --radius-stages $stages --stage-minutes $sm --tag bfly-stages;\
p256-bfly-coarse=$common --init-from $state/$bfly --pattern butterfly --radius-stages 12 24 48 96 full --stage-minutes $sm_coarse --tag bfly-coarse;\
p256-bfly-direct=--runs pretrained-frozen --no-probe --lr 1e-4 --init-from $state/$bfly --pattern butterfly --radius-stages full --steps ${DIRECT_STEPS:-20000} --resume --tag bfly-direct;\
p256-dense-stages=$common --init-from $state/$dense --radius-stages $stages --stage-minutes $sm --tag dense-stages" \
    exec bash "$here/neighbourhood_gpus.sh" "$state" "$minutes"
