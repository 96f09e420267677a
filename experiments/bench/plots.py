"""`sparseflash plot RESULTS --out DIR`: every benchmark figure, drawn from saved rows only.

Sparsity results (one set of figures per pattern; a panel per shape, a column per mode):
- ``sparsity_runtime_<pattern>.png``: runtime vs density, log-log, with the ideal line
  "runtime proportional to density" through the dense point (sparseflash dense, else the
  pattern's densest sparseflash point) and dense providers as horizontal lines;
- ``sparsity_speedup_<pattern>.png``: sparseflash's speedup over each other provider (dense ones
  at the same shape, block-sparse / masked ones at the same mask) vs density;
- ``sparsity_tflops_<pattern>.png``: effective TFLOP/s (computed token pairs only) vs density.
Sequence-length results: ``seqlen_runtime.png`` and ``seqlen_memory.png`` (peak memory), with
OOM rows marked where they happened.

Density on the x axis is ``rel_density``: the fraction of dense attention's work left (causal
included). Figures of CPU rows say "CPU (not GPU results)" in their titles.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from sparseflash.experiments.bench.results import CPU_NOTE, load_results

__all__ = ["plot_results", "plot_rows"]

_MODE_NAMES = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward + backward"}


def _color(provider: str):
    from sparseflash.experiments.bench.providers import PROVIDERS

    import matplotlib

    names = list(PROVIDERS)
    cmap = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    return cmap(names.index(provider) % cmap.N) if provider in names else "gray"


def _ok(r) -> bool:
    return r.get("status") == "ok" and r.get("ms") is not None and math.isfinite(r["ms"]) and r["ms"] > 0


def _shape_key(r):
    return (r.get("device_name"), r.get("seq_len"), r.get("batch"), r.get("heads"), r.get("head_dim"),
            r.get("dtype"), bool(r.get("causal")))


def _panel_title(key, mode):
    _, n, b, h, d, dtype, causal = key
    return f"N={n} B={b} H={h} d={d} {dtype}{' causal' if causal else ''}\n{_MODE_NAMES.get(mode, mode)}"


def suptitle(fig, text, rows):
    """The figure's title: ``text`` and the devices of ``rows``, marked as CPU results when any row
    ran on a CPU (a CPU run is a check of the script, not a measurement)."""
    devices = sorted({str(r.get("device_name")) for r in rows})
    cpu = any(r.get("device") == "cpu" for r in rows)
    title = f"{text} -- {', '.join(devices)}"
    if cpu:
        title = f"{CPU_NOTE}: {title}"
    fig.suptitle(title, fontsize=10, color="firebrick" if cpu else "black")


def save_figure(fig, path, dpi: int = 110) -> Path:
    """Lay out, write and close ``fig``; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path)


def _grid(n_rows, n_cols):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.6 * n_cols, 3.6 * n_rows + 0.6), layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    return fig, axes


def _sparsity_figures(rows, out: Path) -> list[str]:
    rows = [r for r in rows if r.get("bench") == "sparsity"]
    dense = defaultdict(dict)  # (shape key, mode) -> provider -> row
    for r in rows:
        if r.get("pattern") == "dense" and _ok(r):
            dense[(_shape_key(r), r["mode"])][r["provider"]] = r
    written = []
    for pattern in sorted({r["pattern"] for r in rows if r.get("pattern") not in ("dense", None)}):
        prow = [r for r in rows if r.get("pattern") == pattern]
        keys = sorted({_shape_key(r) for r in prow}, key=lambda k: tuple(str(x) for x in k))
        modes = [m for m in ("fwd", "bwd", "fwdbwd") if any(r["mode"] == m for r in prow)]
        figs = {kind: _grid(len(keys), len(modes)) for kind in ("runtime", "speedup", "tflops")}
        for i, key in enumerate(keys):
            for j, mode in enumerate(modes):
                here = [r for r in prow if _shape_key(r) == key and r["mode"] == mode and _ok(r)]
                by_prov = defaultdict(list)
                for r in sorted(here, key=lambda r: r["rel_density"]):
                    by_prov[r["provider"]].append(r)
                base = dense.get((key, mode), {})
                _runtime_panel(figs["runtime"][1][i][j], by_prov, base)
                _speedup_panel(figs["speedup"][1][i][j], by_prov, base)
                _tflops_panel(figs["tflops"][1][i][j], by_prov, base)
                for kind in figs:
                    figs[kind][1][i][j].set_title(_panel_title(key, mode), fontsize=8)
        for kind, (fig, axes) in figs.items():
            what = {"runtime": "runtime vs density", "speedup": "sparseflash speedup vs density",
                    "tflops": "effective TFLOP/s (computed pairs only) vs density"}[kind]
            suptitle(fig, f"{pattern}: {what}", prow)
            path = out / f"sparsity_{kind}_{pattern}.png"
            fig.savefig(path, dpi=110)
            written.append(str(path))
    return written


