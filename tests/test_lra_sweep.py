"""`sparseflash lra sweep`: pattern settings by density, and a tiny sweep on generated ListOps data
(resumed, skipped when finished, redrawn from sweep.json)."""

import csv
import json
import math

import pytest
import torch

from sparseflash.experiments.lra import sweep as S
from sparseflash.experiments.lra.model import build_pattern
from sparseflash.experiments.lra.train import EXIT_STOPPED


def test_settings_nearest_density():
    # 1024 tokens in blocks of 128: the butterfly has 4 blocks a row, 2 with one factor, 1 with none
    got = [S.choose_settings("butterfly", d, 1024, 128) for d in (1, 0.5, 0.25, 0.125, 0.01)]
    assert [g["density"] for g in got] == [1.0, 0.5, 0.25, 0.125, 0.125]
    assert got[0]["pattern"] is None and got[2]["kwargs"] == {"n_factors": 1}
    for g in got[1:]:  # the recorded density is the built mask's
        assert build_pattern("butterfly", 1024, 128, **g["kwargs"]).density() == g["density"]
    assert S.choose_settings("random", 0.25, 2048, 128)["kwargs"] == {"blocks_per_row": 4}
    loc = S.choose_settings("local", 0.2, 2048, 128)  # 3 blocks a row inside, 2 at the ends: 46/256
    assert loc["kwargs"] == {"window": 128} and loc["density"] == pytest.approx(46 / 256)
    bb = S.choose_settings("bigbird", 0.125, 16384, 128)
    assert set(bb["kwargs"]) == {"window", "global_tokens", "random_blocks_per_row"} and bb["kwargs"]["window"] > 0
    assert abs(math.log(bb["density"] / 0.125)) < 0.05
    for name in S.SWEEP_PATTERNS:  # every candidate builds at a short and a long length
        for n in (64, 4096):
            assert S.choose_settings(name, 0.3, n, 8 if n == 64 else 128)["density"] > 0
    with pytest.raises(ValueError, match="must be one of"):
        S.candidates("strided", 1024, 128)
    with pytest.raises(ValueError, match=r"densities must lie in \(0, 1\]"):
        S.choose_settings("butterfly", 1.5, 1024, 128)


def _args(data, out, *extra):
    return ["--task", "listops", "--data", str(data), "--out", str(out), "--device", "cpu", "--pattern", "butterfly",
            "--densities", "1", "0.25", "--seeds", "0", "1", "--attention", "torch", "--block-size", "8",
            "--num-workers", "0", "--no-progress", "--timing-warmup", "1", "--timing-repeats", "2",
            "--set", "data.seq_len=64", "--set", "model.d_model=32", "--set", "model.d_ff=64",
            "--set", "train.batch_size=16", "--set", "train.eval_every=3", "--set", "train.log_every=1", *extra]


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # toy models: faster on one thread, far faster on a busy machine
    yield
    torch.set_num_threads(n)


