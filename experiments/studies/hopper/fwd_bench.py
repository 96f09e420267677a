"""The Hopper forward against the portable one, SDPA flash, cuDNN and FlexAttention (issue 22).

    python -m sparseflash.experiments.studies.hopper.fwd_bench [--seqs 4096 16384] [--head-dims 64 128]
        [--masks dense random butterfly causal local] [--modes fwd fwdbwd] [--providers ...] [--out DIR]

GPU time (CUDA-graph replays, `bench.timing.graph_ms`), bf16, 16 heads, 16K tokens per batch
(B = 16384 / N), side by side in one process. Providers:
- ``hopper``: sparseflash.attention as it runs by default on sm_90: the Hopper forward, and the
  Hopper backward without block lists (hopper_bwd.MODE "auto": block-sparse calls take the
  portable backward);
- ``hopper-fwd``: the Hopper forward with the portable backward (hopper_bwd.MODE "off");
- ``portable``: the same call with SPARSEFLASH_HOPPER off (the portable kernels, with their
  own TMA rule);
- ``flex``: torch.compile(flex_attention) with the identical block mask (`bench.providers`);
- ``sdpa-flash``, ``sdpa-cudnn``: dense and dense causal only.
Masks: dense; random (3 of 32 blocks per row at 4K, 13 of 128 at 16K: density ~0.1); butterfly
(block 128); causal (dense, bottom-right); local (a 1024-token window each side, block 128).
fwdbwd times forward + backward. ``--rounds R`` measures every row R times, the providers of a case
interleaved (A B C A B C), and reports the median (``ms_rounds`` keeps each): the H100 runs these
at its 700 W power cap, where clocks drift by a few percent with the GPU's temperature.
TFLOP/s count attended pairs only (`bench.flops`). Writes hopper_fwd.csv / .json with --out;
`python -m sparseflash.experiments.studies.hopper.plot DIR/hopper_fwd.json` draws them.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command

PROVIDERS = ("hopper", "hopper-fwd", "portable", "flex", "sdpa-flash", "sdpa-cudnn")
# (forward, backward) modes of the sparseflash providers, held over the whole timed step
MODES = {"hopper": ("auto", "auto"), "hopper-fwd": ("auto", "off"), "portable": ("off", "off")}


@contextlib.contextmanager
def _modes(provider: str):
    """Hold `hopper.MODE` and `hopper_bwd.MODE` at the provider's values (others: unchanged)."""
    from sparseflash.flash.hopper import backward as hopper_bwd, forward as hopper

    saved = hopper.MODE, hopper_bwd.MODE
    hopper.MODE, hopper_bwd.MODE = MODES.get(provider, saved)
    try:
        yield
    finally:
        hopper.MODE, hopper_bwd.MODE = saved


def _mask(kind: str, n: int):
    from sparseflash.patterns import butterfly, local, random as random_mask

    if kind in ("dense", "causal"):
        return None
    if kind == "random":
        return random_mask(n, 3 if n <= 4096 else max(1, round(0.1 * n / 128)), block_size=128, seed=0, device="cuda")
    if kind.startswith("random") and kind[6:].isdigit():  # randomK: K random blocks a row
        return random_mask(n, int(kind[6:]), block_size=128, seed=0, device="cuda")
    if kind == "butterfly":
        return butterfly(n, block_size=128, device="cuda")
    if kind == "local":
        return local(n, 1024, block_size=128, device="cuda")
    raise ValueError(kind)


def _call(provider: str, mask, causal: bool, scale: float):
    import torch.nn.functional as F

    import sparseflash

    if provider in MODES:
        return lambda q, k, v: sparseflash.attention(q, k, v, mask=mask, causal=causal)
    if provider == "flex":
        from sparseflash.experiments.bench.providers import _flex_compiled, to_flex_block_mask

        fn = _flex_compiled()
        m = mask
        if m is None and causal:
            raise ValueError("dense causal for flex: use the all-on mask")
        bm = None if m is None else to_flex_block_mask(m, causal, torch.device("cuda"))
        return lambda q, k, v: fn(q, k, v, block_mask=bm, scale=scale)
    if provider.startswith("sdpa-"):
        if mask is not None:
            raise ValueError("SDPA has no block mask")
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.FLASH_ATTENTION if provider == "sdpa-flash" else SDPBackend.CUDNN_ATTENTION

        def run(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        return run
    raise ValueError(provider)


def step(prov: str, fn, mode: str, q, k, v, do):
    """The timed step of one row: ``fn`` (`_call`'s) forward without grad, or forward + backward
    (``torch.autograd.grad``), under the provider's kernel modes."""
    if mode == "fwd":
        def run():
            with torch.no_grad(), _modes(prov):
                fn(q, k, v)
        return run
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def run():
        with _modes(prov):
            torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), do)
    return run


