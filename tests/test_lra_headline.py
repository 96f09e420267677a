"""experiments/lra/results/headline.csv is built from the run files, and RESULTS.md's headline table and
the README's LRA sentences are rendered from it (`python -m sparseflash.experiments.lra.headline`).
CPU only, reads files (well under a second)."""

import math

import pytest

from sparseflash.experiments.lra import headline


@pytest.fixture(scope="module")
def rows():
    return headline.build_rows()


def test_csv_is_what_the_run_files_give(rows):
    assert headline.CSV.read_text() == headline.csv_text(rows), \
        "headline.csv differs from the run files: run python -m sparseflash.experiments.lra.headline"


def test_results_md_and_readme_are_rendered_from_the_csv():
    rows = headline.read_csv()
    table = headline.block(headline.RESULTS_MD.read_text(), "headline").strip()
    assert table == headline.render_table(rows), "RESULTS.md's headline table is stale: run the headline module"
    sentence = " ".join(headline.block(headline.README.read_text(), "lra-headline").split())
    assert sentence == headline.render_readme(rows), "README's LRA sentences are stale: run the headline module"


def test_check_flag_passes_on_the_committed_files():
    assert headline.main(["--check"]) == 0


def test_every_row_has_its_columns_and_an_existing_source(rows):
    keys = set()
    for r in rows:
        assert tuple(r) == headline.COLUMNS
        assert r["task"] in headline.TASKS
        path = headline.ROOT / r["source"].split("#")[0]
        assert path.is_file(), f"{r['source']}: no such file"
        assert 0 <= r["test_acc"] <= 1 and r["n_test"] > 0
        assert math.isclose(r["stderr"], math.sqrt(r["test_acc"] * (1 - r["test_acc"]) / r["n_test"]))
        assert r["commit"] and r["commit"] != "unknown", f"{r['source']}: no commit"
        assert len(r["date"]) == 10 and r["gpu"]
        key = tuple(r[k] for k in ("task", "train_fidelity", "eval_set", "pattern", "density", "seed", "run"))
        assert key not in keys
        keys.add(key)


def test_a_changed_run_file_changes_the_table(rows, monkeypatch):
    """The table follows the files: a different accuracy in a summary.json shows in the row and the prose."""
    real = headline._read_json

    def fake(rel):
        d = real(rel)
        if rel.endswith("dense-bip/summary.json"):
            d = dict(d, test_best=dict(d["test_best"], acc=0.6543))
        return d

    monkeypatch.setattr(headline, "_read_json", fake)
    changed = headline.build_rows()
    row = next(r for r in changed if r["run"] == "dense-bip" and r["eval_set"] == "release")
    assert row["test_acc"] == 0.6543
    prose = headline.render_readme(changed)
    assert "(seed 0: 65.4 / " in prose  # seed 0 beside the mean over the seeds, which moves with it
    mean, sd, _ = headline.seed_stats(changed, "dense", "release")
    assert mean < headline.seed_stats(rows, "dense", "release")[0]
    assert f"{100 * mean:.1f} ± {100 * sd:.1f}% dense" in prose
    assert "65.43 ± 0.34%" in headline.render_table(changed)


def test_the_path256_gap_is_counted_in_standard_errors(rows):
    r = next(r for r in rows if r["task"] == "path256" and r["eval_set"] == "release-val")
    assert headline.published_gap(rows) == pytest.approx((0.631 - r["test_acc"]) / r["stderr"])
    assert f"{headline.published_gap(rows):.1f} standard errors below" in headline.render_readme(rows)


def test_update_block_replaces_one_block_and_rejects_none_or_two():
    text = "a <!-- x -->old<!-- /x --> b"
    assert headline.update_block(text, "x", "new", before="", after="") == "a <!-- x -->new<!-- /x --> b"
    with pytest.raises(LookupError, match="expected one"):
        headline.update_block("no block here", "x", "new")
    with pytest.raises(LookupError, match="expected one"):
        headline.update_block(text + text, "x", "new")


def test_a_missing_zero_shot_row_is_an_error():
    with pytest.raises(LookupError, match="no row for"):
        headline._from_zero_shot(f"{headline._PX}/swap", "no-such-model", "swapR6",
                                 f"{headline._PX}/runs/cont-bfly/cont-bfly-1-full", "pathx", "swap-R6")


def test_cue_tests_rows_read_the_follow_rate(monkeypatch):
    """cue_tests.py's table becomes headline rows: the cut set's follow rate, the balanced set's accuracy."""
    real = headline._read_json
    table = {"meta": {"commit": "1234567890abcdef", "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-12-01T10:00:00"},
             "rows": [{"label": "dense", "set": "cut", "class": "cut positives", "n": 900, "follow": 0.25, "flip": 0.3},
                      {"label": "dense", "set": "balanced", "class": "all", "n": 3000, "acc": 0.52}]}
    monkeypatch.setattr(headline, "_read_json", lambda rel: table if rel == "X/cue_tests.json" else real(rel))
    run = "experiments/studies/pathfinder-release/results/dense-bip"
    cut = headline._from_cue_tests("X", "dense", "cut", "cut positives", run, "pathfinder32", "cut-positives")
    assert (cut["test_acc"], cut["n_test"], cut["commit"], cut["date"], cut["run"]) == (0.25, 900, "1234567", "2026-12-01", "dense-bip")
    bal = headline._from_cue_tests("X", "dense", "balanced", "all", run, "pathfinder32", "balanced")
    assert bal["test_acc"] == 0.52 and bal["source"] == "X/cue_tests.json#dense/balanced/all"
    with pytest.raises(LookupError, match="no row"):
        headline._from_cue_tests("X", "butterfly", "cut", "cut positives", run, "pathfinder32", "cut-positives")


