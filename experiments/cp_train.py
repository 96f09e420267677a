"""Train a small causal Transformer LM on one long sequence split across the ranks of a host:
context parallelism with `sparseflash.distributed` on a block-sparse mask, tokens/s and peak memory.

    torchrun --nproc-per-node 4 -m sparseflash.experiments.cp_train --seq-len 1048576 --mask local \\
        --checkpoint --steps 30 --out experiments/results/cp-train/w4-local-1M
    python -m sparseflash.experiments.cp_train --world 1 --seq-len 1048576 --mask local --checkpoint \\
        --steps 30 --out experiments/results/cp-train/w1-local-1M        (one GPU, no torchrun)
    torchrun --nproc-per-node 2 -m sparseflash.experiments.cp_train --device cpu --backend reference \\
        --seq-len 333 --block 32 --layers 2 --heads 2 --head-dim 8 --window 64 --steps 5 --out DIR   (CPU, gloo)

Model: pre-norm blocks (LayerNorm, q/k/v projection, rotary positions, attention, output projection;
LayerNorm, GELU MLP), token embedding, final norm and a vocabulary head. Embeddings, norms, MLPs, the
rotary angles and the loss are token-local, so every rank applies them to its own shard of the sequence
(``plan.shard`` of the ids, the targets and the positions: under a zig-zag or greedy placement a rank's
tokens are not contiguous, and the rotary angles use each token's global position). Only the attention
talks across ranks: `sparseflash.distributed.attention` on one `sparseflash.distributed.plan` (built once:
the mask does not change between steps), causal, with ``--mask``:

- ``local``: a causal window of ``--window`` tokens (the benchmark's ``window_mask``);
- ``butterfly``: `sparseflash.patterns.butterfly`, causal;
- ``documents``: packed documents of ``--doc-min``..``--doc-max`` tokens (``segment_ids``), causal;
- ``causal``: dense causal.

``--world 1`` runs the same model in one process on the full sequence with `sparseflash.attention` and
the same mask: the baseline, and the reference the tests hold the sharded run to.

Parameters are replicated: every rank builds them from ``--seed``, the gradients are summed over the
ranks with one all-reduce per step (each rank's backward gives its tokens' share of the gradient of the
global loss, the key/value gradients of other ranks' queries included through the exchange's backward),
and every rank takes the same AdamW step on the same sums, so the copies stay equal (a test checks it
bit for bit on gloo). The loss is the mean cross-entropy over all predicted tokens of the sequence: each
rank divides its sum by the all-reduced count.

Task (synthetic, new tokens every step, identical on every rank): random tokens that repeat after a
period ``P``: in every unit of ``2P`` tokens the second ``P`` copy the first (documents: each document's
second half copies its first). Only the copies enter the loss, so it can fall below chance (ln vocab)
only by attending ``P - 1`` tokens back, which the mask allows: ``P`` defaults to ``window / 2`` (local),
the largest power of two of blocks at most half the blocks (butterfly: block ``i`` sees ``i - 2^k`` when
bit ``k`` of ``i`` is set; the first token of each block then has its source out of reach, a floor of
``ln(vocab) / block`` on the loss) and half the sequence (causal).

``--checkpoint`` recomputes each block in the backward (torch.utils.checkpoint, non-reentrant): the
recomputation runs the attention's exchange again, on every rank in the same order. On CUDA the blocks
run under bf16 autocast (the residual stream, norms and loss in float32).

Writes ``OUT/cp_train.csv`` (a row per step: loss, ms, tokens/s, peak GiB of the busiest rank and of each
rank -- ``n/a`` on CPU --, bytes the exchanges of all ranks sent: forward, backward and, with
``--checkpoint``, the recomputed forward), ``OUT/cp_train.json`` (GPU, versions, commit, date, world,
arguments, the plan's placement, work per rank and remote blocks, a summary), ``OUT/cp_train.png`` (loss and tokens/s
against step), progress lines while it runs and a short table last. ``--compare DIR ...`` tabulates
finished runs instead: each run's median tokens/s over the one-GPU (``--world 1``) run of the same model
and mask, in ``OUT/cp_train_compare.csv`` and ``.png``. A step's time runs from a barrier to
the end of the optimiser step (the slowest rank's); tokens/s is ``batch * seq_len`` over it. Step 0
includes Triton compilation: the summary takes the median over the later steps.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from sparseflash.cmdline import ArgumentParser, CommandError, check_output_dir, positive_int, run_command

MASKS = ("local", "butterfly", "documents", "causal")
FIELDS = ["step", "loss", "ms", "tokens_per_s", "peak_gib_max", "peak_gib_ranks", "sent_bytes", "world", "seq_len",
          "batch", "mask"]


# ------------------------------------------------------------------ the sequence as a rank sees it
class Sequence:
    """What the model needs to know about the sequence: this process's tokens and how they attend.

    ``plan`` None: the whole sequence in one process (`sparseflash.attention`). Otherwise this rank's
    shard under ``plan`` (`sparseflash.distributed.attention`). ``mask_kw``: ``mask`` / ``causal`` /
    ``segment_ids`` as `sparseflash.distributed.plan` takes them.
    """

    def __init__(self, seq_len: int, mask_kw: dict, plan=None, backend: str = "auto"):
        self.seq_len, self.mask_kw, self.plan, self.backend = seq_len, mask_kw, plan, backend
        self.local_len = seq_len if plan is None else plan.local_len

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, seq_len]`` -> this process's ``[B, local_len]`` (padding: 0)."""
        if self.plan is None:
            return x
        return self.plan.shard(x[:, None, :, None])[:, 0, :, 0]

    def attend(self, q, k, v):
        """Causal attention of this process's ``[B, H, local_len, D]`` q, k, v under the mask."""
        if self.plan is None:
            import sparseflash

            kw = self.mask_kw
            seg = kw.get("segment_ids")
            return sparseflash.attention(q, k, v, kw.get("mask"), causal=kw.get("causal", False),
                                         segment_ids=None if seg is None else seg.to(q.device)[None],
                                         backend=self.backend)
        import sparseflash.distributed as sfd

        return sfd.attention(q, k, v, self.plan, backend=self.backend)


