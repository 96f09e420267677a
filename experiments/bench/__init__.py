"""Benchmarks: runtime vs sparsity and sequence length against the baselines, with plots.

    sparseflash bench sparsity [...]   sparsity.py   density sweep of each pattern's own parameter
    sparseflash bench seqlen [...]     seqlen.py     runtime / peak memory vs sequence length
    sparseflash plot RESULTS --out D   plots.py      every figure, redrawn from saved rows

providers.py (every implementation compared), masks.py (the pattern table, density targets,
mask build timing), flops.py (effective FLOPs and densities), timing.py (eager back-to-back / CUDA-graph / CPU timing,
peak memory), runner.py (jobs -> rows, failures recorded), results.py (CSV / JSON / tables),
config.py (GPU and CPU defaults, presets), cli.py (arguments).

Benchmarks run as modules: dropout.py (dropout against none, and the baselines' fused dropout),
packed.py (packed documents: segment_ids against Flex's document mask and dense attention).
Developer tools: tune_tiles.py (search kernel tile configs on a GPU), inspect_kernels.py (compile
for sm_90a without a GPU: registers, spills, SASS). One-off investigations live in
experiments/studies/<topic>/, each with its README.
"""