def test_attended_length_and_effective_density(rows):
    """Each row's attended tokens and the pattern's density over them (the top-left corner the packed
    encoder runs): the full grid's density when every position is attended, more over fewer tokens;
    empty only where nothing records the attended length (black-as-padding Pathfinder-32)."""
    model = {"pattern": "butterfly", "seq_len": 16384, "block_size": 128, "pattern_kwargs": {}}
    assert headline.effective_density(model, 16384) == pytest.approx(0.0625)
    assert headline.effective_density(model, 128) == 1.0  # one block: the diagonal is kept
    assert headline.effective_density(dict(model, pattern=None), 2000) == 1.0
    for r in rows:
        if r["attended_tokens"] is None:
            assert r["effective_density"] is None
            assert r["task"] == "pathfinder32" and r["run"] != "faithful-dense", r["run"]
            continue
        assert r["density"] <= r["effective_density"] <= 1
        assert r["effective_density"] == 1 if r["pattern"] == "dense" else r["effective_density"] > r["density"]
    p256 = next(r for r in rows if r["task"] == "path256" and r["eval_set"] == "release-val")
    assert p256["attended_tokens"] == 2451.2 and 0.24 <= p256["effective_density"] <= 0.26
    assert "0.25 of the blocks over its ~2.45K attended tokens" in headline.render_table(rows)
    bfly = next(r for r in rows if r["run"] == "cont-bfly-1-full" and r["eval_set"] == "release-val")
    assert "a dense curriculum model continued 14,758 steps with butterfly 0.0625" in headline.render_table(rows)
    assert bfly["effective_density"] == pytest.approx(headline.effective_density(model, bfly["attended_tokens"]), abs=1e-4)


def test_listops_rows_say_their_attended_length(rows):
    """Every ListOps row carries the mean length of its test split (test_lengths.json) and the pattern's
    corner at that mean, the same quantities as the other rows; the table and the README say them."""
    rec = headline.listops_lengths()
    assert rec is not None, f"{headline.LISTOPS_LENGTHS} is missing: run {headline.LISTOPS_COMMAND}"
    lo = [r for r in rows if r["task"] == "listops"]
    assert len(lo) == 4
    for r in lo:
        assert r["attended_tokens"] == round(rec["mean"], 1), r["run"]
        model = headline._read_json(f"{headline._LO}/runs/{r['run']}/config.json")["model"]
        assert r["effective_density"] == round(headline.effective_density(model, rec["mean"]), 4)
        assert r["effective_density"] == 1 if r["pattern"] == "dense" else r["density"] < r["effective_density"] < 1
    assert [r["effective_density"] for r in lo] == [1, 0.6543, 0.4074, 0.2099]  # 9 of 16 blocks at ~1034 tokens
    assert "~1.03K tokens on average: there butterfly 0.5 / 0.25 / 0.125 keep 0.65 / 0.41 / 0.21 of the blocks" \
        in headline.render_table(rows)
    assert "down to 1/8 of the blocks (0.21 over its ~1.03K attended tokens)" in headline.render_readme(rows)
    # the docstring's contrast: the mean over examples of each one's own corner
    model = headline._read_json(f"{headline._LO}/runs/butterfly-d0.125-s0/config.json")["model"]
    per_example = {}
    for n in rec["lengths"]:
        per_example.setdefault(math.ceil(n / 128), headline.effective_density(model, n))
    mean = sum(per_example[math.ceil(n / 128)] for n in rec["lengths"]) / len(rec["lengths"])
    assert f"{mean:.2f}" == "0.25" and "0.70 / 0.45 / 0.25 against 0.65 / 0.41 / 0.21" in headline.__doc__


def test_listops_lengths_record_is_whole_and_checked():
    """test_lengths.json: the sweep's generator arguments, 2,000 lengths whose summary it states, and
    checks against the files the runs and the generation log left, every one equal and recomputable."""
    rec = headline.listops_lengths()
    lengths = rec["lengths"]
    assert rec["generator"] == headline.LISTOPS_DATA and rec["split"] == "test" and rec["command"] == headline.LISTOPS_COMMAND
    assert rec["count"] == len(lengths) == 2000 and rec["stream"]["examples"] == 100000
    assert rec["mean"] == pytest.approx(sum(lengths) / 2000) and (rec["min"], rec["max"]) == (min(lengths), max(lengths))
    assert 500 < rec["min"] and rec["max"] < 2000
    assert sum(rec["histogram"].values()) == 2000
    assert all(n == sum(int(k) <= x < int(k) + rec["bin_width"] for x in lengths) for k, n in rec["histogram"].items())
    assert len(rec["checks"]) == 15 and all(c["equal"] for c in rec["checks"].values()), rec["checks"]
    assert headline.listops_checks(rec) == rec["checks"]


def test_record_listops_lengths_writes_the_record(tmp_path, monkeypatch):
    """The command on a tiny set: the file is written with its lengths, and checks against the sweep's
    files that do not hold (another size) make it fail instead of rebuilding the table."""
    small = dict(headline.LISTOPS_DATA, train=100, val=20, test=30, seed=4)
    out = tmp_path / "test_lengths.json"
    monkeypatch.setattr(headline, "LISTOPS_DATA", small)
    monkeypatch.setattr(headline, "LISTOPS_LENGTHS", str(out))
    assert headline.main(["--record-listops-lengths"]) == 1
    rec = headline.listops_lengths()
    assert rec["generator"] == small and rec["count"] == len(rec["lengths"]) == 30
    assert not rec["checks"]["dense-d1-s0: test count"]["equal"]
    assert not rec["checks"]["log: label counts"]["equal"]
