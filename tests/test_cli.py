"""The `sparseflash` command's error handling: a known failure is one line on stderr and exit 2.

In-process through `sparseflash.cli.main`, plus one subprocess run of a training command on a missing
folder (the installed entry point, so that nothing between it and `main` prints a traceback). About 5 s on CPU.
"""

import os
import re
import subprocess
import sys

import pytest

from sparseflash import cli


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("sparseflash: error: "), err
    return lines[0]


def test_issue_example_missing_data_is_one_line(tmp_path):
    """`sparseflash lra train ... --data /nonexistent`: one line, exit 2, no traceback."""
    env = {**os.environ, "SPARSEFLASH_DEBUG": ""}
    r = subprocess.run([sys.executable, "-m", "sparseflash", "lra", "train", "--task", "listops", "--config", "quick",
                        "--data", str(tmp_path / "nonexistent"), "--out", str(tmp_path / "runs" / "x")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == cli.EXIT_USAGE, r.stderr
    line = _one_error_line(r.stderr)
    assert "nonexistent" in line and "is not a folder" in line
    assert "sparseflash lra data" in line  # says what to do
    assert not (tmp_path / "runs").exists()  # a failed start leaves no output folder behind


def _write_listops(root, target="foo"):
    d = root / "listops-1000"
    d.mkdir(parents=True)
    for split in ("train", "val", "test"):
        (d / f"basic_{split}.tsv").write_text(f"Source\tTarget\n( [MAX 2 3 ] )\t{target}\n")
    return root


def test_malformed_data_is_one_line(tmp_path, capsys):
    data = _write_listops(tmp_path / "data")
    rc = cli.main(["lra", "train", "--task", "listops", "--config", "quick", "--data", str(data),
                   "--out", str(tmp_path / "run")])
    assert rc == cli.EXIT_USAGE
    line = _one_error_line(capsys.readouterr().err)
    assert "basic_train.tsv:2" in line and "foo" in line


def test_bad_config_override_is_one_line(tmp_path, capsys):
    rc = cli.main(["lra", "train", "--task", "listops", "--config", "quick", "--data", str(tmp_path),
                   "--set", "model.no_such_field=1", "--out", str(tmp_path / "run")])
    assert rc == cli.EXIT_USAGE
    line = _one_error_line(capsys.readouterr().err)
    assert "no_such_field" in line and "--help" in line


def test_unwritable_output_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "sub"  # a folder below a regular file cannot be made, even as root
    rc = cli.main(["patterns", "--seq-len", "256", "--out", str(out)])
    assert rc == cli.EXIT_USAGE
    line = _one_error_line(capsys.readouterr().err)
    assert str(out) in line


def test_missing_input_is_one_line(tmp_path, capsys):
    rc = cli.main(["lra", "show", "listops", str(tmp_path / "nothing")])
    assert rc == cli.EXIT_USAGE
    assert "nothing" in _one_error_line(capsys.readouterr().err)


def test_bad_option_value_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["lra", "train", "--task", "listops", "--config", "no-such-config", "--data", "x", "--out", "y"])
    assert e.value.code == cli.EXIT_USAGE
    assert "no-such-config" in capsys.readouterr().err


def test_debug_env_reraises(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFLASH_DEBUG", "1")
    with pytest.raises(FileNotFoundError, match="nothing"):
        cli.main(["lra", "show", "listops", str(tmp_path / "nothing")])


def test_bug_keeps_its_traceback(monkeypatch):
    def broken(args):
        return 1 // 0

    monkeypatch.setattr(cli, "_cmd_info", broken)
    with pytest.raises(ZeroDivisionError):
        cli.main(["info"])


@pytest.mark.parametrize("exc, expected", [
    (FileExistsError(17, "File exists", "/x/y"), "another output folder"),
    (PermissionError(13, "Permission denied", "/x/y"), "you can read and write"),
    (ValueError("window must be positive, got -1"), "--help"),
])
def test_known_error_hints(exc, expected):
    what, todo = cli.known_error(exc)
    assert expected in todo
    assert ("/x/y" in what) or ("window" in what)


def test_unknown_error_is_not_known():
    assert cli.known_error(RuntimeError("kernel failed")) is None
    assert cli.known_error(KeyError("k")) is None


# ------------------------------------------------------------------ every command, bad arguments
def _leaf_parsers(parser, path=()):
    """(argv prefix, parser) of every runnable subcommand under ``parser``."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, p in subs[0].choices.items():
        yield from _leaf_parsers(p, (*path, name))


_LEAVES = list(_leaf_parsers(cli.build_parser()))


def _argparse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    assert e.value.code == cli.EXIT_USAGE, argv
    return _one_error_line(capsys.readouterr().err)


def test_every_subcommand_is_walked():
    names = {" ".join(p) for p, _ in _LEAVES}
    assert {"info", "patterns", "bench sparsity", "bench seqlen", "plot", "lra data listops", "lra data pathfinder",
            "lra show listops", "lra train", "lra speed", "lra sweep", "lra curves"} <= names


@pytest.mark.parametrize("path", [p for p, _ in _LEAVES], ids=lambda p: "-".join(p))
def test_every_subcommand_rejects_bad_arguments(path, capsys):
    """An unknown option, and a word where each typed option wants a number: the contract's one line
    (exit 2) naming the option and what it expects, never an internal name such as a function's."""
    line = _argparse_error([*path, "--no-such-option"], capsys)  # or first: a required argument missing
    assert ("--no-such-option" in line or "required" in line) and "(see sparseflash" in line and line.endswith("--help)")
    parser = dict(_LEAVES)[path]
    typed = [a for a in parser._actions if a.option_strings and callable(a.type) and a.type is not str]
    for action in typed:
        opt = action.option_strings[-1]
        line = _argparse_error([*path, opt, "ten"], capsys)
        assert opt in line and "'ten'" in line, line
        assert not re.search(r"(?<![\w-])_[a-z]", line), f"an internal name in {line!r}"


def test_lra_data_bad_count_names_what_it_expects(capsys):
    line = _argparse_error(["lra", "data", "listops", "--train", "ten", "--out", "x"], capsys)
    assert "--train" in line and "expected a non-negative integer" in line and "_non_negative" not in line


def test_patterns_negative_length(capsys):
    line = _argparse_error(["patterns", "--seq-len", "-5"], capsys)
    assert "--seq-len" in line and "positive" in line


def _known(argv, capsys) -> str:
    assert cli.main(list(argv)) == cli.EXIT_USAGE
    return _one_error_line(capsys.readouterr().err)


def test_missing_inputs_follow_the_contract(tmp_path, capsys):
    gone = str(tmp_path / "nonexistent")
    assert "sweep.json" in _known(["lra", "sweep", "--plot-only", gone], capsys)
    assert gone in _known(["lra", "curves", gone], capsys)
    (tmp_path / "empty").mkdir()
    assert "eval.csv" in _known(["lra", "curves", str(tmp_path / "empty")], capsys)
    assert "speed.json" in _known(["lra", "speed", "--plot-only", "--out", str(tmp_path / "empty")], capsys)
    assert gone in _known(["plot", gone, "--out", str(tmp_path / "figs")], capsys)
    assert "--task" in _known(["lra", "sweep", "--out", str(tmp_path / "s")], capsys)


def _blocked(tmp_path):
    (tmp_path / "a_file").write_text("")
    return str(tmp_path / "a_file" / "out")  # no folder can be made below a regular file, even as root


@pytest.mark.parametrize("argv, module, attr", [
    (["bench", "sparsity", "--out", "{out}"], "sparseflash.experiments.bench.sparsity", "run"),
    (["bench", "seqlen", "--out", "{out}"], "sparseflash.experiments.bench.seqlen", "run"),
    (["plot", "{here}", "--out", "{out}"], "sparseflash.experiments.bench.plots", "plot_results"),
    (["patterns", "--seq-len", "256", "--out", "{out}"], "sparseflash.analysis", "zoo"),
    (["lra", "data", "listops", "--out", "{out}"], "sparseflash.experiments.lra.data.listops", "write_listops"),
    (["lra", "train", "--task", "listops", "--data", "{here}", "--out", "{out}"], "sparseflash.experiments.lra.train",
     "train"),
    (["lra", "speed", "--task", "listops", "--device", "cpu", "--tiny", "--out", "{out}"],
     "sparseflash.experiments.lra.speed", "run_speed"),
    (["lra", "sweep", "--task", "listops", "--out", "{out}"], "sparseflash.experiments.lra.sweep", "run_sweep"),
    (["lra", "show", "listops", "{here}", "--out", "{out}/x.png"], "sparseflash.experiments.lra.data.show",
     "show_listops"),
])
def test_unwritable_output_fails_before_any_work(tmp_path, capsys, monkeypatch, argv, module, attr):
    """`bench sparsity --out /proc/nope` must fail at once, not after the measurements."""
    import importlib

    def no_work(*a, **k):
        raise AssertionError("the command started its work before checking --out")

    monkeypatch.setattr(importlib.import_module(module), attr, no_work)
    out = _blocked(tmp_path)
    line = _known([a.format(out=out, here=tmp_path) for a in argv], capsys)
    assert "--out" in line and "a_file" in line


def test_unreadable_file_gets_no_disk_hint():
    """An OSError that is not the system's (PIL's 'cannot identify image file') is about the file."""
    what, todo = cli.known_error(OSError("cannot identify image file 'sample_3.png'"))
    assert "sample_3.png" in what and "writable" not in todo and "regenerate or replace" in todo


_ENTRY_POINTS = ["sparseflash.experiments.lra.train", "sparseflash.experiments.lra.sweep",
                 "sparseflash.experiments.lra.speed", "sparseflash.experiments.lra.curves",
                 "sparseflash.experiments.lra.weights", "sparseflash.experiments.lra.headline",
                 "sparseflash.experiments.bench.packed", "sparseflash.experiments.bench.host",
                 "sparseflash.experiments.bench.dropout", "sparseflash.experiments.bench.tune_tiles",
                 "sparseflash.experiments.bench.inspect_kernels", "sparseflash.experiments.hf_example",
                 *(f"sparseflash.experiments.studies.{m}" for m in (
                     "gluon.gluon_probe", "host_cost.breakdown", "host_cost.host_python", "host_cost.pieces",
                     "host_cost.host_cost", "tma.ws_probe", "tma.tma_ab", "hopper.fwd_bench", "hopper.plot",
                     "hopper.compile_check", "hopper.bwd_parts", "hopper.fwd_epilogue", "hopper.power_probe",
                     "hopper.bwd_knobs", "hopper.short_rows", "short_rows.fixed_cost", "short_rows.short_rows"))]


def _run_module(name, argv, monkeypatch) -> int:
    import runpy

    monkeypatch.setattr(sys, "argv", [name, *argv])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(name, run_name="__main__", alter_sys=False)
    return e.value.code


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # runpy: the module is already imported
@pytest.mark.parametrize("name", _ENTRY_POINTS)
def test_python_m_entry_points_follow_the_contract(name, monkeypatch, capsys):
    """``python -m NAME --no-such-option`` (as its __main__ block runs it): one line, exit 2."""
    pytest.importorskip(name)
    assert _run_module(name, ["--no-such-option"], monkeypatch) == cli.EXIT_USAGE
    line = _one_error_line(capsys.readouterr().err)
    assert ("--no-such-option" in line or "required" in line) and f"python -m {name} --help" in line


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name, argv", [
    ("sparseflash.experiments.lra.curves", ["{here}/nonexistent"]),
    ("sparseflash.experiments.lra.sweep", ["--plot-only", "{here}/nonexistent"]),
    ("sparseflash.experiments.bench.packed", ["--device", "cpu", "--out", "{out}"]),
    ("sparseflash.experiments.bench.host", ["--device", "cpu", "--out", "{out}"]),
])
def test_python_m_known_failures_are_one_line(name, argv, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SPARSEFLASH_DEBUG", raising=False)
    out = _blocked(tmp_path)
    rc = _run_module(name, [a.format(here=tmp_path, out=out) for a in argv], monkeypatch)
    assert rc == cli.EXIT_USAGE
    _one_error_line(capsys.readouterr().err)
