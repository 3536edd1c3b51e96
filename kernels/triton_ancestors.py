"""Tree ancestors as bit words (Triton), with its launcher: the mask a tree's queries
apply to the tree's own keys, computed once per fixed-shape verify forward so that
each layer's attention (kernels/triton_tree_attention.py) reads it instead of walking
parents up. Semantics: ``treespec.kernels.reference.tree_ancestors``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treespec.kernels.triton_common import (INDEX_DTYPES, check_devices, check_dtype, check_shape,
                                   launch_options, next_pow2, pdl_enter, vmax)


@triton.jit
def _tree_ancestors_kernel(par_ptr, out_ptr, t_len, W: tl.constexpr, BLOCK_W: tl.constexpr,
                           BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """One program per (chunk, BLOCK_R queries): walk each query's parents up once,
    setting bit (a % 64) of word (a // 64) for every non-padding ancestor a (for a
    BLOCK row, every other non-padding query)."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < t_len
    par_chunk = par_ptr + b.to(tl.int64) * t_len
    p = tl.load(par_chunk + r, mask=r_ok, other=-1)
    w = tl.arange(0, BLOCK_W)
    words = tl.full([BLOCK_R, BLOCK_W], 0, dtype=tl.int64)
    one = tl.full([BLOCK_R], 1, dtype=tl.int64)
    steps = t_len * 0
    block = p == -3                        # a BLOCK row: every other non-padding query
    if vmax(block.to(tl.int32), 0) > 0:
        for j in range(0, t_len):
            pj = tl.load(par_chunk + j)
            hit = block & (pj != -2) & (r != j)
            bit = tl.where(hit, one << (j % 64), 0)
            words = words | tl.where(w[None, :] == j // 64, bit[:, None], 0)
    while (vmax(p, 0) >= 0) & (steps < t_len):
        up = p >= 0
        pp = tl.load(par_chunk + p, mask=up, other=-1)
        hit = up & (pp != -2)
        bit = tl.where(hit, one << (tl.where(up, p, 0) % 64).to(tl.int64), 0)
        words = words | tl.where(w[None, :] == (p // 64)[:, None], bit[:, None], 0)
        p = tl.where(up, pp, -1)
        steps += 1
    row = (b.to(tl.int64) * t_len + r)[:, None]
    tl.store(out_ptr + row * W + w[None, :], words, mask=r_ok[:, None] & (w[None, :] < W))


def tree_ancestors(chunk_parents: torch.Tensor) -> torch.Tensor:
    """See treespec.kernels.reference.tree_ancestors."""
    where = "tree_ancestors"
    check_devices(_tree_ancestors_kernel, where, chunk_parents=chunk_parents)
    check_dtype(where, "chunk_parents", chunk_parents, INDEX_DTYPES)
    check_shape(where, "chunk_parents", chunk_parents, (None, None))
    b, t = chunk_parents.shape
    w = triton.cdiv(t, 64)
    out = torch.empty((b * t, w), dtype=torch.int64, device=chunk_parents.device)
    if b * t == 0:
        return out
    block_r = min(64, next_pow2(t))
    _tree_ancestors_kernel[(b, triton.cdiv(t, block_r))](
        chunk_parents.contiguous(), out, t, W=w, BLOCK_W=next_pow2(w), BLOCK_R=block_r,
        num_warps=4, **launch_options(_tree_ancestors_kernel, chunk_parents.device))
    return out


__all__ = ["tree_ancestors"]
