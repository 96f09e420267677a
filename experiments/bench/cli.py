"""`sparseflash bench sparsity|seqlen` and `sparseflash plot`: argument declarations and handlers.

    sparseflash bench sparsity [--pattern butterfly local random] [--seq-len 4096 16384] ...
    sparseflash bench sparsity --preset kernel-check          # the standard performance check
    sparseflash bench seqlen [--pattern butterfly] [--seq-len 512 ... 65536] ...
    sparseflash plot RESULTS [RESULTS ...] --out DIR           # redraw every figure from saved rows

Every option left out takes the default of `config.defaults` for the device (GPU sizes on CUDA, a
small labelled CPU version elsewhere), after the preset if one is named.
"""

from __future__ import annotations

import argparse
import shlex

__all__ = ["register", "config_from_args", "command_line"]

_MODES = ("fwd", "bwd", "fwdbwd", "all")


def _length(text: str) -> int:
    """A token count: 4096, 4K or 4k (x1024)."""
    t = text.strip().lower()
    try:
        n = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int such as 4096 or 4K, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return n


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return n


def _density(text: str) -> float:
    try:
        num, _, den = text.partition("/")
        x = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected a density such as 0.25 or 1/64, got {text!r}") from None
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"density must lie in (0, 1], got {text!r}")
    return x


def _add_common(p: argparse.ArgumentParser, bench: str) -> None:
    from sparseflash.experiments.bench.masks import PATTERNS
    from sparseflash.experiments.bench.providers import DEFAULT_PROVIDERS, PROVIDERS

    g = p.add_argument_group("what to run (left out: the device's defaults)")
    g.add_argument("--pattern", nargs="+", choices=sorted(PATTERNS), metavar="NAME",
                   help=f"patterns ({', '.join(sorted(PATTERNS))})"
                   + ("" if bench == "sparsity" else "; fixed configuration per length"))
    g.add_argument("--seq-len", nargs="+", type=_length, metavar="N", help="sequence lengths (4096 or 4K)")
    g.add_argument("--batch", type=_positive, help="batch size (default: tokens // seq_len, at least 1)")
    g.add_argument("--tokens", type=_positive, help="batch x seq_len held constant when --batch is not given")
    g.add_argument("--heads", type=_positive)
    g.add_argument("--head-dim", nargs="+", type=_positive, metavar="D")
    g.add_argument("--dtype", choices=("bf16", "fp16", "fp32"))
    g.add_argument("--mode", nargs="+", choices=_MODES, help="fwd, bwd (backward alone), fwdbwd, or all")
    g.add_argument("--causal", action="store_true", default=None, help="causal attention (default: not causal)")
    g.add_argument("--providers", nargs="+", metavar="NAME",
                   help=f"providers, several or comma-separated, or 'all': {', '.join(PROVIDERS)} "
                        f"(default: all but {', '.join(n for n in PROVIDERS if n not in DEFAULT_PROVIDERS)})")
    g.add_argument("--block-size", type=_positive, help="mask block size (GPU default 128)")
    if bench == "sparsity":
        g.add_argument("--densities", nargs="+", type=_density, metavar="X", help="target densities, e.g. 1 0.5 1/64")
        g.add_argument("--masked-densities", choices=("ends", "all"),
                       help="where masked dense-compute providers run: densest and sparsest mask (default) or all")
        g.add_argument("--preset", choices=("kernel-check",),
                       help="kernel-check: the standard performance check (bf16, d 64/128, seq 4K/16K, "
                            "16 heads, 16K tokens, random/butterfly at 1, ~0.5, 0.25, 0.1, vs SDPA flash/cuDNN, "
                            "FlexAttention and FlashAttention-4, outputs checked against the reference)")
    g.add_argument("--quick", action="store_true", help="a smaller sweep (fewer lengths, densities, shorter timing)")
    h = p.add_argument_group("how")
    h.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    h.add_argument("--backend", choices=("auto", "triton", "reference"), default="auto",
                   help="backend= of sparseflash.attention (auto: Triton on CUDA, reference on CPU)")
    h.add_argument("--warmup-ms", type=float, help="untimed warm-up per measurement (GPU default 25)")
    h.add_argument("--rep-ms", type=float, help="timed repetitions per measurement, ms (GPU default 100)")
    h.add_argument("--rounds", type=_positive,
                   help="CPU: passes over the whole plan, in alternating order, samples pooled per row (default 5)")
    h.add_argument("--cuda-graph", action="store_true",
                   help="GPU: time CUDA-graph replays (the kernels' GPU time, no Python/launch overhead)")
    h.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="compare each provider's output with the float32 reference (max_err column; default: on "
                        "for CPU runs and the kernel-check preset, off otherwise)")
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--out", help=f"output directory (default bench-results/{bench}-<device>)")
    h.add_argument("--no-plot", action="store_true", help="write CSV/JSON/tables only")
    h.add_argument("--overwrite", action="store_true",
                   help="replace the results in an --out folder that holds some; without it such a folder is refused")
    h.add_argument("--no-progress", action="store_true")


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: runtime vs sparsity / sequence length against baselines")
    bsub = bench.add_subparsers(dest="bench_command", metavar="SWEEP", required=True)  # none: a usage error
    for name, text in (("sparsity", "runtime vs density, sweeping each pattern's own parameter"),
                       ("seqlen", "runtime and peak memory vs sequence length, dense and one pattern")):
        p = bsub.add_parser(name, help=text, description=text)
        _add_common(p, name)
        p.set_defaults(func=_cmd_bench, bench=name)
    p = subparsers.add_parser("plot", help="redraw every benchmark figure from saved results")
    p.add_argument("results", nargs="+", help="result files (.json / .csv) or directories holding them")
    p.add_argument("--out", required=True, help="directory for the PNGs")
    p.add_argument("--overwrite", action="store_true",
                   help="replace figures of the same names already in --out; without it such a file is refused")
    p.set_defaults(func=_cmd_plot)


