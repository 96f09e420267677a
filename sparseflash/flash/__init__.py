"""Triton block-sparse FlashAttention, one op in four layers (public function first):

- `sparseflash.attention` (api.py): validation, the short path of repeated calls, dispatch here;
- autograd.py: the torch.library ops, `FlashAttentionFunction` (the one autograd Function, of the
  general path and of the short path's entries) and `flash_attention`;
- launch.py: the launchers (`fwd`, `bwd`: plans, grids, outputs, the launch), which ask
  dispatch.py whether the Hopper Gluon kernels run a call (hopper/: forward.py forward, backward.py
  backward, hopper/common.py their shared helpers) and otherwise take tiles and TMA from tiles.py
  and the kernels' arguments from operands.py;
- kernels.py: the portable @triton.jit kernels.

fast.py is the short path of repeated eager calls (entered through `fast.lookup`; its C++ half:
native.py, _native.cpp). README.md beside this file follows one call from `sparseflash.attention`
to a kernel."""

from sparseflash.flash.autograd import FlashAttentionFunction, flash_attention
from sparseflash.flash.tiles import TileConfig, tile_config

__all__ = ["flash_attention", "FlashAttentionFunction", "TileConfig", "tile_config"]
