"""Packed variable-length documents: sparseflash with ``segment_ids`` against FlexAttention's
document mask and against dense attention over the whole packed row.

    python -m sparseflash.experiments.bench.packed --out DIR [--tokens 16384] [--batch 2] [--heads 16]
        [--mean-lens 512 2048] [--head-dims 64 128] [--causal on|off|both] [--no-graph]
    python -m sparseflash.experiments.bench.packed --plot DIR          (redraw DIR/packed.png from DIR/packed.json)
    python -m sparseflash.experiments.bench.packed --device cpu --out DIR   (tiny CPU run, labelled as such)

Every row of the batch packs documents of random lengths (exponential with the given mean, cut
to fit the row; seeds fixed) into ``tokens`` positions; bf16, forward and forward+backward.

Providers:
- ``sparseflash-segments``: `sparseflash.attention(..., segment_ids=ids)`; the timed call includes
  building the pruned block lists from the ids (done on the device at every call).
- ``flex-document``: compiled ``flex_attention`` with a ``create_block_mask`` of the document
  mask_mod (and causal); the block mask is built once outside the timed calls (``prep_ms``
  reports what that build costs per batch of ids).
- ``sparseflash-dense``, ``sdpa-dense``: attention over the whole row (no document mask), the
  work packing without a mask would do (and a wrong result; the reference point).

Timing: ``ms`` eager calls back to back (`timing.stream_ms`: the host's cost shows where it is the
longer), ``gpu_ms`` CUDA-graph replays (`timing.graph_ms`: kernels only; skipped with
``--no-graph``). ``tflops`` counts the attended pairs only (inside documents, causal), the same
numerator for every provider (`flops.attention_flops`). ``max_diff_vs_flex``: the largest
difference of the sparseflash forward output from Flex's at that setting (a check, not a
timing). Writes DIR/packed.csv, DIR/packed.json and DIR/packed.png.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, check_output_dir, positive_int, run_command
from sparseflash.experiments.bench.results import write_tidy

PROVIDERS = ("sparseflash-segments", "flex-document", "sparseflash-dense", "sdpa-dense")


def document_ids(tokens: int, mean_len: float, seed: int, device) -> torch.Tensor:
    """int32 [tokens]: the document index of each position, lengths exponential with this mean
    (at least 1), the last document cut to fit."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], tokens
    while left > 0:
        n = max(1, int(-mean_len * math.log(1.0 - float(torch.rand(1, generator=g)))))
        lengths.append(min(n, left))
        left -= lengths[-1]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids.to(device=device, dtype=torch.int32)


