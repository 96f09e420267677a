"""ListOps (Nangia & Bowman 2018, as generated for LRA): random operator trees over digits.

The generator reproduces LRA's ``lra_benchmarks/data/listops.py``:

- A tree grows from depth 1. At a node of depth < ``max_depth`` draw r ~ U[0, 1): r > 0.25 makes
  a leaf (a digit drawn uniformly from 0-9), otherwise an operator drawn uniformly from
  MIN, MAX, MED, SM with ``randint(2, max_args)`` children (both ends included), each grown at
  depth + 1. Nodes at ``max_depth`` are leaves.
- Length counts tokens without parentheses: 1 per digit, 2 per operator (its ``[OP`` and ``]``).
  A tree is kept only if ``min_len < length < max_len`` (strict), and duplicates are dropped.
- Semantics: MIN, MAX; MED = int(median) (the mean of the two middle values, truncated, when the
  count is even); SM = sum mod 10.
- Text: the release writes the left-nested pairs ``((op, a1), a2) ... , ']'`` in parentheses, so a
  node with k arguments reads ``( ( ( [MIN 3 ) 4 ) ] )`` for k = 2. Files are
  ``listops-1000/basic_{train,val,test}.tsv`` with header ``Source\\tTarget``.

One difference that does not change the distribution: a tree whose length already reached
``max_len`` while growing is abandoned at once (it would be rejected anyway), which saves most of
the time. Determinism: chunk c of accepted trees is drawn from ``random.Random`` seeded by
``(seed, c)``; chunks are merged in order and de-duplicated, so the files depend on the seed and the
sizes only, never on ``workers``.

`split_lengths` counts the tokens of one split without writing the files (with the statistics
`sparseflash lra data listops` prints and the split's sha256), so a set generated elsewhere can be
measured, and compared with what its generation kept, on a CPU.

`tokenize` / `evaluate` read the release text back the way LRA loaders do (parentheses removed,
``]`` kept as a token); `parse` additionally checks that the parentheses follow the release
grammar exactly.
"""

from __future__ import annotations

import csv
import hashlib
import io
import os
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "OPERATORS", "END", "DIGITS", "VOCAB", "TOKEN_IDS", "Sample", "generate_tree", "to_text", "tokenize",
    "encode", "UnknownTokenError", "evaluate", "value_of", "parse", "tree_stats", "generate", "write_listops",
    "read_tsv", "split_lengths",
]

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
DIGITS = tuple(str(d) for d in range(10))
VALUE_P = 0.25  # a node is an operator iff r <= VALUE_P (and depth < max_depth)
# Token ids: 0 is padding; digits 1-10, operators 11-14, ']' 15 (vocab_size 16).
VOCAB = ("<pad>",) + DIGITS + OPERATORS + (END,)
TOKEN_IDS = {tok: i for i, tok in enumerate(VOCAB)}
_SPLITS = ("train", "val", "test")
_CHUNK = 250  # accepted trees per seeded chunk


class _TooLong(Exception):
    pass


def _reduce(op: str, args: list[int]) -> int:
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":
        s = sorted(args)
        n = len(s)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2
    if op == "[SM":
        return sum(args) % 10
    raise ValueError(f"unknown ListOps operator {op!r}")


def generate_tree(rng: random.Random, max_depth: int = 10, max_args: int = 10, max_len: int | None = None):
    """One random tree as nested tuples ``(op, [children])`` / ``int``, with its token length.

    Returns ``(tree, length)``, or ``(None, length_so_far)`` when ``max_len`` is given and the tree
    reached it while growing (LRA would reject it).
    """
    length = 0

    def grow(depth):
        nonlocal length
        if depth >= max_depth or rng.random() > VALUE_P:
            length += 1
            if max_len is not None and length >= max_len:
                raise _TooLong
            return rng.randrange(10)
        length += 2
        k = rng.randint(2, max_args)
        op = OPERATORS[rng.randrange(4)]
        children = [grow(depth + 1) for _ in range(k)]
        return (op, children)

    try:
        tree = grow(1)
    except _TooLong:
        return None, length
    if max_len is not None and length >= max_len:
        return None, length
    return tree, length


def to_text(tree) -> str:
    """The release's text form (with parentheses) of a tree from `generate_tree`."""
    parts: list[str] = []

    def emit(node):
        if isinstance(node, int):
            parts.append(str(node))
            return
        op, children = node
        parts.append("( " * (len(children) + 1) + op)
        for c in children:
            parts.append(" ")
            emit(c)
            parts.append(" )")
        parts.append(" ] )")

    emit(tree)
    return "".join(parts)


