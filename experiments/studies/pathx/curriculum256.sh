#!/usr/bin/env bash
# Path-256 from the Path-X curriculum's whole-image weights, on a machine of 4 GPUs (one variant per
# GPU), resumable across commands:
#   experiments/studies/pathx/curriculum256.sh STATE MINUTES
# From a snapshot's root (as campaign.sh). The recipe's Path-256 starts from Path-X weights with the
# position grid upsampled 2x2 (configs.py: path256 from pathx); here those are the Path-X curriculum's
# last butterfly weights (BFLY_INIT, a path under STATE: 57.2% on whole Path-X images), table
# frozen. Unchanged they answer a constant on 256 px images at
# every radius, also with their pooling rescaled to 16,384 positions (results/curriculum256/), and a
# chain of 600-step stages stayed at chance (call 28): the first stage, at R = 8 (the probe's k at
# 256 px), gets 4 minutes, as the Path-X R = 6 run needed ~3,000 steps before it learned.
# At 256 px the marker patches give little (probe MLP 57%; 74% at 128 px), but the two marker
# coordinates alone give 63.6% of release labels and 64.2% of clean ones (probe256/), and the first
# stage shows where the markers are. The frozen table is no smooth code of position: neighbouring cells' vectors are
# unrelated (mean cosine 0.03), and an MLP given the table's vectors at the two markers scores 50%
# where one given the coordinates scores 65% and one given their 2-D sin-cos codes 59% (8K images).
# So two chains keep the recipe's table and two start from fresh weights with fixed 2-D sin-cos
# positions (model.pos_emb=grid_sincos). neighbourhood.py --resolution 256 --radius-stages on NUM
# (default 100000) hard release 256 px images (80K / 10K / 10K), butterfly attention throughout,
# minutes a stage after each chain:
#   bfly-stages         Path-X weights, table frozen; R 8 12 16 24 32 48 64 96, whole images; lr 3e-4; 4 1 1 1 1 1 1 1 2
#   bfly-coarse         the same on R 8 16 32 64, whole images; 4 1.5 1.5 2 3
#   sincos-stages       fresh weights, 2-D sin-cos positions; the fine radii; lr 3e-4
#   sincos-stages-lr1e-4  the same at lr 1e-4
# (SCALE multiplies every stage's minutes; ~13 minutes a chain: two 9-minute commands, or three.)
# Ran on 4 H200s (calls 29-31, 7 + 9 + 9 minutes): sincos-stages 62.0% on whole images; the two
# frozen-table chains at chance at every radius; sincos-stages-lr1e-4 at chance from R 96 (neighbourhood.md).
# GRAPHS=1 (the default here) replays the steps from CUDA graphs (4.4-6.4 ms a step in calls 29-31, where the
# eager 256 px step took 16-19 ms), after neighbourhood_gpus.sh's 40-step check (eager if it fails).
# (The sin-cos chains have no table: their weights are ~0.4 MB.)
# Only the newest stage of a chain keeps its weights, its frozen 256x256 table stored as the 64x64 source
# it was duplicated from (neighbourhood.compact_grid: 17 MB -> ~1 MB), so the state stays small enough to carry.
# A chain that finishes exports its last stage's best weights in bf16 to STATE/weights/<tag>-<k>-full/
# (neighbourhood_gpus.sh, neighbourhood.py --export-weights), to commit under experiments/lra/weights/.
# Runs go to STATE/nb-p256-<variant>/runs/; with OUT set the state goes back at exit
# (neighbourhood_gpus.sh). CPU rehearsal: NUM=40 DEVICE=cpu GRAPHS=0 WORKERS=2 SCALE=0.05 ... STATE 4
set -uo pipefail
state=$1; minutes=$2
here=$(cd "$(dirname "$0")" && pwd)
bfly=${BFLY_INIT:-nb-cont-bfly/runs/cont-bfly-1-full/checkpoints/best.pt}
[ -f "$state/$bfly" ] || { echo "curriculum256: $state/$bfly did not arrive with the carried state" >&2; exit 3; }
scaled() { python3 -c "import sys; print(' '.join(f'{float(m) * ${SCALE:-1}:g}' for m in sys.argv[1:]))" "$@"; }
fine="8 12 16 24 32 48 64 96 full"; fine_m=$(scaled 4 1 1 1 1 1 1 1 2)
coarse="8 16 32 64 full"; coarse_m=$(scaled 4 1.5 1.5 2 3)
common="--no-probe --pattern butterfly"
recipe="--runs pretrained-frozen --init-from $state/$bfly"
sincos="--runs scratch --set model.pos_emb=grid_sincos"
RESOLUTION=256 STEPS=auto VARIANTS="p256-bfly-stages=$common $recipe --lr 3e-4 --radius-stages $fine --stage-minutes $fine_m --tag bfly-stages;\
p256-bfly-coarse=$common $recipe --lr 3e-4 --radius-stages $coarse --stage-minutes $coarse_m --tag bfly-coarse;\
p256-sincos-stages=$common $sincos --lr 3e-4 --radius-stages $fine --stage-minutes $fine_m --tag sincos-stages;\
p256-sincos-stages-lr1e-4=$common $sincos --lr 1e-4 --radius-stages $fine --stage-minutes $fine_m --tag sincos-stages-lr1e-4" \
    GRAPHS=${GRAPHS:-1} exec bash "$here/neighbourhood_gpus.sh" "$state" "$minutes"
