"""Training (and self-pretraining) of the LRA / Path-X classifiers, on one device or data-parallel under ``torchrun``.

    sparseflash lra train --task listops --config quick --data DIR --attention sparseflash \\
        --pattern butterfly --out runs/listops-bf [--max-steps N] [--device cpu|cuda] [--time-limit MIN]
    sparseflash lra train ... --objective denoise  (self-pretraining: see below; then --init-from its best.pt)
    sparseflash lra train ... --resume            (same flags: continue OUT/checkpoints/last.pt)
    sparseflash lra train ... --overwrite         (start afresh in an OUT that holds a run; else it is refused)
    torchrun --nproc-per-node 4 -m sparseflash.experiments.lra.train ...      (same flags)

What a run does: bf16 autocast on CUDA, AdamW (no decay on biases, norms and embeddings), warm-up
then linear / cosine / inverse-sqrt decay, gradient clipping; evaluation on val every
``eval_every`` steps and at the end of the schedule, and at the end on test with the final and the
best-on-val weights; checkpoints ``OUT/checkpoints/{last,best}.pt``; ``OUT/metrics.jsonl`` plus
``train.csv`` / ``eval.csv``; ``OUT/config.json`` (the config and the ``commit`` of the command that began
the run) and ``OUT/summary.json``. A command that fails
before its run recorded a step (a bad pattern, a checkpoint that cannot be read, an error in the
first step) removes what it wrote, so the corrected command finds ``OUT`` as it was.

Reproducibility. The data order is a pure function of (seed, step): epoch e is a permutation drawn
from (seed, e), and step s takes batch ``s mod steps_per_epoch`` of epoch ``s // steps_per_epoch``.
A full checkpoint (``last.pt``, every ``save_every`` steps and when a command ends) stores model,
optimizer, scheduler, step, the best-on-val record and weights, the RNG states of torch (CPU and
CUDA), NumPy and Python of every rank, and the byte size of each log file. ``--resume`` restores all
of it and cuts the logs back to those sizes (dropping what a command wrote after its checkpoint)
before appending, so a run split over any number of commands ends bit-identical to one
uninterrupted run (on CPU; on a GPU as far as its kernels are deterministic): weights, optimizer,
logs, best.pt, summary (but its wall-clock fields). ``--max-steps`` ends a run early without
changing the schedule (defined by ``train.steps`` or ``train.epochs``); its closing validation,
off the ``eval_every`` grid, comes after the checkpoint, so a resumed run never sees it. ``--resume``
checks the run's ``config.json`` against the checkpoint's config (a damaged or differing one is
refused) and never rewrites it; it keeps each earlier command's record in ``segments`` as that
command's summary wrote it; a run that has already ended where the command would end it is left
as it is (nothing runs).

Stopping early, for machines that end a command after a fixed time. SIGTERM or SIGINT (to the main
process or the whole process group; data-loader workers ignore them, and end with the main process
however it ends) ends the command after the step in progress with a full checkpoint, the line
"stopped at step N by SIGTERM; continue with --resume", and exit status 75 (`EXIT_STOPPED`); a
second signal acts at once. ``--time-limit MIN`` does the same before a step that, with the
evaluation and checkpoint it triggers, is predicted not to end within MIN minutes of the command's
start (see `_Stopper`). ``summary.json`` lists the run's commands in ``segments`` (step range, wall
time, how each ended, the commit of its code, host, GPU, command line) and their total wall time in
``wall_s_total``; a stopped command writes it with ``stopped_by`` set. ``commit`` (summary.json and
each segment) is `provenance.code_commit`: ``SPARSEFLASH_COMMIT`` when set (a snapshot sent to a
GPU), else git HEAD, ``+dirty`` if the code differs from it.

Data parallel. ``torchrun`` sets WORLD_SIZE; each rank then takes a contiguous slice of size
``batch_size / world`` of the same global batch, DDP averages gradients (NCCL on CUDA, gloo on
CPU), so the effective batch and the update equal a single-process run (up to float summation
order; dropout masks differ per rank). Only rank 0 logs and writes files. The ranks agree on
stopping through an all-reduce of one number per step. With ``--cuda-graphs`` the ranks run the
module itself and average the gradients with one all-reduce of a flat buffer (`average_gradients`),
captured inside each rank's graphed step: a DDP wrapper holds the parameters' gradient accumulators
bound to the stream they were made on, which a capture cannot take (`GraphedTrainStep`).

Path-X / Path-256: ``--init-from CKPT`` loads a model trained at a smaller resolution and
upsamples its 2-D position grid (2x2 duplication from Path-64 to Path-X).

CUDA graphs. ``--cuda-graphs`` (CUDA, classifier, not with ``--compile``) replays each
training step from a CUDA graph (`GraphedTrainStep`): forward, loss, backward, clipping, AdamW and
the log window's update, one graph per bucket of (attended width, nothing is padding), captured when
first seen, at most ``--max-graphs`` (16; past it a batch takes the narrowest wider graph, else an
eager step, with one warning). With ``model.black_is_padding`` the width is the batch's widest image
rounded up to the block size, computed by the loader's workers from the CPU batch
(`collate_planned`, `model.host_plan`), so a step reads nothing back from the device: its host cost
is three input copies, the lr and a replay, where the eager Path-X step is bound by the host's
launches. The optimizer's first step runs eagerly (it makes the AdamW state); evaluation stays
eager. A capture needs every autograd graph through the parameters gone (a caller keeping an eager
step's loss or logits gets a clear error instead of a failed capture). Dropout draws fresh masks at
each replay from the device generator (sparseflash's attention dropout draws its seed there too), so
a run with dropout is statistically, not bitwise, the eager one, and a resumed run (its graphs
captured anew) is not bit-identical to an uninterrupted one; without dropout the losses and weights
agree with eager training to float rounding (test_gpu_cuda_graphs_match_eager). Checkpoints are the
same as eager ones (float lrs; only the groups' ``capturable`` flag differs, set by each command)
and resume either way.

Self-pretraining (SPT; Amos, Berant & Gupta, "Never Train from Scratch", ICLR 2024).
``--objective denoise`` (``train.objective``) trains the same encoder, on the task's own training
inputs and without labels, to fill in masked tokens, for a classifier to start from:

    sparseflash lra train --task pathfinder32 --config faithful --data DIR --objective denoise --out runs/spt
    sparseflash lra train --task pathfinder32 --config faithful --data DIR \
        --init-from runs/spt/checkpoints/best.pt --out runs/ft

- Masking: in every sequence exactly ``k = min(L, max(1, round(mask_ratio * L)))`` of its ``L``
  real tokens (never padding; each document of a Retrieval pair on its own), uniformly at random
  (`mask_positions`), ``train.mask_ratio`` 0.15 by default. The draw is ``torch.rand`` on the
  device, the generator that also drives dropout, so the masks are part of the checkpointed RNG
  state and ``--resume`` stays bit-identical; each rank draws its own.
- Model (`LRADenoiser`): masked positions get a learned vector (``mask_embed``) instead of their
  token embedding (the table or ``model.embed=pixel``), plus their position embedding; the encoder
  is the classifier's (attention backend, pattern, positions, CLS, augmentation); an untied MLM
  head (Linear, GELU, LayerNorm, Linear to the vocabulary) predicts every position, and the loss is
  the cross-entropy (with ``train.label_smoothing``) at the masked positions only.
- Logs: ``train.csv`` keeps its columns (loss and accuracy of the masked tokens); ``eval.csv``
  has ``step, split, weights, loss, acc, tokens, n, time_s``: masked-token loss and accuracy,
  ``tokens`` masked tokens in ``n`` sequences. Evaluation masks are fixed per example (`eval_mask`:
  the generator of ``(EVAL_MASK_SEED, index)``), so every evaluation, run and rank count agree.
  ``best.pt`` holds the weights of the lowest validation loss (classify: highest accuracy);
  ``summary.json`` has ``objective`` (and ``mask_ratio``).
- Fine-tuning: ``--init-from`` requires the encoder (``encoder.*``) to fit, upsampling a position
  grid as above, and skips what the other objective has (a denoiser's ``mask_embed`` and
  ``denoise_head.*``, a classifier's ``head.*``), printing the skipped and the freshly initialised
  keys; so Path-64 SPT -> Path-X classifier works too.
- Data parallel: each rank draws its own masks and averages the loss over its own masked tokens
  before DDP averages the ranks, so unlike the classifier a run does not repeat a single-process
  one (the objective is the same).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import functools
import gc
import json
import math
import os
import platform
import random
import shlex
import signal
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sparseflash.experiments.lra.checkpoints import load_checkpoint, model_weights
from sparseflash.experiments.lra.configs import (
    OBJECTIVES, TASKS, VARIANTS, ExperimentConfig, TrainConfig, config_from_dict, get_config)
from sparseflash.experiments.lra.model import (
    ATTENTIONS, LRAClassifier, LRADenoiser, ModelConfig, host_plan, load_pretrained, mask_positions, parse_pattern_spec)
from sparseflash.experiments.lra.provenance import code_commit

__all__ = ["train", "evaluate", "build_model", "freeze_parameters", "average_gradients", "eval_mask", "denoise_loss", "StepBatches", "collate", "collate_planned",
           "lr_factor", "register_lra", "main", "EXIT_STOPPED", "EVAL_MASK_SEED", "add_data_arguments",
           "add_device_arguments", "GraphedTrainStep", "graph_bucket", "check_cuda_graphs", "MAX_GRAPHS"]

_TRAIN_COLS = ("step", "epoch", "lr", "loss", "acc", "grad_norm", "step_ms", "tokens_per_s", "mem_gb", "time_s")
_EVAL_COLS = ("step", "split", "weights", "loss", "acc", "n", "time_s")
# denoise: loss and acc over the masked tokens, `tokens` of them, in `n` sequences
_EVAL_COLS_DENOISE = ("step", "split", "weights", "loss", "acc", "tokens", "n", "time_s")
EVAL_MASK_SEED = 20240  # denoise evaluation: example i of a split is masked by the generator of (EVAL_MASK_SEED, i)


# ------------------------------------------------------------------------------------------- data
class StepBatches:
    """Infinite batch sampler: the indices of this rank for every step from ``start_step`` on."""

    def __init__(self, n: int, global_batch: int, seed: int, rank: int = 0, world: int = 1, start_step: int = 0):
        if n < global_batch:
            raise ValueError(f"the training set has {n} examples, fewer than one batch of {global_batch}")
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self.rank, self.world, self.start_step = rank, world, start_step
        self.per_rank = global_batch // world
        self.steps_per_epoch = n // global_batch  # the last partial batch of an epoch is dropped

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def __iter__(self):
        step, cached = self.start_step, (None, None)
        while True:
            epoch, i = divmod(step, self.steps_per_epoch)
            if cached[0] != epoch:
                cached = (epoch, self.order(epoch))
            batch = cached[1][i * self.global_batch:(i + 1) * self.global_batch]
            yield batch[self.rank * self.per_rank:(self.rank + 1) * self.per_rank].tolist()
            step += 1


_TOKEN_DTYPES = (torch.int16, torch.int32, torch.int64)


def collate(items: list[dict]) -> dict:
    """Stack loader items: tokens ``[B, N]`` (``[B, 2, N]`` for Retrieval), lengths, labels. Tokens
    an item gives as int16 or int32 stay so (a Path-256 batch of int64 is 16 MB to pass between
    processes and copy to the device; int16 is 4 MB), others become int64; the training and
    evaluation steps make them int64 on the device."""
    toks = [torch.as_tensor(it["tokens"]) for it in items]
    return {
        "tokens": torch.stack([t if t.dtype in _TOKEN_DTYPES else t.long() for t in toks]),
        "lengths": torch.stack([torch.as_tensor(it["length"], dtype=torch.long) for it in items]),
        "labels": torch.tensor([int(it["label"]) for it in items], dtype=torch.long),
    }


def collate_planned(model_cfg: ModelConfig, items: list[dict]) -> dict:
    """`collate` plus ``plan``, the batch's `host_plan` (attended width, nothing is padding), for
    --cuda-graphs: computed here, in the loader's workers, from the CPU tensors, so the training
    step picks its graph without reading the device."""
    b = collate(items)
    b["plan"] = host_plan(model_cfg, b["tokens"], b["lengths"])
    return b


def load_datasets(cfg: ExperimentConfig, root, cache_dir=None) -> dict:
    from sparseflash.experiments.lra.data import get_dataset  # written alongside; imported when needed

    return {split: get_dataset(cfg.task, root, split, cache_dir=cache_dir, **cfg.data) for split in ("train", "val", "test")}


def fit_to_data(cfg: ExperimentConfig, ds) -> None:
    """Take vocabulary, classes and length from the training set; check single vs dual input."""
    m = cfg.model
    m.vocab_size, m.num_classes = int(ds.vocab_size), int(ds.num_classes)
    if int(ds.seq_len) != m.seq_len:
        m.seq_len = int(ds.seq_len)
        if m.pos_emb.startswith("grid") or m.augment == "dihedral":
            side = math.isqrt(m.seq_len)
            if side * side != m.seq_len:
                raise ValueError(f"dataset length {m.seq_len} is not a square image, but the model uses a 2-D grid")
            m.grid = (side, side)
    dual = torch.as_tensor(ds[0]["tokens"]).dim() == 2
    if dual != m.dual:
        raise ValueError(f"task {cfg.task}: dataset gives {'pairs of' if dual else 'single'} sequences but model.dual={m.dual}")


# --------------------------------------------------------------------------------------- schedule
def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Multiplier of the base lr for the update after ``step`` completed steps."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "inverse_sqrt":
        return math.sqrt(max(warmup, 1) / (step + 1))
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return min_ratio + (1 - min_ratio) * (1 - progress)
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}")


def freeze_parameters(model: torch.nn.Module, prefixes) -> int:
    """Turns off ``requires_grad`` of every parameter named by one of ``prefixes`` (the name itself or
    a dotted prefix of it: ``"encoder.pos"`` holds ``encoder.pos.grid``); returns how many numbers
    were frozen. A prefix that names no parameter is an error (a typo would train everything)."""
    names = [n for n, _ in model.named_parameters()]
    total = 0
    for prefix in prefixes:
        hit = [n for n in names if n == prefix or n.startswith(prefix + ".")]
        if not hit:
            roots = sorted({n.rsplit(".", 1)[0] for n in names})
            raise ValueError(f"train.freeze: {prefix!r} names no parameter of this model; its modules are {roots}")
        for n, p in model.named_parameters():
            if n in hit and p.requires_grad:
                p.requires_grad_(False)
                total += p.numel()
    return total


def average_gradients(params, world: int) -> None:
    """Average the gradients of ``params`` over the ``world`` data-parallel ranks, as DDP does, with
    one all-reduce of a flat buffer (the step with ``--cuda-graphs``, where the ranks run the module
    without a DDP wrapper; inside a captured step the collective is captured too). Every rank calls
    it exactly once per update, eager or replayed, so the collectives pair up whichever graph (width
    bucket) each rank's half of the batch takes."""
    if world <= 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _optimizer(model, tc, device, capturable: bool = False):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:  # train.freeze
            continue
        # Matrices of linear layers decay; biases, norms, embeddings and position tables do not.
        (decay if p.dim() >= 2 and "embed" not in name and ".pos." not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kw = {"fused": True} if device.type == "cuda" else {}
    if capturable:  # --cuda-graphs: the step may be captured (fused AdamW keeps its step counts on the device either way)
        kw["capturable"] = True
    return torch.optim.AdamW(groups, lr=tc.lr, betas=tuple(tc.betas), eps=tc.eps, **kw)


# ------------------------------------------------------------------------------ distributed, state
def _dist_setup(device: str | None):
    """(rank, world, device); initialises the process group under torchrun if not done yet."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    if world > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if world > 1 else "cuda"
    return rank, world, torch.device(device)


def close_distributed() -> None:
    """Tear the process group down on every rank together.

    The barrier makes each rank wait until all ranks have finished their queued collectives (DDP's
    bucketed all-reduces and the evaluation's all-reduce run asynchronously on gloo's worker
    threads) before any of them destroys its group, and the collection frees work handles that
    still hold tensors, so that no gloo thread is left touching Python objects at interpreter exit.
    A 2-rank gloo run aborted once in CI ("terminate called without an active exception") when
    ranks destroyed their groups unsynchronised.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _rng_state() -> dict:
    """Every RNG's state as tensors and plain values, so that a checkpoint loads with weights_only=True."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
            "python": random.getstate()}


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    name, keys, pos, has_gauss, gauss = s["numpy"]
    keys = keys.numpy() if torch.is_tensor(keys) else keys  # an array in checkpoints of older versions
    np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = s["python"]
    random.setstate((version, tuple(internal), gauss_next))


def _gather(obj, world):
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


# what `_Run.save_full` writes and `--resume` reads (older checkpoints lack the others: see `_Run._load_checkpoint`)
_FULL_CHECKPOINT = ("model", "config", "step", "best", "optimizer", "scheduler", "rng")


def _write_json(path: Path, obj) -> None:
    """``path`` holds ``obj`` as JSON, whole or not at all (a process killed while writing leaves the old file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def _read_run_json(path: Path) -> dict | None:
    """A run's config.json or summary.json as a dict, None when there is none; a file that is not
    a JSON object raises ValueError naming it."""
    from sparseflash.cmdline import read_json_object

    return read_json_object(path, "restore it, or delete it and --resume writes it again from the checkpoint")


def _config_diff(saved, ours: dict) -> list[str]:
    """The fields in which the config ``saved`` (a checkpoint's, a config.json) differs from ``ours``
    (``["everything"]`` when ``saved`` is no run config). A field ``saved`` lacks is newer than the
    run, which ran with its default behaviour."""
    if not (isinstance(saved, dict) and all(isinstance(saved.get(s), dict) for s in ("model", "train"))
            and all(k in saved for k in ("task", "data"))):
        return ["everything (it holds no run config: task, data, model, train)"]
    defaults = {"model": ModelConfig().__dict__, "train": TrainConfig().__dict__}
    diff = sorted(f"{s}.{k}" for s in ("model", "train") for k in ours[s]
                  if saved[s].get(k, defaults[s].get(k)) != ours[s][k])
    return diff + [k for k in ("task", "data") if saved[k] != ours[k]]


def _same_command(a: dict, b: dict) -> bool:
    """Whether two records of ``segments`` are of the same command (the summary's record of it is
    written when it ends, the checkpoint's at its last save)."""
    return all(a.get(k) == b.get(k) for k in ("started", "start_step", "end_step", "host"))


def _history(segments: list, summary: dict | None) -> list:
    """The earlier commands of a run, as a resumed command lists them: the checkpoint's records,
    each replaced by the summary's record of the same command when there is one (its wall time and
    end include what that command did after its last checkpoint: the closing evaluations), so
    that resuming never rewrites the history an earlier summary recorded."""
    ended = summary.get("segments", []) if summary else []
    return [next((e for e in ended if isinstance(e, dict) and _same_command(e, seg)), seg) for seg in segments]


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class _Logs:
    """metrics.jsonl plus train.csv / eval.csv in OUT (rank 0 only), only ever appended to.

    A full checkpoint records the byte size of each file (`sizes`); resuming cuts each file back to
    exactly that size (`truncate_to`), which drops the records a command wrote after its last
    checkpoint (it died, or it was resumed from an older checkpoint), and appends from there.
    """

    FILES = ("metrics.jsonl", "train.csv", "eval.csv")

    def __init__(self, out: Path, enabled: bool, eval_cols: tuple = _EVAL_COLS):
        self.out, self.enabled, self.eval_cols = out, enabled, eval_cols

    def sizes(self) -> dict:
        return {name: (self.out / name).stat().st_size if (self.out / name).exists() else 0 for name in self.FILES}

    def truncate_to(self, sizes: dict, step: int) -> None:
        """Cut every log back to the size recorded in the checkpoint of ``step``."""
        if not self.enabled:
            return
        for name, size in sizes.items():
            path = self.out / name
            have = path.stat().st_size if path.exists() else 0
            if not path.exists() and size:
                print(f"warning: {path} is missing; its records up to step {step} are not in {self.out}", file=sys.stderr)
                continue
            if have < size:
                raise ValueError(f"cannot resume from the checkpoint of step {step}: {path} has {have} bytes, but it had "
                                 f"{size} when that checkpoint was written (these logs belong to another run)")
            if size == 0:
                path.unlink(missing_ok=True)
            elif have > size:
                os.truncate(path, size)

    def truncate_after(self, step: int) -> None:
        """Drop records later than ``step``: for checkpoints written before log sizes were recorded."""
        if not self.enabled:
            return
        path = self.out / "metrics.jsonl"
        if path.exists():
            keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
            path.write_text("".join(ln + "\n" for ln in keep))
        for name in ("train.csv", "eval.csv"):
            p = self.out / name
            if p.exists():
                with p.open() as f:
                    rows = list(csv.DictReader(f))
                cols = _TRAIN_COLS if name == "train.csv" else self.eval_cols
                with p.open("w", newline="") as f:
                    w = csv.DictWriter(f, cols)
                    w.writeheader()
                    w.writerows(r for r in rows if int(r["step"]) <= step)

    def write(self, kind: str, record: dict) -> None:
        if not self.enabled:
            return
        with (self.out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"kind": kind, **record}) + "\n")
        path = self.out / f"{kind}.csv"
        new = not path.exists() or path.stat().st_size == 0
        with path.open("a", newline="") as f:
            w = csv.DictWriter(f, _TRAIN_COLS if kind == "train" else self.eval_cols, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(record)


# ------------------------------------------------------------------------------- stopping early
EXIT_STOPPED = 75  # the command's exit status when it stopped early with a checkpoint (sysexits' EX_TEMPFAIL)
_STOP_CODES = {None: 0, "time_limit": 1, "SIGINT": 2, "SIGTERM": 3}


def _init_loader_worker(worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``. Workers ignore SIGTERM / SIGINT, so that a signal sent to the
    whole process group leaves them serving the step the main process is finishing (it shuts
    them down itself); and on Linux they are killed the moment the process that started them
    ends, however it ends (SIGKILL, a second signal), instead of living on, orphaned, until they
    notice (PyTorch's workers look every 5 s, and not while a batch is being read). Workers made
    through a fork server (not the main process's children) keep PyTorch's watch only."""
    import multiprocessing

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if sys.platform.startswith("linux") and parent is not None and os.getppid() == parent.pid:
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):  # no prctl here: PyTorch's own watch stays
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent.pid:  # the main process ended before the line above
            os._exit(0)


class _Stopper:
    """When this command ends before ``stop``: at SIGTERM / SIGINT, or before a step that would
    cross ``deadline`` (a `time.monotonic` value).

    The signal handler only records the signal (a second one of the same kind gives up and acts
    as if no handler were installed); the loop sees it between steps, finishes nothing more, and
    writes a full checkpoint. Signals that were ignored when training started stay ignored.

    The time limit is checked before every step but a command's first (whose time, with its
    compilation and warm-up, is unknown): the step is skipped, and the command stops, when
    ``MARGIN x (step + the evaluation and checkpoint it triggers [+ the test evaluation if it is
    the last]) + RESERVE_S`` would pass the deadline. Step time is the synchronized mean of the
    last log window (and, within ``END_ZONE_STEPS`` steps or 60 s of the deadline, of the very
    last step, synchronized), evaluation time per batch and checkpoint time the last measured
    (estimates from the checkpoint a run resumed from before that).
    """

    MARGIN, RESERVE_S, END_ZONE_STEPS = 1.25, 2.0, 20
    clock = staticmethod(time.monotonic)  # deadlines and the durations that predict them (tests inject one)

    def __init__(self, deadline: float | None, timing: dict | None = None):
        self.deadline, self.signal = deadline, None
        self.timing = {"step_s": None, "eval_batch_s": None, "save_s": None, **(timing or {})}
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            return
        signal.signal(signum, self._previous.pop(signum, signal.SIG_DFL))  # a second signal: no clean stop
        os.kill(os.getpid(), signum)

    def left_s(self) -> float:
        return math.inf if self.deadline is None else self.deadline - self.clock()

    def in_end_zone(self) -> bool:
        step_s = self.timing["step_s"] or 0.0
        return self.left_s() < max(60.0, self.END_ZONE_STEPS * step_s)

    def needed_s(self, *, evals: int = 0, tests: int = 0) -> float:
        """Predicted seconds for one step that runs ``evals`` validation batches and ``tests`` test
        batches after it, then a checkpoint."""
        t = self.timing
        step_s = t["step_s"] or 0.0
        batch_s = t["eval_batch_s"] if t["eval_batch_s"] is not None else step_s  # forward only: ~1/3 of a step
        save_s = t["save_s"] if t["save_s"] is not None else 1.0
        return self.MARGIN * (step_s + (evals + tests) * batch_s + save_s) + self.RESERVE_S

    def reason(self, first: bool, **cost) -> str | None:
        if self.signal is not None:
            return self.signal
        if self.deadline is not None and (self.left_s() <= 0 or (not first and self.left_s() < self.needed_s(**cost))):
            return "time_limit"
        return None


# ----------------------------------------------------------------------------------- evaluation
def eval_mask(indices, lengths: torch.Tensor, shape: tuple, ratio: float) -> torch.Tensor:
    """The denoising mask of evaluation: examples ``indices`` of a split, tokens of ``shape``
    (``[B, N]`` or ``[B, 2, N]``). Example i's scores come from NumPy's generator seeded with
    ``(EVAL_MASK_SEED, i)``, so its mask is the same in every evaluation, run, batch size and
    number of ranks; `mask_positions` picks the positions (the rule of training)."""
    scores = np.stack([np.random.default_rng([EVAL_MASK_SEED, int(i)]).random(tuple(shape[1:])) for i in indices])
    return mask_positions(torch.from_numpy(scores), lengths.cpu(), ratio)


def denoise_loss(logits: torch.Tensor, tokens: torch.Tensor, masked: torch.Tensor, *, label_smoothing: float = 0.0,
                 reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cross-entropy of ``logits`` ``[..., N, V]`` against the original ``tokens`` at the
    ``masked`` positions only, correct predictions there, number of masked positions)."""
    target = tokens.masked_fill(~masked, -100)
    loss = F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), ignore_index=-100, reduction=reduction,
                           label_smoothing=label_smoothing)
    correct = ((logits.argmax(-1) == tokens) & masked).sum()
    return loss, correct, masked.sum()


@torch.no_grad()
def evaluate(model, ds, *, batch_size: int, max_batches: int | None, device, autocast, rank: int = 0, world: int = 1,
             num_workers: int = 0, objective: str = "classify", mask_ratio: float = 0.15) -> dict:
    """Loss and accuracy over the first ``max_batches * batch_size`` examples of ``ds`` (all of it
    if None), sharded over ranks and summed exactly.

    ``objective="denoise"``: loss and accuracy of the masked tokens (`eval_mask`: a fixed mask per
    example, so evaluations compare), ``tokens`` their number, ``n`` that of the sequences."""
    n = len(ds) if max_batches is None else min(len(ds), max_batches * batch_size)
    shard = list(range(rank, n, world))
    per_rank = max(1, batch_size // world)
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(ds, shard), batch_size=per_rank,
                                         collate_fn=collate, num_workers=num_workers,
                                         worker_init_fn=_init_loader_worker if num_workers else None,
                                         generator=torch.Generator().manual_seed(0))
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, correct, count (examples or tokens), examples
    for j, b in enumerate(loader):
        tokens, lengths = b["tokens"].to(device).long(), b["lengths"].to(device)
        if objective == "denoise":
            masked = eval_mask(shard[j * per_rank:(j + 1) * per_rank], b["lengths"], tuple(tokens.shape), mask_ratio)
            masked = masked.to(device)
            with autocast:
                logits = model(tokens, lengths, masked)
            loss, correct, count = denoise_loss(logits, tokens, masked, reduction="sum")
        else:
            labels = b["labels"].to(device)
            with autocast:
                logits = model(tokens, lengths)
            loss = F.cross_entropy(logits.float(), labels, reduction="sum")
            correct, count = (logits.argmax(-1) == labels).sum(), labels.numel()
        sums += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device)
                             for v in (loss, correct, count, tokens.shape[0])])
    if world > 1:
        dist.all_reduce(sums)
    model.train(was_training)
    loss, correct, count, examples = sums.tolist()
    r = {"loss": loss / max(count, 1), "acc": correct / max(count, 1), "n": int(examples)}
    if objective == "denoise":
        r["tokens"] = int(count)
    return r


