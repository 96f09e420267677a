"""Triton block-sparse FlashAttention: kernels.py (the @triton.jit kernels), launch.py (tiles,
grids, launches), function.py (torch.library ops, autograd.Function, `flash_attention`)."""

from sparseflash.flash.function import FlashAttentionFunction, flash_attention
from sparseflash.flash.launch import TileConfig, tile_config

__all__ = ["flash_attention", "FlashAttentionFunction", "TileConfig", "tile_config"]
