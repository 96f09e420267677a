"""`sparseflash bench sparsity`: runtime versus density, sweeping each pattern's own parameter.

For every pattern and sequence length the sweep picks the masks nearest to the target densities
(1.0 down to 1/64, see `masks.sweep_points`), times their construction on the device (``mask_ms``,
reported apart from attention time), and measures every provider at every
(seq_len, head_dim, mode): dense providers once per shape, block-sparse ones at every mask, and
masked dense-compute ones (standard attention / SDPA with a token ``attn_mask``, whose cost does not
depend on the mask) at the densest and sparsest mask unless ``masked_points="all"``.
"""

from __future__ import annotations

import torch

from sparseflash.experiments.bench.config import BenchConfig
from sparseflash.experiments.bench.masks import PatternUnavailable, sweep_points, time_mask_build
from sparseflash.experiments.bench.runner import Point, execute

__all__ = ["mask_points", "run"]


def mask_points(cfg: BenchConfig, notes: list[str]) -> dict[int, list[Point]]:
    """The sweep's masks per sequence length, built and timed on the benchmark device."""
    out: dict[int, list[Point]] = {n: [] for n in cfg.seq_lens}
    for name in cfg.patterns:
        for n in cfg.seq_lens:
            try:
                chosen = sweep_points(name, n, cfg.block_size, cfg.causal, cfg.targets, cfg.seed)
                for mp in chosen:
                    time_mask_build(mp, n, cfg.block_size, cfg.causal, torch.device(cfg.device), cfg.seed)
            except PatternUnavailable as e:
                notes.append(f"pattern {name} skipped at seq_len={n}: {e}")
                continue
            except Exception as e:  # a broken generator must not end the other patterns' sweeps
                notes.append(f"pattern {name} skipped at seq_len={n}: {type(e).__name__}: {e}")
                continue
            for i, mp in enumerate(chosen):
                out[n].append(Point(name, mp.param, mp.mask, mp.density, mp.token_density, mp.rel_density,
                                    mp.mask_ms, ends=i in (0, len(chosen) - 1)))
    return out


def run(cfg: BenchConfig, command: str = "", show_progress: bool = True, log=None):
    """Run the sweep; returns (rows, meta)."""
    if cfg.bench != "sparsity":
        raise ValueError(f"sparsity.run needs a config with bench='sparsity', got {cfg.bench!r}")
    notes: list[str] = []
    points = mask_points(cfg, notes)
    return execute(cfg, points, notes, command, show_progress, log)
