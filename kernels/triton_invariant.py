"""The Triton backend in its batch-invariant mode (issue 53): the functions of
``treespec.kernels.dispatch.KERNEL_NAMES`` as ``treespec.kernels.triton_backend``'s, except
that every linear, whatever its row count, runs the Triton GEMM with one K order
(``triton_gemv``'s ``invariant``): no switch of tiles by row class, no GEMM library past
16 rows, no split-K. A bias is added after the product (row-wise).

Not yet invariant here: the tree attention plans its context split by the batch's
program count and reads a tree's chunk keys in chunk order (bench/NOTES.md, issue 53);
the CPU reference (``treespec.kernels.reference``) is invariant throughout."""

from __future__ import annotations

import torch

from treespec.kernels import triton_gemv
from treespec.kernels.triton_backend import (accept_greedy, add_rms_norm, compact_kv,
                                             paged_tree_attention, qk_norm_rope_write,
                                             rejection_walk, rms_norm, silu_mul,
                                             tree_ancestors, vocab_stats, write_kv)


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


def linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """See treespec.kernels.reference.linear_silu_mul; one K order for every row count."""
    return triton_gemv.linear_silu_mul(x.contiguous(), gate_up, invariant=True)


__all__ = ["write_kv", "paged_tree_attention", "tree_ancestors", "accept_greedy",
           "rejection_walk", "compact_kv",
           "rms_norm", "add_rms_norm", "qk_norm_rope_write", "silu_mul", "linear",
           "linear_silu_mul", "vocab_stats"]
