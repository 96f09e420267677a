"""Host launchers for the kernels in kernels.py: tile choice, grids, strides, outputs.

Tiles: the kernels walk the mask's block lists in kernel tiles, so a tile must divide the mask
block (``block_q % BLOCK_M == 0`` for q tiles, ``block_k % BLOCK_N == 0`` for k tiles). The
launcher takes the configured tile and halves it until it divides the mask block; a mask block
that is not a multiple of 16 (the smallest tile `tl.dot` takes) is refused with a clear error.
Dense attention (no mask) has no such constraint.

Configs were chosen by measurement on an H100 (experiments/bench/tune_tiles.py); under the
Triton interpreter small tiles keep CPU tests fast. `tile_config(...)` overrides them (tests use
it to cover several tilings; the tuning script to search). A config also carries the register
cap, the dK/dV orientation (q_rows) and whether its tiles load through TMA descriptors (tma).

Strides: the leading strides of each launch's tensors are passed divided by their common
power-of-two alignment when it is 2, 4 or 8 (`_aligned_strides`), for the kernels to multiply back.

Per-call cost (a short call is bound by host time): what a launch derives from shapes, strides, dtypes and scalars is a
`_Plan` computed once per key; repeat launches of a plan go straight to the compiled kernel's
C launcher (`_launch`, FAST_LAUNCH; see the comment above it for why that is safe).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace

import torch

from sparseflash.flash import kernels

__all__ = ["TileConfig", "tile_config", "fwd", "bwd", "bwd_dq", "bwd_dkdv", "ExactTiles"]


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None  # register cap per thread (more programs per SM), None: the compiler's choice
    # dK/dV only: compute S and dP as [queries, keys] tiles (the forward's orientation) and feed
    # P^T, dS^T to the tensor cores from shared memory, instead of [keys, queries] tiles in registers
    q_rows: bool = False
    # Tensor-memory-accelerator loads (Hopper): the kernel's tiles through tensor descriptors
    # when launch.TMA_MODE is "auto" and the inputs allow it (`_tma_plan`)
    tma: bool = False

    def launch_options(self) -> dict:
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None and not _interpreting():
            opts["maxnreg"] = self.maxnreg
        return opts


_OVERRIDE: dict[str, TileConfig] = {}

# Tests set this to fill every output with NaN before the kernels run, so that an element a
# kernel fails to write cannot pass as a plausible value.
POISON_OUTPUTS = False


def _new(like: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    t = torch.empty_like(like) if shape is None else torch.empty(shape, device=like.device, dtype=dtype)
    return t.fill_(float("nan")) if POISON_OUTPUTS else t


@contextlib.contextmanager
def tile_config(fwd: TileConfig | None = None, dkdv: TileConfig | None = None, dq: TileConfig | None = None):
    """Temporarily use these tiles (each still shrunk to divide the mask block)."""
    saved = dict(_OVERRIDE)
    for name, cfg in (("fwd", fwd), ("dkdv", dkdv), ("dq", dq)):
        if cfg is not None:
            _OVERRIDE[name] = cfg
    try:
        yield
    finally:
        _OVERRIDE.clear()
        _OVERRIDE.update(saved)


# Read once, when kernels.py is imported (as kernels.INTERPRET is, and as Triton decides whether
# its kernels are interpreted): not an environment lookup on every launch.
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreting() -> bool:
    return _INTERPRETING


def _tma_config(kind: str, head_dim: int, k_blocks: int | None) -> TileConfig | None:
    """The tile of a kernel that loads through TMA descriptors, where that measured faster than
    pointer loads at their own best tile; None elsewhere (pointer loads then). H100, triton 3.6,
    bf16, GPU time, `tune_tiles` with SPARSEFLASH_TMA=on and =off, dense and density 0.1 at 4K and
    16K (experiments/studies/tma/results/, 2026-11-23), head_dim 64 and 128 without dropout only.
    Times (ms) TMA vs pointer defaults: 4K dense / 4K sparse / 16K dense / 16K sparse."""
    sparse = k_blocks is not None
    long_rows = sparse and k_blocks >= 64  # rows of ~13 blocks (16K tokens) against ~3 (4K)
    if kind == "fwd":
        if head_dim == 64:
            # dense: TMA's best tile is 4% slower at 4K (0.688 vs 0.660), level at 16K
            return TileConfig(128, 64, 4, 3, tma=True) if sparse else None  # 0.0894/0.0936, 0.311/0.330
        if sparse and not long_rows:
            return TileConfig(64, 64, 4, 3, tma=True)  # 0.158/0.173
        return TileConfig(128, 128, 8, 3, tma=True)  # 1.148/1.187, 4.396/4.551, 0.522/0.557
    if kind == "dq":
        if sparse and not long_rows:  # d=64: level with pointer loads (0.1136/0.1134)
            return TileConfig(128, 32, 4, 3, tma=True) if head_dim == 128 else None  # 0.223/0.231
        # d=64 0.738/0.745, 2.776/2.839, 0.347/0.389; d=128 1.428/1.495, 5.268/5.338, 0.694/0.728
        return TileConfig(128, 64, 8, 3, tma=True)
    if head_dim == 64 and sparse and not long_rows:
        return TileConfig(64, 64, 4, 3, tma=True)  # 0.145/0.159
    # d=64 1.097/1.135, 4.334/4.669, 0.520/0.584; d=128 1.941/1.962, 0.263/0.283, 7.271/7.526, 0.914/0.936
    return TileConfig(64, 64, 4, 2, tma=True)


def _default_config(kind: str, head_dim: int, device: torch.device, k_blocks: int | None = None,
                    dropout: bool = False, tma: bool = False, segments: bool = False) -> TileConfig:
    """The tile of a kernel. ``k_blocks``: the mask's key blocks (None: dense), the proxy for row
    length that needs no look at the mask's contents (longer sequences, longer rows). ``tma``:
    the inputs can be read through TMA descriptors (`_tma_plan`); a config measured faster with
    them then comes from `_tma_config`, else the pointer loads' own best. ``segments``: the
    packed-documents variant (`_segment_config`)."""
    cfg = _default_config_of(kind, head_dim, device, k_blocks, dropout, tma)
    return _segment_config(cfg, kind, head_dim) if segments and device.type == "cuda" and not _interpreting() else cfg


def _segment_config(cfg: TileConfig, kind: str, head_dim: int) -> TileConfig:
    """The segment test (kernels._seg_other) takes the 8-warp d<=64 forward from 128 to 160
    registers in an sm_90 compile (one program per SM instead of two); capped at 128 it compiles
    without spills. Not yet timed on a GPU (tiles are otherwise the block-sparse ones)."""
    if kind == "fwd" and head_dim <= 64 and cfg.num_warps == 8 and cfg.maxnreg is None:
        return replace(cfg, maxnreg=128)
    return cfg


def _default_config_of(kind: str, head_dim: int, device: torch.device, k_blocks: int | None = None,
                       dropout: bool = False, tma: bool = False) -> TileConfig:
    if device.type != "cuda" or _interpreting():
        return TileConfig(32, 32, 4, 1)
    if tma and not dropout and head_dim in (64, 128):
        cfg = _tma_config(kind, head_dim, k_blocks)
        if cfg is not None:
            return cfg
    # H100 (sm90), bf16, pointer loads, measured by experiments/bench/tune_tiles.py in GPU time,
    # dense and at density 0.1, N = 4K and 16K, 16 heads (experiments/results/tune/).
    sparse = k_blocks is not None
    if kind == "fwd":
        if head_dim <= 32 and not dropout:
            # tune/d32/ (d=32; ms 1K / 4K / 16K, default 128x64x8w in brackets): dense 4 warps,
            # 128-key tiles 0.135 / 0.487 / 1.890 (0.152 / 0.562 / 2.177); rows of 1-3 blocks
            # 128x32 0.033 / 0.063 (0.042 / 0.068); rows of 13 (16K) 64x128 0.224 (0.249)
            if not sparse:
                return TileConfig(128, 128, 4, 3)
            return TileConfig(64, 128, 4, 3) if k_blocks >= 64 else TileConfig(128, 32, 4, 3)
        if head_dim <= 64:
            # With dropout, at most 128 registers: two 8-warp programs per SM (the kernel takes
            # 128-130 and the sparse one ran alone; capped, p = 0.1 costs +30-35% instead of
            # +58-62%); without dropout the cap costs 1-2%, so it stays off.
            if head_dim < 64 and _block_d(head_dim) != head_dim and not dropout:
                # head dims padded to 64 (40, 48, 56): 4 warps. At d=40 (16K, sparse path) 8 warps
                # took 28-38% longer (4.0 vs 2.9 ms full mask, 0.45 vs 0.32 at density 0.1); 4 warps
                # is as fast or faster everywhere there. At d=64 4 warps costs 5-8% dense: 8 stay.
                return TileConfig(128, 64, 4, 3)
            return TileConfig(128, 64, 8, 3, maxnreg=128 if dropout else None)
        if head_dim <= 128:
            if not sparse:
                return TileConfig(128, 64, 8, 3)
            # rows of ~13 blocks (16K tokens): 7% faster with 128-key tiles; rows of ~3 (4K): 64 x 64
            return TileConfig(128, 128, 8, 3) if k_blocks >= 64 else TileConfig(64, 64, 4, 3)
        # head_dim 129-256 (tune/d256/, ms at d=256, 4K / 16K): dense 2.45 / 9.51 (64x32x4w: 3.09 /
        # 12.36), density 0.1 0.312 / 0.999 (0.361 / 1.285)
        return TileConfig(128, 64, 8, 2) if sparse else TileConfig(128, 32, 8, 3)
    if kind == "dkdv":  # block_n = k tile held on chip, block_m = q tile streamed
        if head_dim <= 64:
            if head_dim <= 32 and not dropout and sparse and k_blocks >= 64:
                return TileConfig(64, 128, 4, 3)  # d=32, 16K rows of 13 blocks: 0.366 ms (32x128: 0.426)
            # With dropout, [queries, keys] tiles (the bits as the forward draws them, no shuffle):
            # 13-19% faster than the default with dropout, 3-15% slower without it (tune/dropout/).
            # At d=128 the same orientation gains nothing with dropout (within 2%) and costs without.
            return TileConfig(64, 64, 4, 3, q_rows=True) if dropout else TileConfig(32, 128, 4, 3)
        if head_dim <= 128:
            return TileConfig(64, 128, 8, 3)
        # d=256: dense 7.44 / 29.5 ms, density 0.1 0.91 / 3.40 (32x64x8w, which spilled: 9.64 / 40.9, 1.09 / 4.32)
        return TileConfig(64, 32, 4, 2)
    # dq: block_m = q tile held, block_n = k tile streamed
    if head_dim <= 64:
        if dropout:  # 128 registers (two programs per SM): 8% faster dense, 24% sparse (4K) than uncapped
            return TileConfig(128, 64, 8, 3, maxnreg=128)
        return TileConfig(64, 64, 4, 3) if sparse else TileConfig(128, 64, 8, 3)
    if head_dim <= 128:
        return TileConfig(128, 64, 8, 3)
    # d=256: dense 2.90 / 11.1 ms, density 0.1 0.48 / 1.47 (64x32x8w: 8.47 / 37.3, 1.01 / 3.98)
    return TileConfig(128, 32, 8, 3)


def _fit(tile: int, mask_block: int | None, what: str) -> int:
    if mask_block is None:
        return tile
    if mask_block % 16:
        raise ValueError(
            f"the Triton kernels need mask block sizes that are multiples of 16 (the smallest kernel tile), "
            f"got {what}={mask_block}; build the mask with block_size a multiple of 16"
        )
    while mask_block % tile:
        tile //= 2
    return tile


# fp32 past head_dim 128: the 16-bit tiles of before 2026-11-24 halved twice (the current 16-bit
# ones do not fit in fp32: dQ would need 303 KB of shared memory). Not re-tuned.
_FP32_WIDE = {"fwd": TileConfig(64, 16, 4, 2), "dkdv": TileConfig(16, 64, 8, 2), "dq": TileConfig(64, 16, 8, 2)}


def _fp32_config(cfg: TileConfig, kind: str, head_dim: int) -> TileConfig:
    """fp32 tiles take twice the shared memory of bf16: halve the streamed tile, at most 2 stages
    (past head_dim 128, `_FP32_WIDE`)."""
    if head_dim > 128:
        return _FP32_WIDE[kind]
    bm, bn = cfg.block_m, cfg.block_n
    if kind == "dkdv":
        bm = max(16, bm // 2)
    else:
        bn = max(16, bn // 2)
    return replace(cfg, block_m=bm, block_n=bn, num_stages=min(cfg.num_stages, 2))


def _config(kind: str, head_dim: int, device, mask_bq: int | None, mask_bk: int | None,
            dtype: torch.dtype = torch.bfloat16, k_blocks: int | None = None, dropout: bool = False,
            tma: bool = False, segments: bool = False) -> TileConfig:
    cfg = _OVERRIDE.get(kind)
    if cfg is None:  # the defaults depend only on these values: computed once per combination
        return _default_fitted(kind, head_dim, device.type, mask_bq, mask_bk, dtype, k_blocks, dropout, tma,
                               _interpreting(), segments)
    return _fitted(cfg, mask_bq, mask_bk)


@functools.lru_cache(maxsize=1024)
def _default_fitted(kind, head_dim, device_type, mask_bq, mask_bk, dtype, k_blocks, dropout, tma,
                    interpreting, segments=False) -> TileConfig:
    cfg = _default_config(kind, head_dim, torch.device(device_type), k_blocks, dropout, tma, segments)
    if dtype == torch.float32 and device_type == "cuda" and not interpreting:
        cfg = _fp32_config(cfg, kind, head_dim)
    return _fitted(cfg, mask_bq, mask_bk)


def _fitted(cfg: TileConfig, mask_bq: int | None, mask_bk: int | None) -> TileConfig:
    bm = _fit(cfg.block_m, mask_bq, "block_q")
    bn = _fit(cfg.block_n, mask_bk, "block_k")
    if (bm, bn) == (cfg.block_m, cfg.block_n):
        return cfg  # the common case, without dataclasses.replace's cost on every launch
    return replace(cfg, block_m=bm, block_n=bn)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: dots as torch.matmul makes them, full precision by default and tf32 when
    # torch.set_float32_matmul_precision is "high" or "medium" (the interpreter always multiplies
    # fp32 exactly). 16-bit inputs: tensor-core dots; the interpreter multiplies them in fp32 (what
    # tensor cores do; its own bf16 dot is wrong).
    if dtype == torch.float32:
        if _interpreting() or torch.get_float32_matmul_precision() == "highest":
            return "ieee"
        return "tf32"
    return "upcast" if _interpreting() else "tf32"


# Plain integer helpers: triton.cdiv / next_power_of_2 are ConstexprFunction objects in newer
# Triton, whose call costs microseconds on every launch.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _p2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _block_d(head_dim: int) -> int:
    return max(16, _p2(head_dim))


def _nb_p2(n: int) -> int:
    return max(2, _p2(n))


def _aligned_strides(*ts: torch.Tensor) -> tuple[tuple, int]:
    """The strides of 4-D tensors ``ts`` as kernel arguments, and the ALIGN constexpr: the largest
    power of two dividing every stride but the last of each tensor, when each has a unit last
    stride and that power is 2, 4 or 8 (else 1), with the leading strides then divided by it for
    the kernels to multiply back (kernels._aligned). The compiler then knows where rows start:
    Triton's own specialisation only recognises strides divisible by 16, and a head_dim of 40 (row
    stride 40) would otherwise get element-wise loads, no async copies and spills (sm_90 compile:
    dQ 255 registers and 551 instructions per step instead of 155 and 285). Strides divisible by
    16 need no help (ALIGN 1: the same kernel as without it), nor can strides of 2**31 or more
    have it: divided, one could pass as int32 and wrap when multiplied back."""
    return _align_plan(tuple(t.stride() for t in ts))


@functools.lru_cache(maxsize=1024)
def _align_plan(all_strides: tuple[tuple[int, ...], ...]) -> tuple[tuple, int]:
    """`_aligned_strides` on the tensors' stride tuples (cached: a model calls with few layouts)."""
    strides = ()
    lead = 0  # OR of the leading strides: its lowest set bit is their common power-of-two alignment
    for st in all_strides:
        sb, sh, sm, sd = st
        if sd != 1:
            return tuple(x for st in all_strides for x in st), 1
        lead |= sb | sh | sm
        strides += st
    align = lead & -lead
    if not lead & 15 or align == 1 or max(strides) >= 2**31:
        return strides, 1
    return tuple(x if i % 4 == 3 else x // align for i, x in enumerate(strides)), align


# Lists up to this many entries are read from registers in the loop (GATHER), longer ones from
# memory; see kernels._tile_start. SPARSEFLASH_GATHER_MAX overrides it (for measurement).
GATHER_MAX = int(os.environ.get("SPARSEFLASH_GATHER_MAX", "512"))


def _gather(nb_p2: int) -> bool:
    return nb_p2 <= GATHER_MAX


# Pointer arguments a kernel variant never reads (no lists when dense, no key_lengths, no
# dropout) get an input tensor of the call as a placeholder. Never a cached tensor allocated on
# first use: under torch.compile's CUDA graphs that first use can fall inside the graph's memory
# pool, which then holds a live allocation it does not track and refuses to run.
def _list_args(idx, B, H, placeholder: torch.Tensor):
    """(lists, their strides, NB_P2) for a kernel; the lists' [B', H', ...] read as [B, H, ...]
    (stride 0 where the mask is shared). Dense attention (idx None) passes the placeholder."""
    if idx is None:
        return placeholder, (0, 0, 0), 1
    (ib, ih, _, nb), (sb, sh, sr, _) = idx.shape, idx.stride()
    if ib not in (1, B) or ih not in (1, H):
        raise ValueError(f"block lists of shape {tuple(idx.shape)} do not broadcast to batch {B}, heads {H}")
    return idx, (0 if ib == 1 else sb, 0 if ih == 1 else sh, sr), _nb_p2(nb)


def _rng_args(dropout_p: float, rng: torch.Tensor | None, placeholder: torch.Tensor):
    """Kernel arguments of dropout: the (seed_lo, seed_hi, offset) tensor, threshold, scale."""
    if dropout_p <= 0.0:
        return placeholder, 0, 1.0
    return _checked_rng(rng, placeholder.device), *_drop_consts(dropout_p)


def _checked_rng(rng, device) -> torch.Tensor:
    if not (isinstance(rng, torch.Tensor) and rng.dtype == torch.int64 and rng.shape == (3,) and rng.device == device):
        got = f"{rng.dtype} {tuple(rng.shape)} on {rng.device}" if isinstance(rng, torch.Tensor) else type(rng).__name__
        raise ValueError(f"rng must be an int64 tensor [3] (seed_lo, seed_hi, offset) on {device} when dropout_p > 0, "
                         f"got {got} (sparseflash.dropout.draw_rng makes one)")
    return rng


def _drop_consts(dropout_p: float) -> tuple[int, float]:
    """(threshold on 8 random bits, scale of kept values); (0, 1.0) without dropout."""
    if dropout_p <= 0.0:
        return 0, 1.0
    from sparseflash.dropout import effective_p, threshold

    # Scale by the probability the 8-bit threshold really applies; p = 1 keeps nothing and
    # scales by 0 (not 1/0).
    p = effective_p(dropout_p)
    return threshold(dropout_p), (1.0 / (1.0 - p) if p < 1.0 else 0.0)


# Tile loads through TMA tensor descriptors (Hopper's bulk copies). "auto": on sm_90+ GPUs, for
# inputs that allow it and calls large enough to hide the descriptors' host cost (`_tma_plan`,
# `_tma_auto`), with the tiles measured fastest that way (`_tma_config`; TileConfig.tma) where
# TMA won, pointer loads elsewhere. "on": TMA wherever the inputs allow
# it, whatever the tile, the Triton interpreter included (tests cover the path on CPU with it;
# tune_tiles times every config both ways with it). "off": never. SPARSEFLASH_TMA sets the
# starting value.
TMA_MODE = os.environ.get("SPARSEFLASH_TMA", "auto")
_TMA_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _sm_major(index: int | None) -> int:
    """The compute capability's major number of a CUDA device (asked once per device)."""
    return torch.cuda.get_device_capability(index)[0]


def _tma_strides(t: torch.Tensor):
    """The strides of a [B, H, N, D] tensor as a TMA descriptor takes them, or None when it cannot
    be one. Needs a unit last stride, a 16-byte aligned base and strides, and a row-major layout:
    each dimension of more than one element at least as far apart as the whole of the next one
    (packed, padded or sliced; never expanded or transposed). Size-1 dimensions get strides TMA
    accepts (their coordinate is always 0)."""
    return _tma_layout(tuple(t.shape), t.stride(), t.element_size(), t.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=1024)
def _tma_layout(shape: tuple, stride: tuple, esz: int, aligned: bool):
    """`_tma_strides` on a tensor's layout (cached: a model calls with few layouts)."""
    B, H, N, D = shape
    sb, sh, sn, sd = stride
    if sd != 1 or not aligned:
        return None
    sn = sn if N > 1 else D + (-D) % (16 // esz)
    sh = sh if H > 1 else N * sn
    sb = sb if B > 1 else H * sh
    ok = all((x * esz) % 16 == 0 for x in (sb, sh, sn)) and sn >= D and sh >= N * sn and sb >= H * sh
    return [sb, sh, sn, 1] if ok else None


# Below this many estimated forward FLOPs an eager call keeps pointer loads in "auto": triton 3.6
# builds and encodes every descriptor on the host at each launch (12 per fwd+bwd), which makes small
# eager calls host-bound and slower. H100, 2026-11-23 (experiments/studies/host_cost/results/tma/):
# 4K d=64 density 0.094 (2.6e10 FLOPs) fwd+bwd host time 0.93-1.14 -> 1.22-1.32 ms with
# descriptors against 0.46 ms of GPU time; 4K d=128 density 0.094 (5.2e10) 1.00-1.07 -> 1.05-1.53
# ms against 0.87 -> 0.82 ms of GPU time, so eager calls there gain nothing either. Calls from about
# 1e11 on have fwd+bwd GPU time beyond the host time, where the 4-9% of GPU time counts.
# Inside CUDA-graph capture the host cost is paid once, at capture, so "auto" takes descriptors
# there whatever the size: a captured call may run a kernel its eager warm-up did not, which is
# loaded during the capture (measured to work on the H100: torch 2.11, triton 3.6, lazy and eager
# module loading; test_gpu_graph_capture_after_eager_warmup).
TMA_MIN_WORK = 1e11


def _tma_auto(device: torch.device, work: float, capturing: bool = False) -> bool:
    """TMA_MODE "auto"'s rule: a CUDA device of compute capability 9 or more, and a call of at
    least TMA_MIN_WORK estimated forward FLOPs (``work``; -1: unknown, taken as large) or one being
    captured in a CUDA graph."""
    if device.type != "cuda" or _interpreting() or _sm_major(device.index) < 9:
        return False
    return capturing or not 0 <= work < TMA_MIN_WORK


def _in_graph_capture(t: torch.Tensor) -> bool:
    """Whether a launch on ``t``'s device is being captured in a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _tma_plan(block_d: int, *ts: torch.Tensor, work: float = -1.0):
    """The descriptor strides of every tensor of a launch when its tiles can load through TMA, or
    None: TMA_MODE allows it ("on", or "auto" and `_tma_auto`), the dtype is 16-bit, head_dim <=
    128 (the measured range) and each tensor passes `_tma_strides`."""
    if not _tma_wanted(ts[0], block_d, work):
        return None
    strides = [_tma_strides(t) for t in ts]
    return None if None in strides else strides


def _tma_wanted(t0: torch.Tensor, block_d: int, work: float) -> bool:
    """TMA_MODE's rule for a launch on ``t0``'s device and dtype, whatever the layouts: "on", or
    "auto" and `_tma_auto`; never for other dtypes or head_dim > 128. The Hopper forward's
    descriptors follow the same rule (`_hopper_layouts`)."""
    if TMA_MODE not in ("auto", "on", "off"):
        raise ValueError(f"launch.TMA_MODE (SPARSEFLASH_TMA) must be 'auto', 'on' or 'off', got {TMA_MODE!r}")
    if TMA_MODE == "off" or t0.dtype not in _TMA_DTYPES or block_d > 128:
        return False
    return TMA_MODE == "on" or _tma_auto(t0.device, work, _in_graph_capture(t0))


def _tma_args(cfg: TileConfig, plan, block_d: int, *tiles):
    """Kernel arguments for the tensors of ``tiles``, (tensor, rows per tile) pairs, and the TMA
    flag: 4-D descriptors (blocks [1, 1, rows, block_d]; rows past each head's end and columns past
    head_dim read as zeros) when there is a `_tma_plan` and the tile takes TMA (TileConfig.tma, or
    any tile with TMA_MODE "on"); otherwise the tensors themselves as placeholders and False."""
    if _tma_taken(cfg, plan):
        from triton.tools.tensor_descriptor import TensorDescriptor

        return tuple(TensorDescriptor(t, list(t.shape), st, [1, 1, rows, block_d])
                     for (t, rows), st in zip(tiles, plan)), True
    return tuple(t for t, _ in tiles), False


def _tma_taken(cfg: TileConfig, plan) -> bool:
    """Whether a launch of tile ``cfg`` with `_tma_plan` ``plan`` loads through descriptors."""
    return plan is not None and (cfg.tma or TMA_MODE == "on")


class KeyRanges(tuple):
    """The ``seg`` of a call with key ranges instead of segment ids: ``(table, table)``, the int32
    table [1 or B, 2, Nq] (contiguous) of each query's key range [start, end) (the kernels'
    KEY_RANGES; it takes the slot of the query segment ids)."""


class ExactTiles(tuple):
    """The bits of a call whose mask applies a token-level definition inside its partial blocks:
    ``(bits, kv_tile, q_tile)``, `sparseflash.mask.ExactBits`'s words [P, block_q, ceil(block_k /
    32)] and its int32 tables laid out exactly as the call's row lists (kv_idx) and column lists
    (q_idx) (the kernels' EXACT). Calls with them take the portable kernels."""


def _exact_slots(exact) -> tuple:
    """The plan's argument entries of the tile table and bit slots: tensors of the call (`_T`) with
    bits, else None (a constexpr to Triton: the default kernels keep their signature and code)."""
    return (None, None) if exact is None else (_T, _T)


def _exact_flag(exact) -> dict:
    """The EXACT constexpr, passed only when on (other plans keep their kwargs)."""
    return {} if exact is None else dict(EXACT=True)


def _check_exact(exact, idx, what: str):
    """The (table, bits) of a launch: the table must be laid out as the list it follows."""
    bits, table = exact[0], exact[1] if what == "kv_idx" else exact[2]
    if idx is None or table.shape != idx.shape or table.stride() != idx.stride() or table.dtype != torch.int32 \
            or bits.dtype != torch.int32 or not bits.is_contiguous():
        raise ValueError(f"exact tiles must come with block lists: an int32 table shaped and strided as {what} "
                         f"{None if idx is None else tuple(idx.shape)}, got {tuple(table.shape)} {table.dtype}")
    return table, bits


class Alibi(tuple):
    """The ``seg`` of a call with ALiBi slopes: ``(table, slopes)``. ``slopes``: float32 [1 or B,
    Hq], contiguous (the kernels' SEG_K slot); ``table`` (the SEG_Q slot): None, a `KeyRanges`
    table (``inner`` "ranges"), or the segment ids packed as one int32 table [1 or B, Nq + Nk],
    query ids then key ids (``inner`` "segments"). Made by `with_alibi`."""

    def __new__(cls, table, slopes, inner):
        self = super().__new__(cls, (table, slopes))
        self.inner = inner
        return self


def with_alibi(seg, slopes: torch.Tensor | None):
    """The ``seg`` of a call (None, segment ids (seg_q, seg_k), or a `KeyRanges`) with ALiBi
    ``slopes`` ([1 or B, Hq]) added: an `Alibi` (``seg`` itself when ``slopes`` is None)."""
    if slopes is None:
        return seg
    slopes = slopes.to(torch.float32).contiguous()
    if seg is None:
        return Alibi(None, slopes, None)
    if isinstance(seg, KeyRanges):
        return Alibi(seg[0], slopes, "ranges")
    sq, sk = seg
    b = max(sq.shape[0], sk.shape[0])
    return Alibi(torch.cat([sq.expand(b, -1), sk.expand(b, -1)], dim=1), slopes, "segments")


def _seg_pair(seg, placeholder: torch.Tensor) -> tuple:
    """The tensors of the SEG_Q and SEG_K slots (the placeholder where a variant reads none)."""
    if seg is None:
        return placeholder, placeholder
    sq, sk = seg
    return placeholder if sq is None else sq, sk


def _seg_args(seg, placeholder: torch.Tensor):
    """Kernel arguments of segment ids: (SEG_Q, SEG_K, their batch strides) and the constexpr
    flags (SEGMENTS, and KEY_RANGES=True / ALIBI=True only when on, so other plans keep their
    kwargs). ``seg``: None, int32 (seg_q [1 or B, Nq], seg_k [1 or B, Nk]) with unit last stride,
    a `KeyRanges`, or an `Alibi`."""
    if seg is None:
        return (placeholder, placeholder, 0, 0), dict(SEGMENTS=False)
    sq, sk = seg
    if isinstance(seg, Alibi):
        flags = dict(SEGMENTS=seg.inner == "segments", ALIBI=True)
        if seg.inner == "ranges":
            flags["KEY_RANGES"] = True
        sq = placeholder if sq is None else sq
        return (sq, sk, sq.stride(0) if sq.shape[0] > 1 else 0, sk.stride(0) if sk.shape[0] > 1 else 0), flags
    if isinstance(seg, KeyRanges):
        return (sq, sq, sq.stride(0) if sq.shape[0] > 1 else 0, 0), dict(SEGMENTS=False, KEY_RANGES=True)
    return (sq, sk, sq.stride(0) if sq.shape[0] > 1 else 0, sk.stride(0) if sk.shape[0] > 1 else 0), dict(SEGMENTS=True)


# ----------------------------------------------------------------------------- launch plans
# Everything a launch derives from its inputs' shapes, strides and dtypes and from the call's
# scalars (tile config, grid, the strides and their alignment, the lists' strides, the dropout
# constants, the constexprs) is computed once per combination (the key) and kept as a _Plan; a
# call then allocates its outputs, puts its tensors into the plan's argument list and launches
# (`_launch`). The key also holds the module state the plans read (tile overrides, TMA_MODE,
# GATHER_MAX, interpreter, dot precision), so changing any of it makes new plans.

_T = object()  # marks where a tensor of the call goes in a plan's argument list
_PLANS: dict = {}
_PLANS_MAX = 1024


class _Plan:
    """One kernel's launch for one key: ``args`` its positional arguments with `_T` where the
    call's tensors go (positions ``slots``, in the order the launcher passes them), ``kwargs`` the
    constexprs and compile options, ``tma`` whether the tensors' last slots take TMA descriptors
    (built per call). ``bound``: `_launch`'s bound launches of this plan."""

    __slots__ = ("kernel", "grid", "args", "slots", "kwargs", "cfg", "tma", "cuda", "bound")

    def __init__(self, kernel: str, grid, args, kwargs, cfg, tma: bool, device: torch.device):
        # the kernel by name in kernels.py, looked up at each launch (tools may swap it)
        self.kernel, self.grid, self.kwargs, self.cfg, self.tma = kernel, grid, kwargs, cfg, tma
        self.args = tuple(args)
        self.slots = tuple(i for i, a in enumerate(self.args) if a is _T)
        self.cuda = device.type == "cuda"
        self.bound = {}


def plan_state() -> tuple:
    """The module state a plan depends on beyond its inputs (part of every plan key)."""
    return _INTERPRETING, TMA_MODE, GATHER_MAX, tuple(_OVERRIDE.items()) if _OVERRIDE else ()


def _plan(key, build, *args):
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()  # a model calls with few layouts; this bounds a sweep over many
        plan = _PLANS[key] = build(*args)
    return plan


def _layout(t: torch.Tensor | None):
    """The part of a tensor's layout a plan reads: None, or (shape, strides)."""
    return None if t is None else (t.shape, t.stride())


def _seg_layout(seg):
    return None if seg is None else (_layout(seg[0]), _layout(seg[1]), type(seg).__name__, getattr(seg, "inner", None))


def _frozen(tma_plan):
    return None if tma_plan is None else tuple(map(tuple, tma_plan))


# Bound launches: after a plan's first launch through Triton (`kernel[grid](...)`, which
# specialises, compiles or finds the compiled kernel, and launches), `_launch` keeps the
# CompiledKernel Triton returned and launches later calls of the plan with its C launcher
# directly: ``compiled.run(grid, stream, function, packed_metadata, launch_metadata=None,
# enter_hook=None, exit_hook=None, *every parameter's value)``, the call JITFunction.run itself
# ends with (the same in triton 3.6 and 3.9). That skips Triton's per-launch binding of ~45
# arguments, its cache key, its option parsing, its launch metadata and the launcher's
# data_ptr() call and pointer-attribute query per tensor (tensors go as their addresses).
#
# Safe because everything Triton specialises a compiled kernel on is in the bound launch's key:
# the plan key fixes every scalar argument (so whether each int is 1, divisible by 16, int32 or
# int64), the constexprs and the options; per call the key adds the current device, each tensor's
# dtype and whether its address is 16-byte aligned. Anything else takes Triton's own path:
# the interpreter, plans with TMA descriptors, active launch hooks (profilers such as proton),
# pre-run hooks, TRITON_DEBUG, and a first launch whose result does not look like a
# CompiledKernel. FAST_LAUNCH = False (SPARSEFLASH_FAST_LAUNCH=0) turns it off, for A/B timing
# or to let tools that hook JITFunction.run see every launch.
FAST_LAUNCH = os.environ.get("SPARSEFLASH_FAST_LAUNCH", "1") not in ("", "0")


_KNOBS = None


def _runtime_knobs():
    """triton.knobs.runtime (triton 3.4+), or None: no bound launches without it."""
    global _KNOBS
    if _KNOBS is None:
        try:
            from triton import knobs

            _KNOBS = knobs.runtime
        except (ImportError, AttributeError):
            _KNOBS = False
    return _KNOBS or None


def hooks_idle() -> bool:
    """Triton has its launch knobs and no launch hook is set (triton 3.6+ keeps them in
    HookChains, empty by default; a profiler such as proton adds to them)."""
    rt = _runtime_knobs()
    if rt is None:
        return False
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def _current_device() -> int:
    return torch.cuda.current_device()  # the device Triton launches on (its driver asks the same)


try:  # what Triton's own CUDA driver asks for the current stream
    from torch._C import _cuda_getCurrentRawStream as raw_stream
except ImportError:  # pragma: no cover
    def raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def _bind(plan: _Plan, kernel, compiled, args: list) -> tuple | None:
    """The bound launch of ``plan`` from its first launch: (run, function, packed_metadata, every
    parameter's value with None where a tensor's address goes, the compiled kernel), or None when
    it cannot be bound."""
    if getattr(kernel, "pre_run_hooks", None) or _runtime_knobs().debug:
        return None
    run, function, meta = getattr(compiled, "run", None), getattr(compiled, "function", None), \
        getattr(compiled, "packed_metadata", None)
    if run is None or function is None or meta is None:
        return None
    import inspect

    params = list(inspect.signature(kernel.fn).parameters.values())
    if len(args) > len(params):
        return None
    values = list(args)
    for p in params[len(args):]:
        if p.name in plan.kwargs:
            values.append(plan.kwargs[p.name])
        elif p.default is not inspect.Parameter.empty:
            values.append(p.default)
        else:
            return None
    for i in plan.slots:
        values[i] = None
    return run, function, meta, tuple(values), compiled


def _launch(plan: _Plan, tensors) -> tuple | None:
    """Launch ``plan`` with ``tensors`` in its slots: bound (see FAST_LAUNCH) or through Triton.
    Returns (key, bound launch) of this combination when it has one (`_Quick` keeps it)."""
    fast = FAST_LAUNCH and plan.cuda and not plan.tma and not _INTERPRETING
    if fast:
        ptrs = [t.data_ptr() for t in tensors]
        key = (_current_device(), tuple(p & 15 == 0 for p in ptrs), tuple(t.dtype for t in tensors))
        bound = plan.bound.get(key)
        if bound is not None and hooks_idle():
            run, function, meta, values = bound[:4]
            values = list(values)
            for i, p in zip(plan.slots, ptrs):
                values[i] = p
            g = plan.grid
            run(g[0], g[1], 1, raw_stream(key[0]), function, meta, None, None, None, *values)
            return key, bound
    args = list(plan.args)
    for i, t in zip(plan.slots, tensors):
        args[i] = t
    kernel = getattr(kernels, plan.kernel)
    compiled = kernel[plan.grid](*args, **plan.kwargs)
    if fast and hooks_idle():
        try:
            bound = _bind(plan, kernel, compiled, args)
        except Exception:  # an unexpected Triton: keep its own launch path
            bound = None
        if bound is not None:
            plan.bound[key] = bound
            return key, bound
    return None


def fwd(q, k, v, kv_idx, key_lengths, scale: float, causal: bool, mask_bq: int | None, mask_bk: int | None,
        dropout_p: float, rng: torch.Tensor | None, *, work: float = -1.0, seg=None, softcap: float = 0.0,
        exact: ExactTiles | None = None):
    """Forward launch. Returns (o like q, lse float32 [B, Hq, Nq] with +inf for empty rows).
    ``rng``: the `sparseflash.dropout.draw_rng` tensor, read when dropout_p > 0. ``work``: the
    call's estimated forward FLOPs, -1 unknown (`_tma_plan`). ``seg``: int32 segment ids
    (seg_q, seg_k), a `KeyRanges`, an `Alibi` (`with_alibi`), or None (`_seg_args`). ``softcap``:
    > 0 soft-caps the scores (the kernels' SOFTCAP). ``exact``: an `ExactTiles` (the kernels'
    EXACT). Calls with any of these take the portable kernels (the Hopper ones have none of them):
    this test, and `bwd`'s, is where that is decided."""
    B, Hq, Nq, D = q.shape
    if dropout_p <= 0.0 and seg is None and not softcap and exact is None and scale > 0.0:
        lay = _hopper_layouts(q, k, v, mask_bq, mask_bk, work)
        if lay is not None:
            return hopper_fwd(q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, lay=lay)
    tma_plan = _tma_plan(_block_d(D), q, k, v, work=work)
    o = _new(q)
    lse = _new(q, (B, Hq, Nq), torch.float32)
    key = _fwd_key(q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, seg, tma_plan, softcap,
                   exact is not None)
    plan = _plan(key, _fwd_plan, q, k, v, o, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p,
                 tma_plan, seg, softcap, exact)
    rng = None if dropout_p <= 0.0 else _checked_rng(rng, q.device)
    bm, bn = plan.cfg.block_m, plan.cfg.block_n
    descs = _tma_args(plan.cfg, tma_plan, _block_d(D), (q, bm), (k, bn), (v, bn))[0]  # (q, k, v) without TMA
    ex = None if exact is None else _check_exact(exact, kv_idx, "kv_idx")
    _launch(plan, _fwd_tensors(q, k, v, o, lse, kv_idx, key_lengths, seg, rng, descs, ex))
    return o, lse


def hopper_fwd(q, k, v, kv_idx, key_lengths, scale: float, causal: bool, mask_bq, mask_bk, *, lay=None,
               num_sms=None):
    """The Hopper forward (`hopper.fwd`) with its outputs and list arguments made here. ``lay``:
    `hopper.layouts` of (q, k, v), if known."""
    from sparseflash.flash import hopper

    B, Hq, Nq, _ = q.shape
    lists = None
    if kv_idx is not None:
        lists = (*_list_args(kv_idx, B, Hq, q), kv_idx.shape[-1])
    return hopper.fwd(q, k, v, _new(q), _new(q, (B, Hq, Nq), torch.float32), lists, key_lengths, scale, causal,
                      mask_bq, mask_bk, lay or hopper.layouts(q, k, v), num_sms=num_sms)


def hopper_bwd(do, q, k, v, o, lse, dlse, q_idx, key_lengths, scale: float, causal: bool, mask_bq, mask_bk, *,
               lays=None, num_sms=None):
    """The Hopper backward (`hopper_bwd.bwd`) with its list arguments made here. ``lays``: (the
    `hopper.layouts` of (q, k, v), `hopper_bwd.do_layout` of dO), if known."""
    from sparseflash.flash import hopper, hopper_bwd as hb

    B, Hq = q.shape[:2]
    lists = None
    if q_idx is not None:
        lists = (*_list_args(q_idx, B, Hq, q), q_idx.shape[-1])
    lay, do_lay = lays or (hopper.layouts(q, k, v), hb.do_layout(do))
    return hb.bwd(do, q, k, v, o, lse, dlse, lists, key_lengths, scale, causal, mask_bq, mask_bk, lay, do_lay, new=_new,
                  num_sms=num_sms)


def _hopper_bwd_layouts(do, q, k, v, o, mask_bq, mask_bk, work: float, lists: bool = False):
    """(q, k, v layouts, dO layout) when the backward runs the Hopper kernel, else None: where the
    forward would (`_hopper_layouts`) and `hopper_bwd.plan` takes dO, O and the walk (``lists``:
    block lists, whose mean length per key tile comes from the work estimate)."""
    lay = _hopper_layouts(q, k, v, mask_bq, mask_bk, work)
    if lay is None:
        return None
    from sparseflash.flash import hopper, hopper_bwd

    cols = None
    if lists:  # 128-row q blocks per key tile's walk: work = 4 B H Nq Nk D x density (-1: unknown)
        B, H, _, D = q.shape
        cols = work / (4.0 * B * H * k.shape[2] * D * hopper.TILE) if work > 0 else -1.0
    return hopper_bwd.plan(do, q, o, lay, cols)


def _hopper_layouts(q, k, v, mask_bq, mask_bk, work: float):
    """The descriptor layouts (`hopper.layouts`) when the forward runs the warp-specialised Hopper
    kernel, else None: on sm_90, for the calls TMA_MODE gives descriptors (`_tma_wanted`: large or
    captured calls in "auto"), then as `hopper.plan` decides. Imported only here, so CPU runs never
    import gluon."""
    if q.device.type != "cuda" or _interpreting() or _sm_major(q.device.index) != 9:
        return None
    if not _tma_wanted(q, _block_d(q.shape[-1]), work):
        return None
    from sparseflash.flash import hopper

    return hopper.plan(q, k, v, mask_bq=mask_bq, mask_bk=mask_bk)


def _fwd_key(q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, seg, tma_plan,
             softcap=0.0, exact: bool = False) -> tuple:
    return ("fwd", q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, _layout(kv_idx),
            None if key_lengths is None else key_lengths.dtype, _seg_layout(seg), scale, causal, mask_bq, mask_bk,
            dropout_p, _frozen(tma_plan), _dot_precision(q.dtype), plan_state(), softcap, exact)


# The tensors of each kernel's launch in the order its plan's slots take them. Placeholders for
# arguments a variant never reads are q (or the lists). Also called with role markers instead of
# the per-call tensors (`quick_fwd`, `quick_bwd`), so the order is written once.
# ``ex``: the (tile table, bits) pair of an exact call (`_check_exact`), in the slots after the list.
def _fwd_tensors(q, k, v, o, lse, kv_idx, key_lengths, seg, rng, descs, ex=None) -> tuple:
    idx = q if kv_idx is None else kv_idx
    sq, sk = _seg_pair(seg, q)
    return (q, k, v, o, lse, idx, *(ex or ()), idx if key_lengths is None else key_lengths, sq, sk,
            q if rng is None else rng, *descs)


def _dq_tensors(q, k, v, o, do, lse, dlse, delta, dq, kv_idx, key_lengths, seg, rng, descs, ex=None) -> tuple:
    return (q, k, v, o, do, lse, lse if dlse is None else dlse, delta, dq, q if kv_idx is None else kv_idx,
            *(ex or ()), *_bwd_tensors(q, key_lengths, rng, seg), *descs)


def _dkdv_tensors(q, k, v, do, lse, delta, dk, dv, q_idx, key_lengths, seg, rng, descs, ex=None) -> tuple:
    return (q, k, v, do, lse, delta, dk, dv, q if q_idx is None else q_idx, *(ex or ()),
            *_bwd_tensors(q, key_lengths, rng, seg), *descs)


def _softcap_flag(softcap: float) -> dict:
    """The SOFTCAP constexpr, passed only when on (other plans keep their kwargs)."""
    return dict(SOFTCAP=float(softcap)) if softcap else {}


def _fwd_plan(q, k, v, o, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan, seg, softcap=0.0,
              exact=None):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    cfg = _config("fwd", D, q.device, mask_bq, mask_bk, q.dtype, None if kv_idx is None else kv_idx.shape[-1],
                  dropout_p > 0.0, tma_plan is not None, seg is not None)
    _, i_strides, nb_p2 = _list_args(kv_idx, B, Hq, q)
    thresh, drop_scale = _drop_consts(dropout_p)
    (_, _, *seg_strides), seg_flags = _seg_args(seg, q)
    strides, align = _aligned_strides(q, k, v, o)
    tma = _tma_taken(cfg, tma_plan)
    args = (_T,) * 6 + _exact_slots(exact) + (_T,) * 3 + (*seg_strides, *strides, *i_strides, Hq, Hq // Hkv, Nq, Nk,
                                                          scale * 1.4426950408889634, _T, thresh, drop_scale, _T, _T, _T)
    kwargs = dict(HEAD_DIM=D, BLOCK_D=_block_d(D), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  MASK_BQ=mask_bq or cfg.block_m, MASK_BK=mask_bk or cfg.block_n, NB_P2=nb_p2, GATHER=_gather(nb_p2),
                  DENSE=kv_idx is None, CAUSAL=causal, HAS_KEYLEN=key_lengths is not None, DROPOUT=dropout_p > 0.0,
                  DOT_PREC=_dot_precision(q.dtype), **cfg.launch_options(), ALIGN=align, TMA=tma, **seg_flags,
                  **_softcap_flag(softcap), **_exact_flag(exact))
    return _Plan("_fwd_kernel", (_cdiv(Nq, cfg.block_m), B * Hq), args, kwargs, cfg, tma, q.device)


def bwd(do, q, k, v, o, lse, dlse, kv_idx, q_idx, key_lengths, scale: float, causal: bool,
        mask_bq: int | None, mask_bk: int | None, dropout_p: float, rng: torch.Tensor | None, *, work: float = -1.0,
        seg=None, softcap: float = 0.0, exact: ExactTiles | None = None):
    """Backward launches: dQ (which also computes delta), then dK/dV. Returns (dq, dk, dv). The
    sm_90 calls the Hopper forward takes (`_hopper_layouts`) whose dO TMA can read run the one-pass
    Hopper backward instead (`hopper_bwd`; its MODE "auto" leaves block-sparse calls with short
    column lists here, `hopper_bwd.LIST_MIN_BLOCKS`). ``seg``, ``softcap``, ``exact``: as `fwd`'s."""
    if dropout_p <= 0.0 and seg is None and not softcap and exact is None and scale > 0.0:
        lays = _hopper_bwd_layouts(do, q, k, v, o, mask_bq, mask_bk, work, q_idx is not None)
        if lays is not None:
            return hopper_bwd(do, q, k, v, o, lse, dlse, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, lays=lays)
    delta = _new(lse)
    args = (do, q, k, v, lse, delta, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, rng)
    dq = bwd_dq(*args, kv_idx, o=o, dlse=dlse, work=work, seg=seg, softcap=softcap, exact=exact)
    dk, dv = bwd_dkdv(*args, q_idx, work=work, seg=seg, softcap=softcap, exact=exact)
    return dq, dk, dv


def _bwd_tensors(q, key_lengths, rng, seg) -> tuple:
    """The per-call tensors both backward kernels take after their lists: KEY_LEN, SEG_Q, SEG_K, RNG
    (``rng`` None without dropout)."""
    sq, sk = _seg_pair(seg, q)
    return q if key_lengths is None else key_lengths, sq, sk, q if rng is None else rng


def _bwd_consts(q, key_lengths, causal, dropout_p, seg, softcap=0.0, exact=None) -> tuple[tuple, dict]:
    """(segment batch strides, the constexprs) both backward kernels take."""
    D = q.shape[-1]
    (_, _, *seg_strides), seg_flags = _seg_args(seg, q)
    return tuple(seg_strides), dict(HEAD_DIM=D, BLOCK_D=_block_d(D), CAUSAL=causal, HAS_KEYLEN=key_lengths is not None,
                                    DROPOUT=dropout_p > 0.0, DOT_PREC=_dot_precision(q.dtype), **seg_flags,
                                    **_softcap_flag(softcap), **_exact_flag(exact))


def _bwd_key(kind, do, q, k, v, idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, seg, tma_plan, *extra,
             softcap=0.0, exact: bool = False):
    return (kind, q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), q.dtype, q.device, _layout(idx),
            None if key_lengths is None else key_lengths.dtype, _seg_layout(seg), scale, causal, mask_bq, mask_bk,
            dropout_p, _frozen(tma_plan), _dot_precision(q.dtype), plan_state(), *extra, softcap, exact)


