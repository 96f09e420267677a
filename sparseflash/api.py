"""`sparseflash.attention`: input validation and dispatch to the Triton kernels or the reference.

The call path: `attention` tries the short path of repeated eager calls first
(`sparseflash.flash.fast.lookup` / `build` / `call`: a call seen before skips validation; a new
one is validated here first), else validates (`_check_inputs`) and dispatches to `sparseflash.reference.attention` or
`sparseflash.flash.flash_attention` (flash/autograd.py: the autograd Function and torch.library
ops) -> `launch.fwd` / `launch.bwd` (flash/launch.py; `flash/dispatch.py` picks the portable
Triton kernels of flash/kernels.py or the Hopper Gluon ones of flash/hopper/).

Every option and the paths a call can take:

`sparseflash.attention(q, k, v, mask=None, *, causal=False, scale=None, key_lengths=None,
return_lse=False, dropout_p=0.0, generator=None, segment_ids=None, key_ranges=None, softcap=None,
alibi_slopes=None, exact=True, backend="auto")`

- q `[B, Hq, Nq, D]`, k and v `[B, Hkv, Nk, D]`; `Hq` a multiple of `Hkv` (GQA / MQA); fp16,
  bf16, fp32 (fp64 through the reference; fp32 dots follow `torch.set_float32_matmul_precision`:
  full precision by default, tf32 at "high" / "medium", as `torch.matmul`); head_dim up to 256 on the Triton kernels (more: a ValueError), any value (40, 80, 96 ...); the reference backend takes any head_dim;
  any sequence lengths, `Nq != Nk`; arbitrary strides.
- `mask`: a `BlockMask`, shared or per batch and per head; `None` is dense attention. Pair (i, j)
  is attended iff its block is on, and inside a partial block of a mask built from a token-level
  definition (`BlockMask.from_fn`, `from_dense`, `from_flex` with a mask_mod) iff that definition
  attends it, and with `causal` `j <= i + Nk - Nq` (bottom-right aligned), and with `key_lengths`
  `j < key_lengths[b]`. A row that attends to nothing gives 0 and zero gradients, never NaN.
- `exact` (default True): the token-level definition is applied inside partial blocks, forward
  and backward, from one bit tile per partial block built once per device
  (`BlockMask.exact_bits`; memory proportional to the partial blocks); full blocks run as
  before, with no element-wise work. Combined with everything else here (`causal`,
  `key_lengths`, `segment_ids`, `key_ranges`, GQA, dropout, `softcap`, `alibi_slopes`, masks per
  batch and head). `exact=False` computes every pair of an on block
  (block-level, the behaviour before exact masks). On Hopper, exact calls run the Hopper
  kernels with their bits, forward and backward (the backward at any column-list length;
  `SPARSEFLASH_HOPPER_EXACT=off` keeps them on the portable kernels); they skip the short path of
  repeated calls below. Under torch.compile call `mask.exact_bits(device)` once outside the
  compiled code.
- `segment_ids`: packed variable-length documents. An int tensor `[B, N]` (or a pair for
  `Nq != Nk`); pair (i, j) is attended only if `seg_q[b, i] == seg_k[b, j]`, exact at token level
  (boundaries anywhere), combined with any mask, `causal` (on positions of the packed row: causal
  inside each document), `key_lengths`, GQA, dropout. Each call builds the block lists on the
  device so that block pairs sharing no document are never visited, and only tiles that hold
  more than one id compare ids element-wise. Flash-attn's `cu_seqlens`:
  `sparseflash.segments_from_cu_seqlens(cu_seqlens, total)`. Conventions (padding, id order) in
  `sparseflash/segments.py`.
- `key_ranges`: an int tensor `[B or 1, Nq, 2]`; query i attends only keys
  `key_ranges[b, i, 0] <= j < key_ranges[b, i, 1]`, exact at token level, combined with the mask,
  `causal`, `key_lengths`, GQA, dropout (not with `segment_ids`); block pairs no range reaches are
  skipped. Flash-attn's varlen sequences, causal bottom-right in each:
  `sparseflash.segments.key_ranges_from_cu_seqlens`.
- `softcap` (a float > 0): scores `s` become `softcap * tanh(s / softcap)` (Gemma 2);
  `alibi_slopes` (float32 `[Hq]` or `[B, Hq]`, no gradient): `-slope[b, h] * |i + Nk - Nq - j|`
  added after (flash-attn's definitions). Both in the kernels, forward and backward, combined
  with everything above; such calls run the portable kernels (not the Hopper ones, nor the
  short path below), and each softcap value compiles its own kernel variant.
- `mask` also takes torch's FlexAttention `BlockMask` (converted by `BlockMask.from_flex`); any
  other type raises an error that says how to build a `BlockMask`.
- Autograd for q, k, v (and through the returned log-sum-exp); registered with `torch.library`,
  so `torch.compile(fullgraph=True)` traces it. The portable backward is deterministic (no
  atomics); the Hopper backward below adds dQ with TMA reductions, so under
  `torch.use_deterministic_algorithms(True)`, or on a call with `deterministic=True`, the portable one runs.
- On Hopper (sm_90) the forward runs a warp-specialised Gluon kernel
  (`sparseflash/flash/hopper/forward.py`). It is FlashAttention-3's design: a TMA loader warp, two
  consumer warpgroups taking turns on the tensor cores, a persistent grid. The backward of dense,
  causal and key_lengths calls runs a one-pass Gluon backward (`flash/hopper/backward.py`). How
  fast each is against cuDNN, FlashAttention-2 and FlexAttention: BENCHMARKS.md.
  Block-sparse backwards take it when a key tile's column list holds at least 16 blocks on
  average (`hopper.backward.LIST_MIN_BLOCKS`; calls with exact-mask bits at any length) and keep the
  portable kernels below
  (`SPARSEFLASH_HOPPER_BWD=on` forces the Hopper one, `off` turns it off); `SPARSEFLASH_HOPPER=off` keeps the portable kernels
  everywhere.
- Repeated eager calls are cheap: a call whose shapes, layouts, mask and scalars were seen before
  skips validation and planning (`sparseflash/flash/fast.py`; `SPARSEFLASH_FAST_PATH=0` turns it
  off), and on CUDA its forward, autograd node and backward run in C++ with the same kernels
  (`sparseflash/flash/native.py`): less host time per call than SDPA's forward and about its
  forward + backward; an eager fwd+bwd takes the time of its own kernels, and every LRA task's
  training step is at least as fast with our dense kernel as with SDPA's (BENCHMARKS.md "Host cost"). The C++ part is compiled once, in the background of the first CUDA
  calls (about a minute; they take the Python path meanwhile), into `~/.cache/sparseflash`; it
  needs a C++20 compiler (`$CXX` or `c++`); without one it warns and the Python path serves
  (`SPARSEFLASH_NATIVE=0` turns it off).
- `dropout_p`: attention dropout inside the kernels; the keep-mask is regenerated in backward
  from a Philox counter (seeded by one small torch random op on the device, so `torch.manual_seed`
  controls it and a call captured in a CUDA graph draws fresh bits on every replay) and
  `sparseflash.dropout.keep_mask` reproduces it bit for bit. Each decision uses 8 random bits
  (as FlashAttention-2): p is applied in steps of 1/256 (`sparseflash.dropout.effective_p`;
  0.1 → 0.1016) and kept values are scaled by its complement, so outputs stay unbiased.
- `backend`: `"triton"` (the kernels; CUDA, or CPU with `TRITON_INTERPRET=1`), `"reference"`
  (plain PyTorch, chunked; defines correctness), `"auto"` (CUDA → triton, CPU → reference).
- On Hopper (sm_90+) the kernels load 16-bit tiles through TMA descriptors where that measured
  faster (`SPARSEFLASH_TMA=auto`, the default; `on` wherever the inputs allow, `off` never);
  eager calls under 1e11 estimated FLOPs keep pointer loads, whose host cost is lower
  (BENCHMARKS.md, "Host cost"); calls captured in a CUDA graph take descriptors at any size.
"""

