"""Token-exact masks: sparseflash applying a mask_mod inside partial blocks (``exact=True``) against
the same mask computed block-level (``exact=False``) and against compiled FlexAttention with the
same mask_mod, on one exact mask per setting.

    python -m sparseflash.experiments.bench.exact --out DIR [--tokens 16384] [--batch 1] [--heads 16]
        [--masks sliding-window documents] [--window 1024] [--doc-len 2048] [--head-dims 64 128] [--no-graph]
        [--providers ...]   (the default four; add sparseflash-exact-hopper-bwd sparseflash-block-hopper-bwd)
    python -m sparseflash.experiments.bench.exact --device cpu --out DIR   (tiny CPU run, labelled as such)

Masks (both causal, built with `BlockMask.from_fn` on the device, block 128 on a GPU):
- ``sliding-window``: ``kv_idx <= q_idx < kv_idx + window``;
- ``documents``: documents of random lengths (exponential with mean ``doc-len``, seeds fixed,
  `packed.document_ids`), causal inside each.

Providers, bf16, forward and forward+backward:
- ``sparseflash-exact``: `sparseflash.attention(q, k, v, mask)` (the default ``exact=True``: bits
  read in partial blocks only; built once per mask, outside the timed calls) on the portable
  kernels: `dispatch.HOPPER_EXACT` "off" for all of its calls, forward and backward;
- ``sparseflash-exact-hopper`` (GPU): the same call with `dispatch.HOPPER_EXACT` "on" (the
  default): the Hopper kernels with bits where they take the call (sm_90), the portable ones elsewhere;
- ``sparseflash-exact-hopper-bwd`` / ``sparseflash-block-hopper-bwd`` (GPU, not run by default): the
  exact-hopper / block rows with the Hopper backward for every block-sparse call
  (`hopper_bwd.MODE` "on", ``SPARSEFLASH_HOPPER_BWD=on``), whose "auto" leaves column lists shorter
  than `hopper_bwd.LIST_MIN_BLOCKS` to the portable backward (a 1024 window has ~9 a column);
- ``sparseflash-block``: the same call with ``exact=False``: every pair of an on block (the work
  without the bits, and a different result: the reference point for their cost);
- ``sparseflash-predicate`` (not run by default): the same exact mask from the kernels' own
  token-level predicates instead of bits: the block-level mask (``exact=False``) with
  ``key_ranges`` ``[i - window + 1, i + 1)`` for the window, ``segment_ids`` and ``causal=True``
  for the documents (what `flash_attn_func`'s ``window_size`` and packed documents use);
- ``flash-attn-api`` (not run by default): the same exact mask through flash-attn's interface, as a
  flash-attn user writes it: `sparseflash.flash_attn_func` with ``causal=True, window_size=(window -
  1, 0)`` for the window (a cached exact mask at this length), `sparseflash.flash_attn_varlen_func`
  with the documents' ``cu_seqlens`` and ``causal=True`` for the documents (key ranges), on
  ``[B, N, H, D]`` views (the output's transpose back to ``[B, N, H, D]`` is a copy, part of the call);
- ``flex``: compiled ``flex_attention`` with ``mask.to_flex(layout_in_mask_mod=False)`` (its full
  and partial lists and the mask_mod; built once outside the timed calls).

Timing as `packed` (``ms``: eager calls back to back; ``gpu_ms``: CUDA-graph replays, kernels
only). ``tflops`` counts the exactly attended pairs for every provider (`exact_pairs`).
``max_diff_vs_flex`` (GPU) / ``max_diff_vs_reference`` (CPU): the largest difference of the
forward output of that provider from Flex's / the reference's (exact; the block-level one differs
by design). Writes DIR/exact.csv and DIR/exact.json.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, check_output_dir, positive_int, run_command
from sparseflash.experiments.bench.results import write_tidy

# sparseflash providers: (exact, dispatch.HOPPER_EXACT, hopper_bwd.MODE), None leaving a switch as it is
_SPARSEFLASH = {"sparseflash-exact": (True, "off", None), "sparseflash-exact-hopper": (True, "on", None),
                "sparseflash-block": (False, None, None), "sparseflash-exact-hopper-bwd": (True, "on", "on"),
                "sparseflash-block-hopper-bwd": (False, None, "on"), "sparseflash-predicate": (False, None, None)}
PROVIDERS = ("sparseflash-exact", "sparseflash-exact-hopper", "sparseflash-block", "flex",
             "sparseflash-exact-hopper-bwd", "sparseflash-block-hopper-bwd", "sparseflash-predicate", "flash-attn-api")
DEFAULT_PROVIDERS = PROVIDERS[:4]
GPU_ONLY = ("flex", "sparseflash-exact-hopper", "sparseflash-exact-hopper-bwd", "sparseflash-block-hopper-bwd")
MASKS = ("sliding-window", "documents")


def build_mask(kind: str, tokens: int, window: int, doc_len: int, block: int, device):
    """The `BlockMask` of ``kind`` (from_fn on ``device``), its mask_mod's description, and the
    `sparseflash.attention` arguments that give the same mask from in-kernel predicates."""
    from sparseflash import BlockMask

    if kind == "sliding-window":
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        label = f"window={window}"
        i = torch.arange(tokens, device=device)
        predicate = {"key_ranges": torch.stack([(i - window + 1).clamp(min=0), i + 1], -1)[None].to(torch.int32),
                     "_flash_attn": dict(causal=True, window_size=(window - 1, 0))}
    elif kind == "documents":
        from sparseflash.experiments.bench.packed import document_ids

        doc = document_ids(tokens, doc_len, seed=tokens + doc_len, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        label = f"docs={int(doc.max()) + 1} mean_len={doc_len}"
        counts = torch.bincount(doc, minlength=int(doc.max()) + 1)
        cu = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
        predicate = {"segment_ids": doc[None].to(torch.int32), "causal": True,
                     "_flash_attn": dict(causal=True, cu_seqlens=cu, max_seqlen=int(counts.max()))}
    else:
        raise ValueError(f"unknown mask {kind!r}, expected one of {MASKS}")
    return BlockMask.from_fn(mask_mod, tokens, block_size=block, device=device), label, predicate


def exact_pairs(mask) -> int:
    """Token pairs the mask attends exactly (summed over its layout's slices): every pair of its full
    blocks and the set bits of its partial blocks."""
    full = int((mask.full * mask.pair_counts()).sum())
    eb = mask.exact_bits()
    if eb is None:
        return full
    on = (eb.bits[..., None] >> torch.arange(32, device=eb.bits.device)) & 1
    return full + int(on.sum())


def _calls(provider: str, q, k, v, mask, flex_mask, predicate=None):
    """A zero-argument forward call of ``provider``."""
    import sparseflash

    if provider == "sparseflash-predicate":
        kw = {key: val for key, val in predicate.items() if not key.startswith("_")}
        return lambda: sparseflash.attention(q, k, v, mask, exact=False, **kw)
    if provider == "flash-attn-api":  # [B, N, H, D] views in, the output back to [B, H, N, D]
        # (the views are taken inside each call: a view node made outside would run its backward on
        # the stream it was made on, which breaks a CUDA-graph capture of fwd+bwd)
        fa = dict(predicate["_flash_attn"])
        if "cu_seqlens" not in fa:
            return lambda: sparseflash.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), **fa).transpose(1, 2)
        cu, n = fa.pop("cu_seqlens"), fa.pop("max_seqlen")
        if q.shape[0] != 1:
            raise ValueError("the varlen call packs one row of documents: run it with --batch 1")
        return lambda: sparseflash.flash_attn_varlen_func(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, cu, n, n,
                                                          **fa).transpose(0, 1)[None]
    if provider in _SPARSEFLASH:  # (its switches: `_switch`)
        exact = _SPARSEFLASH[provider][0]
        return lambda: sparseflash.attention(q, k, v, mask, exact=exact)
    if provider == "flex":
        from sparseflash.experiments.bench.providers import _flex_compiled

        fn = _flex_compiled()
        return lambda: fn(q, k, v, block_mask=flex_mask)
    raise ValueError(f"unknown provider {provider!r}")


@contextlib.contextmanager
def _switch(provider: str):
    """`dispatch.HOPPER_EXACT` as ``provider`` needs it, for all of its calls (the backward runs
    after the forward call returns, and CUDA graphs are captured inside)."""
    from sparseflash.flash import dispatch

    _, hopper_exact, bwd_mode = _SPARSEFLASH.get(provider, (None, None, None))
    saved = dispatch.HOPPER_EXACT
    if hopper_exact is not None:
        dispatch.HOPPER_EXACT = hopper_exact
    bwd = None
    if bwd_mode is not None:  # (GPU only: the module imports Gluon)
        from sparseflash.flash.hopper import backward as bwd

        saved_mode, bwd.MODE = bwd.MODE, bwd_mode
    try:
        yield
    finally:
        dispatch.HOPPER_EXACT = saved
        if bwd is not None:
            bwd.MODE = saved_mode


def run(args) -> list[dict]:
    from sparseflash.experiments.bench import timing
    from sparseflash.experiments.bench.flops import attention_flops
    from sparseflash.experiments.bench.results import CPU_NOTE, environment

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    env = environment(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    # eager Flex on a CPU is not the point; the Hopper kernels need an sm_90 GPU
    providers = [p for p in args.providers if cuda or p not in GPU_ONLY]
    rows = []
    for kind in args.masks:
        mask, label, predicate = build_mask(kind, args.tokens, args.window, args.doc_len, args.block, device)
        t0 = time.perf_counter()
        eb = mask.exact_bits(device)
        bits_ms = (time.perf_counter() - t0) * 1000
        pairs = exact_pairs(mask) * args.batch * args.heads
        block_pairs = int(mask.attended_pairs()) * args.batch * args.heads
        flex_mask = mask.to_flex(layout_in_mask_mod=False) if "flex" in providers else None
        for D in args.head_dims:
            g = torch.Generator(device=device).manual_seed(D)
            q, k, v, do = (torch.randn(args.batch, args.heads, args.tokens, D, device=device, dtype=dtype, generator=g)
                           for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
            outs = {}
            for prov in providers:
                fwd = _calls(prov, q, k, v, mask, flex_mask, predicate)
                row = dict(bench="exact", provider=prov, mask=kind, mask_label=label, batch=args.batch,
                           heads=args.heads, seq_len=args.tokens, head_dim=D, dtype=str(dtype).replace("torch.", ""),
                           block=args.block, partial_blocks=0 if eb is None else int(eb.bits.shape[0]),
                           bits_mb=0.0 if eb is None else eb.bits.numel() * 4 / 2**20, bits_build_ms=bits_ms,
                           token_density=round(pairs / (args.batch * args.heads * args.tokens ** 2), 5),
                           block_overcount=round(block_pairs / pairs, 4), status="ok",
                           note="" if cuda else CPU_NOTE, **env)
                with _switch(prov):
                    try:
                        with torch.no_grad():
                            outs[prov] = fwd().float()
                        row.update(timing.fwd_fwdbwd_times(fwd, (q, k, v), do,
                                                           lambda mode: attention_flops(pairs, D, mode), cuda=cuda,
                                                           graphs=not args.no_graph))
                    except Exception as e:  # a provider this machine cannot run: a row that says so
                        row["status"] = "error"
                        row["note"] = (row["note"] + " " + f"{type(e).__name__}: {str(e).splitlines()[0][:160]}").strip()
                rows.append(row)
                print(json.dumps({k_: row.get(k_) for k_ in ("provider", "mask", "head_dim", "fwd_ms", "fwd_gpu_ms",
                                                             "fwdbwd_ms", "fwdbwd_gpu_ms", "status")}), flush=True)
            ref = outs.get("flex")
            if ref is None and not cuda:
                import sparseflash

                ref = sparseflash.attention(q.detach().double(), k.detach().double(), v.detach().double(), mask,
                                            backend="reference").float()
            if ref is not None:
                for r in rows[-len(providers):]:
                    if r["provider"] in outs:
                        r["max_diff_vs_flex" if cuda else "max_diff_vs_reference"] = \
                            float((outs[r["provider"]] - ref).abs().max())
            del q, k, v, do, outs
            if cuda:
                torch.cuda.empty_cache()
    return rows


def write(rows: list[dict], out: Path, meta: dict) -> None:
    write_tidy(rows, meta, out, "exact", "sparseflash-exact/1")


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.bench.exact", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="exact_out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=positive_int, default=None, help="tokens per row (GPU 16384, CPU 128)")
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--heads", type=positive_int, default=None, help="GPU 16, CPU 1")
    ap.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    ap.add_argument("--window", type=positive_int, default=None, help="sliding window (GPU 1024, CPU 40)")
    ap.add_argument("--doc-len", type=positive_int, default=None, help="mean document length (GPU 2048, CPU 30)")
    ap.add_argument("--block", type=positive_int, default=None, help="mask block (GPU 128, CPU 32)")
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=None, help="GPU 64 128, CPU 16")
    ap.add_argument("--providers", nargs="+", default=list(DEFAULT_PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--no-graph", action="store_true", help="eager timings only (no CUDA-graph replays)")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    for name, gpu, cpu in (("tokens", 16384, 128), ("heads", 16, 1), ("window", 1024, 40), ("doc_len", 2048, 30),
                           ("block", 128, 32), ("head_dims", [64, 128], [16])):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda without a CUDA GPU")
    check_output_dir(args.out)
    t0 = time.time()
    rows = run(args)
    meta = dict(command="python -m sparseflash.experiments.bench.exact " + " ".join(argv if argv is not None else
                                                                                  sys.argv[1:]),
                seconds=round(time.time() - t0, 1))
    out = Path(args.out)
    write(rows, out, meta)
    print(f"wrote {out / 'exact.csv'}, {out / 'exact.json'}" + ("" if cuda else " (CPU: not GPU results)"))
    print(f"{'provider':>18} {'mask':>15} {'D':>4} {'fwd ms':>8} {'fwd gpu':>8} {'fb ms':>8} {'fb gpu':>8} {'fb TF/s':>8}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['provider']:>18} {r['mask']:>15} {r['head_dim']:4d} {r['note']}")
            continue
        print(f"{r['provider']:>18} {r['mask']:>15} {r['head_dim']:4d} {r['fwd_ms']:8.3f} {r['fwd_gpu_ms']:8.3f} "
              f"{r['fwdbwd_ms']:8.3f} {r['fwdbwd_gpu_ms']:8.3f} {r['fwdbwd_tflops']:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
