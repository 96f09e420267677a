"""How far a fine-tune moved each tensor from the pretrained weights it started at.

    python experiments/studies/pathx/drift.py PRETRAINED RUN [RUN ...]

PRETRAINED is a checkpoint (``pxstate/pretrain/checkpoints/best.pt``), each RUN a fine-tune's
folder; its ``checkpoints/last.pt`` is compared with the pretrained weights as the fine-tune
received them (position grids upsampled as ``--init-from`` does). Prints, per tensor of more than
1,000 numbers and every position table, the relative change ||after - before|| / ||before|| and
both norms; for a 2-D position grid upsampled by f×f, also the spread inside each f×f cell
relative to the grid's norm (0 while the copies are still equal).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from sparseflash.experiments.lra.checkpoints import load_checkpoint


def drift(before: dict, after: dict) -> list[tuple[str, float, float, float, float | None]]:
    """(name, relative change, norm before, norm after, within-cell spread or None) per tensor."""
    from sparseflash.experiments.lra.model import upsample_grid

    rows = []
    for name, t in after.items():
        p = before.get(name)
        if p is None or not torch.is_floating_point(t):
            continue
        spread = None
        if name.endswith("pos.grid") and p.shape != t.shape:
            p = upsample_grid(p, tuple(t.shape[:2]))
            fh, fw = t.shape[0] // before[name].shape[0], t.shape[1] // before[name].shape[1]
            c = t.float().reshape(t.shape[0] // fh, fh, t.shape[1] // fw, fw, -1)
            spread = float((c - c.mean((1, 3), keepdim=True)).norm() / c.norm())
        if p.shape != t.shape or (t.numel() <= 1000 and "pos" not in name):
            continue
        p, t = p.float(), t.float()
        rows.append((name, float((t - p).norm() / p.norm().clamp_min(1e-12)), float(p.norm()), float(t.norm()), spread))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pretrained", type=Path)
    ap.add_argument("runs", type=Path, nargs="+")
    a = ap.parse_args(argv)
    before = load_checkpoint(a.pretrained)["model"]
    for run in a.runs:
        ck = load_checkpoint(run / "checkpoints" / "last.pt")
        print(f"{run.name} (step {ck['step']}): tensor, relative change, norm before -> after")
        for name, rel, n0, n1, spread in drift(before, ck["model"]):
            extra = f", within-cell spread {spread:.2f}" if spread is not None else ""
            print(f"  {name:36s} {rel:6.3f}  {n0:7.2f} -> {n1:7.2f}{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
