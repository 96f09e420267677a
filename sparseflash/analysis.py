"""Looking at block masks: pictures, load balance, how density scales, and attention-graph reach.

- `plot_mask`: one (batch, head) slice of a layout, titled with lengths, block size, density and
  blocks per row (what `BlockMask.plot` calls).
- `row_stats`: blocks per q-block row and per k-block column (min / mean / max): the forward and
  backward load balance a kernel sees.
- `reach_layers`: after how many attention layers every token can have received information
  from every other one (``None``: never). See its docstring for the exact graph.
- `zoo`, `zoo_table`, `density_sweep`, `plot_zoo`, `plot_density`: the pattern zoo at one length
  (a picture grid and a table) and its density against sequence length (which patterns do
  O(N), O(N log N), O(N^1.5) or O(N^2) work).
- ``sparseflash patterns --seq-len N --out DIR``: all of the above, as PNG, CSV and JSON.

matplotlib and scipy are imported inside the functions that use them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from sparseflash._picture import plot_layout
from sparseflash.mask import BlockMask, check_len

__all__ = [
    "plot_mask", "row_stats", "reach_layers", "ZooEntry", "zoo", "zoo_table", "format_table",
    "density_sweep", "fit_exponents", "plot_zoo", "plot_density", "register",
]



def _check_mask(mask) -> BlockMask:
    if not isinstance(mask, BlockMask):
        raise TypeError(f"mask must be a sparseflash.BlockMask, got {type(mask).__name__}")
    return mask


def row_stats(mask: BlockMask) -> dict:
    """Blocks per q-block row and per k-block column over every stored slice: min / mean / max."""
    layout = _check_mask(mask).layout
    rows, cols = layout.sum(-1).double(), layout.sum(-2).double()
    return {
        "rows_min": int(rows.min()), "rows_mean": float(rows.mean()), "rows_max": int(rows.max()),
        "cols_min": int(cols.min()), "cols_mean": float(cols.mean()), "cols_max": int(cols.max()),
    }


def plot_mask(mask: BlockMask, path=None, ax=None, slice_index=(0, 0), title: str | None = None):
    """Draw one (batch, head) slice of ``mask``'s layout in token coordinates; return the Axes.

    ``title`` (optional) goes above the stats line (lengths, block size, grid, density, blocks per
    row min / mean / max). With ``path`` the figure is saved there (PNG by extension). Without
    ``ax`` a new figure is made (no pyplot, so any backend works). Same as `BlockMask.plot`; the
    drawing lives in `sparseflash._picture`.
    """
    return plot_layout(_check_mask(mask), path=path, ax=ax, slice_index=slice_index, title=title)


# ---------------------------------------------------------------------------- connectivity
def reach_layers(mask: BlockMask, *, causal: bool = False, target: str = "all") -> int | None:
    """Smallest L such that after L attention layers every token has information from every other.

    The graph: one layer sends information from key token j to query token i when the pair is
    attended; the residual stream keeps each token's own information, so L layers reach along
    paths of length <= L (powers of ``A + I``). Attention is block-level (every pair of an on
    block, see `BlockMask`), so tokens of one block are interchangeable and the token graph is
    the block graph blown up: between different blocks the distance is the block-graph distance;
    two tokens of the same block need the diagonal block (1 layer) or a cycle through other
    blocks. The heads of a layer are merged (union), each batch slice is its own graph, and the
    worst pair over all of them is reported.

    ``causal=True``: the attention call is causal (``j <= i`` inside blocks; no information flows
    backwards), so ``target="all"`` is never reached when there is more than one token.
    ``target="past"``: only pairs j < i must be reached (every token sees its whole past; the
    Sparse Transformer criterion). Needs self-attention (``seq_q == seq_k``) and square blocks.
    Returns ``None`` for never. Cost: scipy breadth-first search from every block, O(QB * nnz).
    """
    _check_mask(mask)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if target not in ("all", "past"):
        raise ValueError(f"target must be 'all' or 'past', got {target!r}")
    if mask.seq_q != mask.seq_k or mask.block_size[0] != mask.block_size[1]:
        raise ValueError(
            f"reach_layers needs self-attention with square blocks (layers must compose), got seq_q={mask.seq_q}, "
            f"seq_k={mask.seq_k}, block {mask.block_size}"
        )
    n, b = mask.seq_q, mask.block_size[0]
    if n == 1:
        return 0
    if causal and target == "all":
        return None
    import numpy as np
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import shortest_path

    nb = mask.num_blocks[0]
    sizes = np.minimum(b, n - b * np.arange(nb))
    worst = 0.0
    for A in mask.layout.any(dim=1).cpu().numpy():  # union of heads, one graph per batch slice
        if causal:
            A = np.tril(A)  # blocks above the diagonal hold no causal pair
        if A.all():
            worst = max(worst, 1.0)
            continue
        # D[u, v]: layers for block u's information to reach block v (query v attends key u).
        D = shortest_path(csr_matrix(A.T.astype(np.int8)), directed=True, unweighted=True)
        # Same block: out of I to a key block K it attends, then back in one step (K = I: the diagonal).
        cycle = 1 + np.where(A, D, np.inf).min(axis=1)
        inner = cycle[sizes >= 2].max(initial=0.0)
        pairs = ~np.eye(nb, dtype=bool) if target == "all" else np.triu(np.ones((nb, nb), dtype=bool), 1)
        between = D[pairs].max(initial=0.0)
        worst = max(worst, inner, between)
    return None if math.isinf(worst) else int(worst)


# ---------------------------------------------------------------------------- the zoo
@dataclass
class ZooEntry:
    """One pattern of the zoo: its mask, whether attention is called causal, and how it was built."""

    name: str
    mask: BlockMask
    causal: bool
    params: str
    build_ms: float = float("nan")


def _sync(device):
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def zoo(seq_len: int, *, block_size: int = 128, device=None) -> list[ZooEntry]:
    """The standard zoo at ``seq_len`` tokens, with parameters that scale as the papers use them.

    Windows and global sets stay fixed in tokens (O(N) work); Sparse Transformer strides are
    ``s = round(sqrt(nb))`` blocks (O(N^1.5)); butterfly is O(N log N); dense and causal O(N^2).
    ``build_ms`` is the best of three builds on ``device`` (CPU by default).
    """
    from sparseflash import patterns as P

    n = check_len(seq_len, "seq_len")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int for the zoo (butterfly needs square blocks), got {block_size!r}")
    b = check_len(block_size, "block_size")
    nb = math.ceil(n / b)
    s = max(1, round(math.sqrt(nb)))
    l = s * b
    kw = dict(block_size=b, device=device)
    specs = [
        ("dense", False, "all blocks", lambda: P.dense(n, **kw)),
        ("causal", True, "j <= i", lambda: P.causal(n, **kw)),
        ("local", False, f"window {b}", lambda: P.local(n, b, **kw)),
        ("dilated", False, f"window {8 * b}, dilation {2 * b}", lambda: P.dilated(n, 8 * b, 2 * b, **kw)),
        ("butterfly", False, "log2 nb factors", lambda: P.butterfly(n, **kw)),
        ("butterfly+global", False, "1 global block", lambda: P.butterfly(n, global_blocks=1, **kw)),
        ("strided", True, f"stride {l}", lambda: P.strided(n, l, **kw)),
        ("strided split heads", True, f"stride {l}, 2 heads",
         lambda: P.stack([P.local(n, l - 1, causal=True, **kw), P.dilated(n, n, l, causal=True, **kw)])),
        ("fixed", True, f"stride {l}, summary {min(32, l)}", lambda: P.fixed(n, l, min(32, l), **kw)),
        ("fixed bidirectional", False, f"stride {l}, summary {min(32, l)}",
         lambda: P.fixed(n, l, min(32, l), causal=False, **kw)),
        ("global tokens", False, "tokens 0, N/2", lambda: P.global_tokens(n, sorted({0, n // 2}), **kw)),
        ("random", False, "3 per row + diagonal", lambda: P.random(n, 3, diagonal=True, seed=0, **kw)),
        ("longformer", False, f"window {2 * b}, 1 global", lambda: P.longformer(n, 2 * b, 1, **kw)),
        ("bigbird", False, f"window {b}, {min(2 * b, n)} global, 3 random",
         lambda: P.bigbird(n, b, min(2 * b, n), 3, seed=0, **kw)),
    ]
    out = []
    for name, is_causal, params, build in specs:
        best = float("inf")
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            mask = build()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        out.append(ZooEntry(name, mask, is_causal, params, best * 1e3))
    return out


def zoo_table(entries: list[ZooEntry], *, reach: bool = True, exponents: dict | None = None, show_progress: bool = False) -> list[dict]:
    """One row per entry: density, blocks per row / column, reach (layers; None = never), build time."""
    from sparseflash._progress import progress

    rows = []
    it = progress(entries, desc="zoo analysis") if show_progress else entries
    for e in it:
        m = e.mask
        st = row_stats(m)
        row = {
            "pattern": e.name, "params": e.params, "seq_len": m.seq_q, "block": m.block_size[0],
            "grid": f"{m.num_blocks[0]}x{m.num_blocks[1]}", "heads": m.shape[1], "causal_call": e.causal,
            "density": round(m.density(), 6), "token_density": round(m.token_density(causal=e.causal), 6),
            "rows_min": st["rows_min"], "rows_mean": round(st["rows_mean"], 3), "rows_max": st["rows_max"],
            "cols_max": st["cols_max"],
        }
        if reach:
            row["reach_all"] = reach_layers(m, causal=e.causal, target="all")
            row["reach_past"] = reach_layers(m, causal=e.causal, target="past")
        if exponents is not None:
            row["work_exponent"] = round(exponents.get(e.name, float("nan")), 3)
        row["build_ms"] = round(e.build_ms, 3)
        rows.append(row)
    return rows


_COLUMNS = [
    ("pattern", "pattern"), ("params", "params"), ("heads", "H"), ("causal_call", "causal"),
    ("density", "density"), ("token_density", "tok.dens"), ("rows_min", "row min"), ("rows_mean", "row mean"),
    ("rows_max", "row max"), ("cols_max", "col max"), ("reach_all", "reach all"), ("reach_past", "reach past"),
    ("work_exponent", "work ~N^x"), ("build_ms", "build ms"),
]


def _cell(value) -> str:
    if value is None:
        return "never"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def format_table(rows: list[dict]) -> str:
    """Aligned text table of `zoo_table` rows ('never' for unreachable)."""
    cols = [(k, h) for k, h in _COLUMNS if rows and k in rows[0]]
    cells = [[h for _, h in cols]] + [[_cell(r[k]) for k, _ in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def density_sweep(lengths, *, block_size: int = 128, device=None, show_progress: bool = False) -> list[dict]:
    """Zoo density at each length: rows (pattern, seq_len, density, blocks per head, token density)."""
    from sparseflash._progress import progress

    lengths = list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of positive ints, got {lengths!r}")
    rows = []
    for n in (progress(lengths, desc="density sweep") if show_progress else lengths):
        for e in zoo(n, block_size=block_size, device=device):
            rows.append({
                "pattern": e.name, "seq_len": n, "block": block_size, "density": e.mask.density(),
                "blocks_per_head": float(e.mask.layout.sum(dim=(-1, -2)).double().mean()),
                "token_density": e.mask.token_density(causal=e.causal),
            })
    return rows


def fit_exponents(rows: list[dict], last: int = 4) -> dict[str, float]:
    """Per pattern: slope of log(blocks per head) against log(N) over the ``last`` largest lengths."""
    import numpy as np

    out = {}
    for name in dict.fromkeys(r["pattern"] for r in rows):
        pts = sorted((r["seq_len"], r["blocks_per_head"]) for r in rows if r["pattern"] == name)[-last:]
        if len(pts) < 2:
            out[name] = float("nan")
            continue
        x, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
        out[name] = float(np.polyfit(x, y, 1)[0])
    return out


def plot_zoo(entries: list[ZooEntry], path, *, ncols: int = 4, title: str | None = None):
    """Every entry (every head of multi-head ones) in one grid of `plot_mask` panels; save to ``path``."""
    from matplotlib.figure import Figure

    panels = [(e, h) for e in entries for h in range(e.mask.shape[1])]
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(4.2 * ncols, 4.6 * nrows), dpi=110, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax, (e, h) in zip(axes.flat, panels):
        name = e.name if e.mask.shape[1] == 1 else f"{e.name} [head {h}]"
        label = f"{name}: {e.params}" + (" (causal call)" if e.causal else "")
        plot_mask(e.mask, ax=ax, slice_index=(0, h), title=label)
        ax.title.set_fontsize(7.5)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=12)
    fig.savefig(path)
    return fig


def plot_density(rows: list[dict], path, *, exponents: dict | None = None):
    """Log-log density and blocks per head against N, with O(N), O(N log N), O(N^1.5), O(N^2) guides."""
    import matplotlib
    import numpy as np
    from matplotlib.figure import Figure

    exponents = fit_exponents(rows) if exponents is None else exponents
    names = list(dict.fromkeys(r["pattern"] for r in rows))
    fig = Figure(figsize=(13, 5.4), dpi=110, layout="constrained")
    ax_d, ax_w = fig.subplots(1, 2)
    markers = "osD^v<>phH*Xd8P"
    tab20 = matplotlib.colormaps["tab20"]
    for k, name in enumerate(names):
        pts = sorted((r["seq_len"], r["density"], r["blocks_per_head"]) for r in rows if r["pattern"] == name)
        n = [p[0] for p in pts]
        # tab10 first, then the light tab20 shades dashed: every line its own colour and style
        color = f"C{k}" if k < 10 else tab20((2 * (k - 10) + 1) % 20)
        style = dict(marker=markers[k % len(markers)], markersize=4, linewidth=1.2, color=color,
                     linestyle="-" if k < 10 else "--")
        ax_d.plot(n, [p[1] for p in pts], label=name, **style)
        ax_w.plot(n, [p[2] for p in pts], label=f"{name} (N^{exponents.get(name, float('nan')):.2f})", **style)
    lengths = sorted({r["seq_len"] for r in rows})
    if len(lengths) >= 2:
        x = np.array(lengths, dtype=float)
        block = rows[0]["block"]
        nb = x / block
        for label, y, ls in (("O(N)", nb, ":"), ("O(N log N)", nb * np.log2(nb), "-."),
                             ("O(N^1.5)", nb ** 1.5, (0, (5, 2))), ("O(N^2)", nb ** 2, "--")):
            ax_w.plot(x, y, color="0.45", linestyle=ls, linewidth=1)
            ax_w.annotate(label, (x[-1], y[-1]), textcoords="offset points", xytext=(4, 0), fontsize=8, color="0.35", va="center")
        ax_d.plot(x, np.minimum(1, 1 / nb), color="0.45", linestyle=":", linewidth=1)
        ax_d.annotate("1 block per row", (x[-1], 1 / nb[-1]), textcoords="offset points", xytext=(4, 0), fontsize=8, color="0.35")
    for ax in (ax_d, ax_w):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N (tokens)")
        ax.grid(True, which="major", alpha=0.3)
    ax_d.set_ylabel("block density (fraction of blocks computed)")
    ax_d.set_title("density vs length: flat = O(N^2), slope -1 = O(N)")
    ax_w.set_ylabel("nonzero blocks per head (work)")
    ax_w.set_title(f"work vs length (block {rows[0]['block'] if rows else '?'}; guides: nb, nb log2 nb, nb^1.5, nb^2)")
    ax_w.legend(fontsize=7, loc="upper left", ncol=1)
    fig.savefig(path)
    return fig


# ---------------------------------------------------------------------------- CLI
def register(subparsers) -> None:
    from sparseflash.cmdline import positive_int

    p = subparsers.add_parser(
        "patterns", help="draw and analyse the pattern zoo at one length",
        description="Draw every zoo pattern at --seq-len into one PNG grid, print a table (density, blocks per "
                    "row/column, layers to reach, build time) and write it as CSV and JSON, plus a plot of "
                    "density against sequence length.",
    )
    p.add_argument("--seq-len", type=positive_int, default=4096, help="sequence length in tokens (default 4096)")
    p.add_argument("--block-size", type=positive_int, default=128, help="block size in tokens (default 128)")
    p.add_argument("--out", default="out/patterns", help="output folder (default out/patterns)")
    p.add_argument("--lengths", type=positive_int, nargs="+", default=None,
                   help="lengths for the density plot (default block * 2**k for k = 2..10)")
    p.add_argument("--no-density", action="store_true", help="skip the density-vs-length sweep and plot")
    p.add_argument("--no-reach", action="store_true", help="skip the connectivity (reach) columns")
    p.add_argument("--device", type=_device, default="cpu", help="device to build masks on (default cpu)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the tables and figures of an earlier run in --out; without it they are refused")
    p.set_defaults(func=_cmd_patterns)


def _device(text: str) -> str:
    """argparse type: a torch device name (cpu, cuda, cuda:1)."""
    import argparse

    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a torch device such as cpu or cuda, got {text!r}") from None
    return text


def _write_rows(rows: list[dict], stem, meta: dict) -> list[str]:
    import csv
    import json

    with open(f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: ("never" if v is None and k.startswith("reach") else v) for k, v in r.items()} for r in rows)
    with open(f"{stem}.json", "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    return [f"{stem}.csv", f"{stem}.json"]


def _cmd_patterns(args) -> int:
    import datetime
    import os

    import sparseflash
    from sparseflash.cmdline import check_output_dir, claim_output_files

    check_output_dir(args.out)
    stems = ([] if args.no_density else ["density"]) + [f"zoo_{args.seq_len}"]
    claim_output_files(args.out, [f"{stem}.{ext}" for stem in stems for ext in ("csv", "json", "png")],
                       overwrite=args.overwrite)
    os.makedirs(args.out, exist_ok=True)
    meta = {"sparseflash": sparseflash.__version__, "torch": torch.__version__, "device": str(args.device),
            "block_size": args.block_size, "date": datetime.datetime.now().isoformat(timespec="seconds")}
    written = []
    exponents = None
    if not args.no_density:
        lengths = args.lengths or [args.block_size * 2**k for k in range(2, 11)]
        sweep = density_sweep(sorted(set(lengths)), block_size=args.block_size, device=args.device, show_progress=True)
        exponents = fit_exponents(sweep)
        stem = os.path.join(args.out, "density")
        written += _write_rows(sweep, stem, meta)
        plot_density(sweep, f"{stem}.png", exponents=exponents)
        written.append(f"{stem}.png")
    entries = zoo(args.seq_len, block_size=args.block_size, device=args.device)
    rows = zoo_table(entries, reach=not args.no_reach, exponents=exponents, show_progress=True)
    stem = os.path.join(args.out, f"zoo_{args.seq_len}")
    written += _write_rows(rows, stem, {**meta, "seq_len": args.seq_len})
    plot_zoo(entries, f"{stem}.png", title=f"sparseflash pattern zoo: N = {args.seq_len} tokens, block {args.block_size}")
    written.append(f"{stem}.png")
    print(format_table(rows))
    if not args.no_reach:
        print("reach: layers until every token has every other token's (all) / every earlier token's (past) "
              "information; 'never' = not connected")
    if exponents is not None:
        print("work ~N^x: slope of nonzero blocks per head vs N over the four largest lengths of the density sweep")
    print("wrote " + ", ".join(written))
    return 0
