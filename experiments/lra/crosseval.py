"""Evaluate a trained LRA run on other data: Pathfinder models on the other generator fidelity.

A Pathfinder score depends on which generator made the images (``sparseflash lra data pathfinder
--fidelity release|clean``): the release's images carry cues a model can use without tracing a
path (see ``sparseflash lra probe``). Evaluating the same weights on data of the other fidelity
tells how much of a score survives without them:

    sparseflash lra evaluate RUN --data DIR --fidelity clean --out RUN/crosseval-clean.json

``RUN`` is a ``sparseflash lra train`` output folder; its ``checkpoints/best.pt`` (or
``--checkpoint``) is loaded with the run's own model config. Splits: ``test`` by default, or
``all`` (train + val + test of the folder: every image, for data the model never saw, e.g. a
folder of the other fidelity generated only for this).
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

from sparseflash.experiments.lra.checkpoints import load_checkpoint as safe_load
from sparseflash.experiments.lra.configs import config_from_dict
from sparseflash.experiments.lra.provenance import code_commit

SPLITS = ("train", "val", "test", "all")


def load_checkpoint(run_dir, checkpoint: str = "best.pt") -> tuple:
    """(config, state) of ``run_dir/checkpoints/checkpoint``, a `sparseflash lra train` checkpoint."""
    ckpt = Path(run_dir) / "checkpoints" / checkpoint
    if not ckpt.is_file():
        raise FileNotFoundError(f"no checkpoint {ckpt} (give a `sparseflash lra train` output folder that has one)")
    state = safe_load(ckpt, keys=("config", "model"))
    return config_from_dict(state["config"]), state


def trained_model(cfg, state, dataset, device) -> torch.nn.Module:
    """The checkpoint's model, fitted to ``dataset`` as training fitted it, on ``device``, in eval mode."""
    from sparseflash.experiments.lra.train import build_model, fit_to_data

    fit_to_data(cfg, dataset)
    model = build_model(cfg)
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def evaluate_run(run_dir, data_root, *, fidelity: str | None = None, split: str = "test",
                 checkpoint: str = "best.pt", device: str | None = None, batch_size: int = 512,
                 workers: int = 1) -> dict:
    """Accuracy and loss of a run's weights on ``split`` of ``data_root`` (see the module docstring)."""
    from sparseflash.experiments.lra.data import get_dataset
    from sparseflash.experiments.lra.train import evaluate

    run = Path(run_dir)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    cfg, state = load_checkpoint(run, checkpoint)
    data = dict(cfg.data)
    trained_on = data.get("fidelity")
    if fidelity is not None:
        data["fidelity"] = fidelity
    if cfg.task.startswith("path"):
        data["workers"] = workers
    parts = ("train", "val", "test") if split == "all" else (split,)
    sets = [get_dataset(cfg.task, data_root, s, **data) for s in parts]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = trained_model(cfg, state, sets[0], dev)
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if dev.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    t0 = time.perf_counter()
    loss = correct = n = 0.0
    for ds in sets:
        r = evaluate(model, ds, batch_size=batch_size, max_batches=None, device=dev, autocast=autocast)
        loss += r["loss"] * r["n"]
        correct += r["acc"] * r["n"]
        n += r["n"]
    return {"run": str(run), "checkpoint": checkpoint, "step": state.get("step"), "task": cfg.task,
            "trained_on": trained_on, "data": str(data_root), "fidelity": getattr(sets[0], "fidelity", None),
            "split": split, "n": int(n), "acc": correct / max(n, 1), "loss": loss / max(n, 1),
            "acc_se": (correct / max(n, 1) * (1 - correct / max(n, 1)) / max(n, 1)) ** 0.5,
            "seconds": round(time.perf_counter() - t0, 2), "device": str(dev),
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "commit": code_commit(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def main(args) -> int:
    from sparseflash.cmdline import check_output_file, claim_output_file

    if args.out:
        claim_output_file(check_output_file(args.out), overwrite=args.overwrite)
    r = evaluate_run(args.run, args.data, fidelity=args.fidelity, split=args.split, checkpoint=args.checkpoint,
                     device=args.device, batch_size=args.batch_size, workers=args.workers)
    text = json.dumps(r, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(result_line(r))
    return 0


def result_line(r: dict) -> str:
    """The line `sparseflash lra evaluate` prints for `evaluate_run`'s result ``r``; a task without
    generator fidelities (all but Pathfinder) names the data folder instead."""
    trained = f" trained on {r['trained_on']} data," if r.get("trained_on") else ""
    on = f"{r['fidelity']} {r['split']}" if r.get("fidelity") else f"{r['split']} of {r['data']}"
    return (f"{r['task']} (step {r['step']} of {r['run']}){trained} evaluated on {on} ({r['n']} examples): "
            f"acc {100 * r['acc']:.2f} +- {100 * r['acc_se']:.2f}%, loss {r['loss']:.4f}")


def register_lra(sub) -> None:
    p = sub.add_parser("evaluate", help="evaluate a trained run on other data (e.g. the other Pathfinder fidelity)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a `sparseflash lra train` output folder")
    p.add_argument("--data", required=True, help="data root holding the task's folder")
    p.add_argument("--fidelity", choices=("release", "clean"), default=None,
                   help="Pathfinder: the generator fidelity expected in --data (default: the run's own)")
    p.add_argument("--split", choices=SPLITS, default="test")
    p.add_argument("--checkpoint", default="best.pt", help="file in RUN/checkpoints (best.pt or last.pt)")
    p.add_argument("--device", default=None)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--workers", type=int, default=1, help="processes decoding PNGs when the cache is built")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace the file at --out; without it an existing one "
                                                            "is refused")
    p.set_defaults(func=main)
