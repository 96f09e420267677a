"""A radius curriculum in one table and one figure: held-out accuracy at every stage of every
chain, from the marker neighbourhoods to whole images.

    PYTHONPATH=. python experiments/studies/pathx/curriculum_report.py [--resolution 128|256] [--collect STATE] [--out DIR]

``--resolution 128`` (default): Path-X, `curriculum.sh`'s chains from the R = 6 start beside the
whole-image control; ``256``: Path-256, `curriculum256.sh`'s four chains.
``--collect STATE`` first copies the runs of the curriculum's folders under STATE (at 128 px
``nb-cur-*`` of `curriculum.sh`, ``nb-cont-*`` of the continued whole-image runs and the R = 6 start
``nb-f3/runs/frozen-lr3e-4``; at 256 px ``nb-p256-*``) into ``OUT/runs/<chain>/<run>/`` without their
checkpoints. The
table and the figure are then rebuilt from ``OUT/runs`` alone, so a clone of the repository can
redraw them: ``OUT/curriculum.csv`` / ``.json`` (one row a run: chain, stage, input, mean drawn
tokens, learning rate, attention pattern, steps, wall time, best validation, held-out test accuracy
of the best-on-validation weights with its standard error, the weights it started from, GPU, torch,
commit, date) and ``OUT/curriculum.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAINS = {  # folder under STATE: (chain name in the table, legend)
    "nb-f3": ("start", "R = 6 start (lr 3e-4)"),
    "nb-cur-fine": ("fine", "R 8 -> 48 in 9 steps, lr 3e-4"),
    "nb-cur-fine-lr1e-4": ("fine-lr1e-4", "R 8 -> 48 in 9 steps, lr 1e-4"),
    "nb-cur-coarse": ("coarse", "R 9 -> 48 in 6 steps, lr 3e-4"),
    "nb-cur-direct": ("direct", "whole images from R = 6 at once (control)"),
    "nb-cont-dense": ("cont-dense", "coarse, whole images continued, lr 1e-4"),
    "nb-cont-lr3e-4": ("cont-lr3e-4", "coarse, whole images continued, lr 3e-4"),
    "nb-cont-bfly": ("cont-bfly", "coarse, whole images continued, butterfly"),
    "nb-cont-fine": ("cont-fine", "fine lr 1e-4, whole images continued"),
}
CHAINS_256 = {  # curriculum256.sh: butterfly attention throughout
    "nb-p256-bfly-stages": ("bfly-stages", "Path-X weights, table frozen: R 8 -> 96 in 8 steps, lr 3e-4"),
    "nb-p256-bfly-coarse": ("bfly-coarse", "Path-X weights, table frozen: R 8 16 32 64, lr 3e-4"),
    "nb-p256-sincos-stages": ("sincos-stages", "fresh weights, 2-D sin-cos positions: R 8 -> 96, lr 3e-4"),
    "nb-p256-sincos-stages-lr1e-4": ("sincos-stages-lr1e-4", "fresh weights, 2-D sin-cos positions: R 8 -> 96, lr 1e-4"),
}
REPORTS = {  # resolution: chains, the chains drawn as curves, results folder, title, reference lines
    128: dict(chains=CHAINS, curves=("fine", "fine-lr1e-4", "coarse"), out=HERE / "results" / "curriculum",
              title="Path-X (128 px, hard, release fidelity): a curriculum of growing radii",
              lines=((55, "tab:red", "--", "the issue's bar (55%)"),
                     (61.4, "black", "-.", "published, FlashAttention (61.4%)"))),
    256: dict(chains=CHAINS_256, curves=tuple(c for c, _ in CHAINS_256.values()),
              out=HERE / "results" / "curriculum256",
              title="Path-256 (256 px, hard, release fidelity): a curriculum of growing radii, butterfly",
              lines=((63.6, "tab:green", ":", "the two marker coordinates alone, probe MLP (63.6%)"),
                     (63.1, "black", "-.", "published, FlashAttention (63.1%)")), ylim=(40, None)),
}
DEFAULT_OUT = REPORTS[128]["out"]
KEEP = ("config.json", "eval.csv", "train.csv", "summary.json", "result.json", "metrics.jsonl")


def collect(state: Path, out: Path, chains: dict = CHAINS) -> int:
    """Copy the curriculum's runs (no checkpoints) from ``state`` into ``out/runs``."""
    n = 0
    for folder, (chain, _) in chains.items():
        runs = state / folder / "runs"
        if not runs.is_dir():
            continue
        for run in sorted(runs.iterdir()):
            if not (run / "result.json").is_file() or (chain == "start" and run.name != "frozen-lr3e-4"):
                continue
            dest = out / "runs" / chain / run.name
            dest.mkdir(parents=True, exist_ok=True)
            for name in KEEP:
                if (run / name).is_file():
                    shutil.copy2(run / name, dest / name)
            n += 1
    return n


def _stage(tag: str) -> int:
    """The stage number in a curriculum run's tag (``<chain>-<k>-<input>``), 0 for the start."""
    parts = tag.split("-")
    return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else 0