# ------------------------------------------------------------------------------------ CUDA graphs
MAX_GRAPHS = 16  # --cuda-graphs: captured training steps at most (one per width bucket; a handful at 64 / 128 px)


def check_cuda_graphs(cfg: ExperimentConfig, device, *, compile: bool = False) -> None:
    """Refuse --cuda-graphs where the captured step could not be the eager one (ValueError)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a CUDA device, got device {str(device)!r}: CUDA graphs replay captured "
                         f"GPU work (drop the flag on a CPU)")
    if compile:
        raise ValueError("--cuda-graphs and --compile exclude each other: the graphs capture the eager step "
                         "(torch.compile's own CUDA graphs are its mode='reduce-overhead')")
    if cfg.train.objective != "classify":
        raise ValueError(f"--cuda-graphs captures the classifier's step (train.objective='classify'), got "
                         f"train.objective={cfg.train.objective!r}")
    if cfg.model.attention == "flex":
        raise ValueError("--cuda-graphs does not take model.attention='flex' (its padding mask is built per batch "
                         "outside the graph); use sparseflash, sdpa or torch")


def graph_bucket(plan: tuple[int, bool], captured, max_graphs: int) -> tuple[tuple[int, bool], bool] | None:
    """The graph that runs a batch of `host_plan` ``plan``, as (its key, whether to capture it
    first), or None: the step runs eagerly.

    Its own graph when captured, or captured now while fewer than ``max_graphs`` are; past the
    bound, the narrowest captured graph at least as wide that applies the key lengths (key
    ``(width, False)``): the same function (`Encoder.planned`), at the cost of the wider width."""
    if plan in captured:
        return plan, False
    if len(captured) < max_graphs:
        return plan, True
    wider = [key for key in captured if key[0] >= plan[0] and not key[1]]
    return (min(wider), False) if wider else None


class GraphedTrainStep:
    """The classifier's training step replayed from CUDA graphs: one per bucket of `host_plan`
    (the attended width, with ``black_is_padding`` the batch's widest image rounded up to the
    block size, and whether nothing is padding), captured when first seen, at most ``max_graphs``.

    A graph holds the step of `_Run._train_step`: zeroing the gradients, forward (under
    `Encoder.planned`, so the encoder reads nothing back), the cross-entropy loss, backward,
    gradient clipping, the AdamW step and the metrics window's update. Around it, on the host,
    `run` copies the batch into static buffers, picks the graph (`graph_bucket`, from the plan that
    the loader computed from the CPU batch: no device read), writes the learning rate the scheduler
    set into a device tensor and replays. The caller steps the scheduler and its counters.

    - Learning rate: the optimizer's groups keep float lrs (so checkpoints, the scheduler and an
      eager step are as without graphs); a graph's AdamW step reads the lr from a float32 device
      tensor per group (``capturable=True``: fused AdamW computes in float32 either way), set
      before every replay.
    - Gradients: static tensors, made by the first warm-up's backward (for the parameters the step
      gives a gradient), zeroed inside each graph; the backward adds into them.
    - Optimizer state: made by the optimizer's first step, which runs eagerly (`run` answers False
      while there is none): a captured first step would re-create the state at every replay.
    - Randomness: dropout (torch's and sparseflash's, which draws its seed with a torch random op
      on the device) comes from the device's default generator, which CUDA graphs advance at
      every replay: fresh masks each step. The warm-up before a capture restores the generator.
    - Before a capture: no autograd graph through the parameters may be alive (`_check_no_live_graph`:
      else a clear error, before anything is captured), then two forward+backward passes on the
      capture stream (Triton compiles, caches of masks and indices are filled outside the graph),
      RNG restored, gradients zeroed.
    - One memory pool for all graphs: everything a graph keeps (parameters, gradients, optimizer
      state, lr, window, inputs) lives outside it, so graphs only share scratch and never run at once.
    - Capture runs with ``capture_error_mode="thread_local"``: the loader's pin-memory thread keeps
      calling CUDA while a capture is under way.
    - Data parallel (``world`` > 1): the step averages the gradients over the ranks after the
      backward (`average_gradients`, one all-reduce, captured with the rest); the warm-up runs none,
      so a rank capturing a new width while another replays still pairs its collectives.
    """

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, window: torch.Tensor, *,
                 grad_clip: float, label_smoothing: float = 0.0, autocast_dtype: torch.dtype | None = torch.bfloat16,
                 max_graphs: int = MAX_GRAPHS, warmup: int = 2, world: int = 1):
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be a positive int, got {max_graphs!r}")
        self.model, self.opt, self.window = model, opt, window
        self.device = window.device
        self.grad_clip, self.label_smoothing, self.autocast_dtype = grad_clip, label_smoothing, autocast_dtype
        self.max_graphs, self.warmup, self.world = max_graphs, warmup, world
        self.graphs: dict = {}  # plan key -> torch.cuda.CUDAGraph
        self.lr = [torch.tensor(float(g["lr"]), dtype=torch.float32, device=self.device) for g in opt.param_groups]
        self.inputs = None  # static tokens, lengths (or None), labels
        self.grads = None  # parameter -> its static gradient
        self.pool = self.stream = None  # made at the first capture
        self.replayed = self.eager = 0
        self.warned = False

    def summary(self) -> dict:
        return {"graphs": len(self.graphs), "buckets": [list(k) for k in sorted(self.graphs)],
                "replayed": self.replayed, "eager": self.eager, "max_graphs": self.max_graphs}

    def run(self, b: dict) -> bool:
        """One training step on batch ``b`` (tokens, lengths, labels; ``plan`` from `collate_planned`,
        else computed here) through a graph; False when the step must run eagerly instead (the
        optimizer's first step, a batch of another shape, past the bound with no wider graph)."""
        if not self.opt.state:
            self.eager += 1
            return False
        tokens, lengths, labels = b["tokens"], b.get("lengths"), b["labels"]
        if self.inputs is None:
            self.inputs = (torch.zeros(tokens.shape, dtype=torch.long, device=self.device),
                           None if lengths is None else torch.zeros(lengths.shape, dtype=torch.long, device=self.device),
                           torch.zeros(labels.shape, dtype=torch.long, device=self.device))
        s_tokens, s_lengths, s_labels = self.inputs
        if tokens.shape != s_tokens.shape or (lengths is None) != (s_lengths is None) or labels.shape != s_labels.shape:
            self.eager += 1
            return False
        plan = b.get("plan") or host_plan(self.model.cfg, tokens, lengths)
        pick = graph_bucket(tuple(plan), self.graphs, self.max_graphs)
        if pick is None:
            if not self.warned:
                self.warned = True
                print(f"warning: --cuda-graphs: {len(self.graphs)} graphs captured (the bound, --max-graphs), none "
                      f"as wide as width {plan[0]}: such steps run eagerly (not reported again)",
                      file=sys.stderr, flush=True)
            self.eager += 1
            return False
        key, new = pick
        s_tokens.copy_(tokens, non_blocking=True)
        if lengths is not None:
            s_lengths.copy_(lengths, non_blocking=True)
        s_labels.copy_(labels, non_blocking=True)
        for t, g in zip(self.lr, self.opt.param_groups):
            t.fill_(g["lr"])
        if new:
            self._capture(key)
        self.graphs[key].replay()
        self.replayed += 1
        return True

    def _capture(self, key: tuple[int, bool]) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._check_no_live_graph(params)
        for p in params:  # the first warm-up's backward makes the static gradients (those the step gives)
            p.grad = None if self.grads is None else self.grads.get(p)
        self._warm_up(key)
        if self.grads is None:
            self.grads = {p: p.grad for p in params if p.grad is not None}
        self.graphs[key] = self._record(key)

    @staticmethod
    def _check_no_live_graph(params: list) -> None:
        """Raise before a capture if an autograd graph through ``params`` is still alive.

        Autograd keeps one gradient accumulator (AccumulateGrad node) per parameter while any graph
        through it lives, and runs it on the stream that was current when the node was made. A graph
        kept alive from an eager step (a loss or logits still referenced) thus binds the accumulators
        to the default stream: the captured backward would have to make the legacy stream wait on
        the capturing one, which CUDA refuses (cudaErrorStreamCaptureImplicit); the capture is then
        invalidated, and after the failed capture even eager random ops of the process fail (seen on
        an H100, torch 2.11), so the check comes first. Only without such a graph does the warm-up
        make the accumulators anew on the capture stream. A parameter's accumulator is alive iff a
        tag set on it survives dropping every reference this method holds; graphs kept only by
        reference cycles are collected first."""
        def accumulator(p):
            with torch.enable_grad():  # a view of a leaf: no kernel; its grad_fn leads to the accumulator
                return p.view_as(p).grad_fn.next_functions[0][0]

        def alive() -> list:
            tag = "_sparseflash_graphed_probe"
            for p in params:
                accumulator(p).metadata[tag] = True  # made here and freed at once unless a graph holds it
            held = []
            for p in params:
                meta = accumulator(p).metadata
                if meta.pop(tag, False):
                    held.append(p)
            return held

        held = alive()
        if held:
            gc.collect()
            held = alive()
        if held:
            raise RuntimeError(
                f"--cuda-graphs: an autograd graph through {len(held)} of the model's {len(params)} trainable "
                f"parameters is still alive (a loss, logits or other output of an earlier forward still "
                f"referenced): its gradient accumulators run on the stream it ran on, so the training step "
                f"cannot be captured; drop those references (e.g. `del loss, logits`, or run the eager step "
                f"in a function) before GraphedTrainStep.run")

    def _warm_up(self, key: tuple[int, bool]) -> None:
        """Forward+backward passes of the step on the capture stream, outside any graph (kernels
        compile, caches fill), leaving the device generator as it found it and the gradients zero."""
        device = self.device
        if self.stream is None:
            self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        rng = torch.cuda.get_rng_state(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            for _ in range(max(1, self.warmup)):
                self._body(key, update=False)
            self.opt.zero_grad(set_to_none=False)
        torch.cuda.current_stream(device).wait_stream(self.stream)
        torch.cuda.set_rng_state(rng, device)

    def _record(self, key: tuple[int, bool]):
        """The step captured in a CUDA graph (nothing runs: `run` replays it)."""
        if not all(g["capturable"] for g in self.opt.param_groups):
            raise ValueError("GraphedTrainStep captures the optimizer's step: it needs capturable=True")
        graph = torch.cuda.CUDAGraph()
        try:
            with self._device_lrs(), torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                                      capture_error_mode="thread_local"):
                self._body(key, update=True)
        except Exception as e:
            raise RuntimeError(f"--cuda-graphs: capturing the training step of width {key[0]} failed ({e}); "
                               f"train without --cuda-graphs") from e
        return graph

    @contextlib.contextmanager
    def _device_lrs(self):
        """The optimizer's groups hold the lr tensors instead of their floats: what AdamW's step reads then."""
        groups = self.opt.param_groups
        floats = [g["lr"] for g in groups]
        try:
            for g, t in zip(groups, self.lr):
                g["lr"] = t
            yield
        finally:
            for g, lr in zip(groups, floats):
                g["lr"] = lr

    def _body(self, key: tuple[int, bool], update: bool) -> None:
        """The step `_Run._train_step` takes, on the static inputs (the warm-up: without the update)."""
        model, opt = self.model, self.opt
        tokens, lengths, labels = self.inputs
        opt.zero_grad(set_to_none=False)
        autocast = (torch.autocast("cuda", dtype=self.autocast_dtype, cache_enabled=False)
                    if self.autocast_dtype is not None else nullcontext())
        with model.encoder.planned(*key), autocast:
            logits = model(tokens, lengths)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)
        correct = (logits.argmax(-1) == labels).sum()
        loss.backward()
        if not update:  # (the warm-up runs no collective: the ranks capture at different steps)
            return
        average_gradients(model.parameters(), self.world)
        if self.grad_clip > 0:
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.grad_clip)
        else:
            gnorm = torch.zeros((), device=self.device)
        opt.step()
        with torch.no_grad():
            count = torch.full((), float(labels.numel()), dtype=torch.float64, device=self.device)
            self.window += torch.stack([loss.detach().double() * count, correct.double(), count, gnorm.double()])


