"""Experiment configs for the LRA tasks and Path-X / Path-256: one dataclass per run, two variants.

- ``faithful``: the settings the FlashAttention paper trained with. It follows Tay et al. (LRA)
  and Xiong et al. (Nystromformer); the latter's uniform recipe is used for every LRA task: 2 layers,
  d_model 64, 2 heads of 32, FFN 128, mean pooling, dropout 0.1, AdamW (no weight decay) at lr 1e-4
  with linear warm-up and linear decay, and per task the batch size, warm-up and step count of
  its published config. Path-X / Path-256 follow the FlashAttention paper's recipe: pretrain at
  the smaller resolution, upsample the position grid, fine-tune 200 epochs with 1 warm-up epoch
  and a cosine schedule. Their batch sizes and learning rate are not published; ours are marked.
- ``quick``: the same model, a shorter schedule with a higher learning rate and cosine decay,
  sized for a few minutes on one H100 (evaluation on a fixed subset where the split is large).
- ``tiny``: sized for a CPU (two cores, minutes): sparseflash attention (its PyTorch reference on
  a CPU) through a butterfly pattern whose blocks are small enough to be sparse at the tiny length
  (`_TINY_BLOCK`: block density 0.5 on ListOps and text, 0.31 on 1024 pixels), text-like inputs
  cut to 256 tokens (ListOps to 64: its outer operator and first arguments), a smaller model on
  the 1024-pixel tasks, a few hundred steps, evaluation on a subset. A check that the pipeline
  learns, not a result to compare with the papers (`_TINY` says what each task reached on a CPU;
  ``sparseflash lra data listops --size tiny`` writes just the ListOps examples it reads).

Either variant trains a classifier; ``train.objective="denoise"`` (``--objective denoise``)
self-pretrains the same encoder on the training inputs instead (masked tokens, ``train.mask_ratio``;
see train.py), for a classifier to start from with ``--init-from``.

Tasks match the loaders of `sparseflash.experiments.lra.data` (``get_dataset(task, ...)``).
Vocabulary size and class count are taken from the dataset when training; the values here are
those of the released data and are what the speed experiment uses.

    cfg = get_config("listops", "quick", overrides=["model.d_model=128", "train.lr=3e-4"])
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import types
import typing
from dataclasses import asdict, dataclass, field

from sparseflash.experiments.lra.model import ModelConfig

__all__ = ["TASKS", "VARIANTS", "SPEED_TASKS", "LRA5", "OBJECTIVES", "TrainConfig", "ExperimentConfig", "get_config",
           "apply_overrides", "config_from_dict"]

TASKS = ("listops", "text", "text4k", "retrieval", "image", "pathfinder32", "pathfinder64", "pathx", "path256")
VARIANTS = ("faithful", "quick", "tiny")
SPEED_TASKS = ("listops", "text", "text4k", "retrieval", "image", "pathfinder32", "pathx", "path256")
LRA5 = ("listops", "text", "retrieval", "image", "pathfinder32")  # the tasks of the paper's geometric mean
SCHEDULES = ("linear", "cosine", "inverse_sqrt", "constant")
OBJECTIVES = ("classify", "denoise")  # train.objective


@dataclass
class TrainConfig:
    batch_size: int = 32  # global: split evenly over data-parallel ranks
    steps: int = 5000  # length of the schedule (optimizer steps)
    epochs: float | None = None  # if set, steps = epochs * (train size // batch_size)
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: str = "linear"
    warmup_steps: int = 1000
    warmup_epochs: float | None = None  # if set, overrides warmup_steps
    min_lr_ratio: float = 0.0  # floor of linear / cosine decay, as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    label_smoothing: float = 0.0
    eval_every: int = 500
    eval_batches: int | None = None  # evaluate on the first N batches of a split; None: all of it
    eval_batch_size: int | None = None  # default: batch_size
    log_every: int = 50
    save_every: int = 1000
    seed: int = 0
    objective: str = "classify"  # "denoise": self-pretraining, predict masked tokens (train.py's docstring)
    mask_ratio: float = 0.15  # denoise: the fraction of each sequence's real tokens that is masked
    # parameters kept at their initial (or --init-from) values, by name or name prefix, e.g.
    # ("encoder.pos",): a fine-tune whose learned position table (92% of a Path-X model's
    # parameters) would otherwise be free to memorise the training images
    freeze: tuple[str, ...] = ()

    def validate(self) -> "TrainConfig":
        for name in ("batch_size", "steps", "eval_every", "log_every", "save_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"train.{name} must be a positive int, got {v!r}")
        for name in ("warmup_steps", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"train.{name} must be a non-negative int, got {v!r}")
        for name in ("eval_batches", "eval_batch_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"train.{name} must be a positive int or None, got {v!r}")
        for name in ("epochs", "warmup_epochs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (name == "epochs" and v == 0)):
                raise ValueError(f"train.{name} must be a positive number or None, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"train.lr must be positive, got {self.lr!r}")
        for name in ("weight_decay", "grad_clip", "label_smoothing", "min_lr_ratio", "eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"train.{name} must be a non-negative number, got {v!r}")
        if self.min_lr_ratio > 1 or self.label_smoothing >= 1:
            raise ValueError("train.min_lr_ratio must be <= 1 and train.label_smoothing < 1")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)):
            raise ValueError(f"train.betas must be a pair of floats in [0, 1), got {self.betas!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"train.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"train.objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not (isinstance(self.freeze, tuple) and all(isinstance(f, str) and f for f in self.freeze)):
            raise ValueError(f"train.freeze must be a tuple of parameter names or prefixes, got {self.freeze!r}")
        r = self.mask_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < 1:
            raise ValueError(f"train.mask_ratio must be a number in (0, 1), got {r!r}")
        return self


@dataclass
class ExperimentConfig:
    task: str
    variant: str
    model: ModelConfig
    train: TrainConfig
    data: dict = field(default_factory=dict)  # task options for get_dataset (e.g. difficulty)
    init_from_task: str | None = None  # recipe: which task's checkpoint to start from (--init-from)
    notes: str = ""

    def validate(self) -> "ExperimentConfig":
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if not isinstance(self.data, dict):
            raise TypeError(f"data must be a dict of loader options, got {type(self.data).__name__}")
        self.train.validate()
        if self.model.vocab_size:  # 0 until the dataset fills it in
            self.model.validate()
        return self

    def to_dict(self) -> dict:
        return asdict(self)


def config_from_dict(d: dict) -> ExperimentConfig:
    """Inverse of `ExperimentConfig.to_dict` (JSON turns tuples into lists; they come back as tuples). A
    run's config.json also records the ``commit`` that began the run: not part of the config."""
    d = copy.deepcopy(d)
    d.pop("commit", None)
    model = d.pop("model")
    if model.get("grid") is not None:
        model["grid"] = tuple(model["grid"])
    train = d.pop("train")
    train["betas"] = tuple(train["betas"])
    if "freeze" in train:
        train["freeze"] = tuple(train["freeze"])
    return ExperimentConfig(model=ModelConfig(**model), train=TrainConfig(**train), **d)


