"""Train a small causal language model with per-step top-k block selection beside dense attention
and a fixed local pattern: loss curves and step time: what per-step selection costs in a real training loop.

    python -m sparseflash.experiments.topk_train --out DIR                  (CPU: tiny, ~5 minutes on 2 cores)
    python -m sparseflash.experiments.topk_train --out DIR --device cuda --seq-len 4096 --block 128 \\
        --d-model 256 --heads 4 --layers 2 --batch 8 --steps 300 --topk 4 --window 512

Task (synthetic, nothing downloaded): every sequence is a random token string of half the length,
then the same string again; the loss is next-token cross-entropy on the second half, which a
model can only get below chance (ln vocab) by finding, far back, the position it is copying. That
is what a block selection from the data can do and a local window shorter than half the sequence
cannot.

Variants, each a stack of pre-norm blocks (`sparseflash.nn.SparseAttention`, causal, + an MLP),
same seed and data:
- ``dense``: full causal attention;
- ``local``: the fixed ``sparseflash.patterns.local`` pattern of ``--window`` tokens;
- ``topk``: ``SparseAttention(topk=K)``: every step and layer, the top ``--topk`` key blocks of
  every query block by mean-pooled q·k (`sparseflash.topk_blocks`), the own block always on.

Writes DIR/topk_train.csv (variant, step, loss, ms per step) and DIR/topk_train.png (loss
curves, and the median step time in the legend), and prints a table last. On CPU the attention
runs the PyTorch reference (``backend="auto"``), so CPU step times say nothing about the kernels.
"""

from __future__ import annotations

import csv
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from sparseflash.cmdline import ArgumentParser, check_output_dir, positive_int, run_command

VARIANTS = ("dense", "local", "topk")


class Block(nn.Module):
    def __init__(self, d: int, heads: int, attn_kwargs: dict):
        super().__init__()
        from sparseflash.nn import SparseAttention

        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SparseAttention(d, heads, causal=True, **attn_kwargs)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int, heads: int, layers: int, attn_kwargs: dict):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, attn_kwargs) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def copy_batch(batch: int, seq_len: int, vocab: int, generator: torch.Generator, device) -> torch.Tensor:
    """int64 [batch, seq_len]: a random half, then the same half again."""
    half = torch.randint(0, vocab, (batch, seq_len // 2), generator=generator)
    return torch.cat([half, half], dim=1).to(device)


def attn_kwargs(variant: str, args) -> dict:
    kw = dict(block_size=args.block)
    if variant == "local":
        kw.update(pattern="local", pattern_kwargs=dict(window=args.window, causal=True))
    elif variant == "topk":
        kw.update(topk=args.topk)
    return kw


def train(variant: str, args, device) -> list[dict]:
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = TinyLM(args.vocab, args.seq_len, args.d_model, args.heads, args.layers, attn_kwargs(variant, args)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed + 1)
    half = args.seq_len // 2
    rows = []
    for step in range(args.steps):
        ids = copy_batch(args.batch, args.seq_len, args.vocab, g, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            logits = model(ids[:, :-1])
        # the second half's tokens, each predicted from the one before
        loss = nn.functional.cross_entropy(logits[:, half - 1:].float().reshape(-1, args.vocab), ids[:, half:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append(dict(variant=variant, step=step, loss=loss.item(), ms=(time.perf_counter() - t0) * 1000))
    return rows


def plot(rows: list[dict], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparseflash.experiments.bench.plots import save_figure

    fig, ax = plt.subplots(figsize=(6, 4))
    for v in VARIANTS:
        pts = [(r["step"], r["loss"]) for r in rows if r["variant"] == v]
        if pts:
            ms = statistics.median(r["ms"] for r in rows if r["variant"] == v and r["step"] > 0)
            ax.plot(*zip(*pts), label=f"{v} ({ms:.1f} ms/step)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss on the copied half")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, out / "topk_train.png")


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m sparseflash.experiments.topk_train", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="topk_train_out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--seq-len", type=positive_int, default=64)
    ap.add_argument("--block", type=positive_int, default=16)
    ap.add_argument("--topk", type=positive_int, default=2, help="key blocks selected per query block (own block extra)")
    ap.add_argument("--window", type=positive_int, default=16, help="the local pattern's window (tokens)")
    ap.add_argument("--vocab", type=positive_int, default=8)
    ap.add_argument("--d-model", type=positive_int, default=64)
    ap.add_argument("--heads", type=positive_int, default=2)
    ap.add_argument("--layers", type=positive_int, default=2)
    ap.add_argument("--batch", type=positive_int, default=8)
    ap.add_argument("--steps", type=positive_int, default=200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda without a CUDA GPU")
    if args.seq_len % 2 or args.seq_len % args.block:
        ap.error(f"--seq-len must be even and a multiple of --block ({args.block}), got {args.seq_len}")
    out = check_output_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for v in args.variants:
        rows += train(v, args, device)
        print(f"{v}: final loss {rows[-1]['loss']:.3f}", flush=True)
    with open(out / "topk_train.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["variant", "step", "loss", "ms"])
        w.writeheader()
        w.writerows(rows)
    title = (f"copy task: {args.seq_len} tokens, block {args.block}, top-{args.topk}, local window {args.window}, "
             f"{args.device}")
    print(f"wrote {out / 'topk_train.csv'}, {plot(rows, out, title)}")
    print(f"{'variant':>8} {'first loss':>10} {'last loss':>10} {'ms/step':>8}")
    tail = max(1, args.steps // 10)
    for v in args.variants:
        rs = [r for r in rows if r["variant"] == v]
        last = statistics.mean(r["loss"] for r in rs[-tail:])
        ms = statistics.median(r["ms"] for r in rs[1:] or rs)
        print(f"{v:>8} {rs[0]['loss']:>10.3f} {last:>10.3f} {ms:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))
