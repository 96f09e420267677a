"""Benchmark results as tidy data: the row schema, environment stamp, CSV/JSON files and tables.

One row per provider x setting. The JSON file holds ``{"schema", "meta", "rows"}`` (meta: the
command, configuration, notes such as skipped patterns, timings of the run); the CSV holds the
same rows. Rows measured on a CPU carry ``device=cpu`` and the note `CPU_NOTE`, and every table
printed from them says so.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import math
import os
import platform
from collections import defaultdict
from pathlib import Path

__all__ = ["SCHEMA", "COLUMNS", "CPU_NOTE", "environment", "git_commit", "write_results", "load_results",
           "pivot_table", "summary_table", "seqlen_table", "format_table"]

SCHEMA = "sparseflash-bench/1"
CPU_NOTE = "CPU (not GPU results)"

COLUMNS = (
    "bench", "device", "device_name", "provider", "label", "kind", "backend", "pattern", "param",
    "density", "token_density", "rel_density", "batch", "heads", "seq_len", "head_dim", "dtype", "causal",
    "mode", "block_size", "ms", "ms_lo", "ms_hi", "n_runs", "tflops", "flops", "peak_mem_mb", "mask_ms", "prep_ms", "first_ms", "n_sets", "max_err",
    "status", "note", "torch", "triton", "sparseflash", "commit", "date", "timing",
)
_INT = {"batch", "heads", "seq_len", "head_dim", "block_size", "n_sets", "n_runs"}
_FLOAT = {"density", "token_density", "rel_density", "ms", "ms_lo", "ms_hi", "tflops", "flops", "peak_mem_mb", "mask_ms", "prep_ms",
          "first_ms", "max_err"}


def git_commit(start: Path | None = None) -> str:
    """Commit of the checkout this package runs from, read from .git without running git
    (``SPARSEFLASH_COMMIT`` overrides; 'unknown' outside a checkout, e.g. a copied tree)."""
    if os.environ.get("SPARSEFLASH_COMMIT"):
        return os.environ["SPARSEFLASH_COMMIT"]
    here = (start or Path(__file__)).resolve()
    for d in [here, *here.parents]:
        git = d / ".git"
        if git.is_file():  # worktree: "gitdir: <path>"
            text = git.read_text().strip()
            git = (d / text.split(":", 1)[1].strip()) if text.startswith("gitdir:") else git
        if not git.is_dir():
            continue
        try:
            head = (git / "HEAD").read_text().strip()
            if not head.startswith("ref:"):
                return head
            ref = head.split(":", 1)[1].strip()
            common = git / "commondir"
            base = (git / common.read_text().strip()).resolve() if common.is_file() else git
            for root in (git, base):
                if (root / ref).is_file():
                    return (root / ref).read_text().strip()
                packed = root / "packed-refs"
                if packed.is_file():
                    for line in packed.read_text().splitlines():
                        if line.endswith(" " + ref):
                            return line.split()[0]
        except OSError:
            pass
        return "unknown"
    return "unknown"


def environment(device) -> dict:
    """Fields every row of a run shares: device, versions, commit, date."""
    import torch

    import sparseflash

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = "none"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU {platform.machine()} ({os.cpu_count()} threads available, {torch.get_num_threads()} used)"
    return {
        "device": device.type,
        "device_name": name,
        "torch": torch.__version__,
        "triton": triton_version,
        "sparseflash": sparseflash.__version__,
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _csv_value(v):
    if v is None:
        return ""
    if isinstance(v, float) and not math.isfinite(v):
        return "" if math.isnan(v) else str(v)
    return v


def write_results(rows: list[dict], meta: dict, out_dir, stem: str) -> dict:
    """Write ``<stem>.csv``, ``<stem>.json`` and ``<stem>_table.md`` under ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / f"{stem}.csv", "json": out / f"{stem}.json", "md": out / f"{stem}_table.md"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in COLUMNS})
    nan = lambda v: isinstance(v, float) and math.isnan(v)
    clean = [{k: None if nan(r.get(k)) else r.get(k) for k in COLUMNS} for r in rows]
    with open(paths["json"], "w") as f:
        json.dump({"schema": SCHEMA, "meta": meta, "rows": clean}, f, indent=1, allow_nan=False)
    header, lines = pivot_table(rows)
    title = f"# {meta.get('bench', stem)}: {meta.get('device_name', '')}"
    if any(r.get("device") == "cpu" for r in rows):
        title += f" -- {CPU_NOTE}"
    notes = "".join(f"- {n}\n" for n in meta.get("notes", []))
    cmd = meta.get("command", "")
    text = f"{title}\n\nCommand: `{cmd}`\n\n{notes}\n{format_table(header, lines, markdown=True)}\n"
    paths["md"].write_text(text)
    return {k: str(v) for k, v in paths.items()}


