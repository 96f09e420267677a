#!/usr/bin/env bash
# Today's results in one GPU call: the kernel check, the eager density sweep behind README's figure
# and the sequence-length sweep (eager, then GPU time), all on the default kernels of this tree.
#
#   SPARSEFLASH_COMMIT=<short sha of this tree> bash experiments/bench/remeasure.sh OUT
#
# Writes OUT/kernel-check/, OUT/sparsity/, OUT/seqlen/, OUT/seqlen-gpu-time/ (each: the bench's
# CSV, JSON, table and plots; its log beside it, OUT/<stage>.log) and OUT/remeasure.json (per stage: status, seconds, rows);
# prints a short table last. Stages run in order of need, each bounded so the whole call stays
# within BUDGET_S seconds (default 530, for a 9-minute call): the kernel check (BENCHMARKS.md's first
# tables) keeps RESERVE_S (default 240) for the two eager sweeps after it, the density sweep keeps
# 50 for the eager sequence-length sweep, and the GPU-time sequence-length sweep runs only with at
# least 75 s left. A stage cut off by its bound writes no tables (the bench writes at its end): it
# shows as "timeout" and the call still returns the others. The kernel check runs the densities
# BENCHMARKS.md reads (1 and the sparsest, ~0.1: 88 rows instead of the preset's 152; a CUDA-graph
# row costs about a second). Expected on an H200: about 2.5 + 3 + 1 + 1.2 minutes, 7.5 in all (the
# H100 runs took 230 s for all 152 rows, 169 and 44 s; the Hopper kernels compile in the first stage).
# Afterwards: experiments/README.md, "Today's results: re-measure, copy, render".
set -uo pipefail
out=${1:?usage: SPARSEFLASH_COMMIT=<sha> bash experiments/bench/remeasure.sh OUT}
# The device's copy of the tree has no trustworthy git history: the rows must carry the commit they ran.
if [ -z "${SPARSEFLASH_COMMIT:-}" ]; then
    echo "remeasure.sh: set SPARSEFLASH_COMMIT to the commit of this tree (git rev-parse --short HEAD where it was made)" >&2
    exit 2
fi
export SPARSEFLASH_COMMIT PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
budget=${BUDGET_S:-530}
reserve=${RESERVE_S:-240}
# TINY_ARGS: options appended to every bench command (a small CPU run that tests this script:
# tests/test_remeasure.py); on the GPU leave it unset
tiny=${TINY_ARGS:-}
bench="$py -m sparseflash bench"
# each stage: name, seconds to leave for the stages after it, least seconds it needs to start, command
stages=(
    "kernel-check|$reserve|120|$bench sparsity --preset kernel-check --densities 1 0.1 --cuda-graph --no-progress"
    "sparsity|50|100|$bench sparsity --no-progress"
    "seqlen|0|30|$bench seqlen --providers sparseflash sparseflash-dense sdpa-flash sdpa-cudnn torch --no-progress"
    "seqlen-gpu-time|0|75|$bench seqlen --providers sparseflash sparseflash-dense sdpa-flash sdpa-cudnn --cuda-graph --no-progress"
)
mkdir -p "$out"
start=$(date +%s)
summary=()
for spec in "${stages[@]}"; do
    IFS='|' read -r name keep need cmd <<< "$spec"
    d=$out/$name
    left=$(( budget - ($(date +%s) - start) ))
    bound=$(( left - keep ))
    if [ "$bound" -lt "$need" ]; then
        summary+=("$name|skipped|0|0|${left}s left")
        continue
    fi
    echo "=== $name ($(date -u +%H:%M:%S), at most ${bound}s): $cmd --out $d"
    t0=$(date +%s)
    timeout "$bound" $cmd $tiny --out "$d" > "$out/$name.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - t0 ))
    tail -n 4 "$out/$name.log"
    rows=$(ls "$d"/*.csv >/dev/null 2>&1 && $py -c "import csv,sys; print(sum(1 for _ in csv.DictReader(open(sys.argv[1]))))" "$(ls "$d"/*.csv | head -1)" || echo 0)
    case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status="exit $rc" ;; esac
    summary+=("$name|$status|$secs|$rows|")
done
$py - "$out" "$SPARSEFLASH_COMMIT" "${summary[@]}" <<'EOF'
import json, sys
out, commit, lines = sys.argv[1], sys.argv[2], sys.argv[3:]
stages = [dict(zip(("stage", "status", "seconds", "rows", "note"), l.split("|"))) for l in lines]
for s in stages:
    s["seconds"], s["rows"] = int(s["seconds"]), int(s["rows"])
json.dump({"commit": commit, "stages": stages}, open(f"{out}/remeasure.json", "w"), indent=1)
print(f"\nremeasure at {commit}: {out}")
print(f"{'stage':<16} {'status':<10} {'s':>5} {'rows':>5}  note")
for s in stages:
    print(f"{s['stage']:<16} {s['status']:<10} {s['seconds']:>5} {s['rows']:>5}  {s['note']}")
EOF
