"""BENCHMARKS.md from the results tables: one command writes the whole file.

    python -m sparseflash.experiments.bench.report            # rewrite BENCHMARKS.md
    python -m sparseflash.experiments.bench.report --check    # exit 1 when BENCHMARKS.md is stale

The prose lives in `BENCHMARKS.template.md` beside this module; every ``{{name}}`` there is a
value computed here from the tables under experiments/results/ (and the few study tables the
document quotes): a markdown table, a range of ratios, a commit or a date. No number is typed into
the template, so a re-run that replaces a table changes the document the next time this runs, and
`tests/test_benchmarks_md.py` fails until it does.
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from pathlib import Path

__all__ = ["ROOT", "TEMPLATE", "render", "values", "main"]

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = Path(__file__).with_name("BENCHMARKS.template.md")
OUTPUT = ROOT / "BENCHMARKS.md"
RES = "experiments/results"
_PLACEHOLDER = re.compile(r"\{\{([a-z0-9_]+)\}\}")


# ----------------------------------------------------------------------------- loading
_TEXT = {"commit", "date", "param", "search", "note", "status", "torch", "triton", "sparseflash"}


def _value(v: str, key: str = ""):
    if key in _TEXT:
        return v
    if v in ("", None):
        return None
    if v in ("True", "False"):
        return v == "True"
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if re.fullmatch(r"-?\d+", v) else f


_results_dir = ROOT / RES  # where paths under RES are read from (`values`' ``results``)


def _path(path: str) -> Path:
    """A path relative to the repository root; those under experiments/results/ read from the
    results folder being rendered."""
    return _results_dir / path[len(RES) + 1:] if path.startswith(RES + "/") else ROOT / path


def table(path: str) -> list[dict]:
    """Rows of a results CSV (numbers parsed), path relative to the repository root."""
    with open(_path(path), newline="") as f:
        return [{k: _value(v, k) for k, v in r.items()} for r in csv.DictReader(f)]


def _json(path: str):
    return json.loads(_path(path).read_text())


def pick(rows, **want) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in want.items())]


def one(rows, **want) -> dict:
    found = pick(rows, **want)
    if len(found) != 1:
        raise LookupError(f"{len(found)} rows match {want}")
    return found[0]


# ----------------------------------------------------------------------------- formatting
def ms3(x: float) -> str:
    """Milliseconds as the tables print them: 3 decimals below 10, 4 significant digits above."""
    return f"{x:.3f}" if x < 10 else f"{x:.4g}"


def tf(x: float) -> str:
    return f"{x:.0f}"


def span(xs, fmt="{:.2f}", sep="–") -> str:
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def pct_span(xs) -> str:
    return span([100 * x for x in xs], "{:.0f}") + "%"


def short(commit: str) -> str:
    return str(commit)[:7]


def day(date: str) -> str:
    return str(date)[:10]


def md_table(header, lines) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(map(str, line)) + " |" for line in lines])


def _stamp(rows, what="commit") -> str:
    vals = sorted({short(r[what]) if what == "commit" else r[what] for r in rows})
    if len(vals) != 1:
        raise ValueError(f"expected one {what}, got {vals}")
    return vals[0]


def kernels(folder: str, stem: str) -> str:
    """Which of our kernels a bench run measured, in words: the run's meta "kernels" (written by
    `runner.default_kernels` since 2026-11-28: "hopper" or "portable (why)"). Runs written before
    that field ran the portable kernels: the Hopper kernels were not yet the default path."""
    family = _json(f"{folder}/{stem}.json")["meta"].get("kernels", "portable")
    return "the Hopper kernels on sm_90" if family == "hopper" else "the portable kernels"


def preset_options(folder: str, stem: str, preset: str = "kernel-check") -> str:
    """The options a preset run was given beyond ``--preset``, as BENCHMARKS.md prints its command:
    " --densities ..." when its densities differ from the preset's (read from the run's command)."""
    from sparseflash.experiments.bench.config import PRESETS

    found = re.search(r"--densities ((?:[0-9][0-9.e/-]* ?)+)", _json(f"{folder}/{stem}.json")["meta"]["command"])
    if found is None:
        return ""
    ran = tuple(float(x) for x in found.group(1).split())
    return "" if ran == tuple(PRESETS[preset]["targets"]) else " --densities " + " ".join(f"{x:g}" for x in ran)


def gpu(rows) -> str:
    return _stamp(rows, "device_name").replace("NVIDIA ", "")


# ----------------------------------------------------------------------------- the sparsity-bench tables
SHAPES = [(4096, 64), (4096, 128), (16384, 64), (16384, 128)]
MODES = ("fwd", "fwdbwd")


def _dense(rows, provider, n, d, mode):
    """A dense time: the provider's dense row, or Flex's all-on block mask (density 1; the faster of
    the run's two all-on masks, random and butterfly)."""
    if provider == "flex":
        return min(pick(rows, provider="flex", seq_len=n, head_dim=d, mode=mode, rel_density=1.0), key=lambda r: r["ms"])
    return one(rows, provider=provider, seq_len=n, head_dim=d, mode=mode)


def _sparsest(rows, provider, pattern, n, d, mode):
    cand = pick(rows, provider=provider, pattern=pattern, seq_len=n, head_dim=d, mode=mode)
    return min(cand, key=lambda r: r["rel_density"])


def _cell(r, bold=False, fmt=ms3):
    text = f"{fmt(r['ms'])}"
    return f"**{text}** ({tf(r['tflops'])})" if bold else f"{text} ({tf(r['tflops'])})"


def dense_section(v: dict, rows, key: str, shapes=SHAPES, fmt=ms3) -> None:
    """The dense table of a kernel-check style run and its ratios against FA2, cuDNN and Flex."""
    provs = ["sparseflash-dense", "sdpa-flash", "sdpa-cudnn", "flex"]
    fa4 = bool(pick(rows, provider="fa4-dense"))  # runs with FlashAttention-4 (a Hopper run of the preset)
    if fa4:
        provs.append("fa4-dense")
    lines = []
    for n, d in shapes:
        line = [n, d]
        for p in provs:
            cells = [_cell(_dense(rows, p, n, d, m), bold=(p == "sparseflash-dense" and key == "kc"), fmt=fmt)
                     for m in MODES]
            line.append(" ; ".join(cells))
        lines.append(line)
    v[f"{key}_dense_table"] = md_table(
        ["N", "d", "sparseflash", "SDPA flash (FA2)", "SDPA cuDNN", "FlexAttention"] + (["FlashAttention-4"] if fa4 else []),
        lines)
    ratio = lambda other: [_dense(rows, other, n, d, m)["ms"] / _dense(rows, "sparseflash-dense", n, d, m)["ms"]
                           for n, d in shapes for m in MODES]
    v[f"{key}_x_fa2"] = span(ratio("sdpa-flash"))
    v[f"{key}_x_flex"] = span(ratio("flex"))
    v[f"{key}_x_cudnn"] = span(ratio("sdpa-cudnn"))
    v[f"{key}_fa4"] = ""
    if fa4:  # FA4's time / ours: our speed relative to FA4, forward and fwd+bwd apart (the gap is the backward)
        per_mode = {m: [_dense(rows, "fa4-dense", n, d, m)["ms"] / _dense(rows, "sparseflash-dense", n, d, m)["ms"]
                        for n, d in shapes] for m in MODES}
        v[f"{key}_fa4"] = (f" Against FlashAttention-4 (its time / ours: above 1 is faster than FA4): forward "
                           f"{span(per_mode['fwd'])}×, forward + backward {span(per_mode['fwdbwd'])}×.")
    v[f"{key}_commit"] = _stamp(rows)
    v[f"{key}_date"] = day(_stamp(rows, "date"))
    v[f"{key}_max_err"] = re.sub(r"e-0(\d)", r"e-\1", f"{max(r['max_err'] for r in rows if r.get('max_err') is not None):.1e}")


def sparse_section(v: dict, rows, block: int) -> None:
    fa4 = bool(pick(rows, provider="fa4"))
    lines, keep4, keep16 = [], [], []
    blocks = {4096: set(), 16384: set()}
    for n, d in SHAPES:
        line = [n, d]
        less = {m: [] for m in MODES}
        vs_fa4 = {m: [] for m in MODES}  # FA4's time / ours on the same block lists
        for pat in ("random", "butterfly"):
            cells = []
            for m in MODES:
                r = _sparsest(rows, "sparseflash", pat, n, d, m)
                base = _dense(rows, "sparseflash-dense", n, d, m)
                keep = r["tflops"] / base["tflops"]
                (keep4 if n == 4096 else keep16).append(keep)
                cells.append(f"{ms3(r['ms'])} ({tf(r['tflops'])}, {100 * keep:.0f}%)")
                fx = _sparsest(rows, "flex", pat, n, d, m)
                assert fx["rel_density"] == r["rel_density"]
                less[m].append(f"{100 * (1 - r['ms'] / fx['ms']):.0f}%")
                if fa4:
                    f4 = _sparsest(rows, "fa4", pat, n, d, m)
                    assert f4["rel_density"] == r["rel_density"]
                    vs_fa4[m].append(f"{f4['ms'] / r['ms']:.2f}")
                blocks[n].add(round(r["rel_density"] * n / block))
            line.append(" ; ".join(cells))
        line.append(" ; ".join(" / ".join(less[m]) for m in MODES))
        if fa4:
            line.append(" ; ".join(" / ".join(vs_fa4[m]) for m in MODES))
        lines.append(line)
    v["kc_sparse_table"] = md_table(["N", "d", "random", "butterfly", "less than Flex (random / butterfly)"]
                                    + (["× FA4's speed (random / butterfly)"] if fa4 else []), lines)
    v["kc_keep_16k"] = pct_span(keep16)
    v["kc_keep_4k"] = pct_span(keep4)
    v["kc_blocks_4k"] = span(blocks[4096], "{}")
    v["kc_blocks_16k"] = span(blocks[16384], "{}")
    v["kc_row_4k"], v["kc_row_16k"] = str(4096 // block), str(16384 // block)
    dens = {r["rel_density"] for n, d in SHAPES for p in ("random", "butterfly")
            for r in [_sparsest(rows, "sparseflash", p, n, d, "fwd")]}
    v["kc_density"] = f"{sum(dens) / len(dens):.1f}"


def eager_dense(v: dict, rows) -> None:
    """Dense points of the eager sweep against SDPA's FlashAttention-2."""
    ratios = [one(rows, provider="sdpa-flash", seq_len=n, head_dim=d, mode=m)["ms"]
              / one(rows, provider="sparseflash-dense", seq_len=n, head_dim=d, mode=m)["ms"]
              for n, d in SHAPES for m in MODES]
    v["eager_x_fa2"] = span(ratios)
    v["eager_commit"], v["eager_gpu"] = _stamp(rows), gpu(rows)
    v["eager_kernels"] = kernels(f"{RES}/sparsity", "sparsity")


PROPORTIONAL_SLACK = 1.6  # "falls in proportion to density": time within this factor of dense time x density


def eager_sweep(v: dict, rows) -> None:
    """How far down the eager density sweep the forward's time stays proportional to density: the
    lowest density of the random and butterfly grids down to which it holds at every density (every
    head dim), per sequence length."""
    def lowest(n):
        found = []
        for pat in ("random", "butterfly"):
            pts = sorted(pick(rows, provider="sparseflash", pattern=pat, seq_len=n, mode="fwd", status="ok"),
                         key=lambda r: -r["rel_density"])
            held = 1.0
            for dens in sorted({r["rel_density"] for r in pts}, reverse=True):
                if not all(r["ms"] <= PROPORTIONAL_SLACK * r["rel_density"]
                           * one(rows, provider="sparseflash-dense", seq_len=n, head_dim=r["head_dim"], mode="fwd")["ms"]
                           for r in pts if r["rel_density"] == dens):
                    break
                held = dens
            found.append(held)
        return f"1/{round(1 / max(found))}"
    v["sweep_low_16k"], v["sweep_low_4k"] = lowest(16384), lowest(4096)
    v["sweep_slack"] = f"{PROPORTIONAL_SLACK:g}"
    from sparseflash.flash.tiles import TMA_MIN_WORK

    v["tma_min_work"] = f"{TMA_MIN_WORK:.0e}".replace("e+", "e")


def h200_training(v: dict, rows) -> None:
    """Today's H200 16K run (random and butterfly at density ~0.1, d 64 and 128): fwd+bwd against
    Flex on the same mask, against the ideal (density x our dense fwd+bwd), dense against cuDNN."""
    x_flex, x_ideal, x_cudnn = [], [], []
    for d in (64, 128):
        dense = one(rows, provider="sparseflash-dense", seq_len=16384, head_dim=d, mode="fwdbwd")["ms"]
        x_cudnn.append(one(rows, provider="sdpa-cudnn", seq_len=16384, head_dim=d, mode="fwdbwd")["ms"] / dense)
        for pat in ("random", "butterfly"):
            ours = _sparsest(rows, "sparseflash", pat, 16384, d, "fwdbwd")
            x_flex.append(_sparsest(rows, "flex", pat, 16384, d, "fwdbwd")["ms"] / ours["ms"])
            x_ideal.append(ours["ms"] / (ours["rel_density"] * dense))
    v["h2_fb_x_flex"], v["h2_x_ideal"], v["h2_fb_x_cudnn"] = span(x_flex), span(x_ideal), span(x_cudnn)
    v["h2_density"] = span([r["rel_density"] for r in pick(rows, provider="sparseflash", seq_len=16384, mode="fwdbwd")
                            if r["rel_density"] < 0.5])
    v["h2_commit"], v["h2_date"] = _stamp(rows), day(_stamp(rows, "date"))


def decode_section(v: dict, rows, det_rows) -> None:
    """`flash_attn_with_kvcache` decoding (bench.decode): the cache read rate of ours and Flex's; and
    (its --deterministic-check) deterministic=True's fwd+bwd time against the default's."""
    det = {r["deterministic"]: r for r in det_rows}
    v["dec_det_x"] = _span_or_dash([_ratio(det.get(True, {}).get("fwd_bwd_ms"), det.get(False, {}).get("fwd_bwd_ms"))])
    v["dec_det_commit"] = _stamps(det_rows) or "-"
    ok = [r for r in rows if r["status"] == "ok"]
    ours = [r for r in ok if r["provider"] == "sparseflash"]
    dense = [r for r in ours if r["mode"] == "dense"]
    at = lambda r: (r["mode"], r["batch"], r["cache_len"])  # noqa: E731
    v["dec_dense_tbs"] = _span_or_dash([r["gb_per_s"] / 1e3 for r in dense], "{:.1f}")
    v["dec_sparse_tbs"] = _span_or_dash([r["gb_per_s"] / 1e3 for r in ours if r["mode"] == "sparse"], "{:.2f}")
    flex = {at(r): r["ms"] for r in ok if r["provider"] == "flex"}
    x = [flex[at(r)] / r["ms"] for r in ours if at(r) in flex]  # Flex's time / ours
    v["dec_flex_x"] = _span_or_dash(x)
    v["dec_flex_points"], v["dec_points"] = str(len(x)), str(len(ours))
    v["dec_commit"], v["dec_date"] = _stamps(ours), _stamps(ours, "date")
    v["dec_gpu"] = ", ".join(sorted({str(r["device_name"]).replace("NVIDIA ", "") for r in ours}))
    v["dec_flex_commits"] = _stamps([r for r in rows if r["provider"] == "flex"]) or "-"
    low = [r for r in dense if r["gb_per_s"] < DECODE_BANDWIDTH_GOAL * r["copy_gb_per_s"]]
    sdpa = {at(r): r for r in ok if r["provider"] == "sdpa"}
    v["dec_bw_goal"] = f"{DECODE_BANDWIDTH_GOAL:.0%}"
    v["dec_dense_80"] = f"{len(dense) - len(low)} of {len(dense)}"
    if not low:
        v["dec_dense_low"] = "every point"
    else:
        sdpa_low = [r for r in low if at(r) in sdpa
                    and sdpa[at(r)]["gb_per_s"] < DECODE_BANDWIDTH_GOAL * r["copy_gb_per_s"]]
        v["dec_dense_low"] = (
            "not " + ", ".join(f"B{r['batch']} x {r['cache_len'] // 1024}K" for r in low)
            + f": calls under {math.ceil(max(r['ms'] for r in low) * 1e3)} µs, where SDPA misses it at "
            + f"{len(sdpa_low)} of {len(low)} too")
    v["dec_copy_tbs"] = _span_or_dash([r["copy_gb_per_s"] / 1e3 for r in dense])
    v["dec_x_sdpa"] = _span_or_dash([r["ms"] / sdpa[at(r)]["ms"] for r in dense if at(r) in sdpa])
    # the eager step (wall time of a call, host included) beside SDPA's at the goal's points
    v["dec_eager_goal"] = f"{DECODE_EAGER_GOAL}×"
    eager = [(r, _ratio(r.get("eager_ms"), sdpa[at(r)].get("eager_ms"))) for r in dense
             if at(r) in sdpa and r["batch"] in (1, 16) and r["cache_len"] == 16384]
    v["dec_eager"] = "; ".join(
        f"B{r['batch']} x 16K {_num(r['eager_ms']) * 1e3:.0f} µs, {x:.2f}×" for r, x in eager if x is not None) or "not measured"


DYNAMIC_FLEX_GOAL = 2.0  # per-call masks: the speed against Flex with its mask built per call that we aim at
DECODE_BANDWIDTH_GOAL = 0.8  # decoding: the share of the copy bandwidth that we aim at
DECODE_EAGER_GOAL = 1.2  # decoding: an eager step's wall time, at most this many times SDPA's (B1 and B16 x 16K)


def _num(x) -> float | None:
    """A measured value, or None where the row has none (missing, None or NaN)."""
    return None if x is None or x == "" or x != x else float(x)


def _cell3(x) -> str:
    return "-" if _num(x) is None else ms3(x)


def _ratio(a, b) -> float | None:
    a, b = _num(a), _num(b)
    return None if a is None or b is None or b == 0 else a / b


def _span_or_dash(xs, fmt="{:.2f}") -> str:
    xs = [x for x in xs if _num(x) is not None]
    return span(xs, fmt) if xs else "-"


def _stamps(rows, what="commit") -> str:
    """One commit (or date), or several joined: a table merged from runs."""
    vals = sorted({short(r[what]) if what == "commit" else day(r[what]) for r in rows})
    return ", ".join(vals)


def dynamic_section(v: dict, rows) -> None:
    """Per-call top-k masks (bench.dynamic): a row per (head_dim, K) with the selection, the index
    build, per-call forward and fwd+bwd (kernels' GPU time / CUDA-graph replay / eager, against the
    goal: selection + 1.1x the fixed mask's GPU time) and the speed against Flex built per call
    (Flex's time / ours; "-" where a run has no value: --no-flex, a Ks not compiled, a CPU run)."""
    pairs = sorted({(r["head_dim"], r["k_blocks"]) for r in rows if r["provider"] == "per-call"},
                   key=lambda p: (-p[0], p[1]))
    lines, eager_met, graph_met, x_eager, x_comp, x_graph_comp, index_us = [], 0, 0, [], [], [], []
    n = 0
    for d, k in pairs:
        sub = [r for r in rows if (r["head_dim"], r["k_blocks"]) == (d, k)]

        def get(provider, mode="fwd"):
            found = pick(sub, provider=provider, mode=mode)
            return found[0] if found else {}
        index_us.append(_num(get("index").get("gpu_ms")))
        cells = [str(d), str(k), _cell3(get("select").get("gpu_ms")),
                 "-" if index_us[-1] is None else f"{index_us[-1] * 1e3:.0f}"]
        pair_eager, pair_comp = [], []
        for mode in ("fwd", "fwdbwd"):
            pc, flex = get("per-call", mode), get("flex", mode)
            if not pc:
                cells.append("-")
                continue
            n += 1
            goal = _num(pc.get("goal_ms"))
            met = goal is not None and _num(pc.get("ms")) is not None and pc["ms"] <= goal
            eager_met += met
            graph_met += goal is not None and _num(pc.get("graph_ms")) is not None and pc["graph_ms"] <= goal
            pair_eager.append(_num(pc.get("speedup_vs_flex")))
            pair_comp.append(_num(pc.get("compiled_speedup_vs_flex")))
            x_graph_comp.append(_ratio(flex.get("compiled_ms"), pc.get("graph_ms")))
            cells.append(f"{_cell3(pc.get('gpu_ms'))} / {_cell3(pc.get('graph_ms'))} / {'**' * met}"
                         f"{_cell3(pc.get('ms'))}{'**' * met} / {_cell3(goal)}")
        x_eager += pair_eager
        x_comp += pair_comp
        cells += [" ; ".join("-" if x is None else f"{x:.2f}" for x in xs) for xs in (pair_eager, pair_comp)]
        lines.append(cells)
    v["dyn_table"] = md_table(["d", "K", "select", "index µs", "forward: GPU / graph / eager / goal",
                               "fwd+bwd: GPU / graph / eager / goal", "× Flex's speed, eager (fwd ; fwd+bwd)",
                               "× Flex's speed, compiled"], lines)
    sync = [r for r in rows if r["provider"] == "sync-check"]
    v["dyn_sync"] = ("host syncs not checked" if not sync else
                     "no host sync in any (selection, index, attention) step" if all(r["status"] == "ok" for r in sync)
                     else "a host sync: " + "; ".join(r["status"] for r in sync if r["status"] != "ok"))
    v["dyn_graph_met"], v["dyn_eager_met"], v["dyn_n"] = str(graph_met), str(eager_met), str(n)
    v["dyn_index_us"] = _span_or_dash([x * 1e3 for x in index_us if x is not None], "{:.0f}")
    v["dyn_x_flex"], v["dyn_x_flex_c"] = _span_or_dash(x_eager), _span_or_dash(x_comp)
    v["dyn_graph_x_flex_c"] = _span_or_dash(x_graph_comp)
    factors = []
    for d, k in pairs:
        pc, sel, fixed = (pick(rows, provider=p, mode="fwd", head_dim=d, k_blocks=k) for p in ("per-call", "select", "fixed"))
        if pc and sel and fixed:
            f = _ratio(_num(pc[0].get("goal_ms")) - _num(sel[0].get("gpu_ms")), fixed[0].get("gpu_ms")) \
                if None not in (_num(pc[0].get("goal_ms")), _num(sel[0].get("gpu_ms"))) else None
            factors += [f] if f is not None else []
    v["dyn_goal_factor"] = _span_or_dash(factors, "{:.1f}")
    v["dyn_flex_goal"] = f"{DYNAMIC_FLEX_GOAL:g}"
    v["dyn_commit"], v["dyn_date"] = _stamps(rows), _stamps(rows, "date")
    v["dyn_gpu"] = ", ".join(sorted({str(r["device_name"]).replace("NVIDIA ", "") for r in rows}))


# ----------------------------------------------------------------------------- Hopper
HOPPER_PROVIDERS = ("hopper", "portable", "flex", "sdpa-flash", "sdpa-cudnn")
HOPPER_MASKS = ("dense", "causal", "random", "butterfly", "local")


def hopper_section(v: dict, rows) -> None:
    n, seqs = 16384, sorted({r["seq"] for r in rows})
    g = lambda nn, d, mask, p, m: next((r for r in rows if (r["seq"], r["head_dim"], r["mask"], r["provider"], r["mode"])
                                        == (nn, d, mask, p, m) and r.get("ms") is not None), None)
    get = lambda d, mask, p, m: g(n, d, mask, p, m)
    def cell(d, mask, p):  # forward ; forward+backward, each with its TFLOP/s
        parts = []
        for m in ("fwd", "fwdbwd"):
            r = get(d, mask, p, m)
            text = "-" if r is None else f"{r['ms']:.3f}"
            parts.append(text if r is None else (f"**{text}**" if p == "hopper" else text) + f" ({tf(r['tflops'])})")
        return " ; ".join(parts) if any(x != "-" for x in parts) else "-"

    lines = [[n, d, mask, *(cell(d, mask, p) for p in HOPPER_PROVIDERS)]
             for d in (64, 128) for mask in HOPPER_MASKS
             if d == 128 or mask in ("dense", "causal")]  # (d=64 block-sparse rows are in the JSON)
    v["hopper_table"] = md_table(["N", "d", "mask", "**hopper**", "portable", "FlexAttention", "SDPA flash", "SDPA cuDNN"],
                                 lines)
    def x(other, d, masks, m):  # over both sequence lengths of the run
        return [g(nn, d, k, other, m)["ms"] / g(nn, d, k, "hopper", m)["ms"] for nn in seqs for k in masks]
    v["hop_fwd_cudnn_d128"] = span(x("sdpa-cudnn", 128, ("dense",), "fwd"))
    v["hop_fwd_cudnn_d64"] = span(x("sdpa-cudnn", 64, ("dense",), "fwd"))
    v["hop_fb_cudnn_dense"] = span(x("sdpa-cudnn", 64, ("dense",), "fwdbwd") + x("sdpa-cudnn", 128, ("dense",), "fwdbwd"))
    v["hop_fb_cudnn_causal"] = span(x("sdpa-cudnn", 64, ("causal",), "fwdbwd") + x("sdpa-cudnn", 128, ("causal",), "fwdbwd"))
    v["hop_causal_cudnn"] = f"{get(128, 'causal', 'sdpa-cudnn', 'fwd')['ms'] / get(128, 'causal', 'hopper', 'fwd')['ms']:.2f}"
    sparse = ("random", "butterfly", "local")
    v["hop_fwd_flex_d128"] = span(x("flex", 128, sparse, "fwd"))
    v["hop_fwd_flex_d64"] = span(x("flex", 64, sparse, "fwd"))
    v["hop_fb_flex_rb"] = span(x("flex", 64, ("random", "butterfly"), "fwdbwd") + x("flex", 128, ("random", "butterfly"), "fwdbwd"))
    spread = [max(r["ms_rounds"]) / min(r["ms_rounds"]) - 1 for r in rows
              if isinstance(r.get("ms_rounds"), list) and len(r["ms_rounds"]) > 1 and min(r["ms_rounds"]) > 0]
    spread.sort()
    v["hop_spread_median"] = f"{100 * spread[len(spread) // 2]:.1f}%"
    v["hop_spread_p90"] = f"{100 * spread[int(0.9 * (len(spread) - 1))]:.0f}%"
    v["hop_random_density"] = f"{_stamp(pick(rows, seq=n, mask='random', provider='hopper'), 'density'):.1f}"
    commits = sorted({short(r["commit"]) for r in rows})
    v["hop_commits"] = " and ".join(commits)
    v["hop_date"] = day(min(r["date"] for r in rows))
    v["hop_gpu"] = _stamp(rows, "device_name").replace("NVIDIA ", "").split()[0]


def _hopper_rows() -> list[dict]:
    return _json(f"{RES}/hopper/hopper_fwd.json")["rows"]


# ----------------------------------------------------------------------------- seqlen, causal, head dims
SEQLEN_COLUMNS = (1024, 4096, 16384, 32768, 65536)  # the printed columns; the CSV has 512 to 64K


SEQLEN_GPU_TIME = f"{RES}/seqlen/gpu-time"  # the same sweep with --cuda-graph, when it was run


def seqlen_section(v: dict, rows, gpu_rows=None) -> None:
    """The eager fwd+bwd table against sequence length; with ``gpu_rows`` (the same sweep with
    --cuda-graph) each cell reads "eager / GPU time"."""
    v["seqlen_gpu"], v["seqlen_kernels"] = gpu(rows), kernels(f"{RES}/seqlen", "seqlen")
    rows = pick(rows, mode="fwdbwd", status="ok")
    gpu_rows = pick(gpu_rows, mode="fwdbwd", status="ok") if gpu_rows else []
    lens = [n for n in SEQLEN_COLUMNS if any(r["seq_len"] == n for r in rows)]
    label = lambda n: f"{n // 1024}K"
    order = [("sparseflash-dense", "dense", "sparseflash dense"), ("sdpa-flash", "dense", "SDPA flash"),
             ("sdpa-cudnn", "dense", "SDPA cuDNN"), ("sparseflash", "butterfly", "sparseflash butterfly")]
    lines = []
    for prov, pat, name in order:
        by_n = {r["seq_len"]: r for r in pick(rows, provider=prov, pattern=pat)}
        on_gpu = {r["seq_len"]: r for r in pick(gpu_rows, provider=prov, pattern=pat)}
        cell = lambda n: "-" if n not in by_n else ms3(by_n[n]["ms"]) + (f" / {ms3(on_gpu[n]['ms'])}" if n in on_gpu else "")
        lines.append([name] + [cell(n) for n in lens])
    v["seqlen_table"] = md_table(["provider"] + [label(n) for n in lens], lines)
    v["seqlen_timing"] = "eager" if not gpu_rows else \
        f"eager / GPU time (`{SEQLEN_GPU_TIME}/`, the same sweep with --cuda-graph, {_stamp(gpu_rows)})"
    big = max(lens)
    bf = one(rows, provider="sparseflash", pattern="butterfly", seq_len=big)
    v["seqlen_big"] = label(big)
    v["seqlen_big_density"] = f"{bf['rel_density']:.3f}"
    v["seqlen_x_dense"] = f"{one(rows, provider='sparseflash-dense', seq_len=big)['ms'] / bf['ms']:.0f}"
    v["seqlen_x_cudnn"] = f"{one(rows, provider='sdpa-cudnn', seq_len=big)['ms'] / bf['ms']:.0f}"
    v["seqlen_commit"] = _stamp(rows)


def causal_section(v: dict, rows) -> None:
    big = [s for s in SHAPES if s[0] == 16384]
    dense_section(v, rows, "causal", shapes=big, fmt=lambda x: f"{x:#.3g}")
    # ratios over every shape of the run, not only the 16K rows printed
    r = lambda other: [_dense(rows, other, n, d, m)["ms"] / _dense(rows, "sparseflash-dense", n, d, m)["ms"]
                       for n, d in SHAPES for m in MODES]
    v["causal_x_fa2"], v["causal_x_flex"], v["causal_x_cudnn"] = span(r("sdpa-flash")), span(r("flex")), span(r("sdpa-cudnn"))
    wins = total = 0
    dens = set()
    for n, d in SHAPES:
        for pat in ("random", "butterfly"):
            for m in MODES:
                ours, fx = _sparsest(rows, "sparseflash", pat, n, d, m), _sparsest(rows, "flex", pat, n, d, m)
                total += 1
                wins += ours["ms"] < fx["ms"]
                dens.add(ours["density"])
    v["causal_wins"], v["causal_points"] = str(wins), str(total)
    v["causal_sparse_density"] = f"{sum(dens) / len(dens):.2f}"


def head_dims_section(v: dict) -> None:
    base = f"{RES}/head-dims"
    d32, d40, d256 = (table(f"{base}/d{d}/sparsity.csv") for d in (32, 40, 256))
    v["hd_commit_32"], v["hd_commit_40"], v["hd_commit_256"] = _stamp(d32), _stamp(d40), _stamp(d256)
    shapes = lambda rows: sorted({(r["seq_len"], r["head_dim"]) for r in rows})
    dense_ratio = lambda rows, other: [_dense(rows, other, n, d, m)["ms"] / _dense(rows, "sparseflash-dense", n, d, m)["ms"]
                                       for n, d in shapes(rows) for m in MODES]
    v["hd32_x_cudnn"] = span(dense_ratio(d32, "sdpa-cudnn"))
    v["hd40_tflops"] = span([r["tflops"] for r in pick(d40, provider="sparseflash-dense")], "{:.0f}")
    v["hd256_x_fa2"] = span(dense_ratio(d256, "sdpa-flash"))
    v["hd256_cudnn_faster"] = span([1 / x for x in dense_ratio(d256, "sdpa-cudnn")])
    less = [1 - _sparsest(d256, "sparseflash", p, n, d, m)["ms"] / _sparsest(d256, "flex", p, n, d, m)["ms"]
            for n, d in shapes(d256) for p in ("random", "butterfly") for m in MODES]
    v["hd256_less_than_flex"] = pct_span(less)


# ----------------------------------------------------------------------------- dropout
def dropout_section(v: dict, rows) -> None:
    mine = [r for r in rows if r["provider"] == "sparseflash"]
    for d in (64, 128):
        for m, key in (("fwd", "fwd"), ("fwdbwd", "fb")):
            v[f"do_{key}_d{d}"] = "+" + span([r[f"{m}_overhead_pct"] for r in pick(mine, head_dim=d)], "{:.0f}") + "%"
            for p in ("sdpa-flash", "sdpa-cudnn"):
                v[f"do_{key}_d{d}_{p.split('-')[1]}"] = "+" + span(
                    [r[f"{m}_overhead_pct"] for r in pick(rows, provider=p, head_dim=d)], "{:.0f}") + "%"
    for p in ("sdpa-cudnn",):  # cuDNN over both head dims
        for m, key in (("fwd", "fwd"), ("fwdbwd", "fb")):
            v[f"do_{key}_cudnn"] = "+" + span([r[f"{m}_overhead_pct"] for r in pick(rows, provider=p)], "{:.0f}") + "%"
    for m, key in (("fwd", "fwd"), ("fwdbwd", "fb")):
        x = [one(rows, provider="sdpa-flash", seq_len=n, head_dim=d, mask="dense")[f"{m}_ms_p0.1"]
             / one(rows, provider="sparseflash", seq_len=n, head_dim=d, mask="dense")[f"{m}_ms_p0.1"]
             for n, d in SHAPES]
        v[f"do_{key}_x_fa2"] = span(x)
    v["do_commit"], v["do_date"] = _stamp(rows), day(_stamp(rows, "date"))
    v["do_p"] = f"{_stamp(rows, 'p'):g}"


# ----------------------------------------------------------------------------- short rows (study table)
def short_rows_section(v: dict, kc) -> None:
    fits = _json("experiments/studies/short_rows/results/fixed-cost/fixed_cost.json")["fits"]
    at4k = lambda mode: [f["fixed_blocks"] for f in fits if f["seq_len"] == 4096 and f["mode"] == mode]
    v["sr_fixed_fwd"] = span(at4k("fwd"), "{:.1f}")
    v["sr_fixed_bwd"] = span(at4k("bwd"), "{:.1f}")
    blocks = 3
    v["sr_blocks"] = str(blocks)
    v["sr_keep_ours"] = pct_span([blocks / (blocks + x) for x in at4k("fwd")] + [
        one(kc, provider="sparseflash", pattern="random", seq_len=4096, head_dim=d, mode="fwd", rel_density=blocks / 32)["tflops"]
        / _dense(kc, "sparseflash-dense", 4096, d, "fwd")["tflops"] for d in (64, 128)])
    v["sr_keep_flex"] = pct_span([
        _sparsest(kc, "flex", p, 4096, d, m)["tflops"] / _dense(kc, "flex", 4096, d, m)["tflops"]
        for p in ("random", "butterfly") for d in (64, 128) for m in MODES])


# ----------------------------------------------------------------------------- host cost
def host_section(v: dict) -> None:
    pieces = _json(f"{RES}/host/pieces.json")
    meta, rows = pieces["meta"], {r["piece"]: r for r in pieces["rows"]}
    us = lambda x: f"{x:.1f}" if x < 100 else f"{x:.0f}"
    fmt = lambda r, bold=False: (f"**{us(r['host_us'])}** ({us(r['host_us_min'])})" if bold
                                 else f"{us(r['host_us'])} ({us(r['host_us_min'])})")
    goal_fwd, goal_own = "40", "120"  # the host-cost study's goals (microseconds), not measurements
    fwd = ["ours", "ours python short path", "ours general", "sdpa (dense)", "autograd floor"]
    line_f = ["forward, no grad"] + [fmt(rows[f"fwd no-grad: {k}"], i == 0) for i, k in enumerate(fwd)] + [goal_fwd]
    line_b = ["fwd+bwd (`autograd.grad`)"] + [fmt(rows[f"fwd+bwd: {k}"], i == 0) for i, k in enumerate(fwd)] + ["—"]
    floor = rows["fwd+bwd: autograd floor"]
    own = lambda k: (rows[f"fwd+bwd: {k}"]["host_us"] - floor["host_us"], rows[f"fwd+bwd: {k}"]["host_us_min"] - floor["host_us_min"])
    o1, o2 = own("ours"), own("ours python short path")
    line_o = ["our own part of fwd+bwd (ours − the do-nothing Function)", f"**{o1[0]:.0f}** ({o1[1]:.0f})",
              f"{o2[0]:.0f} ({o2[1]:.0f})", "", "", "", goal_own]
    v["host_pieces_table"] = md_table(["call (d=64)", "ours (native)", "ours, Python short path", "ours, general path",
                                       "SDPA (dense)", "Python autograd Function doing nothing", "goal"],
                                      [line_f, line_b, line_o])
    v["pieces_commit"], v["pieces_gpu"] = short(meta["commit"]), meta["device_name"].replace("NVIDIA ", "").split()[0]
    v["pieces_shape"] = f"B={meta['B']}, H={meta['H']}, {meta['N'] // 1024}K, d={meta['D']}"
    v["pieces_density"] = re.search(r"density ([0-9.]+)", meta["mask"]).group(1)
    h = table(f"{RES}/host/host.csv")
    kern = lambda d, kl, checked, prov="sparseflash": one(
        [r for r in h if r.get("mask") != "dense"], provider=prov, head_dim=d, key_lengths=kl, kl_checked=checked)["eager_over_kernels"]
    v["hk_plain"] = span([kern(64, False, False), kern(128, False, False)])
    v["hk_checked"] = f"{kern(64, True, True):.2f} / {kern(128, True, True):.2f}"
    v["hk_commit"], v["hk_gpu"] = _stamp(h), _stamp(h, "device_name").replace("NVIDIA ", "")
    v["hk_n"] = f"{_stamp(h, 'N') // 1024}K"
    v["hk_goal"] = "1.15"  # the host-cost study's goal for eager / own kernels, not a measurement
    v["hk_density"] = f"{_stamp([r for r in h if r.get('mask') != 'dense'], 'density'):.3f}"


# ----------------------------------------------------------------------------- packed
def packed_section(v: dict) -> None:
    rows = table(f"{RES}/packed/packed.csv")
    ratio = lambda m: [one(rows, provider="sdpa-dense", mean_doc_len=r["mean_doc_len"], head_dim=r["head_dim"])[f"{m}_ms"]
                       / r[f"{m}_ms"] for r in pick(rows, provider="sparseflash-segments")]
    v["pk_x_sdpa_fwd"], v["pk_x_sdpa_fb"] = span(ratio("fwd"), "{:.1f}"), span(ratio("fwdbwd"), "{:.1f}")
    fx = table(f"{RES}/packed/flex-d128/packed.csv")
    ours, flex = one(fx, provider="sparseflash-segments"), one(fx, provider="flex-document")
    less = lambda m: 1 - flex[f"{m}_ms"] / ours[f"{m}_ms"]  # Flex's time saved, paired run
    v["pk_flex_less_fwd"], v["pk_flex_less_fb"] = pct_span([less("fwd")]), pct_span([less("fwdbwd")])
    v["pk_flex_ms"] = f"{flex['fwd_ms']:.2f} / {flex['fwdbwd_ms']:.2f}"
    v["pk_ours_ms"] = f"{ours['fwd_ms']:.2f} / {ours['fwdbwd_ms']:.2f}"
    v["pk_mean_doc"] = f"{int(flex['mean_doc_len'])}"
    v["pk_means"] = " or ".join(str(int(x)) for x in sorted({r["mean_doc_len"] for r in rows}))
    v["pk_commit"], v["pk_date"] = _stamp(rows), day(_stamp(rows, "date"))
    v["pk_rows"] = f"{_stamp(rows, 'batch')} rows of {_stamp(rows, 'seq_len') // 1024}K tokens"


def exact_section(v: dict) -> None:
    """Token-exact masks against the same mask block-level and FlexAttention (GPU time)."""
    rows = pick(table(f"{RES}/exact/exact.csv"), status="ok")
    # what a call with bits runs by default on sm_90: the Hopper forward and backward with bits
    ex = pick(rows, provider="sparseflash-exact-hopper")
    other = lambda r, p: one(rows, provider=p, mask=r["mask"], head_dim=r["head_dim"])
    for m, col in (("fwd", "fwd_gpu_ms"), ("fb", "fwdbwd_gpu_ms")):
        v[f"ex_x_flex_{m}"] = span([other(r, "flex")[col] / r[col] for r in ex])
        v[f"ex_cost_{m}"] = pct_span([r[col] / other(r, "sparseflash-block")[col] - 1 for r in ex])
    v["ex_diff"] = f"{max(r['max_diff_vs_flex'] for r in ex):.3g}"
    v["ex_block_diff"] = span([r["max_diff_vs_flex"] for r in pick(rows, provider="sparseflash-block")], "{:.2g}")
    win = pick(ex, mask="sliding-window")[0]
    v["ex_bits"] = f"{win['bits_mb']:.2f} MB ({int(win['partial_blocks'])} partial blocks, built once in {win['bits_build_ms']:.0f} ms)"
    # flash-attn's interface on the same masks: the window through flash_attn_func, documents through the varlen call
    fa = pick(rows, provider="flash-attn-api")
    for m, col in (("fwd", "fwd_gpu_ms"), ("fb", "fwdbwd_gpu_ms")):
        win = pick(fa, mask="sliding-window")
        v[f"ex_fa_pred_{m}"] = span([other(r, "sparseflash-predicate")[col] / r[col] for r in win])
        v[f"ex_fa_flex_{m}"] = span([other(r, "flex")[col] / r[col] for r in win])
    docs = pick(fa, mask="documents")
    for m, col in (("fwd", "fwd_gpu_ms"), ("fb", "fwdbwd_gpu_ms")):
        v[f"ex_va_pred_{m}"] = span([other(r, "sparseflash-predicate")[col] / r[col] for r in docs])
    v["ex_fa_varlen_eager"] = span([r["fwd_ms"] for r in docs], "{:.2f}")
    v["ex_fa_varlen_gpu"] = span([r["fwd_gpu_ms"] for r in docs], "{:.2f}")
    v["ex_gpu"], v["ex_commit"], v["ex_date"] = _stamp(rows, "device_name"), _stamp(rows), day(_stamp(rows, "date"))
    v["ex_shape"] = f"{_stamp(rows, 'seq_len') // 1024}K tokens, {_stamp(rows, 'heads')} heads, {_stamp(rows, 'dtype')}"


# ----------------------------------------------------------------------------- LRA training steps (read only)
LRA_SPARSE_MAX = 0.5  # block-sparse LRA steps counted: density at most this


def lra_section(v: dict) -> None:
    rerun = [r for r in table("experiments/lra/results/speed-paired-short/paired.csv") if r["status"] == "ok"]
    redone = {r["task"] for r in rerun}  # the short-rounds run re-measured these tasks; its rows replace the first run's
    rows = [r for r in table("experiments/lra/results/speed-paired/paired.csv")
            if r["status"] == "ok" and r["task"] not in redone] + rerun
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    name = lambda t: f"{t} ({_stamp(pick(rows, task=t), 'seq_len') // 1024}K)"
    dense = {t: one(rows, task=t, provider="sparseflash") for t in tasks}
    faster = [t for t in tasks if dense[t]["ratio_hi"] < 1]
    v["lra_dense_x_sdpa"] = span([dense[t]["ratio"] for t in faster], "{:.3f}")
    v["lra_dense_faster"] = str(len(faster))
    v["lra_dense_ties"] = ", ".join(name(t) for t in tasks if t not in faster) or "none"
    sparse_ok = [t for t in tasks if all(r["ratio_hi"] < 1 and r["vs_dense_hi"] < 1 for r in rows
                                         if r["task"] == t and r["provider"].startswith("sparseflash/") and r["density"] <= LRA_SPARSE_MAX)]
    v["lra_sparse_faster"] = str(len(sparse_ok))
    v["lra_sparse_ties"] = ", ".join(name(t) for t in tasks if t not in sparse_ok) or "none"
    v["lra_tasks"] = str(len(tasks))
    v["lra_sparse_max"] = f"{LRA_SPARSE_MAX:g}"
    envs = [_json(f"experiments/lra/results/{f}/paired.json")["environment"] for f in ("speed-paired", "speed-paired-short")]
    v["lra_gpu"] = " / ".join(sorted({e["gpu"].replace("NVIDIA ", "") for e in envs}))
    v["lra_commit"] = " / ".join(sorted({short(e["commit"]) for e in envs}))


# ----------------------------------------------------------------------------- context parallelism
CP_PROVIDERS = ("sparseflash-1gpu", "sparseflash-cp", "torch-cp-allgather", "torch-cp-alltoall")


def context_parallel_section(v: dict) -> None:
    """`experiments/bench/context_parallel.py` on the largest GPU count measured: fwd+bwd ms per case
    and length, ours beside one GPU and torch's two rotate methods, with the memory beyond q/k/v."""
    rows = [r for r in table(f"{RES}/context-parallel/context_parallel.csv") if r["kind"] == "time" and not r["error"]]
    world = max(int(r["world"]) for r in rows)
    at = lambda c, n, p: next((r for r in rows if (r["case"], r["seq_len"], r["provider"]) == (c, n, p)
                               and (p == "sparseflash-1gpu" or int(r["world"]) == world)), None)
    keys = list(dict.fromkeys((r["case"], r["seq_len"]) for r in rows if int(r["world"]) == world))
    names = {"dense-causal": "causal", "window": "causal window", "documents": "packed documents", "butterfly": "butterfly"}
    lines, slower, memory = [], [], []
    for c, n in keys:
        cells = {p: at(c, n, p) for p in CP_PROVIDERS}
        best = min((r["ms"] for p, r in cells.items() if r is not None and p != "sparseflash-1gpu"), default=None)
        out = []
        for p in CP_PROVIDERS:
            r = cells[p]
            if r is None:
                out.append("")
                continue
            ms = f"{r['ms']:.1f}"
            ms = f"**{ms}**" if p != "sparseflash-1gpu" and r["ms"] == best else ms
            extra = f"{r['extra_gib']:.1f} GiB" if _num(r.get("extra_gib")) is not None else ""
            speed = f"{r['speedup_vs_1gpu']:.2f}x, " if p == "sparseflash-cp" and _num(r.get("speedup_vs_1gpu")) else ""
            out.append(f"{ms} ({speed}{extra})" if speed or extra else ms)
        torch_best = min((cells[p]["ms"] for p in CP_PROVIDERS[2:] if cells[p] is not None), default=None)
        if torch_best is not None and cells["sparseflash-cp"] is not None:
            slower.append(cells["sparseflash-cp"]["ms"] / torch_best)
        torch_mem = [_num(cells[p].get("extra_gib")) for p in CP_PROVIDERS[2:] if cells[p] is not None]
        torch_mem = [m for m in torch_mem if m]
        if torch_mem and cells["sparseflash-cp"] is not None and _num(cells["sparseflash-cp"].get("extra_gib")) is not None:
            memory.append(cells["sparseflash-cp"]["extra_gib"] / min(torch_mem))
        lines.append([f"{names.get(c, c)} {n // 1024}K", *out])
    v["cp_table"] = md_table(["work", "one GPU", f"ours, {world} GPUs", "torch CP all-gather", "torch CP ring (alltoall)"],
                             lines)
    v["cp_x_torch"] = span(slower)
    v["cp_mem_x_torch"] = span(memory)  # our memory beyond q/k/v over torch's smaller one
    ours = [r for r in rows if r["provider"] == "sparseflash-cp" and int(r["world"]) == world]
    v["cp_bytes_equal"] = "every" if all(r["sent_bytes"] == r["plan_bytes"] for r in ours) else "not every"
    v["cp_world"], v["cp_gpu"] = str(world), _stamp(ours, "gpu")
    v["cp_commit"], v["cp_date"] = _stamp(ours), day(_stamp(ours, "date"))
    v["cp_shape"] = f"{_stamp(ours, 'heads')} heads, d={_stamp(ours, 'head_dim')}"
    v["cp_stage"] = f"{_stamp(ours, 'stage_tokens') // 1024}K"
    v["cp_versions"] = f"torch {_stamp(ours, 'torch')}, triton {_stamp(ours, 'triton')}"


# ----------------------------------------------------------------------------- the document
def values(results: Path | None = None) -> dict[str, str]:
    """Every placeholder's value, from the tables under ``results`` (default experiments/results/;
    another folder of the same layout renders results not yet copied in)."""
    global _results_dir
    _results_dir = Path(results) if results is not None else ROOT / RES
    v: dict[str, str] = {}
    kc = table(f"{RES}/kernel-check/sparsity.csv")
    cfg = _json(f"{RES}/kernel-check/sparsity.json")["meta"]["config"]
    dense_section(v, kc, "kc")
    v["kc_gpu"], v["kc_kernels"] = gpu(kc), kernels(f"{RES}/kernel-check", "sparsity")
    v["kc_options"] = preset_options(f"{RES}/kernel-check", "sparsity")
    v["kc_kernels_cap"] = v["kc_kernels"][0].upper() + v["kc_kernels"][1:]
    sparse_section(v, kc, cfg["block_size"])
    sweep = table(f"{RES}/sparsity/sparsity.csv")
    eager_dense(v, sweep)
    eager_sweep(v, sweep)
    hop = _hopper_rows()
    hopper_section(v, hop)
    h2 = table(f"{RES}/kernel-check-h200-16k/sparsity.csv")
    h200_training(v, h2)
    v["h2_gpu"] = gpu(h2)
    decode_section(v, table(f"{RES}/decode/decode.csv"), table(f"{RES}/decode/deterministic.csv"))
    dynamic_section(v, table(f"{RES}/dynamic/dynamic.csv"))
    seqlen = table(f"{RES}/seqlen/seqlen.csv")
    seqlen_gpu = table(f"{SEQLEN_GPU_TIME}/seqlen.csv") if _path(f"{SEQLEN_GPU_TIME}/seqlen.csv").is_file() else None
    seqlen_section(v, seqlen, seqlen_gpu)
    causal_section(v, table(f"{RES}/causal/sparsity.csv"))
    head_dims_section(v)
    dropout_section(v, table(f"{RES}/dropout/dropout.csv"))
    short_rows_section(v, kc)
    host_section(v)
    packed_section(v)
    exact_section(v)
    lra_section(v)
    context_parallel_section(v)
    stamped = [kc, table(f"{RES}/causal/sparsity.csv"), seqlen, sweep, hop, h2] + ([seqlen_gpu] if seqlen_gpu else [])
    dates = sorted(day(r["date"]) for rows in stamped for r in rows)
    names = sorted({r["device_name"] for rows in stamped for r in rows})
    v["gpus"] = " or ".join(f"one {n}" for n in names)
    v["first_date"], v["last_date"] = dates[0], dates[-1]
    v["heads"], v["tokens"] = str(cfg["heads"]), f"{cfg['tokens'] // 1024}K"
    v["block"], v["dtype"] = str(cfg["block_size"]), cfg["dtype"]
    from sparseflash.experiments.bench.flops import MODE_FACTOR

    v["fwdbwd_factor"] = f"{MODE_FACTOR['fwdbwd']:g}"
    v["torch"] = _stamp(kc, "torch")
    v["triton"] = _stamp(kc, "triton")
    return v


def render(template: str | None = None, results: Path | None = None) -> str:
    """BENCHMARKS.md's text: the template with every placeholder filled (from ``results``: `values`)."""
    text = TEMPLATE.read_text() if template is None else template
    v = values(results)
    missing = sorted(set(_PLACEHOLDER.findall(text)) - set(v))
    if missing:
        raise KeyError(f"template placeholders with no value: {missing}")
    body = _PLACEHOLDER.sub(lambda m: v[m.group(1)], text)
    return "<!-- generated by `python -m sparseflash.experiments.bench.report` from experiments/results/ and " \
           "experiments/bench/BENCHMARKS.template.md: edit those, not this file -->\n" + body


def main(argv=None) -> int:
    from sparseflash.cmdline import ArgumentParser

    ap = ArgumentParser(prog="python -m sparseflash.experiments.bench.report",
                                 description="write BENCHMARKS.md from the results tables and its template")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when BENCHMARKS.md differs")
    ap.add_argument("--out", default=str(OUTPUT), help="where to write (default: the repository's BENCHMARKS.md)")
    ap.add_argument("--results", default=None,
                    help="a folder laid out as experiments/results/ to render from (default: that folder)")
    args = ap.parse_args(argv)
    if args.results is not None and not Path(args.results).is_dir():
        raise ValueError(f"--results must be a folder laid out as experiments/results/, got {args.results!r}")
    text = render(results=args.results)
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} is stale: run python -m sparseflash.experiments.bench.report", file=sys.stderr)
            return 1
        print(f"{out} is current")
        return 0
    out.write_text(text)
    print(f"wrote {out} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    from sparseflash.cmdline import run_command

    raise SystemExit(run_command(main))
