"""Hugging Face transformers: run a model's attention through `sparseflash.attention` with a pattern.

    import sparseflash.hf
    sparseflash.hf.register("blocksparse-butterfly", pattern="butterfly")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="blocksparse-butterfly")

(Names must not contain "flash": transformers treats any such name as a FlashAttention kernel to
load, so the default name is ``"blocksparse"``.)

`register` adds an attention function to transformers' ``AttentionInterface`` (transformers >= 4.48;
``pip install sparseflash[hf]``) and, where transformers has one (>= 4.53), the boolean 4-D mask
builder of SDPA to its ``AttentionMaskInterface`` under the same name, so the model hands the
function the mask it would hand SDPA. The function follows transformers' signature
``(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)`` with
``query [B, H, Nq, D]``, ``key`` / ``value [B, Hkv, Nk, D]`` (grouped heads are passed on as they
are: sparseflash does GQA itself) and returns ``(out [B, Nq, H, D], None)``.

What it does with the model's mask:

- ``attention_mask is None``: causal iff the module (``module.is_causal``, or an ``is_causal``
  keyword) is causal and ``Nq > 1``; every key attended otherwise.
- a 4-D mask (bool, True = attend; or additive float, 0 = attend, the dtype's minimum = masked):
  the causal (bottom-right aligned) or the full mask with right padding of the keys becomes
  ``causal`` plus ``key_lengths`` (the kernels' fastest path); any other mask whose every query
  row attends one contiguous run of keys, the same for every head, becomes per-query
  ``key_ranges`` (`mask_to_key_ranges`), exact at token level: left padding (batched, cached
  ``generate``), sliding-window layers (Mistral, Gemma 2), packed sequences, prefix-LM. Rows with
  holes (image-token overlays and the like) and additive biases raise ValueError naming the case:
  attending more or fewer pairs than the model asks for would be wrong.
- ``softcap`` (transformers passes the module's ``attn_logit_softcapping``, Gemma 2): tanh
  soft-capping in the kernels (`sparseflash.attention`'s ``softcap``); ``position_bias`` is refused.
- the pattern is resolved per (layer, Nq, Nk) and device and cached: ``None`` (dense), a
  `sparseflash.patterns` name (called with ``seq_k=Nk`` where ``Nq != Nk``), a `BlockMask`, a
  callable ``f(seq_q, seq_k) -> BlockMask | None``, or a list / dict giving one of these per layer
  (``module.layer_idx``). Every query head shares it.

``output_attentions=True`` is not supported (no probabilities are formed); dropout follows the
module (transformers passes 0 in eval). CUDA runs the Triton kernels, other devices the PyTorch
reference (``backend=`` to choose).
"""

from __future__ import annotations


import torch

from sparseflash.mask import BlockMask

__all__ = ["register", "make_attention_function", "mask_to_key_lengths", "mask_to_key_ranges"]

_BACKENDS = ("auto", "triton", "reference")