def _legend(ax):
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=6, loc="best")


def _xdensity(ax):
    ax.set_xscale("log")
    ax.set_xlabel("density (fraction of dense work)", fontsize=8)
    ax.tick_params(labelsize=7)


def _has_spread(r) -> bool:
    lo, hi = r.get("ms_lo"), r.get("ms_hi")
    return lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi)


def _errorbars(ax, xs, rs, prov):
    """The spread of CPU rows (25th-75th percentile of the calls) as error bars."""
    pts = [(x, r) for x, r in zip(xs, rs) if _has_spread(r)]
    if pts:
        ax.errorbar([x for x, _ in pts], [r["ms"] for _, r in pts],
                    yerr=[[r["ms"] - r["ms_lo"] for _, r in pts], [r["ms_hi"] - r["ms"] for _, r in pts]],
                    fmt="none", ecolor=_color(prov), elinewidth=1, capsize=2)


def _runtime_panel(ax, by_prov, base):
    xs_all = [r["rel_density"] for rs in by_prov.values() for r in rs]
    for prov, rs in by_prov.items():
        ax.plot([r["rel_density"] for r in rs], [r["ms"] for r in rs], "o-", ms=3, color=_color(prov),
                label=rs[0]["label"])
        _errorbars(ax, [r["rel_density"] for r in rs], rs, prov)
    for prov, r in base.items():
        ax.axhline(r["ms"], ls="--", lw=1, color=_color(prov), label=f"{r['label']} (dense)")
        if _has_spread(r):
            ax.axhspan(r["ms_lo"], r["ms_hi"], color=_color(prov), alpha=0.12, lw=0)
    ref = base.get("sparseflash-dense")
    ref_x, ref_ms = (1.0, ref["ms"]) if ref else (None, None)
    if ref is None and by_prov.get("sparseflash"):
        top = by_prov["sparseflash"][-1]
        ref_x, ref_ms = top["rel_density"], top["ms"]
    if ref_ms is not None and xs_all:
        lo = min(xs_all + [ref_x])
        ax.plot([lo, 1.0], [ref_ms * lo / ref_x, ref_ms / ref_x], ":", color="black", lw=1.2,
                label="ideal: runtime ∝ density")
    _xdensity(ax)
    ax.set_yscale("log")
    spread = any(_has_spread(r) for rs in [*by_prov.values(), list(base.values())] for r in rs)
    ax.set_ylabel("ms (median; bars, bands: 25th-75th percentile)" if spread else "ms (median)", fontsize=8)
    _legend(ax)


def _speedup_panel(ax, by_prov, base):
    sf = by_prov.get("sparseflash", [])
    if not sf:
        ax.text(0.5, 0.5, "no sparseflash rows", ha="center", va="center", transform=ax.transAxes)
        return
    for prov, r in base.items():
        if prov == "sparseflash":
            continue
        ax.plot([s["rel_density"] for s in sf], [r["ms"] / s["ms"] for s in sf], "o-", ms=3, color=_color(prov),
                label=f"over {r['label']} (dense)")
    for prov, rs in by_prov.items():
        if prov == "sparseflash":
            continue
        other = {r["param"]: r for r in rs}
        pts = [(s["rel_density"], other[s["param"]]["ms"] / s["ms"]) for s in sf if s["param"] in other]
        if pts:
            ax.plot(*zip(*pts), "s--", ms=3, color=_color(prov), label=f"over {rs[0]['label']}")
    ax.axhline(1.0, color="black", lw=0.8)
    _xdensity(ax)
    ax.set_yscale("log")
    ax.set_ylabel("speedup (x)", fontsize=8)
    _legend(ax)


def _tflops_panel(ax, by_prov, base):
    for prov, rs in by_prov.items():
        ax.plot([r["rel_density"] for r in rs], [r["tflops"] for r in rs], "o-", ms=3, color=_color(prov),
                label=rs[0]["label"])
    for prov, r in base.items():
        ax.axhline(r["tflops"], ls="--", lw=1, color=_color(prov), label=f"{r['label']} (dense)")
    _xdensity(ax)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("effective TFLOP/s", fontsize=8)
    _legend(ax)