def rotary(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[n, head_dim / 2]`` (float32) of the rotary angles at ``positions`` (computed in
    float64: at a million positions float32 angles lose the fast frequencies)."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    ang = positions.double()[:, None] * inv[None]
    return ang.cos().float(), ang.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + D/2]) of ``x [B, H, n, D]`` by the angles (in x's dtype)."""
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, head_dim: int, mlp_ratio: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.n1, self.n2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * heads * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, d_model, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(),
                                 nn.Linear(mlp_ratio * d_model, d_model))

    def forward(self, x, cos, sin, seq: Sequence):
        B, n, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = seq.attend(q, k, v.contiguous())  # [B, H, n, D]
        x = x + self.proj(o.transpose(1, 2).reshape(B, n, self.heads * self.head_dim))
        return x + self.mlp(self.n2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d_model: int, heads: int, head_dim: int, layers: int, mlp_ratio: int = 4,
                 rope_base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"--head-dim must be even (rotary positions rotate pairs), got {head_dim}")
        self.head_dim, self.rope_base = head_dim, rope_base
        self.tok = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, head_dim, mlp_ratio) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids, positions, seq: Sequence, checkpoint: bool = False):
        """Logits ``[B, n, vocab]`` of this process's token ids ``[B, n]`` at global ``positions [n]``."""
        cos, sin = rotary(positions, self.head_dim, self.rope_base)
        x = self.tok(ids)
        for blk in self.blocks:
            if checkpoint:
                x = torch.utils.checkpoint.checkpoint(blk, x, cos, sin, seq, use_reentrant=False)
            else:
                x = blk(x, cos, sin, seq)
        return self.head(self.norm(x))


