"""Accuracy curves of finished training runs: ``sparseflash lra curves RUNS_DIR --out PNG``.

Reads every ``RUNS_DIR/*/eval.csv`` written by `sparseflash lra train` (columns step, split,
weights, loss, acc) and ``config.json`` / ``summary.json`` beside it, and draws validation
accuracy against step, one panel per task, one line per run (labelled with its attention pattern
and block density). Prints a table of each run's best validation and test accuracy.
Self-pretraining runs (``objective`` "denoise" in summary.json or config.json) get panels of
their own, ``TASK (SPT)``, whose accuracy is that of the masked tokens.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

__all__ = ["load_runs", "legend_labels", "plot_curves", "register_lra", "main"]


def _record(path: Path) -> dict:
    """A run's summary.json or config.json ({} when there is none); a damaged one raises ValueError naming it."""
    from sparseflash.cmdline import read_json_object

    return read_json_object(path, "restore it, or move its run out of RUNS") or {}


def _val_curve(ev: Path) -> list[tuple[int, float]]:
    """(step, accuracy) of the validations of the current weights in an eval.csv; a damaged file
    raises ValueError naming it."""
    with ev.open(newline="") as f:
        rows = list(csv.DictReader(f))
    try:
        return [(int(r["step"]), float(r["acc"])) for r in rows
                if r["split"] == "val" and r.get("weights", "current") == "current"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{ev} is not an eval.csv of sparseflash lra train (columns step, split, acc: {e!r}); "
                         f"restore it, or move its run out of RUNS") from None


def load_runs(root) -> list[dict]:
    runs = []
    for ev in sorted(Path(root).glob("*/eval.csv")):
        d = ev.parent
        val = _val_curve(ev)
        summary = _record(d / "summary.json")
        config = _record(d / "config.json")
        task = summary.get("task") or config.get("task") or d.name.split("_")[0]
        if (summary.get("objective") or config.get("train", {}).get("objective")) == "denoise":
            task += " (SPT)"  # masked-token accuracy: not on the classifiers' axes
        model = config.get("model", {})
        pattern = summary.get("pattern") or model.get("pattern") or "dense"
        kwargs = summary.get("pattern_kwargs", model.get("pattern_kwargs")) or {}
        if kwargs:
            pattern += ":" + ",".join(f"{k}={v}" for k, v in kwargs.items())
        runs.append(dict(name=d.name, task=task, val=val, summary=summary, pattern=pattern,
                         density=summary.get("density"), finished=bool(summary) and summary.get("stopped_by") is None))
    return runs


def legend_labels(runs: list[dict]) -> list[str]:
    """Each run's line label: its pattern and density (and "stopped early"), prefixed with the run's
    folder name where two runs of one panel would otherwise read the same."""
    plain = []
    for r in runs:
        dens = f", density {r['density']:.2f}" if r["density"] is not None else ""
        plain.append(f"{r['pattern']}{dens}" + ("" if r["finished"] else " (stopped early)"))
    return [f"{r['name']}: {label}" if plain.count(label) > 1 else label for r, label in zip(runs, plain)]


def plot_curves(runs: list[dict], path) -> dict[str, list[str]]:
    """Draw the validation curves of ``runs`` into ``path``; returns each panel's (task's) legend labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in runs})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    drawn = {}
    for ax, task in zip(axes[0], tasks):
        shown = [r for r in runs if r["task"] == task and r["val"]]
        drawn[task] = legend_labels(shown)
        for r, label in zip(shown, drawn[task]):
            steps, acc = zip(*r["val"])
            ax.plot(steps, [100 * a for a in acc], marker="o", ms=3, label=label)
        ax.set_title(f"{task}: validation {'masked-token ' if task.endswith('(SPT)') else ''}accuracy")
        ax.set_xlabel("training step")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def _table(runs) -> str:
    lines = [f"{'run':36s} {'task':19s} {'pattern':22s} {'density':>7s} {'best val':>8s} {'test':>6s} {'steps':>6s}"]
    for r in runs:
        s = r["summary"]
        best = s.get("best_val", {}).get("acc")
        test = s.get("test_best", {}).get("acc")
        fmt = lambda x: f"{100 * x:.1f}" if x is not None else "-"  # noqa: E731
        dens = f"{r['density']:.3f}" if r["density"] is not None else "-"
        lines.append(f"{r['name']:36s} {r['task']:19s} {str(r['pattern']):22s} {dens:>7s} {fmt(best):>8s} "
                     f"{fmt(test):>6s} {str(s.get('steps', '-')):>6s}")
    return "\n".join(lines)


def _cmd(args) -> int:
    from sparseflash.cmdline import CommandError, check_output_file, claim_output_file

    if not Path(args.runs).is_dir():
        raise CommandError(f"RUNS {args.runs} is not a folder", "give the folder that holds your lra train outputs")
    out = check_output_file(Path(args.out) if args.out else Path(args.runs) / "curves.png")
    claim_output_file(out, overwrite=args.overwrite)
    runs = load_runs(args.runs)
    if not runs:
        raise CommandError(f"no runs with eval.csv under {args.runs}",
                           "give a folder whose sub-folders are sparseflash lra train outputs")
    plot_curves(runs, out)
    print(_table(runs))
    print(f"figure: {out}")
    return 0


def register_lra(sub) -> None:
    p = sub.add_parser("curves", help="draw validation-accuracy curves of finished training runs")
    p.add_argument("runs", help="a directory whose sub-directories are `lra train` outputs")
    p.add_argument("--out", default=None, help="PNG path (default RUNS/curves.png)")
    p.add_argument("--overwrite", action="store_true", help="replace the file at --out; without it an existing one "
                                                            "is refused")
    p.set_defaults(func=_cmd)


def main(argv=None) -> int:
    from sparseflash.cmdline import ArgumentParser

    ap = ArgumentParser(prog="python -m sparseflash.experiments.lra.curves", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    register_lra(sub)
    return _cmd(ap.parse_args(["curves", *(argv or [])]) if argv is not None else ap.parse_args())


if __name__ == "__main__":
    from sparseflash.cmdline import run_command

    raise SystemExit(run_command(main))
