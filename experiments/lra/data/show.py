"""Quick looks at LRA data (generated or released): ``sparseflash lra show listops|pathfinder DIR``.

- `show_listops`: prints samples with their target, evaluated value, length and depth; checks every
  expression of every split (evaluate, compare with the target); draws the length histogram, the
  operator mix and the label distribution.
- `show_pathfinder`: a grid of images titled with their labels, and the label balance.

Figures are drawn without pyplot (any matplotlib backend works).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

__all__ = ["show_listops", "show_pathfinder", "find_pathfinder_folders"]


def _listops_folder(path: Path) -> Path:
    for c in (path / "listops-1000", path, path / "lra_release" / "listops-1000"):
        if any((c / f"basic_{s}.tsv").is_file() for s in ("train", "val", "test")):
            return c
    raise FileNotFoundError(f"no basic_{{train,val,test}}.tsv in {path} or {path / 'listops-1000'}")


def show_listops(path, out=None, num: int = 5, split: str = "train", stream=None) -> dict:
    """Check and summarise the ListOps tsv files under ``path``; write a histogram PNG to ``out``
    (default ``listops_summary.png`` in the working directory). Returns the summary."""
    import sys

    from matplotlib.figure import Figure

    from sparseflash.experiments.lra.data.listops import OPERATORS, evaluate, read_tsv, tokenize

    stream = stream or sys.stdout
    folder = _listops_folder(Path(path))
    summary, lengths, ops, labels = {"folder": str(folder)}, {}, {}, {}
    for s in ("train", "val", "test"):
        f = folder / f"basic_{s}.tsv"
        if not f.is_file():
            continue
        rows = read_tsv(f)
        ls, ds, bad, op = [], [], 0, Counter()
        for src, target in rows:
            toks = tokenize(src)
            value, depth = evaluate(toks)
            bad += value != target
            ls.append(len(toks))
            ds.append(depth)
            op.update(t for t in toks if t in OPERATORS)
        lengths[s], ops[s], labels[s] = np.array(ls), op, Counter(t for _, t in rows)
        summary[s] = {"n": len(rows), "mismatched_labels": int(bad), "length_mean": float(np.mean(ls)) if ls else 0.0,
                      "length_min": int(min(ls, default=0)), "length_max": int(max(ls, default=0)),
                      "depth_max": int(max(ds, default=0)), "depth_mean": float(np.mean(ds)) if ds else 0.0,
                      "operators": {k: op[k] for k in OPERATORS}, "labels": dict(sorted(labels[s].items()))}
        if s == split:
            for src, target in rows[:num]:
                toks = tokenize(src)
                value, depth = evaluate(toks)
                text = src if len(src) <= 110 else src[:110] + " ..."
                print(f"[{s}] target {target} evaluated {value} length {len(toks)} depth {depth}: {text}", file=stream)
    for s in ("train", "val", "test"):
        if s in summary:
            d = summary[s]
            n_ops = sum(d["operators"].values()) or 1
            mix = " ".join(f"{k[1:]} {v / n_ops:.3f}" for k, v in d["operators"].items())
            print(f"{s:5s} n={d['n']:6d} labels mismatching the evaluation: {d['mismatched_labels']}  length mean "
                  f"{d['length_mean']:.0f} [{d['length_min']}, {d['length_max']}]  depth mean {d['depth_mean']:.2f} "
                  f"max {d['depth_max']}  operators {mix}", file=stream)

    fig = Figure(figsize=(13, 3.6))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for s, ls in lengths.items():
        ax1.hist(ls, bins=40, histtype="step", density=True, label=f"{s} ({len(ls)})")
        n_ops = sum(ops[s].values()) or 1
        ax2.plot(range(4), [ops[s][k] / n_ops for k in OPERATORS], "o-", label=s)
        c = labels[s]
        n = sum(c.values()) or 1
        ax3.plot(range(10), [c.get(k, 0) / n for k in range(10)], "o-", label=s)
    ax1.set(xlabel="length (tokens, no parentheses)", ylabel="density", title="ListOps lengths")
    ax2.set(ylabel="fraction of operators", title="operator mix", xticks=range(4),
            xticklabels=[k[1:] for k in OPERATORS])
    ax3.set(xlabel="label", ylabel="fraction", title="labels", xticks=range(10))
    for ax in (ax1, ax2, ax3):
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out) if out is not None else Path("listops_summary.png")
    fig.savefig(out, dpi=110)
    summary["figure"] = str(out)
    print(f"figure: {out}", file=stream)
    return summary


def find_pathfinder_folders(path) -> list[Path]:
    """Difficulty folders (holding ``metadata/*.npy``) at ``path`` or up to two levels below it."""
    path = Path(path)
    found = []
    for c in [path, *sorted(path.glob("*")), *sorted(path.glob("*/*"))]:
        if c.is_dir() and (c / "metadata").is_dir() and any((c / "metadata").glob("*.npy")):
            found.append(c)
    return found


def show_pathfinder(path, out=None, num: int = 16, resolution: int | None = None, difficulty: str | None = None,
                    seed: int = 0, stream=None) -> dict:
    """A grid of ``num`` random images of one Pathfinder folder under ``path``, titled with labels
    (default file ``pathfinder_samples.png`` in the working directory). Returns a summary."""
    import sys

    from matplotlib.figure import Figure
    from PIL import Image

    from sparseflash.experiments.lra.data.datasets import _metadata_key, _read_metadata
    from sparseflash.experiments.lra.data.pathfinder import DIFFICULTIES

    stream = stream or sys.stdout
    folders = find_pathfinder_folders(path)
    if resolution is not None:
        folders = [f for f in folders if f.parent.name == f"pathfinder{resolution}"]
    if difficulty is not None:
        folders = [f for f in folders if f.name == DIFFICULTIES[difficulty][0]]
    if not folders:
        raise FileNotFoundError(f"no Pathfinder folder (with metadata/*.npy) at or below {path}"
                                + (f" for resolution {resolution}" if resolution else "")
                                + (f" and difficulty {difficulty}" if difficulty else ""))
    folder = folders[0]
    if len(folders) > 1:
        print(f"{len(folders)} Pathfinder folders found, showing {folder} (choose with --resolution / --difficulty)",
              file=stream)
    rows = []
    for meta in sorted((folder / "metadata").glob("*.npy"), key=_metadata_key):
        rows += [(folder / r[0] / r[1], int(float(r[3]))) for r in _read_metadata(meta) if len(r) >= 4]
    labels = np.array([lab for _, lab in rows])
    pick = np.random.default_rng(seed).choice(len(rows), size=min(num, len(rows)), replace=False)
    cols = int(np.ceil(np.sqrt(len(pick))))
    nrows = int(np.ceil(len(pick) / cols))
    fig = Figure(figsize=(2.2 * cols, 2.4 * nrows))
    axes = np.atleast_1d(fig.subplots(nrows, cols)).ravel()
    for ax in axes:
        ax.axis("off")
    for ax, k in zip(axes, pick):
        p, lab = rows[k]
        with Image.open(p) as im:
            arr = np.asarray(im.convert("L"))
        ax.imshow(arr, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
        ax.set_title(f"{p.parent.name}/{p.name}\nlabel {lab} ({'connected' if lab else 'not connected'})", fontsize=7)
    fig.suptitle(f"{folder.parent.name}/{folder.name}: {len(rows)} images, {labels.mean():.3f} positive", fontsize=9)
    fig.tight_layout()
    out = Path(out) if out is not None else Path("pathfinder_samples.png")
    fig.savefig(out, dpi=110)
    summary = {"folder": str(folder), "images": len(rows), "positive_fraction": float(labels.mean()),
               "figure": str(out)}
    print(f"{folder}: {len(rows)} images, {int(labels.sum())} with label 1 ({labels.mean():.3f}); figure: {out}",
          file=stream)
    return summary
