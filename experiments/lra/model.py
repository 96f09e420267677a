"""The LRA / Path-X model: a pre-LayerNorm Transformer encoder classifier whose attention goes
through one switch.

    tokens -> token embedding + position embedding -> [pre-LN block] x L -> LayerNorm -> pool -> MLP head

- ``attention``: ``"sparseflash"`` (`sparseflash.attention`, optionally block-sparse through a
  pattern of `sparseflash.patterns`), ``"torch"`` (the textbook softmax(QK^T)V in PyTorch ops, the
  "standard attention" of the FlashAttention paper), ``"sdpa"``
  (`torch.nn.functional.scaled_dot_product_attention`) or ``"flex"`` (FlexAttention).
  Every backend computes the same function: the pattern (if any) and the padding mask apply to all
  of them, so one set of weights gives the same logits under each (tests check this).
- Padding: keys ``j >= length`` are excluded (``key_lengths`` for sparseflash, a boolean mask for
  torch / sdpa, a ``mask_mod`` for flex) and mean pooling averages only real tokens, so the values
  of padded tokens cannot change the output. A query row that attends to nothing (possible with a
  pattern and padding) outputs 0, sparseflash's rule; torch / sdpa get the same by letting such a
  row see key 0 and zeroing its output, which keeps their softmax free of NaN.
- Position embeddings: ``"learned"`` (one vector per position), ``"sinusoidal"`` (fixed),
  ``"grid"`` (a learned ``[H, W, d]`` table for pixel tasks, read row-major; `upsample_grid` maps
  it to a finer grid, which is how the Path-X / Path-256 recipe initialises a larger model),
  ``"grid_sincos"`` (fixed 2-D sinusoids added to the input) and ``"grid_rope"`` (no table: 2-D
  rotary encoding of queries and keys, `GridRotary`, so attention scores depend on the row and
  column *offset* between two pixels; it has no parameters, so it carries over to any grid).
- Pooling: ``"mean"`` over real tokens or ``"cls"`` (a learned token prepended, so the encoder
  sees ``seq_len + 1`` positions and the pattern is built for that length).
- ``conv_stem`` (pixel tasks, not part of any published LRA recipe): that many residual 3x3
  convolutions over the embedded grid before the first attention block (`_ConvStem`), so each
  pixel sees its neighbours' gray levels and a marker disk or a dash is a local feature.
- ``black_is_padding`` (pixel tasks): black pixels are padding, as the released LRA pipelines
  treat them: their token ids are raw gray levels, and both LRA's encoder (``inputs > 0``) and the
  Nystromformer code the FlashAttention paper builds on (``input_ids != 0``) mask id 0 as padding,
  so attention runs over the drawn pixels only. Here the kept pixels (gray level > 0, token id > 1)
  are packed to the front of each sequence in raster order after the embeddings are added, the
  encoder attends with ``key_lengths`` = their count (every backend, exactly the masked attention
  for dense), the final outputs go back to their pixels with black pixels' outputs zeroed, and
  mean pooling divides by all ``seq_len`` positions (the reference's ``norm(x) * mask`` then mean).
  A block pattern then applies to the packed sequence (blocks of drawn pixels in raster order),
  not to pixel positions. The encoder runs on the packed sequence trimmed to the batch's widest
  image (rounded up to the block size; a pattern's top-left corner of that size): the same
  function, since no row attends past its image's count, at a fraction of the cost (Path-X images
  draw ~13% of their pixels: ~2.2K of 16K tokens).
  With ``conv_stem`` too, the stem runs on the whole grid first, so black pixels still pass their
  neighbours' gray levels into the drawn pixels' vectors (only attention and pooling skip them).
- ``dual=True`` (Retrieval): both documents go through the same encoder and the head sees
  ``[u, v, u * v, u - v]``.
- `LRADenoiser`, for self-pretraining (``train.objective="denoise"``): the same encoder, a learned
  vector in place of the embedding of masked tokens (`mask_positions` picks them), and a token
  prediction head at every position; `load_pretrained` moves the encoder between the two.

Attention dropout is applied only in training. FlexAttention has no dropout: with ``flex`` the
attention dropout is ignored (a warning says so); the residual / FFN dropout still applies.
On CPU ``backend="auto"`` runs sparseflash through its PyTorch reference (running a whole model
under the Triton interpreter would take minutes per step); on CUDA through the Triton kernels.
"""

from __future__ import annotations

import ast
import contextlib
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from sparseflash.api import key_lengths_range
from sparseflash.mask import BlockMask
from sparseflash.nn import SparseAttention, resolve_pattern

__all__ = [
    "ATTENTIONS", "ModelConfig", "LRAClassifier", "LRADenoiser", "mask_positions", "AttentionKernel", "build_pattern",
    "parse_pattern_spec", "upsample_grid", "load_pretrained", "GridRotary", "kept_pixels", "packed_width", "host_plan",
]

ATTENTIONS = ("sparseflash", "torch", "sdpa", "flex")
POS_EMBS = ("learned", "sinusoidal", "grid", "grid_sincos", "grid_rope", "none")
AUGMENTS = (None, "dihedral")
EMBEDS = ("table", "pixel")
POOLINGS = ("mean", "cls")
SPARSEFLASH_BACKENDS = ("auto", "triton", "reference")


