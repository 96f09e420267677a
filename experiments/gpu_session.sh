#!/usr/bin/env bash
# The GPU runs behind experiments/results/, in stages that each fit one call of a lent H100:
#   experiments/gpu_session.sh OUT STAGE [STAGE ...]
# Stages: sweep (bench sparsity, full GPU defaults), seqlen (bench seqlen), causal (the kernel check, causal), dropout, tests (GPU
# test files and the bench tests, in SHARDS processes), tune (tile search, dense and density 0.1), kernel-check (issue
# 3's check against the baselines, GPU time and eager), ab (the kernel check, sparseflash only, in
# GPU time, for the source tree in AB_OLD and for this one), tma (TMA loads vs pointer loads:
# tma_ab and a tile search per kernel and mode), eager-4k (the kernel check at 4K, eager), host-cost
# (host time per call, SPARSEFLASH_TMA=off and auto), host (issue 21: host us per call of ours, bound
# and unbound launches, and SDPA's, side by side; eager fwd+bwd against GPU time at 4K), short-rows (per-row fixed cost, with the
# baselines), gluon (experiments/studies/gluon/gluon_probe.py), exact (the Hopper kernels' exact-mask tests,
# then bench.exact), packed (segment_ids tests, then packed
# documents against FlexAttention's document mask: experiments/bench/packed.py), short-calls (issue 21:
# the native, short-path, compile and graph tests, then eager fwd+bwd against its own kernels' time),
# dynamic (per-call top-k masks), decode (the KV-cache decode grid), upstream (flash-attn's own test
# file), threshold (the Hopper dispatch threshold and the host profile),
# lra-paired (issue 21: every LRA task's training step paired with SDPA's), lra-speed, lra-train. Each stage
# writes OUT/<stage>/ and a log; everything is packed into OUT/<stage>.tgz so a call brings back
# few files.
set -uo pipefail
out=$1; shift
export PYTHONUNBUFFERED=1
# The device's copy of the tree has no trustworthy git history (a stale .git gives a wrong id):
# results must carry the commit they ran, so pass SPARSEFLASH_COMMIT=$(git rev-parse --short HEAD)
# from the checkout the tree came from.
if [ -z "${SPARSEFLASH_COMMIT:-}" ]; then
    echo "gpu_session.sh: set SPARSEFLASH_COMMIT to the commit of this tree (git rev-parse --short HEAD where it was made)" >&2
    exit 2
