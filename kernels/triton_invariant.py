"""The Triton backend in its batch-invariant mode (issue 53): the functions of
``treespec.kernels.dispatch.KERNEL_NAMES`` as ``treespec.kernels.triton_backend``'s, except
that every linear, whatever its row count, runs the Triton GEMM with one K order
(``triton_gemv``'s ``invariant``): no switch of tiles by row class, no GEMM library past
16 rows, no split-K. A bias is added after the product (row-wise). The tree attention
runs ``triton_tree_attention``'s invariant mode: each row's keys in position order (a
tree node's ancestors by depth after the context), in fixed tiles and key chunks from
position 0, folded in order.

The CPU reference (``treespec.kernels.reference``) is invariant throughout."""

from __future__ import annotations

import torch

from treespec.kernels import triton_gemv
from treespec.kernels.triton_backend import (accept_greedy, add_rms_norm, compact_kv,
                                             qk_norm_rope_write, rejection_walk, rms_norm,
                                             silu_mul, tree_ancestors, vocab_stats, write_kv)
from treespec.kernels.triton_tree_attention import paged_tree_attention as _paged_tree_attention


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """See treespec.kernels.reference.linear; one K order for every row count."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    y = triton_gemv.linear(flat, weight, invariant=True)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], -1)


def paged_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         cu_q: torch.Tensor, chunk_parents: torch.Tensor,
                         scale: float, ancestors: torch.Tensor | None = None) -> torch.Tensor:
    """See treespec.kernels.reference.paged_tree_attention; a row's bits depend on its
    query and the keys it sees only (ancestors, a speed hint, is not used)."""
    return _paged_tree_attention(q, k_cache, v_cache, block_tables, context_lens, cu_q,
                                 chunk_parents, scale, invariant=True)


def linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """See treespec.kernels.reference.linear_silu_mul; one K order for every row count."""
    return triton_gemv.linear_silu_mul(x.contiguous(), gate_up, invariant=True)


__all__ = ["write_kv", "paged_tree_attention", "tree_ancestors", "accept_greedy",
           "rejection_walk", "compact_kv",
           "rms_norm", "add_rms_norm", "qk_norm_rope_write", "silu_mul", "linear",
           "linear_silu_mul", "vocab_stats"]
