"""Decode speed: one query token against a KV cache, as a fraction of the memory bandwidth it needs.

    python -m sparseflash.experiments.bench.decode --out experiments/results/decode

bf16, head dim 128, GQA 32 query heads / 8 kv heads, batch 1-64, cache 4K-256K tokens (a point is
skipped when its cache would not fit ``--max-cache-gb``). Dense: every cached key; sparse: 10% of
the cache blocks of 128 tokens per (batch, kv head), drawn at random (block-sparse decoding, as a
top-k selection gives). Providers:

- ``sparseflash``: `sparseflash.flash_attn_with_kvcache` (the split-KV kernel, ``num_splits=0``),
  cache ``[batch, seq, kv_heads, d]``; sparse through ``mask=``.
- ``flex``: ``torch.compile(flex_attention)`` with ``enable_gqa``, cache ``[batch, kv_heads, seq, d]``;
  sparse through a BlockMask of full blocks (``from_kv_blocks``, the 10% per query head).
- ``sdpa``: ``scaled_dot_product_attention(enable_gqa=True)``, dense only.
- ``sparseflash-NAME``: ``sparseflash`` with the decode switches of ``NAME`` set
  (`experiments.studies.decode_host.VARIANTS`), measured beside the default in the same run
  (`sparseflash.flash.decode.OVERRIDES`; experiments/studies/decode_host): ``old``, the default before
  the H200 measurement of fdc55a7 (the bounds check its own launch, the split count unbalanced);
  ``unbalanced`` and ``host-check``, each of those alone; ``fused``, the study switch ``fused_combine``
  on (the split kernel merges its splits). A variant's call also sorts its OVERRIDES into the call key
  (about 1 µs of host time that the default does not pay).

Time: GPU time per call from CUDA-graph replays (``do_bench_cudagraph`` median: no host cost; the
cache is far larger than L2 from batch 4 / 16K on), and ``eager_ms``, the wall time per call of calls
issued back to back on the stream as a decode loop issues them (`timing.stream_ms`: host cost
included; the larger of a call's host and GPU time). The table ends with ours beside SDPA's per dense
point, eager and GPU time (the issue's eager goal: at most 1.2x SDPA's at B1 x 16K and B16 x 16K,
``--full``). Achieved bandwidth = bytes of cache the call must
read (K and V of the attended keys; the query and output are negligible) / time, and its percentage
of the device-copy bandwidth measured in the same run (`copy_bandwidth`: an elementwise kernel over a
1 GiB buffer, read + write bytes / time). ``max_err`` compares each output with a float32 computation of the same attention.
Also (``--deterministic-check``, on by default) fwd+bwd of `flash_attn_func` at 16K tokens, d 128, 16
heads, causal, bf16, with and without ``deterministic=True``.

Writes ``DIR/decode.csv`` (a row per provider x point), ``DIR/decode.json``, ``DIR/decode.png``,
``DIR/deterministic.csv``; prints the table, then ours beside SDPA's per dense point. About 3-4 minutes on an H100 (most of it Flex's
compilation per shape). ``--quick``: tiny sizes, for a CPU check of the script (interpreter).
``--full``: the issue's whole grid (batch 1/4/16/64 x cache 4K/16K/64K/256K; B64 x 256K, 64 GiB of
cache, is over its 48 GB and skipped).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

from sparseflash.experiments.bench.results import environment, write_tidy

BLOCK = 128  # cache block of the sparse points (tokens)


def copy_bandwidth(device) -> float:
    """Bytes per second of a 1 GiB buffer read and written by an elementwise kernel (read + write
    bytes), CUDA-graph median: the rate kernels on the SMs reach. (A plain ``copy_`` of a contiguous
    buffer is a device-to-device memcpy, which a captured graph runs as a memcpy node: it measured
    ~2.7 TB/s on an H200, below what the decode kernel itself reads.)"""
    from sparseflash.experiments.bench.timing import graph_ms

    n = (1 << 30) // 4
    src = torch.ones(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = graph_ms(lambda: torch.mul(src, 2.0, out=dst))
    return 2 * n * 4 / (ms / 1e3)


def _time_ms(fn, device) -> float:
    fn()
    if device.type == "cuda":
        from sparseflash.experiments.bench.timing import graph_ms

        torch.cuda.synchronize()
        return graph_ms(fn)
    t0 = time.perf_counter()  # CPU (--quick): one call's wall time, a check of the script only
    fn()
    return (time.perf_counter() - t0) * 1e3


def _eager_step_ms(fn, device) -> float:
    """Wall ms per call of calls issued back to back (GPU: `timing.stream_ms`, 20 calls a sample, host
    cost included); on a CPU one call's wall time."""
    if device.type != "cuda":
        return _time_ms(fn, device)
    from sparseflash.experiments.bench.timing import stream_ms

    return stream_ms(fn, 20)


