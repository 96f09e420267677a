"""The LRA headline numbers as one tidy table, built from the run files, and the prose made from it.

    python -m sparseflash.experiments.lra.headline            # rewrite results/headline.csv, RESULTS.md's table, README's LRA sentences
    python -m sparseflash.experiments.lra.headline --check    # exit 1 when any of the three is stale
    python -m sparseflash.experiments.lra.headline --record-listops-lengths   # regenerate ListOps' test lengths (~5 min)

``experiments/lra/results/headline.csv`` has one row per (task, training fidelity, evaluation
set, pattern, density, seed, run): ``task`` (listops, pathfinder32, pathx, path256),
``train_fidelity`` (the generator of the training images: release, clean; ``-`` for ListOps),
``eval_set``, ``pattern``, ``density`` (block density of the attention pattern as the run
recorded it: over the full grid of ``seq_len`` positions), ``attended_tokens`` (the mean number of
tokens an example of the evaluation set attends over: with black pixels as padding, the drawn
pixels, packed to the front; without, every position; for ListOps its own length, the keys past it
masked), ``effective_density`` (the share of blocks
the pattern keeps over those tokens: its top-left corner of ceil(attended_tokens / block_size)
blocks, which is what the packed encoder runs, `model.Encoder.pattern_corner`; 1 for dense),
``seed`` (the run's training seed), ``test_acc``, ``stderr`` (binomial,
sqrt(p (1 - p) / n)), ``n_test``, ``commit``, ``gpu`` (``cpu`` where the evaluation ran on a
CPU), ``date``, ``source`` (the file the number is read from, relative to the repository root;
``#key`` names the row of a table) and ``run`` (the run's name; it tells apart runs that share the
other keys, e.g. the two dense Path-X runs and the 15.6K-step Pathfinder-32 sweep).

Evaluation sets:

- ``test``: ListOps' test split (2,000).
- ``release``: the test split of the release-fidelity data the run trained on (Pathfinder-32:
  20,000 images, scored once at the end of the run with the best-on-validation weights).
- ``release-val``: Path-X / Path-256's 10,000 held-out release images. They were scored after
  every curriculum stage while the curriculum was designed (~35 stages), so they are a
  validation set now, not a test set.
- ``fresh``: 2,000 fresh release images drawn with another seed (1), scored once per model.
- ``clean``: images of the clean generator (Pathfinder-32: 20,000; Path-X / Path-256: 2,000
  fresh ones).
- ``swap-R``: the swap test (``zero_shot.py --swap R``): the share of answers that follow the
  marker neighbourhoods (radius R) of an image of the other label.
- ``cut-positives`` / ``joined-negatives`` / ``balanced`` (``studies/pathx/cue_tests.py``, rows read
  by `_from_cue_tests` once a run of it is committed): the share of answers that follow a cut or a
  join far from the markers, per class; accuracy on the cue-balanced set.

Commits. Where a run file records the commit of the code that ran, that is the commit. The
Pathfinder-32 runs' ``summary.json`` carries none (written before run records kept their commit); for them ``commit``
is what the history shows, prefixed ``history:``, one commit per command of a run joined by
``>``: ``+dirty`` where the tree sent to the GPU had uncommitted edits
(``experiments/studies/pathfinder-release/calls.md``), and the HEAD at the time each command
started otherwise (whether that tree was clean is not recorded). ``HISTORY`` below holds them, with
the reason for each. Runs whose commands record their commits (the Pathfinder-32 seeds 1 and 2) list
them the same way, without the prefix: ``909660a>341a6f3`` is a run resumed at the second commit.

Seeds: the faithful Pathfinder-32 runs on release data have three (``PF_SEEDS``: ``dense-bip``,
``butterfly-bip`` are seed 0, ``-s1`` / ``-s2`` seeds 1 and 2, same recipe and data); RESULTS.md's
table gives seed 0 with its standard error and the mean ± sample standard deviation over the
three (`seed_stats`). Seed 0 was also trained again on 2026-11-29 (H200, 341a6f3>87fb685) to keep
its weights (``PF_RERUNS``: ``dense-bip-rerun``, ``butterfly-bip-rerun``; same seed, recipe and
data): their release and clean rows are in the CSV, but not in the table, the seed statistics or
the README's sentences, which stay those of the original seed-0 runs.

``attended_tokens`` and ``effective_density`` are empty where nothing records the attended
length: the Pathfinder-32 runs with black pixels as padding (their files count the 1,024
positions, not the drawn pixels of the images, which were not kept). They are filled where the
run's ``result.json`` or ``zero_shot.json`` row records ``mean_tokens`` (Path-X, Path-256), where
every position is attended (no black-as-padding), and for ListOps from the lengths of its test
split, regenerated (below).

ListOps. The encoder runs the whole pattern of 2,048 positions (16 x 16 blocks of 128; mean
pooling, no CLS token) with the keys past each example's length masked in every layer and the
pooling over its real tokens only, so an example of L tokens is computed by the pattern's top-left
corner of ceil(L / 128) blocks, the corner the packed encoder runs for the pixel tasks.
``attended_tokens`` is the mean length of the 2,000 test examples and ``effective_density`` the
corner at that mean, as for every other row (not the mean over examples of each one's own corner,
which is higher, 0.70 / 0.45 / 0.25 against 0.65 / 0.41 / 0.21 for butterfly 0.5 / 0.25 / 0.125:
short examples sit in the pattern's denser top-left blocks). The run files keep no lengths;
``sweep-listops/test_lengths.json`` holds them, written by ``python -m
sparseflash.experiments.lra.headline --record-listops-lengths`` (`record_listops_lengths`, ~5
minutes of one core): it regenerates `LISTOPS_DATA`, the defaults of ``sparseflash lra data
listops`` (seed 0, 96K / 2K / 2K), which is the command RESULTS.md gives for the sweep (the runs'
``config.json`` has ``"data": {}`` and their command only ``--data data/lra``). The test split is
the last 2,000 of one de-duplicated stream of 100,000, so the whole stream is generated. What
verifies it (`listops_checks`, the file's ``checks``): no run file records a hash of its data, so
the regenerated stream is compared with the one generation of these arguments whose statistics
were kept, run_quick.sh's of 2026-11-22 (``results/train/log.txt``: acceptance, mean length and
the ten label counts of all 100,000 examples, equal), and with the sweep's files (2,000 test and
2,000 validation examples, and an epoch of 1,500 steps of 64: 96,000 training examples, up to
the 63 a last partial batch would drop).
That shows the generator still makes the data it made then, with the sizes the sweep read; that
the sweep's own folder was generated with seed 0 and these arguments rests on the documented
command, not on a recorded checksum. The file's ``sha256`` (of the test tsv as written) lets later
data be checked against it.

Not in the table because no run file holds them: the Pathfinder-64 pretraining (test 72.08%,
quoted from its log in RESULTS.md), the density sweep's seeds 1 and 2 (RESULTS.md's table,
``studies/pathfinder-release/results/sweep-seeds/``), and everything the issue asks for that has not
finished (interventions at 128 / 256 px, a test set used once).
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from pathlib import Path

__all__ = ["ROOT", "CSV", "COLUMNS", "PUBLISHED", "HISTORY", "build_rows", "write_csv", "read_csv",
           "render_table", "render_readme", "update_block", "main", "effective_density", "LISTOPS_DATA",
           "LISTOPS_LENGTHS", "listops_lengths", "record_listops_lengths", "listops_checks"]

ROOT = Path(__file__).resolve().parents[2]
CSV = ROOT / "experiments" / "lra" / "results" / "headline.csv"
RESULTS_MD = ROOT / "experiments" / "lra" / "RESULTS.md"
README = ROOT / "README.md"
COLUMNS = ("task", "train_fidelity", "eval_set", "pattern", "density", "attended_tokens", "effective_density", "seed",
           "test_acc", "stderr", "n_test", "commit", "gpu", "date", "source", "run")
TASKS = ("listops", "pathfinder32", "pathx", "path256")
TASK_NAMES = {"listops": "ListOps", "pathfinder32": "Pathfinder-32", "pathx": "Path-X (16K positions)",
              "path256": "Path-256 (64K positions)"}
# published test accuracy (%): (Transformer or dense, block-sparse FlashAttention). ListOps' and
# Pathfinder-32's first is the vanilla Transformer of the LRA paper (Tay et al. 2021, Table 1:
# 36.37, 71.40); Path-X's first is dense FlashAttention (FlashAttention paper, Dao et al. 2022);
# the block-sparse numbers are the FlashAttention paper's (Table 3: ListOps 37.0, Pathfinder 73.3;
# section 4.2: Path-X 56.0, Path-256 63.1, which only block-sparse reached)
PUBLISHED = {"listops": (36.4, 37.0), "pathfinder32": (71.4, 73.3), "pathx": (61.4, 56.0), "path256": (None, 63.1)}
PUBLISHED_NOTE = ("Published: ListOps and Pathfinder-32 Transformer from the LRA paper (Tay et al. 2021, Table 1: "
                  "36.37, 71.40); Path-X's first number is dense FlashAttention; every block-sparse FlashAttention "
                  "number from the FlashAttention paper (Dao et al. 2022: Table 3 for ListOps and Pathfinder-32, "
                  "section 4.2 for Path-X and Path-256).")

_PF = "experiments/studies/pathfinder-release/results"
# the faithful Pathfinder-32 runs on release data, black as padding: seed 0 (the headline runs of
# 2026-11-26, H100) and seeds 1 and 2 (2026-11-29, H200; issue 68)
PF_SEEDS = ("dense-bip", "butterfly-bip", "dense-bip-s1", "butterfly-bip-s1", "dense-bip-s2", "butterfly-bip-s2")
# seed 0 trained again with its weights exported (2026-11-29, H200); beside the originals, not in
# their place: the headline and the seed statistics use PF_SEEDS only
PF_RERUNS = ("dense-bip-rerun", "butterfly-bip-rerun")
_PX = "experiments/studies/pathx/results/curriculum"
_P256 = "experiments/studies/pathx/results/curriculum256"
_LO = "experiments/lra/results/sweep-listops"
# The data the ListOps sweep trained and was tested on: `sparseflash lra data listops --out DATA`
# with its defaults (RESULTS.md's command for the sweep; the runs' config.json holds "data": {} and
# no generator arguments), generated by code unchanged from 5725ef2 through the sweep's 50050e8 to
# now. Its test split's token lengths are recorded in LISTOPS_LENGTHS by `record_listops_lengths`.
LISTOPS_DATA = {"train": 96000, "val": 2000, "test": 2000, "seed": 0, "min_len": 500, "max_len": 2000,
                "max_depth": 10, "max_args": 10}
LISTOPS_LENGTHS = f"{_LO}/test_lengths.json"
LISTOPS_COMMAND = "python -m sparseflash.experiments.lra.headline --record-listops-lengths"
# the one generation of these arguments whose statistics were kept: run_quick.sh's, 2026-11-22
_LISTOPS_LOG = "experiments/lra/results/train/log.txt"

# Commits the run files do not record, from the history (see the module docstring).
HISTORY = {
    # command 1 ran from the shared tree sent at 11:23:57 (HEAD 0e5d47f, other sessions' edits
    # uncommitted in it: calls.md call 2); commands 2-4 from a snapshot of b0f0354 (calls.md call 3)
    f"{_PF}/dense-bip": "history:0e5d47f+dirty>b0f0354",
    f"{_PF}/butterfly-bip": "history:0e5d47f+dirty>b0f0354",
    # evaluated at the end of call 5, from the b0f0354 snapshot
    f"{_PF}/dense-bip/crosseval-clean.json": "history:b0f0354",
    f"{_PF}/butterfly-bip/crosseval-clean.json": "history:b0f0354",
    # two commands, 2026-11-25 02:37 and 05:03; HEAD then: 50050e8, 35533c3
    "experiments/lra/results/train/pf32-faithful/faithful-dense": "history:50050e8>35533c3",
}


# ----------------------------------------------------------------------------- reading run files
def _read_json(rel: str) -> dict:
    return json.loads((ROOT / rel).read_text())


def _csv_rows(rel: str) -> list[dict]:
    with open(ROOT / rel, newline="") as f:
        return list(csv.DictReader(f))


def _short(commit) -> str:
    commit = str(commit or "")
    return commit[:7] if re.fullmatch(r"[0-9a-f]{8,40}", commit) else commit or "unknown"


def _day(date) -> str:
    return str(date or "")[:10]


def _seed(run_dir: str) -> int:
    return int(_read_json(f"{run_dir}/config.json")["train"]["seed"])


def _row(task, train_fidelity, eval_set, pattern, density, seed, acc, n, commit, gpu, date, source, run,
         attended=None, effective=None) -> dict:
    acc, n = float(acc), int(n)
    return {"task": task, "train_fidelity": train_fidelity, "eval_set": eval_set, "pattern": pattern,
            "density": float(density), "attended_tokens": None if attended is None else round(float(attended), 1),
            "effective_density": None if effective is None else round(float(effective), 4), "seed": int(seed),
            "test_acc": acc,
            "stderr": math.sqrt(acc * (1 - acc) / n), "n_test": n, "commit": commit, "gpu": gpu,
            "date": _day(date), "source": source, "run": run}


def effective_density(model: dict, tokens: float) -> float:
    """The share of blocks the pattern of ``model`` (a run's config.json ``model``) keeps over its
    first ``tokens`` positions (a CLS token first with CLS pooling): the top-left corner of the
    full-length pattern that the packed encoder runs (`model.Encoder.pattern_corner`)."""
    from sparseflash.experiments.lra.model import build_pattern

    if model.get("pattern") in (None, "dense"):
        return 1.0
    c = int(model.get("pooling") == "cls")
    mask = build_pattern(model["pattern"], int(model["seq_len"]) + c, int(model["block_size"]),
                         **(model.get("pattern_kwargs") or {}))
    if mask is None:
        return 1.0
    bq, bk = mask.block_size
    corner = mask.layout[..., :math.ceil((tokens + c) / bq), :math.ceil((tokens + c) / bk)]
    return float(corner.float().mean())


def _attended(run_dir: str, mean_tokens=None) -> tuple:
    """(attended tokens, effective density) of ``run_dir``'s model on a set whose examples attend
    over ``mean_tokens`` (recorded by the evaluation, or for ListOps the mean length of its test
    split, `listops_lengths`); pixels without black-as-padding attend every position; (None, None)
    where nothing records the length (module docstring)."""
    model = _read_json(f"{run_dir}/config.json")["model"]
    if not model.get("black_is_padding") and model.get("vocab_size") == 257 and model.get("grid"):
        mean_tokens = int(model["seq_len"])  # pixels, none of them padding
    if mean_tokens is None:
        return None, None
    return float(mean_tokens), effective_density(model, float(mean_tokens))


def listops_lengths() -> dict | None:
    """`LISTOPS_LENGTHS`: the token lengths of the ListOps sweep's test split (None before it is recorded)."""
    return _read_json(LISTOPS_LENGTHS) if (ROOT / LISTOPS_LENGTHS).is_file() else None


def record_listops_lengths(workers: int = 1) -> dict:
    """Regenerate the ListOps sweep's data (`LISTOPS_DATA`; ~5 minutes of one core) and write its test
    split's lengths, with `listops_checks` against what the run files and the generation log kept,
    to `LISTOPS_LENGTHS`."""
    import time

    from sparseflash.experiments.lra.data.listops import split_lengths
    from sparseflash.experiments.lra.provenance import code_commit

    commit, t0 = code_commit(), time.perf_counter()  # (the code as the run began)
    rec = split_lengths("test", **LISTOPS_DATA, workers=workers)
    lengths = rec.pop("lengths")
    rec = {"command": LISTOPS_COMMAND, "commit": commit, "seconds": round(time.perf_counter() - t0, 1), **rec}
    rec["checks"] = listops_checks(rec)
    rec["lengths"] = lengths
    text = json.dumps({k: v for k, v in rec.items() if k != "lengths"}, indent=1)
    # the 2,000 lengths on one line, so the file stays short to read
    text = text[:-2] + ',\n "lengths": ' + json.dumps(lengths, separators=(",", ":")) + "\n}\n"
    (ROOT / LISTOPS_LENGTHS).write_text(text)
    return rec


def listops_checks(rec: dict) -> dict:
    """What can be compared between a `split_lengths` record of `LISTOPS_DATA` and the files the
    runs left: {check: {"kept": value in the files, "regenerated": value in ``rec``, "equal": bool}}.

    No ListOps run file records a hash of its data. Kept are: the statistics the 2026-11-22 generation
    with the same arguments printed (`_LISTOPS_LOG`: acceptance, mean length, label counts of all
    100,000 examples; another folder than the sweep's, on another host), the sweep's test and
    validation counts (eval.csv) and its epochs (train.csv: steps / steps per epoch, which is
    train size // batch)."""
    out = {}

    def put(name, kept, regenerated):
        out[name] = {"kept": kept, "regenerated": regenerated, "equal": kept == regenerated}

    line = (ROOT / _LISTOPS_LOG).read_text().splitlines()[0]
    m = re.search(r"acceptance ([\d.]+), mean length (\d+), labels (\{[^}]*\})", line)
    if m is None:
        raise LookupError(f"{_LISTOPS_LOG}: no ListOps generation line")
    stream = rec["stream"]
    put("log: acceptance (3 decimals)", m.group(1), f"{stream['acceptance']:.3f}")
    put("log: mean length (rounded)", m.group(2), f"{stream['mean_length']:.0f}")
    labels = {str(k): v for k, v in json.loads(re.sub(r"(\d+):", r'"\1":', m.group(3))).items()}
    put("log: label counts", labels, stream["labels"])
    for run in ("dense-d1-s0", "butterfly-d0.5-s0", "butterfly-d0.25-s0", "butterfly-d0.125-s0"):
        d = f"{_LO}/runs/{run}"
        n = {(r["split"]): int(r["n"]) for r in _csv_rows(f"{d}/eval.csv")}
        put(f"{run}: test count", n["test"], rec["count"])
        put(f"{run}: validation count", n["val"], rec["generator"]["val"])
        batch = int(_read_json(f"{d}/config.json")["train"]["batch_size"])
        last = _csv_rows(f"{d}/train.csv")[-1]
        spe = rec["generator"]["train"] // batch
        put(f"{run}: epoch at step {last['step']}", float(last["epoch"]), round(int(last["step"]) / spe, 4))
    return out


def _from_sweep(table: str, run: str, train_fidelity: str) -> dict:
    """A row of a ``sparseflash lra sweep`` table (its run's test accuracy, best-on-val weights)."""
    r = next((r for r in _csv_rows(table) if r["run"] == run), None)
    if r is None:
        raise LookupError(f"{table}: no run {run!r}")
    mean_tokens = None
    if r["task"] == "listops" and str(Path(table).parent) == _LO and (lengths := listops_lengths()) is not None:
        if lengths["count"] != int(r["test_n"]):
            raise AssertionError(f"{LISTOPS_LENGTHS} holds {lengths['count']} lengths, {run} tested {r['test_n']}")
        mean_tokens = lengths["mean"]
    return _row(r["task"], train_fidelity, "test" if r["task"] == "listops" else "release", r["pattern"],
                r["density"], r["seed"], r["test_acc"], r["test_n"], _short(r["commit"]), r["gpu"], r["date"],
                f"{table}#{run}", run, *_attended(str(Path(table).parent / "runs" / run), mean_tokens))


def _segment_commits(summary: dict) -> str:
    """The commits a run's commands ran, in order, joined by ``>`` (a run resumed over commands
    at two commits is both); the summary's own commit where no command records one."""
    commits = [_short(g["commit"]) for g in summary.get("segments", []) if g.get("commit")]
    return ">".join(dict.fromkeys(commits)) if commits else _short(summary.get("commit"))


def _from_summary(run_dir: str, train_fidelity: str, eval_set: str) -> dict:
    """A training run's ``summary.json``: test accuracy of the best-on-validation weights."""
    s = _read_json(f"{run_dir}/summary.json")
    commit = _segment_commits(s) if s.get("commit") else HISTORY.get(run_dir, "unknown")
    return _row(s["task"], train_fidelity, eval_set, s["pattern"], s["density"], _seed(run_dir),
                s["test_best"]["acc"], s["test_best"]["n"], commit, s["gpu"], s["segments"][-1]["ended"],
                f"{run_dir}/summary.json", Path(run_dir).name, *_attended(run_dir))


def _from_crosseval(run_dir: str, name: str, eval_set: str, train_fidelity: str) -> dict:
    """A ``sparseflash lra evaluate`` result beside a run (GPU and date: the run's last command's)."""
    e, s = _read_json(f"{run_dir}/{name}"), _read_json(f"{run_dir}/summary.json")
    commit = _short(e["commit"]) if e.get("commit") else HISTORY.get(f"{run_dir}/{name}", "unknown")
    return _row(e["task"], train_fidelity, eval_set, s["pattern"], s["density"], _seed(run_dir), e["acc"], e["n"],
                commit, s["gpu"] if e.get("device") == "cuda" else e.get("device", "unknown"),
                e.get("date") or s["segments"][-1]["ended"], f"{run_dir}/{name}", Path(run_dir).name, *_attended(run_dir))


def _from_result(run_dir: str, task: str) -> dict:
    """A ``neighbourhood.py`` run's ``result.json`` (held-out accuracy of the best-on-val weights)."""
    r, s = _read_json(f"{run_dir}/result.json"), _read_json(f"{run_dir}/summary.json")
    return _row(task, "release", "release-val", s["pattern"], s["density"], _seed(run_dir), r["test_acc"], r["n_test"],
                _short(r["commit"]), s["gpu"], r["date"], f"{run_dir}/result.json", r["tag"],
                *_attended(run_dir, r.get("mean_tokens")))


def _from_zero_shot(folder: str, label: str, input_: str, run_dir: str, task: str, eval_set: str) -> dict:
    """A row of ``zero_shot.py``'s table: model ``label`` (trained in ``run_dir``) on ``input_``."""
    z = _read_json(f"{folder}/zero_shot.json")
    r = next((r for r in z["rows"] if r["label"] == label and r["input"] == input_), None)
    if r is None:
        raise LookupError(f"{folder}/zero_shot.json: no row for {label!r} on {input_!r}")
    s, res = _read_json(f"{run_dir}/summary.json"), _read_json(f"{run_dir}/result.json")
    m = z["meta"]
    return _row(task, "release", eval_set, s["pattern"], s["density"], _seed(run_dir), r["acc"], r["n"],
                _short(m.get("commit")), "cpu" if m.get("device") == "cpu" else m.get("gpu", m.get("device")),
                m.get("date"), f"{folder}/zero_shot.json#{label}/{input_}", res["tag"],
                *_attended(run_dir, r.get("mean_tokens")))


def _from_cue_tests(folder: str, label: str, set_: str, cls: str, run_dir: str, task: str, eval_set: str) -> dict:
    """A row of ``cue_tests.py``'s table: model ``label`` (trained in ``run_dir``) on ``set_`` /
    ``cls``. For the cut set ``test_acc`` is the follow rate (answers equal to the changed image's
    label: 0 for a cut positive, 1 for a joined negative; also the dashed join's); otherwise the accuracy."""
    z = _read_json(f"{folder}/cue_tests.json")
    r = next((r for r in z["rows"] if r["label"] == label and r["set"] == set_ and r["class"] == cls), None)
    if r is None:
        raise LookupError(f"{folder}/cue_tests.json: no row for {label!r} on {set_!r} / {cls!r}")
    s, m = _read_json(f"{run_dir}/summary.json"), z["meta"]
    name = _read_json(f"{run_dir}/result.json")["tag"] if (ROOT / run_dir / "result.json").is_file() else Path(run_dir).name
    return _row(task, "release", eval_set, s["pattern"], s["density"], _seed(run_dir),
                r["follow"] if "follow" in r else r["acc"], r["n"], _short(m.get("commit")),
                m.get("gpu") or m.get("device"), m.get("date"), f"{folder}/cue_tests.json#{label}/{set_}/{cls}", name,
                *_attended(run_dir, r.get("mean_tokens")))


def build_rows() -> list[dict]:
    """Every headline row, read from the run files (nothing typed in but where to look)."""
    rows = [_from_sweep(f"{_LO}/sweep.csv", run, "-")
            for run in ("dense-d1-s0", "butterfly-d0.5-s0", "butterfly-d0.25-s0", "butterfly-d0.125-s0")]
    for run in PF_SEEDS + PF_RERUNS:
        rows.append(_from_summary(f"{_PF}/{run}", "release", "release"))
        rows.append(_from_crosseval(f"{_PF}/{run}", "crosseval-clean.json", "clean", "release"))
    rows.append(_from_summary("experiments/lra/results/train/pf32-faithful/faithful-dense", "clean", "clean"))
    rows += [_from_sweep(f"{_PF}/sweep/sweep.csv", run, "release")
             for run in ("dense-d1-s0", "butterfly-d0.5-s0", "butterfly-d0.25-s0", "butterfly-d0.125-s0")]
    px = {"dense": f"{_PX}/runs/cont-dense/cont-dense-1-full", "dense-lr3e-4": f"{_PX}/runs/cont-lr3e-4/cont-lr3e-4-1-full",
          "butterfly": f"{_PX}/runs/cont-bfly/cont-bfly-1-full"}
    rows += [_from_result(d, "pathx") for d in px.values()]
    for label, key in (("curriculum, dense", "dense-lr3e-4"), ("curriculum, butterfly", "butterfly")):
        rows.append(_from_zero_shot(f"{_PX}/fresh-release", label, "full", px[key], "pathx", "fresh"))
        rows.append(_from_zero_shot(f"{_PX}/fresh-clean", label, "full", px[key], "pathx", "clean"))
    for label, key in (("dense-lr3e-4", "dense-lr3e-4"), ("butterfly", "butterfly")):
        rows.append(_from_zero_shot(f"{_PX}/swap", label, "swapR6", px[key], "pathx", "swap-R6"))
    p256 = f"{_P256}/runs/sincos-stages/sincos-stages-9-full"
    rows.append(_from_result(p256, "path256"))
    rows.append(_from_zero_shot(f"{_P256}/fresh-release", "sincos-lr3e-4", "full", p256, "path256", "fresh"))
    rows.append(_from_zero_shot(f"{_P256}/fresh-clean", "sincos-lr3e-4", "full", p256, "path256", "clean"))
    rows.append(_from_zero_shot(f"{_P256}/swap", "sincos-lr3e-4", "swapR8", p256, "path256", "swap-R8"))
    keys = [tuple(r[k] for k in ("task", "train_fidelity", "eval_set", "pattern", "density", "seed", "run")) for r in rows]
    if len(set(keys)) != len(keys):
        raise AssertionError("two headline rows share their keys")
    return rows


# ----------------------------------------------------------------------------- the CSV
def _fmt(key, v) -> str:
    if v is None:
        return ""
    if key in ("test_acc", "stderr"):
        return f"{v:.6f}"
    if key in ("density", "attended_tokens", "effective_density"):
        return f"{v:g}"
    return str(v)


def write_csv(rows: list[dict], path: Path = CSV) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(csv_text(rows))


def csv_text(rows: list[dict]) -> str:
    lines = [",".join(COLUMNS)]
    for r in rows:
        cells = [_fmt(k, r[k]) for k in COLUMNS]
        lines.append(",".join(f'"{c}"' if ("," in c or '"' in c) else c for c in cells))
    return "\n".join(lines) + "\n"


def read_csv(path: Path = CSV) -> list[dict]:
    """headline.csv's rows, numbers parsed."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["density"], r["test_acc"], r["stderr"] = float(r["density"]), float(r["test_acc"]), float(r["stderr"])
        for k in ("attended_tokens", "effective_density"):
            r[k] = float(r[k]) if r[k] != "" else None
        r["seed"], r["n_test"] = int(r["seed"]), int(r["n_test"])
    return rows


# ----------------------------------------------------------------------------- the prose
def _one(rows, **want) -> dict:
    found = [r for r in rows if all(r[k] == v for k, v in want.items())]
    if len(found) != 1:
        raise LookupError(f"{len(found)} headline rows match {want}")
    return found[0]


def _pct(r, digits=None) -> str:
    d = digits if digits is not None else (2 if r["n_test"] >= 20000 or r["task"] == "listops" else 1)
    return f"{100 * r['test_acc']:.{d}f}"


def _pm(r) -> str:
    d = 2 if r["n_test"] >= 20000 or r["task"] == "listops" else 1
    return f"{_pct(r)} ± {100 * r['stderr']:.{d}f}%"


def _density(d: float) -> str:
    return "dense" if d == 1 else f"butterfly {d:g}"


def _span(values, digits=1, sep="–") -> str:
    lo, hi = f"{100 * min(values):.{digits}f}", f"{100 * max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}{sep}{hi}"


def published_gap(rows, task="path256") -> float:
    """How many of our standard errors the published block-sparse number lies above our release-val one."""
    r = _one(rows, task=task, eval_set="release-val")
    return (PUBLISHED[task][1] / 100 - r["test_acc"]) / r["stderr"]


def render_table(rows) -> str:
    """RESULTS.md's headline table: one line a task, every number a headline.csv row."""
    lo = [r for r in rows if r["task"] == "listops"]
    pf = [r for r in rows if r["task"] == "pathfinder32" and r["run"].endswith("-bip")]
    pf_all = [r for r in rows if r["task"] == "pathfinder32" and r["train_fidelity"] == "release"
              and re.fullmatch(r"(dense|butterfly)-bip(-s\d+)?", r["run"])]
    out = ["| task | published: Transformer (Path-X: dense FlashAttention) / block-sparse FlashAttention | ours, release "
           "data (best-on-validation weights, ± one binomial standard error) | ours, other evaluation sets | commit, GPU, "
           "date |",
           "|---|---|---|---|---|"]

    def pub(task):
        a, b = PUBLISHED[task]
        return f"{'—' if a is None else f'{a:.1f}'} / {b:.1f}"

    def prov(rs):
        commits = ", ".join(dict.fromkeys(r["commit"] for r in rs))
        gpus = ", ".join(dict.fromkeys(r["gpu"] for r in rs))
        dates = ", ".join(dict.fromkeys(r["date"] for r in rs))
        return f"{commits}; {gpus}; {dates}"

    out.append(f"| ListOps | {pub('listops')} | " + ", ".join(f"{_density(r['density'])} {_pm(r)}" for r in lo)
               + f" (quick config, seed {lo[0]['seed']}{_listops_attended(lo)}) | — | {prov(lo)} |")
    rel = [r for r in pf if r["eval_set"] == "release"]
    cl = [r for r in pf if r["eval_set"] == "clean"]
    clean_trained = _one(rows, task="pathfinder32", train_fidelity="clean")
    seeds_rel = [r for r in pf_all if r["eval_set"] == "release" and r not in rel]
    seeds_cl = [r for r in pf_all if r["eval_set"] == "clean" and r not in cl]
    out.append(f"| Pathfinder-32 | {pub('pathfinder32')} | " + ", ".join(f"**{_density(r['density'])} {_pm(r)}**" for r in rel)
               + f" (faithful, black as padding, seed {rel[0]['seed']}); over seeds "
               + f"{_seed_list(pf_all)} (mean ± sample standard deviation, then each seed): "
               + ", ".join(_seed_text(pf_all, r["pattern"], "release") for r in rel) + _seed0_rank(pf_all, rel)
               + f" | the same weights on {cl[0]['n_test']:,} clean images: "
               + ", ".join(f"{_pct(r)}%" for r in cl) + f" (seeds {_seed_list(pf_all)}: "
               + ", ".join(_seed_text(pf_all, r["pattern"], "clean") for r in cl)
               + f"); trained on clean data (dense): {_pct(clean_trained)}% | "
               + f"seed 0: {prov(rel + cl)}; seeds {_seed_list(seeds_rel)}: {prov(seeds_rel + seeds_cl)}; "
               + f"clean-trained {clean_trained['commit']} |")
    for task in ("pathx", "path256"):
        val = [r for r in rows if r["task"] == task and r["eval_set"] == "release-val"]
        others = [r for r in rows if r["task"] == task and r["eval_set"] != "release-val"]
        cells = []
        for es, what in (("fresh", "fresh release images, scored once per model"), ("clean", "clean images"),
                         ("swap-R6", "swap test, answers following the R = 6 neighbourhoods"),
                         ("swap-R8", "swap test, answers following the R = 8 neighbourhoods")):
            rs = [r for r in others if r["eval_set"] == es]
            if rs:
                cells.append(f"{what} ({rs[0]['n_test']:,}): " + ", ".join(f"{r['run']} {_pct(r)}%" for r in rs))
        out.append(f"| {TASK_NAMES[task]} | {pub(task)} | "
                   + ", ".join(f"**{r['run']} ({_model_text(r)}) {_pm(r)}**" for r in val)
                   + f" on {val[0]['n_test']:,} held-out images that also guided the curriculum (a validation set) | "
                   + "; ".join(cells) + f" | {prov(val)}; evaluations {prov(others)} |")
    return "\n".join(out + ["", PUBLISHED_NOTE])


def _listops_attended(lo) -> str:
    """``; an example attends over its own length, ~1.03K tokens on average: there butterfly 0.5 /
    0.25 / 0.125 keep 0.65 / 0.41 / 0.21 of the blocks``, where the ListOps rows know their length."""
    tokens = {r["attended_tokens"] for r in lo}
    sparse = [r for r in lo if r["density"] < 1]
    if len(tokens) != 1 or None in tokens or not sparse:
        return ""
    return (f"; an example attends over its own length, ~{tokens.pop() / 1000:.2f}K tokens on average: there "
            + "butterfly " + " / ".join(f"{r['density']:g}" for r in sparse) + " keep "
            + " / ".join(f"{r['effective_density']:.2f}" for r in sparse) + " of the blocks")


def seed_stats(rows, pattern: str, eval_set: str) -> tuple[float, float, list[dict]]:
    """(mean, sample standard deviation, the rows) of the faithful black-as-padding Pathfinder-32
    runs of ``pattern`` on ``eval_set`` over their seeds (accuracies as fractions)."""
    import statistics

    found = sorted((r for r in rows if r["task"] == "pathfinder32" and r["train_fidelity"] == "release"
                    and r["pattern"] == pattern and r["eval_set"] == eval_set
                    and re.fullmatch(r"(dense|butterfly)-bip(-s\d+)?", r["run"])), key=lambda r: r["seed"])
    accs = [r["test_acc"] for r in found]
    return statistics.mean(accs), statistics.stdev(accs) if len(accs) > 1 else 0.0, found


def _seed_list(rs) -> str:
    seeds = sorted({r["seed"] for r in rs})
    return ", ".join(map(str, seeds[:-1])) + f" and {seeds[-1]}" if len(seeds) > 1 else str(seeds[0])


def _seed_text(rows, pattern: str, eval_set: str) -> str:
    """``dense 72.51 ± 1.78% (74.18, 70.63, 72.72)``: mean ± sample standard deviation over the
    seeds, then each seed's accuracy in seed order."""
    mean, sd, found = seed_stats(rows, pattern, eval_set)
    each = ", ".join(f"{100 * r['test_acc']:.2f}" for r in found)
    return f"{_density(found[0]['density'])} {100 * mean:.2f} ± {100 * sd:.2f}% ({each})"


_WORDS = {2: "two", 3: "three", 4: "four", 5: "five"}


def _seed0_rank(rows, rel) -> str:
    """``; seed 0 is the highest of the three for both``, or which patterns it is highest for."""
    best = [r["pattern"] for r in rel if r["test_acc"] >= max(x["test_acc"] for x in seed_stats(rows, r["pattern"], "release")[2])]
    n = len(seed_stats(rows, rel[0]["pattern"], "release")[2])
    if not best:
        return ""
    which = "both" if len(best) == len(rel) == 2 else " and ".join(best)
    return f"; seed 0 is the highest of the {_WORDS.get(n, n)} for {which}, the means are lower"


def _continued_from(row) -> tuple[str, int] | None:
    """(pattern of the run it started from, its own steps) when a ``release-val`` row's run
    continued a committed run of another pattern (its ``init_from`` names that run's folder)."""
    r = _read_json(row["source"])
    init = r.get("init_from")
    if not init:
        return None
    name = Path(init).parent.parent.name
    root = ROOT / Path(row["source"]).parents[2]  # .../runs/<chain>/<run>/result.json -> .../runs
    found = sorted(root.glob(f"*/{name}/summary.json"))
    if len(found) != 1:
        return None
    pattern = json.loads(found[0].read_text())["pattern"]
    return (pattern, int(r["steps"])) if pattern != row["pattern"] else None


def _model_text(row) -> str:
    """A Path-X / Path-256 model in the table: its pattern, the density of the full grid and over
    the attended tokens, and a continuation of another pattern's model said as such."""
    if row["density"] == 1:
        return "dense"
    text = f"butterfly {row['density']:g} of the full grid"
    if row["effective_density"] is not None:
        text += f", {row['effective_density']:.2f} of the blocks over its ~{row['attended_tokens'] / 1000:.2f}K attended tokens"
    cont = _continued_from(row)
    if cont:
        text = f"a {cont[0]} curriculum model continued {cont[1]:,} steps with {text}"
    return text


def render_readme(rows) -> str:
    """README's LRA sentences, numbers from headline.csv."""
    lo = [r for r in rows if r["task"] == "listops"]
    pf = {r["pattern"]: r for r in rows if r["task"] == "pathfinder32" and r["run"].endswith("-bip") and r["eval_set"] == "release"}
    pf_clean = [r for r in rows if r["task"] == "pathfinder32" and r["eval_set"] == "clean" and r["run"] not in PF_RERUNS]
    px = [r for r in rows if r["task"] == "pathx" and r["eval_set"] == "release-val"]
    px_dense = [r for r in px if r["pattern"] == "dense"]
    px_bf = _one(rows, task="pathx", eval_set="release-val", pattern="butterfly")
    px_fresh = {r["pattern"]: r for r in rows if r["task"] == "pathx" and r["eval_set"] == "fresh"}
    p256 = _one(rows, task="path256", eval_set="release-val")
    p256_fresh = _one(rows, task="path256", eval_set="fresh")
    chains = _chains_that_learned()
    pf_d, pf_b = seed_stats(rows, "dense", "release"), seed_stats(rows, "butterfly", "release")
    n_pf = len(pf_d[2])
    return (
        f"On LRA ([experiments/lra/RESULTS.md](experiments/lra/RESULTS.md), `results/headline.csv`; one seed "
        f"each, Pathfinder-32 {_WORDS.get(n_pf, n_pf)}) ListOps keeps {_span([r['test_acc'] for r in lo])}% down to "
        f"1/8 of the blocks{_listops_sparsest(lo)}. "
        f"Pathfinder-32: {100 * pf_d[0]:.1f} ± {100 * pf_d[1]:.1f}% dense, {100 * pf_b[0]:.1f} ± {100 * pf_b[1]:.1f}% with butterfly "
        f"at half the blocks (seed 0: {_pct(pf['dense'], 1)} / {_pct(pf['butterfly'], 1)}%; published "
        f"{PUBLISHED['pathfinder32'][0]:g}–{PUBLISHED['pathfinder32'][1]:g}%) on the authors' generator's images "
        f"(`--fidelity release`), {_span([r['test_acc'] for r in pf_clean], 0)}% without its quirks: the marker "
        f"positions alone give {_probe32():.0f}% of release labels. Path-X (16K positions, "
        f"~{_tokens(px_bf):.2f}K drawn pixels attended): {_span([r['test_acc'] for r in px_dense])}% dense, "
        f"{_pct(px_bf)}% for the dense curriculum model continued {_continued_from(px_bf)[1] / 1000:.1f}K steps "
        f"with butterfly (published {PUBLISHED['pathx'][0]:.1f} / {PUBLISHED['pathx'][1]:.1f}) on 10K "
        f"release images used to design the curriculum (a validation set; {_pct(px_fresh['dense'])}% / "
        f"{_pct(px_fresh['butterfly'])}% on 2,000 fresh ones), after a curriculum of growing marker neighbourhoods. "
        f"Path-256 (64K positions, ~{_tokens(p256):.2f}K attended): "
        f"{_pct(p256)}% butterfly, sparse from its first stage ({p256['density']:.4f} of the full grid, "
        f"{p256['effective_density']:.2f} of the blocks over the attended tokens; {_pct(p256_fresh)}% on fresh images), {published_gap(rows):.1f} standard errors "
        f"below the published {PUBLISHED['path256'][1]:g}, with 2-D sin-cos positions ({chains[0]} of {chains[1]} "
        f"chains learned). All are at chance on clean images.")


def _listops_sparsest(lo) -> str:
    """`` (0.21 over its ~1.03K attended tokens)``: the sparsest ListOps row over what it attends."""
    r = min(lo, key=lambda r: r["density"])
    if r["effective_density"] is None:
        return ""
    return f" ({r['effective_density']:.2f} over its ~{r['attended_tokens'] / 1000:.2f}K attended tokens)"


def _tokens(row) -> float:
    """Mean drawn (attended) tokens an image of a ``release-val`` row's run, in thousands."""
    return _read_json(row["source"])["mean_tokens"] / 1000


def _probe32() -> float:
    """The marker-coordinate probe's accuracy on Pathfinder-32 release labels (%)."""
    rows = _read_json("experiments/studies/pathfinder-generator/probe32/probe.json")["rows"]
    return 100 * next(r["acc"] for r in rows if r["fidelity"] == "release" and r["features"] == "coords")


def _chains_that_learned(threshold_se: float = 3.0) -> tuple[int, int]:
    """(chains whose last, whole-image stage beats chance by ``threshold_se`` standard errors, chains)
    of the Path-256 curriculum (``curriculum256/curriculum.csv``)."""
    last = {}
    for r in _csv_rows(f"{_P256}/curriculum.csv"):
        if r["chain"] not in last or int(r["stage"]) > int(last[r["chain"]]["stage"]):
            last[r["chain"]] = r
    learned = sum(float(r["test_acc"]) - 0.5 > threshold_se * float(r["test_se"]) for r in last.values())
    return learned, len(last)


# ----------------------------------------------------------------------------- the documents
def update_block(text: str, name: str, body: str, before: str = "\n", after: str = "\n") -> str:
    """``text`` with what lies between ``<!-- name -->`` and ``<!-- /name -->`` replaced by ``body``
    (``before`` and ``after`` it)."""
    pattern = re.compile(rf"(<!-- {re.escape(name)} -->)(.*?)(<!-- /{re.escape(name)} -->)", re.S)
    if len(pattern.findall(text)) != 1:
        raise LookupError(f"expected one <!-- {name} --> ... <!-- /{name} --> block")
    return pattern.sub(lambda m: m.group(1) + before + body + after + m.group(3), text)


def block(text: str, name: str) -> str:
    m = re.search(rf"<!-- {re.escape(name)} -->(.*?)<!-- /{re.escape(name)} -->", text, re.S)
    if m is None:
        raise LookupError(f"no <!-- {name} --> block")
    return m.group(1)


def _wrap(text: str, width: int = 100) -> str:
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join(lines + [line])


def main(argv=None) -> int:
    from sparseflash.cmdline import ArgumentParser

    ap = ArgumentParser(prog="python -m sparseflash.experiments.lra.headline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if headline.csv, RESULTS.md or README.md is stale")
    ap.add_argument("--record-listops-lengths", action="store_true",
                    help=f"regenerate the ListOps sweep's data (~5 minutes of one core) and write {LISTOPS_LENGTHS}, "
                         "then rebuild as usual")
    ap.add_argument("--workers", type=int, default=1, help="processes generating ListOps (--record-listops-lengths)")
    a = ap.parse_args(argv)
    if a.record_listops_lengths:
        rec = record_listops_lengths(a.workers)
        bad = [k for k, c in rec["checks"].items() if not c["equal"]]
        print(f"wrote {LISTOPS_LENGTHS}: {rec['count']} lengths, mean {rec['mean']:.1f}, in {rec['seconds']:.0f} s; "
              + (f"checks that differ: {bad}" if bad else f"all {len(rec['checks'])} checks equal"))
        if bad:
            return 1
    rows = build_rows()
    want = {CSV: csv_text(rows)}
    results, readme = RESULTS_MD.read_text(), README.read_text()
    want[RESULTS_MD] = update_block(results, "headline", render_table(rows))
    # README: compared without line breaks, so a rewrap there is not a change
    if " ".join(block(readme, "lra-headline").split()) != render_readme(rows):
        want[README] = update_block(readme, "lra-headline", _wrap(render_readme(rows)), after=" ")
    stale = [p for p, t in want.items() if not p.exists() or p.read_text() != t]
    if a.check:
        for p in stale:
            print(f"stale: {p.relative_to(ROOT)} (run python -m sparseflash.experiments.lra.headline)", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(want[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    from sparseflash.cmdline import run_command

    raise SystemExit(run_command(main))