def value_of(tree) -> int:
    if isinstance(tree, int):
        return tree
    op, children = tree
    return _reduce(op, [value_of(c) for c in children])


def tokenize(text: str) -> list[str]:
    """LRA loaders' tokenisation: parentheses removed, split on whitespace (``]`` stays a token)."""
    return text.replace("(", " ").replace(")", " ").split()


class UnknownTokenError(ValueError):
    """A text holds a token outside `VOCAB`; ``index`` is the text's position, ``token`` the token."""

    def __init__(self, index: int, token: str):
        super().__init__(f"text {index}: unknown ListOps token {token!r}")
        self.index, self.token = index, token


_TEXT_IDS = {tok: i for tok, i in TOKEN_IDS.items() if i}  # what may appear in a text (not <pad>)


def encode(text: str, index: int = 0) -> np.ndarray:
    """Token ids (uint8) of one release text: `tokenize` then `TOKEN_IDS`. Raises `UnknownTokenError`
    (carrying ``index``, the text's position, for the message)."""
    toks = tokenize(text)
    try:
        return np.array([_TEXT_IDS[t] for t in toks], np.uint8)
    except KeyError as e:
        raise UnknownTokenError(index, e.args[0]) from None


def evaluate(tokens) -> tuple[int, int]:
    """Value and depth (1 for a bare digit) of a token sequence from `tokenize`.

    Raises ValueError on anything that is not exactly one well-formed expression.
    """
    stack: list[tuple[str, list[int]]] = []
    result, depth = None, 0
    for pos, tok in enumerate(tokens):
        if result is not None:
            raise ValueError(f"extra token {tok!r} at position {pos} after a complete expression")
        if tok in OPERATORS:
            stack.append((tok, []))
        elif tok == END:
            if not stack:
                raise ValueError(f"']' at position {pos} closes no operator")
            op, args = stack.pop()
            if not args:
                raise ValueError(f"operator {op} closed at position {pos} without arguments")
            v = _reduce(op, args)
            if stack:
                stack[-1][1].append(v)
            else:
                result = v
        elif tok in DIGITS:
            depth = max(depth, len(stack) + 1)
            if stack:
                stack[-1][1].append(int(tok))
            else:
                result = int(tok)
        else:
            raise ValueError(f"unknown ListOps token {tok!r} at position {pos}")
    if result is None:
        raise ValueError("incomplete expression: " + (f"{len(stack)} operator(s) not closed" if stack else "no tokens"))
    return result, depth


def parse(text: str):
    """Parse release text (with parentheses) into a tree, checking the exact release grammar.

    Raises ValueError if the text is not precisely what `to_text` writes for some tree.
    """
    toks = text.split(" ")
    pos = 0

    def node():
        nonlocal pos
        if pos >= len(toks):
            raise ValueError("unexpected end of text")
        tok = toks[pos]
        if tok in DIGITS:
            pos += 1
            return int(tok)
        opens = 0
        while pos < len(toks) and toks[pos] == "(":
            opens += 1
            pos += 1
        if pos >= len(toks) or toks[pos] not in OPERATORS:
            raise ValueError(f"expected an operator at token {pos}, got {toks[pos] if pos < len(toks) else 'end'!r}")
        op = toks[pos]
        pos += 1
        k = opens - 1
        if k < 1:
            raise ValueError(f"operator {op} at token {pos - 1} has {opens} opening parentheses, expected >= 2")
        children = []
        for _ in range(k):
            children.append(node())
            if pos >= len(toks) or toks[pos] != ")":
                raise ValueError(f"expected ')' at token {pos}")
            pos += 1
        if toks[pos:pos + 2] != ["]", ")"]:
            raise ValueError(f"expected '] )' at token {pos}")
        pos += 2
        return (op, children)

    tree = node()
    if pos != len(toks):
        raise ValueError(f"trailing text after token {pos}")
    return tree


def tree_stats(tree) -> dict:
    """Length (tokens), depth, operator counts and argument counts of one tree."""
    ops: Counter = Counter()
    nargs: list[int] = []
    length, depth = 0, 0

    def walk(node, d):
        nonlocal length, depth
        depth = max(depth, d)
        if isinstance(node, int):
            length += 1
            return
        op, children = node
        ops[op] += 1
        nargs.append(len(children))
        length += 2
        for c in children:
            walk(c, d + 1)

    walk(tree, 1)
    return {"length": length, "depth": depth, "ops": ops, "nargs": nargs}


