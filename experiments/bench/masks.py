"""Which masks a benchmark runs: the pattern table, density sweeps and mask build timing.

`PATTERNS` is the one table saying how each generator of `sparseflash.patterns` is called and
which parameter a density sweep turns. A sweep builds every candidate value on the CPU, measures
its ``rel_density`` (attended pairs over those of dense attention with the same ``causal``), and
keeps, for each target density, the candidate nearest in log density. Mask build time of the
chosen masks is measured on the benchmark device, separately from the attention time. A pattern
whose generator is missing is reported as unavailable and never crashes a sweep.
"""

from __future__ import annotations

import inspect
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from sparseflash.experiments.bench.flops import densities
from sparseflash.mask import BlockMask

__all__ = ["PatternSpec", "PATTERNS", "DEFAULT_TARGETS", "PatternUnavailable", "MaskPoint", "generator",
           "build_mask", "sweep_points", "default_point", "time_mask_build"]

# Densities a sparsity sweep aims at: dense down to 1/64.
DEFAULT_TARGETS = (1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64)


class PatternUnavailable(RuntimeError):
    """The pattern's generator is not (yet) in sparseflash.patterns."""


def _ladder(n: int) -> list[int]:
    """Integers from 1 to n, roughly geometric (~10% steps), with every power of two."""
    if n <= 1:
        return [1]
    geo = {max(1, round(n ** (i / 48))) for i in range(49)}
    return sorted(geo | {1 << i for i in range(n.bit_length())} | {n})


def _butterfly_candidates(nb: int, b: int):
    # The full butterfly of every size s (stretched over the grid, density (1 + log2 s) / s), then
    # the largest one with fewer factors ((1 + f) / nb): sparser than any full butterfly.
    p = 1 << max(0, (nb - 1).bit_length())
    sizes = [1 << i for i in range(p.bit_length())]  # 1, 2, 4, ..., p
    full = [((), {"butterfly_size": s}) for s in sizes]
    return full + [((), {"butterfly_size": p, "n_factors": f}) for f in range(p.bit_length() - 1)]


Args = tuple[tuple, dict]


@dataclass(frozen=True)
class PatternSpec:
    """How to call one generator: ``fn(seq_len, *args, **kwargs, block_size=b[, causal=][, seed=][, device=])``.

    ``candidates(nb, b)`` lists the (args, kwargs) a density sweep tries for a grid of ``nb``
    blocks of ``b`` tokens; ``default(nb, b)`` is the fixed point a sequence-length sweep uses.
    ``causal`` / ``seed`` / ``device`` are passed when the generator accepts them.
    """

    name: str
    knob: str
    candidates: Callable[[int, int], list[Args]]
    default: Callable[[int, int], Args]


PATTERNS: dict[str, PatternSpec] = {p.name: p for p in (
    PatternSpec("butterfly", "butterfly_size s (full: density (1 + log2 s) / s), then n_factors at the largest s",
                _butterfly_candidates, lambda nb, b: ((), {})),
    PatternSpec("local", "window = w blocks of tokens (2w + 1 blocks per row)",
                lambda nb, b: [((w * b,), {}) for w in [0] + _ladder(nb)], lambda nb, b: ((2 * b,), {})),
    PatternSpec("strided", "stride = s blocks of tokens",
                lambda nb, b: [((s * b,), {}) for s in _ladder(nb)],
                lambda nb, b: ((b * max(1, round(math.sqrt(nb))),), {})),
    PatternSpec("random", "blocks_per_row = k",
                lambda nb, b: [((k,), {}) for k in _ladder(nb)], lambda nb, b: ((min(nb, 8),), {})),
    PatternSpec("bigbird", "window = w blocks, w random blocks per row, one global block",
                lambda nb, b: [((w * b, b, w), {}) for w in [0] + _ladder(nb)], lambda nb, b: ((b, 2 * b, 3), {})),
    PatternSpec("longformer", "window = w blocks, one global block",
                lambda nb, b: [((w * b, b), {}) for w in [0] + _ladder(nb)], lambda nb, b: ((2 * b, b), {})),
)}


@dataclass
class MaskPoint:
    """One mask of a sweep: how it was made and its densities (see flops.densities)."""

    pattern: str
    param: str
    args: tuple
    kwargs: dict
    mask: BlockMask
    density: float
    token_density: float
    rel_density: float
    mask_ms: float = float("nan")


