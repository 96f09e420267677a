"""The Path-X radius curriculum in one table and one figure: held-out accuracy at every stage of
every chain, from the marker neighbourhoods (R = 6) to whole images, beside the whole-image control.

    PYTHONPATH=. python experiments/studies/pathx/curriculum_report.py [--collect STATE] [--out DIR]

``--collect STATE`` first copies the runs of the curriculum's folders under STATE (``nb-cur-*`` of
`curriculum.sh`, ``nb-cont-*`` of the continued whole-image runs and the R = 6 start
``nb-f3/runs/frozen-lr3e-4``) into ``OUT/runs/<chain>/<run>/`` without their checkpoints. The
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
DEFAULT_OUT = HERE / "results" / "curriculum"
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
KEEP = ("config.json", "eval.csv", "train.csv", "summary.json", "result.json", "metrics.jsonl")


def collect(state: Path, out: Path) -> int:
    """Copy the curriculum's runs (no checkpoints) from ``state`` into ``out/runs``."""
    n = 0
    for folder, (chain, _) in CHAINS.items():
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


def rows(out: Path) -> list[dict]:
    table = []
    for folder, (chain, _) in CHAINS.items():
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
    order = list(CHAINS.values())
    table.sort(key=lambda t: ([c for c, _ in order].index(t["chain"]), t["stage"]))
    return table


def plot(out: Path, table: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    legend = dict(CHAINS.values())
    fig, ax = plt.subplots(figsize=(8.5, 4.6))
    start = [t for t in table if t["chain"] == "start"]
    full_x = max(t["mean_tokens"] for t in table)
    markers = {"cont-dense": "s", "cont-lr3e-4": "D", "cont-bfly": "*", "cont-fine": "v", "direct": "X"}
    for chain in ("fine", "fine-lr1e-4", "coarse"):
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
    ax.axhline(55, color="tab:red", ls="--", lw=0.8, label="the issue's bar (55%)")
    ax.axhline(61.4, color="black", ls="-.", lw=0.8, label="published, FlashAttention (61.4%)")
    ax.set_xscale("log")
    ax.set_xlabel("drawn pixels the model attends to (mean per image; radius R of the kept marker neighbourhoods, "
                  "rightmost: whole images)", fontsize=8)
    ax.set_ylabel("held-out test accuracy (%), 10K images")
    radii = {}
    for t in table:
        radii.setdefault(t["input"], t["mean_tokens"])
    ax.set_xticks(list(radii.values()), [f"{k}\n{v:.0f}" for k, v in radii.items()], fontsize=7)
    ax.minorticks_off()
    ax.set_title("Path-X (128 px, hard, release fidelity): a curriculum of growing radii", fontsize=10)
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
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default {DEFAULT_OUT})")
    a = ap.parse_args(argv)
    if a.collect is not None:
        if not a.collect.is_dir():
            ap.error(f"--collect {a.collect}: no such folder")
        print(f"copied {collect(a.collect, a.out)} runs from {a.collect}", flush=True)
    if not (a.out / "runs").is_dir():
        ap.error(f"{a.out / 'runs'}: no runs to report (collect them first with --collect STATE)")
    table = rows(a.out)
    from sparseflash.experiments.bench.results import write_tidy

    write_tidy(table, {"runs": str(a.out / "runs")}, a.out, "curriculum", "pathx-curriculum/1")
    for t in table:
        print(f"{t['chain']:12s} {t['stage']:2d} {t['input']:>5s} {t['mean_tokens']:7.0f} tokens  lr {t['lr']:g}  "
              f"{t['pattern']:9s} {t['steps']:6d} steps  test {100 * t['test_acc']:.1f} +- {100 * t['test_se']:.1f}%")
    print(f"wrote {a.out / 'curriculum.csv'}, .json, {plot(a.out, table).name}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