def _allowed(attention_mask: torch.Tensor) -> torch.Tensor:
    """The bool ``[B, 1 or H, Nq, Nk]`` (True = attend) of a 4-D transformers mask."""
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be 4-D [batch, heads, q, k], got shape {tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_floating_point():
        lowest = torch.finfo(attention_mask.dtype).min
        if not bool(((attention_mask == 0) | (attention_mask <= lowest / 2) | torch.isneginf(attention_mask)).all()):
            raise ValueError("attention_mask carries additive biases (values other than 0 and the dtype's minimum): "
                             "sparseflash supports masks, not score biases")
        return attention_mask == 0
    raise TypeError(f"attention_mask must be bool or floating, got {attention_mask.dtype}")


def mask_to_key_ranges(attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-query key ranges ``[B, Nq, 2]`` (int64 ``(start, end)``, ``(0, 0)`` for a row that attends
    nothing) of a 4-D transformers mask ``[B, 1 or H, Nq, Nk]`` whose every row attends one
    contiguous run of keys, the same for every head (`sparseflash.attention`'s ``key_ranges``:
    exactly the mask's pairs); ValueError otherwise."""
    allowed = _allowed(attention_mask)
    if allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        raise ValueError("attention_mask differs between heads: sparseflash's key ranges are shared by the heads")
    a = allowed[:, 0]  # [B, Nq, Nk]
    nk = a.shape[-1]
    cols = torch.arange(nk, device=a.device)
    some = a.any(-1)
    start = torch.where(some, torch.where(a, cols, nk).amin(-1), 0)
    end = torch.where(some, torch.where(a, cols + 1, 0).amax(-1), 0)
    if not torch.equal(a, (cols >= start[..., None]) & (cols < end[..., None])):
        raise ValueError("attention_mask has a query row whose keys are not one contiguous run (e.g. an image-token "
                         "or other overlay): sparseflash takes such masks as causal + key_lengths or as per-query "
                         "key ranges only")
    return torch.stack([start, end], dim=-1)


def mask_to_key_lengths(attention_mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """Key lengths ``[batch]`` for a 4-D transformers mask ``[B, 1 or H, Nq, Nk]`` that is exactly
    (keys ``j < length[b]``) & (with ``causal``: ``j <= i + Nk - Nq``); ValueError otherwise
    (`mask_to_key_ranges` takes more masks)."""
    allowed = _allowed(attention_mask)
    B, _, nq, nk = allowed.shape
    lengths = allowed.any(dim=-2).any(dim=1).sum(-1)  # [B]: keys anyone attends
    cols = torch.arange(nk, device=allowed.device)
    expected = (cols[None, :] < lengths[:, None])[:, None, None, :]
    if causal:
        rows = torch.arange(nq, device=allowed.device)
        expected = expected & (cols[None, :] <= rows[:, None] + (nk - nq))[None, None]
    if not torch.equal(allowed, expected.expand_as(allowed)):
        what = "causal" if causal else "full (bidirectional)"
        raise ValueError(
            f"attention_mask is not a {what} mask with right padding: sparseflash turns only those into causal + "
            f"key_lengths (left padding, sliding-window layers, packed sequences and mask overlays have no "
            f"sparseflash form; use right padding, or a pattern for windows)"
        )
    return lengths


def _resolve(pattern, nq: int, nk: int, device, pattern_kwargs: dict, block_size) -> BlockMask | None:
    """One layer's mask; a callable here takes (seq_q, seq_k), every other form is `nn.resolve_pattern`'s."""
    from sparseflash.nn import resolve_pattern

    if callable(pattern) and not isinstance(pattern, (str, BlockMask)):
        mask = pattern(nq, nk)
        if mask is not None and not isinstance(mask, BlockMask):
            raise TypeError(f"pattern callable returned {type(mask).__name__}, expected a BlockMask or None")
        return None if mask is None else mask.to(device)
    if isinstance(pattern, (list, tuple)):
        raise TypeError("a pattern list here means one pattern per layer (a list or dict given to register); "
                        "for a pattern per head give a BlockMask from sparseflash.patterns.stack")
    if pattern is not None and not isinstance(pattern, (str, BlockMask)):
        raise TypeError(f"pattern must be None, a sparseflash.patterns name, a BlockMask or a callable "
                        f"(seq_q, seq_k) -> BlockMask, got {type(pattern).__name__}")
    return resolve_pattern(pattern, nq, seq_k=nk, block_size=block_size, device=device, pattern_kwargs=pattern_kwargs)


def make_attention_function(pattern=None, *, pattern_kwargs: dict | None = None, block_size=128,
                            backend: str = "auto"):
    """The transformers attention function (see the module docstring) for ``pattern``; `register`
    registers it. Its mask cache is ``fn.masks`` (keyed by layer, lengths, device)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if pattern_kwargs is not None and not isinstance(pattern_kwargs, dict):
        raise TypeError(f"pattern_kwargs must be a dict or None, got {type(pattern_kwargs).__name__}")
    pattern_kwargs = dict(pattern_kwargs or {})
    per_layer = isinstance(pattern, (list, tuple, dict))
    masks: dict = {}

    def sparseflash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        import sparseflash

        if kwargs.get("output_attentions"):
            raise ValueError("sparseflash attention does not form attention probabilities: output_attentions=True "
                             "needs attn_implementation='eager'")
        if kwargs.get("position_bias") is not None:
            raise ValueError("sparseflash attention has no position bias: use 'eager' or 'sdpa'")
        softcap = kwargs.get("softcap")
        softcap = float(softcap) if softcap else None  # (None or 0: off)
        nq, nk = query.shape[2], key.shape[2]
        is_causal = kwargs.get("is_causal")
        is_causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal) and nq > 1
        key_lengths = key_ranges = None
        if attention_mask is not None:
            try:
                key_lengths = mask_to_key_lengths(attention_mask, is_causal)
            except ValueError:  # (a bias raises again below)
                # left padding, sliding windows, packed sequences: the mask's own pairs, per query
                key_ranges = mask_to_key_ranges(attention_mask)
                is_causal = False
            else:
                if bool((key_lengths >= nk).all()):
                    key_lengths = None
        layer = getattr(module, "layer_idx", None)
        pat = pattern
        if per_layer:
            if layer is None:
                raise ValueError("a per-layer pattern needs module.layer_idx, which this model's attention lacks")
            try:
                pat = pattern[layer]
            except (IndexError, KeyError):
                raise ValueError(f"the per-layer pattern has no entry for layer {layer}") from None
        cache_key = (layer if per_layer else None, nq, nk, str(query.device))
        if cache_key not in masks:
            masks[cache_key] = _resolve(pat, nq, nk, query.device, pattern_kwargs, block_size)
        mask = masks[cache_key]
        chosen = backend
        if chosen == "auto":
            chosen = "triton" if query.device.type == "cuda" else "reference"
        out = sparseflash.attention(query, key, value, mask, causal=is_causal, scale=scaling, key_lengths=key_lengths,
                                    key_ranges=key_ranges, softcap=softcap, dropout_p=float(dropout), backend=chosen)
        return out.transpose(1, 2).contiguous(), None

    sparseflash_attention.masks = masks
    return sparseflash_attention


def register(name: str = "blocksparse", pattern=None, *, pattern_kwargs: dict | None = None, block_size=128,
             backend: str = "auto"):
    """Register sparseflash attention with ``pattern`` as ``attn_implementation=name`` in transformers.

    Returns the registered function. Register several names for several patterns. Raises
    ImportError naming the extra when transformers (>= 4.48) is not installed.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    if "flash" in name.lower() or name in ("eager", "sdpa") or name.startswith("paged"):
        raise ValueError(f"name {name!r} is taken or reserved by transformers (it loads any name containing 'flash' "
                         f"as a FlashAttention kernel): choose another, e.g. 'blocksparse'")
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError("sparseflash.hf needs transformers >= 4.48 (AttentionInterface): "
                          f"pip install 'sparseflash[hf]' ({e})") from None
    fn = make_attention_function(pattern, pattern_kwargs=pattern_kwargs, block_size=block_size, backend=backend)
    AttentionInterface.register(name, fn)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # older transformers build 4-D masks for any implementation
        pass
    else:
        AttentionMaskInterface.register(name, sdpa_mask)
    return fn
