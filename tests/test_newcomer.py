"""What a newcomer meets: output folders that hold a run are refused and left byte for
byte (``--resume`` / ``--overwrite``), and so are files a command would replace; a failed start
that leaves nothing to block its retry; ``--resume`` that keeps a run's history and checks its
config.json; tiny LRA configs that are really sparse (and a warning when a pattern comes out
dense), tiny's own data command, usage errors, damaged files named in one line, ``scale`` > 0,
the README's first code block, and checkpoints that load without running code (or say they are
damaged). About 25 s on 2 CPU cores."""

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch

import sparseflash
from sparseflash import cli
from sparseflash.cmdline import CommandError, claim_output_dir

README = Path(__file__).resolve().parent.parent / "README.md"


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("sparseflash: error: "), err
    return lines[0]


def _hashes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _fake_run(folder: Path) -> dict:
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "last.pt").write_bytes(os.urandom(64))
    (folder / "summary.json").write_text('{"steps": 600}')
    (folder / "train.csv").write_text("step,loss\n200,1.5\n400,1.2\n600,1.1\n")
    return _hashes(folder)


def _tiny_listops(root: Path) -> Path:
    from sparseflash.experiments.lra.data.listops import write_listops

    write_listops(root, train=64, val=32, test=32, seed=1, min_len=10, max_len=120, max_depth=4, workers=1,
                  show_progress=False)
    return root


# ------------------------------------------------------------------------- output folders
def test_train_refuses_a_folder_holding_a_run_and_leaves_it_byte_for_byte(tmp_path, capsys):
    run = tmp_path / "run"
    before = _fake_run(run)
    base = ["lra", "train", "--task", "listops", "--config", "tiny", "--data", str(tmp_path / "no-data"),
            "--out", str(run)]
    assert cli.main(base) == cli.EXIT_USAGE
    line = _one_error_line(capsys.readouterr().err)
    assert "already holds a run" in line and "--resume" in line and "--overwrite" in line and str(run) in line
    assert _hashes(run) == before
    # --overwrite removes only what a run writes: a folder holding anything else is refused whole
    (run / "notes.txt").write_text("mine")
    before = _hashes(run)
    assert cli.main(base + ["--overwrite"]) == cli.EXIT_USAGE
    line = _one_error_line(capsys.readouterr().err)
    assert "notes.txt" in line and "nothing was removed" in line
    assert _hashes(run) == before
    assert cli.main(base + ["--overwrite", "--resume"]) == cli.EXIT_USAGE
    assert "contradict" in _one_error_line(capsys.readouterr().err)
    assert _hashes(run) == before


def test_a_failed_start_does_not_block_its_retry(tmp_path, capsys, monkeypatch):
    """Each way a start fails -- a bad --pattern, --pattern-arg, a missing --resume or --init-from
    file, an error in the first step -- leaves --out as it found it (absent, or the empty folder it
    was), so the corrected command runs without --overwrite; a command that failed after its run
    recorded a step keeps that run."""
    from sparseflash.experiments.lra import train as T

    data = _tiny_listops(tmp_path / "data")

    def command(out, *extra):
        return ["lra", "train", "--task", "listops", "--config", "tiny", "--data", str(data), "--out", str(out),
                "--set", "train.batch_size=8", "--set", "train.eval_batches=1", "--set", "train.log_every=1",
                "--set", "model.d_model=16", "--set", "model.d_ff=32", "--num-workers", "0", "--no-progress", *extra]

    out = tmp_path / "run"
    failures = {"--pattern": ["--pattern", "no_such_pattern"], "unknown --pattern-arg": ["--pattern-arg", "nope=3"],
                "bad --pattern-arg": ["--pattern-arg", "n_factors=many"],
                "--resume": ["--resume", str(tmp_path / "gone.pt")], "--init-from": ["--init-from", str(tmp_path / "gone.pt")]}
    for empty_folder_first in (False, True):
        if empty_folder_first:
            out.mkdir()
        for what, extra in failures.items():
            assert cli.main(command(out, *extra)) == cli.EXIT_USAGE, what
            _one_error_line(capsys.readouterr().err)
            assert out.exists() == empty_folder_first, what
            assert not empty_folder_first or list(out.iterdir()) == [], what

    def broken_step(self, b):
        raise ValueError("a failure in the first step")

    with monkeypatch.context() as m:
        m.setattr(T._Run, "_train_step", broken_step)
        assert cli.main(command(out, "--max-steps", "1")) == cli.EXIT_USAGE
        assert "first step" in _one_error_line(capsys.readouterr().err) and list(out.iterdir()) == []
    assert cli.main(command(out, "--max-steps", "1")) == 0  # the corrected command, without --overwrite
    capsys.readouterr()
    assert json.loads((out / "summary.json").read_text())["steps"] == 1

    # a failure after the run recorded its first step leaves the run (config.json and its records)
    real, calls = T._Run._train_step, []

    def fails_second(self, b):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("a failure in the second step")
        return real(self, b)

    monkeypatch.setattr(T._Run, "_train_step", fails_second)
    later = tmp_path / "later"
    assert cli.main(command(later, "--max-steps", "3")) == cli.EXIT_USAGE
    assert "second step" in _one_error_line(capsys.readouterr().err)
    assert {"config.json", "train.csv", "metrics.jsonl"} <= {p.name for p in later.iterdir()}


