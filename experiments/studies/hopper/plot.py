"""Draw `fwd_bench`'s results: effective TFLOP/s per provider, a panel per (tokens, head_dim, mode).

    python -m sparseflash.experiments.studies.hopper.plot experiments/results/hopper/hopper_fwd.json \\
        [--out experiments/results/hopper]

Writes hopper_tflops.png: for each case (dense, causal, random, butterfly, local) a group of bars,
one per provider, with the Hopper kernels' bar labelled by its time ratio to cuDNN (dense and
causal) or to FlexAttention (block masks). Needs only the JSON (no GPU).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sparseflash.cmdline import ArgumentParser, run_command

PROVIDERS = ("hopper", "hopper-fwd", "portable", "flex", "sdpa-flash", "sdpa-cudnn")
LABELS = {"hopper": "sparseflash (Hopper kernels)", "hopper-fwd": "Hopper forward + portable backward",
          "portable": "sparseflash (portable kernels)", "flex": "FlexAttention", "sdpa-flash": "SDPA flash",
          "sdpa-cudnn": "SDPA cuDNN"}
COLORS = {"hopper": "#1f77b4", "hopper-fwd": "#aec7e8", "portable": "#9ecae1", "flex": "#ff7f0e",
          "sdpa-flash": "#bbbbbb", "sdpa-cudnn": "#2ca02c"}
MODES = {"fwd": "forward", "fwdbwd": "forward + backward"}


def plot(rows: list[dict], meta: dict, out: Path) -> Path:
    from matplotlib.figure import Figure

    ok = [r for r in rows if r.get("ms") and r.get("tflops")]
    seqs = sorted({r["seq"] for r in ok})
    dims = sorted({r["head_dim"] for r in ok})
    modes = [m for m in MODES if any(r["mode"] == m for r in ok)]
    masks = list(dict.fromkeys(r["mask"] for r in ok))
    provs = [p for p in PROVIDERS if any(r["provider"] == p for r in ok)]
    key = {(r["seq"], r["head_dim"], r["mask"], r["mode"], r["provider"]): r for r in ok}
    panels = [(n, d, m) for m in modes for n in seqs for d in dims]
    n_cols = len(seqs) * len(dims)
    fig = Figure(figsize=(4.4 * n_cols, 3.6 * len(modes) + 1.0), layout="constrained")
    axes = fig.subplots(len(modes), n_cols, squeeze=False)
    width = 0.8 / len(provs)
    for ax, (n, d, mode) in zip(axes.flat, panels):
        for i, p in enumerate(provs):
            xs, ys = [], []
            for j, mk in enumerate(masks):
                r = key.get((n, d, mk, mode, p))
                if r is not None:
                    xs.append(j + (i - (len(provs) - 1) / 2) * width)
                    ys.append(r["tflops"])
            ax.bar(xs, ys, width, color=COLORS.get(p, "gray"), label=LABELS.get(p, p))
        for j, mk in enumerate(masks):  # the Hopper bar's time ratio to the anchor of its case
            h = key.get((n, d, mk, mode, "hopper"))
            ref = key.get((n, d, mk, mode, "sdpa-cudnn")) or key.get((n, d, mk, mode, "flex"))
            if h is not None and ref is not None:
                x = j + (provs.index("hopper") - (len(provs) - 1) / 2) * width
                ax.text(x, h["tflops"], f"{ref['ms'] / h['ms']:.2f}x", ha="center", va="bottom", fontsize=7,
                        rotation=90)
        ax.set_xticks(range(len(masks)), masks, fontsize=8)
        ax.set_title(f"N={n}, d={d}: {MODES[mode]}", fontsize=9)
        ax.set_ylabel("TFLOP/s (attended pairs)", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(provs), fontsize=8)
    # a file merged from several runs (meta "runs") names each run's commit
    commit = " + ".join(r["commit"] for r in meta["runs"]) if meta.get("runs") else meta.get("commit", "?")
    fig.suptitle(f"{meta.get('device_name', '?')}, torch {meta.get('torch', '?')}, triton {meta.get('triton', '?')}, "
                 f"commit {commit}: bf16, 16 heads, 16K tokens per batch, GPU time. Label: time ratio to cuDNN "
                 "(dense, causal) or FlexAttention (block masks); > 1 is faster", fontsize=9)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hopper_tflops.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.studies.hopper.plot", description=__doc__.splitlines()[0])
    ap.add_argument("results", help="hopper_fwd.json written by fwd_bench --out")
    ap.add_argument("--out", default=None, help="directory for hopper_tflops.png (default: the JSON's)")
    args = ap.parse_args(argv)
    src = Path(args.results)
    data = json.loads(src.read_text())
    print(plot(data["rows"], data.get("meta", {}), Path(args.out) if args.out else src.parent))
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
