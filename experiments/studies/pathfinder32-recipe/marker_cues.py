"""How much of a Pathfinder-32 label can be read from the markers' geometry alone?

A model that cannot trace a path may still beat chance with simple cues. This measures two on
generated images (the generator's own layers give the marker tips and the target snakes' paddle
orientations): the distance between the two markers, and the direction from the origin marker to
the other one relative to the orientation of the origin snake's seed paddle (a snake tends to go on
the way its first paddle points). Each cue is binned on half the images (20 bins, label-wise
histograms) and the more frequent label per bin predicts the other half.

    python experiments/studies/pathfinder32-recipe/marker_cues.py [--num 20000] [--reference 3000]

Result (2026-11-25, CPU, seed 1): distance 52.9% for both methods (20,000 batched, 3,000 reference
images); seed direction 61.2% (batched) and 58.7% (reference).
"""

from __future__ import annotations

import argparse

import numpy as np

from sparseflash.experiments.lra.data.pathfinder import params_for, render, render_many


def _held_out_accuracy(x: np.ndarray, y: np.ndarray, lo: float, hi: float, bins: int = 20) -> float:
    half = len(x) // 2
    edges = np.linspace(lo, hi, bins + 1)
    h1 = np.histogram(x[:half][y[:half] == 1], edges)[0]
    h0 = np.histogram(x[:half][y[:half] == 0], edges)[0]
    pred = (h1 > h0)[np.clip(np.digitize(x[half:], edges) - 1, 0, bins - 1)]
    return float((pred == y[half:]).mean())


def cues(layers: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Per image: marker distance (px) and cos(angle between the origin snake's seed paddle and the
    vector from the origin marker to the other marker)."""
    dist, cos = [], []
    for L in layers:
        (ay, ax), (by, bx) = L["tips"]
        v = np.array([by - ay, bx - ax], float)
        dist.append(np.hypot(*v))
        theta = L["thetas"][L["tip_snakes"][0] - 1][0]
        cos.append((np.sin(theta) * v[0] + np.cos(theta) * v[1]) / max(np.hypot(*v), 1e-9))
    return np.array(dist), np.array(cos)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num", type=int, default=20000, help="images from the batched method")
    p.add_argument("--reference", type=int, default=3000, help="images from the reference method (slow)")
    args = p.parse_args()
    params = params_for(32, "hard")
    for method, n in (("batched", args.num), ("reference", args.reference)):
        if n <= 0:
            continue
        rng = np.random.default_rng(1)
        y = np.arange(n) % 2
        if method == "batched":
            layers = [L for _, L in render_many(params, rng, y, return_layers=True)]
        else:
            layers = [render(params, rng, int(v), return_layers=True, method="reference")[1] for v in y]
        dist, cos = cues(layers)
        print(f"{method:9s} {n:6d} images: distance cue {100 * _held_out_accuracy(dist, y, 0, 45):.1f}%, "
              f"seed-direction cue {100 * _held_out_accuracy(cos, y, -1, 1):.1f}% "
              f"(mean cos: label 1 {cos[y == 1].mean():+.3f}, label 0 {cos[y == 0].mean():+.3f})")


if __name__ == "__main__":
    main()