# ------------------------------------------------------------------ the task
def default_period(mask: str, seq_len: int, block: int, window: int) -> int:
    if mask == "local":
        return max(1, window // 2)
    if mask == "butterfly":
        half = max(1, math.ceil(seq_len / block) // 2)
        return block * (1 << (half.bit_length() - 1))
    return max(1, seq_len // 2)


def check_period(mask: str, period: int, seq_len: int, block: int, window: int) -> None:
    """The copy's source must be visible under the mask (``--period`` errors name the option)."""
    if mask == "local" and period > window:
        raise ValueError(f"--period {period} is longer than --window {window}: the copies' sources would be out of "
                         f"the local window (at most --window)")
    if mask == "butterfly":
        nb = math.ceil(seq_len / block)
        padded = 1 << max(0, (nb - 1).bit_length())
        blocks = period // block
        if period % block or blocks & (blocks - 1) or blocks >= padded:
            raise ValueError(f"--period {period} must be {block} (--block) times a power of two below {padded} "
                             f"(the butterfly's grid): block i sees block i - 2^k only")


def mask_setup(args, device) -> dict:
    """The plan's keyword arguments for ``--mask`` (always causal: a language model)."""
    from sparseflash.experiments.bench.context_parallel import doc_ids, window_mask

    n = args.seq_len
    if args.mask == "local":
        return {"mask": window_mask(n, args.window, args.block, device), "causal": True}
    if args.mask == "butterfly":
        from sparseflash.patterns import butterfly

        return {"mask": butterfly(n, block_size=args.block, device=device), "causal": True}
    if args.mask == "documents":
        return {"causal": True, "segment_ids": doc_ids(n, args.doc_min, args.doc_max, seed=args.seed)}
    return {"causal": True}


def copy_sources(seq_len: int, period: int | None, segment_ids: torch.Tensor | None):
    """(src, copy): ``src[t]`` the position token t repeats (itself if it is fresh) and ``copy[t]``."""
    t = torch.arange(seq_len)
    if segment_ids is None:
        copy = (t % (2 * period)) >= period
        return torch.where(copy, t - period, t), copy
    seg = segment_ids.reshape(-1).long()
    _, lengths = torch.unique_consecutive(seg, return_counts=True)
    starts = torch.cumsum(lengths, 0) - lengths
    start, half = starts.repeat_interleave(lengths), (lengths // 2).repeat_interleave(lengths)
    u = t - start
    copy = (u >= half) & (u < 2 * half)
    return torch.where(copy, t - half, t), copy


def make_batch(step: int, batch: int, vocab: int, src: torch.Tensor, copy: torch.Tensor, seed: int):
    """(ids, targets, weights), each ``[batch, seq_len]``, the same on every rank: ``targets[t] =
    ids[t + 1]``, weight 1 where that target is a copy (0 elsewhere and at the last position)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    fresh = torch.randint(0, vocab, (batch, src.numel()), generator=g)
    ids = fresh[:, src]
    targets = torch.nn.functional.pad(ids[:, 1:], (0, 1))
    weights = torch.nn.functional.pad(copy[1:], (0, 1)).float().expand(batch, -1)
    return ids, targets, weights


# ------------------------------------------------------------------ training
def _world_sum(x: torch.Tensor, distributed: bool) -> torch.Tensor:
    if distributed:
        dist.all_reduce(x)
    return x


def sync_gradients(model: nn.Module, distributed: bool) -> None:
    """Sum every parameter gradient over the ranks: one all-reduce of one flat buffer."""
    if not distributed:
        return
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    off = 0
    for p in params:
        p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
        off += p.numel()


def loss_and_backward(model, seq: Sequence, ids, targets, weights, positions, *, checkpoint: bool,
                      autocast: bool, distributed: bool) -> float:
    """This process's share of the mean copy loss over the whole sequence, backward included; the
    gradients are this process's share too (`sync_gradients` sums them). Returns the global loss."""
    ids_l, tgt_l, w_l = seq.shard(ids), seq.shard(targets), seq.shard(weights)
    count = _world_sum(w_l.sum().reshape(1), distributed)  # the same on every rank
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(ids_l, positions, seq, checkpoint=checkpoint)
    ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tgt_l.flatten(), reduction="none")
    loss = (ce * w_l.flatten()).sum() / count.clamp(min=1)
    loss.backward()
    return float(_world_sum(loss.detach().reshape(1), distributed))


def build(args, device, distributed: bool):
    """(model, optimiser, Sequence, local positions, (src, copy), plan seconds), the same on every rank."""
    mask_kw = mask_setup(args, device)
    t0 = time.perf_counter()
    plan = None
    if distributed:
        import sparseflash.distributed as sfd

        plan = sfd.plan(args.seq_len, None, block_size=args.block, **mask_kw)
    plan_s = time.perf_counter() - t0
    seq = Sequence(args.seq_len, mask_kw, plan, args.backend)
    positions = seq.shard(torch.arange(args.seq_len)[None])[0].to(device)
    if args.mask == "documents":
        sources = copy_sources(args.seq_len, None, mask_kw["segment_ids"])
    else:
        period = args.period or default_period(args.mask, args.seq_len, args.block, args.window)
        check_period(args.mask, period, args.seq_len, args.block, args.window)
        sources = copy_sources(args.seq_len, period, None)
    if not bool(sources[1][1:].any()):
        raise ValueError(f"--seq-len {args.seq_len}: no token is a copy (the period or the documents are longer "
                         f"than the sequence), so there is nothing to learn")
    torch.manual_seed(args.seed)  # the same parameters on every rank
    model = TinyLM(args.vocab, args.d_model or args.heads * args.head_dim, args.heads, args.head_dim, args.layers,
                   args.mlp_ratio, args.rope_base).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    return model, opt, seq, positions, sources, plan_s


def train(args, device, rank: int, world: int, log=None):
    """Run ``args.steps`` steps; returns (rows, meta extras, model). ``log``: a function of one line."""
    distributed = world > 1
    model, opt, seq, positions, (src, copy), plan_s = build(args, device, distributed)
    cuda = device.type == "cuda"
    if log is not None:
        where = "one process" if seq.plan is None else (
            f"plan {seq.plan.placement} in {plan_s:.1f} s, {seq.local_len} tokens per rank, "
            f"work per rank {seq.plan.work}")
        log(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; {where}; "
            f"{int(copy[1:].sum())} copied tokens per sequence")
    rows = []
    for step in range(args.steps):
        ids, targets, weights = (t.to(device) for t in make_batch(step, args.batch, args.vocab, src, copy, args.seed))
        if seq.plan is not None:
            seq.plan.bytes_sent = 0
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_and_backward(model, seq, ids, targets, weights, positions, checkpoint=args.checkpoint,
                                 autocast=cuda, distributed=distributed)
        sync_gradients(model, distributed)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        ms = 1e3 * (time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
        sent = seq.plan.bytes_sent if seq.plan is not None else 0
        mine = torch.tensor([ms, peak, float(sent)], dtype=torch.float64,
                            device=seq.plan.comm_device if distributed else "cpu")
        every = [torch.zeros_like(mine) for _ in range(world)]
        if distributed:
            dist.all_gather(every, mine)
        else:
            every = [mine]
        every = torch.stack(every).cpu()
        ms_max = float(every[:, 0].max())
        peaks = every[:, 1].tolist()
        row = dict(step=step, loss=loss, ms=ms_max, tokens_per_s=args.batch * args.seq_len / (ms_max / 1e3),
                   peak_gib_max=max(peaks) if cuda else "n/a",
                   peak_gib_ranks=";".join(f"{p:.2f}" for p in peaks) if cuda else "n/a",
                   sent_bytes=int(every[:, 2].sum()), world=world, seq_len=args.seq_len, batch=args.batch,
                   mask=args.mask)
        rows.append(row)
        if log is not None and (step % args.log_every == 0 or step == args.steps - 1):
            mem = f"{row['peak_gib_max']:.1f} GiB" if cuda else "n/a"
            log(f"step {step + 1}/{args.steps}  loss {loss:.4f}  {ms_max:.0f} ms  "
                f"{row['tokens_per_s'] / 1e3:.1f}K tok/s  peak {mem}")
    extras = {"plan_s": plan_s, "params": sum(p.numel() for p in model.parameters()),
              "chance_loss": math.log(args.vocab), "local_len": seq.local_len,
              "loss_tokens_per_step": int(copy[1:].sum()) * args.batch}
    if seq.plan is not None:
        p = seq.plan
        extras.update(placement=p.placement, work_per_rank=list(p.work), blocks_per_rank=p.blocks_per_rank,
                      traffic_blocks=p.traffic_blocks)
    return rows, extras, model


# ------------------------------------------------------------------ output
def plot(rows: list[dict], path: Path, title: str, chance: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparseflash.experiments.bench.plots import save_figure

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [r["step"] for r in rows]
    a.plot(steps, [r["loss"] for r in rows])
    a.axhline(chance, color="grey", ls="--", lw=1, label="chance (ln vocab)")
    a.legend(fontsize=8)
    a.set_xlabel("step")
    a.set_ylabel("loss on the copied tokens")
    a.grid(True, alpha=0.3)
    b.plot(steps, [r["tokens_per_s"] / 1e3 for r in rows])
    b.set_xlabel("step")
    b.set_ylabel("K tokens / s")
    b.set_yscale("log")
    b.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def summary(rows: list[dict]) -> dict:
    """Medians over the steps after the first (compilation), and the loss at both ends."""
    later = rows[1:] or rows
    tail = rows[-max(1, len(rows) // 10):]
    peaks = [r["peak_gib_max"] for r in rows if r["peak_gib_max"] != "n/a"]
    return {"first_loss": rows[0]["loss"], "last_loss": statistics.mean(r["loss"] for r in tail),
            "median_ms": statistics.median(r["ms"] for r in later),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in later),
            "peak_gib_max": max(peaks) if peaks else "n/a"}


def write_outputs(out: Path, rows, meta) -> None:
    with open(out / "cp_train.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    with open(out / "cp_train.json", "w") as f:
        json.dump(meta, f, indent=1)
    a = meta["args"]
    title = (f"{a['layers']} layers, {a['heads']} heads x {a['head_dim']}, {a['mask']} mask, {a['seq_len']} tokens x "
             f"{a['batch']}, {meta['world']} x {meta['gpu']}")
    try:
        plot(rows, out / "cp_train.png", title, meta["chance_loss"])
    except Exception as e:  # noqa: BLE001 - the CSV is the result; a figure problem is reported
        print(f"figure not made: {e}", file=sys.stderr)


def print_table(rows, meta) -> None:
    s = meta["summary"]
    pick = sorted({0, 1, *range(0, len(rows), max(1, len(rows) // 6)), len(rows) - 1} & set(range(len(rows))))
    print(f"{'step':>5} {'loss':>8} {'ms':>9} {'tok/s':>10} {'peak GiB':>9}")
    for i in pick:
        r = rows[i]
        pk = f"{r['peak_gib_max']:.2f}" if r["peak_gib_max"] != "n/a" else "n/a"
        print(f"{r['step']:>5} {r['loss']:>8.4f} {r['ms']:>9.1f} {r['tokens_per_s']:>10.0f} {pk:>9}")
    pk = s["peak_gib_max"] if s["peak_gib_max"] == "n/a" else f"{s['peak_gib_max']:.2f} GiB"
    print(f"world {meta['world']} ({meta['gpu']}), {meta['args']['seq_len']} tokens x {meta['args']['batch']}, "
          f"mask {meta['args']['mask']}: median {s['median_ms']:.1f} ms/step, {s['median_tokens_per_s']:.0f} tokens/s, "
          f"peak {pk} per rank (max); loss {s['first_loss']:.3f} -> {s['last_loss']:.3f} "
          f"(chance {meta['chance_loss']:.3f})")


COMPARE_FIELDS = ["run", "gpu", "world", "seq_len", "batch", "mask", "checkpoint", "steps", "median_ms",
                  "tokens_per_s", "speedup_vs_1gpu", "one_gpu_seq_len", "peak_gib_max", "first_loss", "last_loss",
                  "commit", "date"]


def compare(dirs, out: Path) -> list[dict]:
    """One row per finished run folder: median tokens/s against the one-process (``--world 1``) run of
    the same mask and model (the longest such run: the longest length that fitted on one GPU)."""
    runs = []
    for d in dirs:
        path = Path(d) / "cp_train.json"
        if not path.is_file():
            raise CommandError(f"--compare: {d} holds no cp_train.json", "give folders that cp_train wrote")
        meta = json.loads(path.read_text())
        a, s = meta["args"], meta["summary"]
        model = tuple(a[k] for k in ("mask", "layers", "heads", "head_dim", "d_model", "vocab", "block", "window"))
        runs.append((model, dict(run=Path(d).name, gpu=meta["gpu"], world=meta["world"], seq_len=a["seq_len"],
                                 batch=a["batch"], mask=a["mask"], checkpoint=a["checkpoint"], steps=a["steps"],
                                 median_ms=s["median_ms"], tokens_per_s=s["median_tokens_per_s"],
                                 peak_gib_max=s["peak_gib_max"], first_loss=s["first_loss"],
                                 last_loss=s["last_loss"], commit=meta["commit"], date=meta["date"])))
    rows = []
    for model, r in runs:
        ones = [o for m, o in runs if m == model and o["world"] == 1]
        base = max(ones, key=lambda o: (o["seq_len"] * o["batch"], o["tokens_per_s"]), default=None)
        r["speedup_vs_1gpu"] = r["tokens_per_s"] / base["tokens_per_s"] if base else ""
        r["one_gpu_seq_len"] = base["seq_len"] if base else ""
        rows.append(r)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "cp_train_compare.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COMPARE_FIELDS)
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from sparseflash.experiments.bench.plots import save_figure

        fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(rows)), 3.8))
        ax.bar(range(len(rows)), [r["tokens_per_s"] / 1e3 for r in rows])
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([f"{r['mask']}\n{r['world']} x {r['seq_len'] // 1024}K" for r in rows], fontsize=8)
        for i, r in enumerate(rows):
            pk = "" if r["peak_gib_max"] == "n/a" else f"{r['peak_gib_max']:.0f} GiB"
            ax.annotate(pk, (i, r["tokens_per_s"] / 1e3), ha="center", va="bottom", fontsize=7)
        ax.set_ylabel("K tokens / s (median step)")
        ax.set_title(f"training throughput, {rows[0]['gpu']}", fontsize=9)
        save_figure(fig, out / "cp_train_compare.png")
    except Exception as e:  # noqa: BLE001 - the CSV is the result
        print(f"figure not made: {e}", file=sys.stderr)
    print(f"wrote {out / 'cp_train_compare.csv'}")
    print(f"{'run':24} {'world':>5} {'tokens':>8} {'mask':10} {'ckpt':>5} {'ms/step':>9} {'tok/s':>10} "
          f"{'x 1 GPU':>8} {'peak GiB':>9} {'loss':>14}")
    for r in rows:
        sp = f"{r['speedup_vs_1gpu']:.2f}" if r["speedup_vs_1gpu"] != "" else ""
        pk = r["peak_gib_max"] if r["peak_gib_max"] == "n/a" else f"{r['peak_gib_max']:.1f}"
        print(f"{r['run'][:24]:24} {r['world']:>5} {r['seq_len']:>8} {r['mask']:10} {str(r['checkpoint']):>5} "
              f"{r['median_ms']:>9.1f} {r['tokens_per_s']:>10.0f} {sp:>8} {pk:>9} "
              f"{r['first_loss']:>6.3f}->{r['last_loss']:<6.3f}")
    return rows


# ------------------------------------------------------------------ command
def parse(argv=None):
    ap = ArgumentParser(prog="python -m sparseflash.experiments.cp_train", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for cp_train.csv, .json and .png")
    ap.add_argument("--world", type=positive_int, default=None,
                    help="ranks: 1 runs one process without torchrun; default: torchrun's WORLD_SIZE, else 1")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: gloo, float32")
    ap.add_argument("--backend", default="auto", help="sparseflash.attention's backend (CPU tests: reference)")
    ap.add_argument("--mask", choices=MASKS, default="local")
    ap.add_argument("--window", type=positive_int, default=4096, help="--mask local: keys i-window+1 .. i")
    ap.add_argument("--doc-min", type=positive_int, default=2048, help="--mask documents: shortest document")
    ap.add_argument("--doc-max", type=positive_int, default=65536, help="--mask documents: longest document")
    ap.add_argument("--period", type=positive_int, default=None,
                    help="copy period in tokens (default: by --mask, see the module doc; not with documents)")
    ap.add_argument("--seq-len", type=positive_int, default=1 << 20)
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--block", type=positive_int, default=128)
    ap.add_argument("--layers", type=positive_int, default=4)
    ap.add_argument("--heads", type=positive_int, default=8)
    ap.add_argument("--head-dim", type=positive_int, default=128)
    ap.add_argument("--d-model", type=positive_int, default=None, help="width (default heads * head-dim)")
    ap.add_argument("--mlp-ratio", type=positive_int, default=4)
    ap.add_argument("--vocab", type=positive_int, default=32)
    ap.add_argument("--rope-base", type=float, default=10000.0)
    ap.add_argument("--steps", type=positive_int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", action="store_true", help="recompute each block in the backward")
    ap.add_argument("--log-every", type=positive_int, default=5)
    ap.add_argument("--compare", nargs="+", metavar="RUN_DIR", default=None,
                    help="no training: tabulate finished runs (tokens/s against the --world 1 run of the same "
                         "model), writing OUT/cp_train_compare.csv and .png")
    args = ap.parse_args(argv)
    if args.mask == "documents" and args.period is not None:
        ap.error("--period does not apply to --mask documents (each document's second half copies its first)")
    if args.doc_min > args.doc_max:
        ap.error(f"--doc-min {args.doc_min} is above --doc-max {args.doc_max}")
    if not args.lr > 0:
        ap.error(f"--lr must be > 0, got {args.lr}")
    return args


def _world(args) -> int:
    env = os.environ.get("WORLD_SIZE")
    launched = int(env) if env else None
    world = args.world or launched or 1
    if launched is None and world > 1:
        raise CommandError(f"--world {world} needs one process per rank",
                           f"run it as torchrun --nproc-per-node {world} -m sparseflash.experiments.cp_train ...")
    if launched is not None and world != launched:
        raise CommandError(f"--world {world} but torchrun started {launched} processes",
                           f"leave --world out, or start {world} processes")
    return world


def main(argv=None) -> int:
    args = parse(argv)
    if args.compare:
        compare(args.compare, check_output_dir(args.out))
        return 0
    world = _world(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CommandError("--device cuda without a CUDA GPU", "pass --device cpu")
    # only rank 0 writes the outputs: the others must not race it in check_output_dir's probe (which
    # makes the folder and removes it again)
    out = check_output_dir(args.out) if int(os.environ.get("RANK", 0)) == 0 else Path(args.out)
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank = 0
    if world > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        rank = dist.get_rank()
    import triton

    from sparseflash.experiments.bench.results import git_commit

    def log(line):
        if rank == 0:
            print(line, file=sys.stderr, flush=True)

    log(f"cp_train: world {world}, {args.seq_len} tokens x {args.batch}, mask {args.mask}, {args.layers} layers, "
        f"{args.heads} heads x {args.head_dim}, checkpoint {args.checkpoint}, {args.steps} steps")
    # a failure leaves the process group as it is: a rank may have posted sends its peers never matched, and
    # tearing the group down could wait on them; the process exits and torchrun stops the other ranks
    try:
        rows, extras, _ = train(args, device, rank, world, log)
    except torch.cuda.OutOfMemoryError as e:
        raise CommandError(f"out of memory at --seq-len {args.seq_len} x --batch {args.batch} on {world} GPU(s), "
                           f"rank {rank}: {str(e).splitlines()[0][:160]}",
                           "pass --checkpoint, or a shorter --seq-len") from None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    torch=torch.__version__, triton=triton.__version__, commit=git_commit(),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    world=world, args=vars(args), **extras)
        meta["summary"] = summary(rows)
        write_outputs(out, rows, meta)
        print(f"wrote {out / 'cp_train.csv'}, {out / 'cp_train.json'}, {out / 'cp_train.png'}")
        print_table(rows, meta)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    rc = run_command(main)
    if os.environ.get("LOCAL_RANK") is not None:
        # A torchrun rank whose run is done (outputs written, process group destroyed) leaves without
        # the interpreter's teardown: a CPU 2-rank run has aborted there now and then ("terminate called
        # without an active exception", a C++ thread still joinable at exit; about 1 run in 20),
        # turning a finished run into a failed one.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    sys.exit(rc)
