"""Control for the Pathfinder-32 study: the published recipe in an independent minimal Transformer.

Our LRA model stays at chance on generated Pathfinder-32 with every recipe tried, while a CNN reaches
93% on the same images. This script separates "our training path" from "the data": it is the
Nystromformer LRA Transformer (the code the FlashAttention paper's numbers come from) written from
its published description in ~100 lines of plain PyTorch, sharing nothing with
`sparseflash.experiments.lra` but the arrays (read as `cnn_control.py` reads them):

- pixel values 0..255 as token ids (vocab 256), learned token and position tables (N(0, 0.02)),
  embedding dropout 0.1;
- 2 pre-LayerNorm blocks, d 64, 2 heads of 32, FFN 128 with GELU, dropout 0.1 after attention and
  in the FFN, attention dropout 0.1 (`F.scaled_dot_product_attention`);
- final LayerNorm, mean over positions, head Linear(64, 128), ReLU, Linear(128, 2);
- with ``--black-is-padding``, what the released pipelines do with pixel ids: id 0 (black) is
  padding, so black keys are masked out of attention and black positions' final outputs are zeroed
  before the mean over all 1024 positions (Nystromformer's ``mask = input_ids != 0``,
  ``norm(X) * mask``; LRA's ``inputs > 0``);
- with ``--patch P`` (a diagnostic, not the LRA task: the sequence is no longer pixels), the
  image is cut into P x P patches whose gray levels (/ 255) a linear map embeds, as a ViT does:
  (32 / P)^2 tokens, each already a local picture;
- AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-6, no weight decay, no clipping; `OneCycleLR` with
  312 warm-up steps of 62,400, linear annealing, its default beta1 cycling; batch 256, bf16 autocast.

If this model learns on our images where ours does not, the fault is in our training path; if it
stays at chance too, the difference lies in the data (or in luck: the recipe is known to be seed
sensitive on the released data as well).

    python experiments/studies/pathfinder32-recipe/minimal_transformer.py --data DATA --minutes 8 --out OUT
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cnn_control import load  # the same arrays the CNN control reads (pixels / 255, labels)

COLS = ["step", "train_loss", "val_loss", "val_acc", "lr", "time_s"]  # eval.csv


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int, p: float):
        super().__init__()
        self.heads, self.p = heads, p
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ffn = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Dropout(p), nn.Linear(ff, d), nn.Dropout(p))
        self.drop = nn.Dropout(p)

    def forward(self, x, keep=None):  # x [B, N, d]; keep: bool [B, 1, 1, N] keys attended, or None (all)
        B, N, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=self.p if self.training else 0.0)
        x = x + self.drop(self.out(a.transpose(1, 2).reshape(B, N, d)))
        return x + self.ffn(self.norm2(x))


class MinimalTransformer(nn.Module):
    def __init__(self, n: int = 1024, d: int = 64, heads: int = 2, ff: int = 128, layers: int = 2, p: float = 0.1,
                 black_is_padding: bool = False, patch: int = 1):
        super().__init__()
        side = math.isqrt(n)
        if patch < 1 or side % patch or (patch > 1 and black_is_padding):
            raise ValueError(f"patch must divide {side} (and patches > 1 have no black padding), got {patch}")
        self.black_is_padding, self.patch, self.side = black_is_padding, patch, side
        n = (side // patch) ** 2
        self.patch_embed = nn.Linear(patch * patch, d) if patch > 1 else None
        self.tok, self.pos = nn.Embedding(256, d), nn.Parameter(torch.randn(n, d) * 0.02)
        nn.init.normal_(self.tok.weight, std=0.02)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList(Block(d, heads, ff, p) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Sequential(nn.Linear(d, ff), nn.ReLU(), nn.Linear(ff, 2))

    def forward(self, pixels):  # pixels: int [B, N] in 0..255
        if self.patch_embed is not None:  # [B, N] -> [B, (side / P)^2, P * P] -> [B, n, d]
            P, g = self.patch, self.side // self.patch
            x = pixels.view(-1, g, P, g, P).permute(0, 1, 3, 2, 4).reshape(-1, g * g, P * P)
            x = self.patch_embed(x.to(self.patch_embed.weight.dtype) / 255)
        else:
            x = self.tok(pixels)
        x = self.drop(x + self.pos)
        keep = pixels != 0 if self.black_is_padding else None  # [B, N]
        for blk in self.blocks:
            x = blk(x, None if keep is None else keep[:, None, None, :])
        x = self.norm(x)
        return self.head((x if keep is None else torch.where(keep[..., None], x, 0.0)).mean(1))


@torch.no_grad()
def evaluate(model, x, y, bs=1024):
    model.eval()
    loss = correct = 0.0
    for i in range(0, len(x), bs):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.is_cuda):
            logits = model(x[i:i + bs]).float()
        loss += F.cross_entropy(logits, y[i:i + bs], reduction="sum").item()
        correct += (logits.argmax(-1) == y[i:i + bs]).sum().item()
    model.train()
    return loss / len(x), correct / len(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=8.0, help="stop training after this much wall time")
    p.add_argument("--steps", type=int, default=62400, help="length of the schedule")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-size", type=int, default=10240, help="validation images per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--black-is-padding", action="store_true", help="pixel id 0 is padding, as in the released pipelines")
    p.add_argument("--patch", type=int, default=1, help="P x P patches as tokens (a ViT-style diagnostic; 1 = pixels)")
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    t0 = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    (xt, yt), (xv, yv), (xs, ys) = (load(args.data, s, device) for s in ("train", "val", "test"))
    # back from pixels / 255 to the byte values the released pipeline feeds as token ids
    xt, xv, xs = ((t.flatten(1) * 255).round().long() for t in (xt, xv, xs))
    xv, yv = xv[:args.eval_size], yv[:args.eval_size]
    model = MinimalTransformer(black_is_padding=args.black_is_padding, patch=args.patch, layers=args.layers).to(device)
    step_fn = model if args.no_compile or device != "cuda" else torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.steps, pct_start=min(312 / args.steps, 0.5),
                                                anneal_strategy="linear")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vars(args) | {"params": sum(t.numel() for t in model.parameters())}))
    with open(out / "eval.csv", "w", newline="", buffering=1) as f:  # line-buffered: rows survive a kill
        log = csv.writer(f)
        log.writerow(COLS)
        per_epoch = len(xt) // args.batch_size
        step, run_loss = 0, []
        while step < args.steps and time.time() - t0 < 60 * args.minutes:
            perm = torch.randperm(len(xt), device=device)
            for i in range(per_epoch):
                b = perm[i * args.batch_size:(i + 1) * args.batch_size]
                with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                    loss = F.cross_entropy(step_fn(xt[b]).float(), yt[b])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                run_loss.append(loss.detach())
                if step % args.eval_every == 0 or step == args.steps:
                    vl, va = evaluate(model, xv, yv)
                    row = [step, round(torch.stack(run_loss).mean().item(), 4), round(vl, 4), round(va, 4),
                           f"{sched.get_last_lr()[0]:.3g}", round(time.time() - t0, 1)]
                    run_loss = []
                    log.writerow(row)
                    print(json.dumps(dict(zip(COLS, row))), flush=True)
                if step >= args.steps or time.time() - t0 >= 60 * args.minutes:
                    break
    tl, ta = evaluate(model, xs, ys)
    result = {"steps": step, "test_loss": round(tl, 4), "test_acc": round(ta, 4), "time_s": round(time.time() - t0, 1)}
    (out / "result.json").write_text(json.dumps(result))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
