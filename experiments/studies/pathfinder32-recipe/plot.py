"""Redraw the Pathfinder-32 recipe study's figure from its logs:

    python experiments/studies/pathfinder32-recipe/plot.py      -> results/curves.png

Training loss (left) and validation accuracy (right) against step for every run of the study
(every classifier run under results/), the faithful runs (experiments/lra/results/train/pf32-faithful/*)
and the independent minimal Transformer (minimal_transformer.py's runs: eval.csv only, dashed)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
FAITHFUL = HERE.parents[1] / "lra" / "results" / "train" / "pf32-faithful"


def _classifier(run: Path) -> bool:
    """Self-pretraining runs log masked-token loss and accuracy, which are not on these axes."""
    cfg = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else {}
    return cfg.get("train", {}).get("objective", "classify") == "classify"


# minimal_transformer.py's runs: an eval.csv with the training loss in it, and no train.csv
MINIMAL = sorted(p.parent for p in RESULTS.rglob("eval.csv")
                 if not (p.parent / "train.csv").exists() and "train_loss" in p.read_text().split("\n", 1)[0])
RUNS = [p.parent for p in sorted(RESULTS.rglob("train.csv")) + sorted(FAITHFUL.glob("faithful-*/train.csv"))
        if _classifier(p.parent)]
LABELS = {
    "explore1-f1e4": "faithful, seed 0 (3 side by side)", "explore1-f1e3": "faithful, lr 1e-3",
    "explore1-f1e4c": "faithful, seed 1, compiled", "explore2-learned_s0": "faithful, seed 0, compiled",
    "explore2-sincos": "fixed 2-D sin/cos positions", "explore2-dihedral": "dihedral augmentation",
    "explore3-pixel": "pixel intensity as a number", "explore3-pixel_sincos": "pixel number + 2-D sin/cos",
    "explore3-pixel_dihedral": "pixel number + dihedral",
    "explore5-sapkota": "4 layers, 4 heads, lr 3e-4 cosine, wd 1e-3",
    "explore5-lra1layer": "LRA's config: 1 layer, d 128, sinusoidal, lr 1e-3, batch 512",
    "call5-faithful_fp32": "faithful, fp32 (no autocast)",
    "call5-sapkota_spt_ft/ft": "4-layer, after 5K steps of self-pretraining",
    "faithful-dense": "faithful dense, 200K batched data", "faithful-butterfly": "faithful butterfly (0.5)",
    "e7-rope": "2-D rotary positions", "e7-rope_dihedral": "2-D rotary + dihedral",
    "e7-rope_lr3e-4": "2-D rotary, lr 3e-4", "e7-rope_4l": "2-D rotary, 4 layers, lr 3e-4 cosine",
    "call11-rope4l_spt20k/ft": "2-D rotary, 4 layers, after 20K steps of self-pretraining",
    "c13-dense_bip": "faithful, black pixels as padding", "c13-butterfly_bip": "faithful butterfly, black pixels as padding",
    "c16-cs1": "1 conv-stem layer", "c16-cs2": "2 conv-stem layers", "c16-cs2_bip": "2 conv-stem layers, black as padding",
    "c16-cs2_lr5e-4": "2 conv-stem layers, lr 5e-4",
}


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def main() -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(14, 6))
    # one distinct colour per run (the default cycle repeats after 10)
    colours = ([plt.cm.tab20(i) for i in range(20)] + [plt.cm.tab20b(i) for i in range(0, 20, 2)]
               + [plt.cm.tab20c(i) for i in range(0, 20, 2)] + [plt.cm.Set1(i) for i in range(9)])
    assert len(RUNS) + len(MINIMAL) <= len(colours), "more runs than distinct colours: extend the list"
    for ax in (ax_l, ax_a):
        ax.set_prop_cycle(color=colours)
    for run in RUNS:
        key = run.relative_to(RESULTS).as_posix() if run.is_relative_to(RESULTS) else run.name
        label = LABELS.get(key, key)
        tr = _rows(run / "train.csv")
        steps = [int(r["step"]) for r in tr]
        loss = [float(r["loss"]) for r in tr]
        k = 20  # a running mean over 20 log windows (1000 steps) makes the trend readable
        smooth = [sum(loss[max(0, i - k + 1):i + 1]) / len(loss[max(0, i - k + 1):i + 1]) for i in range(len(loss))]
        line, = ax_l.plot(steps, smooth, label=label, lw=1.4)
        ev = [r for r in _rows(run / "eval.csv") if r["split"] == "val"]
        ax_a.plot([int(r["step"]) for r in ev], [100 * float(r["acc"]) for r in ev], "o-", ms=3, color=line.get_color(),
                  label=label)
    for run in MINIMAL:  # the independent model logs the mean training loss of each 500-step window
        ev = _rows(run / "eval.csv")
        steps = [int(r["step"]) for r in ev]
        cfg = json.loads((run / "config.json").read_text())
        label = f"independent minimal Transformer, seed {cfg['seed']}"
        if cfg.get("black_is_padding"):
            label += ", black as padding"
        if cfg.get("patch", 1) > 1:
            label += f", {cfg['patch']}x{cfg['patch']} patches"
        if cfg.get("layers", 2) != 2:
            label += f", {cfg['layers']} layers"
        if Path(cfg["data"]).name != "lra":  # the 1M-image data set of call 14
            label += f", data {Path(cfg['data']).name}"
        line, = ax_l.plot(steps, [float(r["train_loss"]) for r in ev], "--", lw=1.4, label=label)
        ax_a.plot(steps, [100 * float(r["val_acc"]) for r in ev], "s--", ms=3, color=line.get_color(), label=label)
    ax_l.axhline(0.6931, color="gray", ls=":", lw=1)
    ax_l.set(xlabel="step (batch 256)", ylabel="training loss (running mean)", title="Pathfinder-32: training loss")
    ax_a.axhline(50, color="gray", ls=":", lw=1)
    ax_a.set(xlabel="step (batch 256)", ylabel="validation accuracy (%)", title="validation accuracy (chance 50%)",
             ylim=(45, 75))
    ax_a.legend(fontsize=6, loc="upper left", ncol=2)
    for ax in (ax_l, ax_a):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = HERE / "results" / "curves.png"
    fig.savefig(out, dpi=120)
    print(out)
    return out


if __name__ == "__main__":
    main()
