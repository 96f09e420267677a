"""Pictures of a block layout: the text picture in `BlockMask`'s repr and the matplotlib drawing.

One home for both, below `sparseflash.mask` and `sparseflash.analysis`: it works on any object
with a ``layout`` (bool ``[B, H, q_blocks, k_blocks]``), ``block_size``, ``seq_q`` and ``seq_k``
and imports neither module, so `BlockMask.picture` / `BlockMask.plot` and
`sparseflash.analysis.plot_mask` share it without an import cycle. Grids larger than the picture
are OR-pooled (a cell is on if any of its blocks is), so thin diagonals stay visible.
matplotlib is imported inside `plot_layout`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["pool_any", "layout_slice", "text_picture", "stats_title", "plot_layout"]

ON_COLOR = "#1f4e79"
PLOT_CELLS = 512  # larger grids are OR-pooled for drawing


def pool_any(grid: torch.Tensor, max_cells: int) -> tuple[torch.Tensor, int, int]:
    """OR-pool a bool ``[q_blocks, k_blocks]`` grid to at most ``max_cells`` per side.

    Returns the pooled grid and the pooling factors ``(fq, fk)`` (1, 1 when it already fits)."""
    qb, kb = grid.shape
    fq, fk = math.ceil(qb / max_cells), math.ceil(kb / max_cells)
    if fq > 1 or fk > 1:
        pad = torch.nn.functional.pad(grid, (0, -kb % fk, 0, -qb % fq))
        grid = pad.reshape(pad.shape[0] // fq, fq, pad.shape[1] // fk, fk).any(-1).any(1)
    return grid, fq, fk


def layout_slice(mask, slice_index) -> torch.Tensor:
    """The ``[q_blocks, k_blocks]`` layout of one (batch, head) slice, on the CPU."""
    b, h = mask.layout.shape[:2]
    if (not isinstance(slice_index, (tuple, list)) or len(slice_index) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in slice_index)):
        raise TypeError(f"slice_index must be a pair (batch, head) of ints, got {slice_index!r}")
    bi, hi = slice_index
    if not (0 <= bi < b and 0 <= hi < h):
        raise ValueError(f"slice_index {tuple(slice_index)} is outside the layout's batch x heads = {b}x{h}")
    return mask.layout[bi, hi].cpu()


def text_picture(grid: torch.Tensor, max_cells: int = 32) -> str:
    """One line per (pooled) q-block row: ``█`` on, ``·`` off."""
    grid, _, _ = pool_any(grid, max_cells)
    return "\n".join("".join("█" if x else "·" for x in row) for row in grid.tolist())


def stats_title(mask, grid: torch.Tensor) -> str:
    """Lengths, block size, grid, density and blocks per row (min / mean / max) of one slice."""
    bq, bk = mask.block_size
    per_row = grid.sum(-1).double()
    block = f"{bq}" if bq == bk else f"{bq}x{bk}"
    lengths = f"N={mask.seq_q}" if mask.seq_q == mask.seq_k else f"seq_q={mask.seq_q}, seq_k={mask.seq_k}"
    return (f"{lengths}, block {block}, grid {grid.shape[0]}x{grid.shape[1]}, density {float(grid.double().mean()):.3f}\n"
            f"blocks/row min {int(per_row.min())} / mean {float(per_row.mean()):.1f} / max {int(per_row.max())}")


def plot_layout(mask, path=None, ax=None, slice_index=(0, 0), title: str | None = None):
    """Draw one (batch, head) slice of ``mask.layout`` in token coordinates; return the Axes.

    ``title`` (optional) goes above the stats line (`stats_title`). With ``path`` the figure is
    saved there (PNG by extension). Without ``ax`` a new figure is made (no pyplot, so any backend
    works)."""
    grid = layout_slice(mask, slice_index)
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    fig = None
    if ax is None:
        fig = Figure(figsize=(5.2, 5.6), dpi=120, layout="constrained")
        ax = fig.add_subplot()
    bq, bk = mask.block_size
    qb, kb = grid.shape
    draw, fq, fk = pool_any(grid, PLOT_CELLS)
    ax.imshow(draw.numpy(), cmap=ListedColormap(["#ffffff", ON_COLOR]), vmin=0, vmax=1, interpolation="nearest",
              extent=(0, draw.shape[1] * fk * bk, draw.shape[0] * fq * bq, 0), aspect="auto")
    if qb <= 48 and kb <= 48:  # block boundaries, where there are few enough to read
        ax.vlines([j * bk for j in range(1, kb)], 0, mask.seq_q, colors="#b0b0b0", linewidth=0.4)
        ax.hlines([i * bq for i in range(1, qb)], 0, mask.seq_k, colors="#b0b0b0", linewidth=0.4)
    ax.set_xlim(0, mask.seq_k)
    ax.set_ylim(mask.seq_q, 0)
    if mask.seq_q == mask.seq_k:
        ax.set_aspect("equal")
    ax.set_xlabel("key position", fontsize=8)
    ax.set_ylabel("query position", fontsize=8)
    ax.tick_params(labelsize=7)
    text = stats_title(mask, grid)
    if fq > 1 or fk > 1:
        text += f" (cell = {fq}x{fk} blocks)"
    b, h = mask.layout.shape[:2]
    if b * h > 1:
        text += f", slice {tuple(slice_index)} of {b}x{h}"
    ax.set_title(text if title is None else f"{title}\n{text}", fontsize=8)
    if path is not None:
        (fig or ax.figure).savefig(path)
    return ax
