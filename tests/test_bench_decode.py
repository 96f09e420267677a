"""experiments/bench/decode.py on CPU (--quick: tiny sizes, the kernel under the interpreter): it
writes decode.csv / .json / .png and deterministic.csv with a row per provider and point, every
provider's output close to the float32 reference, an eager time per call in every row, and prints the
table, then ours beside SDPA's per dense point."""

from __future__ import annotations

import csv

import pytest
import torch

from sparseflash.experiments.bench import decode


def test_decode_bench_quick(tmp_path, capsys):
    assert decode.main(["--out", str(tmp_path), "--quick"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "decode.csv")))
    # dense: sparseflash and sdpa; sparse: sparseflash (and flex on a GPU: its compile) at 2 batches x 1 length
    want = {("dense", "sparseflash"), ("dense", "sdpa"), ("sparse", "sparseflash")}
    cuda = torch.cuda.is_available()
    if cuda:
        want |= {("dense", "flex"), ("sparse", "flex")}
    assert {(r["mode"], r["provider"]) for r in rows} == want
    assert len(rows) == 2 * len(want) and all(r["status"] == "ok" for r in rows), [r["status"] for r in rows]
    assert all(float(r["max_err"]) < (2e-3 if cuda else 1e-4) for r in rows)  # float16 on a GPU, float32 here
    sparse = [r for r in rows if r["mode"] == "sparse"]
    assert all(abs(float(r["density"]) - 0.5) < 0.01 or float(r["density"]) <= 0.25 for r in sparse)
    assert all(int(r["bytes_read"]) < int(d["bytes_read"]) for r in sparse for d in rows
               if d["mode"] == "dense" and (d["batch"], d["cache_len"]) == (r["batch"], r["cache_len"]))
    assert (tmp_path / "decode.png").stat().st_size > 0
    det = list(csv.DictReader(open(tmp_path / "deterministic.csv")))
    assert [r["deterministic"] for r in det] == ["False", "True"] and all(float(r["fwd_bwd_ms"]) > 0 for r in det)
    assert all(float(r["eager_ms"]) > 0 for r in rows)
    printed = capsys.readouterr().out.strip().splitlines()
    n, pairs = len(rows), 2  # dense points with ours and SDPA: B1 and B2 at one length
    head = len(printed) - pairs - 1 - n - 1
    assert printed[head].startswith("mode") and all(line.split()[0] in ("dense", "sparse")
                                                    for line in printed[head + 1:head + 1 + n])
    assert "eager goal" in printed[-pairs - 1]
    for line, b in zip(printed[-pairs:], (1, 2)):
        ours = next(r for r in rows if (r["mode"], r["provider"], r["batch"]) == ("dense", "sparseflash", str(b)))
        sdpa = next(r for r in rows if (r["mode"], r["provider"], r["batch"]) == ("dense", "sdpa", str(b)))
        cells = line.split()
        assert cells[:3] == [str(b), "256", "sparseflash"]
        assert float(cells[5]) == pytest.approx(float(ours["eager_ms"]) / float(sdpa["eager_ms"]), abs=0.006)


def test_decode_bench_measures_study_switches_beside_the_default(tmp_path, capsys):
    """``sparseflash-NAME`` providers: the call with the decode switches of NAME set (decode_host.VARIANTS:
    ``old`` the default before fdc55a7's H200 measurement, ``fused`` the study switch fused_combine on), a
    row beside the default's at each point, marked whether its output is the default's bit for bit (here
    both are: at these sizes the balanced split count is the old one, and the launch switches keep the
    order); OVERRIDES empty again after; an unknown NAME is refused before anything runs."""
    from sparseflash.experiments.studies.decode_host import VARIANTS
    from sparseflash.flash import decode as kernel

    assert VARIANTS["old"] == dict(balanced_splits=False, check_in_split=False)
    assert set(VARIANTS["old"]) | set(VARIANTS["fused"]) == set(kernel.SWITCH_DEFAULTS)
    assert all(kernel.SWITCH_DEFAULTS[k] != v for over in VARIANTS.values() for k, v in over.items())  # (each changes)
    assert decode.main(["--out", str(tmp_path), "--quick", "--no-deterministic-check", "--cache-lens", "256",
                        "--providers", "sparseflash,sparseflash-old,sparseflash-fused,sdpa"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "decode.csv")))
    for name in ("sparseflash-old", "sparseflash-fused"):
        var = [r for r in rows if r["provider"] == name]
        assert len(var) == 4 and all(r["status"] == "ok" and r["bitwise_default"] == "True" for r in var), name
    assert all(r["bitwise_default"] == "" for r in rows if r["provider"] in ("sparseflash", "sdpa"))
    assert kernel.OVERRIDES == {}
    assert "sparseflash-fused" in capsys.readouterr().out.splitlines()[-1]
    with pytest.raises(SystemExit):
        decode.main(["--out", str(tmp_path), "--quick", "--providers", "sparseflash-bogus"])