def bwd_dkdv(do, q, k, v, lse, delta, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, rng, q_idx, *,
             work: float = -1.0, seg=None, softcap: float = 0.0, exact: ExactTiles | None = None):
    """dK, dV: one program per (k tile, batch * kv head), walking the column lists (delta from `bwd_dq`)."""
    tma_plan = _tma_plan(_block_d(q.shape[-1]), q, k, v, do, work=work)
    dk, dv = _new(k), _new(v)
    key = _bwd_key("dkdv", do, q, k, v, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, seg, tma_plan,
                   softcap=softcap, exact=exact is not None)
    plan = _plan(key, _dkdv_plan, do, q, k, v, dk, dv, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p,
                 tma_plan, seg, softcap, exact)
    bm, bn = plan.cfg.block_m, plan.cfg.block_n
    descs = _tma_args(plan.cfg, tma_plan, _block_d(q.shape[-1]), (q, bm), (k, bn), (v, bn), (do, bm))[0]
    rng = None if dropout_p <= 0.0 else _checked_rng(rng, q.device)
    ex = None if exact is None else _check_exact(exact, q_idx, "q_idx")
    _launch(plan, _dkdv_tensors(q, k, v, do, lse, delta, dk, dv, q_idx, key_lengths, seg, rng, descs, ex))
    return dk, dv