# ------------------------------------------------------------------------------------------ train
def build_model(cfg: ExperimentConfig) -> torch.nn.Module:
    """The model ``cfg.train.objective`` trains: `LRAClassifier` ("classify") or `LRADenoiser` ("denoise")."""
    if cfg.train.objective not in OBJECTIVES:
        raise ValueError(f"train.objective must be one of {OBJECTIVES}, got {cfg.train.objective!r}")
    return (LRADenoiser if cfg.train.objective == "denoise" else LRAClassifier)(cfg.model)


def _n_batches(ds, batch_size: int, max_batches: int | None) -> int:
    n = len(ds) if max_batches is None else min(len(ds), max_batches * batch_size)
    return math.ceil(n / batch_size)


CPU_WARN_S = 600  # a run on a CPU expected to take longer than this gets a warning


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


def cpu_size_warning(cfg: ExperimentConfig, step_s: float, steps_left: int) -> str | None:
    """The warning for a run on a CPU whose remaining steps (at ``step_s`` each, the first step's
    time) take longer than `CPU_WARN_S`, or None. Tiny configs are CPU-sized and never warned about."""
    left = step_s * steps_left
    if cfg.variant == "tiny" or left <= CPU_WARN_S:
        return None
    return (f"warning: --config {cfg.variant} is sized for a GPU: its first step took {step_s:.1f} s on this CPU, so "
            f"the {steps_left} steps left would take about {_duration(left)} (plus evaluation); --config tiny trains "
            f"{cfg.task} on a CPU in minutes (SIGTERM or --time-limit stop with a checkpoint)")