def write_tidy(rows: list[dict], meta: dict, out_dir, stem: str, schema: str) -> None:
    """``<stem>.json`` (schema, meta, rows) and ``<stem>.csv`` (every column any row has, in order of
    appearance) under ``out_dir``: the free-form tables of the benches that do not share `COLUMNS`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.json", "w") as f:
        json.dump(dict(schema=schema, meta=meta, rows=rows), f, indent=1)
    cols = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


def _parse_csv_row(r: dict) -> dict:
    out = dict(r)
    for k, v in r.items():
        if k in _INT:
            out[k] = int(float(v)) if v not in ("", None) else None
        elif k in _FLOAT:
            out[k] = float(v) if v not in ("", None) else float("nan")
        elif k == "causal":
            out[k] = v in ("True", "true", "1")
    return out


def load_results(paths) -> tuple[list[dict], list[dict]]:
    """Rows and metas from result files (.json or .csv) or directories holding them (their .json
    files, or .csv files where no .json of the same name exists)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            jsons = sorted(p.glob("*.json"))
            files += jsons + [c for c in sorted(p.glob("*.csv")) if c.with_suffix(".json") not in jsons]
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no results file or directory at {p}")
    rows, metas = [], []
    for f in files:
        if f.suffix == ".json":
            try:
                data = json.loads(f.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{f} is not valid JSON ({e}); regenerate it with sparseflash bench, or leave it "
                                 f"out") from None
            if not isinstance(data, dict) or data.get("schema") != SCHEMA:
                continue  # some other JSON file in the directory
            metas.append(data.get("meta", {}))
            rows += [{k: float("nan") if v is None and k in _FLOAT else v for k, v in r.items()} for r in data["rows"]]
        elif f.suffix == ".csv":
            with open(f, newline="") as fh:
                reader = csv.DictReader(fh)
                if reader.fieldnames is None or "provider" not in reader.fieldnames:
                    continue
                rows += [_parse_csv_row(r) for r in reader]
        else:
            raise ValueError(f"results must be .json or .csv files, got {f}")
    if not rows:
        raise ValueError(f"no benchmark rows found in {[str(p) for p in paths]}")
    return rows, metas


# ----------------------------------------------------------------------------- tables
_MODES = ("fwd", "bwd", "fwdbwd")


def _num(x, digits=3):
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"


def _status_short(status: str) -> str:
    if status == "OOM":
        return "OOM"
    return status.split(":", 1)[0] if status else "-"


def _group_key(r):
    return (r.get("bench"), r.get("causal"), r.get("dtype"), r.get("seq_len"), r.get("head_dim"), r.get("batch"),
            r.get("heads"), r.get("pattern") != "dense", r.get("pattern"), -(r.get("rel_density") or 0), r.get("param"))