def test_a_failed_sweep_start_does_not_block_its_retry(tmp_path, capsys, monkeypatch):
    """`lra sweep` whose start fails (a missing --init-from, an error in its first run's first
    step) leaves no folder behind, so the same command, corrected, runs without --overwrite."""
    from sparseflash.experiments.lra import train as T

    data = _tiny_listops(tmp_path / "data")
    out = tmp_path / "sweep"
    command = ["lra", "sweep", "--task", "listops", "--config", "tiny", "--data", str(data), "--out", str(out),
               "--densities", "1", "--max-steps", "1", "--timing-warmup", "0", "--timing-repeats", "1", "--set",
               "train.batch_size=8", "--set", "train.eval_batches=1", "--set", "model.d_model=16", "--set",
               "model.d_ff=32", "--num-workers", "0", "--no-progress"]
    assert cli.main(command + ["--init-from", str(tmp_path / "gone.pt")]) == cli.EXIT_USAGE
    assert "gone.pt" in _one_error_line(capsys.readouterr().err) and not out.exists()

    def broken_step(self, b):
        raise ValueError("a failure in the first step")

    with monkeypatch.context() as m:
        m.setattr(T._Run, "_train_step", broken_step)
        assert cli.main(command) == cli.EXIT_USAGE
        err = capsys.readouterr().err  # after the sweep's line naming the run it starts
        assert "Traceback" not in err and err.splitlines()[-1].startswith("sparseflash: error: a failure in the first")
        assert not out.exists()
    assert cli.main(command) == 0
    capsys.readouterr()
    assert json.loads((out / "sweep.json").read_text())["rows"][0]["status"] == "done"


def test_resume_keeps_the_history_and_checks_config_json(tmp_path, capsys):
    """--resume never rewrites what a run recorded: a run that has ended is left byte for byte;
    going on keeps the first command's record (wall time, end) as its summary wrote it; a damaged
    or differing config.json is refused, leaving the folder as it was; a deleted one is written again."""
    data = _tiny_listops(tmp_path / "data")
    run = tmp_path / "run"
    args = ["lra", "train", "--task", "listops", "--config", "tiny", "--data", str(data), "--out", str(run),
            "--set", "train.steps=3", "--set", "train.batch_size=8", "--set", "train.eval_batches=1", "--set",
            "train.log_every=1", "--set", "model.d_model=16", "--set", "model.d_ff=32", "--num-workers", "0",
            "--no-progress"]
    assert cli.main(args + ["--max-steps", "2"]) == 0
    first = json.loads((run / "summary.json").read_text())
    before = _hashes(run)
    assert cli.main(args + ["--max-steps", "2", "--resume"]) == 0  # ended where this command would end it
    assert "has ended at step 2" in capsys.readouterr().err and _hashes(run) == before

    config = (run / "config.json").read_bytes()
    for damaged, said in (('{"task": ', "is not valid JSON"), ("[]", "holds a JSON list"),
                          (config.decode().replace('"d_model": 16', '"d_model": 17'), "differs from the checkpoint's "
                                                                                      "config in ['model.d_model']")):
        (run / "config.json").write_text(damaged)
        before = _hashes(run)
        assert cli.main(args + ["--resume"]) == cli.EXIT_USAGE
        line = _one_error_line(capsys.readouterr().err)
        assert f"{run / 'config.json'} {said}" in line, line
        assert _hashes(run) == before
    (run / "config.json").unlink()

    assert cli.main(args + ["--resume"]) == 0  # on to the end of the schedule
    capsys.readouterr()
    assert (run / "config.json").read_bytes() == config
    done = json.loads((run / "summary.json").read_text())
    assert done["segments"][0] == first["segments"][0] and [s["end_step"] for s in done["segments"]] == [2, 3]
    assert done["wall_s_total"] == pytest.approx(sum(s["wall_s"] for s in done["segments"]))
    before = _hashes(run)
    assert cli.main(args + ["--resume"]) == 0
    assert "nothing to run" in capsys.readouterr().err and _hashes(run) == before
    (run / "summary.json").write_text("{")
    assert cli.main(args + ["--resume"]) == cli.EXIT_USAGE
    assert f"{run / 'summary.json'} is not valid JSON" in _one_error_line(capsys.readouterr().err)


