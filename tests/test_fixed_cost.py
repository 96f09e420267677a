"""The fixed-cost fit of experiments/studies/short_rows/fixed_cost.py on synthetic sweeps with known answers."""

import json
import math

import pytest

from sparseflash.experiments.studies.short_rows.fixed_cost import fit_fixed_cost, main
from sparseflash.experiments.bench.results import write_results


def _rows(fixed, per_block, n=4096, block=128, mode="fwd", noise=0.0):
    kb = n // block
    rows = []
    for i, bpr in enumerate((1, 2, 3, 4, 6, 8, 16, kb)):
        ms = (fixed + per_block * bpr) * (1 + noise * (-1) ** i)
        rows.append(dict(provider="sparseflash", pattern="random", seq_len=n, head_dim=64, mode=mode, dtype="bf16",
                         causal=False, block_size=block, rel_density=bpr / kb, ms=ms, tflops=bpr / ms, status="ok"))
    rows.append(dict(rows[-1], pattern="dense", block_size=None))  # dense rows are not fitted
    rows.append(dict(rows[0], rel_density=0.5, ms=float("nan"), status="error: boom"))  # nor failed ones
    return rows


def test_fit_recovers_fixed_and_per_block_cost():
    fits = fit_fixed_cost(_rows(0.06, 0.0375) + _rows(0.2, 0.1, mode="bwd", n=16384))
    assert [(f["mode"], f["seq_len"]) for f in fits] == [("fwd", 4096), ("bwd", 16384)]
    fwd, bwd = fits
    assert fwd["fixed_ms"] == pytest.approx(0.06) and fwd["per_block_ms"] == pytest.approx(0.0375)
    assert fwd["fixed_blocks"] == pytest.approx(1.6) and fwd["key_blocks"] == 32
    assert bwd["fixed_blocks"] == pytest.approx(2.0) and bwd["key_blocks"] == 128
    assert fwd["max_rel_residual"] < 1e-9
    assert len(fwd["points"]) == 8  # the full-mask point is reported, not fitted
    assert fwd["full_tflops"] == pytest.approx(32 / (0.06 + 0.0375 * 32))


def test_fit_ignores_the_full_mask_point_and_reports_residuals():
    rows = _rows(0.06, 0.0375, noise=0.02)
    rows[-3]["ms"] *= 10  # the full mask (rel_density 1): far off the line, but left out of the fit
    (f,) = fit_fixed_cost(rows)
    assert f["fixed_blocks"] == pytest.approx(1.6, rel=0.5) and 0.01 < f["max_rel_residual"] < 0.1
    assert fit_fixed_cost(rows[:2]) == []  # too few sparse points


def test_cli_writes_json_and_plot(tmp_path, capsys):
    write_results(_rows(0.03, 0.02), {"command": "test"}, tmp_path, "sparsity")
    assert main([str(tmp_path), "--out", str(tmp_path / "fit")]) == 0
    assert "1.50" in capsys.readouterr().out
    data = json.loads((tmp_path / "fit" / "fixed_cost.json").read_text())
    assert math.isclose(data["fits"][0]["fixed_blocks"], 1.5)
    assert (tmp_path / "fit" / "fixed_cost.png").stat().st_size > 10_000
