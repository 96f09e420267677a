"""Our training step (forward + backward) beside FlashAttention-4's on the same tensors, per design
step of the Hopper backward.

    python -m sparseflash.experiments.studies.hopper_bwd_fa4.compare --out DIR [--cases NAME ...]
        [--variants ours ours-q64 ...] [--providers fa4 cudnn flex] [--rep-ms 100]

Cases (`CASES`): 16 heads, bf16, batch 16384 / N (4K: 4 sequences), dense or causal, and block
masks near density 0.1 built as `bench sparsity` builds them (random, butterfly, causal local);
also by name (`case`): ``randomK-dD-Nk`` (K random blocks a row, each head its own) and
``localW-dD-Nk`` (a causal window of W tokens), for the backward's dispatch threshold.
Each provider runs the call on the same [B, H, N, D] tensors (FA4 on its [B, N, H, D] views, no
copy; block masks as the same block lists, `experiments/bench/providers.py`). Times are GPU ms of
CUDA-graph replays (`timing.graph_ms`): the forward without autograd, and forward + backward
(the gradients of q, k, v for one dO); ``bwd_ms`` is their difference. Our variants (`VARIANTS`)
are the production kernels with a study override (`hopper.backward.OVERRIDES`); ``ours`` is
the production default. Each provider's output and gradients are compared with ours
(``max_diff_*``, max abs difference; the float64 checks are the GPU tests'). Writes DIR/compare.csv
and DIR/compare.json (environment, rows) and prints a table last, with each provider's speed
relative to FA4's (FA4's time / its time: above 1 is faster than FA4).
"""

from __future__ import annotations

import contextlib
import csv
import json
import re
import sys
from pathlib import Path

import torch

from sparseflash.cmdline import ArgumentParser, run_command

__all__ = ["CASES", "VARIANTS", "variant", "main"]

# name: (seq_len, head_dim, causal, pattern or None)
CASES = {
    f"{kind}-d{d}-{n // 1024}k": (n, d, kind in ("causal", "local"), None if kind in ("dense", "causal") else kind)
    for n in (16384, 4096) for kind in ("dense", "causal", "random", "butterfly", "local") for d in (128, 64)
}
DEFAULT_CASES = ("dense-d128-16k", "dense-d64-16k", "causal-d128-16k", "causal-d64-16k", "random-d128-16k",
                 "random-d64-16k", "dense-d128-4k", "dense-d64-4k", "causal-d128-4k", "causal-d64-4k",
                 "random-d128-4k", "random-d64-4k")
# our variants: hopper.backward.OVERRIDES for the call, and "MODE" for hopper.backward.MODE ("on":
# the one-pass backward on every walk, "off": the portable pair); "ours": the production default
VARIANTS = {"ours": {}, "ours-q64": {"q_step": {64: 64}}, "ours-q128": {"q_step": {64: 128}},
            "ours-regstore": {"dkdv_tma": False}, "onepass": {"MODE": "on"},
            "onepass-regstore": {"MODE": "on", "dkdv_tma": False}, "portable": {"MODE": "off"},
            # a causal walk in one loop testing every step (the default before the split), with either store
            "causal-one-loop": {"causal_split": False},
            "causal-one-loop-regstore": {"causal_split": False, "dkdv_tma": False},
            # a non-persistent backward grid: one CTA a key tile (causal: a pair of them)
            "bwd-grid-all": {"grid_all": True},
            # dP^T started at zero, -delta added after (no injected warpgroup wait between S^T and dP^T)
            "bwd-dp-zero": {"dp_zero": True},
            # the forward at d=64 without block lists: "fwd-2wg", two ping-pong consumer warpgroups (the
            # default before three flat ones); "fwd-2wg-flat": two warpgroups in the flat step order;
            # "fwd-3wg-flat": three flat warpgroups (the default there)
            "fwd-2wg": {"fwd": {"consumers": 2}}, "fwd-3wg-flat": {"fwd": {"consumers": 3, "flat": True}},
            "fwd-2wg-flat": {"fwd": {"consumers": 2, "flat": True}},
            # the causal forward's heads in sections of 2 / 4 / 8 (longest tiles first within each), so the
            # K / V a section's CTAs re-read stay in L2 (all heads at once: 128 MB at 16K, d=128, 16 heads)
            "fwd-sec2": {"fwd": {"sec_heads": 2}}, "fwd-sec4": {"fwd": {"sec_heads": 4}},
            "fwd-sec8": {"fwd": {"sec_heads": 8}},
            # one CTA a tile instead of a persistent grid (the hardware deals the tiles out as SMs free
            # up, as FA4's causal forward does), all heads at once or in sections of 2 / 4 / 8
            "fwd-one-tile": {"fwd": {"one_tile": True}},
            **{f"fwd-one-tile-sec{s}": {"fwd": {"one_tile": True, "sec_heads": s}} for s in (2, 4, 8)},
            # the two ping-pong warpgroups pass the turn by named barriers (no warpgroup bar.sync an arrive)
            "fwd-named-turns": {"fwd": {"named_turns": True}},
            "fwd-named-turns-one-tile": {"fwd": {"named_turns": True, "one_tile": True}},
            # the dynamic schedule (each CTA of the persistent grid takes its next tile from a counter):
            # causal sections of `forward.section`'s size, or of 1 / 2 / 4 / 8 / all (batch, head)s
            "fwd-dyn": {"fwd": {"dynamic": True}},
            **{f"fwd-dyn-sec{s}": {"fwd": {"dynamic": True, "sec_heads": s}} for s in (1, 2, 4, 8)},
            "fwd-dyn-all": {"fwd": {"dynamic": True, "sec_heads": None}},
            "fwd-static": {"fwd": {"dynamic": False}},
            # three consumer warpgroups at d=64 with turns and in-warpgroup overlap (FA4's configuration there),
            # spill-free since the loader keeps 32 registers; and the flat default with the loader's old 40
            "fwd-3wg-overlap": {"fwd": {"consumers": 3, "flat": False}},
            "fwd-3wg-lr40": {"fwd": {"loader_regs": 40}}}


