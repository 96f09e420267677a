"""Trained LRA weights small enough to commit, and one command that scores every one of them again.

    python -m sparseflash.experiments.lra.weights export RUN/checkpoints/best.pt experiments/lra/weights/NAME
    python -m sparseflash.experiments.lra.weights evaluate [--weights experiments/lra/weights] --out DIR
    sparseflash lra weights export ... / sparseflash lra weights evaluate ...   (the same)

``export``: a training checkpoint (``sparseflash lra train``'s or ``neighbourhood.py``'s ``best.pt``,
a curriculum stage's with its frozen position table compacted by ``neighbourhood.compact_grid``)
becomes the folder ``NAME/`` (``NAME``: the run's name, default the run folder's) holding
``model.pt`` (``config``, ``model`` with every floating tensor in bf16 and integer buffers as they
are, ``step``, ``best``, ``source``: the checkpoint's path, ``sha256`` of the checkpoint file,
``commit``: the run's code from its ``summary.json`` or ``result.json``, ``dtype``) and
``config.json`` (the config that rebuilds the model, ``run``, ``task``, ``pattern``, ``density``,
the provenance above, size and parameter count). A Path-X model (~1.1M parameters) is ~2.3 MB;
``--max-mb`` (default 5) refuses a larger export. ``model.pt`` loads wherever a ``best.pt`` does
(``studies/pathx/cue_tests.py``, ``zero_shot.py``, through `model.load_pretrained`): the bf16 values
are copied into the fp32 model, so an evaluation of the export is that of the bf16-rounded weights.
The Path-X / Path-256 chains (``neighbourhood.py --export-weights``, which ``neighbourhood_gpus.sh``,
``curriculum.sh`` and ``curriculum256.sh`` pass) and ``studies/pathx/campaign.sh`` export their final
models into ``STATE/weights/<run>/``; ``studies/pathfinder-release/campaign.sh`` into
``RUNS/weights/<name>/``: copy those folders to ``experiments/lra/weights/`` to commit them.

``evaluate``: every ``WEIGHTS/<run>/model.pt`` (or the ``--runs`` named) on its task's sets of
``--num`` (default 2,000) hard images drawn with ``--seed`` (default 1):

- ``fresh``: release images; ``clean``: images of the clean generator; ``swap-R<r>``: the swap
  test (`zero_shot.swapped_images`, r = the probe's patch half-size: 5 px at 32, 6 at 64 and 128,
  8 at 256): the share of answers that follow the pasted marker neighbourhoods.
- At 128 and 256 px the images are ``neighbourhood.load_or_generate``'s (cached in ``--cache``),
  seed 1: the very sets of headline.csv's ``fresh`` / ``clean`` / ``swap-R`` rows, whose accuracy
  each row carries beside the new one (``headline_acc``). At 32 and 64 px they are drawn on their
  own generator stream (``STREAM``), not the one of ``cue_tests.py``'s untouched sets (56).

Writes ``OUT/weights_eval.csv`` and ``.json`` (one row a model and set: ``run``, ``task``,
``pattern``, ``density``, ``step``, ``set``, ``n``, ``acc``, ``se``, ``headline_acc``,
``headline_source``; the JSON's meta says what ran where). With no exported weights it stops at
once with one line naming ``--weights``.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

from sparseflash.experiments.lra.checkpoints import load_checkpoint

__all__ = ["ROOT", "WEIGHTS", "STREAM", "export", "export_run", "exported_runs", "evaluation_sets", "evaluate",
           "main", "register_lra"]

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ROOT / "experiments" / "lra" / "weights"
STREAM = 68  # the generator stream of evaluate's 32 / 64 px sets (cue_tests.py's untouched sets use 56)
RESOLUTION_OF = {"pathfinder32": 32, "pathfinder64": 64, "pathx": 128, "path256": 256}
SETS = ("fresh", "clean", "swap")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _run_record(run: Path) -> dict:
    """What the run folder says about itself: its summary.json, with result.json's commit and tag
    (neighbourhood.py's runs record their commit there)."""
    rec = {}
    for name in ("summary.json", "result.json"):  # summary.json's values first
        p = run / name
        if p.is_file():
            try:
                found = json.loads(p.read_text())
            except json.JSONDecodeError:
                continue
            rec.update({k: v for k, v in found.items() if rec.get(k) in (None, "")})
    return rec


def export(checkpoint, out, *, max_mb: float = 5.0) -> dict:
    """Write the bf16 export of ``checkpoint`` to the file ``out`` (``model.pt``'s content, see the
    docstring); returns its summary (size, parameters, step, commit, ...)."""
    import torch

    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint}: no such file")
    ck = load_checkpoint(checkpoint, keys=("config", "model"))
    model = {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach().clone()
             for k, v in ck["model"].items()}
    run = checkpoint.parent.parent
    rec = _run_record(run)
    obj = {"config": ck["config"], "model": model, "step": ck.get("step"), "best": ck.get("best"),
           "source": str(checkpoint), "sha256": _sha256(checkpoint), "commit": rec.get("commit") or "unknown",
           "dtype": "bfloat16"}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save(obj, tmp)
    mb = tmp.stat().st_size / 2 ** 20
    if mb > max_mb:
        tmp.unlink()
        raise ValueError(f"{checkpoint}: the bf16 export is {mb:.1f} MB, over --max-mb {max_mb:g}")
    tmp.replace(out)
    return {"out": str(out), "mb": round(mb, 2), "parameters": sum(v.numel() for v in model.values()),
            "step": obj["step"], "commit": obj["commit"], "source": obj["source"], "sha256": obj["sha256"],
            "pattern": rec.get("pattern", ck["config"].get("model", {}).get("pattern")),
            "density": rec.get("density")}


