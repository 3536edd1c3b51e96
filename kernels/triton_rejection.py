"""Recursive rejection sampling over trees on the device (Triton), with its launcher.

One program per sequence walks its tree from the root exactly as
``treespec.kernels.reference.rejection_walk`` does, for a target distribution that is sparse:
its W candidates (a top-k selection, W <= 64 as the verify step makes it) and a q of
Q ids per node stay in registers, so a whole walk of depth D with S siblings tried
per node is D x S vector steps in one kernel instead of hundreds of small ones over
the vocabulary; the uniforms and the bonus's Gumbel noise are hashed in it, the same
integers as kernels/noise.py. A dense target distribution takes the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treespec.kernels.noise import ACCEPT_SALT, BONUS_SALT
from treespec.kernels.triton_common import (INDEX_DTYPES, check_devices, check_dtype, check_shape,
                                   next_pow2, vcumsum, vmax, vmin, vsum)
from treespec.kernels.triton_noise import mix32, uniform


@triton.jit
def _rejection_walk_kernel(tok_ptr, par_ptr, p_ptr, pid_ptr, qid_ptr, qp_ptr, seed_ptr, pos_ptr,
                           acc_ptr, num_ptr, bonus_ptr, n, w, q,
                           ACCEPT: tl.constexpr, BONUS: tl.constexpr,
                           MAX_DEPTH: tl.constexpr, SIBLINGS: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                           BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + b).to(tl.int64)
    t = n + 1
    i = tl.arange(0, BLOCK_N)
    cw = tl.arange(0, BLOCK_W)
    cq = tl.arange(0, BLOCK_Q)
    cs = tl.arange(0, BLOCK_S)
    live_w, live_q = cw < w, cq < q
    tok = tl.load(tok_ptr + b * n + i, mask=i < n, other=-1).to(tl.int64)
    par = tl.load(par_ptr + b * n + i, mask=i < n, other=-3)
    cur = tl.program_id(0) * 0 - 1                     # -1 = the root
    alive = cur < 0
    num = cur * 0
    bonus = (cur * 0).to(tl.int64)
    for d in tl.static_range(MAX_DEPTH + 1):
        row = b * t + (cur + 1)                        # [root, nodes] row of the step
        r = tl.load(p_ptr + row * w + cw, mask=live_w, other=0.0).to(tl.float32)
        ids = tl.load(pid_ptr + row * w + cw, mask=live_w, other=-1).to(tl.int64)
        pos = tl.load(pos_ptr + row).to(tl.int64)
        mass = vsum(r, 0)
        found = cur < -1                               # False
        nxt = cur
        if d < MAX_DEPTH:
            kids = (par == cur) & alive
            rank = vcumsum(kids.to(tl.int32), 0) - 1
            rejected = tl.full([BLOCK_S], -1, tl.int64)
            for j in tl.static_range(SIBLINGS):
                idx = vmin(tl.where(kids & (rank == j), i, BLOCK_N), 0)
                has = (idx < BLOCK_N) & ~found
                idx = tl.minimum(idx, n - 1)
                x = vsum(tl.where(i == idx, tok, 0), 0)
                at = (b * n + idx) * q + cq
                qi = tl.load(qid_ptr + at, mask=live_q, other=-1).to(tl.int64)
                qp = tl.maximum(tl.load(qp_ptr + at, mask=live_q, other=0.0).to(tl.float32), 0.0)
                gone = vsum(tl.where(qi[:, None] == rejected[None, :], 1, 0), 1) > 0
                qp = tl.where(gone, 0.0, qp)
                qp = qp / tl.maximum(vsum(qp, 0), 1e-30)
                qx = vsum(tl.where(qi == x, qp, 0.0), 0)
                px = vsum(tl.where(ids == x, r, 0.0), 0) / tl.maximum(mass, 1e-30)
                uj = uniform(mix32(mix32(seed ^ ACCEPT) ^ pos), j)
                ok = has & (qx > 0) & (uj * qx < px)
                found = found | ok
                nxt = tl.where(ok, idx, nxt)
                off = has & (~ok) & (qx > 0)           # a node outside its q: skipped
                match = (qi[:, None] == ids[None, :]) & live_w[None, :]          # [Q, W]
                r_at = vsum(tl.where(match, r[None, :], 0.0), 1)                 # [Q]
                cut = tl.where(off, tl.minimum(r_at, mass * qp), 0.0)
                r = r - vsum(tl.where(match, cut[:, None], 0.0), 0)
                mass = mass - vsum(cut, 0)
                rejected = tl.where((cs == j) & off, x, rejected)
            tl.store(acc_ptr + b * MAX_DEPTH + d, tl.where(found, nxt, -1))
        stop = alive & ~found
        noise = -tl.log(-tl.log(uniform(mix32(mix32(seed ^ BONUS) ^ pos), ids)))
        left = tl.where(live_w, tl.log(tl.maximum(r, 0.0)) + noise, float("-inf"))
        best = vmax(left, 0)
        first = vmin(tl.where(left == best, cw, BLOCK_W), 0)
        pick = vsum(tl.where(cw == first, ids, 0), 0)
        bonus = tl.where(stop, pick, bonus)
        num += found.to(tl.int32)
        cur = nxt
        alive = alive & found
    tl.store(num_ptr + b, num)
    tl.store(bonus_ptr + b, bonus)


def rejection_walk(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor,
                   p_ids: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
                   seed: torch.Tensor, position: torch.Tensor, max_depth: int, siblings: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See treespec.kernels.reference.rejection_walk; p_ids must be given (a sparse p)."""
    where = "rejection_walk"
    check_devices(_rejection_walk_kernel, where, tokens=tokens, parents=parents, probs=probs,
                  p_ids=p_ids, q_ids=q_ids, q_probs=q_probs, seed=seed, position=position)
    for name, x in (("tokens", tokens), ("parents", parents), ("p_ids", p_ids),
                    ("q_ids", q_ids), ("seed", seed), ("position", position)):
        check_dtype(where, name, x, INDEX_DTYPES)
    b, n = tokens.shape
    t, w = n + 1, probs.shape[-1]
    check_shape(where, "parents", parents, (b, n))
    check_shape(where, "probs", probs, (b, t, w))
    check_shape(where, "p_ids", p_ids, (b, t, w))
    check_shape(where, "q_ids", q_ids, (b, n, None))
    check_shape(where, "q_probs", q_probs, tuple(q_ids.shape))
    check_shape(where, "seed", seed, (b,))
    check_shape(where, "position", position, (b, t))
    dev = tokens.device
    accepted = torch.full((b, max_depth), -1, dtype=torch.int32, device=dev)
    num = torch.zeros(b, dtype=torch.int32, device=dev)
    bonus = torch.zeros(b, dtype=torch.int64, device=dev)
    if b == 0 or n == 0:
        return accepted, num, bonus
    qw = q_ids.shape[-1]
    args = [x.contiguous() for x in (tokens, parents, probs, p_ids, q_ids, q_probs, seed,
                                     position)]
    _rejection_walk_kernel[(b,)](
        *args, accepted, num, bonus, n, w, qw, ACCEPT=ACCEPT_SALT, BONUS=BONUS_SALT,
        MAX_DEPTH=max_depth, SIBLINGS=siblings, BLOCK_N=max(16, next_pow2(n)),
        BLOCK_W=max(16, next_pow2(w)), BLOCK_Q=max(16, next_pow2(qw)),
        BLOCK_S=max(2, next_pow2(siblings)), num_warps=2)
    return accepted, num, bonus