fi
export SPARSEFLASH_COMMIT
py=${PYTHON:-python3}
for stage in "$@"; do
    d=$out/$stage; mkdir -p "$d"
    echo "=== $stage ($(date -u +%H:%M:%S))"
    # STAGE_TIMEOUT (seconds) bounds each command, so one slow stage cannot eat a whole call
    t="timeout ${STAGE_TIMEOUT:-86400}"
    case $stage in
        sweep)   $t $py -m sparseflash bench sparsity --out "$d" ;;
        seqlen)  $t $py -m sparseflash bench seqlen --providers sparseflash sparseflash-dense sdpa-flash sdpa-cudnn torch --out "$d" ;;
        dropout) $t $py -m pytest -q -x -p no:cacheprovider tests/test_dropout.py --tb=short
                 $t $py -m sparseflash.experiments.bench.dropout --cuda-graph --out "$d" ;;
        tests)   # SHARDS pytest processes side by side (compiling the many kernel variants is the slow part)
                 # TEST_FILES replaces the default list of test files; TEST_IDS (a file of test ids, one a
                 # line, as `pytest --collect-only -q` prints them) replaces both: ids hold spaces, so they
                 # never go through a shell variable
                 if [ -n "${TEST_IDS:-}" ]; then
                     grep '::' "$TEST_IDS" > "$d/ids.txt"
                 else
                     $py -m pytest --collect-only -q -p no:cacheprovider ${TEST_FILES:-tests/test_flash.py tests/test_dropout.py tests/test_bench.py tests/test_studies.py tests/test_segments.py tests/test_launch.py tests/test_lra_denoise.py} \
                         | grep '::' > "$d/ids.txt"
                 fi
                 if [ ! -s "$d/ids.txt" ]; then  # (pytest given no ids would run every test, in every shard)
                     echo "tests: no test ids collected (see above)"
                 else
                     split -n "r/${SHARDS:-12}" "$d/ids.txt" "$d/shard_"
                     for f in "$d"/shard_*; do
                         mapfile -t ids < "$f"
                         [ "${#ids[@]}" -gt 0 ] && $t $py -m pytest -q -p no:cacheprovider --durations=5 "${ids[@]}" > "$f.log" 2>&1 &
                     done
                     wait
                     for f in "$d"/shard_*.log; do echo "--- $f"; tail -n 12 "$f"; done
                 fi ;;
        tune)    # TUNE_ARGS replaces the default search (e.g. --kinds dkdv --dropout 0 0.1 --configs ...)
                 $t $py -m sparseflash.experiments.bench.tune_tiles ${TUNE_ARGS:---seq-lens 4096 16384 --densities 1 0.1} --out "$d" ;;
        causal)  # the kernel check, causal, GPU time (experiments/results/causal/)
                 $t $py -m sparseflash bench sparsity --preset kernel-check --causal --cuda-graph --out "$d" ;;
        kernel-check)
                 $t $py -m sparseflash bench sparsity --preset kernel-check --cuda-graph --out "$d/graph"
                 $t $py -m sparseflash bench sparsity --preset kernel-check --seq-len 4096 --out "$d/eager-4k" ;;
        ab)      # AB_OLD: a source tree of an earlier commit (git archive), carried with the call;
                 # AB_ARGS: extra options for both (e.g. --head-dim 40 80 for the row-alignment hint)
                 ab="--preset kernel-check --providers sparseflash sparseflash-dense --densities 1 0.1 --cuda-graph --no-plot ${AB_ARGS:-}"
                 (cd "${AB_OLD:?set AB_OLD}" && $t $py -m sparseflash bench sparsity $ab --out "$d/old")
                 $t $py -m sparseflash bench sparsity $ab --out "$d/new" ;;
        tma)     # TMA descriptor loads against pointer loads (experiments/studies/tma/results/): tma_ab at the
                 # default tiles, then the tile search of each kernel in TMA_KINDS once per mode
                 # (TMA_TUNE_ARGS: extra tune_tiles options, e.g. --configs ...; TMA_AB=0 skips tma_ab)
                 [ "${TMA_AB:-1}" = 1 ] && $t $py -m sparseflash.experiments.studies.tma.tma_ab --out "$d"
                 for kind in ${TMA_KINDS:-fwd dq dkdv}; do
                     for m in off on; do
                         SPARSEFLASH_TMA=$m $t $py -m sparseflash.experiments.bench.tune_tiles --kinds $kind \
                             --seq-lens 4096 16384 --densities 1 0.1 --rep 40 ${TMA_TUNE_ARGS:-} --out "$d/tune-$kind-$m"
                     done
                 done ;;
        eager-4k) # the kernel check at 4K as a user calls it (host cost included), default loads
                 # (EAGER_ARGS: extra options, e.g. --providers ...)
                 $t $py -m sparseflash bench sparsity --preset kernel-check --seq-len 4096 ${EAGER_ARGS:-} --out "$d" ;;
        short-rows) # per-row fixed cost: ours, FlexAttention's, SDPA flash's and cuDNN's (SHORT_ROWS_ARGS)
                 $t $py -m sparseflash.experiments.studies.short_rows.short_rows --out "$d" ${SHORT_ROWS_ARGS:-} ;;
        host-cost) # host time per call, pointer loads vs the default (TMA where it is taken), d=64 and 128
                 for m in off auto; do
                     for hd in 64 128; do
                         SPARSEFLASH_TMA=$m $t $py -m sparseflash.experiments.studies.host_cost.host_cost --head-dim $hd --out "$d/$m-d$hd"
                     done
                 done ;;
        host)    # issue 21's goals in one run: host us per call (fwd, fwd+bwd; d=64/128; dense and density
                 # 0.094 at 4K; with and without key_lengths) of ours with bound launches, with Triton's own
                 # launch path, and SDPA's; eager fwd+bwd against CUDA-graph GPU time (HOST_ARGS: extra options)
                 $t $py -m pytest -q -x -p no:cacheprovider tests/test_launch.py --tb=short
                 $t $py -m sparseflash.experiments.bench.host --out "$d" ${HOST_ARGS:-} ;;
        gluon)   # the Gluon probe: a persistent warp-specialised forward (GLUON_ARGS: extra options,
                 # e.g. --variant ...), timed beside ours on the same inputs
                 $t $py -m sparseflash.experiments.studies.gluon.gluon_probe --out "$d" ${GLUON_ARGS:-} ;;
        exact)   # token-exact masks: the Hopper kernels' bits against the float64 reference, then the
                 # bench (the default path with bits beside the block-level call, the predicates,
                 # flash-attn's interface and FlexAttention: BENCHMARKS.md's providers)
                 $t $py -m pytest -q -p no:cacheprovider tests/test_hopper.py -k exact_bits --tb=short
                 $t $py -m sparseflash.experiments.bench.exact --out "$d" ${EXACT_ARGS:---providers \
                     sparseflash-exact-hopper sparseflash-block sparseflash-predicate flash-attn-api flex} ;;
        packed)  # PACKED_ARGS: extra options (e.g. --causal both --mean-lens 128 512 2048)
                 $t $py -m pytest -q -x -p no:cacheprovider tests/test_segments.py --tb=short
                 $t $py -m sparseflash.experiments.bench.packed --out "$d" ${PACKED_ARGS:-} ;;
        short-calls) # issue 21 on the GPU: the native plan built first (not in the background of a test),
                 # the short-path, native, launch, torch.compile and CUDA-graph tests in 4 processes, then
                 # the eager-against-GPU part of bench.host (HOST_ARGS: extra options)
                 $t $py -c "from sparseflash.flash import native; native.load(); print('native built in', native.cache_dir())"
                 pt="$t $py -m pytest -q -p no:cacheprovider --tb=short"
                 $pt tests/test_native.py tests/test_bench.py::test_gpu_kernel_ms_is_the_calls_own_kernels > "$d/tests_native.log" 2>&1 &
                 $pt tests/test_fast_path.py > "$d/tests_fast_path.log" 2>&1 &
                 $pt tests/test_launch.py > "$d/tests_launch.log" 2>&1 &
                 { $pt tests/test_flash.py -k "compile or graph"; $pt tests/test_dropout.py -k "graph or compiled"
                   $pt tests/test_segments.py -k compile; } > "$d/tests_compile_graph.log" 2>&1 &
                 wait
                 for f in "$d"/tests_*.log; do echo "--- $f"; tail -n 8 "$f"; done
                 $t $py -m sparseflash.experiments.bench.host --no-host --providers sparseflash sparseflash-python sdpa \
                     --out "$d" ${HOST_ARGS:-} ;;
        dynamic) # per-call top-k masks against the fixed mask and Flex built per call (experiments/results/dynamic/;
                 # writes after every (head_dim, K)); DYNAMIC_ARGS: extra options, e.g. --head-dims 128 --ks 8
                 $t $py -m pytest -q -p no:cacheprovider tests/test_dynamic.py --tb=short
                 $t $py -m sparseflash.experiments.bench.dynamic --out "$d" ${DYNAMIC_ARGS:-} ;;
        decode)  # flash_attn_with_kvcache's decode grid (experiments/results/decode/), the whole grid
                 $t $py -m pytest -q -p no:cacheprovider tests/test_kvcache.py --tb=short
                 $t $py -m sparseflash.experiments.bench.decode --full --max-cache-gb 48 --out "$d" ;;
        upstream) # flash-attn's own tests/test_flash_attn.py through the name shim (carry .upstream: see
                 # experiments/studies/flash_attn_upstream/README.md); UPSTREAM_N cases per test function
                 $t $py -m sparseflash.experiments.studies.flash_attn_upstream.run_upstream "$d" --n ${UPSTREAM_N:-8} \
                     --jobs ${UPSTREAM_JOBS:-4} ;;
        threshold) # where the Hopper kernels should start taking eager calls, then the host profile
                 $t $py -m sparseflash.experiments.studies.hopper_threshold.threshold --out "$d" ${THRESHOLD_ARGS:-}
                 $t $py -m sparseflash.experiments.studies.hopper_threshold.host_profile --out "$d/host_profile" ;;
        lra-paired) # issue 21's third goal: every task's training step paired with SDPA's and our dense one's
                 $t $py -m sparseflash lra speed --paired ${PAIRED_STEPS:-120} --task ${PAIRED_TASKS:-all} \
                     --providers sdpa sparseflash --no-flex-sparse --no-progress --out "$d" ;;
        lra-speed) $t $py -m sparseflash lra speed --task all --max-seconds 5 --repeats 5 --out "$d" ;;
        lra-train) $t bash experiments/lra/run_quick.sh "$d" ;;
        *) echo "unknown stage $stage"; exit 2 ;;
    esac 2>&1 | tee "$out/$stage.log" | tail -n 40
    # (the log joins the stage's folder afterwards: the commands refuse an --out that holds files they
    # did not write, and tee would have made it first)
    mkdir -p "$d" && mv "$out/$stage.log" "$d/log.txt"
    tar czf "$out/$stage.tgz" -C "$out" "$stage" && rm -rf "$d"
done