def _selection(B, Hk, nkb, density, gen, device):
    """Per (batch, kv head) a random 10% (at least one) of the cache blocks: a bool layout [B, Hk, nkb]."""
    n_sel = max(1, round(density * nkb))
    scores = torch.rand(B, Hk, nkb, generator=gen)
    top = scores.topk(n_sel, dim=-1).indices
    return torch.zeros(B, Hk, nkb, dtype=torch.bool).scatter_(-1, top, True).to(device), n_sel


def _reference(q, k, v, keep=None):
    """float32 attention: q [B, 1, H, D], k, v [B, N, Hk, D]; keep [B, Hk, N] (True: attended). One
    batch row at a time, GQA groups without expanding K and V (a 256K cache stays in memory)."""
    B, _, H, D = q.shape
    Hk = k.shape[2]
    out = torch.empty(B, 1, H, D, device=q.device, dtype=torch.float32)
    for b in range(B):
        qb = q[b, 0].float().view(Hk, H // Hk, D)
        kb, vb = k[b].float(), v[b].float()  # [N, Hk, D]
        s = torch.einsum("hgd,nhd->hgn", qb, kb) / math.sqrt(D)
        if keep is not None:
            s = s.masked_fill(~keep[b][:, None, :], float("-inf"))
        out[b, 0] = torch.einsum("hgn,nhd->hgd", s.softmax(-1), vb).reshape(H, D)
        del kb, vb
    return out


def switches(provider: str) -> dict:
    """The decode switches of a ``sparseflash-NAME`` provider ({} for ``sparseflash``, the default)."""
    if provider == "sparseflash":
        return {}
    from sparseflash.experiments.studies.decode_host import VARIANTS

    name = provider.removeprefix("sparseflash-")
    if name not in VARIANTS:
        raise ValueError(f"unknown provider {provider!r}: sparseflash-NAME takes NAME of {', '.join(VARIANTS)}")
    return VARIANTS[name]


def run_point(B, N, H, Hk, D, dtype, device, sparse: bool, providers, gen, flex_fn):
    """Rows of one (batch, cache length, dense or sparse) point, one per provider."""
    import torch.nn.functional as F

    import sparseflash
    from sparseflash import BlockMask

    rows = []
    dgen = torch.Generator(device=device).manual_seed(B * N)  # drawn on the device: a 256K cache in seconds
    q = torch.randn(B, 1, H, D, generator=dgen, device=device, dtype=dtype)
    k = torch.randn(B, N, Hk, D, generator=dgen, device=device, dtype=dtype)
    v = torch.randn(B, N, Hk, D, generator=dgen, device=device, dtype=dtype)
    seqlens = torch.full((B,), N, dtype=torch.int32, device=device)
    nkb = N // BLOCK
    keep = mask = None
    n_sel = nkb
    if sparse:
        lay, n_sel = _selection(B, Hk, nkb, 0.10, gen, device)
        mask = BlockMask.from_layout(lay[:, :, None, :], block_size=(BLOCK, BLOCK), seq_q=1, seq_k=N)
        keep = lay.repeat_interleave(BLOCK, -1)
    bytes_read = 2 * B * Hk * n_sel * BLOCK * D * torch.finfo(dtype).bits // 8
    want = _reference(q, k, v, keep)
    from sparseflash.flash import decode

    saved = dict(decode.OVERRIDES)
    for prov in providers:
        if prov == "sdpa" and sparse:
            continue
        try:
            if prov.startswith("sparseflash"):
                decode.OVERRIDES.update(switches(prov))  # (for the provider's whole measurement: no switching a call)
                fn = lambda: sparseflash.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, mask=mask)
            else:
                qt, kt, vt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
                if prov == "sdpa":
                    fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
                else:
                    bm = None
                    if sparse:
                        from torch.nn.attention.flex_attention import BlockMask as FlexMask

                        idx = lay.nonzero()[:, 2].view(B, Hk, n_sel).to(torch.int32)
                        idx = idx.repeat_interleave(H // Hk, 1)[:, :, None, :]  # [B, H, 1, n_sel]
                        # Flex's index lists are as wide as the key blocks (the rest is padding)
                        idx = torch.nn.functional.pad(idx, (0, nkb - n_sel)).contiguous()
                        cnt = torch.full((B, H, 1), n_sel, dtype=torch.int32, device=device)
                        bm = FlexMask.from_kv_blocks(torch.zeros_like(cnt), idx, cnt, idx, BLOCK_SIZE=BLOCK,
                                                     seq_lengths=(1, N))
                    fn = lambda: flex_fn(qt, kt, vt, block_mask=bm, enable_gqa=True).transpose(1, 2)
            got = fn()
            err = (got.float() - want).abs().max().item()
            ms = _time_ms(fn, device)
            rows.append(dict(provider=prov, status="ok", ms=ms, eager_ms=_eager_step_ms(fn, device), max_err=err,
                             **({"_out": got} if prov.startswith("sparseflash") else {})))
            del fn
        except Exception as e:  # a provider that cannot run a point gives a row that says why
            if device.type == "cuda" and "out of memory" in str(e):
                torch.cuda.empty_cache()
            rows.append(dict(provider=prov, status=f"error: {type(e).__name__}: {str(e)[:120]}", ms=float("nan"),
                             eager_ms=float("nan"), max_err=float("nan")))
        finally:
            decode.OVERRIDES.clear()
            decode.OVERRIDES.update(saved)
    # whether a variant changes any bit of the answer: the launch switches ("host-check", "fused") must
    # not; the unbalanced split count ("old", "unbalanced") sums in another order where it differs from the
    # balanced one (on an H200: batch 4; experiments/studies/decode_host)
    outs = {r["provider"]: r.pop("_out") for r in rows if "_out" in r}
    default = outs.get("sparseflash")
    for r in rows:
        if r["provider"] in outs and r["provider"] != "sparseflash" and default is not None:
            r["bitwise_default"] = bool(torch.equal(outs[r["provider"]], default))
    for r in rows:
        r.update(batch=B, cache_len=N, heads=H, kv_heads=Hk, head_dim=D, dtype=str(dtype)[6:],
                 mode="sparse" if sparse else "dense", density=n_sel / nkb, bytes_read=bytes_read)
        r["gb_per_s"] = bytes_read / (r["ms"] / 1e3) / 1e9 if r["status"] == "ok" else float("nan")
    return rows


def deterministic_rows(device, n: int = 16384, heads: int = 16, d: int = 128) -> list[dict]:
    """fwd+bwd of flash_attn_func, causal, bf16, batch 1, with and without deterministic=True."""
    import sparseflash

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v, do = (torch.randn(1, n, heads, d, generator=gen).to(device, dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    rows = []
    for det in (False, True):
        def step():
            out = sparseflash.flash_attn_func(q, k, v, causal=True, deterministic=det)
            out.backward(do)
        ms = _time_ms(step, device) if device.type != "cuda" else _eager_ms(step)
        rows.append(dict(bench="deterministic", seq_len=n, heads=heads, head_dim=d, causal=True,
                         dtype=str(dtype)[6:], deterministic=det, fwd_bwd_ms=ms))
    rows[1]["slowdown"] = rows[1]["fwd_bwd_ms"] / rows[0]["fwd_bwd_ms"]
    return rows


def _eager_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def plot(rows, copy_bw, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparseflash.experiments.bench.plots import save_figure, suptitle

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mode in zip(axes, ("dense", "sparse")):
        for prov, style in (("sparseflash", "-o"), ("flex", "--s"), ("sdpa", ":^")):
            for B in sorted({r["batch"] for r in rows}):
                pts = [(r["cache_len"], r["pct_copy_bw"]) for r in rows
                       if r["provider"] == prov and r["mode"] == mode and r["batch"] == B and r["status"] == "ok"]
                if pts:
                    xs, ys = zip(*sorted(pts))
                    ax.plot(xs, ys, style, label=f"{prov} B{B}", markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cache length (tokens)")
        ax.set_title(f"{mode} decode ({'10% of cache blocks' if mode == 'sparse' else 'whole cache'})")
        ax.axhline(80, color="grey", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"% of device-copy bandwidth ({copy_bw / 1e12:.2f} TB/s)")
    axes[1].legend(fontsize=7, ncol=2)
    suptitle(fig, "decode with a KV cache: bf16, one query token", rows)
    save_figure(fig, path, dpi=120)


def table(rows) -> str:
    head = (f"{'mode':6} {'B':>3} {'cache':>7} {'provider':18} {'ms':>8} {'eager ms':>8} {'GB/s':>7} {'%copy':>6} "
            f"{'max_err':>8}  status")
    lines = [head]
    for r in rows:
        lines.append(f"{r['mode']:6} {r['batch']:>3} {r['cache_len']:>7} {r['provider']:18} {r['ms']:>8.4f} "
                     f"{r['eager_ms']:>8.4f} {r['gb_per_s']:>7.0f} {r['pct_copy_bw']:>6.1f} {r['max_err']:>8.1e}  "
                     f"{r['status'][:40]}")
    return "\n".join(lines)


EAGER_GOAL = 1.2  # the eager step's wall time, at most this many times SDPA's (B1 x 16K and B16 x 16K)


def against_sdpa(rows) -> str:
    """Per dense point measured for both: our eager step's wall time and GPU time beside SDPA's, as
    ratios (ours / SDPA: under 1 is faster), the eager goal's points marked; a row per sparseflash
    provider (the default and each ``sparseflash-NAME`` variant, with whether its output equals the
    default's bit for bit)."""
    ok = [r for r in rows if r["status"] == "ok" and r["mode"] == "dense"]
    sdpa = {(r["batch"], r["cache_len"]): r for r in ok if r["provider"] == "sdpa"}
    lines = [f"{'B':>3} {'cache':>7} {'provider':>18} {'eager ms':>9} {'SDPA':>8} {'x':>6} {'GPU ms':>8} {'SDPA':>8} "
             f"{'x':>6}  (ours / SDPA; eager goal <= {EAGER_GOAL})"]
    for r in ok:
        s = sdpa.get((r["batch"], r["cache_len"]))
        if not r["provider"].startswith("sparseflash") or s is None:
            continue
        goal = (r["batch"], r["cache_len"]) in ((1, 16384), (16, 16384))
        xe, xg = r["eager_ms"] / s["eager_ms"], r["ms"] / s["ms"]
        mark = ("  goal " + ("met" if xe <= EAGER_GOAL else "missed")) if goal else ""
        if "bitwise_default" in r:
            mark += "  bitwise the default" if r["bitwise_default"] else "  DIFFERS from the default"
        lines.append(f"{r['batch']:>3} {r['cache_len']:>7} {r['provider']:>18} {r['eager_ms']:>9.4f} "
                     f"{s['eager_ms']:>8.4f} {xe:>6.2f} {r['ms']:>8.4f} {s['ms']:>8.4f} {xg:>6.2f}{mark}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder for decode.csv, decode.json, decode.png, deterministic.csv (required unless --plot)")
    ap.add_argument("--plot", metavar="DIR", help="only redraw DIR/decode.png from DIR/decode.json")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--cache-lens", default="4096,32768,262144")
    ap.add_argument("--providers", default="sparseflash,flex,sdpa",
                    help="of sparseflash, flex, sdpa and sparseflash-NAME (the decode switches NAME: old, "
                         "unbalanced, host-check, fused)")
    ap.add_argument("--max-cache-gb", type=float, default=20.0, help="skip points whose K+V cache is larger")
    ap.add_argument("--no-deterministic-check", action="store_true")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU check of the script)")
    ap.add_argument("--full", action="store_true",
                    help="the issue's whole grid: batches 1,4,16,64 x caches 4K,16K,64K,256K, caches up to 48 GB")
    args = ap.parse_args(argv)
    if args.plot:
        import json

        doc = json.loads((Path(args.plot) / "decode.json").read_text())
        plot(doc["rows"], doc["meta"]["copy_gb_per_s"] * 1e9, Path(args.plot) / "decode.png")
        print(Path(args.plot) / "decode.png")
        return 0
    if not args.out:
        ap.error("--out is required")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    H, Hk, D, dtype = 32, 8, 128, torch.bfloat16
    if args.full:
        args.batches, args.cache_lens, args.max_cache_gb = "1,4,16,64", "4096,16384,65536,262144", 48.0
    batches = [int(x) for x in args.batches.split(",")]
    lens = [int(x) for x in args.cache_lens.split(",")]
    providers = args.providers.split(",")
    for p in providers:
        if p.startswith("sparseflash-"):
            try:
                switches(p)
            except ValueError as e:
                ap.error(str(e))
    if args.quick:
        H, Hk, D, batches, lens = 4, 2, 16, [1, 2], [256]
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        providers = [p for p in providers if device.type == "cuda" or p != "flex"]
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    flex_fn = None
    if "flex" in providers:
        import torch._dynamo as dynamo
        from torch.nn.attention.flex_attention import flex_attention

        dynamo.config.cache_size_limit = 256  # one compile per shape; never the unfused fallback
        if hasattr(dynamo.config, "recompile_limit"):
            dynamo.config.recompile_limit = 256
        flex_fn = torch.compile(flex_attention, dynamic=False)
    env = environment(device)
    copy_bw = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    gen = torch.Generator().manual_seed(0)
    rows = []
    t0 = time.time()
    for sparse in (False, True):
        for B in batches:
            for N in lens:
                if 2 * B * N * Hk * D * torch.finfo(dtype).bits / 8 > args.max_cache_gb * 2**30:
                    continue
                rows += run_point(B, N, H, Hk, D, dtype, device, sparse, providers, gen, flex_fn)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    for r in rows:
        r["copy_gb_per_s"] = copy_bw / 1e9
        r["pct_copy_bw"] = 100 * r["gb_per_s"] * 1e9 / copy_bw if copy_bw == copy_bw else float("nan")
        r.update({k: v for k, v in env.items()})
    out = Path(args.out)
    meta = dict(bench="decode", command=" ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                copy_gb_per_s=copy_bw / 1e9, seconds=time.time() - t0, **env)
    write_tidy(rows, meta, out, "decode", "sparseflash.decode/1")
    plot(rows, copy_bw if copy_bw == copy_bw else 1.0, out / "decode.png")
    if not args.no_deterministic_check:
        det = deterministic_rows(device, *((64, 1, 16) if args.quick else ()))
        for r in det:
            r.update(env)
        write_tidy(det, dict(bench="deterministic", **env), out, "deterministic", "sparseflash.deterministic/1")
        print("deterministic=True cost (fwd+bwd, causal): " + ", ".join(
            f"{'det' if r['deterministic'] else 'default'} {r['fwd_bwd_ms']:.3f} ms" for r in det)
            + f" (x{det[1]['slowdown']:.2f})")
    print(f"{env['device_name']}: device copy {copy_bw / 1e9:.0f} GB/s (read + write); {time.time() - t0:.0f} s")
    print(table(rows))
    print(against_sdpa(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