def test_tiny_sweep_resumes_skips_and_redraws(tmp_path, monkeypatch, capsys, one_thread):
    from sparseflash.experiments.lra import train as T
    from sparseflash.experiments.lra.data.listops import write_listops

    data = tmp_path / "data"
    write_listops(data, train=64, val=16, test=32, seed=1, min_len=10, max_len=60, max_depth=4, workers=1,
                  show_progress=False)
    out = tmp_path / "sweep"
    calls = []
    real_train = T.train

    def counted(cfg, out_dir, **kw):
        calls.append((out_dir.name, kw["resume"]))
        return real_train(cfg, out_dir, **kw)

    monkeypatch.setattr(T, "train", counted)

    assert S.main(_args(data, out, "--max-steps", "2")) == 0
    names = ["dense-d1-s0", "butterfly-d0.25-s0", "dense-d1-s1", "butterfly-d0.25-s1"]  # seed-major
    assert calls == [(n, None) for n in names]
    with (out / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == names and all(r["status"] == "done" and r["steps"] == "2" for r in rows)
    bf = rows[1]
    assert (bf["pattern"], json.loads(bf["params"]), float(bf["density"])) == ("butterfly", {"n_factors": 1}, 0.25)
    assert rows[0]["pattern"] == "dense" and float(rows[0]["density"]) == 1.0 and rows[0]["seq_len"] == "64"
    for r in rows:
        acc, se = float(r["test_acc"]), float(r["test_se"])
        assert r["test_n"] == "32" and se == pytest.approx(math.sqrt(acc * (1 - acc) / 32))
        assert float(r["step_ms"]) > 0 and float(r["wall_s"]) > 0 and r["torch"] and r["date"]

    # the same --out again: refused without --resume (or --overwrite)
    from sparseflash.cmdline import CommandError

    with pytest.raises(CommandError, match="already holds a sweep"):
        S.main(_args(data, out, "--max-steps", "4"))
    # a longer schedule: every run resumes from its checkpoint; then nothing is left to do
    calls.clear()
    assert S.main(_args(data, out, "--max-steps", "4", "--resume")) == 0
    assert calls == [(n, "auto") for n in names]
    calls.clear()
    before = (out / "runs" / names[0] / "summary.json").stat().st_mtime_ns
    assert S.main(_args(data, out, "--max-steps", "4", "--resume")) == 0
    assert calls == [] and (out / "runs" / names[0] / "summary.json").stat().st_mtime_ns == before
    result = json.loads((out / "sweep.json").read_text())
    assert [r["steps"] for r in result["rows"]] == [4] * 4 and result["stopped_by"] is None
    assert [len(json.loads((out / "runs" / n / "summary.json").read_text())["segments"]) for n in names] == [2] * 4

    md = (out / "sweep.md").read_text()
    assert md.count("| dense-d1-s") == 2 and "| 0.25 | 0.2500 |" in md and "| 1 | 1.0000 |" in md
    for name in ("sweep.png", "sweep.md"):
        (out / name).unlink()
    assert S.main(["--plot-only", str(out)]) == 0
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / "sweep.md").read_text() == md

    # a sweep whose runs start from the best weights of the same-named runs of this one (the Path-X recipe)
    capsys.readouterr()
    more = ["--densities", "0.25", "--seeds", "1", "--max-steps", "1"]
    assert S.main(_args(data, tmp_path / "next", *more, "--init-from-sweep", str(out))) == 0
    assert f"initialised from {out / 'runs' / names[3] / 'checkpoints' / 'best.pt'}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="which does not exist"):
        S.main(_args(data, tmp_path / "next2", *more, "--init-from-sweep", str(tmp_path / "nothing")))

    # out of time before a run can start: the sweep stops at once, exit status 75
    monkeypatch.setattr(S, "START_RESERVE_S", 1e9)
    capsys.readouterr()
    assert S.main(_args(data, tmp_path / "late", "--max-steps", "2", "--time-limit", "5")) == EXIT_STOPPED
    assert "sweep stopped by time_limit" in capsys.readouterr().out
    late = json.loads((tmp_path / "late" / "sweep.json").read_text())
    assert late["stopped_by"] == "time_limit" and [r["status"] for r in late["rows"]] == ["pending"] * 4


def test_sweep_argument_errors(tmp_path):
    from sparseflash.cli import CommandError

    with pytest.raises(SystemExit):
        S.main(["--task", "listops", "--out", str(tmp_path), "--densities", "0"])
    with pytest.raises(CommandError, match="--task"):
        S.main(["--out", str(tmp_path)])
    with pytest.raises(CommandError, match="sweep.json does not exist"):
        S.main(["--plot-only", str(tmp_path)])
    from sparseflash.experiments.lra.configs import get_config

    with pytest.raises(ValueError, match="train.objective must be 'classify', got 'denoise'"):
        S.run_sweep(get_config("listops", "quick", ["train.objective=denoise"]), tmp_path, pattern="butterfly",
                    densities=[1], datasets={})