# ------------------------------------------------------------------------------------- the table
# Per-task data facts: (seq_len the loader pads to, vocab incl. pad, classes, grid). Training
# replaces seq_len / vocab / classes with the dataset's own; speed uses them as they are.
_DATA = {
    "listops": (2048, 16, 10, None),
    "text": (1024, 257, 2, None),
    "text4k": (4096, 257, 2, None),
    "retrieval": (4096, 257, 2, None),
    "image": (1024, 257, 10, (32, 32)),
    "pathfinder32": (1024, 257, 2, (32, 32)),
    "pathfinder64": (4096, 257, 2, (64, 64)),
    "pathx": (16384, 257, 2, (128, 128)),
    "path256": (65536, 257, 2, (256, 256)),
}

_NYSTROM = "Xiong et al. 2021 (Nystromformer) LRA config, as followed by the FlashAttention paper"
_PATHX = ("FlashAttention paper recipe (pretrain smaller, upsample position grid, fine-tune 200 epochs, "
          "cosine, 1 warm-up epoch); batch size and lr are our choice (not published)")

# task: (faithful train kwargs, quick train kwargs, notes)
_TRAIN = {
    # quick, measured on one H100 (generated data, attention dropout 0): 42 s, val 35.9% / test 36.2%
    # with butterfly, 35.7% / 36.1% dense
    "listops": (dict(batch_size=32, steps=5000, warmup_steps=1000, eval_every=250), dict(
        batch_size=64, steps=2500, lr=5e-4, warmup_steps=250, schedule="cosine", eval_every=250), _NYSTROM),
    "text": (dict(batch_size=32, steps=20000, warmup_steps=8000, eval_every=1000), dict(
        batch_size=32, steps=4000, lr=5e-4, warmup_steps=400, schedule="cosine", eval_every=500, eval_batches=100),
        _NYSTROM + "; LRA's length of 1000 bytes (padded to 1024)"),
    "text4k": (dict(batch_size=32, steps=20000, warmup_steps=8000, eval_every=1000), dict(
        batch_size=32, steps=4000, lr=5e-4, warmup_steps=400, schedule="cosine", eval_every=500, eval_batches=100),
        _NYSTROM + "; 4K bytes as Nystromformer / xformers"),
    "retrieval": (dict(batch_size=32, steps=30000, warmup_steps=800, eval_every=1000), dict(
        batch_size=32, steps=4000, lr=5e-4, warmup_steps=400, schedule="cosine", eval_every=500, eval_batches=100),
        _NYSTROM),
    "image": (dict(batch_size=256, steps=35000, warmup_steps=175, eval_every=1750), dict(
        batch_size=256, steps=3500, lr=1e-3, warmup_steps=175, schedule="cosine", eval_every=350), _NYSTROM),
    "pathfinder32": (dict(batch_size=256, steps=62400, warmup_steps=312, eval_every=3120), dict(
        batch_size=256, steps=6240, lr=1e-3, warmup_steps=312, schedule="cosine", eval_every=624, eval_batches=40),
        _NYSTROM),
    "pathfinder64": (dict(batch_size=128, steps=62400, warmup_steps=312, eval_every=3120, schedule="cosine"), dict(
        batch_size=128, steps=6000, lr=1e-3, warmup_steps=300, schedule="cosine", eval_every=600, eval_batches=40),
        "Path-X pretraining stage (our settings; the paper does not publish them)"),
    "pathx": (dict(batch_size=32, epochs=200, warmup_epochs=1, schedule="cosine", eval_every=5000, eval_batches=200,
                   save_every=5000), dict(
        batch_size=32, steps=3000, lr=1e-3, warmup_steps=150, schedule="cosine", eval_every=500, eval_batches=40),
        _PATHX),
    "path256": (dict(batch_size=8, epochs=200, warmup_epochs=1, schedule="cosine", eval_every=20000, eval_batches=400,
                     save_every=5000), dict(
        batch_size=8, steps=2000, lr=1e-3, warmup_steps=100, schedule="cosine", eval_every=500, eval_batches=80),
        _PATHX),
}
_INIT_FROM = {"pathx": "pathfinder64", "path256": "pathx"}