def _dkdv_plan(do, q, k, v, dk, dv, q_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan, seg,
               softcap=0.0, exact=None):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    seg_strides, constexprs = _bwd_consts(q, key_lengths, causal, dropout_p, seg, softcap, exact)
    cfg = _config("dkdv", D, q.device, mask_bq, mask_bk, q.dtype, None if q_idx is None else q_idx.shape[-2],
                  dropout_p > 0, tma_plan is not None)
    _, ci_s, nb_p2 = _list_args(q_idx, B, Hq, q)
    strides, align = _aligned_strides(q, k, v, do, dk, dv)
    args = (_T,) * 9 + _exact_slots(exact) + (_T,) * 3 + (*seg_strides, *strides, *ci_s, Hq, Hkv, Hq // Hkv, Nq, Nk,
                                                          scale * 1.4426950408889634, scale, _T,
                                                          *_drop_consts(dropout_p), _T, _T, _T, _T)
    kwargs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MASK_BQ=mask_bq or cfg.block_m,
                  MASK_BK=mask_bk or cfg.block_n, NB_P2=nb_p2, GATHER=_gather(nb_p2), DENSE=q_idx is None,
                  **cfg.launch_options(), **constexprs, Q_ROWS=cfg.q_rows, ALIGN=align, TMA=_tma_taken(cfg, tma_plan))
    return _Plan("_bwd_dkdv_kernel", (_cdiv(Nk, cfg.block_n), B * Hkv), args, kwargs, cfg, kwargs["TMA"], q.device)