def dense_pattern_warning(model_cfg: ModelConfig, mask) -> str | None:
    """The warning for a run that asked for a pattern whose mask comes out dense at the attended
    length (every block computed: a block size as long as the sequence), or None."""
    if model_cfg.pattern in (None, "dense") or (mask is not None and mask.density() < 1.0):
        return None
    return (f"warning: --pattern {model_cfg.pattern} at --block-size {model_cfg.block_size} is dense for "
            f"{model_cfg.attn_len} attended tokens (block density 1.0): this run computes dense attention; a "
            f"smaller --block-size makes it sparse")


def _now_iso() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")


def train(cfg: ExperimentConfig, out_dir, *, datasets: dict | None = None, data_root=None, cache_dir=None,
          device: str | None = None, max_steps: int | None = None, resume: str | None = None,
          init_from: str | None = None, compile: bool = False, precision: str | None = None,
          num_workers: int = 0, show_progress: bool = True, deadline: float | None = None,
          cuda_graphs: bool = False, max_graphs: int = MAX_GRAPHS) -> dict:
    """Train ``cfg`` and write everything under ``out_dir``; returns the summary dict.

    ``datasets``: ``{"train", "val"[, "test"]}`` objects with the loader interface (default: load
    ``cfg.task`` from ``data_root``). ``resume``: a checkpoint path, or ``"auto"`` for
    ``out_dir/checkpoints/last.pt`` if it exists. ``precision``: ``"bf16"`` (default on CUDA:
    autocast) or ``"fp32"`` (default on CPU). ``deadline``: a `time.monotonic` value; the command
    stops before a step that would not end (with its evaluation and checkpoint) before it.

    Stopping early. SIGTERM, SIGINT or the deadline end the command between two steps with a full
    checkpoint; the summary then has ``stopped_by`` set (and no test evaluation) and ``--resume``
    continues exactly where it stopped. Every segment of a run split over commands is listed in
    ``summary["segments"]`` (step range, wall time, how it ended, host, command line).

    ``cuda_graphs`` (CUDA, classifier, one process, not with ``compile``): training steps are
    replayed from CUDA graphs, one per width bucket, at most ``max_graphs`` (`GraphedTrainStep`):
    the eager step's semantics (loss, clipping, AdamW, schedule, logs) at a fraction of its host
    time. Evaluation stays eager. Dropout draws fresh masks at every replay, but not the eager
    run's masks, and a resumed run captures its graphs anew: with dropout, runs and resumes are
    statistically, not bitwise, those of eager training.
    """
    run = _Run(cfg, out_dir, datasets=datasets, data_root=data_root, cache_dir=cache_dir, device=device,
               max_steps=max_steps, precision=precision, deadline=deadline, cuda_graphs=cuda_graphs,
               max_graphs=max_graphs, compile=compile)
    try:
        run.build(init_from)
        run.resume_from(resume)
        if run.ended is not None:
            run.say_ended()
            return run.ended
        run.prepare_loop(compile, num_workers)
        run.run_steps(show_progress)
        return run.finish()
    except BaseException:
        run.forget_failed_start()
        raise


