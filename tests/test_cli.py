"""The `sparseflash` command's error handling: a known failure is one line on stderr and exit 2.

In-process through `sparseflash.cli.main`, plus one subprocess run of issue 23's example (the
installed entry point, so that nothing between it and `main` prints a traceback). About 5 s on CPU.
"""

import os
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
    """`sparseflash lra train ... --data /nonexistent` (issue 23): one line, exit 2, no traceback."""
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
    what, todo = cli._known_error(exc)
    assert expected in todo
    assert ("/x/y" in what) or ("window" in what)


def test_unknown_error_is_not_known():
    assert cli._known_error(RuntimeError("kernel failed")) is None
    assert cli._known_error(KeyError("k")) is None