def export_run(checkpoint, folder, *, max_mb: float = 5.0) -> dict:
    """``folder/model.pt`` (`export`) and ``folder/config.json`` (the config that rebuilds the model
    and the provenance); the run's name is the folder's name. Returns config.json's content."""
    folder = Path(folder)
    r = export(checkpoint, folder / "model.pt", max_mb=max_mb)
    cfg = load_checkpoint(folder / "model.pt", keys=("config",))["config"]
    info = {"run": folder.name, "task": cfg.get("task"), "pattern": r["pattern"], "density": r["density"],
            "step": r["step"], "dtype": "bfloat16", "parameters": r["parameters"], "mb": r["mb"],
            "source": r["source"], "sha256": r["sha256"], "commit": r["commit"], "config": cfg}
    tmp = folder / ".config.json.tmp"
    tmp.write_text(json.dumps(info, indent=1, default=str) + "\n")
    tmp.replace(folder / "config.json")
    return info


def exported_runs(weights=WEIGHTS, runs=None) -> list[Path]:
    """The ``model.pt`` of every exported run under ``weights`` (``runs``: only those, in that
    order). Raises `CommandError` (one line, naming ``--weights`` / ``--runs``) when there is none
    or a named run is missing."""
    from sparseflash.cmdline import CommandError

    weights = Path(weights)
    todo = ("no trained weights are committed yet; export a run's best.pt with `python -m "
            "sparseflash.experiments.lra.weights export CHECKPOINT experiments/lra/weights/NAME` or give --weights")
    if not weights.is_dir():
        raise CommandError(f"--weights {weights}: no such folder, so no exported weights to evaluate", todo)
    found = sorted(p for p in weights.glob("*/model.pt") if p.is_file())
    if runs:
        have = {p.parent.name: p for p in found}
        missing = [r for r in runs if r not in have]
        if missing:
            raise CommandError(f"--runs {' '.join(missing)}: no {weights}/<run>/model.pt for "
                               f"{'it' if len(missing) == 1 else 'them'}",
                               f"exported runs: {', '.join(have) or 'none'}")
        return [have[r] for r in runs]
    if not found:
        raise CommandError(f"--weights {weights}: no exported weights (no {weights}/<run>/model.pt)", todo)
    return found


def _draw(job):
    """One generator chunk of 32 / 64 px images: (images, tips, labels)."""
    import numpy as np

    from sparseflash.experiments.lra.data import pathfinder as pf

    seed, chunk, count, fidelity, res = job
    p = pf.params_for(res, "hard", fidelity)
    labels = [(chunk * pf.CHUNK[res] + i) % 2 for i in range(pf.CHUNK[res])]
    made = pf.render_many(p, np.random.default_rng([seed, res, STREAM, chunk]), labels, True)[:count]
    return (np.stack([img for img, _ in made]).astype(np.uint8),
            np.asarray([[tuple(int(v) for v in t) for t in lay["tips"]] for _, lay in made], np.int16),
            np.asarray(labels[:count], np.int8))