def rows(out: Path, chains: dict = CHAINS) -> list[dict]:
    table = []
    for folder, (chain, _) in chains.items():
        base = out / "runs" / chain
        if not base.is_dir():
            continue
        for run in base.iterdir():
            r = json.loads((run / "result.json").read_text())
            s = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
            table.append({
                "chain": chain, "stage": _stage(r["tag"]), "tag": r["tag"],
                "input": "full" if r["radius"] is None else f"R{r['radius']:g}", "radius": r["radius"],
                "mean_tokens": r["mean_tokens"], "lr": r["lr"], "pattern": s.get("pattern") or "dense",
                "density": s.get("density"), "steps": r["steps"], "wall_s": r["wall_s"], "step_ms": r["step_ms"],
                "train_acc_last": r["train_acc_last"], "val_best": r["val_best"], "val_best_step": r["val_best_step"],
                "test_acc": r["test_acc"], "test_se": round(r["test_se"], 4), "n_test": r["n_test"],
                "init_from": Path(r["init_from"]).parts[-3] if r.get("init_from") else None,
                "gpu": s.get("gpu"), "torch": r.get("torch"), "commit": r.get("commit"), "date": r.get("date"),
            })
    order = list(chains.values())
    table.sort(key=lambda t: ([c for c, _ in order].index(t["chain"]), t["stage"]))
    return table


def plot(out: Path, table: list[dict], report: dict = REPORTS[128]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    legend = dict(report["chains"].values())
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    start = [t for t in table if t["chain"] == "start"]
    full_x = max(t["mean_tokens"] for t in table)
    markers = {"cont-dense": "s", "cont-lr3e-4": "D", "cont-bfly": "*", "cont-fine": "v", "direct": "X"}
    for chain in report["curves"]:
        ts = start + [t for t in table if t["chain"] == chain]
        if len(ts) > 1:
            ax.errorbar([t["mean_tokens"] for t in ts], [100 * t["test_acc"] for t in ts],
                        yerr=[100 * t["test_se"] for t in ts], marker="o", ms=4, capsize=2, label=legend[chain])
    for chain, m in markers.items():
        for t in (t for t in table if t["chain"] == chain):
            # the continued runs sit just right of the whole-image stage so they do not hide it
            x = full_x * (1.12 if chain.startswith("cont") else 0.92)
            ax.errorbar([x], [100 * t["test_acc"]], yerr=[100 * t["test_se"]], marker=m, ms=8 if m == "*" else 6,
                        capsize=2, ls="none", label=f"{legend[chain]}: {100 * t['test_acc']:.1f}%")
    ax.axhline(50, color="gray", ls=":", lw=0.8)
    for y, color, ls, label in report["lines"]:
        ax.axhline(y, color=color, ls=ls, lw=0.8, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("drawn pixels the model attends to (mean per image; radius R of the kept marker neighbourhoods, "
                  "rightmost: whole images)", fontsize=8)
    ax.set_ylabel("held-out test accuracy (%), 10K images")
    radii = {}
    for t in table:
        radii.setdefault(t["input"], t["mean_tokens"])
    ax.set_xticks(list(radii.values()), [f"{k}\n{v:.0f}" for k, v in radii.items()], fontsize=7)
    ax.minorticks_off()
    ax.set_title(report["title"], fontsize=10)
    if report.get("ylim"):  # room for the legend below the curves
        ax.set_ylim(*report["ylim"])
    ax.legend(fontsize=6.5, loc="lower left")
    fig.tight_layout()
    path = out / "curriculum.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--collect", type=Path, default=None, metavar="STATE",
                    help="copy the runs from a campaign state folder (e.g. pxstate) first")
    ap.add_argument("--resolution", type=int, choices=sorted(REPORTS), default=128,
                    help="128: Path-X (curriculum.sh, default), 256: Path-256 (curriculum256.sh)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default results/curriculum, or results/curriculum256 at 256 px)")
    a = ap.parse_args(argv)
    report = REPORTS[a.resolution]
    a.out = a.out or report["out"]
    if a.collect is not None:
        if not a.collect.is_dir():
            ap.error(f"--collect {a.collect}: no such folder")
        print(f"copied {collect(a.collect, a.out, report['chains'])} runs from {a.collect}", flush=True)
    if not (a.out / "runs").is_dir():
        ap.error(f"{a.out / 'runs'}: no runs to report (collect them first with --collect STATE)")
    table = rows(a.out, report["chains"])
    from sparseflash.experiments.bench.results import write_tidy

    write_tidy(table, {"runs": str(a.out / "runs"), "resolution": a.resolution}, a.out, "curriculum",
               "pathx-curriculum/1")
    for t in table:
        print(f"{t['chain']:12s} {t['stage']:2d} {t['input']:>5s} {t['mean_tokens']:7.0f} tokens  lr {t['lr']:g}  "
              f"{t['pattern']:9s} {t['steps']:6d} steps  test {100 * t['test_acc']:.1f} +- {100 * t['test_se']:.1f}%")
    print(f"wrote {a.out / 'curriculum.csv'}, .json, {plot(a.out, table, report).name}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