from __future__ import annotations

import math

import torch

from sparseflash.dropout import check_p as check_dropout_p
from sparseflash.mask import BlockMask, as_block_mask
from sparseflash.mask import tracing as _capturing
from sparseflash.segments import check_key_ranges, check_segment_ids
from sparseflash import _env

__all__ = ["attention", "resolve_backend", "key_lengths_range"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BACKENDS = ("auto", "triton", "reference")

# Whether `attention` checks that key_lengths lie in [0, seq_k]: reading its values back is the
# one host synchronisation of a call (it waits for the GPU to finish the work queued so far, so
# the host can no longer run ahead of it). SPARSEFLASH_CHECK_KEY_LENGTHS=0 (or setting this to
# False) skips it; the kernels then clamp each length to [0, seq_k] (the reference does not).
# Never checked inside torch.compile traces or CUDA-graph capture.
CHECK_KEY_LENGTHS = _env.flag("SPARSEFLASH_CHECK_KEY_LENGTHS", True)


def _interpreting() -> bool:
    return _env.interpreting()


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype = torch.float16) -> str:
    """Which implementation ``backend`` means for tensors on ``device`` of ``dtype``."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if dtype == torch.float64:
        return "reference"  # the kernels take fp16 / bf16 / fp32
    if device.type == "cuda" or (device.type == "cpu" and _interpreting()):
        return "triton"
    return "reference"


def key_lengths_range(key_lengths: torch.Tensor, seq_k: int, name: str = "key_lengths") -> tuple[int, int]:
    """(min, max) of ``key_lengths`` in one device read (a host synchronisation on a GPU); raises
    unless both lie in ``[0, seq_k]``. For a caller that checks once for several attention calls
    and passes ``check_key_lengths=False`` to each."""
    lo, hi = torch.stack(torch.aminmax(key_lengths)).tolist()
    if lo < 0 or hi > seq_k:
        raise ValueError(f"{name} must lie in [0, seq_k={seq_k}], got values in [{lo}, {hi}]")
    return lo, hi


_FAST = None


def _fast_module():
    """sparseflash.flash.fast, imported on first use (it imports triton)."""
    global _FAST
    from sparseflash.flash import fast

    _FAST = fast
    return fast


def _scale(scale, q) -> float:
    """The softmax scale of a (validated) call: ``scale``, default ``1 / sqrt(head_dim)``."""
    return float(1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)


def _check_exact(exact) -> bool:
    # isinstance, not a class identity test: under torch.compile (torch 2.11) the identity test of a
    # traced constant fails, which broke every compiled call
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool (True: a mask's token-level definition is applied inside its partial "
                        f"blocks; False: every pair of an on block is attended), got {exact!r}")
    return exact


def _needs_bits(mask, q, exact: bool) -> bool:
    """Whether a call applies bits inside partial blocks: ``exact`` and a mask with a token-level
    definition and at least one partial block (its bits are built here on first use)."""
    return exact and mask is not None and mask.mask_mod is not None and isinstance(q, torch.Tensor) \
        and mask.exact_bits(q.device) is not None


def _checks_lengths(check_key_lengths: bool | None) -> bool:
    """Whether a call checks its key_lengths' range: its own choice, else `CHECK_KEY_LENGTHS`."""
    return CHECK_KEY_LENGTHS if check_key_lengths is None else check_key_lengths