class _Run:
    """One command of a training run, as the steps `train` calls in order.

    The steps share the run's state (step, best-on-val record and weights, logs, stopper, timing
    window) through the instance, so that the checkpoints, the logs and the summary see exactly
    what the step loop left. The steps must run in this order: it fixes the order of the RNG draws
    (initial weights, then per-rank dropout streams), of the file writes and of the collectives
    every rank takes part in, on which bit-identical resumes and data-parallel runs rest."""

    def __init__(self, cfg: ExperimentConfig, out_dir, *, datasets, data_root, cache_dir, device, max_steps,
                 precision, deadline, cuda_graphs: bool = False, max_graphs: int = MAX_GRAPHS, compile: bool = False):
        """Devices and precision, then the data and the resolved config (schedule in steps)."""
        self.clock = _Stopper.clock  # every duration of a run (logs, stopping predictions) on the deadline's clock
        self.t_start = self.clock()
        self.started_at = _now_iso()
        self.commit = code_commit()  # this command's code (SPARSEFLASH_COMMIT on a GPU snapshot)
        self.rank, self.world, device = _dist_setup(device)
        self.device, self.deadline = device, deadline
        self.lead = self.rank == 0
        self.out = Path(out_dir)
        self.ckpt_dir = self.out / "checkpoints"
        if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps <= 0):
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps!r}")
        if deadline is not None and not isinstance(deadline, (int, float)):
            raise ValueError(f"deadline must be a time.monotonic() value or None, got {deadline!r}")
        if cuda_graphs:
            check_cuda_graphs(cfg, device, compile=compile)
            if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
                raise ValueError(f"max_graphs must be a positive int, got {max_graphs!r}")
        self.cuda_graphs, self.max_graphs, self.graphs = bool(cuda_graphs), max_graphs, None
        precision = precision or ("bf16" if device.type == "cuda" else "fp32")
        if precision not in ("bf16", "fp32"):
            raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
        self.precision = precision
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()

        if datasets is None:
            if data_root is None:
                raise ValueError("give the data directory (--data DIR) or datasets=")
            datasets = load_datasets(cfg, data_root, cache_dir)
        self.datasets = datasets
        self.made, self.wrote_config = [], False  # what this command made in OUT (`forget_failed_start`)
        cfg = config_from_dict(cfg.to_dict())  # resolved copy; the caller's config is left alone
        fit_to_data(cfg, datasets["train"])
        tc = cfg.train
        steps_per_epoch = len(datasets["train"]) // tc.batch_size
        if tc.epochs is not None:
            tc.steps = max(1, round(tc.epochs * steps_per_epoch))
        if tc.warmup_epochs is not None:
            tc.warmup_steps = round(tc.warmup_epochs * steps_per_epoch)
        cfg.validate()
        if tc.batch_size % self.world:
            raise ValueError(f"train.batch_size ({tc.batch_size}) must be divisible by the number of ranks ({self.world})")
        self.cfg, self.tc = cfg, tc
        self.stop = tc.steps if max_steps is None else min(max_steps, tc.steps)
        self.denoise = tc.objective == "denoise"

    def build(self, init_from: str | None) -> None:
        """Model (optionally from ``init_from``), optimizer, schedule, logs and the empty best-on-val record."""
        tc, lead = self.tc, self.lead
        _seed_all(tc.seed)  # the same initial weights on every rank
        model = build_model(self.cfg)
        self.mask = model.pattern_mask()  # a pattern that cannot be built fails here, before anything is written
        if init_from:
            state = load_checkpoint(init_from, "--init-from")
            weights = model_weights(state, init_from, "--init-from")
            try:
                notes = load_pretrained(model, weights)
            except ValueError as e:  # the weights do not fit this model: say which file
                raise ValueError(f"--init-from {init_from}: {e}") from None
            if lead:
                config = state.get("config") if isinstance(state.get("config"), dict) else {}
                source = (config.get("train") or {}).get("objective", "classify")
                print(f"initialised from {init_from} (a {source} checkpoint, into a {tc.objective} model)"
                      + "".join(f"\n  {n}" for n in notes), file=sys.stderr)
        frozen = freeze_parameters(model, tc.freeze)
        if lead and frozen:
            print(f"frozen (train.freeze): {frozen} of {sum(p.numel() for p in model.parameters())} parameters",
                  file=sys.stderr)
        model.to(self.device)
        self.model = model
        self.opt = _optimizer(model, tc, self.device, capturable=self.cuda_graphs)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, tc.steps, tc.warmup_steps, tc.schedule, tc.min_lr_ratio))
        _seed_all(tc.seed + 1 + self.rank)  # dropout streams differ per rank

        self.logs = _Logs(self.out, lead, _EVAL_COLS_DENOISE if self.denoise else _EVAL_COLS)
        # best on val: highest accuracy (classify), lowest masked-token loss (denoise)
        self.best = {"loss": None, "acc": None, "step": None} if self.denoise else {"acc": -1.0, "step": None}
        self.step, self.best_state = 0, None
        self.segments, self.timing = [], None  # earlier commands of this run; their time estimates
        self.ended = None  # the summary of a run that --resume finds ended where this command would end it

    def resume_from(self, resume: str | None) -> None:
        """Continue from checkpoint ``resume`` (``"auto"``: last.pt if there is one); write config.json
        unless the run has one. A run that has already ended where this command would end it is left
        as it is (``ended``: its summary)."""
        if resume == "auto":
            resume = str(self.ckpt_dir / "last.pt") if (self.ckpt_dir / "last.pt").exists() else None
        self.resume = resume
        if resume:
            self._load_checkpoint(resume)
        if self.lead:
            self._make_folders()
            if not (resume and (self.out / "config.json").exists()):  # (checked against the checkpoint's above)
                # (with the commit of the command that began the run; later commands: summary.json's segments)
                _write_json(self.out / "config.json", {**self.cfg.to_dict(), "commit": self.commit})
                self.wrote_config = True
        if self.ended is not None:
            return
        self.t_offset = sum(seg["wall_s"] for seg in self.segments)  # wall time of the earlier commands, for time_s
        self.start_step = self.step

    def say_ended(self) -> None:
        """The note of a --resume that found its run ended: nothing is run, and nothing is written
        but a missing config.json."""
        if self.lead:
            more = (f"; a --max-steps above {self.step} goes on (the schedule has {self.tc.steps})"
                    if self.step < self.tc.steps else "")
            print(f"note: the run in {self.out} has ended at step {self.step} ({self.out / 'summary.json'}): nothing "
                  f"to run{more}", file=sys.stderr)

    def _make_folders(self) -> None:
        """OUT and OUT/checkpoints, made by this command's first write (noted for `forget_failed_start`)."""
        for folder in reversed([p for p in (self.ckpt_dir, self.out, *self.out.parents) if not p.exists()]):
            folder.mkdir()
            self.made.append(folder)

    def forget_failed_start(self) -> None:
        """After this command failed before its run recorded anything (a log record, a checkpoint,
        a summary): remove the config.json it wrote and the folders it made, so that the same
        command, corrected, is not refused for an --out that holds a run."""
        if not self.lead:
            return
        recorded = [self.out / name for name in (*_Logs.FILES, "summary.json") if (self.out / name).exists()]
        if recorded or (self.ckpt_dir.is_dir() and any(self.ckpt_dir.iterdir())):
            return
        if self.wrote_config:
            (self.out / "config.json").unlink(missing_ok=True)
        for folder in reversed(self.made):
            with contextlib.suppress(OSError):  # not empty: it holds what this command did not write
                folder.rmdir()

    def _load_checkpoint(self, resume: str) -> None:
        ckpt_dir = self.ckpt_dir
        ck = load_checkpoint(resume, "--resume", keys=("model", "config", "step"))
        if "optimizer" not in ck:
            raise ValueError(f"cannot resume from {resume}: it holds weights only (best.pt?); resume from a full "
                             f"checkpoint such as {ckpt_dir / 'last.pt'}")
        lacks = [k for k in _FULL_CHECKPOINT if k not in ck]
        if lacks:
            raise ValueError(f"--resume {resume}: not a full checkpoint of sparseflash lra train (it lacks {lacks}); "
                             f"resume from a run's {ckpt_dir / 'last.pt'}")
        ours = self.cfg.to_dict()
        diff = _config_diff(ck["config"], ours)
        if diff:
            raise ValueError(f"cannot resume {resume}: its config differs in {diff}")
        # the run's records in OUT, checked before anything is changed
        config_path, summary_path = self.out / "config.json", self.out / "summary.json"
        recorded = _read_run_json(config_path)
        if recorded is not None:
            diff = _config_diff(recorded, json.loads(json.dumps(ours)))  # as JSON holds it: tuples are lists
            if diff:
                raise ValueError(f"--resume: {config_path} differs from the checkpoint's config in {diff}; restore it, "
                                 f"or delete it and --resume writes it again from the checkpoint")
        summary = _read_run_json(summary_path)
        segments = list(ck.get("segments", []))
        if summary is not None and not isinstance(summary.get("segments", []), list):
            raise ValueError(f"--resume: {summary_path} is not the summary of a run (its 'segments' is no list); "
                             f"restore it, or delete it and the checkpoint's record of the earlier commands is used")
        self.segments = _history(segments, summary)
        if (summary is not None and summary.get("finished") and summary.get("steps") == ck["step"] >= self.stop
                and segments and summary.get("segments") and _same_command(summary["segments"][-1], segments[-1])):
            self.ended, self.step = summary, ck["step"]
            return
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["optimizer"])
        for group in self.opt.param_groups:  # this command's choice, whichever the checkpoint's command made
            if "capturable" in group:
                group["capturable"] = self.cuda_graphs
        self.sched.load_state_dict(ck["scheduler"])
        self.step, self.best = ck["step"], ck["best"]
        rngs = ck["rng"]
        if len(rngs) == self.world:
            _set_rng_state(rngs[self.rank])
        elif self.lead:
            print(f"warning: checkpoint has RNG states of {len(rngs)} ranks, running {self.world}: dropout streams restart",
                  file=sys.stderr)
        self.timing = ck.get("timing")
        if "best_model" in ck:
            self.best_state = ck["best_model"]
            if self.best_state is not None and ck.get("best_model_from_model"):  # frozen: saved once, in "model"
                shared, best = set(ck["best_model_from_model"]), self.best_state
                self.best_state = {k: (v if k in shared else best[k]) for k, v in ck["model"].items()}
        elif (ckpt_dir / "best.pt").exists():  # a checkpoint of an older version: best.pt is all there is
            self.best_state = load_checkpoint(ckpt_dir / "best.pt", keys=("model",))["model"]
        if "logs" in ck:
            self.logs.truncate_to(ck["logs"], self.step)
        else:
            self.logs.truncate_after(self.step)

    def prepare_loop(self, compile: bool, num_workers: int) -> None:
        """The wrapped model (DDP, compile), the training loader, the evaluation settings and the stopper."""
        tc, device, datasets = self.tc, self.device, self.datasets
        net = self.model
        if self.world > 1 and not self.cuda_graphs:  # (with graphs: `average_gradients`)
            net = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[device.index] if device.type == "cuda" else None)
        if compile:
            net = torch.compile(net)
        self.net = net

        self.sampler = StepBatches(len(datasets["train"]), tc.batch_size, tc.seed, self.rank, self.world,
                                   start_step=self.step)
        # --cuda-graphs: the workers also compute each batch's plan (width bucket) from the CPU tensors
        collate_fn = functools.partial(collate_planned, self.cfg.model) if self.cuda_graphs else collate
        self.loader = torch.utils.data.DataLoader(datasets["train"], batch_sampler=self.sampler, collate_fn=collate_fn,
                                                  num_workers=num_workers, pin_memory=device.type == "cuda",
                                                  worker_init_fn=_init_loader_worker if num_workers else None,
                                                  generator=torch.Generator().manual_seed(tc.seed))
        self.eval_kw = dict(batch_size=tc.eval_batch_size or tc.batch_size, max_batches=tc.eval_batches, device=device,
                            autocast=self.autocast, rank=self.rank, world=self.world, num_workers=num_workers,
                            objective=tc.objective, mask_ratio=tc.mask_ratio)
        self.val_batches = _n_batches(datasets["val"], self.eval_kw["batch_size"], tc.eval_batches)
        self.has_test = datasets.get("test") is not None
        self.test_batches = _n_batches(datasets["test"], self.eval_kw["batch_size"], tc.eval_batches) if self.has_test else 0
        self.tokens_per_step = tc.batch_size * self.cfg.model.seq_len * (2 if self.cfg.model.dual else 1)
        self.stopper = _Stopper(self.deadline, self.timing)
        if self.resume and self.best_state is not None:  # best.pt may be from after the checkpoint
            self.save_weights(self.ckpt_dir / "best.pt", self.best_state, self.best["step"])

    # ---- checkpoints and validation, at any step
    def segment(self, end: str) -> dict:
        """This command's entry in ``segments`` (of last.pt and summary.json), as if it ended now by ``end``."""
        device = self.device
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        return {"start_step": self.start_step, "end_step": self.step, "wall_s": self.clock() - self.t_start,
                "started": self.started_at, "ended": _now_iso(), "end": end, "commit": self.commit,
                "host": platform.node(),
                "device": str(device), "gpu": gpu, "world_size": self.world, "resumed_from": self.resume,
                "command": shlex.join(sys.argv)}

    def save_weights(self, path: Path, state: dict, at_step: int) -> None:
        if self.lead:
            _atomic_save({"model": state, "step": at_step, "config": self.cfg.to_dict(), "best": self.best}, path)

    def save_full(self, end: str) -> None:
        """last.pt: everything the next command needs to continue as if this one had gone on."""
        t0 = self.clock()
        rngs = _gather(_rng_state(), self.world)  # every rank takes part
        if self.lead:
            step, spe = self.step, self.sampler.steps_per_epoch
            # the best weights less the frozen parameters, which are the same in "model" (a frozen Path-X
            # position table is 92% of the model: this keeps a run's state small enough to carry)
            frozen = [n for n, p in self.model.named_parameters() if not p.requires_grad]
            best = (None if self.best_state is None
                    else {k: v for k, v in self.best_state.items() if k not in frozen})
            obj = {"model": self.model.state_dict(), "step": step, "config": self.cfg.to_dict(), "best": self.best,
                   "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "rng": rngs,
                   "world_size": self.world,
                   "data": {"epoch": step // spe, "batch_in_epoch": step % spe,
                            "steps_per_epoch": spe, "order_seed": self.tc.seed},
                   "best_model": best, "best_model_from_model": frozen if best is not None else [],
                   "logs": self.logs.sizes(),
                   "segments": self.segments + [self.segment(end)], "timing": self.stopper.timing}
            _atomic_save(obj, self.ckpt_dir / "last.pt")
        self.stopper.timing["save_s"] = self.clock() - t0

    def validate_now(self) -> dict:
        """Evaluate on val, log it, and keep the weights (best.pt) if they are the best so far."""
        clock, step, best = self.clock, self.step, self.best
        t0 = clock()
        r = evaluate(self.model, self.datasets["val"], **self.eval_kw)
        self.stopper.timing["eval_batch_s"] = (clock() - t0) / max(1, self.val_batches)
        self.logs.write("eval", {"step": step, "split": "val", "weights": "current", **r,
                                 "time_s": self.t_offset + clock() - self.t_start})
        better = (best["step"] is None or r["loss"] < best["loss"]) if self.denoise else r["acc"] > best["acc"]
        if better:
            self.best = ({"loss": r["loss"], "acc": r["acc"], "step": step} if self.denoise
                         else {"acc": r["acc"], "loss": r["loss"], "step": step})
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
            self.save_weights(self.ckpt_dir / "best.pt", self.best_state, step)
        return r

    def is_eval_step(self, s: int) -> bool:
        return s % self.tc.eval_every == 0 or s == self.tc.steps

    # ---- the step loop
    def run_steps(self, show_progress: bool) -> None:
        """Steps from the resumed one to ``stop``, or until a signal or the deadline ends the command
        (then with a full checkpoint)."""
        cfg, tc, device, clock = self.cfg, self.tc, self.device, self.clock
        if self.lead:
            warning = dense_pattern_warning(cfg.model, self.mask)
            if warning:
                print(warning, file=sys.stderr, flush=True)
        desc = f"{cfg.task} {cfg.model.attention}/{cfg.model.pattern or 'dense'}"
        from sparseflash._progress import Progress

        self.bar = bar = Progress(self.stop, desc, disable=not (self.lead and show_progress))
        bar.n = self.step
        self.window = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, correct, count, grad-norm sum
        if self.cuda_graphs:  # the graphs update this very window tensor
            self.graphs = GraphedTrainStep(self.model, self.opt, self.window, grad_clip=tc.grad_clip,
                                           label_smoothing=tc.label_smoothing,
                                           autocast_dtype=torch.bfloat16 if self.precision == "bf16" else None,
                                           max_graphs=self.max_graphs, world=self.world)
        self.win_steps, self.t_last, self.paused = 0, clock(), 0.0  # paused: eval / checkpoint time, not step time
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.net.train()
        self.batches = iter(self.loader)  # held by the run, as long as the run, like the loader's workers
        self.stopped_by = None
        if self.lead and device.type == "cpu" and cfg.variant != "tiny" and self.step < self.stop:
            print(f"note: --config {cfg.variant} is sized for a GPU (batch {tc.batch_size}, {tc.steps} steps); its time "
                  f"on this CPU is estimated after the first step; --config tiny is sized for a CPU", file=sys.stderr,
                  flush=True)
        with self.stopper:
            while self.step < self.stop:
                self.stopped_by = self._stop_reason()
                if self.stopped_by is not None:
                    break
                end_zone = self.stopper.deadline is not None and self.stopper.in_end_zone()
                t_step = clock()
                lr_used = self._train_step(next(self.batches))
                self._time_step(end_zone, t_step)
                postfix = None
                if self.step % tc.log_every == 0 or self.step == self.stop:
                    postfix = self._log_window(end_zone, lr_used)
                t_pause = clock()
                postfix = self._validate_and_save(postfix)
                self.paused += clock() - t_pause
                bar.update(1, postfix=postfix)
            # (nothing to save if no step ran)
            if self.stopped_by is not None and not (self.resume and self.step == self.start_step):
                self.save_full(self.stopped_by)
        bar.close()

    def _stop_reason(self) -> str | None:
        """Why the command ends before the next step (None: it runs), the same on every rank."""
        nxt = self.step + 1
        val_batches, test_batches = self.val_batches, self.test_batches
        cost = {"evals": val_batches if self.is_eval_step(nxt) else 0,
                "tests": (2 * test_batches + (val_batches if not self.is_eval_step(nxt) else 0)) if nxt == self.stop else 0}
        stopped_by = self.stopper.reason(first=self.step == self.start_step, **cost)
        if self.world > 1:  # every rank stops at the same step
            flag = torch.tensor([_STOP_CODES[stopped_by]], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stopped_by = {v: k for k, v in _STOP_CODES.items()}[int(flag.item())]
        return stopped_by

    def _train_step(self, b: dict) -> float:
        """One update on batch ``b``, added to the log window; returns the lr it used."""
        lr_used = self.opt.param_groups[0]["lr"]
        if self.graphs is None:
            self._eager_update(b)
        elif not self.graphs.run(b):
            with warnings.catch_warnings():  # a --cuda-graphs step run eagerly: fused AdamW is the same either way
                warnings.filterwarnings("ignore", message=".*capturable=True.*")
                self._eager_update(b)
        self.sched.step()
        self.step += 1
        self.win_steps += 1
        return lr_used

    def _eager_update(self, b: dict) -> None:
        """The update of `_train_step` in eager mode (`GraphedTrainStep` replays the same)."""
        tc, device, net = self.tc, self.device, self.net
        tokens = b["tokens"].to(device, non_blocking=True).long()  # (int16 from some loaders: `collate`)
        lengths = b["lengths"].to(device, non_blocking=True)
        if self.denoise:  # the mask comes from torch's generator on the device: checkpointed with the run
            masked = mask_positions(torch.rand(tokens.shape, device=device), lengths, tc.mask_ratio)
            with self.autocast:
                logits = net(tokens, lengths, masked)
            loss, correct, count = denoise_loss(logits, tokens, masked, label_smoothing=tc.label_smoothing)
        else:
            labels = b["labels"].to(device, non_blocking=True)
            with self.autocast:
                logits = net(tokens, lengths)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=tc.label_smoothing)
            correct, count = (logits.argmax(-1) == labels).sum(), labels.numel()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.graphs is not None:  # data parallel with --cuda-graphs: no DDP wrapper (`average_gradients`)
            average_gradients(self.model.parameters(), self.world)
        if tc.grad_clip > 0:
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        else:
            gnorm = torch.zeros((), device=device)
        self.opt.step()
        with torch.no_grad():
            count = torch.as_tensor(count, dtype=torch.float64, device=device)
            self.window += torch.stack([loss.detach().double() * count, correct.double(), count, gnorm.double()])

    def _time_step(self, end_zone: bool, t_step: float) -> None:
        """Near the deadline (or with no estimate yet, at a command's first step) time this very step."""
        step, first = self.step, self.step == self.start_step + 1
        if end_zone or first:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.stopper.timing["step_s"] = self.clock() - t_step
            if self.lead and first and self.device.type == "cpu":
                warning = cpu_size_warning(self.cfg, self.stopper.timing["step_s"], self.stop - step)
                if warning:
                    print(warning, file=sys.stderr, flush=True)

    def _log_window(self, end_zone: bool, lr_used: float) -> str:
        """Write the train record of the steps since the last one; returns the progress bar's postfix."""
        device, world = self.device, self.world
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = self.clock()
        if world > 1:
            dist.all_reduce(self.window)
        ls, correct, count, gsum = self.window.tolist()
        dt = (now - self.t_last - self.paused) / self.win_steps
        if not end_zone:
            self.stopper.timing["step_s"] = dt
        rec = {"step": self.step, "epoch": round(self.step / self.sampler.steps_per_epoch, 4), "lr": lr_used,
               "loss": ls / count, "acc": correct / count, "grad_norm": gsum / (self.win_steps * world),
               "step_ms": 1e3 * dt, "tokens_per_s": self.tokens_per_step / dt,
               "mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
               "time_s": self.t_offset + now - self.t_start}
        self.logs.write("train", rec)
        self.window.zero_()
        self.win_steps, self.t_last, self.paused = 0, now, 0.0
        return f"loss {rec['loss']:.3f} acc {rec['acc']:.3f} lr {rec['lr']:.2e} {rec['step_ms']:.0f} ms/step"

    def _validate_and_save(self, postfix: str | None) -> str | None:
        """The validation and the checkpoint the step just taken triggers; returns the bar's postfix."""
        step = self.step
        if self.is_eval_step(step):
            r = self.validate_now()
            if self.denoise:
                shown = f" | val loss {r['loss']:.3f} acc {r['acc']:.3f} (best loss {self.best['loss']:.3f})"
            else:
                shown = f" | val {r['acc']:.3f} (best {self.best['acc']:.3f})"
            postfix = (postfix or self.bar.postfix) + shown
        if step % self.tc.save_every == 0 or step == self.stop:
            self.save_full("done" if step == self.tc.steps else "max_steps" if step == self.stop else "checkpoint")
        return postfix

    # ---- the end
    def finish(self) -> dict:
        """The closing validation and the test evaluations of a run that ended; summary.json."""
        cfg, tc, model, step, mask, device = self.cfg, self.tc, self.model, self.step, self.mask, self.device
        summary = {"task": cfg.task, "variant": cfg.variant, "objective": tc.objective,
                   **({"mask_ratio": tc.mask_ratio} if self.denoise else {}), "attention": cfg.model.attention,
                   "pattern": cfg.model.pattern or "dense", "pattern_kwargs": cfg.model.pattern_kwargs,
                   "block_size": cfg.model.block_size, "density": mask.density() if mask is not None else 1.0,
                   "token_density": mask.token_density() if mask is not None else 1.0,
                   "params": sum(p.numel() for p in model.parameters()),
                   "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                   "steps": step, "schedule_steps": tc.steps,
                   "finished": self.stopped_by is None, "stopped_by": self.stopped_by,
                   "world_size": self.world, "precision": self.precision, "device": str(device),
                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   "torch": torch.__version__, "commit": self.commit, "best_val": self.best}
        if self.stopped_by is not None:
            if self.lead:
                print(f"stopped at step {step} by {self.stopped_by}; continue with --resume", flush=True)
        else:
            if step < tc.steps and not self.is_eval_step(step):
                self.validate_now()  # the end of a --max-steps run; after its checkpoint, so a resumed run never sees it
                summary["best_val"] = self.best
            if self.has_test:
                summary.update(self._test())
        if self.graphs is not None:  # this command's graphs
            summary["cuda_graphs"] = self.graphs.summary()
        end = self.stopped_by or ("done" if step == tc.steps else "max_steps")
        summary["segments"] = self.segments + [self.segment(end)]
        summary["resumed_from"] = self.resume
        summary["wall_s"] = self.clock() - self.t_start  # this command
        summary["wall_s_total"] = sum(seg["wall_s"] for seg in summary["segments"])  # every command of the run
        if self.lead:
            _write_json(self.out / "summary.json", summary)
        return summary

    def _test(self) -> dict:
        """Test evaluations with the final and the best-on-val weights (the model keeps the final)."""
        model, results = self.model, {}
        now_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        for weights, state in (("final", now_state), ("best", self.best_state)):
            if state is None:
                continue
            model.load_state_dict(state)
            r = evaluate(model, self.datasets["test"], **self.eval_kw)
            self.logs.write("eval", {"step": self.step, "split": "test", "weights": weights, **r,
                                     "time_s": self.t_offset + self.clock() - self.t_start})
            results[f"test_{weights}"] = r
        model.load_state_dict(now_state)
        return results


