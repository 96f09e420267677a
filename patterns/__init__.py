"""The pattern zoo: generators that return `sparseflash.BlockMask` (installed as sparseflash.patterns).

Every generator takes the sequence length in tokens first and ``block_size=128`` (an int or a
``(block_q, block_k)`` pair) by keyword, plus ``device=None``. Token-level patterns (`local`,
`dilated`, `strided`, `fixed`, `global_tokens`, `longformer`, the window and global parts of
`bigbird`, `causal`) are exact: a block is on iff some token pair inside it is attended, computed
on the block grid without any token-level N x N tensor. They take ``seq_k`` for
``seq_q != seq_k``, where query i sits at position ``i + seq_k - seq_q`` (bottom-right aligned,
like ``causal`` in `sparseflash.attention`). `butterfly` and `random` are block-level patterns.

Combine with ``|`` and ``&`` (``mask & causal(n)`` restricts to causal blocks; the generators'
own ``causal=True`` is the exact pooled causal pattern, which can be smaller), and `stack` for
a different pattern per head. This package never imports triton.
"""

from sparseflash.patterns.bigbird import bigbird
from sparseflash.patterns.butterfly import butterfly
from sparseflash.patterns.causal import causal
from sparseflash.patterns.dense import dense
from sparseflash.patterns.dilated import dilated
from sparseflash.patterns.fixed import fixed
from sparseflash.patterns.global_tokens import global_tokens
from sparseflash.patterns.local import local
from sparseflash.patterns.longformer import longformer
from sparseflash.patterns.random import random
from sparseflash.patterns.stack import stack
from sparseflash.patterns.strided import strided

__all__ = [
    "bigbird", "butterfly", "causal", "dense", "dilated", "fixed", "global_tokens", "local",
    "longformer", "random", "stack", "strided",
]
