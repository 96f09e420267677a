"""Loaders for every LRA task, reading the release layout (``lra_release/``) or user-provided data.

    ds = get_dataset("listops", root, "train")          # root: the folder holding listops-1000/ ...
    ds[i] -> {"tokens": LongTensor[seq_len], "length": int, "label": int}
    ds[i] -> {"tokens": LongTensor[2, seq_len], "length": LongTensor[2], "label": int}   (retrieval)

Vocabularies (0 is padding everywhere, and no real token is ever 0, so ``tokens != 0`` and
``length`` agree):

============  ==========================================================  =====  =======  =======
task          tokens                                                      vocab  classes  seq_len
============  ==========================================================  =====  =======  =======
listops       parentheses removed, ``]`` kept: digits 0-9 -> 1-10,        16     10       2048
              ``[MIN [MAX [MED [SM`` -> 11-14, ``]`` -> 15; sequences are
              cut at ``max_len`` = 2000 (the release never exceeds it)
text, text4k  UTF-8 bytes + 1 of the review, cut at 1000 / 4000 bytes     257    2        1024 / 4096
retrieval     UTF-8 bytes + 1 of each document, cut at 4000                257    2        4096 x 2
image         CIFAR-10 in grayscale (TF's rgb_to_grayscale), pixel + 1     257    10       1024
pathfinder*   pixel + 1 (32, 64, 128 = Path-X, 256 = Path-256)            257    2        R * R
============  ==========================================================  =====  =======  =======

Pixel tasks are never padded (``length == seq_len``); gray levels are shifted by one so that 0 stays
padding. Byte tasks follow LRA's byte-level encoder (bytes shifted past the pad id).

Where files are looked for (``root`` may also be the inner folder itself, or contain
``lra_release/``): ``listops-1000/basic_{train,val,test}.tsv``;
``tsv_data/new_aan_pairs.{train,eval,test}.tsv`` (val = eval); ``aclImdb/{train,test}/{pos,neg}/*.txt``
(val = test, as LRA); ``cifar-10-batches-py/{data_batch_1..5,test_batch}`` (val = the last 5000
training images, as LRA's train[90%:]); ``pathfinder{R}/{curv_baseline | curv_contour_length_9 |
curv_contour_length_14}/{metadata,imgs}`` (difficulty easy / medium / hard; an 80 / 10 / 10 split of
all images after a permutation seeded by ``split_seed`` = 42; the known empty image
``pathfinder32/curv_baseline/imgs/0/sample_172.png`` is skipped). Nothing is ever downloaded: a
missing dataset raises `DatasetNotFoundError` saying which files to put where.

Cache: the first use tokenises everything into ``<cache_dir>/<name>-<source>-<fingerprint>/`` (a flat uint8
``data.bin``, ``offsets.npy``, ``labels.npy``), read memory-mapped afterwards. The fingerprint
covers the source files' names, sizes and modification times (for Pathfinder: the metadata files
and each image folder's entry count and time), so changed sources are re-read. ``cache_dir``
defaults to ``<root>/.sparseflash_cache``.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from sparseflash._progress import progress
from sparseflash.experiments.lra.data import SPLITS, TASKS

__all__ = ["TASKS", "SPLITS", "get_dataset", "LRADataset", "DatasetNotFoundError", "MalformedDataError",
           "PATHFINDER_BLACKLIST", "pathfinder_split"]

PATHFINDER_BLACKLIST = frozenset({"pathfinder32/curv_baseline/imgs/0/sample_172.png"})
_PATH_RES = {"pathfinder32": 32, "pathfinder64": 64, "pathx": 128, "path256": 256}
_CACHE_VERSION = 1
_RELEASE = "the LRA release (https://storage.googleapis.com/long-range-arena/lra_release.gz, unpacked)"

# task: (seq_len, max_len, vocab_size, num_classes)
_SPECS = {
    "listops": (2048, 2000, 16, 10),
    "text": (1024, 1000, 257, 2),
    "text4k": (4096, 4000, 257, 2),
    "retrieval": (4096, 4000, 257, 2),
    "image": (1024, 1024, 257, 10),
    **{t: (r * r, r * r, 257, 2) for t, r in _PATH_RES.items()},
}


class DatasetNotFoundError(FileNotFoundError):
    """The files of a dataset are not where the loader looks; the message says what to put where."""


class MalformedDataError(ValueError):
    """A data file exists but is not in the expected format; the message names the file (and line)."""


# ------------------------------------------------------------------------------------- the dataset
class LRADataset(torch.utils.data.Dataset):
    """One split of one task over a memory-mapped token store (see the module docstring)."""

    def __init__(self, task: str, split: str, store: Path, index: np.ndarray | None, *, seq_len: int, max_len: int,
                 vocab_size: int, num_classes: int, offset: int, pairs: bool = False):
        self.task, self.split, self.store = task, split, Path(store)
        self.seq_len, self.max_len = int(seq_len), int(max_len)
        self.vocab_size, self.num_classes, self.pad_id = int(vocab_size), int(num_classes), 0
        self.offset, self.pairs = int(offset), bool(pairs)
        self._index = None if index is None else np.asarray(index, np.int64)
        self._open()

    def _open(self):
        self._offsets = np.load(self.store / "offsets.npy", mmap_mode="r")
        self._labels = np.load(self.store / "labels.npy", mmap_mode="r")
        total = int(self._offsets[-1])
        self._data = (np.memmap(self.store / "data.bin", np.uint8, "r", shape=(total,)) if total
                      else np.zeros(0, np.uint8))

    def __getstate__(self):  # DataLoader workers reopen the memory maps instead of copying them
        state = self.__dict__.copy()
        for k in ("_offsets", "_labels", "_data"):
            state.pop(k)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return len(self._labels) if self._index is None else len(self._index)

    @property
    def store_size(self) -> int:
        """Examples in the whole store (every split of the folder), the range of `with_rows`."""
        return len(self._labels)

    def with_rows(self, rows) -> "LRADataset":
        """This dataset (same store, options and attributes) read at ``rows``, positions in the
        store (generation indices of a Pathfinder folder), instead of its split's: e.g. the images
        of a folder that a model's training split held, located with `pathfinder_split`."""
        rows = np.asarray(rows, np.int64)
        n = self.store_size
        if rows.ndim != 1 or (rows.size and (rows.min() < 0 or rows.max() >= n)):
            raise ValueError(f"rows must be a 1-D array of store positions in [0, {n}), got shape {rows.shape}")
        out = copy.copy(self)  # the memory maps are read-only: the copy shares them
        out._index = rows
        return out

    def _row(self, j: int) -> int:
        return int(j) if self._index is None else int(self._index[j])

    def _tokens(self, seq: int):
        a, b = int(self._offsets[seq]), int(self._offsets[seq + 1])
        n = min(b - a, self.max_len)
        out = torch.zeros(self.seq_len, dtype=torch.long)
        out[:n] = torch.from_numpy(self._data[a:a + n].astype(np.int64)) + self.offset
        return out, n

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {self.task} {self.split} of size {len(self)}")
        j = self._row(i % len(self))
        if self.pairs:
            (t1, n1), (t2, n2) = self._tokens(2 * j), self._tokens(2 * j + 1)
            return {"tokens": torch.stack([t1, t2]), "length": torch.tensor([n1, n2]), "label": int(self._labels[j])}
        tokens, n = self._tokens(j)
        return {"tokens": tokens, "length": n, "label": int(self._labels[j])}

    @property
    def indices(self) -> np.ndarray:
        """Rows of the underlying store that make up this split (in order)."""
        return np.arange(len(self._labels)) if self._index is None else self._index.copy()

    @property
    def labels(self) -> np.ndarray:
        lab = np.asarray(self._labels)
        return lab.copy() if self._index is None else lab[self._index]

    @property
    def lengths(self) -> np.ndarray:
        """True lengths of every example (``[N]``, or ``[N, 2]`` for retrieval), after cutting at max_len."""
        n = np.minimum(np.diff(np.asarray(self._offsets)), self.max_len)
        if self.pairs:
            n = n.reshape(-1, 2)
        return n if self._index is None else n[self._index]

    def __repr__(self) -> str:
        return (f"LRADataset(task={self.task!r}, split={self.split!r}, n={len(self)}, seq_len={self.seq_len}, "
                f"vocab_size={self.vocab_size}, num_classes={self.num_classes}, store={str(self.store)!r})")


