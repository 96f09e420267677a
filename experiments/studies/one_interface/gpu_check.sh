#!/usr/bin/env bash
# The GPU half of the host-side refactor's check, in one device call (about 7 minutes on an H200):
#   1. bitwise snapshot of the default paths, this tree against the tree in .ab_old (git archive of
#      the commit before the change), compared (snapshot.py);
#   2. the GPU test files the launchers touch, in five processes side by side;
#   3. host cost per eager call of every launch route at the issue's anchor (B32 H4 N1K d64).
# Usage: SPARSEFLASH_COMMIT=<sha> bash experiments/studies/one_interface/gpu_check.sh OUT
set -u
OUT=${1:?output folder}
mkdir -p "$OUT"
echo "commit ${SPARSEFLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}, $(date -u +%F)" > "$OUT/commit.txt"
export OMP_NUM_THREADS=1 SPARSEFLASH_CACHE="$OUT/.cache"
log() { echo "[$(date -u +%H:%M:%S)] $*"; }
log "snapshots"
(cd .ab_old && PYTHONPATH=$PWD timeout 200 python -m sparseflash.experiments.studies.one_interface.snapshot save "$OUT/before.pt" > "$OUT/snap_before.log" 2>&1) &
PYTHONPATH=$PWD timeout 200 python -m sparseflash.experiments.studies.one_interface.snapshot save "$OUT/after.pt" > "$OUT/snap_after.log" 2>&1
wait
PYTHONPATH=$PWD python -m sparseflash.experiments.studies.one_interface.snapshot compare "$OUT/before.pt" "$OUT/after.pt" > "$OUT/snapshot_compare.txt" 2>&1
rm -f "$OUT/before.pt" "$OUT/after.pt"
tail -1 "$OUT/snapshot_compare.txt"
log "GPU tests"
groups=("tests/test_flash.py" "tests/test_segments.py tests/test_exact_masks.py" \
        "tests/test_score_mods.py tests/test_native.py tests/test_fast_path.py tests/test_launch.py" \
        "tests/test_hopper.py tests/test_dropout.py" "tests/test_flash_attn_interface.py tests/test_kvcache.py tests/test_dynamic.py")
i=0
for g in "${groups[@]}"; do
  PYTHONPATH=$PWD timeout 330 python -m pytest -q -x -p no:cacheprovider $g > "$OUT/tests_$i.txt" 2>&1 &
  i=$((i + 1))
done
wait
for f in "$OUT"/tests_*.txt; do echo "$f: $(tail -1 "$f")"; done
log "host routes"
PYTHONPATH=$PWD timeout 150 python -m sparseflash.experiments.bench.host --out "$OUT/host" --seq-len 1024 --tokens 32768 \
  --heads 4 --head-dims 64 > "$OUT/host.log" 2>&1
tail -25 "$OUT/host.log"
log "done"
