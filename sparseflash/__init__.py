"""sparseflash: block-sparse FlashAttention in Triton.

    import sparseflash
    from sparseflash.patterns import butterfly
    o = sparseflash.attention(q, k, v, mask=butterfly(n))   # q, k, v: [batch, heads, seq, head_dim]

Where things are: `sparseflash.attention` (api.py: validation + dispatch), `BlockMask` (mask.py),
the pure-PyTorch reference (reference.py), the Triton kernels, launchers and autograd wrapper
(flash/), the pattern zoo (`sparseflash.patterns`), analysis and plots of masks (analysis.py),
benchmarks and LRA experiments (`sparseflash.experiments`), the CLI (cli.py).
"""

from sparseflash.api import attention
from sparseflash.mask import BlockIndex, BlockMask

__version__ = "0.1.0"

__all__ = ["attention", "BlockMask", "BlockIndex", "__version__"]
