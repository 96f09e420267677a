"""Control for the Pathfinder-32 study: is the generated task learnable from its pixels at all?

A small convolutional network (no attention) is trained on the same splits the Transformer sees
(`get_dataset("pathfinder32", ...)`, pixels / 255), and its validation / test accuracy is printed
and written as JSON. A CNN far above chance says the labels are a learnable function of the
images, so a Transformer stuck at 50% is a problem of the recipe or the model, not of the data.

    python experiments/studies/pathfinder32-recipe/cnn_control.py --data DATA --epochs 8 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def load(root, split, device):
    from sparseflash.experiments.lra.data import get_dataset

    ds = get_dataset("pathfinder32", root, split, difficulty="hard")
    idx = np.arange(len(ds)) if ds._index is None else ds._index
    rows = np.asarray(ds._data).reshape(-1, 1024)[idx]  # each image is one 1024-byte record
    x = torch.from_numpy(rows.astype(np.float32) / 255).view(-1, 1, 32, 32)
    y = torch.from_numpy(np.asarray(ds._labels)[idx].astype(np.int64))
    return x.to(device), y.to(device)


def net(width: int = 64) -> nn.Module:
    def block(cin, cout, stride=1):
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    layers = block(1, width) + block(width, width) + block(width, width) + block(width, 2 * width, 2)
    layers += block(2 * width, 2 * width) + block(2 * width, 2 * width) + block(2 * width, 4 * width, 2)
    layers += block(4 * width, 4 * width) + block(4 * width, 4 * width)
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, 2))


@torch.no_grad()
def accuracy(model, x, y, bs=1024):
    model.eval()
    correct = sum((model(x[i:i + bs]).argmax(-1) == y[i:i + bs]).sum().item() for i in range(0, len(x), bs))
    model.train()
    return correct / len(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--out")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    (xt, yt), (xv, yv), (xs, ys) = (load(args.data, s, device) for s in ("train", "val", "test"))
    model = net().to(device).to(memory_format=torch.channels_last)
    steps = args.epochs * (len(xt) // args.batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=steps, pct_start=0.1)
    t0, history = time.time(), []
    for epoch in range(args.epochs):
        perm = torch.randperm(len(xt), device=device)
        for i in range(len(xt) // args.batch_size):
            b = perm[i * args.batch_size:(i + 1) * args.batch_size]
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = F.cross_entropy(model(xt[b]), yt[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        history.append({"epoch": epoch + 1, "loss": loss.item(), "val_acc": accuracy(model, xv, yv),
                        "time_s": round(time.time() - t0, 1)})
        print(json.dumps(history[-1]), flush=True)
    result = {"model": "9-layer CNN (64-128-256 channels, BN, ReLU), pixels / 255", "epochs": args.epochs,
              "train": len(xt), "val_acc": history[-1]["val_acc"], "test_acc": accuracy(model, xs, ys),
              "history": history, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    print(f"CNN control: val {result['val_acc']:.4f} test {result['test_acc']:.4f} after {args.epochs} epochs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
