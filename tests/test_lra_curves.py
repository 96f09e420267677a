"""`sparseflash lra curves`: reads finished runs and draws their validation curves."""

import csv
import json

from sparseflash.experiments.lra import curves


def _run(d, task, pattern, density, accs, summary=True, objective="classify"):
    d.mkdir()
    with (d / "eval.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "split", "weights", "loss", "acc", "n", "time_s"])
        for i, a in enumerate(accs):
            w.writerow([100 * (i + 1), "val", "current", 1.0, a, 10, i])
    (d / "config.json").write_text(json.dumps({"task": task, "model": {"pattern": pattern, "pattern_kwargs": {}}}))
    if summary:
        (d / "summary.json").write_text(json.dumps({"task": task, "objective": objective, "pattern": pattern, "pattern_kwargs": {"n_factors": 2},
                                                     "density": density, "steps": 100 * len(accs),
                                                     "best_val": {"acc": max(accs)}, "test_best": {"acc": 0.4}}))


def test_curves_table_and_png(tmp_path, capsys):
    _run(tmp_path / "a", "listops", "butterfly", 0.19, [0.2, 0.3, 0.35])
    _run(tmp_path / "b", "listops", "dense", 1.0, [0.1, 0.36], summary=False)
    runs = curves.load_runs(tmp_path)
    assert [r["name"] for r in runs] == ["a", "b"]
    assert runs[0]["pattern"] == "butterfly:n_factors=2" and runs[0]["val"][-1] == (300, 0.35)
    assert not runs[1]["finished"]
    out = tmp_path / "c.png"
    assert curves.main([str(tmp_path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "35.0" in text and "40.0" in text
    # a self-pretraining run: its masked-token accuracy gets a panel of its own
    _run(tmp_path / "spt", "listops", "dense", 1.0, [0.5, 0.9], objective="denoise")
    assert [r["task"] for r in curves.load_runs(tmp_path)] == ["listops", "listops", "listops (SPT)"]
