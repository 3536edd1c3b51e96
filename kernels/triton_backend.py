"""The Triton backend: the functions of ``kernels.dispatch.KERNEL_NAMES``, with the
signatures and semantics of ``kernels.reference``. Each kernel lives in its own
module beside its launcher; this module only gathers them."""

from __future__ import annotations

import torch

from kernels.triton_accept import accept_greedy
from kernels.triton_fused import add_rms_norm, qk_norm_rope_write, rms_norm, silu_mul
from kernels.triton_kv import compact_kv, write_kv
from kernels.triton_tree_attention import paged_tree_attention as _paged_tree_attention


def paged_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         cu_q: torch.Tensor, chunk_parents: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """See kernels.reference.paged_tree_attention."""
    return _paged_tree_attention(q, k_cache, v_cache, block_tables, context_lens, cu_q,
                                 chunk_parents, scale)


__all__ = ["write_kv", "paged_tree_attention", "accept_greedy", "compact_kv",
           "rms_norm", "add_rms_norm", "qk_norm_rope_write", "silu_mul"]
