"""Block-sparse context parallelism: one sequence's attention across the ranks of a process group.

Usage (every rank runs the same lines; ``q, k, v`` are the full ``[B, H, N, D]`` tensors)::

    import sparseflash.distributed as sfd
    plan = sfd.plan(N, group, mask=mask, causal=True, segment_ids=None, block_size=128)
    q_l, k_l, v_l = plan.shard(q), plan.shard(k), plan.shard(v)
    o_l = sfd.attention(q_l, k_l, v_l, plan)   # autograd; dropout_p=, scale= as sparseflash.attention
    o = plan.unshard(o_l)                       # the full [B, H, N, D] on every rank

Algorithm
---------
*The plan* (`plan`, a pure function of the layout, the same on every rank). The sequence is cut into
token blocks of ``block_size`` and padded to ``world * blocks_per_rank`` blocks; every rank holds the
same number of blocks. The global predicate of pair (i, j) is ``mask`` (its ``mask_mod`` inside partial
blocks, or its layout) AND ``j <= i`` if ``causal`` AND ``seg[i] == seg[j]`` with ``segment_ids`` AND
``j < N``. Its block-level form (which block pairs have any pair on, which have all on; `_Predicate`) is
never built as an ``[nb, nb]`` grid: each query block's on key blocks are an interval (real blocks, ``j <= i``
with ``causal``, for packed documents the blocks whose ids meet) cut, where there is one, by a dense part
(the mask's own layout, or ids in no order), which is read a chunk of rows at a time. Without a dense part
the work per query block and the blocks each rank needs are interval arithmetic, O(blocks): 1M tokens,
causal, 4 ranks plan in ~0.2 s on a CPU core (the grids took 3.8-13.6 s). Three placements are scored by
the most work one rank gets (on block pairs) and by the traffic (key blocks some other rank needs):
contiguous runs (documents and windows stay together), zig-zag (rank r takes chunks r and 2W-1-r of 2W:
balanced causal) and a longest-processing-time greedy with equal block counts. The least traffic among
the placements within 10% of the best balance wins (`place`). The plan keeps lists (each rank's blocks,
the blocks each needs from each) and builds, once per device, the index tensors and sub-masks of this
rank's own rows that its calls use.

*The checks* (`_agree`). Before any exchange (in `plan`, `attention` and `Plan.unshard`) every rank runs its
own checks and then one small all-gather compares what every rank must share: in `plan` the lengths, block
size, ``causal`` and the digests of the mask (its layout, full blocks and the bits its ``mask_mod`` gives in
every partial block) and of the segment ids; in `attention` the plan's digest, every shard's shape and
dtype, ``dropout_p``, ``scale`` and whether a backward will follow. A rank whose own checks fail still
takes part, so every rank raises the same error (that rank's message) instead of waiting in an exchange
until the backend's timeout; values that differ between ranks raise on every rank, naming them. The
gather runs on the group itself when it takes CPU tensors (gloo), else on a gloo group over the same
ranks made once (no device synchronisation).

For each pair (my query blocks, rank s) the plan keeps the key blocks of s that some on block needs
(only those are sent: a window sends its halo, rank-aligned documents nothing) and, per stage, a
`BlockMask` in local coordinates whose ``mask_mod`` maps local to global positions and evaluates the
global predicate, so causality, windows and documents stay token-exact although a rank's blocks are not
contiguous. One exception: under plain causal attention (no mask, no segment ids, no padding) a rank's
own stage is its whole shard against itself, and since a shard lists its blocks in ascending order that
is exactly causal attention in local coordinates (`Plan.causal_stage`): it runs the kernels' causal walk,
without block lists or the mask's bits (a 2-GPU 512K causal profile on H200s, before this: the stages'
kernels, own and remote, took 11-13% more than half the one-GPU causal kernels).

*The exchange* (`_Attention`, one autograd Function) is a pipeline of stages (`Plan.stages`). A rank's
own needed blocks are one stage; the key blocks it needs from another rank s are cut into chunks of at
most ``stage_tokens``; remote stage (t, c) receives chunk c of what this rank needs from rank - t and
sends chunk c of what rank + t needs from it (a rotation, as a ring's steps, but each rank sends only the
blocks its peer needs, straight from their owner). Every rank runs the same (t, c) in the same order,
skipping the compute (and the message) of a stage it has nothing for; a (t, c) no rank has anything for
is left out. The first remote stage is posted before the own stage computes; from then on stage i + 1's
transfer is posted before stage i computes, so on CUDA the kernels of one stage run while NCCL (on its
own stream) moves the next. A stage computes only the shard rows its keys reach (`Plan.sub_mask`). Each
stage's output and LSE (over its keys only) are folded into one float32 output and LSE in place
(`_merge_into`); a row with no key anywhere gives 0, LSE -inf and zero gradients. Only q, k, v, the
output and the LSE are saved for backward. The backward walks the same stages: it fetches each remote
chunk again (posted one stage ahead), computes the stage's dQ, dK, dV from the *final* output and LSE
(`_Kernels`: dS = P (dP - delta + dLSE) restricted to the stage's keys is that stage's share), adds dQ
into a float32 dQ and sends the chunk's dK, dV back to its owner while the next stage computes; the
owner adds what comes back into its float32 dK, dV.

Memory (per rank, beyond q, k, v, the output, its LSE, dO and the returned gradients). L local tokens, C
stage tokens, e bytes per element, KV = 2 B Hkv C D e (one stage's keys and values). Forward: the float32
output accumulator 4 B Hq L D, one stage's output B Hq L D e, 3 KV (two received: the one computing and
the next arriving; one sent). Backward: float32 dQ, dK, dV 4 B (Hq + 2 Hkv) L D, one stage's dQ B Hq L D e
and dK, dV (1 KV), 3 KV of fetches and 2 KV of returned gradients in flight. Nothing holds every peer's
keys at once. 1M tokens on 4 ranks, 8 heads, d 128, bf16, C = 64K: forward 1 + 0.5 + 0.75 GiB = 2.25 GiB;
backward 3 + 0.5 + 0.25 + 0.75 + 0.5 GiB = 5 GiB, of which the float32 accumulators are 3 (the kernels
write each stage's gradients anew: accumulating inside them would save those and the stage's dQ).
Besides, each stage's sub-mask keeps its block lists (int32, ``2 x (L / block) x (C / block)``) per plan.

Limits
------
- The mask is one `BlockMask` over ``N x N`` with block ``(block_size, block_size)``; a layout that
  varies with the batch / head is kept (the balance counts all of it).
- Segment blocks are judged by each block's (min, max) id: exact for packed documents (ids that never
  decrease); other orders may send (never compute wrongly) blocks that turn out empty.
- ``unshard``'s gradient is this rank's slice of the output gradient: every rank is taken to compute the
  same loss from the gathered output. A loss on the shard uses ``o_l`` directly.
- With dropout each stage draws its own random bits (the backward regenerates them): the same
  distribution as one process, not the same bits.
- ``shard`` takes the full tensor on every rank.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import struct

import torch
import torch.distributed as dist

from sparseflash.mask import BlockMask
from sparseflash.mask_mods import FN_CHUNK_ELEMS, eval_partial

__all__ = ["Plan", "plan", "place", "attention"]

# a placement whose busiest rank has at most this much more work than the best one may win on traffic
_BALANCE_SLACK = 1.1


# ------------------------------------------------------------------ checks
def _group_info(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialised: call torch.distributed.init_process_group "
                           "on every rank before sparseflash.distributed.plan")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the group given")
    return rank, dist.get_world_size(group)


def _comm_device(group) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# a gloo group over the same ranks per NCCL group: the checks talk there (CPU tensors, no device sync)
_CONTROL: dict = {}


def _control_group(group):
    """The group the ranks' checks are gathered on: ``group`` itself when its backend takes CPU tensors
    (gloo), else a gloo group over the same ranks, made once (collectively: every member calls this)."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    if group not in _CONTROL:
        _CONTROL[group] = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                         use_local_synchronization=True)
        # a first collective with every rank, so that later batched point-to-point calls may involve only
        # some ranks (NCCL leaves a first batch without every rank undefined)
        dist.all_reduce(torch.zeros(1, device=_comm_device(group)), group=group)
    return _CONTROL[group]


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtype_code(dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _float_code(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


_SHOW = {
    "dtype": lambda c: str(_DTYPES[c]).replace("torch.", "") if c < len(_DTYPES) else "another dtype",
    "float": lambda c: repr(struct.unpack("<d", struct.pack("<q", c))[0]),
    "digest": lambda c: f"{c:014x}",
    "int": str,
    "bool": lambda c: str(bool(c)),
}


_MAX_FIELDS = 32


def _agree(ctl, what: str, fields: list | None, error: BaseException | None):
    """Every rank's ``fields`` (``(name, kind, int)`` triples, the same names everywhere) and whether it
    passed its own checks, gathered in one collective on the control group; then every rank raises the
    same error if some rank failed (its message; ``error`` is this rank's own failure, or None) or the
    ranks' fields differ. So a rank's bad input stops every rank at once instead of leaving the others
    blocked in an exchange until the backend's timeout."""
    world = dist.get_world_size(ctl)
    row = torch.zeros(_MAX_FIELDS + 2, dtype=torch.int64)  # one size on every rank, whatever failed where
    if error is None:
        row[0], row[1] = 1, len(fields)
        row[2:2 + len(fields)] = torch.tensor([v for _, _, v in fields], dtype=torch.int64)
    every = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(every, row, group=ctl)
    rows = torch.stack(every).tolist()
    if not all(r[0] for r in rows):
        mine = None if error is None else (type(error).__name__, str(error))
        msgs = [None] * world
        dist.all_gather_object(msgs, mine, group=ctl)
        failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
        by_text: dict = {}
        for r, (kind, text) in failed:
            by_text.setdefault((kind, text), []).append(r)
        parts = [f"{text} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                 for (_, text), rs in by_text.items()]
        cls = {"TypeError": TypeError, "ValueError": ValueError}.get(failed[0][1][0], RuntimeError)
        raise cls(f"{what}: " + "; ".join(parts)) from error
    if len({r[1] for r in rows}) != 1 or any(r[2:] != rows[0][2:] for r in rows):
        diff = [(i, name, kind) for i, (name, kind, _) in enumerate(fields) if len({r[2 + i] for r in rows}) > 1]
        show = "; ".join(f"{name}: " + ", ".join(f"rank {r} {_SHOW[kind](rows[r][2 + i])}" for r in range(world))
                         for i, name, kind in diff)
        raise ValueError(f"{what}: the ranks disagree ({show}): every rank must make the same call")


def _tensor_digest(t) -> int:
    """7 bytes of the sha256 of a tensor's shape, dtype and values (0 for None)."""
    if t is None:
        return 0
    h = hashlib.sha256(repr((tuple(t.shape), str(t.dtype))).encode())
    h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:7], "little")


# partial blocks whose mask_mod bits one step of `_mask_digest` evaluates
_DIGEST_BLOCKS = 1024


def _mask_digest(mask) -> int:
    """Digest of what a mask attends (0 for None): its layout and full blocks, and with a ``mask_mod`` the
    bits it gives inside every partial block (evaluated on the mask's device a chunk of blocks at a
    time, as `BlockMask.exact_bits` does, but not kept): two masks attend the same pairs iff their
    digests agree (up to a hash collision), whatever functions define them."""
    if mask is None:
        return 0
    h = hashlib.sha256(repr((mask.seq_q, mask.seq_k, mask.block_size)).encode())
    h.update(_tensor_digest(mask.layout).to_bytes(7, "little"))
    if mask.mask_mod is not None:
        h.update(_tensor_digest(mask.full).to_bytes(7, "little"))
        nz = mask.partial.nonzero()
        for i in range(0, nz.shape[0], _DIGEST_BLOCKS):
            bits = eval_partial(mask.mask_mod, nz[i:i + _DIGEST_BLOCKS], mask.seq_q, mask.seq_k, mask.block_size,
                                FN_CHUNK_ELEMS["cuda" if mask.device.type == "cuda" else "cpu"])
            h.update(bits.cpu().numpy().tobytes())
    return int.from_bytes(h.digest()[:7], "little")


def _tensor_fields(name, t) -> list:
    dims = ("batch", "heads", "tokens", "head_dim")
    return [(f"{name} {d}", "int", int(n)) for d, n in zip(dims, t.shape)] + [(f"{name} dtype", "dtype",
                                                                                _dtype_code(t.dtype))]


def _check_call(plan, what: str, local):
    """The collective check before an exchange: ``local()`` runs this rank's own checks and returns
    ``(tensors, fields)`` (named tensors whose shapes and dtypes, and named values, every rank must
    share); then `_agree` on the plan's control group, with the plan's digest."""
    if not isinstance(plan, Plan):
        # the other ranks wait in the check on their plan's control group: join the default group's
        # if there is one (the usual case), else this rank can only raise alone
        ctl = _CONTROL.get(dist.group.WORLD, dist.group.WORLD if dist.is_initialized() and "gloo" in str(
            dist.get_backend()).lower() else None)
        error = TypeError(f"plan must be a sparseflash.distributed.Plan (from sfd.plan), got {type(plan).__name__}")
        if ctl is None:
            raise error
        _agree(ctl, what, None, error)
    fields, error = None, None
    try:
        tensors, extra = local()
        fields = [("plan", "digest", plan.digest)] + [f for n, t in tensors for f in _tensor_fields(n, t)] + extra
    except (TypeError, ValueError) as e:
        error = e
    _agree(plan.control, what, fields, error)


# ------------------------------------------------------------------ the global predicate
class _GlobalMod:
    """mask_mod of one (query shard, key blocks) pair: local indices -> global positions -> the predicate."""

    def __init__(self, qpos, kpos, n, user_mod, causal, seg):
        self.qpos, self.kpos, self.n, self.user_mod, self.causal, self.seg = qpos, kpos, n, user_mod, causal, seg

    def __call__(self, b, h, q_idx, kv_idx):
        gq, gk = self.qpos[q_idx], self.kpos[kv_idx]
        on = gk < self.n
        gq, gk = gq.clamp(max=self.n - 1), gk.clamp(max=self.n - 1)
        if self.causal:
            on = on & (gk <= gq)
        if self.seg is not None:
            sb = b if self.seg.shape[0] > 1 else 0
            on = on & (self.seg[sb, gq] == self.seg[sb, gk])
        if self.user_mod is not None:
            on = on & self.user_mod(b, h, gq, gk)
        return on

    def to(self, device):
        mod = self.user_mod.to(device) if hasattr(self.user_mod, "to") else self.user_mod
        seg = None if self.seg is None else self.seg.to(device)
        return _GlobalMod(self.qpos.to(device), self.kpos.to(device), self.n, mod, self.causal, seg)


# query-block rows x key blocks x batch x heads that `_Predicate` evaluates at once (16 MiB of bools)
_CHUNK_CELLS = 1 << 24


class _Predicate:
    """The global predicate at block level, for any query-block rows and key-block columns on demand; no
    ``[nb, nb]`` grid is ever built. A block pair is on iff some token pair in it is, full iff every real
    pair in it is. Each row's on blocks are an interval of key blocks (both blocks real, ``j <= i`` with
    ``causal``, and with packed documents, ids that never decrease along a row, the blocks whose id ranges
    meet the row's) intersected, where there is one, with a *dense part*: the mask's layout, or the id
    test of segment ids in another order. Without a dense part the work per row and the blocks a rank needs
    are interval arithmetic, O(blocks); with one they are evaluated a chunk of rows at a time
    (`_CHUNK_CELLS`). Runs on the mask's device (else the segment ids', else the CPU)."""

    def __init__(self, n, bs, nb_pad, mask, causal, seg):
        self.n, self.bs, self.nb_pad, self.causal, self.mask = n, bs, nb_pad, causal, mask
        self.nb = math.ceil(n / bs)
        self.device = mask.device if mask is not None else (seg.device if seg is not None else torch.device("cpu"))
        self.lead = (1, 1) if mask is None else tuple(mask.layout.shape[:2])
        self.seg_range, self.sorted_ids = None, True
        if seg is not None:
            # each block's (min, max) id per batch row; padding blocks meet nothing
            ids = seg.to(self.device).long()
            self.lead = (max(self.lead[0], ids.shape[0]), self.lead[1])
            big = torch.iinfo(torch.int64).max
            padded = torch.nn.functional.pad(ids, (0, nb_pad * bs - n), value=0).view(ids.shape[0], nb_pad, bs)
            real = (torch.arange(nb_pad * bs, device=self.device) < n).view(nb_pad, bs)
            self.seg_range = (torch.where(real, padded, big).amin(-1), torch.where(real, padded, -big).amax(-1))
            self.sorted_ids = bool((ids[:, 1:] >= ids[:, :-1]).all())
        self.dense = mask is not None or not self.sorted_ids

    def intervals(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key-block interval ``[lo, hi)`` of each row, int64 ``[B', len(rows)]`` (B' the ids' batch, or 1):
        every block the row attends lies in it; exact where there is no dense part."""
        hi = torch.where(rows < self.nb, torch.full_like(rows, self.nb), 0)
        if self.causal:
            hi = torch.minimum(hi, rows + 1)
        lo, hi = torch.zeros_like(rows)[None], hi[None]
        if self.seg_range is not None and self.sorted_ids:
            # ids never decrease: the blocks whose id range meets row i's are an interval
            smin, smax = (t[:, :self.nb].contiguous() for t in self.seg_range)
            r = rows.clamp(max=self.nb - 1)
            first = torch.searchsorted(smax, smin[:, r])  # first block whose max id >= the row's min
            past = torch.searchsorted(smin, smax[:, r], right=True)  # first block whose min id > the row's max
            lo, hi = torch.maximum(lo, first), torch.minimum(hi, past)
        return lo, torch.maximum(lo, hi)

    def rows(self, rows: torch.Tensor, cols: torch.Tensor | None = None, full: bool = False):
        """on (and with ``full`` the full blocks), bool ``[B', H', len(rows), len(cols)]`` (``cols`` None:
        every key block) of query-block rows ``rows``; int64 indices on `device`."""
        every = cols is None
        cols = torch.arange(self.nb_pad, device=self.device) if every else cols
        if self.causal or self.seg_range is not None:
            lo, hi = self.intervals(rows)
            on = ((cols >= lo[:, :, None]) & (cols < hi[:, :, None]))[:, None]
        else:  # the interval is every real block
            on = ((rows < self.nb)[:, None] & (cols < self.nb)[None, :])[None, None]
        if self.mask is not None:
            r, c = rows.clamp(max=self.nb - 1), cols.clamp(max=self.nb - 1)
            lay = self.mask.layout.index_select(2, r)
            # (columns past nb are off in the interval already: any value serves there)
            on = on & (torch.nn.functional.pad(lay, (0, self.nb_pad - self.nb)) if every else lay[..., c])
        if self.seg_range is not None and not self.sorted_ids:
            smin, smax = self.seg_range
            meet = (smin[:, rows, None] <= smax[:, None, cols]) & (smin[:, None, cols] <= smax[:, rows, None])
            on = on & meet[:, None]
        if not full:
            return on
        fl = on & (cols != self.nb - 1 if self.n % self.bs else True)  # the tail key block holds padding
        if self.causal:
            fl = fl & (cols[None, :] < rows[:, None])
        if self.mask is not None:
            fl = fl & self.mask.full.index_select(2, r)[..., c]
        if self.seg_range is not None:
            smin, smax = self.seg_range
            one = smin == smax
            fl = fl & (one[:, rows, None] & one[:, None, cols] & (smin[:, rows, None] == smin[:, None, cols]))[:, None]
        return on, fl

    def _chunks(self, rows: torch.Tensor):
        step = max(1, _CHUNK_CELLS // max(1, self.nb_pad * self.lead[0] * self.lead[1]))
        return [rows[i:i + step] for i in range(0, rows.numel(), step)]

    def row_work(self) -> torch.Tensor:
        """On block pairs per query-block row (every batch and head counted), int64 ``[nb_pad]``, on the CPU."""
        rows = torch.arange(self.nb_pad, device=self.device)
        if not self.dense:
            lo, hi = self.intervals(rows)
            return (hi - lo).sum(0).cpu() * self.lead[1]
        return torch.cat([self.rows(c).sum(dim=-1, dtype=torch.int32).sum(dim=(0, 1)) for c in self._chunks(rows)
                          ]).long().cpu()

    def needed(self, owners: list, world: int) -> list:
        """For each placement in ``owners`` (a list of ``[nb_pad]`` tensors: the rank of each query block),
        ``need [world, nb_pad]`` bool on the CPU: the key blocks some query block of rank r needs (any batch /
        head). Without a dense part: the union of each rank's intervals; with one: a single pass over the rows."""
        rows = torch.arange(self.nb_pad, device=self.device)
        owners = [o.to(self.device) for o in owners]
        if not self.dense:  # +1 where an interval starts, -1 past its end, per rank
            lo, hi = self.intervals(rows)
            some = (hi > lo).long().reshape(-1)
            out = []
            for o in owners:
                marks = torch.zeros(world * (self.nb_pad + 1), dtype=torch.int64, device=self.device)
                base = (o * (self.nb_pad + 1))[None]
                marks.index_add_(0, (base + lo).reshape(-1), some)
                marks.index_add_(0, (base + hi).reshape(-1), -some)
                out.append((marks.view(world, -1).cumsum(1)[:, :-1] > 0).cpu())
            return out
        need = [torch.zeros(world, self.nb_pad, dtype=torch.bool, device=self.device) for _ in owners]
        for c in self._chunks(rows):
            row_any = self.rows(c).any(dim=1).any(dim=0)  # [len(c), nb_pad]
            for n, o in zip(need, owners):
                oc = o[c]
                # the chunk's rows grouped by owner (already so but for greedy): one slice per rank
                grouped = row_any.index_select(0, torch.argsort(oc, stable=True))
                ends = torch.bincount(oc, minlength=world).cumsum(0).tolist()
                for r, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
                    if b > a:
                        n[r] |= grouped[a:b].any(dim=0)
        return [n.cpu() for n in need]


def _placements(work, w, per):
    """Candidate block -> rank assignments (lists of sorted block lists), work ``[nb_pad]``."""
    nbp = w * per
    out = {"contiguous": [list(range(r * per, (r + 1) * per)) for r in range(w)]}
    if per % 2 == 0:
        half = per // 2
        out["zigzag"] = [list(range(r * half, (r + 1) * half)) + list(range((2 * w - 1 - r) * half, (2 * w - r) * half))
                         for r in range(w)]
    work = work.tolist()
    order = sorted(range(nbp), key=lambda i: (-work[i], i))
    # longest processing time first: each block to the least loaded rank with room (a heap of (load, rank))
    heap, owned = [(0, r) for r in range(w)], [[] for _ in range(w)]
    for i in order:
        load, r = heapq.heappop(heap)
        owned[r].append(i)
        if len(owned[r]) < per:
            heapq.heappush(heap, (load + work[i], r))
    out["greedy"] = [sorted(o) for o in owned]
    return out


def place(seq_len: int, world: int, mask=None, causal: bool = False, segment_ids=None, block_size: int = 128) -> dict:
    """The layout half of `plan`, a pure function (no group): which blocks each of ``world`` ranks holds and
    which key blocks each needs from each. Returns a dict: ``placement``, ``owned``, ``work``,
    ``traffic_blocks``, ``needed`` (as `Plan`'s attributes) and ``predicate`` (the `_Predicate`).
    ``segment_ids`` as ``[B, N]``; arguments already checked (`plan` does)."""
    nb = math.ceil(seq_len / block_size)
    per = math.ceil(nb / world)
    pred = _Predicate(seq_len, block_size, world * per, mask, causal, segment_ids)
    row_work = pred.row_work()
    cands = _placements(row_work, world, per)
    owners = {}
    for name, owned in cands.items():
        owners[name] = torch.empty(world * per, dtype=torch.long)
        for r, o in enumerate(owned):
            owners[name][o] = r
    needs = dict(zip(cands, pred.needed(list(owners.values()), world)))
    scored = {}
    for name, owned in cands.items():
        loads = [int(row_work[o].sum()) for o in owned]
        need = needs[name]
        traffic = int(need.sum()) - sum(int(need[r, o].sum()) for r, o in enumerate(owned))
        scored[name] = (max(loads), traffic, loads)
    best = min(v[0] for v in scored.values())
    ok = [n for n in cands if scored[n][0] <= best * _BALANCE_SLACK + 1e-9]
    name = min(ok, key=lambda n: (scored[n][1], scored[n][0]))
    owned = cands[name]
    needed = [[torch.tensor(owned[s])[need[owned[s]]].tolist() for s in range(world)] for need in needs[name]]
    return {"placement": name, "owned": owned, "work": scored[name][2], "traffic_blocks": scored[name][1],
            "needed": needed, "predicate": pred}


# tokens of key / value one stage of the exchange moves at most (module docstring, "Memory")
_STAGE_TOKENS = 1 << 16
# A study switch (experiments/bench/context_parallel.py --own-stage-lists): False runs a plain causal plan's
# own stage with block lists and the mask's bits like every other stage (`Plan.causal_stage`), for an A/B
# of the causal walk there. True in normal use.
CAUSAL_OWN_STAGE = True


class _Stage:
    """One step of this rank's exchange: compute with key blocks ``blocks`` of rank ``source`` (None: none),
    send blocks ``send_blocks`` of this rank to ``dest`` (None: none)."""

    __slots__ = ("source", "blocks", "dest", "send_blocks")

    def __init__(self, source, blocks, dest, send_blocks):
        self.source, self.blocks, self.dest, self.send_blocks = source, blocks, dest, send_blocks


class _StageOps:
    """A stage's device side: ``mask`` (the sub-mask of its keys, over rows ``rows`` of the shard),
    ``rows`` (a slice of the shard's rows: from the first query block with a key block in the stage to the
    last; the stage computes and merges only these), ``keys`` (an own stage's keys in the shard), ``send``
    (the sent blocks in the shard, where their gradients come back). ``causal``: the stage is the whole
    shard against itself under plain causal attention (`Plan.causal_stage`): ``mask`` is None and the
    kernels run their causal walk, no block lists and no bits."""

    __slots__ = ("mask", "rows", "keys", "send", "causal")

    def __init__(self, mask, rows, keys, send, causal=False):
        self.mask, self.rows, self.keys, self.send, self.causal = mask, rows, keys, send, causal


class Plan:
    """Where every token block lives and which key blocks each rank needs from whom (see module doc).

    Attributes: ``seq_len``, ``block_size``, ``world_size``, ``rank``, ``group``, ``owned`` (a list per
    rank of its global block indices, ascending), ``local_len`` (tokens per rank, padding included),
    ``placement`` (its name), ``work`` (on block pairs per rank), ``needed`` (``needed[r][s]``: global
    key blocks rank r receives from s), ``bytes_sent`` (bytes this rank has sent through exchanges,
    forward and backward; reset it freely).
    """

    def __init__(self, seq_len, group, mask, causal, segment_ids, block_size, stage_tokens=_STAGE_TOKENS):
        rank, world = _group_info(group)
        self.group, self.rank, self.world_size = group, rank, world
        self.seq_len, self.block_size, self.causal = seq_len, block_size, causal
        self.comm_device = _comm_device(group)
        nb = math.ceil(seq_len / block_size)
        self.blocks_per_rank = per = math.ceil(nb / world)
        self.padded_len = world * per * block_size
        self.local_len = per * block_size
        self.stage_blocks = max(1, stage_tokens // block_size)
        layout = place(seq_len, world, mask, causal, segment_ids, block_size)
        self.placement, self.owned, self.work = layout["placement"], layout["owned"], layout["work"]
        self.traffic_blocks, self.needed, pred = layout["traffic_blocks"], layout["needed"], layout["predicate"]
        local_slot = torch.empty(world * per, dtype=torch.long)
        for o in self.owned:
            local_slot[o] = torch.arange(per)
        self._local_slot = local_slot
        self._pred = pred
        self._user_mod = None if mask is None else mask.mask_mod  # (a layout's pairs are all on in its on blocks)
        self._seg = segment_ids
        self._plain = mask is None and segment_ids is None
        self._cache: dict = {}
        self.bytes_sent = 0
        self.digest = self._digest(mask, segment_ids)
        self.control = None  # the group the ranks' checks talk on (`plan` sets it)

    # ------------------------------------------------------------------ identity
    def _digest(self, mask, seg) -> int:
        """What every rank must agree on: the arguments' digests and the placement."""
        self._mask_digest, self._seg_digest = _mask_digest(mask), _tensor_digest(seg)
        h = hashlib.sha256(repr((self.seq_len, self.block_size, self.world_size, self.causal, self.placement,
                                 self.owned, self.stage_blocks, self._mask_digest, self._seg_digest)).encode())
        return int.from_bytes(h.digest()[:7], "little")

    def _fields(self) -> list:
        return [("seq_len", "int", self.seq_len), ("block_size", "int", self.block_size),
                ("stage_blocks", "int", self.stage_blocks), ("causal", "bool", int(self.causal)),
                ("mask", "digest", self._mask_digest), ("segment_ids", "digest", self._seg_digest),
                ("plan", "digest", self.digest)]

    # ------------------------------------------------------------------ per-pair masks, indices
    def _cached(self, key, build):
        """A tensor (or mask) made once per plan and device: every call after the first finds it here."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def _positions(self, blocks, device):
        """Token positions ``[len(blocks) * block_size]`` of global (or local) blocks ``blocks``."""
        bs = self.block_size
        b = torch.tensor(blocks, dtype=torch.long, device=device)
        return (b[:, None] * bs + torch.arange(bs, device=device)).reshape(-1)

    def positions(self, r: int, device) -> torch.Tensor:
        """Global token positions of rank ``r``'s tokens, in its local order (made once per device)."""
        return self._cached(("pos", r, torch.device(device)), lambda: self._positions(self.owned[r], device))

    def peer(self, r: int) -> int:
        """The global rank of group rank ``r`` (what point-to-point ops take)."""
        return r if self.group is dist.group.WORLD else dist.get_global_rank(self.group, r)

    def _local_index(self, blocks, device):
        """Where global blocks ``blocks`` (held by one rank) lie in their owner's shard: a slice when they are
        consecutive there, else a token index tensor."""
        slots = self._local_slot[list(blocks)].tolist()
        bs = self.block_size
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return slice(slots[0] * bs, (slots[-1] + 1) * bs)
        return self._positions(slots, device)

    def stages(self) -> tuple[list, list]:
        """(own, remote): this rank's stages (module docstring, "The exchange"), made once. The own stage
        takes all of this rank's needed own blocks at once (they are resident: cutting them into chunks
        bounds no memory and repeats every stage's passes over all local rows, the output's merge and the
        backward's row passes, once a chunk); remote stage (t, c) receives chunk c of what it needs from
        rank - t and sends chunk c of what rank + t needs from it. Every rank lists the same (t, c) in the
        same order (a (t, c) that no rank uses is left out everywhere; one this rank does not use is kept,
        empty), so the point-to-point messages of any two ranks are posted in the same order on both."""
        def build():
            me, w, c = self.rank, self.world_size, self.stage_blocks
            chunks = lambda xs: [tuple(xs[i:i + c]) for i in range(0, len(xs), c)]  # noqa: E731
            mine = tuple(self.needed[me][me])
            own = [_Stage(me, mine, None, ())] if mine else []
            remote = []
            for t in range(1, w):
                n = max(math.ceil(len(self.needed[(r + t) % w][r]) / c) for r in range(w))
                src, dst = (me - t) % w, (me + t) % w
                get, put = chunks(self.needed[me][src]), chunks(self.needed[dst][me])
                for i in range(n):
                    b, sb = (get[i] if i < len(get) else ()), (put[i] if i < len(put) else ())
                    remote.append(_Stage(src if b else None, b, dst if sb else None, sb))
            return own, remote

        return self._cached("stages", build)

    def stage_ops(self, device) -> list:
        """Per stage (own, then remote), what a call uses on ``device``, made once: the sub-mask of its keys,
        where its own keys lie in this rank's shard, where the blocks it sends lie."""
        device = torch.device(device)

        def build():
            own, remote = self.stages()
            out = []
            for st in own + remote:
                causal = self.causal_stage(st)
                if causal:
                    mask, rows = None, slice(0, self.local_len)
                else:
                    mask, rows = self._sub_mask(st.source, device, st.blocks) if st.blocks else (None, None)
                out.append(_StageOps(mask, rows,
                                     self._local_index(st.blocks, device) if st.source == self.rank else None,
                                     self._local_index(st.send_blocks, device) if st.send_blocks else None, causal))
            return out

        return self._cached(("ops", device), build)

    def causal_stage(self, st) -> bool:
        """Whether stage ``st`` is this rank's whole shard against itself under plain causal attention (a
        causal plan without mask or segment ids, no padding): blocks hold consecutive positions and a shard
        lists its blocks in ascending order, so in local coordinates the stage is exactly causal
        attention of a square, and the kernels' causal walk (no block lists, no bits) computes it."""
        mine = tuple(self.owned[self.rank])
        return bool(CAUSAL_OWN_STAGE and self.causal and self._plain and st.source == self.rank and tuple(st.blocks) == mine
                    and self.padded_len == self.seq_len and list(mine) == sorted(mine))

    def sub_mask(self, s: int, device, blocks: tuple | None = None) -> BlockMask:
        """The `BlockMask` of this rank's queries against key blocks ``blocks`` of rank ``s`` (default: all
        it needs from ``s``), made once per device from the predicate, over only the shard's rows from the
        first query block with an on block to the last (`_sub_mask` gives that row slice too)."""
        return self._sub_mask(s, device, blocks)[0]

    def _sub_mask(self, s: int, device, blocks: tuple | None = None) -> tuple:
        """(`sub_mask`, the slice of the shard's rows it covers): a window's halo reaches a few blocks of
        rows, not the whole shard, and a stage computes only those."""
        blocks = tuple(self.needed[self.rank][s]) if blocks is None else blocks
        device = torch.device(device)

        def build():
            mine = self.owned[self.rank]
            on, full = self._pred.rows(torch.tensor(mine, device=self._pred.device),
                                       torch.tensor(blocks, dtype=torch.long, device=self._pred.device), full=True)
            reach = on.any(-1).reshape(-1, on.shape[-2]).any(0).nonzero().flatten()  # rows with an on block
            lo, hi = (int(reach[0]), int(reach[-1]) + 1) if len(reach) else (0, len(mine))
            on, full = on[..., lo:hi, :], full[..., lo:hi, :]
            seg = None if self._seg is None else self._seg.to(device).long()
            bs = self.block_size
            mod = _GlobalMod(self.positions(self.rank, device)[lo * bs:hi * bs], self._positions(list(blocks), device),
                             self.seq_len, self._user_mod, self.causal, seg)
            mask = BlockMask(on.to(device), bs, (hi - lo) * bs, len(blocks) * bs, full=full.to(device), mask_mod=mod)
            return mask, slice(lo * bs, hi * bs)

        return self._cached(("mask", s, blocks, device), build)

    def expected_bytes(self, k: torch.Tensor, v: torch.Tensor, backward: bool = False) -> int:
        """Bytes this rank sends in one forward for local shards ``k``, ``v``: the blocks peers need from it;
        ``backward=True`` adds the backward's: those blocks again (fetched anew stage by stage) and the
        gradients of the blocks it received, sent back to their owners."""
        per_block = (k[:, :, :self.block_size].numel() * k.element_size()
                     + v[:, :, :self.block_size].numel() * v.element_size())
        me, w = self.rank, self.world_size
        sent = sum(len(self.needed[r][me]) for r in range(w) if r != me)
        if not backward:
            return sent * per_block
        got = sum(len(self.needed[me][s]) for s in range(w) if s != me)
        return (2 * sent + got) * per_block

    # ------------------------------------------------------------------ shard / unshard
    def _check_full(self, x, name):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a [batch, heads, seq_len, head_dim] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``[B, H, local_len, D]`` part of the full ``x [B, H, seq_len, D]`` (zero padded)."""
        self._check_full(x, "x")
        if x.shape[2] != self.seq_len:
            raise ValueError(f"x: the plan was built for seq_len={self.seq_len}, got x.shape[2]={x.shape[2]}")
        pos = self.positions(self.rank, x.device)
        xp = torch.nn.functional.pad(x, (0, 0, 0, self.padded_len - self.seq_len))
        return xp.index_select(2, pos)

    def unshard(self, o_l: torch.Tensor) -> torch.Tensor:
        """The full ``[B, H, seq_len, D]`` from every rank's ``o_l``; gradient: this rank's slice."""
        def local():
            self._check_local(o_l, "o_l")
            return [("o_l", o_l)], []

        _check_call(self, "Plan.unshard", local)
        return _Unshard.apply(o_l, self)

    def _check_local(self, x, name):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a [batch, heads, local_len, head_dim] tensor (plan.shard's output), "
                             f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.shape[2] != self.local_len:
            raise ValueError(f"{name}: this plan's shards hold local_len={self.local_len} tokens, got "
                             f"{name}.shape[2]={x.shape[2]} (a plan built for another length or group?)")
        if x.device.type != self.comm_device.type:
            raise ValueError(f"{name} is on {x.device}, but the group's backend communicates on "
                             f"{self.comm_device.type} tensors")


def _check_plan_args(seq_len, mask, causal, segment_ids, block_size):
    """The arguments of `plan` checked on this rank; returns ``segment_ids`` as ``[B, N]`` (or None)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if mask is not None:
        if not isinstance(mask, BlockMask):
            raise TypeError(f"mask must be a sparseflash.BlockMask or None, got {type(mask).__name__}")
        if (mask.seq_q, mask.seq_k) != (seq_len, seq_len):
            raise ValueError(f"mask was built for ({mask.seq_q}, {mask.seq_k}) tokens, expected ({seq_len}, {seq_len})")
        if mask.block_size != (block_size, block_size):
            raise ValueError(f"mask has block size {mask.block_size}; the plan's block_size={block_size} must match: "
                             f"build the mask with block_size={block_size}")
    if segment_ids is not None:
        if not isinstance(segment_ids, torch.Tensor) or segment_ids.dtype.is_floating_point \
                or segment_ids.dtype == torch.bool:
            raise TypeError(f"segment_ids must be an integer tensor [seq_len] or [batch, seq_len], got "
                            f"{getattr(segment_ids, 'dtype', type(segment_ids).__name__)}")
        if segment_ids.dim() == 1:
            segment_ids = segment_ids.unsqueeze(0)
        if segment_ids.dim() != 2 or segment_ids.shape[1] != seq_len:
            raise ValueError(f"segment_ids must have shape [seq_len] or [batch, seq_len] with seq_len={seq_len}, "
                             f"got {tuple(segment_ids.shape)}")
    return segment_ids


def plan(seq_len: int, group=None, mask: BlockMask | None = None, causal: bool = False, segment_ids=None,
         block_size: int = 128, stage_tokens: int = _STAGE_TOKENS) -> Plan:
    """Build (collectively: every rank of ``group`` calls it with the same arguments) the `Plan` of one
    sequence of ``seq_len`` tokens. ``group`` None: the default group. ``segment_ids``: integer ``[N]`` or
    ``[B, N]`` packed-document ids (pairs attend only within equal ids). ``stage_tokens``: the most key /
    value tokens one stage of the exchange moves (rounded down to whole blocks, at least one): it bounds
    the transfer buffers (module docstring, "Memory"). See the module docstring.

    Every rank's arguments (lengths, block size, causal, the digests of the mask, its ``mask_mod``
    included, and of the ids) and the plan it built are compared in one collective: if any rank's
    arguments fail its own checks, or the ranks' differ, every rank raises the same error."""
    if group is None:
        _group_info(None)
        group = dist.group.WORLD
    _group_info(group)  # (no group to talk on: this one raises alone)
    ctl = _control_group(group)
    built, error = None, None
    try:
        segment_ids = _check_plan_args(seq_len, mask, causal, segment_ids, block_size)
        if isinstance(stage_tokens, bool) or not isinstance(stage_tokens, int) or stage_tokens <= 0:
            raise ValueError(f"stage_tokens must be a positive int, got {stage_tokens!r}")
        built = Plan(seq_len, group, mask, causal, segment_ids, block_size, stage_tokens)
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks before it is raised
        error = e
    _agree(ctl, "sparseflash.distributed.plan", None if built is None else built._fields(), error)
    built.control = ctl
    return built


# ------------------------------------------------------------------ communication
def _post(plan: Plan, sends: list, recvs: list) -> list:
    """Post ``recvs`` (``(peer, tensor)`` pairs, filled in place) and ``sends`` in one batch; the works to wait on."""
    ops = [dist.P2POp(dist.irecv, t, plan.peer(p), plan.group) for p, t in recvs]
    for p, t in sends:
        ops.append(dist.P2POp(dist.isend, t, plan.peer(p), plan.group))
        plan.bytes_sent += t.numel() * t.element_size()
    return dist.batch_isend_irecv(ops) if ops else []


def _rows(x, r: slice):
    """Rows ``r`` of ``x [B, H, L, ...]`` for a stage's kernels: ``x`` itself when they are all its rows, else
    a contiguous copy (a stage that reaches a few rows copies a few)."""
    if x is None or (r.start == 0 and r.stop >= x.shape[2]):
        return x
    return x[:, :, r].contiguous()


def _take(x: torch.Tensor, idx) -> torch.Tensor:
    """Tokens ``idx`` (a slice: a view; else an index tensor: a copy) of ``x [B, H, N, D]``."""
    return x[:, :, idx] if isinstance(idx, slice) else x.index_select(2, idx)


def _add_at(acc: torch.Tensor, idx, x: torch.Tensor):
    """``acc[:, :, idx] += x`` in ``acc``'s dtype."""
    if isinstance(idx, slice):
        acc[:, :, idx] += x
    else:
        acc.index_add_(2, idx, x.to(acc.dtype))


class _Fetch:
    """One remote stage's key/value transfer in flight: this rank's chunk sent to the stage's ``dest``, the
    chunk it computes with received from its ``source``; `wait` gives the received (k, v) or None."""

    def __init__(self, plan: Plan, st, ops, k: torch.Tensor, v: torch.Tensor):
        sends, recvs, self.kv = [], [], None
        if st.dest is not None:  # (a copy of a chunk at most: the bounded send buffer)
            sends = [(st.dest, _take(k, ops.send).contiguous()), (st.dest, _take(v, ops.send).contiguous())]
        if st.source is not None:
            n = len(st.blocks) * plan.block_size
            self.kv = (k.new_empty(k.shape[0], k.shape[1], n, k.shape[3]),
                       v.new_empty(v.shape[0], v.shape[1], n, v.shape[3]))
            recvs = [(st.source, self.kv[0]), (st.source, self.kv[1])]
        self.sends = sends  # held until the works finish
        self.works = _post(plan, sends, recvs)

    def wait(self):
        for w in self.works:
            w.wait()
        self.sends = None
        return self.kv


class _Return:
    """One remote stage's gradient return in flight: dK, dV of the chunk computed here go back to its
    ``source``; those of this rank's chunk computed by ``dest`` arrive and are added where they belong."""

    def __init__(self, plan: Plan, st, ops, grads, k: torch.Tensor, v: torch.Tensor):
        sends, recvs, self.got, self.idx = [], [], None, ops.send
        if grads is not None:
            sends = [(st.source, grads[0].contiguous()), (st.source, grads[1].contiguous())]
        if st.dest is not None:
            n = len(st.send_blocks) * plan.block_size
            self.got = (k.new_empty(k.shape[0], k.shape[1], n, k.shape[3]),
                        v.new_empty(v.shape[0], v.shape[1], n, v.shape[3]))
            recvs = [(st.dest, self.got[0]), (st.dest, self.got[1])]
        self.sends = sends
        self.works = _post(plan, sends, recvs)

    def finish(self, dk: torch.Tensor, dv: torch.Tensor):
        for w in self.works:
            w.wait()
        self.sends = None
        if self.got is not None:
            _add_at(dk, self.idx, self.got[0])
            _add_at(dv, self.idx, self.got[1])


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_l, plan):
        ctx.plan = plan
        oc = o_l.contiguous()
        every = [torch.empty_like(oc) for _ in range(plan.world_size)]
        dist.all_gather(every, oc, group=plan.group)
        full = oc.new_empty(oc.shape[0], oc.shape[1], plan.padded_len, oc.shape[3])
        for r, part in enumerate(every):
            full.index_copy_(2, plan.positions(r, oc.device), part)
        return full[:, :, :plan.seq_len].clone()

    @staticmethod
    def backward(ctx, g):
        plan = ctx.plan
        gp = torch.nn.functional.pad(g, (0, 0, 0, plan.padded_len - plan.seq_len))
        return gp.index_select(2, plan.positions(plan.rank, g.device)), None


# ------------------------------------------------------------------ attention
class _Kernels:
    """One stage's attention: the forward (output and LSE within the stage: over its keys only) and the
    backward of the stage's keys given the *final* output and LSE, the identity a ring's backward rests on:
    with P = exp(S - LSE) the final probabilities and delta = rowsum(dO * O), dS = P * (dP - delta + dLSE)
    restricted to a stage's keys is that stage's share, so each stage's dQ, dK, dV add up to the whole.

    ``triton``: the kernels' forward and backward ops (`sparseflash.flash.autograd`), with the sub-mask's
    lists and bits (built once per mask and device); the backward takes the final (out, LSE) directly, and
    dropout's bits come back from the forward's draw. ``reference``: `sparseflash.attention` on the
    reference backend; its backward recomputes the stage and pulls the same gradients through the merge
    (dO_s = w dO, dLSE_s = w (rowsum(dO * O_s) - delta + dLSE), w = exp(LSE_s - LSE)), with dropout's
    bits regenerated from the stage's seed."""

    def __init__(self, backend: str, scale: float, dropout_p: float, q: torch.Tensor):
        from sparseflash.api import resolve_backend

        self.backend = resolve_backend(backend, q.device, q.dtype)
        self.scale, self.p = scale, float(dropout_p)
        self.seed = int(torch.randint(0, 1 << 62, (1,))) if self.p > 0 and self.backend == "reference" else 0

    def check(self, q: torch.Tensor):
        """What the kernels refuse, raised before any exchange."""
        if self.backend == "triton":
            from sparseflash.flash.autograd import check_runnable

            check_runnable(q)

    def fwd(self, q, k, v, mask, i: int, causal: bool = False):
        """(o [B, Hq, n, Dv] in q's dtype, lse float32 with -inf where no key of the stage is attended, state).
        ``causal``: plain causal attention (``mask`` None)."""
        if self.backend == "triton":
            from sparseflash.flash.autograd import exact_tables, flash_fwd_eager, mask_lists

            kv_idx, q_idx, bq, bk, density = mask_lists(mask, q.device)
            bits, kv_tile, q_tile = exact_tables(mask, True, q.device, kv_idx, q_idx, False)
            o, lse, rng = flash_fwd_eager(q, k, v, kv_idx, None, None, None, None, self.scale, causal, bq, bk,
                                          self.p, density, None, 0.0, bits, kv_tile, q_tile)
            return o, lse.masked_fill_(lse == math.inf, -math.inf), rng
        from sparseflash.api import attention as sparse_attention

        o, lse = sparse_attention(q, k, v, mask, causal=causal, scale=self.scale, dropout_p=self.p,
                                  generator=self._gen(q, i), return_lse=True, backend="reference")
        return o, lse, None

    def _gen(self, q, i):
        return torch.Generator(q.device).manual_seed(self.seed + i) if self.p > 0 else None

    def bwd(self, do, q, k, v, mask, out, lse, dlse, delta, state, i: int, causal: bool = False):
        """(dq, dk, dv) of the stage's keys. ``lse``: the final LSE (+inf where nothing is attended: the
        kernels' form, P = 0 there); ``delta``: rowsum(dO * O) (reference only); ``causal`` as in `fwd`."""
        if self.backend == "triton":
            from sparseflash.flash.autograd import exact_tables, flash_bwd_impl, mask_lists

            kv_idx, q_idx, bq, bk, density = mask_lists(mask, q.device)
            bits, kv_tile, q_tile = exact_tables(mask, True, q.device, kv_idx, q_idx, False)
            return flash_bwd_impl(do, q, k, v, out, lse, dlse, kv_idx, q_idx, None, state, None, None, self.scale,
                                  causal, bq, bk, self.p, density, None, 0.0, bits, kv_tile, q_tile)
        from sparseflash.api import attention as sparse_attention

        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            o_s, lse_s = sparse_attention(qq, kk, vv, mask, causal=causal, scale=self.scale, dropout_p=self.p,
                                          generator=self._gen(q, i), return_lse=True, backend="reference")
            some = torch.isfinite(lse) & torch.isfinite(lse_s)
            w = torch.where(some, torch.exp(lse_s.detach() - torch.where(some, lse, 0)), 0)
            g_lse = w * ((do * o_s.detach()).sum(-1, dtype=w.dtype) - delta + (0 if dlse is None else dlse))
            return torch.autograd.grad([o_s, lse_s], [qq, kk, vv], [(w[..., None] * do).to(o_s.dtype), g_lse])


def _merge_into(acc: torch.Tensor, lse: torch.Tensor, o_s: torch.Tensor, lse_s: torch.Tensor):
    """Fold one stage's (o_s, lse_s) into the running float32 (acc, lse) in place: both rescaled to their
    log-sum-exp; rows that see no key yet keep 0 / -inf (a finite pivot: never -inf - (-inf))."""
    new = torch.logaddexp(lse, lse_s)
    pivot = torch.where(torch.isfinite(new), new, 0)
    acc.mul_(torch.exp(lse - pivot)[..., None]).addcmul_(o_s, torch.exp(lse_s - pivot)[..., None])
    lse.copy_(new)


class _Attention(torch.autograd.Function):
    """The pipelined exchange and its backward (module docstring, "The exchange"); saves q, k, v, out, LSE."""

    @staticmethod
    def forward(ctx, q, k, v, plan, kern):
        own, remote = plan.stages()
        ops = plan.stage_ops(q.device)
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        acc = q.new_zeros((*q.shape[:3], v.shape[3]), dtype=acc_dtype)
        lse = torch.full(q.shape[:3], -math.inf, dtype=acc_dtype, device=q.device)
        states = {}

        def compute(i, ks, vs):
            r = ops[i].rows
            o_s, lse_s, states[i] = kern.fwd(_rows(q, r), ks, vs, ops[i].mask, i, causal=ops[i].causal)
            _merge_into(acc[:, :, r], lse[:, :, r], o_s, lse_s)

        fetch = _Fetch(plan, remote[0], ops[len(own)], k, v) if remote else None
        for i in range(len(own)):  # while the first remote chunk travels
            compute(i, _take(k, ops[i].keys), _take(v, ops[i].keys))
        for j in range(len(remote)):
            i = len(own) + j
            kv = fetch.wait()
            fetch = _Fetch(plan, remote[j + 1], ops[i + 1], k, v) if j + 1 < len(remote) else None
            if kv is not None:
                compute(i, *kv)
            del kv
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.kern, ctx.states = plan, kern, states
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, kern = ctx.plan, ctx.kern
        own, remote = plan.stages()
        ops = plan.stage_ops(q.device)
        do = torch.zeros_like(out) if dout is None else dout.contiguous()
        if dlse is not None:
            dlse = torch.where(torch.isfinite(lse), dlse, 0)
        if kern.backend == "triton":
            lse_k, delta = torch.where(torch.isfinite(lse), lse, math.inf).float(), None
        else:
            lse_k, delta = lse, (do * out).sum(-1, dtype=lse.dtype)
        acc_dtype = lse.dtype
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)

        def grads(i, ks, vs):
            r = ops[i].rows
            g = kern.bwd(_rows(do, r), _rows(q, r), ks, vs, ops[i].mask, _rows(out, r), _rows(lse_k, r),
                         _rows(dlse, r), _rows(delta, r), ctx.states[i], i, causal=ops[i].causal)
            dq[:, :, r] += g[0]
            return g[1], g[2]

        fetch = _Fetch(plan, remote[0], ops[len(own)], k, v) if remote else None
        for i in range(len(own)):
            gk, gv = grads(i, _take(k, ops[i].keys), _take(v, ops[i].keys))
            _add_at(dk, ops[i].keys, gk)
            _add_at(dv, ops[i].keys, gv)
        back = None
        for j, st in enumerate(remote):
            i = len(own) + j
            kv = fetch.wait()
            fetch = _Fetch(plan, remote[j + 1], ops[i + 1], k, v) if j + 1 < len(remote) else None
            g = None if kv is None else grads(i, *kv)
            del kv
            nxt = _Return(plan, st, ops[i], g, k, v)
            if back is not None:  # the previous stage's gradients travelled while this one computed
                back.finish(dk, dv)
            back = nxt
        if back is not None:
            back.finish(dk, dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def attention(q_l: torch.Tensor, k_l: torch.Tensor, v_l: torch.Tensor, plan: Plan, *, dropout_p: float = 0.0,
              scale: float | None = None, return_lse: bool = False, backend: str = "auto"):
    """Context-parallel `sparseflash.attention` of this rank's shards (``plan.shard`` outputs, GQA allowed).

    Every rank of ``plan.group`` must call it (and its backward). Returns this rank's ``o_l [B, H,
    local_len, D]`` (and the LSE ``[B, H, local_len]``, float32, -inf where nothing is attended, with
    ``return_lse``); padding rows are 0.
    """
    kern = None

    def local():
        nonlocal kern
        if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p <= 1.0:
            raise ValueError(f"dropout_p must be a float in [0, 1], got {dropout_p!r}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"scale must be a finite float > 0 or None, got {scale!r}")
        if backend not in ("auto", "triton", "reference"):
            raise ValueError(f"backend must be one of ('auto', 'triton', 'reference'), got {backend!r}")
        for name, x in (("q_l", q_l), ("k_l", k_l), ("v_l", v_l)):
            plan._check_local(x, name)
            if x.dtype not in _DTYPES:
                raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), "
                                f"got {x.dtype}")
        if not (q_l.dtype == k_l.dtype == v_l.dtype):
            raise TypeError(f"q_l, k_l and v_l must share one dtype, got {q_l.dtype}, {k_l.dtype}, {v_l.dtype}")
        if not (q_l.device == k_l.device == v_l.device):
            raise ValueError(f"q_l, k_l, v_l must be on one device, got {q_l.device}, {k_l.device}, {v_l.device}")
        if k_l.shape != v_l.shape or q_l.shape[0] != k_l.shape[0] or q_l.shape[3] != k_l.shape[3] \
                or q_l.shape[1] % k_l.shape[1]:
            raise ValueError(f"k_l and v_l must have one shape [batch, heads_kv, local_len, head_dim] with q_l's "
                             f"batch and head_dim and heads_q a multiple of heads_kv: got q_l {tuple(q_l.shape)}, "
                             f"k_l {tuple(k_l.shape)}, v_l {tuple(v_l.shape)}")
        kern = _Kernels(backend, 1.0 / math.sqrt(q_l.shape[3]) if scale is None else float(scale), dropout_p, q_l)
        kern.check(q_l)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_l, k_l, v_l))
        return [("q_l", q_l), ("k_l", k_l), ("v_l", v_l)], [
            ("dropout_p", "float", _float_code(dropout_p)),
            ("scale", "float", _float_code(math.nan if scale is None else scale)),
            ("gradient (a backward will follow)", "bool", int(grad))]

    _check_call(plan, "sparseflash.distributed.attention", local)
    o, lse = _Attention.apply(q_l, k_l, v_l, plan, kern)
    return (o, lse) if return_lse else o
