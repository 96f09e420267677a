#!/usr/bin/env bash
# Data-parallel scaling of the Path-X fine-tune step: the same training command on 1 and on every
# GPU of the machine (torchrun, NCCL), at the recipe's global batch of 32 and at 128:
#   experiments/studies/pathx/dp_scaling.sh OUT
# Each run trains the faithful Path-X model (butterfly, black as padding, --cuda-graphs: with several
# ranks each rank's graphed step averages the gradients with one captured all-reduce) for STEPS steps
# (default 3000) on NUM (default 20000) release Path-X images made first in DATA (default
# /tmp/pathx-scaling; a full 200K set there is used as it is). The median step_ms of each run's last
# half of logged steps goes to OUT/dp_scaling.csv with the machine's GPUs and the commit, and a table
# is printed last. GRAPHS=0 runs without --cuda-graphs; CONFIG=tiny NUM=40 STEPS=6 GRAPHS=0 LOADER_WORKERS=0
# rehearses it on a CPU (gloo, 2 ranks).
set -uo pipefail
out=$1
py=${PYTHON:-python3}
data=${DATA:-/tmp/pathx-scaling}; num=${NUM:-20000}; steps=${STEPS:-3000}; config=${CONFIG:-faithful}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
[ -f COMMIT ] && export SPARSEFLASH_COMMIT=$(cat COMMIT)
mkdir -p "$out"
if command -v nvidia-smi > /dev/null && [ "${GRAPHS:-1}" = 1 ]; then
    gpus=$(nvidia-smi -L | wc -l); device=cuda; graphs=(--cuda-graphs)
else
    gpus=2; device=cpu; graphs=()
fi
folder="$data/pathx/pathfinder128/curv_contour_length_14"
if ! $py -c "import json,sys; sys.exit(0 if json.load(open('$folder/generation.json')).get('complete') else 1)" 2>/dev/null; then
    $py -m sparseflash lra data pathfinder --resolution 128 --difficulty hard --num "$num" --out "$data/pathx" \
        --fidelity release --workers "${WORKERS:-16}" --no-progress --resume 2>&1 | tail -n 1
fi
ranks=(1); [ "$gpus" -ge 2 ] && ranks+=("$gpus")
for batch in 32 128; do
    for r in "${ranks[@]}"; do
        run="$out/b${batch}-r${r}"
        echo "=== global batch $batch on $r rank(s) ($(date -u +%H:%M:%S))"
        rm -rf "$run"
        $py -m torch.distributed.run --standalone --nproc_per_node "$r" -m sparseflash lra train --task pathx \
            --config "$config" --data "$data/pathx" --attention sparseflash --pattern butterfly --device "$device" \
            --set model.black_is_padding=True --set "train.batch_size=$batch" --max-steps "$steps" \
            --num-workers "${LOADER_WORKERS:-$(( 8 / r ))}" --no-progress "${graphs[@]}" --out "$run" \
            > "$run.log" 2>&1 || { echo "run $run failed:"; tail -n 20 "$run.log"; }
    done
done
$py - "$out" "$device" <<'EOF'
import csv, glob, json, os, statistics, sys
out, device = sys.argv[1], sys.argv[2]
rows = []
for run in sorted(glob.glob(os.path.join(out, "b*-r*"))):
    if not os.path.isdir(run):  # (each run's .log sits beside its folder)
        continue
    name = os.path.basename(run)
    batch, ranks = (int(x[1:]) for x in name.split("-"))
    try:
        train = list(csv.DictReader(open(os.path.join(run, "train.csv"))))
        summary = json.load(open(os.path.join(run, "summary.json")))
    except OSError:
        continue
    ms = [float(r["step_ms"]) for r in train[len(train) // 2:]]
    rows.append({"global_batch": batch, "ranks": ranks, "steps": len(train) and int(train[-1]["step"]),
                 "median_step_ms": round(statistics.median(ms), 3) if ms else float("nan"),
                 "gpu": summary.get("gpu"), "device": device, "torch": summary.get("torch"),
                 "commit": os.environ.get("SPARSEFLASH_COMMIT", "")})
for r in rows:
    one = [x for x in rows if x["global_batch"] == r["global_batch"] and x["ranks"] == 1]
    r["speedup"] = round(one[0]["median_step_ms"] / r["median_step_ms"], 3) if one else float("nan")
if rows:
    with open(os.path.join(out, "dp_scaling.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
print(f"{'batch':>6} {'ranks':>5} {'steps':>6} {'ms/step':>8} {'speedup':>8}")
for r in rows:
    print(f"{r['global_batch']:>6} {r['ranks']:>5} {r['steps']:>6} {r['median_step_ms']:>8} {r['speedup']:>8}")
EOF