# tiny (CPU): task -> (train kwargs, model overrides, data overrides). Measured on 2 shared CPU
# cores (torch 2.13), generated data: experiments/README.md has the commands.
_TINY_TEXT = (dict(batch_size=32, steps=300, lr=1e-3, warmup_steps=30, schedule="cosine", eval_every=100,
                   eval_batches=16, log_every=25, save_every=100), {}, {"seq_len": 256})
_TINY_PIXELS = (dict(batch_size=32, steps=200, lr=1e-3, warmup_steps=20, schedule="cosine", eval_every=100,
                     eval_batches=8, log_every=25, save_every=100), dict(d_model=32, d_ff=64), {})
_TINY = {
    # ListOps cut to its first 64 tokens: the outer operator and its first arguments, the cue that LRA
    # models' 36-37% comes from. sparseflash (reference), butterfly at block 8 (density 0.5), 2 cores:
    # 35% val / 37.5% test (majority class 19%) in 64 s; the same with SDPA, dense: 36% / 37% in 23 s.
    # Seq 256 with SDPA, 300 steps: 18%
    "listops": (dict(batch_size=32, steps=600, lr=1e-3, warmup_steps=50, schedule="cosine", eval_every=200,
                     eval_batches=16, log_every=50, save_every=200), {}, {"seq_len": 64}),
    "text": _TINY_TEXT, "text4k": _TINY_TEXT, "retrieval": _TINY_TEXT,
    "image": _TINY_PIXELS, "pathfinder32": _TINY_PIXELS,
    # fixed image lengths (4K-64K tokens): still hours on a CPU; the smallest batch and schedule
    "pathfinder64": (dict(batch_size=4, steps=100, lr=1e-3, warmup_steps=10, schedule="cosine", eval_every=50,
                          eval_batches=4, log_every=10, save_every=50), dict(d_model=32, d_ff=64), {}),
}
_TINY["pathx"] = _TINY["path256"] = _TINY["pathfinder64"]
# tiny's butterfly block size: one eighth of ListOps' 64 and the text tasks' 256 tokens (block
# density 0.5), 64 on the 1024-pixel tasks (0.31); 128 from 4096 tokens (0.19 and less)
_TINY_BLOCK = {"listops": 8, "text": 32, "text4k": 32, "retrieval": 32, "image": 64, "pathfinder32": 64}