def bwd_dq(do, q, k, v, lse, delta, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, rng, kv_idx,
           *, o, dlse=None, work: float = -1.0, seg=None, softcap: float = 0.0, exact: ExactTiles | None = None):
    """dQ: one program per (q tile, batch * q head), walking the row lists. It first writes
    delta = rowsum(dO * O) - dLSE (float32 [B, Hq, Nq]) into ``delta``, for `bwd_dkdv`."""
    tma_plan = _tma_plan(_block_d(q.shape[-1]), q, k, v, do, o, work=work)
    dq = _new(q)
    key = _bwd_key("dq", do, q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, seg, tma_plan,
                   o.stride(), dlse is None, softcap=softcap, exact=exact is not None)
    plan = _plan(key, _dq_plan, do, q, k, v, o, dq, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p,
                 tma_plan, seg, dlse is not None, softcap, exact)
    bm, bn = plan.cfg.block_m, plan.cfg.block_n
    descs = _tma_args(plan.cfg, tma_plan, _block_d(q.shape[-1]), (q, bm), (k, bn), (v, bn), (do, bm), (o, bm))[0]
    rng = None if dropout_p <= 0.0 else _checked_rng(rng, q.device)
    ex = None if exact is None else _check_exact(exact, kv_idx, "kv_idx")
    _launch(plan, _dq_tensors(q, k, v, o, do, lse, dlse, delta, dq, kv_idx, key_lengths, seg, rng, descs, ex))
    return dq


