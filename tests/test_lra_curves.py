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


def test_two_runs_that_read_the_same_get_their_names(tmp_path):
    _run(tmp_path / "seed0", "listops", "butterfly", 0.19, [0.2, 0.3])
    _run(tmp_path / "seed1", "listops", "butterfly", 0.19, [0.25, 0.3])
    _run(tmp_path / "dense", "listops", "dense", 1.0, [0.1, 0.3])
    drawn = curves.plot_curves(curves.load_runs(tmp_path), tmp_path / "c.png")
    assert drawn == {"listops": ["dense:n_factors=2, density 1.00", "seed0: butterfly:n_factors=2, density 0.19",
                                 "seed1: butterfly:n_factors=2, density 0.19"]}


def test_damaged_run_files_are_named(tmp_path, capsys):
    """A damaged summary.json, config.json or eval.csv: the contract's one line names the file."""
    from sparseflash import cli

    _run(tmp_path / "a", "listops", "butterfly", 0.19, [0.2, 0.3])
    for name, damaged, said in (("summary.json", '{"task": "listops", ', "is not valid JSON"),
                                ("config.json", "[1, 2]", "holds a JSON list"),
                                ("eval.csv", "step,split\n100,val\n", "is not an eval.csv")):
        good = (tmp_path / "a" / name).read_text()
        (tmp_path / "a" / name).write_text(damaged)
        assert cli.main(["lra", "curves", str(tmp_path), "--out", str(tmp_path / "c.png")]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("sparseflash: error: ") and "Traceback" not in err, err
        assert f"{tmp_path / 'a' / name} {said}" in err, err
        (tmp_path / "a" / name).write_text(good)
    assert not (tmp_path / "c.png").exists()