@dataclass
class ModelConfig:
    vocab_size: int = 0  # including the pad token (id 0); 0 = take it from the dataset
    num_classes: int = 2
    seq_len: int = 1024  # tokens per input (per document for dual)
    d_model: int = 64
    n_heads: int = 2
    n_layers: int = 2
    d_ff: int = 128
    dropout: float = 0.1
    attn_dropout: float = 0.1
    pos_emb: str = "learned"
    grid: tuple[int, int] | None = None  # (H, W) with H * W == seq_len, for pos_emb="grid*"
    rope_base: float = 100.0  # pos_emb="grid_rope": frequencies base ** (-i / (head_dim / 4)), i < head_dim / 4
    pooling: str = "mean"
    dual: bool = False
    head_hidden: int | None = None  # hidden width of the classifier MLP (default d_ff)
    attention: str = "sparseflash"
    pattern: str | None = None  # a generator of sparseflash.patterns; None or "dense": dense
    pattern_kwargs: dict = field(default_factory=dict)
    block_size: int = 128
    backend: str = "auto"  # sparseflash backend: auto | triton | reference
    augment: str | None = None  # "dihedral": a random flip / 90-degree turn of the grid per example in training
    embed: str = "table"  # "table": a learned vector per token id; "pixel": an affine map of (id - 1) / 255
    black_is_padding: bool = False  # pixel tasks: gray level 0 (token id 1) is padding, as the released pipelines treat it
    conv_stem: int = 0  # pixel tasks: this many residual 3x3 convolutions over the embedded grid before the encoder

    def validate(self) -> "ModelConfig":
        for name in ("vocab_size", "num_classes", "seq_len", "d_model", "n_heads", "n_layers", "d_ff", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"model.{name} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        for name in ("dropout", "attn_dropout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"model.{name} must be a float in [0, 1), got {v!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"model.attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.pos_emb not in POS_EMBS:
            raise ValueError(f"model.pos_emb must be one of {POS_EMBS}, got {self.pos_emb!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"model.pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.backend not in SPARSEFLASH_BACKENDS:
            raise ValueError(f"model.backend must be one of {SPARSEFLASH_BACKENDS}, got {self.backend!r}")
        if self.embed not in EMBEDS:
            raise ValueError(f"model.embed must be one of {EMBEDS}, got {self.embed!r}")
        if self.embed == "pixel" and self.vocab_size != 257:
            raise ValueError(f"model.embed='pixel' reads token ids as gray levels + 1 (vocab 257), got vocab {self.vocab_size}")
        if not isinstance(self.black_is_padding, bool):
            raise TypeError(f"model.black_is_padding must be a bool, got {self.black_is_padding!r}")
        if self.black_is_padding and (self.vocab_size != 257 or self.grid is None or self.dual):
            raise ValueError(f"model.black_is_padding is for pixel tasks (token ids gray levels + 1, vocab 257, a "
                             f"model.grid, not dual), got vocab {self.vocab_size}, grid {self.grid}, dual {self.dual}")
        if self.black_is_padding and self.pos_emb == "grid_rope":
            raise ValueError("model.black_is_padding packs the kept pixels to the front, which model.pos_emb='grid_rope' "
                             "(rotations by sequence index) cannot follow; use a position table")
        if isinstance(self.conv_stem, bool) or not isinstance(self.conv_stem, int) or self.conv_stem < 0:
            raise ValueError(f"model.conv_stem must be a non-negative int, got {self.conv_stem!r}")
        if self.augment not in AUGMENTS:
            raise ValueError(f"model.augment must be one of {AUGMENTS}, got {self.augment!r}")
        if self.pos_emb.startswith("grid") or self.augment == "dihedral" or self.conv_stem:
            g = self.grid
            if (not isinstance(g, (tuple, list)) or len(g) != 2
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in g)):
                raise ValueError(f"model.grid must be a pair (H, W) of positive ints for pos_emb={self.pos_emb!r}, "
                                 f"augment={self.augment!r} and conv_stem={self.conv_stem!r}, got {g!r}")
            if g[0] * g[1] != self.seq_len:
                raise ValueError(f"model.grid {tuple(g)} has {g[0] * g[1]} cells but model.seq_len is {self.seq_len}")
        if self.pos_emb == "grid_rope":
            hd = self.d_model // self.n_heads
            if hd % 4:
                raise ValueError(f"model.pos_emb='grid_rope' needs a head dim divisible by 4 (rows and columns each "
                                 f"rotate pairs of channels), got d_model {self.d_model} / n_heads {self.n_heads} = {hd}")
            if isinstance(self.rope_base, bool) or not isinstance(self.rope_base, (int, float)) or self.rope_base <= 1:
                raise ValueError(f"model.rope_base must be a number > 1, got {self.rope_base!r}")
        if self.head_hidden is not None and (not isinstance(self.head_hidden, int) or self.head_hidden <= 0):
            raise ValueError(f"model.head_hidden must be a positive int or None, got {self.head_hidden!r}")
        if not isinstance(self.pattern_kwargs, dict):
            raise TypeError(f"model.pattern_kwargs must be a dict, got {type(self.pattern_kwargs).__name__}")
        if self.pattern is not None and not isinstance(self.pattern, str):
            raise TypeError(f"model.pattern must be a pattern name or None, got {self.pattern!r}")
        return self

    @property
    def attn_len(self) -> int:
        """Positions the encoder attends over: seq_len, plus one with a CLS token."""
        return self.seq_len + (self.pooling == "cls")


# ---------------------------------------------------------------------------------------- patterns
def parse_pattern_spec(spec: str | None) -> tuple[str | None, dict]:
    """``"butterfly:n_factors=2,global_blocks=1"`` -> ``("butterfly", {"n_factors": 2, "global_blocks": 1})``.

    ``None``, ``""`` and ``"dense"`` mean no pattern. Values are Python literals, else strings.
    """
    if spec is None or spec == "" or spec == "dense":
        return None, {}
    if not isinstance(spec, str):
        raise TypeError(f"pattern spec must be a string like 'butterfly:n_factors=2', got {spec!r}")
    name, _, rest = spec.partition(":")
    kwargs = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"pattern argument {item!r} in {spec!r} must look like key=value")
        kwargs[key.strip()] = _literal(value.strip())
    return name.strip(), kwargs


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def build_pattern(name: str | None, seq_len: int, block_size: int = 128, device=None, **kwargs) -> BlockMask | None:
    """The `BlockMask` of pattern ``name`` (a generator of `sparseflash.patterns`) for ``seq_len``
    tokens, or ``None`` for dense (``name`` None or ``"dense"``): `sparseflash.nn.resolve_pattern`."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"pattern must be a sparseflash.patterns name or None, got {name!r}")
    return resolve_pattern(name, seq_len, block_size=block_size, device=device, pattern_kwargs=kwargs)


# --------------------------------------------------------------------------------------- attention
_FLEX = {}


def _flex_fn(device: torch.device):
    """flex_attention, compiled on CUDA (eager flex is an unfused O(N^2) fallback meant for
    debugging) and eager elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _FLEX:
        import torch._dynamo

        # Sweeps over shapes would otherwise hit the recompile limit and fall back to the slow path.
        cfg = torch._dynamo.config
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, knob):
                setattr(cfg, knob, max(getattr(cfg, knob), 64))
        _FLEX["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["cuda"]


class AttentionKernel:
    """Attention of one kind for one batch: the masks each backend needs are built once here and
    shared by every layer.

    ``mask`` is the block pattern for the attended length (or None), ``key_lengths`` int ``[batch]``
    (or None: no padding). Call with ``q, k, v`` ``[batch, heads, seq, head_dim]`` and ``dropout_p``.
    """

    def __init__(self, kind: str, seq_len: int, batch: int, device, *, mask: BlockMask | None = None,
                 key_lengths: torch.Tensor | None = None, backend: str = "auto", flex_cache: dict | None = None):
        if kind not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {kind!r}")
        device = torch.device(device)
        self.kind, self.mask, self.key_lengths = kind, mask, key_lengths
        self.allowed = self.empty = self.flex_mask = None
        if mask is not None:
            mask = self.mask = mask.to(device)
            if (mask.seq_q, mask.seq_k) != (seq_len, seq_len):
                raise ValueError(f"pattern was built for {mask.seq_q} tokens, attention runs over {seq_len}")
        if kind == "sparseflash":
            if backend == "auto":
                backend = "triton" if device.type == "cuda" else "reference"
            self.backend = backend
        elif kind in ("torch", "sdpa"):
            self._build_bool_mask(seq_len, device)
        else:
            self._build_flex_mask(seq_len, batch, device, flex_cache)

    def _build_bool_mask(self, n: int, device) -> None:
        allowed = None
        if self.mask is not None:
            allowed = self.mask.to_dense()  # [B', H', n, n]
        if self.key_lengths is not None:
            keys = torch.arange(n, device=device)[None, :] < self.key_lengths.to(device)[:, None]
            keys = keys[:, None, None, :]  # [B, 1, 1, n]
            allowed = keys if allowed is None else allowed & keys
        if allowed is None:
            return
        empty = ~allowed.any(dim=-1, keepdim=True)
        # Rows that see nothing look at key 0 instead (output zeroed below): no NaN from softmax.
        first = torch.zeros(n, dtype=torch.bool, device=device)
        first[0] = True
        self.allowed = allowed | (empty & first)
        self.empty = empty

    def _build_flex_mask(self, n: int, batch: int, device, cache: dict | None) -> None:
        if self.mask is None and self.key_lengths is None:
            return
        key = (n, str(device)) if self.key_lengths is None and cache is not None else None
        if key is not None and key in cache:
            self.flex_mask = cache[key]
            return
        mask = self.mask
        block = mask.block_size if mask is not None else (128, 128)
        if self.key_lengths is not None:
            lengths = self.key_lengths.to(device)
            padding = BlockMask.from_fn(lambda b, h, q_idx, kv_idx: kv_idx < lengths[b], n, n, block_size=block,
                                        batch=batch, device=device)
            mask = padding if mask is None else mask & padding
        # Unpadded whole blocks of a pattern become Flex's full blocks (the compiled kernel never calls
        # mask_mod); elsewhere mask_mod is exact at token level. Compiled flex wants tiles that are
        # multiples of 128 (smaller ones fail to lower in torch 2.11): coarser tiles pool ours.
        tile = None if block[0] % 128 == 0 and block[1] % 128 == 0 else 128
        self.flex_mask = mask.to_flex(block_size=tile, device=device)
        if key is not None:
            cache[key] = self.flex_mask

    def __call__(self, q, k, v, dropout_p: float = 0.0) -> torch.Tensor:
        if self.kind == "sparseflash":
            import sparseflash

            return sparseflash.attention(q, k, v, self.mask, key_lengths=self.key_lengths, dropout_p=dropout_p,
                                         backend=self.backend)
        if self.kind == "flex":
            flex_attention = _flex_fn(q.device)
            return flex_attention(q, k, v, block_mask=self.flex_mask)
        if self.kind == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed, dropout_p=dropout_p)
        else:
            s = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
            if self.allowed is not None:
                s = s.masked_fill(~self.allowed, float("-inf"))
            p = torch.softmax(s, dim=-1)
            if dropout_p > 0:
                p = F.dropout(p, dropout_p)
            out = torch.matmul(p.to(v.dtype), v)
        if self.empty is not None:
            out = out.masked_fill(self.empty, 0.0)
        return out