@contextlib.contextmanager
def variant(over: dict):
    """The study overrides of a `VARIANTS` entry (``over``) while the block runs: the backward's
    (`hopper_bwd.OVERRIDES`) and its MODE, and under "fwd" the forward's (`hopper.OVERRIDES`); all
    restored after it ({}: the production default)."""
    from sparseflash.flash.hopper import backward as hb, forward as hf

    mode = hb.MODE
    hb.OVERRIDES.clear()
    hb.OVERRIDES.update({k: v for k, v in over.items() if k not in ("MODE", "fwd")})
    hf.OVERRIDES.clear()
    hf.OVERRIDES.update(over.get("fwd", {}))
    hb.MODE = over.get("MODE", mode)
    try:
        yield
    finally:
        hb.OVERRIDES.clear()
        hf.OVERRIDES.clear()
        hb.MODE = mode


def case(name: str):
    """(seq_len, head_dim, causal, pattern) of a case name: one of `CASES`, ``randomK-dD-Nk`` or
    ``localW-dD-Nk``; pattern is None (dense), a `bench sparsity` pattern name, or ("random", K) /
    ("local", W)."""
    if name in CASES:
        return CASES[name]
    m = re.fullmatch(r"(random|local)(\d+)-d(\d+)-(\d+)k", name)
    if m is None:
        raise ValueError(f"case must be one of {sorted(CASES)}, randomK-dD-Nk or localW-dD-Nk, got {name!r}")
    kind, arg, d, n = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)) * 1024
    return n, d, kind == "local", (kind, arg)
HEADS, TOKENS, DENSITY = 16, 16384, 0.1


def _mask(pattern, n: int, causal: bool, device):
    if pattern is None:
        return None
    if isinstance(pattern, tuple):
        from sparseflash.patterns import local, random

        kind, arg = pattern
        if kind == "random":
            return random(n, arg, block_size=128, heads=HEADS, seed=0, device=device)
        return local(n, arg, block_size=128, causal=True, device=device)
    from sparseflash.experiments.bench.masks import sweep_points

    return sweep_points(pattern, n, 128, causal, targets=(DENSITY,))[0].mask.to(device)


def _ours(mask, causal):
    import sparseflash

    return lambda q, k, v: sparseflash.attention(q, k, v, mask=mask, causal=causal)


def _provider(name: str, setting):
    """(prepare-once context, forward(q, k, v)) of a baseline from the bench's provider table."""
    from sparseflash.experiments.bench.providers import PROVIDERS

    p = PROVIDERS[name]
    why = p.check(setting)
    if why is not None:
        return None, why
    ctx = p.prepare(setting)
    return (lambda q, k, v: p.forward(ctx, setting, q, k, v)), None


def _times(fn, q, k, v, do, rep_ms):
    from sparseflash.experiments.bench.timing import graph_ms

    with torch.no_grad():
        fwd = graph_ms(lambda: fn(q, k, v), rep_ms)
    fwdbwd = graph_ms(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), rep_ms)
    return fwd, fwdbwd


def _results(fn, q, k, v, do):
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), do)]