def _validated_scale(q, k, v, mask, causal, scale, key_lengths, check_key_lengths, backend) -> float | None:
    """For the short path's new keys: the checks of `_check_inputs` (a call without dropout), then
    the call's resolved scale when the backend resolves to the kernels, else None."""
    _check_inputs(q, k, v, mask, causal, scale, key_lengths, 0.0, check_key_lengths)
    return _scale(scale, q) if resolve_backend(backend, q.device, q.dtype) == "triton" else None


def _check_inputs(q, k, v, mask, causal, scale, key_lengths, dropout_p, check_key_lengths=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Nq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [batch, heads_kv, seq_k, head_dim], got {tuple(k.shape)} and {tuple(v.shape)}")
    Bk, Hkv, Nk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"k must have batch {B} like q, got shape {tuple(k.shape)}")
    if Dk != D:
        raise ValueError(f"k and v must have head_dim {D} like q, got {Dk}")
    if min(B, Hq, Hkv, D) == 0 or Nq == 0 or Nk == 0:
        raise ValueError(f"q, k, v must be non-empty, got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"heads of q ({Hq}) must be a multiple of heads of k/v ({Hkv}) for grouped-query attention")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise TypeError(f"scale must be a finite float or None, got {scale!r}")
        if scale <= 0:  # 0 would ignore the scores, < 0 reverse them: almost surely a mistake
            raise ValueError(f"scale must be > 0 (the softmax scale; None gives 1 / sqrt(head_dim)), got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not (0.0 <= dropout_p <= 1.0):
        raise ValueError(f"dropout_p must be a float in [0, 1], got {dropout_p!r}")
    check_dropout_p(float(dropout_p))
    if mask is not None:
        if (mask.seq_q, mask.seq_k) != (Nq, Nk):
            raise ValueError(
                f"mask was built for seq_q={mask.seq_q}, seq_k={mask.seq_k} but q has seq {Nq} and k has seq {Nk}"
            )
        mask.check_broadcast(B, Hq, "mask")
    if key_lengths is not None:
        if not isinstance(key_lengths, torch.Tensor):
            raise TypeError(f"key_lengths must be an integer torch.Tensor [batch], got {type(key_lengths).__name__}")
        if key_lengths.dtype.is_floating_point or key_lengths.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise TypeError(f"key_lengths must have an integer dtype, got {key_lengths.dtype}")
        if key_lengths.shape != (B,):
            raise ValueError(f"key_lengths must have shape [batch] = [{B}], got {tuple(key_lengths.shape)}")
        if key_lengths.device != q.device:
            raise ValueError(f"key_lengths must be on q's device {q.device}, got {key_lengths.device}")
        if _checks_lengths(check_key_lengths) and not _capturing():
            key_lengths_range(key_lengths, Nk)


def _check_softcap(softcap) -> float | None:
    """``softcap`` as a float, or None (off)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float > 0 or None (off), got {softcap!r}")
    if not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be a finite float > 0 (the cap of softcap * tanh(score / softcap)) or None "
                         f"(off), got {softcap!r}")
    return float(softcap)


def _check_alibi_slopes(slopes, batch: int, heads_q: int, device) -> torch.Tensor | None:
    """``alibi_slopes`` validated: a float32 / float64 tensor ``[heads_q]`` or ``[batch, heads_q]``
    on q's device, returned as ``[1 or batch, heads_q]``, detached (no gradient), or None."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a float32 torch.Tensor [heads_q] or [batch, heads_q], "
                        f"got {type(slopes).__name__}")
    if slopes.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"alibi_slopes must have dtype float32 (or float64), got {slopes.dtype}")
    if slopes.shape not in ((heads_q,), (batch, heads_q)):
        raise ValueError(f"alibi_slopes must have shape [heads_q] = [{heads_q}] or [batch, heads_q] = "
                         f"[{batch}, {heads_q}] (one slope per query head), got {tuple(slopes.shape)}")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes must be on q's device {device}, got {slopes.device}")
    return slopes.detach().reshape(-1, heads_q)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | None = None, *,
              causal: bool = False, scale: float | None = None, key_lengths: torch.Tensor | None = None,
              return_lse: bool = False, dropout_p: float = 0.0, generator: torch.Generator | None = None,
              segment_ids=None, key_ranges: torch.Tensor | None = None, softcap: float | None = None,
              alibi_slopes: torch.Tensor | None = None, exact: bool = True, backend: str = "auto",
              check_key_lengths: bool | None = None, deterministic: bool = False):
    """Block-sparse (or dense) scaled dot-product attention.

    Args:
        q: ``[batch, heads_q, seq_q, head_dim]``.
        k, v: ``[batch, heads_kv, seq_k, head_dim]``; ``heads_q`` a multiple of ``heads_kv``
            (query head ``h`` reads kv head ``h // (heads_q // heads_kv)``).
        mask: a `BlockMask` built for ``(seq_q, seq_k)`` whose layout broadcasts to
            ``[batch, heads_q, q_blocks, k_blocks]``; ``None`` means dense attention. A mask on
            another device is moved (and its index form cached) on first use. Torch's
            FlexAttention ``BlockMask`` is accepted and converted by `BlockMask.from_flex`
            (its ``mask_mod`` is applied inside its partial blocks, as Flex does).
        causal: also require ``j <= i + seq_k - seq_q`` (bottom-right aligned).
        scale: softmax scale, a float > 0, default ``1 / sqrt(head_dim)``.
        key_lengths: int tensor ``[batch]``; keys ``j >= key_lengths[b]`` are not attended. Its
            values are checked to lie in ``[0, seq_k]``, which reads them back: a host
            synchronisation on a GPU. ``SPARSEFLASH_CHECK_KEY_LENGTHS=0`` in the environment (or
            ``sparseflash.api.CHECK_KEY_LENGTHS = False``) skips the check; the kernels then
            clamp each length to ``[0, seq_k]``.
        check_key_lengths: this call's choice over that default: ``False`` for a caller that
            validated the lengths once for several calls (the layers of one model step), ``True``
            to check regardless; ``None`` follows ``CHECK_KEY_LENGTHS``.
        return_lse: also return the float32 log-sum-exp ``[batch, heads_q, seq_q]`` of the scaled
            scores (``-inf`` for rows that attend to nothing). It is differentiable.
        dropout_p: attention dropout on the normalised probabilities (pass 0 at eval). Applied in
            steps of 1/256 (8 random bits per decision, as FlashAttention-2):
            ``sparseflash.dropout.effective_p(p)`` is the probability used, and kept values are
            scaled by its complement's inverse.
        generator: torch.Generator whose Philox state seeds dropout (default: the device's).
        segment_ids: packed documents: an integer tensor ``[batch, seq]`` (self-attention,
            ``seq_q == seq_k``) or a pair ``(q_segment_ids [batch, seq_q], kv_segment_ids
            [batch, seq_k])`` (a leading 1 broadcasts over the batch); pair (i, j) is attended
            only if the ids are equal, exactly at token level. ``causal`` stays on positions of
            the packed row (within a document: ordinary causal). int32 ids are used as they are;
            int64 ids are checked to fit in int32 (one device read). Flash-attn's ``cu_seqlens``:
            `sparseflash.segments_from_cu_seqlens`. Conventions (padding, id order and what the
            kernels skip): `sparseflash.segments`.
        key_ranges: an integer tensor ``[batch or 1, seq_q, 2]``: query ``i`` attends only keys
            ``key_ranges[b, i, 0] <= j < key_ranges[b, i, 1]`` (exact at token level, on top of the
            mask, ``causal`` and ``key_lengths``; block pairs no range reaches are skipped). Flash-attn's
            varlen sequences, causal bottom-right aligned in each one:
            `sparseflash.segments.key_ranges_from_cu_seqlens`. Not combined with ``segment_ids``.
        softcap: a float > 0: each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``
            (Gemma 2's soft-capping), in the kernels forward and backward. ``None``: off. Each
            value compiles its own kernel variant (a model uses one or two).
        alibi_slopes: a float32 tensor ``[heads_q]`` or ``[batch, heads_q]``: ALiBi,
            ``-slope[b, h] * |i + seq_k - seq_q - j|`` added to the (soft-capped) score of query
            ``i`` and key ``j``, as flash-attn defines it. The slopes get no gradient.
            Both combine with every option above (calls with either take the portable kernels,
            not the Hopper ones nor the short path of repeated calls).
        exact: True (default): a mask built from a token-level definition (``mask.mask_mod``) is
            applied exactly, token by token, inside its partial blocks (`BlockMask.partial`),
            forward and backward; full blocks cost what they did. False: every pair of an on
            block is attended (block-level; ``mask.block_level()`` gives the same). Masks
            without a ``mask_mod`` are the same either way.
        deterministic: True asks for a bitwise repeatable backward on every GPU: the call's
            backward runs the portable kernels, which add without atomics, also on Hopper (whose
            one-pass backward adds dQ in arrival order); slower there (BENCHMARKS.md). The forward
            is deterministic either way. ``torch.use_deterministic_algorithms(True)`` does the same
            for every call.
        backend: ``"auto"`` (CUDA, or CPU with ``TRITON_INTERPRET=1`` -> ``"triton"``; CPU ->
            ``"reference"``), ``"triton"`` or ``"reference"``.

    Returns:
        ``out`` ``[batch, heads_q, seq_q, head_dim]`` in q's dtype, or ``(out, lse)``.
        Rows that attend to nothing are 0 and get zero gradients.
    """
    if mask is not None and mask.__class__ is not BlockMask:
        mask = as_block_mask(mask)  # torch's FlexAttention BlockMask, converted; anything else raises
    exact = _check_exact(exact)
    validated = False
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    if not deterministic and segment_ids is None and key_ranges is None and softcap is None and alibi_slopes is None and not return_lse \
            and (backend == "auto" or backend == "triton") and generator is None \
            and (dropout_p.__class__ is float or dropout_p.__class__ is int) and dropout_p == 0 \
            and not _needs_bits(mask, q, exact):
        # the short path of a repeated eager call (sparseflash.flash.fast): a known key skips validation
        # and planning; a new one is validated here first (`_validated_scale`). None: a call it does not take.
        fast = _FAST or _fast_module()
        entry = fast.lookup(q, k, v, mask, causal, scale, key_lengths)
        if entry is not None:
            if entry.__class__ is fast.Miss:
                resolved = _validated_scale(q, k, v, mask, causal, scale, key_lengths, check_key_lengths, backend)
                validated = True  # (a key the short path then declines is not checked twice)
                entry = fast.build(entry, q, k, v, mask, causal, resolved, key_lengths, resolved is not None)
            elif key_lengths is not None and _checks_lengths(check_key_lengths):
                key_lengths_range(key_lengths, k.shape[2])  # (not while capturing: lookup says None then)
            if entry is not None:
                return fast.call(entry, q, k, v, key_lengths, mask)
    if not validated:
        _check_inputs(q, k, v, mask, causal, scale, key_lengths, dropout_p, check_key_lengths)
    segments = check_segment_ids(segment_ids, q.shape[0], q.shape[2], k.shape[2], q.device)
    ranges = check_key_ranges(key_ranges, q.shape[0], q.shape[2], k.shape[2], q.device)
    softcap = _check_softcap(softcap)
    slopes = _check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[1], q.device)
    if segments is not None and ranges is not None:
        raise ValueError("segment_ids and key_ranges cannot be combined: give documents as key ranges "
                         "(sparseflash.segments.key_ranges_from_cu_seqlens) or as segment ids")
    backend = resolve_backend(backend, q.device, q.dtype)
    scale = _scale(scale, q)
    dropout_p = float(dropout_p)

    if backend == "reference":
        keep = None
        if dropout_p > 0:
            from sparseflash import dropout as _dropout

            seed, offset = _dropout.next_seed_offset(q.device, generator)
            keep = _dropout.keep_mask(seed, offset, q.shape[0], q.shape[1], q.shape[2], k.shape[2], dropout_p, device=q.device)
            dropout_p = _dropout.effective_p(dropout_p)  # what the 8-bit threshold applies
        from sparseflash import reference

        return reference.attention(q, k, v, mask, causal=causal, scale=scale, key_lengths=key_lengths,
                                   return_lse=return_lse, dropout_p=dropout_p, dropout_keep=keep,
                                   segment_ids=segments, key_ranges=key_ranges, softcap=softcap,
                                   alibi_slopes=slopes, exact=exact)

    if q.device.type == "cpu" and _interpreting() and not torch.compiler.is_compiling():
        from sparseflash._compat import check_interpreter_versions

        # names a failing triton / numpy pair instead of an InterpreterError; eager calls only
        # (Dynamo would trace through the cached check)
        check_interpreter_versions()
    from sparseflash.flash import flash_attention

    return flash_attention(q, k, v, mask, causal=causal, scale=scale, key_lengths=key_lengths,
                           return_lse=return_lse, dropout_p=dropout_p, generator=generator, segments=segments,
                           key_ranges=ranges, softcap=softcap, alibi_slopes=slopes, exact=exact,
                           deterministic=deterministic)
