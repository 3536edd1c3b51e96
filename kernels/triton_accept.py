"""The greedy accept walk on the device (Triton), with its launcher.

One program per sequence holds the whole tree (N <= a few hundred nodes) in
registers and walks it from the root exactly as ``treespec.kernels.reference.accept_greedy``:
at each level, the lowest-index node whose parent is the current node and whose
draft token equals the target's choice there becomes the current node.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treespec.kernels.triton_common import (INDEX_DTYPES, check_devices, check_dtype, check_shape, next_pow2,
                                   vmin)


@triton.jit
def _accept_greedy_kernel(tok_ptr, par_ptr, tgt_ptr, acc_ptr, num_ptr, bonus_ptr,
                          n, max_depth, s_tok, s_par, s_tgt, s_acc,
                          BLOCK_N: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    live = i < n
    tok = tl.load(tok_ptr + b * s_tok + i, mask=live, other=0)
    par = tl.load(par_ptr + b * s_par + i, mask=live, other=-3)
    cur = tl.program_id(0) * 0 - 1           # -1 = the root
    found_all = cur < 0
    num = cur * 0
    for d in range(max_depth):
        want = tl.load(tgt_ptr + b * s_tgt + (cur + 1))
        match = live & (par == cur) & (tok == want) & found_all
        first = vmin(tl.where(match, i, BLOCK_N), axis=0)
        found = first < BLOCK_N
        tl.store(acc_ptr + b * s_acc + d, tl.where(found, first, -1))
        num += found.to(tl.int32)
        cur = tl.where(found, first, cur)
        found_all = found_all & found
    tl.store(num_ptr + b, num)
    tl.store(bonus_ptr + b, tl.load(tgt_ptr + b * s_tgt + (cur + 1)))


def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor,
                  target_ids: torch.Tensor, max_depth: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The greedy accept walk over a batch of trees (see treespec.kernels.reference).

    tokens, parents [B, N]; target_ids [B, N + 1]. Returns accepted
    [B, max_depth] int32 (padded with -1), num_accepted [B] int32 and bonus [B]
    in target_ids' dtype.
    """
    where = "accept_greedy"
    check_devices(_accept_greedy_kernel, where, tokens=tokens, parents=parents,
                  target_ids=target_ids)
    for name, t in (("tokens", tokens), ("parents", parents), ("target_ids", target_ids)):
        check_dtype(where, name, t, INDEX_DTYPES)
    check_shape(where, "tokens", tokens, (None, None))
    b, n = tokens.shape
    check_shape(where, "parents", parents, (b, n))
    check_shape(where, "target_ids", target_ids, (b, n + 1))
    if max_depth < 0:
        raise ValueError(f"{where}: max_depth must be >= 0, got {max_depth}")
    dev = tokens.device
    accepted = torch.full((b, max_depth), -1, dtype=torch.int32, device=dev)
    num = torch.zeros(b, dtype=torch.int32, device=dev)
    bonus = torch.empty(b, dtype=target_ids.dtype, device=dev)
    if b == 0:
        return accepted, num, bonus
    tokens, parents, target_ids = (t.contiguous() for t in (tokens, parents, target_ids))
    _accept_greedy_kernel[(b,)](
        tokens, parents, target_ids, accepted, num, bonus, n, max_depth,
        tokens.stride(0), parents.stride(0), target_ids.stride(0), max(1, max_depth),
        BLOCK_N=max(16, next_pow2(n)), num_warps=1)
    return accepted, num, bonus