def _images(resolution: int, num: int, seed: int, fidelity: str, workers: int, cache: Path):
    import numpy as np

    if resolution in (128, 256):
        from sparseflash.experiments.studies.pathx.neighbourhood import load_or_generate

        images, tips, labels, _ = load_or_generate(cache, num, seed, workers, False, fidelity=fidelity,
                                                   resolution=resolution)
        return np.asarray(images), np.asarray(tips), np.asarray(labels)
    from sparseflash.experiments.lra.data import pathfinder as pf
    from sparseflash.experiments.lra.data._parallel import run_ordered

    K = pf.CHUNK[resolution]
    jobs = [(seed, c, min(K, num - c * K), fidelity, resolution) for c in range(-(-num // K))]
    parts = list(run_ordered(_draw, jobs, workers, f"{resolution}px {fidelity}", total=num,
                             weight=lambda r: len(r[2]), show_progress=False))
    return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))


def swap_radius(resolution: int) -> float:
    """The swap test's radius at ``resolution``: the probe's patch half-size (ceil(marker radius) + 3)."""
    from sparseflash.experiments.lra.data.pathfinder import RESOLUTIONS

    return float(math.ceil(RESOLUTIONS[resolution]["marker_radius"]) + 3)


def evaluation_sets(resolution: int, num: int, seed: int, sets=SETS, *, workers: int = 1,
                    cache: Path | None = None) -> dict:
    """{set name: (images uint8 [n, R, R], labels [n])} of ``sets`` (the docstring's ``fresh``,
    ``clean``, ``swap``) at ``resolution``."""
    import numpy as np

    from sparseflash.experiments.studies.pathx.zero_shot import swapped_images

    if resolution not in RESOLUTION_OF.values():
        raise ValueError(f"resolution must be one of {tuple(RESOLUTION_OF.values())}, got {resolution!r}")
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise ValueError(f"sets must be among {SETS}, got {unknown}")
    if cache is None:
        from sparseflash.experiments.studies.pathx.neighbourhood import DEFAULT_CACHE as cache
    out = {}
    if "fresh" in sets or "swap" in sets:
        images, tips, labels = _images(resolution, num, seed, "release", workers, cache)
        if "fresh" in sets:
            out["fresh"] = (images, labels.astype(np.int64))
        if "swap" in sets:
            r = swap_radius(resolution)
            composite, lab = swapped_images(images, tips, labels, r, seed)
            out[f"swap-R{r:g}"] = (composite, np.asarray(lab, np.int64))
    if "clean" in sets:
        images, _, labels = _images(resolution, num, seed, "clean", workers, cache)
        out["clean"] = (images, labels.astype(np.int64))
    return out


def _headline(run: str, eval_set: str, n: int):
    """headline.csv's row of ``run`` on ``eval_set`` of ``n`` images, if any."""
    from sparseflash.experiments.lra.headline import CSV, read_csv

    if not CSV.is_file():
        return None
    return next((r for r in read_csv(CSV) if r["run"] == run and r["eval_set"] == eval_set and r["n_test"] == n), None)


def evaluate(paths, *, num: int = 2000, seed: int = 1, sets=SETS, device: str = "cpu", batch_size: int = 32,
             workers: int = 1, cache: Path | None = None, show: bool = True) -> list[dict]:
    """Rows (docstring) of every exported ``model.pt`` in ``paths`` on its task's sets."""
    import numpy as np

    from sparseflash.experiments.studies.pathx.cue_tests import load_model, predict

    drawn, rows = {}, []
    for path in map(Path, paths):
        info = json.loads((path.parent / "config.json").read_text()) if (path.parent / "config.json").is_file() else {}
        task = load_checkpoint(path, "--weights", keys=("config", "model"))["config"].get("task")
        if task not in RESOLUTION_OF:
            raise ValueError(f"{path}: a {task!r} model; evaluate scores Pathfinder / Path-X / Path-256 models "
                             f"({', '.join(RESOLUTION_OF)})")
        res = RESOLUTION_OF[task]
        if res not in drawn:
            drawn[res] = evaluation_sets(res, num, seed, sets, workers=workers, cache=cache)
        model, step = load_model(path, res, device)
        for name, (images, labels) in drawn[res].items():
            t0 = time.perf_counter()
            acc = float(np.mean(predict(model, images, device, batch_size) == labels))
            ref = _headline(path.parent.name, name, len(labels))
            rows.append({"run": path.parent.name, "task": task, "resolution": res, "pattern": info.get("pattern"),
                         "density": info.get("density"), "step": step, "set": name, "seed": seed,
                         "n": int(len(labels)), "acc": round(acc, 4), "se": round(math.sqrt(acc * (1 - acc) / len(labels)), 4),
                         "headline_acc": None if ref is None else round(ref["test_acc"], 4),
                         "headline_source": None if ref is None else ref["source"],
                         "seconds": round(time.perf_counter() - t0, 1)})
            if show:
                r = rows[-1]
                print(f"{r['run']}: {name}: {100 * acc:.1f} +- {100 * r['se']:.1f}% (n {r['n']}"
                      + ("" if ref is None else f"; headline {100 * ref['test_acc']:.1f}%") + ")", flush=True)
    return rows


# ----------------------------------------------------------------------------- the command line
def _cmd_export(a) -> int:
    from sparseflash.cmdline import CommandError, check_output_dir, claim_output_files

    if not a.checkpoint.is_file():
        raise CommandError(f"CHECKPOINT {a.checkpoint}: no such file", "give a run's checkpoints/best.pt")
    check_output_dir(a.out, "OUT")
    claim_output_files(a.out, ["model.pt", "config.json"], overwrite=a.overwrite, option="OUT")
    try:
        r = export_run(a.checkpoint, a.out, max_mb=a.max_mb)
    except ValueError as e:
        raise CommandError(str(e), "give a checkpoint that sparseflash lra train or neighbourhood.py wrote, "
                                   "or raise --max-mb") from None
    print(f"wrote {a.out}/model.pt and config.json: {r['parameters']:,} values in bf16, {r['mb']} MB "
          f"(step {r['step']}, commit {r['commit']})")
    return 0


def _cmd_evaluate(a) -> int:
    from sparseflash.cmdline import check_output_dir, claim_output_files
    from sparseflash.experiments.bench.results import write_tidy

    a.weights, a.out = Path(a.weights), Path(a.out)
    a.cache = None if a.cache is None else Path(a.cache)
    paths = exported_runs(a.weights, a.runs)  # before anything else: no weights is one line
    check_output_dir(a.out)
    claim_output_files(a.out, ["weights_eval.csv", "weights_eval.json"], overwrite=a.overwrite)
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = evaluate(paths, num=a.num, seed=a.seed, sets=a.sets, device=device, batch_size=a.batch_size,
                    workers=a.workers, cache=a.cache)
    from sparseflash.experiments.studies.pathx.neighbourhood import run_meta

    meta = {"weights": str(a.weights), "num": a.num, "seed": a.seed, "sets": list(a.sets), "device": device,
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", **run_meta()}
    write_tidy(rows, meta, a.out, "weights_eval", "lra-weights-eval/1")
    print(f"wrote {Path(a.out) / 'weights_eval.csv'} and .json ({len(rows)} rows, {len(paths)} models)")
    return 0


def _add_commands(sub) -> None:
    from sparseflash.cmdline import positive_int

    p = sub.add_parser("export", help="a run's best.pt as a committable bf16 folder (model.pt, config.json)",
                       description="Write the bf16 export of CHECKPOINT into the folder OUT (its name: the run's).")
    p.add_argument("checkpoint", type=Path, help="a run's checkpoints/best.pt")
    p.add_argument("out", type=Path, help="the run's folder, e.g. experiments/lra/weights/cont-bfly-1-full")
    p.add_argument("--max-mb", type=float, default=5.0, help="refuse an export larger than this (default 5)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT's model.pt and config.json; without it existing ones are refused")
    p.set_defaults(func=_cmd_export)
    e = sub.add_parser("evaluate", help="score every exported model again on its task's sets; a CSV",
                       description="Score every WEIGHTS/<run>/model.pt on fresh, clean and swap-test images of its task.")
    e.add_argument("--weights", default=WEIGHTS, help=f"the exported runs' folder (default {WEIGHTS})")
    e.add_argument("--runs", nargs="+", default=None, help="only these runs (folder names under --weights)")
    e.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS), help="which sets (default all three)")
    e.add_argument("--num", type=positive_int, default=2000, help="images a set (default 2000, headline.csv's)")
    e.add_argument("--seed", type=int, default=1, help="their seed (default 1: headline.csv's fresh sets)")
    e.add_argument("--workers", type=positive_int, default=2, help="processes drawing the images")
    e.add_argument("--cache", default=None, help="image cache of the 128 / 256 px sets "
                                                            "(default neighbourhood.py's)")
    e.add_argument("--device", default=None, help="cpu or cuda (default cuda if available)")
    e.add_argument("--batch-size", type=positive_int, default=32)
    e.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    e.add_argument("--out", required=True, help="folder for weights_eval.csv and .json")
    e.add_argument("--overwrite", action="store_true", help="replace weights_eval.* there")
    e.set_defaults(func=_cmd_evaluate)


def register_lra(sub) -> None:
    """``sparseflash lra weights export|evaluate`` (`cli.EXTENSIONS`)."""
    p = sub.add_parser("weights", help="export trained weights in bf16; score the exported models again",
                       description=__doc__.split("\n\n")[0])
    _add_commands(p.add_subparsers(dest="weights_command", required=True, metavar="{export,evaluate}"))


def main(argv=None) -> int:
    from sparseflash.cmdline import ArgumentParser

    ap = ArgumentParser(prog="python -m sparseflash.experiments.lra.weights", description=__doc__.split("\n\n")[0])
    _add_commands(ap.add_subparsers(dest="command", required=True, metavar="{export,evaluate}"))
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    from sparseflash.cmdline import run_command

    raise SystemExit(run_command(main))
