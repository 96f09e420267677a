"""sparseflash: block-sparse FlashAttention in Triton.

    import sparseflash
    from sparseflash.patterns import butterfly
    o = sparseflash.attention(q, k, v, mask=butterfly(n))   # q, k, v: [batch, heads, seq, head_dim]

Where things are: `sparseflash.attention` (api.py: validation + dispatch), `BlockMask` (mask.py),
the pure-PyTorch reference (reference.py), the Triton kernels, launchers and autograd wrapper
(flash/), flash-attn 2's interface (flash_attn_interface.py; decoding with a KV cache: kvcache.py, kernel flash/decode.py), `sparseflash.nn.SparseAttention` (nn.py), the Hugging Face transformers hook
(hf.py, optional extra ``[hf]``), the pattern zoo (`sparseflash.patterns`), analysis of masks (analysis.py), mask pictures (_picture.py),
per-call block selection (`topk_blocks`, dynamic.py),
benchmarks and LRA experiments (`sparseflash.experiments`), the CLI (cli.py).
"""

import os as _os

# In a source checkout run in place (no install, or a legacy editable install), the
# sub-packages sparseflash.patterns and sparseflash.experiments are the top-level folders
# patterns/ and experiments/ beside this package: let the import system find them there.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "patterns")) and all(
    _os.path.isfile(_os.path.join(_root, *p)) for p in (("pyproject.toml",), ("patterns", "__init__.py"))
):
    __path__.append(_root)

from sparseflash.api import attention  # noqa: E402
from sparseflash.mask import BlockIndex, BlockMask  # noqa: E402
from sparseflash.dynamic import topk_blocks  # noqa: E402
from sparseflash.segments import segments_from_cu_seqlens  # noqa: E402
from sparseflash.flash_attn_interface import (  # noqa: E402
    flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

__version__ = "0.1.0"

__all__ = ["attention", "BlockMask", "BlockIndex", "topk_blocks", "segments_from_cu_seqlens", "flash_attn_func",
           "flash_attn_varlen_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
           "__version__"]
