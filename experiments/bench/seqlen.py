"""`sparseflash bench seqlen`: runtime and peak memory versus sequence length (the FlashAttention
paper's Figure 3 view), for dense attention and one fixed pattern.

Lengths default to 512 ... 64K with ``batch * seq_len`` held at 16K tokens (batch 1 from 16K on).
The pattern is built with its fixed configuration at each length (`masks.PATTERNS[...].default`:
the full butterfly by default, O(N log N) blocks). Providers that run out of memory give rows
with status ``OOM``; nothing is dropped.
"""

from __future__ import annotations

import torch

from sparseflash.experiments.bench.config import BenchConfig
from sparseflash.experiments.bench.masks import PatternUnavailable, default_point, time_mask_build
from sparseflash.experiments.bench.runner import Point, execute
from sparseflash.experiments.bench.timing import free_memory, is_oom

__all__ = ["mask_points", "run"]


def mask_points(cfg: BenchConfig, notes: list[str]) -> dict[int, list[Point]]:
    out: dict[int, list[Point]] = {n: [] for n in cfg.seq_lens}
    for name in cfg.patterns:
        for n in cfg.seq_lens:
            try:
                mp = default_point(name, n, cfg.block_size, cfg.causal, cfg.seed)
                time_mask_build(mp, n, cfg.block_size, cfg.causal, torch.device(cfg.device), cfg.seed)
            except PatternUnavailable as e:
                notes.append(f"pattern {name} skipped at seq_len={n}: {e}")
                continue
            except Exception as e:
                if is_oom(e):
                    free_memory()
                notes.append(f"pattern {name} skipped at seq_len={n}: {type(e).__name__}: {e}")
                continue
            out[n].append(Point(name, mp.param, mp.mask, mp.density, mp.token_density, mp.rel_density, mp.mask_ms))
    return out


def run(cfg: BenchConfig, command: str = "", show_progress: bool = True, log=None):
    """Run the sweep; returns (rows, meta)."""
    if cfg.bench != "seqlen":
        raise ValueError(f"seqlen.run needs a config with bench='seqlen', got {cfg.bench!r}")
    notes: list[str] = []
    points = mask_points(cfg, notes)
    return execute(cfg, points, notes, command, show_progress, log)