def attended_pairs(seg: torch.Tensor, causal: bool) -> int:
    """Token pairs inside documents (and causal), summed over the batch rows ([B, N] ids, sorted)."""
    total = 0
    for row in seg.cpu():
        counts = torch.unique_consecutive(row, return_counts=True)[1].long()
        total += int((counts * (counts + 1) // 2).sum() if causal else (counts * counts).sum())
    return total


def visited_block_fraction(seg: torch.Tensor, causal: bool) -> float:
    """Fraction of the (128 x 128) block pairs that the sparseflash kernels visit with these ids
    (of all block pairs; causal: of those on or below the diagonal)."""
    from sparseflash.flash import autograd
    from sparseflash.segments import segment_block_layout

    b = autograd.SEGMENT_BLOCK
    layout = segment_block_layout(seg, seg, b, b)[:, 0]
    nb = layout.shape[-1]
    if causal:
        tri = torch.ones(nb, nb, dtype=torch.bool, device=layout.device).tril()
        return float((layout & tri).sum()) / float(tri.sum() * layout.shape[0])
    return float(layout.float().mean())


def _flex_block_mask(seg: torch.Tensor, causal: bool, n: int):
    from torch.nn.attention.flex_attention import create_block_mask

    def document(b, h, q_idx, kv_idx):
        same = seg[b, q_idx] == seg[b, kv_idx]
        return same & (kv_idx <= q_idx) if causal else same

    try:
        return create_block_mask(document, seg.shape[0], None, n, n, device=seg.device, _compile=True)
    except TypeError:  # a torch without the _compile switch compiles it (or not) by itself
        return create_block_mask(document, seg.shape[0], None, n, n, device=seg.device)


def _calls(provider: str, q, k, v, seg, causal: bool, flex_mask):
    """A zero-argument forward call of ``provider``."""
    import sparseflash

    if provider == "sparseflash-segments":
        return lambda: sparseflash.attention(q, k, v, causal=causal, segment_ids=seg)
    if provider == "sparseflash-dense":
        return lambda: sparseflash.attention(q, k, v, causal=causal)
    if provider == "sdpa-dense":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if provider == "flex-document":
        from sparseflash.experiments.bench.providers import _flex_compiled

        fn = _flex_compiled()
        return lambda: fn(q, k, v, block_mask=flex_mask)
    raise ValueError(f"unknown provider {provider!r}")


def run(args) -> list[dict]:
    from sparseflash.experiments.bench import timing
    from sparseflash.experiments.bench.flops import attention_flops
    from sparseflash.experiments.bench.results import CPU_NOTE, environment

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    env = environment(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    causals = {"on": [True], "off": [False], "both": [False, True]}[args.causal]
    providers = [p for p in args.providers if cuda or p in ("sparseflash-segments", "sparseflash-dense")]
    rows = []
    for mean_len in args.mean_lens:
        seg = torch.stack([document_ids(args.tokens, mean_len, seed=1000 * b + int(mean_len), device=device)
                           for b in range(args.batch)])
        n_docs = [int(r.max()) + 1 for r in seg.cpu()]
        for causal in causals:
            pairs = attended_pairs(seg, causal) * args.heads
            visited = visited_block_fraction(seg, causal)
            flex_mask, prep_ms = None, float("nan")
            if "flex-document" in providers:
                _flex_block_mask(seg, causal, args.tokens)  # compile the builder outside the timing
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                flex_mask = _flex_block_mask(seg, causal, args.tokens)
                torch.cuda.synchronize()
                prep_ms = (time.perf_counter() - t0) * 1000
            for D in args.head_dims:
                g = torch.Generator(device=device).manual_seed(D)
                q, k, v, do = (torch.randn(args.batch, args.heads, args.tokens, D, device=device, dtype=dtype,
                                           generator=g) for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_()
                outs = {}
                for prov in providers:
                    fwd = _calls(prov, q, k, v, seg, causal, flex_mask)
                    row = dict(bench="packed", provider=prov, batch=args.batch, heads=args.heads, seq_len=args.tokens,
                               head_dim=D, dtype=str(dtype).replace("torch.", ""), causal=causal, mean_doc_len=mean_len,
                               docs_per_row=round(sum(n_docs) / len(n_docs), 1),
                               visited_blocks=round(visited, 4) if prov == "sparseflash-segments" else 1.0,
                               token_density=round(pairs / (args.heads * args.batch * args.tokens ** 2), 5),
                               prep_ms=prep_ms if prov == "flex-document" else 0.0, status="ok", note="" if cuda else CPU_NOTE,
                               **env)
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
                    print(json.dumps({k_: row.get(k_) for k_ in ("provider", "mean_doc_len", "head_dim", "causal", "fwd_ms",
                                                                 "fwd_gpu_ms", "fwdbwd_ms", "fwdbwd_gpu_ms", "status")}),
                          flush=True)
                if "sparseflash-segments" in outs:
                    ref = outs.get("flex-document")
                    if ref is None and not cuda:  # CPU: the reference with segments
                        from sparseflash import reference

                        ref = reference.attention(q.detach(), k.detach(), v.detach(), causal=causal, segment_ids=seg).float()
                    if ref is not None:
                        diff = float((outs["sparseflash-segments"] - ref).abs().max())
                        for r in rows[-len(providers):]:
                            r["max_diff_vs_flex" if cuda else "max_diff_vs_reference"] = diff
                del q, k, v, do, outs
                if cuda:
                    torch.cuda.empty_cache()
    return rows


def write(rows: list[dict], out: Path, meta: dict) -> None:
    write_tidy(rows, meta, out, "packed", "sparseflash-packed/1")


def plot(out: Path) -> Path:
    """DIR/packed.png from DIR/packed.json: time per call against mean document length, one panel
    per (head_dim, causal, mode), one line per provider (GPU time where measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparseflash.experiments.bench.plots import save_figure, suptitle

    rows = [r for r in json.loads((out / "packed.json").read_text())["rows"] if r["status"] == "ok"]
    panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(2, max(1, len(panels)), figsize=(4.2 * max(1, len(panels)), 7), squeeze=False)
    for col, (D, causal) in enumerate(panels):
        for row_i, mode in enumerate(("fwd", "fwdbwd")):
            ax = axes[row_i][col]
            for prov in PROVIDERS:
                pts = sorted((r["mean_doc_len"], r[f"{mode}_gpu_ms"] if r[f"{mode}_gpu_ms"] == r[f"{mode}_gpu_ms"]
                              else r[f"{mode}_ms"]) for r in rows
                             if r["provider"] == prov and r["head_dim"] == D and r["causal"] == causal)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=prov)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("mean document length (tokens)")
            ax.set_ylabel("ms per call")
            ax.set_title(f"d={D} {'causal' if causal else 'full'} {mode}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    r0 = rows[0] if rows else {}
    suptitle(fig, f"packed documents: {r0.get('batch')} x {r0.get('seq_len')} tokens, {r0.get('heads')} heads, "
             f"{r0.get('dtype')}", rows)
    return save_figure(fig, out / "packed.png")


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.bench.packed", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="packed_out")
    ap.add_argument("--plot", metavar="DIR", help="only redraw DIR/packed.png from DIR/packed.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=positive_int, default=None, help="tokens per packed row (GPU 16384, CPU 128)")
    ap.add_argument("--batch", type=positive_int, default=None, help="packed rows (GPU 2, CPU 1)")
    ap.add_argument("--heads", type=positive_int, default=None, help="GPU 16, CPU 1")
    ap.add_argument("--mean-lens", type=float, nargs="+", default=None, help="mean document lengths (GPU 512 2048, CPU 20)")
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=None, help="GPU 64 128, CPU 16")
    ap.add_argument("--causal", choices=("on", "off", "both"), default="on")
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--no-graph", action="store_true", help="eager timings only (no CUDA-graph replays)")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(Path(args.plot)))
        return 0
    cuda = args.device.startswith("cuda")
    for name, gpu, cpu in (("tokens", 16384, 128), ("batch", 2, 1), ("heads", 16, 1), ("mean_lens", [512, 2048], [20]),
                           ("head_dims", [64, 128], [16])):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda without a CUDA GPU")
    check_output_dir(args.out)
    t0 = time.time()
    rows = run(args)
    meta = dict(command="python -m sparseflash.experiments.bench.packed " + " ".join(argv if argv is not None else
                                                                                   sys.argv[1:]),
                seconds=round(time.time() - t0, 1))
    out = Path(args.out)
    write(rows, out, meta)
    print(f"wrote {out / 'packed.csv'}, {out / 'packed.json'}, {plot(out)}")
    hdr = f"{'provider':>22} {'mean':>6} {'D':>4} {'causal':>6} {'fwd ms':>8} {'fwd gpu':>8} {'fb ms':>8} {'fb gpu':>8} {'fb TF/s':>8}"
    print(hdr)
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['provider']:>22} {r['mean_doc_len']:6.0f} {r['head_dim']:4d} {str(r['causal']):>6} {r['note']}")
            continue
        print(f"{r['provider']:>22} {r['mean_doc_len']:6.0f} {r['head_dim']:4d} {str(r['causal']):>6} {r['fwd_ms']:8.3f} "
              f"{r['fwd_gpu_ms']:8.3f} {r['fwdbwd_ms']:8.3f} {r['fwdbwd_gpu_ms']:8.3f} {r['fwdbwd_tflops']:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