# -------------------------------------------------------------------------------------------- CLI
def add_data_arguments(p: argparse.ArgumentParser, *, task_required: bool) -> None:
    """--task, --config, --data, --cache-dir: the head of every command that trains (train, sweep),
    declared once so that their names, defaults and help stay the same."""
    p.add_argument("--task", required=task_required, choices=TASKS)
    p.add_argument("--config", default="quick", choices=VARIANTS, help="settings variant (default: quick)")
    p.add_argument("--data", help="data root directory given to the loaders")
    p.add_argument("--cache-dir", help="cache directory for the loaders")


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """--device, --precision, as `train` takes them (train, sweep)."""
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--precision", choices=("bf16", "fp32"), help="default: bf16 autocast on CUDA, fp32 on CPU")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from sparseflash.cmdline import non_negative_int, positive_int

    add_data_arguments(p, task_required=True)
    p.add_argument("--out", required=True, help="output directory (metrics, checkpoints, summary)")
    p.add_argument("--attention", choices=ATTENTIONS, help="attention implementation (default: the config's)")
    p.add_argument("--pattern", help="block pattern of sparseflash.patterns, e.g. butterfly or "
                                     "'butterfly:n_factors=3'; 'dense' for none")
    p.add_argument("--pattern-arg", action="append", default=[], metavar="KEY=VALUE", help="pattern parameter (repeatable)")
    p.add_argument("--block-size", type=positive_int, help="block size of the pattern (default 128)")
    p.add_argument("--max-steps", type=positive_int, help="stop after this step (the schedule is unchanged)")
    p.add_argument("--time-limit", type=_minutes, metavar="MINUTES",
                   help="end the command, with a checkpoint to --resume from, before a step that would not "
                        f"finish within MINUTES of the command's start (exit status {EXIT_STOPPED}); allow a little "
                        "for Python start-up")
    add_device_arguments(p)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay training steps from CUDA graphs, one per width bucket (CUDA, classifier, one process; "
                        "for black_is_padding pixel tasks, whose steps are host-bound); evaluation stays eager")
    p.add_argument("--max-graphs", type=positive_int, default=MAX_GRAPHS,
                   help=f"--cuda-graphs: graphs captured at most (default {MAX_GRAPHS}); past it a batch takes the "
                        f"narrowest wider graph, else an eager step")
    p.add_argument("--resume", nargs="?", const="auto", help="resume from CHECKPOINT (default OUT/checkpoints/last.pt)")
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out folder that holds a run (its files are removed); without it, "
                        "or --resume, such a folder is refused and left as it is")
    p.add_argument("--init-from", metavar="CHECKPOINT",
                   help="initialise weights (upsampling a 2-D position grid); the encoder must fit, the other "
                        "objective's head (classifier / denoiser) is skipped")
    p.add_argument("--objective", choices=OBJECTIVES,
                   help="classify (default) or denoise: self-pretraining on masked tokens (train.objective; "
                        "--set train.mask_ratio=R, default 0.15)")
    p.add_argument("--seed", type=non_negative_int, help="training seed (default: the config's)")
    p.add_argument("--num-workers", type=non_negative_int, default=2, help="data-loader workers (default 2)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, e.g. --set train.lr=3e-4 --set model.n_layers=4 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args) -> ExperimentConfig:
    overrides = list(args.set)
    if args.attention:
        overrides.append(f"model.attention={args.attention!r}")
    if args.block_size is not None:
        overrides.append(f"model.block_size={args.block_size}")
    if args.seed is not None:
        overrides.append(f"train.seed={args.seed}")
    if args.objective is not None:
        overrides.append(f"train.objective={args.objective!r}")
    cfg = get_config(args.task, args.config, overrides)
    if args.pattern is not None:
        cfg.model.pattern, cfg.model.pattern_kwargs = parse_pattern_spec(args.pattern)
    for item in args.pattern_arg:
        _, kw = parse_pattern_spec(f"x:{item}")
        cfg.model.pattern_kwargs.update(kw)
    return cfg


def _minutes(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"--time-limit must be a positive number of minutes, got {text!r}")
    return v


# what a run writes in its folder (`sweep` adds step_time.json): what --overwrite removes
RUN_FILES = ("config.json", "summary.json", "checkpoints", "step_time.json", *_Logs.FILES)


def _cmd_train(args) -> int:
    """Exit status 0 when the run reached its end (the schedule or --max-steps), `EXIT_STOPPED` (75)
    when a signal or --time-limit ended it early with a checkpoint to ``--resume`` from."""
    from sparseflash.cmdline import CommandError, check_output_dir, claim_output_dir

    deadline = _Stopper.clock() + 60 * args.time_limit if args.time_limit else None
    cfg = config_from_args(args)
    if args.overwrite and args.resume:
        raise CommandError("--overwrite and --resume contradict each other", "give one of them")
    check_output_dir(args.out)
    if int(os.environ.get("RANK", "0")) == 0:
        claim_output_dir(args.out, owned=RUN_FILES, overwrite=args.overwrite, resume=args.resume is not None)
    summary = train(cfg, args.out, data_root=args.data, cache_dir=args.cache_dir, device=args.device,
                    max_steps=args.max_steps, resume=args.resume, init_from=args.init_from, compile=args.compile,
                    precision=args.precision, num_workers=args.num_workers, show_progress=not args.no_progress,
                    deadline=deadline, cuda_graphs=args.cuda_graphs, max_graphs=args.max_graphs)
    if int(os.environ.get("RANK", "0")) == 0 and summary["stopped_by"] is None:
        best = summary["best_val"]
        if summary["objective"] == "denoise":
            line = (f"{cfg.task} (denoise): {summary['steps']} steps, best val masked-token loss {best['loss']:.4f} "
                    f"(acc {best['acc']:.4f}) at step {best['step']}")
            if "test_best" in summary:
                t = summary["test_best"]
                line += f", test loss {t['loss']:.4f} acc {t['acc']:.4f} (best-val weights)"
        else:
            line = f"{cfg.task}: {summary['steps']} steps, best val acc {best['acc']:.4f} at step {best['step']}"
            if "test_best" in summary:
                line += f", test acc {summary['test_best']['acc']:.4f} (best-val weights)"
        print(line + f"; results in {args.out}")
    close_distributed()
    return 0 if summary["stopped_by"] is None else EXIT_STOPPED


def register_lra(subparsers) -> None:
    """Declare ``sparseflash lra train`` (called by experiments/lra/cli.py)."""
    p = subparsers.add_parser("train", help="train an LRA / Path-X classifier",
                              description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_arguments(p)
    p.set_defaults(func=_cmd_train)


def main(argv=None) -> int:
    from sparseflash.cmdline import ArgumentParser

    parser = ArgumentParser(prog="python -m sparseflash.experiments.lra.train", description=__doc__.split("\n\n")[0])
    add_train_arguments(parser)
    return _cmd_train(parser.parse_args(argv))


if __name__ == "__main__":
    from sparseflash.cmdline import run_command

    sys.exit(run_command(main))