# --------------------------------------------------------------------------------------- the cache
def _fingerprint(entries) -> str:
    h = hashlib.sha1(f"sparseflash-lra-cache-v{_CACHE_VERSION}".encode())
    for e in entries:
        h.update(repr(e).encode())
    return h.hexdigest()[:16]


def _file_entries(files, base: Path):
    for f in files:
        st = os.stat(f)
        yield (str(Path(f).relative_to(base)) if base in Path(f).parents else str(f), st.st_size, st.st_mtime_ns)


def _cache_root(root: Path, cache_dir) -> Path:
    c = Path(cache_dir) if cache_dir is not None else root / ".sparseflash_cache"
    try:
        c.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the cache folder {c} ({e}); pass cache_dir= a writable folder") from None
    return c


def _store(cache: Path, name: str, source: Path, key, build) -> Path:
    """The cache folder ``name-<source>-<key>``, built by ``build(tmp_dir)`` if absent; older
    versions for the same source folder (other keys) are removed."""
    name = f"{name}-{hashlib.sha1(str(Path(source).resolve()).encode()).hexdigest()[:8]}"
    final = cache / f"{name}-{key}"
    if (final / "meta.json").is_file():
        return final
    tmp = cache / f".tmp-{name}-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        meta = build(tmp)
        (tmp / "meta.json").write_text(json.dumps({"name": name, "key": key, **meta}, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first
            if not (final / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in cache.glob(f"{name}-*"):
        if old != final and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return final


def _write_sequences(tmp: Path, labels, sequences) -> dict:
    """Write a ragged store from an iterable of uint8 arrays (one per example)."""
    offsets = [0]
    with open(tmp / "data.bin", "wb") as f:
        for seq in sequences:
            seq = np.asarray(seq, np.uint8)
            f.write(seq.tobytes())
            offsets.append(offsets[-1] + seq.size)
    labels = np.asarray(labels, np.int64)
    if len(offsets) - 1 not in (labels.size, 2 * labels.size):
        raise AssertionError("internal: sequences and labels disagree")
    np.save(tmp / "offsets.npy", np.asarray(offsets, np.int64))
    np.save(tmp / "labels.npy", labels)
    return {"examples": int(labels.size), "tokens": int(offsets[-1])}


# ------------------------------------------------------------------------------------- locating data
def _locate(root: Path, sub: str, required, what: str, how: str) -> Path:
    """The first of root/sub, root, root/lra_release/sub that holds every required file."""
    candidates = [root / sub, root, root / "lra_release" / sub]
    for c in candidates:
        if all((c / r).exists() for r in required):
            return c
    shown = ", ".join(required)
    raise DatasetNotFoundError(
        f"{what} not found: expected {shown} in {root / sub} (also looked in {root} and "
        f"{root / 'lra_release' / sub}). {how}")


# ----------------------------------------------------------------------------------------- ListOps
def _build_listops(path: Path, tmp: Path) -> dict:
    from sparseflash.experiments.lra.data.listops import UnknownTokenError, encode, read_tsv

    try:
        rows = read_tsv(path)
    except ValueError as e:
        raise MalformedDataError(str(e)) from None
    def seqs():
        for i, (src, _) in enumerate(progress(rows, desc=f"caching {path.name}", disable=len(rows) < 5000)):
            try:
                yield encode(src, i)
            except UnknownTokenError as e:
                raise MalformedDataError(f"{path}:{e.index + 2}: unknown ListOps token {e.token!r}") from None

    return _write_sequences(tmp, [t for _, t in rows], seqs())


def _listops(root, split, cache):
    folder = _locate(root, "listops-1000", [f"basic_{s}.tsv" for s in SPLITS], "ListOps data",
                     f"Put the listops-1000 folder of {_RELEASE} there, or generate it offline with "
                     f"`sparseflash lra data listops --out {root}`.")
    path = folder / f"basic_{split}.tsv"
    key = _fingerprint(_file_entries([path], folder))
    return _store(cache, f"listops-{split}", folder, key, lambda tmp: _build_listops(path, tmp))


# ---------------------------------------------------------------------------------------- Retrieval
def _read_aan(path: Path, max_len: int):
    csv.field_size_limit(sys.maxsize)
    labels, docs = [], []
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
        for lineno, fields in enumerate(csv.reader(f, delimiter="\t"), start=1):
            if not fields:
                continue
            if len(fields) != 5:
                raise MalformedDataError(f"{path}:{lineno}: expected 5 tab-separated fields (label id1 id2 text1 text2), "
                                         f"got {len(fields)}")
            try:
                label = float(fields[0])
            except ValueError:
                raise MalformedDataError(f"{path}:{lineno}: label must be 0 or 1, got {fields[0][:20]!r}") from None
            if label not in (0.0, 1.0):
                raise MalformedDataError(f"{path}:{lineno}: label must be 0 or 1, got {fields[0][:20]!r}")
            labels.append(int(label))
            for text in fields[3:5]:
                docs.append(np.frombuffer(text.encode("utf-8", "surrogateescape")[:max_len], np.uint8))
    return labels, docs


def _retrieval(root, split, cache, max_len):
    names = {"train": "train", "val": "eval", "test": "test"}
    folder = _locate(root, "tsv_data", [f"new_aan_pairs.{names[s]}.tsv" for s in SPLITS], "Retrieval (AAN) data",
                     f"Put the tsv_data folder of {_RELEASE} there.")
    path = folder / f"new_aan_pairs.{names[split]}.tsv"
    key = _fingerprint([*_file_entries([path], folder), ("max_len", max_len)])

    def build(tmp):
        labels, docs = _read_aan(path, max_len)
        return _write_sequences(tmp, labels, docs)

    return _store(cache, f"retrieval-{split}", folder, key, build)


# --------------------------------------------------------------------------------------------- IMDb
def _imdb(root, split, cache):
    folder = _locate(root, "aclImdb", ["train/pos", "train/neg", "test/pos", "test/neg"], "IMDb reviews (aclImdb)",
                     "IMDb is not part of the LRA release and is never downloaded here: unpack the Large Movie Review "
                     "Dataset (aclImdb_v1.tar.gz, Maas et al. 2011) so that aclImdb/train/{pos,neg}/*.txt and "
                     "aclImdb/test/{pos,neg}/*.txt exist under the data root.")
    part = "train" if split == "train" else "test"  # LRA evaluates on the test reviews (val = test)
    files = {lab: sorted((folder / part / d).glob("*.txt")) for lab, d in ((0, "neg"), (1, "pos"))}
    allf = files[0] + files[1]
    if not allf:
        raise DatasetNotFoundError(f"IMDb reviews not found: {folder / part}/pos and /neg hold no *.txt files")
    key = _fingerprint(_file_entries(allf, folder))

    def build(tmp):
        return _write_sequences(tmp, [0] * len(files[0]) + [1] * len(files[1]),
                                (np.fromfile(f, np.uint8) for f in allf))

    return _store(cache, f"imdb-{part}", folder, key, build)


# ------------------------------------------------------------------------------------------ CIFAR-10
class _CifarUnpickler(pickle.Unpickler):
    """Unpickles CIFAR-10 python batches only: dicts, lists, strings and numpy arrays."""

    _ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
                ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _read_cifar_batch(path: Path):
    try:
        with open(path, "rb") as f:
            d = _CifarUnpickler(f, encoding="bytes").load()
    except Exception as e:  # noqa: BLE001 - any failure means "not a CIFAR-10 python batch"
        raise MalformedDataError(f"{path}: not a CIFAR-10 python batch ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise MalformedDataError(f"{path}: not a CIFAR-10 python batch (a {type(d).__name__}, expected a dict)")
    d = {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}
    if "data" not in d or "labels" not in d:
        raise MalformedDataError(f"{path}: CIFAR-10 batch without 'data' and 'labels' (keys: {sorted(d)})")
    data, labels = np.asarray(d["data"]), np.asarray(d["labels"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (data.shape[0],):
        raise MalformedDataError(f"{path}: expected data uint8 [n, 3072] and n labels, got data {data.dtype} "
                                 f"{list(data.shape)} and labels {list(labels.shape)}")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise MalformedDataError(f"{path}: labels must be 0-9")
    return data, labels.astype(np.int64)


def rgb_to_gray(data: np.ndarray) -> np.ndarray:
    """CIFAR rows ``[n, 3072]`` (R, G, B planes) -> ``[n, 1024]`` uint8, as TF's rgb_to_grayscale:
    weights (0.2989, 0.5870, 0.1140) on values / 255, then back to uint8 by x * 255.5 truncated."""
    rgb = data.reshape(-1, 3, 1024).astype(np.float32) / np.float32(255)
    gray = np.tensordot(np.array([0.2989, 0.5870, 0.1140], np.float32), rgb, axes=([0], [1]))
    return (gray * np.float32(255.5)).astype(np.uint8)


def _cifar(root, split, cache):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    folder = _locate(root, "cifar-10-batches-py", names, "CIFAR-10 (python version)",
                     "CIFAR-10 is not part of the LRA release and is never downloaded here: unpack "
                     "cifar-10-python.tar.gz (Krizhevsky 2009) so that cifar-10-batches-py/data_batch_1 .. "
                     "data_batch_5 and test_batch exist under the data root.")
    part = "test" if split == "test" else "train"
    files = [folder / n for n in (names[5:] if part == "test" else names[:5])]

    def build(tmp):
        batches = [_read_cifar_batch(f) for f in files]
        data = np.concatenate([b[0] for b in batches])
        return _write_sequences(tmp, np.concatenate([b[1] for b in batches]), rgb_to_gray(data))

    store = _store(cache, f"cifar-{part}", folder, _fingerprint(_file_entries(files, folder)), build)
    if part == "test":
        return store, None
    n = len(np.load(store / "labels.npy", mmap_mode="r"))
    n_train = n * 9 // 10  # LRA: train[:90%], val = train[90%:]
    return store, (np.arange(n_train) if split == "train" else np.arange(n_train, n))


# ---------------------------------------------------------------------------------------- Pathfinder
def _read_metadata(path: Path):
    """Rows of one metadata file: the release's text, or a NumPy array of strings (generator's np.save)."""
    raw = path.read_bytes()
    if raw.startswith(b"\x93NUMPY"):
        try:
            arr = np.load(path, allow_pickle=False)
        except ValueError as e:
            raise MalformedDataError(f"{path}: unreadable .npy metadata ({e})") from None
        return [[str(x) for x in np.atleast_1d(row)] for row in np.atleast_2d(arr)]
    return [line.split() for line in raw.decode("utf-8", "replace").splitlines() if line.strip()]


def _metadata_key(p: Path):
    return (0, int(p.stem), "") if p.stem.isdigit() else (1, 0, p.stem)


def _decode_images(job):
    from PIL import Image

    paths, out, start, total, res = job
    mm = np.memmap(out, np.uint8, "r+", shape=(total, res * res))
    for k, path in enumerate(paths):
        try:
            with Image.open(path) as im:
                im.load()
                arr = np.asarray(im if im.mode == "L" else im.convert("L"))
        except Exception as e:  # noqa: BLE001 - report which file is broken
            return f"{path}: cannot read the image ({type(e).__name__}: {e})"
        if arr.shape != (res, res):
            return f"{path}: image is {arr.shape[1]}x{arr.shape[0]}, expected {res}x{res}"
        mm[start + k] = arr.ravel()
    mm.flush()
    return len(paths)


def folder_fidelity(folder) -> str:
    """The generator fidelity of a Pathfinder difficulty folder: what its generation record says
    (``clean`` for records older than fidelities), ``release`` where there is none (the authors'
    release, or a copy of it)."""
    from sparseflash.experiments.lra.data.pathfinder import GENERATION_FILE

    gen = Path(folder) / GENERATION_FILE
    return json.loads(gen.read_text()).get("fidelity", "clean") if gen.is_file() else "release"


def _pathfinder(root, task, difficulty, cache, workers, fidelity=None):
    from sparseflash.experiments.lra.data._parallel import check_workers, run_ordered
    from sparseflash.experiments.lra.data.pathfinder import DIFFICULTIES, GENERATION_FILE

    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {tuple(DIFFICULTIES)}, got {difficulty!r}")
    workers = check_workers(workers)
    res = _PATH_RES[task]
    sub = DIFFICULTIES[difficulty][0]
    name = f"pathfinder{res}"
    how = (f"Put the {name} folder of {_RELEASE} there, or generate it offline with `sparseflash lra data pathfinder "
           f"--resolution {res} --difficulty {difficulty} --out {root} --num 200000`.")
    cands = [root / name / sub, root / sub, root, root / "lra_release" / name / sub]
    folder = next((c for c in cands if (c / "metadata").is_dir() and any((c / "metadata").glob("*.npy"))), None)
    if folder is None:
        raise DatasetNotFoundError(f"Pathfinder-{res} ({difficulty}) not found: expected {root / name / sub}/metadata/*.npy "
                                   f"and {root / name / sub}/imgs/. {how}")
    gen = folder / GENERATION_FILE
    if gen.is_file() and not json.loads(gen.read_text()).get("complete", True):
        raise MalformedDataError(f"{folder} is an unfinished generation ({gen} says complete: false): finish it with "
                                 f"`sparseflash lra data pathfinder ... --resume` (same arguments) before training on it")
    have = folder_fidelity(folder)
    if fidelity is not None and fidelity != have:
        raise MalformedDataError(f"{folder} holds {have!r} Pathfinder data, but {fidelity!r} was asked for: the two "
                                 f"generators make different tasks (see `sparseflash lra data pathfinder --fidelity`); "
                                 f"point --data at {fidelity!r} data or set data.fidelity={have!r}")
    metas = sorted((folder / "metadata").glob("*.npy"), key=_metadata_key)
    img_root = folder / "imgs"
    dirs = sorted(d for d in img_root.iterdir() if d.is_dir()) if img_root.is_dir() else []
    entries = list(_file_entries(metas, folder))
    for d in dirs:
        entries.append((d.name, d.stat().st_mtime_ns, sum(1 for _ in os.scandir(d))))
    key = _fingerprint([*entries, ("resolution", res)])

    def build(tmp):
        paths, labels, missing = [], [], []
        for meta in metas:
            for lineno, row in enumerate(_read_metadata(meta), start=1):
                if len(row) < 4:
                    raise MalformedDataError(f"{meta}:{lineno}: expected at least 4 fields (subdir file index label), "
                                             f"got {len(row)}")
                if f"{name}/{sub}/{row[0]}/{row[1]}" in PATHFINDER_BLACKLIST:
                    continue
                try:
                    label = int(float(row[3]))
                except ValueError:
                    raise MalformedDataError(f"{meta}:{lineno}: label must be 0 or 1, got {row[3]!r}") from None
                if label not in (0, 1):
                    raise MalformedDataError(f"{meta}:{lineno}: label must be 0 or 1, got {row[3]!r}")
                path = folder / row[0] / row[1]
                if not path.is_file():
                    missing.append(str(path))
                paths.append(str(path))
                labels.append(label)
        if missing:
            raise MalformedDataError(f"{len(missing)} images listed in {folder / 'metadata'} do not exist, e.g. "
                                     + ", ".join(missing[:3]))
        if not paths:
            raise MalformedDataError(f"{folder / 'metadata'} lists no images")
        n = len(paths)
        out = tmp / "data.bin"
        with open(out, "wb") as f:
            f.truncate(n * res * res)
        chunk = max(1, min(2000, -(-n // (4 * workers))))
        jobs = [(paths[s:s + chunk], str(out), s, n, res) for s in range(0, n, chunk)]
        for r in run_ordered(_decode_images, jobs, workers, f"caching {name}/{sub}", total=n,
                             weight=lambda r: r if isinstance(r, int) else 0, show_progress=n >= 5000):
            if isinstance(r, str):
                raise MalformedDataError(r)
        np.save(tmp / "offsets.npy", np.arange(n + 1, dtype=np.int64) * (res * res))
        np.save(tmp / "labels.npy", np.asarray(labels, np.int64))
        return {"examples": n, "folder": str(folder)}

    return _store(cache, f"{name}-{sub}", folder, key, build), have


def pathfinder_split(n: int, split: str, seed: int = 42) -> np.ndarray:
    """Sorted generation indices of ``split`` in a Pathfinder folder of ``n`` images (80/10/10 by a
    seeded permutation; ``seed`` is `get_dataset`'s ``split_seed``)."""
    perm = np.random.default_rng(seed).permutation(n)
    n_train, n_val = int(0.8 * n), int(0.1 * n)
    bounds = {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, n)}[split]
    return np.sort(perm[bounds[0]:bounds[1]])


# ------------------------------------------------------------------------------------------- entry
def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def get_dataset(task: str, root, split: str, *, cache_dir=None, **task_options) -> LRADataset:
    """The ``split`` ("train", "val", "test") of LRA ``task`` (one of `TASKS`) under ``root``.

    Task options: ``seq_len`` (padded length) and ``max_len`` (cut) for listops, text, text4k and
    retrieval; ``difficulty`` ("hard" default, "medium", "easy"), ``split_seed`` (42) and
    ``workers`` (processes decoding PNGs when the cache is built, 1) and ``fidelity`` (``"release"``
    or ``"clean"``: refuse a folder generated otherwise; None, the default: whatever it holds) for
    the Pathfinder tasks.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a path (str or os.PathLike), got {type(root).__name__}")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DatasetNotFoundError(f"data root {root} is not a folder")
    seq_len, max_len, vocab, classes = _SPECS[task]
    allowed = {"seq_len", "max_len"} if task in ("listops", "text", "text4k", "retrieval") else (
        {"difficulty", "split_seed", "workers", "fidelity"} if task in _PATH_RES else set())
    unknown = set(task_options) - allowed
    if unknown:
        raise TypeError(f"unexpected option(s) {sorted(unknown)} for task {task!r}; "
                        f"allowed: {sorted(allowed) or 'none'}")
    if "seq_len" in task_options:
        seq_len = _positive_int("seq_len", task_options["seq_len"])
        max_len = min(max_len, seq_len)
    if "max_len" in task_options:
        max_len = _positive_int("max_len", task_options["max_len"])
    if max_len > seq_len:
        raise ValueError(f"max_len ({max_len}) must be <= seq_len ({seq_len})")
    cache = _cache_root(root, cache_dir)
    common = dict(seq_len=seq_len, max_len=max_len, vocab_size=vocab, num_classes=classes)
    if task == "listops":
        return LRADataset(task, split, _listops(root, split, cache), None, offset=0, **common)
    if task in ("text", "text4k"):
        return LRADataset(task, split, _imdb(root, split, cache), None, offset=1, **common)
    if task == "retrieval":
        return LRADataset(task, split, _retrieval(root, split, cache, max_len), None, offset=1, pairs=True, **common)
    if task == "image":
        store, index = _cifar(root, split, cache)
        return LRADataset(task, split, store, index, offset=1, **common)
    difficulty = task_options.get("difficulty", "hard")
    split_seed = task_options.get("split_seed", 42)
    if isinstance(split_seed, bool) or not isinstance(split_seed, (int, np.integer)) or split_seed < 0:
        raise ValueError(f"split_seed must be a non-negative int, got {split_seed!r}")
    fidelity = task_options.get("fidelity")
    from sparseflash.experiments.lra.data.pathfinder import FIDELITIES

    if fidelity is not None and fidelity not in FIDELITIES:
        raise ValueError(f"fidelity must be one of {FIDELITIES} or None (whatever the folder holds), got {fidelity!r}")
    store, have = _pathfinder(root, task, difficulty, cache, task_options.get("workers", 1), fidelity)
    n = len(np.load(store / "labels.npy", mmap_mode="r"))
    ds = LRADataset(task, split, store, pathfinder_split(n, split, int(split_seed)), offset=1, **common)
    ds.difficulty, ds.fidelity = difficulty, have
    return ds