def _seqlen_figures(rows, out: Path) -> list[str]:
    rows = [r for r in rows if r.get("bench") == "seqlen"]
    if not rows:
        return []
    key = lambda r: (r.get("device_name"), r.get("heads"), r.get("head_dim"), r.get("dtype"), bool(r.get("causal")))
    keys = sorted({key(r) for r in rows}, key=lambda k: tuple(str(x) for x in k))
    modes = [m for m in ("fwd", "bwd", "fwdbwd") if any(r["mode"] == m for r in rows)]
    written = []
    for what, col, ylabel in (("runtime", "ms", "ms (median)"), ("memory", "peak_mem_mb", "peak memory (MiB)")):
        fig, axes = _grid(len(keys), len(modes))
        for i, k in enumerate(keys):
            for j, mode in enumerate(modes):
                ax = axes[i][j]
                here = [r for r in rows if key(r) == k and r["mode"] == mode]
                series = defaultdict(list)
                for r in here:
                    name = r["provider"] if r.get("pattern") == "dense" else f"{r['provider']}|{r['pattern']}"
                    series[name].append(r)
                drawn = False
                for name, rs in sorted(series.items()):
                    rs.sort(key=lambda r: r["seq_len"])
                    prov = rs[0]["provider"]
                    label = f"{rs[0]['label']} ({rs[0]['pattern']})"
                    good = [r for r in rs if _ok(r) and r.get(col) is not None and math.isfinite(r[col])]
                    style = "o-" if rs[0].get("kind") != "dense" else "o--"
                    if good:
                        ax.plot([r["seq_len"] for r in good], [r[col] for r in good], style, ms=3,
                                color=_color(prov), label=label)
                        if col == "ms":
                            _errorbars(ax, [r["seq_len"] for r in good], good, prov)
                        drawn = True
                    oom = [r["seq_len"] for r in rs if r.get("status") == "OOM"]
                    if oom:
                        ax.plot(oom, [0.96] * len(oom), "x", ms=7, mew=2, color=_color(prov),
                                transform=ax.get_xaxis_transform(), label=f"{label}: OOM")
                if not drawn and col == "peak_mem_mb":
                    ax.text(0.5, 0.5, "peak memory is measured on CUDA only", ha="center", va="center",
                            transform=ax.transAxes, fontsize=8)
                ax.set_xscale("log", base=2)
                lens = [r["seq_len"] for r in here]
                if lens:
                    ax.set_xlim(min(lens) / 1.3, max(lens) * 1.3)
                if drawn:
                    ax.set_yscale("log")
                ax.set_xlabel("sequence length", fontsize=8)
                ax.set_ylabel(ylabel, fontsize=8)
                ax.tick_params(labelsize=7)
                dev, h, d, dtype, causal = k
                toks = sorted({r["batch"] * r["seq_len"] for r in here})
                tokens = toks[0] if len(toks) == 1 else "varies"
                ax.set_title(f"H={h} d={d} {dtype}{' causal' if causal else ''}, batch x seq = {tokens}"
                             f"\n{_MODE_NAMES.get(mode, mode)}", fontsize=8)
                _legend(ax)
        suptitle(fig, f"{what} vs sequence length (x: out of memory)", rows)
        path = out / f"seqlen_{what}.png"
        fig.savefig(path, dpi=110)
        written.append(str(path))
    return written


def figure_names(rows: list[dict]) -> list[str]:
    """The file names `plot_rows` writes for ``rows``, known before anything is drawn."""
    sparsity = sorted({r["pattern"] for r in rows if r.get("bench") == "sparsity" and r.get("pattern") not in ("dense", None)})
    names = [f"sparsity_{kind}_{p}.png" for p in sparsity for kind in ("runtime", "speedup", "tflops")]
    if any(r.get("bench") == "seqlen" for r in rows):
        names += ["seqlen_runtime.png", "seqlen_memory.png"]
    return names


def plot_rows(rows: list[dict], out_dir) -> list[str]:
    """Draw every figure the rows support into ``out_dir``; returns the written paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return _sparsity_figures(rows, out) + _seqlen_figures(rows, out)


def plot_results(paths, out_dir, *, overwrite: bool = True) -> list[str]:
    """`plot_rows` over the rows of saved result files or directories. Without ``overwrite`` a
    figure file already in ``out_dir`` is refused (`cmdline.claim_output_files`) before anything
    is drawn."""
    from sparseflash.cmdline import claim_output_files

    rows, _ = load_results(paths)
    claim_output_files(out_dir, figure_names(rows), overwrite=overwrite)
    return plot_rows(rows, out_dir)
