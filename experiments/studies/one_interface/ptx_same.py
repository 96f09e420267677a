"""Are the kernels the same code after a host-side change? Compiles every case of
`studies.hopper.compile_check` (the Hopper kernels: forward and backward, d 64 and 128, dense,
causal + key_lengths, block lists of 128 and 256, exact bits) and the portable kernels' builds of
`PORTABLE_CASES` (forward, dQ and dK/dV through the real launchers, d 64 and 128: dense, causal,
key lengths, block lists, exact bits, dropout, segments, key ranges, ALiBi + softcap, LSE
gradient, TMA descriptors, and fp16 at d=40 with ALIGN) and the decode kernels' builds of
`DECODE_CASES` (the split kernel and its combine through `decode.plan`'s launches, d 64 and 128:
dense and paged caches, block lists, GQA, softcap, ALiBi, left / right windows, key lengths or the
whole cache, leftpad, batch index, LSE stored or not, one split or several, query chunks, fp32;
the bounds check and the append of some of them) for sm_90 on any machine (no GPU) and writes each PTX with its line-number and debug records
removed, so a moved or renamed source file compares equal.

    python -m sparseflash.experiments.studies.one_interface.ptx_same dump DIR [hopper|portable|decode]
    python -m sparseflash.experiments.studies.one_interface.ptx_same compare OLD_DIR NEW_DIR

``dump`` writes every set unless one is named; ``compare`` compares the files OLD_DIR has.

``compare`` names each kernel "same", "reordered" (the same instructions, registers renumbered, in
another order: what a change of the kernel's signature leaves, as the parameters are loaded in
another order) or "differs" (exit status 1). Parameters are compared without their names or
positions (`normalised`): the GPU tests check that each reaches its place.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter

_DROP = re.compile(r"^\s*(\.loc|//|\.file|\.b8|\.b16|\.b32|\.b64|\.section|\.param\b)|debug")


def normalised(ptx: str) -> str:
    """PTX without its line records, debug sections, label numbers and parameter declarations,
    each use of a parameter named only "param"."""
    lines = (re.sub(r"\w+_param_\d+", "param", re.sub(r"\$L__\w+", "", ln)) for ln in ptx.splitlines()
             if not _DROP.search(ln))
    return "\n".join(ln for ln in lines if ln.strip() != ":")  # (a debug label's line, its name gone)


def verdict(old: str, new: str) -> str:
    """"same", "reordered" or "differs" (see the module's doc) of two `normalised` PTX texts."""
    if old == new:
        return "same"
    shape = lambda text: Counter(re.sub(r"%[a-z]+\d+", "%", ln) for ln in text.splitlines())  # noqa: E731
    return "reordered" if shape(old) == shape(new) else "differs"


def dump(out: str, which: str = "all") -> int:
    os.makedirs(out, exist_ok=True)
    if which in ("all", "portable"):
        dump_portable(out)
    if which in ("all", "decode"):
        dump_decode(out)
    if which in ("all", "hopper"):
        dump_hopper(out)
    return 0


# The portable kernels' cases: label -> (head dims, options of `_portable_case`).
PORTABLE_CASES = {
    "dense": ((64, 128), {}),
    "causal-keylen": ((64, 128), dict(causal=True, keylen=True)),
    "lists": ((64, 128), dict(lists=True)),
    "lists-causal-dlse": ((64, 128), dict(lists=True, causal=True, dlse=True)),
    "exact": ((64, 128), dict(exact=True, causal=True)),
    "dropout": ((64, 128), dict(dropout=0.1)),
    "lists-dropout-keylen": ((64,), dict(lists=True, dropout=0.1, keylen=True)),
    "segments": ((64, 128), dict(segments=True)),
    "ranges-alibi": ((64,), dict(ranges=True, alibi=True, causal=True)),
    "alibi-segments-softcap": ((64, 128), dict(alibi=True, segments=True, softcap=30.0)),
    "tma-causal": ((64, 128), dict(tma=True, causal=True)),
    "tma-lists-exact": ((64,), dict(tma=True, lists=True, exact=True)),
    "fp16-d40-align": ((40,), dict(dtype="float16", causal=True)),
}


def _portable_case(d: int, causal=False, keylen=False, lists=False, dlse=False, exact=False, dropout=0.0,
                   segments=False, ranges=False, alibi=False, softcap=0.0, tma=False, dtype="bfloat16",
                   seq: int = 1000, block: int = 128) -> dict:
    """{kernel name: CompiledKernel} of one call's three portable launches (forward, dQ, dK/dV),
    compiled for sm_90 through the launchers and Triton's own specialisation (a stand-in driver,
    `inspect_kernels.compile_launches`), with the GPU's default tiles of the call."""
    import torch

    from sparseflash.experiments.bench.inspect_kernels import compile_launches
    from sparseflash.flash import dispatch, launch, tiles as policy
    from sparseflash.flash.operands import ExactTiles
    from sparseflash.mask import BlockMask

    B, H, Hk, N = 2, 4, 2, seq
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    q, do = (torch.randn(B, H, N, d, dtype=dt, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, Hk, N, d, dtype=dt, generator=gen) for _ in range(2))
    lse, delta = torch.zeros(B, H, N), torch.zeros(B, H, N)
    kv_idx = q_idx = ex = mb = None
    if exact:
        m = BlockMask.from_fn(lambda b, h, i, j: (i >= j) & (i - j < 300), N, block_size=block)
        index, eb = m.index("cpu"), m.exact_bits("cpu")
        kv_idx, q_idx, mb = index.kv_idx, index.q_idx, block
        ex = ExactTiles((eb.bits, eb.kv_tile, eb.q_tile))
    elif lists:
        from sparseflash.patterns import random as random_mask

        index = random_mask(N, 3, block_size=block, seed=0, device="cpu").index("cpu")
        kv_idx, q_idx, mb = index.kv_idx, index.q_idx, block
    kl = torch.full((B,), N - 17, dtype=torch.int32) if keylen else None
    rng = torch.zeros(3, dtype=torch.int64)
    seg = None
    if segments:
        ids = (torch.arange(N, dtype=torch.int32) // 300).expand(B, N).contiguous()
        seg = (ids, ids)
    kr = None
    if ranges:
        kr = torch.stack([torch.zeros(N, dtype=torch.int32), torch.arange(1, N + 1, dtype=torch.int32)])[None]
    slopes = torch.rand(1, H) if alibi else None
    named = dict(segments=seg, key_ranges=kr, slopes=slopes, softcap=softcap, exact=ex)
    cuda = torch.device("cuda")
    nkb = None if mb is None else -(-N // mb)
    cfgs = {kind: policy.default_config(kind, d, cuda, nkb, dropout > 0, tma, segments=segments)
            for kind in ("fwd", "dkdv", "dq")}
    if dt == torch.float32:
        cfgs = {kind: policy.fp32_config(c, kind, d) for kind, c in cfgs.items()}
    saved = policy.interpreting, policy.TMA_MODE, dispatch.HOPPER_EXACT
    policy.interpreting = lambda: False
    policy.TMA_MODE = "on" if tma else "off"
    dispatch.HOPPER_EXACT = "off"

    def run():
        with policy.tile_config(**cfgs):
            launch.fwd(q, k, v, kv_idx, kl, d ** -0.5, causal, mb, mb, dropout, rng, **named)
            bargs = (do, q, k, v, lse, delta, kl, d ** -0.5, causal, mb, mb, dropout, rng)
            launch.bwd_dq(*bargs, kv_idx, o=q, dlse=lse if dlse else None, **named)
            launch.bwd_dkdv(*bargs, q_idx, **named)

    try:
        return compile_launches(run)
    finally:
        policy.interpreting, policy.TMA_MODE, dispatch.HOPPER_EXACT = saved


def _family_job(job) -> list:
    """One case of a family (``portable`` or ``decode``) compiled and written out: the file names."""
    out, family, label, d = job
    cases, compile_case = {"portable": (PORTABLE_CASES, _portable_case), "decode": (DECODE_CASES, _decode_case)}[family]
    names = []
    for name, ck in sorted(compile_case(d, **cases[label][1]).items()):
        names.append(f"{family}-{name}-d{d}-{label}.ptx")
        with open(os.path.join(out, names[-1]), "w") as f:
            f.write(normalised(ck.asm["ptx"]))
    return names


def _dump_family(out: str, family: str, cases: dict):
    """(label, head dim, file names) of every case of ``cases``, each compiled in a process of its own
    (SPARSEFLASH_PTX_JOBS, default the CPUs), in order."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    jobs = [(out, family, label, d) for label, (dims, _) in cases.items() for d in dims]
    workers = int(os.environ.get("SPARSEFLASH_PTX_JOBS", "0")) or os.cpu_count() or 1
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for (_, _, label, d), names in zip(jobs, pool.map(_family_job, jobs)):
            yield label, d, names


def dump_portable(out: str) -> None:
    """The portable kernels' builds of every `PORTABLE_CASES` case (fwd_kernel, bwd_dq_kernel,
    bwd_dkdv_kernel each)."""
    for _, _, names in _dump_family(out, "portable", PORTABLE_CASES):
        if len(names) != 3:
            raise RuntimeError(f"expected three kernels, compiled {names}")
        print(" ".join(names), flush=True)


# The decode kernels' cases: label -> (head dims, options of `_decode_case`). GQA 8 / 2 unless heads
# says otherwise; splits: the plan's split count (1: the split kernel stores the answer, no combine);
# check: the call's bounds check too; new: the append of that many new keys too.
DECODE_CASES = {
    "dense-split": ((64, 128), dict(splits=3, check=True, new=1)),
    "dense-direct-nolse": ((64, 128), dict(splits=1, lse=False)),
    "fp16-mha-direct": ((64,), dict(dtype="float16", heads=(4, 4), splits=1)),
    "fp32-direct": ((64,), dict(dtype="float32", splits=1)),
    "paged-causal-softcap-alibi": ((64, 128), dict(paged=True, window=(-1, 0), softcap=30.0, alibi="heads",
                                                   splits=2, check=True, new=2)),
    "paged-whole-window-direct": ((64, 128), dict(paged=True, seqlens=False, seq_add=1024, window=(16, 0),
                                                  splits=1, lse=False, check=True)),
    "leftpad-batchidx-alibi-split": ((64, 128), dict(leftpad=True, batch_idx=True, alibi="batch", splits=2,
                                                     seq_add=1, check=True, new=1)),
    "leftpad-right-direct": ((64,), dict(leftpad=True, window=(-1, 3), splits=1, seq_q=2)),
    "lists-split": ((64, 128), dict(blocks=True, splits=2)),
    "lists-direct-left": ((64, 128), dict(blocks=True, splits=1, window=(100, -1))),
    "lists-paged-leftpad-causal": ((64,), dict(blocks=True, paged=True, leftpad=True, window=(-1, 0), splits=2,
                                               check=True)),
    "chunks-window": ((64,), dict(seq_q=40, window=(50, 8), splits=2, softcap=10.0)),
}


def _decode_case(d: int, heads=(8, 2), seq_q=1, dtype="bfloat16", splits=2, lse=True, paged=False, seqlens=True,
                 leftpad=False, batch_idx=False, blocks=False, window=(-1, -1), softcap=None, alibi=None, seq_add=0,
                 cache=1024, check=False, new=0) -> dict:
    """{kernel name: CompiledKernel} of one decode call's launches (with ``check`` the bounds check
    `decode.bounds_check`, with ``new`` the append `decode.append`, as `flash_attn_with_kvcache`
    makes them; then `decode.plan`'s call: the split kernel, with several splits its combine, per
    query chunk of 64 rows: later chunks' builds as "name.1", ...), compiled for sm_90 through
    Triton's own specialisation (a stand-in driver, `inspect_kernels.compile_launches`)."""
    import torch

    from sparseflash.experiments.bench.inspect_kernels import compile_launches
    from sparseflash.flash import decode

    B, (H, Hk), page = 2, heads, 64
    dt = getattr(torch, dtype)
    q = torch.zeros(B, seq_q, H, d, dtype=dt)
    table = None
    if paged:
        k, v = (torch.zeros(B * cache // page + 3, page, Hk, d, dtype=dt) for _ in range(2))
        table = torch.arange(B * cache // page, dtype=torch.int32).view(B, -1)
    else:
        k, v = (torch.zeros(B + batch_idx, cache, Hk, d, dtype=dt) for _ in range(2))
    blk = (torch.zeros(B, Hk, 3, dtype=torch.int32), torch.zeros(B, Hk, dtype=torch.int32), 128) if blocks else None
    slopes = None if alibi is None else torch.zeros(H) if alibi == "heads" else torch.zeros(B, H)
    vec = torch.zeros(B, dtype=torch.int32)
    runs = []
    if check:
        c = decode.bounds_check(torch.device("cpu"), B, seqlens=seqlens, leftpad=leftpad, batch_idx=batch_idx,
                                block_table=table, seq_add=new if seqlens else cache, max_len=cache,
                                n_rows=k.shape[0], n_pages=k.shape[0], page=k.shape[1])
        runs.append(lambda: c(vec if seqlens else None, vec if leftpad else None, vec if batch_idx else None, table))
    if new:
        kn, vn = (torch.zeros(B, new, Hk, d, dtype=dt) for _ in range(2))
        a = decode.append(kn, vn, k, v, batch_idx=batch_idx, block_table=table)
        runs.append(lambda: a(kn, vn, k, v, vec, vec if batch_idx else None, table))
    p = decode.plan(q, k, v, scale=d ** -0.5, window=window, softcap=softcap, alibi=slopes, batch_idx=batch_idx,
                    block_table=table, blocks=blk, seqlens=seqlens, leftpad=leftpad, seq_add=seq_add,
                    num_splits=splits, max_len=cache, store_lse=lse)
    runs.append(lambda: p(q, k, v, vec if seqlens else None, vec if leftpad else None, vec if batch_idx else None,
                          table, slopes, blk))
    return compile_launches(lambda: [run() for run in runs], every=True)


def dump_decode(out: str) -> None:
    """The decode kernels' builds of every `DECODE_CASES` case."""
    for label, d, names in _dump_family(out, "decode", DECODE_CASES):
        kw = DECODE_CASES[label][1]
        if not any("split_kernel" in n for n in names) \
                or any("combine" in n for n in names) != (kw.get("splits", 2) > 1) \
                or any("bounds" in n for n in names) != kw.get("check", False) \
                or any("append" in n for n in names) != bool(kw.get("new")):
            raise RuntimeError(f"{label} d{d}: unexpected kernels {names}")
        print(" ".join(names), flush=True)


def dump_hopper(out: str) -> None:
    from sparseflash.experiments.studies.hopper import compile_check as cc

    for kernel in ("fwd", "bwd"):
        for d in (64, 128):
            for label, dense, causal, keylen, block in cc.CASES + cc.EXACT_CASES:
                ck = cc.compile_case(d, dense, causal, keylen, block, seq=300, kernel=kernel,
                                     exact=label.startswith("exact"))
                with open(os.path.join(out, f"{kernel}-d{d}-{label.replace(' ', '_')}.ptx"), "w") as f:
                    f.write(normalised(ck.asm["ptx"]))


def compare(old: str, new: str) -> int:
    names = sorted(n for n in os.listdir(old) if n.endswith(".ptx"))
    verdicts = {n: verdict(open(os.path.join(old, n)).read(), open(os.path.join(new, n)).read()) for n in names}
    for n, v in verdicts.items():
        if v != "same":
            print(f"{v}: {n}")
    same, moved = (sum(v == k for v in verdicts.values()) for k in ("same", "reordered"))
    print(f"{same} of {len(names)} kernels the same, {moved} reordered")
    return 0 if same + moved == len(names) else 1


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(dump(*a[1:3]) if a[:1] == ["dump"] else compare(a[1], a[2]) if a[:1] == ["compare"] else print(__doc__) or 2)