def _dq_plan(do, q, k, v, o, dq, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, dropout_p, tma_plan, seg,
             has_dlse, softcap=0.0, exact=None):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    seg_strides, constexprs = _bwd_consts(q, key_lengths, causal, dropout_p, seg, softcap, exact)
    cfg = _config("dq", D, q.device, mask_bq, mask_bk, q.dtype, None if kv_idx is None else kv_idx.shape[-1],
                  dropout_p > 0, tma_plan is not None)
    _, ri_s, nb_p2 = _list_args(kv_idx, B, Hq, q)
    strides, align = _aligned_strides(q, k, v, do, o, dq)
    args = (_T,) * 10 + _exact_slots(exact) + (_T,) * 3 + (*seg_strides, *strides, *ri_s, Hq, Hq // Hkv, Nq, Nk,
                                                           scale * 1.4426950408889634, scale, _T,
                                                           *_drop_consts(dropout_p), _T, _T, _T, _T, _T)
    kwargs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MASK_BQ=mask_bq or cfg.block_m,
                  MASK_BK=mask_bk or cfg.block_n, NB_P2=nb_p2, GATHER=_gather(nb_p2), DENSE=kv_idx is None,
                  HAS_DLSE=has_dlse, **cfg.launch_options(), **constexprs, ALIGN=align, TMA=_tma_taken(cfg, tma_plan))
    return _Plan("_bwd_dq_kernel", (_cdiv(Nq, cfg.block_m), B * Hq), args, kwargs, cfg, kwargs["TMA"], q.device)


