"""Sampling over a row's top-W candidates in one kernel (Triton), for a batch whose
drawing rows all filter by top-k within W (Qwen3's default top-k 20 among 64):

* ``score_candidates``: what treespec.common.spec.sampling.draft_scores computes after the top-W
  selection: a drafter's filtered log-probs, the rejection rows' q (the first Q,
  renormalised), the Gumbel noise of (seed, position, target id) and the picks; a
  greedy row gets its log-softmax (logits minus their logsumexp, given);
* ``filter_draw``: what treespec.common.spec.sampling.filter_draw computes after it: the
  filtered values and the drawn token (the verify's draw at every node).

One program per row holds its W candidates (sorted descending, logits / T) in
registers and applies top-k, top-p and min-p. On the H200 the same in torch is ~40
small kernels a call (a drafter calls it once a level). The torch paths in
common/spec/sampling.py are the reference; the noise is hashed as kernels/noise.py does,
its logs taken in float32 on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treespec.kernels.triton_common import (FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_dtype,
                                   check_shape, next_pow2, vcumsum, vmax, vmin, vsum)
from treespec.kernels.triton_noise import mix32, uniform

MAX_WIDTH = 256             # candidates a row that one program holds


@triton.jit
def _filter(x, rank, inside, top_k, top_p, min_p):
    """Which of a row's candidates x (sorted descending, logits / T; -inf past W)
    survive top-k, top-p and min-p (treespec.common.spec.sampling.filter_sparse), and the largest."""
    first = vmax(x, 0)
    keep = inside & ((top_k <= 0) | (rank < top_k))                            # top-k
    e = tl.where(keep, tl.exp(x - first), 0.0)
    probs = e / vsum(e, 0)
    keep = keep & ((vcumsum(probs, 0) - probs < top_p) | (rank == 0))          # top-p
    return keep & (x - first >= tl.log(min_p)), first                         # min-p


@triton.jit
def _gumbel(seed, pos, ids):
    """treespec.kernels.noise.gumbel_noise of ids for the row keyed (seed, pos)."""
    return -tl.log(-tl.log(uniform(mix32(mix32(seed.to(tl.int64)) ^ pos.to(tl.int64)), ids)))


@triton.jit
def _draw_kernel(x_ptr, col_ptr, t_ptr, k_ptr, p_ptr, minp_ptr, seed_ptr, pos_ptr,
                 vals_ptr, tok_ptr, w, BLOCK_W: tl.constexpr):
    r = tl.program_id(0)
    rank = tl.arange(0, BLOCK_W)
    inside = rank < w
    x = tl.load(x_ptr + r * w + rank, mask=inside, other=float("-inf"))
    cols = tl.load(col_ptr + r * w + rank, mask=inside, other=0).to(tl.int64)
    keep, _ = _filter(x, rank, inside, tl.load(k_ptr + r), tl.load(p_ptr + r),
                      tl.load(minp_ptr + r))
    vals = tl.where(keep, x, float("-inf"))
    tl.store(vals_ptr + r * w + rank, vals, mask=inside)
    pick = tl.where(keep, vals + _gumbel(tl.load(seed_ptr + r), tl.load(pos_ptr + r), cols),
                    float("-inf"))
    best = vmax(pick, 0)
    at = vmin(tl.where(pick == best, rank, BLOCK_W), 0)          # the first, as argmax
    tok = vsum(tl.where(rank == at, cols, 0), 0)
    tl.store(tok_ptr + r, tl.where(tl.load(t_ptr + r) > 0, tok, -1))


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
    keep, first = _filter(x, rank, inside, top_k, tl.load(p_ptr + r), tl.load(minp_ptr + r))
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
    pick = base + _gumbel(tl.load(seed_ptr + r), tl.load(pos_ptr + r), tid)
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
    r, w = _check("score_candidates", _candidates_kernel, x, cols, q, lse=lse,
                  temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                  position=position, rejection=rejection)
    if ids is not None:
        check_dtype("score_candidates", "ids", ids, INDEX_DTYPES)
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


def filter_draw(x: torch.Tensor, cols: torch.Tensor, temperature: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                seed: torch.Tensor, position: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, cols as for score_candidates; per-row parameters [R] -> treespec.common.spec.sampling's
    filter_sparse (values [R, W], cols) and each drawing row's token [R] int64 (-1
    where T is 0: the caller takes the argmax of the logits)."""
    r, w = _check("filter_draw", _draw_kernel, x, cols, 1, temperature=temperature,
                  top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, position=position)
    vals = torch.empty(r, w, dtype=torch.float32, device=x.device)
    tokens = torch.empty(r, dtype=torch.int64, device=x.device)
    if r:
        args = [t.contiguous() for t in (x.float(), cols, temperature.float(), top_k,
                                          top_p.float(), min_p.float(), seed, position)]
        _draw_kernel[(r,)](*args, vals, tokens, w, BLOCK_W=max(16, next_pow2(w)), num_warps=2)
    return vals, cols, tokens


def _check(where: str, kernel, x: torch.Tensor, cols: torch.Tensor, q: int,
           **rows: torch.Tensor) -> tuple[int, int]:
    """A launcher's arguments: x [R, W] float and cols [R, W] ids (0 < q <= W <=
    MAX_WIDTH), per-row tensors [R] (top_k, seed, position ids), one device -> (R, W)."""
    r, w = x.shape
    if not 0 < q <= w <= MAX_WIDTH:
        raise ValueError(f"{where}: need 0 < q <= W <= {MAX_WIDTH}, got q {q}, W {w}")
    check_dtype(where, "x", x, FLOAT_DTYPES)
    check_shape(where, "cols", cols, (r, w))
    for name, t in rows.items():
        check_shape(where, name, t, (r,))
    for name in ("top_k", "seed", "position"):
        check_dtype(where, name, rows[name], INDEX_DTYPES)
    check_dtype(where, "cols", cols, INDEX_DTYPES)
    check_devices(kernel, where, x=x, cols=cols, **rows)
    return r, w
