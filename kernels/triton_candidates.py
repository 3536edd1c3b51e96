"""A drafter's scores of its candidates in one kernel (Triton): what
common.sampling.draft_scores computes after the top-W selection, for a batch whose
drawing rows all filter by top-k within W (Qwen3's default top-k 20 among 64).

One program per row holds the row's W candidates (sorted descending, logits / T) in
registers and applies top-k, top-p and min-p, takes the filtered log-probs, the
rejection rows' q (the first Q, renormalised), the Gumbel noise of (seed, position,
target id) and the picks; a greedy row gets its log-softmax (logits minus their
logsumexp over the vocabulary, given). On the H200 the same in torch is ~40 small
kernels a call, four calls a chain4 step. The torch path of draft_scores is the
reference; the noise is hashed as kernels/noise.py does (log in float32 on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_dtype,
                                   check_shape, next_pow2, vcumsum, vmax, vsum)
from kernels.triton_noise import mix32, uniform

MAX_WIDTH = 256             # candidates a row that one program holds


@triton.jit
def _candidates_kernel(x_ptr, col_ptr, lse_ptr, t_ptr, k_ptr, p_ptr, minp_ptr, seed_ptr,
                       pos_ptr, rej_ptr, ids_ptr, lp_ptr, pick_ptr, qid_ptr, qp_ptr, w, q,
                       HAS_IDS: tl.constexpr, BLOCK_W: tl.constexpr):
    r = tl.program_id(0)
    rank = tl.arange(0, BLOCK_W)
    inside = rank < w
    x = tl.load(x_ptr + r * w + rank, mask=inside, other=float("-inf"))
    cols = tl.load(col_ptr + r * w + rank, mask=inside, other=0).to(tl.int64)
    temp = tl.load(t_ptr + r)
    top_k = tl.load(k_ptr + r)
    rej = (tl.load(rej_ptr + r) != 0) & (temp > 0)
    first = vmax(x, 0)                                       # the row's best (sorted)
    keep = inside & ((top_k <= 0) | (rank < top_k))                            # top-k
    e = tl.where(keep, tl.exp(x - first), 0.0)
    probs = e / vsum(e, 0)
    keep = keep & ((vcumsum(probs, 0) - probs < tl.load(p_ptr + r)) | (rank == 0))  # top-p
    keep = keep & (x - first >= tl.log(tl.load(minp_ptr + r)))                 # min-p
    e = tl.where(keep, tl.exp(x - first), 0.0)
    kept = tl.where(keep, x - first - tl.log(vsum(e, 0)), float("-inf"))     # log-probs
    in_q = rank < q
    eq = tl.where(in_q & keep, tl.exp(kept - vmax(tl.where(in_q, kept, float("-inf")), 0)), 0.0)
    top = tl.where(in_q & keep, kept - vmax(tl.where(in_q, kept, float("-inf")), 0)
                   - tl.log(vsum(eq, 0)), float("-inf"))                     # q's log-probs
    base = tl.where(rej, top, kept)
    if HAS_IDS:
        tid = tl.load(ids_ptr + cols, mask=inside, other=0).to(tl.int64)
    else:
        tid = cols
    key = mix32(mix32(tl.load(seed_ptr + r).to(tl.int64)) ^ tl.load(pos_ptr + r).to(tl.int64))
    pick = base - tl.log(-tl.log(uniform(key, tid)))
    greedy = x - tl.load(lse_ptr + r)                        # T 0: x is the raw logits
    sampled = temp > 0
    tl.store(lp_ptr + r * w + rank, tl.where(sampled, base, greedy), mask=inside)
    tl.store(pick_ptr + r * w + rank, tl.where(sampled, pick, greedy), mask=inside)
    tl.store(qid_ptr + r * q + rank, tl.where(rej, tid, 0).to(tl.int32), mask=in_q)
    tl.store(qp_ptr + r * q + rank, tl.where(rej, tl.exp(top), 0.0), mask=in_q)


def score_candidates(x: torch.Tensor, cols: torch.Tensor, lse: torch.Tensor,
                     temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
                     rejection: torch.Tensor, q: int, ids: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, ...]:
    """x [R, W] float32: each row's W largest logits / T (T 1 for a greedy row), sorted
    descending, cols [R, W] their columns, lse [R] the logsumexp of the row's raw
    logits; per-row parameters [R]; q the rejection rows' q width (<= W); ids [V] the
    target ids of the columns (None: the columns are) -> draft_scores' (log-probs,
    picks, columns, q_ids, q_probs)."""
    where = "score_candidates"
    r, w = x.shape
    if not 0 < q <= w <= MAX_WIDTH:
        raise ValueError(f"{where}: need 0 < q <= W <= {MAX_WIDTH}, got q {q}, W {w}")
    check_dtype(where, "x", x, FLOAT_DTYPES)
    check_shape(where, "cols", cols, (r, w))
    rows = {"lse": lse, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "min_p": min_p, "seed": seed, "position": position, "rejection": rejection}
    for name, t in rows.items():
        check_shape(where, name, t, (r,))
    for name, t in (("cols", cols), ("top_k", top_k), ("seed", seed), ("position", position)):
        check_dtype(where, name, t, INDEX_DTYPES)
    if ids is not None:
        check_dtype(where, "ids", ids, INDEX_DTYPES)
    check_devices(_candidates_kernel, where, x=x, cols=cols, **rows)
    dev = x.device
    lp = torch.empty(r, w, dtype=torch.float32, device=dev)
    pick = torch.empty_like(lp)
    q_ids = torch.empty(r, q, dtype=torch.int32, device=dev)
    q_probs = torch.empty(r, q, dtype=torch.float32, device=dev)
    if r:
        args = [t.contiguous() for t in (x.float(), cols, lse.float(), temperature.float(),
                                          top_k, top_p.float(), min_p.float(), seed, position)]
        _candidates_kernel[(r,)](*args, rejection.to(torch.int8).contiguous(),
                                 cols if ids is None else ids.contiguous(), lp, pick, q_ids,
                                 q_probs, w, q, HAS_IDS=ids is not None,
                                 BLOCK_W=max(16, next_pow2(w)), num_warps=2)
    return lp, pick, cols, q_ids, q_probs
