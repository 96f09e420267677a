"""Benchmark configurations: the defaults for GPU and CPU, `--quick`, and named presets.

Sizes keep ``batch * seq_len`` constant (``tokens``; 16K on the GPU, as in the baselines of
../shared/ANCHORS.md), so every point moves the same number of query tokens and effective TFLOP/s
compare across lengths. GPU defaults are sized for an H100 session of a few minutes
(`sparseflash bench ... ` prints an estimate before it starts); CPU defaults are a small,
labelled version that finishes in about two minutes on two cores: few points, each warmed up and
timed in five interleaved rounds (timing.py), so that two runs agree on every row's median.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from sparseflash.experiments.bench.timing import TimingConfig

__all__ = ["BenchConfig", "PRESETS", "defaults", "MODES", "add_shape_args"]

MODES = ("fwd", "bwd", "fwdbwd")


@dataclass
class BenchConfig:
    bench: str  # "sparsity" or "seqlen"
    patterns: tuple[str, ...]
    seq_lens: tuple[int, ...]
    head_dims: tuple[int, ...]
    heads: int
    tokens: int  # batch = max(1, tokens // seq_len) unless batch is set
    batch: int | None
    dtype: str
    modes: tuple[str, ...]
    causal: bool
    providers: tuple[str, ...]
    targets: tuple[float, ...]  # sparsity: target densities (1.0 ... 1/64)
    block_size: int
    device: str  # "cuda" or "cpu"
    sf_backend: str = "auto"
    masked_points: str = "ends"  # sparsity: "ends" (densest and sparsest mask) or "all"
    timing: TimingConfig = field(default_factory=TimingConfig)
    check: bool = False  # compare every provider's output with the reference (max_err column)
    seed: int = 0
    preset: str | None = None

    def __post_init__(self):
        if self.bench not in ("sparsity", "seqlen"):
            raise ValueError(f"bench must be 'sparsity' or 'seqlen', got {self.bench!r}")
        for name in ("seq_lens", "head_dims"):
            vals = getattr(self, name)
            if not vals or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in vals):
                raise ValueError(f"{name} must be positive ints, got {vals!r}")
        for name in ("heads", "tokens", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        b = self.batch
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            raise ValueError(f"batch must be a positive int or None, got {self.batch!r}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes must be from {MODES}, got {self.modes!r}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.masked_points not in ("ends", "all"):
            raise ValueError(f"masked_points must be 'ends' or 'all', got {self.masked_points!r}")
        if not self.patterns:
            raise ValueError("patterns must name at least one pattern")
        if not self.targets or any(not (0 < t <= 1) for t in self.targets):
            raise ValueError(f"target densities must lie in (0, 1], got {self.targets!r}")

    def batch_for(self, seq_len: int) -> int:
        return self.batch if self.batch is not None else max(1, self.tokens // seq_len)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["timing"] = dataclasses.asdict(self.timing)
        return d


def add_shape_args(ap, seq_len: int = 4096, head_dim: int = 64) -> None:
    """The one-setting options of the single-purpose scripts (studies/host_cost: breakdown, host_cost): sequence
    length, head dim, heads, and tokens per batch (batch = max(1, tokens // seq_len))."""
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--head-dim", type=int, default=head_dim)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def defaults(bench: str, device: str, quick: bool = False) -> dict:
    """Default fields of a BenchConfig for ``bench`` on ``device`` ('cuda' / 'cpu')."""
    from sparseflash.experiments.bench.masks import DEFAULT_TARGETS
    from sparseflash.experiments.bench.providers import DEFAULT_PROVIDERS

    d = dict(bench=bench, dtype="bf16", modes=("fwd", "fwdbwd"), causal=False, providers=DEFAULT_PROVIDERS,
             targets=DEFAULT_TARGETS, device=device, batch=None)
    if device == "cuda":
        d.update(heads=16, tokens=16384, block_size=128, timing=TimingConfig(warmup_ms=25, rep_ms=100))
        if bench == "sparsity":
            d.update(patterns=("butterfly", "local", "random"), seq_lens=(4096, 16384), head_dims=(64, 128))
        else:
            d.update(patterns=("butterfly",), seq_lens=tuple(512 << i for i in range(8)), head_dims=(64,))
        if quick:
            d.update(seq_lens=(4096,) if bench == "sparsity" else (1024, 4096, 16384), head_dims=(128,)
                     if bench == "sparsity" else (64,), targets=(1.0, 1 / 4, 1 / 16),
                     timing=TimingConfig(warmup_ms=10, rep_ms=40))
        return d
    # CPU: the reference path (or the Triton interpreter, at smaller sizes still).
    small = _interpreting()
    d.update(heads=1 if small else 2, tokens=256 if small else 1024, block_size=32, check=True,
             timing=TimingConfig(warmup_ms=0, rep_ms=20, min_runs=1) if small else
             TimingConfig(warmup_ms=100, rep_ms=300, min_runs=3, rounds=5))
    if bench == "sparsity":
        d.update(patterns=("butterfly", "local", "random"), seq_lens=(256,) if small else (512,),
                 head_dims=(16,) if small else (32,))
        if not small:
            d.update(targets=(1.0, 1 / 4, 1 / 16))
    else:
        d.update(patterns=("butterfly",), seq_lens=(64, 128, 256) if small else (128, 256, 512, 1024),
                 head_dims=(16,) if small else (32,))
    if quick:
        d.update(targets=(1.0, 1 / 4), modes=("fwd",), patterns=d["patterns"][:1])
    return d


# Named presets: fields that replace the defaults (explicit command-line options still win).
PRESETS = {
    # the standard performance check: bf16, d 64/128, seq 4K/16K, 16 heads, 16K tokens, density
    # 1.0 and random / butterfly at ~0.5, 0.25, 0.1, fwd and fwd+bwd, against SDPA flash / cuDNN,
    # FlexAttention on the same block mask and FlashAttention-4 (dense and the same block lists;
    # skipped with its reason where flash_attn.cute is not importable).
    "kernel-check": dict(
        bench="sparsity", patterns=("random", "butterfly"), targets=(1.0, 0.5, 0.25, 0.1), modes=("fwd", "fwdbwd"),
        providers=("sparseflash", "sparseflash-dense", "sdpa-flash", "sdpa-cudnn", "flex", "fa4", "fa4-dense"),
        causal=False,
        dtype="bf16", check=True,
        gpu=dict(seq_lens=(4096, 16384), head_dims=(64, 128), heads=16, tokens=16384, block_size=128),
    ),
}