def generator(name: str):
    """The generator function for a pattern name (PatternUnavailable if it does not exist)."""
    if name not in PATTERNS:
        raise ValueError(f"pattern must be one of {sorted(PATTERNS)}, got {name!r}")
    try:
        import sparseflash.patterns as zoo
    except ImportError as e:  # pragma: no cover - the zoo is part of the package
        raise PatternUnavailable(f"sparseflash.patterns is not importable ({e})") from e
    fn = getattr(zoo, name, None)
    if fn is None:
        raise PatternUnavailable(f"sparseflash.patterns has no generator {name!r} yet")
    return fn


def build_mask(name: str, seq_len: int, block_size: int, args: tuple, kwargs: dict, causal: bool,
               device=None, seed: int = 0) -> tuple[BlockMask, str]:
    """Build one mask; returns it and its parameter string (e.g. ``"window=256"``)."""
    fn = generator(name)
    sig = inspect.signature(fn)
    bound = sig.bind(seq_len, *args, **kwargs)
    first = next(iter(sig.parameters))
    param = ",".join(f"{k}={v}" for k, v in bound.arguments.items() if k != first) or "default"
    kw = dict(kwargs, block_size=block_size)
    if "causal" in sig.parameters:
        kw["causal"] = causal
    if "seed" in sig.parameters:
        kw.setdefault("seed", seed)
    if "device" in sig.parameters and device is not None:
        kw["device"] = device
    mask = fn(seq_len, *args, **kw)
    if not isinstance(mask, BlockMask):
        raise TypeError(f"sparseflash.patterns.{name} returned {type(mask).__name__}, not a BlockMask")
    return mask, param


def _point(name, seq_len, block_size, args, kwargs, causal, seed) -> MaskPoint:
    mask, param = build_mask(name, seq_len, block_size, args, kwargs, causal, None, seed)
    b, h = mask.shape[:2]
    return MaskPoint(name, param, args, kwargs, mask, **densities(mask, b, h, causal))


def sweep_points(name: str, seq_len: int, block_size: int, causal: bool, targets=DEFAULT_TARGETS,
                 seed: int = 0) -> list[MaskPoint]:
    """Masks of pattern ``name`` nearest to each target density, densest first, without repeats."""
    spec = PATTERNS[name] if name in PATTERNS else generator(name)
    targets = [float(t) for t in targets]
    if not targets or any(not (0 < t <= 1) for t in targets):
        raise ValueError(f"target densities must lie in (0, 1], got {targets}")
    nb = math.ceil(seq_len / block_size)
    cands = []
    for args, kwargs in spec.candidates(nb, block_size):
        try:
            p = _point(name, seq_len, block_size, args, kwargs, causal, seed)
        except ValueError:
            continue  # a candidate the generator rejects at this size
        if p.rel_density > 0:
            cands.append(p)
    if not cands:
        raise PatternUnavailable(f"pattern {name!r} has no usable mask at seq_len={seq_len}, block {block_size}")
    chosen = {}
    for t in targets:
        best = min(cands, key=lambda p: abs(math.log(p.rel_density / t)))
        chosen.setdefault(best.param, best)
    return sorted(chosen.values(), key=lambda p: -p.rel_density)


def default_point(name: str, seq_len: int, block_size: int, causal: bool, seed: int = 0) -> MaskPoint:
    """The pattern's fixed configuration at this length (for sequence-length sweeps)."""
    spec = PATTERNS[name] if name in PATTERNS else generator(name)
    args, kwargs = spec.default(math.ceil(seq_len / block_size), block_size)
    return _point(name, seq_len, block_size, args, kwargs, causal, seed)


def time_mask_build(point: MaskPoint, seq_len: int, block_size: int, causal: bool, device, seed: int = 0,
                    repeats: int = 3) -> MaskPoint:
    """Rebuild ``point``'s mask on ``device`` (one warm-up, median of ``repeats`` timed builds,
    including the compressed index a kernel reads); sets ``point.mask`` / ``point.mask_ms``.

    Generators without a ``device`` argument build on the CPU and the move is timed with them.
    """
    device = torch.device(device)

    def build():
        m, _ = build_mask(point.pattern, seq_len, block_size, point.args, point.kwargs, causal, device, seed)
        m = m.to(device)
        m.index(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return m

    mask = build()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        mask = build()
        times.append((time.perf_counter() - t0) * 1000)
    if not mask.equal(point.mask):
        raise RuntimeError(f"pattern {point.pattern}({point.param}) built a different mask on {device} than on the CPU")
    point.mask, point.mask_ms = mask, statistics.median(times)
    return point