def test_evaluate_names_what_it_evaluated(tmp_path, capsys):
    """`lra evaluate` of a task without generator fidelities (ListOps) names the data it read, not
    'trained on None data, evaluated on None test'."""
    data = _tiny_listops(tmp_path / "data")
    run = tmp_path / "run"
    assert cli.main(["lra", "train", "--task", "listops", "--config", "tiny", "--data", str(data), "--out", str(run),
                     "--max-steps", "1", "--set", "train.batch_size=8", "--set", "train.eval_batches=1", "--set",
                     "model.d_model=16", "--set", "model.d_ff=32", "--num-workers", "0", "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["lra", "evaluate", str(run), "--data", str(data), "--device", "cpu"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"listops (step 1 of {run}) evaluated on test of {data} (32 examples): acc ")
    assert "None" not in line


def test_claim_output_dir_rules(tmp_path):
    assert claim_output_dir(tmp_path / "new", owned=()) == tmp_path / "new"  # absent or empty: fine
    run = tmp_path / "run"
    before = _fake_run(run)
    assert claim_output_dir(run, owned=(), resume=True) == run and _hashes(run) == before
    with pytest.raises(CommandError, match=r"already holds results \(checkpoints, summary.json, train.csv\)") as e:
        claim_output_dir(run, owned=(), kind="results", resumable=False)
    assert "--resume" not in e.value.todo and "--overwrite" in e.value.todo
    claim_output_dir(run, owned=("checkpoints", "*.json", "*.csv"), overwrite=True)
    assert list(run.iterdir()) == []


def test_train_overwrite_starts_afresh_tiny_is_sparse_and_a_dense_pattern_is_said(tmp_path, capsys):
    """A tiny ListOps run goes through sparseflash with a mask of density < 1; the same folder again
    with --overwrite starts afresh (no duplicate rows); a pattern whose blocks cover the sequence
    says once that the run is dense."""
    data = _tiny_listops(tmp_path / "data")
    run = tmp_path / "run"
    args = ["lra", "train", "--task", "listops", "--config", "tiny", "--data", str(data), "--out", str(run),
            "--max-steps", "2", "--set", "train.batch_size=8", "--set", "train.eval_batches=1", "--set",
            "train.log_every=1", "--set", "model.d_model=16", "--set", "model.d_ff=32", "--num-workers", "0",
            "--no-progress"]
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["attention"] == "sparseflash" and summary["pattern"] == "butterfly"
    assert summary["block_size"] == 8 and summary["density"] == 0.5 and "dense" not in err
    assert [r.split(",")[0] for r in (run / "train.csv").read_text().splitlines()[1:]] == ["1", "2"]

    assert cli.main(args + ["--block-size", "64", "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: --pattern butterfly at --block-size 64 is dense for 64 attended tokens") == 1, err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["density"] == 1.0 and summary["block_size"] == 64 and summary["resumed_from"] is None
    assert [r.split(",")[0] for r in (run / "train.csv").read_text().splitlines()[1:]] == ["1", "2"]
    assert sum(json.loads(line)["kind"] == "train" for line in (run / "metrics.jsonl").read_text().splitlines()) == 2


def test_bench_and_data_refuse_folders_that_hold_results(tmp_path, capsys, monkeypatch):
    out = tmp_path / "bench"
    out.mkdir()
    (out / "sparsity.json").write_text('{"rows": []}')
    (out / "sparsity_table.md").write_text("# old\n")
    before = _hashes(out)
    args = ["bench", "sparsity", "--device", "cpu", "--seq-len", "128", "--out", str(out), "--no-progress"]
    assert cli.main(args) == cli.EXIT_USAGE  # before any measurement
    line = _one_error_line(capsys.readouterr().err)
    assert "already holds benchmark results" in line and "--overwrite" in line and "--resume" not in line
    assert _hashes(out) == before

    # lra data listops into a folder that holds ListOps files: refused; --overwrite replaces them
    root = tmp_path / "data"
    (root / "listops-1000").mkdir(parents=True)
    (root / "listops-1000" / "basic_train.tsv").write_text("Source\tTarget\n")
    before = _hashes(root)
    small = ["lra", "data", "listops", "--out", str(root), "--train", "4", "--val", "2", "--test", "2",
             "--min-len", "10", "--max-len", "60", "--max-depth", "3", "--workers", "1", "--no-progress"]
    assert cli.main(small) == cli.EXIT_USAGE
    assert "already holds ListOps data" in _one_error_line(capsys.readouterr().err)
    assert _hashes(root) == before
    assert cli.main(small + ["--overwrite"]) == 0
    assert len((root / "listops-1000" / "basic_train.tsv").read_text().splitlines()) == 1 + 4

    # --size tiny: just what --config tiny reads (600 steps of 32; 16 evaluation batches of 32)
    from sparseflash.experiments.lra import cli as lra_cli
    from sparseflash.experiments.lra.configs import get_config

    seen = {}

    def fake_write(out, **kw):
        seen.update(kw)
        raise CommandError("stop here", "a test")

    monkeypatch.setattr("sparseflash.experiments.lra.data.listops.write_listops", fake_write)
    assert cli.main(["lra", "data", "listops", "--size", "tiny", "--out", str(tmp_path / "tiny")]) == cli.EXIT_USAGE
    tc = get_config("listops", "tiny").train
    assert (seen["train"], seen["val"], seen["test"]) == (tc.steps * tc.batch_size, tc.eval_batches * tc.batch_size,
                                                          tc.eval_batches * tc.batch_size)
    assert lra_cli.LISTOPS_SIZES["tiny"] == {"train": seen["train"], "val": seen["val"], "test": seen["test"]}


def test_tiny_configs_are_sparse_at_their_length():
    from sparseflash.experiments.lra.configs import TASKS, get_config
    from sparseflash.experiments.lra.model import build_pattern

    for task in TASKS:
        m = get_config(task, "tiny").model
        mask = build_pattern(m.pattern, m.attn_len, m.block_size)
        assert m.attention == "sparseflash" and mask is not None and mask.density() < 1.0, task


# the commands that write files by name: (argv, files it would replace, the module and the function
# that starts its work); {out} holds the files, {here} is a folder that exists
_WRITERS = [
    pytest.param(["patterns", "--seq-len", "256", "--out", "{out}"], ["density.png", "zoo_256.csv"],
                 "sparseflash.analysis", "density_sweep", id="patterns"),
    pytest.param(["patterns", "--seq-len", "256", "--no-density", "--out", "{out}"], ["zoo_256.json"],
                 "sparseflash.analysis", "zoo", id="patterns-no-density"),
    pytest.param(["lra", "speed", "--task", "listops", "--device", "cpu", "--tiny", "--out", "{out}"], ["speed.json"],
                 "sparseflash.experiments.lra.speed", "run_speed", id="lra-speed"),
    pytest.param(["lra", "speed", "--paired", "3", "--task", "listops", "--device", "cpu", "--tiny", "--out", "{out}"],
                 ["paired.png"], "sparseflash.experiments.lra.speed", "run_paired", id="lra-speed-paired"),
    pytest.param(["lra", "probe", "--out", "{out}"], ["probe.csv"], "sparseflash.experiments.lra.probe", "run_probe",
                 id="lra-probe"),
    pytest.param(["lra", "curves", "{here}", "--out", "{out}/mine.png"], ["mine.png"],
                 "sparseflash.experiments.lra.curves", "load_runs", id="lra-curves-out"),
    pytest.param(["lra", "curves", "{out}"], ["curves.png"], "sparseflash.experiments.lra.curves", "load_runs",
                 id="lra-curves-default"),
    pytest.param(["lra", "evaluate", "{here}", "--data", "{here}", "--out", "{out}/result.json"], ["result.json"],
                 "sparseflash.experiments.lra.crosseval", "evaluate_run", id="lra-evaluate"),
    pytest.param(["lra", "show", "listops", "{here}", "--out", "{out}/look.png"], ["look.png"],
                 "sparseflash.experiments.lra.data.show", "show_listops", id="lra-show-listops"),
    pytest.param(["lra", "show", "pathfinder", "{here}", "--out", "{out}/look.png"], ["look.png"],
                 "sparseflash.experiments.lra.data.show", "show_pathfinder", id="lra-show-pathfinder"),
]


@pytest.mark.parametrize("argv, names, module, attr", _WRITERS)
def test_commands_that_write_refuse_files_already_there(tmp_path, capsys, monkeypatch, argv, names, module, attr):
    """A file the command would write that is already there (an earlier result, or another file of
    that name) is refused before any work, one line naming it and --overwrite, every file left
    byte for byte; other files in the folder do not matter; --overwrite goes on to the work."""
    import importlib

    def work(*a, **k):
        raise CommandError("reached the work", "a test")

    monkeypatch.setattr(importlib.import_module(module), attr, work)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not an output of the command")
    command = [a.format(out=out, here=tmp_path) for a in argv]
    assert cli.main(command) == cli.EXIT_USAGE
    assert "reached the work" in _one_error_line(capsys.readouterr().err)  # nothing to replace yet
    for name in names:
        (out / name).write_bytes(b"mine")
    before = _hashes(out)
    assert cli.main(command) == cli.EXIT_USAGE
    line = _one_error_line(capsys.readouterr().err)
    assert names[0] in line and "--overwrite" in line and "reached" not in line, line
    assert _hashes(out) == before
    assert cli.main(command + ["--overwrite"]) == cli.EXIT_USAGE
    assert "reached the work" in _one_error_line(capsys.readouterr().err)


def test_plot_refuses_figures_already_there(tmp_path, capsys):
    """`sparseflash plot` knows its figures' names from the rows before drawing: one already in
    --out (an earlier figure, or an unrelated file of that name) is refused in one line naming it
    and --overwrite, every file left byte for byte; other files do not matter; --overwrite redraws."""
    import shutil

    src = tmp_path / "rows"
    src.mkdir()
    shutil.copy(README.parent / "experiments/results/seqlen/seqlen.json", src)
    out = tmp_path / "figs"
    out.mkdir()
    (out / "notes.txt").write_text("not a figure")
    (out / "seqlen_memory.png").write_bytes(b"mine")
    before = _hashes(out)
    assert cli.main(["plot", str(src), "--out", str(out)]) == cli.EXIT_USAGE
    line = _one_error_line(capsys.readouterr().err)
    assert "seqlen_memory.png" in line and "--overwrite" in line, line
    assert _hashes(out) == before
    assert cli.main(["plot", str(src), "--out", str(out), "--overwrite"]) == 0
    assert (out / "seqlen_memory.png").read_bytes()[:4] == b"\x89PNG" and (out / "seqlen_runtime.png").exists()
    assert (out / "notes.txt").read_text() == "not a figure"


def test_weights_export_refuses_a_file_already_there(tmp_path, capsys):
    from sparseflash.experiments.lra import weights

    ckpt = tmp_path / "best.pt"
    torch.save({"config": {}, "model": {"w": torch.ones(2)}, "step": 1}, ckpt)
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.pt").write_bytes(b"mine")
    assert cli.run_command(weights.main, ["export", str(ckpt), str(out)]) == cli.EXIT_USAGE
    line = _one_error_line(capsys.readouterr().err)
    assert "already" in line and "model.pt" in line and "--overwrite" in line
    assert (out / "model.pt").read_bytes() == b"mine"
    assert cli.run_command(weights.main, ["export", str(ckpt), str(out), "--overwrite"]) == 0
    assert torch.load(out / "model.pt", weights_only=True)["model"]["w"].dtype == torch.bfloat16


# ----------------------------------------------------------------------------- edges
def test_usage_errors_bench_without_sweep_and_corrupt_plot_input(tmp_path, capsys):
    for argv in (["bench"], ["lra"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == cli.EXIT_USAGE
        assert "required" in _one_error_line(capsys.readouterr().err)
    bad = tmp_path / "sparsity.json"
    bad.write_text('{"schema": "sparseflash-bench/1", "rows": [')
    assert cli.main(["plot", str(bad), "--out", str(tmp_path / "plots")]) == cli.EXIT_USAGE
    line = _one_error_line(capsys.readouterr().err)
    assert str(bad) in line and "not valid JSON" in line


def test_redraws_name_a_damaged_results_file(tmp_path, capsys):
    """`lra speed --plot-only` and `lra sweep --plot-only` given a damaged speed.json / sweep.json:
    one line naming the file."""
    for argv, name in ((["lra", "speed", "--plot-only", "--out", "{d}"], "speed.json"),
                       (["lra", "speed", "--plot-only", "--out", "{d}"], "paired.json"),
                       (["lra", "sweep", "--plot-only", "{d}"], "sweep.json")):
        d = tmp_path / name.replace(".", "-")
        d.mkdir()
        for content, said in (('{"rows": [', "is not valid JSON"), ("[]", "holds a JSON list")):
            (d / name).write_text(content)
            assert cli.main([a.format(d=d) for a in argv]) == cli.EXIT_USAGE
            assert f"{d / name} {said}" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("scale", [0, 0.0, -0.125])
def test_non_positive_scale_is_refused(scale):
    q = torch.randn(1, 1, 16, 8)
    with pytest.raises(ValueError, match=r"scale must be > 0"):
        sparseflash.attention(q, q, q, scale=scale)


def test_readme_first_code_block_runs_as_shown():
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope = {}
    exec(compile(block, str(README), "exec"), scope)  # noqa: S102 - the README's own example
    q, k, v, o = (scope[n] for n in ("q", "k", "v", "o"))
    assert o.shape == q.shape and torch.isfinite(o).all()


# ----------------------------------------------------------------------------- checkpoints
def test_checkpoint_with_a_pickled_callable_is_refused(tmp_path, capsys):
    from sparseflash.experiments.lra.checkpoints import load_checkpoint

    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "config": {}, "hook": os.getcwd}, evil)  # a callable: unpickling would import it
    with pytest.raises(ValueError, match="refused, it holds more than tensors and plain values"):
        load_checkpoint(evil, "--resume")
    good = tmp_path / "good.pt"
    torch.save({"model": {"w": torch.ones(2)}, "step": 3, "rng": ("MT19937", torch.arange(3), 1, 0, 0.0)}, good)
    assert load_checkpoint(good)["step"] == 3
    # a checkpoint of an older version: its NumPy RNG state is an array (data, let through), and it
    # restores the same stream; an array beside a callable is still refused
    import numpy as np

    from sparseflash.experiments.lra import train as T

    np.random.seed(5)
    old = tmp_path / "old.pt"
    torch.save({"rng": [{**T._rng_state(), "numpy": np.random.get_state()}]}, old)
    expected = np.random.random(3)
    np.random.seed(6)
    T._set_rng_state(load_checkpoint(old)["rng"][0])
    assert np.array_equal(np.random.random(3), expected)
    torch.save({"numpy": np.random.get_state(), "hook": os.getcwd}, old)
    with pytest.raises(ValueError, match="refused"):
        load_checkpoint(old)
    data = _tiny_listops(tmp_path / "data")
    for flag in ("--resume", "--init-from"):
        out = tmp_path / f"run{flag}"
        assert cli.main(["lra", "train", "--task", "listops", "--config", "tiny", "--data", str(data), "--out",
                         str(out), flag, str(evil), "--no-progress", "--num-workers", "0"]) == cli.EXIT_USAGE
        line = _one_error_line(capsys.readouterr().err)
        assert f"{flag} {evil}: refused" in line


def _damaged_checkpoints(folder: Path) -> dict:
    """What can lie where a checkpoint should: an empty file, a bare tensor, a torch.save file cut
    short (a crash or a full disk during a save or a copy), random bytes."""
    import random

    folder.mkdir()
    whole = folder / "whole.pt"
    torch.save({"model": {"w": torch.randn(64, 64)}, "config": {}, "step": 3}, whole)
    data = whole.read_bytes()
    files = {"empty": b"", "half": data[:len(data) // 2], "end-cut": data[:-64],
             "random": random.Random(0).randbytes(4096)}
    paths = {}
    for name, content in files.items():
        paths[name] = folder / f"{name}.pt"
        paths[name].write_bytes(content)
    paths["tensor"] = folder / "tensor.pt"
    torch.save(torch.ones(3), paths["tensor"])
    return paths


def test_damaged_checkpoints_are_one_line_that_says_so(tmp_path, capsys):
    """--resume / --init-from given an empty, truncated, random or bare-tensor file: one line naming
    the option and the file, saying it is damaged (not that it could run code); no folder is left."""
    from sparseflash.experiments.lra.checkpoints import load_checkpoint

    data = _tiny_listops(tmp_path / "data")
    damaged = _damaged_checkpoints(tmp_path / "files")
    said = {"empty": "the file is empty", "half": "damaged or truncated", "end-cut": "damaged or truncated",
            "random": "damaged or truncated", "tensor": "holds a Tensor"}
    for name, path in damaged.items():
        with pytest.raises(ValueError, match=said[name]):
            load_checkpoint(path, "--resume", keys=("model",))
        for flag in ("--resume", "--init-from"):
            out = tmp_path / "run"  # the same --out each time: a failed start leaves nothing to refuse
            assert cli.main(["lra", "train", "--task", "listops", "--config", "tiny", "--data", str(data), "--out",
                             str(out), flag, str(path), "--no-progress", "--num-workers", "0"]) == cli.EXIT_USAGE
            line = _one_error_line(capsys.readouterr().err)
            assert f"{flag} {path}: " in line and said[name] in line and "run code" not in line, line
            assert not out.exists(), f"{flag} {name}: a failed start left {sorted(out.rglob('*'))}"
    # the last.pt of a run folder, damaged: `--resume` names it and leaves the folder as it was
    run = tmp_path / "damaged-run"
    before = _fake_run(run)
    assert cli.main(["lra", "train", "--task", "listops", "--config", "tiny", "--data", str(data), "--out", str(run),
                     "--resume", "--no-progress", "--num-workers", "0"]) == cli.EXIT_USAGE
    line = _one_error_line(capsys.readouterr().err)
    assert f"--resume {run / 'checkpoints' / 'last.pt'}: the file is damaged" in line
    assert _hashes(run) == before


class _PlantDType:
    """Pickles as a call of ``numpy.dtypes._add_dtype_helper``, which writes into ``numpy.dtypes``."""

    def __reduce__(self):
        import numpy as np

        return np.dtypes._add_dtype_helper, (type(np.dtype(np.uint32)), "sparseflash_planted")


def test_numpy_allow_list_names_exact_globals(tmp_path):
    """Only the names an older checkpoint's NumPy RNG state needs are let through: a function of
    numpy.dtypes is refused before it runs, and so is an array of another dtype."""
    import numpy as np

    from sparseflash.experiments.lra.checkpoints import NUMPY_ARRAY_GLOBALS, load_checkpoint

    if not hasattr(getattr(np, "dtypes", None), "_add_dtype_helper"):
        pytest.skip("this NumPy has no numpy.dtypes._add_dtype_helper")
    assert all(not name.endswith(".") and name.count(".") >= 1 for name in NUMPY_ARRAY_GLOBALS)
    planted = tmp_path / "planted.pt"
    torch.save({"model": {}, "x": _PlantDType()}, planted)
    names_before = list(np.dtypes.__all__)
    with pytest.raises(ValueError, match=r"refused, .*numpy\.dtypes\._add_dtype_helper.*could run code"):
        load_checkpoint(planted)
    assert not hasattr(np.dtypes, "sparseflash_planted") and np.dtypes.__all__ == names_before
    floats = tmp_path / "floats.pt"
    torch.save({"model": {}, "x": np.zeros(3)}, floats)
    with pytest.raises(ValueError, match="refused"):
        load_checkpoint(floats)
    rng = tmp_path / "rng.pt"
    torch.save({"numpy": np.random.get_state()}, rng)
    assert np.array_equal(load_checkpoint(rng)["numpy"][1], np.random.get_state()[1])