def config_from_args(args):
    """A BenchConfig from parsed arguments: device defaults, then the preset, then explicit options."""
    import torch

    from sparseflash.experiments.bench.config import PRESETS, BenchConfig, defaults
    from sparseflash.experiments.bench.timing import TimingConfig

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    fields = defaults(args.bench, device, args.quick)
    preset = getattr(args, "preset", None)
    if preset:
        spec = dict(PRESETS[preset])
        gpu = spec.pop("gpu", {})
        fields.update(spec)
        if device == "cuda":
            fields.update(gpu)
        fields["preset"] = preset
    explicit = {
        "patterns": args.pattern, "seq_lens": args.seq_len, "batch": args.batch, "tokens": args.tokens,
        "heads": args.heads, "head_dims": args.head_dim, "dtype": args.dtype, "causal": args.causal,
        "block_size": args.block_size, "targets": getattr(args, "densities", None),
        "masked_points": getattr(args, "masked_densities", None), "check": args.check,
    }
    if args.mode:
        expand = {"all": ("fwd", "bwd", "fwdbwd")}
        explicit["modes"] = tuple(dict.fromkeys(m for x in args.mode for m in expand.get(x, (x,))))
    if args.providers:
        explicit["providers"] = tuple(n.strip() for x in args.providers for n in x.split(",") if n.strip())
    fields.update({k: tuple(v) if isinstance(v, list) else v for k, v in explicit.items() if v is not None})
    if args.warmup_ms is not None or args.rep_ms is not None or args.cuda_graph or args.rounds is not None:
        t = fields["timing"]
        fields["timing"] = TimingConfig(warmup_ms=t.warmup_ms if args.warmup_ms is None else args.warmup_ms,
                                        rep_ms=t.rep_ms if args.rep_ms is None else args.rep_ms, min_runs=t.min_runs,
                                        cuda_graph=args.cuda_graph, rounds=t.rounds if args.rounds is None else args.rounds)
    fields.update(sf_backend=args.backend, seed=args.seed)
    if "providers" in fields:
        from sparseflash.experiments.bench.providers import get_providers

        fields["providers"] = tuple(p.name for p in get_providers(list(fields["providers"])))
    return BenchConfig(**fields)


def command_line(cfg) -> str:
    """The command that reruns ``cfg`` with every choice spelled out."""
    t = cfg.timing
    parts = ["sparseflash", "bench", cfg.bench, "--pattern", *cfg.patterns, "--seq-len", *map(str, cfg.seq_lens),
             *(["--batch", str(cfg.batch)] if cfg.batch else ["--tokens", str(cfg.tokens)]), "--heads", str(cfg.heads),
             "--head-dim", *map(str, cfg.head_dims), "--dtype", cfg.dtype, "--mode", *cfg.modes,
             *(["--causal"] if cfg.causal else []), "--providers", ",".join(cfg.providers),
             "--block-size", str(cfg.block_size)]
    if cfg.bench == "sparsity":
        parts += ["--densities", *(f"{x:.6g}" for x in cfg.targets), "--masked-densities", cfg.masked_points]
    parts += ["--check" if cfg.check else "--no-check", "--device", cfg.device, "--backend", cfg.sf_backend,
              "--warmup-ms", f"{t.warmup_ms:g}", "--rep-ms", f"{t.rep_ms:g}", "--seed", str(cfg.seed)]
    if cfg.device == "cpu":
        parts += ["--rounds", str(t.rounds)]
    if t.cuda_graph:
        parts.append("--cuda-graph")
    return " ".join(shlex.quote(p) for p in parts)


