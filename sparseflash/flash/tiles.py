"""Tile and TMA policy of the portable kernels: which tile each kernel runs with, and whether its
tiles load through TMA descriptors. Pure decisions on shapes, dtypes and the device; the launchers
(`sparseflash.flash.launch`) ask here and launch.

Tiles: the kernels walk the mask's block lists in kernel tiles, so a tile must divide the mask
block (``block_q % BLOCK_M == 0`` for q tiles, ``block_k % BLOCK_N == 0`` for k tiles). `config`
takes the configured tile and halves it until it divides the mask block (`fit_tile`); a mask block
that is not a multiple of 16 (the smallest tile `tl.dot` takes) is refused with a clear error.
Dense attention (no mask) has no such constraint.

Configs were chosen by measurement (experiments/bench/tune_tiles.py; `default_config`,
`tma_config`, `fp32_config`, the segments variant; the timings behind each choice:
experiments/studies/kernel-tuning/README.md and, for TMA, experiments/studies/tma/README.md);
under the Triton interpreter small tiles keep
CPU tests fast. `tile_config(...)` overrides them (tests use it to cover several tilings; the
tuning script to search). A config also carries the register cap, the dK/dV orientation (q_rows)
and whether its tiles load through TMA descriptors (tma).

TMA: `TMA_MODE` (``SPARSEFLASH_TMA``) and `tma_plan` decide whether a launch's tensors can go as
descriptors (sm_90+, 16-bit, head_dim <= 128, layouts a descriptor takes, calls large enough or
captured in a CUDA graph in "auto"); `tma_args` builds them for a tile that takes them. The same
rule gates the Hopper kernels (`sparseflash.flash.dispatch`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace

import torch
from sparseflash import _env

__all__ = ["TileConfig", "tile_config", "config", "default_config", "fp32_config", "tma_config", "fit_tile", "block_d",
           "interpreting", "INTERPRETING", "overrides", "TMA_MODE", "TMA_MIN_WORK", "sm_major", "tma_strides",
           "tma_auto", "in_graph_capture", "tma_wanted", "tma_plan", "tma_args", "tma_taken"]


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
    # when TMA_MODE is "auto" and the inputs allow it (`tma_plan`)
    tma: bool = False

    def launch_options(self) -> dict:
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None and not interpreting():
            opts["maxnreg"] = self.maxnreg
        return opts


_OVERRIDE: dict[str, TileConfig] = {}


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


def overrides() -> tuple:
    """The tiles `tile_config` sets now, as part of a plan key (empty outside it)."""
    return tuple(_OVERRIDE.items()) if _OVERRIDE else ()


# Read once, when kernels.py is imported (as kernels.INTERPRET is, and as Triton decides whether
# its kernels are interpreted): not an environment lookup on every launch.
INTERPRETING = _env.interpreting()


def interpreting() -> bool:
    """Whether the kernels run under the Triton interpreter (`INTERPRETING`, read at import)."""
    return INTERPRETING


def tma_config(kind: str, head_dim: int, k_blocks: int | None) -> TileConfig | None:
    """The tile of a kernel that loads through TMA descriptors, where that measured faster than
    pointer loads at their own best tile; None elsewhere (pointer loads then). Searched with
    `tune_tiles` under SPARSEFLASH_TMA=on and =off, dense and density 0.1 at 4K and 16K, head_dim
    64 and 128 without dropout only; the times of each choice: experiments/studies/tma/README.md."""
    sparse = k_blocks is not None
    long_rows = sparse and k_blocks >= 64  # rows of ~13 blocks (16K tokens) against ~3 (4K)
    if kind == "fwd":
        if head_dim == 64:
            # dense: TMA's best tile does not beat pointer loads, so they stay
            return TileConfig(128, 64, 4, 3, tma=True) if sparse else None
        if sparse and not long_rows:
            return TileConfig(64, 64, 4, 3, tma=True)
        return TileConfig(128, 128, 8, 3, tma=True)
    if kind == "dq":
        if sparse and not long_rows:  # d=64: level with pointer loads, which stay
            return TileConfig(128, 32, 4, 3, tma=True) if head_dim == 128 else None
        return TileConfig(128, 64, 8, 3, tma=True)
    if head_dim == 64 and sparse and not long_rows:
        return TileConfig(64, 64, 4, 3, tma=True)
    return TileConfig(64, 64, 4, 2, tma=True)


def default_config(kind: str, head_dim: int, device: torch.device, k_blocks: int | None = None,
                    dropout: bool = False, tma: bool = False, segments: bool = False) -> TileConfig:
    """The tile of a kernel. ``k_blocks``: the mask's key blocks (None: dense), the proxy for row
    length that needs no look at the mask's contents (longer sequences, longer rows). ``tma``:
    the inputs can be read through TMA descriptors (`tma_plan`); a config measured faster with
    them then comes from `tma_config`, else the pointer loads' own best. ``segments``: the
    packed-documents variant (`_segment_config`)."""
    cfg = _default_config_of(kind, head_dim, device, k_blocks, dropout, tma)
    return _segment_config(cfg, kind, head_dim) if segments and device.type == "cuda" and not interpreting() else cfg


def _segment_config(cfg: TileConfig, kind: str, head_dim: int) -> TileConfig:
    """The segment test (kernels._seg_other) takes the 8-warp d<=64 forward from 128 to 160
    registers in an sm_90 compile (one program per SM instead of two); capped at 128 it compiles
    without spills. Not yet timed on a GPU (tiles are otherwise the block-sparse ones)."""
    if kind == "fwd" and head_dim <= 64 and cfg.num_warps == 8 and cfg.maxnreg is None:
        return replace(cfg, maxnreg=128)
    return cfg


def _default_config_of(kind: str, head_dim: int, device: torch.device, k_blocks: int | None = None,
                       dropout: bool = False, tma: bool = False) -> TileConfig:
    if device.type != "cuda" or interpreting():
        return TileConfig(32, 32, 4, 1)
    if tma and not dropout and head_dim in (64, 128):
        cfg = tma_config(kind, head_dim, k_blocks)
        if cfg is not None:
            return cfg
    # sm_90, bf16, pointer loads: the fastest config of experiments/bench/tune_tiles.py in GPU time,
    # dense and at density 0.1, N = 4K and 16K, 16 heads; each choice's times:
    # experiments/studies/kernel-tuning/README.md ("The evidence behind tiles.py's defaults").
    sparse = k_blocks is not None
    if kind == "fwd":
        if head_dim <= 32 and not dropout:
            # d=32: dense 4 warps with 128-key tiles; short rows (1-3 blocks) 128x32; long rows 64x128
            if not sparse:
                return TileConfig(128, 128, 4, 3)
            return TileConfig(64, 128, 4, 3) if k_blocks >= 64 else TileConfig(128, 32, 4, 3)
        if head_dim <= 64:
            # With dropout, at most 128 registers: two 8-warp programs per SM (the kernel takes
            # 128-130, so uncapped one program runs alone); without dropout the cap costs time, so
            # it stays off.
            if head_dim < 64 and block_d(head_dim) != head_dim and not dropout:
                # head dims padded to 64 (40, 48, 56): 4 warps, as fast or faster than 8 everywhere
                # there; at d=64 itself 4 warps are slower dense, so 8 stay.
                return TileConfig(128, 64, 4, 3)
            return TileConfig(128, 64, 8, 3, maxnreg=128 if dropout else None)
        if head_dim <= 128:
            if not sparse:
                return TileConfig(128, 64, 8, 3)
            # rows of ~13 blocks (16K tokens): 128-key tiles; rows of ~3 (4K): 64 x 64
            return TileConfig(128, 128, 8, 3) if k_blocks >= 64 else TileConfig(64, 64, 4, 3)
        # head_dim 129-256: the d=256 search's best
        return TileConfig(128, 64, 8, 2) if sparse else TileConfig(128, 32, 8, 3)
    if kind == "dkdv":  # block_n = k tile held on chip, block_m = q tile streamed
        if head_dim <= 64:
            if head_dim <= 32 and not dropout and sparse and k_blocks >= 64:
                return TileConfig(64, 128, 4, 3)  # d=32, 16K rows of 13 blocks
            # With dropout, [queries, keys] tiles (the bits as the forward draws them, no shuffle):
            # faster than the default with dropout, slower without it. At d=128 the same
            # orientation gains nothing with dropout and costs without, so it stays off there.
            return TileConfig(64, 64, 4, 3, q_rows=True) if dropout else TileConfig(32, 128, 4, 3)
        if head_dim <= 128:
            return TileConfig(64, 128, 8, 3)
        # d=256: the search's best (the earlier 32x64x8w tile spilled)
        return TileConfig(64, 32, 4, 2)
    # dq: block_m = q tile held, block_n = k tile streamed
    if head_dim <= 64:
        if dropout:  # 128 registers (two programs per SM): faster than uncapped, dense and sparse
            return TileConfig(128, 64, 8, 3, maxnreg=128)
        return TileConfig(64, 64, 4, 3) if sparse else TileConfig(128, 64, 8, 3)
    if head_dim <= 128:
        return TileConfig(128, 64, 8, 3)
    # d=256: the search's best
    return TileConfig(128, 32, 8, 3)


def fit_tile(tile: int, mask_block: int | None, what: str) -> int:
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


# fp32 past head_dim 128: the earlier 16-bit d=256 tiles halved twice (the current 16-bit ones do
# not fit in fp32: dQ would need more shared memory than sm_90 has). Not re-tuned.
_FP32_WIDE = {"fwd": TileConfig(64, 16, 4, 2), "dkdv": TileConfig(16, 64, 8, 2), "dq": TileConfig(64, 16, 8, 2)}


def fp32_config(cfg: TileConfig, kind: str, head_dim: int) -> TileConfig:
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


def config(kind: str, head_dim: int, device, mask_bq: int | None, mask_bk: int | None,
            dtype: torch.dtype = torch.bfloat16, k_blocks: int | None = None, dropout: bool = False,
            tma: bool = False, segments: bool = False) -> TileConfig:
    cfg = _OVERRIDE.get(kind)
    if cfg is None:  # the defaults depend only on these values: computed once per combination
        return _default_fitted(kind, head_dim, device.type, mask_bq, mask_bk, dtype, k_blocks, dropout, tma,
                               interpreting(), segments)
    return _fitted(cfg, mask_bq, mask_bk)


@functools.lru_cache(maxsize=1024)
def _default_fitted(kind, head_dim, device_type, mask_bq, mask_bk, dtype, k_blocks, dropout, tma,
                    interpreting, segments=False) -> TileConfig:
    cfg = default_config(kind, head_dim, torch.device(device_type), k_blocks, dropout, tma, segments)
    if dtype == torch.float32 and device_type == "cuda" and not interpreting:
        cfg = fp32_config(cfg, kind, head_dim)
    return _fitted(cfg, mask_bq, mask_bk)


def _fitted(cfg: TileConfig, mask_bq: int | None, mask_bk: int | None) -> TileConfig:
    bm = fit_tile(cfg.block_m, mask_bq, "block_q")
    bn = fit_tile(cfg.block_n, mask_bk, "block_k")
    if (bm, bn) == (cfg.block_m, cfg.block_n):
        return cfg  # the common case, without dataclasses.replace's cost on every launch
    return replace(cfg, block_m=bm, block_n=bn)


def _p2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def block_d(head_dim: int) -> int:
    return max(16, _p2(head_dim))


# Tile loads through TMA tensor descriptors (Hopper's bulk copies). "auto": on sm_90+ GPUs, for
# inputs that allow it and calls large enough to hide the descriptors' host cost (`tma_plan`,
# `tma_auto`), with the tiles measured fastest that way (`tma_config`; TileConfig.tma) where
# TMA won, pointer loads elsewhere. "on": TMA wherever the inputs allow
# it, whatever the tile, the Triton interpreter included (tests cover the path on CPU with it;
# tune_tiles times every config both ways with it). "off": never. SPARSEFLASH_TMA sets the
# starting value.
TMA_MODE = _env.text("SPARSEFLASH_TMA", "auto")
_TMA_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def sm_major(index: int | None) -> int:
    """The compute capability's major number of a CUDA device (asked once per device)."""
    return torch.cuda.get_device_capability(index)[0]