def save_json(out, name: str, rows: list, meta: dict | None = None) -> Path:
    """Write ``{meta, rows}`` to ``out/name`` (meta: this GPU's `bench.results.environment` by
    default); the hopper studies' one JSON format."""
    if meta is None:
        from sparseflash.experiments.bench.results import environment

        meta = environment(torch.device("cuda"))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    return path


def _write(out: Path, rows: list, meta: dict) -> None:
    import csv

    stamp = {k: meta.get(k) for k in ("device_name", "torch", "triton", "sparseflash", "commit", "date")}
    rows = [dict(r, **stamp) for r in rows]  # every row says where and when it ran
    save_json(out, "hopper_fwd.json", rows, meta)
    with open(out / "hopper_fwd.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper.fwd_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--masks", nargs="+", default=["dense", "random", "butterfly", "causal", "local"])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    ap.add_argument("--rounds", type=int, default=1, help="times each row is measured, providers interleaved; "
                    "the row's ms is the median")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from sparseflash.experiments.bench.flops import attended_pairs, attention_flops
    from sparseflash.experiments.bench.results import environment
    from sparseflash.experiments.bench.timing import graph_ms
    from sparseflash.mask import BlockMask

    meta = dict(environment(torch.device("cuda")), args=vars(args))
    rows = []
    H = 16
    for n in args.seqs:
        B = max(1, 16384 // n)
        for d in args.head_dims:
            g = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v, do = (torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
            for kind in args.masks:
                causal = kind == "causal"
                mask = _mask(kind, n)
                pairs = attended_pairs(mask, B, H, n, n, causal)
                case_rows = {}
                for rnd in range(args.rounds):  # rounds interleave the providers (the GPU's power cap drifts)
                    for prov in args.providers:
                        if prov.startswith("sdpa") and mask is not None:
                            continue
                        pmask = mask
                        if prov == "flex" and mask is None:  # dense / causal: the all-on layout
                            nb = n // 128
                            pmask = BlockMask(torch.ones(nb, nb, dtype=torch.bool, device="cuda"), 128, n)
                        for mode in args.modes:
                            row = case_rows.setdefault((prov, mode), dict(
                                seq=n, batch=B, heads=H, head_dim=d, mask=kind, provider=prov, mode=mode,
                                density=pairs / (B * H * n * n), ms=None, tflops=None, ms_rounds=[], error=None))
                            if row["error"]:
                                continue
                            try:
                                run = step(prov, _call(prov, pmask, causal, d ** -0.5), mode, q, k, v, do)
                                run()
                                torch.cuda.synchronize()
                                row["ms_rounds"].append(round(graph_ms(run), 5))
                                row["ms"] = statistics.median(row["ms_rounds"])
                                row["tflops"] = (attention_flops(pairs, d, "fwd" if mode == "fwd" else "fwdbwd")
                                                 / row["ms"] / 1e9)
                            except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
                                row["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()[-400:]
                            if rnd == 0:
                                rows.append(row)
                            if args.out:  # after every row: a run cut short keeps what it measured
                                _write(Path(args.out), rows, meta)
                            ms = ("failed" if row["ms"] is None else
                                  f"{row['ms_rounds'][-1]:.4f} ms (median {row['ms']:.4f}) {row['tflops']:6.1f} TFLOP/s")
                            print(f"N={n:5d} d={d:3d} {kind:9s} {prov:10s} {mode:6s} r{rnd} {ms}"
                                  + (f"  {row['error'][:160]}" if row["error"] else ""), flush=True)
    # summary: hopper against each other provider (time ratio; > 1: hopper faster)
    print(f"\n{'N':>5s} {'d':>3s} {'mask':9s} {'mode':6s} {'hopper ms':>9s} " + " ".join(f"{p:>10s}" for p in args.providers if p != "hopper"))
    key = {(r["seq"], r["head_dim"], r["mask"], r["mode"], r["provider"]): r["ms"] for r in rows}
    for n in args.seqs:
        for d in args.head_dims:
            for kind in args.masks:
                for mode in args.modes:
                    h = key.get((n, d, kind, mode, "hopper"))
                    if h is None:
                        continue
                    cells = []
                    for p in args.providers:
                        if p == "hopper":
                            continue
                        o = key.get((n, d, kind, mode, p))
                        cells.append(f"{o / h:9.2f}x" if o else f"{'-':>10s}")
                    print(f"{n:5d} {d:3d} {kind:9s} {mode:6s} {h:9.4f} " + " ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