# ----------------------------------------------------------------------------- quick launches
# The launches of `sparseflash.flash.fast`'s calls: a plan whose per-call tensors are known by
# role (q, k, v, outputs; `_R` markers in the launch's tensor tuple) and whose other tensors (the
# mask's lists) are fixed. After its first launch through `_launch` it keeps the bound launch of
# the case where every address is 16-byte aligned, with the fixed tensors' addresses filled in;
# a call then reads the role tensors' addresses, checks their alignment, and calls the C
# launcher. Anything else (misaligned, hooks set, FAST_LAUNCH off, the interpreter) goes through
# `_launch` with the full tensor tuple.

class _R(int):
    """A role marker: the position of a per-call tensor in a quick launch's argument tuple."""


_Q, _K, _V, _O, _LSE, _KL, _DO, _DELTA, _DQ, _DK, _DV = (_R(i) for i in range(11))


class _Quick:
    __slots__ = ("plan", "layout", "roles", "bound", "n")

    def __init__(self, plan: _Plan, layout: tuple):
        self.plan, self.layout = plan, layout  # layout: the launch's tensors, _R markers where a role goes
        self.roles = tuple((slot, r) for slot, r in zip(plan.slots, layout) if isinstance(r, _R))
        self.bound = None
        self.n = len(layout)

    def __call__(self, ts: tuple, ptrs: list) -> None:
        """Launch with ``ts`` the role tensors (indexed by the markers; None where a role is unused)
        and ``ptrs`` their addresses (`quick_ptrs`)."""
        b = self.bound
        if b is not None and FAST_LAUNCH and hooks_idle():
            run, function, meta, values, dev = b[:5]
            values = list(values)
            acc = 0
            for i, r in self.roles:
                p = values[i] = ptrs[r]
                acc |= p
            if not acc & 15 and _current_device() == dev:
                g = self.plan.grid
                run(g[0], g[1], 1, raw_stream(dev), function, meta, None, None, None, *values)
                return
        done = _launch(self.plan, tuple(ts[r] if isinstance(r, _R) else r for r in self.layout))
        if b is None and done is not None and all(done[0][1]):  # keep the all-aligned bound launch
            run, function, meta, values, compiled = done[1]
            values = list(values)
            for i, t in zip(self.plan.slots, self.layout):
                if not isinstance(t, _R):
                    values[i] = t.data_ptr()
            self.bound = run, function, meta, tuple(values), done[0][0], compiled


