"""KV page writes and accepted-path compaction (Triton), with their launchers.

Same layout and semantics as ``treespec.kernels.reference.write_kv`` / ``compact_kv``: a
flat slot id is ``page * block_size + offset``; a slot's row is
``[kv_heads, head_dim]``.

Why ``compact_kv`` is race-free. The moves come from ``treespec.common.spec.accept.commit_kv``
(and the draft model's rollback, in the same order): per sequence, dst is strictly
increasing and src >= dst; different sequences own disjoint slots. Hence no move ever reads a slot that an *earlier* move writes
(src_m >= dst_m > dst_j for j < m), so the only hazard is write-after-read: move k
overwriting the slot an earlier move m < k reads (path [1, 2]: 2->1 then 3->2).
Each program owns a disjoint (layer, column range) of the caches and walks the
moves in order, BLOCK_M at a time: it loads the block's source rows into
registers, passes a CTA barrier (every thread's loads are performed), then stores
them. A block's stores therefore come after every read of that block and of all
earlier blocks, exactly the gather-before-scatter order of the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treespec.kernels.triton_common import (FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_dtype,
                                   check_paged, check_shape, check_unit_last, next_pow2)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, num_heads,
                     s_kt, s_kh, s_vt, s_vh, s_kcs, s_kch, s_vcs, s_vch,
                     D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < D) & ((h * 0 + slot) >= 0)
    row = t.to(tl.int64)
    k = tl.load(k_ptr + row * s_kt + h * s_kh + d, mask=mask)
    v = tl.load(v_ptr + row * s_vt + h * s_vh + d, mask=mask)
    tl.store(kc_ptr + slot * s_kcs + h * s_kch + d, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * s_vcs + h * s_vch + d, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] at flat slots [T] of one layer's pages.

    Caches [num_blocks, block_size, kv_heads, head_dim]. A negative slot is
    skipped (the reference would raise), so padded CUDA-graph batches can write
    nothing for their padding rows.
    """
    where = "write_kv"
    check_devices(_write_kv_kernel, where, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                  slots=slots)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(where, name, t, FLOAT_DTYPES)
        check_shape(where, name, t, (None, None, None, None))
        check_paged(where, name, t, 0)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{where}: v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    _, _, hkv, d = k_cache.shape
    n = slots.shape[0] if slots.dim() == 1 else -1
    check_dtype(where, "slots", slots, INDEX_DTYPES)
    check_shape(where, "slots", slots, (None,))
    for name, t in (("k", k), ("v", v)):
        check_dtype(where, name, t, FLOAT_DTYPES)
        check_shape(where, name, t, (n, hkv, d))
        check_unit_last(where, name, t)
    if n == 0:
        return
    slots = slots.contiguous()
    _write_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slots, hkv,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        D=d, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), num_warps=4)


@triton.jit
def _compact_kv_kernel(kc_ptr, vc_ptr, src_ptr, dst_ptr, num_moves, row_len,
                       s_kl, s_ks, s_vl, s_vs,
                       BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    layer = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < row_len
    kc = kc_ptr + layer * s_kl
    vc = vc_ptr + layer * s_vl
    for m0 in range(0, num_moves, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < num_moves
        src = tl.load(src_ptr + m, mask=m_ok, other=0).to(tl.int64)[:, None]
        dst = tl.load(dst_ptr + m, mask=m_ok, other=0).to(tl.int64)[:, None]
        mask = m_ok[:, None] & c_ok[None, :]
        k = tl.load(kc + src * s_ks + c[None, :], mask=mask)
        v = tl.load(vc + src * s_vs + c[None, :], mask=mask)
        tl.debug_barrier()
        tl.store(kc + dst * s_ks + c[None, :], k, mask=mask)
        tl.store(vc + dst * s_vs + c[None, :], v, mask=mask)


def compact_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor,
               dst: torch.Tensor) -> None:
    """Move KV of flat slots src -> dst [M] in every layer.

    Caches [layers, num_blocks, block_size, kv_heads, head_dim], each slot's row
    dense. Requires what commit_kv produces (per sequence: src >= dst, dst
    strictly increasing); see the module docstring for why that is race-free.
    """
    where = "compact_kv"
    check_devices(_compact_kv_kernel, where, k_cache=k_cache, v_cache=v_cache, src=src, dst=dst)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(where, name, t, FLOAT_DTYPES)
        check_shape(where, name, t, (None, None, None, None, None))
        check_paged(where, name, t, 1)
        if t.stride(3) != t.shape[4]:
            raise ValueError(f"{where}: {name} slot rows [kv_heads, head_dim] must be dense, "
                             f"strides {t.stride()}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{where}: v_cache {tuple(v_cache.shape)} {v_cache.dtype} does not "
                         f"match k_cache {tuple(k_cache.shape)} {k_cache.dtype}")
    for name, t in (("src", src), ("dst", dst)):
        check_dtype(where, name, t, INDEX_DTYPES)
        check_shape(where, name, t, (None,))
    if src.shape != dst.shape:
        raise ValueError(f"{where}: src {tuple(src.shape)} and dst {tuple(dst.shape)} differ")
    m = src.shape[0]
    if m == 0:
        return
    layers, row = k_cache.shape[0], k_cache.shape[3] * k_cache.shape[4]
    block_c = min(256, next_pow2(row))
    _compact_kv_kernel[(layers, triton.cdiv(row, block_c))](
        k_cache, v_cache, src.contiguous(), dst.contiguous(), m, row,
        k_cache.stride(0), k_cache.stride(2), v_cache.stride(0), v_cache.stride(2),
        BLOCK_M=min(16, next_pow2(m)), BLOCK_C=block_c, num_warps=4)
