"""Every attention implementation the benchmarks compare, defined in one place.

A provider has a ``kind`` that says how it relates to the block mask of a setting:

- ``sparse``: computes only the mask's nonzero blocks (sparseflash, FlexAttention with the same
  block mask converted to its own format); timed at every density point;
- ``masked``: takes the mask as a token-level boolean ``attn_mask`` but computes every pair
  (standard attention with a masked softmax; SDPA memory-efficient / cuDNN with ``attn_mask``);
  timed at the densest and sparsest mask of a sweep (or every one: ``--masked-densities all``);
- ``dense``: ignores the mask (sparseflash ``mask=None``, standard attention, SDPA flash / cuDNN /
  memory-efficient, FlexAttention without a mask); timed once per shape, as the density-1 point.

``causal`` is honoured by all of them (``is_causal`` for SDPA, folded into the token mask where
there is one, a ``mask_mod`` on the diagonal blocks for FlexAttention). Inputs are
``[batch, heads, seq, head_dim]`` with equal query and key lengths.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from sparseflash.mask import BlockMask

__all__ = ["Setting", "Provider", "PROVIDERS", "DEFAULT_PROVIDERS", "get_providers", "device_label", "standard_attention",
           "token_mask", "to_flex_block_mask", "dtype_of"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Setting:
    """One benchmark point (the mask is None for dense rows)."""

    device: torch.device
    dtype: torch.dtype
    batch: int
    heads: int
    seq_len: int
    head_dim: int
    causal: bool
    mode: str  # "fwd", "bwd" or "fwdbwd"
    mask: BlockMask | None = None
    sf_backend: str = "auto"  # backend= for sparseflash.attention

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


@dataclass(frozen=True)
class Provider:
    name: str
    label: str
    kind: str  # "sparse" | "masked" | "dense"
    description: str
    check: Callable[[Setting], str | None]  # None if it can run here, else why not
    prepare: Callable[[Setting], object]  # one-off work outside the timed call (mask conversion)
    forward: Callable[[object, Setting, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    backend: Callable[[Setting], str] = field(default=lambda s: "")


# ----------------------------------------------------------------------------- masks
def token_mask(s: Setting) -> torch.Tensor | None:
    """Bool ``[B', H', N, N]`` of attended pairs (block mask and causal), or None if neither."""
    m = None if s.mask is None else s.mask.to(s.device).to_dense()
    if s.causal:
        c = torch.ones(s.seq_len, s.seq_len, dtype=torch.bool, device=s.device).tril_()[None, None]
        m = c if m is None else m & c
    return m


def to_flex_block_mask(mask: BlockMask, causal: bool, device=None):
    """The identical mask as a ``torch.nn.attention.flex_attention.BlockMask``: `BlockMask.to_flex`.

    Blocks whose every real token pair is attended go in the "full" lists (no mask_mod applied);
    with ``causal``, blocks cut by the diagonal go in the partial lists with a causal mask_mod
    and blocks above it (no attended pair) are dropped, as the sparseflash kernel skips them.
    The block lookup stays out of mask_mod (``layout_in_mask_mod=False``): the benchmark runs
    compiled flex only, which calls mask_mod in the diagonal blocks alone, where it is true.
    """
    return mask.to_flex(causal, device=device, layout_in_mask_mod=False)


# ----------------------------------------------------------------------------- implementations
def standard_attention(q, k, v, masked_out: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v in the input dtype, materialising the N x N scores (the FlashAttention
    paper's baseline). ``masked_out``: bool, True where a pair is NOT attended."""
    s = torch.matmul(q * scale, k.transpose(-2, -1))  # scaling q, not the N x N scores
    if masked_out is not None:
        s = s.masked_fill(masked_out, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def _needs_cuda(s: Setting) -> str | None:
    return None if s.device.type == "cuda" else "needs a CUDA device"


def _sparseflash_check(s: Setting) -> str | None:
    from sparseflash.api import _interpreting, resolve_backend

    if resolve_backend(s.sf_backend, s.device) == "triton" and s.device.type == "cpu" and not _interpreting():
        return "backend 'triton' on CPU needs TRITON_INTERPRET=1"
    return None


def _sparseflash_backend(s: Setting) -> str:
    from sparseflash.api import _interpreting, resolve_backend

    b = resolve_backend(s.sf_backend, s.device)
    return "triton-interpreter" if b == "triton" and s.device.type == "cpu" and _interpreting() else b


def _sparseflash_prepare(s: Setting, use_mask: bool):
    if not use_mask or s.mask is None:
        return None
    m = s.mask.to(s.device)
    m.index(s.device)  # compressed index: built once, cached on the mask
    return m


def _sparseflash_forward(ctx, s, q, k, v):
    import sparseflash

    return sparseflash.attention(q, k, v, mask=ctx, causal=s.causal, backend=s.sf_backend)


def _torch_prepare(s: Setting, use_mask: bool):
    m = token_mask(s if use_mask else dataclasses.replace(s, mask=None))
    return None if m is None else ~m


def _sdpa(backend_name: str, use_mask: bool):
    def prepare(s: Setting):
        return token_mask(s) if use_mask else None

    def forward(ctx, s, q, k, v):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            if ctx is not None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx)
            return F.scaled_dot_product_attention(q, k, v, is_causal=s.causal)

    return prepare, forward


