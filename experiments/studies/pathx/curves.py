"""Training curves of the Path-X campaign's runs: does a fine-tune generalise or memorise?

Reads each run's ``train.csv`` (one row per logged step) and ``eval.csv`` under the carried state
(``pxstate/``), writes one tidy table, ``curves.csv`` (run, split, step, epoch, acc, loss; training
rows are means over windows of ``--window`` steps, so the table stays small), and draws
``curves.png`` from that table alone: accuracy and loss against epoch, training dashed and
validation solid, one colour a run. The state is not committed; the table is, so

    python experiments/studies/pathx/curves.py --out experiments/studies/pathx/results

redraws the figure from the committed table, and ``--state pxstate`` rebuilds the table first.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

FIELDS = ("run", "split", "step", "epoch", "acc", "loss")


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def run_rows(run_dir: Path, window: int) -> list[dict]:
    """One run's training windows and validation evaluations, in the table's columns."""
    name = run_dir.name
    train = _read(run_dir / "train.csv")
    if not train:
        return []
    per_epoch = float(train[-1]["step"]) / max(float(train[-1]["epoch"]), 1e-9)  # steps per epoch
    rows, bucket = [], []
    for r in train:
        bucket.append(r)
        if int(r["step"]) % window == 0 or r is train[-1]:
            step = int(bucket[-1]["step"])
            rows.append({"run": name, "split": "train", "step": step, "epoch": round(step / per_epoch, 3),
                         "acc": sum(float(b["acc"]) for b in bucket) / len(bucket),
                         "loss": sum(float(b["loss"]) for b in bucket) / len(bucket)})
            bucket = []
    evals = _read(run_dir / "eval.csv") if (run_dir / "eval.csv").exists() else []
    for r in evals:
        if r["split"] == "val" and r.get("weights", "current") == "current":
            step = int(r["step"])
            rows.append({"run": name, "split": "val", "step": step, "epoch": round(step / per_epoch, 3),
                         "acc": float(r["acc"]), "loss": float(r["loss"])})
    return rows


def build_table(state: Path, runs: list[str], window: int) -> list[dict]:
    rows = []
    for name in runs:
        d = state / name
        if not (d / "train.csv").exists():
            raise SystemExit(f"curves: {d}/train.csv not found (runs are folders of the state: {state})")
        rows += run_rows(d, window)
    return rows


def write_table(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.4f}" if k in ("acc", "loss") else r[k]) for k in FIELDS})


def draw(table: Path, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read(table)
    runs = list(dict.fromkeys(r["run"] for r in rows))
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, run in enumerate(runs):
        colour = f"C{i}"
        for split, style in (("train", "--"), ("val", "-")):
            pts = [r for r in rows if r["run"] == run and r["split"] == split]
            if not pts:
                continue
            x = [float(r["epoch"]) for r in pts]
            ax_acc.plot(x, [100 * float(r["acc"]) for r in pts], style, color=colour, label=f"{run} ({split})")
            ax_loss.plot(x, [float(r["loss"]) for r in pts], style, color=colour)
    ax_acc.axhline(50, color="grey", lw=0.8)
    ax_acc.axhline(55, color="grey", lw=0.8, ls=":")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="Path-X fine-tunes: training (dashed) vs validation")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss", yscale="log")
    ax_acc.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state", type=Path, help="the campaign's state folder (pxstate/): rebuild curves.csv from it")
    p.add_argument("--runs", nargs="+", default=["finetune", "finetune-dihedral", "finetune-frozen-encoder-pos", "finetune-dihedral-frozen-encoder-pos",
                                                 "finetune-frozen-encoder-pos-lr3e-4", "finetune-frozen-encoder-pos-lr3e-5"], help="run folders in the state")
    p.add_argument("--window", type=int, default=2500, help="training steps averaged into one row")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args(argv)
    if a.window <= 0:
        p.error(f"--window must be positive, got {a.window}")
    a.out.mkdir(parents=True, exist_ok=True)
    table = a.out / "curves.csv"
    if a.state is not None:
        write_table(build_table(a.state, a.runs, a.window), table)
    elif not table.exists():
        p.error(f"{table} does not exist: give --state to build it")
    draw(table, a.out / "curves.png")
    print(f"wrote {table} and {a.out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