def _print_tables(rows, bench: str, cpu: bool, md_path: str) -> None:
    from sparseflash.experiments.bench.results import (CPU_NOTE, format_table, pivot_table, seqlen_table,
                                                       summary_table)

    banner = f"\n=== bench {bench}" + (f" -- {CPU_NOTE} ===" if cpu else " ===")
    print(banner)
    header, lines = pivot_table(rows)
    if bench == "seqlen":
        for mode in ("fwd", "bwd", "fwdbwd"):
            h, ls = seqlen_table(rows, mode)
            if ls:
                print(f"\n{mode}: ms by sequence length")
                print(format_table(h, ls))
    elif len(lines) <= 100:
        print(format_table(header, lines))
    else:
        h, ls = summary_table(rows)
        print("sparseflash block-sparse: ms, effective TFLOP/s, and speedup over sparseflash dense, "
              "FlexAttention (same mask) and the fastest dense SDPA backend")
        print(format_table(h, ls))
    from sparseflash.experiments.bench.runner import CHECK_TOL

    # max_err is None where nothing was checked, NaN where the output held NaN
    off = [r for r in rows if r["status"] == "ok" and r.get("max_err") is not None
           and not r["max_err"] <= CHECK_TOL.get(r["dtype"], 0.06)]
    for r in off:
        print(f"possible mismatch: {r['provider']} {r['pattern']} {r['param']} N={r['seq_len']} d={r['head_dim']} "
              f"{r['mode']}: max |out - reference| = {r['max_err']:.3g}")
    bad = [r for r in rows if r["status"] not in ("ok",) and not r["status"].startswith("unavailable")]
    if bad:
        kinds = sorted({f"{r['provider']}: {r['status'][:80]}" for r in bad})
        print(f"\n{len(bad)} rows did not run: " + "; ".join(kinds)[:2000])
    print(f"\nfull table: {md_path}" + (f"\n{CPU_NOTE}" if cpu else ""))


def _cmd_bench(args) -> int:
    from sparseflash.experiments.bench import seqlen, sparsity
    from sparseflash.experiments.bench.results import write_results

    from sparseflash.cmdline import check_output_dir, claim_output_dir

    cfg = config_from_args(args)
    out = args.out or f"bench-results/{cfg.bench}-{cfg.device}"
    check_output_dir(out)  # before the measurements, not after them
    claim_output_dir(out, owned=(f"{cfg.bench}.csv", f"{cfg.bench}.json", f"{cfg.bench}_table.md", "*.png"),
                     overwrite=args.overwrite, kind="benchmark results", resumable=False)
    command = command_line(cfg)
    run = sparsity.run if cfg.bench == "sparsity" else seqlen.run
    rows, meta = run(cfg, command=command, show_progress=not args.no_progress)
    paths = write_results(rows, meta, out, cfg.bench)
    if not args.no_plot:
        from sparseflash.experiments.bench.plots import plot_rows

        paths["plots"] = plot_rows(rows, out)
    _print_tables(rows, cfg.bench, cfg.device == "cpu", paths["md"])
    plots = "" if args.no_plot else f"; {len(paths['plots'])} plots in {out}"
    print(f"results: {paths['csv']}, {paths['json']}{plots}")
    return 0


def _cmd_plot(args) -> int:
    from pathlib import Path

    from sparseflash.cmdline import CommandError, check_output_dir
    from sparseflash.experiments.bench.plots import plot_results

    for r in args.results:
        if not Path(r).exists():
            raise FileNotFoundError(2, "No such file or directory", r)
    check_output_dir(args.out)
    written = plot_results(args.results, args.out, overwrite=args.overwrite)
    for p in written:
        print(p)
    if not written:
        raise CommandError(f"no figures: {' '.join(args.results)} hold no sparsity or seqlen rows",
                           "give the folders that sparseflash bench wrote")
    return 0