_FLEX_COMPILED = None


def _flex_check(s: Setting) -> str | None:
    if s.device.type != "cuda":
        return "FlexAttention is benchmarked compiled on CUDA only"
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch.nn.attention.flex_attention not importable ({e})"
    return None


def _flex_compiled():
    """``torch.compile(flex_attention)`` made once, with the recompile limits raised: a sweep
    compiles once per shape and mode, and past dynamo's default limit (8) FlexAttention silently
    falls back to an unfused O(N^2)-memory path."""
    global _FLEX_COMPILED
    if _FLEX_COMPILED is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 4096))
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


def _flex(use_mask: bool):
    def prepare(s: Setting):
        fn = _flex_compiled()
        if not use_mask or (s.mask is None and not s.causal):
            return fn, None
        if s.mask is None:  # dense causal: an all-on layout with the causal split
            nb = math.ceil(s.seq_len / 128)
            mask = BlockMask(torch.ones(nb, nb, dtype=torch.bool, device=s.device), 128, s.seq_len)
        else:
            mask = s.mask
        return fn, to_flex_block_mask(mask, s.causal, s.device)

    def forward(ctx, s, q, k, v):
        fn, bm = ctx
        return fn(q, k, v, block_mask=bm, scale=s.scale)

    return prepare, forward


def _fa4_check(s: Setting) -> str | None:
    """Why FlashAttention-4 cannot run ``s`` here, or None."""
    if s.device.type != "cuda":
        return "FlashAttention-4 needs a CUDA device"
    if torch.cuda.get_device_capability(s.device)[0] not in (9, 10):
        return "FlashAttention-4 runs on sm_90 / sm_100 GPUs"
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure: not installed, CUDA DSL missing
        return f"flash_attn.cute not importable ({type(e).__name__}: {e}); pip install flash-attn-4"
    if s.dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention-4 takes fp16 / bf16, not {s.dtype}"
    if s.mask is not None and tuple(s.mask.block_size) != (128, 128):
        return f"FlashAttention-4's SM90 block sparsity takes 128 x 128 blocks, not {s.mask.block_size}"
    return None


def _fa4(use_mask: bool):
    """FlashAttention-4 (`flash_attn.cute.flash_attn_func`) on [B, N, H, D] views of the same
    [B, H, N, D] tensors (its layout; no copy). With a block mask: its block lists as FA4 takes
    them, Flex's format (blocks every pair of which is attended in the full lists, blocks cut by
    the causal diagonal in the partial ones, with ``causal=True`` masking them), for the forward
    and, transposed, for the backward."""

    def prepare(s: Setting):
        from flash_attn.cute import flash_attn_func

        if not use_mask or s.mask is None:
            return flash_attn_func, None, None
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

        fm = to_flex_block_mask(s.mask, s.causal, s.device)
        size = tuple(s.mask.block_size)
        fwd = BlockSparseTensorsTorch(fm.kv_num_blocks, fm.kv_indices, fm.full_kv_num_blocks, fm.full_kv_indices,
                                      block_size=size)
        bwd = BlockSparseTensorsTorch(fm.q_num_blocks, fm.q_indices, fm.full_q_num_blocks, fm.full_q_indices,
                                      block_size=size)
        return flash_attn_func, fwd, bwd

    def forward(ctx, s, q, k, v):
        fn, fwd, bwd = ctx
        out, _ = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=s.scale, causal=s.causal,
                    block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd)
        return out.transpose(1, 2)

    return prepare, forward


def _cuda_sdpa_backend(name):
    return lambda s: f"sdpa:{name.lower()}"


