"""``sparseflash lra ...``: the LRA / Path-X command group.

    sparseflash lra data listops --out DIR [--train 96000 --val 2000 --test 2000] [--seed S] [--workers N]
    sparseflash lra data listops --size tiny --out DIR     just what --config tiny reads (19200 / 512 / 512)
    sparseflash lra data pathfinder --resolution {32,64,128,256} --difficulty {easy,medium,hard,all} \\
        --out DIR --num N [--seed S] [--workers N]
    sparseflash lra show listops DIR            samples, evaluated labels, length / depth / label histograms
    sparseflash lra show pathfinder DIR         a grid of images with their labels
    sparseflash lra train ... / speed ...       from experiments/lra/train.py and speed.py, when present
    sparseflash lra sweep ... / curves ...      accuracy vs density (sweep.py), validation curves (curves.py)
    sparseflash lra weights export|evaluate     bf16 exports of trained runs, scored again (weights.py)

Other modules add subcommands to the group through a ``register_lra(lra_subparsers)`` function; the
modules in `EXTENSIONS` are asked when the parser is built (a module that does not exist is skipped).
Heavy imports happen inside the handlers.
"""

from __future__ import annotations

import importlib
import json

from sparseflash.cmdline import check_output_dir, check_output_file, claim_output_file
from sparseflash.cmdline import non_negative_int as _non_negative
from sparseflash.cmdline import positive_int as _positive

__all__ = ["register", "EXTENSIONS"]

EXTENSIONS = ["sparseflash.experiments.lra.train", "sparseflash.experiments.lra.speed", "sparseflash.experiments.lra.curves",
              "sparseflash.experiments.lra.sweep", "sparseflash.experiments.lra.crosseval",
              "sparseflash.experiments.lra.probe", "sparseflash.experiments.lra.weights"]


# examples per split: the release's, and what --config tiny reads (600 steps of 32; 16 evaluation
# batches of 32 on val and on test)
LISTOPS_SIZES = {"full": {"train": 96000, "val": 2000, "test": 2000}, "tiny": {"train": 19200, "val": 512, "test": 512}}
LISTOPS_FILES = ("basic_train.tsv", "basic_val.tsv", "basic_test.tsv", "generator.json")


def _cmd_data_listops(args) -> int:
    import time
    from pathlib import Path

    from sparseflash.cmdline import claim_output_dir
    from sparseflash.experiments.lra.data.listops import write_listops

    for split, n in LISTOPS_SIZES[args.size].items():
        if getattr(args, split) is None:
            setattr(args, split, n)
    check_output_dir(args.out)
    folder = Path(args.out) / "listops-1000"
    claim_output_dir(folder, owned=LISTOPS_FILES, option="--out", overwrite=args.overwrite, resume=False,
                     kind="ListOps data", resumable=False)
    t0 = time.perf_counter()
    summary = write_listops(args.out, train=args.train, val=args.val, test=args.test, seed=args.seed,
                            min_len=args.min_len, max_len=args.max_len, max_depth=args.max_depth,
                            max_args=args.max_args, workers=args.workers, show_progress=not args.no_progress)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    summary["args"] = {k: v for k, v in vars(args).items() if k not in ("func",)}
    (Path(args.out) / "listops-1000" / "generator.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"wrote {', '.join(summary['paths'].values())} in {summary['seconds']:.1f}s: acceptance "
          f"{summary['acceptance']:.3f}, mean length {summary['mean_length']:.0f}, labels {summary['labels']}")
    return 0


def _cmd_data_pathfinder(args) -> int:
    import time
    from pathlib import Path

    from sparseflash.experiments.lra.data.pathfinder import DIFFICULTIES, write_pathfinder

    check_output_dir(args.out)
    for difficulty in (DIFFICULTIES if args.difficulty == "all" else [args.difficulty]):
        t0 = time.perf_counter()
        summary = write_pathfinder(args.out, args.resolution, difficulty, args.num, seed=args.seed,
                                   workers=args.workers, per_batch=args.per_batch, overwrite=args.overwrite, resume=args.resume,
                                   show_progress=not args.no_progress, method=args.method,
                                   fidelity=args.fidelity)
        summary["seconds"] = round(time.perf_counter() - t0, 2)
        summary["workers"] = args.workers
        (Path(summary["folder"]) / "generator.json").write_text(json.dumps(summary, indent=1))
        print(f"wrote {summary['num']} images to {summary['folder']} in {summary['seconds']:.1f}s "
              f"({summary['num'] / max(summary['seconds'], 1e-9):.1f} images/s); label 1: {summary['label_ones']}")
    return 0


def _cmd_show_listops(args) -> int:
    from sparseflash.experiments.lra.data.show import show_listops

    out = claim_output_file(check_output_file(args.out or "listops_summary.png"), overwrite=args.overwrite)
    show_listops(args.dir, out=out, num=args.num, split=args.split)
    return 0


def _cmd_show_pathfinder(args) -> int:
    from sparseflash.experiments.lra.data.show import show_pathfinder

    out = claim_output_file(check_output_file(args.out or "pathfinder_samples.png"), overwrite=args.overwrite)
    show_pathfinder(args.dir, out=out, num=args.num, resolution=args.resolution, difficulty=args.difficulty,
                    seed=args.seed)
    return 0


