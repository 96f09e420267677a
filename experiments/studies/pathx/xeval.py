"""Does a Pathfinder run generalise or memorise? Its accuracy on images it trained on against images
it never saw, from the same generator and seed.

A Pathfinder image is a pure function of (seed, index), so the first images of a 200K folder can be
made again anywhere (`sparseflash lra data pathfinder --num 1000 ...` gives indices 0-999 of the
200K set) and split by `pathfinder_split` into those the run's training split held and the rest. A
run whose training accuracy is high while validation sits at chance either memorises (high on its
own images, chance on the others) or evaluates differently from how it trains (chance on both).
With a folder of the other fidelity every image is unseen and is reported as one group.

    python experiments/studies/pathx/xeval.py RUN --data ROOT [--checkpoint last.pt]
        [--fidelity release|clean] [--limit 100] [--full-size 200000]

Runs on the CPU (minutes for a few hundred Path-X images).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch


def main(argv=None) -> int:
    from sparseflash.experiments.lra.crosseval import load_checkpoint, trained_model
    from sparseflash.experiments.lra.data import get_dataset, pathfinder_split
    from sparseflash.experiments.lra.train import evaluate

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a `sparseflash lra train` output folder")
    p.add_argument("--data", required=True, help="data root holding the task's folder")
    p.add_argument("--checkpoint", default="last.pt")
    p.add_argument("--fidelity", choices=("release", "clean"), default=None, help="default: the run's")
    p.add_argument("--limit", type=int, default=100, help="images per group")
    p.add_argument("--full-size", type=int, default=200_000, help="images in the folder the run trained on")
    p.add_argument("--batch-size", type=int, default=50)
    a = p.parse_args(argv)

    run = Path(a.run)
    cfg, state = load_checkpoint(run, a.checkpoint)
    data = dict(cfg.data)
    trained_on = data.get("fidelity")
    fidelity = a.fidelity or trained_on
    data.update(fidelity=fidelity, workers=1)
    base = get_dataset(cfg.task, a.data, "train", **data)
    n = base.store_size  # images in the folder
    model = trained_model(cfg, state, base, torch.device("cpu"))
    if fidelity == trained_on:
        seen = np.isin(np.arange(n), pathfinder_split(a.full_size, "train", int(data.get("split_seed", 42))))
        groups = {"trained on": np.flatnonzero(seen), "never seen": np.flatnonzero(~seen)}
    else:
        groups = {f"never seen ({fidelity}; trained on {trained_on})": np.arange(n)}
    for name, rows in groups.items():
        t0 = time.perf_counter()
        r = evaluate(model, base.with_rows(rows[:a.limit]), batch_size=a.batch_size, max_batches=None,
                     device=torch.device("cpu"), autocast=torch.autocast("cpu", enabled=False))
        se = (r["acc"] * (1 - r["acc"]) / max(r["n"], 1)) ** 0.5
        print(f"{run.name}/{a.checkpoint} (step {state.get('step')}) on {fidelity} {a.data}, {name}: "
              f"n={r['n']} acc {100 * r['acc']:.1f} +- {100 * se:.1f}%, loss {r['loss']:.3f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