@dataclass(frozen=True)
class Sample:
    text: str
    label: int
    length: int


def _chunk(job) -> tuple[list[tuple[str, int, int]], int]:
    """``_CHUNK`` accepted trees from the chunk's own seed; also how many trees were drawn."""
    seed, index, n, min_len, max_len, max_depth, max_args = job
    rng = random.Random(int(np.random.SeedSequence([seed, index, 0x115705]).generate_state(1)[0]))
    out, drawn = [], 0
    while len(out) < n:
        tree, length = generate_tree(rng, max_depth, max_args, max_len)
        drawn += 1
        if tree is not None and min_len < length < max_len:
            out.append((to_text(tree), value_of(tree), length))
    return out, drawn


def _check_int(name, v, lo=0):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def generate(num: int, *, seed: int = 0, min_len: int = 500, max_len: int = 2000, max_depth: int = 10,
             max_args: int = 10, workers: int = 1, show_progress: bool = False) -> tuple[list[Sample], dict]:
    """``num`` distinct accepted ListOps samples in a seed-determined order, and run statistics
    (``drawn``: trees generated, ``acceptance``: accepted / drawn before de-duplication)."""
    from sparseflash.experiments.lra.data._parallel import check_workers, run_ordered

    _check_int("num", num, 1)
    _check_int("seed", seed)
    _check_int("min_len", min_len)
    _check_int("max_len", max_len, 2)
    _check_int("max_depth", max_depth, 1)
    _check_int("max_args", max_args, 2)
    if max_len - min_len < 2:
        raise ValueError(f"need min_len < length < max_len for some length, got min_len={min_len}, max_len={max_len}")
    workers = check_workers(workers)
    seen: set[str] = set()
    samples: list[Sample] = []
    drawn = accepted = 0
    next_chunk = 0
    while len(samples) < num:
        missing = num - len(samples)
        n_chunks = -(-missing // _CHUNK)
        jobs = [(seed, c, _CHUNK, min_len, max_len, max_depth, max_args)
                for c in range(next_chunk, next_chunk + n_chunks)]
        next_chunk += n_chunks
        for out, d in run_ordered(_chunk, jobs, workers, "listops", total=n_chunks * _CHUNK,
                                  weight=lambda r: len(r[0]), show_progress=show_progress):
            drawn += d
            for text, label, length in out:
                accepted += 1
                if len(samples) < num and text not in seen:
                    seen.add(text)
                    samples.append(Sample(text, label, length))
    stats = {"drawn": drawn, "accepted": accepted, "acceptance": accepted / drawn, "duplicates": accepted - len(seen)}
    return samples, stats


def write_listops(out, *, train: int = 96000, val: int = 2000, test: int = 2000, seed: int = 0, min_len: int = 500,
                  max_len: int = 2000, max_depth: int = 10, max_args: int = 10, workers: int = 1,
                  show_progress: bool = True) -> dict:
    """Write ``out/listops-1000/basic_{train,val,test}.tsv`` in the release format.

    Splits are consecutive slices of one de-duplicated stream, so they are disjoint. Returns a
    summary (paths, sizes, acceptance rate, mean length, label counts).
    """
    sizes, samples, stats = _generate_splits(train, val, test, seed=seed, min_len=min_len, max_len=max_len,
                                             max_depth=max_depth, max_args=max_args, workers=workers,
                                             show_progress=show_progress)
    folder = Path(out) / "listops-1000"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, part in _split_parts(samples, sizes).items():
        path = folder / f"basic_{split}.tsv"
        tmp = path.with_suffix(".tsv.tmp")
        with open(tmp, "w", newline="") as f:
            f.write(_tsv_text(part))
        os.replace(tmp, path)
        paths[split] = str(path)
    return {"paths": paths, "sizes": sizes, "seed": seed, **_stream_stats(samples, stats)}


def _generate_splits(train, val, test, **kwargs) -> tuple[dict, list[Sample], dict]:
    sizes = {"train": train, "val": val, "test": test}
    for k, v in sizes.items():
        _check_int(k, v)
    samples, stats = generate(sum(sizes.values()), **kwargs)
    return sizes, samples, stats


def _split_parts(samples: list[Sample], sizes: dict) -> dict[str, list[Sample]]:
    """The splits as consecutive slices of the stream, in `_SPLITS` order."""
    start, parts = 0, {}
    for split in _SPLITS:
        parts[split] = samples[start:start + sizes[split]]
        start += sizes[split]
    return parts


def _tsv_text(part: list[Sample]) -> str:
    """The text of one split's release tsv, exactly as `write_listops` writes it."""
    buf = io.StringIO()
    w = csv.writer(buf, delimiter="\t", lineterminator="\n")
    w.writerow(["Source", "Target"])
    w.writerows((s.text, s.label) for s in part)
    return buf.getvalue()


def _stream_stats(samples: list[Sample], stats: dict) -> dict:
    lengths = np.array([s.length for s in samples])
    return {**stats, "mean_length": float(lengths.mean()),
            "labels": dict(sorted(Counter(s.label for s in samples).items()))}


def split_lengths(split: str = "test", *, train: int = 96000, val: int = 2000, test: int = 2000, seed: int = 0,
                  min_len: int = 500, max_len: int = 2000, max_depth: int = 10, max_args: int = 10, workers: int = 1,
                  bin_width: int = 100, show_progress: bool = False) -> dict:
    """The token lengths of one split of the data `write_listops` writes with these arguments, without
    writing it: a record of the generator's arguments, the split's count, mean, min, max, a histogram
    (bins of ``bin_width`` tokens, keyed by their lower edge), every length in order, the sha256 of the
    split's tsv as `write_listops` writes it, and the statistics of the whole stream (``stream``: the
    acceptance, mean length and label counts `sparseflash lra data listops` prints), so a record can be
    compared with a log of the generation it stands for.

    A split is a slice of one de-duplicated stream, so the whole stream is generated (the test split
    of the full 96K/2K/2K set takes ~5 minutes of one core). A length counts what the model reads:
    tokens without parentheses, digits, operators and ``]`` (`tokenize`); every one is below ``max_len``,
    so with the default 2,000 the loader's cut at 2,000 tokens leaves every example whole.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    _check_int("bin_width", bin_width, 1)
    generator = {"train": train, "val": val, "test": test, "seed": seed, "min_len": min_len, "max_len": max_len,
                 "max_depth": max_depth, "max_args": max_args}
    _check_int(split, generator[split], 1)  # before minutes of generation, not after
    sizes, samples, stats = _generate_splits(train, val, test, seed=seed, min_len=min_len, max_len=max_len,
                                             max_depth=max_depth, max_args=max_args, workers=workers,
                                             show_progress=show_progress)
    part = _split_parts(samples, sizes)[split]
    lengths = [s.length for s in part]
    hist = Counter(bin_width * (n // bin_width) for n in lengths)
    stream = _stream_stats(samples, stats)
    return {"split": split, "generator": generator, "count": len(lengths), "mean": float(np.mean(lengths)),
            "min": min(lengths), "max": max(lengths), "bin_width": bin_width,
            "histogram": {str(k): hist[k] for k in sorted(hist)},
            "sha256": hashlib.sha256(_tsv_text(part).encode()).hexdigest(),
            "stream": {"examples": len(samples), **stream, "labels": {str(k): v for k, v in stream["labels"].items()}},
            "lengths": lengths}


def read_tsv(path) -> list[tuple[str, int]]:
    """Rows ``(source, target)`` of a release ListOps tsv; ValueError naming the line if malformed."""
    path = Path(path)
    rows = []
    with open(path, newline="") as f:
        header = f.readline().rstrip("\r\n")
        if header.split("\t") != ["Source", "Target"]:
            raise ValueError(f"{path}: first line must be the header 'Source\\tTarget', got {header[:60]!r}")
        for lineno, line in enumerate(f, start=2):
            line = line.rstrip("\r\n")
            if not line:
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise ValueError(f"{path}:{lineno}: expected 2 tab-separated fields (Source, Target), "
                                 f"got {len(fields)}")
            try:
                target = int(fields[1])
            except ValueError:
                raise ValueError(f"{path}:{lineno}: Target must be an integer 0-9, got {fields[1][:20]!r}") from None
            if not 0 <= target <= 9:
                raise ValueError(f"{path}:{lineno}: Target must be an integer 0-9, got {target}")
            rows.append((fields[0], target))
    return rows