def _register_data(sub) -> None:
    p = sub.add_parser("data", help="generate ListOps / Pathfinder data in the LRA release layout")
    dsub = p.add_subparsers(dest="lra_data", metavar="DATASET", required=True)
    from sparseflash.experiments.lra.data._parallel import default_workers

    lo = dsub.add_parser("listops", help="write listops-1000/basic_{train,val,test}.tsv",
                         description="LRA's ListOps generator: MIN, MAX, MED, SM trees, min-len < length < max-len.")
    lo.add_argument("--out", required=True, help="output root (listops-1000/ is created inside)")
    lo.add_argument("--size", choices=tuple(LISTOPS_SIZES), default="full",
                    help="full: the release's 96000 / 2000 / 2000 examples (default); tiny: 19200 / 512 / 512, "
                         "what --config tiny reads (--train / --val / --test override either)")
    lo.add_argument("--train", type=_non_negative, default=None)
    lo.add_argument("--val", type=_non_negative, default=None)
    lo.add_argument("--test", type=_non_negative, default=None)
    lo.add_argument("--overwrite", action="store_true",
                    help="replace the ListOps files of an --out that holds them; without it such a folder is refused")
    lo.add_argument("--seed", type=_non_negative, default=0)
    lo.add_argument("--min-len", type=_non_negative, default=500)
    lo.add_argument("--max-len", type=_positive, default=2000)
    lo.add_argument("--max-depth", type=_positive, default=10)
    lo.add_argument("--max-args", type=_positive, default=10)
    lo.add_argument("--workers", type=_positive, default=default_workers())
    lo.add_argument("--no-progress", action="store_true")
    lo.set_defaults(func=_cmd_data_listops)

    pf = dsub.add_parser("pathfinder", help="write pathfinder{R}/<difficulty>/{imgs,metadata}",
                         description="Pathfinder / Path-X / Path-256 images with LRA's per-resolution parameters.")
    pf.add_argument("--resolution", type=int, choices=(32, 64, 128, 256), required=True)
    pf.add_argument("--difficulty", choices=("easy", "medium", "hard", "all"), required=True,
                    help="easy = curv_baseline, medium = curv_contour_length_9, hard = curv_contour_length_14")
    pf.add_argument("--out", required=True, help="output root (pathfinder{R}/ is created inside)")
    pf.add_argument("--num", type=_positive, required=True, help="images per difficulty (the release has 200000)")
    pf.add_argument("--seed", type=_non_negative, default=0)
    pf.add_argument("--workers", type=_positive, default=default_workers())
    pf.add_argument("--per-batch", type=_positive, default=1000, help="images per imgs/<batch> folder")
    pf.add_argument("--overwrite", action="store_true", help="replace existing metadata in the output folder")
    pf.add_argument("--resume", action="store_true",
                    help="finish an interrupted run with the same arguments (finished batch folders are kept)")
    pf.add_argument("--method", choices=("batched", "reference"), default="batched",
                    help="batched: many target-snake attempts at once (fast); reference: one at a time, as the "
                         "original code (same distribution, different images)")
    pf.add_argument("--fidelity", choices=("release", "clean"), default="release",
                    help="release (default): the authors' generator as run for LRA's release, quirks included (the "
                         "task published scores were measured on); clean: our corrected generator")
    pf.add_argument("--no-progress", action="store_true")
    pf.set_defaults(func=_cmd_data_pathfinder)


def _register_show(sub) -> None:
    p = sub.add_parser("show", help="look at ListOps / Pathfinder data")
    ssub = p.add_subparsers(dest="lra_show", metavar="DATASET", required=True)
    lo = ssub.add_parser("listops", help="samples with evaluated labels; length / depth / label histograms")
    lo.add_argument("dir", help="a folder holding listops-1000/ (or the listops-1000 folder)")
    lo.add_argument("--out", default=None, help="PNG path (default listops_summary.png)")
    lo.add_argument("--num", type=_non_negative, default=5, help="samples to print")
    lo.add_argument("--split", choices=("train", "val", "test"), default="train")
    lo.add_argument("--overwrite", action="store_true", help="replace the PNG at --out; without it an existing one "
                                                             "is refused")
    lo.set_defaults(func=_cmd_show_listops)
    pf = ssub.add_parser("pathfinder", help="a PNG grid of images with their labels")
    pf.add_argument("dir", help="a data root, a pathfinder{R} folder or one difficulty folder")
    pf.add_argument("--out", default=None, help="PNG path (default pathfinder_samples.png)")
    pf.add_argument("--num", type=_positive, default=16)
    pf.add_argument("--resolution", type=int, choices=(32, 64, 128, 256), default=None)
    pf.add_argument("--difficulty", choices=("easy", "medium", "hard"), default=None)
    pf.add_argument("--seed", type=_non_negative, default=0, help="which images are picked")
    pf.add_argument("--overwrite", action="store_true", help="replace the PNG at --out; without it an existing one "
                                                             "is refused")
    pf.set_defaults(func=_cmd_show_pathfinder)


def register(subparsers):
    """Declare ``sparseflash lra`` and its subcommands; returns the ``lra`` sub-subparsers."""
    p = subparsers.add_parser("lra", help="LRA / Path-X: data, pictures, training, speed",
                              description="LRA / Path-X: generate data in the release layout (data), look at it "
                                          "(show), train classifiers (train) and time them (speed).")
    sub = p.add_subparsers(dest="lra_command", metavar="LRA_COMMAND", required=True)  # none: a usage error
    _register_data(sub)
    _register_show(sub)
    for name in EXTENSIONS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue  # that subcommand is not written (or not installed) yet
            raise
        module.register_lra(sub)
    return sub