def pivot_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One line per provider x setting, the modes side by side: ms, effective TFLOP/s, peak MiB."""
    modes = [m for m in _MODES if any(r.get("mode") == m for r in rows)]
    header = ["provider", "pattern", "param", "N", "batch", "d", "causal", "density"]
    for m in modes:
        header += [f"{m} ms", f"{m} TFLOP/s", f"{m} MiB"]
    cells: dict[tuple, dict] = {}
    order = {}
    for r in rows:
        key = (r.get("provider"), r.get("pattern"), r.get("param"), r.get("seq_len"), r.get("batch"),
               r.get("head_dim"), r.get("causal"), r.get("dtype"), r.get("heads"), r.get("bench"))
        cells.setdefault(key, {})[r.get("mode")] = r
        order.setdefault(key, (_group_key(r), len(order)))
    lines = []
    for key in sorted(cells, key=lambda k: order[k]):
        by_mode = cells[key]
        any_row = next(iter(by_mode.values()))
        line = [str(key[0]), str(key[1]), str(key[2] or ""), str(key[3]), str(key[4]), str(key[5]),
                "yes" if key[6] else "no", _num(any_row.get("rel_density"))]
        for m in modes:
            r = by_mode.get(m)
            if r is None:
                line += ["", "", ""]
            elif r.get("status") == "ok":
                mib = r.get("peak_mem_mb")
                line += [_num(r.get("ms"), 4), _num(r.get("tflops")), _num(mib, 5)]
            else:
                line += [_status_short(r.get("status", "")), "", ""]
        lines.append(line)
    return header, lines


def _shape(r):
    return (r.get("bench"), r.get("seq_len"), r.get("batch"), r.get("heads"), r.get("head_dim"), r.get("dtype"),
            r.get("causal"), r.get("mode"))


def summary_table(rows: list[dict], ref: str = "sparseflash") -> tuple[list[str], list[list[str]]]:
    """One line per ``ref`` mask point, modes side by side: ms, effective TFLOP/s and speedups
    over ``ref``-dense, over FlexAttention on the same mask and over the fastest dense SDPA
    backend at the same shape (its name in the last column)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    dense, flex = defaultdict(dict), {}
    for r in ok:
        if r.get("kind") == "dense":
            dense[_shape(r)][r["provider"]] = r["ms"]
        elif r["provider"] == "flex":
            flex[_shape(r) + (r.get("pattern"), r.get("param"))] = r["ms"]
    modes = [m for m in _MODES if any(r.get("mode") == m and r.get("provider") == ref for r in ok)]
    header = ["pattern", "param", "N", "d", "density"]
    for m in modes:
        header += [f"{m} ms", f"{m} TF", f"{m} x dense", f"{m} x flex", f"{m} x SDPA"]
    header.append("best SDPA")
    lines, index = [], {}
    for r in sorted((r for r in ok if r.get("provider") == ref and r.get("kind") != "dense"), key=_group_key):
        key = (r.get("bench"), r.get("pattern"), r.get("param"), r.get("seq_len"), r.get("batch"), r.get("heads"),
               r.get("head_dim"), r.get("dtype"), r.get("causal"))
        if key not in index:
            index[key] = len(lines)
            lines.append([str(r.get("pattern")), str(r.get("param")), str(r.get("seq_len")), str(r.get("head_dim")),
                          _num(r.get("rel_density"))] + [""] * (5 * len(modes)) + [""])
        line = lines[index[key]]
        base = dense.get(_shape(r), {})
        sdpa = {p: ms for p, ms in base.items() if p.startswith("sdpa-")}
        best = min(sdpa, key=sdpa.get) if sdpa else None
        fx = flex.get(_shape(r) + (r.get("pattern"), r.get("param")))
        i = 5 + 5 * modes.index(r["mode"])
        line[i : i + 5] = [_num(r["ms"], 4), _num(r.get("tflops")),
                           _num(base[f"{ref}-dense"] / r["ms"]) if f"{ref}-dense" in base else "-",
                           _num(fx / r["ms"]) if fx else "-", _num(sdpa[best] / r["ms"]) if best else "-"]
        if best:
            line[-1] = best
    return header, lines


def seqlen_table(rows: list[dict], mode: str) -> tuple[list[str], list[list[str]]]:
    """Milliseconds (or status) of one mode: a line per provider (and pattern) and head_dim,
    a column per sequence length."""
    rows = [r for r in rows if r.get("mode") == mode]
    lens = sorted({r["seq_len"] for r in rows})
    header = ["provider", "pattern", "d"] + [str(n) for n in lens]
    cells: dict[tuple, dict] = {}
    for r in sorted(rows, key=_group_key):
        key = (r["provider"], r.get("pattern"), r.get("head_dim"))
        ok = r.get("status") == "ok"
        cells.setdefault(key, {})[r["seq_len"]] = _num(r["ms"], 4) if ok else _status_short(r["status"])
    lines = [[p, str(pat), str(d)] + [c.get(n, "") for n in lens] for (p, pat, d), c in cells.items()]
    return header, lines


def format_table(header: list[str], lines: list[list[str]], markdown: bool = False) -> str:
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])