def get_config(task: str, variant: str = "quick", overrides=None) -> ExperimentConfig:
    """The config of ``task`` (one of `TASKS`) in ``variant`` (``"faithful"``, ``"quick"`` or ``"tiny"``),
    with ``overrides`` (``["model.d_model=128", "train.lr=3e-4", "data.difficulty='easy'"]`` or a
    dict of the same keys) applied."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    seq_len, vocab, classes, grid = _DATA[task]
    faithful, quick, notes = _TRAIN[task]
    model = ModelConfig(vocab_size=vocab, num_classes=classes, seq_len=seq_len, d_model=64, n_heads=2, n_layers=2,
                        d_ff=128, dropout=0.1, attn_dropout=0.1, pos_emb="grid" if grid else "learned", grid=grid,
                        pooling="mean", dual=task == "retrieval")
    train = TrainConfig(**(faithful if variant == "faithful" else quick))
    # Pathfinder: the release's images (the authors' generator, quirks included) unless overridden
    data = {"difficulty": "hard", "fidelity": "release"} if task.startswith("path") else {}
    if variant == "tiny":
        tiny_train, tiny_model, tiny_data = _TINY[task]
        train = TrainConfig(**tiny_train)
        # sparseflash (its PyTorch reference on a CPU) through a butterfly whose blocks are small
        # enough for the mask to be sparse at the tiny length; no attention dropout
        model = dataclasses.replace(model, attention="sparseflash", pattern="butterfly", attn_dropout=0.0,
                                    **{"block_size": _TINY_BLOCK.get(task, 128), **tiny_model})
        data.update(tiny_data)
        notes = "tiny: a CPU-sized check that the pipeline learns (configs.py docstring); " + notes
    cfg = ExperimentConfig(task=task, variant=variant, model=model, train=train, data=data,
                           init_from_task=_INIT_FROM.get(task), notes=notes)
    if overrides:
        apply_overrides(cfg, overrides)
    return cfg.validate()


def apply_overrides(cfg: ExperimentConfig, overrides) -> ExperimentConfig:
    """Set ``section.field=value`` entries (section ``model``, ``train`` or ``data``; a top-level
    field without a section). Values are Python literals (strings may go unquoted) and are checked
    against the field's type. Modifies ``cfg`` in place and returns it."""
    if isinstance(overrides, dict):
        items = list(overrides.items())
    else:
        items = []
        for text in overrides:
            if not isinstance(text, str) or "=" not in text:
                raise ValueError(f"override must look like section.field=value, got {text!r}")
            key, _, value = text.partition("=")
            items.append((key.strip(), _literal(value.strip())))
    for key, value in items:
        section, _, name = key.rpartition(".")
        if section == "data":
            cfg.data[name] = value
            continue
        target = {"": cfg, "model": cfg.model, "train": cfg.train}.get(section)
        if target is None:
            raise ValueError(f"override {key!r}: section must be model, train or data, got {section!r}")
        hints = typing.get_type_hints(type(target))
        fields = [f.name for f in dataclasses.fields(target) if f.name not in ("model", "train")]
        if name not in fields:
            raise ValueError(f"override {key!r}: {type(target).__name__} has no field {name!r}; fields: {fields}")
        setattr(target, name, _coerce(value, hints[name], key))
    # a step count set while the config derives it from epochs would be overwritten without a word
    keys = {k for k, _ in items}
    for steps, epochs in (("train.steps", "train.epochs"), ("train.warmup_steps", "train.warmup_epochs")):
        derived_from = getattr(cfg.train, epochs.split(".")[1])
        if steps in keys and derived_from is not None:
            raise ValueError(f"override {steps!r}: this config derives it from {epochs}={derived_from!r} "
                             f"({steps.split('.')[1]} = epochs x (train size // batch size)); set {epochs}=None "
                             f"as well, or stop a run early with --max-steps")
    return cfg


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: a string


def _coerce(value, hint, key: str):
    """Check ``value`` against the type ``hint`` (int -> float allowed, list -> tuple)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for opt in options:
        base = typing.get_origin(opt) or opt
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base is bool and isinstance(value, bool):
            return value
        if base is bool and value in ("true", "false"):  # the shell's spelling
            return value == "true"
        if base is str and isinstance(value, str):
            return value
        if base is tuple and isinstance(value, (tuple, list)):
            return tuple(value)
        if base is dict and isinstance(value, dict):
            return value
    raise ValueError(f"override {key}={value!r}: expected {hint}")