def _make_providers() -> dict[str, Provider]:
    out = {}

    def add(p):
        out[p.name] = p

    add(Provider("sparseflash", "sparseflash block-sparse", "sparse",
                 "sparseflash.attention with the pattern's BlockMask",
                 _sparseflash_check, lambda s: _sparseflash_prepare(s, True), _sparseflash_forward,
                 _sparseflash_backend))
    add(Provider("sparseflash-dense", "sparseflash", "dense", "sparseflash.attention with mask=None",
                 _sparseflash_check, lambda s: None, _sparseflash_forward, _sparseflash_backend))
    add(Provider("flex", "FlexAttention block mask", "sparse",
                 "torch.compile(flex_attention) with the identical block mask (BlockMask.from_kv_blocks)",
                 _flex_check, *_flex(True), lambda s: "flex:compiled"))
    add(Provider("flex-dense", "FlexAttention", "dense", "torch.compile(flex_attention) without a block mask",
                 _flex_check, *_flex(False), lambda s: "flex:compiled"))
    add(Provider("fa4", "FlashAttention-4 block-sparse", "sparse",
                 "flash_attn.cute.flash_attn_func (pip flash-attn-4) with the identical block lists",
                 _fa4_check, *_fa4(True), lambda s: "fa4"))
    add(Provider("fa4-dense", "FlashAttention-4", "dense", "flash_attn.cute.flash_attn_func (pip flash-attn-4)",
                 _fa4_check, *_fa4(False), lambda s: "fa4"))
    for name, backend, label in (("flash", "FLASH_ATTENTION", "SDPA flash"),
                                 ("cudnn", "CUDNN_ATTENTION", "SDPA cuDNN"),
                                 ("efficient", "EFFICIENT_ATTENTION", "SDPA mem-efficient")):
        check = None if name == "flash" else _needs_cuda  # flash has a CPU kernel too
        add(Provider(f"sdpa-{name}", label, "dense", f"F.scaled_dot_product_attention under sdpa_kernel({backend})",
                     check or (lambda s: None), *_sdpa(backend, False), _cuda_sdpa_backend(backend)))
        if name != "flash":  # FlashAttention takes no attn_mask
            add(Provider(f"sdpa-{name}-masked", f"{label} + attn_mask", "masked",
                         f"F.scaled_dot_product_attention(attn_mask=bool token mask) under sdpa_kernel({backend})",
                         _needs_cuda, *_sdpa(backend, True), _cuda_sdpa_backend(backend)))
    add(Provider("torch", "standard attention", "dense", "matmul + softmax + matmul in the input dtype (N x N scores)",
                 lambda s: None, lambda s: _torch_prepare(s, False),
                 lambda ctx, s, q, k, v: standard_attention(q, k, v, ctx, s.scale), lambda s: "torch"))
    add(Provider("torch-masked", "standard attention + mask", "masked",
                 "matmul + masked softmax (bool token mask) + matmul in the input dtype",
                 lambda s: None, lambda s: _torch_prepare(s, True),
                 lambda ctx, s, q, k, v: standard_attention(q, k, v, ctx, s.scale), lambda s: "torch"))
    return out


PROVIDERS: dict[str, Provider] = _make_providers()

# What a sweep runs unless --providers says otherwise (flex-dense is opt-in: the flex block-mask
# provider at density 1 is the same computation, and every extra compile costs GPU time).
DEFAULT_PROVIDERS = ("sparseflash", "sparseflash-dense", "flex", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient",
                     "sdpa-efficient-masked", "sdpa-cudnn-masked", "torch", "torch-masked")


def get_providers(names) -> list[Provider]:
    """Providers by name (a list or a comma-separated string); 'all' means every provider."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = list(names)
    if names == ["all"]:
        return list(PROVIDERS.values())
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown or not names:
        raise ValueError(f"providers must be names from {sorted(PROVIDERS)} (or 'all'), got {names!r}")
    return [PROVIDERS[n] for n in dict.fromkeys(names)]


# What a provider is when it runs on a CPU: its GPU name would claim a kernel that is not running.
_CPU_LABELS = {
    "sdpa-flash": "SDPA (CPU flash kernel)",
    "torch": "standard attention (CPU)",
    "torch-masked": "standard attention + mask (CPU)",
}


def device_label(p: Provider, s: Setting) -> str:
    """``p.label`` as it runs in ``s``: on a CPU, what actually computes (SDPA's CPU kernel, the
    PyTorch reference, which computes every block and masks, or the Triton interpreter)."""
    if s.device.type == "cuda":
        return p.label
    if p.name.startswith("sparseflash"):
        backend = p.backend(s)
        what = {"reference": "CPU reference, dense work", "triton-interpreter": "Triton interpreter"}.get(backend, backend)
        return f"{p.label} ({what})"
    return _CPU_LABELS.get(p.name, f"{p.label} (CPU)")


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {name!r}")
    return _DTYPES[name]