def tma_strides(t: torch.Tensor):
    """The strides of a [B, H, N, D] tensor as a TMA descriptor takes them, or None when it cannot
    be one. Needs a unit last stride, a 16-byte aligned base and strides, and a row-major layout:
    each dimension of more than one element at least as far apart as the whole of the next one
    (packed, padded or sliced; never expanded or transposed). Size-1 dimensions get strides TMA
    accepts (their coordinate is always 0)."""
    return _tma_layout(tuple(t.shape), t.stride(), t.element_size(), t.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=1024)
def _tma_layout(shape: tuple, stride: tuple, esz: int, aligned: bool):
    """`tma_strides` on a tensor's layout (cached: a model calls with few layouts)."""
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
# eager calls host-bound and slower; from about this size on a call's GPU time exceeds its host
# time, where the descriptors' GPU-time gain counts (the measurements: experiments/studies/tma/README.md,
# "Why TMA_MIN_WORK"; runs in experiments/studies/host_cost/results/tma/).
# Inside CUDA-graph capture the host cost is paid once, at capture, so "auto" takes descriptors
# there whatever the size: a captured call may run a kernel its eager warm-up did not, which is
# loaded during the capture (lazy and eager module loading; test_gpu_graph_capture_after_eager_warmup
# checks it on a GPU).
TMA_MIN_WORK = 1e11


