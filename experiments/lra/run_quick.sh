#!/usr/bin/env bash
# Quick LRA runs behind experiments/lra/RESULTS.md (one H100, a few minutes):
#   experiments/lra/run_quick.sh OUT [PATHFINDER_IMAGES]
# ListOps (generated, full 96K/2K/2K): dense vs butterfly at two densities; Pathfinder-32 hard
# (generated, PATHFINDER_IMAGES images, default 60000): dense vs butterfly. Quick configs.
set -uo pipefail
out=$1; n_pf=${2:-60000}
py=${PYTHON:-python3}
data=${LRA_DATA:-/tmp/lra_data}
workers=$(nproc)
mkdir -p "$out"
t0=$(date +%s)
$py -m sparseflash lra data listops --out "$data" --workers "$workers" --no-progress | tail -n 2
echo "listops data: $(( $(date +%s) - t0 )) s"
for spec in dense butterfly "butterfly:n_factors=2"; do
    name=listops_$(echo "$spec" | tr ':=' '__')
    $py -m sparseflash lra train --task listops --config quick --data "$data" --attention sparseflash \
        --pattern "$spec" --out "$out/$name" --no-progress --set model.attn_dropout=0.1 | tail -n 3
done
t0=$(date +%s)
$py -m sparseflash lra data pathfinder --resolution 32 --difficulty hard --out "$data" --num "$n_pf" \
    --workers "$workers" --no-progress | tail -n 2
echo "pathfinder32 data ($n_pf images): $(( $(date +%s) - t0 )) s"
for spec in dense butterfly; do
    $py -m sparseflash lra train --task pathfinder32 --config quick --data "$data" --attention sparseflash \
        --pattern "$spec" --out "$out/pathfinder32_$spec" --no-progress | tail -n 3
done
# the small files that tell the story (metrics, summaries), not the checkpoints
find "$out" -name '*.pt' -delete