def quick_ptrs(ts: tuple) -> list:
    """The addresses of role tensors ``ts`` (0 for None), once for the launches that share them."""
    return [0 if t is None else t.data_ptr() for t in ts]


def quick_fwd(q, k, v, kv_idx, key_lengths, scale: float, causal: bool, mask_bq: int | None,
              mask_bk: int | None, *, work: float) -> _Quick | None:
    """The forward of a `sparseflash.flash.fast` call (no dropout, no segments) as a quick launch,
    role tensors (q, k, v, o, lse, key_lengths); None when its plan would load through TMA."""
    if _tma_plan(_block_d(q.shape[-1]), q, k, v, work=work) is not None:
        return None
    o = torch.empty_like(q)  # only the layout is read
    key = _fwd_key(q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, 0.0, None, None)
    plan = _plan(key, _fwd_plan, q, k, v, o, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, 0.0, None, None)
    kl = None if key_lengths is None else _KL
    return _Quick(plan, _fwd_tensors(_Q, _K, _V, _O, _LSE, kv_idx, kl, None, None, (_Q, _K, _V)))


def quick_bwd(do, q, k, v, o, kv_idx, q_idx, key_lengths, scale: float, causal: bool, mask_bq: int | None,
              mask_bk: int | None, *, work: float) -> tuple[_Quick, _Quick] | None:
    """dQ and dK/dV of a `sparseflash.flash.fast` call for ``do``'s layout, role tensors (q, k, v,
    o, lse, key_lengths, do, delta, dq, dk, dv); None when a plan would load through TMA."""
    D = q.shape[-1]
    if _tma_plan(_block_d(D), q, k, v, do, o, work=work) is not None:
        return None
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # only their layouts are read
    args = (do, q, k, v, kv_idx, key_lengths, scale, causal, mask_bq, mask_bk, 0.0, None, None)
    plan = _plan(_bwd_key("dq", *args, o.stride(), True), _dq_plan, do, q, k, v, o, dq, kv_idx, key_lengths, scale,
                 causal, mask_bq, mask_bk, 0.0, None, None, False)
    args = (do, q, k, v, q_idx) + args[5:]
    plan_kv = _plan(_bwd_key("dkdv", *args), _dkdv_plan, do, q, k, v, dk, dv, q_idx, key_lengths, scale, causal,
                    mask_bq, mask_bk, 0.0, None, None)
    kl = None if key_lengths is None else _KL
    return (_Quick(plan, _dq_tensors(_Q, _K, _V, _O, _DO, _LSE, None, _DELTA, _DQ, kv_idx, kl, None, None,
                                     (_Q, _K, _V, _DO, _O))),
            _Quick(plan_kv, _dkdv_tensors(_Q, _K, _V, _DO, _LSE, _DELTA, _DK, _DV, q_idx, kl, None, None,
                                          (_Q, _K, _V, _DO))))
