"""BENCHMARKS.md is generated: it must equal what `python -m sparseflash.experiments.bench.report`
writes from experiments/results/ and experiments/bench/BENCHMARKS.template.md. CPU only, reads
files (well under a second)."""

import re

import pytest

from sparseflash.experiments.bench import report


def test_benchmarks_md_is_what_the_report_command_writes():
    text = report.render()
    current = report.OUTPUT.read_text()
    if current != text:
        diff = [f"line {i + 1}: {a!r} != {b!r}" for i, (a, b) in enumerate(zip(current.splitlines(), text.splitlines()))
                if a != b][:5]
        pytest.fail("BENCHMARKS.md differs from the tables: run python -m sparseflash.experiments.bench.report\n"
                    + "\n".join(diff))


def test_benchmarks_md_is_at_most_200_lines():
    assert report.render().count("\n") <= 200


def test_template_holds_placeholders_not_measurements():
    """Numbers come from the tables: the template's prose (outside code spans and links) has no
    times, ratios, percentages, decimals or counts typed in; head dims and lengths are labels."""
    prose = re.sub(r"`[^`]*`|\{\{[a-z0-9_]+\}\}|\]\([^)]*\)", "", report.TEMPLATE.read_text())
    typed = re.findall(r"\d+(?:\.\d+)?\s*(?:×|ms\b|%|µs)|\d+\.\d+|\b\d+ of \d+", prose)
    assert not typed, f"numbers typed into the template: {typed}"


def test_a_missing_placeholder_is_an_error():
    with pytest.raises(KeyError, match="no_such_value"):
        report.render("{{no_such_value}}")


def test_check_flag_reports_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "BENCHMARKS.md"
    stale.write_text("old\n")
    assert report.main(["--check", "--out", str(stale)]) == 1
    assert report.main(["--out", str(stale)]) == 0
    assert report.main(["--check", "--out", str(stale)]) == 0


def _restamp(folder, stem, **meta):
    """A results folder's run as if measured again: its JSON meta and its rows get ``meta``'s
    values (device_name, commit, kernels, command), the CSV too."""
    import csv
    import json

    doc = json.loads((folder / f"{stem}.json").read_text())
    doc["meta"].update(meta)
    for row in doc["rows"]:
        row.update({k: v for k, v in meta.items() if k in row})
    (folder / f"{stem}.json").write_text(json.dumps(doc))
    with open(folder / f"{stem}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(folder / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({**r, **{k: v for k, v in meta.items() if k in r}} for r in rows)


def test_todays_results_drop_in(tmp_path):
    """The re-measured folders (experiments/bench/remeasure.sh: kernel-check, sparsity, seqlen and
    seqlen's GPU time, on the Hopper kernels of an H200) render without touching the template: the
    first tables name the Hopper kernels and the H200, the kernel check's smaller density list is
    printed with its command, seqlen's cells read eager / GPU time, and the file stays <= 200 lines."""
    import shutil

    results = tmp_path / "results"
    shutil.copytree(report.ROOT / report.RES, results)
    new = dict(device_name="NVIDIA H200", commit="abc1234", kernels="hopper")
    kc = results / "kernel-check"
    command = report._json(f"{report.RES}/kernel-check/sparsity.json")["meta"]["command"]
    _restamp(kc, "sparsity", **new, command=command.replace("--densities 1 0.5 0.25 0.1", "--densities 1 0.1"))
    _restamp(results / "sparsity", "sparsity", **new)
    _restamp(results / "seqlen", "seqlen", **new)
    if not (results / "seqlen" / "gpu-time").is_dir():  # (a GPU-time run of its own when it was measured)
        shutil.copytree(results / "seqlen", results / "seqlen" / "gpu-time")
    _restamp(results / "seqlen" / "gpu-time", "seqlen", **new)

    text = report.render(results=results)
    dense = text[text.index("## Dense attention"):text.index("## Block-sparse attention")]
    assert "--preset kernel-check --densities 1 0.1 --cuda-graph" in dense
    assert "the Hopper kernels on sm_90, the default path there; H200, commit abc1234" in dense
    assert "The Hopper kernels on sm_90 are " in dense and "portable" not in dense
    sweep = text[text.index("The eager density sweep"):text.index("## Hopper kernels")]
    assert "the Hopper kernels on sm_90, H200" in sweep
    seqlen = text[text.index("## Sequence length"):text.index("## Causal attention")]
    assert "eager / GPU time (`experiments/results/seqlen/gpu-time/`" in seqlen
    assert re.search(r"\| sparseflash butterfly \| [0-9.]+ / [0-9.]+ \|", seqlen)
    assert "NVIDIA H100 80GB HBM3 or one NVIDIA H200" in text  # the sections not re-measured keep their GPU
    assert text.count("\n") <= 200
    assert report.render() == report.OUTPUT.read_text()  # rendering elsewhere left the module's default alone


def test_results_option_refuses_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="--results must be a folder"):
        report.main(["--results", str(tmp_path / "nothing"), "--out", str(tmp_path / "B.md")])


def test_dynamic_and_decode_sections_take_partial_runs():
    """Runs the benches legitimately write render with "-" where a value is missing: no Flex rows
    (--no-flex), a K not compiled (compiled times empty), a table merged from two commits, a decode
    run without SDPA whose every dense point meets the bandwidth share."""
    rows = report.table(f"{report.RES}/dynamic/dynamic.csv")
    partial = [dict(r) for r in rows if r["provider"] != "flex"]
    for i, r in enumerate(partial):
        if r["provider"] == "per-call":
            r.update(compiled_ms=None, compiled_speedup_vs_flex=None, speedup_vs_flex=float("nan"))
        r["commit"] = "abc1234" if i % 2 else "def5678"
    v = {}
    report.dynamic_section(v, partial)
    assert v["dyn_x_flex"] == v["dyn_x_flex_c"] == v["dyn_graph_x_flex_c"] == "-"
    assert v["dyn_commit"] == "abc1234, def5678" and "| - ; - |" in v["dyn_table"]
    assert v["dyn_n"] == str(2 * len({(r["head_dim"], r["k_blocks"]) for r in partial if r["provider"] == "per-call"}))

    dec = [dict(r) for r in report.table(f"{report.RES}/decode/decode.csv") if r["provider"] == "sparseflash"]
    for r in dec:
        r["gb_per_s"] = r["copy_gb_per_s"]  # every point at the copy rate
    v = {}
    report.decode_section(v, dec, report.table(f"{report.RES}/decode/deterministic.csv"))
    assert v["dec_dense_low"] == "every point" and v["dec_x_sdpa"] == v["dec_flex_x"] == "-"
    assert v["dec_flex_points"] == "0" and v["dec_flex_commits"] == "-"
