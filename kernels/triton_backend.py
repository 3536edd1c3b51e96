"""The Triton backend: the functions of ``treespec.kernels.dispatch.KERNEL_NAMES``, with the
signatures and semantics of ``treespec.kernels.reference``. Each kernel lives in its own
module beside its launcher; this module only gathers them."""

from __future__ import annotations

import torch

from treespec.kernels import reference, triton_gemv, triton_rejection
from treespec.kernels.triton_accept import accept_greedy
from treespec.kernels.triton_fused import add_rms_norm, qk_norm_rope_write, rms_norm, silu_mul
from treespec.kernels.triton_kv import compact_kv, write_kv
from treespec.kernels.triton_tree_attention import paged_tree_attention as _paged_tree_attention
from treespec.kernels.triton_ancestors import tree_ancestors
from treespec.kernels.triton_vocab import vocab_stats

_SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def _skinny(x: torch.Tensor, w: torch.Tensor, silu: bool,
            bias: torch.Tensor | None = None) -> bool:
    """A decode / verify-sized product in 16 bits: the Triton GEMV (reads the weight
    once at ~4 TB/s and fuses SwiGLU); anything else goes to the GEMM library."""
    n = w.shape[0] // 2 if silu else w.shape[0]
    return (bias is None and x.dim() == 2 and x.dtype in _SKINNY_DTYPES
            and x.stride(1) == 1 and triton_gemv.supports(x.shape[0], n, x.shape[1], silu))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """See treespec.kernels.reference.linear."""
    if _skinny(x, weight, False, bias):
        return triton_gemv.linear(x, weight)
    return reference.linear(x, weight, bias)


def linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """See treespec.kernels.reference.linear_silu_mul."""
    if _skinny(x, gate_up, True):
        return triton_gemv.linear_silu_mul(x, gate_up)
    return silu_mul(reference.linear(x, gate_up))


def paged_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         cu_q: torch.Tensor, chunk_parents: torch.Tensor,
                         scale: float, ancestors: torch.Tensor | None = None) -> torch.Tensor:
    """See treespec.kernels.reference.paged_tree_attention."""
    return _paged_tree_attention(q, k_cache, v_cache, block_tables, context_lens, cu_q,
                                 chunk_parents, scale, ancestors)


def rejection_walk(tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor,
                   p_ids: torch.Tensor | None, q_ids: torch.Tensor, q_probs: torch.Tensor,
                   seed: torch.Tensor, position: torch.Tensor, max_depth: int, siblings: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See treespec.kernels.reference.rejection_walk: one program per row over a sparse p (the
    verify step's top-k candidates); a dense p (the whole vocabulary) takes the
    reference."""
    walk = reference.rejection_walk if p_ids is None else triton_rejection.rejection_walk
    return walk(tokens, parents, probs, p_ids, q_ids, q_probs, seed, position, max_depth,
                siblings)


__all__ = ["write_kv", "paged_tree_attention", "tree_ancestors", "accept_greedy",
           "rejection_walk", "compact_kv",
           "rms_norm", "add_rms_norm", "qk_norm_rope_write", "silu_mul", "linear",
           "linear_silu_mul", "vocab_stats"]
