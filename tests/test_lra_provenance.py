"""Every LRA run record carries the commit of the code that ran (experiments/lra/provenance.py):
SPARSEFLASH_COMMIT when set (a snapshot sent to a GPU), else git HEAD with +dirty; summary.json and
each of its segments, `sparseflash lra evaluate`'s result and neighbourhood.py's result.json get it."""

import json
import shutil
import subprocess

import pytest

from sparseflash.experiments.lra import provenance
from sparseflash.experiments.lra import train as T
from test_lra_train import toy_config, toy_datasets

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_environment_variable_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEFLASH_COMMIT", "abc1234")
    assert provenance.code_commit(tmp_path) == "abc1234"


@needs_git
def test_head_and_dirty_flag(monkeypatch, tmp_path):
    monkeypatch.delenv("SPARSEFLASH_COMMIT", raising=False)
    assert provenance.code_commit(tmp_path) == "unknown"  # not a checkout
    _git(tmp_path, "init", "-q")
    assert provenance.code_commit(tmp_path) == "unknown"  # a checkout without commits
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("runs/\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert provenance.code_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("not code\n")  # untracked, not code
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "scratch.py").write_text("ignored\n")  # ignored code
    assert provenance.code_commit(tmp_path) == head
    (tmp_path / "pkg" / "m.py").write_text("x = 2\n")  # an edit to tracked code
    assert provenance.code_commit(tmp_path) == head + "+dirty"
    _git(tmp_path, "checkout", "-q", "--", "pkg/m.py")
    (tmp_path / "pkg" / "new.sh").write_text("echo\n")  # new, untracked code
    assert provenance.code_commit(tmp_path) == head + "+dirty"


def test_summary_and_segments_carry_each_command_s_commit(monkeypatch, tmp_path):
    over = {"model.attention": "sdpa", "train.steps": 4, "train.eval_every": 2, "train.log_every": 1}
    data = toy_datasets(64)
    monkeypatch.setenv("SPARSEFLASH_COMMIT", "aaaaaaa")
    T.train(toy_config(**over), tmp_path, datasets=data, device="cpu", max_steps=2, show_progress=False)
    monkeypatch.setenv("SPARSEFLASH_COMMIT", "bbbbbbb+dirty")
    summary = T.train(toy_config(**over), tmp_path, datasets=data, device="cpu", resume="auto", show_progress=False)
    assert summary["commit"] == "bbbbbbb+dirty"
    assert [s["commit"] for s in summary["segments"]] == ["aaaaaaa", "bbbbbbb+dirty"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["commit"] == "bbbbbbb+dirty" and on_disk["segments"][0]["commit"] == "aaaaaaa"


def test_neighbourhood_and_zero_shot_meta_carry_the_commit(monkeypatch):
    from sparseflash.experiments.studies.pathx.neighbourhood import run_meta

    monkeypatch.setenv("SPARSEFLASH_COMMIT", "ccccccc")
    assert run_meta([])["commit"] == "ccccccc"