def tma_auto(device: torch.device, work: float, capturing: bool = False) -> bool:
    """TMA_MODE "auto"'s rule: a CUDA device of compute capability 9 or more, and a call of at
    least TMA_MIN_WORK estimated forward FLOPs (``work``; -1: unknown, taken as large) or one being
    captured in a CUDA graph."""
    if device.type != "cuda" or interpreting() or sm_major(device.index) < 9:
        return False
    return capturing or not 0 <= work < TMA_MIN_WORK


def in_graph_capture(t: torch.Tensor) -> bool:
    """Whether a launch on ``t``'s device is being captured in a CUDA graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def tma_plan(block_d: int, *ts: torch.Tensor, work: float = -1.0):
    """The descriptor strides of every tensor of a launch when its tiles can load through TMA, or
    None: TMA_MODE allows it ("on", or "auto" and `tma_auto`), the dtype is 16-bit, head_dim <=
    128 (the measured range) and each tensor passes `tma_strides`."""
    if not tma_wanted(ts[0], block_d, work):
        return None
    strides = [tma_strides(t) for t in ts]
    return None if None in strides else strides


def tma_wanted(t0: torch.Tensor, block_d: int, work: float) -> bool:
    """TMA_MODE's rule for a launch on ``t0``'s device and dtype, whatever the layouts: "on", or
    "auto" and `tma_auto`; never for other dtypes or head_dim > 128. The Hopper forward's
    descriptors follow the same rule (`sparseflash.flash.dispatch`)."""
    if TMA_MODE not in ("auto", "on", "off"):
        raise ValueError(f"tiles.TMA_MODE (SPARSEFLASH_TMA) must be 'auto', 'on' or 'off', got {TMA_MODE!r}")
    if TMA_MODE == "off" or t0.dtype not in _TMA_DTYPES or block_d > 128:
        return False
    return TMA_MODE == "on" or tma_auto(t0.device, work, in_graph_capture(t0))


def tma_args(cfg: TileConfig, plan, block_d: int, *tiles):
    """Kernel arguments for the tensors of ``tiles``, (tensor, rows per tile) pairs, and the TMA
    flag: 4-D descriptors (blocks [1, 1, rows, block_d]; rows past each head's end and columns past
    head_dim read as zeros) when there is a `tma_plan` and the tile takes TMA (TileConfig.tma, or
    any tile with TMA_MODE "on"); otherwise the tensors themselves as placeholders and False."""
    if tma_taken(cfg, plan):
        from triton.tools.tensor_descriptor import TensorDescriptor

        return tuple(TensorDescriptor(t, list(t.shape), st, [1, 1, rows, block_d])
                     for (t, rows), st in zip(tiles, plan)), True
    return tuple(t for t, _ in tiles), False


def tma_taken(cfg: TileConfig, plan) -> bool:
    """Whether a launch of tile ``cfg`` with `tma_plan` ``plan`` loads through descriptors."""
    return plan is not None and (cfg.tma or TMA_MODE == "on")
