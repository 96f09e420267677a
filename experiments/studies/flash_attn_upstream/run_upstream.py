"""Cross-check: flash-attn's own tests/test_flash_attn.py, unchanged, against sparseflash.

The upstream file is not part of this repository: fetch it into ``.upstream/test_flash_attn.py``
(ignored by git). This runner installs a ``flash_attn`` name shim before pytest imports the file:
``flash_attn`` and ``flash_attn.flash_attn_interface`` map to sparseflash's drop-in functions,
``flash_attn.bert_padding`` and ``flash_attn.layers.rotary`` get the small helpers the tests use,
written here (pad/unpad of padded batches, rotary embedding). It then runs a seeded sample of
``--n`` cases per test function (dropout cases deselected: dropout's bits differ from flash-attn's
by design) spread over ``--jobs`` processes, and writes per test function the passed / failed /
skipped counts, skip reasons and first failure messages.

    python -m sparseflash.experiments.studies.flash_attn_upstream.run_upstream OUT_DIR [--n 8] [--jobs 12]

The upstream file asks for a CUDA device at import (``torch.cuda.get_device_capability``) and
makes every tensor on "cuda", so it runs only on a GPU; ``einops`` must be importable there.
Writes ``upstream_cases.csv``, ``upstream_summary.csv``, ``upstream.json``; prints the table last.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
import types
from collections import defaultdict

import torch

from sparseflash.experiments.studies.flash_attn_upstream import _summary

UPSTREAM = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".upstream",
                                         "test_flash_attn.py"))
# Tests that exercise something other than flash-attn's Python interface, with the reason.
NOT_INTERFACE = {
    "test_flash_attn_generator_arg_must_be_none": "calls flash-attn's compiled C++ entry points "
    "(flash_attn_gpu.fwd/bwd), not its Python interface; sparseflash has no such extension",
    "test_flash_attn_varlen_paged_kv_num_splits": "calls flash-attn's private _flash_attn_varlen_forward "
    "(the raw forward taking num_splits), not a public function",
}


# ---------------------------------------------------------------- helpers the upstream tests import


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """[B, S, ...] and a [B, S] bool mask -> (tokens [T, ...], their flat indices [T], cu_seqlens
    [B + 1] int32, the longest length, the per-sequence counts [B] int32). ``unused_mask`` marks
    tokens kept in the packed tensor but not counted in cu_seqlens (only seqused counts them)."""
    keep = attention_mask if unused_mask is None else attention_mask | unused_mask
    counted = attention_mask.sum(-1, dtype=torch.int32)
    used = keep.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(counted, 0, dtype=torch.int32), (1, 0))
    return (hidden_states.flatten(0, 1)[indices], indices, cu, int(counted.max().item()), used)


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: tokens [T, ...] back to [batch, seqlen, ...], zeros elsewhere."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    """Rotary embedding of the first ``2 * cos.shape[1]`` features of x [B, S, H, D] at positions
    ``seqlen_offsets + arange(S)`` (pairs (2i, 2i+1) if interleaved, else (i, i + r/2)), computed in
    float32 and rounded to x's dtype."""
    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_emb shim: cu_seqlens (packed sequences) is not written")
    B, S = x.shape[:2]
    r = 2 * cos.shape[1]
    off = torch.as_tensor(seqlen_offsets, device=x.device).long().reshape(-1, 1).expand(B, 1)
    pos = off + torch.arange(S, device=x.device)  # [B, S]
    c, s = cos.float()[pos][:, :, None], sin.float()[pos][:, :, None]  # [B, S, 1, r/2]
    xr = x[..., :r].float()
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)
    else:
        a, b = xr[..., : r // 2], xr[..., r // 2:]
        rot = torch.cat((a * c - b * s, a * s + b * c), -1)
    out = torch.cat((rot.to(x.dtype), x[..., r:]), -1)
    if inplace:
        x.copy_(out)
        return x
    return out


def install_shim() -> None:
    """sys.modules entries for flash_attn.* backed by sparseflash and the helpers above."""
    import sparseflash

    names = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
             "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
    root = types.ModuleType("flash_attn")
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    for n in names:
        setattr(root, n, getattr(sparseflash, n))
        setattr(iface, n, getattr(sparseflash, n))
    # The tests' reference splits its scores into key blocks of this width only to form the LSE
    # block by block; any width gives the same LSE.
    iface._get_block_size_n = lambda device, head_dim, is_dropout, is_causal: 128
    iface.USE_TRITON_ROCM = False
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = pad_input, unpad_input
    layers = types.ModuleType("flash_attn.layers")
    rotary = types.ModuleType("flash_attn.layers.rotary")
    rotary.apply_rotary_emb = apply_rotary_emb
    root.flash_attn_interface, root.bert_padding, root.layers, layers.rotary = iface, padding, layers, rotary
    root.__version__ = "2.8.3"  # the interface version sparseflash's drop-in follows
    sys.modules.update({"flash_attn": root, "flash_attn.flash_attn_interface": iface,
                        "flash_attn.bert_padding": padding, "flash_attn.layers": layers,
                        "flash_attn.layers.rotary": rotary})


# ---------------------------------------------------------------- sampling


class Sampler:
    """Keeps ``n`` cases per test function (seeded; dropout cases removed first), then this
    process's shard; tests of something other than the Python interface are skipped with a reason."""

    def __init__(self, n: int, seed: int, shard: tuple[int, int]):
        self.n, self.seed, self.shard = n, seed, shard

    def pytest_collection_modifyitems(self, session, config, items):
        import pytest

        by_fn = defaultdict(list)
        dropped = []
        for it in items:
            params = getattr(getattr(it, "callspec", None), "params", {})
            (dropped if params.get("dropout_p", 0.0) != 0.0 else by_fn[it.originalname]).append(it)
        keep = []
        for fn in sorted(by_fn):
            cases = by_fn[fn]
            pick = sorted(random.Random(f"{self.seed}-{fn}").sample(range(len(cases)), min(self.n, len(cases))))
            keep += [cases[j] for j in pick]
            dropped += [c for j, c in enumerate(cases) if j not in set(pick)]
        i, k = self.shard
        dropped += [c for j, c in enumerate(keep) if j % k != i]
        keep = keep[i::k]
        for it in keep:
            if it.originalname in NOT_INTERFACE:
                it.add_marker(pytest.mark.skip(reason=NOT_INTERFACE[it.originalname]))
        items[:] = keep
        config.hook.pytest_deselected(items=dropped)


def function_of(nodeid: str) -> str:
    return re.sub(r"\[.*", "", nodeid.split("::")[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder for the CSV/JSON files")
    p.add_argument("--n", type=int, default=8, help="cases per test function (seeded sample)")
    p.add_argument("--seed", type=int, default=57)
    p.add_argument("--jobs", type=int, default=12, help="processes sharing the GPU")
    p.add_argument("--timeout-s", type=float, default=225.0, help="stop unfinished processes after this long")
    p.add_argument("--upstream", default=UPSTREAM, help="path of flash-attn's tests/test_flash_attn.py")
    p.add_argument("--shard", help=argparse.SUPPRESS)  # internal: i/k
    p.add_argument("--shard-stream", help=argparse.SUPPRESS)
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = p.parse_args(argv)
    if a.n < 1 or a.jobs < 1:
        p.error(f"--n and --jobs must be positive, got --n {a.n} --jobs {a.jobs}")
    if not os.path.isfile(a.upstream):
        p.error(f"--upstream: no file {a.upstream}; fetch flash-attn's tests/test_flash_attn.py there "
                "(it is not committed)")
    if a.shard_stream:
        import pytest

        install_shim()
        i, k = (int(x) for x in a.shard.split("/"))
        return int(pytest.main([a.upstream, "-q", "-p", "no:cacheprovider", "--rootdir", os.path.dirname(a.upstream),
                                *a.pytest_args], plugins=[Sampler(a.n, a.seed, (i, k)),
                                                          _summary.Recorder(function_of, a.shard_stream)]))
    if not torch.cuda.is_available():
        p.error("flash-attn's test file makes its tensors on 'cuda' and asks for the device at import: "
                "run this on a GPU machine")
    t0 = time.time()
    rows, timed_out, codes = _summary.run_shards(
        __spec__.name, a.out, a.jobs, a.timeout_s,
        lambda i, stream: ["--n", str(a.n), "--seed", str(a.seed), "--upstream", a.upstream,
                           "--shard", f"{i}/{a.jobs}", "--shard-stream", stream, a.out,
                           *(["--", *a.pytest_args] if a.pytest_args else [])])
    wall = time.time() - t0
    summary = _summary.write(a.out, "upstream", rows, dict(cases_per_function=a.n, seed=a.seed, jobs=a.jobs,
                                                           wall_s=round(wall, 1), timed_out=timed_out,
                                                           exit_codes=codes))
    _summary.print_table(summary, f"flash-attn's test_flash_attn.py on sparseflash: {len(rows)} cases in {wall:.0f} s"
                         + (" (stopped at --timeout-s: the rest not run)" if timed_out else ""))
    return 0 if not timed_out and all(s["failed"] == 0 for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
