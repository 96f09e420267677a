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