# ------------------------------------------------------------------------------------------ model
class SelfAttention(SparseAttention):
    """`sparseflash.nn.SparseAttention` (its ``qkv`` / ``proj`` projections, its sparseflash call with
    dropout in training only) whose attention may also run through the other backends: the pattern
    and padding come from the batch's `AttentionKernel`, shared by every layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.d_model, cfg.n_heads, dropout=cfg.attn_dropout, block_size=cfg.block_size,
                         backend=cfg.backend)

    def forward(self, x: torch.Tensor, attend: AttentionKernel, rope: "GridRotary | None" = None) -> torch.Tensor:
        q, k, v = self.project(x)
        if rope is not None:
            q, k = rope(q), rope(k)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if attend.kind == "sparseflash":
            # the lengths were checked once for the whole step (Encoder.features)
            o = self.attend(q, k, v, attend.mask, attend.key_lengths, backend=attend.backend, check_key_lengths=False)
        else:
            o = attend(q, k, v, self.dropout if self.training else 0.0)
        return self.output(o)


class Block(nn.Module):
    """Pre-LN: x + Drop(Attn(LN(x))), then x + Drop(FFN(LN(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        self.ffn = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Dropout(cfg.dropout),
                                 nn.Linear(cfg.d_ff, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, attend, rope=None):
        x = x + self.drop(self.attn(self.ln1(x), attend, rope))
        return x + self.drop(self.ffn(self.ln2(x)))


def _sincos(pos: torch.Tensor, d: int) -> torch.Tensor:
    """The Transformer's sinusoids of positions ``pos`` [n] in ``d`` channels: [n, d] (sin, cos interleaved)."""
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float64) / d)
    table = torch.zeros(pos.numel(), d, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos[:, None] * freq)
    table[:, 1::2] = torch.cos(pos[:, None] * freq[: d // 2])
    return table


def dihedral_permutations(rows: int, cols: int) -> torch.Tensor:
    """[k, rows * cols] index maps of the symmetries of a ``rows x cols`` grid read row-major: the 8
    flips and quarter turns of a square (4 of a rectangle: no transposes). ``tokens.gather(1, perm)``
    applies one; the identity is row 0. A Pathfinder label (are the two markers on one path?) is
    invariant under all of them."""
    idx = torch.arange(rows * cols).view(rows, cols)
    maps = []
    for t in ((False, True) if rows == cols else (False,)):
        base = idx.t() if t else idx
        for fy in (False, True):
            for fx in (False, True):
                m = base.flip(0) if fy else base
                maps.append((m.flip(1) if fx else m).flatten())
    return torch.stack(maps)


class GridRotary(nn.Module):
    """2-D rotary position encoding (RoPE on two axes) for queries and keys ``[B, H, n, head_dim]``.

    Channel pair ``(i, i + head_dim / 2)`` is turned by the angle ``row * f_i`` for ``i < head_dim /
    4`` and ``col * f_(i - head_dim / 4)`` above, ``f_j = base ** (-j / (head_dim / 4))``: the score
    of query p and key q then depends on their contents and on (row_p - row_q, col_p - col_q) only,
    a locality prior that an absolute table has to learn. Cells are read row-major; ``offset``
    leading positions (a CLS token) are not turned. The turn is computed in float32."""

    def __init__(self, grid: tuple[int, int], head_dim: int, base: float = 100.0, offset: int = 0):
        super().__init__()
        rows, cols = grid
        quarter = head_dim // 4
        freq = base ** (-torch.arange(quarter, dtype=torch.float64) / quarter)
        r, c = torch.meshgrid(torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64),
                              indexing="ij")
        angle = torch.cat([r.flatten()[:, None] * freq, c.flatten()[:, None] * freq], dim=1)  # [rows*cols, hd/2]
        angle = torch.cat([angle.new_zeros(offset, angle.shape[1]), angle])
        self.register_buffer("cos", angle.cos().float(), persistent=False)
        self.register_buffer("sin", angle.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, half = x.shape[-2], x.shape[-1] // 2
        if n != self.cos.shape[0] or half != self.cos.shape[1]:
            raise ValueError(f"rotary encoding covers {self.cos.shape[0]} positions of head dim {2 * self.cos.shape[1]}, "
                             f"got {n} positions of head dim {x.shape[-1]}")
        x1, x2 = x.float().split(half, dim=-1)
        cos, sin = self.cos, self.sin
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class PositionEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.pos_emb
        n, d = cfg.seq_len, cfg.d_model
        if self.kind == "learned":
            self.table = nn.Parameter(torch.randn(n, d) * 0.02)
        elif self.kind == "grid":
            self.grid = nn.Parameter(torch.randn(*cfg.grid, d) * 0.02)
        elif self.kind == "sinusoidal":
            self.register_buffer("table", _sincos(torch.arange(n, dtype=torch.float64), d).float(), persistent=False)
        elif self.kind == "grid_sincos":
            # Fixed 2-D encoding: the first half of the channels encode the row, the second half the
            # column, each with the 1-D sinusoids; attention sees both offsets from the first step.
            rows, cols = cfg.grid
            r, c = torch.meshgrid(torch.arange(rows, dtype=torch.float64), torch.arange(cols, dtype=torch.float64),
                                  indexing="ij")
            half = d // 2
            table = torch.cat([_sincos(r.flatten(), half), _sincos(c.flatten(), d - half)], dim=1)
            self.register_buffer("table", table.float(), persistent=False)

    def forward(self, n: int) -> torch.Tensor | None:
        if self.kind in ("none", "grid_rope"):
            return None
        table = self.grid.flatten(0, 1) if self.kind == "grid" else self.table
        if n > table.shape[0] or (self.kind.startswith("grid") and n != table.shape[0]):
            raise ValueError(f"input has {n} tokens but the {self.kind} position embedding covers {table.shape[0]}")
        return table[:n]


class _PixelEmbedding(nn.Module):
    """Token id t (a gray level + 1; 0 is padding) -> w * (t - 1) / 255 + b, and 0 for padding."""

    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(1, d)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        level = ((tokens - 1).clamp(min=0).to(self.proj.weight.dtype) / 255)[..., None]
        return self.proj(level) * (tokens != 0)[..., None]


class _ConvStem(nn.Module):
    """x + Conv3x3(GELU(LayerNorm(x))) over the ``H x W`` grid of token vectors (read row-major):
    each pixel sees its 8 neighbours before any attention, as in convolution-stem Transformers.
    The convolution starts at zero, so a new stem is the identity."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.conv = nn.Conv2d(d, d, 3, padding=1)
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)

    def forward(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:  # x [B, H*W, d]
        B, N, d = x.shape
        y = F.gelu(self.norm(x)).transpose(1, 2).reshape(B, d, H, W)
        return x + self.conv(y).flatten(2).transpose(1, 2)


def kept_pixels(tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """black_is_padding: the pixels the encoder keeps, bool ``[B, N]``: drawn (gray level > 0, token
    id > 1; id 0 is padding) and inside each row's length."""
    keep = tokens > 1
    if lengths is not None:
        keep &= torch.arange(tokens.shape[-1], device=tokens.device)[None, :] < lengths[:, None]
    return keep


def packed_width(longest: int, seq_len: int, block_size: int) -> int:
    """The width the black_is_padding encoder runs on: the batch's longest kept count rounded up to
    the block size (at least one block), at most ``seq_len``."""
    return min(seq_len, max(1, -(-int(longest) // block_size)) * block_size)


def host_plan(cfg: ModelConfig, tokens: torch.Tensor, lengths: torch.Tensor | None) -> tuple[int, bool]:
    """What the encoder would read back from the device for this batch, computed on the host from
    the batch's CPU tensors: (the attended width before a CLS token, whether nothing in it is padding).

    The width is `packed_width` of the longest kept count with ``black_is_padding``, else
    ``seq_len``; "nothing is padding" is every key length (the kept counts with
    ``black_is_padding``) reaching that width, where the encoder drops the lengths. Under
    `Encoder.planned` with this plan the encoder reads nothing back (CUDA-graph capture) and
    computes what it computes unplanned. Also does the input checks that read values (lengths in
    range; ``augment="dihedral"`` needs unpadded inputs), on the host."""
    N = tokens.shape[-1]
    flat_len = None if lengths is None else lengths.reshape(-1)
    if flat_len is not None and flat_len.numel() and (int(flat_len.min()) < 0 or int(flat_len.max()) > N):
        raise ValueError(f"lengths must lie in [0, {N}], got values in [{int(flat_len.min())}, {int(flat_len.max())}]")
    if cfg.augment == "dihedral" and flat_len is not None and bool((flat_len < N).any()):
        raise ValueError("augment='dihedral' needs unpadded grid inputs (every length == seq_len)")
    if cfg.black_is_padding:
        counts = kept_pixels(tokens.reshape(-1, N), flat_len).sum(1)
        width = packed_width(int(counts.max()), N, cfg.block_size)
        return width, bool((counts >= width).all())
    return N, flat_len is None or bool((flat_len >= N).all())


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.embed == "pixel":  # intensity as a number (as S4 / Mega feed images), not one of 256 symbols
            self.embed = _PixelEmbedding(cfg.d_model)
        else:
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            nn.init.normal_(self.embed.weight, std=0.02)
        self.pos = PositionEmbedding(cfg)
        self.stem = nn.ModuleList(_ConvStem(cfg.d_model) for _ in range(cfg.conv_stem))
        self.rope = (GridRotary(cfg.grid, cfg.d_model // cfg.n_heads, cfg.rope_base, offset=int(cfg.pooling == "cls"))
                     if cfg.pos_emb == "grid_rope" else None)
        self.cls = nn.Parameter(torch.randn(cfg.d_model) * 0.02) if cfg.pooling == "cls" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self._masks: dict = {}  # (attended length, device) -> BlockMask | None
        self._flex_cache: dict = {}
        self._plan: tuple[int, bool] | None = None  # `planned`: (width, nothing is padding) from the host

    @contextlib.contextmanager
    def planned(self, width: int, no_padding: bool):
        """Inside, the encoder takes the attended width and the "nothing is padding" decision from
        `host_plan` instead of reading the device (``int(packed.max())``, the key-length check), so
        a forward can be captured in a CUDA graph. The plan must be the batch's own (`host_plan`)
        or a wider one with ``no_padding=False``: black pixels past every count are attended by no
        row and their outputs are zeroed, so a wider width computes the same function."""
        previous, self._plan = self._plan, (int(width), bool(no_padding))
        try:
            yield
        finally:
            self._plan = previous

    def pattern_mask(self, n: int, device) -> BlockMask | None:
        """The block pattern for ``n`` attended positions on ``device`` (built once, cached)."""
        key = (n, str(device))
        if key not in self._masks:
            cfg = self.cfg
            self._masks[key] = build_pattern(cfg.pattern, n, cfg.block_size, device=device, **cfg.pattern_kwargs)
        return self._masks[key]

    def pattern_corner(self, n_full: int, n: int, device) -> BlockMask | None:
        """The top-left ``n x n`` corner of the pattern for ``n_full`` positions (cached): what the
        full pattern computes for the first ``n`` rows and keys."""
        full = self.pattern_mask(n_full, device)
        if full is None or n == n_full:
            return full
        key = ("corner", n_full, n, str(device))
        if key not in self._masks:
            bq, bk = full.block_size
            layout = full.layout[..., :math.ceil(n / bq), :math.ceil(n / bk)]
            self._masks[key] = BlockMask.from_layout(layout, full.block_size, seq_q=n, seq_k=n)
        return self._masks[key]

    def _pack(self, tokens: torch.Tensor, lengths: torch.Tensor | None):
        """black_is_padding: (order ``[B, N]`` putting drawn pixels first in raster order, their
        count ``[B]``, and the width the encoder runs on: the longest count rounded up to the block
        size). Rows past a count are black pixels: trimming them is exact, since no row attends to
        them (key lengths) and their outputs are zeroed. One device read per call, as the length
        check; under torch.compile that read is a graph break, and each width a recompile (a few).
        Under `planned` the width is the host's and nothing is read."""
        keep = kept_pixels(tokens, lengths)  # [B, N]
        order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # [B, N]
        packed = keep.sum(1)
        if self._plan is not None:  # computed on the host (`planned`): no device read
            return order, packed, self._plan[0]
        return order, packed, packed_width(int(packed.max()), tokens.shape[1], self.cfg.block_size)

    def _encode(self, tokens: torch.Tensor, lengths: torch.Tensor | None, masked: torch.Tensor | None = None,
                mask_vector: torch.Tensor | None = None):
        """The encoder's outputs after the final LayerNorm, ``[B, n, d]``, the key lengths it used,
        and for black_is_padding (order, count) of the packed pixels (else None, None): then the
        outputs are the packed drawn pixels, trimmed to the widest image of the batch."""
        B, N = tokens.shape
        order = packed = None
        pos = self.pos(N)
        if self.cfg.black_is_padding and not len(self.stem):  # embed only the kept pixels
            order, packed, width = self._pack(tokens, lengths)
            sel = order[:, :width]
            x = self.embed(tokens.gather(1, sel))
            if pos is not None:
                x = x + pos[sel].to(x.dtype)
            lengths = packed
        else:
            x = self.embed(tokens)
            if masked is not None:
                x = torch.where(masked[..., None], mask_vector.to(x.dtype), x)
            if pos is not None:
                x = x + pos.to(x.dtype)
            if len(self.stem):
                H, W = self.cfg.grid
                if N != H * W:
                    raise ValueError(f"model.conv_stem needs the whole {H}x{W} grid, got {N} tokens")
                for conv in self.stem:
                    x = conv(x, H, W)
            if self.cfg.black_is_padding:  # the stem saw the whole grid; attention sees the drawn pixels
                order, packed, width = self._pack(tokens, lengths)
                sel = order[:, :width]
                x = x.gather(1, sel[..., None].expand(B, width, x.shape[-1]))
                lengths = packed
        m = x.shape[1]  # attended positions before the CLS token
        # one device read per step (the layers skip sparseflash's own check); none under a host plan
        if lengths is not None:
            if self._plan is not None:
                no_padding = self._plan[1]
            else:
                no_padding = not torch.compiler.is_compiling() and key_lengths_range(lengths, m, "lengths")[0] >= m
            if no_padding:
                lengths = None  # nothing is padding: skip building masks (pixel tasks, speed runs)
        if self.cls is not None:
            x = torch.cat([self.cls.to(x.dtype).expand(B, 1, -1), x], dim=1)
            lengths = None if lengths is None else lengths + 1
        x = self.drop(x)
        n = x.shape[1]
        c = int(self.cls is not None)
        attend = AttentionKernel(self.cfg.attention, n, B, x.device, mask=self.pattern_corner(N + c, n, x.device),
                                 key_lengths=lengths, backend=self.cfg.backend, flex_cache=self._flex_cache)
        for block in self.blocks:
            x = block(x, attend, self.rope)
        return self.norm(x), lengths, order, packed

    def features(self, tokens: torch.Tensor, lengths: torch.Tensor | None, masked: torch.Tensor | None = None,
                 mask_vector: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-position outputs ``[B, n, d]`` after the final LayerNorm (``n = N + 1`` with a CLS
        token, at position 0) and the key lengths the attention used (None: no padding).

        ``masked`` (bool ``[B, N]``) with ``mask_vector`` (``[d]``): those positions get the vector
        instead of their token embedding (their position embedding is still added)."""
        x, lengths, order, packed = self._encode(tokens, lengths, masked, mask_vector)
        if order is None:
            return x, lengths
        # back to pixel positions, black pixels' outputs zeroed
        B, N = tokens.shape
        c = int(self.cls is not None)
        body = self._kept_outputs(x[:, c:], packed)
        full = body.new_zeros(B, N, body.shape[-1])
        full.scatter_(1, order[:, :body.shape[1], None].expand_as(body), body)
        return torch.cat([x[:, :c], full], dim=1), None  # every position is defined (zero for black pixels)

    @staticmethod
    def _kept_outputs(body: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        kept = torch.arange(body.shape[1], device=body.device)[None, :] < packed[:, None]
        return body * kept[..., None]

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        """The pooled representation ``[B, d]``: the CLS output, or the mean over real tokens."""
        x, lengths, order, packed = self._encode(tokens, lengths)
        if self.cls is not None:
            return x[:, 0]
        if order is not None:  # the mean over all seq_len positions, black ones 0
            return self._kept_outputs(x, packed).sum(1) / tokens.shape[1]
        if lengths is None:
            return x.mean(dim=1)
        n = x.shape[1]
        valid = (torch.arange(n, device=x.device)[None, :] < lengths[:, None]).to(x.dtype)
        return (x * valid[..., None]).sum(1) / lengths.clamp(min=1)[:, None].to(x.dtype)


class _LRAModel(nn.Module):
    """What the classifier and the denoiser share: the config check, the encoder, input checks and
    the dihedral augmentation."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        if cfg.attention == "flex" and cfg.attn_dropout > 0:
            warnings.warn(f"FlexAttention has no attention dropout: attn_dropout={cfg.attn_dropout} is ignored "
                          f"(residual and FFN dropout still apply)", stacklevel=3)
        self.encoder = Encoder(cfg)
        if cfg.augment == "dihedral":
            self.register_buffer("_dihedral", dihedral_permutations(*cfg.grid), persistent=False)

    def pattern_mask(self, device="cpu") -> BlockMask | None:
        return self.encoder.pattern_mask(self.cfg.attn_len, device)

    def _check(self, tokens: torch.Tensor, lengths: torch.Tensor | None) -> None:
        cfg = self.cfg
        want = 3 if cfg.dual else 2
        if tokens.dim() != want or (cfg.dual and tokens.shape[1] != 2):
            raise ValueError(f"tokens must be {'[batch, 2, seq]' if cfg.dual else '[batch, seq]'}, got {tuple(tokens.shape)}")
        if lengths is not None and lengths.shape != tokens.shape[:-1]:
            raise ValueError(f"lengths must have shape {tuple(tokens.shape[:-1])}, got {tuple(lengths.shape)}")

    def _symmetry(self, tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor | None:
        """In training with ``augment="dihedral"``: one grid symmetry per example, ``[B, N]`` index
        maps (``tokens.gather(-1, perm)`` applies it); else None."""
        if self.cfg.augment != "dihedral" or not self.training:
            return None
        # under a host plan `host_plan` checked this on the host (a read here would break a CUDA-graph capture)
        if lengths is not None and self.encoder._plan is None and bool((lengths < tokens.shape[-1]).any()):
            raise ValueError("augment='dihedral' needs unpadded grid inputs (every length == seq_len)")
        # one symmetry per example, drawn from torch's generator on the device (checkpointed)
        pick = torch.randint(self._dihedral.shape[0], tokens.shape[:1], device=tokens.device)
        return self._dihedral[pick]


class LRAClassifier(_LRAModel):
    """Encoder + MLP head. ``forward(tokens, lengths=None)`` with tokens ``[B, N]`` (``[B, 2, N]``
    and lengths ``[B, 2]`` when ``dual``) returns logits ``[B, num_classes]``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hidden = cfg.head_hidden or cfg.d_ff
        width = 4 * cfg.d_model if cfg.dual else cfg.d_model
        self.head = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, cfg.num_classes))

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        self._check(tokens, lengths)
        perm = self._symmetry(tokens, lengths)
        if perm is not None:
            tokens = tokens.gather(-1, perm if tokens.dim() == 2 else perm[:, None].expand_as(tokens))
        if not cfg.dual:
            return self.head(self.encoder(tokens, lengths))
        B = tokens.shape[0]
        # Both documents in one pass of the shared encoder: [2B, N], rows 0..B-1 are the first docs.
        z = self.encoder(tokens.transpose(0, 1).flatten(0, 1),
                         None if lengths is None else lengths.transpose(0, 1).flatten())
        u, v = z[:B], z[B:]
        return self.head(torch.cat([u, v, u * v, u - v], dim=-1))


class LRADenoiser(_LRAModel):
    """Encoder + token-prediction head, for self-pretraining (``train.objective="denoise"``).

    ``forward(tokens, lengths=None, masked=None)``: the positions where the bool ``masked`` (shape
    of ``tokens``) is True get the learned ``mask_embed`` vector in place of their token embedding
    (both ``model.embed`` kinds); the encoder runs as in the classifier (same attention, pattern,
    positions, padding); the head maps every position's output to logits over the vocabulary,
    ``[B, N, vocab]`` (``[B, 2, N, vocab]`` when ``dual``: each document is a sequence of its
    own). The loss (train.py) is the cross-entropy at the masked positions only.

    The head is BERT's masked-LM head, untied: Linear(d, d), GELU, LayerNorm, Linear(d, vocab).
    Untied, because ``model.embed="pixel"`` has no table to tie to and because the head is thrown
    away at fine-tuning: its transform takes the token-specific last step off the encoder's final
    layer, and the embedding table the classifier inherits gets no gradient but the encoder's.
    With ``augment="dihedral"`` the symmetry is applied to tokens and mask together and undone on
    the outputs, so logits stay aligned with the input positions.
    """

    def __init__(self, cfg: ModelConfig):
        if cfg.black_is_padding:
            raise ValueError("model.black_is_padding is for classifiers: the denoiser predicts every pixel, black ones included")
        super().__init__(cfg)
        d = cfg.d_model
        self.mask_embed = nn.Parameter(torch.randn(d) * 0.02)
        self.denoise_head = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d), nn.Linear(d, cfg.vocab_size))

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                masked: torch.Tensor | None = None) -> torch.Tensor:
        self._check(tokens, lengths)
        if masked is not None and (masked.shape != tokens.shape or masked.dtype != torch.bool):
            raise ValueError(f"masked must be a bool tensor of shape {tuple(tokens.shape)}, "
                             f"got {masked.dtype} {tuple(masked.shape)}")
        shape = tokens.shape
        N = shape[-1]
        tokens = tokens.reshape(-1, N)  # dual: each document on its own
        lengths = None if lengths is None else lengths.reshape(-1)
        masked = None if masked is None else masked.reshape(-1, N)
        perm = self._symmetry(tokens, lengths)
        if perm is not None:
            tokens = tokens.gather(-1, perm)
            masked = None if masked is None else masked.gather(-1, perm)
        x, _ = self.encoder.features(tokens, lengths, masked, self.mask_embed)
        if self.encoder.cls is not None:
            x = x[:, 1:]
        if perm is not None:  # back to the input's positions: output i of the turned grid is input perm[i]
            x = torch.zeros_like(x).scatter(1, perm[..., None].expand_as(x), x)
        return self.denoise_head(x).reshape(*shape, -1)


def mask_positions(scores: torch.Tensor, lengths: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """The positions to mask for denoising: in each sequence (last dim of ``scores``, ``[..., N]``)
    the ``k = min(length, max(1, round(ratio * length)))`` real tokens (positions ``< length``; all N if
    ``lengths`` is None) with the smallest ``scores``. ``scores`` are i.i.d. uniform draws in
    [0, 1); ties are broken by position (a stable sort), so the count is exact. Returns bool, the
    shape of ``scores``."""
    if not 0 < ratio < 1:
        raise ValueError(f"mask ratio must be in (0, 1), got {ratio!r}")
    N = scores.shape[-1]
    flat = scores.reshape(-1, N)
    pos = torch.arange(N, device=scores.device)
    if lengths is None:
        n = torch.full(flat.shape[:1], N, device=scores.device)
    else:
        n = lengths.reshape(-1).to(scores.device).clamp(0, N)
        flat = flat.masked_fill(pos[None, :] >= n[:, None], 2.0)  # padding sorts last
    k = (n.double() * ratio).round().clamp(min=1).minimum(n.double()).long()
    order = flat.argsort(dim=-1, stable=True)
    chosen = pos[None, :] < k[:, None]  # the first k of each row, in sorted order
    return torch.zeros_like(chosen).scatter(1, order, chosen).reshape(scores.shape)


# ------------------------------------------------------------------------------- pretrained weights
def upsample_grid(grid: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Upsample a ``[H, W, d]`` grid of embeddings to ``[H', W', d]`` by integer factors, copying
    each cell into an ``(H'/H) x (W'/W)`` block (2x2 duplication from Path-64 to Path-X)."""
    if not isinstance(grid, torch.Tensor) or grid.dim() != 3:
        raise ValueError(f"grid must be a [H, W, d] tensor, got {getattr(grid, 'shape', type(grid).__name__)}")
    H, W, _ = grid.shape
    H2, W2 = size
    if H2 % H or W2 % W or H2 < H or W2 < W:
        raise ValueError(f"cannot upsample a {H}x{W} grid to {H2}x{W2}: each side must grow by an integer factor")
    return grid.repeat_interleave(H2 // H, dim=0).repeat_interleave(W2 // W, dim=1)


def load_pretrained(model: nn.Module, state_dict: dict) -> list[str]:
    """Copy ``state_dict`` into ``model`` (an `LRAClassifier` or `LRADenoiser`); returns notes.

    The encoder (``encoder.*``: embeddings, positions, CLS token, blocks, final norm) must match
    exactly, except that a 2-D position grid of another size is upsampled grid-wise
    (`upsample_grid`); any other missing, unexpected or mis-shaped encoder tensor is an error.
    Outside the encoder, tensors the model does not have (the other objective's head: a classifier
    checkpoint's ``head.*``, a denoiser's ``denoise_head.*`` and ``mask_embed``) are skipped, and
    tensors the checkpoint lacks keep their fresh initialisation; tensors in both are copied
    (shapes must agree). One note per upsampled grid and per skipped or fresh group."""
    own = model.state_dict()
    enc = "encoder."
    missing = sorted(k for k in set(own) - set(state_dict) if k.startswith(enc))
    unexpected = sorted(k for k in set(state_dict) - set(own) if k.startswith(enc))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model's encoder: missing {missing}, unexpected {unexpected}")
    notes, new = [], dict(own)
    for name, t in state_dict.items():
        if name not in own:
            continue
        target = own[name]
        if t.shape == target.shape:
            new[name] = t
        elif name.endswith("pos.grid") and t.dim() == 3 and t.shape[-1] == target.shape[-1]:
            new[name] = upsample_grid(t, tuple(target.shape[:2]))
            notes.append(f"{name}: upsampled {tuple(t.shape[:2])} -> {tuple(target.shape[:2])}")
        else:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(t.shape)}, the model expects {tuple(target.shape)}")
    skipped = sorted(set(state_dict) - set(own))
    fresh = sorted(set(own) - set(state_dict))
    if skipped:
        notes.append(f"skipped (not in this model): {', '.join(skipped)}")
    if fresh:
        notes.append(f"left at initialisation (not in the checkpoint): {', '.join(fresh)}")
    model.load_state_dict(new)
    return notes
