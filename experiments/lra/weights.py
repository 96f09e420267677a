"""Trained LRA weights small enough to commit: bf16 copies of a run's best-on-validation checkpoint.

    python -m sparseflash.experiments.lra.weights RUN/checkpoints/best.pt experiments/lra/weights/NAME.pt

A training checkpoint (``sparseflash lra train`` or ``neighbourhood.py``'s ``best.pt``) holds the
weights in fp32 beside the optimizer-free state; the export keeps its ``config`` and ``step``, casts
every floating tensor to bf16 (integer buffers as they are) and adds ``source`` (the checkpoint's
path), ``commit`` (the run's code, from its ``summary.json`` when it records one) and ``sha256`` of
the checkpoint file. A Path-X model (~1.1M parameters) is ~2.3 MB. The export loads wherever a
``best.pt`` does (``studies/pathx/cue_tests.py``, ``zero_shot.py``): ``load_state_dict`` copies bf16
values into the fp32 model, so an evaluation of the export is the evaluation of the bf16-rounded
weights. ``--max-mb`` (default 5) refuses an export larger than that.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sparseflash.experiments.lra.checkpoints import load_checkpoint

__all__ = ["export", "main"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def export(checkpoint, out, *, max_mb: float = 5.0) -> dict:
    """Write the bf16 export of ``checkpoint`` to ``out``; returns its summary (size, parameters, source)."""
    import torch

    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint}: no such file")
    ck = load_checkpoint(checkpoint, keys=("config", "model"))
    model = {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach().clone()
             for k, v in ck["model"].items()}
    run = checkpoint.parent.parent
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    obj = {"config": ck["config"], "model": model, "step": ck.get("step"), "best": ck.get("best"),
           "source": str(checkpoint), "sha256": _sha256(checkpoint), "commit": summary.get("commit", "unknown"),
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
            "step": obj["step"], "commit": obj["commit"]}


def main(argv=None) -> int:
    from sparseflash.cmdline import ArgumentParser, check_output_file, claim_output_file

    ap = ArgumentParser(prog="python -m sparseflash.experiments.lra.weights", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, help="a run's checkpoints/best.pt")
    ap.add_argument("out", type=Path, help="the export, e.g. experiments/lra/weights/pathx-dense.pt")
    ap.add_argument("--max-mb", type=float, default=5.0, help="refuse an export larger than this (default 5)")
    ap.add_argument("--overwrite", action="store_true", help="replace the file at OUT; without it an existing one "
                                                             "is refused")
    a = ap.parse_args(argv)
    claim_output_file(check_output_file(a.out, "OUT"), overwrite=a.overwrite, option="OUT")
    r = export(a.checkpoint, a.out, max_mb=a.max_mb)
    print(f"wrote {r['out']}: {r['parameters']:,} values in bf16, {r['mb']} MB (step {r['step']}, commit {r['commit']})")
    return 0


if __name__ == "__main__":
    from sparseflash.cmdline import run_command

    raise SystemExit(run_command(main))
