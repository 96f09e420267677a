"""`sparseflash.nn.SparseAttention`: multi-head (block-sparse) self-attention as a ``torch.nn.Module``.

    attn = SparseAttention(d_model=512, n_heads=8, n_kv_heads=2, pattern="butterfly", causal=True, dropout=0.1)
    y = attn(x, key_lengths=lengths)          # x [batch, seq, d_model] -> y [batch, seq, d_model]

x -> one fused input projection to q, k, v (``qkv``: features ordered [q heads | k heads | v heads],
so with ``n_kv_heads == n_heads`` it is the usual ``Linear(d, 3d)``) -> `sparseflash.attention`
with the pattern's `BlockMask` -> output projection (``proj``). The pattern is resolved per
sequence length and device and cached, so a model that sees several lengths builds each mask once.

``pattern`` may be:

- ``None``: dense attention;
- a `BlockMask`: used as is (it fixes the sequence length);
- a name from `sparseflash.patterns` (``"butterfly"``, ``"local"`` ...) with ``pattern_kwargs``,
  called as ``generator(seq_len, block_size=block_size, device=device, **pattern_kwargs)``;
- a callable ``f(seq_len) -> BlockMask | None`` (e.g. ``functools.partial(local, window=256)`` or
  ``lambda n: BlockMask.from_fn(doc_mask, n)``), moved to the input's device;
- a list with one of the above per query head (``None`` there: that head is dense), stacked with
  `sparseflash.patterns.stack`.

Per-step selection instead of a pattern: ``topk=n`` builds the mask of every forward from the
layer's own q and k with `sparseflash.topk_blocks` (the top ``n`` key blocks of every query block
by mean-pooled q·k, ``block_size`` blocks; with ``causal`` each query block's own block on and not
counted), with ``topk_sinks`` always-on leading key blocks and, with ``topk_share_kv``, one
selection per KV head shared by its query heads (NSA). The mask is built on the device without a
host synchronisation; the selection carries no gradient.

Attention dropout (``dropout``) applies only in training. ``backend="auto"`` runs the Triton
kernels on CUDA and the PyTorch reference elsewhere (a model under the Triton interpreter would take
minutes per step; pass ``backend="triton"`` to force it). A mask built from a token-level
definition is applied exactly inside its partial blocks (see `BlockMask.partial`), as
`sparseflash.attention` does by default.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from sparseflash.mask import BlockMask

__all__ = ["SparseAttention", "resolve_pattern", "padding_to_lengths"]

_BACKENDS = ("auto", "triton", "reference")


def _zoo_generator(name: str):
    import sparseflash.patterns as zoo

    available = sorted(getattr(zoo, "__all__", []))
    gen = getattr(zoo, name, None) if name in available else None
    if not callable(gen) or name == "stack":
        raise ValueError(f"unknown pattern {name!r}: sparseflash.patterns provides "
                         f"{[a for a in available if a != 'stack']} (or 'dense')")
    return gen


def resolve_pattern(pattern, seq_len: int, *, block_size=128, device=None, pattern_kwargs: dict | None = None,
                    n_heads: int | None = None, seq_k: int | None = None) -> BlockMask | None:
    """The `BlockMask` (or None: dense) that ``pattern`` means for ``seq_len`` tokens on ``device``.

    ``pattern`` is one of the forms listed in the module docstring. A list needs ``n_heads``
    entries; its dense (None) entries take the block size of the others (``block_size`` if all are
    None). ``seq_k`` (default ``seq_len``): keys attended, for a BlockMask or a zoo name (whose
    generator must then take ``seq_k``, e.g. decoding with a KV cache).
    """
    device = torch.device("cpu" if device is None else device)
    kwargs = dict(pattern_kwargs or {})
    seq_k = seq_len if seq_k is None else seq_k
    if pattern is None:
        return None
    if isinstance(pattern, BlockMask):
        if (pattern.seq_q, pattern.seq_k) != (seq_len, seq_k):
            raise ValueError(f"pattern is a BlockMask for seq_q={pattern.seq_q}, seq_k={pattern.seq_k}, but the "
                             f"layer attends {seq_len} queries to {seq_k} keys (pass a callable for varying lengths)")
        return pattern.to(device)
    if isinstance(pattern, str):
        if pattern == "dense":
            return None
        gen = _zoo_generator(pattern)
        if seq_k != seq_len:
            if "seq_k" not in inspect.signature(gen).parameters:
                raise ValueError(f"pattern {pattern!r} is for self-attention of one length, the layer attends "
                                 f"{seq_len} queries to {seq_k} keys (decoding with a cache): use a pattern that "
                                 f"takes seq_k")
            kwargs["seq_k"] = seq_k
        try:
            mask = gen(seq_len, block_size=block_size, device=device, **kwargs)
        except TypeError as e:
            raise ValueError(f"pattern {pattern!r} rejected its arguments {pattern_kwargs or {}}: {e}") from None
        return mask.to(device)
    if isinstance(pattern, (list, tuple)):
        if n_heads is None or len(pattern) != n_heads:
            raise ValueError(f"a per-head pattern list must have one entry per query head ({n_heads}), "
                             f"got {len(pattern)}")
        masks = [resolve_pattern(p, seq_len, block_size=block_size, device=device, pattern_kwargs=kwargs)
                 for p in pattern]
        if all(m is None for m in masks):
            return None
        from sparseflash.patterns import dense, stack

        bs = next(m.block_size for m in masks if m is not None)
        return stack([dense(seq_len, block_size=bs, device=device) if m is None else m for m in masks])
    if callable(pattern):
        mask = pattern(seq_len)
        if mask is not None and not isinstance(mask, BlockMask):
            raise TypeError(f"pattern callable returned {type(mask).__name__}, expected a BlockMask or None")
        if mask is not None:
            if (mask.seq_q, mask.seq_k) != (seq_len, seq_len):
                raise ValueError(f"pattern callable returned a mask for seq_q={mask.seq_q}, seq_k={mask.seq_k}, "
                                 f"asked for {seq_len} tokens")
            mask = mask.to(device)
        return mask
    raise TypeError(f"pattern must be None, a BlockMask, a sparseflash.patterns name, a callable seq_len -> "
                    f"BlockMask or a per-head list of these, got {type(pattern).__name__}")


def padding_to_lengths(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """Key lengths ``[batch]`` (int64) from a bool ``[batch, seq]`` mask that is True at padding keys
    (``torch.nn.MultiheadAttention``'s convention). Only right padding has a length: a row whose
    padding is not a suffix raises ValueError."""
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool \
            or key_padding_mask.dim() != 2:
        raise TypeError(f"key_padding_mask must be a bool tensor [batch, seq] (True = padding), got "
                        f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)} "
                        f"{tuple(getattr(key_padding_mask, 'shape', ()))}")
    lengths = (~key_padding_mask).sum(-1)
    n = key_padding_mask.shape[-1]
    suffix = torch.arange(n, device=key_padding_mask.device)[None, :] >= lengths[:, None]
    if not torch.equal(suffix, key_padding_mask):
        raise ValueError("key_padding_mask must pad at the end of each row (right padding) to become key_lengths; "
                         "sparseflash has no token-level key mask for other layouts")
    return lengths


class SparseAttention(nn.Module):
    """Multi-head self-attention through `sparseflash.attention` (see the module docstring).

    Args:
        d_model: input and output width.
        n_heads: query heads. ``n_kv_heads``: key / value heads (default ``n_heads``; a divisor of
            it: grouped-query attention, 1 = multi-query).
        pattern: the block pattern (module docstring); ``pattern_kwargs`` go to a zoo generator.
        head_dim: default ``d_model // n_heads``.
        causal: attend only to keys ``j <= i``. ``dropout``: attention dropout (training only).
        bias: biases in both projections. ``block_size``: for patterns given by name.
        backend: ``"auto"`` (CUDA -> Triton kernels, else the PyTorch reference), ``"triton"``,
            ``"reference"``.
        topk, topk_sinks, topk_share_kv: per-step top-k selection instead of ``pattern`` (module
            docstring).

    ``forward(x, key_lengths=None, key_padding_mask=None)``: ``x [batch, seq, d_model]``;
    ``key_lengths`` int ``[batch]`` or ``key_padding_mask`` bool ``[batch, seq]`` (True = padding,
    right padding only) exclude padding keys. Returns ``[batch, seq, d_model]``.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, pattern=None, *,
                 pattern_kwargs: dict | None = None, head_dim: int | None = None, causal: bool = False,
                 dropout: float = 0.0, bias: bool = True, block_size=128, backend: str = "auto",
                 topk: int | None = None, topk_sinks: int = 0, topk_share_kv: bool = False,
                 device=None, dtype=None):
        super().__init__()
        for name, v in (("d_model", d_model), ("n_heads", n_heads)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads must be a positive divisor of n_heads={n_heads}, got {n_kv_heads!r}")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads}), or pass head_dim")
            head_dim = d_model // n_heads
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if pattern_kwargs is not None and not isinstance(pattern_kwargs, dict):
            raise TypeError(f"pattern_kwargs must be a dict or None, got {type(pattern_kwargs).__name__}")
        if isinstance(pattern, (list, tuple)) and len(pattern) != n_heads:
            raise ValueError(f"a per-head pattern list must have one entry per query head ({n_heads}), got {len(pattern)}")
        if isinstance(pattern, str) and pattern != "dense":
            _zoo_generator(pattern)  # fail early on a misspelt name
        if topk is not None:
            if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
                raise ValueError(f"topk must be None or an int >= 0 (key blocks selected per query block), got {topk!r}")
            if pattern is not None:
                raise ValueError("pass topk and pattern not together: topk selects the mask every step")
        if isinstance(topk_sinks, bool) or not isinstance(topk_sinks, int) or topk_sinks < 0:
            raise ValueError(f"topk_sinks must be an int >= 0, got {topk_sinks!r}")
        if not isinstance(topk_share_kv, bool):
            raise TypeError(f"topk_share_kv must be a bool, got {topk_share_kv!r}")
        self.topk, self.topk_sinks, self.topk_share_kv = topk, topk_sinks, topk_share_kv
        self.d_model, self.n_heads, self.n_kv_heads, self.head_dim = d_model, n_heads, n_kv_heads, head_dim
        self.pattern, self.pattern_kwargs, self.block_size = pattern, dict(pattern_kwargs or {}), block_size
        self.causal, self.dropout, self.backend = causal, float(dropout), backend
        kw = dict(device=device, dtype=dtype)
        self.qkv = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * head_dim, bias=bias, **kw)
        self.proj = nn.Linear(n_heads * head_dim, d_model, bias=bias, **kw)
        self._masks: dict = {}

    def extra_repr(self) -> str:
        pat = self.pattern if self.pattern is None or isinstance(self.pattern, str) else type(self.pattern).__name__
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, pattern={pat!r}, causal={self.causal}, dropout={self.dropout}"
                + ("" if self.topk is None else f", topk={self.topk}, topk_sinks={self.topk_sinks}, "
                                                f"topk_share_kv={self.topk_share_kv}"))

    def mask_for(self, seq_len: int, device) -> BlockMask | None:
        """The pattern's mask for ``seq_len`` tokens on ``device`` (built once, cached; the cache is
        ``self._masks``, cleared by ``reset_masks``)."""
        device = torch.device(device)
        key = (seq_len, str(device))
        if key not in self._masks:
            self._masks[key] = resolve_pattern(self.pattern, seq_len, block_size=self.block_size, device=device,
                                               pattern_kwargs=self.pattern_kwargs, n_heads=self.n_heads)
        return self._masks[key]

    def select(self, q: torch.Tensor, k: torch.Tensor) -> BlockMask:
        """This step's mask with ``topk`` (`sparseflash.topk_blocks` of the layer's q and k)."""
        from sparseflash.dynamic import topk_blocks

        group = self.n_heads // self.n_kv_heads if self.topk_share_kv else 1
        return topk_blocks(q, k, self.topk, self.block_size, self.causal, group_size=group,
                           sink_blocks=self.topk_sinks)

    def reset_masks(self) -> None:
        """Forget cached masks (after changing ``self.pattern``)."""
        self._masks.clear()

    def project(self, x: torch.Tensor):
        """q ``[B, n_heads, N, head_dim]``, k and v ``[B, n_kv_heads, N, head_dim]`` (views of one matmul)."""
        B, N, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.qkv(x)
        q = qkv[..., : H * hd].view(B, N, H, hd).transpose(1, 2)
        k = qkv[..., H * hd: (H + Hkv) * hd].view(B, N, Hkv, hd).transpose(1, 2)
        v = qkv[..., (H + Hkv) * hd:].view(B, N, Hkv, hd).transpose(1, 2)
        return q, k, v

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """Output projection of ``o [B, n_heads, N, head_dim]`` -> ``[B, N, d_model]``."""
        B, H, N, hd = o.shape
        return self.proj(o.transpose(1, 2).reshape(B, N, H * hd))

    def attend(self, q, k, v, mask: BlockMask | None, key_lengths: torch.Tensor | None = None,
               backend: str | None = None, check_key_lengths: bool | None = None) -> torch.Tensor:
        """`sparseflash.attention` with this module's causal flag, dropout (training only) and backend
        (``check_key_lengths``: as `sparseflash.attention`'s)."""
        import sparseflash

        backend = self.backend if backend is None else backend
        if backend == "auto":
            backend = "triton" if q.device.type == "cuda" else "reference"
        return sparseflash.attention(q, k, v, mask, causal=self.causal, key_lengths=key_lengths,
                                     dropout_p=self.dropout if self.training else 0.0, backend=backend,
                                     check_key_lengths=check_key_lengths)

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, seq, d_model={self.d_model}], got "
                             f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
        if key_padding_mask is not None:
            if key_lengths is not None:
                raise ValueError("pass key_lengths or key_padding_mask, not both")
            if key_padding_mask.shape != x.shape[:2]:
                raise ValueError(f"key_padding_mask must have shape [batch, seq] = {list(x.shape[:2])}, "
                                 f"got {tuple(key_padding_mask.shape)}")
            key_lengths = padding_to_lengths(key_padding_mask.to(x.device))
        q, k, v = self.project(x)
        o = self.attend(q, k, v, self.select(q, k) if self.topk is not None else self.mask_for(x.shape[1], x.device),
                        key_lengths)
        return self.output(o)