def run_case(name: str, variants, providers, rep_ms: float, device) -> list[dict]:
    from sparseflash.experiments.bench.flops import densities
    from sparseflash.experiments.bench.providers import Setting

    n, d, causal, pattern = case(name)
    batch = TOKENS // n
    mask = _mask(pattern, n, causal, device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(batch, HEADS, n, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    dens = 1.0 if mask is None else densities(mask, *mask.shape[:2], causal)["rel_density"]
    base = dict(case=name, seq_len=n, batch=batch, heads=HEADS, head_dim=d, causal=causal,
                pattern="dense" if pattern is None else pattern if isinstance(pattern, str) else f"{pattern[0]}{pattern[1]}",
                rel_density=round(dens, 4))
    setting = Setting(device, torch.bfloat16, batch, HEADS, n, d, causal, "fwdbwd", mask)
    runs = [(v_name, _ours(mask, causal), None, VARIANTS[v_name]) for v_name in variants]
    for p in providers:
        pname = {"fa4": "fa4" if mask is not None else "fa4-dense", "cudnn": "sdpa-cudnn",
                 "flex": "flex"}[p]
        if p == "cudnn" and mask is not None:
            continue
        fn, why = _provider(pname, setting)
        runs.append((p, fn, why, {}))
    rows, ref = [], None
    for label, fn, why, over in runs:
        row = dict(base, provider=label)
        if fn is None:
            rows.append(dict(row, status=f"skipped: {why}"))
            print(f"  {name:18s} {label:10s} skipped: {why}", flush=True)
            continue
        try:
            with variant(over):
                res = _results(fn, q, k, v, do)
                if ref is None:
                    ref = res
                diffs = {f"max_diff_{t}": float((a.float() - b.float()).abs().max()) for t, a, b in
                         zip(("out", "dq", "dk", "dv"), res, ref)}
                del res
                fwd, fwdbwd = _times(fn, q, k, v, do, rep_ms)
            row.update(status="ok", fwd_ms=round(fwd, 4), fwdbwd_ms=round(fwdbwd, 4), bwd_ms=round(fwdbwd - fwd, 4),
                       **diffs)
        except Exception as e:  # noqa: BLE001 - one failing provider must not lose the others' rows
            row.update(status=f"error: {type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(f"  {name:18s} {label:10s} {row.get('status')} fwd {row.get('fwd_ms', '-')} fwd+bwd "
              f"{row.get('fwdbwd_ms', '-')}", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Per case and provider: fwd, bwd and fwd+bwd ms, and the speed against FA4 (FA4's time / this)."""
    fa4 = {r["case"]: r for r in rows if r["provider"] == "fa4" and r.get("status") == "ok"}
    lines = ["| case | provider | fwd ms | bwd ms | fwd+bwd ms | fwd vs FA4 | fwd+bwd vs FA4 |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['case']} | {r['provider']} | {r.get('status')} | | | | |")
            continue
        f = fa4.get(r["case"])
        rf = f"{f['fwd_ms'] / r['fwd_ms']:.3f}" if f else "-"
        rb = f"{f['fwdbwd_ms'] / r['fwdbwd_ms']:.3f}" if f else "-"
        lines.append(f"| {r['case']} | {r['provider']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} "
                     f"| {rf} | {rb} |")
    return "\n".join(lines)


def _case_name(name: str) -> str:
    import argparse

    try:
        case(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def _write(out: Path, env: dict, rows: list) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "compare.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)
    (out / "compare.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper_bwd_fa4.compare",
                        description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), type=_case_name,
                    help=f"case names: {', '.join(sorted(CASES))}, randomK-dD-Nk, localW-dD-Nk")
    ap.add_argument("--variants", nargs="+", default=["ours"], choices=sorted(VARIANTS))
    ap.add_argument("--providers", nargs="*", default=["fa4", "cudnn"], choices=["fa4", "cudnn", "flex"])
    ap.add_argument("--rep-ms", type=float, default=100.0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from sparseflash.experiments.bench.results import environment

    device = torch.device("cuda")
    env = environment(device)
    try:
        import importlib.metadata as md

        env["flash_attn_4"] = md.version("flash-attn-4")
    except Exception:  # noqa: BLE001
        env["flash_attn_4"] = "not installed"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, name in enumerate(args.cases):
        print(f"[{i + 1}/{len(args.cases)}] {name}", flush=True)
        rows += run_case(name, args.variants, args.providers, args.rep_ms, device)
        torch.cuda.empty_cache()
        _write(out, env, rows)  # after every case: a run cut off by its time limit keeps what it measured
    print(json.dumps(env))
    print(table(rows))
    return 0 if all(r.get("status") == "ok" or str(r.get("status")).startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(run_command(main))
