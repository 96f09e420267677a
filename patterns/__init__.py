"""The pattern zoo: generators that return `sparseflash.BlockMask` (installed as sparseflash.patterns).

Every generator takes the sequence length in tokens first and ``block_size=128`` by keyword.
This package never imports triton.
"""

from sparseflash.patterns.butterfly import butterfly

__all__ = ["butterfly"]
